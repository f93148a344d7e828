"""Paths and defaults of the supervisor, from the environment and the invoking user."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeRuntimeDir(RuntimeError):
    """The runtime dir (sockets of a non-root supervisor) is someone else's or open to others."""


def runtime_dir() -> Path:
    """Where the supervisor's sockets live: /run/sandvisor for root; for anyone else
    ``$XDG_RUNTIME_DIR/sandvisor`` (systemd makes that 0700 for its user), else
    ``/tmp/sandvisor-<uid>/sandvisor`` -- a predictable name in a shared directory,
    which :func:`claim_runtime_dir` makes or checks before it is used."""
    if os.geteuid() == 0:
        return Path("/run/sandvisor")
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/sandvisor-{os.geteuid()}"
    return Path(runtime) / "sandvisor"


def default_socket() -> Path:
    """``SANDVISOR_SOCKET``, else the runtime dir's sandvisor.sock."""
    env = os.environ.get("SANDVISOR_SOCKET")
    if env:
        return Path(env)
    return runtime_dir() / "sandvisor.sock"


def default_run_root() -> Path:
    """Short paths for per-VM sockets (AF_UNIX paths are limited to 107 bytes)."""
    return runtime_dir() / "vms"


def claim_runtime_dir() -> Path:
    """For a non-root supervisor: the runtime dir, and its /tmp parent when there is
    no $XDG_RUNTIME_DIR, made 0700 -- or, when they exist, checked: real directories
    (no symlink), ours, 0700. One someone else made first is refused
    (:class:`UnsafeRuntimeDir`): they could read or replace our sockets."""
    path = runtime_dir()
    if os.geteuid() == 0:
        return path
    dirs = [path] if os.environ.get("XDG_RUNTIME_DIR") else [path.parent, path]
    for d in dirs:
        _private(d)
    return path


def check_runtime_dir(sock: Path) -> None:
    """For a client of a non-root supervisor at the default socket: the runtime dir is
    ours (else a local user who made it first could stand in for the supervisor)."""
    if os.geteuid() == 0 or os.environ.get("SANDVISOR_SOCKET"):
        return
    d = sock.parent
    try:
        st = d.lstat()
    except FileNotFoundError:
        return  # nothing there: the connect fails on its own
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise UnsafeRuntimeDir(
            f"{d} is not a 0700 directory of uid {os.geteuid()} (owner {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}): refusing to talk to a socket in it"
        )


def make_dirs(path: Path, mode: int) -> list[Path]:
    """``path`` and each of its missing parents, made with ``mode`` whatever the umask
    (serve runs under umask 077: ``mkdir(parents=True)`` would make every parent 0700 and
    lock QEMU's user and a --group out of what lies below). Directories that exist are
    left as they are. Returns what was made, outermost first."""
    missing: list[Path] = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    made = []
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue  # made meanwhile by someone else: checked by whoever needs it
        os.chmod(d, mode)
        made.append(d)
    return made


def passable_runtime_dir() -> None:
    """Root's runtime dir (/run/sandvisor) is the supervisor's by definition: made
    0711 (QEMU's users reach their run dirs under it, a --group its socket; nobody lists
    it), and, when an earlier supervisor left it 0700, opened to pass through again.
    (systemd's ``RuntimeDirectory=`` makes it 0755: also passable, left so.)"""
    path = runtime_dir()
    make_dirs(path, 0o711)
    st = path.lstat()
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o011 != 0o011:
        os.chmod(path, stat.S_IMODE(st.st_mode) | 0o011)


def _private(d: Path) -> None:
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRuntimeDir(f"{d} exists and is not a directory (a symlink or a file): refusing it")
    if st.st_uid != os.geteuid():
        raise UnsafeRuntimeDir(
            f"{d} belongs to uid {st.st_uid}, not to this supervisor's uid {os.geteuid()}: someone else made it "
            "first; remove it, or set XDG_RUNTIME_DIR or --socket/--run-root"
        )
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)  # ours: close it


def default_memory_dir(state_dir: Path) -> Path | None:
    """Where guest RAM files live: tmpfs (/dev/shm), one directory per state dir (two
    supervisors never sweep each other's files). None where there is no /dev/shm:
    guest RAM is then anonymous and checkpoints stream it."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return None
    import hashlib  # (here: the quick CLI, given a socket, never needs it; 2.6 ms measured)

    key = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return shm / f"sandvisor-{key}"
