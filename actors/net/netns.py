"""Network namespaces, and the few host network operations tap networking needs.

:class:`NetNS` names the namespace where the supervisor's sandbox networking lives:
its own (``NetNS()``, production) or a named one under /run/netns (the tests run a
whole "host" in a namespace they made). A socket, a TAP or a netlink handle belongs
to the namespace it was *created* in and keeps working from any thread after, so
:meth:`NetNS.entered` switches only the calling thread, only for the few
microseconds it takes to create one (setns(2) on a thread is allowed for network
namespaces, even in a multi-threaded process).

Link operations use iproute2's ``ip -batch -`` (one process per sandbox, ~4 ms,
measured: benchmarks/network_tap.py) rather than pyroute2: the TAP itself must be
created in-process anyway (its fd goes to QEMU), the rest is three commands per
sandbox, and ``ip`` is the reference implementation, with stable syntax and clear
errors. pyroute2 0.9 does one operation in ~0.3 ms but costs ~140 ms to import,
~7 ms per namespace handle, and a dependency whose API has changed twice.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import attrs

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
IFF_TUN_EXCL = 0x8000

_libc = ctypes.CDLL(None, use_errno=True)


class NetError(Exception):
    """A host network operation failed (message from the kernel or iproute2)."""


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetError(f"setns: {os.strerror(err)}")


@attrs.frozen
class NetNS:
    """A network namespace: a named one (``ip netns add NAME``) or, with no name, the
    supervisor's own."""

    name: str | None = None
    file: str = ""  # or a namespace file: /proc/<pid>/ns/net of a jailed QEMU

    @property
    def path(self) -> Path | None:
        if self.file:
            return Path(self.file)
        return None if self.name is None else Path("/run/netns") / self.name

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The calling thread is in this namespace for the block (synchronous code only:
        nothing may await inside)."""
        if self.path is None:
            yield
            return
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            target = os.open(str(self.path), os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield
            finally:
                _setns(back)  # a thread left in the wrong namespace would be a silent disaster
        finally:
            os.close(back)

    def ip_argv(self) -> list[str]:
        return ["ip"] if self.name is None else ["ip", "-n", self.name]

    def ip(self, *commands: str) -> None:
        """Run iproute2 commands in one process (``ip -batch -``); stop at the first error."""
        if not commands:
            return
        proc = subprocess.run(
            [*self.ip_argv(), "-batch", "-"],
            input="\n".join(commands).encode() + b"\n",
            capture_output=True,
            check=False,
        )
        if proc.returncode != 0:
            raise NetError(f"ip: {proc.stderr.decode(errors='replace').strip()[:500]}")

    def sysctl(self, key: str, value: str | int) -> None:
        """Write a net sysctl (``ipv4/conf/svn.../proxy_arp``) of this namespace."""
        with self.entered():
            # /proc/sys/net resolves to the namespace of the thread that opens it
            fd = os.open(f"/proc/sys/net/{key}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(value).encode())
        except OSError as exc:
            raise NetError(f"sysctl net/{key}={value}: {exc.strerror}") from None
        finally:
            os.close(fd)

    def read_sysctl(self, key: str) -> str:
        with self.entered():
            fd = os.open(f"/proc/sys/net/{key}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, 256).decode().strip()
        finally:
            os.close(fd)

    def open_tap(self, name: str, *, vnet_hdr: bool = True) -> int:
        """Create TAP ``name`` in this namespace and return its queue fd (CLOEXEC: pass it
        to QEMU explicitly). Not persistent: the device goes away when the last fd (QEMU's)
        closes, so a crash leaves no TAP behind. IFF_TUN_EXCL: a name in use is an error,
        never an attachment to someone else's device."""
        with self.entered():
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)  # the TAP's netns: the opener's
        flags = IFF_TAP | IFF_NO_PI | IFF_TUN_EXCL | (IFF_VNET_HDR if vnet_hdr else 0)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), flags))
        except OSError as exc:
            os.close(fd)
            raise NetError(f"cannot create TAP {name}: {exc.strerror}") from None
        return fd

    def link_exists(self, name: str) -> bool:
        # not /sys/class/net: /sys shows the namespace it was mounted in, not the thread's
        with self.entered():
            try:
                socket.if_nametoindex(name)
            except OSError:
                return False
            return True

    def socket(self, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM) -> socket.socket:
        """A socket of this namespace (it stays there whichever thread uses it)."""
        with self.entered():
            return socket.socket(family, type)
