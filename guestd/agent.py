"""guestd: the in-guest agent. Runs as PID 1 of the microVM (stdlib + msgpack only).

This module is the event loop and the dispatch of host messages; boot and power-off
are boot.py's, the rest has one module per concern (listed in common.py). Boot pays
for what is imported here; files.py and workers.py (and tree, fsops, netcfg) are
imported at the first request that needs them.

One single-threaded epoll loop serves everything: the virtio-serial port (and
AF_VSOCK connections where the guest has a vsock transport), child process
pipes and PTYs, SIGCHLD (PID 1 reaps every zombie), timers. Every byte stream
is flow-controlled by credit (see proto.py, session.py): a flooding process is
simply not read while its stream has no credit, so neither side buffers without
bound.
"""

from __future__ import annotations

import _signal as signal  # the C module: 'signal' pulls in enum (~20 ms of boot)
import os
import select
import time

from guestd import boot, proto, system
from guestd.common import (
    DEFAULT_PATH,  # (re-exported: tests/support/fakeguest.py)
    T_START,
    ExecFailed,
    errcode,
    log,
    now,
    set_nonblock,
)
from guestd.exec import Proc
from guestd.session import Conn, Session

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~30 ms of boot

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from guestd.files import FileReader
    from guestd.freeze import Freezer
    from guestd.oom import OomWatch
    from guestd.workers import Worker

__all__ = ["DEFAULT_PATH", "Agent", "ExecFailed", "entry", "errcode", "main"]

ROOT_FD = -1  # the initramfs root, kept open across the chroot
# A port whose host went away sits in epoll edge-triggered: the driver wakes the port's
# wait queue when the host reconnects (VIRTIO_CONSOLE_PORT_OPEN) and that edge brings
# it back at once. (A 10 ms poll did before: ~5 ms of every reconnect, and a Python
# wakeup every 10 ms of an idle guest with no host.) This is only the safety net.
AWAY_POLL = 1.0
INIT_POLL = 0.05  # a shutdown the init cannot take yet (it is starting) is asked again this often

