"""The ``sandbox.v1`` SandboxSnapshotService's bodies: checkpoint, restore, list, delete,
export and import of snapshots.

The field order of each class is the msgpack wire's (:mod:`supervisor.wire.protocol`).
"""

from __future__ import annotations

import attrs

from supervisor.wire.messages.files import FileChunk


@attrs.frozen
class CheckpointRequest:
    sandbox_id: str
    name: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class CheckpointResponse:
    snapshot_id: str
    snapshot_dir: str
    created_at: str  # RFC3339
    # extensions: what the checkpoint wrote and how long the guest was paused
    size_bytes: int = 0
    memory: str = ""  # "mapped" (RAM file, restores map it), "streamed" (RAM in vmstate), "disk" (none)
    paused_ms: float = 0.0
    disk_only: bool = False  # a stopped sandbox's disk: its restores boot


@attrs.frozen
class RestoreRequest:
    snapshot_id: str  # a snapshot id, or a snapshot name that is unique
    id: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)
    network_override: bool = False  # tap: a fresh address even when the snapshot's is free
    ttl_seconds: int = 0


@attrs.frozen
class RestoreResponse:
    id: str
    ip_address: str = ""


@attrs.frozen
class ListSnapshotsRequest:
    sandbox_id: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class SnapshotSummary:
    id: str
    sandbox_id: str
    name: str
    labels: dict[str, str]
    snapshot_dir: str
    created_at: str  # RFC3339
    # extensions: what a restore keeps of its origin (its network mode, secrets' names, host directories)
    network: str = ""
    secrets: list[str] = attrs.field(factory=list)
    host_mounts: int = 0
    size_bytes: int = 0
    memory: str = ""
    memory_mib: int = 0
    pool_ready: int = 0  # warm pool members ready for this snapshot
    disk_only: bool = False  # a stopped sandbox's disk (memory "disk"): its restores boot


@attrs.frozen
class ListSnapshotsResponse:
    snapshots: list[SnapshotSummary]


@attrs.frozen
class DeleteSnapshotRequest:
    snapshot_id: str


@attrs.frozen
class ExportSnapshotRequest:
    """A server stream of FileChunks: the snapshot as one export file (the last chunk done)."""

    snapshot_id: str  # an id, or a unique name
    include_base: bool = False  # carry the image layers too (else named: the importer must have them)


@attrs.frozen
class ImportSnapshotOpen:
    name: str = ""  # "": the export's own name
    labels: dict[str, str] = attrs.field(factory=dict)  # added to (and overriding) the export's own


@attrs.frozen
class ImportSnapshotRequest:
    """A client stream: ``open`` first, then the export's bytes in ``chunk``s (the last done)."""

    open: ImportSnapshotOpen | None = None
    chunk: FileChunk | None = None


# --- fork (docs/fork.md) -----------------------------------------------------------------------
@attrs.frozen
class ForkRequest:
    id: str  # the parent: a running sandbox the caller sees
    count: int = 1
    names: list[str] = attrs.field(factory=list)  # one per child (else name_prefix + 1..count, else uids)
    name_prefix: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)  # on top of the parent's


@attrs.frozen
class ForkedSandbox:
    id: str
    ip_address: str = ""
    uid: str = ""


@attrs.frozen
class ForkResponse:
    sandboxes: list[ForkedSandbox]
    snapshot_id: str = ""  # the fork point (hidden; it goes with the last descendant)
    paused_ms: float = 0.0  # how long the parent was paused


# --- diff (docs/fork.md, "What a branch changed") ----------------------------------------------
@attrs.frozen
class DiffRequest:
    id: str  # a: the sandbox compared from
    other: str = ""  # b: the sandbox compared to (empty: a snapshot is a, this sandbox b)
    path: str = "/"  # the directory compared in both (its file system only, as ``cp -r``)
    # -- a sandbox against a snapshot's disk (docs/fork.md): ``other`` empty, ``id`` is b
    fork_point: bool = False  # a: the snapshot ``id`` was forked from (its disk, read on the host)
    snapshot: str = ""  # a: this snapshot (id or name) instead
    content: str = ""  # not the trees: both sides of this one file (the first MiB of each)


@attrs.frozen
class DiffChange:
    """One path that differs: ``change`` added (only in b), removed (only in a), modified.
    Each side: kind (file, dir, link; "" absent), size, mode (permission bits), hash (a
    file's SHA-256, computed on the host; a link's target)."""

    path: str
    change: str
    kind_a: str = ""
    size_a: int = 0
    mode_a: int = 0
    hash_a: str = ""
    kind_b: str = ""
    size_b: int = 0
    mode_b: int = 0
    hash_b: str = ""


@attrs.frozen
class DiffResponse:
    changes: list[DiffChange]
    entries_a: int = 0  # paths compared on each side
    entries_b: int = 0
    # -- a sandbox against a snapshot's disk, and ``content`` ---------------------------------
    base: str = ""  # the snapshot compared with (a), when one was
    content_a: bytes = b""  # ``content``: each side's first MiB
    content_b: bytes = b""
    found_a: bool = False  # ``content``: whether each side has that file
    found_b: bool = False
