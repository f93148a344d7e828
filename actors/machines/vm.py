"""Bring a VM up: a :class:`VmSpec`, the kernel command line, QEMU, the guest channel, hello.

:func:`booted_guest` is the one way the project brings up a VM (the sandbox actor,
the tests and the benchmarks all use it). It owns, for the duration of its block,
the QEMU process (via :class:`~actors.machines.machine.Machine`) and the guest channel;
leaving the block -- normally, by error or by cancellation -- powers the guest off
through the shutdown ladder and reaps QEMU. The files a spec names (the overlay,
the RAM file, the run dir) belong to the caller (a sandbox's
:class:`~actors.sandboxes.files.SandboxFiles`).

::

    booted_guest(spec, run_dir)
      Machine.run -------------------> QEMU (argv from spec.machine; its QMP, console and
                                       guest sockets made and connected before it starts)
      [restore] migrate-incoming fd:N <- vmstate (inherited; sent with the QMP handshake)
      HOST_SYNC + Hello -------------> guestd (waits in the socket as the state loads)
      [restore] fix-ups (Attach.fixups, pipelined behind the Hello)
                        <------------- GUEST_SYNC + HelloOk (+ the fix-ups' answers)
      yield Guest ... then ladder: guest poweroff -> quit -> SIGTERM -> SIGKILL, reaped
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from actors import defaults
from actors._groups import collapse_single
from actors.channel.guest import GuestChannel, HelloTimeout, open_channel
from actors.channel.guestwire import ChannelBroken
from actors.machines.disk import backing_chain
from actors.machines.machine import Machine, Placement
from actors.machines.qemuproc import (
    AdoptedProcess,
    LaunchError,
    MachineError,
    connect_guest_socket,
    legacy_restore,
)
from actors.machines.qemuspec import MachineSpec, Volume
from actors.model import load as load_value
from images.build import Image, host_tsc_khz

log = logging.getLogger("sandvisor.vm")

BASE_CMDLINE = "console=ttyS0 quiet panic=-1 pci=off i8042.noaux i8042.nomux i8042.nopnp"


class BootError(LaunchError):
    """The guest did not reach guestd's hello (QEMU died, or the boot timed out)."""

    def __init__(self, message: str, console: str = "") -> None:
        super().__init__(message)
        self.console = console


class BootTimeout(BootError):
    """QEMU ran, the guest did not say hello in time: a host too busy may be why."""


def kernel_cmdline(accel: str, *, root: bool = True, hostname: str = "sandbox", extra: str = "") -> str:
    parts = [BASE_CMDLINE]
    if accel == "tcg":
        khz = host_tsc_khz()
        if khz:
            parts.append(f"tsc_early_khz={khz}")  # TCG boots hang ~1 in 30 calibrating otherwise
        # TCG's TSC is QEMU's virtual clock (all vCPUs alike, paused and migrated with the
        # VM), but on a loaded host the clocksource watchdog sees it skew against the
        # HPET/PM timer and falls back to refined-jiffies: a 4 ms clock and a 250 Hz tick
        # even when idle (an idle guest 4.2-5.2% of a core against 1.0-1.3% on the TSC;
        # docs/results/exec.md). Which clock a guest got depended on the load at its boot.
        parts.append("tsc=reliable")
    if root:
        parts.append("sandvisor.root=/dev/vda")
    parts.append(f"sandvisor.hostname={hostname}")
    if extra:
        parts.append(extra)
    return " ".join(parts)


@attrs.frozen
class NetConfig:
    """A VM's network, as the guest is configured (kernel command line) and QEMU given it.

    User mode (``tap`` False): QEMU's slirp; no packet leaves the QEMU process by
    itself. ``restrict`` (the default) cuts the guest off from the host and the
    outside; only host forwards (exposed ports) reach it. Without it, slirp's
    sockets are opened in QEMU's network namespace (in a jail: the uplink that
    actors/net/hostnet.py made, filtered as a TAP is).

    Tap (``tap`` True): QEMU gets a TAP by descriptor (``Attach.fds[TAP_FD]``, made
    by actors/net/hostnet.py) and the guest an address of the IP pool, its MAC
    (``mac``), the gateway as router and resolver.

    Detached (``detached`` True): the guest's network device on a hub port nothing
    else joins, a backend with no saved state of its own: what a snapshot
    conversion's helper, which never runs the guest, gives a tap guest's stream."""

    restrict: bool = True
    net: str = "10.0.2.0/24"
    address: str = "10.0.2.15"
    gateway: str = "10.0.2.2"
    dns: str = "10.0.2.3"
    prefix: int = 24
    tap: bool = False
    mac: str = ""
    tap_name: str = ""  # the host side's link
    detached: bool = False


NETDEV_ID = "n0"
TAP_FD = "tap"  # the Attach.fds key of a tap VM's TAP descriptor


