"""A real guest turned hostile: root in the guest ptrace-stops guestd (PID
1), so the channel goes silent after hello -- the real-VM case of the fake guest's
hostile behaviours (tests/unit/test_fakeguest.py covers silence, ignored kills and floods
of unknown request ids frame by frame). Every request to it ends on the host's
deadline, its neighbours' metrics still come, and Stop ends it promptly."""

from __future__ import annotations

import time

import pytest
import trio

from images.build import Image
from supervisor.client import AsyncSandbox, connect
from supervisor.main.throwaway import supervisor, workdir
from supervisor.wire.protocol import ApiError
from tests.support.client import run, wait_state

GUEST_TIMEOUT = 4.0
# PTRACE_ATTACH stops guestd (init ignores SIGSTOP, not a tracer). The freezer leaves
# the Run's session at once (its parent waits for that, then exits: the Run ends) and
# attaches two seconds later; then it sleeps on, holding guestd stopped.
FREEZE = """
import os, time
r, w = os.pipe()
if os.fork():
    os.read(r, 1)
    os._exit(0)
os.setsid()
os.write(w, b"x")
time.sleep(2)
import ctypes
ctypes.CDLL(None, use_errno=True).ptrace(16, 1, None, None)
time.sleep(3600)
"""


async def test_a_silenced_guestd_costs_only_its_own_sandbox(image: Image) -> None:
    with workdir("sv-hostile-") as work, trio.fail_after(300):
        async with supervisor(work, templates=False, guest_timeout=GUEST_TIMEOUT) as _, connect(work.socket) as c:
            for id in ("hostile", "neighbour"):
                await c.call("Create", {"id": id})
            for id in ("hostile", "neighbour"):
                await wait_state(c, id, "ready")
            hostile = await AsyncSandbox.get("hostile", socket=work.socket)
            await hostile.fs.write("/root/freeze.py", FREEZE.encode())
            assert (await hostile.run(["python3", "/root/freeze.py"])).exit_code == 0
            with trio.fail_after(60):  # until the freezer has attached
                while True:
                    try:
                        await c.call("Metrics", {"id": "hostile"})
                    except ApiError as exc:
                        assert exc.code == "DEADLINE_EXCEEDED", exc
                        break
                    await trio.sleep(0.5)
            t = time.monotonic()
            with pytest.raises(ApiError) as e:
                await c.call("Metrics", {"id": "hostile"})
            assert e.value.code == "DEADLINE_EXCEEDED", e.value
            assert time.monotonic() - t < GUEST_TIMEOUT + 3
            # everyone's metrics: the silent one costs its own answer, not the others'
            t = time.monotonic()
            every = (await c.call("MetricsAll", {}))["sandboxes"]
            assert time.monotonic() - t < GUEST_TIMEOUT + 3
            assert [m["id"] for m in every] == ["neighbour"]
            assert (await run(c, "neighbour", ["echo", "fine"]))[0] == b"fine\n"
            # a Run to it ends on the host: its start is a guest request with the deadline
            t = time.monotonic()
            with pytest.raises(ApiError) as e:
                await run(c, "hostile", ["sleep", "60"])
            assert e.value.code == "DEADLINE_EXCEEDED"
            assert time.monotonic() - t < GUEST_TIMEOUT + 3
            # Stop cannot ask guestd to power off: the ladder ends QEMU in bounded time
            t = time.monotonic()
            await c.call("Stop", {"id": "hostile", "timeout_seconds": 2})
            await wait_state(c, "hostile", "stopped", "failed", "crashed", timeout=60)
            assert time.monotonic() - t < 30
            assert (await c.call("Inspect", {"id": "neighbour"}))["state"] == "ready"
