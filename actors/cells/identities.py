"""The identities of cells: the uid and gid each jailed QEMU (or tool) runs as, taken from
a range no user or group of the host has, and the jail's error type.

``IdentityAllocator`` refuses a range that touches a real id (/etc/passwd, /etc/group,
/etc/subuid, /etc/subgid, NSS) and, at start, adopts the ids of running processes.
"""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

import attrs

from actors import defaults


class JailError(Exception):
    """The jail could not be built, entered or removed (the message names the step)."""


NOBODY = 65534
DEFAULT_ID_FIRST = defaults.JAIL_ID_FIRST  # above systemd-nspawn's 0x00080000-0x6FFFFFFF, below 0x7FFE0000
DEFAULT_ID_COUNT = defaults.JAIL_ID_COUNT


@attrs.frozen
class Identity:
    """The uid and gid one sandbox's QEMU runs as (equal numbers, from the range)."""

    uid: int
    gid: int


def _id_ranges(path: Path) -> list[tuple[str, int, int]]:
    """``name:first:count`` lines of /etc/subuid or /etc/subgid."""
    out: list[tuple[str, int, int]] = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


def _db_ids(path: Path) -> list[tuple[str, int]]:
    """(name, id) of /etc/passwd or /etc/group lines (the third field)."""
    out: list[tuple[str, int]] = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[2].isdigit():
            out.append((parts[0], int(parts[2])))
    return out


class IdentityAllocator:
    """Hands out one uid/gid pair per live QEMU from ``[first, first + count)``.

    The range is refused at construction when it holds 0, 65534, a user or group of
    ``passwd``/``group`` or part of a ``subuid``/``subgid`` range. Each allocation also
    asks NSS (``getpwuid``/``getgrgid``: LDAP, sssd) and skips ids it knows. Ids are
    handed out round-robin, so a released id is reused as late as possible. The
    supervisor records each identity with its sandbox and, after a restart,
    :meth:`adopt`\\ s the recorded ones and :meth:`adopt_running` those that still own a
    process (an unrecorded QEMU): an id is never shared by two live QEMUs.
    """

    def __init__(
        self,
        first: int = DEFAULT_ID_FIRST,
        count: int = DEFAULT_ID_COUNT,
        *,
        etc: Path = Path("/etc"),
    ) -> None:
        if first <= 0 or count <= 0 or first + count > 2**32 - 1:
            raise JailError(f"uid range [{first}, {first + count}) is not a valid range of ids")
        self.first = first
        self.count = count
        self._live: dict[int, str] = {}
        self._next = first
        problems: list[str] = []
        if self._within(NOBODY):
            problems.append(f"it holds {NOBODY} (nobody)")
        for db in ("passwd", "group"):
            for name, n in _db_ids(etc / db):
                if self._within(n):
                    problems.append(f"{db} has {name!r} with id {n}")
        for sub in ("subuid", "subgid"):
            for name, lo, n in _id_ranges(etc / sub):
                if lo < first + count and first < lo + n:
                    problems.append(f"{sub} gives {name!r} [{lo}, {lo + n})")
        if problems:
            raise JailError(
                f"sandbox uid range [{first}, {first + count}) collides with real ids: "
                + "; ".join(problems[:5])
                + ("; ..." if len(problems) > 5 else "")
                + " (choose another range)"
            )

    def _within(self, n: int) -> bool:
        return self.first <= n < self.first + self.count

    @property
    def live(self) -> dict[int, str]:
        """uid -> owner of every identity handed out and not released."""
        return dict(self._live)

    def allocate(self, owner: str) -> Identity:
        for _ in range(self.count):
            n = self._next
            self._next = self.first + (n - self.first + 1) % self.count
            if n in self._live or not _unknown_id(n):
                continue
            self._live[n] = owner
            return Identity(n, n)
        raise JailError(f"no free sandbox uid in [{self.first}, {self.first + self.count}): {len(self._live)} live")

    def adopt(self, identity: Identity, owner: str) -> None:
        """Record an identity that is live already (a QEMU the last supervisor started)."""
        if not self._within(identity.uid) or identity.uid != identity.gid:
            raise JailError(f"{identity} is not a sandbox identity of this range")
        other = self._live.get(identity.uid)
        if other is not None and other != owner and not other.startswith("pid "):  # (adopt_running's mark)
            raise JailError(f"uid {identity.uid} is live for {other}, not {owner}")
        self._live[identity.uid] = owner

    def adopt_running(self, proc: Path = Path("/proc")) -> dict[int, int]:
        """Mark every id of the range that owns a process as live (owner ``pid N``), so
        an orphaned QEMU's uid is never handed out. Returns uid -> one pid."""
        found: dict[int, int] = {}
        for entry in os.scandir(proc):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"{entry.path}/status", "rb") as f:
                    for line in f:
                        if line.startswith(b"Uid:"):
                            uids = {int(x) for x in line.split()[1:]}
                            for u in uids:
                                if self._within(u):
                                    found.setdefault(u, int(entry.name))
                            break
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        for u, pid in found.items():
            self._live.setdefault(u, f"pid {pid}")
        return found

    def release(self, identity: Identity) -> None:
        self._live.pop(identity.uid, None)


def _unknown_id(n: int) -> bool:
    """No user or group of the system (NSS) has this id."""
    try:
        pwd.getpwuid(n)
        return False
    except KeyError:
        pass
    try:
        grp.getgrgid(n)
        return False
    except KeyError:
        return True
