"""A running guest saved to a directory (a checkpoint), and the machine a saved state
loads into (a restore, a conversion's helper). The sequence, and what a snapshot
directory holds: :mod:`actors.snapshots.snapshot`; one sandbox's guarded checkpoints:
:mod:`actors.sandboxes.checkpoint`; the snapshot store above both records them."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

from actors import defaults
from actors.cells import guestmem
from actors.channel.guest import GuestError
from actors.durable import fsync_dir
from actors.errors import FailedPrecondition
from actors.machines.machine import Machine
from actors.machines.qemuproc import MachineError, QemuUser, unsearchable_parent
from actors.machines.qemuspec import MachineSpec
from actors.machines.vm import Guest, NetConfig, VmSpec
from actors.model import MemoryKind, NetMode, SandboxConfig
from actors.sandboxes.files import SandboxFiles
from actors.settings import Settings
from actors.store import MachineRecord, SnapshotRecord

log = logging.getLogger("sandvisor.snapshot")

# freezing the guest's file systems for a capture (guestd/freeze.py)
FREEZE_ANSWER = 5.0  # s: a freeze not answered by then is abandoned (the capture is crash-consistent)
FREEZE_HOLD = 30.0  # s of guest time after which guestd thaws on its own (a host gone meanwhile)
THAW_ANSWER = 5.0  # s: the host's thaw after the capture (guestd's own timeout is the net)


class CheckpointError(MachineError):
    """QEMU refused a step of the checkpoint; the guest runs on."""


MAX_DEVICE_STATE = 64 << 20  # bytes: a microVM's device state is ~0.1 MiB; more is an attack


class DeviceStateTooLarge(MachineError):
    """A helper QEMU wrote more device state than :data:`MAX_DEVICE_STATE`."""


async def save_device_state(m: Machine, out: Path, limit: int = MAX_DEVICE_STATE) -> None:
    """A paused helper's device state alone (its RAM a shared file: ``x-ignore-shared``)
    saved into ``out`` (created; at most ``limit`` bytes) through a pipe: the helper (a
    conversion's, a fork's live copy's) writes what the stream it loaded made it, and is
    no more trusted than that stream's guest."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        async with trio.open_nursery() as io:
            io.start_soon(_drain, r, out, limit)
            r = -1  # (the drain owns it)
            await m.migrate_to_fd(w, ignore_shared=True)
            os.close(w)  # QEMU closes its copy when the migration is cleaned up, or as it quits
            w = -1
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


async def _drain(read_fd: int, out: Path, limit: int) -> None:
    """Copy a helper's device state from the pipe to ``out``, at most ``limit`` bytes."""
    stream = trio.lowlevel.FdStream(read_fd)
    total = 0
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        async with stream:
            while data := await stream.receive_some(1 << 16):
                total += len(data)
                if total > limit:
                    raise DeviceStateTooLarge(f"the helper wrote more than {limit >> 20} MiB of device state")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


@attrs.frozen
class Checkpoint:
    """What a checkpoint wrote: how RAM is held, how long the guest was paused, sizes."""

    memory: MemoryKind
    paused_s: float
    sizes: dict[str, int]
    memory_stat: list[int]
    machine: MachineRecord  # what a restore must start QEMU with
    chain: tuple[str, ...] = ()  # the layers below the frozen disk, top first
    # how the disk was captured: "frozen" (its file systems frozen: clean), "crash-consistent
    # (why)" (a freeze that failed or did not answer), "" (freezing off, or an older guest)
    consistency: str = ""
    freeze_s: float = 0.0  # the freeze's round trip (the guest's sync and FIFREEZE)
    # seconds each step took, in order ("stage", "freeze", "stop", "disk", "state", "memory", "cont",
    # "write", "finish"): the pause is stop..cont
    phases: dict[str, float] = attrs.field(factory=dict)
    # the saved memory as a sealed memfd (``keep_memory``): the caller's to close or hand
    # on (the sealed cache: restores of the snapshot need not fill it from the file); -1: none
    memfd: int = -1


def allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def stat_key(path: Path) -> list[int]:
    """Size and mtime: a write changes them. (Not ctime: the hard link a restore may
    make changes it.)"""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


class Phases:
    """A capture's steps, timed: ``phase(name)`` ends the step begun at the last call
    (or at its making); ``times`` is what each took (s), in order."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._mark = time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.times[name] = now - self._mark
        self._mark = now


async def checkpoint_guest(
    guest: Guest,
    *,
    files: SandboxFiles,
    snap_dir: Path,
    user: QemuUser | None,
    chain: tuple[str, ...] = (),
    on_frozen: Callable[[Path], None] | None = None,
    stay_paused: bool = False,
    freeze: bool = False,
    keep_memory: bool = False,
    memory_file: bool = True,
) -> Checkpoint:
    """Save a running guest into ``snap_dir`` (which exists and is empty) and let it run
    on. Its disk (``files.disk``) is frozen into ``snap_dir/disk.qcow2`` and the guest
    goes on writing a new overlay at the same path, on top of the frozen one.

    Until the freeze, a failure undoes everything here (the staged overlay, its fd set
    and block node); after it, the guest runs on the new overlay and ``snap_dir`` holds
    the disk it stands on (the caller's collector keeps it while used): ``on_frozen``
    is told at once, so the sandbox's recorded chain is never behind its disk.
    ``chain``: the layers below the current disk (they become the frozen disk's).
    ``stay_paused``: the guest stays stopped after a checkpoint that succeeded (a pause
    ends its QEMU next: nothing runs past the saved state); a failure lets it run.
    ``freeze``: the guest's writable file systems are frozen (:func:`freeze_guest`) right
    before it is stopped and thawed once it runs again -- except after a pause that
    succeeded: its saved memory holds them frozen, and guestd thaws them at the hello
    of whatever resumes or restores it (guestd/freeze.py).

    Mapped RAM is copied, while the guest is stopped, into a memfd (memory to memory,
    its data extents only, two copies side by side: :func:`copy_ram`; the memfd's pages
    allocated before the stop, while the guest runs: :func:`guestmem.preallocate`), which is sealed
    and written to ``snap_dir/memory`` after the guest runs again (thawed); a guest that
    stays stopped (``stay_paused``) has its RAM written to that file directly.
    ``keep_memory``: the sealed memfd is returned too (``Checkpoint.memfd``, the
    caller's: the sealed cache, so that restores need not fill it from the file).
    ``memory_file`` False (with ``keep_memory``: a fork's hidden snapshot, restored only
    by its children, in this supervisor's life): no file, and the record's
    ``memory_stat`` is empty."""
    m = guest.machine
    spec = m.spec
    mapped = spec.memory_file is not None and spec.memory_shared
    frozen = snap_dir / "disk.qcow2"
    frozen_done = False
    staged = None
    vm_fd = mem_fd = -1
    consistency, freeze_s, thaw = "", 0.0, False
    phase = Phases()

    direct = mapped and stay_paused and not keep_memory  # (stopped anyway: straight to the file)
    try:
        staged = await m.stage_disk(await files.stage_next_disk(frozen))
        vm_fd = os.open(snap_dir / "vmstate", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        await m.prepare_migration(vm_fd, ignore_shared=mapped)  # (its QMP round trips before the pause)
        if mapped and not direct:
            assert spec.memory_file is not None
            ram_fd = os.open(spec.memory_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                mem_fd = guestmem.new_memfd(os.fstat(ram_fd).st_size)
                # its pages allocated while the guest runs: the pause only copies into them
                await trio.to_thread.run_sync(guestmem.preallocate, ram_fd, mem_fd)
            finally:
                os.close(ram_fd)
        phase("stage")
        if freeze:
            consistency, freeze_s, thaw = await freeze_guest(guest)
            phase("freeze")
        async with _stopped(m, stay_paused) as t0:
            phase("stop")
            try:
                await m.switch_disk(staged)
            finally:
                # QEMU writes the staged overlay from here, even when the switch raised
                # (its answer lost to a cancel or a timeout: Machine.switch_disk asked
                # QEMU): its file takes the disk's name before the guest runs on it --
                # the undo below would unlink a file the guest writes
                if m.disk_top == staged.node:
                    await swap_names(m, files, frozen)
                    frozen_done = True
                    if on_frozen is not None:
                        on_frozen(frozen)
            phase("disk")
            await m.migrate_prepared()
            phase("state")
            if mapped:
                assert spec.memory_file is not None
                if direct:
                    await trio.to_thread.run_sync(_write_memory_from, spec.memory_file, snap_dir / "memory")
                else:
                    await copy_ram(spec.memory_file, mem_fd)
                phase("memory")
        paused = time.monotonic() - t0
        phase("cont")
        if stay_paused:
            thaw = False  # (its QEMU ends frozen: what resumes it thaws at its hello)
    except BaseException:
        if not frozen_done:
            if staged is not None:
                await m.unstage_disk(staged)
            files.discard_next_disk()
            with trio.CancelScope(shield=True), contextlib.suppress(MachineError):
                await m.qmp_execute("closefd", {"fdname": "snapfd"})  # (given ahead, never used)
        if mem_fd >= 0:
            os.close(mem_fd)
        raise
    finally:
        if vm_fd >= 0:
            os.close(vm_fd)
        if thaw:
            with trio.CancelScope(shield=True):
                await thaw_guest(guest)
    on_file = mapped and (memory_file or not keep_memory)
    try:
        if on_file and not direct:  # (the guest runs, its file systems thawed)
            await trio.to_thread.run_sync(_write_memory, mem_fd, snap_dir / "memory")
            phase("write")
        files_written = ["vmstate", "disk.qcow2", *(["memory"] if on_file else [])]
        await trio.to_thread.run_sync(finish_files, snap_dir, files_written, user, spec.kernel, spec.initrd)
        phase("finish")
        sizes = {f: allocated(snap_dir / f) for f in files_written}
        if mapped and not on_file:
            sizes["memory"] = os.fstat(mem_fd).st_blocks * 512  # (held by the supervisor: no file)
    except BaseException:
        if mem_fd >= 0:
            os.close(mem_fd)
        raise
    if mem_fd >= 0 and not keep_memory:
        os.close(mem_fd)
        mem_fd = -1
    mem_stat = stat_key(snap_dir / "memory") if on_file else []
    kind = MemoryKind.MAPPED if mapped else MemoryKind.STREAMED
    return Checkpoint(
        kind, paused, sizes, mem_stat, machine_record(spec), chain, consistency, freeze_s, phase.times, mem_fd
    )


def machine_record(spec: MachineSpec) -> MachineRecord:
    """What a restore of a checkpoint of a guest of ``spec`` must start QEMU with."""
    return MachineRecord(
        append=spec.append,
        memory_mib=spec.memory_mib,
        cpus=spec.cpus,
        accel=spec.accel,
        machine=spec.machine,
        balloon=spec.balloon,
    )


async def swap_names(m: Machine, files: SandboxFiles, frozen: Path) -> None:
    """The disk's names after QEMU switched to the staged overlay (the guest is
    paused: nobody sees them change). If they cannot move, QEMU is killed before the
    guest runs again: it would write a file without the disk's name, which the undo
    removes (the disk, as it was, holds everything the guest wrote)."""
    try:
        files.swap_disks(frozen)
    except OSError as exc:
        with trio.CancelScope(shield=True):
            log.warning("%s: the disk swap failed after QEMU switched (%s): killed", m.name, exc)
            await m.kill()
        raise


RAM_COPIES = 2  # copies side by side of the guest's RAM while it is stopped


async def copy_ram(ram: Path, memfd: int) -> None:
    """The RAM file's data into ``memfd`` (same offsets; holes stay holes), then sealed:
    RAM_COPIES worker threads (the event loop runs on meanwhile)."""
    src = os.open(ram, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        parts = guestmem.split_extents(await trio.to_thread.run_sync(guestmem.data_extents, src), RAM_COPIES)
        async with trio.open_nursery() as n:
            for part in parts:
                n.start_soon(trio.to_thread.run_sync, guestmem.copy_extents, src, memfd, part)
    except guestmem.MemoryFileError as exc:
        raise CheckpointError(f"copying guest memory failed: {exc}") from None
    finally:
        os.close(src)
    guestmem.seal(memfd)


def _write_memory_from(ram: Path, path: Path) -> None:
    src = os.open(ram, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _write_memory(src, path)
    finally:
        os.close(src)


def _write_memory(memfd: int, path: Path) -> None:
    """The saved memory's file (sparse: the data extents of ``memfd``: the sealed memfd,
    or the RAM file of a stopped guest). Fails with OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, os.fstat(memfd).st_size)
        guestmem.copy_extents(memfd, fd, guestmem.data_extents(memfd))
    except guestmem.MemoryFileError as exc:
        raise OSError(f"writing the saved memory: {exc}") from None
    finally:
        os.close(fd)


async def freeze_guest(guest: Guest) -> tuple[str, float, bool]:
    """Freeze the running guest's writable file systems for a capture: (the capture's
    consistency, the freeze's seconds, whether a thaw is owed). A guest runtime without
    the request is not asked (""); a freeze that fails or does not answer within
    FREEZE_ANSWER is abandoned -- what it froze is thawed after -- and the capture goes
    on crash-consistent, saying why."""
    chan = guest.channel
    if not chan.has_feature("freeze"):
        return "", 0.0, False
    t0 = time.monotonic()
    with trio.move_on_after(FREEZE_ANSWER):
        try:
            n = await chan.freeze(FREEZE_HOLD)
        except GuestError as exc:
            log.warning("%s: freezing its file systems: %s", guest.machine.name, exc)
            return f"crash-consistent (the freeze failed: {exc})", time.monotonic() - t0, True
        return "frozen", time.monotonic() - t0, n > 0
    log.warning("%s: the freeze did not answer in %g s: a crash-consistent capture", guest.machine.name, FREEZE_ANSWER)
    return f"crash-consistent (the freeze did not answer in {FREEZE_ANSWER:g} s)", time.monotonic() - t0, True


async def thaw_guest(guest: Guest) -> None:
    """Thaw what :func:`freeze_guest` froze (bounded; guestd's own timeout thaws a
    guest that does not answer). Never raises."""
    if guest.machine.exited or not guest.channel.has_feature("freeze"):
        return
    with trio.move_on_after(THAW_ANSWER) as scope:
        try:
            await guest.channel.thaw()
        except GuestError as exc:
            log.warning("%s: thawing its file systems: %s", guest.machine.name, exc)
    if scope.cancelled_caught:
        log.warning("%s: the thaw did not answer in %g s (guestd thaws on its own)", guest.machine.name, THAW_ANSWER)


@asynccontextmanager
async def _stopped(m: Machine, stay: bool) -> AsyncIterator[float]:
    """The guest stopped for the block (``Machine.paused``); ``stay``: it runs again only
    if the block fails."""
    if not stay:
        async with m.paused() as t0:
            yield t0
        return
    await m.qmp_execute("stop")
    t0 = time.monotonic()
    try:
        yield t0
    except BaseException:
        with trio.CancelScope(shield=True):
            try:
                await m.qmp_execute("cont")
            except MachineError as exc:
                log.warning("%s: cont after a failed pause: %s", m.name, exc)
        raise


async def still_running(guest: Guest) -> bool:
    """After a failed checkpoint: is the guest running again (not left paused)?"""
    if guest.machine.exited:
        return False
    try:
        if await guest.machine.status() == "running":
            return True
        await guest.machine.qmp_execute("cont")
        return await guest.machine.status() == "running"
    except MachineError:
        return False


def finish_files(snap_dir: Path, files: list[str], user: QemuUser | None, kernel: Path, initrd: Path) -> None:
    for name in files:
        fd = os.open(snap_dir / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if user is not None and (snap_dir / "memory").exists():
        # QEMU 7.2 maps a read-only file read-only (guest RAM must be writable), so
        # the restores' QEMU user opens it read-write; it maps it MAP_PRIVATE and never
        # writes it, and the recorded (size, mtime) catches a file written since
        os.chown(snap_dir / "memory", user.uid, user.gid)
    for src, name in ((kernel, "kernel"), (initrd, "initrd")):
        try:
            os.link(src, snap_dir / name)
        except OSError:
            shutil.copy2(src, snap_dir / name)
            os.chmod(snap_dir / name, 0o644)  # a jailed QEMU opens it itself (-kernel /proc/self/fd/N)
    fsync_dir(snap_dir)  # its names, and the directory's own name, before the record names it
    fsync_dir(snap_dir.parent)


def memory_for_restore(snap_dir: Path, run_dir: Path, user: QemuUser | None) -> Path:
    """The snapshot's RAM file as a path QEMU's user can open: the file itself when
    its directory is reachable, else a hard link in the run dir (removed with it)."""
    mem = snap_dir / "memory"
    if user is None or unsearchable_parent(mem) is None:
        return mem
    link = run_dir / "memory"
    try:
        link.unlink(missing_ok=True)
        os.link(mem, link)
    except OSError as exc:
        raise FailedPrecondition(
            f"QEMU's user {user.name!r} cannot reach {mem} (a parent is not o+x) and it cannot be "
            f"linked into {run_dir}: {exc.strerror}; make the state directory's parents searchable"
        ) from None
    return link


def helper_net(config: SandboxConfig) -> NetConfig | None:
    """The network device a conversion's helper gives a stream of a guest of
    ``config``: the same device, on a backend whose saved state matches the origin's
    (slirp's state for user mode; none for a tap, whose backend saves none). The
    helper never runs the guest: no packet moves."""
    mode = config.network.mode
    if mode == NetMode.USER:
        return NetConfig(restrict=True)
    if mode == NetMode.TAP:
        return NetConfig(detached=True)
    return None


def resume_spec(
    snap: SnapshotRecord,
    settings: Settings,
    *,
    disk: Path,
    chain: tuple[Path, ...],
    ram: Path | None,
    ram_shared: bool,
    network: NetConfig | None,
    name: str = "vm",
    boot_timeout: float = defaults.BOOT_TIMEOUT,
    answer_timeout: float | None = None,
    preload: Path | None = None,
) -> VmSpec:
    """The machine a saved state of ``snap`` loads into: its kernel, initrd and command
    line, its vCPUs and memory, the devices of its configuration (its balloon too).
    Restores and the converter's helper both start from it, so their devices match the
    stream's. ``preload``: the discard shim, for a balloon on privately mapped RAM."""
    return VmSpec.of(
        kernel=snap.path / "kernel",
        initrd=snap.path / "initrd",
        append=snap.machine.append,
        disk=disk,
        chain=chain,
        cpus=snap.machine.cpus,
        memory_mib=snap.machine.memory_mib,
        accel=settings.accel,
        machine=snap.machine.machine,
        user=None if settings.cells is not None else settings.qemu_user,
        network=network,
        ram=ram,
        ram_shared=ram_shared,
        restore=snap.path / snap.vmstate,
        boot_timeout=boot_timeout,
        answer_timeout=answer_timeout,
        name=name,
        balloon=snap.machine.balloon,
        preload=preload,
        tb_size_mib=settings.tb_size_mib,
    )
