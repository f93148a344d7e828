"""A fake guestd for fast unit tests: the guest channel protocol, in-process, in Trio.

:class:`FakeGuest` stands in for a booted VM running guestd. It serves Trio streams,
one per host connection (the guest end of ``trio.testing.memory_stream_pair()`` or of
a socketpair), and answers as guestd answers on its virtio-serial port: the same
frames and messages (:mod:`guestd.proto`), the same HOST_SYNC/GUEST_SYNC
resynchronisation, the same credit discipline, the same error codes and messages for
the same mistakes (it reuses guestd's ``errcode`` and ``ExecFailed``). Its state
(files, hostname, activity, clock, running processes) belongs to the guest, not to a
connection: a host that goes away and comes back (a new stream, HOST_SYNC, Hello)
finds its processes still running, as after a restore or a supervisor restart::

    host (actors.channel.guest.GuestChannel)              FakeGuest
      | HOST_SYNC, Hello --------------------->  | new session; the old one's requests are orphaned
      | <--------------- GUEST_SYNC, HelloOk     |   (their processes run on, output discarded)
      | Exec{rid} ---------------------------->  | FakeProcess: a Trio task running a command handler
      | <--------------------- ExecStarted{pid}  |
      | <----------- Data{ch} ... within credit  | a write at zero credit waits, like a full pipe
      | Credit{rid, ch, n} ------------------->  |
      | <------------ Eof{1}, Eof{2}, Exit{code} | Exit always last; 128+sig when killed

Use::

    async with fake_guest() as guest:                      # a running "VM"
        guest.files["/etc/motd"] = (0o644, b"hi\\n")
        async with open_channel(guest.connect()) as chan:  # the real host channel
            r = await chan.run(["sh", "-c", "cat /etc/motd; exit 3"])

        @guest.command("greet")                            # a test's own command
        async def greet(cmd: Command) -> int:
            await cmd.write(f"hello {cmd.argv[1]}\\n")
            return 0

        guest.hostile.silent_after_hello = True            # misbehave from the next hello on

Or start it in a nursery of your own: ``await nursery.start(guest.run)``. ``connect()``
gives a memory stream, ``connect_socket()`` a socketpair stream, ``serve(stream)``
serves one you made. ``power_off()`` is the VM dying; a Shutdown request does the same
after its Ok, and every stream then reads EOF.

Commands (by name, or as /bin/NAME, /usr/bin/NAME ...; ``guest.commands`` maps names to
handlers and takes your own): ``true``, ``false``, ``echo [-n]``, ``cat [FILE...]`` (no
FILE: stdin to stdout), ``sleep S`` (Trio time, so MockClock autojump works), ``head -c
N FILE`` (``/dev/zero``: a flood of N bytes within credit), ``sh -c SCRIPT``,
``hostname``, ``env``, ``pwd``, ``id [-u|-un]``, ``stty size``, ``ps``, ``kill [-SIG]
PID``, ``mkdir [-p]``, ``rm [-f] [-r]``, ``touch``. A missing command is guestd's
NOT_FOUND; ``Exec.timeout`` SIGKILLs the process group; Signal reaches the process
group (SIGKILL, SIGTERM, ... end it with ``128+sig``); Resize is recorded. SCRIPT is a
mini shell: simple commands joined by ``;``, newline, ``&&``, ``||`` and ``&``
(background, same process group), redirections ``> FILE``, ``>> FILE``, ``>&2``, and
``exit N``; words are split as by shlex; no variables, globs, pipes or subshells.

Trees, patches and mounts (protocol 2) work on the same model: ``read_tree`` streams a
real tar (tarfile, pax) of a directory's files, directories and symlinks (``guest.symlinks``:
path -> target; reads follow them, writes never do), ``write_tree`` unpacks one under
guestd's rules (the same name checks: absolute names, ``..``, names through a symlink,
devices and FIFOs, hard links outside the archive are INVALID_ARGUMENT, and nothing of
the archive is written then), ``patch`` applies its entries in order, ``mount``/``umount``
record mounts of the disks in ``guest.disks`` (device or ``serial:NAME`` -> read-only).
Owners given by write_file, write_tree and patch are recorded in ``guest.owners`` (path ->
(uid, gid)), resolved from the fake's user and group tables; modes with the file (or
``guest.dir_modes``).

Hostile modes (:class:`Hostile`, ``guest.hostile``, switchable at any time): go
silent (now or after the next hello), stop reading (deaf), ignore kills, flood frames
with unknown request ids, send data beyond credit, answer with the wrong message type,
close the stream mid-request, send any field of any message with a value of any type or
range (``tampered``), send garbage bytes after a hello.

Not modelled (a real VM is the proof of these): pipe buffers (stdin credit comes back
when the command reads it, and a killed process's unread output is lost, where guestd
still delivers what sits in the pipe); background children holding the exec's output
(theirs is discarded, so guestd's 200 ms drain grace never applies); a real TTY (output
gets ONLCR and stderr merged into stdout, but there is no echo, line discipline, job
control or ^C); users and groups beyond tables (users root, nobody; groups root, nogroup,
as Debian's; numeric ids) and permissions beyond the trees a test marks read-only
(``guest.readonly``: EROFS, so PERMISSION_DENIED); /proc, /sys and special files (a
write under /proc is NOT_FOUND, as guestd answers); symlinks anywhere but on reads;
write_file's visible temporary file; guestd's out-buffer limit (a host that stops
reading blocks the fake on a socketpair, or lets a memory stream grow); vsock; the
power-off sequence (sync, remount). Metrics are fixed, plausible numbers.

tests/unit/test_guest_contract.py runs the same protocol tests against this fake and guestd.
"""

from __future__ import annotations

import copy
import errno
import io
import posixpath
import shlex
import signal
import socket
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing

from guestd import proto
from guestd.agent import DEFAULT_PATH, ExecFailed, errcode
from guestd.fsops import PATCH_OPS
from guestd.tree import MAX_DEPTH

Handler = Callable[["Command"], Awaitable[int]]
"""A command: gets its :class:`Command` context, returns the exit status (0-255)."""
Sink = Callable[[bytes], Awaitable[None]]

BOOT_MARKS = {"init": 0.05, "modules": 0.1, "rootfs": 0.15, "python": 0.2, "ready": 0.25}
FEATURES = ["exec", "pty", "files", "metrics", "trees", "patch", "mount", "serial"]
FIRST_PID = 100
UNKNOWN_RID = 1 << 30  # rids of the flood: far above what a host hands out
_FHS = "/ /bin /dev /etc /home /root /run /sbin /tmp /var /usr /usr/bin /usr/sbin /usr/local /usr/local/bin"
DEFAULT_DIRS = frozenset([*_FHS.split(), "/usr/local/sbin"])  # no /proc, /sys: writes there are NOT_FOUND
USERS = {"root": (0, 0, "/root"), "nobody": (65534, 65534, "/nonexistent")}  # name -> uid, gid, home
GROUPS = {"root": 0, "nogroup": 65534}  # name -> gid, as Debian's /etc/group (no group is called "nobody")
_IGNORE_OR_STOP = "SIGCHLD SIGCONT SIGURG SIGWINCH SIGSTOP SIGTSTP SIGTTIN SIGTTOU"
NOT_FATAL = frozenset(int(getattr(signal, name)) for name in _IGNORE_OR_STOP.split())  # recorded, not acted on


