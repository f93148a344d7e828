"""One VM life of a sandbox: everything one run of a QEMU holds, freed in one place.

A sandbox's life is said by a :data:`~actors.sandboxes.plans.Plan`::

    Boot(template=...)        a fresh boot (or its disk again, after a Stop); at the
                              first ready, before any caller's work, ``template`` may
                              save it as its configuration's boot template
    Resume(snapshot, fallback) a restore of a snapshot; a boot template that does
                              not restore is reported to ``fallback`` and the sandbox
                              boots instead (a second Life)
    Adopt(life, proc)         a QEMU a previous supervisor started, still running
    AwaitTemplate(resolve)    another boot is making this configuration's template:
                              wait for it, then Resume or Boot (the sandbox resolves it)

A :class:`Life` (``Life.boot``, ``Life.resume``, ``Life.adopt``) is an async context
manager. Entering it brings the guest up: the disk (a new overlay's chain recorded
first), the run dir, the volume claims, the host link (TAP or uplink, egress filter
and DNS registration), the cell (jail, cgroup, identity), the guest RAM (a fresh
file, or a snapshot's memory: sealed in a cell), QEMU through ``Settings.launch``
(:func:`~actors.machines.vm.booted_guest`: the Machine and the guest channel), a restored
clone's fresh identity and network, and the nursery of its port relays
(:class:`~actors.net.ports.PortRelays`). It owns all of that until :meth:`Life._teardown`
frees it, in one place, shielded, whatever happened (a failed bring-up included)::

    relays cancelled -> QEMU (ask, quit, TERM, KILL; reaped) or, detached, let go
      -> state stream and RAM descriptors (sealed memory back to the cache)
      -> link (closed; detached: kept for the next supervisor)
      -> cell, run dir, the record's life (not when detached)
      -> volume claims (checked after the reap; detached: released unchecked)

The sandbox (:class:`~actors.sandboxes.sandbox.Sandbox`) keeps the state machine, the events
and the handle's operations, and holds its current Life.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Protocol

import attrs
import trio

from actors import defaults, hostdirs, image_disks
from actors._groups import collapse_single
from actors.cells.cell import Cell
from actors.cells.guestmem import own_memory
from actors.channel.guest import CLOCK_STALE_S, GuestChannel, GuestError, GuestOpError, GuestTimeout
from actors.crash import crash_point
from actors.errors import (
    AlreadyExists,
    DeadlineExceeded,
    DomainError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from actors.machines.disk import backing_chain, grow_overlay, virtual_size
from actors.machines.machine import Placement
from actors.machines.qemuproc import UNKNOWN_EXIT, MachineError, legacy_restore
from actors.machines.qemuspec import Volume
from actors.machines.vm import TAP_FD, Attach, BootError, Guest, NetConfig, VmSpec, load_spec
from actors.model import Action, Cause, Ending, Limits, MemoryKind, PortSpec, SandboxConfig
from actors.model import dump as dump_value
from actors.net import netlink
from actors.net.egress import EgressPolicy
from actors.net.hostnet import SandboxLink
from actors.net.ports import PortRelays
from actors.quotas import check_sandbox_disk
from actors.sandboxes import secrets, usage
from actors.sandboxes.diskerrors import DiskErrors
from actors.sandboxes.files import SandboxFiles
from actors.sandboxes.logs import SandboxLog
from actors.sandboxes.oomkills import GuestOoms, oom_death
from actors.sandboxes.paused import PauseHold
from actors.sandboxes.plans import Adopt, Boot, Resume
from actors.sandboxes.savedstate import memory_for_restore, resume_spec
from actors.sandboxes.sessions import HeldSessions
from actors.settings import Settings
from actors.store import LifeState, Record, SnapshotRecord
from actors.volumes import Volumes
from guestd import proto

RESTORE_HELLO_TIMEOUT = 15.0  # a restored guest answers in ~0.1 s; one that does not in 15 s will not

_GUEST_CODES: dict[str, type[DomainError]] = {
    proto.E_NOT_FOUND: NotFound,
    proto.E_INVALID: InvalidArgument,
    proto.E_IS_DIR: InvalidArgument,
    proto.E_PERM: FailedPrecondition,
    proto.E_TOO_LARGE: ResourceExhausted,
    proto.E_EXISTS: AlreadyExists,
    proto.E_FAILED: FailedPrecondition,
    proto.E_UNSUPPORTED: Unimplemented,
}


def guest_error(exc: GuestError) -> DomainError:
    """A guest-channel error in the domain's terms."""
    if isinstance(exc, GuestOpError):
        return _GUEST_CODES.get(exc.code, Internal)(exc.message)
    if isinstance(exc, GuestTimeout):
        return DeadlineExceeded(f"sandbox guest: {exc}")
    return Unavailable(f"sandbox guest unavailable: {exc}")


