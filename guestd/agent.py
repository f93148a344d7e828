"""guestd: the in-guest agent. Runs as PID 1 of the microVM (stdlib + msgpack only).

Boot: the initramfs ``/init`` (busybox sh) mounts /proc, /sys, /dev, loads the
virtio modules, mounts the user's root filesystem at /sysroot (with /proc,
/sys, /dev, /dev/pts, /tmp, /run inside it) and execs Python on this module.
guestd then opens the channel port, keeps a handle on the initramfs root and
chroots into /sysroot, so every process it starts and every file it touches
sees the user's root filesystem as ``/``. guestd's own Python never lives in
the user's root filesystem: a rootfs without Python works.

One single-threaded epoll loop serves everything: the virtio-serial port (and
AF_VSOCK connections where the guest has a vsock transport), child process
pipes and PTYs, SIGCHLD (PID 1 reaps every zombie), timers. Every byte stream
is flow-controlled by credit (see proto.py): a flooding process is simply not
read while its stream has no credit, so neither side buffers without bound.
"""

from __future__ import annotations

import _signal as signal  # the C module: 'signal' pulls in enum (~20 ms of boot)
import errno
import fcntl
import os
import select
import struct
import sys
import time

from guestd import proto as P

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~30 ms of boot

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable
    from typing import Any

T_START = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
ROOT_FD = -1  # the initramfs root, kept open across the chroot

SYSROOT = "/sysroot"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PORT_NAME = "sandvisor.0"
VSOCK_PORT = 1024
# A port whose host went away sits in epoll edge-triggered: the driver wakes the port's
# wait queue when the host reconnects (VIRTIO_CONSOLE_PORT_OPEN) and that edge brings
# it back at once. (A 10 ms poll did before: ~5 ms of every reconnect, and a Python
# wakeup every 10 ms of an idle guest with no host.) This is only the safety net.
AWAY_POLL = 1.0
MAX_OUTBUF = 8 * 1024 * 1024  # a host that stops reading this long is dropped
DRAIN_GRACE = 0.2  # after exit, wait this long for background holders of the pipes
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
# the two tty ioctls guestd needs (asm-generic/ioctls.h: x86 and arm64 alike); the
# termios module is a shared object in lib-dynload: ~5 ms of boot to dlopen under TCG
TIOCSCTTY = 0x540E
TIOCSWINSZ = 0x5414
_WINSZ = struct.Struct("HHHH")

EPOLLIN, EPOLLOUT = select.EPOLLIN, select.EPOLLOUT
EPOLLERR, EPOLLHUP, EPOLLET = select.EPOLLERR, select.EPOLLHUP, select.EPOLLET


def now() -> float:
    return time.monotonic()


def log(text: str) -> None:
    """Diagnostics go to the serial console; never raise."""
    try:
        fd = os.open("/dev/console", os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            os.write(fd, f"guestd: {text}\n".encode(errors="replace"))
        finally:
            os.close(fd)
    except OSError:
        pass


errcode = P.errcode  # (moved to proto: guestd.tree and the host's tree unpacking use it too)


def set_nonblock(fd: int) -> None:
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)


# ---------------------------------------------------------------------------
# users
# ---------------------------------------------------------------------------


