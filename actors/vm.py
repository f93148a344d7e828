"""Boot a guest: overlay disk, kernel command line, QEMU, guest channel, hello.

:func:`booted_guest` is the one way the project brings up a VM (the sandbox actor,
the tests and the benchmarks all use it). It owns, for the duration of its block,
the QEMU process (via :class:`~actors.machine.Machine`), the guest channel and the
qcow2 overlay in ``run_dir``; leaving the block -- normally, by error or by
cancellation -- powers the guest off through the shutdown ladder and reaps QEMU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

from actors._groups import collapse_single
from actors.disk import backing_chain, create_overlay
from actors.guest import GuestChannel, HelloTimeout, open_channel
from actors.machine import LaunchError, Machine, MachineError, MachineSpec, QemuUser, connect_guest_socket
from images.build import Image, host_tsc_khz

log = logging.getLogger("sandvisor.vm")

BASE_CMDLINE = "console=ttyS0 quiet panic=-1 pci=off i8042.noaux i8042.nomux i8042.nopnp"


class BootError(LaunchError):
    """The guest did not reach guestd's hello (QEMU died, or the boot timed out)."""

    def __init__(self, message: str, console: str = "") -> None:
        super().__init__(message)
        self.console = console


def kernel_cmdline(accel: str, *, root: bool = True, hostname: str = "sandbox", extra: str = "") -> str:
    parts = [BASE_CMDLINE]
    if accel == "tcg":
        khz = host_tsc_khz()
        if khz:
            parts.append(f"tsc_early_khz={khz}")  # TCG boots hang ~1 in 30 calibrating otherwise
    if root:
        parts.append("sandvisor.root=/dev/vda")
    parts.append(f"sandvisor.hostname={hostname}")
    if extra:
        parts.append(extra)
    return " ".join(parts)


@attrs.frozen
class NetConfig:
    """User-mode networking (QEMU's slirp: no packet leaves the QEMU process by itself).
    ``restrict`` (the default) cuts the guest off from the host and the outside; only
    host forwards (exposed ports) reach it."""

    restrict: bool = True
    net: str = "10.0.2.0/24"
    address: str = "10.0.2.15"
    gateway: str = "10.0.2.2"
    dns: str = "10.0.2.3"
    prefix: int = 24


NETDEV_ID = "n0"


def netdev_args(net: NetConfig | None) -> tuple[str, ...]:
    if net is None:
        return ()
    restrict = "on" if net.restrict else "off"
    return (
        "-netdev",
        f"user,id={NETDEV_ID},net={net.net},host={net.gateway},dns={net.dns},restrict={restrict}",
        "-device",
        "{net},netdev=" + NETDEV_ID,
    )


def network_cmdline(net: NetConfig | None) -> str:
    if net is None:
        return ""
    return f"sandvisor.net={net.address}/{net.prefix},{net.gateway},{net.dns}"


@attrs.frozen
class RestoreFrom:
    """A saved state to start from instead of booting (see actors/snapshot.py).
    ``memory``: the snapshot's RAM file, mapped privately (copy-on-write); None when
    the RAM is in ``vmstate`` (a streamed snapshot)."""

    vmstate: Path
    memory: Path | None