class LifeOwner(Protocol):
    """What a life uses of its sandbox (the Sandbox is one; this module does not import
    it): what it is (read), where its files and log are, what it held while paused,
    and the record changes a life makes, which the sandbox writes."""

    record: Record
    settings: Settings
    files: SandboxFiles
    volumes: Volumes | None
    log: SandboxLog

    @property
    def id(self) -> str: ...

    @property
    def config(self) -> SandboxConfig: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def hostname(self) -> str: ...

    @property
    def network(self) -> NetConfig | None: ...

    @property
    def egress(self) -> EgressPolicy: ...

    @property
    def timings(self) -> dict[str, float]: ...

    def emit(self, action: Action, **attributes: str) -> None: ...

    @property
    def held(self) -> PauseHold: ...

    def note_pid(self, pid: int) -> None: ...

    def note_life(self, life: LifeState) -> None: ...

    def note_life_ended(self) -> None: ...

    async def note_chain(self, chain: list[str]) -> None: ...

    def note_ports(self, ports: list[PortSpec]) -> None: ...


class Life:
    """One run of a QEMU for ``sb``. ``async with Life.boot(sb, plan) as life:`` the
    guest is up (``life.guest``) and serves the block; everything is freed after."""

    def __init__(self, sb: LifeOwner, plan: Boot | Resume | Adopt) -> None:
        self.sb = sb
        self.plan = plan
        self.guest: Guest | None = None  # set once the guest is this sandbox's (after a restore's fixups)
        self.cell: Cell | None = None  # its jail, cgroup, identity
        self.link: SandboxLink | None = None  # its host link (tap; a jail's uplink)
        self.ports: PortRelays | None = None  # its forwards and relays, while the guest is up
        self.secrets: secrets.SecretsOfLife | None = None  # its secret proxy (a sandbox with secrets)
        self.sessions: HeldSessions | None = None  # its detachable exec sessions, while the guest is up
        self.detaching = False  # it lets go of QEMU instead of stopping it
        self.pausing = False  # it ends for a pause: the volume claims stay
        self.guest_hostname = ""  # what the fixups last set in its guest
        self._launched: Guest | None = None
        self._ram_fd = -1  # the guest RAM's descriptor for QEMU (a cell's), until QEMU maps it
        self._sealed = ""  # the snapshot whose sealed memory that descriptor is
        self._state_fd = -1  # a restore's saved state, until loaded
        self._shares: hostdirs.Shares | None = None  # its host directories' servers (in its stack)
        self.cpu = usage.CpuMeter()  # QEMU's CPU use between two looks (Metrics)
        self.memory = usage.MemorySplit()  # its pages shared and its own (Inspect)
        self._fixed = False  # a restore's fix-ups came with its hello (Attach.fixups)
        self._stack = AsyncExitStack()  # its scope, _release, QEMU (the launcher's block), the relays' nursery
        self.ooms = GuestOoms(sb.emit)  # the guest's own OOM kills (guestd's reports), its oom_kill events
        # its disks' I/O errors (QEMU's BLOCK_IO_ERROR), its disk_error events
        self.disk_errors = DiskErrors(sb.emit, [m.name for m in sb.config.volumes])
        self._scope = trio.CancelScope()

    @classmethod
    def boot(cls, sb: LifeOwner, plan: Boot) -> Life:
        """A fresh boot, or the sandbox's disk booted again."""
        return cls(sb, plan)

    @classmethod
    def resume(cls, sb: LifeOwner, plan: Resume) -> Life:
        """A restore of ``plan.snapshot``, made this sandbox's (identity, network)."""
        return cls(sb, plan)

    @classmethod
    def adopt(cls, sb: LifeOwner, plan: Adopt) -> Life:
        """A running QEMU a previous supervisor left, reconnected."""
        return cls(sb, plan)

    @classmethod
    def of(cls, sb: LifeOwner, plan: Boot | Resume | Adopt) -> Life:
        if isinstance(plan, Adopt):
            return cls.adopt(sb, plan)
        if isinstance(plan, Resume):
            return cls.resume(sb, plan)
        return cls.boot(sb, plan)

    # -- the context manager -------------------------------------------------------------
    async def __aenter__(self) -> Life:
        # the life's own scope, outermost: its teardown shields it (nothing stops the ladder)
        self._scope = self._stack.enter_context(trio.CancelScope())
        self._stack.push_async_callback(self._release)  # last out: after QEMU is reaped
        try:
            with collapse_single():
                if isinstance(self.plan, Adopt):
                    guest = await self._reconnect(self.plan)
                else:
                    guest = await self._launch(self.plan)
                guest.channel.on_oom_kill = self.ooms.report  # (an adopted guest's too)
                nursery = await self._stack.enter_async_context(trio.open_nursery())
                self._stack.callback(nursery.cancel_scope.cancel)  # (first out: the relays end)
                self.sessions = HeldSessions(nursery)  # (they end with the relays)
                nursery.start_soon(self._watch_disks, guest)
                jailed = self.cell is not None
                held = self.sb.held.take_port  # a resumed sandbox's listeners
                self.ports = PortRelays(
                    self.sb.settings, guest, self.sb.network, jailed=jailed, nursery=nursery, held=held
                )
                if self.sb.config.secrets and self.link is not None:  # its proxy, before the guest runs anything
                    self.secrets = secrets.SecretsOfLife(self.sb, self.link)
                    await nursery.start(self.secrets.run)
                if isinstance(self.plan, Resume):
                    await self._restored(guest, self.plan)
                crash_point("hello")
                self.guest = guest
                self._record_timings(guest)
                self.sb.note_pid(guest.machine.pid or 0)
        except BaseException:
            await self._teardown(*sys.exc_info())
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool:
        return await self._teardown(et, ev, tb)

    async def _teardown(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool:
        """The one ladder (see the module's docstring), shielded: the relays end, QEMU
        is stopped and reaped (``Settings.launch``'s block; or let go, detached), then
        :meth:`_release` frees what it held."""
        self._scope.shield = True
        suppress = False
        with collapse_single():
            suppress = bool(await self._stack.__aexit__(et, ev, tb))
        return suppress

    async def _release(self) -> None:
        """What the life held beside QEMU, once QEMU is gone: every step runs whatever
        the one before it raised (the first error is raised at the end)."""
        self.guest = self._launched = None
        self.ports = None
        self.sessions = None
        errors: list[Exception] = []
        for step in (self._close_descriptors, self._close_link, self._close_cell):
            try:
                step()
            except Exception as exc:
                errors.append(exc)
        try:
            await self._release_volumes()
        except Exception as exc:
            errors.append(exc)
        if errors:
            raise errors[0]

    def detach(self) -> None:
        """Let go of QEMU instead of stopping it: it runs on, with its link, cell and
        volumes, for the next supervisor."""
        self.detaching = True
        if self._launched is not None:
            self._launched.machine.detach()

    def _close_descriptors(self) -> None:
        if self._state_fd >= 0:
            os.close(self._state_fd)
            self._state_fd = -1
        self._release_ram()

    def _close_link(self) -> None:
        link, self.link = self.link, None
        if link is None:
            return
        if self.pausing and link.tap_fd is not None and not link.closed:
            self.sb.held.hold_link(link)  # paused: the TAP stays, its queue holds what comes for the guest
            return
        link.detach() if self.detaching else link.close()

    def _close_cell(self) -> None:
        """The cell, the run dir, the record's life (kept when detached: QEMU runs on)."""
        sb = self.sb
        cell, self.cell = self.cell, None
        if self.detaching:
            return
        if cell is not None:
            cell.close()
        sb.files.end_life()
        sb.note_life_ended()

    # -- bringing a guest up -------------------------------------------------------------
    async def _launch(self, plan: Boot | Resume) -> Guest:
        sb = self.sb
        s, files = sb.settings, sb.files
        own = Path(sb.config.boot.rootfs) if sb.config.boot.rootfs else None
        if own is not None:  # a caller's file, checked at every life: it may have changed since
            # no backing or data file: its header names nothing we open (a vmdk...: its conversion)
            own = await image_disks.attach(s, own)
        # a new overlay's chain is on disk before the overlay: a crash in between
        # leaves a chain without its disk (the next start makes a fresh one), never a
        # disk standing on layers its record does not name
        from_snapshot = plan.snapshot if isinstance(plan, Resume) else plan.disk_of
        if from_snapshot is not None:
            await self._record_chain([str(p) for p in from_snapshot.layers])
            await files.overlay_on(from_snapshot.disk)
        elif not files.disk.exists():
            base = own or self._base()
            size, below = virtual_size(base), () if own is not None else backing_chain(base)  # ours: trusted
            recs = sb.volumes.records if sb.volumes is not None else {}
            rw = [(m.name, recs[m.name].size_bytes) for m in sb.config.volumes if not m.read_only and m.name in recs]
            check_sandbox_disk(s.max_sandbox_disk_mib, max(size, sb.limits.disk_mib << 20), rw)
            await self._record_chain([str(base), *map(str, below)])
            await files.overlay_on(base)
        if not isinstance(plan, Resume) and sb.limits.disk_mib:
            # --disk-size (Create, or Modify of a stopped sandbox): grown before QEMU opens it
            await grow_overlay(files.disk, sb.limits.disk_mib << 20)
        sb.timings["disk_ready"] = time.monotonic()
        run_dir = files.new_run_dir()
        volumes = self._claim_volumes()
        held = sb.held.take_link() if isinstance(plan, Resume) and plan.wake else None  # paused: its TAP
        if held is not None:
            self.link, uplink = held, None
        else:
            self.link, uplink = netlink.open_link(s, sb.config.network, sb.record.uid, run_dir)
        fds: dict[str, int] = {}
        if self.link is not None and self.link.tap_fd is not None:
            fds[TAP_FD] = self.link.tap_fd  # (the link keeps it; QEMU gets its own copy)
        if s.cells is not None:
            self.cell = s.cells.open(
                sb.record.uid[:18], run_dir, memory_mib=self.boot_memory_mib(plan), vcpus=sb.limits.vcpus, uplink=uplink
            )
        cell = self.cell
        sb.timings["cell_ready"] = time.monotonic()
        if isinstance(plan, Resume):
            # the snapshot as it is now, and its stream opened, in this one step: a
            # conversion may switch the record (and unlink the old stream) after it
            self._state_fd = self._open_state(plan.snapshot)
        ram, shared = await self._ram(plan)
        sb.timings["ram_ready"] = time.monotonic()
        if self._ram_fd >= 0:
            fds["ram"] = self._ram_fd
        spec = self._vm_spec(plan, ram, shared).with_volumes(volumes)
        if sb.config.init is not None:  # the init's shutdown (actors/sandboxes/handoff.py)
            spec = attrs.evolve(spec, poweroff_grace=defaults.INIT_POWEROFF_GRACE)
        if sb.config.host_mounts:
            fds.update(await self._share_dirs(plan))
            spec = spec.with_fs_tags(tuple(hostdirs.tag(i) for i in range(len(sb.config.host_mounts))))
        placement = (
            Placement(sock_dir=cell.sock_dir, qemu_dir=cell.qemu_dir, log=run_dir / "qemu.log", spawn=cell.spawn)
            if cell is not None
            else Placement.plain(run_dir)
        )

        def spawned(pid: int, started: int) -> None:
            sb.note_pid(pid)
            sb.note_life(
                LifeState(
                    pid=pid,
                    start_time=started,
                    run_dir=str(run_dir),
                    sock_dir=str(placement.sock_dir),
                    uid=cell.identity.uid if cell is not None else 0,
                    cgroup=cell.name if cell is not None and cell.cgroup is not None else "",
                    jail_root=str(cell.spec.root) if cell is not None else "",
                    ram=str(ram) if ram is not None and shared else "",
                    spec=dump_value(spec),
                )
            )

        pipelined = isinstance(plan, Resume) and not legacy_restore()
        at = Attach(
            placement, fds, on_spawned=spawned, restore_fd=self._state_fd, fixups=self._fixups if pipelined else None
        )
        try:
            guest = self._launched = await self._stack.enter_async_context(s.launch(spec, at))
        except (BootError, MachineError) as exc:
            if self._shares is not None and self._shares.failure:  # QEMU failed because a server did
                raise MachineError(self._shares.failure) from exc
            raise
        self._release_ram()  # QEMU has its own mapping now
        if self._state_fd >= 0:
            os.close(self._state_fd)  # (loaded)
            self._state_fd = -1
        return guest

    async def _share_dirs(self, plan: Boot | Resume) -> dict[str, int]:
        """The life's host directories, each served by virtiofsd in a cell (in a nursery
        of the life's stack, cancelled after QEMU is gone); QEMU's ends of their sockets."""
        sb = self.sb
        s, mounts = sb.settings, sb.config.host_mounts
        if isinstance(plan, Resume):
            raise FailedPrecondition("a snapshot of a sandbox with host directories cannot be restored (virtio-fs)")
        tools = hostdirs.servers(s)
        for m in mounts:  # at every life: a directory may have gone or changed since the Create
            hostdirs.check_host_dir(m.source, s.allowed_paths, writable=m.writable)
        shares = self._shares = hostdirs.Shares(mounts, lambda text: sb.log.append("system", text.encode()))
        nursery = await self._stack.enter_async_context(trio.open_nursery())
        self._stack.callback(nursery.cancel_scope.cancel)  # (after QEMU: it was entered before)
        self._stack.callback(shares.close)
        return await shares.open(tools, nursery)

    async def _watch_disks(self, guest: Guest) -> None:
        """QEMU's reports of the disk requests it failed, for the life (disk_error events)."""
        with guest.machine.events() as events:
            await self.disk_errors.watch(events)

    async def _reconnect(self, plan: Adopt) -> Guest:
        """Reconnect to a QEMU a previous supervisor started (its cell, sockets, guest)."""
        sb = self.sb
        life, cells = plan.life, sb.settings.cells
        run_dir = Path(life.run_dir)
        if life.uid and cells is not None:
            self.cell = cells.reopen(sb.record.uid[:18], run_dir, life.uid, life.ram)
        placement = Placement(sock_dir=Path(life.sock_dir), log=run_dir / "qemu.log")
        spec = load_spec(life.spec)
        if sb.volumes is not None and sb.config.volumes:
            sb.volumes.claim(sb.record.uid, sb.id, sb.config.volumes, adopted=True)
        self.link = netlink.readopt_link(sb.settings, sb.config.network, sb.record.uid)
        at = Attach(placement, adopt=plan.proc, disk_top=life.disk_top, staged=life.staged)
        guest = self._launched = await self._stack.enter_async_context(sb.settings.launch(spec, at))
        return guest

    async def _restored(self, guest: Guest, plan: Resume) -> None:
        """A restored clone made this sandbox's, before anyone sees it."""
        sb = self.sb
        sb.timings["restored"] = time.monotonic()
        what = "the boot template" if plan.fallback is not None else f"snapshot {plan.snapshot.id}"
        how = "mapped" if sb.timings.get("mapped") else "streamed"
        sb.log.append("system", f"restored from {what} (memory {how})".encode())
        # the hello set the clock, but a restored vCPU busy on a loaded host answers it
        # late (a clone 4.4 s behind at load 38): then it is set again
        if self._fixed:  # the rest came with the hello (_fixups)
            if guest.channel.clock_stale:
                try:
                    await guest.channel.set_clock()
                except GuestError as exc:
                    raise MachineError(f"post-restore fixups failed: {exc}") from None
            return
        await self.fresh_identity(guest, clock=guest.channel.clock_stale)
        await netlink.configure_guest_net(guest, sb.network)

    async def _fixups(self, chan: GuestChannel) -> None:
        """A restored clone's identity (entropy, hostname) and tap network, sent right
        behind the Hello (Attach.fixups): answered in the guest's same wakeup, no
        round trip of their own. The clock is the Hello's (set again after it if its
        answer came late: _restored)."""
        builds = self.identity_requests(clock=False)
        net = self.sb.network
        if net is not None and net.tap:
            builds.append(
                lambda rid: proto.NetConfig(
                    rid=rid, address=net.address, prefix=net.prefix, gateway=net.gateway, dns=[net.dns], mac=net.mac
                )
            )
        answers = await chan.post(builds)
        try:
            await answers()
        except GuestError as exc:
            raise MachineError(f"post-restore fixups failed: {exc}") from None
        self.guest_hostname = self.sb.hostname
        self._fixed = True

    async def _record_chain(self, chain: list[str]) -> None:
        await self.sb.note_chain(chain)

    def _base(self) -> Path:
        """The read-only root filesystem a fresh boot's overlay stands on."""
        sb = self.sb
        if sb.record.image is not None:
            return Path(sb.record.image.rootfs)
        boot = sb.config.boot
        return Path(boot.rootfs) if boot.rootfs else sb.settings.image.rootfs

    def _vm_spec(self, plan: Boot | Resume, ram: Path | None, ram_shared: bool = True) -> VmSpec:
        sb = self.sb
        s, cfg, files = sb.settings, sb.config, sb.files
        limits = sb.limits
        chain = tuple(Path(p) for p in sb.record.chain)
        if isinstance(plan, Resume):
            return resume_spec(
                plan.snapshot,
                s,
                disk=files.disk,
                chain=chain,
                ram=ram,
                ram_shared=ram_shared,
                network=sb.network,
                name=sb.hostname,
                boot_timeout=min(s.boot_timeout, RESTORE_HELLO_TIMEOUT),
                answer_timeout=s.guest_timeout,
                # a balloon on the snapshot's memory, mapped privately (a sealed memfd, or a
                # paused sandbox's own file, which the shim never lets QEMU punch: _ram)
                preload=s.cells.discard_shim if plan.snapshot.machine.balloon and not ram_shared and s.cells else None,
            )
        return VmSpec.boot(
            s.image,
            disk=files.disk,
            chain=chain,
            accel=s.accel,
            hostname=sb.hostname,
            network=sb.network,
            # the vCPUs above the value stay offline from boot (Modify brings them online)
            extra_cmdline=" ".join(
                x
                for x in (
                    cfg.boot.boot_args,
                    f"maxcpus={limits.vcpus}" if limits.vcpu_ceiling > limits.vcpus else "",
                    f"sandvisor.rootfstype={cfg.boot.rootfs_fstype}" if cfg.boot.rootfs_fstype else "",
                )
                if x
            ),
            kernel=Path(cfg.boot.kernel) if cfg.boot.kernel else None,
            cpus=limits.vcpu_ceiling,
            memory_mib=self.boot_memory_mib(plan),
            user=None if s.cells is not None else s.qemu_user,
            ram=ram,
            boot_timeout=s.boot_timeout,
            answer_timeout=s.guest_timeout,
            balloon=s.balloon,
            tb_size_mib=s.tb_size_mib,
        )

    async def _ram(self, plan: Boot | Resume) -> tuple[Path | None, bool]:
        """The life's guest RAM: (file, shared). A fresh shared file (a boot, a streamed
        restore), or a mapped snapshot's memory, privately. In a cell both go to QEMU
        by descriptor (``fds["ram"]``, held until QEMU maps it): the RAM file is the cell identity's own; the
        snapshot's memory a sealed memfd nobody can write."""
        sb, cell = self.sb, self.cell
        s, files = sb.settings, sb.files
        size = self.boot_memory_mib(plan)
        if isinstance(plan, Resume) and plan.snapshot.memory == MemoryKind.MAPPED:
            snap = plan.snapshot
            if cell is not None and plan.wake:
                # a paused sandbox's own saved memory, read by this resume alone (no clone
                # shares it, and no other jail can reach it): mapped privately from the
                # file itself, loaded by page faults -- not first copied into a memfd
                self._ram_fd = own_memory(snap.path / "memory", cell.identity)
                return snap.path / "memory", False
            if cell is not None:
                # (a fill copies the file: in a worker thread; restores side by side share one)
                self._ram_fd = await trio.to_thread.run_sync(cell.cells.sealed.acquire, snap.id, snap.path / "memory")
                self._sealed = snap.id
                return snap.path / "memory", False
            if snap.machine.balloon:
                # QEMU 7.2 would punch the balloon's free pages into the snapshot's file
                raise FailedPrecondition(
                    f"snapshot {snap.id} has a balloon: it restores only in a jail (a root supervisor), "
                    "where its memory is sealed"
                )
            return memory_for_restore(snap.path, files.run_dir, s.qemu_user), False
        if s.memory_dir is None:
            return None, True
        if cell is not None:
            path, self._ram_fd = cell.make_ram(size)
            return path, True
        return files.make_ram(size, s.qemu_user), True

    def boot_memory_mib(self, plan: Boot | Resume) -> int:
        """The machine's RAM: a snapshot's, or the memory ceiling (the balloon gives the
        guest its value: docs/modify.md); without a balloon, the value."""
        if isinstance(plan, Resume):
            return plan.snapshot.machine.memory_mib
        limits = self.sb.limits
        return limits.memory_ceiling if self.sb.settings.balloon else limits.memory_mib

    def _release_ram(self) -> None:
        fd, self._ram_fd = self._ram_fd, -1
        if fd < 0:
            return
        if self._sealed and self.cell is not None:
            self.cell.cells.sealed.release(self._sealed, fd)
        else:
            os.close(fd)
        self._sealed = ""

    def _open_state(self, snap: SnapshotRecord) -> int:
        """``snap``'s stream, opened; its memory kind goes into the timings ("mapped":
        1, or 0 for a streamed restore: RAM read from the stream)."""
        try:
            fd = os.open(snap.path / snap.vmstate, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise BootError(f"cannot open the saved state of snapshot {snap.id}: {exc.strerror}") from None
        self.sb.timings["mapped"] = 1.0 if snap.memory == MemoryKind.MAPPED else 0.0
        return fd

    def _claim_volumes(self) -> tuple[Volume, ...]:
        """This life's named volumes (FAILED_PRECONDITION when one is gone or busy)."""
        sb = self.sb
        mounts = sb.config.volumes
        if not mounts:
            return ()
        if sb.volumes is None:
            raise FailedPrecondition("this supervisor has no volumes")
        woken = isinstance(self.plan, Resume) and self.plan.wake  # claimed since before its pause
        return sb.volumes.claim(sb.record.uid, sb.id, mounts, adopted=woken)

    async def _release_volumes(self) -> None:
        """After the reap (or the detach: QEMU runs on with them, the claims go with us)."""
        sb = self.sb
        if sb.volumes is None:
            return
        if self.detaching:
            sb.volumes.release(sb.record.uid)
            return
        if self.pausing:  # a paused guest has them mounted: they stay claimed (checked at its end)
            return
        for note in await sb.volumes.release_checked(sb.record.uid):
            sb.log.append("system", note.encode())

    def _record_timings(self, guest: Guest) -> None:
        """Host and guest milestones on one clock. The guest reports seconds since its
        kernel started; the hello's arrival anchors that clock to ours."""
        info = guest.channel.hello_info
        t = {"spawned": guest.t_launch, "qmp_ready": guest.t_qmp, "hello": guest.t_ready}
        if guest.t_connected:
            t["connected"] = guest.t_connected
        if guest.t_loaded:
            t["loaded"] = guest.t_loaded  # a restore: the guest's boot marks are the origin's
        elif info is not None:
            kernel_start = guest.t_ready - info.ready_ns / 1e9
            t["kernel_started"] = kernel_start
            for mark in ("init", "modules", "rootfs", "python"):
                if mark in info.marks:
                    t[f"guest_{mark}"] = kernel_start + info.marks[mark]
        self.sb.timings.update(t)

    # -- what the sandbox does with its guest ----------------------------------------------
    async def fresh_identity(self, guest: Guest, *, clock: bool) -> None:
        """What a clone must not share with its snapshot: the clock (host time), the
        kernel's CRNG (reseeded with fresh host entropy, else every clone reads the
        same /dev/urandom stream), the hostname. The requests go out together and the
        guest answers them in one wakeup: one round trip, not three (a pool acquire
        is little else)."""
        ch = guest.channel
        hostname = self.sb.hostname
        calls: list[Callable[[], Awaitable[object]]] = [functools.partial(ch.add_entropy, 256)]
        if clock:
            calls.append(ch.set_clock)
        rename = hostname != self.guest_hostname  # a pool member adopted as is keeps its own
        if rename:
            calls.append(functools.partial(ch.set_hostname, hostname))
        errors: list[GuestError] = []

        async def one(call: Callable[[], Awaitable[object]]) -> None:
            try:
                await call()
            except GuestError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for call in calls:
                nursery.start_soon(one, call)
        if errors:
            raise MachineError(f"post-restore fixups failed: {errors[0]}") from None
        if rename:
            self.guest_hostname = hostname

    def identity_requests(self, *, clock: bool) -> list[Callable[[int], proto.Message]]:
        """:meth:`fresh_identity`'s requests, for GuestChannel.post (the clock's time
        taken as it is sent): fresh entropy, the clock, the hostname if the guest's is
        another."""
        data = os.urandom(256)
        builds: list[Callable[[int], proto.Message]] = [lambda rid: proto.AddEntropy(rid=rid, data=data)]
        if clock:
            builds.append(lambda rid: proto.SetClock(rid=rid, realtime_ns=time.time_ns()))
        hostname = self.sb.hostname
        if hostname != self.guest_hostname:
            builds.append(lambda rid: proto.SetHostname(rid=rid, hostname=hostname))
        return builds

    async def post_identity(self, guest: Guest) -> Callable[[], Awaitable[None]]:
        """A warm pool member handed over: its fresh identity sent, not waited for (what
        the caller does next is behind it on the channel); the answers' waiter, which
        sets the clock again if they came late. MachineError when the guest is gone."""
        ch = guest.channel
        t0 = time.monotonic()
        try:
            answers = await ch.post(self.identity_requests(clock=True))
        except GuestError as exc:
            raise MachineError(f"fixups failed: {exc}") from None
        self.guest_hostname = self.sb.hostname

        async def done() -> None:
            await answers()
            if time.monotonic() - t0 >= CLOCK_STALE_S:
                await ch.set_clock()

        return done

    async def apply_ports(self, *, relays_only: bool = False) -> None:
        """The record's ports, forwarded in this life (host ports filled in)."""
        sb, ports = self.sb, self.ports
        assert ports is not None
        applied = []
        for pm in sb.record.ports:
            try:
                applied.append(await ports.forward(pm, relay_only=relays_only))
            except DomainError as exc:
                sb.log.append("system", f"port {pm.label()}: {exc.message}".encode())
                raise MachineError(f"cannot expose port {pm.sandbox_port}: {exc.message}") from None
        sb.note_ports(applied)

    def update_policy(self) -> None:
        """A warm pool member taken by a Create: the caller's egress policy."""
        netlink.set_policy(self.link, self.sb.egress)

    def death(self, guest: Guest, rc: int) -> Cause:
        """Why QEMU ended on its own: its cgroup's OOM kill, a signal, its exit status,
        or (status 0: the guest asked) a poweroff or a kernel panic (the guest's own OOM
        kill when its init died of it: actors/sandboxes/oomkills.py). The kernel runs with
        ``panic=-1`` and QEMU with ``-no-reboot``, so a panic resets the guest and QEMU
        exits 0 as for a poweroff: the console's panic line, read by the supervisor
        while the guest runs, tells them apart (a guest that prints one and powers off
        only mislabels its own death)."""
        cell = self.cell
        if cell is not None and cell.oom_killed():
            limit = cell.cgroup.stats().memory_limit if cell.cgroup is not None else None
            return Cause(
                Ending.OUT_OF_MEMORY,
                by="cgroup",
                signal=-rc if rc < 0 else None,
                detail=f"memory limit {(limit or 0) >> 20} MiB: guest RAM + {cell.cells.config.overhead_mib} MiB",
            )
        machine = guest.machine
        console = machine.console.text()
        panic = panic_line(console)
        if rc in (0, UNKNOWN_EXIT) and panic:
            # an init that exited because the guest's OOM killer took what it ran: out of memory
            return oom_death(panic, console, self.ooms.recent) or Cause(Ending.GUEST_PANIC, detail=panic)
        said = machine.describe_exit()
        if rc == UNKNOWN_EXIT:  # an adopted QEMU: not our child, its status is unknown
            return Cause(Ending.QEMU_DIED, detail=said)
        said = said.partition(": ")[2]  # (the status is in the cause: what QEMU said last, if anything)
        if rc < 0:
            return Cause(Ending.QEMU_DIED, signal=-rc, detail=said)
        if rc:
            return Cause(Ending.QEMU_DIED, exit_code=rc, detail=said)
        return Cause(Ending.EXITED, exit_code=0)


PANIC_MARK = "Kernel panic - not syncing"


def panic_line(console: str) -> str:
    """The guest kernel's panic line in its console's last output ("" when none)."""
    at = console.rfind(PANIC_MARK)
    if at < 0:
        return ""
    return console[at:].splitlines()[0].strip()[:200]