def netdev_args(net: NetConfig | None) -> tuple[str, ...]:
    if net is None:
        return ()
    if net.detached:
        return ("-netdev", f"hubport,id={NETDEV_ID},hubid=0", "-device", "{net},netdev=" + NETDEV_ID)
    if net.tap:
        # vnet_hdr: QEMU reads it from the descriptor (IFF_VNET_HDR); the number is the
        # one QEMU inherits it under (MachineSpec.argv fills it in)
        return (
            "-netdev",
            f"tap,id={NETDEV_ID},fd={{fd:{TAP_FD}}}",
            "-device",
            "{net}" + f",netdev={NETDEV_ID},mac={net.mac}",
        )
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
class VmSpec:
    """Everything one VM life is brought up from: its machine (QEMU's command line:
    the files it boots, its devices, its RAM), the state it resumes, and how long it
    may take to say hello.

    ``restore``: a saved state (vmstate) to resume instead of booting; the machine
    must be the one it was saved with, started with ``-incoming`` (``incoming``).
    :meth:`of` and :meth:`boot` derive the machine's network devices, disk chain, RAM
    file and ``incoming`` from what a caller knows."""

    machine: MachineSpec
    restore: Path | None = None
    boot_timeout: float = defaults.BOOT_TIMEOUT
    answer_timeout: float | None = None  # every guest request's deadline (None: none)
    name: str = "vm"
    poweroff_grace: float = defaults.POWEROFF_GRACE  # the guest's own power-off, before QMP quit

    def __attrs_post_init__(self) -> None:
        if self.machine.incoming != (self.restore is not None):
            raise ValueError("a restore's machine starts with -incoming, a boot's without")

    @classmethod
    def of(
        cls,
        *,
        kernel: Path,
        initrd: Path,
        append: str,
        disk: Path | None = None,
        chain: tuple[Path, ...] | None = None,
        network: NetConfig | None = None,
        ram: Path | None = None,
        ram_shared: bool = True,
        restore: Path | None = None,
        boot_timeout: float = defaults.BOOT_TIMEOUT,
        answer_timeout: float | None = None,
        name: str = "vm",
        **machine: Any,
    ) -> VmSpec:
        """A VM from the files it boots and the state it resumes. ``disk``: the
        sandbox's overlay, which exists; ``chain``: the layers below it, top first, as
        the store recorded them (None: read from the overlay's header, which only a
        caller that made the file itself may trust). ``network``: the guest's network
        devices. ``ram``: guest RAM in this file, mapped shared (``ram_shared``: a
        checkpoint copies it) or privately (a restore maps a snapshot's RAM
        copy-on-write); None for anonymous RAM. ``machine``: the rest of
        :class:`MachineSpec` (cpus, memory_mib, accel, user, machine, balloon, ...)."""
        return cls(
            MachineSpec(
                kernel=kernel,
                initrd=initrd,
                append=append,
                disk=disk,
                disk_chain=(chain if chain is not None else backing_chain(disk)) if disk is not None else (),
                netdev=netdev_args(network),
                memory_file=ram,
                memory_shared=ram_shared,
                incoming=restore is not None,
                **machine,
            ),
            restore=restore,
            boot_timeout=boot_timeout,
            answer_timeout=answer_timeout,
            name=name,
        )

    @classmethod
    def boot(
        cls,
        image: Image,
        *,
        disk: Path | None,
        accel: str = "tcg",
        hostname: str = "sandbox",
        network: NetConfig | None = None,
        extra_cmdline: str = "",
        kernel: Path | None = None,
        machine: str = "microvm",
        **kw: Any,
    ) -> VmSpec:
        """A fresh boot of ``image`` (or of ``kernel`` with the image's runtime); ``kw``:
        :meth:`of`'s."""
        append = kernel_cmdline(
            accel,
            root=disk is not None,
            hostname=hostname,
            extra=" ".join(x for x in (network_cmdline(network), extra_cmdline) if x),
        )
        return cls.of(
            kernel=kernel or (image.kernel if machine == "microvm" else image.kernel_bz),
            initrd=image.initrd,
            append=append,
            disk=disk,
            accel=accel,
            network=network,
            name=hostname,
            machine=machine,
            **kw,
        )

    @property
    def mapped_restore(self) -> bool:
        """A restore whose RAM is the snapshot's file (x-ignore-shared on both sides)."""
        m = self.machine
        return self.restore is not None and m.memory_file is not None and not m.memory_shared

    def with_volumes(self, volumes: tuple[Volume, ...]) -> VmSpec:
        return attrs.evolve(self, machine=attrs.evolve(self.machine, volumes=volumes))

    def with_fs_tags(self, tags: tuple[str, ...]) -> VmSpec:
        return attrs.evolve(self, machine=attrs.evolve(self.machine, fs_tags=tags))


