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

The actor owns, for one life: the QEMU process and guest channel (through
:func:`~actors.vm.booted_guest`) and the run dir. For the sandbox's whole existence
(owned by the registry): its directory with the qcow2 overlay and the log.
``run(task_status)`` is started with ``await nursery.start(...)`` and reports
started once the life is set up (state "starting"), so Create returns at once.
"""

from __future__ import annotations

import logging
import math
import shutil
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.guest import ChannelBroken, ExecHandle, GuestError, GuestOpError
from actors.logs import SandboxLog
from actors.machine import MachineError, QemuUser
from actors.snapshot import MAPPED, Checkpoint, checkpoint_guest, memory_for_restore, still_running
from actors.vm import NETDEV_ID, BootError, Guest, NetConfig, RestoreFrom, booted_guest
from guestd import proto as P
from images.build import Image
from supervisor.protocol import (
    FAILED_PRECONDITION,
    INTERNAL,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    ApiError,
)
from supervisor.store import Record, SnapshotRecord

log = logging.getLogger("sandvisor.sandbox")

STARTING, READY, RUNNING, STOPPING, STOPPED, FAILED = "starting", "ready", "running", "stopping", "stopped", "failed"
ALIVE = (READY, RUNNING)
_GUEST_CODES = {
    P.E_NOT_FOUND: NOT_FOUND,
    P.E_INVALID: INVALID_ARGUMENT,
    P.E_IS_DIR: INVALID_ARGUMENT,
    P.E_PERM: FAILED_PRECONDITION,
    P.E_TOO_LARGE: RESOURCE_EXHAUSTED,
    P.E_EXISTS: "ALREADY_EXISTS",
}


def api_error(exc: GuestError) -> ApiError:
    """A guest-channel error as the seed's codes."""
    if isinstance(exc, GuestOpError):
        return ApiError(_GUEST_CODES.get(exc.code, INTERNAL), exc.message)
    return ApiError(UNAVAILABLE, f"sandbox guest unavailable: {exc}")


@attrs.define
class Settings:
    """What every sandbox of one supervisor shares."""

    image: Image
    sandboxes_dir: Path  # <state>/sandboxes/<uid>/{disk.qcow2, log}
    run_root: Path  # short paths for sockets: <run_root>/<uid>
    accel: str = "tcg"
    boot_timeout: float = 60.0
    default_memory_mib: int = 256
    default_vcpus: int = 1
    qemu_user: QemuUser | None = None  # set when the supervisor is root
    expose_address: str = "127.0.0.1"  # where exposed ports listen on the host
    # guest RAM as shared files here (tmpfs), so checkpoints are "mapped"; None: anonymous
    memory_dir: Path | None = None


