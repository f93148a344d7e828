"""One running QEMU process: launch (or adopt), QMP, console, the checkpoint's QMP
steps, and the shutdown ladder.

Modelled on QEMU's ``python/qemu/machine/machine.py``: a runstate guard on every
operation, and a shutdown that always ends with the process reaped. Its command line
is :class:`~actors.machines.qemuspec.MachineSpec`'s; the process it watches, the user it runs
as and the error tree (:class:`~actors.machines.qemuproc.MachineError` and below) are
:mod:`actors.machines.qemuproc`'s.

Runstates::

    NEW --launch()--> RUNNING --(process exits)--> EXITED
                        |                            ^
                        +--shutdown(): ask -> quit -> SIGTERM -> SIGKILL -> wait

QMP is :mod:`actors.machines.qmp`'s Trio-native client, its reader a task of the machine's
nursery.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from actors._groups import collapse_single
from actors.cells.identities import JailError
from actors.crash import crash_point
from actors.machines.qemuproc import (
    UNKNOWN_EXIT,
    AdoptedProcess,
    LaunchError,
    MachineError,
    MachineStateError,
    Proc,
    QMPCommandError,
    check_peer,
    legacy_restore,
    start_time,
)
from actors.machines.qemuspec import LAYER_FDSET, MachineSpec
from actors.machines.qmp import Event, QMPClient, QMPCommandFailed, QMPError, QMPTimeout

log = logging.getLogger("sandvisor.machine")
MERGE_POLL = 0.02  # s: how often a merge asks QEMU how its block job is doing
SETTLE_TIMEOUT = 10.0  # s: QEMU's answer to which layer its disk writes, after a switch that failed

CONSOLE_RING = 64 * 1024
CONNECT_POLL_FIRST, CONNECT_POLL_MAX = 0.002, 0.02  # s: the polls for QEMU's sockets (_connect)


class Runstate(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    EXITED = "exited"


@attrs.frozen
class StagedDisk:
    """An overlay QEMU has open as a block node, not yet written by the disk device."""

    node: str
    fdset: int


class _Ring:
    """The last ``size`` bytes written: guest-controlled output never grows memory."""

    def __init__(self, size: int) -> None:
        self.buf: collections.deque[bytes | bytearray] = collections.deque()
        self.size = size
        self.len = 0
        self.total = 0

    def add(self, data: bytes | bytearray) -> None:
        self.buf.append(data)
        self.len += len(data)
        self.total += len(data)
        while self.len > self.size and len(self.buf) > 1:
            self.len -= len(self.buf.popleft())

    def text(self) -> str:
        return b"".join(self.buf)[-self.size :].decode(errors="replace")


Spawner = Callable[[list[str], tuple[int, ...], int, dict[str, str]], Awaitable[Proc]]
"""Start QEMU's argv with these descriptors, this stderr fd and these environment
variables (its whole environment), somewhere (a jail)."""


@attrs.frozen
class Placement:
    """Where a QEMU runs: its socket dir as the host reaches it and as QEMU sees it (in
    a jail, its socket dir), its stderr log (a file the next supervisor can read), and
    how it is started (``spawn``: into a jail; None: a plain child, as ``user``)."""

    sock_dir: Path
    log: Path
    qemu_dir: Path | None = None  # default: sock_dir
    spawn: Spawner | None = None

    @classmethod
    def plain(cls, run_dir: Path) -> Placement:
        return cls(sock_dir=run_dir, log=run_dir / "qemu.log")


class Machine:
    """One QEMU process and its QMP connection. Owns the process, the QMP client and
    the console; the placement's directories are the caller's (they exist).

    ``run`` starts QEMU (``on_spawned`` is told its pid and start time at once, before
    QMP: a crash from here on leaves a process the next supervisor can find); or, for
    a machine made by :meth:`adopt`, attaches to a QEMU a previous supervisor started.
    :meth:`detach` lets go of a running QEMU without stopping it (it outlives us)."""

    def __init__(
        self,
        spec: MachineSpec,
        placement: Placement | Path,
        *,
        name: str = "vm",
        fds: dict[str, int] | None = None,
        on_spawned: Callable[[int, int], None] | None = None,
    ) -> None:
        self.spec = spec
        self.placement = placement if isinstance(placement, Placement) else Placement.plain(placement)
        self.run_dir = self.placement.sock_dir
        self.name = name
        self.runstate = Runstate.NEW
        self.proc: Proc | None = None
        self.qmp = QMPClient(name)
        self.console = _Ring(CONSOLE_RING)
        self._exited = trio.Event()
        self.returncode: int | None = None
        self._nursery: trio.Nursery | None = None
        # one descriptor-carrying command at a time, until its reply: QEMU keeps the last
        # descriptor it read and closes an earlier one its command has not claimed yet
        self._fd_lock = trio.Lock()
        self._disk_top = "disk0"  # the block node the disk device writes to (moves on checkpoint)
        self._staged = 0  # overlays staged so far: fd set and node names stay unique
        self._fds = dict(fds or {})  # more descriptors for QEMU (RAM, taps), the caller's
        self._on_spawned = on_spawned
        self._adopted: AdoptedProcess | None = None
        self.detached = False
        # our connected ends of QEMU's sockets (qmp, console, guest), made before it
        # started (_pre_connect); each taken by its user
        self._pre: dict[str, socket.socket] = {}
        self.restore_fd = -1  # a saved state QEMU loads as it starts (-incoming fd:), the caller's

    @classmethod
    def adopt(cls, spec: MachineSpec, placement: Placement, proc: AdoptedProcess, *, name: str = "vm") -> Machine:
        """A machine for a running QEMU (its :meth:`run` attaches instead of starting)."""
        m = cls(spec, placement, name=name)
        m._adopted = proc
        return m

    @property
    def disk_top(self) -> str:
        return self._disk_top

    @property
    def staged(self) -> int:
        return self._staged

    def resume_life_state(self, disk_top: str, staged: int) -> None:
        """An adopted QEMU's block graph, as recorded (a checkpoint moved its disk)."""
        self._disk_top, self._staged = disk_top, staged

    @property
    def guest_socket(self) -> Path:
        return self.run_dir / "guest.sock"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stderr_tail(self, lines: int = 3) -> list[str]:
        try:
            with open(self.placement.log, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                return f.read().decode(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return []

    def describe_exit(self) -> str:
        rc = self.returncode
        if rc == UNKNOWN_EXIT:
            how = "exited (its status is unknown: a previous supervisor started it)"
        elif rc is not None and rc < 0:
            how = f"killed by signal {-rc}"
        else:
            how = f"exit status {rc}"
        err = self.stderr_tail()
        return f"QEMU {how}" + (f": {' | '.join(err)}" if err else "")

    async def run(self, task_status: trio.TaskStatus[Machine] = trio.TASK_STATUS_IGNORED) -> None:
        """Launch (or attach to) QEMU, then supervise it until it exits. ``started`` once
        QMP is up."""
        if self.runstate is not Runstate.NEW:
            raise MachineStateError(f"machine is {self.runstate.value}, not new")
        if self._adopted is not None:
            self.proc = self._adopted
        else:
            try:
                self.proc = await self._launch()
            except BaseException:
                self._close_pre()
                raise
        self.runstate = Runstate.RUNNING
        try:
            with collapse_single():
                await self._supervise(task_status)
        finally:
            self._close_pre()  # (the ones nobody took)
            with trio.CancelScope(shield=True):
                if not self.detached:
                    await self._kill_and_reap()
                await self.qmp.aclose()  # (its socket closed already, unless QMP never started)
            self._nursery = None

    async def _launch(self) -> Proc:
        p = self.placement
        for old in p.sock_dir.glob("*.sock"):
            old.unlink()
        user = self.spec.user
        if user is not None and p.spawn is None:
            os.chown(p.sock_dir, user.uid, user.gid)  # QEMU creates its sockets here
        files = self.spec.open_files()
        fds = {**files, **self._fds}
        if not legacy_restore():
            try:
                files.update(self._pre_connect())
            except OSError as exc:
                for fd in files.values():
                    os.close(fd)
                self._close_pre()
                raise LaunchError(f"cannot make QEMU's sockets in {p.sock_dir}: {exc.strerror}") from None
            fds.update(files)
            if self.restore_fd >= 0 and self.spec.incoming:
                fds["incoming"] = self.restore_fd  # inherited: migrate-incoming fd:N, sent with the handshake
        try:
            argv = self.spec.argv(p.qemu_dir or p.sock_dir, fds)
            env = self.spec.environ(fds)
        except BaseException:  # (a device check refused): the descriptors are still ours
            for fd in files.values():
                os.close(fd)
            raise
        log.debug("launch %s: %s %s", self.name, " ".join(f"{k}={v}" for k, v in env.items()), shlex.join(argv))
        try:
            err = os.open(p.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            for fd in files.values():
                os.close(fd)
            raise LaunchError(f"cannot open QEMU's log {p.log}: {exc.strerror}") from None
        try:
            if p.spawn is not None:
                try:
                    proc = await p.spawn(argv, tuple(fds.values()), err, env)
                except JailError as exc:  # a cell's spawner (actors/cells/cell.py)
                    raise LaunchError(f"cannot start QEMU in its jail: {exc}") from None
            else:
                creds: dict[str, Any] = {}
                if user is not None:
                    creds = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}
                try:
                    proc = await trio.lowlevel.open_process(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        pass_fds=tuple(fds.values()),
                        env={**os.environ, **env} if env else None,
                        start_new_session=True,  # a ^C to the supervisor must not reach QEMU
                        **creds,
                    )
                except OSError as exc:
                    raise LaunchError(f"cannot start {argv[0]}: {exc}") from exc
        finally:
            os.close(err)
            for fd in files.values():
                os.close(fd)
        if self._on_spawned is not None:
            try:
                self._on_spawned(proc.pid, start_time(proc.pid))
            except BaseException:
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
                raise
        crash_point("spawned")
        return proc

    def _pre_connect(self) -> dict[str, int]:
        """QEMU's listening sockets, made here and connected to at once (the connection
        waits in the backlog: QEMU, started with ``wait=on``, accepts it as it starts):
        no connect loop after the spawn, and QMP, the console and the guest channel are
        ours before QEMU runs. Their listening descriptors, for QEMU (closed after the
        spawn); a later supervisor connects by path. QEMU listens on them again, so the
        kernel's peer credentials are QEMU's (:func:`check_peer` on adoption)."""
        listeners: dict[str, int] = {}
        for name in ("qmp", "console", "guest"):
            path = self.run_dir / f"{name}.sock"
            lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                lsock.bind(str(path))
                lsock.listen(1)
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                self._pre[name] = client
                client.connect(str(path))
            except OSError:
                lsock.close()
                for fd in listeners.values():
                    os.close(fd)
                raise
            listeners[f"listen:{name}.sock"] = lsock.detach()
        return listeners

    def _incoming_commands(self) -> tuple[tuple[str, dict[str, Any]], ...]:
        """A restore's QMP steps, sent with the handshake (no round trip each): the
        migration capability (x-ignore-shared for a mapped restore: RAM is the file
        QEMU mapped), then migrate-incoming from the saved state QEMU inherited (by its
        number). :meth:`loaded` waits for the load."""
        if self.restore_fd < 0 or not self.spec.incoming:
            return ()
        mapped = self.spec.memory_file is not None and not self.spec.memory_shared
        caps = {"capabilities": [{"capability": "x-ignore-shared", "state": mapped}]}
        return (("migrate-set-capabilities", caps), ("migrate-incoming", {"uri": f"fd:{self.restore_fd}"}))

    def _close_pre(self) -> None:
        for sock in self._pre.values():
            sock.close()
        self._pre.clear()

    def take_guest_stream(self) -> trio.SocketStream | None:
        """Our connection to the guest channel, made before QEMU started (None: the
        legacy path, or adopted: connect by path)."""
        sock = self._pre.pop("guest", None)
        return trio.SocketStream(trio.socket.from_stdlib_socket(sock)) if sock is not None else None

    async def _connect(self, name: str) -> socket.socket:
        """Connect to one of QEMU's listening sockets (made during its start-up). Polled,
        backing off from 2 ms to 20 ms: a QEMU coming up in a burst takes 0.1-1 s to
        listen, and each try is a socket, a connect and a wakeup of the supervisor
        (at 2 ms: 12% of its CPU per Create in a burst of 16; docs/results/burst-fast.md)."""
        path = self.run_dir / name
        delay = CONNECT_POLL_FIRST
        with trio.fail_after(10):
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                try:
                    s.connect(str(path))
                    check_peer(s, self.pid, path)
                    return s
                except (FileNotFoundError, ConnectionRefusedError):
                    s.close()
                    if self.exited:
                        raise LaunchError(f"QEMU exited before it listened on {name}: {self.describe_exit()}") from None
                    await trio.sleep(delay)
                    delay = min(delay * 1.5, CONNECT_POLL_MAX)
                except OSError:
                    s.close()
                    raise

    async def _supervise(self, task_status: trio.TaskStatus[Machine]) -> None:
        assert self.proc is not None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._reap)
            try:
                with trio.fail_after(10):
                    pre = self._pre.pop("qmp", None)
                    sock = pre if pre is not None else await self._connect("qmp.sock")
                    then = self._incoming_commands() if pre is not None else ()
                    await nursery.start(functools.partial(self.qmp.run, sock, eager=pre is not None, then=then))
            except (Exception, trio.TooSlowError) as exc:
                with trio.move_on_after(0.5):
                    await self._exited.wait()
                raise LaunchError(f"QMP handshake failed: {exc}; {self.describe_exit()}") from exc
            with contextlib.suppress(LaunchError, OSError, trio.TooSlowError):
                con = self._pre.pop("console", None) or await self._connect("console.sock")
                nursery.start_soon(self._pump, trio.SocketStream(trio.socket.from_stdlib_socket(con)), self.console)
            task_status.started(self)
            await self._exited.wait()
            nursery.cancel_scope.cancel()

    def detach(self) -> None:
        """Let go of QEMU without stopping it: leaving ``run`` closes our connections and
        leaves the process running (for the next supervisor to adopt)."""
        self.detached = True
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _pump(self, stream: trio.abc.ReceiveStream, ring: _Ring) -> None:
        try:
            async with stream:
                while True:
                    data = await stream.receive_some(4096)
                    if not data:
                        return
                    ring.add(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return

    async def _reap(self) -> None:
        assert self.proc is not None
        self.returncode = await self.proc.wait()
        self.runstate = Runstate.EXITED
        self._exited.set()

    async def _kill_and_reap(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.kill()
        self.returncode = await self.proc.wait()
        self.runstate = Runstate.EXITED
        self._exited.set()

    async def kill(self) -> None:
        """SIGKILL, reaped: for a QEMU whose state must not run on (shielded)."""
        with trio.CancelScope(shield=True):
            await self._kill_and_reap()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    # -- QMP -----------------------------------------------------------------
    async def qmp_execute(self, cmd: str, args: dict[str, Any] | None = None, *, timeout: float = 30) -> Any:
        return await self._execute(cmd, args, timeout=timeout)

    async def _execute(
        self, cmd: str, args: dict[str, Any] | None = None, *, timeout: float = 30, fd: int | None = None
    ) -> Any:
        if self.runstate is not Runstate.RUNNING:
            raise MachineStateError(f"QMP {cmd} on a machine that is {self.runstate.value}")
        try:
            return await self.qmp.execute(cmd, args, timeout=timeout, fd=fd)
        except QMPCommandFailed as exc:
            raise QMPCommandError(f"{cmd}: {exc.desc}") from None
        except QMPTimeout:
            raise QMPCommandError(f"{cmd}: no answer within {timeout:g}s") from None
        except QMPError as exc:  # disconnected, EOF, garbage: the process is going away
            raise MachineStateError(f"QMP {cmd}: {type(exc).__name__}: {exc}") from None

    @contextlib.contextmanager
    def events(self) -> Iterator[trio.MemoryReceiveChannel[Event]]:
        """QEMU's QMP events from now on, for the block (``QMPClient.listen``)."""
        with self.qmp.listen() as events:
            yield events

    async def hmp(self, line: str) -> str:
        """A human-monitor command. HMP reports errors as reply text; the caller checks it."""
        return str(await self.qmp_execute("human-monitor-command", {"command-line": line}))

    async def getfd(self, fd: int, name: str) -> None:
        """Hand QEMU a descriptor under ``name`` (for ``fd:name`` migration URIs)."""
        async with self._fd_lock:
            await self._execute("getfd", {"fdname": name}, fd=fd)

    async def add_fd(self, fd: int, fdset: int, opaque: str = "") -> None:
        """Add a descriptor to fd set ``fdset`` (opened by QEMU as /dev/fdset/N)."""
        async with self._fd_lock:
            await self._execute("add-fd", {"fdset-id": fdset, "opaque": opaque}, fd=fd)

    async def status(self) -> str:
        return str((await self.qmp_execute("query-status"))["status"])

    async def migrate_to_fd(self, fd: int, *, ignore_shared: bool, timeout: float = 120.0) -> dict[str, Any]:
        """Save device state (and RAM unless it is a shared file and ``ignore_shared``)
        into ``fd``. The caller has stopped the guest; it stays stopped. Returns QEMU's
        final query-migrate answer."""
        await self.prepare_migration(fd, ignore_shared=ignore_shared)
        return await self.migrate_prepared(timeout=timeout)

    async def prepare_migration(self, fd: int, *, ignore_shared: bool) -> None:
        """:meth:`migrate_to_fd`'s settings and descriptor, given ahead (the guest may run):
        :meth:`migrate_prepared` then saves, once the caller has stopped the guest."""
        await self._migration_caps(ignore_shared)
        await self.qmp_execute("migrate-set-parameters", {"max-bandwidth": 1 << 40, "downtime-limit": 2000})
        await self.getfd(fd, "snapfd")

    async def migrate_prepared(self, *, timeout: float = 120.0) -> dict[str, Any]:
        """Save into the descriptor :meth:`prepare_migration` gave (the guest stopped)."""
        await self.qmp_execute("migrate", {"uri": "fd:snapfd"})
        with trio.fail_after(timeout):
            while True:
                info = await self.qmp_execute("query-migrate")
                st = info.get("status")
                if st == "completed":
                    break
                if st in ("failed", "cancelled"):
                    raise QMPCommandError(f"migration {st}: {info.get('error-desc', '')}")
                await trio.sleep(0.002)
            # the completed status can come while the run state is still finish-migrate;
            # cont then fails with "Migration is not finalized yet" (measured)
            while await self.status() == "finish-migrate":
                await trio.sleep(0.001)
        return dict(info)

    async def migrate_from_fd(
        self, fd: int, *, ignore_shared: bool, resume: bool = True, timeout: float = 120.0
    ) -> None:
        """Load a saved state into a machine started with ``incoming``; it runs after
        (``resume``), or stays paused (a conversion: started with ``-S``, it never runs
        the guest)."""
        await self.incoming_from_fd(fd, ignore_shared=ignore_shared)
        await self.loaded(resume=resume, timeout=timeout)

    async def incoming_from_fd(self, fd: int, *, ignore_shared: bool) -> None:
        """Start loading a state from ``fd`` (a file, or a live source's socket) into a
        machine started with ``incoming``; :meth:`loaded` waits for it."""
        await self._migration_caps(ignore_shared)
        await self.getfd(fd, "snapfd")
        await self.qmp_execute("migrate-incoming", {"uri": "fd:snapfd"})

    async def loaded(self, *, resume: bool = True, timeout: float = 120.0) -> None:
        """Wait for an incoming state to be in (started with it by descriptor, or after
        :meth:`migrate_from_fd`'s migrate-incoming); it runs after (``resume``: a state
        saved with its paused runstate is told ``cont``), or stays paused. QEMU loads a
        file in one go of its main loop and answers QMP after it: one or two polls."""
        with trio.fail_after(timeout):
            while True:
                st = await self.status()
                if st == "running":
                    if not resume:
                        raise QMPCommandError("the loaded guest runs, though it was to stay paused")
                    return
                if st in ("paused", "postmigrate"):
                    if resume:
                        await self.qmp_execute("cont")
                    return
                if st not in ("inmigrate", "prelaunch", "restore-vm"):
                    raise QMPCommandError(f"restore ended in run state {st!r}")
                await trio.sleep(0.001)

    async def _migration_caps(self, ignore_shared: bool, *, pause_before_switchover: bool = False) -> None:
        caps = [
            {"capability": "x-ignore-shared", "state": ignore_shared},
            {"capability": "pause-before-switchover", "state": pause_before_switchover},
        ]
        await self.qmp_execute("migrate-set-capabilities", {"capabilities": caps})

    # -- a live copy (precopy while the guest runs: actors/sandboxes/livecopy.py) ------------
    async def migrate_live(self, fd: int, *, downtime_ms: int) -> None:
        """Send the running guest's RAM and devices into ``fd`` (a helper QEMU's incoming
        socket) while it runs: QEMU tracks what the guest writes and sends it again,
        stops the guest once what is left fits ``downtime_ms``, and waits in
        ``pre-switchover`` (the guest stopped) for :meth:`migrate_continue`."""
        await self._migration_caps(False, pause_before_switchover=True)
        await self.qmp_execute("migrate-set-parameters", {"max-bandwidth": 1 << 40, "downtime-limit": downtime_ms})
        await self.getfd(fd, "livefd")
        await self.qmp_execute("migrate", {"uri": "fd:livefd"})

    async def migration(self) -> dict[str, Any]:
        """QEMU's ``query-migrate`` answer."""
        return dict(await self.qmp_execute("query-migrate"))

    async def migrate_continue(self) -> None:
        """Past ``pre-switchover``: the last pages and the device state go."""
        await self.qmp_execute("migrate-continue", {"state": "pre-switchover"})

    async def abandon_migration(self, *, timeout: float = 10.0) -> None:
        """Cancel an outgoing migration under way, if any, and wait until it has ended
        (QEMU runs the guest again if it ran before; a guest stopped for the switchover
        is let go too). Shielded; never raises for a QEMU that is gone."""
        with trio.CancelScope(shield=True), trio.move_on_after(timeout), contextlib.suppress(MachineError):
            st = (await self.migration()).get("status")
            if st in (None, "none", "completed", "failed", "cancelled"):
                return
            await self.qmp_execute("migrate_cancel")
            while (await self.migration()).get("status") not in ("failed", "cancelled", "completed"):
                await trio.sleep(0.002)
            while await self.status() == "finish-migrate":
                await trio.sleep(0.002)

    # -- checkpoint steps ----------------------------------------------------------
    async def stage_disk(self, path: Path) -> StagedDisk:
        """Open a new overlay (read-write and read-only descriptors in a fresh fd set:
        QEMU picks by access mode when it reopens the layer read-only later) and add
        it as a block node no device uses yet. Undone on failure."""
        self._staged += 1
        staged = StagedDisk(node=f"ov{self._staged}", fdset=100 + self._staged)
        try:
            fds = [os.open(path, os.O_RDWR | os.O_CLOEXEC), os.open(path, os.O_RDONLY | os.O_CLOEXEC)]
        except OSError as exc:
            raise LaunchError(f"cannot open {path}: {exc.strerror}") from None
        added = False
        try:
            try:
                for fd, opaque in zip(fds, ("rw", "ro"), strict=True):
                    await self.add_fd(fd, staged.fdset, f"{staged.node}-{opaque}")
                    added = True
            finally:
                for fd in fds:
                    os.close(fd)
            await self.qmp_execute(
                "blockdev-add",
                {
                    "driver": "qcow2",
                    "node-name": staged.node,
                    "file": {"driver": "file", "filename": f"/dev/fdset/{staged.fdset}", "locking": "off"},
                    "backing": None,
                },
            )
        except BaseException:
            if added:
                with trio.CancelScope(shield=True), contextlib.suppress(MachineError):
                    await self.qmp_execute("remove-fd", {"fdset-id": staged.fdset})
            raise
        return staged

    async def unstage_disk(self, staged: StagedDisk) -> None:
        """Drop a staged overlay that was never switched to (best effort, shielded)."""
        with trio.CancelScope(shield=True):
            with contextlib.suppress(MachineError):
                await self.qmp_execute("blockdev-del", {"node-name": staged.node})
            with contextlib.suppress(MachineError):
                await self.qmp_execute("remove-fd", {"fdset-id": staged.fdset})

    async def switch_disk(self, staged: StagedDisk) -> None:
        """The disk device writes the staged overlay from now on, on top of the layer it
        wrote so far (reopened read-only). The guest must be paused.

        A failure does not say that nothing moved: QEMU may have done the switch and its
        answer been lost (the caller cancelled, or the answer came after the timeout), and
        an overlay QEMU writes must not be undone as one it never took. So after any
        failure QEMU is asked which node the device writes, and :attr:`disk_top` says
        it when this raises. A QEMU that cannot say is killed (the guest is paused: it
        never ran on either layer) and this raises :class:`MachineStateError`."""
        before = self._disk_top
        try:
            await self.qmp_execute("blockdev-snapshot", {"node": before, "overlay": staged.node})
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                top = await self._device_node({before, staged.node})
                if top is None:
                    log.warning("%s: blockdev-snapshot failed (%r), its outcome unknown: killed", self.name, exc)
                    await self._kill_and_reap()
            if top is None:
                raise MachineStateError(f"QMP blockdev-snapshot: {exc!r}; the disk's state unknown") from exc
            self._disk_top = top
            if top == staged.node:
                log.warning("%s: blockdev-snapshot answered %r, but QEMU did it", self.name, exc)
            raise
        self._disk_top = staged.node

    async def _device_node(self, candidates: set[str]) -> str | None:
        """Which of ``candidates`` a block device writes, as QEMU says now; None if it
        does not answer (within :data:`SETTLE_TIMEOUT`) or names none of them."""
        try:
            blocks = await self.qmp_execute("query-block", timeout=SETTLE_TIMEOUT)
        except MachineError:
            return None
        for b in blocks if isinstance(blocks, list) else []:
            node = (b.get("inserted") or {}).get("node-name") if isinstance(b, dict) else None
            if node in candidates:
                return str(node)
        return None

    async def merge_layers(self, count: int, backing_file: str, *, timeout: float = 600.0) -> None:
        """Merge the disk's ``count`` backing layers nearest its top (the launch's nodes
        ``layer0`` .. ``layer{count-1}``) into the top node while the guest runs
        (block-stream: every cluster they hold and the top does not is copied up); the
        top is then backed by ``layer{count}``, whose name ``backing_file`` is written into
        its header (QEMU knows it only as an fd set). The merged layers' nodes and fd sets
        go after (QEMU closes their files). A failure or cancellation cancels the job and
        leaves the graph as it was (the top may hold some of their clusters: the same data)."""
        job = f"merge-{os.urandom(6).hex()}"  # (unique in QEMU: an earlier supervisor's job may be left)
        args = {"job-id": job, "device": self._disk_top, "base-node": f"layer{count}", "backing-file": backing_file}
        await self.qmp_execute("block-stream", {**args, "auto-dismiss": False})
        done = False
        try:
            with trio.fail_after(timeout):
                while True:
                    state = await self._job(job)
                    if state.get("status") == "concluded":
                        break
                    await trio.sleep(MERGE_POLL)
            if state.get("error"):
                raise QMPCommandError(f"block-stream: {state['error']}")
            done = True
        except trio.TooSlowError:
            raise QMPCommandError(f"block-stream: not done within {timeout:g}s") from None
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(10), contextlib.suppress(MachineError):
                if not done:
                    with contextlib.suppress(MachineError):
                        await self.qmp_execute("job-cancel", {"id": job})
                    while (await self._job(job)).get("status") not in ("concluded", None):
                        await trio.sleep(MERGE_POLL)
                await self.qmp_execute("job-dismiss", {"id": job})
        for i in range(count):  # top first: a node goes before the one it stands on
            for what, cmd, arg in (
                ("node", "blockdev-del", {"node-name": f"layer{i}"}),
                ("node", "blockdev-del", {"node-name": f"layer{i}file"}),
                ("fd set", "remove-fd", {"fdset-id": LAYER_FDSET + i}),
            ):
                try:
                    await self.qmp_execute(cmd, arg)
                except QMPCommandError as exc:  # (no fd set when QEMU opened it by path)
                    log.info("%s: merged layer %d: its %s stays: %s", self.name, i, what, exc)

    async def _job(self, job: str) -> dict[str, Any]:
        """QEMU's state of block job ``job`` ({} once it is gone)."""
        jobs = await self.qmp_execute("query-jobs")
        return next((dict(j) for j in jobs if j.get("id") == job), {})

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[float]:
        """The guest paused for the block (yields when it stopped, monotonic); it runs
        again however the block ends, or this raises."""
        await self.qmp_execute("stop")
        t0 = time.monotonic()
        try:
            yield t0
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.qmp_execute("cont")
                except MachineError as exc:
                    log.warning("%s: cont after a pause failed: %s", self.name, exc)
                    raise

    # -- shutdown ladder ---------------------------------------------------------
    async def shutdown(
        self,
        ask: Callable[[], Awaitable[None]] | None = None,
        *,
        ask_timeout: float = 10.0,
        step_timeout: float = 3.0,
    ) -> int:
        """ask (guestd powers off) -> QMP quit -> SIGTERM -> SIGKILL; always reaped.
        Shielded: a cancelled caller still leaves no process behind."""
        with trio.CancelScope(shield=True):
            if self.proc is None or self.detached:
                return 0
            steps: list[tuple[str, Callable[[], Awaitable[None]], float]] = []
            if ask is not None:
                steps.append(("guest poweroff", ask, ask_timeout))
            steps.append(("QMP quit", self._quit, step_timeout))
            steps.append(("SIGTERM", self._term, step_timeout))
            for what, step, timeout in steps:
                if self.exited:
                    break
                with trio.move_on_after(timeout):
                    try:
                        await step()
                    except Exception as exc:
                        log.debug("%s: %s failed: %s", self.name, what, exc)
                    await self._exited.wait()
                if not self.exited:
                    log.info("%s: %s did not stop QEMU in %gs", self.name, what, timeout)
            await self._kill_and_reap()
        assert self.returncode is not None
        return self.returncode

    async def _quit(self) -> None:
        await self.qmp_execute("quit", timeout=2)

    async def _term(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
