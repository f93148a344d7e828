"""The plans of files in a sandbox (see :mod:`supervisor.client.sdk.ops`): read and write whole
files, copy files and trees in and out (trees as tar streams, :mod:`supervisor.client.treecopy`),
and the file-system operations (list, stat, mkdir, remove, rename).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
from collections.abc import AsyncIterable, Iterable
from pathlib import Path

from supervisor.client.sdk.ops import (
    CHUNK,
    Blocking,
    Finish,
    Open,
    Plan,
    Pull,
    Receive,
    ReceiveTree,
    Send,
    SendTree,
    Target,
    Unary,
    collect,
)
from supervisor.wire import protocol


# --- files ----------------------------------------------------------------------------------
def read(t: Target, path: str) -> Plan[bytes]:
    chunks: list[protocol.FileChunk] = yield from collect(
        "ReadFile", protocol.ReadFileRequest(id=t.id, path=path), protocol.FileChunk
    )
    return b"".join(ch.data for ch in chunks)


def write(
    t: Target, path: str, data: bytes | Iterable[bytes] | AsyncIterable[bytes], *, mode: int = 0o644
) -> Plan[None]:
    """Write ``data`` (bytes, or an iterable of pieces; async too on Trio) to the file
    ``path``, streamed in 1 MiB chunks."""
    call = yield Open(
        "WriteFile", protocol.WriteFileRequest(open=protocol.WriteFileOpen(id=t.id, path=path, mode=mode))
    )
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for i in range(0, len(view), CHUNK):
            yield Send(call, protocol.WriteFileRequest(chunk=protocol.FileChunk(data=bytes(view[i : i + CHUNK]))))
    else:
        source = data if isinstance(data, AsyncIterable) else iter(data)
        while (piece := (yield Pull(source))) is not None:
            yield Send(call, protocol.WriteFileRequest(chunk=protocol.FileChunk(data=bytes(piece))))
    yield Send(call, protocol.WriteFileRequest(chunk=protocol.FileChunk(done=True)))
    yield Finish(call, protocol.Empty)


def copy_in(t: Target, local: str | Path, path: str) -> Plan[None]:
    """``cp FILE box:/path``: the host file ``local`` (its mode too) into the sandbox."""
    src = Path(local)
    mode = src.stat().st_mode & 0o7777
    f = yield Blocking(open, (src, "rb"))
    with f:
        call = yield Open(
            "WriteFile", protocol.WriteFileRequest(open=protocol.WriteFileOpen(id=t.id, path=path, mode=mode))
        )
        while piece := (yield Blocking(f.read, (CHUNK,))):
            yield Send(call, protocol.WriteFileRequest(chunk=protocol.FileChunk(data=piece)))
        yield Send(call, protocol.WriteFileRequest(chunk=protocol.FileChunk(done=True)))
        yield Finish(call, protocol.Empty)


def copy_out(t: Target, path: str, local: str | Path) -> Plan[None]:
    """``cp box:/path DEST``: the sandbox's file ``path`` into the host file ``local``.
    ``local`` naming a directory (a symlink to one too, as ``cp`` follows it; the
    kernel's protected_symlinks rule applies) means ``local/<basename of path>``.
    The file is written to a new, unpredictable name in the target directory
    (O_CREAT|O_EXCL|O_NOFOLLOW, mode 0666 & ~umask) and renamed into place when whole:
    whatever is at the final name (a file, a symlink a guest's tree or another
    user planted) is replaced, never written through or followed; nothing is left
    behind on a failure."""
    from supervisor.client.treecopy import commit_temp, create_temp, open_target

    dfd, name = yield Blocking(open_target, (os.fspath(local), path))
    try:
        tmp, fd = yield Blocking(create_temp, (dfd, name))
        done = False
        try:
            with open(fd, "wb", closefd=True) as f:
                call = yield Open("ReadFile", protocol.ReadFileRequest(id=t.id, path=path))
                while (ch := (yield Receive(call, protocol.FileChunk))) is not None:
                    yield Blocking(f.write, (ch.data,))
            yield Blocking(commit_temp, (dfd, tmp, name))
            done = True
        finally:
            if not done:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
    finally:
        os.close(dfd)


def copy_tree_in(t: Target, local: str | Path, path: str, *, owner: str = "") -> Plan[int]:
    """``cp -r DIR box:/path``: the host directory ``local`` into the sandbox's
    directory ``path`` (made if missing; existing directories merged, files
    replaced) as one tar stream packed here, with the caller's rights: modes,
    mtimes, symlinks, hard links, empty directories. ``owner`` "": every entry
    keeps its numeric uid/gid; else user[:group] (the guest's names) owns all.
    Returns the number of entries written."""
    from supervisor.client.treecopy import open_dir

    fd = yield Blocking(open_dir, (Path(local),))
    try:
        call = yield Open(
            "WriteTree", protocol.WriteTreeRequest(open=protocol.WriteTreeOpen(id=t.id, path=path, owner=owner))
        )
        yield SendTree(call, fd, lambda piece: protocol.WriteTreeRequest(chunk=protocol.FileChunk(data=piece)))
    finally:
        os.close(fd)
    yield Send(call, protocol.WriteTreeRequest(chunk=protocol.FileChunk(done=True)))
    r: protocol.WriteTreeResponse = yield Finish(call, protocol.WriteTreeResponse)
    return r.entries


def copy_tree_out(t: Target, path: str, local: str | Path, *, keep_owners: bool = False) -> Plan[int]:
    """``cp -r box:/path DIR``: the sandbox's directory ``path`` into the host
    directory ``local`` (made if missing; the guest directory's mode and mtime
    become its own) as one tar stream, unpacked here by guestd's hostile-stream
    unpacker (no absolute names, '..', writes through symlinks, devices,
    setuid bits). ``keep_owners``: the guest's numeric owners (root only); else
    the files are the caller's. Returns the number of entries."""
    from supervisor.client.treecopy import open_dir

    dest = Path(local)
    yield Blocking(functools.partial(dest.parent.mkdir, parents=True, exist_ok=True))
    try:  # a DEST that was there keeps its mode, owner and times (as every directory in it)
        yield Blocking(dest.mkdir)
        made = True
    except FileExistsError:
        made = False
    fd = yield Blocking(open_dir, (dest,))
    try:
        call = yield Open("ReadTree", protocol.ReadTreeRequest(id=t.id, path=path))
        n: int = yield ReceiveTree(call, fd, keep_owners, made)
        return n
    finally:
        os.close(fd)


def fs_list(t: Target, path: str) -> Plan[builtins.list[protocol.FsEntry]]:
    """The entries of the directory ``path``, by name (``.kind``: file, dir, symlink,
    other; symlinks are not followed); NotFound, FailedPrecondition (not a directory)."""
    pages: list[protocol.FsListResponse] = yield from collect(
        "FsList", protocol.FsPathRequest(id=t.id, path=path), protocol.FsListResponse
    )
    return [e for page in pages for e in page.entries]


def fs_stat(t: Target, path: str) -> Plan[protocol.FsEntry]:
    """``path`` itself (a symlink as one, not followed); NotFound if it is not there."""
    e: protocol.FsEntry = yield Unary("FsStat", protocol.FsPathRequest(id=t.id, path=path), protocol.FsEntry)
    return e


def fs_exists(t: Target, path: str) -> Plan[bool]:
    r: protocol.FsExistsResponse = yield Unary(
        "FsExists", protocol.FsPathRequest(id=t.id, path=path), protocol.FsExistsResponse
    )
    return r.exists


def fs_mkdir(t: Target, path: str, *, parents: bool = True, mode: int = 0o755) -> Plan[None]:
    """``mkdir -p`` (``parents=False``: ``mkdir``, AlreadyExists if it is there)."""
    yield Unary("FsMkdir", protocol.FsMkdirRequest(id=t.id, path=path, parents=parents, mode=mode), protocol.Empty)


def fs_remove(t: Target, path: str, *, recursive: bool = False) -> Plan[None]:
    """``rm`` of a file, a link or an empty directory; ``recursive``: ``rm -r``."""
    yield Unary("FsRemove", protocol.FsRemoveRequest(id=t.id, path=path, recursive=recursive), protocol.Empty)


def fs_rename(t: Target, path: str, dest: str) -> Plan[None]:
    """``mv path dest`` (one file system)."""
    yield Unary("FsRename", protocol.FsRenameRequest(id=t.id, path=path, dest=dest), protocol.Empty)