def _read_db(path: str) -> list[list[str]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n").split(":") for line in f if line.strip() and not line.startswith("#")]
    except OSError:
        return []


_USER_CACHE: dict[str, tuple[tuple[int, ...], tuple[int, int, list[int], str, str]]] = {}


def _db_stamp() -> tuple[int, ...]:
    st = []
    for path in ("/etc/passwd", "/etc/group"):
        try:
            s = os.stat(path)
            st += [s.st_ino, s.st_size, s.st_mtime_ns]
        except OSError:
            st += [0, 0, 0]
    return tuple(st)


def resolve_user(spec: str) -> tuple[int, int, list[int], str, str]:
    """``name``, ``uid`` or ``uid:gid`` -> (uid, gid, groups, home, name), from the rootfs'
    files. Cached per spec while both files are unchanged (two stats instead of reading
    and parsing both files on every exec)."""
    if not spec:
        spec = "root"
    stamp = _db_stamp()
    hit = _USER_CACHE.get(spec)
    if hit is not None and hit[0] == stamp:
        uid, gid, groups, home, name = hit[1]
        return uid, gid, list(groups), home, name
    found = _resolve_user(spec)
    if len(_USER_CACHE) > 64:
        _USER_CACHE.clear()
    _USER_CACHE[spec] = (stamp, found)
    return found


def _resolve_user(spec: str) -> tuple[int, int, list[int], str, str]:
    user, _, group = spec.partition(":")
    passwd = _read_db("/etc/passwd")
    entry = None
    for row in passwd:
        if len(row) >= 7 and (row[0] == user or (user.isdigit() and row[2] == user)):
            entry = row
            break
    if entry is not None:
        name, uid, gid, home = entry[0], int(entry[2]), int(entry[3]), entry[5] or "/"
    elif user.isdigit():
        name, uid, gid, home = user, int(user), int(user), "/"
    elif user == "root":
        name, uid, gid, home = "root", 0, 0, "/root"
    else:
        raise LookupError(f"unknown user {user!r}")
    groups_db = _read_db("/etc/group")
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            for row in groups_db:
                if len(row) >= 3 and row[0] == group:
                    gid = int(row[2])
                    break
            else:
                raise LookupError(f"unknown group {group!r}")
    groups = {gid}
    for row in groups_db:
        if len(row) >= 4 and name in row[3].split(","):
            try:
                groups.add(int(row[2]))
            except ValueError:
                pass
    return uid, gid, sorted(groups), home, name


# ---------------------------------------------------------------------------
# connections (the host side of a session)
# ---------------------------------------------------------------------------


class Conn:
    """One host connection: a framed, non-blocking byte pipe with a bounded out-buffer."""

    def __init__(self, agent: Agent, fd: int, kind: str) -> None:
        self.agent = agent
        self.fd = fd
        self.kind = kind  # "port" (persistent fd, host comes and goes) or "vsock"
        self.decoder = P.FrameDecoder()
        self.out = bytearray()
        self.session: Session | None = None
        self.away = False
        self.stalled = False  # some stream declined to read because we were congested
        self.syncing = True  # discarding input up to HOST_SYNC (at start, after an error)
        self.discarded = 0

    def send(self, msg: P.Message) -> None:
        if self.away:
            return
        self.out += P.encode(msg)
        if len(self.out) > MAX_OUTBUF:
            log(f"{self.kind}: host is not reading; dropping the session")
            self.drop()
            return
        # written once per turn of the event loop, not once per message: an exec's
        # eof, eof and exit (or exec_started and its first output) leave in one write,
        # one virtio transfer and one wakeup of the host's reader
        self.agent.dirty.add(self)

    def flush(self) -> None:
        while self.out and not self.away:
            try:
                n = os.write(self.fd, self.out[: 1 << 20])
            except BlockingIOError:
                break
            except OSError:
                self.drop()
                return
            del self.out[:n]
        self.agent.update_conn(self)

    @property
    def congested(self) -> bool:
        return len(self.out) > P.WINDOW

    def on_readable(self) -> None:
        try:
            data = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.drop()
            return
        self.decoder.feed(data)
        while True:
            if self.syncing:
                if not self.decoder.resync(P.HOST_SYNC):
                    self.discarded += len(data)
                    if self.discarded > P.MAX_RESYNC and self.kind != "port":
                        self.drop()
                    return
                self.syncing = False
                self.discarded = 0
                self.reset_session()
            try:
                for msg in self.decoder.messages():
                    self.agent.dispatch(self, msg)
                    if self.away:
                        return
                return
            except P.ProtocolError as exc:
                # lost the frame boundary (a host that reconnected mid-frame, or garbage):
                # wait for the next host's sync marker; the buffered bytes are searched too
                log(f"{self.kind}: protocol error from host: {exc}; resynchronising")
                self.syncing = True
                data = b""

    def reset_session(self) -> None:
        """A new host (after HOST_SYNC): stale output of the old one must not reach it."""
        if self.session is not None:
            self.session.close()
            self.session = None
        self.out.clear()

    def drop(self) -> None:
        """The host went away (or misbehaved): end the session, keep the processes."""
        self.agent.dirty.discard(self)
        if self.session is not None:
            self.session.close()
            self.session = None
        self.out.clear()
        self.decoder.reset()
        self.syncing = True
        if self.kind == "port":
            self.away = True  # the port fd stays open; poll for the host's return
            self.agent.update_conn(self)
        else:
            self.agent.remove_conn(self)


class Session:
    """What one Hello started: the requests of one host connection."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.reqs: dict[int, Req] = {}

    def send(self, msg: P.Message) -> None:
        self.conn.send(msg)

    def close(self) -> None:
        for req in list(self.reqs.values()):
            req.orphan()
        self.reqs.clear()


class Req:
    """A request with a life beyond its first answer (exec, file streams)."""

    def __init__(self, session: Session, rid: int) -> None:
        self.session: Session | None = session
        self.rid = rid

    def send(self, msg: P.Message) -> None:
        if self.session is not None:
            self.session.send(msg)

    def finish(self) -> None:
        if self.session is not None:
            self.session.reqs.pop(self.rid, None)
            self.session = None

    def orphan(self) -> None:
        self.session = None

    def on_data(self, ch: int, data: bytes) -> None:
        raise P.BadMessage("this request takes no data")

    def on_eof(self, ch: int) -> None:
        raise P.BadMessage("this request takes no eof")

    def on_credit(self, ch: int, n: int) -> None:
        raise P.BadMessage("this request takes no credit")


# ---------------------------------------------------------------------------
# exec
# ---------------------------------------------------------------------------


class OutStream:
    def __init__(self, proc: Proc, ch: int, fd: int) -> None:
        self.proc, self.ch, self.fd = proc, ch, fd
        self.credit = P.WINDOW
        self.open = True


class Proc(Req):
    def __init__(self, agent: Agent, session: Session, msg: P.Exec) -> None:
        super().__init__(session, msg.rid)
        self.agent = agent
        self.tty = msg.tty
        self.pid = 0
        self.status: int | None = None
        self.exited_at = 0.0
        self.timed_out = False
        self.deadline = now() + msg.timeout if msg.timeout > 0 else 0.0
        self.outs: list[OutStream] = []
        self.stdin_fd = -1
        self.stdin_buf = bytearray()
        self.stdin_eof = False
        self.stdin_received = 0
        self.done = False

    # -- start ---------------------------------------------------------------
    def start(self, msg: P.Exec) -> None:
        uid, gid, groups, home, name = resolve_user(msg.user)
        env = {"PATH": DEFAULT_PATH, "HOME": home, "USER": name, "LOGNAME": name, "HOSTNAME": self.agent.hostname}
        if msg.tty:
            env["TERM"] = "xterm-256color"
        env.update(msg.env)
        cwd = msg.cwd or (home if os.path.isdir(home) else "/")
        child_fds: list[int] = []
        if msg.tty:
            master, slave = os.openpty()
            fcntl.ioctl(master, TIOCSWINSZ, _WINSZ.pack(msg.rows, msg.cols, 0, 0))
            stdio = (slave, slave, slave)
            child_fds.append(slave)
            set_nonblock(master)
            self.outs.append(OutStream(self, P.STDOUT, master))
            if msg.stdin:
                self.stdin_fd = master
            else:
                self.stdin_eof = True
        else:
            if msg.stdin:
                rin, win = os.pipe()
                set_nonblock(win)
                self.stdin_fd = win
                child_fds.append(rin)
            else:
                rin = os.open("/dev/null", os.O_RDONLY)
                child_fds.append(rin)
                self.stdin_eof = True
            rout, wout = os.pipe()
            rerr, werr = os.pipe()
            child_fds += [wout, werr]
            for fd in (rout, rerr):
                set_nonblock(fd)
            self.outs += [OutStream(self, P.STDOUT, rout), OutStream(self, P.STDERR, rerr)]
            stdio = (rin, wout, werr)
        try:
            self.pid = spawn(msg.argv, env, cwd, uid, gid, groups, stdio, msg.tty)
        except BaseException:
            for s in self.outs:
                os.close(s.fd)
            if self.stdin_fd >= 0 and not msg.tty:
                os.close(self.stdin_fd)
            self.outs, self.stdin_fd = [], -1
            raise
        finally:
            for fd in child_fds:
                os.close(fd)
        self.agent.procs[self.pid] = self
        for s in self.outs:
            self.agent.watch(s.fd, EPOLLIN, self.on_out_event(s))
        if self.stdin_fd >= 0 and not msg.tty:
            self.agent.watch(self.stdin_fd, 0, self.on_stdin_writable)
        self.update()

    # -- output --------------------------------------------------------------
    def on_out_event(self, s: OutStream) -> Callable[[int], None]:
        def handler(ev: int) -> None:
            if ev & EPOLLOUT:
                self.write_stdin()
            if ev & ~EPOLLOUT:
                self.read_out(s)

        return handler

    def read_out(self, s: OutStream) -> None:
        if not s.open:
            return
        want = P.CHUNK if self.session is None else min(P.CHUNK, s.credit)
        if want <= 0:
            return
        try:
            data = os.read(s.fd, want)
        except BlockingIOError:
            return
        except OSError:  # EIO on a PTY master once every slave is closed
            data = b""
        if not data:
            self.close_out(s)
            return
        if self.session is not None:
            s.credit -= len(data)
            self.send(P.Data(rid=self.rid, ch=s.ch, data=data))
        self.update()

    def close_out(self, s: OutStream) -> None:
        if not s.open:
            return
        s.open = False
        if s.fd == self.stdin_fd:  # PTY master doubles as stdin
            self.stdin_fd = -1
        self.agent.unwatch(s.fd)
        os.close(s.fd)
        self.send(P.Eof(rid=self.rid, ch=s.ch))
        self.maybe_finish()

    def on_credit(self, ch: int, n: int) -> None:
        for s in self.outs:
            if s.ch == ch:
                s.credit = min(s.credit + max(n, 0), 1 << 30)
        self.update()

    # -- input ---------------------------------------------------------------
    def on_data(self, ch: int, data: bytes) -> None:
        if ch != P.STDIN or self.stdin_eof:
            raise P.BadMessage("stdin data after eof or on a wrong channel")
        self.stdin_received += len(data)
        if len(self.stdin_buf) + len(data) > P.WINDOW:
            raise P.BadMessage("stdin beyond granted credit")
        if self.stdin_fd < 0:  # process already closed its input: drop, but keep crediting
            self.send(P.Credit(rid=self.rid, ch=P.STDIN, n=len(data)))
            return
        self.stdin_buf += data
        self.write_stdin()

    def on_eof(self, ch: int) -> None:
        self.stdin_eof = True
        self.write_stdin()

    def on_stdin_writable(self, _ev: int) -> None:
        self.write_stdin()

    def write_stdin(self) -> None:
        fd = self.stdin_fd
        if fd < 0:
            self.stdin_buf.clear()
            return
        written = 0
        while self.stdin_buf:
            try:
                n = os.write(fd, self.stdin_buf[: P.CHUNK])
            except BlockingIOError:
                break
            except OSError:  # EPIPE: the process closed stdin
                self.stdin_buf.clear()
                break
            del self.stdin_buf[:n]
            written += n
        if written:
            self.send(P.Credit(rid=self.rid, ch=P.STDIN, n=written))
        if not self.stdin_buf and self.stdin_eof:
            if self.tty:
                try:
                    os.write(fd, b"\x04")  # ^D: end of input for the line discipline
                except OSError:
                    pass
            else:
                self.agent.unwatch(fd)
                os.close(fd)
            self.stdin_fd = -1
        self.update()

    # -- control -------------------------------------------------------------
    def resize(self, rows: int, cols: int) -> None:
        if self.tty and self.outs and self.outs[0].open:
            fcntl.ioctl(self.outs[0].fd, TIOCSWINSZ, _WINSZ.pack(rows, cols, 0, 0))

    def kill(self, signum: int) -> None:
        if self.status is not None:
            return
        try:
            os.killpg(self.pid, signum)
        except OSError:
            try:
                os.kill(self.pid, signum)
            except OSError:
                pass

    def on_exit(self, status: int) -> None:
        self.status = status
        self.exited_at = now()
        self.maybe_finish()
        if not self.done:
            self.update()  # arms the drain timer for pipes held by background children

    def tick(self, t: float) -> None:
        if self.deadline and self.status is None and t >= self.deadline:
            self.timed_out = True
            self.deadline = 0.0
            self.kill(signal.SIGKILL)
        if self.status is not None and t - self.exited_at >= DRAIN_GRACE:
            # The process is gone but something (a background child) still holds
            # its pipes: send what is buffered now, then stop waiting for EOF.
            for s in self.outs:
                while s.open and self.readable(s):
                    try:
                        data = os.read(s.fd, P.CHUNK if self.session is None else min(P.CHUNK, s.credit))
                    except BlockingIOError:
                        self.close_out(s)
                        break
                    except OSError:
                        data = b""
                    if not data:
                        self.close_out(s)
                        break
                    if self.session is not None:
                        s.credit -= len(data)
                        self.send(P.Data(rid=self.rid, ch=s.ch, data=data))

    def next_deadline(self) -> float:
        d = self.deadline or float("inf")
        if self.status is not None and any(s.open and self.readable(s) for s in self.outs):
            d = min(d, self.exited_at + DRAIN_GRACE)
        return d

    def maybe_finish(self) -> None:
        if self.done or self.status is None or any(s.open for s in self.outs):
            return
        self.done = True
        st = self.status
        if os.WIFSIGNALED(st):
            sig = os.WTERMSIG(st)
            code = 128 + sig
        else:
            sig, code = 0, os.WEXITSTATUS(st)
        if self.stdin_fd >= 0:
            self.agent.unwatch(self.stdin_fd)
            os.close(self.stdin_fd)
            self.stdin_fd = -1
        self.send(P.Exit(rid=self.rid, code=code, signal=sig, timed_out=self.timed_out))
        self.finish()
        self.agent.procs.pop(self.pid, None)
        self.agent.timers.discard(self)

    def orphan(self) -> None:
        super().orphan()
        self.stdin_buf.clear()
        self.stdin_eof = True
        if self.stdin_fd >= 0 and not self.tty:
            self.agent.unwatch(self.stdin_fd)
            os.close(self.stdin_fd)
            self.stdin_fd = -1
        self.update()

    def readable(self, s: OutStream) -> bool:
        if self.session is None:
            return True
        if self.session.conn.congested:
            self.session.conn.stalled = True
            return False
        return s.credit > 0

    def update(self) -> None:
        """Re-arm epoll interest: read only streams with credit and a host that keeps up."""
        for s in self.outs:
            if s.open:
                mask = EPOLLIN if self.readable(s) else 0
                if self.tty and self.stdin_buf:
                    mask |= EPOLLOUT
                self.agent.modify(s.fd, mask)
        if self.stdin_fd >= 0 and not self.tty:
            self.agent.modify(self.stdin_fd, EPOLLOUT if self.stdin_buf else 0)
        if self.deadline or self.status is not None:
            self.agent.timers.add(self)


def which(name: str, env: dict[str, str]) -> str:
    """Resolve argv[0] on the command's own PATH (not guestd's), like execvp would."""
    if "/" in name:
        return name
    for d in env.get("PATH", DEFAULT_PATH).split(":"):
        p = f"{d or '.'}/{name}"
        if os.access(p, os.X_OK) and not os.path.isdir(p):
            return p
    raise ExecFailed(P.E_NOT_FOUND, f"exec {name!r}: executable file not found in $PATH")


_SIGDEF = (signal.SIGPIPE, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def spawn(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    uid: int,
    gid: int,
    groups: list[int],
    stdio: tuple[int, int, int],
    tty: bool,
) -> int:
    """Start a process. Root without a TTY (the common case) goes through posix_spawn,
    which glibc implements with CLONE_VFORK: no copy of guestd's page tables, a few ms
    less per exec under TCG. Anything needing setuid or a controlling TTY forks."""
    if not argv:
        raise ExecFailed(P.E_INVALID, "empty command")
    path = which(argv[0], env)
    if uid == 0 and gid == 0 and not tty:
        try:
            os.chdir(cwd)  # single-threaded: the child inherits it; we go back at once
        except OSError as exc:
            raise ExecFailed(errcode(exc), f"chdir {cwd!r}: {exc.strerror}") from None
        try:
            return os.posix_spawn(
                path,
                argv,
                env,
                file_actions=[(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(stdio)],
                setsid=True,
                setsigdef=_SIGDEF,
                setsigmask=(),
            )
        except OSError as exc:
            raise ExecFailed(errcode(exc), f"exec {argv[0]!r}: {exc.strerror}") from None
        finally:
            os.chdir("/")
    return fork_exec(path, argv, env, cwd, uid, gid, groups, stdio, tty)


def fork_exec(
    path: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    uid: int,
    gid: int,
    groups: list[int],
    stdio: tuple[int, int, int],
    tty: bool,
) -> int:
    """fork + exec with a close-on-exec error pipe, like subprocess without its import cost."""
    rerr, werr = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        stage = "exec"
        try:
            os.close(rerr)
            for sig in _SIGDEF:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            os.setsid()
            for i, fd in enumerate(stdio):
                os.dup2(fd, i)
            if tty:
                fcntl.ioctl(0, TIOCSCTTY, 0)
            stage = "chdir"
            os.chdir(cwd)
            stage = "setuid"
            if groups:
                os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            os.umask(0o022)
            stage = "exec"
            os.execve(path, argv, env)
        except BaseException as exc:
            code = errcode(exc) if isinstance(exc, OSError) else P.E_INVALID
            target = cwd if stage == "chdir" else argv[0]
            what = f"{stage} {target!r}: {exc.strerror if isinstance(exc, OSError) else exc}"
            try:
                os.write(werr, f"{code}\0{what}".encode(errors="replace"))
            except BaseException:
                pass
        os._exit(127)
    os.close(werr)
    chunks = []
    while True:
        d = os.read(rerr, 4096)
        if not d:
            break
        chunks.append(d)
    os.close(rerr)
    if chunks:
        os.waitpid(pid, 0)
        code, _, what = b"".join(chunks).decode(errors="replace").partition("\0")
        raise ExecFailed(code, what)
    return pid


class ExecFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ---------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------


class FileReader(Req):
    def __init__(self, agent: Agent, session: Session, rid: int, fd: int, size: int) -> None:
        super().__init__(session, rid)
        self.agent, self.fd, self.left, self.credit = agent, fd, size, P.WINDOW

    def on_credit(self, ch: int, n: int) -> None:
        self.credit = min(self.credit + max(n, 0), 1 << 30)
        self.agent.runnable.add(self)

    def run(self) -> None:
        """Send what credit allows, one chunk per loop turn, so others get served."""
        if self.session is None:
            self.close()
            return
        if self.session.conn.congested:
            self.session.conn.stalled = True  # rescheduled once the connection drains
            return
        if self.credit <= 0:
            return  # rescheduled by the host's next credit
        data = os.read(self.fd, min(P.CHUNK, self.credit, max(self.left, 0) or P.CHUNK))
        if not data or self.left <= 0:
            self.send(P.Eof(rid=self.rid, ch=P.STDOUT))
            self.close()
            return
        self.left -= len(data)
        self.credit -= len(data)
        self.send(P.Data(rid=self.rid, ch=P.STDOUT, data=data))
        self.agent.runnable.add(self)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.finish()

    def orphan(self) -> None:
        super().orphan()
        self.close()


class FileWriter(Req):
    def __init__(
        self, session: Session, rid: int, fd: int, path: str, tmp: str, mode: int, ids: tuple[int, int] | None = None
    ) -> None:
        super().__init__(session, rid)
        self.fd, self.path, self.tmp, self.mode, self.size = fd, path, tmp, mode, 0
        self.ids = ids

    def on_data(self, ch: int, data: bytes) -> None:
        self.size += len(data)
        if self.size > P.MAX_FILE:
            self.fail(P.E_TOO_LARGE, f"file exceeds {P.MAX_FILE} bytes")
            return
        try:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as exc:
            self.fail(errcode(exc), f"write {self.path}: {exc.strerror}")
            return
        self.send(P.Credit(rid=self.rid, ch=P.STDIN, n=len(data)))

    def on_eof(self, ch: int) -> None:
        try:
            if self.ids is not None:
                os.fchown(self.fd, *self.ids)  # before the mode: chown clears setuid bits
            os.fchmod(self.fd, self.mode)
            os.close(self.fd)
            self.fd = -1
            os.rename(self.tmp, self.path)
        except OSError as exc:
            self.fail(errcode(exc), f"write {self.path}: {exc.strerror}")
            return
        self.send(P.Ok(rid=self.rid, value=self.size))
        self.finish()

    def fail(self, code: str, text: str) -> None:
        self.send(P.Error(rid=self.rid, code=code, message=text))
        self.discard()
        self.finish()

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.tmp)
            except OSError:
                pass

    def orphan(self) -> None:
        super().orphan()
        self.discard()


# ---------------------------------------------------------------------------
# workers: trees, patches, mounts
# ---------------------------------------------------------------------------

F_SETPIPE_SZ = 1031
BLKFLSBUF = 0x1261
PIPE_SIZE = 1 << 20  # a worker's data pipe: fewer wakeups of both sides per MiB of tar


class Worker(Req):
    """A request served by a forked child of guestd: work that blocks or takes long
    (tar packing and unpacking, patches, mounts) runs outside PID 1's event loop,
    which goes on serving every other request meanwhile. The child is guestd's own
    image (no exec, nothing to load but what the work imports, e.g. tarfile, which
    PID 1 itself never pays for), holding only its pipes::

        guestd (event loop)                          worker (fork, blocking I/O)
          data pipe <-- tar (read_tree) ------------  pack(dir) -> write
          data pipe --- tar (write_tree) ---------->  unpack(read) -> files
          status pipe <-- b"OK\0value" | b"CODE\0message", then exit

    The data streams follow the exec rules: output is read only while the host has
    granted credit (the child blocks in write meanwhile), input is credited back as
    the pipe takes it. The answer (Eof or Ok, or Error) is sent once the child
    exited and its output is drained. A tree worker whose host went away (or
    cancelled it with Signal) is killed; a patch or mount worker finishes its work."""

    def __init__(self, agent: Agent, session: Session, rid: int) -> None:
        super().__init__(session, rid)
        self.agent = agent
        self.pid = 0
        self.status_fd = -1
        self.out_fd = -1  # the child's output, to the host on STDOUT (read_tree)
        self.in_fd = -1  # the host's STDIN data, to the child (write_tree)
        self.credit = P.WINDOW
        self.in_buf = bytearray()
        self.in_eof = False
        self.status: int | None = None
        self.killable = False
        self.streams_out = False  # success ends the output stream (Eof), else it is an Ok
        self.on_ok: Callable[[int], None] | None = None
        self.done = False

    def start(
        self,
        work: Callable[[int], int],
        *,
        out: bool = False,
        inp: bool = False,
        keep: tuple[int, ...] = (),
        killable: bool = False,
        first: P.Message | None = None,
    ) -> None:
        fds: list[int] = []
        try:
            status_r, status_w = os.pipe()
            fds += [status_r, status_w]
            child_end = -1
            if out or inp:
                r, w = os.pipe()
                fds += [r, w]
                try:
                    fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_SIZE)
                except OSError:
                    pass
                mine, child_end = (r, w) if out else (w, r)
            pid = os.fork()
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if pid == 0:
            _worker_child(work, child_end, status_w, (*keep, self.agent.root_fd))
        os.close(status_w)
        if child_end >= 0:
            os.close(child_end)
            set_nonblock(mine)
        self.pid, self.status_fd, self.killable = pid, status_r, killable
        self.agent.procs[pid] = self
        assert self.session is not None
        self.session.reqs[self.rid] = self
        if first is not None:
            self.send(first)
        if out:
            self.out_fd = mine
            self.streams_out = True
            self.agent.watch(mine, EPOLLIN, self.on_out)
        elif inp:
            self.in_fd = mine
            self.agent.watch(mine, 0, self.on_writable)
        self.update()

    # -- output (read_tree) ------------------------------------------------------
    def readable(self) -> bool:
        if self.session is None:
            return True  # orphaned: drain and discard
        if self.session.conn.congested:
            self.session.conn.stalled = True
            return False
        return self.credit > 0

    def on_out(self, _ev: int) -> None:
        if self.out_fd < 0:
            return
        want = P.CHUNK if self.session is None else min(P.CHUNK, self.credit)
        if want <= 0:
            self.update()
            return
        try:
            data = os.read(self.out_fd, want)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.agent.unwatch(self.out_fd)
            os.close(self.out_fd)
            self.out_fd = -1
            self.maybe_finish()
            return
        if self.session is not None:
            self.credit -= len(data)
            self.send(P.Data(rid=self.rid, ch=P.STDOUT, data=data))
        self.update()

    def on_credit(self, ch: int, n: int) -> None:
        if ch == P.STDOUT:
            self.credit = min(self.credit + max(n, 0), 1 << 30)
            self.update()

    # -- input (write_tree) ----------------------------------------------------------
    def on_data(self, ch: int, data: bytes) -> None:
        if ch != P.STDIN or self.in_eof:
            raise P.BadMessage("data after eof or on a wrong channel")
        if len(self.in_buf) + len(data) > P.WINDOW:
            raise P.BadMessage("data beyond granted credit")
        if self.in_fd < 0:  # the child stopped reading (it failed: its answer is coming)
            self.send(P.Credit(rid=self.rid, ch=P.STDIN, n=len(data)))
            return
        self.in_buf += data
        self.write_in()

    def on_eof(self, ch: int) -> None:
        self.in_eof = True
        self.write_in()

    def on_writable(self, _ev: int) -> None:
        self.write_in()

    def write_in(self) -> None:
        written = 0
        while self.in_buf and self.in_fd >= 0:
            try:
                n = os.write(self.in_fd, self.in_buf[: 4 * P.CHUNK])
            except BlockingIOError:
                break
            except OSError:  # EPIPE: the child is gone
                written += len(self.in_buf)
                self.in_buf.clear()
                self.close_in()
                break
            del self.in_buf[:n]
            written += n
        if written:
            self.send(P.Credit(rid=self.rid, ch=P.STDIN, n=written))
        if not self.in_buf and self.in_eof:
            self.close_in()
        self.update()

    def close_in(self) -> None:
        if self.in_fd >= 0:
            self.agent.unwatch(self.in_fd)
            os.close(self.in_fd)
            self.in_fd = -1

    # -- life ------------------------------------------------------------------------
    def update(self) -> None:
        if self.out_fd >= 0:
            self.agent.modify(self.out_fd, EPOLLIN if self.readable() else 0)
        if self.in_fd >= 0:
            self.agent.modify(self.in_fd, EPOLLOUT if self.in_buf else 0)

    def cancel(self) -> None:
        """The host gave up on the request (Signal): stop the work, answer nothing."""
        self.orphan()
        self.finish()

    def orphan(self) -> None:
        super().orphan()
        self.in_buf.clear()
        self.in_eof = True
        self.close_in()
        if self.killable and self.status is None and self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        self.update()

    def on_exit(self, status: int) -> None:
        self.status = status
        self.maybe_finish()

    def maybe_finish(self) -> None:
        if self.done or self.status is None or self.out_fd >= 0:
            return
        self.done = True
        self.agent.procs.pop(self.pid, None)
        self.close_in()
        chunks = []
        while True:  # the child has exited: its end is closed, this cannot block
            b = os.read(self.status_fd, 4096)
            if not b:
                break
            chunks.append(b)
        os.close(self.status_fd)
        self.status_fd = -1
        code, _, text = b"".join(chunks).decode(errors="replace").partition("\0")
        if code == "OK":
            value = int(text or 0)
            if self.on_ok is not None:
                self.on_ok(value)
            if self.streams_out:
                self.send(P.Eof(rid=self.rid, ch=P.STDOUT))
            else:
                self.send(P.Ok(rid=self.rid, value=value))
        elif code:
            self.send(P.Error(rid=self.rid, code=code, message=text[:2000]))
        else:
            st = self.status
            why = f"signal {os.WTERMSIG(st)}" if os.WIFSIGNALED(st) else f"status {os.WEXITSTATUS(st)}"
            text = f"guestd worker ended without an answer ({why})"
            self.send(P.Error(rid=self.rid, code=P.E_INTERNAL, message=text))
        self.finish()


def _tree() -> Any:
    """guestd.tree, imported by PID 1 itself at the first tree request (never at boot).
    In PID 1, not in each worker: the import (tarfile, shutil, re, enum) costs ~250 ms
    under TCG, once per guest this way instead of once per tree request (measured, a
    read_tree of an empty directory: 150-500 ms importing in the worker; a worker
    that imports nothing, an empty patch: 26-59 ms). The price: PID 1's loop stalls
    for that one import, and ~1.5 MB more of its memory."""
    from guestd import tree

    return tree


def _worker_child(work: Callable[[int], int], data_fd: int, status_w: int, keep: tuple[int, ...]) -> None:
    """The forked worker: reset what PID 1 set up for itself, do the work, report, exit."""
    code = 1
    try:
        try:
            signal.set_wakeup_fd(-1)
            for sig in _SIGDEF:
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a reader gone is an EPIPE error, not a death
            low = 3
            for fd in sorted({data_fd, status_w, *keep} - {-1}):
                if fd >= low:
                    os.closerange(low, fd)
                    low = fd + 1
            os.closerange(low, 1 << 20)  # (close_range: one system call)
            os.umask(0o022)
            answer = f"OK\0{int(work(data_fd))}"
            code = 0
        except BaseException as exc:
            answer = _describe(exc)
        os.write(status_w, answer.encode(errors="replace")[:4000])  # below PIPE_BUF: one write
    finally:
        os._exit(code)


def _describe(exc: BaseException) -> str:
    c = getattr(exc, "code", None)
    if isinstance(c, str) and isinstance(getattr(exc, "message", None), str):  # tree.TreeError, ExecFailed
        return f"{c}\0{exc.message}"  # type: ignore[attr-defined]
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{errcode(exc)}\0{exc.strerror or exc}{where}"
    if isinstance(exc, LookupError):
        return f"{P.E_INVALID}\0{exc.args[0] if exc.args else exc}"
    return f"{P.E_INTERNAL}\0{type(exc).__name__}: {exc}"


def busybox_run(root_fd: int, argv: list[str]) -> None:
    """Run a busybox applet of the initramfs (in a worker: this blocks). Its stderr
    becomes the message of a FAILED_PRECONDITION when it fails."""
    r, w = os.pipe()
    try:
        pid = os.posix_spawn(
            f"/proc/self/fd/{root_fd}/usr/bin/busybox",
            ["busybox", *argv],
            {"PATH": DEFAULT_PATH},
            file_actions=[(os.POSIX_SPAWN_DUP2, w, 2), (os.POSIX_SPAWN_DUP2, w, 1)],
            setsigdef=_SIGDEF,
        )
    finally:
        os.close(w)
    try:
        out = b""
        while len(out) < 4096:
            b = os.read(r, 4096)
            if not b:
                break
            out += b
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        text = out.decode(errors="replace").strip().replace("\n", "; ") or f"{argv[0]} failed ({status})"
        raise ExecFailed(P.E_FAILED, text)


def find_disk(device: str) -> str:
    """``/dev/vdX`` or ``serial:NAME`` -> the block device's /dev path."""
    if device.startswith("serial:"):
        want = device[len("serial:") :]
        for name in sorted(os.listdir("/sys/block")):
            if want and _read(f"/sys/block/{name}/serial").strip() == want:
                return f"/dev/{name}"
        raise ExecFailed(P.E_NOT_FOUND, f"no disk with serial {want!r}")
    if not device.startswith("/dev/"):
        raise LookupError("device must be a /dev path or serial:NAME")
    return device


