"""The plans of snapshots (see :mod:`supervisor.client.sdk.ops`): checkpoint, restore, list,
delete, and export and import as one streamed file.
"""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from supervisor.client.sdk.ops import (
    CHUNK,
    Blocking,
    Finish,
    Made,
    Open,
    Plan,
    Receive,
    Send,
    Target,
    Unary,
)
from supervisor.client.sdk.spec import (
    SnapshotRef,
    _kv,
    _snapshot_id,
)
from supervisor.wire import protocol
from supervisor.wire.protocol import (
    CheckpointResponse,
    SnapshotSummary,
)


def restore(
    snapshot: SnapshotRef,
    *,
    name: str = "",
    labels: Mapping[str, str] | None = None,
    ttl: int = 0,
    network_override: bool = False,
    detached: bool = False,
    socket: str | Path | None = None,
) -> Plan[Made]:
    """A new sandbox from a snapshot (id, unique snapshot name, or a checkpoint's
    result), ready when this returns. As a context manager it is removed on exit
    unless ``detached``. A tap clone keeps the snapshot's address when it is free,
    unless ``network_override``."""
    req = protocol.RestoreRequest(
        snapshot_id=_snapshot_id(snapshot),
        id=name,
        labels=_kv(labels),
        ttl_seconds=ttl,
        network_override=network_override,
    )
    r: protocol.RestoreResponse = yield Unary("Restore", req, protocol.RestoreResponse)
    return Made(r.id, detached)


def snapshots(
    *, sandbox: str = "", labels: Mapping[str, str] | None = None, socket: str | Path | None = None
) -> Plan[builtins.list[SnapshotSummary]]:
    """Snapshots, oldest first; filtered by origin sandbox id and labels (all must match)."""
    req = protocol.ListSnapshotsRequest(sandbox_id=sandbox, labels=_kv(labels))
    r: protocol.ListSnapshotsResponse = yield Unary("ListSnapshots", req, protocol.ListSnapshotsResponse)
    return r.snapshots


def delete_snapshot(snapshot: SnapshotRef, *, socket: str | Path | None = None) -> Plan[None]:
    yield Unary("DeleteSnapshot", protocol.DeleteSnapshotRequest(snapshot_id=_snapshot_id(snapshot)), protocol.Empty)


def export_snapshot(
    snapshot: SnapshotRef,
    path: str | Path | BinaryIO,
    *,
    include_base: bool = False,
    socket: str | Path | None = None,
) -> Plan[int]:
    """Write the snapshot as one export file at ``path`` (a directory: ``snapshot.svsnap``
    in it), streamed; the file appears when whole (nothing is left on a failure). A
    binary file object (a pipe: ``sys.stdout.buffer``) is written as the data comes.
    ``include_base``: carry the image's root filesystem too (else the importing
    supervisor must have that image). Returns the file's size in bytes."""
    from supervisor.client.treecopy import commit_temp, create_temp, open_target

    req = protocol.ExportSnapshotRequest(snapshot_id=_snapshot_id(snapshot), include_base=include_base)
    if not isinstance(path, str | os.PathLike):
        call = yield Open("ExportSnapshot", req)
        n = 0
        while (ch := (yield Receive(call, protocol.FileChunk))) is not None:
            yield Blocking(path.write, (ch.data,))
            n += len(ch.data)
        yield Blocking(path.flush)
        return n
    dfd, name = yield Blocking(open_target, (os.fspath(path), "/snapshot.svsnap"))
    total = 0
    try:
        tmp, fd = yield Blocking(create_temp, (dfd, name))
        done = False
        try:
            with open(fd, "wb", closefd=True) as f:
                call = yield Open("ExportSnapshot", req)
                while (ch := (yield Receive(call, protocol.FileChunk))) is not None:
                    yield Blocking(f.write, (ch.data,))
                    total += len(ch.data)
                yield Blocking(f.flush)
                yield Blocking(os.fsync, (f.fileno(),))
            yield Blocking(commit_temp, (dfd, tmp, name))
            done = True
        finally:
            if not done:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
    finally:
        os.close(dfd)
    return total


