"""The registry actor: names and ids, the event bus, TTL and idle timers, listing.

It owns every :class:`~actors.sandbox.Sandbox` of the supervisor and the nursery
their VM lives run in, the SQLite store, and the event bus. The server calls its
methods; they validate (typed :class:`~supervisor.protocol.ApiError`), change the
registry synchronously (so two creates with one id race to exactly one sandbox)
and start or stop sandbox lives.

Event bus: each subscriber has a bounded buffer; a subscriber that falls behind by
more than that is told it lagged and is dropped. Publishing never blocks.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.sandbox import ALIVE, FAILED, RUNNING, STARTING, STOPPED, STOPPING, Sandbox, Settings
from supervisor.protocol import (
    ALREADY_EXISTS,
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    ApiError,
    CreateSandboxRequest,
    ListSandboxesRequest,
    ResourceLimits,
    SandboxEvent,
    SandboxInfo,
    SandboxNetwork,
    SandboxSummary,
    unstructure_body,
)
from supervisor.store import Record, Store

log = logging.getLogger("sandvisor.registry")

MAX_ID_BYTES = 128
RESERVED_LABEL_PREFIXES = ("sandbox.", "sandvisor.")
STATES = (STARTING, "ready", RUNNING, STOPPING, STOPPED, FAILED)
ACTIONS = ("created", "ready", "running", "idle", "stopping", "stopped", "failed", "removed")
DEFAULT_STOP_TIMEOUT = 30.0
MAX_WORKLOAD_BYTES = 256 * 1024  # well inside the guest channel's frame cap


class Lagged(Exception):
    """The subscriber fell behind the event bus and was dropped."""


@attrs.define(eq=False)
class Subscription:
    id: str
    action: str
    send: trio.MemorySendChannel[SandboxEvent]
    receive: trio.MemoryReceiveChannel[SandboxEvent]
    lagged: bool = False

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> SandboxEvent:
        try:
            return await self.receive.receive()
        except trio.EndOfChannel:
            if self.lagged:
                raise Lagged("event subscriber fell behind and was dropped") from None
            raise StopAsyncIteration from None


class EventBus:
    def __init__(self, buffer: int = 256) -> None:
        self.buffer = buffer
        self.subs: list[Subscription] = []
        self.published = 0

    def subscribe(self, id: str = "", action: str = "") -> Subscription:
        send, receive = trio.open_memory_channel[SandboxEvent](self.buffer)
        sub = Subscription(id, action, send, receive)
        self.subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self.subs:
            self.subs.remove(sub)
        sub.send.close()

    def publish(self, ev: SandboxEvent) -> None:
        self.published += 1
        for sub in list(self.subs):
            if (sub.id and sub.id != ev.sandbox_id) or (sub.action and sub.action != ev.action):
                continue
            try:
                sub.send.send_nowait(ev)
            except trio.WouldBlock:
                sub.lagged = True
                self.unsubscribe(sub)
            except trio.ClosedResourceError:
                self.unsubscribe(sub)


def validate_id(id: str) -> None:
    if len(id.encode()) > MAX_ID_BYTES:
        raise ApiError(INVALID_ARGUMENT, f"id is {len(id.encode())} bytes; at most {MAX_ID_BYTES} UTF-8 bytes")
    if any(ord(c) < 32 or ord(c) == 127 for c in id):
        raise ApiError(INVALID_ARGUMENT, "id must not contain control characters")
    if id.strip() != id:
        raise ApiError(INVALID_ARGUMENT, "id must not start or end with whitespace")


def validate_port(sandbox_port: int, host_port: int, protocol: str) -> None:
    if not 0 < sandbox_port <= 65535 or not 0 <= host_port <= 65535:
        raise ApiError(INVALID_ARGUMENT, "ports must be 1-65535 (host_port 0 allocates one)")
    if protocol not in ("tcp", "udp", ""):
        raise ApiError(INVALID_ARGUMENT, f"protocol {protocol!r}: tcp or udp")


def validate_labels(labels: dict[str, str]) -> None:
    for k, v in labels.items():
        if not k:
            raise ApiError(INVALID_ARGUMENT, "label keys must not be empty")
        if len(k.encode()) > 256 or len(v.encode()) > 4096:
            raise ApiError(INVALID_ARGUMENT, f"label {k[:40]!r} is too long")
        if k.startswith(RESERVED_LABEL_PREFIXES):
            raise ApiError(INVALID_ARGUMENT, f"label {k!r}: the prefixes sandbox. and sandvisor. are reserved")


class Registry:
    def __init__(self, settings: Settings, store: Store, *, max_sandboxes: int = 64) -> None:
        self.settings = settings
        self.store = store
        self.max_sandboxes = max_sandboxes
        self.sandboxes: dict[str, Sandbox] = {}
        self.events = EventBus()
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._removing: set[str] = set()

    # -- lifecycle of the registry ---------------------------------------------
    async def run(self, task_status: trio.TaskStatus[Registry] = trio.TASK_STATUS_IGNORED) -> None:
        self.settings.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.settings.run_root.mkdir(parents=True, exist_ok=True)
        if self.settings.qemu_user is not None:
            self.settings.run_root.chmod(0o711)  # QEMU's user reaches its own run dir, lists none
            _check_traversable(self.settings.run_root, self.settings.qemu_user.name)
        self._recover()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._timers)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for sb in self.sandboxes.values():
                sb.log.close()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every sandbox (bounded), for supervisor exit. Shielded."""
        self._closing = True
        with trio.CancelScope(shield=True):
            for sb in self.sandboxes.values():
                sb.request_stop(timeout)
            await self._wait_all(timeout + 5)
            for sb in self.sandboxes.values():
                if not sb.stopped:
                    sb.request_stop(0, force=True)
            await self._wait_all(10)

    async def _wait_all(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            for sb in list(self.sandboxes.values()):
                if not sb.stopped:
                    await sb.wait_stopped()

    def _recover(self) -> None:
        """Records of the previous supervisor: a VM it left running is killed, never adopted."""
        for rec in self.store.all():
            sb = Sandbox(rec, self.settings, self._emit, self.store.update, self.store.update_config)
            if rec.state in (STARTING, *ALIVE, STOPPING):
                killed = _kill_orphan(rec.qemu_pid, rec.uid)
                rec.state = FAILED
                rec.error = "the supervisor exited while this sandbox was running" + (
                    " (its QEMU process was killed)" if killed else ""
                )
                rec.qemu_pid = 0
                self.store.update(rec)
            self.sandboxes[rec.id] = sb
        for stale in self.settings.run_root.glob("*"):
            shutil.rmtree(stale, ignore_errors=True)

    def _emit(self, sandbox_id: str, action: str, attributes: dict[str, str]) -> None:
        self.events.publish(SandboxEvent(sandbox_id, action, time.time_ns(), dict(attributes)))

    # -- lookups ---------------------------------------------------------------
    def get(self, id: str) -> Sandbox:
        sb = self.sandboxes.get(id)
        if sb is None:
            raise ApiError(NOT_FOUND, f"no sandbox {id!r}")
        return sb

    def info(self, sb: Sandbox) -> SandboxInfo:
        r = sb.record
        limits = r.config.get("limits") or {}
        return SandboxInfo(
            id=r.id,
            state=r.state,
            labels=dict(r.config.get("labels") or {}),
            limits=ResourceLimits(
                vcpus=int(limits.get("vcpus") or self.settings.default_vcpus),
                memory_mib=int(limits.get("memory_mib") or self.settings.default_memory_mib),
            ),
            network=SandboxNetwork(ip_address=sb.ip_address, gateway=sb.gateway),
            created_at=r.created_at,
            ready_at=r.ready_at,
            last_exited_at=r.last_exited_at,
            last_exit_code=r.last_exit_code,
            error=r.error if r.state == FAILED else "",
        )

    def list(self, req: ListSandboxesRequest) -> tuple[list[SandboxSummary], str]:
        if req.state and req.state not in STATES:
            raise ApiError(INVALID_ARGUMENT, f"unknown state {req.state!r}; one of {', '.join(STATES)}")
        limit = req.limit or 20
        if not 1 <= limit <= 100:
            raise ApiError(INVALID_ARGUMENT, "limit must be between 1 and 100")
        before = _decode_cursor(req.cursor) if req.cursor else None
        matches = [
            sb
            for sb in sorted(self.sandboxes.values(), key=lambda s: s.record.seq, reverse=True)
            if (not req.state or sb.state == req.state)
            and all((sb.config.get("labels") or {}).get(k) == v for k, v in req.labels.items())
            and (before is None or sb.record.seq < before)
        ]
        page = matches[:limit]
        cursor = _encode_cursor(page[-1].record.seq) if len(matches) > limit else ""
        return [
            SandboxSummary(
                id=sb.id,
                state=sb.state,
                labels=dict(sb.config.get("labels") or {}),
                ip_address="",
                created_at=sb.record.created_at,
            )
            for sb in page
        ], cursor

    # -- operations --------------------------------------------------------------
    async def create(self, req: CreateSandboxRequest) -> Sandbox:
        self._check_open()
        self._validate_create(req)
        config = unstructure_body(req)
        config.pop("id", None)
        if req.id and req.id in self.sandboxes:
            existing = self.sandboxes[req.id]
            if existing.config == config:
                return existing  # idempotent: same id, same request
            raise ApiError(ALREADY_EXISTS, f"sandbox {req.id!r} exists with a different configuration")
        if sum(1 for s in self.sandboxes.values() if not s.stopped) >= self.max_sandboxes:
            raise ApiError(RESOURCE_EXHAUSTED, f"at most {self.max_sandboxes} sandboxes may run at once")
        uid = str(uuid.uuid4())
        rec = Record(
            uid=uid,
            id=req.id or uid,
            seq=self.store.next_seq(),
            config=config,
            state=STARTING,
            created_at=int(time.time()),
        )
        self.store.insert(rec)
        sb = Sandbox(rec, self.settings, self._emit, self.store.update, self.store.update_config)
        self.sandboxes[rec.id] = sb
        self._emit(rec.id, "created", {})
        await self._start_life(sb)
        return sb

    async def _start_life(self, sb: Sandbox) -> None:
        assert self._nursery is not None, "registry is not running"
        sb.timings = {"accepted": time.monotonic()}
        await self._nursery.start(sb.run)

    def _validate_create(self, req: CreateSandboxRequest) -> None:
        validate_id(req.id)
        validate_labels(req.labels)
        if req.image:
            raise ApiError(
                FAILED_PRECONDITION,
                "OCI images are not supported in sandbox.v1: pass an ext4 root filesystem as 'rootfs' instead",
            )
        if req.mounts:
            raise ApiError(FAILED_PRECONDITION, "mounts are not supported in sandbox.v1: copy files in with WriteFile")
        if req.ssh_public_key is not None:
            raise ApiError(FAILED_PRECONDITION, "ssh keys are not supported in sandbox.v1: use Exec for access")
        if req.network.mode == "tap":
            raise ApiError(FAILED_PRECONDITION, "network mode 'tap' is not available yet; use 'user' or 'none'")
        if req.network.mode not in ("", "none", "user"):
            raise ApiError(INVALID_ARGUMENT, f"network mode {req.network.mode!r}: one of none, user")
        if req.ports and req.network.mode != "user":
            raise ApiError(FAILED_PRECONDITION, "ports need network mode 'user'")
        seen = set()
        for pm in req.ports:
            validate_port(pm.sandbox_port, pm.host_port, pm.protocol)
            if (pm.sandbox_port, pm.protocol) in seen:
                raise ApiError(ALREADY_EXISTS, f"port {pm.sandbox_port}/{pm.protocol} is given twice")
            seen.add((pm.sandbox_port, pm.protocol))
        if req.limits.vcpus < 0 or req.limits.vcpus > max(1, os.cpu_count() or 1) * 4:
            raise ApiError(INVALID_ARGUMENT, f"vcpus must be 0 (default) to {(os.cpu_count() or 1) * 4}")
        if req.limits.memory_mib and not 64 <= req.limits.memory_mib <= 65536:
            raise ApiError(INVALID_ARGUMENT, "memory_mib must be 0 (default) or 64 to 65536")
        if req.ttl_seconds < 0 or req.idle_timeout_seconds < 0:
            raise ApiError(INVALID_ARGUMENT, "ttl_seconds and idle_timeout_seconds must not be negative")
        for what, path in (("kernel", req.kernel), ("rootfs", req.rootfs)):
            if path and not Path(path).is_file():
                raise ApiError(NOT_FOUND, f"{what} {path!r} is not a file on the supervisor's host")
        if req.hostname and (len(req.hostname) > 63 or not req.hostname.replace("-", "").isalnum()):
            raise ApiError(INVALID_ARGUMENT, "hostname must be 1-63 letters, digits or '-'")
        if any(not isinstance(a, str) or not a for a in req.cmd[:1]):
            raise ApiError(INVALID_ARGUMENT, "cmd[0] must not be empty")
        workload = sum(len(x.encode()) for x in (*req.cmd, *req.env, *req.env.values(), req.working_dir, req.user))
        if workload > MAX_WORKLOAD_BYTES:
            raise ApiError(INVALID_ARGUMENT, f"cmd, env, working_dir and user take {workload} bytes; at most 256 KiB")
        if len(req.boot_args) > 1024 or "\n" in req.boot_args:
            raise ApiError(INVALID_ARGUMENT, "boot_args must be one line of at most 1024 bytes")

    async def start(self, id: str) -> Sandbox:
        self._check_open()
        sb = self.get(id)
        if sb.state not in (STOPPED, FAILED):
            raise ApiError(FAILED_PRECONDITION, f"sandbox {id} is {sb.state}; only a stopped sandbox can start")
        await self._start_life(sb)
        return sb

    def stop(self, id: str, timeout: float = DEFAULT_STOP_TIMEOUT) -> Sandbox:
        sb = self.get(id)
        sb.request_stop(timeout)
        return sb

    def kill(self, id: str) -> Sandbox:
        sb = self.get(id)
        sb.request_stop(0, force=True)
        return sb

    def drain(self, id: str) -> Sandbox:
        sb = self.get(id)
        if sb.state not in (*ALIVE, STARTING):
            raise ApiError(FAILED_PRECONDITION, f"sandbox {id} is {sb.state}")
        sb.draining = True
        sb.request_stop(24 * 3600.0)  # no new work; in-flight work finishes, however long
        return sb

    async def remove(self, id: str, force: bool = False) -> None:
        sb = self.get(id)
        if sb.state == RUNNING and not force:
            raise ApiError(FAILED_PRECONDITION, f"sandbox {id} is running a workload; use force to remove it")
        if not sb.stopped:
            sb.request_stop(0, force=True)
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                await sb.wait_stopped()
        if self.sandboxes.get(id) is not sb:
            return  # removed meanwhile by another call
        del self.sandboxes[id]
        sb.log.close()
        self.store.delete(sb.record.uid)
        shutil.rmtree(sb.dir, ignore_errors=True)
        shutil.rmtree(sb.run_dir, ignore_errors=True)
        self._emit(id, "removed", {})

    def _check_open(self) -> None:
        if self._closing:
            raise ApiError("UNAVAILABLE", "the supervisor is shutting down")

    # -- timers ------------------------------------------------------------------
    async def _timers(self) -> None:
        """TTL (from creation; not reset by activity) removes; idle timeout stops."""
        while True:
            await trio.sleep(0.25)
            now_wall, now = time.time(), time.monotonic()
            for sb in list(self.sandboxes.values()):
                if sb.config.get("ephemeral") and sb.stopped and sb.id in self.sandboxes:
                    assert self._nursery is not None
                    self._nursery.start_soon(self._remove_quietly, sb.id)
                    continue
                ttl = int(sb.config.get("ttl_seconds") or 0)
                if ttl and now_wall >= sb.record.created_at + ttl:
                    sb.log.append("system", b"ttl expired: removing")
                    assert self._nursery is not None
                    self._nursery.start_soon(self._remove_quietly, sb.id)
                    continue
                idle = int(sb.config.get("idle_timeout_seconds") or 0)
                if (
                    idle
                    and sb.state == "ready"
                    and not sb.workloads
                    and not sb.execs
                    and now - sb.last_activity >= idle
                    and not sb.stopped
                ):
                    sb.log.append("system", b"idle timeout: stopping")
                    sb.request_stop(DEFAULT_STOP_TIMEOUT)

    async def _remove_quietly(self, id: str) -> None:
        if id in self._removing:
            return
        self._removing.add(id)
        try:
            await self.remove(id, force=True)
        except ApiError:
            pass
        finally:
            self._removing.discard(id)

    def statistics(self) -> dict[str, Any]:
        return {
            "sandboxes": len(self.sandboxes),
            "alive": sum(1 for s in self.sandboxes.values() if not s.stopped),
            "subscribers": len(self.events.subs),
            "events_published": self.events.published,
        }


def _check_traversable(path: Path, user: str) -> None:
    """QEMU runs as ``user`` and creates its guest socket under ``path``: every parent
    must let others through (o+x). Said at start, not at the first boot's failure."""
    for parent in [path.resolve(), *path.resolve().parents]:
        if not parent.stat().st_mode & 0o001:
            raise ApiError(
                FAILED_PRECONDITION,
                f"the run root {path} is not reachable by QEMU's user {user!r}: {parent} is not o+x "
                "(choose another run root, or another --qemu-user)",
            )


def _encode_cursor(seq: int) -> str:
    return base64.urlsafe_b64encode(f"seq:{seq}".encode()).decode()


def _decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor.encode()).decode()
        kind, _, value = raw.partition(":")
        if kind != "seq":
            raise ValueError
        return int(value)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(INVALID_ARGUMENT, "invalid cursor") from None


def _kill_orphan(pid: int, uid: str) -> bool:
    """Kill a QEMU left by a dead supervisor, only if it is really ours (its argv names the uid)."""
    if not pid:
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if b"qemu" not in argv or uid[:18].encode() not in argv:
        return False
    try:
        os.kill(pid, 9)
    except OSError:
        return False
    return True
