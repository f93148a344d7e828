"""The sandbox actor: one sandbox, one VM life at a time, sandbox.v1's state machine.

State machine (``sandbox.v1``)::

    starting --> ready --> running --> ready      (a workload: the initial cmd or a Run)
       |           |          |
       +-----------+----------+--> stopping --> stopped --(Start)--> starting
       |           |          |               ^   (a guest's poweroff: stopped, exited)
       |           +----------+--> draining --+   (Drain, a TTL that stops: no new work)
       +--> failed (boot failed, the guest broke the channel)
       +--> crashed (ready or running: a panic, QEMU killed, its memory limit)

    ready --(Pause)--> paused --(Resume, or auto-resume)--> ready

Every end has a :class:`~actors.model.Cause`, kept in the record (``_set(cause=)``).

A pause saves the guest (``hibernate``: a checkpoint that leaves it stopped), the
registry records it paused, then its life ends (``end_for_pause``): no QEMU, no RAM.
A resume is a life with a ``Resume(wake=True)`` plan: the record says "paused" until
the guest is back and ready; a resume that fails leaves it paused (with its error).

Events: created (by the registry), ready, running, idle (exit_code), stopping,
stopped (exit_code), failed (error), removed (by the registry).

Exec sessions do not change the state: they are interactive access beside the
workload, allowed while ready or running, and they count as activity for the idle
timeout. Run on a running sandbox is FAILED_PRECONDITION, as sandbox.v1 says.

Handle and tasks: the registry owns the actor and calls its methods; a run (Start to
stopped) is started with :meth:`Sandbox.start`, which runs :meth:`Sandbox.run` in the
nursery it is given, with a :data:`~actors.sandboxes.life.Plan`. ``run`` reports started once
the sandbox is "starting", so Create returns at once; it then holds one
:class:`~actors.sandboxes.life.Life` at a time (two when a boot template does not restore and
the sandbox boots instead), which owns everything the QEMU run holds and frees it in
one place. What one start controls (the stop request, ready, done, the timings) is
one :class:`~actors.sandboxes.runstate.RunState`, made fresh by ``start``. The sandbox
owns its log and record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from actors.cells.cell import Cell
from actors.channel.guest import GuestError
from actors.crash import crash_point
from actors.errors import DomainError, FailedPrecondition, Internal
from actors.events import EventBus
from actors.machines.qemuproc import MachineError
from actors.machines.vm import BootError, BootTimeout, Guest
from actors.model import (
    ALIVE,
    ENDED,
    Action,
    Applied,
    Cause,
    Ending,
    ImageUse,
    Limits,
    PortSpec,
    Protocol,
    SandboxConfig,
    SandboxMetrics,
    State,
    is_hidden,
)
from actors.net.ports import Exposed
from actors.sandboxes import guestsetup, usage
from actors.sandboxes.checkpoint import CheckpointLost, Checkpoints
from actors.sandboxes.files import SandboxFiles
from actors.sandboxes.identity import Identity
from actors.sandboxes.life import Life, guest_error
from actors.sandboxes.paused import PauseHold
from actors.sandboxes.plans import Adopt, AwaitTemplate, Boot, Plan, Resume
from actors.sandboxes.runstate import RunState
from actors.sandboxes.savedstate import Checkpoint
from actors.sandboxes.workload import Workloads
from actors.settings import Settings
from actors.store import LifeState, MachineRecord, Record, Store
from actors.volumes import Volumes

__all__ = ["Adopt", "AwaitTemplate", "Boot", "Plan", "Resume", "Sandbox"]

READY_FLUSH_TIMEOUT = 5.0  # s: the ready state's commit before READY is announced

log = logging.getLogger("sandvisor.sandbox")
T = TypeVar("T")


class Sandbox(Identity):
    """The actor. The registry calls its methods; one VM life runs in :meth:`run`."""

    def __init__(
        self,
        record: Record,
        settings: Settings,
        files: SandboxFiles,
        store: Store,
        events: EventBus,
        volumes: Volumes | None = None,
        waker: Callable[[Sandbox], Awaitable[None]] | None = None,
    ) -> None:
        self.record = record
        if record.limits is None:  # stored before effective limits were kept: ours, written back once
            record.limits = settings.limits(record.config.limits)
            store.update_tuning(record)
        self.volumes = volumes
        self.settings = settings
        self.files = files
        self.store = store
        self._events = events
        self.log = files.open_log()
        self.life: Life | None = None  # the current VM life
        self._run = RunState()
        self._run.done.set()  # no life runs (a recovered sandbox: at once)
        self.work = Workloads(self)
        # the handle's work in its guest is its Workloads' (actors/sandboxes/workload.py)
        self.run_workload, self.exec_session = self.work.run, self.work.exec
        self.read_file, self.write_file = self.work.read_file, self.work.write_file
        self.read_tree, self.write_tree = self.work.read_tree, self.work.write_tree
        self.fs_list, self.fs_stat, self.fs_change = self.work.fs_list, self.work.fs_stat, self.work.fs_change
        # trio's clock (timers run on it): when the sandbox last saw activity, and when it
        # was created (a recovered record's age counts)
        self.last_activity = trio.current_time()
        self.born = trio.current_time() - max(0.0, time.time() - record.created_at)
        self.began = self.born  # when its current (or last) life started: a TTL that stops counts from here
        self._ckpt = Checkpoints(record, self, files, settings, self.log)
        self._exposed = Exposed(record, self.note_ports)
        # hibernation (actors/hibernation.py): what it holds while paused, and who
        # resumes it when a call needs its guest
        self.held = PauseHold()
        self.waker = waker  # who resumes it (None: nobody; a call needing its guest is refused)
        self.modify_lock = trio.Lock()  # one Modify at a time (balloon targets and restarts do not interleave)

    def retune(self, config: SandboxConfig, *, changed: bool) -> None:
        """A Modify's configuration, stored; the limits it leaves at 0 stay as they were
        (``changed``: something changed, ``updated_at`` says when). Whatever was saved
        for the next start is in ``config`` (a Modify plans on it) and pending no more."""
        before = self.limits
        self.record.config = config
        self.record.pending = None
        self.record.limits = config.limits.filled(before.vcpus, before.memory_mib)
        if changed:
            self.record.updated_at = int(time.time())
        self.store.update_tuning(self.record)

    def save_pending(self, config: SandboxConfig) -> None:
        """A Modify's configuration for the next start (policy next_start): the running
        machine and the record's configuration stay as they are until then."""
        self.record.pending = config
        self.record.updated_at = int(time.time())
        self.store.update_tuning(self.record)

    def take_pending(self) -> bool:
        """The configuration saved for the next start made the sandbox's (a boot from
        stopped); whether there was one."""
        pending = self.record.pending
        if pending is None:
            return False
        self.retune(pending, changed=False)
        self.log.append("system", b"modified: the changes saved for the next start are applied")
        return True

    # -- what the current life holds ------------------------------------------------
    @property
    def guest(self) -> Guest | None:
        """The current life's guest, once it is this sandbox's."""
        return self.life.guest if self.life is not None else None

    @property
    def cell(self) -> Cell | None:
        return self.life.cell if self.life is not None else None

    @property
    def ready_event(self) -> trio.Event:
        """Set when this start reaches ready (or ends)."""
        return self._run.ready

    @property
    def timings(self) -> dict[str, float]:
        """Monotonic timestamps of the last start, for the cold-start breakdown."""
        return self._run.timings

    @timings.setter
    def timings(self, value: dict[str, float]) -> None:
        self._run.timings = value

    @property
    def checkpointing(self) -> bool:
        return self._ckpt.active

    # -- the record: this actor is its one writer (tests/unit/test_one_writer.py) --------
    def save_new(self) -> None:
        """Its record stored for the first time (a Create, a restore, a pool member)."""
        self.store.insert(self.record)

    def delete_record(self) -> None:
        """Its record goes (a Remove: before its files)."""
        self.store.delete(self.record.uid)

    def hand_over(
        self,
        id: str,
        seq: int,
        config: SandboxConfig,
        owner: str,
        *,
        limits: Limits | None,
        image: ImageUse | None,
        ports: list[PortSpec] | None,
    ) -> None:
        """A warm pool member becomes a caller's sandbox: their id, configuration and
        owner (a Create's limits, image and ports), created now."""
        rec = self.record
        rec.id, rec.seq, rec.config, rec.owner = id or rec.uid, seq, config, owner
        rec.created_at = rec.ready_at = int(time.time())
        self.born = trio.current_time()
        if limits is not None:
            rec.limits = limits
        if image is not None:
            rec.image = image
        if ports is not None:
            rec.ports = ports
        self.store.rekey(rec)

    def set_ttl(
        self, ttl_seconds: int, *, ttl_action: str | None = None, kill_timeout_seconds: int | None = None
    ) -> None:
        """Its TTL (seconds; 0: none) and, when given, what it does and Kill's timeout, stored."""
        cfg = self.config
        timers = attrs.evolve(cfg.timers, ttl_seconds=ttl_seconds)
        if ttl_action is not None:
            timers = attrs.evolve(timers, ttl_action=ttl_action)
        if kill_timeout_seconds is not None:
            timers = attrs.evolve(timers, kill_timeout_seconds=kill_timeout_seconds)
        self.record.config = attrs.evolve(cfg, timers=timers)
        self.store.update_config(self.record)

    def note_applied(self, applied: Applied) -> None:
        """What the running machine has now (vCPUs, memory, disk), stored."""
        self.record.applied = applied
        self.store.update_tuning(self.record)

    def note_pid(self, pid: int) -> None:
        """Its QEMU's pid (stored with the next state)."""
        self.record.qemu_pid = pid

    def note_life(self, life: LifeState) -> None:
        """The running QEMU as the next supervisor needs it (spawned, or its files moved), stored."""
        self.record.life = life
        self.store.update_life(self.record)

    def note_life_ended(self) -> None:
        """No QEMU runs for it any more (its life's cell and run dir are gone)."""
        if self.record.life is not None:
            self.record.life = None
            self.store.update_life(self.record)

    async def note_chain(self, chain: list[str]) -> None:
        """The layers below its overlay, top first: on disk before it goes on."""
        self.record.chain = chain
        self.store.update_life(self.record)
        await self.store.flush()

    def note_ports(self, ports: list[PortSpec]) -> None:
        """Its port mappings (host ports filled in), stored."""
        self.record.ports = ports
        self.store.update_ports(self.record)

    async def journal_swap(self, frozen: str) -> None:
        """A checkpoint's disk swap to ``frozen`` may be under way from here: on disk
        first (the next supervisor finishes or undoes it: actors/recovery.py)."""
        self.record.swap = frozen
        self.store.update_life(self.record)
        await self.store.flush()

    def swapped(self, frozen: str, *, disk_top: str | None = None, staged: int | None = None) -> None:
        """The disk swap is done: ``frozen`` is the top of its chain (and the running
        QEMU's block graph is ``disk_top``, ``staged``); the journal is closed."""
        rec = self.record
        rec.chain, rec.swap = [frozen, *rec.chain], ""
        if rec.life is not None and disk_top is not None and staged is not None:
            rec.life = attrs.evolve(rec.life, disk_top=disk_top, staged=staged)
        self.store.update_life(rec)

    def void_swap(self) -> None:
        """No disk swap is under way (a checkpoint failed before its disk moved)."""
        if self.record.swap:
            self.record.swap = ""
            self.store.update_life(self.record)

    def mark_stopped(self, cause: Cause | None = None) -> None:
        """Stopped, with no life (a supervisor start; a paused one stopped)."""
        self._set(State.STOPPED, qemu_pid=0, cause=cause or self.record.cause or Cause(Ending.STOPPED, by="user"))

    def mark_failed(self, error: str, cause: Cause | None = None) -> None:
        """Failed with ``error``, with no life (a supervisor start found it so)."""
        self._set(State.FAILED, error=error, qemu_pid=0, cause=cause or Cause(Ending.ERROR, detail=error))

    @property
    def cause(self) -> Cause | None:
        """Why its last life ended (or why the current one is ending, once asked)."""
        return self.record.cause

    def cause_attributes(self) -> dict[str, str]:
        """Its cause as event attributes (none when no life has ended)."""
        return self.record.cause.attributes() if self.record.cause is not None else {}

    def unmark_paused(self) -> None:
        """A pause that failed after its checkpoint: ready again (its guest runs on)."""
        if self.state == State.PAUSED:
            self._set(State.READY)
        self._run.pausing = False

    # -- state machine -----------------------------------------------------------
    def _set(self, state: State, **changes: Any) -> None:
        self.record.state = state
        for k, v in changes.items():
            setattr(self.record, k, v)
        self.store.update(self.record)

    def emit(self, action: Action, **attributes: str) -> None:
        if not is_hidden(self.id):  # pool members are invisible until taken
            self._events.emit(self.id, action, attributes, self.record.owner)

    def _fail(self, error: str, cause: Cause | None = None) -> None:
        if self._run.waking and not self._run.served:  # a resume that failed: it stays paused
            log.warning("sandbox %s did not resume: %s", self.id, error)
            self.log.append("system", f"resume failed: {error}".encode())
            self._set(State.PAUSED, error=f"resume failed: {error}")
            return
        cause = cause or Cause(Ending.ERROR, detail=error)
        state = State.CRASHED if cause.crashed else State.FAILED
        log.warning("sandbox %s %s: %s", self.id, state, error)
        self.log.append("system", f"{state}: {error}".encode())
        self._run.cause = cause
        self._set(state, error=error, cause=cause)
        self.emit(Action.FAILED, **cause.attributes(), error=error)

    def _ended(self, cause: Cause) -> None:
        """QEMU ended without being asked: a crash fails the life, a guest's poweroff stops it."""
        if cause.crashed:
            self._fail(cause.sentence(), cause)
        elif cause.ending == Ending.EXITED:
            self.log.append("system", cause.sentence().encode())
            self._run.cause = cause
        else:
            self._fail(cause.detail or cause.sentence(), cause)

    async def start(self, nursery: trio.Nursery, plan: Plan) -> None:
        """Start a life in ``nursery``; returns once it is set up (state "starting")."""
        self._run = run = RunState()  # at once: the sandbox counts as alive from here
        self.began = trio.current_time()
        try:
            await nursery.start(self.run, plan)
        except BaseException:
            run.done.set()
            raise

    async def run(self, plan: Plan, task_status: trio.TaskStatus[Sandbox] = trio.TASK_STATUS_IGNORED) -> None:
        """Boot, restore or adopt; serve until asked to stop (or until QEMU dies), power
        off -- or, detached (the supervisor exits and leaves sandboxes running), let go
        of QEMU with its record as it is, for the next supervisor."""
        run = self._run
        run.waking = isinstance(plan, Resume) and plan.wake
        if not isinstance(plan, Adopt) and not run.waking:
            self._set(State.STARTING, error="", qemu_pid=0, cause=None)
        run.timings = {"accepted": plan.accepted or time.monotonic()}
        try:
            with trio.CancelScope() as scope:
                run.scope = scope
                task_status.started(self)
                if isinstance(plan, AwaitTemplate):
                    plan = await plan.resolve()
                await self._live(plan)
        except BootError as exc:
            ending = Ending.GAVE_UP if isinstance(exc, BootTimeout) else Ending.BOOT_FAILED
            self._fail(f"boot failed: {exc}", Cause(ending, detail=str(exc)))
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
            run.scope = None
            run.ready.set()
            if run.detached:
                self.log.append("system", b"detached: QEMU runs on for the next supervisor")
            elif self.state == State.PAUSED:  # paused (or a resume that did not come back)
                self._set(State.PAUSED, qemu_pid=0)
            elif self.state not in (State.FAILED, State.CRASHED):
                cause = run.cause or self.record.cause or Cause(Ending.STOPPED, by="user")
                if cause.exit_code is None and self.record.last_exited_at:
                    cause = attrs.evolve(cause, exit_code=self.record.last_exit_code)
                self._set(State.STOPPED, qemu_pid=0, cause=cause)
                self.emit(Action.STOPPED, **{"exit_code": str(self.record.last_exit_code), **cause.attributes()})
            else:
                self._set(self.state, qemu_pid=0)
            run.done.set()

    async def _live(self, plan: Boot | Resume | Adopt) -> None:
        """One life, served to its end; a boot template that does not restore must not
        fail the Create: it is reported, and a second life boots."""
        # a fresh disk gets the Create's patches (a restart of its own disk, or a
        # restore of a snapshot, has them already); a boot template's restore is fresh
        fresh = (isinstance(plan, Resume) and plan.fallback is not None) or (
            isinstance(plan, Boot) and plan.disk_of is None and not self.files.disk.exists()
        )
        up = False
        self.life = life = Life.of(self, plan)
        try:
            async with life:
                up = True
                await self._serve(life, plan, fresh=fresh)
        except (BootError, MachineError, GuestError, DomainError) as exc:
            if up or not isinstance(plan, Resume) or plan.fallback is None:
                raise
            plan.fallback(plan.snapshot, str(exc), isinstance(exc, BootTimeout))
            self.log.append("system", f"template restore failed ({exc}); booting".encode())
            self._set(State.STARTING, error="")
            await self._live(Boot(accepted=plan.accepted))
        finally:
            self.life = None

    async def _serve(self, life: Life, plan: Boot | Resume | Adopt, *, fresh: bool) -> None:
        """A life from the guest's hello to the end of its work."""
        guest, run = life.guest, self._run
        assert guest is not None
        init_runs_workload = False  # handed off to an init that runs it (guestsetup.prepare)
        if isinstance(plan, Adopt):  # its forwards live in QEMU still; calls of the last supervisor are gone
            await life.apply_ports(relays_only=True)
            self._set(State.READY)
            self.log.append("system", b"adopted after a supervisor restart")
        else:
            init_runs_workload = await guestsetup.prepare(self, life, guest, plan, fresh=fresh)
            if run.waking:
                crash_point("resume-loaded")
            ready_at = self.record.ready_at if run.waking and self.record.ready_at else int(time.time())
            before = self.state
            self._set(State.READY, ready_at=ready_at, qemu_pid=guest.machine.pid or 0, error="")
            # on disk before anyone hears of it: a supervisor killed right after a client
            # saw "ready" adopts the sandbox (the record said "starting": it was killed).
            # Stored as ready above; known as ready (Inspect, Run) only once on disk, with
            # its event: a Run seen between the two ran before its "ready" was announced
            self.record.state = before
            run.served = True
            try:
                with trio.move_on_after(READY_FLUSH_TIMEOUT):
                    try:
                        await self.store.flush()
                    except DomainError as exc:  # a full disk: it runs, but a restart will not keep it
                        self.log.append("system", f"ready, not stored: {exc.message}".encode())
            finally:
                self.record.state = State.READY
            self.log.append("system", b"resumed" if run.waking else b"ready")
            self.emit(Action.RESUMED if run.waking else Action.READY)
        run.timings["ready_event"] = time.monotonic()
        run.ready.set()
        self.last_activity = trio.current_time()
        async with trio.open_nursery() as nursery:
            run.work = nursery
            nursery.start_soon(self._watch_machine, life, guest, nursery.cancel_scope)
            if self.work.initial_cmd and not init_runs_workload:
                nursery.start_soon(self.work.run_initial)
            try:
                await run.stop.wait()
                if not run.detached:
                    await self._drain_workloads()
            finally:
                run.work = None
            nursery.cancel_scope.cancel()
        if self.state in (State.FAILED, State.CRASHED, State.PAUSED) or run.detached:
            if run.pausing and guest.machine.proc is not None:  # saved and stopped: nothing to wait for
                guest.channel.expect_eof()
                guest.machine.proc.kill()
            return
        if self.state == State.DRAINING:
            self.emit(Action.STOPPING)
        self._set(State.STOPPING)
        if run.force and guest.machine.proc is not None:
            guest.channel.expect_eof()
            guest.machine.proc.kill()

    async def adopt(self, *, apply_ports: bool) -> None:
        """A warm pool member becomes the caller's sandbox (its record already holds the
        caller's configuration): fresh identity (it may have waited a while), the
        ports unless the member forwarded them already, then the initial command. A
        failure fails this sandbox, as it would fail a boot."""
        guest, life, run = self.guest, self.life, self._run
        if guest is None or life is None or run.work is None or self.state != State.READY:
            self._fail(f"pool member is {self.state}, not ready to be handed over")
            run.stop.set()
            raise MachineError(f"pool member is {self.state}")
        try:
            # awaited: with the answers in the background (Life.post_identity) a clean-clone
            # run saw events and the first Run race the fix-ups (test_daemon's TTL order,
            # test_snapshots' pool member), so the hand-over waits for them again
            await life.fresh_identity(guest, clock=True)
            await guestsetup.prepare_member(self, life, guest, apply_ports=apply_ports)
        except MachineError as exc:
            self._fail(str(exc))
            run.stop.set()
            raise
        self.log.append("system", b"ready (from the warm pool)")
        self.touch()
        if self.work.initial_cmd:
            run.work.start_soon(self.work.run_initial)

    async def _watch_machine(self, life: Life, guest: Guest, scope: trio.CancelScope) -> None:
        rc = await guest.machine.wait()
        if not self._run.stop.is_set():
            self._ended(life.death(guest, rc))
            self._run.stop.set()
            scope.cancel()

    async def _drain_workloads(self) -> None:
        run = self._run
        if run.force or self.state in (State.FAILED, State.CRASHED):
            return
        if run.cause is not None and run.cause.ending != Ending.STOPPED:  # QEMU is gone already
            return
        with trio.move_on_after(run.timeout):
            await self._ckpt.wait_idle()  # a checkpoint in progress finishes first
            await self.work.drain()

    # -- control ---------------------------------------------------------------
    def request_stop(self, timeout: float, *, force: bool = False, by: str = "user") -> None:
        """Graceful (wait up to ``timeout`` for workloads, then power off) or forced;
        ``by``: who asks (the stop's cause, :data:`~actors.model.STOPPED_BY`)."""
        if self.stopped:
            return
        run = self._run
        run.timeout = timeout
        run.force = run.force or force
        if not run.stop.is_set():
            run.cause = run.cause or Cause(Ending.STOPPED, by=by)
            if self.state in ALIVE:
                self._set(State.STOPPING, cause=run.cause)
            if self.state != State.DRAINING:
                self.emit(Action.STOPPING, **run.cause.attributes())
            run.stop.set()
        guest = self.guest
        if guest is None:
            if run.scope is not None:  # still booting: abandon the boot
                run.scope.cancel()
        elif run.force and guest.machine.proc is not None:
            guest.channel.expect_eof()
            guest.machine.proc.kill()

    def detach(self) -> None:
        """Let go of a running QEMU without stopping it (the supervisor exits with
        --keep-sandboxes): the record keeps its state and life, for the next one."""
        if self.stopped or self.guest is None or self.life is None:
            return
        self._run.detached = True
        self.life.detach()
        self._run.stop.set()

    # -- hibernation (the sequence is actors/hibernation.py's) -------------------
    async def hibernate(self, snap_dir: Path) -> Checkpoint:
        """Save this sandbox into ``snap_dir`` for a pause: as :meth:`checkpoint`, but
        the guest stays stopped after it (its life ends next, :meth:`end_for_pause`)."""
        guest = self.check_checkpointable()
        try:
            return await self._ckpt.take(guest, snap_dir, stay_paused=True)
        except CheckpointLost as exc:
            self._fail(str(exc))
            self._run.stop.set()
            raise Internal(f"pause of {self.id} failed: {exc}") from None

    def layers_exclusive(self) -> AbstractAsyncContextManager[None]:
        """No checkpoint moves the disk while the block runs (a merge of its layers)."""
        return self._ckpt.exclusive()

    def mark_paused(self) -> None:
        """The record says paused (its saved state is recorded); the life ends next."""
        self._run.pausing = True
        self._set(State.PAUSED, error="")

    def end_for_pause(self) -> None:
        """End the life of a saved, stopped guest: QEMU is killed (nothing runs past the
        saved state), the volume claims stay, no stopping/stopped events."""
        run, life = self._run, self.life
        run.pausing = run.force = True
        if life is not None:
            life.pausing = True
        run.stop.set()
        guest = self.guest
        if guest is None and run.scope is not None:
            run.scope.cancel()

    async def awake(self) -> None:
        """A call that needs the guest: a paused sandbox is resumed first (auto-resume),
        or FAILED_PRECONDITION when it was created with auto-resume off."""
        if self.state != State.PAUSED and not self.held.under_way:
            return
        if not self.config.timers.auto_resume or self.waker is None:
            raise FailedPrecondition(f"sandbox {self.id} is paused (auto-resume is off): resume it first")
        await self.waker(self)

    def drain(self, grace: float = 0, *, by: str = "drain") -> None:
        """State draining: no new work; work in flight gets ``grace`` seconds (0: however
        long it takes), then it stops (``by``: who asked: a drain, its TTL)."""
        if self.state == State.DRAINING:
            return
        if self.state not in (*ALIVE, State.STARTING):
            raise FailedPrecondition(f"sandbox {self.id} is {self.state}")
        run = self._run
        run.draining = True
        run.cause = run.cause or Cause(Ending.STOPPED, by=by)
        if self.state in ALIVE:
            self._set(State.DRAINING, cause=run.cause)
            self.emit(Action.DRAINING, **run.cause.attributes())
        self.request_stop(grace or 24 * 3600.0, by=by)

    async def wait_stopped(self) -> None:
        """Until no life runs, and the record says so on disk (a caller told "stopped"
        must not find it running after a crash)."""
        await self._run.done.wait()
        await self.persisted()

    async def persisted(self) -> None:
        """Until the record's changes so far are on disk (a full disk: logged, not raised)."""
        try:
            await self.store.flush()
        except DomainError as exc:
            log.warning("sandbox %s: %s", self.id, exc.message)

    @property
    def stopped(self) -> bool:
        """No life runs (a recovered sandbox, one that stopped or failed)."""
        return self._run.done.is_set() or self.state in ENDED

    @property
    def stopping(self) -> bool:
        """Its life is ending: asked to stop or drain, or QEMU died."""
        return self._run.stop.is_set()

    def touch(self) -> None:
        self.last_activity = trio.current_time()

    # -- work ------------------------------------------------------------------
    def require_alive(self) -> Guest:
        guest = self.guest
        if self.state == State.DRAINING or self._run.draining:
            raise FailedPrecondition(f"sandbox {self.id} is draining: no new execs or runs")
        if self.state not in ALIVE or guest is None:
            raise FailedPrecondition(f"sandbox {self.id} is {self.state}, not ready or running")
        if self._run.stop.is_set():
            raise FailedPrecondition(f"sandbox {self.id} is stopping: no new work")
        if self.checkpointing:
            raise FailedPrecondition(f"sandbox {self.id} is being checkpointed; retry in a moment")
        return guest

    def check_checkpointable(self) -> Guest:
        guest = self.require_alive()
        if self.state != State.READY:
            raise FailedPrecondition(f"sandbox {self.id} is {self.state}; checkpoint needs it ready")
        if self.execs or self.workloads:
            raise FailedPrecondition(f"sandbox {self.id} has exec sessions open; checkpoint needs it idle")
        if self.config.host_mounts:
            # QEMU refuses to migrate a vhost-user-fs device (its state is virtiofsd's)
            raise FailedPrecondition(
                f"sandbox {self.id} has host directories mounted (virtio-fs): it cannot be checkpointed"
            )
        return guest

    async def checkpoint(self, snap_dir: Path, *, keep_memory: bool = False, memory_file: bool = True) -> Checkpoint:
        """Save this sandbox into ``snap_dir``; it runs on afterwards. Only when ready with no
        exec session open (work in flight would be cloned into every restore). ``keep_memory``:
        its memory comes back as a sealed memfd too; ``memory_file`` False: only there (a fork's)."""
        guest = self.check_checkpointable()
        try:
            return await self._ckpt.take(guest, snap_dir, keep_memory=keep_memory, memory_file=memory_file)
        except CheckpointLost as exc:  # never leave a sandbox "ready" but paused
            self._fail(str(exc))
            self._run.stop.set()
            raise Internal(f"checkpoint of {self.id} failed: {exc}") from None

    def check_disk_checkpointable(self) -> None:
        """A disk-only checkpoint: the sandbox is stopped (no life runs) and stays so while it runs."""
        if not self.stopped or self.state not in ENDED:
            raise FailedPrecondition(f"sandbox {self.id} is {self.state}: a disk-only checkpoint needs it stopped")
        if self.checkpointing:
            raise FailedPrecondition(f"sandbox {self.id} is being checkpointed; retry in a moment")

    async def checkpoint_stopped(self, snap_dir: Path) -> Checkpoint:
        """Save this stopped sandbox's disk into ``snap_dir`` (restores boot on it)."""
        self.check_disk_checkpointable()
        limits = self.limits
        machine = MachineRecord(
            append="",
            memory_mib=limits.memory_mib,
            cpus=limits.vcpus,
            accel=self.settings.accel,
            balloon=self.settings.balloon,
        )
        return await self._ckpt.take_stopped(snap_dir, machine)

    async def checkpoints_done(self) -> None:
        """Until no checkpoint of this sandbox is under way."""
        await self._ckpt.wait_idle()

    async def checkpoint_first_boot(self, snap_dir: Path) -> Checkpoint:
        """Save a fresh boot at its first ready, before any caller's work (a boot
        template). A lost guest raises :class:`CheckpointLost`: the life fails."""
        guest = self.guest
        if guest is None or self.state != State.STARTING:
            raise FailedPrecondition(f"sandbox {self.id} is {self.state}: not a fresh boot")
        return await self._ckpt.take(guest, snap_dir)

    @property
    def workloads(self) -> int:
        return self.work.runs

    @property
    def execs(self) -> int:
        return self.work.execs

    def workload_started(self) -> None:
        self._set(State.RUNNING)
        self.emit(Action.RUNNING)
        self.touch()

    def workload_ended(self, code: int, error: str, *, oom_killed: bool = False) -> None:
        self.touch()
        if self.record.state == State.RUNNING:  # (not stopping or failed meanwhile)
            self._set(State.READY, last_exited_at=int(time.time()), last_exit_code=code)
            extra = {"error": error} if error else {}
            if oom_killed:  # the guest kernel's OOM killer ended it
                extra["oom_killed"] = "true"
            self.emit(Action.IDLE, exit_code=str(code), **extra)
        else:
            self.record.last_exited_at, self.record.last_exit_code = int(time.time()), code

    async def guest_call(self, fn: Callable[[Guest], Awaitable[T]]) -> T:
        await self.awake()
        await self._ckpt.wait_idle()  # short calls wait out a checkpoint's pause
        guest = self.require_alive()
        try:
            return await fn(guest)
        except GuestError as exc:
            raise guest_error(exc) from None

    async def metrics(self) -> SandboxMetrics:
        m = await self.guest_call(lambda g: g.channel.metrics())
        life = self.life
        if life is None:
            raise FailedPrecondition(f"sandbox {self.id} is {self.state}, not ready or running")
        return usage.sandbox_metrics(m, self.id, self.record.qemu_pid, life.cell, life.cpu, self.files.disk)

    def host_rss(self) -> int:
        return usage.proc_rss(self.record.qemu_pid)

    def host_cpu_seconds(self) -> float:
        return usage.proc_cpu_seconds(self.record.qemu_pid)

    def cpu_percent(self) -> float:
        """QEMU's CPU use since the previous call (first call: since the VM started)."""
        life = self.life
        return life.cpu.percent(self.record.qemu_pid) if life is not None else 0.0

    # -- ports (the record's mappings; the current life's forwards: actors/net/ports.py) --
    def ports(self) -> list[PortSpec]:
        """Its port mappings, host ports filled in (a restored sandbox's carried ones
        with the host ports it got), in the order they were exposed."""
        return list(self.record.ports)

    async def expose(self, sandbox_port: int, host_port: int, protocol: Protocol, host_address: str = "") -> PortSpec:
        """Forward ``sandbox_port`` from ``host_port`` (0: one is picked) on ``host_address``
        ("": the sandbox's bind address); see :meth:`Exposed.expose`."""
        address = host_address or self.config.network.port_address
        self.settings.check_bind_address(address)
        await self.awake()
        self.require_alive()
        relays = self.life.ports if self.life is not None else None
        return await self._exposed.expose(PortSpec(sandbox_port, host_port, protocol, address), self.network, relays)

    async def unexpose(self, sandbox_port: int, protocol: Protocol) -> None:
        life = self.life
        held = self.held.ports.pop((sandbox_port, protocol), None)
        if held is not None:  # paused: its host port is released now
            held.close()

        def serving() -> bool:
            return life is not None and life.guest is not None and self.state in ALIVE

        await self._exposed.unexpose((sandbox_port, protocol), life.ports if life else None, hostfwd=serving)
