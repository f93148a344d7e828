"""The registry's start: what the previous supervisor left, set right before we serve.

The run root is checked (QEMU's user must pass through it); a QEMU of ours no record
can adopt is killed and reaped (:func:`end_qemu`, :func:`our_qemus`); the disk swap
of a checkpoint it died in is finished or undone (:func:`repair_swap`); what a dead
life left goes (:func:`close_life`); leases and jail namespaces nothing holds go
(:func:`recover_network`). :func:`recover` decides which sandbox gets which.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol as Interface

import trio

from actors.errors import FailedPrecondition
from actors.machines.qemuproc import AdoptedProcess, start_time, unsearchable_parent
from actors.model import ALIVE, Cause, Ending, State, is_hidden
from actors.net.ippool import link_name
from actors.sandboxes.files import SandboxFiles
from actors.sandboxes.sandbox import Adopt, Sandbox
from actors.settings import Settings
from actors.snapshots.snapshot import SnapshotStore
from actors.store import Record, Store

log = logging.getLogger("sandvisor.registry")


def check_traversable(path: Path, user: str) -> None:
    """QEMU runs as ``user`` and creates its guest socket under ``path``: every parent
    must let others through (o+x). Said at start, not at the first boot's failure."""
    blocked = unsearchable_parent(path / "x")  # the run root itself must be passable too
    if blocked is not None:
        raise FailedPrecondition(
            f"the run root {path} is not reachable by QEMU's user {user!r}: {blocked} is not o+x "
            "(choose another run root, or another --qemu-user)"
        )


def repair_swap(sb: Sandbox) -> None:
    """Finish or undo the disk swap of a checkpoint the previous supervisor died in
    (the journal names the frozen disk); the chain then says where the disk stands."""
    rec = sb.record
    frozen = rec.swap
    if sb.files.repair_swap(Path(frozen)) and (not rec.chain or rec.chain[0] != frozen):
        sb.swapped(frozen)
    else:
        sb.void_swap()
    done = "finished" if rec.chain[:1] == [frozen] else "undone"
    log.warning("sandbox %s: the disk swap of a checkpoint was %s", rec.id, done)


def recover_network(settings: Settings, sandboxes: Iterable[Sandbox], adopted: Iterable[Sandbox]) -> None:
    """Leases whose sandbox is gone (a crash between a Remove's record and its lease)
    go back to the pool; jail namespaces no adopted life runs in go."""
    hn = settings.hostnet
    if hn is None:
        return
    owners = {sb.record.uid for sb in sandboxes}
    for owner in hn.pool.leases():
        if owner not in owners:
            hn.pool.release(owner)
    for owner, address in hn.pool.dropped:
        log.warning("the IP pool changed: sandbox %s loses its address %s", owner, address)
    hn.sweep(keep={link_name(sb.record.uid) for sb in adopted})


def close_life(settings: Settings, sb: Sandbox) -> None:
    """What a dead life left (its cell: cgroup, jail dir, identity, RAM file)."""
    life, cells = sb.record.life, settings.cells
    if life is None:
        return
    if life.uid and cells is not None:
        cells.reopen(sb.record.uid[:18], Path(life.run_dir), life.uid, life.ram).close()
    sb.note_life_ended()


async def end_qemu(proc: AdoptedProcess | None, timeout: float = 10.0) -> bool:
    """SIGKILL a QEMU and wait until it is gone (a pidfd: no recycled pid is hit).
    True if it was running."""
    if proc is None:
        return False
    proc.kill()
    with trio.move_on_after(timeout) as scope:
        await proc.wait()
    if scope.cancelled_caught:
        log.error("QEMU %d did not die within %gs of SIGKILL", proc.pid, timeout)
    return True


