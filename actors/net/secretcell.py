"""A sandbox's secret proxy, confined (docs/secrets.md, "The proxy's cell").

The supervisor keeps what needs privilege and parses nothing the guest chose::

    ProxyCell (a task of the sandbox's life: actors/sandboxes/secrets.py)
      listener on the gateway (in the host network namespace), one per sandbox
      accept -> peer must be the guest; original destination from conntrack
                (SO_ORIGINAL_DST); the upstream TCP connection opened here with the
                sandbox's mark (so the nft output hook judges it by the sandbox's own
                egress chain: SO_MARK needs CAP_NET_ADMIN, which the proxy has not)
             -> both sockets to the proxy over SCM_RIGHTS (actors/secrets/wire.py), closed here
      control channel: the sandbox's secrets and CA down (at start, after every vault
                change), ``blocked`` reports up (validated, rate-limited)
      the proxy process (actors/secrets/proxyproc.py): in a cell like a tool's
        (actors/cells/toolcell.py): an id of the jail range, no capabilities,
        no_new_privs, new mount/pid/ipc/uts/cgroup namespaces seeing /usr, Python and
        the package read-only and nothing else (no state dir, no /etc), an empty
        network namespace, rlimits, a cgroup (memory, pids); killed and reaped when the
        task ends (stop, crash, cancel, supervisor exit), started again if it dies

Without a jailer (``serve --no-jail``, or not root) it is a plain child process: the
same channel and code, no confinement (like QEMU then).
"""

from __future__ import annotations

import array
import contextlib
import errno
import logging
import os
import resource
import socket
import struct
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any, Protocol

import trio

from actors.cells import jail
from actors.cells.cell import Cells
from actors.cells.cgroups import Cgroup, CgroupError, CgroupLimits
from actors.cells.identities import JailError
from actors.net.netns import NetNS
from actors.secrets import wire

log = logging.getLogger("sandvisor.secrets")

SO_ORIGINAL_DST = 80
CONNECT_TIMEOUT = 20.0
MAX_PENDING = 256  # accepted connections waiting for their upstream connect (more: closed)
MEMORY_MIB = 256  # the proxy's cgroup
PIDS = 32
NOFILE = 2048  # two per connection
RESPAWN_DELAY = 1.0
EVENTS_PER_SECOND = 5.0  # blocked reports repeated (burst EVENTS_BURST), more are dropped
EVENTS_BURST = 20
STDERR_LINES = 200  # of the proxy's stderr logged per process


class _Proc(Protocol):
    pid: int

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


def python_binds(exclude: list[Path]) -> tuple[list[jail.Bind], str, str]:
    """What the proxy's Python needs, read-only: the interpreter's prefix, the package's
    directory and the import path (minus anything holding ``exclude``: the state and
    run dirs). (binds, the interpreter, PYTHONPATH)."""
    pkg = Path(__file__).resolve().parents[2]  # the directory holding the actors package
    paths = [pkg, *(Path(p).resolve() for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p))]
    paths = list(dict.fromkeys(paths))
    ex = [e.resolve() for e in exclude]
    paths = [p for p in paths if not any(e == p or p in e.parents for e in ex)]
    exe = os.path.realpath(sys.executable)
    dirs = {Path(sys.base_prefix).resolve(), *paths}
    outer = sorted(d for d in dirs if not any(o in d.parents for o in dirs) and Path("/usr") not in (d, *d.parents))
    binds = [jail.Bind(d, str(d)) for d in outer]
    return binds, exe, ":".join(str(p) for p in paths)


def original_destination(sock: socket.socket) -> tuple[str, int] | None:
    try:
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return None
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(addr), port


