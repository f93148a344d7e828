"""Snapshots: a running guest checkpointed to a directory (actors/sandboxes/savedstate.py),
and the snapshot store.

A snapshot directory holds::

    vmstate     QEMU's migration stream (device state; RAM too when "streamed")
    memory      guest RAM, when "mapped": restores map it privately (copy-on-write)
    disk.qcow2  the origin's overlay as it was, frozen; restores put overlays on it
    kernel, initrd   links to the image parts the guest was booted with

Checkpoint (the guest is paused only between ``stop`` and ``cont``)::

    new overlay made, opened, handed to QEMU (add-fd), blockdev-add   <- guest runs
    stop
    blockdev-snapshot: the disk device now writes the new overlay; the old one is
                       read-only from here and moves into the snapshot dir
    migrate to fd:     device state (+ RAM unless x-ignore-shared skips the shared
                       RAM file); wait "completed" and then for the run state to leave
                       finish-migrate (cont fails before that, measured)
    copy the RAM file  (mapped only: cp --sparse, ~100 MB touched of 256)
    cont                                                              <- guest runs
    fsync, sizes

A guest whose RAM is a shared file (every cold boot, and every restore of a streamed
snapshot) checkpoints "mapped". A guest restored from a mapped snapshot has its RAM
mapped privately from that snapshot's file, which QEMU cannot copy as a file: its
checkpoints are "streamed" (RAM in vmstate). That is every checkpoint of a default
Create (a restore of its boot template), so the store's converter task turns each
streamed snapshot into a mapped one in the background (:mod:`actors.snapshots.convert`: a jailed
helper QEMU loads the stream into a RAM file and saves the device state alone), then
switches the record in one step::

    checkpoint (streamed)  -> record {memory: streamed, vmstate: "vmstate"}   restores stream
    converter: memory.part, vmstate-mapped.part -> renamed; fsync
    switch (one Trio step) -> record {memory: mapped, vmstate: "vmstate-mapped",
                                      sizes, memory_stat}; flushed     restores map from here
    the old stream unlinked (a restore that opened it before reads on)

A restore reads the record once and opens the stream it names in the same step
(:class:`~actors.sandboxes.sandbox.Sandbox`): whichever side of the switch it lands on, it has a
consistent pair. After a crash the collector removes what a conversion left in a
snapshot dir (``*.part``, or the files the record does not name) and the next start
converts again; the helper's QEMU, run dir and cgroup go the way of every QEMU no
record names (the registry's recovery).

Migration capabilities must match on both sides: ``x-ignore-shared`` is on for mapped
snapshots (checkpoint and restore) and off for streamed ones.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

import attrs
import trio

from actors.cells.identities import JailError
from actors.crash import crash_point
from actors.errors import DomainError, FailedPrecondition, InvalidArgument, NotFound
from actors.machines.qemuproc import MachineError
from actors.model import ImageUse, MemoryKind, SandboxConfig
from actors.principals import LEGACY_OWNER, Principal
from actors.sandboxes.savedstate import Checkpoint, stat_key
from actors.store import Record, SnapshotRecord, Store

log = logging.getLogger("sandvisor.snapshot")


@attrs.frozen
class Converted:
    """What a conversion wrote into a snapshot dir (renamed into place, synced): the
    device state alone (``vmstate``, a file name) and ``memory``, the guest RAM."""

    vmstate: str
    sizes: dict[str, int]
    memory_stat: list[int]


Hold = Callable[[], Awaitable[None]]
# (a snapshot, the hold its conversion passes at its last step) -> what it wrote
Convert = Callable[[SnapshotRecord, Hold], Awaitable[Converted]]
CONVERT_RETRY = 5.0  # s: a conversion that found no room looks again after this long
PART = ".part"  # a conversion's files while it writes them


def rfc3339(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class SnapshotStore:
    """The snapshots of one supervisor: records (SQLite) and directories
    (``<state>/snapshots/<uid>``). The only writer of snapshot records: a checkpoint is
    recorded through :meth:`take` and nothing else; the registry checks who depends
    on a snapshot before :meth:`delete`.

    ``in_use``: the disk layers live sandboxes stand on (their directories are never
    collected as garbage). ``convert``: how a streamed snapshot becomes a mapped one
    (:func:`actors.snapshots.convert.convert_streamed`; None: snapshots stay as checkpointed);
    ``may_convert``: whether there is room for one now (else it waits).

    Tasks (:meth:`run`): the collector, and the converter, which converts the streamed
    snapshots one at a time, oldest first (each checkpoint queues its snapshot; a start
    queues those still streamed). :attr:`convert_lock` is held for each conversion:
    whoever holds it (a test) keeps conversions from starting. Whoever holds
    :attr:`convert_hold` stops a conversion under way at its last step, the crash point
    ``convert`` (its helper QEMU paused with the stream loaded, both ``.part`` files
    written, the record not switched), until it is released: a delete or an exit then
    cuts it there. ``convert_hold.statistics().tasks_waiting`` says one waits."""

    def __init__(
        self,
        root: Path,
        store: Store,
        in_use: Callable[[], set[Path]],
        *,
        convert: Convert | None = None,
        may_convert: Callable[[SnapshotRecord], bool] | None = None,
    ) -> None:
        self.root = root
        self.store = store
        self.in_use = in_use
        self.snapshots: dict[str, SnapshotRecord] = {}
        self.pending: set[Path] = set()  # directories of checkpoints in progress: not garbage
        self._collect_wanted = trio.Event()
        self._convert = convert
        self._may_convert = may_convert
        self._to_convert: list[str] = []  # snapshot ids, oldest first
        self._convert_wanted = trio.Event()
        self.convert_lock = trio.Lock()
        self.convert_hold = trio.Lock()
        self.converting: SnapshotRecord | None = None  # its dir is not garbage, nor its files stray
        self._convert_scope: trio.CancelScope | None = None
        self._convert_done = trio.Event()
        self._convert_done.set()

    def load(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)  # restores' QEMU reaches <uid>/memory; lists nothing
        for rec in self.store.snapshots():
            self.snapshots[rec.id] = rec
            self.convert_soon(rec)

    def new_id(self) -> str:
        """A fresh snapshot id (none of the store's has it)."""
        while True:
            sid = "snap-" + os.urandom(6).hex()
            if sid not in self.snapshots:
                return sid

    async def take(
        self,
        checkpoint: Callable[[Path], Awaitable[Checkpoint]],
        origin: Record,
        *,
        name: str = "",
        labels: dict[str, str] | None = None,
        template_key: str = "",
        image: tuple[str, ...] = (),
        config: SandboxConfig | None = None,
        oci: ImageUse | None = None,
        address: str = "",
        volume_generations: dict[str, int] | None = None,
        paused_for: str = "",
        owner: str = LEGACY_OWNER,
        fork_only: bool = False,
    ) -> tuple[SnapshotRecord, Checkpoint]:
        """Checkpoint a sandbox into a new directory (``checkpoint(dir)``: the sandbox's
        own, guarded sequence) and record it, with ``config`` (default: the origin's)
        as what restores inherit. On failure the directory goes, unless the sandbox's
        disk froze into it (the collector keeps it while used)."""
        uid = os.urandom(8).hex()
        snap_dir = self.root / uid
        snap_dir.mkdir(mode=0o711)
        self.pending.add(snap_dir.resolve())
        created = time.time_ns()
        try:
            ck = await checkpoint(snap_dir)
        except BaseException:
            self.pending.discard(snap_dir.resolve())
            self.collect_soon()  # the directory stays only if the sandbox's disk froze into it
            raise
        try:  # (a memory the checkpoint kept for its caller goes with a failure)
            rec = SnapshotRecord(
                uid=uid,
                id=self.new_id(),
                name=name,
                labels=dict(labels or {}),
                sandbox_id="" if template_key else origin.id,
                origin_uid=origin.uid,
                created_ns=created,
                dir=str(snap_dir),
                memory=ck.memory,
                machine=ck.machine,
                # what restores inherit: the origin's configuration with every port it has
                # exposed (a restore forwards each again, on its own host port), and its
                # limits as resolved when it was made (not the defaults of a later supervisor)
                config=config
                or attrs.evolve(origin.config, ports=tuple(origin.ports), limits=origin.limits or origin.config.limits),
                sizes=ck.sizes,
                memory_stat=ck.memory_stat,
                template_key=template_key,
                image=image,
                oci=oci or origin.image,
                chain=ck.chain,
                address=address,
                volume_generations=dict(volume_generations or {}),
                paused_for=paused_for,
                owner=owner,
                fork_only=fork_only,
            )
            crash_point("template-checkpoint" if template_key else "snapshot-record")
            self.store.insert_snapshot(rec)
        except BaseException:
            if ck.memfd >= 0:
                os.close(ck.memfd)
            raise
        self.snapshots[rec.id] = rec
        self.pending.discard(snap_dir.resolve())
        self.convert_soon(rec)
        return rec, ck

    def get(self, ref: str, viewer: Principal | None = None) -> SnapshotRecord:
        """By id, else by name when exactly one snapshot has it (templates are not callers');
        of those ``viewer`` may see (None: all)."""
        if not ref:
            raise InvalidArgument("snapshot_id is required")

        def shown(r: SnapshotRecord) -> bool:
            return not r.hidden and (viewer is None or viewer.may_see(r.owner))

        rec = self.snapshots.get(ref)
        if rec is not None and shown(rec):
            return rec
        named = [r for r in self.snapshots.values() if r.name == ref and shown(r)]
        if len(named) == 1:
            return named[0]
        if len(named) > 1:
            raise InvalidArgument(f"{len(named)} snapshots are named {ref!r}: use an id")
        raise NotFound(f"no snapshot {ref!r}")

    def select(
        self, sandbox_id: str = "", labels: dict[str, str] | None = None, viewer: Principal | None = None
    ) -> list[SnapshotRecord]:
        """The callers' snapshots, oldest first, by origin and labels (all must match), of
        those ``viewer`` may see (None: all)."""
        labels = labels or {}
        return [
            r
            for r in sorted(self.snapshots.values(), key=lambda r: r.created_ns)
            if not r.hidden
            and (viewer is None or viewer.may_see(r.owner))
            and (not sandbox_id or r.sandbox_id == sandbox_id)
            and all(r.labels.get(k) == v for k, v in labels.items())
        ]

    def templates(self) -> list[SnapshotRecord]:
        return [r for r in self.snapshots.values() if r.template_key]

    def check_restorable(self, rec: SnapshotRecord, accel: str) -> None:
        if rec.memory == MemoryKind.DISK:  # its restores boot: any accelerator, this supervisor's kernel
            if not rec.disk.exists():
                raise FailedPrecondition(f"snapshot {rec.id} is incomplete on disk: disk.qcow2 is missing")
            return
        if rec.machine.accel != accel:
            raise FailedPrecondition(
                f"snapshot {rec.id} was taken under {rec.machine.accel}; this supervisor runs {accel}"
            )
        for part in (rec.vmstate, "disk.qcow2", "kernel", "initrd"):
            if not (rec.path / part).exists():
                raise FailedPrecondition(f"snapshot {rec.id} is incomplete on disk: {part} is missing")
        if rec.memory != MemoryKind.MAPPED:
            return
        if rec.fork_only and not rec.memory_stat:
            return  # a fork's memory, held sealed by the supervisor (no file: Registry.checkpoint)
        try:
            key = stat_key(rec.path / "memory")
        except OSError as exc:
            raise FailedPrecondition(f"snapshot {rec.id}: memory file unreadable: {exc.strerror}") from None
        if key != rec.memory_stat:
            raise FailedPrecondition(f"snapshot {rec.id}: its memory file was changed after the checkpoint; delete it")

    def dependents(self, rec: SnapshotRecord, chains: Iterable[tuple[str, Iterable[str]]]) -> list[str]:
        """Who needs this snapshot's disk: ``chains`` are (what, the layers below its
        overlay) of the live sandboxes; other snapshots' are checked here. Chains as
        the store recorded them: never read from headers QEMU could have written."""
        mine = str(rec.disk)
        others = [(f"snapshot {r.id}", r.chain) for r in self.snapshots.values() if r.id != rec.id]
        return [what for what, chain in [*chains, *others] if mine in chain]

    def drop(self, rec: SnapshotRecord, why: str) -> None:
        """Forget a snapshot whose files may still be used (a broken or stale boot
        template): its directory goes once nothing stands on it."""
        log.warning("snapshot %s dropped: %s", rec.id, why)
        self.retire(rec)

    def retire(self, rec: SnapshotRecord) -> None:
        """A paused sandbox's saved state once it resumed (or went): the record goes,
        and its memory and streams with it; the directory stays while its frozen disk is
        a layer of the sandbox's chain (the collector removes it after). (A machine restored
        from that memory keeps its mapping: the file's blocks go with it.)"""
        self._stop_converting(rec)
        if self.snapshots.get(rec.id) is rec:
            self.store.delete_snapshot(rec.uid)
            del self.snapshots[rec.id]
        _drop_saved_memory(rec.path)
        self.collect_soon()

    def retire_forks(self, named: set[str]) -> list[SnapshotRecord]:
        """The snapshots taken only to fork that no sandbox's lineage names (``named``: the
        snapshot ids the sandboxes' lineages name) are retired: their record, memory and
        stream go; their frozen disk stays while a chain uses it. The retired ones."""
        gone = [r for r in self.snapshots.values() if r.fork_only and r.id not in named]
        for r in gone:
            self.retire(r)
        return gone

    async def delete(self, rec: SnapshotRecord) -> None:
        self._stop_converting(rec)
        await self._convert_done.wait()  # (its helper reaped, its files gone)
        self.store.delete_snapshot(rec.uid)
        self.snapshots.pop(rec.id, None)
        await trio.to_thread.run_sync(shutil.rmtree, rec.dir, True)
        self.collect_soon()  # (layers below it that only its chain kept: a fork point's disk)

    def collect_soon(self) -> None:
        """Ask the collector task (:meth:`run`) for a collection."""
        self._collect_wanted.set()

    async def run(self, task_status: trio.TaskStatus[SnapshotStore] = trio.TASK_STATUS_IGNORED) -> None:
        """The collector (removes garbage when asked, :meth:`collect_soon`) and the
        converter; cancelled, a conversion in progress is undone (its helper QEMU
        reaped, its files removed) before this returns."""
        async with trio.open_nursery() as nursery:
            if self._convert is not None:
                nursery.start_soon(self._converter, self._convert)
            task_status.started(self)
            while True:
                await self._collect_wanted.wait()
                self._collect_wanted = trio.Event()
                await self.collect()

    async def collect(self) -> int:
        """Remove snapshot directories without a record that no disk chain (of a sandbox
        or a snapshot) uses (what a failed checkpoint or a crash left behind), and the
        files a conversion left in recorded ones; removals in a worker thread."""
        busy = {Path(self.converting.dir).resolve()} if self.converting is not None else set()
        known = {Path(r.dir).resolve() for r in self.snapshots.values()} | self.pending | busy
        # the layers of live disks and of every recorded snapshot's chain (a dropped
        # template's directory stays while a snapshot made on top of it stands on it)
        layers = [*self.in_use(), *(Path(p) for r in self.snapshots.values() for p in r.chain)]
        used = {p.resolve().parent for p in layers}
        dirs = [d for d in self.root.iterdir() if d.is_dir() and d.resolve() not in known]
        garbage = [d for d in dirs if d.resolve() not in used]
        for d in garbage:
            await trio.to_thread.run_sync(shutil.rmtree, d, True)
        for d in dirs:  # kept for a chain's sake: its disk is all that is needed of it
            if d not in garbage:
                _drop_saved_memory(d)
        if garbage:
            log.info("removed %d snapshot directories nothing uses", len(garbage))
        strays = [p for r in list(self.snapshots.values()) if r is not self.converting for p in _strays(r)]
        for p in strays:
            p.unlink(missing_ok=True)
        if strays:
            log.info("removed %d files of unfinished snapshot conversions", len(strays))
        return len(garbage)

    # -- the converter -------------------------------------------------------------
    def convert_soon(self, rec: SnapshotRecord) -> None:
        """Queue a streamed snapshot for conversion (nothing when conversions are off).
        A snapshot with volumes stays streamed: the helper machine has no volume
        disks, and the stream's device state names them."""
        if self._convert is None or rec.memory != MemoryKind.STREAMED or rec.id in self._to_convert:
            return
        if rec.config.volumes:
            return
        self._to_convert.append(rec.id)
        self._convert_wanted.set()

    def _stop_converting(self, rec: SnapshotRecord) -> None:
        """``rec`` is going: not queued any more, and its conversion (if running) cancelled."""
        if rec.id in self._to_convert:
            self._to_convert.remove(rec.id)
        if self.converting is rec and self._convert_scope is not None:
            self._convert_scope.cancel()

    def _next_to_convert(self) -> SnapshotRecord | None:
        while self._to_convert:
            rec = self.snapshots.get(self._to_convert[0])
            if rec is not None and rec.memory == MemoryKind.STREAMED:
                return rec
            self._to_convert.pop(0)
        return None

    async def _converter(self, convert: Convert) -> None:
        while True:
            rec = self._next_to_convert()
            if rec is None:
                self._convert_wanted = trio.Event()
                await self._convert_wanted.wait()
                continue
            if self._may_convert is not None and not self._may_convert(rec):
                with trio.move_on_after(CONVERT_RETRY):  # no room now: real work comes first
                    self._convert_wanted = trio.Event()
                    await self._convert_wanted.wait()
                continue
            async with self.convert_lock:
                if self._next_to_convert() is rec:
                    self._to_convert.pop(0)
                    await self.convert_one(rec, convert)

    async def convert_one(self, rec: SnapshotRecord, convert: Convert) -> bool:
        """Convert ``rec`` and switch its record (True), or leave it streamed: a failure
        is logged and not retried until the next start; a cancel (the snapshot is
        deleted, the supervisor exits) leaves nothing of the conversion."""
        self.converting = rec
        self._convert_done = trio.Event()
        t0 = time.monotonic()
        try:
            with trio.CancelScope() as scope:
                self._convert_scope = scope
                try:
                    out = await convert(rec, self._hold)
                except (MachineError, JailError, OSError, DomainError) as exc:
                    log.warning("snapshot %s stays streamed: its conversion failed: %s", rec.id, exc)
                    return False
                except Exception:  # a bug must cost this conversion, not the supervisor
                    log.exception("snapshot %s stays streamed: its conversion crashed", rec.id)
                    return False
            if scope.cancelled_caught or self.snapshots.get(rec.id) is not rec:
                return False
            old = rec.vmstate
            # the switch: one step, no checkpoint inside (a restore sees all of it or none)
            rec.memory, rec.vmstate = MemoryKind.MAPPED, out.vmstate
            rec.sizes, rec.memory_stat = {**rec.sizes, **out.sizes}, out.memory_stat
            self.store.update_snapshot(rec)
        finally:
            self.converting = None
            self._convert_scope = None
            self._convert_done.set()
        log.info("snapshot %s converted to mapped in %.0f ms", rec.id, (time.monotonic() - t0) * 1000)
        try:
            await self.store.flush()  # the old stream goes only once the record names the new one
        except DomainError as exc:  # a full disk: the next start removes it, whichever record it finds
            log.warning("snapshot %s: %s", rec.id, exc.message)
            return True
        if old != rec.vmstate:
            (rec.path / old).unlink(missing_ok=True)
        return True

    async def _hold(self) -> None:
        """A conversion's last step: it waits here while someone holds :attr:`convert_hold`."""
        async with self.convert_hold:
            pass


def _strays(rec: SnapshotRecord) -> list[Path]:
    """Files in a recorded snapshot's dir that an unfinished conversion left: its
    ``*.part`` files, a RAM file or stream the record does not name."""
    try:
        names = [e.name for e in os.scandir(rec.path) if e.is_file(follow_symlinks=False)]
    except OSError:
        return []
    named = {rec.vmstate, *(["memory"] if rec.memory == MemoryKind.MAPPED else [])}
    return [
        rec.path / n
        for n in names
        if n.endswith(PART) or ((n.startswith("vmstate") or n == "memory") and n not in named)
    ]


def _drop_saved_memory(path: Path) -> None:
    """A snapshot directory's saved memory and streams (what only its restores read)."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for n in names:
        if n == "memory" or n.startswith("vmstate"):
            (path / n).unlink(missing_ok=True)
