"""Freeze and thaw the guest's writable file systems (a crash-consistent capture).

The host freezes them right before it captures the disk (a pause, a checkpoint) and
thaws them after, so the captured disk is clean: its journal flushed, no
``needs_recovery``, what a disk-only restore mounts with no replay. FIFREEZE makes
the kernel sync the file system, flush its journal, mark it clean on disk and block
every new write to it until FITHAW.

A freeze is the host session's that asked for it, and bounded: it ends at the
host's thaw, at the next hello (a restored guest -- whose memory was saved frozen --
or a new supervisor adopting it: the one that froze is gone), or on its own after
its timeout, counted in the guest's running time (a frozen root with the host gone
would hang every writer of the guest). guestd itself writes to no file system while
one is frozen (the host's checkpoint guard holds other requests back).
"""

from __future__ import annotations

import fcntl
import os

from guestd.common import log, now

FIFREEZE = 0xC0045877  # _IOWR('X', 119, int)
FITHAW = 0xC0045878  # _IOWR('X', 120, int)
# block file systems that support freezing; tmpfs, virtiofs, proc, overlay... are not frozen
FREEZABLE = ("ext4", "ext3", "ext2", "xfs", "btrfs")
MAX_TIMEOUT = 300.0  # s: the most a host may ask a freeze to last


def writable_mounts() -> list[str]:
    """Mount points of the writable block file systems, deepest first, one per
    device (a bind mount of a frozen one would be EBUSY)."""
    seen: set[str] = set()
    out: list[str] = []
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        a, b = pre.split(), post.split()
        if len(a) < 6 or len(b) < 3:
            continue
        dev, point, opts = a[2], _unescape(a[4]), a[5].split(",")
        fstype, super_opts = b[0], b[2].split(",")
        if fstype not in FREEZABLE or "ro" in opts or "ro" in super_opts or dev in seen:
            continue
        seen.add(dev)
        out.append(point)
    out.sort(key=lambda p: p.rstrip("/").count("/") if p != "/" else 0, reverse=True)
    return out


def _unescape(s: str) -> str:
    """mountinfo's octal escapes (space, tab, newline, backslash)."""
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _ioctl(point: str, op: int) -> None:
    fd = os.open(point, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, op, 0)
    finally:
        os.close(fd)


class Freezer:
    """What guestd holds frozen, and until when (an agent timer: ``next_deadline``/``tick``)."""

    def __init__(self) -> None:
        self.frozen: list[str] = []  # in freeze order: thawed in reverse
        self.deadline = float("inf")
        self.done = False  # (the agent's timer protocol: never done)

    def freeze(self, timeout: float) -> int:
        """Sync, then freeze every writable mount, deepest first; how many froze. One
        that refuses (no freeze support, a device gone) is skipped and logged; an
        earlier freeze still held is thawed first."""
        self.thaw()
        os.sync()
        for point in writable_mounts():
            try:
                _ioctl(point, FIFREEZE)
            except OSError as exc:
                log(f"freeze {point}: {exc.strerror}")
                continue
            self.frozen.append(point)
        if self.frozen:
            self.deadline = now() + max(0.1, min(timeout, MAX_TIMEOUT))
        return len(self.frozen)

    def thaw(self) -> int:
        """Thaw what :meth:`freeze` froze, last first; how many thawed."""
        n = 0
        while self.frozen:
            point = self.frozen.pop()
            try:
                _ioctl(point, FITHAW)
                n += 1
            except OSError as exc:  # EINVAL: not frozen (someone else thawed it)
                log(f"thaw {point}: {exc.strerror}")
        self.deadline = float("inf")
        return n

    def next_deadline(self) -> float:
        return self.deadline

    def tick(self, t: float) -> None:
        if t >= self.deadline:
            log(f"file systems frozen past their timeout: thawing {len(self.frozen)}")
            self.thaw()
