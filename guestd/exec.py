"""Processes: the exec request (:class:`Proc`) and how guestd starts one.

A process's stdout and stderr (or its PTY) are :class:`~guestd.session.OutStream`\\ s,
its stdin an :class:`~guestd.session.InStream`: the credit rules are session.py's. PID 1
reaps every child (agent.py) and hands the status to the Proc that started it.
"""

from __future__ import annotations

import _signal as signal  # the C module: 'signal' pulls in enum (~20 ms of boot)
import fcntl
import os
import select

from guestd import proto
from guestd.common import DEFAULT_PATH, SIGDEF, TIOCSCTTY, TIOCSWINSZ, WINSZ, ExecFailed, errcode, now
from guestd.session import InStream, OutStream, Req, Session
from guestd.users import resolve_user

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~30 ms of boot

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from guestd.agent import Agent

PROFILE = "sandvisor.execprof"  # =1 on the kernel command line: time marks of each exec, as a Log
# back to default in every process: what guestd catches or ignores, and SIGXFSZ, which
# Python ignores at start-up (a process past RLIMIT_FSIZE is killed, not handed EFBIG)
CHILD_SIGDEF = (*SIGDEF, signal.SIGXFSZ)
DRAIN_GRACE = 0.2  # after exit, wait this long for background holders of the pipes
EPOLLIN, EPOLLOUT = select.EPOLLIN, select.EPOLLOUT


