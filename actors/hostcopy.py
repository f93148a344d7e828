"""Copy patches (``Patch.copy_file``, ``Patch.copy_dir``): host files and trees read by
the supervisor, never by the guest, and handed to guestd as the file, mkdir and
symlink entries they expand to.

The host path is the caller's choice, so it is read the way a hostile path would be:
it must be inside an ``serve --allow-path`` directory (PERMISSION_DENIED, said before
the path is looked at), every component below that directory is opened with
O_NOFOLLOW from its parent's descriptor (a symlink on the way is INVALID_ARGUMENT: no
link leads out of the allowed directory, nor a rename racing the walk), files are
opened O_NONBLOCK and must be regular (a FIFO, socket or device is INVALID_ARGUMENT),
what is read must be readable by every local user (the supervisor reads as root for a
caller: PERMISSION_DENIED otherwise, as host directory mounts ask the same),
symlinks inside a copied tree are copied as links (their targets never read), and
what one sandbox's copies carry is bounded (:data:`MAX_COPY_BYTES`, each file
:data:`MAX_COPY_FILE`, at most :data:`~actors.model.MAX_PATCHES` entries in all).
Checked at Create (:func:`expand`, results dropped) and read again when the patches
are applied on the sandbox's fresh disk: a file changed in between goes in as it is then.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from actors.errors import InvalidArgument, NotFound, PermissionDenied
from actors.model import MAX_PATCHES, Patch
from guestd import patch as patch_ops
from guestd import proto

MAX_COPY_BYTES = 4 << 20  # file contents of one sandbox's copy patches
MAX_COPY_FILE = proto.MAX_FRAME - (64 << 10)  # one file: one guestd patch entry (a frame)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class _Budget:
    def __init__(self, entries: int) -> None:
        self.bytes = 0
        self.entries = entries

    def take(self, what: str, size: int = 0) -> None:
        self.entries += 1
        self.bytes += size
        if self.entries > MAX_PATCHES:
            raise InvalidArgument(f"{what}: the copies make more than {MAX_PATCHES} patch entries (use cp -r)")
        if self.bytes > MAX_COPY_BYTES:
            raise InvalidArgument(f"{what}: the copies carry more than {MAX_COPY_BYTES >> 20} MiB (use cp -r)")


def expand(patches: Iterable[Patch], allowed: tuple[Path, ...]) -> tuple[Patch, ...]:
    """``patches`` with each copy patch replaced by the entries it makes (others as they are)."""
    patches = tuple(patches)
    out: list[Patch] = []
    budget = _Budget(sum(p.op not in patch_ops.HOST_OPS for p in patches))
    for p in patches:
        if p.op not in patch_ops.HOST_OPS:
            out.append(p)
            continue
        fd, name = _open_parent(p.source, allowed)
        try:
            if p.op == "copy_file":
                data, mode = _read_file(fd, name, p.source, budget)
                out.append(Patch("file", p.path, data, mode=p.mode if p.mode is not None else mode, replace=p.replace))
            else:
                try:
                    dfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    raise _refusal(p.source, exc, "a directory") from None
                try:
                    _copy_tree(dfd, p.source, p.path.rstrip("/") or "/", p.replace, budget, out)
                finally:
                    os.close(dfd)
        finally:
            os.close(fd)
    return tuple(out)


def _open_parent(source: str, allowed: tuple[Path, ...]) -> tuple[int, str]:
    """The directory holding ``source``'s last component (a descriptor reached through
    no symlink from an allowed directory), and that component."""
    p = Path(source)
    if not p.is_absolute() or ".." in p.parts:
        raise InvalidArgument(f"host source {source!r} must be an absolute path without '..'")
    roots = [d.resolve() for d in allowed]
    root = next((d for d in roots if p.is_relative_to(d) and p != d), None)
    if root is None:
        where = ", ".join(map(str, roots)) or "none (serve --allow-path DIR allows one)"
        raise PermissionDenied(f"host source {source!r} is not in a directory the supervisor allows: {where}")
    *dirs, name = p.relative_to(root).parts
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in dirs:
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _refusal(source, exc, "a directory on the way") from None
            os.close(fd)
            fd = nfd
            _others_may(os.fstat(fd).st_mode, stat.S_IXOTH, source, f"the directory {part!r} on the way")
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def _others_may(mode: int, need: int, source: str, what: str) -> None:
    """What a copy reads, every local user may read: the supervisor reads as root on a
    caller's behalf, and a caller may be anyone its socket lets in (PERMISSION_DENIED)."""
    if mode & need != need:
        raise PermissionDenied(
            f"host source {source!r}: {what} (mode {stat.S_IMODE(mode):o}) is not readable by others: "
            "a copy takes only what every local user may read"
        )


