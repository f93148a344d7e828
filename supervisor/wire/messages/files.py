"""The file bodies of the SandboxService: whole files (ReadFile, WriteFile), trees as tar
streams (ReadTree, WriteTree) and the file-system operations (FsList, FsStat, ...).

The field order of each class is the msgpack wire's (:mod:`supervisor.wire.protocol`).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class ReadFileRequest:
    id: str
    path: str


@attrs.frozen
class FileChunk:
    data: bytes = b""
    done: bool = False


@attrs.frozen
class WriteFileOpen:
    id: str
    path: str
    mode: int = 0


@attrs.frozen
class WriteFileRequest:
    open: WriteFileOpen | None = None
    chunk: FileChunk | None = None


@attrs.frozen
class ReadTreeRequest:
    """A guest directory as one tar stream (answered with FileChunk items, the last done)."""

    id: str
    path: str


@attrs.frozen
class WriteTreeOpen:
    id: str
    path: str
    owner: str = ""  # "": the archive's numeric owners; else user[:group] owns every entry


@attrs.frozen
class WriteTreeRequest:
    """A client stream: ``open`` first, then tar bytes in ``chunk``s (the last done)."""

    open: WriteTreeOpen | None = None
    chunk: FileChunk | None = None


@attrs.frozen
class WriteTreeResponse:
    entries: int


@attrs.frozen
class FsPathRequest:
    """FsList (a directory's entries), FsStat (the path itself), FsExists."""

    id: str
    path: str


@attrs.frozen
class FsEntry:
    """One file of FsList or FsStat (symlinks are reported as links, not followed)."""

    name: str  # the entry's name (FsStat: the path)
    path: str  # its absolute path
    kind: str  # file | dir | symlink | other
    size: int = 0
    mode: int = 0  # permission bits
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0  # unix ns
    target: str = ""  # a symlink's target


@attrs.frozen
class FsListResponse:
    entries: list[FsEntry] = attrs.field(factory=list)


@attrs.frozen
class FsExistsResponse:
    exists: bool = False


@attrs.frozen
class FsMkdirRequest:
    id: str
    path: str
    parents: bool = False  # mkdir -p: parents too, and an existing directory is fine
    mode: int = 0  # permission bits; 0 = 0755


@attrs.frozen
class FsRemoveRequest:
    id: str
    path: str
    recursive: bool = False  # a directory and everything in it (else: empty directories only)


@attrs.frozen
class FsRenameRequest:
    id: str
    path: str
    dest: str