def mount_work(root_fd: int, msg: P.Mount) -> int:
    """In a worker: mount ``msg.device`` at ``msg.path``."""
    import stat

    dev = find_disk(msg.device)
    st = os.stat(dev)
    if not stat.S_ISBLK(st.st_mode):
        raise ExecFailed(P.E_INVALID, f"{dev} is not a block device")
    name = os.path.basename(dev)
    if not msg.read_only and _read(f"/sys/class/block/{name}/ro").strip() == "1":
        # busybox mount would quietly fall back to a read-only mount
        raise ExecFailed(P.E_PERM, f"{dev} is attached read-only; mount it read-only")
    if os.path.ismount(msg.path):
        raise ExecFailed(P.E_EXISTS, f"{msg.path} is a mount point already")
    os.makedirs(msg.path, 0o755, exist_ok=True)
    # A restored snapshot's kernel may hold pages of this device read before the
    # snapshot (another disk then, e.g. a template's placeholder): drop them.
    fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, BLKFLSBUF, 0)
    finally:
        os.close(fd)
    opts = "ro" if msg.read_only else "rw,noatime"
    busybox_run(root_fd, ["mount", "-t", msg.fstype, "-o", opts, dev, msg.path])
    return 0


# ---------------------------------------------------------------------------
# the agent
# ---------------------------------------------------------------------------


