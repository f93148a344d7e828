"""Durability against real VMs: a supervisor killed with SIGKILL and started
again keeps every sandbox -- memory, processes, exposed ports, the same QEMU -- and a
supervisor stopped with --keep-sandboxes leaves them to the next one."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import trio

from images.build import Image
from supervisor.client import connect
from supervisor.main.throwaway import Workdir, supervisor_process, workdir
from supervisor.wire.protocol import ApiError
from tests.support.client import COUNTER, run, wait_state

WEB = "cd /tmp && echo hello-from-guest > hello.txt && (python3 -m http.server 8000 >/dev/null 2>&1 &)"


def qemu_pid(work: Workdir, id: str) -> int:
    import sqlite3

    db = sqlite3.connect(str(work.state / "sandvisor.db"))
    (pid,) = db.execute("SELECT qemu_pid FROM sandboxes WHERE id=?", (id,)).fetchone()
    db.close()
    return int(pid)


def http_get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /hello.txt HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data


async def wait_http(port: int, timeout: float = 60) -> bytes:
    with trio.fail_after(timeout):
        while True:
            try:
                reply = await trio.to_thread.run_sync(http_get, port)
                if reply.startswith(b"HTTP/1.0 200"):
                    return reply
            except OSError:
                pass
            await trio.sleep(0.3)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"


def test_a_supervisor_killed_and_restarted_keeps_every_sandbox(image: Image) -> None:
    interrupted: list[ApiError] = []

    async def before(work: Workdir) -> dict[str, int]:
        async with connect(work.socket) as c:
            for id, extra in (
                ("counter", {}),
                ("web", {"network": {"mode": "user"}, "ports": [{"sandbox_port": 8000}]}),
                ("busy", {}),
                ("keeper", {}),
            ):
                await c.call("Create", {"id": id, **extra})
            for id in ("counter", "web", "busy", "keeper"):
                await wait_state(c, id, "ready")
            assert (await run(c, "counter", ["sh", "-c", f"({COUNTER}) >/dev/null 2>&1 &"]))[1] == 0
            assert (await run(c, "web", ["sh", "-c", WEB]))[1] == 0
            await c.call("Stop", {"id": "keeper"})
            await wait_http(_port_of(work, "web"))
            pids = {id: qemu_pid(work, id) for id in ("counter", "web", "busy")}
        return pids

    async def kill_mid_run(work: Workdir, proc: Any) -> None:
        # killed once the guest runs the process: its first output came back. (The
        # sandbox is "running" from the Run's acceptance, before the guest got the
        # command: a kill then loses the command, and nothing would run on.)
        started = trio.Event()
        async with connect(work.socket) as c, trio.open_nursery() as n:

            async def long_run() -> None:
                cmd = ["sh", "-c", "echo started; sleep 4; echo finished > /root/after"]
                try:
                    async with c.open_call("Run", {"id": "busy", "cmd": cmd}) as call:
                        async for item in call:
                            if item["data"]:
                                started.set()
                except ApiError as exc:
                    interrupted.append(exc)

            n.start_soon(long_run)
            await started.wait()
            assert (await c.call("Inspect", {"id": "busy"}))["state"] == "running"
            proc.kill()  # SIGKILL: no cleanup at all
            await trio.to_thread.run_sync(proc.wait)

    async def after(work: Workdir, pids: dict[str, int]) -> None:
        async with connect(work.socket) as c:
            listed = {s["id"]: s["state"] for s in (await c.call("List", {}))["sandboxes"]}
            errors = {id: (await c.call("Inspect", {"id": id}))["error"] for id in listed}
            assert listed == {"counter": "ready", "web": "ready", "busy": "ready", "keeper": "stopped"}, errors
            assert {id: qemu_pid(work, id) for id in pids} == pids  # the same QEMUs, adopted
            first = int((await run(c, "counter", ["cat", "/run/cnt"]))[0])
            await trio.sleep(1)
            assert int((await run(c, "counter", ["cat", "/run/cnt"]))[0]) > first  # memory and processes went on
            assert (await wait_http(_port_of(work, "web"))).rstrip().endswith(b"hello-from-guest")
            with trio.fail_after(30):  # the interrupted Run's process ran on in the guest
                while (await run(c, "busy", ["cat", "/root/after"]))[0] != b"finished\n":
                    await trio.sleep(0.5)
            got = b""
            async with c.open_call("Exec", {"init": {"id": "busy", "cmd": ["cat"]}}) as ex:
                await ex.send({"stdin": b"exec works\n"})
                await ex.send({"close_stdin": True})
                async for item in ex:
                    got += item["data"]
            assert got == b"exec works\n"
            with trio.fail_after(20):  # promptly, also for the sandbox that was stopped before
                await c.call("Kill", {"id": "keeper"})
                await c.call("Stop", {"id": "counter", "timeout_seconds": 5})
            assert not alive(pids["counter"])

    with workdir("sv-durable-", private_state=True) as work:
        with supervisor_process(work) as (_, proc):
            pids = trio.run(before, work)
            trio.run(kill_mid_run, work, proc)
        assert [e.code for e in interrupted] == ["UNAVAILABLE"], interrupted
        assert all(alive(p) for p in pids.values())  # QEMUs outlive their supervisor
        with supervisor_process(work) as (_, proc):
            trio.run(after, work, pids)
            proc.send_signal(signal.SIGTERM)  # graceful: stops every sandbox, exits 0
            assert proc.wait(timeout=60) == 0
        assert not any(alive(p) for p in pids.values())


def _port_of(work: Workdir, id: str) -> int:
    import sqlite3

    import msgpack

    db = sqlite3.connect(str(work.state / "sandvisor.db"))
    (blob,) = db.execute("SELECT ports FROM sandboxes WHERE id=?", (id,)).fetchone()
    db.close()
    return int(msgpack.unpackb(blob)[0]["host_port"])


def test_keep_sandboxes_leaves_them_to_the_next_supervisor(image: Image) -> None:
    async def start(work: Workdir) -> int:
        async with connect(work.socket) as c:
            await c.call("Create", {"id": "kept"})
            await wait_state(c, "kept", "ready")
            await run(c, "kept", ["sh", "-c", "echo 42 > /run/mark"])
        return qemu_pid(work, "kept")

    async def check(work: Workdir, pid: int) -> None:
        async with connect(work.socket) as c:
            assert (await c.call("Inspect", {"id": "kept"}))["state"] == "ready"
            assert (await run(c, "kept", ["cat", "/run/mark"]))[0] == b"42\n"
            assert qemu_pid(work, "kept") == pid

    with workdir("sv-keep-", private_state=True) as work:
        with supervisor_process(work, "--keep-sandboxes") as (_, proc):
            pid = trio.run(start, work)
            t = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            assert time.monotonic() - t < 30  # nothing was stopped
        assert alive(pid)
        with supervisor_process(work) as (_, proc):
            trio.run(check, work, pid)
