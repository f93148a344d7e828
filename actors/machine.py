"""One QEMU process: argv, launch, QMP, console, and the shutdown ladder.

Modelled on QEMU's ``python/qemu/machine/machine.py``: QMP over an inherited
socketpair (no path to race on or leave behind), a runstate guard on every
operation, and a shutdown that always ends with the process reaped.

Runstates::

    NEW --launch()--> RUNNING --(process exits)--> EXITED
                        |                            ^
                        +--shutdown(): ask -> quit -> SIGTERM -> SIGKILL -> wait

Error tree::

    MachineError
     +-- LaunchError        QEMU did not start (bad argv, missing file, QMP handshake failed)
     +-- MachineStateError  an operation in the wrong runstate (e.g. QMP after exit)
     +-- QMPCommandError    QEMU refused a QMP command (message from QEMU)

QMP runs through ``qemu.qmp`` on asyncio, bridged into Trio by trio-asyncio: the
caller must be inside :func:`qmp_loop` (the supervisor and the tests open it once).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import grp
import logging
import os
import pwd
import shlex
import signal
import socket
import stat
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio
import trio_asyncio
from qemu.qmp import ExecuteError as _QMPExecuteError
from qemu.qmp import QMPClient

from actors._groups import collapse_single
from actors.crash import crash_point

log = logging.getLogger("sandvisor.machine")

GUEST_PORT_NAME = "sandvisor.0"
CONSOLE_RING = 64 * 1024


class MachineError(Exception):
    """Base of the errors of one QEMU process."""


class LaunchError(MachineError):
    """QEMU did not come up."""


class MachineStateError(MachineError):
    """The operation does not fit the machine's runstate."""


class QMPCommandError(MachineError):
    """QEMU answered a QMP command with an error."""


