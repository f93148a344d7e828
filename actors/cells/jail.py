"""A jail per QEMU, after Firecracker's jailer: its own uid and gid, new namespaces,
``pivot_root`` into a root-owned directory holding only what QEMU opens by path, no
privileges, rlimits, a cgroup; everything else is handed over as file descriptors.

QEMU is started from a short-lived thread that has unshared its pid namespace for
children: QEMU is pid 1 of a new pid namespace *and* the supervisor's own child, so
its host pid is Popen's pid, its exit status is ours to reap, and a ``pidfd`` watches
it. The jail is entered by a small static C helper, ``sandvisor-jail-exec``
(``jail_exec.c``, built by the package build: actors/helpers.py), that Popen can
*vfork*; it makes the plan of syscalls :func:`_plan` computes, given as arguments::

    supervisor (Trio)          spawn thread                child (becomes QEMU, pid 1 of its pid ns)
    -----------------          ------------                -----------------------------------------
    build_jail(spec)           (dir, device nodes, socket dir; no mounts on the host)
    spawn(argv) ---to_thread-> unshare(CLONE_NEWPID)
                               Popen(helper + plan) -----> vfork, exec sandvisor-jail-exec
                               setns(our own pid ns)       write "0" to cgroup.procs (each controller)
                                                           unshare(NEWNS|NEWIPC|NEWUTS|NEWCGROUP|NEWNET)
                                                             or setns(a given netns)
                                                           / rprivate; bind jail (ro, nosuid); ro binds
                                                             (/usr); socket dir rw; proc (subset=pid)
                                                           hostname; lo up; pivot_root(., .); umount old /
                                                           setgroups, setresgid; drop the bounding set;
                                                           clear ambient; rlimits; setresuid; capset(0);
                                                           no_new_privs; umask 077; execve(QEMU)
                               <- EOF on the error pipe    (only pass_fds and stdio survive)
    <- JailedProcess(pid = QEMU's host pid, pidfd)
       ... wait() reaps; the caller removes the cgroup, then remove_jail()

Every mount is made inside the child's private mount namespace: the host sees a plain
directory, and the mounts vanish with QEMU, even when the supervisor is killed.

Measured on the dev machine (2 cores shared with other VMs, nested virtualization,
kernel 6.18; spawn to exit of /usr/bin/true, medians, see ``benchmarks/jail.py``): at
load ~1, plain ``open_process`` as another user 1.6-2 ms, a Python ``preexec_fn``
stage (removed) 4-4.4 ms; at load 7-13, plain 6-15 ms, the Python stage 15-31 ms (a
fork of the supervisor and Python in the child: page-table copies and copy-on-write
faults are dear under nested virtualization), the C helper 12 ms -- cheaper than
today's plain spawn, which forks too (``user=`` rules out vfork). The child's own
syscalls take ~1.3 ms, 0.7 of it the new network namespace. Rejected: util-linux
``unshare``+``sh``+``setpriv`` (15-28 ms), a Python stage-2 process (12-17 ms before
it does anything), the Python ``preexec_fn`` stage (Python in a forked copy of a
threaded process, and a second implementation of the plan to keep equal).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

# the identities a jail runs as, and the error every step here raises
from actors.cells.identities import Identity, JailError

log = logging.getLogger("sandvisor.jail")


# -- the jail's description ---------------------------------------------------------


class NetNS(enum.Enum):
    NEW = "new"  # an empty network namespace (loopback only)
    HOST = "host"  # the supervisor's own (no isolation: only for tests and comparisons)


@attrs.frozen
class Bind:
    """A host path visible in the jail at ``target`` (absolute, in-jail)."""

    source: Path
    target: str
    writable: bool = False


@attrs.frozen
class Rlimits:
    """Hard = soft. ``nproc`` counts QEMU's threads (its uid is its own): main, RCU,
    one per vCPU, up to 64 block I/O workers, migration."""

    nofile: int = 4096
    nproc: int = 256
    core: int = 0
    extra: tuple[tuple[int, int], ...] = ()  # (resource.RLIMIT_*, value)

    def items(self) -> tuple[tuple[int, int], ...]:
        return (
            (resource.RLIMIT_NOFILE, self.nofile),
            (resource.RLIMIT_NPROC, self.nproc),
            (resource.RLIMIT_CORE, self.core),
            *self.extra,
        )


WORLD_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def default_binds() -> tuple[Bind, ...]:
    """What QEMU's binary needs: /usr read-only (binary, libraries, firmware in
    share/qemu, accelerator modules in lib/.../qemu); /lib, /lib64, /bin become
    symlinks on merged-/usr hosts, read-only binds elsewhere."""
    binds = [Bind(Path("/usr"), "/usr")]
    for name in ("lib", "lib64", "bin"):
        p = Path("/") / name
        if p.is_dir() and not p.is_symlink():
            binds.append(Bind(p, f"/{name}"))
    return tuple(binds)


@attrs.frozen
class JailSpec:
    """Everything that decides one QEMU's jail."""

    identity: Identity
    root: Path  # the jail dir on the host: made by build_jail, the child's "/"
    binds: tuple[Bind, ...] = attrs.field(factory=default_binds)
    devices: tuple[str, ...] = ("/dev/null", "/dev/zero", "/dev/urandom")  # of WORLD_DEVICES, 0666
    kvm: bool = False  # /dev/kvm, owned by the identity inside the jail
    tun: bool = False  # /dev/net/tun, likewise (a tap QEMU opens itself; prefer fd=)
    socket_dir: str = "/run"  # in-jail, owned by the identity (0700): QMP, guest and port sockets
    netns: NetNS | Path = NetNS.NEW  # or a netns file (/run/netns/NAME) the network layer made
    loopback: bool = True  # bring "lo" up in a NEW netns (slirp hostfwd listens there)
    hostname: str = "sandbox"
    groups: tuple[int, ...] = ()  # supplementary groups (none: /dev/kvm in the jail is the uid's)
    rlimits: Rlimits = Rlimits()
    read_only_root: bool = True
    proc_subset_pid: bool = True  # /proc shows only processes (no /proc/sys, kcore, ...)
    # a tool's cell (actors/cells/toolcell.py): run as ``identity`` *inside* a user namespace
    # (spawn's ``userns_fd``, entered after pivot_root), keeping these capabilities there
    keep_caps: tuple[int, ...] = ()

    def host_path(self, in_jail: str | Path) -> Path:
        """Where an in-jail path is on the host (for the sockets QEMU makes)."""
        p = Path(in_jail)
        if not p.is_absolute():
            raise ValueError(f"{in_jail!r} is not an absolute in-jail path")
        return self.root / p.relative_to("/")

    @property
    def socket_host_dir(self) -> Path:
        return self.host_path(self.socket_dir)

    def all_devices(self) -> tuple[tuple[str, bool], ...]:
        """(host device path, owned by the identity?)"""
        odd = [d for d in self.devices if d not in WORLD_DEVICES]
        if odd:
            raise JailError(f"{', '.join(odd)}: only {', '.join(WORLD_DEVICES)} go in devices (kvm=, tun= for others)")
        devs = [(d, False) for d in self.devices]
        if self.kvm:
            devs.append(("/dev/kvm", True))
        if self.tun:
            devs.append(("/dev/net/tun", True))
        return tuple(devs)


