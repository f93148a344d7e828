"""A sandbox's guarded checkpoint: one at a time, with a journal for its disk swap.

:class:`Checkpoints` is the sandbox's guard (one per sandbox, across lives): one
checkpoint runs at a time; while it does, short guest calls wait for it
(:meth:`Checkpoints.wait_idle`) and new work is refused. :meth:`Checkpoints.take`
is the sequence: wait out the guest's requests in flight, journal the disk swap
(``record.swap``: a crash from there to the end of the swap is finished or undone by
the next supervisor, ``actors.recovery.recover``), :func:`~actors.sandboxes.savedstate.checkpoint_guest`,
and a failure that left the guest paused is :class:`CheckpointLost` (the life cannot
go on). Recording the snapshot is the registry's (``SnapshotStore.take``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol

import trio

from actors.durable import fsync_path
from actors.errors import FailedPrecondition, Internal, ResourceExhausted
from actors.machines.qemuproc import MachineError
from actors.machines.vm import Guest
from actors.model import MemoryKind
from actors.quotas import short_of_space
from actors.sandboxes.files import SandboxFiles
from actors.sandboxes.livecopy import checkpoint_live, supports, worth_it
from actors.sandboxes.logs import SandboxLog
from actors.sandboxes.savedstate import Checkpoint, allocated, checkpoint_guest, still_running
from actors.settings import Settings
from actors.store import MachineRecord, Record

log = logging.getLogger("sandvisor.checkpoint")

BUSY_WAIT = 5.0  # s: requests in flight get this long to finish before a checkpoint


class CheckpointLost(MachineError):
    """A checkpoint failed and the guest did not run again: the life cannot go on."""


class SwapJournal(Protocol):
    """The sandbox's record, as a checkpoint's disk swap changes it (the sandbox writes it)."""

    async def journal_swap(self, frozen: str) -> None: ...

    def swapped(self, frozen: str, *, disk_top: str | None = None, staged: int | None = None) -> None: ...

    def void_swap(self) -> None: ...


class Checkpoints:
    """One sandbox's checkpoints: the lock, and whether one is under way. It reads the
    sandbox's ``record``; ``journal`` (the sandbox) records the disk swap."""

    def __init__(
        self, record: Record, journal: SwapJournal, files: SandboxFiles, settings: Settings, log: SandboxLog
    ) -> None:
        self.record, self.journal, self.files, self.settings, self.log = record, journal, files, settings, log
        self.active = False
        self._lock = trio.Lock()
        self._done = trio.Event()
        self._done.set()

    async def wait_idle(self) -> None:
        """Until no checkpoint is under way."""
        await self._done.wait()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """No checkpoint starts while the block runs (a merge of the disk's layers: the
        disk must not move under it); guest calls go on as usual."""
        async with self._lock:
            yield

    async def take(
        self,
        guest: Guest,
        snap_dir: Path,
        *,
        stay_paused: bool = False,
        keep_memory: bool = False,
        memory_file: bool = True,
    ) -> Checkpoint:
        """Save ``guest`` into ``snap_dir``; it runs on afterwards (``stay_paused``: it
        stays stopped, for a pause that ends its QEMU next; ``keep_memory``: the saved
        memory comes back as a sealed memfd too, ``Checkpoint.memfd``; ``memory_file``
        False: only there, no file: checkpoint_guest)."""
        async with self._lock:
            self.active = True
            self._done = trio.Event()
            try:
                return await self._take(guest, snap_dir, stay_paused, keep_memory, memory_file)
            finally:
                self.active = False
                self._done.set()

    async def _take(
        self, guest: Guest, snap_dir: Path, stay_paused: bool, keep_memory: bool, memory_file: bool
    ) -> Checkpoint:
        rec, journal = self.record, self.journal
        # requests in flight (metrics, files) finish first: a request sitting in the
        # guest's queue at the pause would run again in every restore
        with trio.move_on_after(BUSY_WAIT):
            while guest.channel.statistics().requests_in_flight:
                await trio.sleep(0.002)
        if guest.channel.statistics().requests_in_flight:
            raise FailedPrecondition(f"sandbox {rec.id}: guest channel busy; retry the checkpoint")

        def frozen(disk: Path) -> None:
            journal.swapped(str(disk), disk_top=guest.machine.disk_top, staged=guest.machine.staged)

        try:
            # the journal: a crash from here to the end of the disk swap is finished or
            # undone by the next supervisor (actors.recovery.recover)
            await journal.journal_swap(str(snap_dir / "disk.qcow2"))
            spec = guest.machine.spec
            if keep_memory and not memory_file and not stay_paused and supports(spec, self.settings) and worth_it(spec):
                # a fork's: the RAM copied while the guest runs (actors/sandboxes/livecopy.py)
                ck = await checkpoint_live(
                    guest,
                    files=self.files,
                    settings=self.settings,
                    config=rec.config,
                    snap_dir=snap_dir,
                    chain=tuple(rec.chain),
                    on_frozen=frozen,
                    freeze=self.settings.freeze_fs,
                )
            else:
                ck = await checkpoint_guest(
                    guest,
                    files=self.files,
                    snap_dir=snap_dir,
                    user=None if self.settings.cells is not None else self.settings.qemu_user,
                    chain=tuple(rec.chain),
                    on_frozen=frozen,
                    stay_paused=stay_paused,
                    freeze=self.settings.freeze_fs,
                    keep_memory=keep_memory,
                    memory_file=memory_file,
                )
        except (MachineError, OSError) as exc:
            self._void_journal()
            if not await still_running(guest):
                raise CheckpointLost(f"checkpoint failed and the guest did not resume: {exc}") from None
            if short_of_space(exc, snap_dir):  # (another writer took the room admission saw)
                raise ResourceExhausted(f"checkpoint of {rec.id}: the state dir's filesystem is full ({exc})") from None
            raise Internal(f"checkpoint of {rec.id} failed: {exc}") from None
        except BaseException:
            self._void_journal()
            raise
        fs = f"; file systems {ck.consistency} ({ck.freeze_s * 1000:.0f} ms)" if ck.consistency else ""
        steps = ", ".join(f"{k} {v * 1000:.0f}" for k, v in ck.phases.items())
        text = f"checkpoint: {ck.memory}, paused {ck.paused_s * 1000:.0f} ms{fs} (ms: {steps})"
        self.log.append("system", text.encode())
        log.info("%s: %s", rec.id, text)
        return ck

    async def take_stopped(self, snap_dir: Path, machine: MachineRecord) -> Checkpoint:
        """A stopped sandbox's disk frozen into ``snap_dir`` (a disk-only snapshot): the
        disk swap of a live checkpoint, with no QEMU, under the same journal. The
        sandbox goes on (at its next Start) on a new overlay on top of it."""
        async with self._lock:
            self.active = True
            self._done = trio.Event()
            try:
                return await self._freeze_stopped(snap_dir, machine)
            finally:
                self.active = False
                self._done.set()

    async def _freeze_stopped(self, snap_dir: Path, machine: MachineRecord) -> Checkpoint:
        rec, files = self.record, self.files
        if not files.disk.exists():
            raise FailedPrecondition(f"sandbox {rec.id} has no disk yet (it never booted)")
        frozen = snap_dir / "disk.qcow2"
        below = tuple(rec.chain)
        await self.journal.journal_swap(str(frozen))
        try:
            await files.stage_next_disk(frozen)
            await trio.to_thread.run_sync(fsync_path, files.disk)  # the last life's writes, before it is a snapshot
            files.swap_disks(frozen)
        except BaseException:
            files.discard_next_disk()
            self._void_journal()
            raise
        self.journal.swapped(str(frozen))  # (on ``below``: the chain as it was)
        self.log.append("system", b"checkpoint: disk only (the sandbox is stopped)")
        return Checkpoint(MemoryKind.DISK, 0.0, {"disk.qcow2": allocated(frozen)}, [], machine, below)

    def _void_journal(self) -> None:
        """A checkpoint failed before its disk moved (``frozen`` clears the journal when
        it did): nothing is under way."""
        self.journal.void_swap()
