"""Hand PID 1 to the image's own init (systemd, tini, s6, ...); imported lazily (only
sandboxes created with an init pay for it).

guestd boots as PID 1 and does the boot-time set-up the host asks for (mounts, network,
volumes, patches, ...). Then the host sends HandOff: guestd forks; the parent, PID 1,
execs the init; the child goes on as guestd with everything it holds (the channel's
port and vsock listener, the epoll set, the sessions): all of it is one set of open
file descriptions, and the parent's copies are close-on-exec, so the exec leaves exactly
one owner of each. Nothing runs in guestd at that point but guestd (the host hands off
before the sandbox is ready, and a request with a process still running is refused):
its children after the fork are its own, orphans go to the init, as on any system.

Stop and kill: guestd, no longer PID 1, does not power off itself (boot.poweroff refuses
anywhere but PID 1); it asks the init, by the signal the init takes for it
(:data:`POWEROFF`), and the host's ladder (QMP quit, then kill) follows after its grace.
The init's own shutdown ends guestd with the other processes (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import _signal as signal  # the C module: 'signal' pulls in enum (~20 ms of boot)
import os

from guestd import proto
from guestd.common import DEFAULT_PATH, ExecFailed, log, read_text

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~30 ms of boot

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

# inits known by name at the start of an ENTRYPOINT (Init.Auto): the binary's name
KNOWN_INITS = frozenset(
    {
        "systemd",
        "init",
        "tini",
        "tini-static",
        "dumb-init",
        "catatonit",
        "s6-svscan",
        "runit",
        "runit-init",
        "openrc-init",
        "docker-init",
    }
)
# where Init.Auto looks in the guest when the ENTRYPOINT does not start with an init
PROBE = ("/sbin/init", "/lib/systemd/systemd", "/usr/lib/systemd/systemd")
SYSTEMD, OTHER = "systemd", "other"
SIGRTMIN = getattr(signal, "SIGRTMIN", 34)
# how each kind of init is asked to power off or reboot. systemd: SIGRTMIN+4 starts
# poweroff.target and SIGRTMIN+5 reboot.target (SIGRTMIN+3, halt.target, is a
# container runtime's stop signal: in a VM a halt leaves the machine running, so the
# host would wait its whole grace); any other init: SIGTERM, as a container runtime sends
POWEROFF = {SYSTEMD: SIGRTMIN + 4, OTHER: signal.SIGTERM}
REBOOT = {SYSTEMD: SIGRTMIN + 5, OTHER: signal.SIGTERM}
MAX_ARGS = 256
MAX_ENV = 256
# set in guestd once its parent, PID 1, exec'd the init: the one state in which guestd
# signals PID 1 (anywhere else, on a host running guestd for a test, PID 1 is the host's)
HANDED_OFF = [False]


def is_init(path: str) -> bool:
    """``path`` names a known init (by its file name)."""
    return os.path.basename(path) in KNOWN_INITS or path == "/init"


def choose(
    path: str, args: list[str], workload: list[str], exists: Callable[[str], bool]
) -> tuple[str, list[str], bool]:
    """The init to exec: (path, argv after argv[0], whether it runs the workload).

    ``path`` "" or "auto" is Init.Auto: a workload (what the sandbox would start: the
    image's Entrypoint + Cmd, or the Create's cmd under that Entrypoint) that starts
    with a known init gives that init, with the rest of the workload as its arguments
    (tini -- app, or a systemd image's CMD /lib/systemd/systemd: the init runs the
    workload); else the first of :data:`PROBE` that ``exists`` (then ``args`` are its
    arguments)."""
    if path not in ("", "auto"):
        return path, list(args), False
    if workload and is_init(workload[0]) and exists(workload[0]):
        return workload[0], [*workload[1:], *args], True
    for p in PROBE:
        if exists(p):
            return p, list(args), False
    raise ExecFailed(proto.E_NOT_FOUND, f"Init.Auto: no init in the image (looked for {', '.join(PROBE)})")


def kind(path: str) -> str:
    """systemd (/sbin/init is usually a link to it) or any other init."""
    try:
        real = os.path.realpath(path)
    except OSError:
        real = path
    return SYSTEMD if os.path.basename(real) == "systemd" else OTHER


def executable(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_mode & 0o170000) == 0o100000 and os.access(path, os.X_OK)


def machine_id() -> None:
    """A machine-id of its own for systemd, when the image has none (an empty file or
    "uninitialized", as image builders leave it): systemd would otherwise take the boot
    as the first one (ConditionFirstBoot units, systemd-firstboot's prompts on the
    console) and every sandbox of one image would share an id."""
    path = "/etc/machine-id"
    try:
        with open(path) as f:
            current = f.read().strip()
    except OSError:
        current = ""
    if len(current) == 32 and current != "uninitialized":
        return
    try:
        with open(path, "w") as f:
            f.write(os.urandom(16).hex() + "\n")
    except OSError as exc:  # a read-only /etc: systemd makes a transient one
        log(f"machine-id: {exc.strerror}")


def no_console_getty() -> None:
    """Mask systemd's getty on the serial console, for this boot only (in /run, as
    ``systemctl mask --runtime`` does): the console is the host's log of the guest (the
    sandbox is reached through guestd), and without udev in the image systemd would
    wait 90 s for the console's device unit before giving the getty up."""
    words = read_text("/proc/cmdline").split()
    consoles = [w[8:].partition(",")[0] for w in words if w.startswith("console=")]
    for name in consoles:
        if not name.startswith("tty") or name[3:].isdigit():  # (a VT: no serial getty)
            continue
        d = "/run/systemd/system"
        try:
            os.makedirs(d, exist_ok=True)
            os.symlink("/dev/null", f"{d}/serial-getty@{name}.service")
        except OSError as exc:
            log(f"serial-getty@{name}: not masked: {exc.strerror}")


