"""The sandbox actor: one sandbox, one VM life at a time, the seed's state machine.

State machine (``sandbox.v1``)::

    starting --> ready --> running --> ready      (a workload: the initial cmd or a Run)
       |           |          |
       +-----------+----------+--> stopping --> stopped --(Start)--> starting
       |                                  \\
       +--> failed (boot failed, QEMU died, the guest broke the channel)

Events: created (by the registry), ready, running, idle (exit_code), stopping,
stopped (exit_code), failed (error), removed (by the registry).

Exec sessions do not change the state: they are interactive access beside the
workload, allowed while ready or running, and they count as activity for the idle
timeout. Run on a running sandbox is FAILED_PRECONDITION, as the seed says.

Handle and tasks: the registry owns the actor and calls its methods; a life is
started with :meth:`Sandbox.start`, which runs :meth:`Sandbox.run` in the nursery
it is given, with a :data:`Plan` saying what the life does::

    Boot(template=...)        a fresh boot (or its disk again, after a Stop); at the
                              first ready, before any caller's work, ``template`` may
                              save it as its configuration's boot template
    Resume(snapshot, fallback) a restore of a snapshot; a boot template that does
                              not restore is reported to ``fallback`` and the life
                              boots instead
    AwaitTemplate(resolve)    another boot is making this configuration's template:
                              wait for it (in state starting), then Resume or Boot

``run`` reports started once the life is set up (state "starting"), so Create
returns at once. The actor owns, for one life, the QEMU process and guest channel
(through :func:`~actors.vm.booted_guest`), the run dir and RAM file (through its
:class:`~actors.files.SandboxFiles`, which also holds its disk and log).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from actors.cell import Cell, Uplink
from actors.cgroups import CgroupError, CgroupStats
from actors.crash import crash_point
from actors.disk import backing_chain, check_user_disk, virtual_size
from actors.egress import EgressPolicy
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
)
from actors.events import EventBus
from actors.files import SandboxFiles
from actors.guest import (
    ExecHandle,
    FileReadStream,
    GuestError,
    GuestOpError,
    GuestTimeout,
    PatchEntry,
    TreeReadStream,
)
from actors.hostnet import SandboxLink
from actors.ippool import PoolExhausted, link_name
from actors.machine import AdoptedProcess, MachineError, Placement, Volume
from actors.model import (
    ALIVE,
    ENDED,
    Action,
    Limits,
    MemoryKind,
    NetMode,
    Network,
    PortSpec,
    Protocol,
    SandboxConfig,
    SandboxMetrics,
    State,
    dump,
    is_hidden,
    load,
    script_patches,
)
from actors.netns import NetError, NetNS
from actors.nft import NftError
from actors.portfwd import PortInUse, Target, bind_listener, relay_tcp, relay_udp
from actors.quotas import check_sandbox_disk
from actors.settings import Settings
from actors.snapshot import (
    Checkpoint,
    checkpoint_guest,
    memory_for_restore,
    resume_spec,
    still_running,
)
from actors.store import LifeState, Record, SnapshotRecord, Store
from actors.vm import NETDEV_ID, TAP_FD, Attach, BootError, BootTimeout, Guest, NetConfig, VmSpec
from actors.volumes import Volumes
from guestd import proto as P

READY_FLUSH_TIMEOUT = 5.0  # s: the ready state's commit before READY is announced

log = logging.getLogger("sandvisor.sandbox")
T = TypeVar("T")

_GUEST_CODES: dict[str, type[DomainError]] = {
    P.E_NOT_FOUND: NotFound,
    P.E_INVALID: InvalidArgument,
    P.E_IS_DIR: InvalidArgument,
    P.E_PERM: FailedPrecondition,
    P.E_TOO_LARGE: ResourceExhausted,
    P.E_EXISTS: AlreadyExists,
}
RESTORE_HELLO_TIMEOUT = 15.0  # a restored guest answers in ~0.1 s; one that does not in 15 s will not


def guest_error(exc: GuestError) -> DomainError:
    """A guest-channel error in the domain's terms."""
    if isinstance(exc, GuestOpError):
        return _GUEST_CODES.get(exc.code, Internal)(exc.message)
    if isinstance(exc, GuestTimeout):
        return DeadlineExceeded(f"sandbox guest: {exc}")
    return Unavailable(f"sandbox guest unavailable: {exc}")


class CheckpointLost(MachineError):
    """A checkpoint failed and the guest did not run again: the life cannot go on."""


@attrs.frozen
class Boot:
    """A fresh boot, or a stopped sandbox's disk booted again."""

    accepted: float = 0.0  # monotonic: when the request was accepted (for the timings)
    template: Callable[[Sandbox], Awaitable[None]] | None = None


@attrs.frozen
class Resume:
    """A restore of ``snapshot``. With ``fallback`` (a boot template), a restore that
    fails is reported there and the life boots instead: a Create must not fail on it."""

    snapshot: SnapshotRecord
    accepted: float = 0.0
    # (snapshot, why, transient): transient = the guest did not answer in time
    fallback: Callable[[SnapshotRecord, str, bool], None] | None = None


@attrs.frozen
class Adopt:
    """A QEMU a previous supervisor started and recorded (``life``), still running
    (``proc``): reconnect and serve it, with its memory, processes and ports."""

    life: LifeState
    proc: AdoptedProcess
    accepted: float = 0.0


@attrs.frozen
class AwaitTemplate:
    """The boot template this configuration restores is being made by another
    sandbox's boot: ``resolve`` waits for that (the template is saved before the
    maker's first ready) and says what to do then -- restore it, or boot (it failed).
    Booting beside the maker instead would put N boots on the cores at once."""

    resolve: Callable[[], Awaitable[Boot | Resume]]
    accepted: float = 0.0


Plan = Boot | Resume | Adopt | AwaitTemplate


