"""Fork: a running sandbox copied N times in one call, and the family it makes.

A fork is one checkpoint of the parent into a hidden snapshot
(``SnapshotRecord.fork_only``: listed nowhere, no warm pool) -- the parent pauses once
and runs on -- then N restores of it, side by side. Each child is a full sandbox of
the caller: its own id, hostname, entropy, MAC and IP, fresh secret placeholders and
its own host ports (the restore path's fix-ups: ``SandboxConfig.restored``, the life's
``fresh_identity``), with the parent's processes, memory and files at the fork point.
Children of children fork the same way.

Lineage: each child's record keeps :class:`~actors.store.Lineage` (the parent by uid
and id, the fork's snapshot, when). The hidden snapshot goes once no sandbox's lineage
names it (``Registry.retire_forks``, at every removal); its frozen disk stays while a
chain stands on it (the parent's and the children's: the snapshot collector's). A
named checkpoint is a snapshot like any other and stays.

The operation is one: a child that fails to restore takes its siblings made so far
with it, and the error is the caller's; the parent runs on either way.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence

import attrs
import trio

from actors.errors import AlreadyExists, DomainError, FailedPrecondition, InvalidArgument
from actors.model import State
from actors.principals import LEGACY_OWNER
from actors.registry import Registry
from actors.rules import check_id, check_labels
from actors.sandboxes.sandbox import Sandbox
from actors.store import Lineage, SnapshotRecord

MAX_CHILDREN = 100  # children of one fork call (E2B's bound)


@attrs.frozen
class Forked:
    """A fork's result: the hidden snapshot it took, how long the parent was paused,
    and the children (ready), in the order asked."""

    snapshot: SnapshotRecord
    paused_s: float
    children: list[Sandbox]


def child_ids(n: int, names: Sequence[str], name_prefix: str) -> list[str]:
    """The children's ids: ``names`` (one per child), else ``name_prefix`` + 1..n, else
    none (each gets its uid)."""
    if not 1 <= n <= MAX_CHILDREN:
        raise InvalidArgument(f"a fork makes 1 to {MAX_CHILDREN} sandboxes, not {n}")
    if names and name_prefix:
        raise InvalidArgument("give names or name_prefix, not both")
    if names:
        if len(names) != n:
            raise InvalidArgument(f"{len(names)} names for {n} sandboxes")
        ids = list(names)
    elif name_prefix:
        ids = [f"{name_prefix}{i}" for i in range(1, n + 1)]
    else:
        return [""] * n
    if len(set(ids)) != len(ids):
        raise InvalidArgument("the children's names must differ")
    for i in ids:
        if not i:
            raise InvalidArgument("a child's name must not be empty")
        check_id(i)
    return ids


def check_forkable(sb: Sandbox) -> None:
    """What a fork refuses before anything is paused, with the reason."""
    for m in sb.config.host_mounts:
        if m.writable:
            raise FailedPrecondition(
                f"sandbox {sb.id} has the host directory {m.source} mounted read-write at {m.path}: "
                "its children would all write one host directory, so it cannot be forked"
            )
    if sb.config.host_mounts:
        raise FailedPrecondition(
            f"sandbox {sb.id} has host directories mounted (virtio-fs): their state is the host's, "
            "so it cannot be forked"
        )
    if sb.state != State.READY:
        raise FailedPrecondition(f"sandbox {sb.id} is {sb.state}; fork needs it ready")
    for v in sb.config.volumes:
        if not v.read_only:
            raise FailedPrecondition(
                f"sandbox {sb.id} mounts the volume {v.name} read-write: a volume is written by one "
                "sandbox at a time, so it cannot be forked"
            )


async def fork(
    reg: Registry,
    parent_id: str,
    n: int = 1,
    *,
    names: Sequence[str] = (),
    name_prefix: str = "",
    labels: dict[str, str] | None = None,
    owner: str = LEGACY_OWNER,
) -> Forked:
    """``n`` children of the running sandbox ``parent_id``, owned by ``owner`` (who asked;
    the edge checked that it sees the parent). Their labels: the parent's, then ``labels``."""
    reg.check_open()
    ids = child_ids(n, names, name_prefix)
    labels = dict(labels or {})
    check_labels(labels)
    for i in ids:
        if i and i in reg.sandboxes:
            raise AlreadyExists(f"sandbox {i!r} exists")
    parent = reg.get(parent_id)
    check_forkable(parent)
    child_labels = {**parent.config.labels, **labels}
    snap, ck = await reg.checkpoint(parent.id, owner=owner, fork_only=True)
    lineage = Lineage(parent.record.uid, parent.id, snap.id, snap.created_ns)
    made: list[Sandbox | None] = [None] * n
    failed: list[DomainError] = []

    async def child(k: int, id: str, cancel: trio.CancelScope) -> None:
        try:
            made[k] = await reg.restore_from(
                snap, id=id, labels=child_labels, network_override=True, owner=owner, lineage=lineage
            )
        except DomainError as exc:  # the first failure ends the call: its siblings are cancelled
            failed.append(exc)
            cancel.cancel()

    try:
        async with trio.open_nursery() as nursery:
            for k, i in enumerate(ids):
                nursery.start_soon(child, k, i, nursery.cancel_scope)
    except BaseException:
        await _undo(reg, snap)
        raise
    if failed:
        await _undo(reg, snap)
        raise failed[0]
    return Forked(snap, ck.paused_s, [sb for sb in made if sb is not None])


