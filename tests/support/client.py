"""Calls on a supervisor's socket that the VM tests share: wait for a state, run a command."""

from __future__ import annotations

from typing import Any

import trio

from supervisor.client import AsyncConnection

# a guest process whose count in /run/cnt grows while it runs (memory kept or lost shows
# in it); written aside and renamed, so a read never finds the file truncated and empty
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /run/cnt.new; mv /run/cnt.new /run/cnt; sleep 0.05; done"


async def wait_state(c: AsyncConnection, id: str, *states: str, timeout: float = 120) -> dict[str, Any]:
    with trio.fail_after(timeout):
        while True:
            info = await c.call("Inspect", {"id": id})
            if info["state"] in states:
                return info
            await trio.sleep(0.1)


async def run(c: AsyncConnection, id: str, cmd: list[str]) -> tuple[bytes, int]:
    out, code = b"", -1
    async with c.open_call("Run", {"id": id, "cmd": cmd}) as call:
        async for item in call:
            out += item["data"]
            if item["done"]:
                code = item["exit_code"]
    return out, code
