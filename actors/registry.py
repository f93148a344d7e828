"""The registry actor: ids, lifecycle, recovery, snapshots' orchestration.

It owns every :class:`~actors.sandboxes.sandbox.Sandbox` of the supervisor and the nursery
their lives run in, the SQLite store, the event bus, the snapshot store and the
:class:`~actors.snapshots.pools.Pools` actor. An edge calls its methods with domain values
(:class:`~actors.model.SandboxConfig`, ids); they check the rules (typed
:class:`~actors.errors.DomainError`), change the registry synchronously (so two
Creates with one id race to exactly one sandbox) and start or stop lives.

Handle and tasks::

    Registry.run(task_status)         opens the lives' nursery; started when ready
      +-- Pools.run(self)             the warm pool keeper
      +-- Timers.run()                TTL removes, idle stops, ephemeral removals (actors/timers.py)
      +-- Sandbox.run(plan)           one task per VM life

Its roles kept elsewhere: the rules of a Create (actors/create_checks.py), what the
previous supervisor left (actors/recovery.py), OCI images (actors/oci_images.py), the
timers (actors/timers.py), List's pages (actors/listing.py).

Message flow of a Create::

    edge --create(id, config)--> check id/config/files (actors/create_checks.py); effective
         limits resolved (kept in the record); same id + same request: the existing
         sandbox (idempotent: create_checks.created, asked again after an image's pull,
         actors/oci_images.py); a warm member of its template: adopted; else a record
         (stored), "created",
         Pools.plan_for -> Sandbox.start(plan)
         --started (state starting)--> the edge answers {state: starting}
"""

from __future__ import annotations

import builtins
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import attrs
import trio