async def _undo(reg: Registry, snap: SnapshotRecord) -> None:
    """A fork that failed: every child it made (ready or not) goes, and its snapshot."""
    with trio.CancelScope(shield=True):
        made = [sb for sb in reg.sandboxes.values() if sb.record.lineage and sb.record.lineage.snapshot_id == snap.id]
        for sb in made:
            if reg.sandboxes.get(sb.id) is sb:
                await reg.remove(sb.id, force=True)
        reg.retire_forks()


def children(reg: Registry) -> dict[str, builtins.list[Sandbox]]:
    """The registry's sandboxes by their parent's uid."""
    out: dict[str, list[Sandbox]] = {}
    for sb in sorted(reg.sandboxes.values(), key=lambda sb: sb.record.seq):  # in the order made
        if sb.record.lineage is not None:
            out.setdefault(sb.record.lineage.parent_uid, []).append(sb)
    return out


def descendants(reg: Registry, sb: Sandbox) -> builtins.list[Sandbox]:
    """Every sandbox forked from ``sb``, from theirs, and so on: the deepest first."""
    kids = children(reg)
    out: list[Sandbox] = []

    def walk(uid: str) -> None:
        for c in kids.get(uid, []):
            walk(c.record.uid)
            out.append(c)

    walk(sb.record.uid)
    return out


def is_descendant(reg: Registry, sb: Sandbox, ancestor: Sandbox) -> bool:
    """Whether ``ancestor`` is a parent of ``sb``, or a parent's parent... (while the
    family's records are there: a removed sandbox ends the line)."""
    by_uid = {s.record.uid: s for s in reg.sandboxes.values()}
    seen: set[str] = set()
    cur = sb
    while cur.record.lineage is not None and cur.record.uid not in seen:
        seen.add(cur.record.uid)
        if cur.record.lineage.parent_uid == ancestor.record.uid:
            return True
        nxt = by_uid.get(cur.record.lineage.parent_uid)
        if nxt is None:
            return False
        cur = nxt
    return False


async def remove_with_descendants(
    reg: Registry, id: str, *, force: bool = False, may_remove: Callable[[Sandbox], bool] = lambda sb: True
) -> builtins.list[str]:
    """Remove ``id`` and its descendants that ``may_remove`` allows (the caller's view:
    others' stay, their line ends at them), the deepest first; the ids removed."""
    sb = reg.get(id)
    family = [d for d in descendants(reg, sb) if may_remove(d)]
    if not force:
        busy = [d.id for d in [*family, sb] if d.state == State.RUNNING]
        if busy:
            raise FailedPrecondition(f"{', '.join(busy)} running a workload; use force to remove them")
    gone = []
    for d in [*family, sb]:
        if reg.sandboxes.get(d.id) is d:
            await reg.remove(d.id, force=force)
            gone.append(d.id)
    return gone