def load_spec(data: Any) -> VmSpec:
    """A VmSpec as a life record holds it (:func:`actors.model.dump`). A record an
    earlier supervisor wrote (``serve --keep-sandboxes``, then an upgrade) has the
    flat form, :meth:`VmSpec.of`'s arguments with ``machine`` the machine type: read as
    that supervisor derived its machine."""
    if isinstance(data, dict) and not isinstance(data.get("machine", {}), dict):
        d = dict(data)
        own = {k: d.pop(k) for k in ("restore", "boot_timeout", "answer_timeout", "name") if k in d}
        network = load_value(d.pop("network", None), NetConfig | None)  # type: ignore[arg-type]
        chain, disk = d.pop("chain", None), d.get("disk")
        if chain is None and disk is not None:
            chain = [str(p) for p in backing_chain(Path(disk))]
        d["memory_file"], d["memory_shared"] = d.pop("ram", None), d.pop("ram_shared", True)
        d.update(disk_chain=chain or [], netdev=list(netdev_args(network)), incoming=own.get("restore") is not None)
        data = {"machine": d, **own}
    return load_value(data, VmSpec)


@attrs.define
class Guest:
    """A booted VM: its machine, its channel, and boot timestamps (monotonic seconds)."""

    machine: Machine
    channel: GuestChannel
    t_launch: float
    t_qmp: float
    t_ready: float
    t_loaded: float = 0.0  # a restore: when the saved state was in
    t_connected: float = 0.0  # the guest channel's socket connected (Hello sent after)


@attrs.frozen
class Attach:
    """Where and how a life's VM comes up, beyond its spec (what it names is the
    caller's): its placement (sockets, log, a jail to spawn into), more descriptors
    for QEMU (RAM, taps), who is told QEMU's pid at once, or a running QEMU to adopt
    (with its recorded block graph)."""

    placement: Placement
    fds: dict[str, int] = attrs.field(factory=dict)
    on_spawned: Callable[[int, int], None] | None = None
    adopt: AdoptedProcess | None = None
    disk_top: str = "disk0"
    staged: int = 0
    # the saved state (``spec.restore``) opened already, the caller's: what a restore
    # loads when its snapshot may change under it (a conversion replaces the file)
    restore_fd: int = -1
    # a restore's fix-ups (identity, network): requests sent right behind the Hello,
    # answered in the same wakeup of the guest (GuestChannel.post); done before the
    # guest is yielded. None on the legacy path (the caller sends them after).
    fixups: Callable[[GuestChannel], Awaitable[None]] | None = None