class Runstate(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    EXITED = "exited"


def kvm_usable() -> bool:
    """True where /dev/kvm is a real hardware KVM. Nested PVM (``kvm_pvm``) hangs a stock
    kernel, so ``--accel auto`` must not pick it."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    if Path("/sys/module/kvm_pvm").exists():
        return False
    return bool(Path("/sys/module/kvm_intel").exists() or Path("/sys/module/kvm_amd").exists())


def resolve_accel(accel: str) -> str:
    if accel == "auto":
        return "kvm" if kvm_usable() else "tcg"
    if accel not in ("kvm", "tcg"):
        raise ValueError(f"accel must be auto, kvm or tcg, not {accel!r}")
    return accel


# virtio-mmio transports of QEMU's microvm machine (7.2, ioapic2 on: its default; 8 with
# ioapic2=off). Counted with `info qtree`. Every virtio device takes one: the channel's
# virtio-serial, the root disk, each volume, a NIC, the balloon. Beyond them QEMU
# fails to start ("No 'virtio-bus' bus found"): MachineSpec refuses first, saying why.
MICROVM_VIRTIO_SLOTS = 24
VOLUME_FDSET = 1 << 20  # fd set of volume i: VOLUME_FDSET + i (apart from disk, layers, staged overlays)


@attrs.frozen
class Volume:
    """An extra disk: a raw image file (ext4, see :mod:`actors.volumes`) attached as
    virtio-blk after the root disk, in the order of ``MachineSpec.volumes`` (/dev/vdb,
    /dev/vdc, ... on a fresh boot). The guest finds it by ``serial`` whatever its name
    (guestd's ``mount`` takes ``serial:NAME``): up to 20 bytes, default ``vol<i>``."""

    path: Path
    read_only: bool = False
    serial: str = ""

    def __attrs_post_init__(self) -> None:
        if len(self.serial) > 20 or not all(c.isalnum() or c in "._-" for c in self.serial):
            raise ValueError(f"volume serial {self.serial!r}: at most 20 of [A-Za-z0-9._-]")


class TooManyDevices(LaunchError):
    """More virtio devices than the machine has slots for."""


@attrs.frozen
class MachineSpec:
    """Everything that decides QEMU's command line."""

    kernel: Path
    initrd: Path
    disk: Path | None = None  # the sandbox's qcow2 overlay (becomes /dev/vda)
    disk_format: str = "qcow2"
    cpus: int = 1
    memory_mib: int = 256
    append: str = ""  # kernel command line (the caller builds it)
    accel: str = "tcg"  # resolved: kvm or tcg
    # TCG's translation cache, MiB; None leaves QEMU's default (1 GiB, which a busy
    # guest's QEMU fills: 1.38 GB RSS after 3 minutes of a shell loop). Measured, six
    # 256 MiB guests running one shell/python/coreutils loop side by side for 180 s:
    #   tb-size   16    32    64   128   256  1024
    #   loops     12    44    58    66    65    62
    #   RSS MiB  228   247   282   355   502  1382
    # and exec of `true` 56.8 / 42.1 / 37.6 / 35.4 ms at 32 / 64 / 128 / 1024 (four
    # guests interleaved). 64 keeps a busy guest's QEMU within its RAM + 128 MiB at
    # ~10% of the loop's throughput (16 and 32 thrash). Ignored under KVM.
    tb_size_mib: int | None = 64
    machine: str = "microvm"  # "pc" only for benchmarks
    extra_ports: tuple[str, ...] = ()  # more virtserialports, by name, each on a socket in run_dir
    # a virtio-balloon with free page reporting: memory the guest frees goes back to the
    # host within seconds (the guest reports free 2 MiB+ blocks; QEMU discards them:
    # MADV_DONTNEED on anonymous RAM, a hole punched in the machine's own shared RAM
    # file). Measured: a guest that allocates and frees 150 MiB gives ~135 MiB back
    # within 3 s. QEMU 7.2 punches the hole in the *file* even when it maps it
    # privately: a restore that maps a snapshot's memory must map a sealed memfd
    # (the kernel refuses the punch) with ``preload`` = the discard shim (which lets
    # QEMU go on to its madvise: actors/ram_discard.c); an unsealed private file would
    # have the snapshot's pages zeroed under every clone. Part of the machine: a
    # snapshot restores only with the same setting (MachineRecord.balloon).
    balloon: bool = False
    # a shared object QEMU's dynamic loader preloads (LD_PRELOAD, passed by descriptor):
    # the discard shim, for a balloon on privately mapped RAM
    preload: Path | None = None
    netdev: tuple[str, ...] = ()  # -netdev/-device pairs, prepared by the network layer
    sandbox: bool = True  # QEMU's seccomp sandbox
    user: QemuUser | None = None  # start QEMU as this user (when the supervisor is root)
    # the overlay's read-only backing layers, top first (a snapshot's disk, ..., the base
    # rootfs), opened by us and passed by fd
    disk_chain: tuple[Path, ...] = ()
    # guest RAM: None = anonymous memory; else a file mapped shared (``memory_shared``:
    # a checkpoint copies it, see actors/snapshot.py) or private (a restore maps the
    # snapshot's memory copy-on-write and never writes the file)
    memory_file: Path | None = None
    memory_shared: bool = True
    incoming: bool = False  # start with -incoming defer: a restore feeds migrate-incoming
    qemu: str = "qemu-system-x86_64"
    extra_args: tuple[str, ...] = ()
    # extra disks after the root disk. A snapshot restores only onto the same devices:
    # a restore gets as many volumes as the machine it was taken from had.
    volumes: tuple[Volume, ...] = ()

    def volume_serial(self, i: int) -> str:
        return self.volumes[i].serial or f"vol{i}"

    def virtio_devices(self) -> int:
        """How many virtio-mmio slots this machine takes (see MICROVM_VIRTIO_SLOTS)."""
        nics = sum(1 for x in self.netdev if "{net}" in x)
        return (
            1  # virtio-serial: the guest channel and every extra port
            + (self.disk is not None)
            + len(self.volumes)
            + self.balloon
            + nics
        )

    def max_volumes(self) -> int:
        """How many volumes this machine could have, its other devices being what they are."""
        return MICROVM_VIRTIO_SLOTS - (self.virtio_devices() - len(self.volumes))

    def check_devices(self) -> None:
        """TooManyDevices when the microvm machine has no slot for every device."""
        if self.machine != "microvm":
            return
        n = self.virtio_devices()
        if n > MICROVM_VIRTIO_SLOTS:
            raise TooManyDevices(
                f"{len(self.volumes)} volumes need {n} virtio devices in all; the microvm machine has "
                f"{MICROVM_VIRTIO_SLOTS} slots: at most {self.max_volumes()} volumes beside the other devices"
            )

    def argv(self, sock_dir: Path, fds: dict[str, int] | None = None) -> list[str]:
        """QEMU's command line. ``sock_dir``: where QEMU makes its listening sockets
        (QMP, console, guest channel) as QEMU sees it (in a jail: the jail's socket
        dir). With ``fds`` (kernel, initrd, disk, backing layers, RAM: descriptors the
        supervisor opened), QEMU opens no file of ours by path: it needs no access to
        the state directory, only to its socket dir. QMP and the console listen on
        sockets, not inherited pipes: they outlive the supervisor, so the next one can
        reconnect (fd passing works over the QMP socket too)."""
        fds = fds or {}
        self.check_devices()
        accel = self.accel
        if self.machine == "microvm":
            # the defaults are the fast path: rtc=off alone costs ~2 s of boot under TCG
            # (measured: the kernel falls back to slow timer calibration without the RTC)
            mach = "microvm,memory-backend=mem0"
            blk, ser, net = "virtio-blk-device", "virtio-serial-device", "virtio-net-device"
        else:
            mach = f"{self.machine},memory-backend=mem0"
            blk, ser, net = "virtio-blk-pci", "virtio-serial-pci", "virtio-net-pci"
        # -accel, not -M accel=: only -accel takes the accelerator's own properties
        accel_opts = accel
        if accel == "tcg" and self.tb_size_mib is not None:
            accel_opts += f",tb-size={self.tb_size_mib}"
        cpu = "host" if accel == "kvm" else "max"
        a = [
            self.qemu,
            "-M",
            mach,
            "-accel",
            accel_opts,
            "-cpu",
            cpu,
            "-smp",
            str(self.cpus),
            "-m",
            f"{self.memory_mib}M",
            "-object",
            self._memory_object(fds.get("ram")),
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-no-reboot",
            "-kernel",
            f"/proc/self/fd/{fds['kernel']}" if "kernel" in fds else str(self.kernel),
            "-initrd",
            f"/proc/self/fd/{fds['initrd']}" if "initrd" in fds else str(self.initrd),
            "-append",
            self.append,
            "-chardev",
            f"socket,id=con,path={sock_dir / 'console.sock'},server=on,wait=off",
            "-serial",
            "chardev:con",
            "-chardev",
            f"socket,id=qmp,path={sock_dir / 'qmp.sock'},server=on,wait=off",
            "-mon",
            "chardev=qmp,mode=control",
            "-device",
            ser,
            "-chardev",
            f"socket,id=guest,path={sock_dir / 'guest.sock'},server=on,wait=off",
            "-device",
            f"virtserialport,chardev=guest,name={GUEST_PORT_NAME}",
        ]
        for i, name in enumerate(self.extra_ports):
            a += [
                "-chardev",
                f"socket,id=port{i},path={sock_dir / f'port{i}.sock'},server=on,wait=off",
                "-device",
                f"virtserialport,chardev=port{i},name={name}",
            ]
        if self.disk is not None:
            # fd sets, not /proc/self/fd paths: a reopen through /proc checks the file's
            # permissions again, and the overlay is the supervisor's, not QEMU's user's.
            # The overlay's set holds a read-write and a read-only descriptor: QEMU picks
            # by access mode when a checkpoint reopens the layer read-only.
            disk_file = str(self.disk)
            if "disk" in fds:
                a += ["-add-fd", f"fd={fds['disk']},set=1,opaque=disk"]
                if "disk_ro" in fds:
                    a += ["-add-fd", f"fd={fds['disk_ro']},set=1,opaque=disk-ro"]
                disk_file = "/dev/fdset/1"
            # locking=off: QEMU's OFD locks conflict between the read-write and read-only
            # descriptions of one file in its own fd set when a checkpoint reopens a layer
            # read-only (measured: "Failed to get shared 'write' lock" on the second
            # checkpoint). Layers are ours: the supervisor decides who writes what.
            a += ["-blockdev", f"driver=file,filename={disk_file},node-name=disk0file,cache.direct=off,locking=off"]
            below = ""
            for i, layer in reversed(list(enumerate(self.disk_chain))):
                name = f"layer{i}"
                path = f"/dev/fdset/{10 + i}" if f"layer{i}" in fds else str(layer)
                if f"layer{i}" in fds:
                    a += ["-add-fd", f"fd={fds[f'layer{i}']},set={10 + i},opaque=layer{i}"]
                a += ["-blockdev", f"driver=file,filename={path},node-name={name}file,read-only=on,locking=off"]
                fmt = _image_format(layer)
                backing = f",backing={below}" if below else (",backing=null" if fmt == "qcow2" else "")
                a += ["-blockdev", f"driver={fmt},file={name}file,node-name={name},read-only=on{backing}"]
                below = name
            backing = f",backing={below}" if below else (",backing=null" if self.disk_format == "qcow2" else "")
            a += [
                "-blockdev",
                f"driver={self.disk_format},file=disk0file,node-name=disk0{backing}",
                "-device",
                # a full host disk is the guest's I/O error, not a VM that QEMU stops
                # (werror's default, enospc): the sandbox lives on and says so itself
                f"{blk},drive=disk0,werror=report,rerror=report",
            ]
        for i, vol in enumerate(self.volumes):
            # raw, by fd set like the disk; locking on (unlike the disk's layers, nothing
            # here reopens a volume): a second QEMU cannot open a volume another one
            # writes, nor write one another one reads ("Failed to get ... lock").
            path = str(vol.path)
            if f"vol{i}" in fds:
                a += ["-add-fd", f"fd={fds[f'vol{i}']},set={VOLUME_FDSET + i},opaque=vol{i}"]
                path = f"/dev/fdset/{VOLUME_FDSET + i}"
            ro = "on" if vol.read_only else "off"
            a += [
                "-blockdev",
                f"driver=file,filename={path},node-name=vol{i}file,read-only={ro},locking=on",
                "-blockdev",
                f"driver=raw,file=vol{i}file,node-name=vol{i},read-only={ro}",
                "-device",
                f"{blk},drive=vol{i},serial={self.volume_serial(i)}",
            ]
        if self.balloon:
            dev = "virtio-balloon-device" if self.machine == "microvm" else "virtio-balloon-pci"
            a += ["-device", f"{dev},free-page-reporting=on"]
        a += _netdev(self.netdev, net, fds)
        if self.incoming:
            a += ["-incoming", "defer"]
        if self.sandbox:
            a += ["-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]
        a += list(self.extra_args)
        return a

    def _memory_object(self, fd: int | None) -> str:
        size = f"size={self.memory_mib}M"
        if self.memory_file is None and fd is None:
            return f"memory-backend-ram,id=mem0,{size}"
        share = "on" if self.memory_shared else "off"
        path = f"/proc/self/fd/{fd}" if fd is not None else self.memory_file  # by descriptor: no path of ours
        return f"memory-backend-file,id=mem0,{size},mem-path={path},share={share}"

    def open_files(self) -> dict[str, int]:
        """Open what QEMU boots from, for :meth:`argv`'s ``fds`` (the caller closes them).
        Regular files only, never through a symlink (``O_NOFOLLOW``; ``O_NONBLOCK`` so a
        FIFO planted on a path cannot block us): a device or a FIFO is a LaunchError."""
        fds: dict[str, int] = {}
        try:
            fds["kernel"] = open_regular(self.kernel, os.O_RDONLY)
            fds["initrd"] = open_regular(self.initrd, os.O_RDONLY)
            if self.disk is not None:
                fds["disk"] = open_regular(self.disk, os.O_RDWR)
                fds["disk_ro"] = open_regular(self.disk, os.O_RDONLY)
                for i, layer in enumerate(self.disk_chain):
                    fds[f"layer{i}"] = open_regular(layer, os.O_RDONLY)
            if self.preload is not None:
                fds["preload"] = open_regular(self.preload, os.O_RDONLY)
            for i, vol in enumerate(self.volumes):
                fds[f"vol{i}"] = open_regular(vol.path, os.O_RDONLY if vol.read_only else os.O_RDWR)
        except LaunchError:
            for fd in fds.values():
                os.close(fd)
            raise
        return fds

    def environ(self, fds: dict[str, int]) -> dict[str, str]:
        """QEMU's environment beyond the one it would inherit: the preload, by descriptor
        (``/proc/self/fd/N``: no path of ours, and the jail has no view of it)."""
        if "preload" in fds:
            return {"LD_PRELOAD": f"/proc/self/fd/{fds['preload']}"}
        return {}


def open_regular(path: Path, flags: int) -> int:
    """``path`` opened with ``flags``, if it is a regular file reached without a symlink."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = "a symlink" if exc.errno == errno.ELOOP else exc.strerror
        raise LaunchError(f"cannot open {path}: {why}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LaunchError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _netdev(args: tuple[str, ...], device: str, fds: dict[str, int]) -> list[str]:
    """The network layer's -netdev/-device arguments: ``{net}`` is the device model,
    ``{fd:NAME}`` the number QEMU inherits descriptor ``fds[NAME]`` under (a TAP)."""
    out = []
    for x in args:
        x = x.replace("{net}", device)
        for name, fd in fds.items():
            x = x.replace(f"{{fd:{name}}}", str(fd))
        if "{fd:" in x:
            raise LaunchError(f"QEMU's network argument {x!r} names a descriptor it is not given")
        out.append(x)
    return out


def _image_format(path: Path) -> str:
    fd = open_regular(path, os.O_RDONLY)
    try:
        return "qcow2" if os.pread(fd, 4, 0) == b"QFI\xfb" else "raw"
    finally:
        os.close(fd)


@attrs.frozen
class StagedDisk:
    """An overlay QEMU has open as a block node, not yet written by the disk device."""

    node: str
    fdset: int


@attrs.frozen
class QemuUser:
    """The unprivileged user QEMU runs as when the supervisor is root."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def unsearchable_parent(path: Path) -> Path | None:
    """The first directory on the way to ``path`` that others may not pass (no o+x):
    where an unprivileged QEMU would be stopped. None when the way is open."""
    for parent in reversed(path.resolve().parents):
        if not parent.stat().st_mode & 0o001:
            return parent
    return None


def unprivileged_user(name: str | None = None) -> QemuUser | None:
    """``name``, else ``sandvisor-qemu`` if that user exists, else ``nobody``; plus the
    ``kvm`` group for /dev/kvm. None when the supervisor is not root (QEMU then runs as
    the supervisor's own user) or when ``name`` is the empty string (explicitly off)."""
    if os.geteuid() != 0 or name == "":
        return None
    for candidate in [name] if name else ["sandvisor-qemu", "nobody"]:
        try:
            pw = pwd.getpwnam(candidate)
        except KeyError:
            continue
        groups = [pw.pw_gid]
        try:
            groups.append(grp.getgrnam("kvm").gr_gid)
        except KeyError:
            pass
        return QemuUser(candidate, pw.pw_uid, pw.pw_gid, tuple(groups))
    raise LaunchError(f"no such user {name!r} to run QEMU as")


class _Ring:
    """The last ``size`` bytes written: guest-controlled output never grows memory."""

    def __init__(self, size: int) -> None:
        self.buf: collections.deque[bytes | bytearray] = collections.deque()
        self.size = size
        self.len = 0
        self.total = 0

    def add(self, data: bytes | bytearray) -> None:
        self.buf.append(data)
        self.len += len(data)
        self.total += len(data)
        while self.len > self.size and len(self.buf) > 1:
            self.len -= len(self.buf.popleft())

    def text(self) -> str:
        return b"".join(self.buf)[-self.size :].decode(errors="replace")


@asynccontextmanager
async def qmp_loop() -> AsyncIterator[None]:
    """The asyncio loop qemu.qmp runs on, inside Trio."""
    async with trio_asyncio.open_loop():
        yield


class Proc(Protocol):
    """A QEMU process, however it was started (a child, a jailed child, or adopted)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


UNKNOWN_EXIT = -1000  # an adopted QEMU's exit status: not our child, the kernel tells us nothing


def start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot): with the pid, who a process is."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


class AdoptedProcess:
    """A QEMU a previous supervisor started, watched through a pidfd: no pid recycling
    race, no zombie of ours (its parent is init now), no exit status."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._returncode: int | None = None

    @classmethod
    def open(cls, pid: int, started: int) -> AdoptedProcess | None:
        """The process ``pid`` if it is still the one that started at ``started``."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
        if start_time(pid) != started:  # (checked after the pidfd: it pins this process)
            os.close(fd)
            return None
        return cls(pid, fd)

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def wait(self) -> int:
        if self._returncode is None:
            await trio.lowlevel.wait_readable(self._pidfd)
            self._returncode = UNKNOWN_EXIT
            os.close(self._pidfd)
            self._pidfd = -1
        return self._returncode

    def send_signal(self, sig: int) -> None:
        if self._returncode is None and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Spawner = Callable[[list[str], tuple[int, ...], int, dict[str, str]], Awaitable[Proc]]
"""Start QEMU's argv with these descriptors, this stderr fd and these environment
variables (its whole environment), somewhere (a jail)."""


@attrs.frozen
class Placement:
    """Where a QEMU runs: its socket dir as the host reaches it and as QEMU sees it (in
    a jail, its socket dir), its stderr log (a file the next supervisor can read), and
    how it is started (``spawn``: into a jail; None: a plain child, as ``user``)."""

    sock_dir: Path
    log: Path
    qemu_dir: Path | None = None  # default: sock_dir
    spawn: Spawner | None = None

    @classmethod
    def plain(cls, run_dir: Path) -> Placement:
        return cls(sock_dir=run_dir, log=run_dir / "qemu.log")


class Machine:
    """One QEMU process and its QMP connection. Owns the process, the QMP client and
    the console; the placement's directories are the caller's (they exist).

    ``run`` starts QEMU (``on_spawned`` is told its pid and start time at once, before
    QMP: a crash from here on leaves a process the next supervisor can find); or, for
    a machine made by :meth:`adopt`, attaches to a QEMU a previous supervisor started.
    :meth:`detach` lets go of a running QEMU without stopping it (it outlives us)."""

    def __init__(
        self,
        spec: MachineSpec,
        placement: Placement | Path,
        *,
        name: str = "vm",
        fds: dict[str, int] | None = None,
        on_spawned: Callable[[int, int], None] | None = None,
    ) -> None:
        self.spec = spec
        self.placement = placement if isinstance(placement, Placement) else Placement.plain(placement)
        self.run_dir = self.placement.sock_dir
        self.name = name
        self.runstate = Runstate.NEW
        self.proc: Proc | None = None
        self.qmp = QMPClient(name)
        self.console = _Ring(CONSOLE_RING)
        self._exited = trio.Event()
        self.returncode: int | None = None
        self._nursery: trio.Nursery | None = None
        self._fd_lock = trio.Lock()  # SCM_RIGHTS + its getfd/add-fd must not interleave
        self._disk_top = "disk0"  # the block node the disk device writes to (moves on checkpoint)
        self._staged = 0  # overlays staged so far: fd set and node names stay unique
        self._fds = dict(fds or {})  # more descriptors for QEMU (RAM, taps), the caller's
        self._on_spawned = on_spawned
        self._adopted: AdoptedProcess | None = None
        self._qmp_sock: socket.socket | None = None
        self.detached = False

    @classmethod
    def adopt(cls, spec: MachineSpec, placement: Placement, proc: AdoptedProcess, *, name: str = "vm") -> Machine:
        """A machine for a running QEMU (its :meth:`run` attaches instead of starting)."""
        m = cls(spec, placement, name=name)
        m._adopted = proc
        return m

    @property
    def disk_top(self) -> str:
        return self._disk_top

    @property
    def staged(self) -> int:
        return self._staged

    def resume_life_state(self, disk_top: str, staged: int) -> None:
        """An adopted QEMU's block graph, as recorded (a checkpoint moved its disk)."""
        self._disk_top, self._staged = disk_top, staged

    @property
    def guest_socket(self) -> Path:
        return self.run_dir / "guest.sock"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stderr_tail(self, lines: int = 3) -> list[str]:
        try:
            with open(self.placement.log, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                return f.read().decode(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return []

    def describe_exit(self) -> str:
        rc = self.returncode
        if rc == UNKNOWN_EXIT:
            how = "exited (its status is unknown: a previous supervisor started it)"
        elif rc is not None and rc < 0:
            how = f"killed by signal {-rc}"
        else:
            how = f"exit status {rc}"
        err = self.stderr_tail()
        return f"QEMU {how}" + (f": {' | '.join(err)}" if err else "")

    async def run(self, task_status: trio.TaskStatus[Machine] = trio.TASK_STATUS_IGNORED) -> None:
        """Launch (or attach to) QEMU, then supervise it until it exits. ``started`` once
        QMP is up."""
        if self.runstate is not Runstate.NEW:
            raise MachineStateError(f"machine is {self.runstate.value}, not new")
        if self._adopted is not None:
            self.proc = self._adopted
        else:
            self.proc = await self._launch()
        self.runstate = Runstate.RUNNING
        try:
            with collapse_single():
                await self._supervise(task_status)
        finally:
            with trio.CancelScope(shield=True):
                if not self.detached:
                    await self._kill_and_reap()
                with contextlib.suppress(Exception):  # EOF after quit/kill is reported here
                    await trio_asyncio.aio_as_trio(self.qmp.disconnect)()
                if self._qmp_sock is not None:
                    self._qmp_sock.close()
            self._nursery = None

    async def _launch(self) -> Proc:
        p = self.placement
        for old in p.sock_dir.glob("*.sock"):
            old.unlink()
        user = self.spec.user
        if user is not None and p.spawn is None:
            os.chown(p.sock_dir, user.uid, user.gid)  # QEMU creates its sockets here
        files = self.spec.open_files()
        fds = {**files, **self._fds}
        argv = self.spec.argv(p.qemu_dir or p.sock_dir, fds)
        env = self.spec.environ(fds)
        log.debug("launch %s: %s %s", self.name, " ".join(f"{k}={v}" for k, v in env.items()), shlex.join(argv))
        try:
            err = os.open(p.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            for fd in files.values():
                os.close(fd)
            raise LaunchError(f"cannot open QEMU's log {p.log}: {exc.strerror}") from None
        try:
            if p.spawn is not None:
                proc = await p.spawn(argv, tuple(fds.values()), err, env)
            else:
                creds: dict[str, Any] = {}
                if user is not None:
                    creds = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}
                try:
                    proc = await trio.lowlevel.open_process(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        pass_fds=tuple(fds.values()),
                        env={**os.environ, **env} if env else None,
                        start_new_session=True,  # a ^C to the supervisor must not reach QEMU
                        **creds,
                    )
                except OSError as exc:
                    raise LaunchError(f"cannot start {argv[0]}: {exc}") from exc
        finally:
            os.close(err)
            for fd in files.values():
                os.close(fd)
        if self._on_spawned is not None:
            try:
                self._on_spawned(proc.pid, start_time(proc.pid))
            except BaseException:
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
                raise
        crash_point("spawned")
        return proc

    async def _connect(self, name: str) -> socket.socket:
        """Connect to one of QEMU's listening sockets (made during its start-up)."""
        path = self.run_dir / name
        with trio.fail_after(10):
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                try:
                    s.connect(str(path))
                    check_peer(s, self.pid, path)
                    return s
                except (FileNotFoundError, ConnectionRefusedError):
                    s.close()
                    if self.exited:
                        raise LaunchError(f"QEMU exited before it listened on {name}: {self.describe_exit()}") from None
                    await trio.sleep(0.002)
                except OSError:
                    s.close()
                    raise

    async def _supervise(self, task_status: trio.TaskStatus[Machine]) -> None:
        assert self.proc is not None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._reap)
            try:
                self._qmp_sock = await self._connect("qmp.sock")
                with trio.fail_after(10):
                    await trio_asyncio.aio_as_trio(self.qmp.connect)(self._qmp_sock)
            except (Exception, trio.TooSlowError) as exc:
                with trio.move_on_after(0.5):
                    await self._exited.wait()
                raise LaunchError(f"QMP handshake failed: {exc}; {self.describe_exit()}") from exc
            with contextlib.suppress(LaunchError, OSError, trio.TooSlowError):
                con = await self._connect("console.sock")
                nursery.start_soon(self._pump, trio.SocketStream(trio.socket.from_stdlib_socket(con)), self.console)
            task_status.started(self)
            await self._exited.wait()
            nursery.cancel_scope.cancel()

    def detach(self) -> None:
        """Let go of QEMU without stopping it: leaving ``run`` closes our connections and
        leaves the process running (for the next supervisor to adopt)."""
        self.detached = True
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _pump(self, stream: trio.abc.ReceiveStream, ring: _Ring) -> None:
        try:
            async with stream:
                while True:
                    data = await stream.receive_some(4096)
                    if not data:
                        return
                    ring.add(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return

    async def _reap(self) -> None:
        assert self.proc is not None
        self.returncode = await self.proc.wait()
        self.runstate = Runstate.EXITED
        self._exited.set()

    async def _kill_and_reap(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.kill()
        self.returncode = await self.proc.wait()
        self.runstate = Runstate.EXITED
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    # -- QMP -----------------------------------------------------------------
    async def qmp_execute(self, cmd: str, args: dict[str, Any] | None = None, *, timeout: float = 30) -> Any:
        if self.runstate is not Runstate.RUNNING:
            raise MachineStateError(f"QMP {cmd} on a machine that is {self.runstate.value}")
        try:
            with trio.fail_after(timeout):
                return await trio_asyncio.aio_as_trio(self.qmp.execute)(cmd, args)
        except _QMPExecuteError as exc:
            raise QMPCommandError(f"{cmd}: {exc.error.error.desc}") from None
        except trio.TooSlowError:
            raise QMPCommandError(f"{cmd}: no answer within {timeout:g}s") from None
        except Exception as exc:  # disconnected, EOF: the process is going away
            raise MachineStateError(f"QMP {cmd}: {type(exc).__name__}: {exc}") from None

    async def hmp(self, line: str) -> str:
        """A human-monitor command. HMP reports errors as reply text; the caller checks it."""
        return str(await self.qmp_execute("human-monitor-command", {"command-line": line}))

    async def getfd(self, fd: int, name: str) -> None:
        """Hand QEMU a descriptor under ``name`` (for ``fd:name`` migration URIs)."""
        async with self._fd_lock:
            self._send_fd(fd)
            await self.qmp_execute("getfd", {"fdname": name})

    async def add_fd(self, fd: int, fdset: int, opaque: str = "") -> None:
        """Add a descriptor to fd set ``fdset`` (opened by QEMU as /dev/fdset/N)."""
        async with self._fd_lock:
            self._send_fd(fd)
            await self.qmp_execute("add-fd", {"fdset-id": fdset, "opaque": opaque})

    def _send_fd(self, fd: int) -> None:
        if self.runstate is not Runstate.RUNNING:
            raise MachineStateError(f"fd passing on a machine that is {self.runstate.value}")
        try:
            self.qmp.send_fd_scm(fd)
        except Exception as exc:
            raise MachineStateError(f"cannot pass a descriptor to QEMU: {exc}") from None

    async def status(self) -> str:
        return str((await self.qmp_execute("query-status"))["status"])

    async def migrate_to_fd(self, fd: int, *, ignore_shared: bool, timeout: float = 120.0) -> dict[str, Any]:
        """Save device state (and RAM unless it is a shared file and ``ignore_shared``)
        into ``fd``. The caller has stopped the guest; it stays stopped. Returns QEMU's
        final query-migrate answer."""
        await self._migration_caps(ignore_shared)
        await self.qmp_execute("migrate-set-parameters", {"max-bandwidth": 1 << 40, "downtime-limit": 2000})
        await self.getfd(fd, "snapfd")
        await self.qmp_execute("migrate", {"uri": "fd:snapfd"})
        with trio.fail_after(timeout):
            while True:
                info = await self.qmp_execute("query-migrate")
                st = info.get("status")
                if st == "completed":
                    break
                if st in ("failed", "cancelled"):
                    raise QMPCommandError(f"migration {st}: {info.get('error-desc', '')}")
                await trio.sleep(0.002)
            # the completed status can come while the run state is still finish-migrate;
            # cont then fails with "Migration is not finalized yet" (measured)
            while await self.status() == "finish-migrate":
                await trio.sleep(0.001)
        return dict(info)

    async def migrate_from_fd(
        self, fd: int, *, ignore_shared: bool, resume: bool = True, timeout: float = 120.0
    ) -> None:
        """Load a saved state into a machine started with ``incoming``; it runs after
        (``resume``), or stays paused (a conversion: started with ``-S``, it never runs
        the guest)."""
        await self._migration_caps(ignore_shared)
        await self.getfd(fd, "snapfd")
        await self.qmp_execute("migrate-incoming", {"uri": "fd:snapfd"})
        with trio.fail_after(timeout):
            while True:
                st = await self.status()
                if st == "running":
                    if not resume:
                        raise QMPCommandError("the loaded guest runs, though it was to stay paused")
                    return
                if st in ("paused", "postmigrate"):
                    if resume:
                        await self.qmp_execute("cont")
                    return
                if st not in ("inmigrate", "prelaunch", "restore-vm"):
                    raise QMPCommandError(f"restore ended in run state {st!r}")
                await trio.sleep(0.002)

    async def _migration_caps(self, ignore_shared: bool) -> None:
        await self.qmp_execute(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "x-ignore-shared", "state": ignore_shared}]},
        )

    # -- checkpoint steps ----------------------------------------------------------
    async def stage_disk(self, path: Path) -> StagedDisk:
        """Open a new overlay (read-write and read-only descriptors in a fresh fd set:
        QEMU picks by access mode when it reopens the layer read-only later) and add
        it as a block node no device uses yet. Undone on failure."""
        self._staged += 1
        staged = StagedDisk(node=f"ov{self._staged}", fdset=100 + self._staged)
        try:
            fds = [os.open(path, os.O_RDWR | os.O_CLOEXEC), os.open(path, os.O_RDONLY | os.O_CLOEXEC)]
        except OSError as exc:
            raise LaunchError(f"cannot open {path}: {exc.strerror}") from None
        added = False
        try:
            try:
                for fd, opaque in zip(fds, ("rw", "ro"), strict=True):
                    await self.add_fd(fd, staged.fdset, f"{staged.node}-{opaque}")
                    added = True
            finally:
                for fd in fds:
                    os.close(fd)
            await self.qmp_execute(
                "blockdev-add",
                {
                    "driver": "qcow2",
                    "node-name": staged.node,
                    "file": {"driver": "file", "filename": f"/dev/fdset/{staged.fdset}", "locking": "off"},
                    "backing": None,
                },
            )
        except BaseException:
            if added:
                with trio.CancelScope(shield=True), contextlib.suppress(MachineError):
                    await self.qmp_execute("remove-fd", {"fdset-id": staged.fdset})
            raise
        return staged

    async def unstage_disk(self, staged: StagedDisk) -> None:
        """Drop a staged overlay that was never switched to (best effort, shielded)."""
        with trio.CancelScope(shield=True):
            with contextlib.suppress(MachineError):
                await self.qmp_execute("blockdev-del", {"node-name": staged.node})
            with contextlib.suppress(MachineError):
                await self.qmp_execute("remove-fd", {"fdset-id": staged.fdset})

    async def switch_disk(self, staged: StagedDisk) -> None:
        """The disk device writes the staged overlay from now on, on top of the layer it
        wrote so far (reopened read-only). The guest must be paused."""
        await self.qmp_execute("blockdev-snapshot", {"node": self._disk_top, "overlay": staged.node})
        self._disk_top = staged.node

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[float]:
        """The guest paused for the block (yields when it stopped, monotonic); it runs
        again however the block ends, or this raises."""
        await self.qmp_execute("stop")
        t0 = time.monotonic()
        try:
            yield t0
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.qmp_execute("cont")
                except MachineError as exc:
                    log.warning("%s: cont after a pause failed: %s", self.name, exc)
                    raise

    # -- shutdown ladder ---------------------------------------------------------
    async def shutdown(
        self,
        ask: Callable[[], Awaitable[None]] | None = None,
        *,
        ask_timeout: float = 10.0,
        step_timeout: float = 3.0,
    ) -> int:
        """ask (guestd powers off) -> QMP quit -> SIGTERM -> SIGKILL; always reaped.
        Shielded: a cancelled caller still leaves no process behind."""
        with trio.CancelScope(shield=True):
            if self.proc is None or self.detached:
                return 0
            steps: list[tuple[str, Callable[[], Awaitable[None]], float]] = []
            if ask is not None:
                steps.append(("guest poweroff", ask, ask_timeout))
            steps.append(("QMP quit", self._quit, step_timeout))
            steps.append(("SIGTERM", self._term, step_timeout))
            for what, step, timeout in steps:
                if self.exited:
                    break
                with trio.move_on_after(timeout):
                    try:
                        await step()
                    except Exception as exc:
                        log.debug("%s: %s failed: %s", self.name, what, exc)
                    await self._exited.wait()
                if not self.exited:
                    log.info("%s: %s did not stop QEMU in %gs", self.name, what, timeout)
            await self._kill_and_reap()
        assert self.returncode is not None
        return self.returncode

    async def _quit(self) -> None:
        await self.qmp_execute("quit", timeout=2)

    async def _term(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)


def check_peer(sock: socket.socket, pid: int | None, path: Path) -> None:
    """The socket we reached by ``path`` is QEMU's own (``pid``). QEMU's socket dir
    belongs to its cell's uid: an escaped QEMU could put a symlink there to any other
    socket on the host (which root may connect to); the listener's pid, as the kernel
    recorded it, tells (translated into our pid namespace)."""
    if pid is None:
        return
    peer = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    if peer != pid:
        sock.close()
        raise LaunchError(f"{path} is not QEMU's (pid {pid}) but pid {peer}'s: refusing it")


async def connect_guest_socket(path: Path, *, pid: int | None, timeout: float = 10.0) -> trio.SocketStream:
    """Connect to the guest channel's unix socket (QEMU, ``pid``, creates it during
    start-up; :func:`check_peer`)."""
    with trio.fail_after(timeout):
        while True:
            try:
                stream = await trio.open_unix_socket(str(path))
            except (FileNotFoundError, ConnectionRefusedError):
                await trio.sleep(0.002)
                continue
            try:
                check_peer(stream.socket, pid, path)  # type: ignore[arg-type]
            except LaunchError:
                await stream.aclose()
                raise
            return stream
