"""sandvisor serve against real VMs: the sandbox.v1 lifecycle over the Unix socket."""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

from images.build import Image
from supervisor.client import AsyncConnection, connect
from supervisor.main.daemon_config import DaemonConfig
from supervisor.main.throwaway import supervisor, workdir
from supervisor.wire.protocol import ApiError


@asynccontextmanager
async def running_daemon(prefix: str, **kw: Any) -> AsyncIterator[DaemonConfig]:
    """An in-process supervisor on a throwaway state dir (sharing the built image)."""
    with workdir(prefix, private_state=True) as work:
        async with supervisor(work, **kw) as (cfg, _):
            yield cfg


@pytest.fixture
async def daemon(image: Image) -> AsyncIterator[DaemonConfig]:
    async with running_daemon("sv-d-", stop_timeout=5) as cfg:
        yield cfg


async def wait_state(c: AsyncConnection, id: str, *states: str, timeout: float = 90) -> dict[str, Any]:
    with trio.fail_after(timeout):
        while True:
            info = await c.call("Inspect", {"id": id})
            if info["state"] in states:
                return info
            await trio.sleep(0.1)


async def run(c: AsyncConnection, id: str, cmd: list[str], **kw: Any) -> tuple[bytes, bytes, int]:
    out, err, code = b"", b"", -1
    async with c.open_call("Run", {"id": id, "cmd": cmd, **kw}) as call:
        async for item in call:
            if item["stream"] == "stdout":
                out += item["data"]
            elif item["stream"] == "stderr":
                err += item["data"]
            elif item["done"]:
                code = item["exit_code"]
    return out, err, code


