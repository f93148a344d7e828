"""A streamed snapshot made mapped: a helper QEMU loads its stream into a RAM file and
saves the device state alone.

A checkpoint of a guest whose RAM is mapped privately (a restore of a mapped snapshot:
every default Create, which restores its boot template) streams the RAM into the
vmstate, and every restore of that snapshot reads it all back into a RAM file of its
own: slow (the whole stream) and heavy (the whole RAM resident in each clone). The
snapshot store's converter task (:class:`~actors.snapshots.snapshot.SnapshotStore`) runs
:func:`convert_streamed` on each such snapshot once, then switches its record::

    supervisor                                         helper QEMU (its own cell, -S)
    memfd: guest RAM (size sealed), the helper's
    overlay on the snapshot's disk (its block device)
    spawn, nice 10 -------------------------------->  -incoming defer, RAM = memfd, shared
    migrate-incoming fd:  <- vmstate (streamed) --->  RAM into the memfd, devices; paused:
                                                      the guest never runs here
    migrate fd: pipe, x-ignore-shared ------------->  device state only (the RAM is shared)
      <- read, at most MAX_DEVICE_STATE --> vmstate-mapped.part
    cp --sparse=always memfd -> memory.part            (paused) zero pages become holes
    quit, reaped
    fsync both, rename (memory, vmstate-mapped), fsync the dir
    cell closed, run dir removed, memfd closed

The stream was written by a QEMU whose guest is hostile (and QEMU is assumed
escapable): the helper that parses it is jailed exactly as a restore's QEMU is (its
own uid, namespaces, cgroup, seccomp; only descriptors of ours), its RAM is a memfd
whose size it cannot change, and what it writes back comes through a pipe we cap.
Its outputs are no more trusted than its input was: restores parse them in their
own jails, as they parsed the stream.

Everything here has one owner, this function: cancelled or failed, it reaps the
helper and removes its cell, run dir and files (shielded) before it returns. A
supervisor killed mid-way leaves a helper QEMU under the run root, its run dir and
cgroup (the registry's recovery kills and removes what no record names) and ``.part``
files (the collector removes them); the next start converts again.

Measured (TCG, 256 MiB guest, 2 busy cores): see docs/results/snapshots.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from pathlib import Path

import attrs
import trio

from actors.cells.cell import Cell
from actors.crash import crash_point
from actors.machines.disk import create_overlay
from actors.machines.machine import Machine, Placement
from actors.machines.qemuproc import LaunchError, MachineError, QemuUser
from actors.sandboxes.savedstate import allocated, helper_net, resume_spec, save_device_state, stat_key
from actors.settings import Settings
from actors.snapshots.snapshot import PART, Converted, Hold
from actors.store import SnapshotRecord

log = logging.getLogger("sandvisor.convert")

MAPPED_STATE = "vmstate-mapped"  # the device state of a converted snapshot
CONVERT_TIMEOUT = 300.0  # s: a helper that takes longer is killed (the snapshot stays streamed)
HELPER_NICE = 10  # conversions yield the cores to real work


class ConvertError(MachineError):
    """The helper failed, or wrote what a device state cannot be."""


def _ram_memfd(size: int, owner: tuple[int, int] | None) -> int:
    """The helper's guest RAM: a memfd of ``size`` bytes that nobody can grow or shrink,
    readable and writable by the helper's uid alone (it reopens /proc/self/fd/N)."""
    fd = os.memfd_create("sandvisor-convert", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def convert_streamed(rec: SnapshotRecord, hold: Hold, settings: Settings) -> Converted:
    """Write ``memory`` and a device-only stream into ``rec``'s dir (see the module's
    diagram); the record is the caller's to switch. ``hold`` is awaited at the last
    step, where the crash point ``convert`` is (the helper paused, both files written). Raises :class:`MachineError`
    (the helper failed), :class:`~actors.cells.identities.JailError` or ``OSError``."""
    snap_dir = rec.path
    mem_part, state_part = snap_dir / f"memory{PART}", snap_dir / f"{MAPPED_STATE}{PART}"
    run_dir = settings.run_root / f"cv-{rec.uid}"
    size = rec.machine.memory_mib << 20
    cell: Cell | None = None
    mfd = -1
    try:
        for p in (mem_part, state_part):
            p.unlink(missing_ok=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        disk = run_dir / "disk.qcow2"  # the virtio-blk device's node; nothing writes it
        await create_overlay(rec.disk, disk)
        cells = settings.cells
        if cells is not None:
            cell = cells.open(f"cv-{rec.uid}", run_dir, memory_mib=rec.machine.memory_mib, vcpus=rec.machine.cpus)
            owner: tuple[int, int] | None = (cell.identity.uid, cell.identity.gid)
        else:
            user = settings.qemu_user
            owner = (user.uid, user.gid) if user is not None else None
        mfd = _ram_memfd(size, owner)
        vm = resume_spec(
            rec,
            settings,
            disk=disk,
            chain=rec.layers,
            ram=None,
            ram_shared=True,
            network=helper_net(rec.config),
            name=f"convert-{rec.id}",
        )
        spec = attrs.evolve(vm.machine, extra_args=("-S",))  # never runs the guest
        placement = (
            Placement(sock_dir=cell.sock_dir, qemu_dir=cell.qemu_dir, log=run_dir / "qemu.log", spawn=cell.spawn)
            if cell is not None
            else Placement.plain(run_dir)
        )
        helper = Machine(spec, placement, name=vm.name, fds={"ram": mfd}, on_spawned=_nice)
        with trio.move_on_after(CONVERT_TIMEOUT) as deadline:
            await _run_helper(helper, rec, state_part, mem_part, mfd, hold)
        if deadline.cancelled_caught:
            raise ConvertError(f"the helper did not finish within {CONVERT_TIMEOUT:g}s")
        if os.fstat(mfd).st_size != size:  # (sealed: cannot happen)
            raise ConvertError("the helper's RAM changed size")
        user = settings.qemu_user if settings.cells is None else None
        return await trio.to_thread.run_sync(_finish, snap_dir, mem_part, state_part, user)
    except BaseException:
        with contextlib.suppress(OSError):
            mem_part.unlink(missing_ok=True)
            state_part.unlink(missing_ok=True)
        raise
    finally:
        if mfd >= 0:
            os.close(mfd)
        if cell is not None:
            cell.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _nice(pid: int, _started: int) -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, HELPER_NICE)


async def _run_helper(m: Machine, rec: SnapshotRecord, state_part: Path, mem_part: Path, mfd: int, hold: Hold) -> None:
    """Start the helper, load the stream, save the device state through a pipe, copy
    the RAM out; the helper is quit and reaped however this ends."""
    async with trio.open_nursery() as nursery:
        await nursery.start(m.run)
        try:
            try:
                vm_in = os.open(rec.path / rec.vmstate, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise LaunchError(f"cannot open the stream {rec.vmstate}: {exc.strerror}") from None
            try:
                await m.migrate_from_fd(vm_in, ignore_shared=False, resume=False)
            finally:
                os.close(vm_in)
            await save_device_state(m, state_part)
            # zero pages the stream named as such were read by QEMU (a memfd allocates on
            # a read fault): cp makes them holes again. The helper is paused meanwhile.
            p = await trio.run_process(
                ["nice", "-n", str(HELPER_NICE), "cp", "--sparse=always", f"/proc/self/fd/{mfd}", str(mem_part)],
                pass_fds=(mfd,),
                capture_stderr=True,
                check=False,
            )
            if p.returncode != 0:
                raise OSError(f"copying the converted memory failed: {p.stderr.decode(errors='replace')[:200]}")
            crash_point("convert")
            await hold()
        finally:
            await m.shutdown()
            nursery.cancel_scope.cancel()


def _finish(snap_dir: Path, mem_part: Path, state_part: Path, user: QemuUser | None) -> Converted:
    for p in (mem_part, state_part):
        _fsync(p)
    os.chmod(mem_part, 0o600)
    if user is not None:
        # restores open the file by path as this user (see snapshot._finish)
        os.chown(mem_part, user.uid, user.gid)
    memory, state = snap_dir / "memory", snap_dir / MAPPED_STATE
    os.replace(mem_part, memory)
    os.replace(state_part, state)
    _fsync(snap_dir, os.O_RDONLY | os.O_DIRECTORY)
    return Converted(
        vmstate=MAPPED_STATE,
        sizes={"vmstate": allocated(state), "memory": allocated(memory)},
        memory_stat=stat_key(memory),
    )
