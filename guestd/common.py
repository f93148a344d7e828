"""What every part of guestd shares: the boot clock mark, diagnostics, fd helpers, the
error a request fails with, and a few kernel numbers.

guestd's modules (imported at boot unless marked lazy; see agent.py)::

    agent    the epoll loop, dispatch of host messages, main()
    session  a host connection, its session, requests and their credited streams
    exec     processes: Proc, spawning (posix_spawn or fork+exec)
    users    user and group lookup in the rootfs' /etc/passwd and /etc/group
    boot     the boot sequence (port, vsock, chroot) and power-off
    system   machine-wide requests: clock, hostname, entropy, metrics, deferred drivers
    files    (lazy) read_file and write_file streams
    workers  (lazy) forked workers: trees, patches, mounts
    oom      (lazy) the kernel's log read for OOM kills (from the first hello)
    tree, fsops, netcfg, proto   (see each)

Boot pays for every module imported here, under TCG a few ms each: stdlib modules
only where they are cheap (no ``typing``, ``signal``, ``enum``, ``termios``).
"""

from __future__ import annotations

import _signal as signal  # the C module: 'signal' pulls in enum (~20 ms of boot)
import fcntl
import os
import struct
import time

from guestd import proto

# CLOCK_BOOTTIME when guestd's own code started (the stdlib and proto loaded): the
# "python" boot mark, and HelloOk.boot_ns. guestd's first module imports this one.
T_START = time.clock_gettime_ns(time.CLOCK_BOOTTIME)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# the two tty ioctls guestd needs (asm-generic/ioctls.h: x86 and arm64 alike); the
# termios module is a shared object in lib-dynload: ~5 ms of boot to dlopen under TCG
TIOCSCTTY = 0x540E
TIOCSWINSZ = 0x5414
WINSZ = struct.Struct("HHHH")
# what guestd catches or ignores, back to default in every process it starts
SIGDEF = (signal.SIGPIPE, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)

errcode = proto.errcode  # (in proto: guestd.tree and the host's tree unpacking use it too)


def now() -> float:
    return time.monotonic()


QUIET = False  # the sandbox's log level leaves guestd's diagnostics out (guestd/shape.py)


def log(text: str) -> None:
    """Diagnostics go to the serial console; never raise."""
    if QUIET:
        return
    try:
        fd = os.open("/dev/console", os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            os.write(fd, f"guestd: {text}\n".encode(errors="replace"))
        finally:
            os.close(fd)
    except OSError:
        pass


def set_nonblock(fd: int) -> None:
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)


def read_text(path: str) -> str:
    """A small kernel file (/proc, /sys), "" if it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


class ExecFailed(Exception):
    """A request failed with a protocol error code (``proto.E_*``) and a message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