async def test_lifecycle_exact_events_run_exec_logs_restart(daemon: DaemonConfig) -> None:
    events: list[tuple[str, dict[str, str]]] = []
    async with connect(daemon.socket) as c, trio.open_nursery() as n:

        async def watch(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            async with c.open_call("Events", {"id": "life"}) as ev:
                task_status.started()  # its Call frame is out, ahead of Create's on this connection
                async for e in ev:
                    events.append((e["action"], e["attributes"]))

        await n.start(watch)
        t = time.monotonic()
        resp = await c.call("Create", {"id": "life", "labels": {"team": "a"}})
        assert resp == {"id": "life", "ip_address": "", "state": "starting"}
        assert time.monotonic() - t < 2  # Create does not wait for the boot
        info = await wait_state(c, "life", "ready")
        assert info["ready_at"] >= info["created_at"] > 0 and info["labels"] == {"team": "a"}
        if os.geteuid() == 0:  # a root supervisor never runs QEMU as root
            status = Path(f"/proc/{_qemu_pid(daemon, 'life')}/status").read_text()
            uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
            assert set(uid_line.split()[1:]) != {"0"}, uid_line

        out, err, code = await run(c, "life", ["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (out, err, code) == (b"out\n", b"err\n", 3)
        info = await c.call("Inspect", {"id": "life"})
        assert info["state"] == "ready" and info["last_exit_code"] == 3 and info["last_exited_at"] > 0

        # Exec with stdin (no state change), then with a PTY
        got = b""
        async with c.open_call("Exec", {"init": {"id": "life", "cmd": ["cat"]}}) as ex:
            await ex.send({"stdin": b"hello exec\n"})
            await ex.send({"close_stdin": True})
            async for item in ex:
                got += item["data"]
        assert got == b"hello exec\n"
        got = b""
        async with c.open_call(
            "Exec", {"init": {"id": "life", "cmd": ["sh"], "tty": True, "tty_size": {"width": 90, "height": 33}}}
        ) as ex:
            await ex.send({"stdin": b"stty size; exit 5\n"})
            code = -1
            async for item in ex:
                got += item["data"]
                if item["done"]:
                    code = item["exit_code"]
        assert b"33 90" in got and code == 5

        # a file survives stop and start (the overlay persists)
        async with c.open_call("WriteFile", {"open": {"id": "life", "path": "/root/kept", "mode": 0o600}}) as wf:
            await wf.send({"chunk": {"data": b"kept", "done": True}})
            await wf.half_close()
            assert await wf.result() == {}
        chunks = await c.collect("ReadFile", {"id": "life", "path": "/root/kept"})
        assert b"".join(x["data"] for x in chunks) == b"kept" and chunks[-1]["done"]
        pong = await c.call("Ping", {"id": "life"})
        assert pong["latency_ns"] > 0
        m = await c.call("Metrics", {"id": "life"})
        assert m["memory_total_bytes"] > 0 and m["host_rss_bytes"] > 0 and m["uptime_seconds"] > 0

        await c.call("Stop", {"id": "life", "timeout_seconds": 10})
        assert (await c.call("Inspect", {"id": "life"}))["state"] == "stopped"
        logs = await c.collect("Logs", {"id": "life"})  # readable while stopped
        by_source = {(e["source"], e["data"]) for e in logs}
        assert ("stdout", b"out\n") in by_source and ("stderr", b"err\n") in by_source
        assert any(e["source"] == "output" for e in logs) and any(e["source"] == "system" for e in logs)
        assert [e["seq"] for e in logs] == sorted(e["seq"] for e in logs)
        tail = await c.collect("Logs", {"id": "life", "tail": 2})
        assert tail == logs[-2:]

        await c.call("Start", {"id": "life"})
        await wait_state(c, "life", "ready")
        out, _, code = await run(c, "life", ["sh", "-c", "ls /root/kept && echo yes"])
        assert code == 0 and out.endswith(b"yes\n")
        await c.call("Remove", {"id": "life", "force": True})
        with pytest.raises(ApiError) as e:
            await c.call("Inspect", {"id": "life"})
        assert e.value.code == "NOT_FOUND"
        with trio.fail_after(10):
            while not events or events[-1][0] != "removed":
                await trio.sleep(0.05)
        n.cancel_scope.cancel()
    actions = [a for a, _ in events]
    assert actions == [
        "created",
        "ready",
        "running",
        "idle",
        "stopping",
        "stopped",
        "ready",
        "running",
        "idle",
        "stopping",
        "stopped",
        "removed",
    ], actions
    assert events[3][1]["exit_code"] == "3"


async def test_bad_input_gets_typed_errors_and_the_daemon_keeps_serving(daemon: DaemonConfig) -> None:
    async with connect(daemon.socket) as c:
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("Create", {"id": "x" * 129}, "INVALID_ARGUMENT"),
            ("Create", {"id": "é" * 65}, "INVALID_ARGUMENT"),  # 130 UTF-8 bytes
            ("Create", {"id": "ok", "labels": {"sandvisor.x": "1"}}, "INVALID_ARGUMENT"),
            ("Create", {"id": "ok", "labels": {"sandbox.y": "1"}}, "INVALID_ARGUMENT"),
            # a malformed reference (plain names resolve as docker's do: a test
            # must not name a real registry, so no well-formed remote name here)
            ("Create", {"id": "ok", "image": "docker.io/library/Alpine"}, "INVALID_ARGUMENT"),
            ("Create", {"id": "ok", "mounts": [{"source": "/", "target": "/m"}]}, "FAILED_PRECONDITION"),
            ("Create", {"id": "ok", "ssh_public_key": "ssh-ed25519 AAAA"}, "INVALID_ARGUMENT"),  # not a key
            ("Create", {"id": 5}, "INVALID_ARGUMENT"),
            ("Create", {"id": "ok", "limits": {"vcpus": "two"}}, "INVALID_ARGUMENT"),
            ("Create", {"id": "ok", "limits": {"memory_mib": 1}}, "INVALID_ARGUMENT"),
            ("Create", {"id": "ok", "rootfs": "/no/such.ext4"}, "FAILED_PRECONDITION"),  # not an allowed dir
            ("Create", {"id": "ok", "rootfs": "/etc/shadow"}, "FAILED_PRECONDITION"),
            ("Create", {"id": "ok", "kernel": "relative/vmlinux"}, "INVALID_ARGUMENT"),
            ("Inspect", {"id": "nope"}, "NOT_FOUND"),
            ("Inspect", {}, "INVALID_ARGUMENT"),
            ("List", {"limit": 101}, "INVALID_ARGUMENT"),
            ("List", {"cursor": "garbage!"}, "INVALID_ARGUMENT"),
            ("List", {"state": "dancing"}, "INVALID_ARGUMENT"),
            ("NoSuchMethod", {}, "UNIMPLEMENTED"),
            ("Stop", {"id": "nope"}, "NOT_FOUND"),
        ]
        for method, body, code in cases:
            with pytest.raises(ApiError) as e:
                await c.call(method, body)
            assert e.value.code == code, (method, body, e.value)
            assert e.value.message

    def raw(payload: bytes) -> bytes:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(daemon.socket))
            hello = msgpack.packb({"t": "hello", "version": 1})
            s.sendall(struct.pack(">I", len(hello)) + hello + payload)
            buf = b""
            while True:
                try:
                    d = s.recv(65536)
                except OSError:
                    break
                if not d:
                    break
                buf += d
            return buf

    for payload in (
        struct.pack(">I", 64 << 20),  # oversized frame
        struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1",  # garbage msgpack
        b"\xde\xad\xbe\xef" * 4,  # garbage bytes
    ):
        reply = await trio.to_thread.run_sync(raw, payload)
        assert b"fail" in reply  # a typed Fail, then the server hung up
    # one connection cannot open calls without bound
    from supervisor.serve.server import MAX_CALLS

    async with connect(daemon.socket) as c:
        async with trio.open_nursery() as n:
            opened = 0

            async def hold() -> None:
                nonlocal opened
                async with c.open_call("Events", {"id": "nobody"}):
                    opened += 1
                    await trio.sleep_forever()

            for _ in range(MAX_CALLS):
                n.start_soon(hold)
            with trio.fail_after(10):
                while opened < MAX_CALLS:
                    await trio.sleep(0.01)
            # no wait for the server: it routes one connection's frames in order, and each
            # Call enters its table before the next frame is read, so this one is the 257th
            with pytest.raises(ApiError) as e:
                await c.call("List", {})
            assert e.value.code == "RESOURCE_EXHAUSTED"
            n.cancel_scope.cancel()
        with trio.fail_after(10):
            while True:  # the cancels reach the server, the calls end, List works again
                try:
                    await c.call("List", {})
                    break
                except ApiError:
                    await trio.sleep(0.1)
    # a truncated frame then EOF: the server just closes
    await trio.to_thread.run_sync(raw, struct.pack(">I", 100) + b"abc")
    # and the daemon still serves everyone else
    async with connect(daemon.socket) as c:
        assert (await c.call("List", {}))["sandboxes"] == []
    assert oct(daemon.socket.stat().st_mode & 0o777) == "0o600"


async def test_kill9_of_qemu_fails_the_sandbox_only(daemon: DaemonConfig) -> None:
    async with connect(daemon.socket) as c:
        await c.call("Create", {"id": "victim"})
        await c.call("Create", {"id": "bystander"})
        await wait_state(c, "victim", "ready")
        await wait_state(c, "bystander", "ready")
        async with c.open_call("Events", {"id": "victim", "action": "failed"}) as ev:
            pid = _qemu_pid(daemon, "victim")
            os.kill(pid, signal.SIGKILL)
            with trio.fail_after(2):
                e = await ev.__anext__()
        assert e["action"] == "failed" and "signal 9" in e["attributes"]["error"]
        info = await c.call("Inspect", {"id": "victim"})
        assert info["state"] == "crashed" and info["error"]  # (died on its own; the event is "failed")
        assert daemon.run_root is not None
        with trio.fail_after(10):  # the victim's run dir is cleaned up; the bystander's stays
            while len(list(daemon.run_root.iterdir())) != 1:
                await trio.sleep(0.05)
        out, _, code = await run(c, "bystander", ["echo", "fine"])
        assert (out, code) == (b"fine\n", 0)
        with pytest.raises(ApiError) as err:
            await run(c, "victim", ["true"])
        assert err.value.code == "FAILED_PRECONDITION"


def _qemu_pid(cfg: DaemonConfig, id: str) -> int:
    import sqlite3

    db = sqlite3.connect(str(cfg.state_dir / "sandvisor.db"))
    (pid,) = db.execute("SELECT qemu_pid FROM sandboxes WHERE id=?", (id,)).fetchone()
    db.close()
    return int(pid)


async def test_idempotent_and_racing_creates_make_one_sandbox(daemon: DaemonConfig) -> None:
    async with connect(daemon.socket) as c, c.open_call("Events", {"id": "twin", "action": "created"}) as created:
        results: list[dict[str, Any]] = []

        async def create() -> None:
            results.append(await c.call("Create", {"id": "twin", "labels": {"k": "v"}}))

        async with trio.open_nursery() as n:
            n.start_soon(create)
            n.start_soon(create)
        assert results == [{"id": "twin", "ip_address": "", "state": "starting"}] * 2
        with trio.fail_after(5):
            assert (await created.__anext__())["sandbox_id"] == "twin"
        with trio.move_on_after(0.5):  # one sandbox: one "created", however many Creates
            extra = await created.__anext__()
            pytest.fail(f"a second created event: {extra}")
        listed = await c.call("List", {})
        assert [s["id"] for s in listed["sandboxes"]] == ["twin"]
        with pytest.raises(ApiError) as e:
            await c.call("Create", {"id": "twin", "labels": {"k": "other"}})
        assert e.value.code == "ALREADY_EXISTS"
        await wait_state(c, "twin", "ready")
        every = await c.call("MetricsAll", {})
        assert [m["id"] for m in every["sandboxes"]] == ["twin"] and every["sandboxes"][0]["host_rss_bytes"] > 0
        samples = []
        async with c.open_call("MetricsStream", {"id": "twin", "interval_seconds": 0.2}) as ms:
            async for m in ms:
                samples.append(m)
                if len(samples) == 3:
                    break  # leaving the block cancels the stream
        assert [m["id"] for m in samples] == ["twin"] * 3
        assert samples[0]["timestamp"] < samples[1]["timestamp"] < samples[2]["timestamp"]
        # Run while running is FAILED_PRECONDITION
        async with trio.open_nursery() as n:
            n.start_soon(run, c, "twin", ["sleep", "3"])
            await wait_state(c, "twin", "running")
            with pytest.raises(ApiError) as e:
                await run(c, "twin", ["true"])
            assert e.value.code == "FAILED_PRECONDITION"
        await c.call("Kill", {"id": "twin"})
        assert (await c.call("Inspect", {"id": "twin"}))["state"] == "stopped"


async def test_eight_concurrent_creates_labels_and_pages(daemon: DaemonConfig) -> None:
    async with connect(daemon.socket) as c:
        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(c.call, "Create", {"id": f"sb{i}", "labels": {"team": "a" if i < 5 else "b", "n": str(i)}})
        with trio.fail_after(240):
            for i in range(8):
                await wait_state(c, f"sb{i}", "ready", timeout=240)
        everything = [s["id"] for s in (await c.call("List", {"limit": 100}))["sandboxes"]]  # newest first
        team_a = [i for i in everything if int(i[2:]) < 5]
        page1 = await c.call("List", {"labels": {"team": "a"}, "limit": 3})
        assert [s["id"] for s in page1["sandboxes"]] == team_a[:3]
        page2 = await c.call("List", {"labels": {"team": "a"}, "limit": 3, "cursor": page1["next_cursor"]})
        assert [s["id"] for s in page2["sandboxes"]] == team_a[3:] and page2["next_cursor"] == ""
        created = [s["created_at"] for s in (await c.call("List", {"limit": 100}))["sandboxes"]]
        assert created == sorted(created, reverse=True)
        both = await c.call("List", {"labels": {"team": "b", "n": "6"}})
        assert [s["id"] for s in both["sandboxes"]] == ["sb6"]
        ready = await c.call("List", {"state": "ready", "limit": 100})
        assert len(ready["sandboxes"]) == 8
        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(c.call, "Kill", {"id": f"sb{i}"})


async def test_ttl_removes_and_idle_timeout_stops(daemon: DaemonConfig) -> None:
    """TTL removes (from creation, whatever the state); the idle timeout stops a sandbox
    that had no activity for that long, and activity (a workload) postpones it."""
    events: list[tuple[str, str, int]] = []
    async with connect(daemon.socket) as c, trio.open_nursery() as n:

        async def watch(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            async with c.open_call("Events", {}) as ev:
                task_status.started()  # its Call frame is out, ahead of Create's on this connection
                async for e in ev:
                    events.append((e["sandbox_id"], e["action"], e["timestamp"]))

        def of(id: str) -> list[str]:
            return [a for i, a, _ in events if i == id]

        def when(id: str, action: str) -> float:
            return next(t for i, a, t in events if i == id and a == action) / 1e9

        await n.start(watch)
        await c.call("Create", {"id": "short", "ttl_seconds": 1})
        await c.call("Create", {"id": "idle", "idle_timeout_seconds": 2})
        await c.call("Create", {"id": "busy", "idle_timeout_seconds": 2})
        await wait_state(c, "busy", "ready")
        _, _, code = await run(c, "busy", ["sleep", "3"])  # activity beyond the idle timeout
        assert code == 0
        with trio.fail_after(60):
            while "removed" not in of("short") or "stopped" not in of("idle") or "stopped" not in of("busy"):
                await trio.sleep(0.1)
        n.cancel_scope.cancel()
    assert of("short")[0] == "created" and of("short")[-1] == "removed"
    with pytest.raises(ApiError) as e:
        async with connect(daemon.socket) as c:
            await c.call("Inspect", {"id": "short"})
    assert e.value.code == "NOT_FOUND"
    assert of("idle") == ["created", "ready", "stopping", "stopped"]
    assert when("idle", "stopping") - when("idle", "ready") >= 2.0  # not before the timeout
    assert of("busy") == ["created", "ready", "running", "idle", "stopping", "stopped"]
    # the workload was activity: the idle clock restarted when it ended (its idle event)
    assert when("busy", "stopping") - when("busy", "idle") >= 1.9


async def test_idempotent_create_compares_what_was_requested(daemon: DaemonConfig) -> None:
    """A retried Create is the same sandbox even after the sandbox changed: its host
    ports were filled in, a port was exposed at run time."""
    req = {"id": "same", "network": {"mode": "user"}, "ports": [{"sandbox_port": 8000}]}
    async with connect(daemon.socket) as c:
        first = await c.call("Create", req)
        await wait_state(c, "same", "ready")
        assert await c.call("Create", req) == first
        await c.call("ExposePort", {"id": "same", "sandbox_port": 8001})
        assert await c.call("Create", req) == first
        with pytest.raises(ApiError) as e:
            await c.call("Create", {**req, "ports": [{"sandbox_port": 8001}]})
        assert e.value.code == "ALREADY_EXISTS"
        listed = (await c.call("List", {}))["sandboxes"]
        assert [(s["id"], s["ip_address"]) for s in listed] == [("same", "10.0.2.15")]
        await c.call("Stop", {"id": "same"})
        started = await c.call("Start", {"id": "same"})
        assert started["ip_address"] == "10.0.2.15"
        await c.call("Remove", {"id": "same", "force": True})


async def test_exec_input_errors_are_typed_and_a_failed_initial_cmd_idles_once(daemon: DaemonConfig) -> None:
    async with connect(daemon.socket) as c:
        actions: list[tuple[str, dict[str, str]]] = []
        async with c.open_call("Events", {"id": "oops"}) as ev:
            await c.call("Create", {"id": "oops", "cmd": ["/no/such/program"]})
            with trio.fail_after(90):
                async for e in ev:
                    actions.append((e["action"], e["attributes"]))
                    if e["action"] == "idle":
                        break
            with trio.move_on_after(1):
                async for e in ev:
                    actions.append((e["action"], e["attributes"]))
        assert [a for a, _ in actions] == ["created", "ready", "running", "idle"], actions
        assert actions[-1][1]["exit_code"] == "127" and actions[-1][1]["error"]
        # resize without a TTY: a typed error from the input pump, not INTERNAL
        with pytest.raises(ApiError) as err:
            async with c.open_call("Exec", {"init": {"id": "oops", "cmd": ["cat"]}}) as ex:
                await ex.send({"resize": {"width": 100, "height": 30}})
                async for _ in ex:
                    pass
        assert err.value.code == "INVALID_ARGUMENT" and "tty" in err.value.message
        with pytest.raises(ApiError) as err:
            async with c.open_call("Exec", {"init": {"id": "oops", "cmd": ["cat"]}}) as ex:
                await ex.send({"stdin": "not bytes"})
                async for _ in ex:
                    pass
        assert err.value.code == "INVALID_ARGUMENT"
        out, _, code = await run(c, "oops", ["echo", "still fine"])
        assert (out, code) == (b"still fine\n", 0)


async def test_drain_finishes_inflight_work_and_log_follow(daemon: DaemonConfig) -> None:
    async with connect(daemon.socket) as c:
        await c.call("Create", {"id": "drainee"})
        await wait_state(c, "drainee", "ready")
        followed: list[bytes] = []
        results: list[tuple[bytes, bytes, int]] = []
        async with trio.open_nursery() as n:

            async def follow() -> None:
                async with c.open_call("Logs", {"id": "drainee", "follow": True}) as lg:
                    async for e in lg:
                        followed.append(e["data"])
                        if e["data"] == b"slow done\n":
                            return

            async def slow() -> None:
                results.append(await run(c, "drainee", ["sh", "-c", "sleep 2; echo slow done"]))

            n.start_soon(follow)
            n.start_soon(slow)
            await wait_state(c, "drainee", "running")
            await c.call("Drain", {"id": "drainee"})
            with pytest.raises(ApiError) as e:
                await c.call("Ping", {"id": "drainee"})
            assert e.value.code == "FAILED_PRECONDITION"
            info = await c.call("WaitUntilStopped", {"id": "drainee"})
        assert info["state"] == "stopped" and info["last_exit_code"] == 0
        assert results == [(b"slow done\n", b"", 0)]
        assert b"slow done\n" in followed


@pytest.fixture
async def impatient_daemon(image: Image) -> AsyncIterator[DaemonConfig]:
    async with running_daemon("sv-i-", boot_timeout=6) as cfg:
        yield cfg


async def test_boot_that_never_gets_ready_fails_after_the_timeout(impatient_daemon: DaemonConfig) -> None:
    async with connect(impatient_daemon.socket) as c:
        await c.call("Create", {"id": "hung", "boot_args": "sandvisor.port=nowhere"})  # guestd finds no port
        info = await wait_state(c, "hung", "failed", timeout=60)
        assert "within 6s" in info["error"]
        logs = await c.collect("Logs", {"id": "hung"})
        assert any(e["source"] == "system" for e in logs)  # the console tail is kept for diagnosis
        await c.call("Remove", {"id": "hung"})


async def test_initial_cmd_runs_after_boot_and_exec_resizes(daemon: DaemonConfig) -> None:
    async with connect(daemon.socket) as c:
        events: list[tuple[str, dict[str, str]]] = []
        async with c.open_call("Events", {"id": "withcmd"}) as ev:
            await c.call("Create", {"id": "withcmd", "cmd": ["sh", "-c", "echo from-cmd; exit 4"], "env": {"A": "1"}})
            with trio.fail_after(90):
                async for e in ev:
                    events.append((e["action"], e["attributes"]))
                    if e["action"] == "idle":
                        break
        assert [a for a, _ in events] == ["created", "ready", "running", "idle"]
        assert events[-1][1]["exit_code"] == "4"
        info = await c.call("Inspect", {"id": "withcmd"})
        assert info["state"] == "ready" and info["last_exit_code"] == 4
        assert info["network"]["ip_address"] == ""  # network mode none (the default)
        out, _, _ = await run(c, "withcmd", ["ls", "/sys/class/net"])
        assert out.split() == [b"lo"]  # no NIC at all, only loopback
        logs = await c.collect("Logs", {"id": "withcmd"})
        assert any(e["data"] == b"from-cmd\n" and e["source"] == "stdout" for e in logs)

        got = b""
        init = {"id": "withcmd", "cmd": ["sh"], "tty": True, "tty_size": {"width": 80, "height": 24}}
        async with c.open_call("Exec", {"init": init}) as ex:
            await ex.send({"stdin": b"stty size\n"})
            async for item in ex:
                got += item["data"]
                if b"24 80" in got:
                    break
            await ex.send({"resize": {"width": 120, "height": 40}})
            await ex.send({"stdin": b"stty size; exit\n"})
            async for item in ex:
                got += item["data"]
        assert b"40 120" in got


def _http_get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(b"GET /hello.txt HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := c.recv(65536):
            data += chunk
        return data


async def _wait_http(port: int, timeout: float = 60) -> bytes:
    with trio.fail_after(timeout):
        while True:
            try:
                reply = await trio.to_thread.run_sync(_http_get, port)
                if reply.startswith(b"HTTP/1.0 200"):
                    return reply
            except OSError:
                pass
            await trio.sleep(0.3)


async def test_user_network_exposed_ports(daemon: DaemonConfig) -> None:
    from actors.net.ports import free_port

    web_port = free_port("127.0.0.1", "tcp")
    serve_http = "cd /tmp && echo hello-from-guest > hello.txt && (python3 -m http.server 8000 >/dev/null 2>&1 &)"
    async with connect(daemon.socket) as c:
        resp = await c.call(
            "Create",
            {"id": "web", "network": {"mode": "user"}, "ports": [{"sandbox_port": 8000, "host_port": web_port}]},
        )
        assert resp["ip_address"] == "10.0.2.15"
        info = await wait_state(c, "web", "ready")
        assert info["network"]["ip_address"] == "10.0.2.15" and info["network"]["gateway"] == "10.0.2.2"
        await run(c, "web", ["sh", "-c", serve_http])
        assert (await _wait_http(web_port)).rstrip().endswith(b"hello-from-guest")

        with pytest.raises(ApiError) as e:  # restricted slirp drops UDP replies: refused up front
            await c.call("ExposePort", {"id": "web", "sandbox_port": 9999, "protocol": "udp"})
        assert e.value.code == "FAILED_PRECONDITION"

        # the same sandbox port again: its mapping (a retry is safe); on another host port: a conflict
        again = await c.call("ExposePort", {"id": "web", "sandbox_port": 8000})
        assert again == {"host_port": web_port, "guest_port": 8000}
        with pytest.raises(ApiError) as e:
            await c.call("ExposePort", {"id": "web", "sandbox_port": 8000, "host_port": free_port("127.0.0.1", "tcp")})
        assert e.value.code == "ALREADY_EXISTS" and str(web_port) in e.value.message
        # a host port that is taken
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            with pytest.raises(ApiError) as e:
                await c.call("ExposePort", {"id": "web", "sandbox_port": 8001, "host_port": taken.getsockname()[1]})
            assert e.value.code == "ALREADY_EXISTS" and "in use" in e.value.message

        # restrict=on: the guest cannot reach a server on the host
        with socket.socket() as host_srv:
            host_srv.bind(("127.0.0.1", 0))
            host_srv.listen(1)
            port = host_srv.getsockname()[1]
            probe = (
                "import socket, sys\n"
                f"for target in (('10.0.2.2', {port}), ('127.0.0.1', {port})):\n"
                "    try:\n"
                "        socket.create_connection(target, timeout=3); sys.exit('reached ' + str(target))\n"
                "    except OSError:\n"
                "        pass\n"
            )
            _, err, code = await run(c, "web", ["python3", "-c", probe])
            assert code == 0, err

        # unexpose closes the host port
        await c.call("UnexposePort", {"id": "web", "sandbox_port": 8000})
        with pytest.raises(OSError):
            await trio.to_thread.run_sync(_http_get, web_port)
        with pytest.raises(ApiError) as e:
            await c.call("UnexposePort", {"id": "web", "sandbox_port": 8000})
        assert e.value.code == "NOT_FOUND"

        # mappings persist: re-exposed, stopped, started -> applied again
        await c.call("ExposePort", {"id": "web", "sandbox_port": 8000, "host_port": web_port})
        await c.call("Stop", {"id": "web"})
        with pytest.raises(OSError):
            await trio.to_thread.run_sync(_http_get, web_port)
        await c.call("Start", {"id": "web"})
        await wait_state(c, "web", "ready")
        await run(c, "web", ["sh", "-c", serve_http])
        assert (await _wait_http(web_port)).rstrip().endswith(b"hello-from-guest")
        await c.call("Remove", {"id": "web", "force": True})
        with pytest.raises(OSError):
            await trio.to_thread.run_sync(_http_get, web_port)

        for bad, code in (
            # this supervisor has no tap networking (throwaway supervisors run in the
            # machine's own namespace: tests/vm/test_net_supervisor.py makes its own)
            ({"id": "x", "network": {"mode": "tap"}}, "FAILED_PRECONDITION"),
            *(  # jailed outbound goes through the (absent) filter
                [({"id": "x", "network": {"mode": "user", "outbound": True}}, "FAILED_PRECONDITION")]
                if os.geteuid() == 0
                else []
            ),
            ({"id": "x", "network": {"mode": "bridge"}}, "INVALID_ARGUMENT"),
            ({"id": "x", "ports": [{"sandbox_port": 80}]}, "FAILED_PRECONDITION"),
            ({"id": "x", "network": {"mode": "user"}, "ports": [{"sandbox_port": 70000}]}, "INVALID_ARGUMENT"),
        ):
            with pytest.raises(ApiError) as e:
                await c.call("Create", bad)
            assert e.value.code == code, bad
