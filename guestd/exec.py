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

from guestd import proto as P
from guestd.common import DEFAULT_PATH, SIGDEF, TIOCSCTTY, TIOCSWINSZ, WINSZ, ExecFailed, errcode, now, set_nonblock
from guestd.session import InStream, OutStream, Req, Session
from guestd.users import resolve_user

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~30 ms of boot

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from guestd.agent import Agent

DRAIN_GRACE = 0.2  # after exit, wait this long for background holders of the pipes
EPOLLIN, EPOLLOUT = select.EPOLLIN, select.EPOLLOUT


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
        self.stdin = InStream(self, agent, -1, eof=True, tty=msg.tty)
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
        stdin_fd = -1
        if msg.tty:
            master, slave = os.openpty()
            fcntl.ioctl(master, TIOCSWINSZ, WINSZ.pack(msg.rows, msg.cols, 0, 0))
            stdio = (slave, slave, slave)
            child_fds.append(slave)
            set_nonblock(master)
            self.outs.append(OutStream(self, P.STDOUT, master))
            if msg.stdin:
                stdin_fd = master
        else:
            if msg.stdin:
                rin, win = os.pipe()
                set_nonblock(win)
                stdin_fd = win
                child_fds.append(rin)
            else:
                rin = os.open("/dev/null", os.O_RDONLY)
                child_fds.append(rin)
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
            if stdin_fd >= 0 and not msg.tty:
                os.close(stdin_fd)
            self.outs = []
            raise
        finally:
            for fd in child_fds:
                os.close(fd)
        self.stdin = InStream(self, self.agent, stdin_fd, eof=stdin_fd < 0, tty=msg.tty)
        self.agent.procs[self.pid] = self
        for s in self.outs:
            self.agent.watch(s.fd, EPOLLIN, self.on_out_event(s))
        self.stdin.watch()
        self.update()

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
        self.send(P.Eof(rid=self.rid, ch=s.ch))
        self.maybe_finish()

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
        self.send(P.Exit(rid=self.rid, code=code, signal=sig, timed_out=self.timed_out))
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


def which(name: str, env: dict[str, str]) -> str:
    """Resolve argv[0] on the command's own PATH (not guestd's), like execvp would."""
    if "/" in name:
        return name
    for d in env.get("PATH", DEFAULT_PATH).split(":"):
        p = f"{d or '.'}/{name}"
        if os.access(p, os.X_OK) and not os.path.isdir(p):
            return p
    raise ExecFailed(P.E_NOT_FOUND, f"exec {name!r}: executable file not found in $PATH")


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
                setsigdef=SIGDEF,
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
            for sig in SIGDEF:
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