@asynccontextmanager
async def booted_guest(spec: VmSpec, where: Path | Attach) -> AsyncIterator[Guest]:
    """Bring a VM up from ``spec`` (a run dir, or an :class:`Attach`), yield it once
    guestd said hello, and power it off through the ladder however the block ends --
    unless its machine was detached (then QEMU runs on). Adopting a running QEMU
    reconnects QMP, the console and the guest channel (guestd resyncs on the new
    hello; its processes ran on)."""
    at = where if isinstance(where, Attach) else Attach(Placement.plain(where))
    if at.adopt is not None:
        vm = Machine.adopt(spec.machine, at.placement, at.adopt, name=spec.name)
        vm.resume_life_state(at.disk_top, at.staged)
    else:
        vm = Machine(spec.machine, at.placement, name=spec.name, fds=at.fds, on_spawned=at.on_spawned)
    adopted = at.adopt is not None
    own_fd = -1
    if spec.restore is not None and not adopted and not legacy_restore():
        # QEMU loads the saved state as it starts (-incoming fd:), no QMP round trip
        if at.restore_fd < 0:
            try:
                own_fd = os.open(spec.restore, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise LaunchError(f"cannot open the saved state {spec.restore}: {exc.strerror}") from None
        vm.restore_fd = at.restore_fd if at.restore_fd >= 0 else own_fd
    try:
        async with _running(
            vm, time.monotonic(), spec, adopted=adopted, restore_fd=at.restore_fd, fixups=at.fixups
        ) as guest:
            yield guest
    finally:
        if own_fd >= 0:
            os.close(own_fd)


@asynccontextmanager
async def _running(
    vm: Machine,
    t0: float,
    spec: VmSpec,
    *,
    adopted: bool = False,
    restore_fd: int = -1,
    fixups: Callable[[GuestChannel], Awaitable[None]] | None = None,
) -> AsyncIterator[Guest]:
    boot_timeout = (spec.answer_timeout or 15.0) if adopted else spec.boot_timeout
    with collapse_single():
        async with trio.open_nursery() as nursery:
            await nursery.start(vm.run)
            t_qmp = time.monotonic()
            try:
                t_loaded = 0.0
                stream = None
                with trio.CancelScope() as boot_scope:

                    async def watch_exit() -> None:
                        await vm.wait()
                        boot_scope.cancel()

                    nursery.start_soon(watch_exit)
                    stream = vm.take_guest_stream() or await connect_guest_socket(vm.guest_socket, pid=vm.pid)
                t_connected = time.monotonic()
                if stream is None or vm.exited:
                    if stream is not None:  # connected as QEMU exited: ours to close
                        await trio.aclose_forcefully(stream)
                    raise BootError(f"QEMU exited during boot: {vm.describe_exit()}", vm.console.text())
                if adopted:
                    # a supervisor killed in a fork's live copy left its migration under
                    # way, or its guest stopped at the switchover: it is let go first
                    await vm.abandon_migration()
                if adopted and await vm.status() != "running":
                    # a supervisor killed in a pause left its guest stopped,
                    # saved; the record still said ready: it runs on (the pause never was)
                    await vm.qmp_execute("cont")
                fed = spec.restore is not None and not adopted and vm.restore_fd >= 0  # loading already
                if spec.restore is not None and not adopted and not fed:
                    # connected first: the port's host side is open as the state loads, as
                    # the stream recorded it, so the resumed guest handles no close and
                    # reopen of its port before the hello (measured: below)
                    try:
                        await _load(vm, spec.restore, ignore_shared=spec.mapped_restore, fd=restore_fd)
                    except BaseException:
                        await trio.aclose_forcefully(stream)
                        raise
                    t_loaded = time.monotonic()
                async with open_channel(stream, hello_timeout=None, answer_timeout=spec.answer_timeout) as chan:
                    with trio.CancelScope() as hello_scope:

                        async def watch_exit_hello() -> None:
                            await vm.wait()
                            hello_scope.cancel()

                        nursery.start_soon(watch_exit_hello)

                        load_errors: list[BootError] = []

                        async def load() -> None:
                            # A failed load is the reason: recorded and the hello's wait
                            # ended, not raised beside the channel's own break (QEMU
                            # exiting resets QMP and the channel at once: a group of two
                            # that the template fallback would not see as a BootError).
                            nonlocal t_loaded
                            try:
                                await vm.loaded()
                            except MachineError as exc:
                                if vm.exited:  # said below, with QEMU's exit (the hello scope is cancelled)
                                    return
                                load_errors.append(BootError(f"restore failed: {exc}", vm.console.text()))
                                steps.cancel_scope.cancel()
                                return
                            t_loaded = time.monotonic()

                        fix_errors: list[Exception] = []

                        async def fix(fixups: Callable[[GuestChannel], Awaitable[None]]) -> None:
                            try:
                                await fixups(chan)
                            except Exception as exc:  # raised after the load and the hello, which say why first
                                fix_errors.append(exc)

                        try:
                            # the Hello (and the fix-ups behind it) wait in the socket
                            # while the state loads: the guest reads them as it runs
                            await chan.send_hello()
                            with collapse_single():
                                async with trio.open_nursery() as steps:
                                    if fed:
                                        steps.start_soon(load)
                                    if fixups is not None:
                                        steps.start_soon(fix, fixups)
                                    await chan.wait_hello(boot_timeout)
                            if load_errors:
                                raise load_errors[0]
                            if fix_errors and not vm.exited:
                                raise fix_errors[0]
                        except HelloTimeout:
                            raise BootTimeout(
                                f"guest did not become ready within {boot_timeout:g}s", vm.console.text()
                            ) from None
                        except ChannelBroken as exc:
                            # the guest's end closed before its hello: QEMU is exiting
                            # (a load it refused says why first)
                            if load_errors:
                                raise load_errors[0] from None
                            raise BootError(f"the guest channel broke during boot: {exc}", vm.console.text()) from None
                    if chan.hello_info is None:
                        raise BootError(f"QEMU exited during boot: {vm.describe_exit()}", vm.console.text())
                    guest = Guest(vm, chan, t0, t_qmp, time.monotonic(), t_loaded, t_connected)
                    try:
                        yield guest
                    finally:
                        await vm.shutdown(
                            ask=chan.shutdown if not chan.broken else None, ask_timeout=spec.poweroff_grace
                        )
            finally:
                await vm.shutdown()
                nursery.cancel_scope.cancel()


async def _load(vm: Machine, vmstate: Path, *, ignore_shared: bool, fd: int = -1) -> None:
    """Load ``vmstate`` (or ``fd``, the caller's descriptor of it) and let the guest run."""
    own = fd < 0
    if own:
        try:
            fd = os.open(vmstate, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise LaunchError(f"cannot open the saved state {vmstate}: {exc.strerror}") from None
    try:
        await vm.migrate_from_fd(fd, ignore_shared=ignore_shared)
    except MachineError as exc:
        raise BootError(f"restore failed: {exc}; {vm.describe_exit() if vm.exited else ''}") from None
    finally:
        if own:
            os.close(fd)