class Sandbox:
    """The actor. The registry calls its methods; one VM life runs in :meth:`run`."""

    def __init__(
        self,
        record: Record,
        settings: Settings,
        emit: Callable[[str, str, dict[str, str]], None],
        persist: Callable[[Record], None],
        persist_config: Callable[[Record], None] | None = None,
    ) -> None:
        self.record = record
        self.settings = settings
        self._emit = emit
        self._persist = persist
        self._persist_config = persist_config or (lambda r: None)
        self._ports_lock = trio.Lock()
        self.dir = settings.sandboxes_dir / record.uid
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = SandboxLog(self.dir / "log")
        self.guest: Guest | None = None
        self.workloads = 0
        self.execs = 0
        self.draining = False
        self.last_activity = time.monotonic()
        self._stop_request: trio.Event = trio.Event()
        self._stop_timeout = 30.0
        self._stop_force = False
        self._stopped = trio.Event()
        self._workload_done = trio.Event()
        self._life_scope: trio.CancelScope | None = None
        self.rss_bytes = 0
        self._cpu_prev: tuple[float, float] | None = None
        # monotonic timestamps of the last boot, for the cold-start breakdown
        self.timings: dict[str, float] = {}
        # the next life resumes this snapshot instead of booting (then it is cleared:
        # a restored sandbox stopped and started again boots from its disk)
        self.restore_from: SnapshotRecord | None = None
        # boot templates (see Registry): called at the first ready of a fresh boot, before
        # any user work, to checkpoint it as the template of its configuration; and
        # called when a restore from a template failed (the life then boots instead)
        self.make_template: Callable[[Sandbox, Guest], Awaitable[None]] | None = None
        self.template_failed: Callable[[SnapshotRecord, str], None] | None = None
        self.checkpointing = False
        self._ckpt_lock = trio.Lock()
        self._ckpt_done = trio.Event()
        self._ckpt_done.set()
        self.ready_event = trio.Event()  # set when this life reaches ready (or ends)
        self._life_nursery: trio.Nursery | None = None
        self._guest_hostname = ""  # what the fixups last set in this life's guest

    # -- identity ------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> str:
        return self.record.state

    @property
    def config(self) -> dict[str, Any]:
        return self.record.config

    @property
    def network(self) -> NetConfig | None:
        net = self.config.get("network") or {}
        if net.get("mode") != "user":
            return None
        return NetConfig(restrict=not net.get("outbound", False))

    @property
    def ip_address(self) -> str:
        net = self.network
        return net.address if net else ""

    @property
    def gateway(self) -> str:
        net = self.network
        return net.gateway if net else ""

    @property
    def run_dir(self) -> Path:
        return self.settings.run_root / self.record.uid[:18]

    def _set(self, state: str, **changes: Any) -> None:
        self.record.state = state
        for k, v in changes.items():
            setattr(self.record, k, v)
        self._persist(self.record)

    def emit(self, action: str, **attributes: str) -> None:
        self._emit(self.id, action, attributes)

    # -- one life ------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[Sandbox] = trio.TASK_STATUS_IGNORED) -> None:
        """Boot, serve until asked to stop (or until QEMU dies), power off. One life."""
        self._stop_request = trio.Event()
        self._stopped = trio.Event()
        self._stop_force = False
        self.draining = False
        self.ready_event = trio.Event()
        self._guest_hostname = ""
        self._set(STARTING, error="", qemu_pid=0)
        cfg = self.config
        limits = cfg.get("limits") or {}
        shutil.rmtree(self.run_dir, ignore_errors=True)
        try:
            with trio.CancelScope() as scope:
                self._life_scope = scope
                task_status.started(self)
                try:
                    await self._life(cfg, limits)
                except (BootError, MachineError, GuestError, ApiError) as exc:
                    snap = self.restore_from
                    if snap is None or self.template_failed is None or self.guest is not None:
                        raise
                    # a boot template that does not restore must not fail the Create: boot
                    self.template_failed(snap, str(exc))
                    self.log.append("system", f"template restore failed ({exc}); booting".encode())
                    self.restore_from = None
                    self._set(STARTING, error="")
                    await self._life(cfg, limits)
        except BootError as exc:
            self._fail(f"boot failed: {exc}")
            if exc.console:
                self.log.append("system", exc.console[-4000:].encode())
        except (MachineError, GuestError) as exc:
            self._fail(str(exc))
        except ApiError as exc:
            self._fail(exc.message)
        except Exception as exc:  # a bug must fail this sandbox, not the supervisor
            log.exception("sandbox %s crashed", self.id)
            self._fail(f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self.guest = None
            self._life_scope = None
            self.restore_from = None
            self.ready_event.set()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.state not in (FAILED,):
                self._set(STOPPED, qemu_pid=0)
                self.emit("stopped", exit_code=str(self.record.last_exit_code))
            else:
                self._set(FAILED, qemu_pid=0)
            self._stopped.set()

    def _fail(self, error: str) -> None:
        log.warning("sandbox %s failed: %s", self.id, error)
        self.log.append("system", f"failed: {error}".encode())
        self._set(FAILED, error=error)
        self.emit("failed", error=error)

    @property
    def memory_file(self) -> Path | None:
        d = self.settings.memory_dir
        return d / f"{self.record.uid[:18]}.ram" if d is not None else None

    async def _life(self, cfg: dict[str, Any], limits: dict[str, Any]) -> None:
        s = self.settings
        kernel = Path(cfg["kernel"]) if cfg.get("kernel") else None
        rootfs = Path(cfg["rootfs"]) if cfg.get("rootfs") else None
        snap = self.restore_from
        kw: dict[str, Any] = {"kernel": kernel}
        memory_file = self.memory_file
        if snap is not None:
            mach = snap.machine
            snap_dir = Path(snap.dir)
            mapped = snap.memory == MAPPED
            kw = {
                "kernel": snap_dir / "kernel",
                "initrd": snap_dir / "initrd",
                "append": mach["append"],
                "restore": RestoreFrom(
                    snap_dir / "vmstate", memory_for_restore(snap_dir, self.run_dir, s.qemu_user) if mapped else None
                ),
            }
            if mapped:
                memory_file = None  # RAM is the snapshot's file, mapped privately
        async with booted_guest(
            s.image,
            self.run_dir,
            rootfs=rootfs,
            disk_path=self.dir / "disk.qcow2",
            cpus=int(limits.get("vcpus") or s.default_vcpus),
            memory_mib=int(limits.get("memory_mib") or s.default_memory_mib),
            accel=s.accel,
            hostname=cfg.get("hostname") or "sandbox",
            extra_cmdline=cfg.get("boot_args", ""),
            # a restored guest answers in ~0.1 s; one that does not within 15 s is not
            # going to (and a Restore caller is waiting)
            boot_timeout=s.boot_timeout if snap is None else min(s.boot_timeout, 15.0),
            user=s.qemu_user,
            network=self.network,
            memory_file=memory_file,
            **kw,
        ) as guest:
            if snap is not None:
                await self._after_restore(guest, cfg)
            self.guest = guest
            self._record_timings(guest)
            self.record.qemu_pid = guest.machine.pid or 0
            if snap is None and self.make_template is not None:
                make, self.make_template = self.make_template, None
                await make(self, guest)  # a fresh boot, nothing of the user's in it yet
            await self._apply_ports(guest)  # ports given at create (or exposed before a stop) come first
            self._set(READY, ready_at=int(time.time()), qemu_pid=guest.machine.pid or 0)
            self.timings["ready_event"] = time.monotonic()
            self.log.append("system", b"ready")
            self.emit("ready")
            self.ready_event.set()
            self.last_activity = time.monotonic()
            async with trio.open_nursery() as nursery:
                self._life_nursery = nursery
                nursery.start_soon(self._watch_machine, guest, nursery.cancel_scope)
                if cfg.get("cmd"):
                    nursery.start_soon(self._initial_cmd, cfg)
                try:
                    await self._stop_request.wait()
                    await self._drain_workloads()
                finally:
                    self._life_nursery = None
                nursery.cancel_scope.cancel()
            if self.state == FAILED:
                return
            self._set(STOPPING)
            if self._stop_force and guest.machine.proc is not None:
                guest.channel.expect_eof()
                guest.machine.proc.kill()

    async def _after_restore(self, guest: Guest, cfg: dict[str, Any]) -> None:
        """A restored life: say where it came from, then the identity fixups (the clock
        was set by the hello). Port forwards are host state, not migrated: the life
        redoes them (_apply_ports) as after a boot."""
        self.timings["restored"] = time.monotonic()
        snap = self.restore_from
        if snap is not None:
            what = "the boot template" if self.template_failed is not None else f"snapshot {snap.id}"
            self.log.append("system", f"restored from {what}".encode())
        await self._fresh_identity(guest, cfg, clock=False)

    async def _fresh_identity(self, guest: Guest, cfg: dict[str, Any], *, clock: bool) -> None:
        """What a clone must not share with its snapshot: the clock (host time), the
        kernel's CRNG (reseeded with fresh host entropy, else every clone reads the
        same /dev/urandom stream), the hostname."""
        hostname = cfg.get("hostname") or "sandbox"
        try:
            if clock:
                await guest.channel.set_clock()
            await guest.channel.add_entropy(256)
            if hostname != self._guest_hostname:  # a pool member adopted as is keeps its own
                await guest.channel.set_hostname(hostname)
                self._guest_hostname = hostname
        except GuestError as exc:
            raise MachineError(f"post-restore fixups failed: {exc}") from None

    async def adopt(self, *, apply_ports: bool) -> None:
        """A warm pool member becomes the caller's sandbox (its record already holds the
        caller's configuration): fresh identity (it may have waited a while), the
        ports unless the member forwarded them already, then the initial command. A
        failure fails this sandbox, as it would fail a boot."""
        guest, cfg = self.guest, self.config
        if guest is None or self._life_nursery is None or self.state != READY:
            raise MachineError(f"pool member is {self.state}")
        try:
            await self._fresh_identity(guest, cfg, clock=True)
            if apply_ports:
                await self._apply_ports(guest)
        except MachineError as exc:
            self._fail(str(exc))
            self._stop_request.set()
            raise
        self.log.append("system", b"ready (from the warm pool)")
        self.touch()
        if cfg.get("cmd"):
            self._life_nursery.start_soon(self._initial_cmd, cfg)

    def _record_timings(self, guest: Guest) -> None:
        """Host and guest milestones on one clock. The guest reports seconds since its
        kernel started; the hello's arrival anchors that clock to ours."""
        info = guest.channel.hello_info
        t = {"spawned": guest.t_launch, "qmp_ready": guest.t_qmp, "hello": guest.t_ready}
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
            self._fail(guest.machine.describe_exit() if rc else "the guest powered off on its own")
            self._stop_request.set()
            scope.cancel()

    async def _drain_workloads(self) -> None:
        if self._stop_force or self.state == FAILED:
            return
        with trio.move_on_after(self._stop_timeout):
            await self._ckpt_done.wait()  # a checkpoint in progress finishes first
            while self.workloads or self.execs:
                await self._workload_done.wait()

    async def _initial_cmd(self, cfg: dict[str, Any]) -> None:
        workload = self.run_workload(
            cfg["cmd"], env=cfg.get("env") or {}, cwd=cfg.get("working_dir", ""), user=cfg.get("user", "")
        )
        try:
            async with aclosing(workload) as outputs:
                async for _ in outputs:
                    pass
        except ApiError as exc:
            self.log.append("system", f"initial cmd failed: {exc}".encode())
            self.emit("idle", exit_code="127", error=exc.message)

    # -- control ---------------------------------------------------------------
    def request_stop(self, timeout: float, *, force: bool = False) -> None:
        """Graceful (wait up to ``timeout`` for workloads, then power off) or forced."""
        if self.stopped:
            return
        self._stop_timeout = timeout
        self._stop_force = self._stop_force or force
        if not self._stop_request.is_set():
            if self.state in ALIVE:
                self._set(STOPPING)
            self.emit("stopping")
            self._stop_request.set()
        if self.guest is None:
            if self._life_scope is not None:  # still booting: abandon the boot
                self._life_scope.cancel()
        elif self._stop_force and self.guest.machine.proc is not None:
            self.guest.channel.expect_eof()
            self.guest.machine.proc.kill()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set() or self.state in (STOPPED, FAILED)

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    # -- work ------------------------------------------------------------------
    def _require_alive(self) -> Guest:
        if self.state not in ALIVE or self.guest is None:
            raise ApiError(FAILED_PRECONDITION, f"sandbox {self.id} is {self.state}, not ready or running")
        if self.draining or self._stop_request.is_set():
            raise ApiError(FAILED_PRECONDITION, f"sandbox {self.id} is draining or stopping: no new work")
        if self.checkpointing:
            raise ApiError(FAILED_PRECONDITION, f"sandbox {self.id} is being checkpointed; retry in a moment")
        return self.guest

    def check_checkpointable(self) -> Guest:
        guest = self._require_alive()
        if self.state != READY:
            raise ApiError(FAILED_PRECONDITION, f"sandbox {self.id} is {self.state}; checkpoint needs it ready")
        if self.execs or self.workloads:
            raise ApiError(FAILED_PRECONDITION, f"sandbox {self.id} has exec sessions open; checkpoint needs it idle")
        return guest

    async def checkpoint(self, snap_dir: Path) -> Checkpoint:
        """Save this sandbox into ``snap_dir``; it runs on afterwards. Only when ready
        with no exec session open: work in flight would be cloned into every restore."""
        guest = self.check_checkpointable()
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
                    raise ApiError(FAILED_PRECONDITION, f"sandbox {self.id}: guest channel busy; retry the checkpoint")
                try:
                    ck = await checkpoint_guest(
                        guest, disk=self.dir / "disk.qcow2", snap_dir=snap_dir, user=self.settings.qemu_user
                    )
                except MachineError as exc:
                    if not await still_running(guest):  # never leave a sandbox "ready" but paused
                        self._fail(f"checkpoint failed and the guest did not resume: {exc}")
                        self._stop_request.set()
                    raise ApiError(INTERNAL, f"checkpoint of {self.id} failed: {exc}") from None
                self.log.append("system", f"checkpoint: {ck.memory}, paused {ck.paused_s * 1000:.0f} ms".encode())
                return ck
            finally:
                self.checkpointing = False
                self._ckpt_done.set()

    def _defaults(self, env: dict[str, str], cwd: str, user: str) -> tuple[dict[str, str], str, str]:
        """The sandbox's create-time env, working dir and user are every command's
        defaults; a call's own values win."""
        cfg = self.config
        return {**(cfg.get("env") or {}), **env}, cwd or cfg.get("working_dir", ""), user or cfg.get("user", "")

    def _workload_finished(self) -> None:
        self._workload_done.set()
        self._workload_done = trio.Event()

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
        if self.state == RUNNING:
            raise ApiError(FAILED_PRECONDITION, f"sandbox {self.id} is running a workload already")
        if not argv:
            raise ApiError(INVALID_ARGUMENT, "cmd must not be empty")
        env, cwd, user = self._defaults(env, cwd, user)
        self.workloads += 1
        self._set(RUNNING)
        self.emit("running")
        self.touch()
        code = -1
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
            raise api_error(exc) from None
        except ChannelBroken as exc:
            raise api_error(exc) from None
        finally:
            self.workloads -= 1
            self.touch()
            if self.state == RUNNING:
                self._set(READY, last_exited_at=int(time.time()), last_exit_code=code)
                self.emit("idle", exit_code=str(code))
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
            raise ApiError(INVALID_ARGUMENT, "cmd must not be empty")
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
                raise api_error(exc) from None
        finally:
            self.execs -= 1
            self.touch()
            self._workload_finished()

    async def guest_call(self, fn: Callable[[Guest], Awaitable[Any]]) -> Any:
        await self._ckpt_done.wait()  # short calls wait out a checkpoint's pause
        guest = self._require_alive()
        try:
            return await fn(guest)
        except GuestError as exc:
            raise api_error(exc) from None

    # -- ports (user networking) -------------------------------------------------
    async def _apply_ports(self, guest: Guest) -> None:
        for pm in list(self.config.get("ports") or []):
            try:
                await self._hostfwd_add(guest, pm)
            except ApiError as exc:
                self.log.append("system", f"port {pm['sandbox_port']}/{pm['protocol']}: {exc.message}".encode())
                raise MachineError(f"cannot expose port {pm['sandbox_port']}: {exc.message}") from None
        self._persist_config(self.record)

    async def _hostfwd_add(self, guest: Guest, pm: dict[str, Any]) -> None:
        proto = pm.get("protocol") or "tcp"
        pm["protocol"] = proto
        if not pm.get("host_port"):
            pm["host_port"] = free_port(self.settings.expose_address, proto)
        rule = f"{proto}:{self.settings.expose_address}:{pm['host_port']}-:{pm['sandbox_port']}"
        reply = await guest.machine.hmp(f"hostfwd_add {NETDEV_ID} {rule}")
        if reply.strip():  # HMP reports failure as text, not as a QMP error
            if "host forwarding" in reply.lower():
                raise ApiError(
                    "ALREADY_EXISTS", f"host port {pm['host_port']}/{proto} is in use on {self.settings.expose_address}"
                )
            raise ApiError(FAILED_PRECONDITION, f"hostfwd_add: {reply.strip()[:200]}")

    async def expose(self, sandbox_port: int, host_port: int, protocol: str) -> dict[str, Any]:
        guest = self._require_alive()
        if self.network is None:
            raise ApiError(
                FAILED_PRECONDITION, f"sandbox {self.id} has no network (create it with network mode 'user')"
            )
        proto = protocol or "tcp"
        if proto == "udp" and self.network is not None and self.network.restrict:
            raise ApiError(
                FAILED_PRECONDITION,
                "QEMU's restricted user networking drops the guest's UDP replies (measured); expose UDP on a "
                "sandbox created with outbound networking allowed",
            )
        async with self._ports_lock:
            ports = self.config.setdefault("ports", [])
            if any(p["sandbox_port"] == sandbox_port and p["protocol"] == proto for p in ports):
                raise ApiError("ALREADY_EXISTS", f"port {sandbox_port}/{proto} is exposed already")
            pm = {"sandbox_port": sandbox_port, "host_port": host_port, "protocol": proto}
            await self._hostfwd_add(guest, pm)
            ports.append(pm)
            self._persist_config(self.record)
        return pm

    async def unexpose(self, sandbox_port: int, protocol: str) -> None:
        proto = protocol or "tcp"
        async with self._ports_lock:
            ports = self.config.setdefault("ports", [])
            match = [p for p in ports if p["sandbox_port"] == sandbox_port and p["protocol"] == proto]
            if not match:
                raise ApiError(NOT_FOUND, f"port {sandbox_port}/{proto} is not exposed")
            pm = match[0]
            if self.guest is not None and self.state in ALIVE:
                reply = await self.guest.machine.hmp(
                    f"hostfwd_remove {NETDEV_ID} {proto}:{self.settings.expose_address}:{pm['host_port']}"
                )
                if reply.strip() and "removed" not in reply:  # success is reported as text too
                    raise ApiError(FAILED_PRECONDITION, f"hostfwd_remove: {reply.strip()[:200]}")
            ports.remove(pm)
            self._persist_config(self.record)

    # -- metrics ---------------------------------------------------------------
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


def free_port(address: str, protocol: str) -> int:
    """A port nobody listens on right now (the kernel's choice)."""
    kind = socket.SOCK_DGRAM if protocol == "udp" else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
