"""Host-side consumers of guest bytes, on hostile input (issue 21): the guest channel's
frame decoder and the copy-out tar reader as Hypothesis properties ("a typed error or a
valid result, never another exception"), and a hostile guestd's answers (out-of-range
values, garbage frames after its hello) through the registry and the server's
mappings: at most that call, or that sandbox, fails, with a typed error."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from fakevm import FakeLab
from test_registry import ready, registry, run
from trio.testing import MockClock

from actors.errors import DomainError
from actors.model import SandboxConfig, State
from guestd import proto as P
from supervisor import mapping as M
from supervisor import protocol as W
from supervisor.grpc_convert import dict_to_message
from supervisor.proto.sandvisor.v1 import sandvisor_pb2 as sv

NAN, INF = math.nan, math.inf
BIG = 2**64 - 1
NEG = -(2**63)

TAMPERED: dict[str, dict[str, dict[str, Any]]] = {
    "metrics negative": {"metrics_ok": {"mem": {"total": NEG, "available": -1}, "disk": {"read_bytes": -5}}},
    "metrics huge": {"metrics_ok": {"mem": {"total": BIG}, "net": {"rx_bytes": BIG, "tx_bytes": BIG}}},
    "metrics nan uptime": {"metrics_ok": {"uptime": NAN, "cpu_seconds": {"user": INF}}},
    "metrics inf uptime": {"metrics_ok": {"uptime": -INF, "ncpu": -1}},
    "metrics missing keys": {"metrics_ok": {"mem": {}, "disk": {}, "net": {}, "cpu_seconds": {}}},
    "metrics wrong types": {"metrics_ok": {"uptime": "soon", "mem": {"total": "lots"}}},
    "metrics not a dict": {"metrics_ok": {"mem": [1, 2, 3]}},
    "pong": {"pong": {"activity": BIG, "guest_ns": NEG}},
    "ok": {"ok": {"activity": NEG, "value": BIG}},
    "exit": {"exit": {"code": BIG, "signal": NEG}},
    "exit wrong type": {"exit": {"code": "zero"}},
    "exec_started": {"exec_started": {"pid": NEG}},
    "file_info": {"file_info": {"size": -1, "mode": BIG}},
    "error": {"error": {"code": "\0" * 1000, "message": "x" * 100_000}},
    "hello marks": {"hello_ok": {"marks": {"init": NAN, "python": INF}}},
    "hello numbers": {"hello_ok": {"ready_ns": BIG, "activity": -1}},
    "hello extra keys": {"hello_ok": {"future": {"a": [1, 2]}}},  # ignored, as newer peers may add them
}
HARMLESS = {"metrics missing keys", "hello extra keys", "error", "a hello_ok again"}  # (error: never sent)
GARBAGE = {
    "garbage frame": b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1",
    "frame too large": b"\x7f\xff\xff\xff",
    "not a map": b"\x00\x00\x00\x01\x05",
    "unknown tag": b"\x00\x00\x00\x0a\x81\xa1t\xa6nosuch",
    "a hello_ok again": b"",
}


@pytest.fixture
def clock() -> MockClock:
    return MockClock(autojump_threshold=0.02)


async def _exercise(sb: Any) -> list[str]:
    """Every call a client makes of a sandbox whose answers a guest makes: a typed error
    or a result the server can encode (both wires)."""
    outcomes = []

    async def one(name: str, call: Any) -> None:
        try:
            with trio.fail_after(120):
                await call()
            outcomes.append(f"{name}: ok")
        except DomainError as exc:
            outcomes.append(f"{name}: {type(exc).__name__}")

    async def metrics() -> None:
        m = await sb.metrics()
        body = W.unstructure_body(M.metrics(m))
        W.encode(W.Reply(1, body))
        dict_to_message(body, sv.SandboxMetrics)

    async def runs() -> None:
        await run(sb, "echo", "hi")

    async def ping() -> None:
        await sb.guest_call(lambda g: g.channel.ping())

    async def read() -> None:
        async with sb.read_file("/tmp/f") as f:
            async for _ in f:
                pass

    async def write() -> None:
        async def one_chunk() -> AsyncIterator[bytes]:
            yield b"x"

        await sb.write_file("/tmp/f", one_chunk(), mode=0o644)

    calls = (("metrics", metrics), ("run", runs), ("ping", ping), ("write", write), ("read", read))
    for name, call in calls:
        await one(name, call)
    return outcomes


@pytest.mark.parametrize("what", sorted(TAMPERED) + sorted(GARBAGE))
async def test_a_hostile_answer_fails_at_most_its_own_sandbox(what: str, tmp_path: Path, clock: MockClock) -> None:
    """Out-of-range numbers (an exit code of 2**64-1 once took the store's writer and
    with it the registry down: SQLite holds int64), wrong types, garbage frames after
    the hello: that sandbox's calls fail typed; another sandbox is served as before."""
    lab = FakeLab()
    async with registry(tmp_path, lab, guest_timeout=30) as reg:
        if what in TAMPERED:
            lab.hostile.tampered = TAMPERED[what]
        else:
            hello = P.encode(P.HelloOk(version=P.PROTOCOL_VERSION, pid=1, boot_ns=0, ready_ns=0, activity=0))
            lab.hostile.garbage_after_hello = GARBAGE[what] or hello
        bad = await reg.create("bad", SandboxConfig())
        with trio.fail_after(120):
            await bad.ready_event.wait()
        if what.startswith("hello ") and what not in HARMLESS:  # the hello is the boot: it fails
            assert bad.state == State.FAILED and "protocol error" in bad.record.error, bad.record.error
        else:
            outcomes = await _exercise(bad)
            if what in HARMLESS:
                assert all(o.endswith(": ok") for o in outcomes), outcomes
            else:  # the guest broke the protocol: its channel is closed, its calls Unavailable
                assert "Unavailable" in "".join(outcomes), outcomes
        lab.hostile.tampered, lab.hostile.garbage_after_hello = {}, b""
        good = await reg.create("good", SandboxConfig())
        await ready(good)
        assert (await run(good, "echo", "hi")) == (b"hi\n", 0)
        assert good.state == State.READY
