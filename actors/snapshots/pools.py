"""Boot templates and warm pools: the actor that makes Creates and Restores fast.

Boot templates: a configuration is keyed by what a fresh boot depends on
(accelerator, image parts, memory, vCPUs, network mode and outbound, RAM mapped or
anonymous); configurations with their own kernel, rootfs or boot arguments always
boot, but for a rootfs the supervisor serves with a warm-up command
(``Settings.template_warmups``: the code-interpreter image's kernel server), keyed
by its path and the command too, whose template is saved once the command ran.
The first Create of a key boots, and at its first ready -- after the warm-up,
before the caller's ports, initial command or any call -- the sandbox is
checkpointed as a hidden snapshot (``template_key`` set). Later Creates of the key restore it
(:class:`~actors.sandboxes.sandbox.Resume` with a fallback): one that fails to restore is
dropped, the Create boots instead, and the key boots until the supervisor restarts.

Warm pools: restored sandboxes kept ready per snapshot (``pool_size`` for every
snapshot, ``pools`` per id or name, ``template_pool`` per boot template), hidden
until taken. The keeper restores one member at a time (members compete for the
cores with real work) and refills after each take.

Handle and tasks::

    Pools.run(host, task_status)       the keeper (one task); started by the registry
      host: PoolHost                   the registry: makes, starts and forgets sandboxes

The registry asks :meth:`Pools.plan_for` how a Create should start, and
:meth:`Pools.take` for a ready member of a snapshot.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol

import trio

from actors.channel.guest import GuestError
from actors.crash import crash_point
from actors.errors import DomainError
from actors.model import ImageUse, Limits, MemoryKind, SandboxConfig, State
from actors.sandboxes.sandbox import AwaitTemplate, Boot, Plan, Resume, Sandbox
from actors.settings import Settings
from actors.snapshots.snapshot import SnapshotStore
from actors.store import SnapshotRecord

log = logging.getLogger("sandvisor.pools")

STALE = "the image, the accelerator or the machine's devices changed"
# a template whose restores time out this many times is replaced (a busy host makes a
# restore late; a broken template fails every time, and not by a timeout)
TRANSIENT_FAILURES = 3
WARMUP_TIMEOUT_S = 600.0  # a template's warm-up (the code-interpreter's kernel, under a busy TCG)


def takeable(m: Sandbox) -> bool:
    """A member a Create or Restore may take now. ``ready_event``: its life is fully up
    (READY is recorded, and flushed in a worker thread, a moment before it is set)."""
    return m.ready_event.is_set() and m.state == State.READY and not m.checkpointing and m.guest is not None


class PoolHost(Protocol):
    """What the pools need of the registry."""

    def new_member(self, snap: SnapshotRecord) -> Sandbox: ...

    async def start_life(self, sb: Sandbox, plan: Plan) -> None: ...

    async def forget(self, sb: Sandbox) -> None: ...

    def admits(self, memory_mib: int, *, ram_file: bool) -> bool: ...


class Pools:
    def __init__(
        self,
        settings: Settings,
        snapshots: SnapshotStore,
        *,
        templates: bool = True,
        template_pool: int = 0,
        pool_size: int = 0,
        pools: dict[str, int] | None = None,
    ) -> None:
        self.settings = settings
        self.snapshots = snapshots
        self.templates = templates
        self.template_pool = template_pool  # warm members per boot template: Creates in milliseconds
        self.pool_size = pool_size  # for every snapshot
        self.pool_sizes = dict(pools or {})  # per snapshot id or name (wins)
        self.members: dict[str, list[Sandbox]] = {}
        self._wake = trio.Event()
        self._pending: dict[str, Sandbox] = {}  # template keys being made, by the boot making each
        self._broken: set[str] = set()  # keys whose template failed: boot until restart
        self._failures: dict[str, int] = {}  # snapshot id: members failed in a row
        self._late: dict[str, int] = {}  # template id: restores timed out in a row
        self._retry_at: dict[str, float] = {}  # snapshot id: no new member before (monotonic)
        self._leaving: list[Sandbox] = []  # evicted members, stopping: forgotten by the keeper
        self._retiring: set[str] = set()  # snapshot ids being deleted: no new member for them
        self._closing = False

    # -- boot templates ------------------------------------------------------------
    def template_key(self, config: SandboxConfig, limits: Limits, image: ImageUse | None) -> str | None:
        """What a fresh boot depends on; None when the configuration boots differently
        (own kernel, rootfs or boot arguments). The hostname, env, cmd, ports, TTL...
        are set after the boot anyway. An OCI image counts by its converted file.
        ``limits``: the sandbox's effective ones (its record's)."""
        warmup = self.warmup(config)
        if not self.templates or (config.boot.custom and warmup is None) or config.volumes or config.host_mounts:
            return None  # (volumes, host directories: devices a template's machine lacks; microvm has no hotplug)
        s = self.settings
        if limits.vcpu_ceiling > limits.vcpus or limits.memory_ceiling > limits.memory_mib or limits.disk_mib:
            return None  # (boots at its ceilings, on a grown disk: a machine of its own)
        parts = [
            s.accel,
            *s.image_parts(),
            image.template_key if image is not None else "",
            str(limits.memory_mib),
            str(limits.vcpus),
            config.network.mode.value,
            "outbound" if config.network.outbound else "",
            "mapped" if s.memory_dir is not None else "anon",
        ]
        if warmup is not None:
            parts += [config.boot.rootfs, hashlib.sha256("\0".join(warmup).encode()).hexdigest()]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]

    def warmup(self, config: SandboxConfig) -> tuple[str, ...] | None:
        """The command a fresh boot of ``config`` runs before its template is saved:
        only for a served rootfs with one (no own kernel or boot arguments)."""
        b = config.boot
        if not b.rootfs or b.kernel or b.boot_args or b.image or b.rootfs_fstype:
            return None
        return self.settings.template_warmups.get(b.rootfs)

    def template(self, key: str) -> SnapshotRecord | None:
        for r in self.snapshots.templates():
            if r.template_key == key:
                return r
        return None

    def drop_stale_templates(self) -> None:
        """Templates of another image, an OCI image no longer there, another
        accelerator or another device set (a balloon or none) are of no use any more."""
        s = self.settings
        for r in self.snapshots.templates():
            gone = r.oci is not None and not Path(r.oci.rootfs).exists()
            other = r.image != s.image_parts() or r.machine.accel != s.accel or r.machine.balloon != s.balloon
            if gone or other:
                self._template_failed(r, STALE)

    def plan_for(self, sb: Sandbox, accepted: float) -> Boot | Resume | AwaitTemplate:
        """How a new sandbox starts: restore its configuration's template, wait for the
        boot making it, or boot (and save the boot as the template when there is none
        yet, nor a boot making one)."""
        key = self.template_key(sb.config, sb.limits, sb.record.image)
        if key is None or key in self._broken:
            return Boot(accepted=accepted)
        tpl = self.template(key)
        if tpl is not None:
            try:
                self.snapshots.check_restorable(tpl, self.settings.accel)
            except DomainError as exc:
                self._template_failed(tpl, exc.message)
                return Boot(accepted=accepted)
            return Resume(tpl, accepted=accepted, fallback=self._template_failed)
        maker = self._pending.get(key)
        if maker is not None and not maker.stopped:
            return AwaitTemplate(functools.partial(self._await_template, maker, sb, accepted), accepted=accepted)
        self._pending[key] = sb
        return Boot(accepted=accepted, template=functools.partial(self._make_template, key, sb))

    async def _await_template(self, maker: Sandbox, sb: Sandbox, accepted: float) -> Boot | Resume:
        """Wait for the boot making the template (saved before its first ready, or not
        at all if it failed), then plan again: restore it, wait for the next maker, or
        become the maker."""
        await maker.ready_event.wait()
        plan = self.plan_for(sb, accepted)
        return await plan.resolve() if isinstance(plan, AwaitTemplate) else plan

    async def _make_template(self, key: str, sb: Sandbox) -> None:
        """Checkpoint a fresh boot (at its first ready, before any user work) as the
        template of its configuration. Failing costs nothing but the template (unless
        the guest was lost: then the boot fails, by CheckpointLost)."""
        # what a restore of the template inherits: only what the key covers (the limits
        # as its machine has them: a member of it gets no defaults of a later supervisor)
        config = SandboxConfig(limits=sb.limits, network=sb.config.network)
        warmup = self.warmup(sb.config)
        if warmup is not None and not await self._warm(key, sb, warmup):
            self._pending.pop(key, None)
            return
        try:
            _, ck = await self.snapshots.take(
                sb.checkpoint_first_boot,
                sb.record,
                template_key=key,
                image=self.settings.image_parts(),
                config=config,
                oci=sb.record.image,
            )
        except (DomainError, OSError) as exc:
            log.warning("boot template %s: checkpoint failed: %s", key, exc)
            return
        finally:
            self._pending.pop(key, None)
        sb.log.append("system", f"boot template {key} saved (paused {ck.paused_s * 1000:.0f} ms)".encode())
        self._wake.set()

    async def _warm(self, key: str, sb: Sandbox, argv: tuple[str, ...]) -> bool:
        """Run a template's warm-up in its fresh boot; failing costs only the template."""
        guest = sb.guest
        if guest is None:
            return False
        t = time.monotonic()
        try:
            res = await guest.channel.run(list(argv), cwd="/", timeout=WARMUP_TIMEOUT_S, max_output=64 << 10)
        except GuestError as exc:
            log.warning("boot template %s: warm-up failed: %s", key, exc)
            return False
        if res.exit_code != 0:
            why = res.stderr.decode(errors="replace").strip()[-500:]
            log.warning("boot template %s: warm-up exited %s: %s", key, res.exit_code, why)
            sb.log.append("system", f"boot template {key}: warm-up exited {res.exit_code}".encode())
            return False
        sb.log.append("system", f"boot template {key}: warmed up in {time.monotonic() - t:.1f} s".encode())
        return True

    def _template_failed(self, tpl: SnapshotRecord, why: str, transient: bool = False) -> None:
        """A template that does not restore is dropped (its files go once unused), and
        its configuration boots until the supervisor restarts. One whose restores only
        timed out (a busy host) is dropped after TRANSIENT_FAILURES of them, and the
        next Create makes a new one."""
        if transient:
            self._late[tpl.uid] = n = self._late.get(tpl.uid, 0) + 1
            log.warning("boot template %s: a restore timed out (%d so far): %s", tpl.template_key, n, why)
            if n < TRANSIENT_FAILURES:
                return
        self._late.pop(tpl.uid, None)
        if why != STALE and not transient:
            self._broken.add(tpl.template_key)  # a new one would likely fail the same way
        self.snapshots.drop(tpl, f"boot template {tpl.template_key}: {why}")

    def take_for_create(self, config: SandboxConfig, limits: Limits, image: ImageUse | None) -> Sandbox | None:
        if config.secrets:
            return None  # a member would need the caller's CA and placeholders first: a boot or restore
        if config.init is not None:
            return None  # a member runs on guestd as PID 1: the hand-off comes with a boot or restore
        key = self.template_key(config, limits, image)
        tpl = self.template(key) if key is not None else None
        return self.take(tpl) if tpl is not None else None

    # -- warm pools ----------------------------------------------------------------
    def target(self, snap: SnapshotRecord) -> int:
        if snap.config.volumes or snap.config.secrets:
            return 0  # a member would hold the snapshot's volumes while it waits
        if snap.memory == MemoryKind.DISK:
            return 0  # its restores boot: no saved state to keep warm
        if snap.fork_only:
            return 0  # a fork's children are made at once, by the fork
        if snap.template_key:
            return self.template_pool
        for key in (snap.id, snap.name):
            if key and key in self.pool_sizes:
                return self.pool_sizes[key]
        return self.pool_size

    def resize(self, *, template_pool: int | None = None, snapshot: str = "", size: int = 0) -> None:
        """Change a pool's target at run time (the keeper follows)."""
        if template_pool is not None:
            self.template_pool = template_pool
        if snapshot:
            self.pool_sizes[snapshot] = size
        self._wake.set()

    def ready(self, snap: SnapshotRecord) -> int:
        """Members :meth:`take` would hand out now."""
        return sum(1 for m in self.members.get(snap.id, []) if takeable(m))

    def all_members(self) -> list[Sandbox]:
        """Members in a pool, and those leaving one that still run."""
        return [*(m for ms in self.members.values() for m in ms), *(m for m in self._leaving if not m.stopped)]

    def evict_one(self) -> bool:
        """Stop a member (the most recently started) to make room for real work."""
        for members in self.members.values():
            if members:
                m = members.pop()
                m.request_stop(0, force=True)
                self._leaving.append(m)
                self._wake.set()
                return True
        return False

    def take(self, snap: SnapshotRecord) -> Sandbox | None:
        """A ready member of ``snap``'s pool, out of the pool (refilled in the background)."""
        members = self.members.get(snap.id, [])  # (none for a disk-only snapshot: target 0)
        if snap.config.secrets:
            return None  # (none are kept: target())
        for m in members:
            if takeable(m):
                members.remove(m)
                self._wake.set()
                return m
        return None

    def wake(self) -> None:
        self._wake.set()

    async def run(self, host: PoolHost, task_status: trio.TaskStatus[Pools] = trio.TASK_STATUS_IGNORED) -> None:
        """The keeper: each snapshot's pool at its target, one restore at a time (they
        compete for the same cores as the caller's work), failed members dropped. It
        never waits on a member: a restore that hangs holds back only the next restore
        (until its own deadlines fail it), not drains, discards or takes."""
        async with trio.open_nursery() as watchers:
            task_status.started(self)
            while True:
                self._wake = trio.Event()
                for sid in list(self.members):
                    if sid not in self.snapshots.snapshots:
                        await self.drain(sid, host)
                for m in [m for m in self._leaving if m.stopped]:
                    self._leaving.remove(m)
                    await host.forget(m)
                starting = False
                # (a copy: a discard awaits, and a drain from another task pops a key meanwhile)
                for members in list(self.members.values()):
                    for m in [m for m in members if m.stopped]:
                        if m in members:  # (a watcher may have taken it out while the last discard awaited)
                            members.remove(m)
                        await self._discard(m, host)
                    starting = starting or any(m.state == State.STARTING for m in members)
                if not starting and not self._closing:
                    snap = self._next_to_fill(host)
                    if snap is not None:
                        sb = await self._start_member(snap, host)
                        crash_point("pool-fill")
                        watchers.start_soon(self._watch, snap, sb)
                with trio.move_on_after(1.0):
                    await self._wake.wait()

    def _next_to_fill(self, host: PoolHost) -> SnapshotRecord | None:
        now = time.monotonic()
        for snap in list(self.snapshots.snapshots.values()):
            if snap.id in self._retiring:
                continue  # (its deletion drained it; a member now would restore from files going away)
            members = self.members.setdefault(snap.id, [])
            if len(members) >= self.target(snap) or self._retry_at.get(snap.id, 0.0) > now:
                continue
            try:
                self.snapshots.check_restorable(snap, self.settings.accel)
            except DomainError as exc:
                log.warning("pool for %s: %s", snap.id, exc.message)
                self._failed(snap)
                continue
            if not host.admits(snap.machine.memory_mib, ram_file=snap.memory != MemoryKind.MAPPED):
                continue  # no room: real work comes first
            return snap
        return None

    def _failed(self, snap: SnapshotRecord) -> None:
        """Back off a snapshot whose members fail: 1, 2, 4 ... 60 s."""
        n = self._failures.get(snap.id, 0) + 1
        self._failures[snap.id] = n
        self._retry_at[snap.id] = time.monotonic() + min(60.0, 2.0 ** (n - 1))

    async def _watch(self, snap: SnapshotRecord, sb: Sandbox) -> None:
        await sb.ready_event.wait()
        if sb.state in (State.FAILED, State.CRASHED):
            log.warning("pool member for %s failed: %s", snap.id, sb.record.error)
            self._failed(snap)
        else:
            self._failures.pop(snap.id, None)
        self._wake.set()

    async def _start_member(self, snap: SnapshotRecord, host: PoolHost) -> Sandbox:
        sb = host.new_member(snap)
        self.members.setdefault(snap.id, []).append(sb)  # from here on, a drain finds it
        try:
            await host.start_life(sb, Resume(snap, accepted=time.monotonic()))
        except BaseException:
            with trio.CancelScope(shield=True):
                if sb in self.members.get(snap.id, []):
                    self.members[snap.id].remove(sb)
                await self._discard(sb, host)
            raise
        return sb

    async def _discard(self, sb: Sandbox, host: PoolHost) -> None:
        if not sb.stopped:
            sb.request_stop(0, force=True)
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                await sb.wait_stopped()
        await host.forget(sb)

    async def drain(self, snapshot_id: str, host: PoolHost) -> None:
        """Discard a snapshot's members (it is gone)."""
        for m in self.members.pop(snapshot_id, []):
            await self._discard(m, host)

    @asynccontextmanager
    async def retiring(self, snapshot_id: str, host: PoolHost) -> AsyncIterator[None]:
        """While a snapshot is deleted: its members discarded first, and none started
        for it meanwhile (the keeper refills a pool whenever it wakes, and a drain's
        stops take long enough for it to wake: a member restoring from files being
        deleted fails, or stays in the pool of a snapshot that is no more). Should the
        deletion fail, the pool refills again afterwards."""
        self._retiring.add(snapshot_id)
        try:
            await self.drain(snapshot_id, host)
            yield
        finally:
            self._retiring.discard(snapshot_id)
            self._wake.set()

    def close(self) -> None:
        """No more members (supervisor exit): stop the existing ones at once."""
        self._closing = True
        for sb in self.all_members():
            sb.request_stop(0, force=True)

    async def discard_all(self, host: PoolHost) -> None:
        """Every member stopped and forgotten (supervisor exit): nothing of them stays."""
        for sid in list(self.members):
            await self.drain(sid, host)
        for m in self._leaving:
            await self._discard(m, host)
        self._leaving.clear()
