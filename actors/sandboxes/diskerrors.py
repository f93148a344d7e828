"""I/O errors on a sandbox's disks, as QEMU reports them: ``disk_error`` events.

A request of the guest that the host could not carry out (its file on a full host
disk: ENOSPC; a failing host disk: EIO) is the guest's I/O error (the disks run with
``werror=report,rerror=report``: actors/machines/qemuspec.py). The guest's file system
then does what it does with one: ext4 aborts its journal and goes read-only when a
journal write fails, so writes the guest had not synced are gone and later ones are
refused, until it boots again. Nothing in the guest tells the caller why; QEMU does,
with a ``BLOCK_IO_ERROR`` event per failed request. :class:`DiskErrors` (one per life)
counts them and makes them ``disk_error`` events: which disk (``root``, or the volume's
name), the operation, QEMU's reason and whether the host ran out of space; at most
:data:`EVENT_BURST` at once for each disk, then one per :data:`EVENT_INTERVAL` (a guest
writing in a loop fails thousands of requests a second; those left out are counted in
the disk's next event's ``suppressed``).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from actors.model import Action
from actors.sandboxes.eventrate import EventRate
from actors.sandboxes.oomkills import printable

EVENT = "BLOCK_IO_ERROR"
EVENT_BURST = 3  # disk_error events one life may emit at once for each disk
EVENT_INTERVAL = 10.0  # s: one more allowed this often once the burst is spent
REASON_MAX = 200  # characters of QEMU's reason kept in an event
OPERATION_MAX = 16  # characters of QEMU's operation ("read", "write") kept in an event
NOSPACE_REASON = os.strerror(errno.ENOSPC)  # QEMU's reason for a full host disk


def disk_name(node: str, volumes: Sequence[str]) -> str:
    """The disk a block node of ours belongs to: ``vol<i>`` is the i-th volume, every
    other node (``disk0``, a checkpoint's overlay ``ov<n>``) is the root disk's top."""
    if node.startswith("vol") and node[3:].isdigit() and int(node[3:]) < len(volumes):
        return volumes[int(node[3:])]
    return "root"


class DiskErrors:
    """One life's disk I/O errors: ``count`` (every request QEMU reported failed). The
    rate is each disk's own: a root disk failing in a loop does not hide a volume's."""

    def __init__(
        self, emit: Callable[..., None], volumes: Sequence[str], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._emit = emit
        self._volumes = tuple(volumes)
        self._clock = clock
        self.count = 0
        self._rates: dict[str, EventRate] = {}  # by disk (at most the volumes and root)

    def report(self, data: Mapping[str, Any]) -> None:
        """One ``BLOCK_IO_ERROR``'s data (QEMU's word: read defensively)."""
        self.count += 1
        node, reason = data.get("node-name"), str(data.get("reason", ""))
        disk = disk_name(node if isinstance(node, str) else "", self._volumes)
        rate = self._rates.get(disk)
        if rate is None:
            rate = self._rates[disk] = EventRate(EVENT_BURST, EVENT_INTERVAL, self._clock)
        extra = rate.allow()
        if extra is None:
            return
        # (QEMU sends ``nospace`` only when the device keeps an I/O status, which a
        # report-only device does not: then its reason, strerror(ENOSPC), says it)
        nospace = data["nospace"] is True if "nospace" in data else reason == NOSPACE_REASON
        attributes = {
            "disk": disk,
            "operation": printable(str(data.get("operation", "")))[:OPERATION_MAX],
            "nospace": "true" if nospace else "false",
            "reason": printable(reason)[:REASON_MAX],
            "count": str(self.count),
            **extra,
        }
        self._emit(Action.DISK_ERROR, **attributes)

    async def watch(self, events: trio.MemoryReceiveChannel[Any]) -> None:
        """Report the ``BLOCK_IO_ERROR`` events of a QMP listener's channel until it ends."""
        async for ev in events:
            if ev.name == EVENT and isinstance(ev.data, Mapping):
                self.report(ev.data)