EPOLLIN, EPOLLOUT = select.EPOLLIN, select.EPOLLOUT
EPOLLERR, EPOLLHUP, EPOLLET = select.EPOLLERR, select.EPOLLHUP, select.EPOLLET


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
        self.timers: set[Proc | Freezer] = set()
        self.runnable: set[FileReader] = set()
        self.activity = 0
        self.hostname = cmdline.get("sandvisor.hostname", "sandbox")
        self.shutting_down: bool | None = None
        self.vsock_fd = -1
        self.deferred_loaded = False
        self.dirty: set[Conn] = set()  # connections with output to write at the end of this turn
        self.mounts: list[str] = []  # what mount requests mounted, unmounted (last first) at power-off
        self.path_extra = ""  # appended to every exec's PATH (guestd/shape.py)
        self.restricted = False  # every exec with no_new_privs (guestd/shape.py)
        self.init_kind = ""  # handed off: the kind of init that is PID 1 now (guestd/initsys.py)
        self.exiting = False  # handed off and told to end (the init's shutdown): no power-off of ours
        self.init_stop: bool | None = None  # handed off: a shutdown (reboot?) the init has yet to be asked for
        self.freezer: Freezer | None = None  # file systems frozen for a capture (guestd/freeze.py)
        self.oom: OomWatch | None = None  # the kernel log, read for OOM kills (guestd/oom.py)

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
                req.resume()

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
    def dispatch(self, conn: Conn, msg: proto.Message) -> None:
        if isinstance(msg, proto.Hello):
            if conn.session is not None:
                conn.session.close()
            conn.session = Session(conn)
            conn.out += proto.GUEST_SYNC
            if self.freezer is not None and self.freezer.frozen:
                # a restore of a state saved frozen, or a new supervisor: the freeze's host is gone
                self.freezer.thaw()
            if msg.host_time_ns and self.cmdline.get("sandvisor.setclock", "1") == "1":
                system.set_clock(msg.host_time_ns)
            conn.send(
                proto.HelloOk(
                    version=proto.PROTOCOL_VERSION,
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
                        "fs",
                        "resources",
                        "init",
                        "freeze",
                        "oom",
                        "vsock" if self.vsock_fd >= 0 else "serial",
                    ],
                )
            )
            if not self.deferred_loaded:
                self.deferred_loaded = True
                boot.load_deferred_modules(self.root_fd)
                self.watch_oom()
            return
        session = conn.session
        if session is None:
            raise proto.BadMessage(f"{msg.TAG} before hello")
        rid = getattr(msg, "rid", None)
        try:
            self.handle(session, msg)
        except proto.ProtocolError:
            raise
        except ExecFailed as exc:
            session.send(proto.Error(rid=rid or 0, code=exc.code, message=exc.message))
        except LookupError as exc:
            session.send(proto.Error(rid=rid or 0, code=proto.E_INVALID, message=str(exc.args[0])))
        except OSError as exc:
            session.send(proto.Error(rid=rid or 0, code=errcode(exc), message=f"{exc.strerror}"))
        except Exception as exc:  # a bug here must not kill PID 1
            log(f"internal error on {msg.TAG}: {type(exc).__name__}: {exc}")
            session.send(proto.Error(rid=rid or 0, code=proto.E_INTERNAL, message=f"{type(exc).__name__}: {exc}"))

    def handle(self, session: Session, msg: proto.Message) -> None:
        if isinstance(msg, (proto.Data, proto.Eof, proto.Credit, proto.Resize, proto.Signal)):
            req = session.reqs.get(msg.rid)
            if req is None:
                return  # finished meanwhile: late stream traffic is harmless
            if isinstance(msg, proto.Data):
                req.on_data(msg.ch, msg.data)
            elif isinstance(msg, proto.Eof):
                req.on_eof(msg.ch)
            elif isinstance(msg, proto.Credit):
                req.on_credit(msg.ch, msg.n)
            elif isinstance(msg, proto.Resize):
                req.on_resize(msg.rows, msg.cols)
            else:
                req.on_signal(msg.signum)
            return
        rid = getattr(msg, "rid", 0)
        if rid in session.reqs:
            raise proto.BadMessage(f"request id {rid} already in use")
        if isinstance(msg, proto.Ping):
            session.send(proto.Pong(rid=rid, activity=self.activity, guest_ns=time.time_ns()))
        elif isinstance(msg, proto.Touch):
            self.activity += 1
            session.send(proto.Ok(rid=rid, activity=self.activity))
        elif isinstance(msg, proto.Exec):
            self.activity += 1
            proc = Proc(self, session, msg)
            proc.start(msg)
            session.reqs[rid] = proc
            session.send(proto.ExecStarted(rid=rid, pid=proc.pid))
        elif isinstance(msg, (proto.ReadFile, proto.WriteFile)):
            from guestd import files  # lazy: boot never pays for it

            if isinstance(msg, proto.ReadFile):
                files.read_file(self, session, msg)
            else:
                files.write_file(session, msg)
        elif isinstance(msg, proto.Metrics):
            session.send(system.metrics(rid))
        elif isinstance(msg, proto.SetClock):
            system.set_clock(msg.realtime_ns)
            session.send(proto.Ok(rid=rid))
        elif isinstance(msg, proto.AddEntropy):
            system.add_entropy(msg.data)
            session.send(proto.Ok(rid=rid))
        elif isinstance(msg, proto.SetHostname):
            self.set_hostname(msg.hostname)
            session.send(proto.Ok(rid=rid))
        elif isinstance(msg, proto.SetCpus):
            session.send(proto.Ok(rid=rid, value=system.set_cpus(msg.online)))
        elif isinstance(msg, proto.GrowRoot):
            session.send(proto.Ok(rid=rid, value=system.grow_root(self.cmdline.get("sandvisor.root", "/dev/vda"))))
        elif isinstance(msg, (proto.ReadTree, proto.WriteTree, proto.Patch, proto.Mount, proto.Umount, proto.Fs)):
            from guestd import workers  # lazy: boot never pays for it

            if isinstance(msg, proto.ReadTree):
                workers.read_tree(self, session, msg)
            elif isinstance(msg, proto.WriteTree):
                workers.write_tree(self, session, msg)
            elif isinstance(msg, proto.Patch):
                workers.patch(self, session, msg)
            elif isinstance(msg, proto.Mount):
                workers.mount(self, session, msg)
            elif isinstance(msg, proto.Fs):
                workers.fs(self, session, msg)
            else:
                workers.umount(self, session, msg)
        elif isinstance(msg, proto.NetConfig):
            self.net_config(msg)
            session.send(proto.Ok(rid=rid))
        elif isinstance(msg, proto.TrustCa):
            from guestd import trust  # lazy: only sandboxes with secrets pay the import

            try:
                trust.install(msg.pem)
            except ValueError as exc:
                raise ExecFailed(proto.E_INVALID, f"trust_ca: {exc}") from None
            session.send(proto.Ok(rid=rid))
        elif isinstance(msg, proto.Configure):
            from guestd import shape  # lazy: only sandboxes with a shape of their own pay the import

            shape.configure(self, msg)
            session.send(proto.Ok(rid=rid))
        elif isinstance(msg, proto.HandOff):
            from guestd import initsys  # lazy: only sandboxes with an init pay the import

            path, kind, runs_workload = initsys.hand_off(len(self.procs), msg)
            self.init_kind = kind  # (the child, from here on: PID 1 is the init)
            log(f"PID 1 is {path} now ({kind}); guestd goes on as {os.getpid()}")
            session.send(proto.HandOffOk(rid=rid, path=path, kind=kind, pid=os.getpid(), workload=runs_workload))
        elif isinstance(msg, (proto.Freeze, proto.Thaw)):
            self.freeze(session, msg)
        elif isinstance(msg, proto.Shutdown):
            session.send(proto.Ok(rid=rid))
            if self.init_kind:  # the init shuts down (and ends guestd on its way)
                for conn in self.conns.values():
                    if conn.out:
                        boot.drain_blocking(conn)
                os.sync()
                self.init_stop = msg.reboot
                self.stop_init()
            else:
                self.shutting_down = msg.reboot
        else:
            raise proto.BadMessage(f"unexpected {msg.TAG} from host")

    # -- operations ------------------------------------------------------------
    def stop_init(self) -> None:
        """Ask the init for its shutdown, once it can take the signal (polled meanwhile)."""
        from guestd import initsys

        if self.init_stop is not None and initsys.ask_init_to_stop(self.init_kind, self.init_stop):
            self.init_stop = None

    def set_hostname(self, name: str) -> None:
        system.set_hostname(name)
        self.hostname = name

    def net_config(self, msg: proto.NetConfig) -> None:
        from guestd import netcfg  # lazy: only restores of networked sandboxes pay the import

        try:
            netcfg.configure(msg.iface, msg.address, msg.prefix, msg.gateway, msg.mac, msg.dns)
        except ValueError as exc:
            raise ExecFailed(proto.E_INVALID, f"net_config: {exc}") from None

    def freeze(self, session: Session, msg: proto.Freeze | proto.Thaw) -> None:
        from guestd.freeze import Freezer  # lazy: only captures pay the import

        if self.freezer is None:
            self.freezer = Freezer()
        if isinstance(msg, proto.Freeze):
            n = self.freezer.freeze(msg.timeout)
            if n:
                self.timers.add(self.freezer)
        else:
            n = self.freezer.thaw()
        session.send(proto.Ok(rid=msg.rid, value=n))

    def watch_oom(self) -> None:
        """Read the kernel log for OOM kills from now on (from the first hello: boot never pays)."""
        from guestd.oom import OomWatch

        try:
            self.oom = OomWatch()
        except OSError as exc:
            log(f"oom watch: {exc}")
            return
        self.watch(self.oom.fd, EPOLLIN, lambda _ev: self.read_oom())

    def read_oom(self) -> None:
        """Report the OOM kills the kernel logged since the last look to the host."""
        oom = self.oom
        if oom is None:
            return
        try:
            kills = oom.drain()
        except OSError as exc:
            log(f"oom watch: {exc}; stopped")
            self.unwatch(oom.fd)
            oom.close()
            self.oom = None
            return
        for kill in kills:
            for conn in self.conns.values():
                if conn.session is not None:
                    conn.session.send(kill)

    def oom_victim(self, pid: int) -> bool:
        """``pid`` (just reaped, killed by SIGKILL) was the OOM killer's: the log read first."""
        self.read_oom()
        return self.oom is not None and self.oom.was_victim(pid)

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
            if (signal.SIGTERM in sigs or signal.SIGINT in sigs) and self.init_kind:
                self.exiting = True  # the init's shutdown ends every process: guestd too
            elif signal.SIGTERM in sigs or signal.SIGINT in sigs:
                self.shutting_down = False  # ctrl-alt-del / ACPI-ish requests: power off

        self.watch(rsig, EPOLLIN, on_signal)
        self.reap()
        while self.shutting_down is None and not self.exiting:
            timeout = -1.0
            if self.runnable:
                timeout = 0.0
            elif any(c.away for c in self.conns.values()):
                timeout = AWAY_POLL
            if self.init_stop is not None:
                timeout = INIT_POLL if timeout < 0 else min(timeout, INIT_POLL)
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
                        r.send(proto.Error(rid=r.rid, code=errcode(exc), message=str(exc.strerror)))
                        r.close()
            if self.timers:
                t = now()
                for p in list(self.timers):
                    p.tick(t)
                    if p.done or p.next_deadline() == float("inf"):
                        self.timers.discard(p)
            if any(c.away for c in self.conns.values()):
                self.check_away()
            if self.init_stop is not None:
                self.stop_init()
            while self.dirty:
                self.dirty.pop().flush()
        for conn in self.conns.values():
            if conn.out:
                boot.drain_blocking(conn)
        if self.freezer is not None:  # (power-off syncs and unmounts: a frozen one would hang it)
            self.freezer.thaw()
        if self.exiting:
            return  # PID 1 is the init: it powers off
        boot.poweroff(self.root_fd, bool(self.shutting_down), self.mounts)


def main() -> None:
    cmdline = boot.read_cmdline()
    marks = boot.boot_marks()
    port_dev = boot.find_port(cmdline.get("sandvisor.port", boot.PORT_NAME))
    port_fd = os.open(port_dev, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK) if port_dev else -1
    listener = None
    if os.path.exists("/dev/vsock"):
        try:
            listener = boot.open_vsock(int(cmdline.get("sandvisor.vsock_port", boot.VSOCK_PORT)))
        except OSError as exc:
            log(f"vsock listener: {exc}")
    global ROOT_FD
    root_fd = ROOT_FD = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    boot.enter_sysroot(root_fd)
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
