"""The E2B endpoint's pure parts for PTY, watchers, gzip, metrics and get_host
(the real SDK against a real VM: tests/vm/test_e2b_more.py)."""

from __future__ import annotations

import base64
import gzip
import struct
from typing import Any

import pytest
import trio

from supervisor.serve import e2b_envd, e2b_http, e2b_metrics, e2b_proxy, e2b_pty, e2b_watch
from supervisor.wire import protocol


def _exchange(headers: dict[str, str], body: list[bytes] | None = None) -> e2b_http.Exchange:
    pieces = list(body or [])

    async def receive() -> dict[str, Any]:
        if not pieces:
            return {"type": "http.disconnect"}
        piece = pieces.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    scope = {
        "method": "POST",
        "path": "/",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    return e2b_http.Exchange(scope, receive, None)  # type: ignore[arg-type]


def test_pty_size_and_input() -> None:
    assert e2b_pty.pty_size({}) is None
    assert e2b_pty.pty_size({"pty": {"size": {"cols": 100, "rows": 30}}}) == (100, 30)
    for bad in ({"cols": -1, "rows": 1}, {"cols": "x", "rows": 1}, {"cols": 5000, "rows": 1}):
        with pytest.raises(e2b_http.RpcError):
            e2b_pty.pty_size({"pty": {"size": bad}})
    assert e2b_pty.input_bytes({"pty": base64.b64encode(b"ls\n").decode()}) == ("pty", b"ls\n")
    assert e2b_pty.input_bytes({"stdin": ""}) == ("stdin", b"")
    for bad_input in (None, {}, {"stdin": "!!"}):
        with pytest.raises(e2b_http.RpcError):
            e2b_pty.input_bytes(bad_input)


def test_client_stream_messages_split_anywhere() -> None:
    def env(value: bytes, flags: int = 0) -> bytes:
        return struct.pack(">BI", flags, len(value)) + value

    raw = env(b'{"start": {}}') + env(b'{"data": {}}') + env(b"{}", e2b_http.END_STREAM)
    got: list[dict[str, Any]] = []

    async def main() -> None:
        ex = _exchange({}, [raw[i : i + 3] for i in range(0, len(raw), 3)])
        async for m in e2b_pty._messages(ex):
            got.append(m)

    trio.run(main)
    assert got == [{"start": {}}, {"data": {}}]

    async def truncated() -> None:
        async for _ in e2b_pty._messages(_exchange({}, [raw[:7]])):
            pass

    with pytest.raises(e2b_http.RpcError):
        trio.run(truncated)


def test_watch_diff() -> None:
    w = e2b_watch.Watcher("/d", "user", False, True)
    w.seen = {"a": ("FILE_TYPE_FILE", "1", "t1", "-rw-r--r--"), "b": ("FILE_TYPE_FILE", "1", "t1", "-rw-r--r--")}
    now = {
        "a": ("FILE_TYPE_FILE", "2", "t2", "-rw-r--r--"),
        "c": ("FILE_TYPE_DIRECTORY", "0", "t2", "drwxr-xr-x"),
    }
    events = e2b_watch._diff(w, now, {"c": {"name": "c"}})
    assert [(e["name"], e["type"]) for e in events] == [
        ("a", "EVENT_TYPE_WRITE"),
        ("c", "EVENT_TYPE_CREATE"),
        ("b", "EVENT_TYPE_REMOVE"),
    ]
    assert events[1]["entry"] == {"name": "c"}
    assert e2b_watch._diff(w, dict(now), {}) == []
    now["a"] = ("FILE_TYPE_FILE", "2", "t2", "-rwxr-xr-x")
    assert e2b_watch._diff(w, now, {}) == [{"name": "a", "type": "EVENT_TYPE_CHMOD"}]
    assert e2b_watch._rel("/d", "/d/sub/x") == "sub/x"


def test_gzip_both_ways() -> None:
    assert e2b_envd.accepts_gzip(_exchange({"Accept-Encoding": "br, gzip;q=0.5"}))
    assert not e2b_envd.accepts_gzip(_exchange({"Accept-Encoding": "gzip;q=0"}))
    assert not e2b_envd.accepts_gzip(_exchange({}))
    data = b"x" * 300_000 + bytes(range(256))
    packed = gzip.compress(data)

    async def body(pieces: list[bytes]) -> Any:
        async for p in e2b_envd.gunzip(_exchange({}, pieces).chunks()):
            yield p

    async def collect(pieces: list[bytes]) -> bytes:
        out = bytearray()
        async for p in body(pieces):
            out += p
        return bytes(out)

    assert trio.run(collect, [packed[:10], packed[10:]]) == data
    for bad in ([packed[:-9]], [b"not gzip at all"]):
        with pytest.raises(e2b_http.HttpError):
            trio.run(collect, bad)


def test_metrics_shape() -> None:
    sample = protocol.MetricsResponse(
        id="s",
        timestamp=1_700_000_000_500_000_000,
        cpu_percent=12.345,
        memory_total_bytes=1000,
        memory_available_bytes=400,
        host_rss_bytes=0,
        disk_read_bytes=0,
        disk_write_bytes=0,
        net_rx_bytes=0,
        net_tx_bytes=0,
        uptime_seconds=1.0,
        root_used_bytes=10,
        root_free_bytes=90,
    )
    m = e2b_metrics.e2b_metrics(sample, 2)
    assert m["timestampUnix"] == 1_700_000_000 and m["timestamp"].endswith("Z")
    assert (m["cpuCount"], m["cpuUsedPct"], m["memUsed"], m["memTotal"]) == (2, 12.35, 600, 1000)
    assert (m["diskUsed"], m["diskTotal"], m["memCache"]) == (10, 100, 0)


def test_proxy_host_routing() -> None:
    assert e2b_proxy.target(_exchange({"Host": "8080-abc-1.127.0.0.1:3000"})) == (8080, "abc-1")
    assert e2b_proxy.target(_exchange({"Host": "127.0.0.1:3000"})) is None
    assert e2b_proxy.target(_exchange({"Host": "localhost"})) is None
    with pytest.raises(e2b_http.HttpError):
        e2b_proxy.target(_exchange({"Host": "99999-abc.x"}))