class _FsError(Exception):
    """guestd's TreeError: a refused tree or patch (code, message)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@attrs.define
class Hostile:
    """Misbehaviours of a guest that is hostile from its first instruction. All off by
    default; flip them on a running guest at any time (they apply from the next frame)."""

    silent: bool = False  # send nothing at all; input is read and discarded (the host's sends never block)
    deaf: bool = False  # stop reading the stream: input backs up into the host's send buffers (a hung VM;
    # only a socketpair shows it, a memory stream buffers without bound)
    silent_after_hello: bool = False  # answer the next hello, then turn `silent`
    ignore_kills: bool = False  # signals and exec timeouts are recorded, never delivered
    flood_unknown_rids: int = 0  # before each answer, this many data frames for rids nobody opened
    overrun_credit: bool = False  # stream data (exec output, file contents) ignores the host's credit
    wrong_reply: bool = False  # answers have the wrong type (Pong for Ok/ExecStarted/FileInfo..., Ok for Pong)
    close_mid_request: bool = False  # on a request: exec/read_file send their first answer, then the
    # stream closes; other requests close it unanswered. The guest lives on (a host can reconnect).
    # tag -> field -> value: every message of that tag the guest sends has these values, any type,
    # any range (e.g. {"metrics_ok": {"mem": {"total": -1}}, "hello_ok": {"marks": {"init": nan}}})
    tampered: dict[str, dict[str, Any]] = attrs.Factory(dict)
    garbage_after_hello: bytes = b""  # raw bytes sent right after the next HelloOk (once)


# ---------------------------------------------------------------------------
# connections, sessions, requests (the shape of guestd's Conn, Session, Req)
# ---------------------------------------------------------------------------


def _tamper(msg: proto.Message, hostile: Hostile) -> proto.Message:
    """``msg`` with the fields ``hostile.tampered`` gives its tag (no type checks: the wire
    takes whatever msgpack packs)."""
    fields = hostile.tampered.get(msg.TAG)
    if not fields:
        return msg
    out = copy.copy(msg)
    for name, value in fields.items():
        object.__setattr__(out, name, value)
    if any(name not in {f for f, _, _ in msg._fields} for name in fields):  # an unknown key: on the wire too
        extra = {k: v for k, v in fields.items() if k not in {f for f, _, _ in msg._fields}}
        wire = out.to_wire
        object.__setattr__(out, "to_wire", lambda: wire() | extra)
    return out


class _Conn:
    """One host connection: frames in, frames out (under a lock, in order)."""

    def __init__(self, guest: FakeGuest, stream: trio.abc.Stream) -> None:
        self.guest = guest
        self.stream = stream
        self.decoder = proto.FrameDecoder()
        self.session: _Session | None = None
        self.syncing = True  # discarding input up to HOST_SYNC (at start, after a protocol error)
        self.closed = False
        self._lock = trio.Lock()

    async def send_raw(self, data: bytes) -> None:
        if self.closed or self.guest.hostile.silent or self.guest.off:
            return
        async with self._lock:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.hang_up()

    async def send(self, msg: proto.Message) -> None:
        await self.send_raw(proto.encode(_tamper(msg, self.guest.hostile)))

    def hang_up(self) -> None:
        """The host is gone (or we close on it): end the session, keep the processes."""
        self.closed = True
        if self.session is not None:
            self.session.close()
            self.session = None

    async def serve(self) -> None:
        try:
            while not self.closed:
                while self.guest.hostile.deaf and not self.closed:
                    await trio.sleep(0.05)
                try:
                    data = await self.stream.receive_some(1 << 16)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                if not data:
                    break
                if self.guest.hostile.silent:
                    continue
                self.decoder.feed(data)
                await self._drain()
        finally:
            self.hang_up()
            await trio.aclose_forcefully(self.stream)

    async def _drain(self) -> None:
        """guestd's Conn.on_readable: resync to HOST_SYNC, dispatch, resync again on an error."""
        while True:
            if self.syncing:
                if not self.decoder.resync(proto.HOST_SYNC):
                    return
                self.syncing = False
                if self.session is not None:  # a new host: the old one's requests are orphaned
                    self.session.close()
                    self.session = None
            try:
                for msg in self.decoder.messages():
                    await self.guest._dispatch(self, msg)
                    if self.closed or self.guest.hostile.silent:
                        return
                return
            except proto.ProtocolError as exc:
                # guestd logs this to the console and waits for the next host's sync marker
                self.guest.protocol_errors.append(str(exc))
                self.syncing = True


class _Session:
    """What one Hello started: the requests of one host connection."""

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.reqs: dict[int, _Req] = {}

    async def send(self, msg: proto.Message) -> None:
        await self.conn.send(msg)

    async def answer(self, msg: proto.Message) -> None:
        """The first (or final) answer of a request: where wrong_reply and the flood act."""
        hostile = self.conn.guest.hostile
        for i in range(hostile.flood_unknown_rids):
            await self.send(proto.Data(rid=UNKNOWN_RID + i, ch=proto.STDOUT, data=b"\0" * 1024))
        if hostile.wrong_reply:
            rid = getattr(msg, "rid", 0)
            msg = proto.Ok(rid=rid) if isinstance(msg, proto.Pong) else proto.Pong(rid=rid, activity=0, guest_ns=0)
        await self.send(msg)

    def close(self) -> None:
        for req in list(self.reqs.values()):
            req.orphan()
        self.reqs.clear()


class _Req:
    """A request with a life beyond its first answer (exec, file streams)."""

    def __init__(self, session: _Session, rid: int) -> None:
        self.session: _Session | None = session
        self.rid = rid
        self.changed = trio.Event()  # credit arrived, stdin arrived, or orphaned

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def send(self, msg: proto.Message) -> None:
        if self.session is not None:
            await self.session.send(msg)

    def finish(self) -> None:
        if self.session is not None:
            self.session.reqs.pop(self.rid, None)
            self.session = None

    def orphan(self) -> None:
        self.session = None
        self.wake()

    async def on_data(self, ch: int, data: bytes) -> None:
        raise proto.BadMessage("this request takes no data")

    async def on_eof(self, ch: int) -> None:
        raise proto.BadMessage("this request takes no eof")

    def on_credit(self, ch: int, n: int) -> None:
        raise proto.BadMessage("this request takes no credit")


class _ExecReq(_Req):
    def __init__(self, session: _Session, rid: int, proc: FakeProcess) -> None:
        super().__init__(session, rid)
        self.proc = proc
        self.credit = {proto.STDOUT: proto.WINDOW, proto.STDERR: proto.WINDOW}

    def on_credit(self, ch: int, n: int) -> None:
        if ch in self.credit:
            self.credit[ch] = min(self.credit[ch] + max(n, 0), 1 << 30)
        self.wake()

    async def on_data(self, ch: int, data: bytes) -> None:
        proc = self.proc
        if ch != proto.STDIN or proc.stdin_eof:
            raise proto.BadMessage("stdin data after eof or on a wrong channel")
        if len(proc.stdin_buf) + len(data) > proto.WINDOW:
            raise proto.BadMessage("stdin beyond granted credit")
        proc.stdin_buf += data
        self.wake()

    async def on_eof(self, ch: int) -> None:
        self.proc.stdin_eof = True
        self.wake()

    def orphan(self) -> None:
        self.proc.stdin_buf.clear()
        self.proc.stdin_eof = True
        self.proc.req = None
        super().orphan()

    async def write(self, ch: int, data: bytes) -> None:
        """Send ``data`` on ``ch`` within credit (waiting for it); discard it once orphaned."""
        view = memoryview(data)
        while view and self.session is not None:
            if self.credit[ch] <= 0 and not self.proc.guest.hostile.overrun_credit:
                await self.changed.wait()
                continue
            n = min(len(view), proto.CHUNK)
            if not self.proc.guest.hostile.overrun_credit:
                n = min(n, self.credit[ch])
            self.credit[ch] -= n
            await self.send(proto.Data(rid=self.rid, ch=ch, data=bytes(view[:n])))
            view = view[n:]