def our_qemus(run_root: Path) -> set[int]:
    """QEMUs whose "/" is a jail dir under our run root (the same directory inode: a
    pivot_root-ed process's root has no path in our mount namespace), or whose argv
    names our run root (unjailed)."""
    root = str(run_root.resolve()).encode()
    jails = set()
    for jail_dir in run_root.glob("*/root"):
        try:
            st = jail_dir.stat()
            jails.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes()
            if b"qemu-system" not in argv.split(b"\0", 1)[0]:
                continue
            st = os.stat(Path(entry.path, "root"))
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in jails or root + b"/" in argv:
            found.add(int(entry.name))
    return found


class RecoveryHost(Interface):
    """What the start's recovery uses of the registry (which implements it): its parts,
    its sandboxes (filled in here), and how it makes, forgets and retires. The registry
    imports this module, not the reverse."""

    settings: Settings
    store: Store
    snapshots: SnapshotStore
    sandboxes: dict[str, Sandbox]

    @property
    def hibernation(self) -> PausedRecovery: ...

    def sandbox_of(self, rec: Record) -> Sandbox: ...

    async def forget(self, sb: Sandbox) -> None: ...

    def retire_forks(self) -> None: ...


class PausedRecovery(Interface):
    """What recovery uses of hibernation: paused sandboxes set right after the kills."""

    def recover(self) -> None: ...


async def recover(reg: RecoveryHost) -> list[tuple[Sandbox, Adopt]]:
    """Records of the previous supervisor. A QEMU it recorded that still runs (the
    same pid and start time) is adopted when its sandbox was ready or running: it
    keeps its memory, processes and ports. Any other QEMU of ours -- recorded but
    not adoptable (booting, a pool member), or under our run root and named by no
    record -- is killed and reaped (or confirmed gone) before we serve."""
    adoptions: list[tuple[Sandbox, Adopt]] = []
    ours: set[int] = set()
    records = reg.store.all()
    for rec in records:
        sb = reg.sandbox_of(rec)
        proc = AdoptedProcess.open(rec.life.pid, rec.life.start_time) if rec.life is not None else None
        swapping = bool(rec.swap)  # a crash during a checkpoint: its QEMU (paused) is not adopted
        if swapping:
            repair_swap(sb)
        adoptable = rec.state in ALIVE and not is_hidden(rec.id) and not swapping
        if proc is not None and rec.life is not None and adoptable:
            adoptions.append((sb, Adopt(rec.life, proc, accepted=time.monotonic())))
            ours.add(proc.pid)
            reg.sandboxes[rec.id] = sb
            continue
        killed = await end_qemu(proc)
        close_life(reg.settings, sb)
        if is_hidden(rec.id):  # a warm pool member: it goes, and so does its QEMU
            await reg.forget(sb)
            continue
        if rec.state in (State.STOPPING, State.DRAINING):  # it was being stopped: it is now
            sb.mark_stopped()
        elif rec.state in (State.STARTING, *ALIVE):
            error = f"the supervisor exited while this sandbox was {rec.state}" + (
                " (its QEMU process was killed)" if killed else ""
            )
            if swapping:
                error += "; it was being checkpointed (its disk is whole: start it again)"
            sb.mark_failed(error, Cause(Ending.HOST_RESTART, detail=error))
        reg.sandboxes[rec.id] = sb
    for pid in our_qemus(reg.settings.run_root) - ours:
        log.warning("killing QEMU %d under our run root that no record names", pid)
        await end_qemu(AdoptedProcess.open(pid, start_time(pid)))
    reg.hibernation.recover()  # paused sandboxes stay paused (their QEMU, if any, killed above)
    keep = {Path(plan.life.run_dir).name for _, plan in adoptions}
    recover_network(reg.settings, reg.sandboxes.values(), [sb for sb, _ in adoptions])
    SandboxFiles.sweep_lives(reg.settings, keep=keep)  # what no adopted life holds is stale
    SandboxFiles.sweep_unrecorded(reg.settings, {rec.uid for rec in records})
    if reg.settings.cells is not None:
        reg.settings.cells.sweep(keep=keep)
    reg.retire_forks()
    await reg.snapshots.collect()
    return adoptions
