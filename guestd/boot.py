"""Boot and power-off: what guestd does as PID 1 before its loop starts and after it ends.

Boot: the initramfs ``/init`` (busybox sh) mounts /proc, /sys, /dev, loads the
virtio modules, mounts the user's root filesystem at /sysroot (with /proc,
/sys, /dev, /dev/pts, /tmp, /run inside it) and execs Python on guestd.agent.
guestd then opens the channel port, keeps a handle on the initramfs root and
chroots into /sysroot (:func:`enter_sysroot`), so every process it starts and
every file it touches sees the user's root filesystem as ``/``. guestd's own
Python never lives in the user's root filesystem: a rootfs without Python works.
"""

from __future__ import annotations

import _signal as signal  # the C module: 'signal' pulls in enum (~20 ms of boot)
import os
import sys
import time

from guestd.common import SIGDEF, T_START, log, now, read_text

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~30 ms of boot

if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

    from guestd.session import Conn

SYSROOT = "/sysroot"
PORT_NAME = "sandvisor.0"
VSOCK_PORT = 1024


def read_cmdline() -> dict[str, str]:
    """The ``sandvisor.*`` words of the kernel command line."""
    cmdline = {}
    for word in read_text("/proc/cmdline").split():
        k, _, v = word.partition("=")
        if k.startswith("sandvisor."):
            cmdline[k] = v
    return cmdline


def boot_marks() -> dict[str, float]:
    """/init's milestones (its SV_T_* variables) and guestd's start, in seconds since
    the kernel started (CLOCK_BOOTTIME)."""
    marks: dict[str, float] = {}
    for k, v in os.environ.items():
        if k.startswith("SV_T_"):
            try:
                marks[k[5:].lower()] = float(v)
            except ValueError:
                pass
    marks["python"] = T_START / 1e9
    return marks


def find_port(name: str, timeout: float = 5.0) -> str | None:
    """The /dev node of the virtio-serial port called ``name`` (no udev here)."""
    deadline = now() + timeout
    while True:
        try:
            for entry in os.listdir("/sys/class/virtio-ports"):
                if read_text(f"/sys/class/virtio-ports/{entry}/name").strip() == name:
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


def enter_sysroot(root_fd: int) -> None:
    """chroot into the user's root filesystem, if /init mounted one. Lazy imports after
    the chroot resolve through the initramfs root's fd ``root_fd`` (a worker's too: it
    keeps that fd at the same number); so do the submodules of packages imported
    already (guestd's own)."""
    if not os.path.ismount(SYSROOT):
        return

    def moved(paths: list[str]) -> list[str]:
        return [f"/proc/self/fd/{root_fd}{p}" if p.startswith("/") else p for p in paths]

    sys.path[:] = moved(sys.path)
    for mod in list(sys.modules.values()):
        pkg_path = getattr(mod, "__path__", None)
        if type(pkg_path) is list:
            pkg_path[:] = moved(pkg_path)
    os.chroot(SYSROOT)
    os.chdir("/")


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
    just exits). Only as PID 1 of a guest: anywhere else ``kill(-1)`` would signal
    every process the caller may (a guestd run on a host for a test or a profile
    killed the host's processes once)."""
    if os.getpid() != 1:
        raise RuntimeError("poweroff: not PID 1 (not a guest's init); refused")
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
        ids = {read_text(f"/sys/bus/virtio/devices/{d}/device").strip() for d in os.listdir("/sys/bus/virtio/devices")}
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
            os.posix_spawn(f"{base}/usr/bin/busybox", argv, {}, setsigdef=SIGDEF)
        except OSError as exc:
            log(f"cannot load {mod}: {exc}")