class Proc(Req):
    def __init__(self, agent: Agent, session: Session, msg: proto.Exec) -> None:
        super().__init__(session, msg.rid)
        self.agent = agent
        self.tty = msg.tty
        self.pid = 0
        self.status: int | None = None
        self.exited_at = 0.0
        self.timed_out = False
        self.oom_killed = False
        self.deadline = now() + msg.timeout if msg.timeout > 0 else 0.0
        self.outs: list[OutStream] = []
        self.stdin = InStream(self, agent, -1, eof=True, tty=msg.tty)
        self.done = False
        self.last_session: Session | None = None
        # profile marks (seconds, monotonic), from the read of the Exec frame on
        self.marks: list[tuple[str, float]] | None = None
        if agent.cmdline.get(PROFILE) == "1":
            self.marks = [("read", session.conn.t_read), ("init", now())]

    def mark(self, name: str) -> None:
        if self.marks is not None:
            self.marks.append((name, now()))

    def on_flushed(self) -> None:
        """Profile: the connection wrote what this exec queued; after its Exit, send the marks."""
        if self.marks is None:
            return
        self.mark("flushed")
        if self.done:
            t0 = self.marks[0][1]
            text = " ".join(f"{k}={(t - t0) * 1e6:.0f}" for k, t in self.marks)
            self.marks = None
            if self.session is None and self.last_session is not None:
                self.last_session.send(proto.Log(level="execprof", text=text))

    def want_flush_mark(self) -> None:
        if self.marks is not None and self.session is not None:
            self.last_session = self.session
            self.session.conn.prof.append(self)

    # -- start ---------------------------------------------------------------
    def start(self, msg: proto.Exec) -> None:
        uid, gid, groups, home, name = resolve_user(msg.user)
        self.mark("user")
        env = {"PATH": DEFAULT_PATH, "HOME": home, "USER": name, "LOGNAME": name, "HOSTNAME": self.agent.hostname}
        if msg.tty:
            env["TERM"] = "xterm-256color"
        if msg.env:
            env.update(msg.env)
        if self.agent.path_extra:
            from guestd.shape import with_path

            with_path(env, self.agent.path_extra)
        cwd = msg.cwd or (home if os.path.isdir(home) else "/")
        stdin_fd = -1
        if msg.tty:
            master, slave = os.openpty()
            fcntl.ioctl(master, TIOCSWINSZ, WINSZ.pack(msg.rows, msg.cols, 0, 0))
            stdio = (slave, slave, slave)
            child_fds = [slave]
            os.set_blocking(master, False)
            self.outs.append(OutStream(self, proto.STDOUT, master))
            if msg.stdin:
                stdin_fd = master
        else:
            # (os.pipe: close-on-exec; the child gets its ends by dup2, guestd's stay behind)
            if msg.stdin:
                rin, stdin_fd = os.pipe()
                os.set_blocking(stdin_fd, False)
                child_fds = [rin]
            else:
                rin = devnull()  # one /dev/null for every exec without stdin: not ours to close
                child_fds = []
            rout, wout = os.pipe()
            rerr, werr = os.pipe()
            child_fds += (wout, werr)
            os.set_blocking(rout, False)
            os.set_blocking(rerr, False)
            self.outs += (OutStream(self, proto.STDOUT, rout), OutStream(self, proto.STDERR, rerr))
            stdio = (rin, wout, werr)
        self.mark("spawn")
        try:
            nnp_root = self.agent.root_fd if self.agent.restricted else -1
            self.pid = spawn(msg.argv, env, cwd, uid, gid, groups, stdio, msg.tty, nnp_root=nnp_root)
        except BaseException:
            for s in self.outs:
                os.close(s.fd)
            if stdin_fd >= 0 and not msg.tty:
                os.close(stdin_fd)
            self.outs = []
            raise
        finally:
            for fd in child_fds:
                os.close(fd)
        self.mark("spawned")
        if stdin_fd >= 0:
            self.stdin = InStream(self, self.agent, stdin_fd, eof=False, tty=msg.tty)
        agent = self.agent
        agent.procs[self.pid] = self
        for s in self.outs:
            agent.watch(s.fd, EPOLLIN if s.readable() else 0, self.on_out_event(s))
        if stdin_fd >= 0:
            self.stdin.watch()
        if self.deadline:
            agent.timers.add(self)
        self.mark("started")
        self.want_flush_mark()

    # -- output --------------------------------------------------------------
    def on_out_event(self, s: OutStream) -> Callable[[int], None]:
        def handler(ev: int) -> None:
            if ev & EPOLLOUT:
                self.stdin.write()  # a PTY master: stdin and output on one fd
            if ev & ~EPOLLOUT:
                self.read_out(s)

        return handler

    def read_out(self, s: OutStream) -> None:
        if not s.open:
            return
        if s.pump() < 0:
            self.close_out(s)
            return
        self.update()

    def close_out(self, s: OutStream) -> None:
        if not s.open:
            return
        s.open = False
        if s.fd == self.stdin.fd:  # PTY master doubles as stdin
            self.stdin.fd = -1
        self.agent.unwatch(s.fd)
        os.close(s.fd)
        self.mark(f"eof{s.ch}")
        self.send(proto.Eof(rid=self.rid, ch=s.ch))
        if self.status is None and not any(o.open for o in self.outs):
            self.reap_now()
        self.maybe_finish()

    def reap_now(self) -> None:
        """Every output hit EOF, most likely because the process is exiting: the close of
        its pipes woke guestd (it preempts the exiting child on the one vCPU) before the
        child reached its SIGCHLD. Yield to it and reap it here, so its Eofs and Exit
        leave in one write and one turn of the loop, not two of each. (Not reaped yet --
        another vCPU, or a process that closed its outputs and runs on -- SIGCHLD reaps it
        as before.)"""
        os.sched_yield()
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == self.pid:
            self.on_exit(status)

    def on_credit(self, ch: int, n: int) -> None:
        for s in self.outs:
            if s.ch == ch:
                s.add_credit(n)
        self.update()

    # -- input ---------------------------------------------------------------
    def on_data(self, ch: int, data: bytes) -> None:
        self.stdin.on_data(ch, data)

    def on_eof(self, ch: int) -> None:
        self.stdin.on_eof()

    # -- control -------------------------------------------------------------
    def on_resize(self, rows: int, cols: int) -> None:
        if self.tty and self.outs and self.outs[0].open:
            fcntl.ioctl(self.outs[0].fd, TIOCSWINSZ, WINSZ.pack(rows, cols, 0, 0))

    def on_signal(self, signum: int) -> None:
        self.kill(signum)

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
        self.mark("reaped")
        self.status = status
        self.exited_at = now()
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and not self.timed_out:
            self.oom_killed = self.agent.oom_victim(self.pid)
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
                while s.open and s.readable():
                    if s.pump() <= 0:
                        self.close_out(s)
                        break

    def next_deadline(self) -> float:
        d = self.deadline or float("inf")
        if self.status is not None and any(s.open and s.readable() for s in self.outs):
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
        self.stdin.close()
        self.send(proto.Exit(rid=self.rid, code=code, signal=sig, timed_out=self.timed_out, oom_killed=self.oom_killed))
        self.mark("exit")
        self.want_flush_mark()
        self.finish()
        self.agent.procs.pop(self.pid, None)
        self.agent.timers.discard(self)

    def orphan(self) -> None:
        super().orphan()
        self.stdin.abandon()
        self.update()

    def resume(self) -> None:
        self.update()

    def update(self) -> None:
        """Re-arm epoll interest: read only streams with credit and a host that keeps up."""
        for s in self.outs:
            if s.open:
                mask = EPOLLIN if s.readable() else 0
                if self.tty and self.stdin.buf:
                    mask |= EPOLLOUT
                self.agent.modify(s.fd, mask)
        self.stdin.update()
        if self.deadline or self.status is not None:
            self.agent.timers.add(self)


_DEVNULL = -1


def devnull() -> int:
    """guestd's one /dev/null (close-on-exec), the stdin of every exec that has none.
    Opened at the first exec: that is after the chroot into the rootfs."""
    global _DEVNULL
    if _DEVNULL < 0:
        _DEVNULL = os.open("/dev/null", os.O_RDONLY)
    return _DEVNULL


