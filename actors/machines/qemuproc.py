"""A QEMU process, however it was started, and who it runs as.

The error tree of one QEMU (:class:`MachineError` and below: the spec, the process
and the running :class:`~actors.machines.machine.Machine` raise them); the :class:`Proc` a
machine watches (a child, a jailed child, or a QEMU a previous supervisor started,
adopted by pidfd and start time: :class:`AdoptedProcess`, :func:`start_time`); the
unprivileged user QEMU runs as when the supervisor is root (:class:`QemuUser`,
:func:`unprivileged_user`); and the check that a socket found by path is QEMU's own
(:func:`check_peer`, :func:`connect_guest_socket`).

Error tree::

    MachineError
     +-- LaunchError        QEMU did not start (bad argv, missing file, QMP handshake failed)
     |    +-- TooManyDevices  more virtio devices than the machine has slots (actors/machines/qemuspec.py)
     +-- MachineStateError  an operation in the wrong runstate (e.g. QMP after exit)
     +-- QMPCommandError    QEMU refused a QMP command (message from QEMU)
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import signal
import socket
import struct
from pathlib import Path
from typing import Protocol

import attrs
import trio

LEGACY_RESTORE_ENV = "SANDVISOR_LEGACY_RESTORE"


def legacy_restore() -> bool:
    """``SANDVISOR_LEGACY_RESTORE=1``: the older launch and restore path (QMP
    and the guest channel found by path, the saved state fed over QMP, each fix-up a
    round trip of its own): benchmarks/restore.py's old side, read at every launch."""
    return os.environ.get(LEGACY_RESTORE_ENV) == "1"


class MachineError(Exception):
    """Base of the errors of one QEMU process."""


class LaunchError(MachineError):
    """QEMU did not come up."""


class MachineStateError(MachineError):
    """The operation does not fit the machine's runstate."""


class QMPCommandError(MachineError):
    """QEMU answered a QMP command with an error."""


@attrs.frozen
class QemuUser:
    """The unprivileged user QEMU runs as when the supervisor is root."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def unsearchable_parent(path: Path) -> Path | None:
    """The first directory on the way to ``path`` that others may not pass (no o+x):
    where an unprivileged QEMU would be stopped. None when the way is open."""
    for parent in reversed(path.resolve().parents):
        if not parent.stat().st_mode & 0o001:
            return parent
    return None


def unprivileged_user(name: str | None = None) -> QemuUser | None:
    """``name``, else ``sandvisor-qemu`` if that user exists, else ``nobody``; plus the
    ``kvm`` group for /dev/kvm. None when the supervisor is not root (QEMU then runs as
    the supervisor's own user) or when ``name`` is the empty string (explicitly off)."""
    if os.geteuid() != 0 or name == "":
        return None
    for candidate in [name] if name else ["sandvisor-qemu", "nobody"]:
        try:
            pw = pwd.getpwnam(candidate)
        except KeyError:
            continue
        groups = [pw.pw_gid]
        try:
            groups.append(grp.getgrnam("kvm").gr_gid)
        except KeyError:
            pass
        return QemuUser(candidate, pw.pw_uid, pw.pw_gid, tuple(groups))
    raise LaunchError(f"no such user {name!r} to run QEMU as")


class Proc(Protocol):
    """A QEMU process, however it was started (a child, a jailed child, or adopted)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


UNKNOWN_EXIT = -1000  # an adopted QEMU's exit status: not our child, the kernel tells us nothing


def start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot): with the pid, who a process is."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _exited(pid: int) -> bool:
    """The process has ended (a zombie, or dead): field 3 of /proc/<pid>/stat."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


class AdoptedProcess:
    """A QEMU a previous supervisor started, watched through a pidfd: no pid recycling
    race, no zombie of ours (its parent is init now), no exit status."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._returncode: int | None = None

    @classmethod
    def open(cls, pid: int, started: int) -> AdoptedProcess | None:
        """The process ``pid`` if it is still the one that started at ``started``."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
        if start_time(pid) != started or _exited(pid):  # (checked after the pidfd: it pins this process)
            os.close(fd)  # (a zombie init has not reaped yet is gone too: nothing to adopt)
            return None
        return cls(pid, fd)

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def wait(self) -> int:
        if self._returncode is None:
            await trio.lowlevel.wait_readable(self._pidfd)
            self._returncode = UNKNOWN_EXIT
            os.close(self._pidfd)
            self._pidfd = -1
        return self._returncode

    def send_signal(self, sig: int) -> None:
        if self._returncode is None and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def check_peer(sock: socket.socket, pid: int | None, path: Path) -> None:
    """The socket we reached by ``path`` is QEMU's own (``pid``). QEMU's socket dir
    belongs to its cell's uid: an escaped QEMU could put a symlink there to any other
    socket on the host (which root may connect to); the listener's pid, as the kernel
    recorded it, tells (translated into our pid namespace)."""
    if pid is None:
        return
    peer = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    if peer != pid:
        sock.close()
        raise LaunchError(f"{path} is not QEMU's (pid {pid}) but pid {peer}'s: refusing it")


async def connect_guest_socket(path: Path, *, pid: int | None, timeout: float = 10.0) -> trio.SocketStream:
    """Connect to the guest channel's unix socket (QEMU, ``pid``, creates it during
    start-up; :func:`check_peer`)."""
    with trio.fail_after(timeout):
        while True:
            try:
                stream = await trio.open_unix_socket(str(path))
            except (FileNotFoundError, ConnectionRefusedError):
                await trio.sleep(0.002)
                continue
            try:
                check_peer(stream.socket, pid, path)  # type: ignore[arg-type]
            except LaunchError:
                await stream.aclose()
                raise
            return stream