from actors import create_checks, image_disks, listing, recovery
from actors.cells.guestmem import private_dir
from actors.crash import crash_point
from actors.errors import (
    AlreadyExists,
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from actors.events import EventBus
from actors.hibernation import Hibernation
from actors.machines.qemuproc import MachineError
from actors.model import (
    ALIVE,
    ENDED,
    POOL_PREFIX,
    Action,
    ImageUse,
    Limits,
    MemoryKind,
    NetMode,
    PullAuth,
    SandboxConfig,
    State,
)
from actors.modify import check_machine
from actors.net.netlink import check_network_available
from actors.oci_images import OciImages
from actors.principals import LEGACY_OWNER, Principal
from actors.quotas import Admission, Quotas
from actors.rules import check_config, check_id, check_labels, check_name
from actors.sandboxes.files import SandboxFiles
from actors.sandboxes.sandbox import Boot, Plan, Resume, Sandbox
from actors.sandboxes.savedstate import Checkpoint
from actors.sandboxes.secrets import new_owner
from actors.secrets.ca import new_ca
from actors.secrets.model import with_placeholders
from actors.settings import Settings
from actors.snapshots.convert import convert_streamed
from actors.snapshots.pools import Pools
from actors.snapshots.snapshot import SnapshotStore
from actors.snapshots.transfer import Importer, export_stream
from actors.store import Lineage, Record, SnapshotRecord, Store
from actors.timers import Timers
from actors.volumes import Volumes

FORGET_FLUSH_TIMEOUT = 10.0  # s: the database's commit of a removal before the files go

log = logging.getLogger("sandvisor.registry")

DEFAULT_STOP_TIMEOUT = 30.0


class Registry:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        *,
        quotas: Quotas | None = None,
        templates: bool = True,
        template_pool: int = 0,
        pool_size: int = 0,
        pools: dict[str, int] | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.admission = Admission(quotas or Quotas(), settings.sandboxes_dir.parent, settings.memory_dir)
        self.sandboxes: dict[str, Sandbox] = {}
        self.events = EventBus()
        # streamed snapshots become mapped in the background, where guests have RAM files
        # at all (serve --anonymous-memory: the operator chose streams)
        self.snapshots = SnapshotStore(
            settings.sandboxes_dir.parent / "snapshots",
            store,
            self._layers_in_use,
            convert=functools.partial(convert_streamed, settings=settings) if settings.memory_dir is not None else None,
            may_convert=lambda rec: self.admits(rec.machine.memory_mib, ram_file=False),
        )
        self.pools = Pools(
            settings, self.snapshots, templates=templates, template_pool=template_pool, pool_size=pool_size, pools=pools
        )
        self.volumes = Volumes(
            settings.sandboxes_dir.parent / "volumes", store, max_size=settings.max_sandbox_disk_mib << 20
        )
        self.volumes.tools = settings.cells.tools if settings.cells is not None else None  # e2fsck in a cell
        self.hibernation = Hibernation(self)  # pause and resume
        self.oci = OciImages(settings, self.images_in_use)
        self.timers = Timers(self.sandboxes, self.admission, self.hibernation, self.remove, DEFAULT_STOP_TIMEOUT)
        self._lives: trio.Nursery | None = None
        self._closing = False
        # what the serving process publishes beside its socket (set by the composition
        # root: "ssh" HOST:PORT and "ssh_host_key", serve --ssh's); read by the edges
        self.endpoints: dict[str, str] = {}

    # -- lifecycle of the registry ---------------------------------------------
    async def run(self, task_status: trio.TaskStatus[Registry] = trio.TASK_STATUS_IGNORED) -> None:
        s = self.settings
        s.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        s.run_root.mkdir(parents=True, exist_ok=True)
        if s.qemu_user is not None:
            s.run_root.chmod(0o711)  # QEMU's user reaches its own run dir, lists none
            recovery.check_traversable(s.run_root, s.qemu_user.name)
        if s.memory_dir is not None and s.cells is None:  # (in cells, Cells made it 0700: RAM goes by fd)
            s.memory_dir.parent.mkdir(parents=True, exist_ok=True)
            private_dir(s.memory_dir, 0o711 if s.qemu_user is not None else 0o700)  # QEMU's user passes through
        self.snapshots.load()
        self.volumes.load()
        for p in self.volumes.sweep():
            log.info("removed %s: no volume names it", p)
        self.pools.drop_stale_templates()
        adoptions = await recovery.recover(self)
        if s.vault is not None:  # values of sandboxes and snapshots that are gone
            s.vault.keep_only({r.uid for r in self.store.all()} | {r.uid for r in self.store.snapshots()})
        try:
            async with trio.open_nursery() as nursery:
                self._lives = nursery
                await nursery.start(self.store.run)
                await nursery.start(self.snapshots.run)
                for sb, plan in adoptions:  # settled before we serve: adopted, or killed and reaped
                    await sb.start(nursery, plan)
                for sb, _ in adoptions:
                    await sb.ready_event.wait()
                    if sb.state in (State.FAILED, State.CRASHED):
                        log.warning("sandbox %s could not be adopted: %s", sb.id, sb.record.error)
                await self.store.flush()
                await nursery.start(self.pools.run, self)
                self.hibernation.hold_all()
                nursery.start_soon(self.timers.run)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._lives = None
            self.hibernation.close_all()
            for sb in [*self.sandboxes.values(), *self.pools.all_members()]:
                sb.log.close()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every sandbox (bounded), for supervisor exit. Shielded."""
        self._closing = True
        with trio.CancelScope(shield=True):
            self.pools.close()
            for sb in self.sandboxes.values():
                sb.request_stop(timeout)
            await self._wait_all(timeout + 5)
            for sb in self.sandboxes.values():
                if not sb.stopped:
                    sb.request_stop(0, force=True)
            await self._wait_all(10)
            await self.pools.discard_all(self)  # pool members are disposable: nothing of them stays

    async def _wait_all(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            for sb in [*self.sandboxes.values(), *self.pools.all_members()]:
                await sb.wait_stopped()

    async def detach_all(self) -> None:
        """Let every running sandbox go on without us (serve --keep-sandboxes): their
        QEMUs run on, recorded, for the next supervisor; pool members are stopped."""
        self._closing = True
        with trio.CancelScope(shield=True):
            self.pools.close()
            for sb in self.sandboxes.values():
                if sb.state in ALIVE and not sb.config.host_mounts:  # (their virtiofsd ends with us)
                    sb.detach()
                else:
                    sb.request_stop(0, force=True)
            await self._wait_all(30)
            await self.pools.discard_all(self)
            await self.store.flush()

    def _layers_in_use(self) -> set[Path]:
        """Every disk layer a sandbox or pool member stands on (as recorded)."""
        used: set[Path] = set()
        for sb in [*self.sandboxes.values(), *self.pools.all_members()]:
            used.update(Path(p) for p in sb.record.chain)
        return used

    # -- sandboxes: making and forgetting ---------------------------------------------
    def sandbox_of(self, rec: Record) -> Sandbox:
        """The sandbox actor of a record (not registered here: the caller's to do)."""
        files = SandboxFiles(rec.uid, self.settings)
        # (auto-resume: hibernation wakes it)
        return Sandbox(rec, self.settings, files, self.store, self.events, self.volumes, waker=self.hibernation.wake)

    def _new_sandbox(
        self,
        id: str,
        config: SandboxConfig,
        limits: Limits,
        *,
        hidden: bool = False,
        origin: str = "",
        image: ImageUse | None = None,
        owner: str = LEGACY_OWNER,
        lineage: Lineage | None = None,
    ) -> Sandbox:
        """A sandbox actor with a fresh record (not stored or registered yet), with its
        effective ``limits`` (kept: later boots use them, whatever the defaults are then).
        Hidden: a warm pool member, with an id no caller can use (its owner is whoever takes it)."""
        uid = str(uuid.uuid4())
        rec = Record(
            uid=uid,
            id=POOL_PREFIX + uid if hidden else id or uid,
            seq=0 if hidden else self.store.next_seq(),
            config=config,
            state=State.STARTING,
            created_at=int(time.time()),
            ports=list(config.ports),
            origin=origin,
            image=image,
            owner=owner,
            limits=limits,
            lineage=lineage,
        )
        return self.sandbox_of(rec)

    def _resolve_limits(self, config: SandboxConfig, snap: SnapshotRecord | None = None) -> Limits:
        """A new sandbox's effective resources, resolved here alone: kept in its record,
        they are what every later boot, restore, pool and Modify of it uses. A Create's
        are the request with the supervisor's defaults for what it leaves at 0; a
        restore's or pool member's are those of the snapshot's sandbox (stored with the
        snapshot; one stored before they were kept: the machine it was saved with), never
        the defaults of now."""
        if snap is not None:
            return snap.config.limits.filled(snap.machine.cpus, snap.machine.memory_mib)
        return self.settings.limits(config.limits)

    def new_member(self, snap: SnapshotRecord) -> Sandbox:
        """A hidden sandbox (stored, not registered) for a warm pool of ``snap``."""
        config = snap.config.restored({}, 0)
        limits = self._resolve_limits(config, snap)
        sb = self._new_sandbox("", config, limits, hidden=True, origin=snap.id, image=snap.oci)
        sb.save_new()
        return sb

    async def start_life(self, sb: Sandbox, plan: Plan) -> None:
        if self._lives is None:
            raise Unavailable("the supervisor is not running")
        await sb.start(self._lives, plan)

    async def forget(self, sb: Sandbox) -> None:
        """The end of a sandbox that has stopped: its record, log, files."""
        sb.log.close()
        sb.delete_record()
        sb.release_lease()  # (written with the delete: the address and the record go together)
        # the record goes first: a crash then leaves files (swept at the next start),
        # not a record without its disk. On a full disk the files go anyway (that is
        # how space comes back). Bounded: shutdown calls this shielded.
        with trio.move_on_after(FORGET_FLUSH_TIMEOUT) as waited:
            try:
                await self.store.flush()
            except DomainError as exc:
                log.warning("removing %s: %s (its record is removed once the disk takes it)", sb.id, exc.message)
        if waited.cancelled_caught:
            log.warning("removing %s: the database did not commit in %gs", sb.id, FORGET_FLUSH_TIMEOUT)
        crash_point("remove")
        if self.settings.vault is not None:
            self.settings.vault.drop_owner(sb.record.uid)
        await sb.files.remove()

    @property
    def lives(self) -> trio.Nursery | None:
        """The nursery the sandboxes' lives run in (None: the registry does not run)."""
        return self._lives

    def check_open(self) -> None:
        """New work is taken only while the supervisor runs and can store it."""
        if self._closing:
            raise Unavailable("the supervisor is shutting down")
        self.store.check_writable()

    def _live_memory(self) -> list[int]:
        """The guest RAM of every live sandbox and pool member (not those evicted: they
        are being killed)."""
        members = [m for ms in self.pools.members.values() for m in ms]
        return [sb.limits.memory_ceiling for sb in [*self.sandboxes.values(), *members] if not sb.stopped]

    def admits(self, memory_mib: int, *, ram_file: bool) -> bool:
        """Would one more of ``memory_mib`` fit (for the pool keeper: members never evict)?"""
        try:
            self.admission.check(self._live_memory(), memory_mib, ram_file=ram_file)
        except ResourceExhausted:
            return False
        return True

    def admit(self, memory_mib: int, *, ram_file: bool) -> None:
        """Room for one more, or RESOURCE_EXHAUSTED naming the limit; warm pool members
        make room for real work."""
        while True:
            try:
                self.admission.check(self._live_memory(), memory_mib, ram_file=ram_file)
                return
            except ResourceExhausted:
                if not self.pools.evict_one():
                    raise

    # -- lookups ---------------------------------------------------------------
    def get(self, id: str) -> Sandbox:
        sb = self.sandboxes.get(id)
        if sb is None:
            raise NotFound(f"no sandbox {id!r}")
        return sb

    def set_ttl(self, id: str, seconds: int) -> int:
        """Its TTL ends ``seconds`` from now (0: never), whatever it was: it is removed
        then (``ttl_action`` "remove", counted from its creation) or drained and stopped
        ("stop", counted from its last start); the wall-clock time it ends (0: never).
        Kept in its record: a restart keeps it."""
        if seconds < 0:
            raise InvalidArgument("ttl seconds must not be negative")
        sb = self.get(id)
        removes = sb.config.timers.ttl_action == "remove"
        age = max(0.0, trio.current_time() - (sb.born if removes else max(sb.born, sb.began)))
        ttl = 0 if seconds == 0 else max(1, int(age + seconds + 0.999))
        sb.set_ttl(ttl)
        if ttl == 0:
            return 0
        return sb.record.created_at + ttl if removes else int(time.time() - age) + ttl

    def list(
        self,
        *,
        state: State | None = None,
        labels: dict[str, str] | None = None,
        limit: int = 20,
        cursor: str = "",
        viewer: Principal | None = None,
        within: builtins.list[Sandbox] | None = None,
    ) -> tuple[builtins.list[Sandbox], str]:
        """A page of the sandboxes, or of those ``within`` (actors/listing.py)."""
        pool = self.sandboxes.values() if within is None else within
        return listing.page(pool, state=state, labels=labels, limit=limit, cursor=cursor, viewer=viewer)

    # -- operations --------------------------------------------------------------
    async def create(
        self,
        id: str,
        config: SandboxConfig,
        secret_values: dict[str, bytes] | None = None,
        *,
        pull_auth: PullAuth | None = None,
        owner: str = LEGACY_OWNER,
    ) -> Sandbox:
        """A new sandbox of ``owner``, starting (or ready at once, from a warm pool). The
        same id with the same configuration and owner is the existing sandbox (idempotent);
        ids are one namespace (another owner's is ALREADY_EXISTS). Its secrets'
        own values (``secret_values``, by name) go to the vault, never to its record.
        ``pull_auth``: the image registry's credentials and CA, for this Create's pull only."""
        self.check_open()
        check_id(id)
        check_config(config)
        limits = self._resolve_limits(config)
        check_machine(limits, balloon=self.settings.balloon)
        check_network_available(self.settings, config.network)
        values = secret_values or {}
        if config.secrets:
            create_checks.check_secrets_available(self.settings, config, values)
        # (asked before the checks of what a new sandbox would take)
        existing = create_checks.created(self.sandboxes, id, config, owner)
        if existing is not None:
            return existing
        self.volumes.check(config.volumes)  # (a life claims them; this refuses before anything is made)
        create_checks.check_host_paths(self.settings, config)
        if config.boot.rootfs:  # a vmdk, vdi, vhdx, VHD: converted (confined) now, its errors the Create's
            await image_disks.attach(self.settings, Path(config.boot.rootfs))
        accepted = time.monotonic()
        image = await self.oci.use(config, pull_auth) if config.boot.image else None
        # created meanwhile, while the image was pulled?
        existing = create_checks.created(self.sandboxes, id, config, owner)
        if existing is not None:
            return existing
        # from here to the registration below nothing awaits: one Create of an id makes it
        create_checks.check_disks(self.settings, self.volumes, config, image)
        if config.secrets:  # (the caller's request is compared above; the record keeps the placeholders)
            config = attrs.evolve(config, secrets=with_placeholders(config.secrets))
        member = self.pools.take_for_create(config, limits, image)
        if member is None:
            self.admit(limits.memory_ceiling, ram_file=True)
        else:
            await self._adopt(
                member,
                id,
                config,
                {"pool": "1"},
                apply_ports=True,
                accepted=accepted,
                image=image,
                owner=owner,
                limits=limits,
            )
            return member  # failed, with its error, if the adoption failed: as a failed boot
        sb = self._new_sandbox(id, config, limits, image=image, owner=owner)
        sb.lease()  # its address is the Create's answer (RESOURCE_EXHAUSTED: nothing made)
        if config.secrets and self.settings.vault is not None:
            new_owner(self.settings.vault, sb.record.uid, values)  # values and CA before the record
        sb.save_new()
        self.sandboxes[sb.id] = sb
        sb.emit(Action.CREATED)
        await self.start_life(sb, self.pools.plan_for(sb, accepted))
        await sb.persisted()
        return sb

    # -- OCI images ----------------------------------------------------------------
    def images_in_use(self) -> set[str]:
        """Digests of the images some sandbox, member or snapshot stands on (never removed)."""
        used = {
            sb.record.image.digest for sb in [*self.sandboxes.values(), *self.pools.all_members()] if sb.record.image
        }
        used |= {r.oci.digest for r in self.snapshots.snapshots.values() if r.oci}
        return used

    async def _adopt(
        self,
        sb: Sandbox,
        id: str,
        config: SandboxConfig,
        created: dict[str, str],
        *,
        apply_ports: bool,
        accepted: float,
        image: ImageUse | None = None,
        owner: str = LEGACY_OWNER,
        limits: Limits | None = None,
    ) -> bool:
        """A ready warm pool member becomes the caller's sandbox: the caller's id and
        configuration (and a Create's effective ``limits``: its template's machine has
        them), created; fresh identity, ports, initial command (Sandbox.adopt);
        ready. False if that failed (the sandbox is then failed, and stopping)."""
        ports = list(config.ports) if apply_ports else None
        sb.hand_over(id, self.store.next_seq(), config, owner, limits=limits, image=image, ports=ports)
        self.sandboxes[sb.id] = sb
        sb.emit(Action.CREATED, **created)
        try:
            await sb.adopt(apply_ports=apply_ports)
        except MachineError:
            return False
        sb.emit(Action.READY)
        sb.timings = {"accepted": accepted, "ready_event": time.monotonic(), "pool": 1.0}
        return True

    async def start(self, id: str) -> Sandbox:
        self.check_open()
        sb = self.get(id)
        if sb.state == State.PAUSED:  # Start of a paused sandbox: it resumes
            await self.hibernation.resume(sb, warm=True)
            return sb
        if sb.state not in ENDED or not sb.stopped:
            raise FailedPrecondition(f"sandbox {id} is {sb.state}; only a stopped sandbox can start")
        if sb.checkpointing:  # a disk-only checkpoint is moving its disk
            raise FailedPrecondition(f"sandbox {id} is being checkpointed; retry in a moment")
        sb.take_pending()  # (a Modify's next_start changes: this boot has them)
        self.admit(sb.limits.memory_ceiling, ram_file=True)
        check_network_available(self.settings, sb.config.network)
        self.volumes.check(sb.config.volumes, sb.record.uid)
        self.volumes.check_owner(sb.config.volumes, sb.record.owner)
        sb.lease()  # (kept since its last life; taken again if the pool changed meanwhile)
        await self.start_life(sb, Boot(accepted=time.monotonic()))
        await sb.persisted()
        return sb

    def stop(self, id: str, timeout: float = DEFAULT_STOP_TIMEOUT) -> Sandbox:
        sb = self.get(id)
        self.hibernation.discard(sb)  # a paused one: its saved memory goes, it is stopped
        sb.request_stop(timeout)
        return sb

    def kill(self, id: str) -> Sandbox:
        sb = self.get(id)
        self.hibernation.discard(sb)
        sb.request_stop(0, force=True)
        return sb

    async def pause(self, id: str) -> Sandbox:
        """Hibernate a ready sandbox (actors/hibernation.py)."""
        sb = self.get(id)
        await self.hibernation.pause(sb)
        return sb

    async def resume(self, id: str) -> Sandbox:
        """Bring a paused sandbox back, as itself; returns once it is ready."""
        sb = self.get(id)
        await self.hibernation.resume(sb, warm=True)
        return sb

    def drain(self, id: str, grace: float = 0) -> Sandbox:
        """State draining: no new work; that in flight gets ``grace`` seconds (0: as long
        as it takes), then it stops."""
        sb = self.get(id)
        sb.drain(grace)
        return sb

    async def remove(self, id: str, force: bool = False) -> None:
        sb = self.get(id)
        if sb.state == State.RUNNING and not force:
            raise FailedPrecondition(f"sandbox {id} is running a workload; use force to remove it")
        if not sb.stopped:
            sb.request_stop(0, force=True)
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                await sb.wait_stopped()
        with trio.CancelScope(shield=True), trio.move_on_after(30):
            await sb.checkpoints_done()  # (a disk-only checkpoint moves the disk of a stopped one)
        if self.sandboxes.get(id) is not sb:
            return  # removed meanwhile by another call
        del self.sandboxes[id]
        sb.emit(Action.REMOVED, **sb.cause_attributes())
        with trio.CancelScope(shield=True):
            if sb.state == State.PAUSED:
                await self.hibernation.forget(sb)
            await self.forget(sb)
        self.retire_forks()
        self.snapshots.collect_soon()

    def retire_forks(self) -> None:
        """A snapshot taken only to fork goes once no sandbox's lineage names it (its
        disk stays while a chain stands on it: the collector's)."""
        named = {sb.record.lineage.snapshot_id for sb in self.sandboxes.values() if sb.record.lineage}
        for snap in self.snapshots.retire_forks(named):
            if self.settings.cells is not None:
                self.settings.cells.sealed.drop(snap.id)
            if self.settings.vault is not None:
                self.settings.vault.drop_owner(snap.uid)

    # -- snapshots (SandboxSnapshotService) ------------------------------------------
    async def checkpoint(
        self,
        sandbox_id: str,
        *,
        name: str = "",
        labels: dict[str, str] | None = None,
        owner: str = LEGACY_OWNER,
        fork_only: bool = False,
    ) -> tuple[SnapshotRecord, Checkpoint]:
        """A snapshot of the sandbox, owned by ``owner`` (who asked); ``fork_only``: hidden,
        for a fork's children (actors/fork.py), gone with the last of them."""
        self.check_open()
        labels = labels or {}
        check_labels(labels)
        check_name(name)
        sb = self.get(sandbox_id)
        stopped = sb.stopped and sb.state in ENDED
        if stopped:  # a disk-only snapshot: its restores boot on its disk
            sb.check_disk_checkpointable()
            self.admission.check_disk()
        else:
            sb.check_checkpointable()  # before a directory is made for nothing
            self.admission.check_capture(f"a checkpoint of {sb.id}", sb.limits.memory_mib)
        address = str(sb.pool_address or "") if sb.config.network.mode == NetMode.TAP else ""
        gens = self.volumes.generations(sb.config.volumes)
        cells = self.settings.cells
        # restores map the checkpoint's own sealed copy of the memory (the cache keeps it;
        # no fill from the file); a fork's is its only one: no file (nothing but its
        # children restores a hidden snapshot), kept until the snapshot is retired
        keep = cells is not None
        take = functools.partial(sb.checkpoint, keep_memory=keep, memory_file=not (fork_only and keep))
        rec, ck = await self.snapshots.take(
            sb.checkpoint_stopped if stopped else take,
            sb.record,
            name=name,
            labels=labels,
            address=address,
            volume_generations=gens,
            owner=owner,
            fork_only=fork_only,
        )
        if ck.memfd >= 0:
            if cells is not None:
                cells.sealed.put(rec.id, ck.memfd, pinned=fork_only)
            else:
                os.close(ck.memfd)
        if sb.config.secrets and self.settings.vault is not None:  # its clones' values (never in the files)
            self.settings.vault.copy_owner(sb.record.uid, rec.uid)
        self.pools.wake()
        await self.store.flush()  # a snapshot the caller was told of is on record
        return rec, ck

    async def restore(
        self,
        snapshot_ref: str,
        *,
        id: str = "",
        labels: dict[str, str] | None = None,
        ttl_seconds: int = 0,
        network_override: bool = False,
        owner: str = LEGACY_OWNER,
        limits: Limits | None = None,
    ) -> Sandbox:
        """A new sandbox from a snapshot, returned once ready (``limits``: a disk-only
        snapshot's resources, when not its origin's: actors/from_snapshot.py). A tap
        clone keeps its snapshot's address when that is free and ``network_override``
        is not asked; else (the origin or another clone holds it) it gets a fresh one.
        Either way a fresh TAP and MAC, and its guest is configured before ready."""
        return await self.restore_from(
            self.snapshots.get(snapshot_ref),
            id=id,
            labels=labels,
            ttl_seconds=ttl_seconds,
            network_override=network_override,
            owner=owner,
            limits=limits,
        )

    async def restore_from(
        self,
        snap: SnapshotRecord,
        *,
        id: str = "",
        labels: dict[str, str] | None = None,
        ttl_seconds: int = 0,
        network_override: bool = False,
        owner: str = LEGACY_OWNER,
        lineage: Lineage | None = None,
        limits: Limits | None = None,
    ) -> Sandbox:
        """:meth:`restore` of a snapshot found already (a fork's hidden one, with the
        child's ``lineage``)."""
        self.check_open()
        labels = labels or {}
        check_id(id)
        check_labels(labels)
        if ttl_seconds < 0:
            raise InvalidArgument("ttl_seconds must not be negative")
        if id and id in self.sandboxes:
            raise AlreadyExists(f"sandbox {id!r} exists")
        self.snapshots.check_restorable(snap, self.settings.accel)
        check_network_available(self.settings, snap.config.network)
        # the snapshot's guest has its volumes mounted: the same ones, free as they were
        self.volumes.check(snap.config.volumes, what=f"snapshot {snap.id} needs ")
        self.volumes.check_owner(snap.config.volumes, owner, what=f"snapshot {snap.id} needs ")
        self.volumes.check_unchanged(snap.config.volumes, snap.volume_generations, what=f"snapshot {snap.id}")
        config = snap.config.restored(labels, ttl_seconds)
        if limits is not None and snap.memory == MemoryKind.DISK:
            check_machine(self.settings.limits(limits), balloon=self.settings.balloon)
            config = attrs.evolve(config, limits=limits)
        accepted = time.monotonic()
        member = self.pools.take(snap)
        if member is not None:
            # the member forwarded the snapshot's ports already, on its own host ports
            if await self._adopt(
                member,
                id,
                config,
                {"snapshot_id": snap.id, "pool": "1"},
                apply_ports=False,
                accepted=accepted,
                owner=owner,
            ):
                return member
            log.warning("pool member for %s could not be handed over (%s): restoring", snap.id, member.record.error)
            with trio.CancelScope(shield=True):
                await self.remove(member.id, force=True)  # (its "created" was emitted: "removed" follows)
            if id and id in self.sandboxes:
                raise AlreadyExists(f"sandbox {id!r} exists")
        disk_only = snap.memory == MemoryKind.DISK
        limits = self._resolve_limits(config, snap)
        memory_mib = limits.memory_mib if disk_only else snap.machine.memory_mib
        self.admit(memory_mib, ram_file=snap.memory != MemoryKind.MAPPED)
        sb = self._new_sandbox(id, config, limits, origin=snap.id, image=snap.oci, owner=owner, lineage=lineage)
        sb.lease(want="" if network_override else snap.address)
        if config.secrets:  # the snapshot's values, a CA of its own (config: fresh placeholders)
            create_checks.check_secrets_available(self.settings, config, {}, fresh=False)
            assert self.settings.vault is not None
            self.settings.vault.copy_owner(snap.uid, sb.record.uid, ca=new_ca(sb.record.uid[:12]))
        sb.save_new()
        self.sandboxes[sb.id] = sb
        sb.emit(Action.CREATED, snapshot_id=snap.id)
        plan: Plan = Boot(accepted=accepted, disk_of=snap) if disk_only else Resume(snap, accepted=accepted)
        await self.start_life(sb, plan)
        await sb.ready_event.wait()
        if sb.state != State.READY:
            error = sb.record.error or sb.state
            with trio.CancelScope(shield=True):
                await self.remove(sb.id, force=True)
            raise Unavailable(f"restore from {snap.id} failed: {error}")
        return sb

    def list_snapshots(
        self, sandbox_id: str = "", labels: dict[str, str] | None = None, viewer: Principal | None = None
    ) -> builtins.list[SnapshotRecord]:
        return self.snapshots.select(sandbox_id, labels, viewer)

    def pool_ready(self, snap: SnapshotRecord) -> int:
        return self.pools.ready(snap)

    async def delete_snapshot(self, ref: str) -> None:
        snap = self.snapshots.get(ref)
        users = [(f"sandbox {sb.id}", sb.record.chain) for sb in self.sandboxes.values()]
        deps = self.snapshots.dependents(snap, users)
        if deps:
            more = f" and {len(deps) - 3} more" if len(deps) > 3 else ""
            raise FailedPrecondition(
                f"snapshot {snap.id} is in use: the disk of {', '.join(deps[:3])}{more} depends on it"
            )
        async with self.pools.retiring(snap.id, self):
            if self.settings.cells is not None:
                self.settings.cells.sealed.drop(snap.id)
            await self.snapshots.delete(snap)
        if self.settings.vault is not None:
            self.settings.vault.drop_owner(snap.uid)

    # -- snapshot export and import (actors/snapshots/transfer.py) ------------------------
    def export_snapshot(self, ref: str, *, include_base: bool = False) -> AsyncGenerator[bytes]:
        """The export of a snapshot, as pieces of one file (see :func:`export_stream`)."""
        return export_stream(self.snapshots.get(ref), self.settings, include_base=include_base)

    async def import_snapshot(
        self,
        chunks: AsyncIterator[bytes],
        *,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        owner: str = LEGACY_OWNER,
    ) -> SnapshotRecord:
        """A snapshot of ``owner`` from an export's bytes, recorded once all of them
        arrived and matched their digest; any failure leaves nothing behind."""
        self.check_open()
        self.admission.check_disk()
        imp = Importer(self.snapshots, self.settings, name=name, labels=labels, check_disk=self.admission.check_disk)
        imp.open()
        try:
            async for data in chunks:
                await imp.feed(data)
            rec = await imp.commit()
        except BaseException:
            await imp.abort()
            raise
        if rec.owner != owner:  # (queued behind the record, before the flush below)
            rec.owner = owner
            self.store.update_snapshot(rec)
        await self.store.flush()  # a snapshot the caller was told of is on record
        self.pools.wake()
        return rec