def which(name: str, env: dict[str, str]) -> str:
    """Resolve argv[0] on the command's own PATH (not guestd's), like execvp would."""
    if "/" in name:
        return name
    for d in env.get("PATH", DEFAULT_PATH).split(":"):
        p = f"{d or '.'}/{name}"
        if os.access(p, os.X_OK) and not os.path.isdir(p):
            return p
    raise ExecFailed(proto.E_NOT_FOUND, f"exec {name!r}: executable file not found in $PATH")


def spawn(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    uid: int,
    gid: int,
    groups: list[int],
    stdio: tuple[int, int, int],
    tty: bool,
    *,
    nnp_root: int = -1,
) -> int:
    """Start a process. Root without a TTY (the common case) goes through posix_spawn, which glibc implements with
    CLONE_VFORK: no copy of guestd's page tables, a few ms less per exec under TCG.
    Another user without a TTY: CPython's C fork+exec (:func:`c_fork_exec`), a child
    that runs no Python. A controlling TTY forks."""
    if not argv:
        raise ExecFailed(proto.E_INVALID, "empty command")
    path = which(argv[0], env)
    if nnp_root >= 0:  # the restricted profile: no_new_privs, set by a static busybox (guestd/shape.py)
        from guestd.shape import nnp_argv

        path, argv = nnp_argv(nnp_root, path, argv)
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
                setsigdef=CHILD_SIGDEF,
                setsigmask=(),
            )
        except OSError as exc:
            raise ExecFailed(errcode(exc), f"exec {argv[0]!r}: {exc.strerror}") from None
        finally:
            os.chdir("/")
    if not tty and _C_FORK_EXEC:
        pid = c_fork_exec(path, argv, env, cwd, uid, gid, groups, stdio)
        if pid:
            return pid
    return fork_exec(path, argv, env, cwd, uid, gid, groups, stdio, tty)


_C_FORK_EXEC = True  # False once this Python's _posixsubprocess turned out to differ


def c_fork_exec(
    path: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    uid: int,
    gid: int,
    groups: list[int],
    stdio: tuple[int, int, int],
) -> int:
    """fork + exec in C (CPython's _posixsubprocess, what subprocess uses; built in, no
    import cost): the child touches none of guestd's Python heap, so neither side pays
    copy-on-write faults for it -- under TCG the Python child of :func:`fork_exec` cost
    several ms more. Its private signature is CPython 3.11's; a Python whose differs
    (TypeError) makes this return 0 and the caller fall back to :func:`fork_exec`.

    The child: new session, stdio by dup2, chdir, umask 022, SIGPIPE back to default
    (caught signals reset at exec by themselves; guestd blocks none), groups, gid, uid,
    exec. Every other descriptor of guestd's is close-on-exec (PEP 446)."""
    global _C_FORK_EXEC
    import _posixsubprocess

    rerr, werr = os.pipe()
    try:
        try:
            pid: int = _posixsubprocess.fork_exec(
                [os.fsencode(a) for a in argv],
                [os.fsencode(path)],
                False,  # close_fds: guestd's own are close-on-exec
                (werr,),
                cwd,
                [os.fsencode(f"{k}={v}") for k, v in env.items()],
                *(stdio[0], -1, -1, stdio[1], -1, stdio[2]),  # p2cread, c2pwrite, errwrite in their slots
                rerr,
                werr,
                True,  # restore_signals: SIGPIPE (ignored by guestd) to default
                True,  # setsid
                -1,  # process_group
                gid,
                groups,
                uid,
                0o022,
                None,  # type: ignore[arg-type]  # preexec_fn: none (the stub says it is required)
                False,  # allow_vfork
            )
        except TypeError:
            _C_FORK_EXEC = False
            return 0
        except ValueError as exc:  # an embedded NUL in argv or env
            raise ExecFailed(proto.E_INVALID, f"exec {argv[0]!r}: {exc}") from None
        os.close(werr)
        werr = -1
        data = b""
        while True:
            d = os.read(rerr, 4096)
            if not d:
                break
            data += d
    finally:
        os.close(rerr)
        if werr >= 0:
            os.close(werr)
    if not data:
        return pid
    os.waitpid(pid, 0)
    _kind, _, rest = data.partition(b":")
    hex_errno, _, where = rest.partition(b":")
    try:
        num = int(hex_errno, 16)
    except ValueError:
        num = 0
    text = os.strerror(num) if num else data.decode(errors="replace")
    code = errcode(OSError(num, text))
    if where.startswith(b"noexec"):  # before exec: chdir (the ids were the host's to pick)
        raise ExecFailed(code, f"chdir {cwd!r}: {text}")
    raise ExecFailed(code, f"exec {argv[0]!r}: {text}")


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
            for sig in CHILD_SIGDEF:
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
            code = errcode(exc) if isinstance(exc, OSError) else proto.E_INVALID
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
