"""A fork's checkpoint as a live copy: the running guest's RAM sent to a helper QEMU
while it runs, so that the guest stops only for what it wrote during the copy.

A checkpoint stops the guest for the whole copy of its RAM (:func:`~actors.sandboxes.
savedstate.checkpoint_guest`: memory to memory for a shared RAM file, through the
migration stream for RAM mapped privately, which is every sandbox restored from a
snapshot: a default Create, a fork's child). A fork's hidden snapshot is restored
only by its children, in this supervisor's life, from a sealed memfd: the copy can
go where the fork wants it, while the guest runs, with QEMU's own dirty tracking::

    supervisor                         parent QEMU (runs)              helper QEMU (its own cell, -S)
    new overlay staged; a memfd (the fork's RAM, the helper's uid); socketpair
    spawn ----------------------------------------------------------> -incoming defer, RAM = memfd, shared
    migrate-incoming fd: <------------------------------------------  socket end B
    freeze (FIFREEZE, after a sync)
    migrate fd: (pause-before-switchover) -> RAM while the guest runs ->  into the memfd
                                   ... again what it wrote, until the rest fits LIVE_DOWNTIME_MS
                                   stops the guest: pre-switchover
    blockdev-snapshot (the disk cut), names swapped (the journal's swap)
    migrate-continue ------------> the last pages, device state ---->  loaded; stays paused
    cont; thaw                     runs on
    helper: migrate fd: pipe, x-ignore-shared -> device state alone --> vmstate (at most MAX_DEVICE_STATE)
    helper quit and reaped; zero pages made holes; memfd sealed: the fork's memory

The guest is stopped from QEMU's convergence to the ``cont``: the pages it wrote in
the last round, the disk cut, the device state. The helper is jailed as a
conversion's is (:mod:`actors.snapshots.convert`): the stream it parses comes from a
guest that is hostile, through a QEMU assumed escapable.

A failure before the cut leaves the parent as it was (the migration cancelled: QEMU
runs the guest again); after it, the parent runs on its new overlay and the snapshot
dir holds the disk below it (``on_frozen``), as for every checkpoint. A supervisor
killed mid-way finds, at its next start, what every checkpoint cut by a crash leaves:
the journal of the disk swap on record, so the parent's QEMU is killed and its disk
kept whole (the sandbox failed: start it again; actors/recovery.py); the helper, under
the run root and named by no record, is killed too. A QEMU adopted with a migration
still under way is let go of it first (``Machine.abandon_migration``).

Under TCG the guest is stopped before the copy starts (:func:`stop_first`: QEMU 7.2's
TCG loses a guest write now and then during a live copy), so the copy is the pause,
and only a guest whose RAM is mapped privately takes this path there
(:func:`worth_it`).

Used when the supervisor runs jails (the helper needs a cell of its own) and the
parent has no volumes or host directories; else the checkpoint is the ordinary one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from actors._groups import collapse_single
from actors.cells import guestmem
from actors.cells.cell import Cell
from actors.crash import crash_point
from actors.machines.machine import Machine, Placement
from actors.machines.qemuproc import MachineError
from actors.machines.qemuspec import MachineSpec
from actors.machines.vm import TAP_FD, Guest, netdev_args
from actors.model import MemoryKind, NetMode, SandboxConfig
from actors.net.netns import NetNS
from actors.sandboxes.files import SandboxFiles
from actors.sandboxes.savedstate import (
    Checkpoint,
    CheckpointError,
    Phases,
    allocated,
    finish_files,
    freeze_guest,
    helper_net,
    machine_record,
    save_device_state,
    swap_names,
    thaw_guest,
)
from actors.settings import Settings

log = logging.getLogger("sandvisor.livecopy")

LIVE_DOWNTIME_MS = 20  # QEMU stops the guest once what is left to send fits this long
LIVE_CONVERGE = 5.0  # s: a guest that writes faster than the copy by then gets ...
LIVE_DOWNTIME_FALLBACK_MS = 2000  # ... this limit: it converges, with a longer stop
LIVE_TIMEOUT = 120.0  # s: the whole copy; past it the fork fails and the parent runs on
LIVE_POLL = 0.003  # s: how often QEMU is asked how the copy goes
HELPER_PREFIX = "lf-"  # the helper's run dir and cell: lf-<snapshot dir name>


def supports(spec: MachineSpec, settings: Settings) -> bool:
    """Whether a fork of a guest of ``spec`` takes the live copy here: a helper cell
    is possible (jails), and every device of the guest can be given to the helper
    (no volume, no host directory: their files are the parent's alone)."""
    return settings.cells is not None and spec.disk is not None and not spec.volumes and not spec.fs_tags


def stop_first(spec: MachineSpec) -> bool:
    """Whether the guest is stopped before the copy (the copy is then the pause) rather
    than run through it. Under TCG: QEMU 7.2's TCG loses a guest write now and then
    during a live copy (children of a busy parent that never say hello: 2 forks in 20;
    none with the parent stopped first, nor with it idle; docs/results/fork.md). KVM
    tracks the guest's writes itself: its guests run through the copy."""
    return spec.accel == "tcg"


def worth_it(spec: MachineSpec) -> bool:
    """Whether a fork of a guest of ``spec`` is better served by the helper than by the
    ordinary checkpoint: always where the guest runs through the copy; under TCG (the
    guest stopped for it, :func:`stop_first`) for RAM mapped privately, whose ordinary
    checkpoint streams it all into a file that each child reads back into RAM of its
    own, not for a shared RAM file, which the ordinary checkpoint copies memory to
    memory, faster than a migration does."""
    return not stop_first(spec) or (spec.memory_file is not None and not spec.memory_shared)


def helper_spec(parent: MachineSpec, config: SandboxConfig, disk: Path) -> MachineSpec:
    """The helper's machine: the parent's (its kernel, initrd, command line, vCPUs,
    memory, balloon: the stream's devices), RAM a shared file given by descriptor, a
    placeholder disk (it never runs the guest), a network backend whose state matches
    the parent's (:func:`helper_net`), started paused for an incoming stream."""
    # a TAP's device keeps the parent's arguments (its offloads are the TAP's: a backend
    # without a vnet header could not load its state), on a TAP of the helper's own
    tap = config.network.mode == NetMode.TAP
    return attrs.evolve(
        parent,
        disk=disk,
        disk_chain=(),
        netdev=parent.netdev if tap else netdev_args(helper_net(config)),
        memory_file=None,
        memory_shared=True,
        incoming=True,
        user=None,
        preload=None,
        extra_args=("-S",),
    )


async def checkpoint_live(
    guest: Guest,
    *,
    files: SandboxFiles,
    settings: Settings,
    config: SandboxConfig,
    snap_dir: Path,
    chain: tuple[str, ...] = (),
    on_frozen: Callable[[Path], None] | None = None,
    freeze: bool = False,
) -> Checkpoint:
    """Save the running ``guest`` into ``snap_dir`` (which exists and is empty) by a live
    copy (see the module's diagram): ``vmstate`` (the device state alone) and
    ``disk.qcow2`` there, the RAM in a sealed memfd (``Checkpoint.memfd``, the caller's),
    no memory file. The guest runs on. The disk's side is
    :func:`~actors.sandboxes.savedstate.checkpoint_guest`'s."""
    m = guest.machine
    spec = m.spec
    cells = settings.cells
    assert cells is not None and supports(spec, settings)
    frozen = snap_dir / "disk.qcow2"
    frozen_done = moving = False
    staged = None
    consistency, freeze_s, thaw = "", 0.0, False
    phase = Phases()

    name = f"{HELPER_PREFIX}{snap_dir.name}"
    run_dir = settings.run_root / name
    cell: Cell | None = None
    helper: Machine | None = None
    mfd = tap = -1
    paused = 0.0
    try:
        next_disk = await files.stage_next_disk(frozen)
        staged = await m.stage_disk(next_disk)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        placeholder = run_dir / "disk.qcow2"  # the helper's block device: never read by a guest
        await trio.run_process(["qemu-img", "create", "-q", "-f", "qcow2", str(placeholder), "1M"])
        cell = cells.open(name, run_dir, memory_mib=spec.memory_mib, vcpus=spec.cpus)
        mfd = guestmem.new_memfd(spec.memory_mib << 20, "sandvisor-fork-memory")
        before = os.fstat(mfd)
        os.fchown(mfd, cell.identity.uid, cell.identity.gid)  # (QEMU reopens /proc/self/fd/N as it)
        os.fchmod(mfd, 0o600)
        placement = Placement(
            sock_dir=cell.sock_dir, qemu_dir=cell.qemu_dir, log=run_dir / "qemu.log", spawn=cell.spawn
        )
        fds = {"ram": mfd}
        if config.network.mode == NetMode.TAP:
            # a TAP nothing joins (down, no address, in no bridge): not persistent, so
            # it goes with the last of its descriptors, ours and the helper's
            tap = NetNS().open_tap(f"svlf{secrets.token_hex(5)}", vnet_hdr=True)
            fds[TAP_FD] = tap
        helper = Machine(helper_spec(spec, config, placeholder), placement, name=f"fork-{m.name}", fds=fds)
        with trio.fail_after(LIVE_TIMEOUT), collapse_single():
            async with trio.open_nursery() as nursery:
                await nursery.start(helper.run)
                try:
                    src, dst = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                    with src, dst:
                        await helper.incoming_from_fd(dst.fileno(), ignore_shared=False)
                        phase("stage")
                        if freeze:
                            consistency, freeze_s, thaw = await freeze_guest(guest)
                            phase("freeze")
                        moving = True
                        t_stop = 0.0
                        if stop_first(spec):
                            await m.qmp_execute("stop")
                            t_stop = time.monotonic()
                        await m.migrate_live(src.fileno(), downtime_ms=LIVE_DOWNTIME_MS)
                    # (both QEMUs hold their ends: ours are closed, so one's exit ends the other's copy)
                    await _until(m, "pre-switchover", helper)
                    phase("copy")
                    try:
                        await m.switch_disk(staged)
                    finally:
                        if m.disk_top == staged.node:  # (see checkpoint_guest: QEMU writes the new overlay)
                            await swap_names(m, files, frozen)
                            frozen_done = True
                            if on_frozen is not None:
                                on_frozen(frozen)
                    phase("disk")
                    crash_point("fork-switchover")
                    await m.migrate_continue()
                    info = await _until(m, "completed", helper)
                    t_done = time.monotonic()
                    while await m.status() == "finish-migrate":  # (cont fails until it leaves)
                        await trio.sleep(0.001)
                    await m.qmp_execute("cont")
                    moving = False
                    # QEMU's downtime: from its stop to the end of the copy; then ours, to the cont
                    # (stopped first: from our stop)
                    qemu_stop = t_done - float(info.get("downtime", 0)) / 1000
                    paused = time.monotonic() - (t_stop or qemu_stop)
                    phase("cont")
                    if thaw:
                        thaw = False
                        with trio.CancelScope(shield=True):
                            await thaw_guest(guest)
                    await helper.loaded(resume=False)
                    await save_device_state(helper, snap_dir / "vmstate")
                    phase("state")
                finally:
                    await helper.shutdown()
                    nursery.cancel_scope.cancel()
        # the helper read every page the stream named zero (a read allocates a shmem
        # page): they become holes again, so the family holds only what the guest wrote
        await trio.run_process(["fallocate", "--dig-holes", f"/proc/self/fd/{mfd}"], pass_fds=(mfd,))
        guestmem.seal(mfd)
        # the helper is gone: the memfd is as every sealed one the children map (nobody writes it)
        os.fchown(mfd, before.st_uid, before.st_gid)
        os.fchmod(mfd, before.st_mode & 0o7777)
        phase("memory")
        await trio.to_thread.run_sync(finish_files, snap_dir, ["vmstate", "disk.qcow2"], None, spec.kernel, spec.initrd)
        phase("finish")
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            if moving:
                await m.abandon_migration()
                with contextlib.suppress(Exception):
                    if not m.exited and await m.status() != "running":
                        await m.qmp_execute("cont")
            if not frozen_done:
                if staged is not None:
                    await m.unstage_disk(staged)
                files.discard_next_disk()
        if mfd >= 0:
            os.close(mfd)
        if isinstance(exc, CheckpointError):
            raise
        if isinstance(exc, MachineError) and helper is not None and helper.exited:
            raise CheckpointError(f"the fork's live copy failed: {exc}; its helper: {helper.describe_exit()}") from None
        if isinstance(exc, (trio.TooSlowError, subprocess.CalledProcessError)):
            raise CheckpointError(f"the fork's live copy failed: {exc!r}") from None
        raise
    finally:
        if tap >= 0:
            os.close(tap)
        if thaw:
            with trio.CancelScope(shield=True):
                await thaw_guest(guest)
        if cell is not None:
            cell.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    sizes = {f: allocated(snap_dir / f) for f in ("vmstate", "disk.qcow2")}
    sizes["memory"] = os.fstat(mfd).st_blocks * 512  # (held by the supervisor: no file)
    return Checkpoint(
        MemoryKind.MAPPED, paused, sizes, [], machine_record(spec), chain, consistency, freeze_s, phase.times, mfd
    )


async def _until(m: Machine, status: str, helper: Machine) -> dict[str, Any]:
    """Poll the parent's migration until it reaches ``status``; a copy that has not
    converged after LIVE_CONVERGE gets the longer downtime limit."""
    t0 = time.monotonic()
    raised = False
    while True:
        info = await m.migration()
        st = info.get("status")
        if st == status:
            return info
        if st in ("failed", "cancelled", "none", None):
            said = f"; its helper: {helper.describe_exit()}" if helper.exited else ""
            raise CheckpointError(f"the fork's live copy {st}: {info.get('error-desc', '')}{said}")
        if not raised and st == "active" and time.monotonic() - t0 > LIVE_CONVERGE:
            raised = True
            log.info("%s: the live copy has not converged in %g s: downtime limit raised", m.name, LIVE_CONVERGE)
            await m.qmp_execute("migrate-set-parameters", {"downtime-limit": LIVE_DOWNTIME_FALLBACK_MS})
        await trio.sleep(LIVE_POLL)
