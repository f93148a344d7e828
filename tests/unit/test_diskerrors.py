"""QEMU's BLOCK_IO_ERROR events as disk_error events: names, QEMU's word read
defensively, and the rate a guest failing requests in a loop cannot flood."""

from __future__ import annotations

from typing import Any

import trio

from actors.machines.qmp import Event
from actors.model import Action
from actors.sandboxes import diskerrors
from actors.sandboxes.diskerrors import DiskErrors, disk_name

NOSPACE = {"node-name": "ov3", "operation": "write", "action": "report", "nospace": True, "reason": "No space left"}


def test_nodes_name_their_disks() -> None:
    assert [disk_name(n, ["data", "cache"]) for n in ("disk0", "ov7", "vol0", "vol1", "vol2", "volx", "")] == [
        "root",
        "root",
        "data",
        "cache",
        "root",
        "root",
        "root",
    ]


def test_a_burst_then_one_per_interval_with_the_rest_counted() -> None:
    now = [0.0]
    got: list[tuple[Action, dict[str, str]]] = []
    errors = DiskErrors(lambda action, **attrs: got.append((action, attrs)), ["data"], clock=lambda: now[0])
    for _ in range(50):
        errors.report(NOSPACE)
    assert errors.count == 50 and len(got) == diskerrors.EVENT_BURST
    assert got[0] == (
        Action.DISK_ERROR,
        {"disk": "root", "operation": "write", "nospace": "true", "reason": "No space left", "count": "1"},
    )
    # a volume's first error is heard though the root disk spent its burst
    errors.report({"node-name": "vol0", "operation": "read", "reason": "Input/output error\x1b[2J" + "x" * 500})
    _, attrs = got[-1]
    assert attrs["disk"] == "data" and attrs["nospace"] == "false" and attrs["count"] == "51"
    assert "suppressed" not in attrs
    assert "\x1b" not in attrs["reason"] and len(attrs["reason"]) == diskerrors.REASON_MAX
    now[0] += diskerrors.EVENT_INTERVAL
    errors.report(NOSPACE)  # the root disk's next, with what it left out
    assert got[-1][1]["disk"] == "root" and got[-1][1]["suppressed"] == str(50 - diskerrors.EVENT_BURST)
    now[0] += diskerrors.EVENT_INTERVAL
    errors.report({"node-name": "disk0", "operation": "write", "reason": diskerrors.NOSPACE_REASON})
    assert got[-1][1]["nospace"] == "true"  # (a report-only device: QEMU sends no nospace, its reason says it)


async def test_only_block_io_errors_are_watched() -> None:
    got: list[dict[str, Any]] = []
    errors = DiskErrors(lambda action, **attrs: got.append(attrs), [])
    send, recv = trio.open_memory_channel[Event](8)
    async with send:
        await send.send(Event("STOP", {}, 0.0))
        await send.send(Event("BLOCK_IO_ERROR", NOSPACE, 0.0))
        await send.send(Event("BLOCK_IO_ERROR", "garbage", 0.0))  # type: ignore[arg-type]
        await send.send(Event("BLOCK_IO_ERROR", {"node-name": 7, "operation": "w\x00" * 10_000}, 0.0))
    await errors.watch(recv)
    assert errors.count == 2 and got[0]["disk"] == "root"
    assert got[1]["disk"] == "root" and len(got[1]["operation"]) == diskerrors.OPERATION_MAX  # (QEMU's word: bounded)
