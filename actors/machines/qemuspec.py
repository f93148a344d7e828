"""QEMU's command line: :class:`MachineSpec` (everything that decides it), the
descriptors QEMU boots from (opened by us: QEMU opens no file of ours by path), and
the microvm machine's device budget (:data:`MICROVM_VIRTIO_SLOTS`,
:class:`TooManyDevices`)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import attrs

from actors import defaults
from actors.machines.qemuproc import LaunchError, QemuUser

GUEST_PORT_NAME = "sandvisor.0"


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
# TCG's CPU: everything QEMU emulates, less ERMS and FSRM ("rep movsb/stosb are fast").
# Under TCG they are not: each iteration of a rep string instruction is one pass through
# a translated block, so the guest kernel's memcpy/clear_page and glibc's large copies,
# which pick `rep movsb`/`rep stosb` when the flags are there, move a byte per pass
# (without them: 8 bytes, or an unrolled loop). Measured on the boot path, A/B in one
# run: docs/results/boot.md. CPUID is not in the migration stream: a snapshot taken with
# the flags restores under this model (its kernel keeps the `rep movsb` it patched in).
TCG_CPU = "max,erms=off,fsrm=off"
LAYER_FDSET = 10  # fd set of backing layer i: LAYER_FDSET + i
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
    tb_size_mib: int | None = defaults.TB_SIZE_MIB
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
    # have the snapshot's pages zeroed under every clone. A paused sandbox's resume maps
    # its saved memory file itself: the shim is told that file (:meth:`environ`) and
    # skips its punches too. Part of the machine: a
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
    # a checkpoint copies it, see actors/snapshots/snapshot.py) or private (a restore maps the
    # snapshot's memory copy-on-write and never writes the file)
    memory_file: Path | None = None
    memory_shared: bool = True
    incoming: bool = False  # start with -incoming defer: a restore feeds migrate-incoming
    qemu: str = "qemu-system-x86_64"
    extra_args: tuple[str, ...] = ()
    # extra disks after the root disk. A snapshot restores only onto the same devices:
    # a restore gets as many volumes as the machine it was taken from had.
    volumes: tuple[Volume, ...] = ()

    # virtio-fs shares (host directories, actors/hostdirs.py), by tag: each a
    # vhost-user-fs device whose server's socket QEMU inherits as fds["fs<i>"]
    fs_tags: tuple[str, ...] = ()

    def volume_serial(self, i: int) -> str:
        return self.volumes[i].serial or f"vol{i}"

    def virtio_devices(self) -> int:
        """How many virtio-mmio slots this machine takes (see MICROVM_VIRTIO_SLOTS)."""
        nics = sum(1 for x in self.netdev if "{net}" in x)
        return (
            1  # virtio-serial: the guest channel and every extra port
            + (self.disk is not None)
            + len(self.volumes)
            + len(self.fs_tags)
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

        def chardev(ident: str, name: str) -> str:
            # a listening socket the supervisor made and connected to already (fds
            # "listen:NAME"): QEMU accepts that connection as it starts (wait=on: no
            # connect loop, no race), and later ones (an adopting supervisor) by path
            if f"listen:{name}" in fds:
                return f"socket,id={ident},fd={fds[f'listen:{name}']},server=on,wait=on"
            return f"socket,id={ident},path={sock_dir / name},server=on,wait=off"

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
        cpu = "host" if accel == "kvm" else TCG_CPU
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
            chardev("con", "console.sock"),
            "-serial",
            "chardev:con",
            "-chardev",
            chardev("qmp", "qmp.sock"),
            "-mon",
            "chardev=qmp,mode=control",
            "-device",
            ser,
            "-chardev",
            chardev("guest", "guest.sock"),
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
                path = f"/dev/fdset/{LAYER_FDSET + i}" if f"layer{i}" in fds else str(layer)
                if f"layer{i}" in fds:
                    a += ["-add-fd", f"fd={fds[f'layer{i}']},set={LAYER_FDSET + i},opaque=layer{i}"]
                a += ["-blockdev", f"driver=file,filename={path},node-name={name}file,read-only=on,locking=off"]
                fmt = _image_format(layer)
                # the bottom qcow2 opens no backing file of its own: an empty name says so
                # on the command line ("null" would be a node called null)
                backing = f",backing={below}" if below else (",backing=" if fmt == "qcow2" else "")
                a += ["-blockdev", f"driver={fmt},file={name}file,node-name={name},read-only=on{backing}"]
                below = name
            backing = f",backing={below}" if below else (",backing=" if self.disk_format == "qcow2" else "")
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
                # as the root disk: a full host disk is the guest's I/O error on this
                # volume, not a VM that QEMU stops until space comes back
                f"{blk},drive=vol{i},serial={self.volume_serial(i)},werror=report,rerror=report",
            ]
        for i, fs_tag in enumerate(self.fs_tags):
            # vhost-user: the server maps guest RAM, which must be a shared file
            if fds.get(f"fs{i}") is None:
                raise LaunchError(f"virtio-fs share {fs_tag}: no server connection")
            if not self.memory_shared or (self.memory_file is None and fds.get("ram") is None):
                raise LaunchError("host directories (virtio-fs) need guest RAM in a shared file")
            dev = "vhost-user-fs-device" if self.machine == "microvm" else "vhost-user-fs-pci"
            a += ["-chardev", f"socket,id=fs{i},fd={fds[f'fs{i}']}", "-device", f"{dev},chardev=fs{i},tag={fs_tag}"]
        if self.fs_tags and self.machine == "microvm":
            # virtio-mmio is legacy (version 1) by default; virtiofsd's libvhost-user serves
            # modern devices only (every device of the machine is then modern)
            a += ["-global", "virtio-mmio.force-legacy=off"]
        if self.balloon:
            dev = "virtio-balloon-device" if self.machine == "microvm" else "virtio-balloon-pci"
            a += ["-device", f"{dev},free-page-reporting=on"]
        a += _netdev(self.netdev, net, fds)
        if self.incoming:
            a += ["-incoming", "defer"]
        if "listen:qmp.sock" in fds:
            # a guest saved paused (every checkpoint) restores running, without a `cont`
            # round trip: no runstate in the stream, so its restore obeys autostart
            # (not -S). A state saved with one still restores paused (VM.restore conts).
            a += ["-global", "migration.store-global-state=off"]
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
        (``/proc/self/fd/N``: no path of ours, and the jail has no view of it), and for
        the discard shim the file of privately mapped RAM (``fds["ram"]``, by device and
        inode), which it never lets QEMU punch: a paused sandbox's saved memory is not
        sealed (actors/ram_discard.c)."""
        if "preload" not in fds:
            return {}
        env = {"LD_PRELOAD": f"/proc/self/fd/{fds['preload']}"}
        if "ram" in fds and not self.memory_shared:
            st = os.fstat(fds["ram"])
            env["SANDVISOR_PRIVATE_RAM"] = f"{st.st_dev}:{st.st_ino}"
        return env


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
