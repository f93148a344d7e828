"""The client's ends of ``cp -r`` (SDK and CLI): a host directory as a tar stream, and a
guest's tar stream unpacked into a host directory, by :mod:`guestd.tree` run in a
worker thread. ``guestd.tree`` is stdlib-only: the SDK imports that codec (and
``guestd.proto``'s limits and codes) and nothing else of guestd, so the hostile-stream
unpacker is the one guestd itself runs.

::

    host dir --pack (thread)--> chunks --> GuestChannel.write_tree(path, chunks)
    GuestChannel.read_tree(path) --> chunks --> unpack (thread) --> host dir

The stream from a guest is hostile: :func:`unpack_tree` refuses what guestd refuses
(absolute names, '..', names through symlinks, devices, FIFOs, hard links out of the
archive, oversized headers, more than the tree limits; every malformed header, a NUL in
a name, a time or owner out of range) and, beyond that, never sets
setuid/setgid/sticky bits nor (unless asked) the guest's owners. Modes, owners and
times go only to what the copy created: a directory already at the destination keeps
its own (as ``cp`` leaves it), and the modes are masked by the caller's umask (but
with ``keep_ids`` as root: ``cp -a``). It walks by directory descriptors, so a symlink
in the destination cannot redirect it either.
Errors are the SDK's typed errors (:func:`supervisor.wire.errors.error_for`) with guestd's
codes (INVALID_ARGUMENT for a refused stream).

Whose permissions: these run with the caller's. A supervisor running as root must
not pack or unpack paths a client names on the client's behalf (a confused deputy);
the client (SDK, CLI) can run the same code itself and send or receive only the tar
bytes.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from guestd import proto, tree
from guestd.fsops import TreeError
from supervisor.wire.errors import SandboxError, collapse_single, error_for

_CODES = {proto.E_TOO_LARGE: "RESOURCE_EXHAUSTED", proto.E_IS_DIR: "INVALID_ARGUMENT"}  # guestd's own -> sandbox.v1's


if TYPE_CHECKING:
    import trio


def _error(code: str, message: str) -> SandboxError:
    return error_for(_CODES.get(code, code), message)


# --- blocking: the codec's calls with the SDK's errors (the sync SDK calls these directly;
# the Trio ends below run them in a worker thread). trio is imported by those only.
def open_dir(path: Path) -> int:
    """A descriptor of the directory ``path`` (the caller closes it); SandboxError if not."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _error(proto.errcode(exc), f"{path}: {exc.strerror}") from None


def pack(fd: int, put: Callable[[bytes], object]) -> int:
    """The tree under the directory ``fd`` as tar chunks passed to ``put``; the number of entries."""
    try:
        return tree.pack(fd, put)
    except TreeError as exc:
        raise _error(exc.code, exc.message) from None


def unpack(read: Callable[[int], bytes], fd: int, *, keep_ids: bool = False, root_meta: bool = False) -> int:
    """A tar stream pulled from ``read`` unpacked into the directory ``fd`` (see
    :func:`unpack_tree`); the number of entries. ``read``'s own errors pass unchanged."""
    ids = keep_ids and os.geteuid() == 0
    mask = 0o777 if ids else 0o777 & ~umask()
    try:
        return tree.unpack(read, fd, keep_ids=ids, root_meta=root_meta, mode_mask=mask, keep_existing=True)
    except TreeError as exc:
        raise _error(exc.code, f"the guest's tree: {exc.message}") from None


@asynccontextmanager
async def packed_tree(path: Path) -> AsyncIterator[trio.MemoryReceiveChannel[bytes]]:
    """The directory ``path`` as tar chunks: iterate the yielded channel (it ends with
    the archive). A thread packs it, never more than a few chunks ahead. An error of
    the packer (TreeError, OSError) is raised as a SandboxError when the block exits."""
    fd = open_dir(path)
    try:
        async with packed_fd(fd) as chunks:
            yield chunks
    finally:
        os.close(fd)


@asynccontextmanager
async def packed_fd(fd: int) -> AsyncIterator[trio.MemoryReceiveChannel[bytes]]:
    """:func:`packed_tree` of the directory ``fd`` (the caller's; open until the block exits)."""
    import trio

    send, recv = trio.open_memory_channel[bytes](4)

    def put(data: bytes) -> None:
        trio.from_thread.run(send.send, data)

    async def produce() -> None:
        async with send:
            await trio.to_thread.run_sync(pack, fd, put)

    # (recv is closed with close(), not aclose(): an aclose in a cancelled scope raises
    # Cancelled, which the nursery then absorbs with the body's own error)
    with collapse_single(), recv:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            yield recv
            nursery.cancel_scope.cancel()  # the body stopped reading: stop the packer