class Agent:
    def __init__(self, cmdline: dict[str, str], marks: dict[str, float], root_fd: int) -> None:
        self.cmdline = cmdline
        self.marks = marks
        self.root_fd = root_fd  # the initramfs root, for our own tools after chroot
        self.ep = select.epoll()
        self.handlers: dict[int, Callable[[int], None]] = {}
        self.masks: dict[int, int] = {}
        self.conns: dict[int, Conn] = {}
        self.procs: dict[int, Proc | Worker] = {}
        self.timers: set[Proc] = set()
        self.runnable: set[FileReader] = set()
        self.activity = 0
        self.hostname = cmdline.get("sandvisor.hostname", "sandbox")
        self.shutting_down: bool | None = None
        self.vsock_fd = -1
        self.deferred_loaded = False
        self.dirty: set[Conn] = set()  # connections with output to write at the end of this turn
        self.mounts: list[str] = []  # what mount requests mounted, unmounted (last first) at power-off

    # -- epoll bookkeeping ---------------------------------------------------
    def watch(self, fd: int, mask: int, handler: Callable[[int], None]) -> None:
        self.handlers[fd] = handler
        self.masks[fd] = 0
        self.modify(fd, mask)

    def modify(self, fd: int, mask: int) -> None:
        """Set the interest of ``fd``. Mask 0 takes it out of epoll altogether, since
        EPOLLHUP and EPOLLERR are reported whatever the mask (a spin otherwise)."""
        old = self.masks.get(fd)
        if old is None or old == mask:
            return
        self.masks[fd] = mask
        if not mask:
            self.ep.unregister(fd)
        elif not old:
            self.ep.register(fd, mask)
        else:
            self.ep.modify(fd, mask)

    def unwatch(self, fd: int) -> None:
        if self.handlers.pop(fd, None) is not None and self.masks.pop(fd, 0):
            self.ep.unregister(fd)

    # -- connections -----------------------------------------------------------
    def add_conn(self, fd: int, kind: str) -> Conn:
        set_nonblock(fd)
        conn = Conn(self, fd, kind)
        self.conns[fd] = conn

        def handler(ev: int) -> None:
            if conn.away:
                self.check_away()
                return
            if ev & EPOLLIN:
                conn.on_readable()
            elif ev & (EPOLLHUP | EPOLLERR) and conn.kind != "port":
                conn.drop()
                return
            elif ev & (EPOLLHUP | EPOLLERR):
                conn.on_readable()  # read returns EOF: host gone
            if not conn.away and ev & EPOLLOUT:
                conn.flush()

        self.watch(fd, EPOLLIN, handler)
        return conn

    def update_conn(self, conn: Conn) -> None:
        if conn.fd not in self.handlers:
            return
        if conn.away:
            # HUP is level-high while the host is away: only edges (its return) wake us
            self.modify(conn.fd, EPOLLIN | EPOLLOUT | EPOLLET)
            return
        self.modify(conn.fd, EPOLLIN | (EPOLLOUT if conn.out else 0))
        if conn.stalled and not conn.congested and conn.session is not None:
            conn.stalled = False
            for req in conn.session.reqs.values():
                if isinstance(req, Proc):
                    req.update()
                elif isinstance(req, FileReader):
                    self.runnable.add(req)
                elif isinstance(req, Worker):
                    req.update()

    def remove_conn(self, conn: Conn) -> None:
        self.unwatch(conn.fd)
        self.conns.pop(conn.fd, None)
        os.close(conn.fd)

    def check_away(self) -> None:
        """Poll an away port: with the host back, POLLHUP clears and the fd is readable/writable."""
        for conn in self.conns.values():
            if conn.away:
                p = select.poll()
                p.register(conn.fd, select.POLLIN | select.POLLOUT)
                evs = p.poll(0)
                if evs and not evs[0][1] & select.POLLHUP:
                    conn.away = False
                    self.update_conn(conn)

    # -- dispatch ----------------------------------------------------------------
    def dispatch(self, conn: Conn, msg: P.Message) -> None:
        if isinstance(msg, P.Hello):
            if conn.session is not None:
                conn.session.close()
            conn.session = Session(conn)
            conn.out += P.GUEST_SYNC
            if msg.host_time_ns and self.cmdline.get("sandvisor.setclock", "1") == "1":
                self.set_clock(msg.host_time_ns)
            conn.send(
                P.HelloOk(
                    version=P.PROTOCOL_VERSION,
                    pid=os.getpid(),
                    boot_ns=T_START,
                    ready_ns=time.clock_gettime_ns(time.CLOCK_BOOTTIME),
                    activity=self.activity,
                    marks=self.marks,
                    features=[
                        "exec",
                        "pty",
                        "files",
                        "metrics",
                        "trees",
                        "patch",
                        "mount",
                        "vsock" if self.vsock_fd >= 0 else "serial",
                    ],
                )
            )
            if not self.deferred_loaded:
                self.deferred_loaded = True
                load_deferred_modules(self.root_fd)
            return
        session = conn.session
        if session is None:
            raise P.BadMessage(f"{msg.TAG} before hello")
        rid = getattr(msg, "rid", None)
        try:
            self.handle(session, msg)
        except P.ProtocolError:
            raise
        except ExecFailed as exc:
            session.send(P.Error(rid=rid or 0, code=exc.code, message=exc.message))
        except LookupError as exc:
            session.send(P.Error(rid=rid or 0, code=P.E_INVALID, message=str(exc.args[0])))
        except OSError as exc:
            session.send(P.Error(rid=rid or 0, code=errcode(exc), message=f"{exc.strerror}"))
        except Exception as exc:  # a bug here must not kill PID 1
            log(f"internal error on {msg.TAG}: {type(exc).__name__}: {exc}")
            session.send(P.Error(rid=rid or 0, code=P.E_INTERNAL, message=f"{type(exc).__name__}: {exc}"))

    def handle(self, session: Session, msg: P.Message) -> None:
        if isinstance(msg, (P.Data, P.Eof, P.Credit, P.Resize, P.Signal)):
            req = session.reqs.get(msg.rid)
            if req is None:
                return  # finished meanwhile: late stream traffic is harmless
            if isinstance(msg, P.Data):
                req.on_data(msg.ch, msg.data)
            elif isinstance(msg, P.Eof):
                req.on_eof(msg.ch)
            elif isinstance(msg, P.Credit):
                req.on_credit(msg.ch, msg.n)
            elif isinstance(msg, P.Resize) and isinstance(req, Proc):
                req.resize(msg.rows, msg.cols)
            elif isinstance(msg, P.Signal) and isinstance(req, Proc):
                req.kill(msg.signum)
            elif isinstance(msg, P.Signal) and isinstance(req, Worker):
                req.cancel()
            return
        rid = getattr(msg, "rid", 0)
        if rid in session.reqs:
            raise P.BadMessage(f"request id {rid} already in use")
        if isinstance(msg, P.Ping):
            session.send(P.Pong(rid=rid, activity=self.activity, guest_ns=time.time_ns()))
        elif isinstance(msg, P.Touch):
            self.activity += 1
            session.send(P.Ok(rid=rid, activity=self.activity))
        elif isinstance(msg, P.Exec):
            self.activity += 1
            proc = Proc(self, session, msg)
            proc.start(msg)
            session.reqs[rid] = proc
            session.send(P.ExecStarted(rid=rid, pid=proc.pid))
        elif isinstance(msg, P.ReadFile):
            self.read_file(session, msg)
        elif isinstance(msg, P.WriteFile):
            self.write_file(session, msg)
        elif isinstance(msg, P.Metrics):
            session.send(metrics(rid))
        elif isinstance(msg, P.SetClock):
            self.set_clock(msg.realtime_ns)
            session.send(P.Ok(rid=rid))
        elif isinstance(msg, P.AddEntropy):
            add_entropy(msg.data)
            session.send(P.Ok(rid=rid))
        elif isinstance(msg, P.SetHostname):
            self.set_hostname(msg.hostname)
            session.send(P.Ok(rid=rid))
        elif isinstance(msg, P.ReadTree):
            self.read_tree(session, msg)
        elif isinstance(msg, P.WriteTree):
            self.write_tree(session, msg)
        elif isinstance(msg, P.Patch):
            self.patch(session, msg)
        elif isinstance(msg, P.Mount):
            self.mount(session, msg)
        elif isinstance(msg, P.Umount):
            self.umount(session, msg)
        elif isinstance(msg, P.NetConfig):
            self.net_config(msg)
            session.send(P.Ok(rid=rid))
        elif isinstance(msg, P.Shutdown):
            session.send(P.Ok(rid=rid))
            self.shutting_down = msg.reboot
        else:
            raise P.BadMessage(f"unexpected {msg.TAG} from host")

    # -- operations ------------------------------------------------------------
    def read_file(self, session: Session, msg: P.ReadFile) -> None:
        if not msg.path.startswith("/"):
            raise LookupError("path must be absolute")
        fd = os.open(msg.path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if (st.st_mode & 0o170000) == 0o040000:
                raise IsADirectoryError(errno.EISDIR, "Is a directory")
            if (st.st_mode & 0o170000) != 0o100000:
                raise LookupError(f"{msg.path} is not a regular file")
            if st.st_size > P.MAX_FILE:
                session.send(P.Error(rid=msg.rid, code=P.E_TOO_LARGE, message=f"{st.st_size} bytes > {P.MAX_FILE}"))
                os.close(fd)
                return
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        session.send(P.FileInfo(rid=msg.rid, size=st.st_size, mode=st.st_mode & 0o7777))
        reader = FileReader(self, session, msg.rid, fd, st.st_size)
        session.reqs[msg.rid] = reader
        self.runnable.add(reader)

    def write_file(self, session: Session, msg: P.WriteFile) -> None:
        if not msg.path.startswith("/") or msg.path.endswith("/"):
            raise LookupError("path must be absolute and name a file")
        if msg.size > P.MAX_FILE:
            session.send(P.Error(rid=msg.rid, code=P.E_TOO_LARGE, message=f"{msg.size} bytes > {P.MAX_FILE}"))
            return
        if os.path.isdir(msg.path):
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
        parent = os.path.dirname(msg.path) or "/"
        if not os.path.isdir(parent):
            raise FileNotFoundError(errno.ENOENT, f"No such directory: {parent}")
        ids = resolve_user(msg.owner)[:2] if msg.owner else None
        tmp = f"{parent}/.{os.path.basename(msg.path)}.sandvisor-{msg.rid}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        session.reqs[msg.rid] = FileWriter(session, msg.rid, fd, msg.path, tmp, msg.mode & 0o7777, ids)

    # -- trees, patches, mounts (in workers) ------------------------------------------
    def read_tree(self, session: Session, msg: P.ReadTree) -> None:
        if not msg.path.startswith("/"):
            raise LookupError("path must be absolute")
        dfd = os.open(msg.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the path's own symlink is followed
        tree = _tree()

        def work(out_fd: int) -> int:
            return int(tree.pack(dfd, tree.write_fd(out_fd)))

        try:
            Worker(self, session, msg.rid).start(work, out=True, keep=(dfd,), killable=True, first=P.Ok(rid=msg.rid))
        finally:
            os.close(dfd)

    def write_tree(self, session: Session, msg: P.WriteTree) -> None:
        if not msg.path.startswith("/"):
            raise LookupError("path must be absolute")
        ids = resolve_user(msg.owner)[:2] if msg.owner else None
        created = False
        if not os.path.isdir(msg.path):
            os.makedirs(msg.path, 0o755)  # EEXIST if a file is there
            created = True
        dfd = os.open(msg.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        tree = _tree()

        def work(in_fd: int) -> int:
            return int(tree.unpack(tree.read_fd(in_fd), dfd, owner=ids, root_meta=created))

        try:
            Worker(self, session, msg.rid).start(work, inp=True, keep=(dfd,), killable=True)
        finally:
            os.close(dfd)

    def patch(self, session: Session, msg: P.Patch) -> None:
        if len(msg.entries) > P.MAX_PATCH_ENTRIES:
            raise LookupError(f"more than {P.MAX_PATCH_ENTRIES} patch entries")

        def work(_fd: int) -> int:
            from guestd import fsops

            return fsops.apply_patch(msg.entries, lambda spec: resolve_user(spec)[:2], msg.base)

        Worker(self, session, msg.rid).start(work)

    def mount(self, session: Session, msg: P.Mount) -> None:
        if not msg.path.startswith("/") or os.path.normpath(msg.path) == "/":
            raise LookupError("mount path must be absolute and not /")
        if msg.fstype not in ("ext4", "ext3", "ext2", "xfs", "btrfs", "vfat", "squashfs", "erofs", "iso9660"):
            raise LookupError(f"unsupported file system type {msg.fstype!r}")
        path = os.path.normpath(msg.path)
        w = Worker(self, session, msg.rid)
        w.on_ok = lambda _v: self.mounts.append(path)
        w.start(lambda _fd: mount_work(self.root_fd, msg))

    def umount(self, session: Session, msg: P.Umount) -> None:
        path = os.path.normpath(msg.path) if msg.path.startswith("/") else ""
        if not path or not os.path.ismount(path):
            raise LookupError(f"{msg.path} is not a mount point")
        w = Worker(self, session, msg.rid)

        def forget(_v: int) -> None:
            if path in self.mounts:
                self.mounts.remove(path)

        def work(_fd: int) -> int:
            busybox_run(self.root_fd, ["umount", path])
            return 0

        w.on_ok = forget
        w.start(work)

    def set_clock(self, ns: int) -> None:
        time.clock_settime_ns(time.CLOCK_REALTIME, ns)

    def set_hostname(self, name: str) -> None:
        if not name or len(name) > 64:
            raise LookupError("hostname must be 1-64 characters")
        with open("/proc/sys/kernel/hostname", "w") as f:
            f.write(name)
        self.hostname = name

    def net_config(self, msg: P.NetConfig) -> None:
        from guestd import netcfg  # lazy: only restores of networked sandboxes pay the import

        try:
            netcfg.configure(msg.iface, msg.address, msg.prefix, msg.gateway, msg.mac, msg.dns)
        except ValueError as exc:
            raise ExecFailed(P.E_INVALID, f"net_config: {exc}") from None

    # -- signals and children ----------------------------------------------------
    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            proc = self.procs.get(pid)
            if proc is not None:
                proc.on_exit(status)

    # -- main loop -----------------------------------------------------------------
    def run(self) -> None:
        rsig, wsig = os.pipe()
        set_nonblock(rsig)
        set_nonblock(wsig)
        signal.set_wakeup_fd(wsig, warn_on_full_buffer=False)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, lambda *_: None)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)

        def on_signal(_ev: int) -> None:
            try:
                sigs = os.read(rsig, 512)
            except BlockingIOError:
                return
            self.reap()
            if signal.SIGTERM in sigs or signal.SIGINT in sigs:
                self.shutting_down = False  # ctrl-alt-del / ACPI-ish requests: power off

        self.watch(rsig, EPOLLIN, on_signal)
        self.reap()
        while self.shutting_down is None:
            timeout = -1.0
            if self.runnable:
                timeout = 0.0
            elif any(c.away for c in self.conns.values()):
                timeout = AWAY_POLL
            if self.timers:
                nd = min(p.next_deadline() for p in self.timers)
                timeout = max(0.0, nd - now()) if timeout < 0 else min(timeout, max(0.0, nd - now()))
            try:
                events = self.ep.poll(timeout)
            except InterruptedError:
                events = []
            for fd, ev in events:
                h = self.handlers.get(fd)
                if h is not None:
                    h(ev)
            if self.runnable:
                batch, self.runnable = self.runnable, set()
                for r in batch:
                    try:
                        r.run()
                    except OSError as exc:
                        r.send(P.Error(rid=r.rid, code=errcode(exc), message=str(exc.strerror)))
                        r.close()
            if self.timers:
                t = now()
                for p in list(self.timers):
                    p.tick(t)
                    if p.done or p.next_deadline() == float("inf"):
                        self.timers.discard(p)
            if any(c.away for c in self.conns.values()):
                self.check_away()
            while self.dirty:
                self.dirty.pop().flush()
        for conn in self.conns.values():
            if conn.out:
                drain_blocking(conn)
        poweroff(self.root_fd, self.shutting_down, self.mounts)


def drain_blocking(conn: Conn, limit: float = 1.0) -> None:
    """Best effort: push the last answers (the shutdown Ok) to the host."""
    deadline = now() + limit
    while conn.out and now() < deadline and not conn.away:
        try:
            n = os.write(conn.fd, conn.out)
            del conn.out[:n]
        except BlockingIOError:
            time.sleep(0.005)
        except OSError:
            return


def poweroff(root_fd: int, reboot: bool, mounts: list[str] | None = None) -> None:
    """Stop every process, unmount the volumes, flush the disks, power off (PID 1 never
    just exits)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(-1, sig)
        except OSError:
            pass
        deadline = now() + 1.0
        while now() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.01)
    os.sync()
    busybox = f"/proc/self/fd/{root_fd}/usr/bin/busybox"
    # the volumes first (their journals end clean: a volume attached read-only next
    # time needs no recovery), then the root read-only; -r: read-only if still busy
    for argv in [["umount", "-r", m] for m in reversed(mounts or [])] + [["mount", "-o", "remount,ro", "/"]]:
        pid = os.fork()
        if pid == 0:
            try:
                os.execv(busybox, ["busybox", *argv])
            finally:
                os._exit(1)
        os.waitpid(pid, 0)
    os.sync()
    os.execv(busybox, ["busybox", "reboot" if reboot else "poweroff", "-f"])


# Drivers nothing waits for at boot, loaded after the first hello is answered (off the
# path to ready): virtio ID -> module of the initramfs. The balloon reports free guest
# pages to the host (free page reporting), which gives their memory back.
DEFERRED_MODULES = {"0x0005": "virtio_balloon"}
# What runs once a deferred module is in. The balloon registers free page reporting at
# pageblock order (9: only free 2 MiB blocks are reported); in a restored clone the
# freed memory is fragmented, and measured over 3 clones each: of 150 MiB allocated and
# freed, order 9 gave back 129, 131 and -2 MiB within 10 s (and failed the test once in
# a full run), order 0 gave back 153 MiB in every one. The cost is a host page fault per
# reported page the guest takes again, which is what giving memory back means.
AFTER_MODULE = {"virtio_balloon": "echo 0 > /sys/module/page_reporting/parameters/page_reporting_order"}


def load_deferred_modules(root_fd: int) -> None:
    """insmod (busybox, from the initramfs) the deferred drivers of devices that are
    there. Best effort and asynchronous: the reaper collects the process."""
    try:
        ids = {_read(f"/sys/bus/virtio/devices/{d}/device").strip() for d in os.listdir("/sys/bus/virtio/devices")}
    except OSError:
        return
    # the initramfs root is our fd; insmod opens the module by path after its exec, when
    # that fd is closed in it: name it through our own /proc entry
    base = f"/proc/{os.getpid()}/fd/{root_fd}"
    release = os.uname().release
    for dev, mod in DEFERRED_MODULES.items():
        if dev not in ids or os.path.exists(f"/sys/module/{mod}"):
            continue
        ko = f"{base}/lib/modules/{release}/{mod}.ko"
        argv = ["insmod", ko]
        if mod in AFTER_MODULE:
            argv = ["sh", "-c", f'"$1" insmod "$0" && {AFTER_MODULE[mod]}', ko, f"{base}/usr/bin/busybox"]
        try:
            os.posix_spawn(f"{base}/usr/bin/busybox", argv, {}, setsigdef=_SIGDEF)
        except OSError as exc:
            log(f"cannot load {mod}: {exc}")


def add_entropy(data: bytes) -> None:
    if len(data) > 4096:
        raise LookupError("at most 4096 bytes of entropy at once")
    buf = struct.pack("ii", len(data) * 8, len(data)) + data
    fd = os.open("/dev/urandom", os.O_WRONLY)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, buf)
        # credited entropy alone does not rekey a CRNG that is already seeded: after a
        # restore, clones of one snapshot would read the same /dev/urandom stream
        # until the next scheduled reseed (up to a minute). Reseed now.
        try:
            fcntl.ioctl(fd, RNDRESEEDCRNG)
        except OSError:
            pass  # ENODATA: not seeded yet (then it will seed from the pool anyway)
    finally:
        os.close(fd)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def metrics(rid: int) -> P.MetricsOk:
    hz = os.sysconf("SC_CLK_TCK")
    cpu: dict[str, float] = {}
    ncpu = 0
    procs = 0
    for line in _read("/proc/stat").splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
            cpu = {n: int(v) / hz for n, v in zip(names, parts[1:9], strict=False)}
        elif parts and parts[0].startswith("cpu"):
            ncpu += 1
        elif parts and parts[0] == "processes":
            procs = int(parts[1])
    mem: dict[str, int] = {}
    keys = {
        "MemTotal": "total",
        "MemAvailable": "available",
        "MemFree": "free",
        "Buffers": "buffers",
        "Cached": "cached",
    }
    for line in _read("/proc/meminfo").splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            mem[keys[k]] = int(v.split()[0]) * 1024
    disk = {"read_bytes": 0, "write_bytes": 0, "reads": 0, "writes": 0}
    for line in _read("/proc/diskstats").splitlines():
        f = line.split()
        if len(f) >= 10 and f[2].startswith("vd") and not f[2][-1].isdigit():
            disk["reads"] += int(f[3])
            disk["read_bytes"] += int(f[5]) * 512
            disk["writes"] += int(f[7])
            disk["write_bytes"] += int(f[9]) * 512
    net = {"rx_bytes": 0, "tx_bytes": 0, "rx_packets": 0, "tx_packets": 0}
    for line in _read("/proc/net/dev").splitlines()[2:]:
        name, _, rest = line.partition(":")
        f = rest.split()
        if name.strip() != "lo" and len(f) >= 10:
            net["rx_bytes"] += int(f[0])
            net["rx_packets"] += int(f[1])
            net["tx_bytes"] += int(f[8])
            net["tx_packets"] += int(f[9])
    up = _read("/proc/uptime").split()
    return P.MetricsOk(
        rid=rid,
        uptime=float(up[0]) if up else 0.0,
        cpu_seconds=cpu,
        ncpu=ncpu,
        mem=mem,
        disk=disk,
        net=net,
        load=_read("/proc/loadavg").split()[:3],
        procs=procs,
    )


# ---------------------------------------------------------------------------
# boot
# ---------------------------------------------------------------------------


def find_port(name: str, timeout: float = 5.0) -> str | None:
    """The /dev node of the virtio-serial port called ``name`` (no udev here)."""
    deadline = now() + timeout
    while True:
        try:
            for entry in os.listdir("/sys/class/virtio-ports"):
                if _read(f"/sys/class/virtio-ports/{entry}/name").strip() == name:
                    dev = f"/dev/{entry}"
                    if os.path.exists(dev):
                        return dev
        except OSError:
            pass
        if now() > deadline:
            return None
        time.sleep(0.001)


def open_vsock(port: int) -> Any:
    import socket

    s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    s.bind((socket.VMADDR_CID_ANY, port))
    s.listen(8)
    s.setblocking(False)
    return s


def main() -> None:
    cmdline = {}
    for word in _read("/proc/cmdline").split():
        k, _, v = word.partition("=")
        if k.startswith("sandvisor."):
            cmdline[k] = v
    marks: dict[str, float] = {}
    for k, v in os.environ.items():
        if k.startswith("SV_T_"):
            try:
                marks[k[5:].lower()] = float(v)
            except ValueError:
                pass
    marks["python"] = T_START / 1e9
    port_dev = find_port(cmdline.get("sandvisor.port", PORT_NAME))
    port_fd = os.open(port_dev, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK) if port_dev else -1
    listener = None
    if os.path.exists("/dev/vsock"):
        try:
            listener = open_vsock(int(cmdline.get("sandvisor.vsock_port", VSOCK_PORT)))
        except OSError as exc:
            log(f"vsock listener: {exc}")
    global ROOT_FD
    root_fd = ROOT_FD = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    if os.path.ismount(SYSROOT):
        # lazy imports after the chroot resolve through the initramfs root's fd (a
        # worker's too: it keeps that fd at the same number); so do the submodules of
        # packages imported already (guestd.tree)
        def moved(paths: list[str]) -> list[str]:
            return [f"/proc/self/fd/{root_fd}{p}" if p.startswith("/") else p for p in paths]

        sys.path[:] = moved(sys.path)
        for mod in list(sys.modules.values()):
            pkg_path = getattr(mod, "__path__", None)
            if type(pkg_path) is list:
                pkg_path[:] = moved(pkg_path)
        os.chroot(SYSROOT)
        os.chdir("/")
    agent = Agent(cmdline, marks, root_fd)
    if "sandvisor.hostname" in cmdline:
        try:
            agent.set_hostname(cmdline["sandvisor.hostname"])
        except (OSError, LookupError):
            pass
    if port_fd >= 0:
        agent.add_conn(port_fd, "port")
    else:
        log("channel port not found")
    if listener is not None:
        agent.vsock_fd = listener.fileno()

        def on_accept(_ev: int) -> None:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            agent.add_conn(sock.detach(), "vsock")

        agent.watch(listener.fileno(), EPOLLIN, on_accept)
    agent.marks["ready"] = time.clock_gettime_ns(time.CLOCK_BOOTTIME) / 1e9
    agent.run()


def entry() -> None:
    """Never let PID 1 die with a Python traceback and a kernel panic without a word."""
    try:
        main()
    except BaseException as exc:
        import traceback

        log("fatal: " + "".join(traceback.format_exception(exc))[-3000:])
        if os.getpid() == 1:
            os.sync()
            try:
                os.execv(f"/proc/self/fd/{ROOT_FD}/usr/bin/busybox", ["busybox", "poweroff", "-f"])
            except OSError:
                pass
        raise


if __name__ == "__main__":
    entry()