# -- the jail directory ------------------------------------------------------------------


def check_root_dir(path: Path) -> None:
    """``path`` is a real directory, owned by us (root), writable by no one else."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise JailError(f"{path} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise JailError(f"{path} is not a directory (a symlink or a file): refusing it")
    if st.st_uid != os.geteuid():
        raise JailError(f"{path} is owned by uid {st.st_uid}, not by the supervisor: refusing it")
    if st.st_mode & 0o022:
        raise JailError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): refusing it")


def make_root_dir(path: Path, mode: int = 0o755) -> Path:
    """The directory jails are made in: created when missing (root's, ``mode``), then
    checked like :func:`check_root_dir`."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
        os.chmod(path, mode)
    check_root_dir(path)
    return path


def build_jail(spec: JailSpec) -> None:
    """Make the jail dir (which must not exist) in a parent only the supervisor can
    write: mount points for the binds, /proc, device nodes, the socket dir (the
    identity's, 0700), symlinks for merged /usr. Root-owned, nothing else in it."""
    root = spec.root
    check_root_dir(root.parent)
    try:
        os.mkdir(root, 0o755)
    except FileExistsError:
        raise JailError(f"jail dir {root} exists already (a stale jail: remove_jail it first)") from None
    try:
        os.chmod(root, 0o755)  # whatever the umask
        _populate(spec)
    except BaseException:
        with contextlib.suppress(JailError):
            remove_jail(root)
        raise


def _populate(spec: JailSpec) -> None:
    root = spec.root

    def mkdirs(rel: str, mode: int = 0o755) -> Path:
        p = root
        for part in Path(rel).relative_to("/").parts:
            p = p / part
            if not p.is_dir():
                os.mkdir(p, mode)
                os.chmod(p, mode)
        return p

    bound = set()
    for b in spec.binds:
        if not b.target.startswith("/") or ".." in Path(b.target).parts:
            raise JailError(f"bind target {b.target!r} must be an absolute path without '..'")
        if b.source.is_dir():
            mkdirs(b.target)
        else:
            mkdirs(str(Path(b.target).parent))
            os.close(os.open(spec.host_path(b.target), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644))
        bound.add(b.target)
    for name in ("lib", "lib64", "bin", "sbin"):
        host = Path("/") / name
        if f"/{name}" not in bound and host.is_symlink():
            target = os.readlink(host)
            if target.lstrip("/").startswith("usr/") and "/usr" in bound:
                os.symlink(target.lstrip("/"), root / name)
    mkdirs("/proc", 0o555)
    mkdirs("/dev")
    for dev, owned in spec.all_devices():
        try:
            st = os.stat(dev)
        except OSError as exc:
            raise JailError(f"device {dev}: {exc.strerror}") from None
        if not stat.S_ISCHR(st.st_mode):
            raise JailError(f"{dev} is not a character device")
        node = spec.host_path(dev)
        mkdirs(str(Path(dev).parent))
        mode = 0o600 if owned else 0o666
        os.mknod(node, stat.S_IFCHR | mode, st.st_rdev)
        os.chmod(node, mode)
        if owned:
            os.chown(node, spec.identity.uid, spec.identity.gid)
    sock = mkdirs(spec.socket_dir, 0o700)
    os.chown(sock, spec.identity.uid, spec.identity.gid)


def _mounts_below(root: Path) -> list[str]:
    prefix = str(root).rstrip("/") + "/"
    out = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            mp = line.split()[4].decode()
            mp = mp.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
            if mp == str(root) or mp.startswith(prefix):
                out.append(mp)
    return out


def remove_jail(root: Path) -> None:
    """Remove a jail dir (after its QEMU is reaped). Refuses when something is mounted
    under it in our namespace (never the case for jails made here): rmtree would
    follow into the mount."""
    if not root.exists() and not root.is_symlink():
        return
    mounted = _mounts_below(root)
    if mounted:
        raise JailError(f"refusing to remove {root}: mounted below it: {', '.join(mounted[:3])}")
    try:
        shutil.rmtree(root)  # fd-based on Linux: symlinks QEMU made are unlinked, not followed
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise JailError(f"cannot remove jail dir {root}: {exc}") from None


# -- syscalls ---------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000


def _last_cap() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 63


_LAST_CAP = _last_cap()


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


@attrs.frozen
class _Mount:
    source: bytes | None
    target: bytes
    fstype: bytes | None
    flags: int
    data: bytes | None
    what: str


@attrs.frozen
class _Plan:
    """What the helper does (its arguments: :func:`_plan_argv`), computed before the spawn."""

    cgroup_fds: tuple[int, ...]
    unshare: int
    netns_fd: int
    mounts: tuple[_Mount, ...]
    root: bytes
    hostname: bytes
    loopback: bool
    groups: tuple[int, ...]
    uid: int
    gid: int
    rlimits: tuple[tuple[int, int], ...]
    err_fd: int
    userns_fd: int = -1
    keep_caps: int = 0  # bit mask of capabilities kept (in the user namespace)


def _plan(spec: JailSpec, cgroup_fds: tuple[int, ...], netns_fd: int, err_fd: int, userns_fd: int = -1) -> _Plan:
    root = bytes(spec.root)
    m: list[_Mount] = [
        _Mount(None, b"/", None, MS_REC | MS_PRIVATE, None, "make / private"),
        _Mount(root, root, None, MS_BIND, None, "bind the jail dir"),
    ]
    for b in spec.binds:
        target = bytes(spec.host_path(b.target))
        m.append(_Mount(bytes(b.source), target, None, MS_BIND | MS_REC, None, f"bind {b.source}"))
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (0 if b.writable else MS_RDONLY)
        m.append(_Mount(None, target, None, flags, None, f"remount {b.target}"))
    # the jail's own files: read-only, no setuid; device nodes stay usable (not nodev)
    m.append(
        _Mount(
            None,
            root,
            None,
            MS_REMOUNT | MS_BIND | MS_NOSUID | (MS_RDONLY if spec.read_only_root else 0),
            None,
            "remount /",
        )
    )
    sock = bytes(spec.socket_host_dir)
    m.append(_Mount(sock, sock, None, MS_BIND, None, "bind the socket dir"))
    m.append(_Mount(None, sock, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC, None, "remount sockets"))
    m.append(
        _Mount(
            b"proc",
            root + b"/proc",
            b"proc",
            MS_NOSUID | MS_NODEV | MS_NOEXEC,
            b"subset=pid" if spec.proc_subset_pid else None,
            "mount /proc",
        )
    )
    flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    if spec.netns is NetNS.NEW:
        flags |= CLONE_NEWNET
    return _Plan(
        cgroup_fds=cgroup_fds,
        unshare=flags,
        netns_fd=netns_fd,
        mounts=tuple(m),
        root=root,
        hostname=spec.hostname.encode(),
        loopback=spec.loopback and spec.netns is NetNS.NEW,
        groups=spec.groups,
        uid=spec.identity.uid,
        gid=spec.identity.gid,
        rlimits=spec.rlimits.items(),
        err_fd=err_fd,
        userns_fd=userns_fd,
        keep_caps=sum(1 << c for c in set(spec.keep_caps)),
    )


_OWN_PID_NS: int | None = None


def _own_pid_ns() -> int:
    global _OWN_PID_NS
    if _OWN_PID_NS is None:
        _OWN_PID_NS = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    return _OWN_PID_NS


def _popen_in_new_pid_ns(argv: list[str], kwargs: dict[str, Any]) -> subprocess.Popen[bytes]:
    """Popen from a fresh thread whose children start a new pid namespace. The thread
    is ours and dies after: a thread whose pid namespace for children could not be
    reset is never reused."""
    own = _own_pid_ns()
    result: list[subprocess.Popen[bytes] | BaseException] = []

    def run() -> None:
        try:
            _check(_libc.unshare(CLONE_NEWPID), "unshare the pid namespace")
        except BaseException as exc:
            result.append(exc)
            return
        try:
            result.append(subprocess.Popen(argv, **kwargs))
        except BaseException as exc:
            result.append(exc)
        finally:
            if _libc.setns(own, CLONE_NEWPID) != 0:
                log.error("spawn thread: cannot return to our pid namespace (the thread ends anyway)")

    t = threading.Thread(target=run, name="sandvisor-jail-spawn")
    t.start()
    t.join()
    out = result[0]
    if isinstance(out, BaseException):
        raise out
    return out


class JailedProcess:
    """A jailed QEMU: our child (reaped here), pid 1 of its own pid namespace. Offers
    what :class:`trio.Process` offers that ``Machine`` uses, plus the ``pidfd``."""

    def __init__(self, popen: subprocess.Popen[bytes], stderr: trio.lowlevel.FdStream | None) -> None:
        self._popen = popen
        self.pid: int = popen.pid
        self.args = popen.args
        self.stderr = stderr
        self.pidfd: int = os.pidfd_open(popen.pid)
        self._wait_lock = trio.Lock()

    @property
    def returncode(self) -> int | None:
        if self._popen.returncode is None:
            self._popen.poll()  # reaps if it exited (never blocks)
        return self._popen.returncode

    def poll(self) -> int | None:
        return self.returncode

    async def wait(self) -> int:
        async with self._wait_lock:
            if self._popen.returncode is None and self.pidfd >= 0:
                await trio.lowlevel.wait_readable(self.pidfd)
            rc = self._popen.wait()  # exited: reaps at once
            self._close_pidfd()
            return rc

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            signal.pidfd_send_signal(self.pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _close_pidfd(self) -> None:
        if self.pidfd >= 0:
            fd, self.pidfd = self.pidfd, -1
            with contextlib.suppress(OSError):
                trio.lowlevel.notify_closing(fd)
            os.close(fd)

    def __repr__(self) -> str:
        rc = self._popen.returncode
        return f"<JailedProcess pid {self.pid} {'running' if rc is None else f'exited {rc}'}>"


def _resolve(argv0: str, spec: JailSpec) -> str:
    exe = shutil.which(argv0) if "/" not in argv0 else argv0
    if exe is None:
        raise JailError(f"{argv0}: not found")
    real = Path(os.path.realpath(exe))
    for b in spec.binds:
        src = Path(os.path.realpath(b.source))
        if real == src or src in real.parents:
            return str(Path(b.target) / real.relative_to(src)) if real != src else b.target
    raise JailError(f"{exe} is outside every bind of the jail ({', '.join(str(b.source) for b in spec.binds)})")


def _plan_argv(plan: _Plan) -> list[str]:
    """The plan as sandvisor-jail-exec's arguments (see jail_exec.c)."""
    a = ["--err-fd", str(plan.err_fd)]
    for fd in plan.cgroup_fds:
        a += ["--cgroup-fd", str(fd)]
    if plan.netns_fd >= 0:
        a += ["--netns-fd", str(plan.netns_fd)]
    a += ["--unshare", hex(plan.unshare)]
    for m in plan.mounts:
        a += ["--mount", os.fsdecode(m.source or b""), os.fsdecode(m.target), os.fsdecode(m.fstype or b"")]
        a += [str(m.flags), os.fsdecode(m.data or b"")]
    a += ["--hostname", plan.hostname.decode(), "--root", os.fsdecode(plan.root)]
    if plan.loopback:
        a.append("--lo")
    if plan.groups:
        a += ["--groups", ",".join(map(str, plan.groups))]
    if plan.userns_fd >= 0:
        a += ["--userns-fd", str(plan.userns_fd)]
    if plan.keep_caps:
        a += ["--keep-caps", hex(plan.keep_caps)]
    a += ["--gid", str(plan.gid), "--uid", str(plan.uid), "--last-cap", str(_LAST_CAP)]
    for res, value in plan.rlimits:
        a += ["--rlimit", str(res), str(value)]
    return a


def _read_all(fd: int) -> str:
    out = b""
    while chunk := os.read(fd, 4096):
        out += chunk
    return out.decode(errors="replace")


def _start(cmd: list[str], kwargs: dict[str, Any], errpipe: list[int]) -> tuple[subprocess.Popen[bytes] | None, str]:
    """In a worker thread: Popen in a new pid namespace, then wait for the helper's
    final exec: EOF on the error pipe without a word. Closes the pipe's write end."""
    try:
        popen = _popen_in_new_pid_ns(cmd, kwargs)
    except (OSError, subprocess.SubprocessError) as exc:
        os.close(errpipe[1])
        errpipe[1] = -1
        return None, _read_all(errpipe[0]) or f"start: {exc}"
    os.close(errpipe[1])
    errpipe[1] = -1
    detail = _read_all(errpipe[0])
    if detail:
        popen.wait()
        return None, detail
    return popen, ""


async def spawn(
    argv: Sequence[str],
    spec: JailSpec,
    *,
    pass_fds: Iterable[int] = (),
    cgroup_procs: Sequence[Path] = (),
    stdin: int | None = subprocess.DEVNULL,
    stdout: int | None = subprocess.DEVNULL,
    stderr_pipe: bool = True,
    stderr_fd: int | None = None,
    env: Mapping[str, str] | None = None,
    helper: Path,
    userns_fd: int = -1,
) -> JailedProcess:
    """Start ``argv`` inside the jail ``spec`` (built by :func:`build_jail`), joined to
    the cgroups whose ``cgroup.procs`` files are given before it runs a line of its
    own. ``argv[0]`` is looked up on the host and must lie under a bind. Only
    ``pass_fds`` (and stdio) reach it. ``helper``: sandvisor-jail-exec (as built at
    install: ``helpers.installed(helpers.JAIL_EXEC)``), which enters the jail,
    vforked. Returns once
    ``argv`` runs; raises :class:`JailError` naming the step that failed. The caller
    owns the process: it must be waited for (reaped). ``stderr_fd``: the process's
    stderr (a log file), instead of a pipe to us. ``userns_fd``: a user namespace (a
    tool's cell, actors/cells/toolcell.py) entered after pivot_root: ``spec.identity`` and
    ``spec.keep_caps`` are then the namespace's."""
    if stderr_fd is not None:
        stderr_pipe = False
    args = [_resolve(argv[0], spec), *argv[1:]]
    opened: list[int] = []
    errpipe = [-1, -1]
    r_out = w_out = -1
    try:
        for p in cgroup_procs:
            opened.append(os.open(p, os.O_WRONLY | os.O_CLOEXEC))
        cgroup_fds = tuple(opened)
        netns_fd = -1
        if isinstance(spec.netns, Path):
            try:
                netns_fd = os.open(spec.netns, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise JailError(f"network namespace {spec.netns}: {exc.strerror}") from None
            opened.append(netns_fd)
        errpipe[:] = os.pipe2(os.O_CLOEXEC)
        if stderr_pipe:
            r_out, w_out = os.pipe2(os.O_CLOEXEC)
        plan = _plan(spec, cgroup_fds, netns_fd, errpipe[1], userns_fd)
        kwargs: dict[str, Any] = {
            "stdin": stdin,
            "stdout": stdout,
            "stderr": w_out if stderr_pipe else (stderr_fd if stderr_fd is not None else subprocess.DEVNULL),
            "close_fds": True,
            "start_new_session": True,  # a ^C to the supervisor must not reach QEMU
            "env": dict(env) if env is not None else {},
        }
        cmd = [str(helper), *_plan_argv(plan), "--", *args]
        kwargs["pass_fds"] = (*pass_fds, *opened, errpipe[1], *((userns_fd,) if userns_fd >= 0 else ()))
        popen, detail = await trio.to_thread.run_sync(_start, cmd, kwargs, errpipe)
        if popen is None:
            raise JailError(f"entering the jail failed at {detail}")
        stream = None
        if stderr_pipe:
            os.set_blocking(r_out, False)
            stream = trio.lowlevel.FdStream(r_out)
            r_out = -1
        try:
            return JailedProcess(popen, stream)
        except OSError:
            popen.kill()
            popen.wait()
            raise
    finally:
        for fd in (*opened, *errpipe, r_out, w_out):
            if fd >= 0:
                os.close(fd)


async def socket_in_netns(
    proc: JailedProcess | int, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM
) -> socket.socket:
    """A socket that lives in the network namespace of a jailed QEMU (a
    :class:`JailedProcess`: entered by its pidfd, no pid reuse race; or a pid): the
    supervisor's way to reach what listens inside the jail (slirp's hostfwd listens on
    the jail's loopback, which the host cannot reach). Made in a short-lived thread
    that enters the namespace; the socket stays in it after the thread returns."""

    def make() -> socket.socket:
        out: list[socket.socket | BaseException] = []

        def run() -> None:
            try:
                if isinstance(proc, JailedProcess):
                    if proc.pidfd < 0:
                        raise JailError(f"process {proc.pid} has exited")
                    target = os.dup(proc.pidfd)  # setns(pidfd, CLONE_NEWNET): Linux 5.8+
                else:
                    target = os.open(f"/proc/{proc}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                out.append(exc)
                return
            except JailError as exc:
                out.append(exc)
                return
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _check(_libc.setns(target, CLONE_NEWNET), "enter the jail's network namespace")
                try:
                    out.append(socket.socket(family, type))
                finally:
                    _check(_libc.setns(own, CLONE_NEWNET), "return to our network namespace")
            except BaseException as exc:
                out.append(exc)
            finally:
                os.close(target)
                os.close(own)

        t = threading.Thread(target=run, name="sandvisor-netns")
        t.start()
        t.join()
        res = out[0]
        if isinstance(res, BaseException):
            raise res
        return res

    return await trio.to_thread.run_sync(make)