def import_snapshot(
    path: str | Path | BinaryIO,
    *,
    name: str = "",
    labels: Mapping[str, str] | None = None,
    socket: str | Path | None = None,
) -> Plan[SnapshotSummary]:
    """A new snapshot (a new id) from an export file, streamed; recorded only once the
    whole file arrived and matched its digest. ``name``: "" keeps the export's (a name
    another snapshot has is AlreadyExists); ``labels`` are added to the export's.
    ``path``: a file, or a binary file object (a pipe: ``sys.stdin.buffer``)."""
    op_ = protocol.ImportSnapshotOpen(name=name, labels=_kv(labels))
    f = (yield Blocking(open, (Path(path), "rb"))) if isinstance(path, str | os.PathLike) else path
    with f if f is not path else contextlib.nullcontext(f):
        call = yield Open("ImportSnapshot", protocol.ImportSnapshotRequest(open=op_))
        while piece := (yield Blocking(f.read, (3 * CHUNK,))):  # (under the wires' 4 MiB message cap)
            yield Send(call, protocol.ImportSnapshotRequest(chunk=protocol.FileChunk(data=piece)))
        yield Send(call, protocol.ImportSnapshotRequest(chunk=protocol.FileChunk(done=True)))
        r: SnapshotSummary = yield Finish(call, SnapshotSummary)
    return r


def checkpoint(t: Target, name: str = "", *, labels: Mapping[str, str] | None = None) -> Plan[CheckpointResponse]:
    """Snapshot this sandbox; ``.snapshot_id`` names the snapshot. Ready: its disk and
    memory, and it runs on; stopped: its disk alone (``.disk_only``; restores boot)."""
    req = protocol.CheckpointRequest(sandbox_id=t.id, name=name, labels=_kv(labels))
    r: CheckpointResponse = yield Unary("Checkpoint", req, CheckpointResponse)
    return r


def fork(
    t: Target,
    n: int = 1,
    *,
    names: Sequence[str] | None = None,
    name_prefix: str = "",
    labels: Mapping[str, str] | None = None,
) -> Plan[protocol.ForkResponse]:
    """``n`` children of the running sandbox (docs/fork.md): it pauses once and runs on;
    each child is ready, with its own id (``names``, else ``name_prefix`` + 1..n, else
    its uid), hostname, address and secret placeholders, and the parent's processes,
    memory and files at the fork point. Their labels: the parent's, then ``labels``."""
    req = protocol.ForkRequest(id=t.id, count=n, names=list(names or ()), name_prefix=name_prefix, labels=_kv(labels))
    r: protocol.ForkResponse = yield Unary("Fork", req, protocol.ForkResponse)
    return r


def diff(t: Target, other: str = "", path: str = "/", *, snapshot: str = "") -> Plan[protocol.DiffResponse]:
    """What differs under ``path`` (docs/fork.md) from this sandbox's tree to ``other``'s
    (a sandbox); or, without ``other``, from the ``snapshot``'s tree (else this sandbox's
    fork point's) to this sandbox's. A sandbox's tree is its own guest's answer; a
    snapshot's is its disk, read on the host. The server hashes (SHA-256) and compares."""
    req = protocol.DiffRequest(
        id=t.id,
        other=other,
        path=path,
        fork_point=not other and not snapshot,
        snapshot=snapshot,
    )
    r: protocol.DiffResponse = yield Unary("Diff", req, protocol.DiffResponse)
    return r


def diff_content(
    t: Target, path: str, other: str = "", *, snapshot: str = ""
) -> Plan[tuple[bytes | None, bytes | None]]:
    """Both sides of the file ``path`` (the first MiB of each; None where it is absent):
    this sandbox's and ``other``'s; or, without ``other``, the ``snapshot``'s (else the
    fork point's) and this sandbox's."""
    req = protocol.DiffRequest(
        id=t.id,
        other=other,
        fork_point=not other and not snapshot,
        snapshot=snapshot,
        content=path,
    )
    r: protocol.DiffResponse = yield Unary("Diff", req, protocol.DiffResponse)
    return (r.content_a if r.found_a else None), (r.content_b if r.found_b else None)