class _FileReadReq(_Req):
    """A file's contents (read_file), or a tree's tar stream (read_tree), within credit."""

    def __init__(self, session: _Session, rid: int, data: bytes) -> None:
        super().__init__(session, rid)
        self.data = data
        self.credit = proto.WINDOW

    def cancel(self) -> None:
        """A Signal from the host (leaving a read_tree early): guestd kills its worker."""
        self.finish()
        self.wake()

    def on_credit(self, ch: int, n: int) -> None:
        self.credit = min(self.credit + max(n, 0), 1 << 30)
        self.wake()

    async def run(self) -> None:
        view = memoryview(self.data)
        overrun = self.session is not None and self.session.conn.guest.hostile.overrun_credit
        while self.session is not None:
            if not view:
                await self.send(proto.Eof(rid=self.rid, ch=proto.STDOUT))
                self.finish()
                return
            if self.credit <= 0 and not overrun:
                await self.changed.wait()
                continue
            n = min(len(view), proto.CHUNK) if overrun else min(len(view), proto.CHUNK, self.credit)
            self.credit -= n
            await self.send(proto.Data(rid=self.rid, ch=proto.STDOUT, data=bytes(view[:n])))
            view = view[n:]


class _FileWriteReq(_Req):
    def __init__(
        self,
        session: _Session,
        rid: int,
        guest: FakeGuest,
        path: str,
        mode: int,
        owner: tuple[int, int] | None = None,
        *,
        tree: bool = False,
    ) -> None:
        super().__init__(session, rid)
        self.guest, self.path, self.mode, self.owner, self.tree = guest, path, mode, owner, tree
        self.buf = bytearray()

    async def on_data(self, ch: int, data: bytes) -> None:
        # like guestd: no credit check here; each chunk is credited back once "written"
        limit = proto.MAX_TREE_STREAM if self.tree else proto.MAX_FILE
        if len(self.buf) + len(data) > limit:
            await self.fail(proto.E_TOO_LARGE, f"{'tree' if self.tree else 'file'} exceeds {limit} bytes")
            return
        self.buf += data
        await self.send(proto.Credit(rid=self.rid, ch=proto.STDIN, n=len(data)))

    async def on_eof(self, ch: int) -> None:
        try:
            if self.tree:
                value = self.guest.unpack_tree(self.path, bytes(self.buf), self.owner)
            else:
                self.guest.store(self.path, bytes(self.buf), self.mode)
                if self.owner is not None:
                    self.guest.owners[self.path] = self.owner
                value = len(self.buf)
        except _FsError as exc:
            await self.fail(exc.code, exc.message)
            return
        except OSError as exc:
            await self.fail(errcode(exc), f"write {self.path}: {exc.strerror}")
            return
        if self.session is not None:
            await self.session.answer(proto.Ok(rid=self.rid, value=value))
        self.finish()

    async def fail(self, code: str, text: str) -> None:
        await self.send(proto.Error(rid=self.rid, code=code, message=text))
        self.finish()


# ---------------------------------------------------------------------------
# processes and commands
# ---------------------------------------------------------------------------


class FakeProcess:
    """A process in the fake guest: a Trio task running a command handler. Tests read
    its record (argv, env, cwd, user, tty, rows/cols, resizes, signals, exit)."""

    def __init__(
        self,
        guest: FakeGuest,
        pid: int,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: str,
        uid: int,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        stdin: bool = False,
        pgid: int = 0,
    ) -> None:
        self.guest = guest
        self.pid = pid
        self.pgid = pgid or pid
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.user = user
        self.uid = uid
        self.tty = tty
        self.rows, self.cols = rows, cols
        self.resizes: list[tuple[int, int]] = []
        self.signals: list[int] = []  # every signal sent to it, delivered or not
        self.ignored: set[int] = set()  # a handler may ignore signals (not SIGKILL, unless hostile)
        self.timed_out = False
        self.exit: proto.Exit | None = None
        self.exited = trio.Event()
        self.req: _ExecReq | None = None  # None: orphaned or background, output discarded
        self.stdin_buf = bytearray()
        self.stdin_eof = not stdin
        self._killed_by = 0
        self._scope = trio.CancelScope()

    @property
    def running(self) -> bool:
        return self.exit is None

    def __repr__(self) -> str:
        return f"<FakeProcess {self.pid} {shlex.join(self.argv)!r} exit={self.exit}>"

    # -- io (used by commands) --------------------------------------------------
    async def write(self, data: bytes, ch: int = proto.STDOUT) -> None:
        if self.tty:
            ch, data = proto.STDOUT, data.replace(b"\n", b"\r\n")  # one stream, ONLCR
        req = self.req
        if req is not None:
            await req.write(ch, data)
        await trio.lowlevel.checkpoint()

    async def read(self, n: int = proto.CHUNK) -> bytes:
        """Up to ``n`` bytes of stdin; b"" at EOF. Returns the credit to the host."""
        while not self.stdin_buf and not self.stdin_eof:
            req = self.req
            if req is None:
                break
            await req.changed.wait()
        data = bytes(self.stdin_buf[:n])
        del self.stdin_buf[:n]
        if data and self.req is not None:
            await self.req.send(proto.Credit(rid=self.req.rid, ch=proto.STDIN, n=len(data)))
        return data

    # -- signals -----------------------------------------------------------------
    def signal(self, signum: int) -> None:
        if self.exit is not None:
            return
        self.signals.append(signum)
        if signum == 0 or self.guest.hostile.ignore_kills or signum in NOT_FATAL:
            return
        if signum in self.ignored and signum != signal.SIGKILL:
            return
        self._killed_by = self._killed_by or signum
        self._scope.cancel()

    def signal_group(self, signum: int) -> None:
        """guestd's Proc.kill: killpg, and nothing once the leader has exited."""
        if self.exit is not None:
            return
        for p in list(self.guest.processes.values()):
            if p.pgid == self.pgid:
                p.signal(signum)

    def resize(self, rows: int, cols: int) -> None:
        if self.tty:
            self.resizes.append((rows, cols))
            self.rows, self.cols = rows, cols

    # -- life ------------------------------------------------------------------
    async def _timer(self, timeout: float) -> None:
        await trio.sleep(timeout)
        self.timed_out = True
        self.signal_group(signal.SIGKILL)

    async def _run(self, handler: Handler, timeout: float) -> None:
        code = 0
        async with trio.open_nursery() as nursery:
            if timeout > 0:
                nursery.start_soon(self._timer, timeout)
            with self._scope:
                code = await handler(Command(self, self.argv))
            nursery.cancel_scope.cancel()
        sig = self._killed_by
        self.exit = proto.Exit(
            rid=self.req.rid if self.req else 0,
            code=128 + sig if sig else code & 0xFF,
            signal=sig,
            timed_out=self.timed_out,
        )
        self.guest.processes.pop(self.pid, None)
        self.stdin_buf.clear()
        self.exited.set()
        req = self.req
        if req is not None:  # every stream's Eof, then Exit, as guestd (Exit ends the request)
            for ch in (proto.STDOUT,) if self.tty else (proto.STDOUT, proto.STDERR):
                await req.send(proto.Eof(rid=req.rid, ch=ch))
            await req.send(self.exit)
            req.finish()
            self.req = None


class Command:
    """What a command handler gets: its argv, its process and its (redirectable) stdio."""

    def __init__(self, proc: FakeProcess, argv: list[str], out: Sink | None = None, err: Sink | None = None) -> None:
        self.proc = proc
        self.argv = argv
        self._out = out or (lambda b: proc.write(b, proto.STDOUT))
        self._err = err or (lambda b: proc.write(b, proto.STDERR))

    @property
    def guest(self) -> FakeGuest:
        return self.proc.guest

    async def write(self, data: bytes | str) -> None:
        await self._out(data.encode() if isinstance(data, str) else data)

    async def error(self, data: bytes | str) -> None:
        await self._err(data.encode() if isinstance(data, str) else data)

    async def read(self, n: int = proto.CHUNK) -> bytes:
        return await self.proc.read(n)

    async def read_all(self) -> bytes:
        buf = bytearray()
        while chunk := await self.read():
            buf += chunk
        return bytes(buf)

    def with_stdio(self, argv: list[str], out: Sink | None = None, err: Sink | None = None) -> Command:
        return Command(self.proc, argv, out or self._out, err or self._err)


async def _true(cmd: Command) -> int:
    return 0


async def _false(cmd: Command) -> int:
    return 1


async def _echo(cmd: Command) -> int:
    args = cmd.argv[1:]
    newline = not (args and args[0] == "-n")
    await cmd.write(" ".join(args if newline else args[1:]) + ("\n" if newline else ""))
    return 0


