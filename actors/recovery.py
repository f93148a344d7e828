"""The registry's start: what the previous supervisor left, set right before we serve.

The run root is checked (QEMU's user must pass through it); a QEMU of ours no record
can adopt is killed and reaped (:func:`end_qemu`, :func:`our_qemus`); the disk swap
of a checkpoint it died in is finished or undone (:func:`repair_swap`); what a dead
life left goes (:func:`close_life`); leases and jail namespaces nothing holds go
(:func:`recover_network`). ``Registry._recover`` decides which sandbox gets which.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import trio

from actors.errors import FailedPrecondition
from actors.machines.qemuproc import AdoptedProcess, unsearchable_parent
from actors.net.ippool import link_name
from actors.sandboxes.sandbox import Sandbox
from actors.settings import Settings

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