class Sandbox:
    """The actor. The registry calls its methods; one VM life runs in :meth:`run`."""

    def __init__(
        self,
        record: Record,
        settings: Settings,
        files: SandboxFiles,
        store: Store,
        events: EventBus,
        volumes: Volumes | None = None,
    ) -> None:
        self.record = record
        self._volumes = volumes
        self.settings = settings
        self.files = files
        self._store = store
        self._events = events
        self.log = files.open_log()
        self.guest: Guest | None = None
        self.workloads = 0
        self.execs = 0
        # trio's clock (timers run on it): when the sandbox last saw activity, and when it
        # was created (a recovered record's age counts)
        self.last_activity = trio.current_time()
        self.born = trio.current_time() - max(0.0, time.time() - record.created_at)
        self.rss_bytes = 0
        self.checkpointing = False
        # monotonic timestamps of the last life, for the cold-start breakdown
        self.timings: dict[str, float] = {}
        self._ports_lock = trio.Lock()
        self._draining = False
        self._stop_request = trio.Event()
        self._stop_timeout = 30.0
        self._stop_force = False
        self._life_done = trio.Event()  # set while no life runs (a recovered sandbox: at once)
        self._life_done.set()
        self._workload_done = trio.Event()
        self._life_scope: trio.CancelScope | None = None
        self._life_nursery: trio.Nursery | None = None
        self._cpu_prev: tuple[float, float] | None = None
        self._ckpt_lock = trio.Lock()
        self._ckpt_done = trio.Event()
        self._ckpt_done.set()
        self.ready_event = trio.Event()  # set when this life reaches ready (or ends)
        self._guest_hostname = ""  # what the fixups last set in this life's guest
        self._detaching = False  # this life lets go of QEMU instead of stopping it
        self._cell: Cell | None = None  # this life's jail, cgroup, identity
        self._sealed = ""  # the snapshot whose sealed memory this life holds
        self._ports_nursery: trio.Nursery | None = None  # this life's port relays (jailed)
        self._relays: dict[tuple[int, Protocol], trio.CancelScope] = {}
        self._link: SandboxLink | None = None  # this life's host link (tap; a jail's uplink)

    # -- identity ------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> State:
        return self.record.state

    @property
    def config(self) -> SandboxConfig:
        return self.record.config

    @property
    def limits(self) -> Limits:
        return self.settings.limits(self.config.limits)

    @property
    def hostname(self) -> str:
        return self.config.hostname or "sandbox"

    @property
    def network(self) -> NetConfig | None:
        """The guest's network (user: slirp's fixed addresses; tap: its pool address,
        None until it has one)."""
        net = self.config.network
        if net.mode == NetMode.USER:
            return NetConfig(restrict=not net.outbound)
        if net.mode != NetMode.TAP or self.settings.hostnet is None:
            return None
        address = self.pool_address
        if address is None:
            return None
        hn = self.settings.hostnet
        g = hn.guest_net(address, link_name(self.record.uid))
        return NetConfig(
            restrict=False,
            net=str(hn.pool.network),
            address=str(g.address),
            gateway=str(g.gateway),
            dns=str(g.dns),
            prefix=g.prefix,
            tap=True,
            mac=g.mac,
            tap_name=g.tap_name,
        )

    @property
    def ip_address(self) -> str:
        net = self.network
        return net.address if net else ""

    @property
    def gateway(self) -> str:
        net = self.network
        return net.gateway if net else ""

    @property
    def tap_name(self) -> str:
        net = self.network
        return net.tap_name if net else ""

    def _set(self, state: State, **changes: Any) -> None:
        self.record.state = state
        for k, v in changes.items():
            setattr(self.record, k, v)
        self._store.update(self.record)

    def emit(self, action: Action, **attributes: str) -> None:
        if not is_hidden(self.id):  # pool members are invisible until taken
            self._events.emit(self.id, action, attributes)

    # -- one life ------------------------------------------------------------
    async def start(self, nursery: trio.Nursery, plan: Plan) -> None:
        """Start a life in ``nursery``; returns once it is set up (state "starting")."""
        self._life_done = trio.Event()  # at once: the sandbox counts as alive from here
        self._stop_request = trio.Event()
        self._stop_force = False
        self._draining = False
        self.ready_event = trio.Event()
        try:
            await nursery.start(self.run, plan)
        except BaseException:
            self._life_done.set()
            raise

    async def run(self, plan: Plan, task_status: trio.TaskStatus[Sandbox] = trio.TASK_STATUS_IGNORED) -> None:
        """Boot, restore or adopt; serve until asked to stop (or until QEMU dies), power
        off -- or, detached (the supervisor exits and leaves sandboxes running), let go
        of QEMU with its record as it is, for the next supervisor."""
        self._guest_hostname = ""
        self._detaching = False
        if not isinstance(plan, Adopt):
            self._set(State.STARTING, error="", qemu_pid=0)
        self.timings = {"accepted": plan.accepted or time.monotonic()}
        try:
            with trio.CancelScope() as scope:
                self._life_scope = scope
                task_status.started(self)
                if isinstance(plan, AwaitTemplate):
                    plan = await plan.resolve()
                try:
                    await self._life(plan)
                except (BootError, MachineError, GuestError, DomainError) as exc:
                    if not isinstance(plan, Resume) or plan.fallback is None or self.guest is not None:
                        raise
                    # a boot template that does not restore must not fail the Create: boot
                    plan.fallback(plan.snapshot, str(exc), isinstance(exc, BootTimeout))
                    self.log.append("system", f"template restore failed ({exc}); booting".encode())
                    self._set(State.STARTING, error="")
                    await self._life(Boot(accepted=plan.accepted))
        except BootError as exc:
            self._fail(f"boot failed: {exc}")
            if exc.console:
                self.log.append("system", exc.console[-4000:].encode())
        except (MachineError, GuestError) as exc:
            self._fail(str(exc))
        except DomainError as exc:
            self._fail(exc.message)
        except Exception as exc:  # a bug must fail this sandbox, not the supervisor
            log.exception("sandbox %s crashed", self.id)
            self._fail(f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self.guest = None
            self._life_scope = None
            self.ready_event.set()
            if self._detaching:
                self.log.append("system", b"detached: QEMU runs on for the next supervisor")
            elif self.state != State.FAILED:
                self._set(State.STOPPED, qemu_pid=0)
                self.emit(Action.STOPPED, exit_code=str(self.record.last_exit_code))
            else:
                self._set(State.FAILED, qemu_pid=0)
            self._life_done.set()

    def _fail(self, error: str) -> None:
        log.warning("sandbox %s failed: %s", self.id, error)
        self.log.append("system", f"failed: {error}".encode())
        self._set(State.FAILED, error=error)
        self.emit(Action.FAILED, error=error)

    async def _record_chain(self, chain: list[str]) -> None:
        self.record.chain = chain
        self._store.update_life(self.record)
        await self._store.flush()

    def _vm_spec(self, plan: Boot | Resume, ram: Path | None, ram_shared: bool = True) -> VmSpec:
        s, cfg, files = self.settings, self.config, self.files
        limits = self.limits
        chain = tuple(Path(p) for p in self.record.chain)
        if isinstance(plan, Resume):
            return resume_spec(
                plan.snapshot,
                s,
                disk=files.disk,
                chain=chain,
                ram=ram,
                ram_shared=ram_shared,
                network=self.network,
                name=self.hostname,
                boot_timeout=min(s.boot_timeout, RESTORE_HELLO_TIMEOUT),
                answer_timeout=s.guest_timeout,
                # a balloon on the snapshot's memory, mapped privately (a sealed memfd: _ram)
                preload=s.cells.discard_shim if plan.snapshot.machine.balloon and not ram_shared and s.cells else None,
            )
        return VmSpec.boot(
            s.image,
            disk=files.disk,
            chain=chain,
            accel=s.accel,
            hostname=self.hostname,
            network=self.network,
            extra_cmdline=cfg.boot.boot_args,
            kernel=Path(cfg.boot.kernel) if cfg.boot.kernel else None,
            cpus=limits.vcpus,
            memory_mib=limits.memory_mib,
            user=None if s.cells is not None else s.qemu_user,
            ram=ram,
            boot_timeout=s.boot_timeout,
            answer_timeout=s.guest_timeout,
            balloon=s.balloon,
            tb_size_mib=s.tb_size_mib,
        )

    def _ram(self, plan: Boot | Resume, cell: Cell | None, fds: dict[str, int]) -> tuple[Path | None, bool]:
        """The life's guest RAM: (file, shared). A fresh shared file (a boot, a streamed
        restore), or a mapped snapshot's memory, privately. In a cell both go to QEMU
        by descriptor (``fds["ram"]``): the RAM file is the cell identity's own; the
        snapshot's memory a sealed memfd nobody can write."""
        s, files = self.settings, self.files
        size = plan.snapshot.machine.memory_mib if isinstance(plan, Resume) else self.limits.memory_mib
        if isinstance(plan, Resume) and plan.snapshot.memory == MemoryKind.MAPPED:
            snap = plan.snapshot
            if cell is not None:
                fds["ram"] = cell.cells.sealed.acquire(snap.id, snap.path / "memory")
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
            path, fds["ram"] = cell.make_ram(size)
            return path, True
        return files.make_ram(size, s.qemu_user), True

    def _base(self) -> Path:
        """The read-only root filesystem a fresh boot's overlay stands on."""
        if self.record.image is not None:
            return Path(self.record.image.rootfs)
        boot = self.config.boot
        return Path(boot.rootfs) if boot.rootfs else self.settings.image.rootfs

    async def _life(self, plan: Boot | Resume | Adopt) -> None:
        if isinstance(plan, Adopt):
            await self._adopted_life(plan)
            return
        # a fresh disk gets the Create's patches (a restart of its own disk, or a
        # restore of a snapshot, has them already); a boot template's restore is fresh
        fresh = (isinstance(plan, Resume) and plan.fallback is not None) or (
            isinstance(plan, Boot) and not self.files.disk.exists()
        )
        own = Path(self.config.boot.rootfs) if self.config.boot.rootfs else None
        if own is not None:  # a caller's file, checked at every life: it may have changed since
            check_user_disk(own)  # no backing or data file: its header names nothing we open
        # a new overlay's chain is on disk before the overlay: a crash in between
        # leaves a chain without its disk (the next start makes a fresh one), never a
        # disk standing on layers its record does not name
        if isinstance(plan, Resume):
            await self._record_chain([str(p) for p in plan.snapshot.layers])
            await self.files.overlay_on(plan.snapshot.disk)
        elif not self.files.disk.exists():
            base = self._base()
            size, below = virtual_size(base), () if own is not None else backing_chain(base)  # ours: trusted
            recs = self._volumes.records if self._volumes is not None else {}
            rw = [(m.name, recs[m.name].size_bytes) for m in self.config.volumes if not m.read_only and m.name in recs]
            check_sandbox_disk(self.settings.max_sandbox_disk_mib, size, rw)
            await self._record_chain([str(base), *map(str, below)])
            await self.files.overlay_on(base)
        run_dir = self.files.new_run_dir()
        cells = self.settings.cells
        cell = None
        fds: dict[str, int] = {}
        self._sealed = ""
        state_fd = -1
        try:
            volumes = self._claim_volumes()
            uplink = self._open_link(run_dir)
            if self._link is not None and self._link.tap_fd is not None:
                fds[TAP_FD] = self._link.tap_fd  # (the link keeps it; QEMU gets its own copy)
            if cells is not None:
                cell = cells.open(
                    self.record.uid[:18],
                    run_dir,
                    memory_mib=self.limits.memory_mib,
                    vcpus=self.limits.vcpus,
                    uplink=uplink,
                )
            if isinstance(plan, Resume):
                # the snapshot as it is now, and its stream opened, in this one step: a
                # conversion may switch the record (and unlink the old stream) after it
                state_fd = self._open_state(plan.snapshot)
            ram, shared = self._ram(plan, cell, fds)
            spec = attrs.evolve(self._vm_spec(plan, ram, shared), volumes=volumes)
            placement = (
                Placement(sock_dir=cell.sock_dir, qemu_dir=cell.qemu_dir, log=run_dir / "qemu.log", spawn=cell.spawn)
                if cell is not None
                else Placement.plain(run_dir)
            )

            def spawned(pid: int, started: int) -> None:
                self.record.qemu_pid = pid
                self.record.life = LifeState(
                    pid=pid,
                    start_time=started,
                    run_dir=str(run_dir),
                    sock_dir=str(placement.sock_dir),
                    uid=cell.identity.uid if cell is not None else 0,
                    cgroup=cell.name if cell is not None and cell.cgroup is not None else "",
                    jail_root=str(cell.spec.root) if cell is not None else "",
                    ram=str(ram) if ram is not None and shared else "",
                    spec=dump(spec),
                )
                self._store.update_life(self.record)

            self._cell = cell
            at = Attach(placement, fds, on_spawned=spawned, restore_fd=state_fd)
            async with self.settings.launch(spec, at) as guest:
                self._release_ram(fds, cell)  # QEMU has its own mapping now
                if state_fd >= 0:
                    os.close(state_fd)  # (loaded)
                    state_fd = -1
                await self._serve(guest, plan, fresh=fresh)
        finally:
            if state_fd >= 0:
                os.close(state_fd)
            self._release_ram(fds, cell)
            self._end_life(cell)
            await self._release_volumes()

    async def _release_volumes(self) -> None:
        """After the reap (or the detach: QEMU runs on with them, the claims go with us)."""
        if self._volumes is None:
            return
        if self._detaching:
            self._volumes.release(self.record.uid)
            return
        with trio.CancelScope(shield=True):
            for note in await self._volumes.release_checked(self.record.uid):
                self.log.append("system", note.encode())

    def _claim_volumes(self) -> tuple[Volume, ...]:
        """This life's named volumes (FAILED_PRECONDITION when one is gone or busy)."""
        mounts = self.config.volumes
        if not mounts:
            return ()
        if self._volumes is None:
            raise FailedPrecondition("this supervisor has no volumes")
        return self._volumes.claim(self.record.uid, self.id, mounts)

    def _open_state(self, snap: SnapshotRecord) -> int:
        """``snap``'s stream, opened; its memory kind goes into the timings ("mapped":
        1, or 0 for a streamed restore: RAM read from the stream)."""
        try:
            fd = os.open(snap.path / snap.vmstate, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise BootError(f"cannot open the saved state of snapshot {snap.id}: {exc.strerror}") from None
        self.timings["mapped"] = 1.0 if snap.memory == MemoryKind.MAPPED else 0.0
        return fd

    def _release_ram(self, fds: dict[str, int], cell: Cell | None) -> None:
        fd = fds.pop("ram", None)
        if fd is None:
            return
        if self._sealed and cell is not None:
            cell.cells.sealed.release(self._sealed, fd)
        else:
            os.close(fd)

    def _end_life(self, cell: Cell | None) -> None:
        """What one life leaves goes, unless it was detached (QEMU runs on)."""
        self._cell = None
        self._close_link()
        if self._detaching:
            return
        if cell is not None:
            cell.close()
        self.files.end_life()
        if self.record.life is not None:
            self.record.life = None
            self._store.update_life(self.record)

    async def _adopted_life(self, plan: Adopt) -> None:
        """Reconnect to a QEMU a previous supervisor started (its cell, sockets, guest)."""
        life, cells = plan.life, self.settings.cells
        run_dir = Path(life.run_dir)
        cell = None
        if life.uid and cells is not None:
            cell = cells.reopen(self.record.uid[:18], run_dir, life.uid, life.ram)
        self._cell = cell
        self._sealed = ""
        placement = Placement(sock_dir=Path(life.sock_dir), log=run_dir / "qemu.log")
        spec = load(life.spec, VmSpec)
        try:
            if self._volumes is not None and self.config.volumes:
                self._volumes.claim(self.record.uid, self.id, self.config.volumes, adopted=True)
            self._readopt_link()
            at = Attach(placement, adopt=plan.proc, disk_top=life.disk_top, staged=life.staged)
            async with self.settings.launch(spec, at) as guest:
                await self._serve(guest, plan)
        finally:
            self._end_life(cell)
            await self._release_volumes()

    async def _serve(self, guest: Guest, plan: Plan, *, fresh: bool = False) -> None:
        """A life from the guest's hello to the end of its work."""
        if isinstance(plan, Resume):
            self.timings["restored"] = time.monotonic()
            what = "the boot template" if plan.fallback is not None else f"snapshot {plan.snapshot.id}"
            how = "mapped" if self.timings.get("mapped") else "streamed"
            self.log.append("system", f"restored from {what} (memory {how})".encode())
            # the hello set the clock, but a restored vCPU busy on a loaded host answers it
            # late (a clone 4.4 s behind at load 38): then it is set again
            await self._fresh_identity(guest, clock=guest.channel.clock_stale)
            await self._configure_guest_net(guest)
        crash_point("hello")
        self.guest = guest
        self._record_timings(guest)
        self.record.qemu_pid = guest.machine.pid or 0
        async with trio.open_nursery() as ports:
            self._ports_nursery = ports
            try:
                await self._serve_life(guest, plan, fresh=fresh)
            finally:
                self._ports_nursery = None
                self._relays.clear()
                ports.cancel_scope.cancel()

    async def _serve_life(self, guest: Guest, plan: Plan, *, fresh: bool) -> None:
        if isinstance(plan, Adopt):  # its forwards live in QEMU still; calls of the last supervisor are gone
            await self._apply_ports(guest, relays_only=True)
            self._set(State.READY)
            self.log.append("system", b"adopted after a supervisor restart")
        else:
            if isinstance(plan, Boot) and plan.template is not None:
                await plan.template(self)  # a fresh boot, nothing of the caller's in it yet
            if not isinstance(plan, Resume):  # (a restored guest has them mounted)
                await self._mount_volumes(guest)
            if fresh:
                await self._apply_patches(guest)
            await self._apply_ports(guest)  # ports given at create (or exposed before a stop) come first
            self._set(State.READY, ready_at=int(time.time()), qemu_pid=guest.machine.pid or 0)
            # on disk before anyone hears of it: a supervisor killed right after a client
            # saw "ready" adopts the sandbox (the record said "starting": it was killed)
            with trio.move_on_after(READY_FLUSH_TIMEOUT):
                try:
                    await self._store.flush()
                except DomainError as exc:  # a full disk: it runs, but a restart will not keep it
                    self.log.append("system", f"ready, not stored: {exc.message}".encode())
            self.log.append("system", b"ready")
            self.emit(Action.READY)
        self.timings["ready_event"] = time.monotonic()
        self.ready_event.set()
        self.last_activity = trio.current_time()
        async with trio.open_nursery() as nursery:
            self._life_nursery = nursery
            nursery.start_soon(self._watch_machine, guest, nursery.cancel_scope)
            if self.initial_cmd:
                nursery.start_soon(self._initial_cmd)
            try:
                await self._stop_request.wait()
                if not self._detaching:
                    await self._drain_workloads()
            finally:
                self._life_nursery = None
            nursery.cancel_scope.cancel()
        if self.state == State.FAILED or self._detaching:
            return
        self._set(State.STOPPING)
        if self._stop_force and guest.machine.proc is not None:
            guest.channel.expect_eof()
            guest.machine.proc.kill()

    async def _fresh_identity(self, guest: Guest, *, clock: bool) -> None:
        """What a clone must not share with its snapshot: the clock (host time), the
        kernel's CRNG (reseeded with fresh host entropy, else every clone reads the
        same /dev/urandom stream), the hostname. The requests go out together and the
        guest answers them in one wakeup: one round trip, not three (a pool acquire
        is little else)."""
        ch = guest.channel
        calls: list[Callable[[], Awaitable[object]]] = [functools.partial(ch.add_entropy, 256)]
        if clock:
            calls.append(ch.set_clock)
        rename = self.hostname != self._guest_hostname  # a pool member adopted as is keeps its own
        if rename:
            calls.append(functools.partial(ch.set_hostname, self.hostname))
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
            self._guest_hostname = self.hostname

    async def adopt(self, *, apply_ports: bool) -> None:
        """A warm pool member becomes the caller's sandbox (its record already holds the
        caller's configuration): fresh identity (it may have waited a while), the
        ports unless the member forwarded them already, then the initial command. A
        failure fails this sandbox, as it would fail a boot."""
        guest = self.guest
        if guest is None or self._life_nursery is None or self.state != State.READY:
            self._fail(f"pool member is {self.state}, not ready to be handed over")
            self._stop_request.set()
            raise MachineError(f"pool member is {self.state}")
        try:
            await self._fresh_identity(guest, clock=True)
            await self._apply_patches(guest)
            self._update_policy()  # the caller's egress policy, not the template's
            if apply_ports:
                await self._apply_ports(guest)
        except MachineError as exc:
            self._fail(str(exc))
            self._stop_request.set()
            raise
        self.log.append("system", b"ready (from the warm pool)")
        self.touch()
        if self.initial_cmd:
            self._life_nursery.start_soon(self._initial_cmd)

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
        self.timings.update(t)

    async def _watch_machine(self, guest: Guest, scope: trio.CancelScope) -> None:
        rc = await guest.machine.wait()
        if not self._stop_request.is_set():
            cell = self._cell
            if cell is not None and cell.oom_killed():
                limit = cell.cgroup.stats().memory_limit if cell.cgroup is not None else None
                self._fail(
                    f"QEMU was killed by its memory limit ({(limit or 0) >> 20} MiB: guest RAM "
                    f"+ {cell.cells.config.overhead_mib} MiB)"
                )
            else:
                self._fail(guest.machine.describe_exit() if rc else "the guest powered off on its own")
            self._stop_request.set()
            scope.cancel()

    async def _drain_workloads(self) -> None:
        if self._stop_force or self.state == State.FAILED:
            return
        with trio.move_on_after(self._stop_timeout):
            await self._ckpt_done.wait()  # a checkpoint in progress finishes first
            while self.workloads or self.execs:
                await self._workload_done.wait()

    @property
    def initial_cmd(self) -> tuple[str, ...]:
        """What runs at the first ready: the Create's cmd, else its OCI image's
        Entrypoint + Cmd. As a container runtime (and the SDK reference's WithCmd): a
        Create's cmd replaces the image's Cmd, not its Entrypoint."""
        img = self.record.image
        if img is None:
            return self.config.workload.cmd
        return (*img.entrypoint, *self.config.workload.cmd) if self.config.workload.cmd else img.argv

    async def _initial_cmd(self) -> None:
        workload = self.run_workload(list(self.initial_cmd), env={})
        try:
            async with aclosing(workload) as outputs:
                async for _ in outputs:
                    pass
        except DomainError as exc:  # its idle event (with the error) was emitted already
            self.log.append("system", f"initial cmd failed: {exc}".encode())

    # -- control ---------------------------------------------------------------
    def request_stop(self, timeout: float, *, force: bool = False) -> None:
        """Graceful (wait up to ``timeout`` for workloads, then power off) or forced."""
        if self.stopped:
            return
        self._stop_timeout = timeout
        self._stop_force = self._stop_force or force
        if not self._stop_request.is_set():
            if self.state in ALIVE:
                self._set(State.STOPPING)
            self.emit(Action.STOPPING)
            self._stop_request.set()
        if self.guest is None:
            if self._life_scope is not None:  # still booting: abandon the boot
                self._life_scope.cancel()
        elif self._stop_force and self.guest.machine.proc is not None:
            self.guest.channel.expect_eof()
            self.guest.machine.proc.kill()

    def detach(self) -> None:
        """Let go of a running QEMU without stopping it (the supervisor exits with
        --keep-sandboxes): the record keeps its state and life, for the next one."""
        if self.stopped or self.guest is None:
            return
        self._detaching = True
        self.guest.machine.detach()
        self._stop_request.set()

    def drain(self) -> None:
        """No new work; work in flight finishes, however long it takes; then stop."""
        if self.state not in (*ALIVE, State.STARTING):
            raise FailedPrecondition(f"sandbox {self.id} is {self.state}")
        self._draining = True
        self.request_stop(24 * 3600.0)

    async def wait_stopped(self) -> None:
        """Until no life runs, and the record says so on disk (a caller told "stopped"
        must not find it running after a crash)."""
        await self._life_done.wait()
        await self.persisted()

    async def persisted(self) -> None:
        """Until the record's changes so far are on disk (a full disk: logged, not raised)."""
        try:
            await self._store.flush()
        except DomainError as exc:
            log.warning("sandbox %s: %s", self.id, exc.message)

    @property
    def stopped(self) -> bool:
        """No life runs (a recovered sandbox, one that stopped or failed)."""
        return self._life_done.is_set() or self.state in ENDED

    def touch(self) -> None:
        self.last_activity = trio.current_time()

    # -- work ------------------------------------------------------------------
    def _require_alive(self) -> Guest:
        if self.state not in ALIVE or self.guest is None:
            raise FailedPrecondition(f"sandbox {self.id} is {self.state}, not ready or running")
        if self._draining or self._stop_request.is_set():
            raise FailedPrecondition(f"sandbox {self.id} is draining or stopping: no new work")
        if self.checkpointing:
            raise FailedPrecondition(f"sandbox {self.id} is being checkpointed; retry in a moment")
        return self.guest

    def check_checkpointable(self) -> Guest:
        guest = self._require_alive()
        if self.state != State.READY:
            raise FailedPrecondition(f"sandbox {self.id} is {self.state}; checkpoint needs it ready")
        if self.execs or self.workloads:
            raise FailedPrecondition(f"sandbox {self.id} has exec sessions open; checkpoint needs it idle")
        return guest

    async def checkpoint(self, snap_dir: Path) -> Checkpoint:
        """Save this sandbox into ``snap_dir``; it runs on afterwards. Only when ready
        with no exec session open: work in flight would be cloned into every restore."""
        guest = self.check_checkpointable()
        try:
            return await self._checkpoint(guest, snap_dir)
        except CheckpointLost as exc:  # never leave a sandbox "ready" but paused
            self._fail(str(exc))
            self._stop_request.set()
            raise Internal(f"checkpoint of {self.id} failed: {exc}") from None

    async def checkpoint_first_boot(self, snap_dir: Path) -> Checkpoint:
        """Save a fresh boot at its first ready, before any caller's work (a boot
        template). A lost guest raises :class:`CheckpointLost`: the life fails."""
        if self.guest is None or self.state != State.STARTING:
            raise FailedPrecondition(f"sandbox {self.id} is {self.state}: not a fresh boot")
        return await self._checkpoint(self.guest, snap_dir)

    async def _checkpoint(self, guest: Guest, snap_dir: Path) -> Checkpoint:
        async with self._ckpt_lock:
            self.checkpointing = True
            self._ckpt_done = trio.Event()
            try:
                # requests in flight (metrics, files) finish first: a request sitting in
                # the guest's queue at the pause would run again in every restore
                with trio.move_on_after(5):
                    while guest.channel.statistics().requests_in_flight:
                        await trio.sleep(0.002)
                if guest.channel.statistics().requests_in_flight:
                    raise FailedPrecondition(f"sandbox {self.id}: guest channel busy; retry the checkpoint")

                def frozen(disk: Path) -> None:
                    self.record.chain = [str(disk), *self.record.chain]
                    self.record.swap = ""
                    if self.record.life is not None:
                        m = guest.machine
                        self.record.life = attrs.evolve(self.record.life, disk_top=m.disk_top, staged=m.staged)
                    self._store.update_life(self.record)

                try:
                    # the journal: a crash from here to the end of the disk swap is
                    # finished or undone by the next supervisor (Registry._recover)
                    self.record.swap = str(snap_dir / "disk.qcow2")
                    self._store.update_life(self.record)
                    await self._store.flush()
                    ck = await checkpoint_guest(
                        guest,
                        files=self.files,
                        snap_dir=snap_dir,
                        user=None if self.settings.cells is not None else self.settings.qemu_user,
                        chain=tuple(self.record.chain),
                        on_frozen=frozen,
                    )
                except (MachineError, OSError) as exc:
                    self._void_journal()
                    if not await still_running(guest):
                        raise CheckpointLost(f"checkpoint failed and the guest did not resume: {exc}") from None
                    raise Internal(f"checkpoint of {self.id} failed: {exc}") from None
                except BaseException:
                    self._void_journal()
                    raise
                self.log.append("system", f"checkpoint: {ck.memory}, paused {ck.paused_s * 1000:.0f} ms".encode())
                return ck
            finally:
                self.checkpointing = False
                self._ckpt_done.set()

    def _void_journal(self) -> None:
        """A checkpoint failed before its disk moved (``frozen`` clears the journal when
        it did): nothing is under way."""
        if self.record.swap:
            self.record.swap = ""
            self._store.update_life(self.record)

    def _workload_finished(self) -> None:
        self._workload_done.set()
        self._workload_done = trio.Event()

    def _defaults(self, env: dict[str, str], cwd: str, user: str) -> tuple[dict[str, str], str, str]:
        """The sandbox's create-time env, working dir and user are every command's
        defaults, over its OCI image's; a call's own values win."""
        w, img = self.config.workload, self.record.image
        if img is None:
            return {**w.env, **env}, cwd or w.working_dir, user or w.user
        return {**img.env, **w.env, **env}, cwd or w.working_dir or img.working_dir, user or w.user or img.user

    async def run_workload(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str = "",
        user: str = "",
        tty: bool = False,
        timeout: float = 0.0,
    ) -> AsyncGenerator[tuple[str, bytes, int | None], None]:
        """A Run: the sandbox goes running, output streams as (stream, data, None), the
        last item is ("exit", b"", code); then back to ready with an idle event."""
        guest = self._require_alive()
        if self.state == State.RUNNING:
            raise FailedPrecondition(f"sandbox {self.id} is running a workload already")
        if not argv:
            raise InvalidArgument("cmd must not be empty")
        env, cwd, user = self._defaults(env, cwd, user)
        self.workloads += 1
        self._set(State.RUNNING)
        self.emit(Action.RUNNING)
        self.touch()
        code = -1
        start_error = ""
        try:
            async with guest.channel.exec(argv, env=env, cwd=cwd, user=user, tty=tty, timeout=timeout) as h:
                src_names = {P.STDOUT: "output" if tty else "stdout", P.STDERR: "stderr"}
                async for ch, data in h:
                    name = src_names[ch]
                    self.log.append(name, data)
                    yield ("stdout" if tty else name), data, None
                assert h.exit is not None
                code = h.exit.code
            yield "exit", b"", code
        except GuestOpError as exc:
            code = 127 if exc.code == P.E_NOT_FOUND else 126
            start_error = exc.message
            raise guest_error(exc) from None
        except GuestError as exc:  # the guest broke, went silent, or would not end it
            raise guest_error(exc) from None
        finally:
            self.workloads -= 1
            self.touch()
            if self.record.state == State.RUNNING:  # (not stopping or failed meanwhile)
                self._set(State.READY, last_exited_at=int(time.time()), last_exit_code=code)
                extra = {"error": start_error} if start_error else {}
                self.emit(Action.IDLE, exit_code=str(code), **extra)
            else:
                self.record.last_exited_at, self.record.last_exit_code = int(time.time()), code
            self._workload_finished()

    @asynccontextmanager
    async def exec_session(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str = "",
        user: str = "",
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        timeout: float = 0.0,
    ) -> AsyncIterator[ExecHandle]:
        guest = self._require_alive()
        if not argv:
            raise InvalidArgument("cmd must not be empty")
        env, cwd, user = self._defaults(env, cwd, user)
        self.execs += 1
        self.touch()
        try:
            try:
                async with guest.channel.exec(
                    argv, env=env, cwd=cwd, user=user, tty=tty, rows=rows, cols=cols, timeout=timeout, stdin=True
                ) as h:
                    yield h
            except GuestError as exc:
                raise guest_error(exc) from None
        finally:
            self.execs -= 1
            self.touch()
            self._workload_finished()

    async def guest_call(self, fn: Callable[[Guest], Awaitable[T]]) -> T:
        await self._ckpt_done.wait()  # short calls wait out a checkpoint's pause
        guest = self._require_alive()
        try:
            return await fn(guest)
        except GuestError as exc:
            raise guest_error(exc) from None

    @asynccontextmanager
    async def read_file(self, path: str) -> AsyncIterator[FileReadStream]:
        """A file of the guest, as a stream of chunks."""
        guest = self._require_alive()
        try:
            async with guest.channel.read_file(path) as f:
                yield f
        except GuestError as exc:
            raise guest_error(exc) from None

    async def write_file(self, path: str, chunks: AsyncIterator[bytes], *, mode: int) -> None:
        await self.guest_call(lambda g: g.channel.write_file(path, chunks, mode=mode))
        self.touch()

    @asynccontextmanager
    async def read_tree(self, path: str) -> AsyncIterator[TreeReadStream]:
        """The guest directory ``path`` as one tar stream (see GuestChannel.read_tree)."""
        guest = self._require_alive()
        try:
            async with guest.channel.read_tree(path) as tar:
                yield tar
        except GuestError as exc:
            raise guest_error(exc) from None
        self.touch()

    async def write_tree(self, path: str, chunks: AsyncIterator[bytes], *, owner: str = "") -> int:
        """Unpack a tar stream into the guest directory ``path``; the number of entries."""
        n = await self.guest_call(lambda g: g.channel.write_tree(path, chunks, owner=owner))
        self.touch()
        return n

    async def metrics(self) -> SandboxMetrics:
        m = await self.guest_call(lambda g: g.channel.metrics())
        cg = self._cgroup_stats()
        return SandboxMetrics(
            cgroup_memory_bytes=cg.memory_bytes if cg is not None else 0,
            cgroup_memory_limit_bytes=(cg.memory_limit or 0) if cg is not None else 0,
            cgroup_oom_kills=cg.oom_kills if cg is not None else 0,
            id=self.id,
            timestamp=time.time_ns(),
            cpu_percent=round(self.cpu_percent(), 2),
            memory_total_bytes=int(m.mem.get("total", 0)),
            memory_available_bytes=int(m.mem.get("available", 0)),
            host_rss_bytes=self.host_rss(),
            disk_read_bytes=int(m.disk.get("read_bytes", 0)),
            disk_write_bytes=int(m.disk.get("write_bytes", 0)),
            net_rx_bytes=int(m.net.get("rx_bytes", 0)),
            net_tx_bytes=int(m.net.get("tx_bytes", 0)),
            uptime_seconds=float(m.uptime),
        )

    def _cgroup_stats(self) -> CgroupStats | None:
        cell = self._cell
        if cell is None or cell.cgroup is None:
            return None
        try:
            return cell.cgroup.stats()
        except (CgroupError, OSError):
            return None

    # -- network: the pool address, a life's host link --------------------------
    @property
    def pool_address(self) -> IPv4Address | None:
        """Its IP pool address (tap: the guest's; user mode with outbound in a jail: its
        uplink's), held from Create to Remove: a stopped sandbox keeps it."""
        hn = self.settings.hostnet
        return hn.pool.address_of(self.record.uid) if hn is not None else None

    @property
    def egress(self) -> EgressPolicy:
        eg = self.config.network.egress
        return EgressPolicy.parse(eg.to_dict() if eg is not None else None)

    def lease(self, want: str = "") -> None:
        """Hold a pool address when the network needs one (idempotent): ``want`` (a
        restore: its snapshot's) when that is free, else the next free one."""
        hn = self.settings.hostnet
        if hn is None or not needs_pool_address(self.settings, self.config.network):
            return
        try:
            hn.pool.allocate(self.record.uid, IPv4Address(want) if want else None)
        except PoolExhausted as exc:
            raise ResourceExhausted(str(exc)) from None

    def release_lease(self) -> None:
        """The address goes back to the pool (Remove)."""
        hn = self.settings.hostnet
        if hn is not None:
            hn.pool.release(self.record.uid)

    def _open_link(self, run_dir: Path) -> Uplink | None:
        """This life's host link, before QEMU starts: a TAP (its descriptor goes to QEMU),
        or for a jailed user-mode sandbox with outbound access the uplink namespace its
        QEMU runs in (returned, for the cell)."""
        hn = self.settings.hostnet
        net = self.config.network
        if hn is None or not needs_pool_address(self.settings, net):
            return None
        self.lease()
        address = self.pool_address
        assert address is not None
        name = link_name(self.record.uid)
        try:
            if net.mode == NetMode.TAP:
                self._link = hn.open_tap(name, address, self.egress)
                return None
            self._link = link = hn.open_uplink(name, address, self.egress)
        except (NetError, NftError) as exc:
            raise MachineError(f"cannot set up the sandbox's network: {exc}") from None
        resolv = run_dir / "resolv.conf"  # slirp forwards the guest's DNS to what it names
        resolv.write_text(f"nameserver {hn.gateway}\n")
        resolv.chmod(0o644)  # (whatever the umask: QEMU's identity reads it in the jail)
        return Uplink(Path(link.jail_netns_path), resolv)

    def _readopt_link(self) -> None:
        """An adopted QEMU's link (its TAP, its uplink), filtered again."""
        hn = self.settings.hostnet
        net = self.config.network
        if hn is None or not needs_pool_address(self.settings, net):
            return
        address = self.pool_address
        if address is None:
            raise MachineError("its IP pool address is gone (the pool changed): it cannot be adopted")
        try:
            self._link = hn.readopt(link_name(self.record.uid), address, self.egress, uplink=net.mode == NetMode.USER)
        except (NetError, NftError) as exc:
            raise MachineError(f"cannot set up the sandbox's network again: {exc}") from None

    def _close_link(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.detach() if self._detaching else link.close()

    def _update_policy(self) -> None:
        """A warm pool member taken by a Create: the caller's egress policy."""
        link, policy = self._link, self.egress
        if link is None or link.policy == policy:
            return
        try:
            link.set_policy(policy)
        except NftError as exc:
            raise MachineError(f"cannot apply the egress policy: {exc}") from None

    async def _configure_guest_net(self, guest: Guest) -> None:
        """A restored tap guest wakes up with its origin's address, MAC and resolver:
        this sandbox's own, before it is reported ready (guestd's net_config, ~1 ms)."""
        net = self.network
        if net is None or not net.tap:
            return
        try:
            await guest.channel.net_config(net.address, net.prefix, net.gateway, [net.dns], net.mac)
        except GuestError as exc:
            raise MachineError(f"post-restore network configuration failed: {exc}") from None

    # -- ports --------------------------------------------------------------------
    # User mode: unjailed, QEMU's slirp binds the host port itself (HMP hostfwd_add).
    # Jailed, slirp lives in QEMU's network namespace (empty, or its uplink's): its
    # forward listens on that namespace's loopback, on the same port number, and a
    # relay task of ours holds the host port and carries each connection (or UDP flow)
    # there through a socket made in the namespace. Tap: a relay from the host port to
    # the sandbox's address (actors/portfwd.py says why not a DNAT). A restarted
    # supervisor re-creates the relays of an adopted QEMU.
    async def _mount_volumes(self, guest: Guest) -> None:
        """Mount the life's volumes (virtio-blk serial vN, in order) where the config says."""
        for i, m in enumerate(self.config.volumes):
            try:
                await guest.channel.mount(f"serial:v{i}", m.path, read_only=m.read_only)
            except GuestError as exc:
                err = guest_error(exc)
                self.log.append("system", f"volume {m.name}: {err.message}".encode())
                raise MachineError(f"volume {m.name!r} at {m.path}: {err.message}") from None

    async def _apply_patches(self, guest: Guest) -> None:
        """The Create's patches, in order, by guestd (batched by the frame cap), before
        anything of the caller's runs. Why not written into the overlay before boot: the
        host would have to parse the guest's file system (an ext4 in a qcow2) as root,
        and a Create served by a boot template restores a disk that is the template's,
        not a fresh one; guestd applies them the same way on both paths, as root in the
        guest, with the guest's own user names."""
        patches = (*script_patches(self.config.scripts), *self.config.patches)
        if not patches:
            return
        entries = [PatchEntry(p.op, p.path, p.data, p.target, p.mode, p.owner, p.replace) for p in patches]
        try:
            n = await guest.channel.patch(entries)
        except GuestError as exc:
            err = guest_error(exc)
            self.log.append("system", f"patches: {err.message}".encode())
            raise MachineError(f"patches: {err.message}") from None
        self.log.append("system", f"{n} patches applied".encode())

    async def _apply_ports(self, guest: Guest, *, relays_only: bool = False) -> None:
        applied = []
        for pm in self.record.ports:
            try:
                applied.append(await self._forward(guest, pm, relay_only=relays_only))
            except DomainError as exc:
                self.log.append("system", f"port {pm.label()}: {exc.message}".encode())
                raise MachineError(f"cannot expose port {pm.sandbox_port}: {exc.message}") from None
        self.record.ports = applied
        self._store.update_ports(self.record)

    async def _forward(self, guest: Guest, pm: PortSpec, *, relay_only: bool = False) -> PortSpec:
        """Forward ``pm``; the host port it got."""
        addr = self.settings.expose_address
        net = self.network
        if net is not None and net.tap:
            return await self._forward_tap(net, pm)
        if self._cell is None:
            host_port = pm.host_port or free_port(addr, pm.protocol)
            await self._hostfwd(guest, f"{pm.protocol}:{addr}:{host_port}-:{pm.sandbox_port}", host_port, pm)
            return attrs.evolve(pm, host_port=host_port)

        async def inside_cell(host_port: int) -> Target:
            # QEMU's hostfwd listens on the cell's own loopback, on the same port number
            if not relay_only:
                await self._hostfwd(guest, f"{pm.protocol}:127.0.0.1:{host_port}-:{pm.sandbox_port}", host_port, pm)
            return Target("127.0.0.1", host_port, NetNS(file=f"/proc/{guest.machine.pid}/ns/net"))

        return await self._relay_from_host(pm, inside_cell)

    async def _forward_tap(self, net: NetConfig, pm: PortSpec) -> PortSpec:
        """A relay from the host port to the sandbox's address (the seed: "the daemon
        binds a host listener"). The host reaches every sandbox; the filter stops only
        what sandboxes send."""
        hn = self.settings.hostnet
        assert hn is not None

        async def sandbox_address(host_port: int) -> Target:
            return Target(net.address, pm.sandbox_port, hn.netns)

        return await self._relay_from_host(pm, sandbox_address)

    async def _relay_from_host(self, pm: PortSpec, target_for: Callable[[int], Awaitable[Target]]) -> PortSpec:
        """Bind the host listener for ``pm`` (its port, or any), then relay it to the
        target ``target_for(host_port)`` names; the listener closes if that fails."""
        addr = self.settings.expose_address
        kind = socket.SOCK_DGRAM if pm.protocol == Protocol.UDP else socket.SOCK_STREAM
        try:
            listener = bind_listener(addr, pm.host_port, kind)
        except PortInUse:
            raise AlreadyExists(f"host port {pm.host_port}/{pm.protocol} is in use on {addr}") from None
        host_port = int(listener.getsockname()[1])
        try:
            target = await target_for(host_port)
            relay = relay_udp if kind == socket.SOCK_DGRAM else relay_tcp
            assert self._ports_nursery is not None
            scope = await self._ports_nursery.start(_relay, relay, listener, target)
        except BaseException:
            listener.close()
            raise
        self._relays[pm.key] = scope
        return attrs.evolve(pm, host_port=host_port)

    async def _hostfwd(self, guest: Guest, rule: str, host_port: int, pm: PortSpec) -> None:
        reply = await guest.machine.hmp(f"hostfwd_add {NETDEV_ID} {rule}")
        if reply.strip():  # HMP reports failure as text, not as a QMP error
            if "host forwarding" in reply.lower():
                raise AlreadyExists(f"host port {host_port}/{pm.protocol} is in use on {self.settings.expose_address}")
            raise FailedPrecondition(f"hostfwd_add: {reply.strip()[:200]}")

    def ports(self) -> list[PortSpec]:
        """Its port mappings, host ports filled in (a restored sandbox's carried ones
        with the host ports it got), in the order they were exposed."""
        return list(self.record.ports)

    async def expose(self, sandbox_port: int, host_port: int, protocol: Protocol) -> PortSpec:
        """Forward ``sandbox_port`` from ``host_port`` (0: one is picked). A port that is
        exposed already answers with its mapping (a retried call is safe), unless the
        call names another host port for it (ALREADY_EXISTS)."""
        guest = self._require_alive()
        net = self.network
        if net is None:
            raise FailedPrecondition(f"sandbox {self.id} has no network (create it with network mode 'tap' or 'user')")
        if protocol == Protocol.UDP and net.restrict:
            raise FailedPrecondition(
                "QEMU's restricted user networking drops the guest's UDP replies (measured); expose UDP on a "
                "sandbox created with outbound networking allowed"
            )
        async with self._ports_lock:
            wanted = PortSpec(sandbox_port, host_port, protocol)
            for p in self.record.ports:
                if p.key == wanted.key:
                    if host_port in (0, p.host_port):
                        return p  # idempotent: the mapping as it is
                    raise AlreadyExists(f"port {wanted.label()} is exposed already, on host port {p.host_port}")
            pm = await self._forward(guest, wanted)
            self.record.ports.append(pm)
            self._store.update_ports(self.record)
        return pm

    async def unexpose(self, sandbox_port: int, protocol: Protocol) -> None:
        async with self._ports_lock:
            match = [p for p in self.record.ports if p.key == (sandbox_port, protocol)]
            if not match:
                raise NotFound(f"port {sandbox_port}/{protocol} is not exposed")
            pm = match[0]
            net = self.network
            if self.guest is not None and self.state in ALIVE and not (net is not None and net.tap):
                where = "127.0.0.1" if self._cell is not None else self.settings.expose_address
                reply = await self.guest.machine.hmp(f"hostfwd_remove {NETDEV_ID} {protocol}:{where}:{pm.host_port}")
                if reply.strip() and "removed" not in reply:  # success is reported as text too
                    raise FailedPrecondition(f"hostfwd_remove: {reply.strip()[:200]}")
            relay = self._relays.pop(pm.key, None)
            if relay is not None:
                relay.cancel()
            self.record.ports.remove(pm)
            self._store.update_ports(self.record)

    # -- host-side metrics -------------------------------------------------------
    def host_rss(self) -> int:
        pid = self.record.qemu_pid
        if not pid:
            return 0
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
        return 0

    def host_cpu_seconds(self) -> float:
        pid = self.record.qemu_pid
        if not pid:
            return 0.0
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / 100.0
        except (OSError, ValueError, IndexError):
            return 0.0

    def cpu_percent(self) -> float:
        """QEMU's CPU use since the previous call (first call: since the VM started)."""
        now, cpu = time.monotonic(), self.host_cpu_seconds()
        prev = self._cpu_prev
        self._cpu_prev = (now, cpu)
        if prev is None or now <= prev[0]:
            return 0.0
        pct = 100.0 * (cpu - prev[1]) / (now - prev[0])
        return 0.0 if math.isnan(pct) else max(0.0, pct)


async def _relay(
    relay: Callable[..., Awaitable[None]],
    listener: socket.socket,
    target: Target,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One mapping's relay, in its own cancel scope (Unexpose cancels it)."""
    with trio.CancelScope() as scope:
        await relay(listener, target, task_status=_Started(task_status, scope))


class _Started:
    """Passes the relay's ``started`` on as its cancel scope."""

    def __init__(self, outer: trio.TaskStatus[trio.CancelScope], scope: trio.CancelScope) -> None:
        self.outer, self.scope = outer, scope

    def started(self, value: object = None) -> None:
        self.outer.started(self.scope)


def needs_pool_address(settings: Settings, net: Network) -> bool:
    """Tap sandboxes have a pool address; so do jailed user-mode sandboxes with
    outbound access (their uplink's)."""
    if net.mode == NetMode.TAP:
        return True
    return net.mode == NetMode.USER and net.outbound and settings.cells is not None


def check_network_available(settings: Settings, net: Network) -> None:
    """What a network needs of this supervisor (FAILED_PRECONDITION otherwise)."""
    if net.mode == NetMode.TAP and settings.hostnet is None:
        raise FailedPrecondition(
            "network mode 'tap' needs a root supervisor with tap networking (serve --ip-pool CIDR)"
        )
    if net.mode == NetMode.USER and net.outbound:
        if settings.cells is not None and settings.hostnet is None:
            raise FailedPrecondition(
                "outbound networking of jailed sandboxes goes through the supervisor's filter: start it with "
                "tap networking (serve --ip-pool CIDR)"
            )
        if settings.cells is None and net.egress is not None:
            raise FailedPrecondition(
                "an egress policy for user-mode networking needs jailed QEMUs (a root supervisor with the jail)"
            )


def free_port(address: str, protocol: str) -> int:
    """A port nobody listens on right now (the kernel's choice)."""
    kind = socket.SOCK_DGRAM if protocol == Protocol.UDP else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