async def _cat(cmd: Command) -> int:
    status = 0
    for name in cmd.argv[1:] or ["-"]:
        if name == "-":
            while data := await cmd.read():
                await cmd.write(data)
            continue
        try:
            await cmd.write(cmd.guest.load(cmd.guest.abspath(name, cmd.proc.cwd))[1])
        except OSError as exc:
            await cmd.error(f"cat: {name}: {exc.strerror}\n")
            status = 1
    return status


async def _sleep(cmd: Command) -> int:
    try:
        seconds = float(cmd.argv[1])
    except (IndexError, ValueError):
        await cmd.error("sleep: invalid time interval\n")
        return 1
    await trio.sleep(seconds)
    return 0


async def _head(cmd: Command) -> int:
    """``head -c N FILE``: FILE /dev/zero floods N bytes in CHUNK writes (each within credit)."""
    if len(cmd.argv) != 4 or cmd.argv[1] != "-c" or not cmd.argv[2].isdigit():
        await cmd.error("head: only head -c N FILE is simulated\n")
        return 1
    n, name = int(cmd.argv[2]), cmd.argv[3]
    if name == "/dev/zero":
        while n > 0:
            await cmd.write(b"\0" * min(n, proto.CHUNK))
            n -= proto.CHUNK
        return 0
    try:
        await cmd.write(cmd.guest.load(cmd.guest.abspath(name, cmd.proc.cwd))[1][:n])
    except OSError as exc:
        await cmd.error(f"head: cannot open '{name}' for reading: {exc.strerror}\n")
        return 1
    return 0


async def _hostname(cmd: Command) -> int:
    await cmd.write(cmd.guest.hostname + "\n")
    return 0


async def _env(cmd: Command) -> int:
    await cmd.write("".join(f"{k}={v}\n" for k, v in sorted(cmd.proc.env.items())))
    return 0


async def _pwd(cmd: Command) -> int:
    await cmd.write(cmd.proc.cwd + "\n")
    return 0


async def _id(cmd: Command) -> int:
    p = cmd.proc
    text = {"-u": str(p.uid), "-un": p.user}.get(" ".join(cmd.argv[1:]), f"uid={p.uid}({p.user})")
    await cmd.write(text + "\n")
    return 0


async def _stty(cmd: Command) -> int:
    if not cmd.proc.tty:
        await cmd.error("stty: 'standard input': Inappropriate ioctl for device\n")
        return 1
    await cmd.write(f"{cmd.proc.rows} {cmd.proc.cols}\n")
    return 0


async def _ps(cmd: Command) -> int:
    lines = [f"{p.pid} {shlex.join(p.argv)}\n" for p in sorted(cmd.guest.processes.values(), key=lambda p: p.pid)]
    await cmd.write("PID CMD\n" + "".join(lines))
    return 0


async def _kill(cmd: Command) -> int:
    args = cmd.argv[1:]
    signum = int(signal.SIGTERM)
    if len(args) > 1 and args[0].startswith("-"):  # kill -9 PID, kill -KILL PID, kill -SIGKILL PID
        spec = args.pop(0)[1:]
        signum = int(spec) if spec.isdigit() else int(getattr(signal, "SIG" + spec.removeprefix("SIG")))
    status = 0
    for arg in args:
        pid = int(arg)
        targets = [p for p in cmd.guest.processes.values() if (p.pgid == -pid if pid < 0 else p.pid == pid)]
        if not targets:
            await cmd.error(f"kill: ({arg}) - No such process\n")
            status = 1
        for p in targets:
            p.signal(signum)
    await trio.lowlevel.checkpoint()  # a signal to itself takes effect here
    return status


async def _mkdir(cmd: Command) -> int:
    parents = "-p" in cmd.argv
    status = 0
    for name in (a for a in cmd.argv[1:] if a != "-p"):
        try:
            cmd.guest.mkdir(cmd.guest.abspath(name, cmd.proc.cwd), parents=parents)
        except OSError as exc:
            await cmd.error(f"mkdir: cannot create directory '{name}': {exc.strerror}\n")
            status = 1
    return status


async def _rm(cmd: Command) -> int:
    flags = "".join(a[1:] for a in cmd.argv[1:] if a.startswith("-"))
    status = 0
    for name in (a for a in cmd.argv[1:] if not a.startswith("-")):
        try:
            cmd.guest.remove(cmd.guest.abspath(name, cmd.proc.cwd), recursive="r" in flags)
        except OSError as exc:
            if not ("f" in flags and exc.errno == errno.ENOENT):
                await cmd.error(f"rm: cannot remove '{name}': {exc.strerror}\n")
                status = 1
    return status


async def _touch(cmd: Command) -> int:
    status = 0
    for name in cmd.argv[1:]:
        path = cmd.guest.abspath(name, cmd.proc.cwd)
        try:
            if path not in cmd.guest.files:
                cmd.guest.store(path, b"", 0o644)
        except OSError as exc:
            await cmd.error(f"touch: cannot touch '{name}': {exc.strerror}\n")
            status = 1
    return status


class _ShellExit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


async def _sh(cmd: Command) -> int:
    """``sh -c SCRIPT``: the mini shell described in the module docstring."""
    if len(cmd.argv) < 3 or cmd.argv[1] != "-c":
        await cmd.error("sh: only sh -c SCRIPT is simulated\n")
        return 2
    lexer = shlex.shlex(cmd.argv[2], posix=True, punctuation_chars=";&|<>\n")
    lexer.whitespace, lexer.whitespace_split = " \t\r", True
    try:
        tokens = list(lexer)
    except ValueError as exc:  # unbalanced quotes
        await cmd.error(f"sh: 1: Syntax error: {exc}\n")
        return 2
    status = 0
    words: list[str] = []
    joiner = ";"  # the operator before the command in `words`
    try:
        for tok in [*tokens, ";"]:
            if tok not in (";", "\n", "&&", "||", "&"):
                words.append(tok)
                continue
            if words and (joiner in (";", "\n", "&") or (joiner == "&&") == (status == 0)):
                if tok == "&":
                    cmd.guest.spawn_background(cmd.proc, words)
                    status = 0
                else:
                    status = await _simple(cmd, words)
            words, joiner = [], tok
    except _ShellExit as exc:
        return exc.code
    return status


async def _simple(cmd: Command, words: list[str]) -> int:
    """One simple command of a script: redirections, then a builtin or a command."""
    argv: list[str] = []
    out: Sink | None = None
    it = iter(words)
    for w in it:
        if w not in (">", ">>", ">&"):
            argv.append(w)
            continue
        target = next(it, "")
        if w == ">&":
            if target != "2":
                await cmd.error(f"sh: 1: {target}: bad file descriptor\n")
                return 2
            out = cmd._err
            continue
        try:
            out = cmd.guest.open_sink(cmd.guest.abspath(target, cmd.proc.cwd), append=w == ">>")
        except OSError as exc:
            await cmd.error(f"sh: 1: cannot create {target}: {exc.strerror}\n")
            return 2
    if not argv:
        return 0
    if argv[0] == "exit":
        raise _ShellExit(int(argv[1]) & 0xFF if len(argv) > 1 and argv[1].isdigit() else 0)
    handler = cmd.guest.lookup(argv[0])
    if handler is None:
        await cmd.error(f"sh: 1: {argv[0]}: not found\n")
        return 127
    return await handler(cmd.with_stdio(argv, out)) & 0xFF


BUILTINS: dict[str, Handler] = {
    "true": _true,
    "false": _false,
    "echo": _echo,
    "cat": _cat,
    "sleep": _sleep,
    "head": _head,
    "sh": _sh,
    "hostname": _hostname,
    "env": _env,
    "pwd": _pwd,
    "id": _id,
    "stty": _stty,
    "ps": _ps,
    "kill": _kill,
    "mkdir": _mkdir,
    "rm": _rm,
    "touch": _touch,
}