def umask() -> int:
    """This process's umask, read without changing it (Linux >= 4.7 reports it in
    /proc/self/status; else set and restored at once)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


async def unpack_tree(
    chunks: AsyncIterable[bytes], dest: Path, *, keep_ids: bool = False, root_meta: bool = False
) -> int:
    """Unpack a tar stream (e.g. a guest's ``read_tree``) into the directory ``dest``,
    which exists; returns the number of entries. ``keep_ids``: the archive's numeric
    owners and exact modes (as root only); else the files are the caller's, their
    modes masked by its umask. ``root_meta``: the archive's root entry sets ``dest``'s
    mode and mtime (pass it only when the caller made ``dest``). Directories already
    under ``dest`` keep their mode, owner and times."""
    fd = open_dir(dest)
    try:
        return await unpack_fd(chunks, fd, keep_ids=keep_ids, root_meta=root_meta)
    finally:
        os.close(fd)


async def unpack_fd(chunks: AsyncIterable[bytes], fd: int, *, keep_ids: bool = False, root_meta: bool = False) -> int:
    """:func:`unpack_tree` into the directory ``fd`` (the caller's)."""
    import trio

    send, recv = trio.open_memory_channel[bytes](4)
    pending = bytearray()

    def read(n: int) -> bytes:
        while not pending:
            try:
                pending.extend(trio.from_thread.run(recv.receive))
            except trio.EndOfChannel:
                return b""
        data = bytes(pending[:n])
        del pending[:n]
        return data

    failed: list[Exception] = []

    async def feed() -> None:
        try:
            async with send:
                async for chunk in chunks:
                    await send.send(chunk)
        except Exception as exc:  # the source's own error (e.g. NOT_FOUND) wins over "truncated"
            failed.append(exc)

    def work() -> int:
        return unpack(read, fd, keep_ids=keep_ids, root_meta=root_meta)

    with collapse_single(), recv:  # (close(), not aclose(): see packed_tree)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            try:
                n = await trio.to_thread.run_sync(work)
            except SandboxError:
                nursery.cancel_scope.cancel()  # the stream is refused: stop reading it
                if failed:
                    raise failed[0] from None
                raise
    if failed:
        raise failed[0]
    return n


# --- single-file copy-out: the destination ---------------------------------------------------


def open_target(dest: str | Path, guest_path: str) -> tuple[int, str]:
    """Where ``cp box:GUEST_PATH DEST`` writes: a descriptor of the directory and the
    name in it. DEST a directory, or a symlink to one (followed, as ``cp`` does; the
    user named it, and the kernel's protected_symlinks rule applies in sticky
    directories): the guest file's basename in it. Else DEST's parent and DEST's last
    component, which is never followed: :func:`commit_temp` renames over whatever is
    there (a symlink included). DEST ending in '/' must be a directory."""
    dest = os.fspath(dest)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        return os.open(dest, flags), _leaf(PurePosixPath(guest_path).name, guest_path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        if dest.endswith("/"):
            raise _error(proto.errcode(exc), f"{dest}: {exc.strerror}") from None
    except OSError as exc:
        raise _error(proto.errcode(exc), f"{dest}: {exc.strerror}") from None
    parent, name = os.path.split(dest)
    name = _leaf(name, dest)
    try:
        return os.open(parent or ".", flags), name
    except OSError as exc:
        raise _error(proto.errcode(exc), f"{parent}: {exc.strerror}") from None


def _leaf(name: str, whole: str) -> str:
    if name in ("", ".", "..") or "\0" in name:
        raise error_for("INVALID_ARGUMENT", f"{whole!r} names no file")
    return name


def create_temp(dfd: int, name: str) -> tuple[str, int]:
    """A new file beside ``name`` in ``dfd`` (mode 0666 & ~umask) under a name nobody
    can predict, made with O_EXCL|O_NOFOLLOW: (its name, a descriptor open for writing)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = f".{name[:100]}.{secrets.token_hex(8)}.sandvisor-part"
        try:
            return tmp, os.open(tmp, flags, 0o666, dir_fd=dfd)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _error(proto.errcode(exc), f"{name}: {exc.strerror}") from None
    raise error_for("FAILED_PRECONDITION", f"{name}: no unused temporary name")


def commit_temp(dfd: int, tmp: str, name: str) -> None:
    """Rename the whole file ``tmp`` to ``name`` (both in ``dfd``): replaces a file or a
    symlink there, never follows it; a directory there is an error."""
    try:
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as exc:
        raise _error(proto.errcode(exc), f"{name}: {exc.strerror}") from None