class ProxyCell:
    """``await nursery.start(cell.run)`` -> the port it listens on. ``push()`` after a
    change of what ``config()`` returns."""

    def __init__(
        self,
        name: str,
        *,
        listen: IPv4Address,
        guest: IPv4Address,
        mark: int,
        netns: NetNS,
        config: Callable[[], dict[str, Any]],
        names: Callable[[], set[str]],
        blocked: Callable[[str, str, int], None],
        cells: Cells | None,
        exclude: list[Path],
    ) -> None:
        self.name = name
        self.listen = listen
        self.guest = guest
        self.mark = mark
        self.netns = netns
        self.config = config
        self.names = names
        self.blocked = blocked
        self.cells = cells
        self.exclude = exclude
        self.port = 0
        self.gen = 0
        self.pid = 0  # the running proxy's (0: none)
        self.spawned = 0
        self.stats = {"accepted": 0, "refused": 0, "upstream_failed": 0, "events_dropped": 0}
        self._wake = trio.Event()
        self._conns: trio.socket.SocketType | None = None
        self._pending = 0
        self._tokens = float(EVENTS_BURST)
        self._last = time.monotonic()

    def push(self) -> None:
        """What config() returns changed: the proxy gets it, and every connection
        accepted from now on waits for it there."""
        self.gen += 1
        self._wake.set()

    async def run(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        raw = self.netns.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        raw.bind((str(self.listen), 0))
        raw.listen(128)
        self.port = raw.getsockname()[1]
        listener = trio.socket.from_stdlib_socket(raw)
        with listener:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._accept, listener, nursery)
                first = True
                while True:
                    async with self._proxy() as (proc, control):
                        if first:
                            task_status.started(self.port)
                            first = False
                        rc = await self._supervise(proc, control)
                    log.error("%s: the secret proxy exited (%s); starting it again", self.name, rc)
                    await trio.sleep(RESPAWN_DELAY)

    # -- the process ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _proxy(self) -> AsyncIterator[tuple[_Proc, trio.socket.SocketType]]:
        control, control_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        conns, conns_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = (control_child.fileno(), conns_child.fileno())
        cleanup: list[Callable[[], None]] = []
        try:
            with control_child, conns_child:
                proc, stderr = await self._spawn(fds, cleanup)
            self.spawned += 1
            self.pid = proc.pid
            ctl = trio.socket.from_stdlib_socket(control)
            self._conns = trio.socket.from_stdlib_socket(conns)
            try:
                async with trio.open_nursery() as nursery:
                    if stderr is not None:
                        nursery.start_soon(self._drain, stderr)
                    try:
                        yield proc, ctl
                    finally:
                        nursery.cancel_scope.cancel()
            finally:
                self._conns = None
                self.pid = 0
                with trio.CancelScope(shield=True):
                    with contextlib.suppress(ProcessLookupError, OSError):
                        proc.kill()
                    await proc.wait()
        finally:
            control.close()
            conns.close()
            with trio.CancelScope(shield=True):
                for undo in reversed(cleanup):
                    try:
                        await trio.to_thread.run_sync(undo)
                    except (JailError, CgroupError, OSError) as exc:
                        log.warning("%s: secret proxy cell: %s", self.name, exc)

    async def _spawn(
        self, fds: tuple[int, int], cleanup: list[Callable[[], None]]
    ) -> tuple[_Proc, trio.abc.ReceiveStream | None]:
        binds, exe, pythonpath = python_binds(self.exclude)
        argv = [exe, "-S", "-B", "-m", "actors.secrets.proxyproc", *map(str, fds)]
        env = {"PYTHONPATH": pythonpath, "LANG": "C.UTF-8", "HOME": "/run", "TMPDIR": "/run"}
        cells = self.cells
        if cells is None or cells.tools is None:
            p = await trio.lowlevel.open_process(
                argv, pass_fds=fds, env={**env, "TMPDIR": os.environ.get("TMPDIR", "/tmp")}, stderr=-1
            )
            return p, p.stderr
        ident = cells.allocator.allocate(f"secret proxy {self.name}")
        cleanup.append(lambda: cells.allocator.release(ident))
        assert cells.tools is not None
        name = f"tool-{os.getpid()}-secrets-{uuid.uuid4().hex[:8]}"  # (ToolCells._sweep takes stale ones)
        spec = jail.JailSpec(
            identity=ident,
            root=cells.tools.dir / name,
            binds=(*jail.default_binds(), *binds),
            socket_dir="/run",  # its own (0700): HOME, TMPDIR (leaf certificates pass a file there)
            netns=jail.NetNS.NEW,  # empty: its only network is the sockets it is handed
            loopback=False,
            hostname="sandvisor-secrets",
            rlimits=jail.Rlimits(nofile=NOFILE, nproc=PIDS, core=0, extra=((resource.RLIMIT_FSIZE, 1 << 20),)),
        )
        await trio.to_thread.run_sync(jail.build_jail, spec)
        cleanup.append(lambda: jail.remove_jail(spec.root))
        cgroup: Cgroup | None = None
        if cells.cgroups is not None:
            cgroup = cells.cgroups.create(name, CgroupLimits(memory_bytes=MEMORY_MIB << 20, pids=PIDS))
            cleanup.append(cgroup.remove)
            cleanup.append(cgroup.kill_all)
        proc = await jail.spawn(
            argv,
            spec,
            pass_fds=fds,
            cgroup_procs=cgroup.procs_files() if cgroup is not None else (),
            env=env,
            helper=cells.helper,
        )
        return proc, proc.stderr

    async def _drain(self, stderr: trio.abc.ReceiveStream) -> None:
        """The proxy's stderr (untrusted: lines cut, a bounded number logged)."""
        buf, lines = b"", 0
        async with stderr:
            while chunk := await stderr.receive_some(65536):
                buf += chunk
                *done, buf = buf.split(b"\n")
                buf = buf[-4096:]
                for line in done:
                    lines += 1
                    if lines <= STDERR_LINES:
                        log.warning("%s: %s", self.name, line[:300].decode(errors="replace"))

    async def _supervise(self, proc: _Proc, control: trio.socket.SocketType) -> int:
        """Config down, reports up, until the process exits (-> its status)."""
        async with trio.open_nursery() as nursery:

            async def down() -> None:
                while True:
                    self._wake = trio.Event()
                    data = wire.frame({**self.config(), "t": "config", "gen": self.gen})
                    while data:
                        n = await control.send(data)
                        data = data[n:]
                    await self._wake.wait()

            async def up() -> None:
                frames = wire.Frames(wire.UP_MAX)
                try:
                    while data := await control.recv(4096):
                        for msg in frames.feed(data):
                            self._report(msg)
                except wire.WireError as exc:
                    log.error("%s: the secret proxy broke its channel (%s): killed", self.name, exc)
                    proc.kill()
                except OSError:
                    pass

            nursery.start_soon(down)
            nursery.start_soon(up)
            rc = await proc.wait()
            nursery.cancel_scope.cancel()
        return rc

    def _report(self, msg: dict[str, Any]) -> None:
        now = time.monotonic()
        self._tokens = min(EVENTS_BURST, self._tokens + (now - self._last) * EVENTS_PER_SECOND)
        self._last = now
        event = wire.blocked_event(msg, self.names())
        if event is None or self._tokens < 1:
            self.stats["events_dropped"] += 1
            return
        self._tokens -= 1
        self.blocked(*event)

    # -- connections ----------------------------------------------------------------------
    async def _accept(self, listener: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        while True:
            try:
                sock, peer = await listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    await trio.sleep(0.1)
                    continue
                raise
            dst = original_destination(sock)  # type: ignore[arg-type]
            if (
                self._pending >= MAX_PENDING
                or self._conns is None
                or peer[0] != str(self.guest)
                or dst is None
                or (dst[0] == str(self.listen) and dst[1] == self.port)
            ):
                self.stats["refused"] += 1
                log.info(
                    "%s: connection from %s to %s refused (pending %d, proxy %s)",
                    self.name,
                    peer,
                    dst,
                    self._pending,
                    self._conns is not None,
                )
                sock.close()
                continue
            self.stats["accepted"] += 1
            self._pending += 1
            nursery.start_soon(self._hand_over, sock, dst, self.gen)

    async def _hand_over(self, sock: trio.socket.SocketType, dst: tuple[str, int], gen: int) -> None:
        up: trio.socket.SocketType | None = None
        err = ""
        try:
            try:
                up = trio.socket.from_stdlib_socket(self.netns.socket())
                up.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, self.mark)
                with trio.fail_after(CONNECT_TIMEOUT):
                    await up.connect(dst)
            except (OSError, trio.TooSlowError) as exc:
                self.stats["upstream_failed"] += 1
                err = "timed out" if isinstance(exc, trio.TooSlowError) else (exc.strerror or type(exc).__name__)
                if up is not None:
                    up.close()
                    up = None
            conns = self._conns
            if conns is None:
                return
            fds = [sock.fileno()] + ([up.fileno()] if up is not None else [])
            head = wire.frame({"gen": gen, "dst": list(dst), "err": err})[wire.HEADER.size :]
            try:
                await conns.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            except OSError as exc:
                log.warning("%s: a connection could not be handed to the proxy: %s", self.name, exc)
        finally:
            self._pending -= 1
            sock.close()
            if up is not None:
                up.close()