def _refusal(source: str, exc: OSError, what: str) -> Exception:
    if isinstance(exc, FileNotFoundError):
        return NotFound(f"host source {source!r} does not exist on the supervisor's host")
    if exc.errno in (40, 20):  # ELOOP, ENOTDIR: a symlink (O_NOFOLLOW) or not a directory
        return InvalidArgument(f"host source {source!r}: not {what} reached through no symlink")
    if isinstance(exc, PermissionError):
        return PermissionDenied(f"host source {source!r}: {exc.strerror}")
    return InvalidArgument(f"host source {source!r}: {exc.strerror}")


def _read_file(dir_fd: int, name: str, source: str, budget: _Budget) -> tuple[bytes, int]:
    try:  # looked at before it is opened: opening a device may do something
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise InvalidArgument(f"host source {source!r}: not a regular file (links, FIFOs, sockets, devices)")
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _refusal(source, exc, "a regular file") from None
    try:
        st = os.fstat(fd)
        _others_may(st.st_mode, stat.S_IROTH, source, "the file")
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(
                f"host source {source!r}: not a regular file (a FIFO, socket or device is not copied)"
            )
        if st.st_size > MAX_COPY_FILE:
            raise InvalidArgument(
                f"host source {source!r}: {st.st_size} bytes; a copied file is at most {MAX_COPY_FILE}"
            )
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1 << 16):
            size += len(chunk)
            if size > MAX_COPY_FILE:  # grew while read
                raise InvalidArgument(f"host source {source!r}: a copied file is at most {MAX_COPY_FILE} bytes")
            chunks.append(chunk)
    finally:
        os.close(fd)
    budget.take(source, size)
    return b"".join(chunks), stat.S_IMODE(st.st_mode) & 0o777  # (no set-id bits from the host)


def _guest_name(source: str, name: str) -> str:
    try:
        name.encode()
    except UnicodeEncodeError:
        raise InvalidArgument(f"host source {source!r}: a name that is not UTF-8") from None
    return name


def _copy_tree(fd: int, source: str, dst: str, replace: bool, budget: _Budget, out: list[Patch]) -> None:
    st = os.fstat(fd)
    _others_may(st.st_mode, stat.S_IROTH | stat.S_IXOTH, source, "the directory")
    budget.take(source)
    out.append(Patch("mkdir", dst, mode=stat.S_IMODE(st.st_mode) & 0o777))
    with os.scandir(fd) as it:
        entries = sorted(it, key=lambda e: e.name)
    base = "" if dst == "/" else dst
    for e in entries:
        where = f"{source.rstrip('/')}/{e.name}"
        target = f"{base}/{_guest_name(where, e.name)}"
        if e.is_symlink():
            budget.take(where)
            out.append(Patch("symlink", target, target=os.readlink(e.name, dir_fd=fd), replace=replace))
        elif e.is_dir(follow_symlinks=False):
            try:
                sub = os.open(e.name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _refusal(where, exc, "a directory") from None
            try:
                _copy_tree(sub, where, target, replace, budget, out)
            finally:
                os.close(sub)
        else:
            data, mode = _read_file(fd, e.name, where, budget)
            out.append(Patch("file", target, data, mode=mode, replace=replace))