def environ(extra: dict[str, str]) -> dict[str, str]:
    """The init's environment: what the kernel gives an init, then the caller's."""
    return {"HOME": "/", "TERM": "linux", "PATH": DEFAULT_PATH, **extra}


def hand_off(procs: int, msg: proto.HandOff) -> tuple[str, str, bool]:
    """Fork; PID 1 execs the init, the caller goes on as its child. Returns (path, kind,
    runs_workload) in the child; never returns in PID 1 unless the exec failed, which
    raises there (the child exits then, and PID 1 stays guestd)."""
    if os.getpid() != 1:
        raise ExecFailed(proto.E_FAILED, "hand-off: guestd is not PID 1 (handed off already)")
    if procs:
        raise ExecFailed(proto.E_FAILED, f"hand-off: {procs} process(es) of guestd still running")
    if len(msg.args) > MAX_ARGS or len(msg.env) > MAX_ENV:
        raise ExecFailed(proto.E_INVALID, f"hand-off: at most {MAX_ARGS} arguments and {MAX_ENV} variables")
    path, args, runs_workload = choose(msg.path, msg.args, msg.workload, executable)
    if not path.startswith("/"):
        raise ExecFailed(proto.E_INVALID, f"init {path!r}: an absolute path in the guest")
    if not executable(path):
        raise ExecFailed(proto.E_NOT_FOUND, f"init {path}: no executable file there")
    k = kind(path)
    if k == SYSTEMD:
        machine_id()
        no_console_getty()
    env = environ(msg.env)
    # every descriptor but the console's is guestd's alone: close-on-exec (Python's
    # own are; this also covers one a library left inheritable)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass
    # the child learns whether the exec happened: EOF (the write end closed on exec),
    # or the errno of a failed exec
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        failed = os.read(r, 64)
        os.close(r)
        if failed:  # PID 1 is still guestd: this copy goes
            os._exit(0)
        HANDED_OFF[0] = True
        return path, k, runs_workload
    os.close(r)
    # caught signals go back to their defaults on exec, an ignored one stays ignored
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        os.chdir("/")
        os.execve(path, [path, *args], env)
    except OSError as exc:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        os.write(w, str(exc.errno).encode())
        os.close(w)
        os.waitpid(pid, 0)
        raise ExecFailed(proto.errcode(exc), f"init {path}: exec failed: {exc.strerror}") from None
    raise AssertionError("unreachable")


def takes(sig: int) -> bool:
    """PID 1 takes ``sig`` now: it has a handler for it, or blocks it (systemd and tini
    read their signals from a signalfd or sigtimedwait). Before that, the kernel drops a
    signal to PID 1 that it would otherwise die of: an init just exec'd is asked again."""
    for line in read_text("/proc/1/status").splitlines():
        key, _, value = line.partition(":")
        if key in ("SigCgt", "SigBlk") and (int(value.strip() or "0", 16) >> (sig - 1)) & 1:
            return True
    return False


def ask_init_to_stop(init_kind: str, reboot: bool) -> bool:
    """Ask the init for its own shutdown; False when it cannot take the request yet (ask
    again). Only in a guestd that handed PID 1 off (else refused, as boot.poweroff
    refuses: elsewhere PID 1 is not a guest's)."""
    if not HANDED_OFF[0]:
        raise RuntimeError("ask_init_to_stop: this guestd did not hand PID 1 off; refused")
    sig = (REBOOT if reboot else POWEROFF).get(init_kind, signal.SIGTERM)
    if not takes(sig):
        return False
    os.kill(1, sig)
    return True