def prepare_memory_file(path: Path, size_mib: int, user: QemuUser | None) -> None:
    """The shared RAM file, made by us (0600, QEMU's user) before QEMU maps it: QEMU
    would create it 0644, readable by every local user."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size_mib << 20)
        if user is not None:
            os.fchown(fd, user.uid, user.gid)
    finally:
        os.close(fd)


@attrs.define
class Guest:
    """A booted VM: its machine, its channel, and boot timestamps (monotonic seconds)."""

    machine: Machine
    channel: GuestChannel
    t_launch: float
    t_qmp: float
    t_ready: float
    t_loaded: float = 0.0  # a restore: when the saved state was in


@asynccontextmanager
async def booted_guest(
    image: Image,
    run_dir: Path,
    *,
    rootfs: Path | None = None,
    disk: bool = True,
    cpus: int = 1,
    memory_mib: int = 256,
    accel: str = "tcg",
    hostname: str = "sandbox",
    extra_cmdline: str = "",
    boot_timeout: float = 60.0,
    machine: str = "microvm",
    sandbox: bool = True,
    user: QemuUser | None = None,
    extra_ports: tuple[str, ...] = (),
    network: NetConfig | None = None,
    disk_path: Path | None = None,
    kernel: Path | None = None,
    initrd: Path | None = None,
    append: str | None = None,
    memory_file: Path | None = None,
    restore: RestoreFrom | None = None,
) -> AsyncIterator[Guest]:
    """``disk_path``: where the overlay lives (default ``run_dir/disk.qcow2``); an existing
    overlay there is booted as is (a stopped sandbox started again keeps its disk).
    ``memory_file``: guest RAM in this shared file (made here, removed on the way out),
    so that a checkpoint can copy it; None for anonymous RAM.
    ``restore``: resume a saved state instead of booting; the machine arguments
    (kernel, initrd, append, memory size, devices) must be those it was saved with."""
    run_dir.mkdir(parents=True, exist_ok=True)
    overlay = None
    chain: tuple[Path, ...] = ()
    if disk:
        overlay = disk_path or run_dir / "disk.qcow2"
        if not overlay.exists():
            await create_overlay(rootfs or image.rootfs, overlay)
        chain = backing_chain(overlay)
    mem_path, mem_shared = memory_file, True
    if restore is not None and restore.memory is not None:
        mem_path, mem_shared = restore.memory, False
    spec = MachineSpec(
        kernel=kernel or (image.kernel if machine == "microvm" else image.kernel_bz),
        initrd=initrd or image.initrd,
        disk=overlay,
        cpus=cpus,
        memory_mib=memory_mib,
        append=append
        if append is not None
        else kernel_cmdline(
            accel,
            root=disk,
            hostname=hostname,
            extra=" ".join(x for x in (network_cmdline(network), extra_cmdline) if x),
        ),
        accel=accel,
        machine=machine,
        sandbox=sandbox,
        user=user,
        disk_chain=chain,
        extra_ports=extra_ports,
        netdev=netdev_args(network),
        memory_file=mem_path,
        memory_shared=mem_shared,
        incoming=restore is not None,
    )
    vm = Machine(spec, run_dir, name=hostname)
    t0 = time.monotonic()
    try:
        if memory_file is not None and mem_shared:
            prepare_memory_file(memory_file, memory_mib, user)
        async with _running(vm, t0, boot_timeout, restore) as guest:
            yield guest
    finally:
        if memory_file is not None and mem_shared:
            with contextlib.suppress(FileNotFoundError):
                memory_file.unlink()


@asynccontextmanager
async def _running(vm: Machine, t0: float, boot_timeout: float, restore: RestoreFrom | None) -> AsyncIterator[Guest]:
    with collapse_single():
        async with trio.open_nursery() as nursery:
            await nursery.start(vm.run)
            t_qmp = time.monotonic()
            try:
                t_loaded = 0.0
                if restore is not None:
                    await _load(vm, restore)
                    t_loaded = time.monotonic()
                stream = None
                with trio.CancelScope() as boot_scope:

                    async def watch_exit() -> None:
                        await vm.wait()
                        boot_scope.cancel()

                    nursery.start_soon(watch_exit)
                    stream = await connect_guest_socket(vm.guest_socket)
                if stream is None or vm.exited:
                    raise BootError(f"QEMU exited during boot: {vm.describe_exit()}", vm.console.text())
                async with open_channel(stream, hello_timeout=None) as chan:
                    with trio.CancelScope() as hello_scope:

                        async def watch_exit_hello() -> None:
                            await vm.wait()
                            hello_scope.cancel()

                        nursery.start_soon(watch_exit_hello)
                        try:
                            await chan.hello(boot_timeout)
                        except HelloTimeout:
                            raise BootError(
                                f"guest did not become ready within {boot_timeout:g}s", vm.console.text()
                            ) from None
                    if chan.hello_info is None:
                        raise BootError(f"QEMU exited during boot: {vm.describe_exit()}", vm.console.text())
                    guest = Guest(vm, chan, t0, t_qmp, time.monotonic(), t_loaded)
                    try:
                        yield guest
                    finally:
                        await vm.shutdown(ask=chan.shutdown if not chan.broken else None)
            finally:
                await vm.shutdown()
                nursery.cancel_scope.cancel()


async def _load(vm: Machine, restore: RestoreFrom) -> None:
    try:
        fd = os.open(restore.vmstate, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise LaunchError(f"cannot open the saved state {restore.vmstate}: {exc.strerror}") from None
    try:
        await vm.migrate_from_fd(fd, ignore_shared=restore.memory is not None)
    except MachineError as exc:
        raise BootError(f"restore failed: {exc}; {vm.describe_exit() if vm.exited else ''}") from None
    finally:
        os.close(fd)
