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
import builtins
import functools
import hashlib
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.disk import backing_chain, create_overlay
from actors.machine import MachineError, unsearchable_parent
from actors.sandbox import ALIVE, FAILED, READY, RUNNING, STARTING, STOPPED, STOPPING, Sandbox, Settings
from actors.snapshot import Checkpoint, SnapshotStore, checkpoint_guest, still_running
from actors.vm import Guest
from supervisor.protocol import (
    ALREADY_EXISTS,
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    ApiError,
    CheckpointRequest,
    CreateSandboxRequest,
    ListSandboxesRequest,
    ResourceLimits,
    RestoreRequest,
    SandboxEvent,
    SandboxInfo,
    SandboxNetwork,
    SandboxSummary,
    unstructure_body,
)
from supervisor.store import Record, SnapshotRecord, Store

log = logging.getLogger("sandvisor.registry")

MAX_ID_BYTES = 128
RESERVED_LABEL_PREFIXES = ("sandbox.", "sandvisor.")
STATES = (STARTING, "ready", RUNNING, STOPPING, STOPPED, FAILED)
ACTIONS = ("created", "ready", "running", "idle", "stopping", "stopped", "failed", "removed")
DEFAULT_STOP_TIMEOUT = 30.0
MAX_WORKLOAD_BYTES = 256 * 1024  # well inside the guest channel's frame cap
STALE = "the image or accelerator changed"
TEMPLATE_LABEL = "sandvisor.template"  # reserved prefix: no caller can set it
POOL_PREFIX = "\x00pool:"  # ids of warm pool members: no caller id can hold a control character


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
    def __init__(
        self,
        settings: Settings,
        store: Store,
        *,
        max_sandboxes: int = 64,
        pool_size: int = 0,
        pools: dict[str, int] | None = None,
        templates: bool = True,
        template_pool: int = 0,
    ) -> None:
        self.settings = settings
        self.store = store
        self.max_sandboxes = max_sandboxes
        self.sandboxes: dict[str, Sandbox] = {}
        self.snapshots = SnapshotStore(settings.sandboxes_dir.parent / "snapshots", store, settings.qemu_user)
        # warm pools: restored sandboxes kept ready per snapshot, hidden until taken
        self.pool_size = pool_size  # for every snapshot
        self.pool_sizes = dict(pools or {})  # per snapshot id or name (wins)
        self.pool: dict[str, list[Sandbox]] = {}
        self._pool_wake = trio.Event()
        # boot templates: per configuration key, a hidden snapshot of a fresh boot that
        # Creates of that configuration restore instead of booting
        self.templates = templates
        self.template_pool = template_pool  # warm members per boot template: Creates in milliseconds
        self._template_pending: set[str] = set()
        self._template_broken: set[str] = set()  # keys whose template failed: boot until restart
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
        if self.settings.memory_dir is not None:
            self.settings.memory_dir.mkdir(parents=True, exist_ok=True)
            self.settings.memory_dir.chmod(0o711)
        self.snapshots.load()
        self._drop_stale_templates()
        self._recover()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._timers)
                nursery.start_soon(self._pool_keeper)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for sb in [*self.sandboxes.values(), *(m for ms in self.pool.values() for m in ms)]:
                sb.log.close()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every sandbox (bounded), for supervisor exit. Shielded."""
        self._closing = True
        with trio.CancelScope(shield=True):
            for members in self.pool.values():
                for sb in members:
                    sb.request_stop(0, force=True)
            for sb in self.sandboxes.values():
                sb.request_stop(timeout)
            await self._wait_all(timeout + 5)
            for sb in self.sandboxes.values():
                if not sb.stopped:
                    sb.request_stop(0, force=True)
            await self._wait_all(10)
            for sid in list(self.pool):
                await self._drain_pool(sid)  # pool members are disposable: nothing of them stays

    async def _wait_all(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            for sb in [*self.sandboxes.values(), *(m for ms in self.pool.values() for m in ms)]:
                if not sb.stopped:
                    await sb.wait_stopped()

    def _recover(self) -> None:
        """Records of the previous supervisor: a VM it left running is killed, never adopted."""
        for rec in self.store.all():
            sb = Sandbox(rec, self.settings, self._emit, self.store.update, self.store.update_config)
            if rec.id.startswith(POOL_PREFIX):  # a warm pool member: its QEMU goes, and so does it
                _kill_orphan(rec.qemu_pid, rec.uid)
                self._forget(sb)
                continue
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
        if self.settings.memory_dir is not None:
            for stale in self.settings.memory_dir.glob("*.ram"):
                stale.unlink(missing_ok=True)
        self._collect_snapshot_dirs()

    def _disks(self) -> list[tuple[str, Path]]:
        """(who, overlay) of every sandbox and pool member that has a disk."""
        out = []
        for sb in [*self.sandboxes.values(), *(m for ms in self.pool.values() for m in ms)]:
            disk = sb.dir / "disk.qcow2"
            if disk.exists():
                out.append((f"sandbox {sb.id}" if not sb.id.startswith(POOL_PREFIX) else "a warm pool member", disk))
        return out

    def _collect_snapshot_dirs(self) -> None:
        def in_use() -> set[Path]:
            used: set[Path] = set()
            for _, disk in self._disks():
                try:
                    used.update(backing_chain(disk))
                except MachineError:
                    continue
            return used

        n = self.snapshots.collect(in_use)
        if n:
            log.info("removed %d snapshot directories nothing uses", n)

    def _emit(self, sandbox_id: str, action: str, attributes: dict[str, str]) -> None:
        if sandbox_id.startswith(POOL_PREFIX):
            return  # pool members are invisible until taken
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
        key = self.template_key(config)
        tpl = self._template(key) if key is not None else None
        member = self._take_member(tpl) if tpl is not None else None
        if member is not None:
            await self._adopt(member, req.id, config, {"pool": "1"}, apply_ports=True)
            return member  # failed, with its error, if the adoption failed: as a failed boot
        sb = self._new_sandbox(req.id, config)
        self.store.insert(sb.record)
        self.sandboxes[sb.id] = sb
        self._emit(sb.id, "created", {})
        t_accepted = time.monotonic()
        await self._use_template(sb)
        await self._start_life(sb)
        sb.timings["accepted"] = t_accepted
        return sb

    def _new_sandbox(self, id: str, config: dict[str, Any], *, hidden: bool = False) -> Sandbox:
        """A sandbox actor with a fresh record (not stored or registered yet). Hidden:
        a warm pool member, with an id no caller can use."""
        uid = str(uuid.uuid4())
        rec = Record(
            uid=uid,
            id=POOL_PREFIX + uid if hidden else id or uid,
            seq=0 if hidden else self.store.next_seq(),
            config=config,
            state=STARTING,
            created_at=int(time.time()),
        )
        return Sandbox(rec, self.settings, self._emit, self.store.update, self.store.update_config)

    def _forget(self, sb: Sandbox) -> None:
        """The end of a sandbox that has stopped: its record, log, directories."""
        sb.log.close()
        self.store.delete(sb.record.uid)
        shutil.rmtree(sb.dir, ignore_errors=True)
        shutil.rmtree(sb.run_dir, ignore_errors=True)

    async def _adopt(
        self, sb: Sandbox, id: str, config: dict[str, Any], created: dict[str, str], *, apply_ports: bool
    ) -> bool:
        """A ready warm pool member becomes the caller's sandbox: the caller's id and
        configuration, created; fresh identity, ports, initial command (Sandbox.adopt);
        ready. False if that failed (the sandbox is then failed, and stopping)."""
        t_accepted = time.monotonic()
        rec = sb.record
        rec.id = id or rec.uid
        rec.seq = self.store.next_seq()
        rec.created_at = rec.ready_at = int(time.time())
        rec.config = config
        self.store.rekey(rec)
        self.sandboxes[rec.id] = sb
        self._emit(rec.id, "created", created)
        try:
            await sb.adopt(apply_ports=apply_ports)
        except MachineError:
            return False
        self._emit(rec.id, "ready", {})
        sb.timings = {"accepted": t_accepted, "ready_event": time.monotonic(), "pool": 1.0}
        return True

    # -- boot templates ------------------------------------------------------------
    def template_key(self, config: dict[str, Any]) -> str | None:
        """What a fresh boot depends on; None when the configuration boots differently
        (own kernel, rootfs or boot arguments). The hostname, env, cmd, ports, TTL...
        are set after the boot anyway."""
        if not self.templates or config.get("kernel") or config.get("rootfs") or config.get("boot_args"):
            return None
        s, img = self.settings, self.settings.image
        limits = config.get("limits") or {}
        net = config.get("network") or {}
        parts = [
            s.accel,
            str(img.kernel),
            str(img.initrd),
            str(img.rootfs),
            str(int(limits.get("memory_mib") or s.default_memory_mib)),
            str(int(limits.get("vcpus") or s.default_vcpus)),
            net.get("mode") or "none",
            "outbound" if net.get("outbound") else "",
            "mapped" if s.memory_dir is not None else "anon",
        ]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]

    def _image_parts(self) -> builtins.list[str]:
        img = self.settings.image
        return [str(img.kernel), str(img.initrd), str(img.rootfs)]

    def _drop_stale_templates(self) -> None:
        """Templates of another image or accelerator are of no use any more."""
        for r in list(self.snapshots.snapshots.values()):
            if TEMPLATE_LABEL in r.labels and (
                r.config.get("image") != self._image_parts() or r.machine.get("accel") != self.settings.accel
            ):
                self._template_failed(r, STALE)

    def _template(self, key: str) -> SnapshotRecord | None:
        for r in self.snapshots.snapshots.values():
            if r.labels.get(TEMPLATE_LABEL) == key:
                return r
        return None

    async def _use_template(self, sb: Sandbox) -> None:
        key = self.template_key(sb.config)
        if key is None or key in self._template_broken:
            return
        tpl = self._template(key)
        if tpl is not None:
            try:
                self._check_restorable(tpl)
                await create_overlay(self.snapshots.disk(tpl), sb.dir / "disk.qcow2")
            except (ApiError, MachineError) as exc:
                self._template_failed(tpl, str(getattr(exc, "message", exc)))
                return
            sb.restore_from = tpl
            sb.template_failed = self._template_failed
        elif key not in self._template_pending:
            self._template_pending.add(key)
            sb.make_template = functools.partial(self._make_template, key)

    async def _make_template(self, key: str, sb: Sandbox, guest: Guest) -> None:
        """Checkpoint a fresh boot (at its first ready, before any user work) as the
        template of its configuration. Failing costs nothing but the template."""
        uid, snap_dir = self.snapshots.new_dir()
        try:
            ck = await checkpoint_guest(
                guest, disk=sb.dir / "disk.qcow2", snap_dir=snap_dir, user=self.settings.qemu_user
            )
        except (MachineError, OSError) as exc:
            log.warning("boot template %s: checkpoint failed: %s", key, exc)
            self.snapshots.settle(snap_dir)
            self._collect_snapshot_dirs()
            if not await still_running(guest):
                raise MachineError(f"the guest did not resume after a failed template checkpoint: {exc}") from None
            return
        except BaseException:  # cancelled: the directory is garbage unless a disk froze into it
            self.snapshots.settle(snap_dir)
            raise
        finally:
            self._template_pending.discard(key)
        cfg = {k: v for k, v in sb.config.items() if k in ("limits", "network")}
        cfg["image"] = self._image_parts()
        self.snapshots.add(
            SnapshotRecord(
                uid=uid,
                id=self.snapshots.new_id(),
                name="",
                labels={TEMPLATE_LABEL: key},
                sandbox_id="",
                origin_uid=sb.record.uid,
                created_ns=time.time_ns(),
                dir=str(snap_dir),
                memory=ck.memory,
                machine=ck.machine,
                config=cfg,
                sizes=ck.sizes,
                memory_stat=ck.memory_stat,
            )
        )
        self.snapshots.settle(snap_dir)
        sb.log.append("system", f"boot template {key} saved (paused {ck.paused_s * 1000:.0f} ms)".encode())

    def _template_failed(self, tpl: SnapshotRecord, why: str) -> None:
        """A template that does not restore is dropped (its files go once unused)."""
        key = tpl.labels.get(TEMPLATE_LABEL, "")
        log.warning("boot template %s dropped: %s", key, why)
        if why != STALE:
            self._template_broken.add(key)  # a new one would likely fail the same way
        if self.snapshots.snapshots.get(tpl.id) is tpl:
            self.snapshots.store.delete_snapshot(tpl.uid)
            self.snapshots.snapshots.pop(tpl.id, None)

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
        self._forget(sb)
        self._emit(id, "removed", {})
        self._collect_snapshot_dirs()

    # -- snapshots (SandboxSnapshotService) ------------------------------------------
    async def checkpoint(self, req: CheckpointRequest) -> tuple[SnapshotRecord, Checkpoint]:
        self._check_open()
        validate_labels(req.labels)
        if len(req.name.encode()) > 256 or any(ord(c) < 32 for c in req.name):
            raise ApiError(INVALID_ARGUMENT, "name must be at most 256 bytes without control characters")
        sb = self.get(req.sandbox_id)
        sb.check_checkpointable()  # before a directory is made for nothing
        uid, snap_dir = self.snapshots.new_dir()
        created = time.time_ns()
        try:
            ck = await sb.checkpoint(snap_dir)
        except BaseException:
            self.snapshots.settle(snap_dir)
            with trio.CancelScope(shield=True):
                self._collect_snapshot_dirs()  # kept only if the disk froze into it
            raise
        rec = SnapshotRecord(
            uid=uid,
            id=self.snapshots.new_id(),
            name=req.name,
            labels=dict(req.labels),
            sandbox_id=sb.id,
            origin_uid=sb.record.uid,
            created_ns=created,
            dir=str(snap_dir),
            memory=ck.memory,
            machine=ck.machine,
            config=dict(sb.config),
            sizes=ck.sizes,
            memory_stat=ck.memory_stat,
        )
        self.snapshots.add(rec)
        self.snapshots.settle(snap_dir)
        self._pool_wake.set()
        return rec, ck

    def _restored_config(self, snap: SnapshotRecord, labels: dict[str, str], ttl: int) -> dict[str, Any]:
        cfg = dict(snap.config)
        cfg.update(labels=dict(labels), ttl_seconds=ttl, cmd=[], ephemeral=False, restored_from=snap.id)
        # forwards are host state: each restore gets its own host ports
        cfg["ports"] = [
            {"sandbox_port": p["sandbox_port"], "protocol": p.get("protocol") or "tcp", "host_port": 0}
            for p in cfg.get("ports") or []
        ]
        return cfg

    def _check_restorable(self, snap: SnapshotRecord) -> None:
        accel = snap.machine.get("accel")
        if accel != self.settings.accel:
            raise ApiError(
                FAILED_PRECONDITION,
                f"snapshot {snap.id} was taken under {accel}; this supervisor runs {self.settings.accel}",
            )
        for part in ("vmstate", "disk.qcow2", "kernel", "initrd"):
            if not (Path(snap.dir) / part).exists():
                raise ApiError(FAILED_PRECONDITION, f"snapshot {snap.id} is incomplete on disk: {part} is missing")
        self.snapshots.check_memory(snap)

    async def restore(self, req: RestoreRequest) -> Sandbox:
        """A new sandbox from a snapshot, returned once ready (as the seed says)."""
        self._check_open()
        validate_id(req.id)
        validate_labels(req.labels)
        if req.ttl_seconds < 0:
            raise ApiError(INVALID_ARGUMENT, "ttl_seconds must not be negative")
        snap = self.snapshots.get(req.snapshot_id)
        if req.id and req.id in self.sandboxes:
            raise ApiError(ALREADY_EXISTS, f"sandbox {req.id!r} exists")
        self._check_restorable(snap)
        config = self._restored_config(snap, req.labels, req.ttl_seconds)
        member = self._take_member(snap)
        if member is not None:
            # the member forwarded the snapshot's ports already, on its own host ports
            config["ports"] = member.config.get("ports") or []
            if not await self._adopt(member, req.id, config, {"snapshot_id": snap.id, "pool": "1"}, apply_ports=False):
                error = member.record.error
                with trio.CancelScope(shield=True):
                    await self.remove(member.id, force=True)
                raise ApiError(UNAVAILABLE, f"restore from {snap.id} failed: {error}")
            return member
        if sum(1 for s in self.sandboxes.values() if not s.stopped) >= self.max_sandboxes:
            raise ApiError(RESOURCE_EXHAUSTED, f"at most {self.max_sandboxes} sandboxes may run at once")
        t_accepted = time.monotonic()
        sb = self._new_sandbox(req.id, config)
        rec = sb.record
        sb.restore_from = snap
        try:
            await create_overlay(self.snapshots.disk(snap), sb.dir / "disk.qcow2")
            if req.id and req.id in self.sandboxes:  # another restore or create took the id meanwhile
                raise ApiError(ALREADY_EXISTS, f"sandbox {req.id!r} exists")
        except BaseException:
            self._forget(sb)  # nothing of it was stored or registered yet
            raise
        self.store.insert(rec)
        self.sandboxes[rec.id] = sb
        self._emit(rec.id, "created", {"snapshot_id": snap.id})
        await self._start_life(sb)
        sb.timings["accepted"] = t_accepted  # the overlay is part of the restore's cost
        await sb.ready_event.wait()
        if sb.state != READY:
            error = sb.record.error or sb.state
            with trio.CancelScope(shield=True):
                await self.remove(rec.id, force=True)
            raise ApiError(UNAVAILABLE, f"restore from {snap.id} failed: {error}")
        return sb

    def list_snapshots(
        self, sandbox_id: str = "", labels: dict[str, str] | None = None
    ) -> builtins.list[SnapshotRecord]:
        return [r for r in self.snapshots.select(sandbox_id, labels) if TEMPLATE_LABEL not in r.labels]

    def pool_ready(self, snap: SnapshotRecord) -> int:
        return sum(1 for m in self.pool.get(snap.id, []) if m.state == READY)

    async def delete_snapshot(self, ref: str) -> None:
        snap = self.snapshots.get(ref)
        deps: builtins.list[str] = self.snapshots.dependents(
            snap, [(who, disk) for who, disk in self._disks() if who != "a warm pool member"]
        )
        if deps:
            more = f" and {len(deps) - 3} more" if len(deps) > 3 else ""
            raise ApiError(
                FAILED_PRECONDITION,
                f"snapshot {snap.id} is in use: the disk of {', '.join(deps[:3])}{more} depends on it",
            )
        await self._drain_pool(snap.id)
        self.snapshots.delete(snap)

    # -- warm pools ----------------------------------------------------------------
    def pool_target(self, snap: SnapshotRecord) -> int:
        if TEMPLATE_LABEL in snap.labels:
            return self.template_pool
        for key in (snap.id, snap.name):
            if key and key in self.pool_sizes:
                return self.pool_sizes[key]
        return self.pool_size

    def _take_member(self, snap: SnapshotRecord) -> Sandbox | None:
        members = self.pool.get(snap.id, [])
        for m in members:
            if m.state == READY and not m.checkpointing and m.guest is not None:
                members.remove(m)
                self._pool_wake.set()  # refill in the background
                return m
        return None

    async def _pool_keeper(self) -> None:
        """Keep each snapshot's pool at its target: one restore at a time (they
        compete for the same cores as the caller's work), failed members dropped."""
        while True:
            self._pool_wake = trio.Event()
            for sid in list(self.pool):
                if sid not in self.snapshots.snapshots:
                    await self._drain_pool(sid)
            started = False
            for snap in list(self.snapshots.snapshots.values()):
                members = self.pool.setdefault(snap.id, [])
                for m in [m for m in members if m.stopped]:
                    members.remove(m)
                    await self._discard(m)
                if self._closing or len(members) >= self.pool_target(snap):
                    continue
                try:
                    self._check_restorable(snap)
                except ApiError as exc:
                    log.warning("pool for %s: %s", snap.id, exc.message)
                    continue
                await self._start_member(snap)
                started = True
                break
            if not started:
                with trio.move_on_after(1.0):
                    await self._pool_wake.wait()

    async def _start_member(self, snap: SnapshotRecord) -> None:
        sb = self._new_sandbox("", self._restored_config(snap, {}, 0), hidden=True)
        rec = sb.record
        sb.restore_from = snap
        self.pool.setdefault(snap.id, []).append(sb)  # from here on, a drain finds it
        try:
            await create_overlay(self.snapshots.disk(snap), sb.dir / "disk.qcow2")
            self.store.insert(rec)
            await self._start_life(sb)
        except BaseException:
            with trio.CancelScope(shield=True):
                if sb in self.pool.get(snap.id, []):
                    self.pool[snap.id].remove(sb)
                await self._discard(sb)
            raise
        await sb.ready_event.wait()
        if sb.state == FAILED:
            log.warning("pool member for %s failed: %s", snap.id, sb.record.error)
            await trio.sleep(1.0)  # do not spin on a snapshot that cannot restore

    async def _discard(self, sb: Sandbox) -> None:
        if not sb.stopped:
            sb.request_stop(0, force=True)
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                await sb.wait_stopped()
        self._forget(sb)

    async def _drain_pool(self, snapshot_id: str) -> None:
        for m in self.pool.pop(snapshot_id, []):
            await self._discard(m)

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
            "snapshots": len(self.snapshots.snapshots),
            "pool_members": sum(len(m) for m in self.pool.values()),
            "sandboxes": len(self.sandboxes),
            "alive": sum(1 for s in self.sandboxes.values() if not s.stopped),
            "subscribers": len(self.events.subs),
            "events_published": self.events.published,
        }


def _check_traversable(path: Path, user: str) -> None:
    """QEMU runs as ``user`` and creates its guest socket under ``path``: every parent
    must let others through (o+x). Said at start, not at the first boot's failure."""
    blocked = unsearchable_parent(path / "x")  # the run root itself must be passable too
    if blocked is not None:
        raise ApiError(
            FAILED_PRECONDITION,
            f"the run root {path} is not reachable by QEMU's user {user!r}: {blocked} is not o+x "
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