# ---------------------------------------------------------------------------
# the guest
# ---------------------------------------------------------------------------


class FakeGuest:
    """A fake booted guest running guestd. State outlives connections; see the module doc."""

    def __init__(
        self,
        *,
        hostname: str = "sandbox",
        files: dict[str, tuple[int, bytes]] | None = None,
        commands: dict[str, Handler] | None = None,
        hostile: Hostile | None = None,
        setclock: bool = True,
        ncpu: int = 1,
        mem_total: int = 512 << 20,
        disks: dict[str, bool] | None = None,
    ) -> None:
        self.hostname = hostname
        self.files: dict[str, tuple[int, bytes]] = {}  # path -> (mode, contents)
        self.dirs: set[str] = set(DEFAULT_DIRS)
        self.readonly: set[str] = set()  # trees where writes fail with EROFS (a read-only mount)
        self.symlinks: dict[str, str] = {}  # path -> target (trees and patches make them; never followed)
        self.owners: dict[str, tuple[int, int]] = {}  # path -> (uid, gid), when a request gave an owner
        self.dir_modes: dict[str, int] = {}  # path -> mode, when a request gave one
        self.disks: dict[str, bool] = dict(disks or {})  # /dev/vdX or serial:NAME -> read-only
        self.mounts: dict[str, tuple[str, bool]] = {}  # mount point -> (device, read-only)
        for path, (mode, data) in (files or {}).items():  # preloaded: read-only trees too
            d = posixpath.dirname(path)
            while d not in self.dirs:
                self.dirs.add(d)
                d = posixpath.dirname(d)
            self.files[path] = (mode & 0o7777, bytes(data))
        self.commands: dict[str, Handler] = {**BUILTINS, **(commands or {})}
        self.users = dict(USERS)
        self.groups = dict(GROUPS)
        self.hostile = hostile or Hostile()
        self.setclock = setclock  # sandvisor.setclock=1: a hello's host_time_ns sets the clock
        self.ncpu = ncpu
        self.mem_total = mem_total
        # what happened (for tests to assert on)
        self.activity = 0
        self.hellos = 0
        self.connections = 0
        self.entropy: list[bytes] = []
        self.net_configs: list[proto.NetConfig] = []  # what net_config set, in order
        self.shapes: list[proto.Configure] = []  # what configure set (the workload shape), in order
        self.clock_offset_ns = 0  # guest realtime minus host realtime
        self.clock_sets: list[int] = []
        self.shutdowns: list[bool] = []  # the reboot flag of each Shutdown request
        self.protocol_errors: list[str] = []  # what guestd logs before resyncing (a re-hello on one stream too)
        self.processes: dict[int, FakeProcess] = {}  # running, by pid
        self.execs: list[FakeProcess] = []  # every process started, in order
        # set to an Event: exec_started waits for it (a slow answer, as guestd's under load);
        # the process exists meanwhile and later frames wait, as guestd's do
        self.hold_exec_started: trio.Event | None = None
        self.off = False
        self._next_pid = FIRST_PID
        self._t0 = 0.0
        self._powered_off: trio.Event | None = None
        self._nursery: trio.Nursery | None = None

    # -- lifecycle -----------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The VM's life: everything the guest runs lives in this task's nursery.
        Returns once powered off (a Shutdown request or :meth:`power_off`)."""
        self._powered_off = trio.Event()
        async with trio.open_nursery() as nursery:
            self._t0 = trio.current_time()
            self._nursery = nursery
            task_status.started()
            await self._powered_off.wait()
            nursery.cancel_scope.cancel()

    def power_off(self) -> None:
        """The VM is gone: no more frames, every process ends, every stream reads EOF."""
        self.off = True
        if self._powered_off is not None:
            self._powered_off.set()

    @property
    def nursery(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError("the fake guest is not running: await nursery.start(guest.run) first")
        if self.off:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "the fake guest is powered off")
        return self._nursery

    # -- connections -----------------------------------------------------------------
    def connect(self) -> trio.abc.Stream:
        """A new host connection over a memory stream; returns the host's end."""
        host, guest = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self.serve, guest)
        return host

    def connect_socket(self) -> trio.SocketStream:
        """A new host connection over a real socketpair (kernel buffers, backpressure)."""
        a, b = socket.socketpair()
        self.nursery.start_soon(self.serve, trio.SocketStream(trio.socket.from_stdlib_socket(b)))
        return trio.SocketStream(trio.socket.from_stdlib_socket(a))

    async def serve(self, stream: trio.abc.Stream) -> None:
        """Serve one host connection until either side closes it."""
        self.connections += 1
        await _Conn(self, stream).serve()

    # -- commands -----------------------------------------------------------------------
    def command(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator: register a command handler under ``name``."""

        def register(handler: Handler) -> Handler:
            self.commands[name] = handler
            return handler

        return register

    def lookup(self, name: str) -> Handler | None:
        if "/" in name:
            d, _, base = name.rpartition("/")
            return self.commands.get(base) if d in DEFAULT_PATH.split(":") else None
        return self.commands.get(name)

    def spawn_background(self, parent: FakeProcess, argv: list[str]) -> FakeProcess:
        """``cmd &`` in a script: same process group, output discarded, never awaited."""
        proc = self._new_process(argv, parent.env, parent.cwd, parent.user, parent.uid, pgid=parent.pgid)

        async def body(cmd: Command) -> int:
            return await _simple(cmd, argv)

        self.nursery.start_soon(proc._run, body, 0.0)
        return proc

    def _new_process(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        user: str,
        uid: int,
        *,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        stdin: bool = False,
        pgid: int = 0,
    ) -> FakeProcess:
        pid, self._next_pid = self._next_pid, self._next_pid + 1
        proc = FakeProcess(
            self, pid, argv, env=env, cwd=cwd, user=user, uid=uid, tty=tty, rows=rows, cols=cols, stdin=stdin, pgid=pgid
        )
        self.processes[pid] = proc
        self.execs.append(proc)
        return proc

    # -- the filesystem ---------------------------------------------------------------
    @staticmethod
    def abspath(path: str, cwd: str = "/") -> str:
        return posixpath.normpath(posixpath.join(cwd, path)).replace("//", "/")

    def _missing(self, path: str) -> OSError:
        parent = posixpath.dirname(path)
        while parent not in ("", "/"):
            if parent in self.files:
                return NotADirectoryError(errno.ENOTDIR, "Not a directory")
            parent = posixpath.dirname(parent)
        return FileNotFoundError(errno.ENOENT, "No such file or directory")

    def resolve(self, path: str) -> str:
        """``path`` with the symlinks among its components followed, as a read's open does
        (ELOOP past 40 of them)."""
        hops = 0
        parts = [p for p in path.split("/") if p]
        i = 0
        while i < len(parts):
            prefix = "/" + "/".join(parts[: i + 1])
            target = self.symlinks.get(prefix)
            if target is None:
                i += 1
                continue
            hops += 1
            if hops > 40:
                raise OSError(errno.ELOOP, "Too many levels of symbolic links")
            base = self.abspath(target, posixpath.dirname(prefix))
            parts = [p for p in base.split("/") if p] + parts[i + 1 :]
            i = 0
        return "/" + "/".join(parts)

    def load(self, path: str) -> tuple[int, bytes]:
        path = self.resolve(path)
        if path in self.dirs:
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
        if path not in self.files:
            raise self._missing(path)
        return self.files[path]

    def _check_writable(self, path: str) -> None:
        if any(path == r or path.startswith(r + "/") for r in self.readonly):
            raise PermissionError(errno.EROFS, "Read-only file system")

    def store(self, path: str, data: bytes, mode: int = 0o644) -> None:
        if path in self.dirs:
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
        if posixpath.dirname(path) not in self.dirs:
            raise self._missing(path)
        self._check_writable(path)
        self.files[path] = (mode & 0o7777, bytes(data))

    def mkdir(self, path: str, *, parents: bool = False) -> None:
        if path in self.dirs:
            if parents:
                return
            raise FileExistsError(errno.EEXIST, "File exists")
        if path in self.files:
            raise FileExistsError(errno.EEXIST, "File exists")
        parent = posixpath.dirname(path)
        if parent not in self.dirs:
            if not parents:
                raise self._missing(path)
            self.mkdir(parent, parents=True)
        self._check_writable(path)
        self.dirs.add(path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._check_writable(path)
        if path in self.files:
            del self.files[path]
        elif path in self.dirs and path != "/":
            if not recursive:
                raise IsADirectoryError(errno.EISDIR, "Is a directory")
            below = path + "/"
            self.files = {p: f for p, f in self.files.items() if not p.startswith(below)}
            self.dirs = {d for d in self.dirs if d != path and not d.startswith(below)}
        else:
            raise self._missing(path)

    def open_sink(self, path: str, *, append: bool) -> Sink:
        """A shell redirection target: truncated (or appended to) now, extended per write."""
        if path == "/dev/null":

            async def discard(_data: bytes) -> None:
                await trio.lowlevel.checkpoint()

            return discard
        mode, old = self.files.get(path, (0o644, b""))
        self.store(path, old if append else b"", mode)

        async def sink(data: bytes) -> None:
            mode, cur = self.files.get(path, (0o644, b""))
            self.store(path, cur + data, mode)
            await trio.lowlevel.checkpoint()

        return sink

    # -- clock and boot -------------------------------------------------------------
    def realtime_ns(self) -> int:
        return time.time_ns() + self.clock_offset_ns

    def _set_clock(self, ns: int) -> None:
        self.clock_sets.append(ns)
        self.clock_offset_ns = ns - time.time_ns()

    def uptime(self) -> float:
        return BOOT_MARKS["ready"] + trio.current_time() - self._t0

    # -- dispatch (guestd's Agent.dispatch and Agent.handle) ---------------------------
    async def _dispatch(self, conn: _Conn, msg: proto.Message) -> None:
        if isinstance(msg, proto.Hello):
            if conn.session is not None:
                conn.session.close()
            conn.session = _Session(conn)
            self.hellos += 1
            if msg.host_time_ns and self.setclock:
                self._set_clock(msg.host_time_ns)
            hello = proto.HelloOk(
                version=proto.PROTOCOL_VERSION,
                pid=1,
                boot_ns=int(BOOT_MARKS["python"] * 1e9),
                ready_ns=int(self.uptime() * 1e9),
                activity=self.activity,
                marks=dict(BOOT_MARKS),
                features=list(FEATURES),
            )
            await conn.send_raw(proto.GUEST_SYNC + proto.encode(_tamper(hello, self.hostile)))
            if self.hostile.garbage_after_hello:
                garbage, self.hostile.garbage_after_hello = self.hostile.garbage_after_hello, b""
                await conn.send_raw(garbage)
            if self.hostile.silent_after_hello:
                self.hostile.silent = True
            return
        session = conn.session
        if session is None:
            raise proto.BadMessage(f"{msg.TAG} before hello")
        rid = getattr(msg, "rid", None)
        try:
            await self._handle(session, msg)
        except proto.ProtocolError:
            raise
        except ExecFailed as exc:
            await session.send(proto.Error(rid=rid or 0, code=exc.code, message=exc.message))
        except LookupError as exc:
            await session.send(proto.Error(rid=rid or 0, code=proto.E_INVALID, message=str(exc.args[0])))
        except OSError as exc:
            await session.send(proto.Error(rid=rid or 0, code=errcode(exc), message=f"{exc.strerror}"))

    async def _handle(self, session: _Session, msg: proto.Message) -> None:
        if isinstance(msg, (proto.Data, proto.Eof, proto.Credit, proto.Resize, proto.Signal)):
            req = session.reqs.get(msg.rid)
            if req is None:
                return  # finished meanwhile: late stream traffic is harmless
            if isinstance(msg, proto.Data):
                await req.on_data(msg.ch, msg.data)
            elif isinstance(msg, proto.Eof):
                await req.on_eof(msg.ch)
            elif isinstance(msg, proto.Credit):
                req.on_credit(msg.ch, msg.n)
            elif isinstance(msg, proto.Resize) and isinstance(req, _ExecReq):
                req.proc.resize(msg.rows, msg.cols)
            elif isinstance(msg, proto.Signal) and isinstance(req, _ExecReq):
                req.proc.signal_group(msg.signum)
            elif isinstance(msg, proto.Signal) and isinstance(req, _FileReadReq):
                req.cancel()
            return
        rid: int = getattr(msg, "rid", 0)
        if rid in session.reqs:
            raise proto.BadMessage(f"request id {rid} already in use")
        if self.hostile.close_mid_request and not isinstance(msg, (proto.Exec, proto.ReadFile, proto.ReadTree)):
            session.conn.hang_up()
            await trio.aclose_forcefully(session.conn.stream)
            return
        if isinstance(msg, proto.Ping):
            await session.answer(proto.Pong(rid=rid, activity=self.activity, guest_ns=self.realtime_ns()))
        elif isinstance(msg, proto.Touch):
            self.activity += 1
            await session.answer(proto.Ok(rid=rid, activity=self.activity))
        elif isinstance(msg, proto.Exec):
            await self._exec(session, msg)
        elif isinstance(msg, proto.ReadFile):
            await self._read_file(session, msg)
        elif isinstance(msg, proto.WriteFile):
            await self._write_file(session, msg)
        elif isinstance(msg, proto.Metrics):
            await session.answer(self._metrics(rid))
        elif isinstance(msg, proto.SetClock):
            self._set_clock(msg.realtime_ns)
            await session.answer(proto.Ok(rid=rid))
        elif isinstance(msg, proto.AddEntropy):
            if len(msg.data) > 4096:
                raise LookupError("at most 4096 bytes of entropy at once")
            self.entropy.append(msg.data)
            await session.answer(proto.Ok(rid=rid))
        elif isinstance(msg, proto.SetHostname):
            if not msg.hostname or len(msg.hostname) > 64:
                raise LookupError("hostname must be 1-64 characters")
            self.hostname = msg.hostname
            await session.answer(proto.Ok(rid=rid))
        elif isinstance(msg, proto.ReadTree):
            await self._read_tree(session, msg)
        elif isinstance(msg, proto.WriteTree):
            await self._write_tree(session, msg)
        elif isinstance(msg, proto.Patch):
            try:
                n = self.apply_patch(msg.entries, msg.base)
            except _FsError as exc:
                await session.send(proto.Error(rid=rid, code=exc.code, message=exc.message))
                return
            await session.answer(proto.Ok(rid=rid, value=n))
        elif isinstance(msg, proto.Mount):
            self._mount(msg)
            await session.answer(proto.Ok(rid=rid))
        elif isinstance(msg, proto.Umount):
            if msg.path not in self.mounts:
                raise LookupError(f"{msg.path} is not a mount point")
            del self.mounts[msg.path]
            self.readonly.discard(msg.path)
            await session.answer(proto.Ok(rid=rid))
        elif isinstance(msg, proto.NetConfig):
            self.net_configs.append(msg)
            await session.answer(proto.Ok(rid=rid))
        elif isinstance(msg, proto.Configure):  # the workload shape: kept, as guestd/shape.py would apply it
            self.shapes.append(msg)
            await session.answer(proto.Ok(rid=rid))
        elif isinstance(msg, proto.Shutdown):
            self.shutdowns.append(msg.reboot)
            await session.answer(proto.Ok(rid=rid))
            self.power_off()  # a reboot too: the fake has no second boot
        else:
            raise proto.BadMessage(f"unexpected {msg.TAG} from host")

    def _resolve_user(self, spec: str) -> tuple[int, str, str]:
        """guestd's resolve_user, from a table: -> (uid, name, home)."""
        user, _, group = (spec or "root").partition(":")
        found = [(uid, name, home) for name, (uid, _gid, home) in self.users.items() if user in (name, str(uid))]
        if found:
            uid, name, home = found[0]
        elif user.isdigit():
            uid, name, home = int(user), user, "/"
        else:
            raise LookupError(f"unknown user {user!r}")
        if group and not group.isdigit() and group not in self.groups:
            raise LookupError(f"unknown group {group!r}")
        return uid, name, home

    async def _exec(self, session: _Session, msg: proto.Exec) -> None:
        self.activity += 1
        uid, name, home = self._resolve_user(msg.user)
        env = {"PATH": DEFAULT_PATH, "HOME": home, "USER": name, "LOGNAME": name, "HOSTNAME": self.hostname}
        if msg.tty:
            env["TERM"] = "xterm-256color"
        env.update(msg.env)
        cwd = msg.cwd or (home if home in self.dirs else "/")
        if not msg.argv:
            raise ExecFailed(proto.E_INVALID, "empty command")
        handler = self.lookup(msg.argv[0])
        if handler is None and "/" not in msg.argv[0]:
            raise ExecFailed(proto.E_NOT_FOUND, f"exec {msg.argv[0]!r}: executable file not found in $PATH")
        if cwd not in self.dirs:
            exc = self._missing(cwd) if cwd not in self.files else NotADirectoryError(errno.ENOTDIR, "Not a directory")
            raise ExecFailed(errcode(exc), f"chdir {cwd!r}: {exc.strerror}")
        if handler is None:
            raise ExecFailed(proto.E_NOT_FOUND, f"exec {msg.argv[0]!r}: No such file or directory")
        proc = self._new_process(
            list(msg.argv), env, cwd, name, uid, tty=msg.tty, rows=msg.rows, cols=msg.cols, stdin=msg.stdin
        )
        req = _ExecReq(session, msg.rid, proc)
        proc.req = req
        session.reqs[msg.rid] = req
        if self.hold_exec_started is not None:
            await self.hold_exec_started.wait()
        await session.answer(proto.ExecStarted(rid=msg.rid, pid=proc.pid))
        self.nursery.start_soon(proc._run, handler, msg.timeout)
        if self.hostile.close_mid_request:
            session.conn.hang_up()
            await trio.aclose_forcefully(session.conn.stream)

    async def _read_file(self, session: _Session, msg: proto.ReadFile) -> None:
        if not msg.path.startswith("/"):
            raise LookupError("path must be absolute")
        mode, data = self.load(self.abspath(msg.path))
        if len(data) > proto.MAX_FILE:
            await session.send(
                proto.Error(rid=msg.rid, code=proto.E_TOO_LARGE, message=f"{len(data)} bytes > {proto.MAX_FILE}")
            )
            return
        await session.answer(proto.FileInfo(rid=msg.rid, size=len(data), mode=mode))
        if self.hostile.close_mid_request:
            session.conn.hang_up()
            await trio.aclose_forcefully(session.conn.stream)
            return
        req = _FileReadReq(session, msg.rid, data)
        session.reqs[msg.rid] = req
        self.nursery.start_soon(req.run)

    async def _write_file(self, session: _Session, msg: proto.WriteFile) -> None:
        if not msg.path.startswith("/") or msg.path.endswith("/"):
            raise LookupError("path must be absolute and name a file")
        if msg.size > proto.MAX_FILE:
            await session.send(
                proto.Error(rid=msg.rid, code=proto.E_TOO_LARGE, message=f"{msg.size} bytes > {proto.MAX_FILE}")
            )
            return
        path = self.abspath(msg.path)
        if path in self.dirs:
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
        parent = posixpath.dirname(path)
        if parent not in self.dirs:
            raise FileNotFoundError(errno.ENOENT, f"No such directory: {parent}")
        owner = self._owner(msg.owner)
        self._check_writable(path)  # guestd's open of the temporary file fails here
        session.reqs[msg.rid] = _FileWriteReq(session, msg.rid, self, path, msg.mode & 0o7777, owner)

    def _owner(self, spec: str) -> tuple[int, int] | None:
        """An owner spec -> (uid, gid) by the fake's user table (guestd: the rootfs' files)."""
        if not spec:
            return None
        user, _, group = spec.partition(":")
        uid, _name, _home = self._resolve_user(spec)
        gid = next((g for n, (u, g, _h) in self.users.items() if n == user or str(u) == user), uid)
        if group:
            gid = int(group) if group.isdigit() else self.groups[group]
        return uid, gid

    # -- trees, patches, mounts -------------------------------------------------------
    def _below(self, root: str) -> tuple[list[str], list[str], list[str]]:
        pre = root.rstrip("/") + "/"
        dirs = sorted(d for d in self.dirs if d.startswith(pre))
        files = sorted(f for f in self.files if f.startswith(pre))
        links = sorted(x for x in self.symlinks if x.startswith(pre))
        return dirs, files, links

    def pack_tree(self, root: str) -> bytes:
        """A real tar of the model below ``root`` (owners from ``owners``, else root; mtime 0)."""
        out = io.BytesIO()
        pre = root.rstrip("/") + "/"

        def info(path: str, kind: bytes, mode: int) -> tarfile.TarInfo:
            ti = tarfile.TarInfo(path[len(pre) :] if path != root else ".")
            ti.type, ti.mode = kind, mode
            ti.uid, ti.gid = self.owners.get(path, (0, 0))
            return ti

        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
            tf.addfile(info(root, tarfile.DIRTYPE, self.dir_modes.get(root, 0o755)))
            dirs, files, links = self._below(root)
            for d in dirs:
                tf.addfile(info(d, tarfile.DIRTYPE, self.dir_modes.get(d, 0o755)))
            for f in files:
                mode, data = self.files[f]
                ti = info(f, tarfile.REGTYPE, mode)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            for link in links:
                ti = info(link, tarfile.SYMTYPE, 0o777)
                ti.linkname = self.symlinks[link]
                tf.addfile(ti)
        return out.getvalue()

    def unpack_tree(self, root: str, data: bytes, owner: tuple[int, int] | None) -> int:
        """guestd's unpack rules on the model: everything is checked before anything is
        written (guestd writes as it goes; what a refused archive left is not modelled)."""
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
                members = tf.getmembers()
                contents = {m.name: tf.extractfile(m).read() for m in members if m.isreg()}  # type: ignore[union-attr]
        except tarfile.TarError as exc:
            raise _FsError(proto.E_INVALID, f"malformed tar stream: {exc}") from None
        if len(members) > proto.MAX_TREE_ENTRIES:
            raise _FsError(proto.E_TOO_LARGE, f"the archive has more than {proto.MAX_TREE_ENTRIES} entries")
        plan: list[tuple[str, tarfile.TarInfo]] = []
        made: set[str] = set()
        files: set[str] = set()
        for m in members:
            if m.name.startswith("/"):
                raise _FsError(proto.E_INVALID, f"absolute name in the archive: {m.name[:200]!r}")
            parts = [p for p in m.name.split("/") if p not in ("", ".")]
            if ".." in parts:
                raise _FsError(proto.E_INVALID, f"'..' in an archive name: {m.name[:200]!r}")
            if len(parts) > MAX_DEPTH:
                raise _FsError(proto.E_INVALID, f"a name deeper than {MAX_DEPTH} levels")
            path = self._in(root, m.name)
            for i in range(1, len(parts)):
                prefix = posixpath.join(root, *parts[:i])
                if prefix in self.symlinks or prefix in made or prefix in self.files:
                    raise _FsError(proto.E_INVALID, f"{m.name}: {'/'.join(parts[:i])} is a symlink or not a directory")
            if m.ischr() or m.isblk() or m.isfifo():
                raise _FsError(proto.E_INVALID, f"{m.name}: device nodes and FIFOs are refused")
            if m.islnk() and self._in(root, m.linkname) not in files:
                raise _FsError(proto.E_INVALID, f"{m.name}: a hard link to {m.linkname!r}, not a file of this archive")
            if not (m.isdir() or m.isreg() or m.issym() or m.islnk()):
                raise _FsError(proto.E_INVALID, f"{m.name}: unsupported tar entry type {m.type!r}")
            if m.issym() or m.isreg() or m.islnk():
                if path in self.dirs:
                    raise _FsError(proto.E_IS_DIR, f"{m.name}: a directory is in the way")
                made.add(path)
            if m.isreg():
                files.add(path)
            plan.append((path, m))
        total = sum(m.size for _, m in plan if m.isreg())
        if total > proto.MAX_TREE:
            raise _FsError(proto.E_TOO_LARGE, f"the archive's files exceed {proto.MAX_TREE} bytes")
        self.mkdir(root, parents=True)
        for path, m in plan:
            d = posixpath.dirname(path)
            if d not in self.dirs and path != root:
                self.mkdir(d, parents=True)
            ids = owner or (m.uid, m.gid)
            if m.isdir():
                if path != root:
                    self.symlinks.pop(path, None)
                    self.files.pop(path, None)
                    self.mkdir(path, parents=True)
                self.dir_modes[path] = m.mode & 0o7777
            elif m.issym():
                self.files.pop(path, None)
                self.symlinks[path] = m.linkname
            elif m.isreg():
                self.symlinks.pop(path, None)
                self.store(path, contents[m.name], m.mode & 0o7777)
            else:  # a hard link: a copy here (the model has no inodes)
                self.symlinks.pop(path, None)
                mode, data = self.files[self._in(root, m.linkname)]
                self.store(path, data, mode)
            self.owners[path] = ids
        return len(plan)

    @staticmethod
    def _in(root: str, name: str) -> str:
        return posixpath.join(root, *[p for p in name.split("/") if p not in ("", ".")])

    def apply_patch(self, entries: list[dict[str, Any]], base: int = 0) -> int:
        for i, e in enumerate(entries):
            try:
                self._patch_one(e)
            except _FsError as exc:
                raise _FsError(exc.code, f"entry {base + i} ({str(e.get('path'))[:200]}): {exc.message}") from None
            except LookupError as exc:
                raise _FsError(proto.E_INVALID, f"entry {base + i} ({e.get('path')}): {exc.args[0]}") from None
            except OSError as exc:
                raise _FsError(errcode(exc), f"entry {base + i} ({e.get('path')}): {exc.strerror}") from None
        return len(entries)

    def _patch_one(self, e: dict[str, Any]) -> None:
        kinds = {"op": str, "path": str, "data": bytes, "target": str, "mode": int, "owner": str, "replace": bool}
        for key, kind in kinds.items():
            if key in e and type(e[key]) is not kind:
                raise _FsError(proto.E_INVALID, f"{key} must be {kind.__name__}")
        op, path = e.get("op", ""), e.get("path", "")
        data, mode, replace = e.get("data", b""), e.get("mode", -1), e.get("replace", False)
        if op not in PATCH_OPS:
            raise _FsError(proto.E_INVALID, f"op must be one of {', '.join(PATCH_OPS)}")
        if not path.startswith("/"):
            raise _FsError(proto.E_INVALID, "path must be absolute")
        if mode < -1 or mode > 0o7777:
            raise _FsError(proto.E_INVALID, "mode must be -1 or 0..0o7777")
        path = posixpath.normpath(path)
        if path == "/":
            raise _FsError(proto.E_INVALID, "the root directory cannot be patched")
        owner = self._owner(e.get("owner", ""))
        exists = path in self.files or path in self.dirs or path in self.symlinks
        if op == "remove":
            if path in self.dirs:
                self.remove(path, recursive=True)
            self.files.pop(path, None)
            self.symlinks.pop(path, None)
            return
        self.mkdir(posixpath.dirname(path), parents=True)
        if op == "mkdir":
            if exists and path not in self.dirs:
                raise _FsError(proto.E_EXISTS, "exists and is not a directory")
            self.mkdir(path, parents=True)
            if mode >= 0 or not exists:
                self.dir_modes[path] = 0o755 if mode < 0 else mode
        elif path in self.dirs:
            raise _FsError(proto.E_IS_DIR, "a directory is in the way")
        elif op in ("file", "symlink") and exists and not replace:
            raise _FsError(proto.E_EXISTS, "exists (replace is false)")
        elif op == "file":
            self.symlinks.pop(path, None)
            self.store(path, data, 0o644 if mode < 0 else mode)
        elif op == "symlink":
            if not e.get("target"):
                raise _FsError(proto.E_INVALID, "a symlink needs a target")
            self._check_writable(path)
            self.files.pop(path, None)
            self.symlinks[path] = e["target"]
        else:  # append
            if path in self.symlinks:
                raise _FsError(proto.E_INVALID, "Too many levels of symbolic links")
            old_mode, old = self.files.get(path, (0o644, b""))
            self.store(path, old + data, old_mode if mode < 0 else mode)
        if owner is not None:
            self.owners[path] = owner

    async def _read_tree(self, session: _Session, msg: proto.ReadTree) -> None:
        if not msg.path.startswith("/"):
            raise LookupError("path must be absolute")
        path = self.abspath(msg.path)
        if path not in self.dirs:
            if path in self.files:
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory")
            raise self._missing(path)
        data = self.pack_tree(path)
        await session.answer(proto.Ok(rid=msg.rid))
        if self.hostile.close_mid_request:
            session.conn.hang_up()
            await trio.aclose_forcefully(session.conn.stream)
            return
        req = _FileReadReq(session, msg.rid, data)
        session.reqs[msg.rid] = req
        self.nursery.start_soon(req.run)

    async def _write_tree(self, session: _Session, msg: proto.WriteTree) -> None:
        if not msg.path.startswith("/"):
            raise LookupError("path must be absolute")
        path = self.abspath(msg.path)
        if path in self.files:
            raise FileExistsError(errno.EEXIST, "File exists")
        owner = self._owner(msg.owner)
        self._check_writable(path)
        session.reqs[msg.rid] = _FileWriteReq(session, msg.rid, self, path, 0, owner, tree=True)

    def _mount(self, msg: proto.Mount) -> None:
        if not msg.path.startswith("/") or posixpath.normpath(msg.path) == "/":
            raise LookupError("mount path must be absolute and not /")
        if msg.device not in self.disks:
            what = f"no disk with serial {msg.device[7:]!r}" if msg.device.startswith("serial:") else msg.device
            raise ExecFailed(proto.E_NOT_FOUND, what)
        if self.disks[msg.device] and not msg.read_only:
            raise ExecFailed(proto.E_PERM, f"{msg.device} is attached read-only; mount it read-only")
        path = posixpath.normpath(msg.path)
        if path in self.mounts:
            raise ExecFailed(proto.E_EXISTS, f"{path} is a mount point already")
        self.mkdir(path, parents=True)
        self.mounts[path] = (msg.device, msg.read_only)
        if msg.read_only:
            self.readonly.add(path)

    def _metrics(self, rid: int) -> proto.MetricsOk:
        up = self.uptime()
        return proto.MetricsOk(
            rid=rid,
            uptime=up,
            cpu_seconds={"user": up / 10, "nice": 0.0, "system": up / 20, "idle": up * self.ncpu * 0.85}
            | {"iowait": 0.0, "irq": 0.0, "softirq": 0.0, "steal": 0.0},
            ncpu=self.ncpu,
            mem={"total": self.mem_total, "available": self.mem_total * 3 // 4, "free": self.mem_total // 2}
            | {"buffers": 0, "cached": self.mem_total // 8},
            disk={"read_bytes": 4 << 20, "write_bytes": 0, "reads": 256, "writes": 0},
            net={"rx_bytes": 0, "tx_bytes": 0, "rx_packets": 0, "tx_packets": 0},
            load=["0.00", "0.00", "0.00"],
            procs=self._next_pid - 1,
        )


@asynccontextmanager
async def fake_guest(**kw: Any) -> AsyncIterator[FakeGuest]:
    """A running :class:`FakeGuest` (keyword arguments as its constructor's); powered off on exit."""
    guest = FakeGuest(**kw)
    async with trio.open_nursery() as nursery:
        await nursery.start(guest.run)
        try:
            yield guest
        finally:
            guest.power_off()
