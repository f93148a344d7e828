"""Hibernation: a ready sandbox paused to disk, resumed as itself.

A paused sandbox has no QEMU and holds no RAM. Its guest's memory and device state are
a hidden snapshot of its own (``SnapshotRecord.paused_for`` = its uid: no caller sees,
restores or deletes it; streamed ones are converted to mapped in the background like
any snapshot), its disk chain stands on that snapshot's frozen disk, and it keeps
everything else: id, name, labels, pool address (tap), port mappings (their host
ports bound by us while paused: :class:`Held`), volume claims, its TTL's clock.

Pause, in order (each step durable before the next; the crash points name them)::

    checkpoint, the guest left stopped (Sandbox.hibernate)      <- a crash: adopted, `cont`
    the snapshot recorded and flushed     [pause-saved]          <- a crash: adopted, `cont`
    the record says "paused", flushed     [pause-stopping]       <- a crash: QEMU killed, paused
    the life ends (QEMU killed: nothing runs past the saved state); ports held; "paused"

Resume is a life with ``Resume(snapshot, wake=True)``: the record says "paused" until
the guest is back and ready (``resume-loaded``: a crash before that leaves it paused),
then "ready", event ``resumed``; the snapshot's record, memory and stream go, and its
frozen disk, now the sandbox's alone, merges back into the running overlay in the
background (:meth:`Hibernation.merge`): pause after pause, the chain stays as deep as
at the first. A resume that fails leaves the sandbox paused, with the error.

Auto-resume: a call that needs the guest (Sandbox.awake) resumes it first; so does an
inbound connection to a held port (the listener is watched; on its first readable
event the sandbox resumes and the listener itself is handed to the new life's relay,
with the connection in its backlog -- or, where QEMU's slirp binds the port itself,
the connections waiting are accepted and piped to it once it is back). A tap
sandbox's own address is not watched (docs/hibernation.md says why).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol as Interface

import attrs
import trio

from actors.channel.guest import GuestError
from actors.crash import crash_point
from actors.errors import DomainError, FailedPrecondition, Internal, ResourceExhausted, Unavailable
from actors.machines.machine import Machine
from actors.machines.qemuproc import MachineError
from actors.model import ALIVE, Action, MemoryKind, NetMode, Protocol, State
from actors.net import netlink
from actors.net.netns import NetError
from actors.net.portfwd import (
    PortInUse,
    Target,
    _tcp_pair,  # (the relay's one connection, with its error boundary)
    bind_listener,
)
from actors.quotas import Admission
from actors.sandboxes.plans import Plan, Resume
from actors.sandboxes.sandbox import Sandbox
from actors.sandboxes.savedstate import Checkpoint, thaw_guest
from actors.settings import Settings
from actors.snapshots.pools import Pools
from actors.snapshots.snapshot import SnapshotStore
from actors.store import SnapshotRecord, Store
from actors.volumes import Volumes

log = logging.getLogger("sandvisor.hibernation")

WARM_TIMEOUT = 10.0  # s: the warm-up exec after an explicit resume
MAX_OWN_LAYERS = 4  # unmerged layers of its own (merges that failed) past which a pause is refused


class HibernationHost(Interface):
    """What hibernation uses of the registry (which implements it): its parts, and the
    admission and lives of new work. The registry imports this module, not the reverse."""

    settings: Settings
    store: Store
    admission: Admission
    snapshots: SnapshotStore
    pools: Pools
    volumes: Volumes

    @property
    def sandboxes(self) -> Mapping[str, Sandbox]: ...

    @property
    def lives(self) -> trio.Nursery | None: ...

    def check_open(self) -> None: ...

    def admit(self, memory_mib: int, *, ram_file: bool) -> None: ...

    async def start_life(self, sb: Sandbox, plan: Plan) -> None: ...


class Hibernation:
    """The registry's pauses and resumes (one at a time per sandbox)."""

    def __init__(self, registry: HibernationHost) -> None:
        self.reg = registry
        self._locks: dict[str, trio.Lock] = {}  # by uid
        self._watchers: dict[str, tuple[trio.CancelScope, trio.Event]] = {}  # held ports' watchers, by uid
        self._pausing: set[str] = set()  # uids an idle pause was started for

    # -- lookups ----------------------------------------------------------------
    def saved(self, sb: Sandbox) -> SnapshotRecord | None:
        """A paused sandbox's saved state."""
        uid = sb.record.uid
        return next((r for r in self.reg.snapshots.snapshots.values() if r.paused_for == uid), None)

    def paused(self) -> list[Sandbox]:
        return [sb for sb in self.reg.sandboxes.values() if sb.state == State.PAUSED]

    def paused_seconds(self, sb: Sandbox) -> float:
        snap = self.saved(sb)
        return max(0.0, time.time() - snap.created_ns / 1e9) if snap is not None else 0.0

    def _lock(self, sb: Sandbox) -> trio.Lock:
        return self._locks.setdefault(sb.record.uid, trio.Lock())

    # -- pause --------------------------------------------------------------------
    async def pause(self, sb: Sandbox) -> None:
        """Hibernate a ready sandbox (idempotent on a paused one)."""
        self.reg.check_open()
        async with self._lock(sb):
            with sb.held.pausing():
                await self._pause(sb)

    async def _pause(self, sb: Sandbox) -> None:
        reg = self.reg
        if sb.state == State.PAUSED:
            return
        sb.check_checkpointable()
        cap = reg.admission.quotas.max_paused
        if cap and len(self.paused()) >= cap:
            raise ResourceExhausted(f"at most {cap} sandboxes may be paused at once (--max-paused)")
        reg.admission.check_capture(f"pausing {sb.id}", sb.limits.memory_mib)
        await self.merge(sb)  # (what an earlier resume's merge left: it failed, or a restart came first)
        own = self.own_layers(sb)
        if own > MAX_OWN_LAYERS:
            raise ResourceExhausted(
                f"sandbox {sb.id} stands on {own} disk layers of its own that did not merge (at most "
                f"{MAX_OWN_LAYERS}): it cannot be paused again; its log says why (stop and start it, or checkpoint)"
            )
        address = str(sb.pool_address or "") if sb.config.network.mode == NetMode.TAP else ""
        gens = reg.volumes.generations(sb.config.volumes)
        t0 = time.monotonic()
        try:
            snap, ck = await reg.snapshots.take(
                sb.hibernate, sb.record, address=address, volume_generations=gens, paused_for=sb.record.uid
            )
        except Internal as exc:
            if "No space left" in exc.message or "ENOSPC" in exc.message:
                raise ResourceExhausted(f"no room to pause {sb.id}: {exc.message}") from None
            raise
        try:
            await reg.store.flush()
            crash_point("pause-saved")
            sb.mark_paused()
            await reg.store.flush()
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._undo(sb, snap)
            raise
        crash_point("pause-stopping")
        sb.end_for_pause()
        with trio.CancelScope(shield=True):
            await sb.wait_stopped()
            self._hold_ports(sb)
        took = time.monotonic() - t0
        fs = f"; file systems {ck.consistency} ({ck.freeze_s * 1000:.0f} ms)" if ck.consistency else ""
        saved = f"{_touched_mib(ck)} MiB saved{fs}"
        sb.log.append("system", f"paused ({ck.memory}, {took * 1000:.0f} ms; {saved})".encode())
        sb.emit(Action.PAUSED, **({"consistency": ck.consistency} if ck.consistency else {}))

    async def _undo(self, sb: Sandbox, snap: SnapshotRecord) -> None:
        """A pause that failed after its checkpoint: the guest runs on, the state goes."""
        sb.unmark_paused()
        guest = sb.guest
        if guest is not None:
            try:
                await guest.machine.qmp_execute("cont")
            except Exception as exc:  # the life fails on its own if QEMU is gone
                log.warning("sandbox %s: cont after a failed pause: %s", sb.id, exc)
            else:  # (its file systems were left frozen for the QEMU that was to end)
                await thaw_guest(guest)
        self.reg.snapshots.retire(snap)

    async def pause_quietly(self, sb: Sandbox) -> None:
        """The idle timer's pause: a refusal is logged; the sandbox runs on."""
        uid = sb.record.uid
        try:
            await self.pause(sb)
        except DomainError as exc:
            sb.log.append("system", f"idle pause refused: {exc.message}".encode())
        finally:
            self._pausing.discard(uid)

    def pause_later(self, sb: Sandbox) -> None:
        lives = self.reg.lives
        if sb.record.uid in self._pausing or lives is None:
            return
        self._pausing.add(sb.record.uid)
        sb.log.append("system", b"idle timeout: pausing")
        lives.start_soon(self.pause_quietly, sb)

    # -- resume -------------------------------------------------------------------
    async def resume(self, sb: Sandbox, *, warm: bool = False) -> None:
        """Bring a paused sandbox back as itself, ready (idempotent on a live one).
        ``warm`` (an explicit Resume): one exec of ``true`` in the guest before this
        returns, so the caller's first Run does not pay for what a fresh QEMU (TCG:
        an empty translation cache) and lazily loaded memory make the first exec cost.
        An auto-resume skips it: the call that wakes the sandbox does that work itself."""
        reg = self.reg
        reg.check_open()
        async with self._lock(sb):
            if sb.state in ALIVE:
                return
            if sb.state != State.PAUSED:
                raise FailedPrecondition(f"sandbox {sb.id} is {sb.state}, not paused")
            await sb.wait_stopped()
            snap = self.saved(sb)
            if snap is None:
                raise FailedPrecondition(f"sandbox {sb.id} is paused but its saved state is gone")
            reg.snapshots.check_restorable(snap, reg.settings.accel)
            reg.admit(snap.machine.memory_mib, ram_file=snap.memory != MemoryKind.MAPPED)
            accepted = time.monotonic()
            pending = await self._release_ports(sb)
            try:
                await reg.start_life(sb, Resume(snap, accepted=accepted, wake=True))
                await sb.ready_event.wait()
            finally:
                if _state(sb) != State.READY:
                    with trio.CancelScope(shield=True):
                        await sb.wait_stopped()
                        for conn in pending:
                            conn.close()
                        if _state(sb) == State.PAUSED:
                            self._hold_ports(sb)
            if _state(sb) != State.READY:
                raise Unavailable(f"sandbox {sb.id} did not resume: {sb.record.error or sb.state}")
            reg.snapshots.retire(snap)
            if reg.settings.cells is not None:
                reg.settings.cells.sealed.drop(snap.id)
            if reg.lives is not None:  # its frozen disk goes back into the running one
                reg.lives.start_soon(self._merge_behind, sb)
            self._pipe(sb, pending)
            sb.touch()
            await sb.persisted()
            if warm:
                await _warm(sb)

    async def wake(self, sb: Sandbox) -> None:
        """Auto-resume (Sandbox.awake): as :meth:`resume`."""
        await self.resume(sb)

    async def _wake_quietly(self, sb: Sandbox) -> None:
        try:
            await self.resume(sb)
        except DomainError as exc:
            sb.log.append("system", f"auto-resume on a connection failed: {exc.message}".encode())

    # -- the disk's layers ------------------------------------------------------------
    def own_layers(self, sb: Sandbox) -> int:
        """How many layers at the top of the sandbox's chain are its alone: a frozen disk
        in the snapshot store with no snapshot record (a pause's, once resumed; a deleted
        snapshot's) that no other sandbox, pool member or snapshot stands on."""
        snaps = self.reg.snapshots
        root = snaps.root.resolve()
        recorded = {Path(r.dir).resolve() for r in snaps.snapshots.values()} | snaps.pending
        others: set[Path] = set()
        for o in [*self.reg.sandboxes.values(), *self.reg.pools.all_members()]:
            if o is not sb:
                others.update(Path(p).resolve() for p in o.record.chain)
        for r in snaps.snapshots.values():
            others.update(Path(p).resolve() for p in r.chain)
        n = 0
        for layer in sb.record.chain[:-1]:  # (the base is never merged)
            p = Path(layer).resolve()
            if p.parent.parent != root or p.parent in recorded or p in others:
                break
            n += 1
        return n

    async def _merge_behind(self, sb: Sandbox) -> None:
        """:meth:`merge` as a task of the registry's lives' nursery, after a resume: an
        error of it (a full disk at the store's flush, a guest gone meanwhile) is the
        sandbox's log line, never the registry's end (a pause merges again)."""
        try:
            await self.merge(sb)
        except Exception as exc:
            log.warning("sandbox %s: merging its disk after a resume: %r", sb.id, exc)

    async def merge(self, sb: Sandbox) -> None:
        """Merge the layers of a running sandbox's disk that are its alone (what its pause
        froze) back into its overlay (Machine.merge_layers: QEMU's block-stream, the
        guest runs on), so pause after pause neither deepens its chain nor keeps a copy
        of what it overwrote; the merged layers' directories go (the collector). Only
        on the block graph its QEMU was launched with (a checkpoint since then moved the
        disk: the next pause's merge). A failure is logged: the chain stays as it was
        (the same data), and a pause tries again."""
        async with sb.layers_exclusive():
            guest, chain = sb.guest, list(sb.record.chain)
            n = self.own_layers(sb)
            if guest is None or sb.state != State.READY or n == 0:
                return
            m = guest.machine
            if m.disk_top != "disk0" or [str(p) for p in m.spec.disk_chain] != chain:
                return
            t0 = time.monotonic()
            try:
                self._keep_boot_files(sb, m, chain[:n])
                await m.merge_layers(n, chain[n])
            except (MachineError, OSError) as exc:
                if sb.state == State.READY:
                    sb.log.append("system", f"disk: merging {n} layer(s) of its own failed: {exc}".encode())
                    log.warning("sandbox %s: merging %d disk layer(s): %s", sb.id, n, exc)
                return
            # the header names chain[n] from here: a crash before this flush leaves the
            # record naming layers the top no longer reads (harmless: it holds their data)
            await sb.note_chain(chain[n:])
            self.reg.snapshots.collect_soon()  # (their directories)
            ms = (time.monotonic() - t0) * 1000
            sb.log.append("system", f"disk: {n} layer(s) of its own merged into it in {ms:.0f} ms".encode())

    def _keep_boot_files(self, sb: Sandbox, m: Machine, merged: list[str]) -> None:
        """A resumed QEMU runs the kernel and initrd of its snapshot's directory (links),
        which its next checkpoint links again: before that directory goes with a merged
        layer, they are linked into the sandbox's own, and the machine (and its life
        record, for a supervisor that adopts it) names them there."""
        gone = {Path(p).parent for p in merged}
        moved: dict[str, Path] = {}
        for name in ("kernel", "initrd"):
            src: Path = getattr(m.spec, name)
            if src.parent not in gone:
                continue
            dst, tmp = sb.files.dir / name, sb.files.dir / f"{name}.new"
            tmp.unlink(missing_ok=True)
            try:
                os.link(src, tmp)
            except OSError:
                shutil.copy2(src, tmp)
            os.replace(tmp, dst)
            moved[name] = dst
        if not moved:
            return
        m.spec = attrs.evolve(
            m.spec, kernel=moved.get("kernel", m.spec.kernel), initrd=moved.get("initrd", m.spec.initrd)
        )
        life = sb.record.life
        if life is not None and isinstance(life.spec, dict) and isinstance(life.spec.get("machine"), dict):
            machine = {**life.spec["machine"], **{k: str(v) for k, v in moved.items()}}
            sb.note_life(attrs.evolve(life, spec={**life.spec, "machine": machine}))

    # -- the end of a paused sandbox --------------------------------------------------
    def discard(self, sb: Sandbox) -> None:
        """Stop a paused sandbox (no life runs): its saved memory goes (its processes
        end), its disk as it was at the pause stays; "stopped"."""
        if sb.state != State.PAUSED or not sb.stopped:
            return
        self._drop(sb)
        sb.mark_stopped()
        sb.emit(Action.STOPPING)
        sb.emit(Action.STOPPED, exit_code=str(sb.record.last_exit_code))
        lives = self.reg.lives
        if sb.config.volumes and lives is not None:
            lives.start_soon(self._release_volumes, sb)

    async def forget(self, sb: Sandbox) -> None:
        """What a paused sandbox holds beside its record (a Remove)."""
        self._drop(sb)
        await self._release_volumes(sb)

    def _drop(self, sb: Sandbox) -> None:
        """Its held ports and saved state."""
        self._close_ports(sb)
        snap = self.saved(sb)
        if snap is not None:
            self.reg.snapshots.retire(snap)
            if self.reg.settings.cells is not None:
                self.reg.settings.cells.sealed.drop(snap.id)
        self._locks.pop(sb.record.uid, None)

    async def _release_volumes(self, sb: Sandbox) -> None:
        """The claims a paused guest held (its file systems checked: it never unmounted)."""
        if sb.config.volumes:
            for note in await self.reg.volumes.release_checked(sb.record.uid):
                sb.log.append("system", note.encode())

    # -- a supervisor start -------------------------------------------------------------
    def recover(self) -> None:
        """After the registry's recovery: paused sandboxes keep their volume claims; a
        saved state whose sandbox is not paused (a crash between its record and the
        sandbox's) goes; a paused sandbox without one fails."""
        reg = self.reg
        by_uid = {sb.record.uid: sb for sb in reg.sandboxes.values()}
        for snap in [r for r in reg.snapshots.snapshots.values() if r.paused_for]:
            sb = by_uid.get(snap.paused_for)
            if sb is None or sb.state != State.PAUSED:
                log.info("saved state %s of a sandbox that is not paused: removed", snap.id)
                reg.snapshots.retire(snap)
        for sb in self.paused():
            if self.saved(sb) is None:
                sb.mark_failed("paused, but its saved state is gone")
                continue
            if sb.config.volumes:
                try:
                    reg.volumes.claim(sb.record.uid, sb.id, sb.config.volumes, adopted=True)
                except DomainError as exc:
                    sb.log.append("system", f"paused: its volumes: {exc.message}".encode())

    def hold_all(self) -> None:
        """The host ports of the paused sandboxes (a supervisor start)."""
        for sb in self.paused():
            self._hold_ports(sb)

    def close_all(self) -> None:
        """The supervisor exits: the held listeners and TAPs go (the next one holds them
        again, :meth:`hold_all`)."""
        for sb in self.paused():
            try:
                self._close_ports(sb)
            except Exception as exc:  # (its link's rules may be gone with the host network)
                log.warning("sandbox %s: releasing what it held while paused: %s", sb.id, exc)

    # -- held ports -------------------------------------------------------------------
    def _relayed(self, sb: Sandbox) -> bool:
        """Whether the sandbox's forwards are our relays (tap, or a jailed user mode),
        which take over a held listener; else QEMU's slirp binds the port itself."""
        return sb.config.network.mode == NetMode.TAP or self.reg.settings.cells is not None

    def _hold_ports(self, sb: Sandbox) -> None:
        """Bind the host ports of a paused sandbox's mappings (they stay reserved) and,
        with auto-resume, watch them: the first connection (or datagram) resumes it."""
        for pm in sb.record.ports:
            if pm.key in sb.held.ports or not pm.host_port:
                continue
            kind = socket.SOCK_DGRAM if pm.protocol == Protocol.UDP else socket.SOCK_STREAM
            try:
                sock = bind_listener(self.reg.settings.bind_address(pm), pm.host_port, kind)
            except (PortInUse, OSError) as exc:
                sb.log.append("system", f"paused: host port {pm.host_port} not held: {exc}".encode())
                continue
            sock.setblocking(False)
            sb.held.hold_port(pm.key, sock)
        watched: list[socket.socket | int] = [*sb.held.ports.values()]
        tap = self._hold_tap(sb)
        if tap is not None:
            watched.append(tap)
        lives = self.reg.lives
        if watched and sb.config.timers.auto_resume and lives is not None:
            self._stop_watch(sb)
            scope, done = trio.CancelScope(), trio.Event()
            self._watchers[sb.record.uid] = (scope, done)
            lives.start_soon(self._watch, sb, watched, scope, done)

    def _hold_tap(self, sb: Sandbox) -> int | None:
        """A paused tap sandbox's TAP stays (or, after a supervisor start, is made again):
        what is sent to its address waits in the TAP's queue -- a permanent neighbour
        entry (its fixed MAC) spares the ARP that nobody would answer -- and is read by
        the resumed QEMU. Its descriptor, to watch (None: not a tap sandbox)."""
        if sb.config.network.mode != NetMode.TAP or self.reg.settings.hostnet is None:
            return None
        link = sb.held.link
        if link is None or link.closed:
            try:
                link, _ = netlink.open_link(self.reg.settings, sb.config.network, sb.record.uid, sb.files.dir)
            except (DomainError, MachineError, OSError) as exc:
                sb.log.append("system", f"paused: its TAP not held: {exc}".encode())
                return None
            sb.held.hold_link(link)
        if link is None or link.tap_fd is None:
            return None
        g = link.guest
        try:
            link.net.netns.ip(f"neigh replace {g.address} lladdr {g.mac} dev {link.name} nud permanent")
        except NetError as exc:
            sb.log.append("system", f"paused: neighbour entry: {exc}".encode())
        return link.tap_fd

    async def _watch(
        self, sb: Sandbox, watched: list[socket.socket | int], scope: trio.CancelScope, done: trio.Event
    ) -> None:
        woke = False
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    for s in watched:
                        nursery.start_soon(_readable, s, nursery.cancel_scope)
                woke = not scope.cancel_called
        finally:
            if self._watchers.get(sb.record.uid) == (scope, done):
                del self._watchers[sb.record.uid]
            done.set()
        if woke and sb.state == State.PAUSED:
            sb.log.append("system", b"a connection to a held port: resuming")
            await self._wake_quietly(sb)

    def _stop_watch(self, sb: Sandbox) -> trio.Event | None:
        w = self._watchers.pop(sb.record.uid, None)
        if w is None:
            return None
        w[0].cancel()
        return w[1]

    async def _release_ports(self, sb: Sandbox) -> list[socket.socket]:
        """Before a resume: the watcher ends; relayed forwards take the listeners over
        (PauseHold.take_port); slirp's need the ports free: the TCP connections
        waiting are accepted first (piped to the forward once it is back)."""
        done = self._stop_watch(sb)
        if done is not None:
            await done.wait()
        if self._relayed(sb):
            return []
        pending: list[socket.socket] = []
        ports, link = sb.held.let_go()
        sb.held.hold_link(link)  # (the TAP stays held: the resumed life takes it)
        for key, sock in ports.items():
            if key[1] == Protocol.TCP:
                while True:
                    try:
                        conn, _ = sock.accept()
                    except OSError:
                        break
                    pending.append(conn)
            sock.close()
        return pending

    def _close_ports(self, sb: Sandbox) -> None:
        self._stop_watch(sb)
        ports, link = sb.held.let_go()
        for sock in ports.values():
            trio.lowlevel.notify_closing(sock)
            sock.close()
        if link is not None:
            if link.tap_fd is not None:
                trio.lowlevel.notify_closing(link.tap_fd)
            link.close()

    def _pipe(self, sb: Sandbox, pending: list[socket.socket]) -> None:
        """Connections accepted while the ports were handed to QEMU: to the port now."""
        lives = self.reg.lives
        if not pending or lives is None:
            for conn in pending:
                conn.close()
            return
        by_port = {pm.host_port: pm for pm in sb.record.ports}
        for conn in pending:
            local = conn.getsockname()[1]
            pm = by_port.get(local)
            if pm is None:
                conn.close()
                continue
            lives.start_soon(_pipe_one, conn, Target(self.reg.settings.bind_address(pm), pm.host_port))


async def _warm(sb: Sandbox) -> None:
    """Best effort: ``true`` run in the guest (not a workload: no state change)."""
    guest = sb.guest
    if guest is None:
        return
    with trio.move_on_after(WARM_TIMEOUT):
        try:
            await guest.channel.run(["true"], timeout=WARM_TIMEOUT)
        except GuestError as exc:
            log.info("sandbox %s: warming up after its resume: %s", sb.id, exc)


def _state(sb: Sandbox) -> State:
    """Its state now (after an await: not what a check before it said)."""
    return sb.state


async def _readable(sock: socket.socket | int, scope: trio.CancelScope) -> None:
    try:
        await trio.lowlevel.wait_readable(sock)
    except (trio.ClosedResourceError, OSError):
        return
    scope.cancel()


async def _pipe_one(raw: socket.socket, target: Target) -> None:
    raw.setblocking(False)
    await _tcp_pair(trio.SocketStream(trio.socket.from_stdlib_socket(raw)), target)


def _touched_mib(ck: Checkpoint) -> int:
    """What a pause wrote of the guest's memory and device state."""
    return sum(v for k, v in ck.sizes.items() if k != "disk.qcow2") >> 20
