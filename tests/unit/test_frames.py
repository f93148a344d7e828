"""Unit tests of the client edge without VMs: the framed stream (both transports),
the plain-map codec against the protocol's converter, the SDK's spec and typed
results against a fake server, the CLI's tables against rich, and the one-shot
commands' import discipline."""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from supervisor.client import (
    AsyncSandbox,
    Boot,
    Lifetime,
    NotFound,
    Resources,
    SandboxInfo,
    SandboxSpec,
    Unavailable,
    Workload,
)
from supervisor.client.cli_output import plain_table, rich_table
from supervisor.client.sdk.aio import connect
from supervisor.wire import frames, protocol
from supervisor.wire.errors import ApiError

ROOT = Path(__file__).resolve().parents[2]

# --- the plain-map codec speaks the converter's wire -----------------------------------
_id = st.integers(0, 2**31)
_text = st.text(max_size=20)
_body = st.dictionaries(
    st.text(max_size=8), st.one_of(st.integers(-(2**40), 2**40), _text, st.binary(max_size=16), st.booleans())
)
envelopes = st.one_of(
    st.builds(protocol.ClientHello, version=_id, client=_text),
    st.builds(protocol.ServerHello, version=_id, server=_text),
    st.builds(protocol.Call, id=_id, method=_text, body=_body),
    st.builds(protocol.Send, id=_id, body=_body),
    st.builds(protocol.HalfClose, id=_id),
    st.builds(protocol.Cancel, id=_id),
    st.builds(protocol.Reply, id=_id, body=_body),
    st.builds(protocol.Item, id=_id, body=_body),
    st.builds(protocol.End, id=_id),
    st.builds(protocol.Fail, id=_id, code=st.sampled_from(sorted(protocol.CODES)), message=_text),
)


@given(envelopes)
def test_plain_maps_and_the_converter_write_the_same_wire(msg: protocol.Envelope) -> None:
    frame = protocol.encode(msg)
    as_map = frames.unpack(frame[4:])
    assert as_map == protocol.converter.unstructure(msg, protocol.Envelope)
    assert protocol.decode(frames.pack(as_map)[4:]) == msg


@given(st.binary(max_size=64))
def test_unpack_of_garbage_is_invalid_argument(body: bytes) -> None:
    try:
        obj = frames.unpack(body)
    except ApiError as exc:
        assert exc.code == protocol.INVALID_ARGUMENT
    else:
        assert isinstance(obj, dict) and isinstance(obj["t"], str)


@given(st.lists(envelopes, max_size=6), st.data())
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_frame_reader_reassembles_any_chunking(msgs: list[protocol.Envelope], data: st.DataObject) -> None:
    stream = b"".join(protocol.encode(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    r = frames.FrameReader()
    got = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        r.feed(stream[a:b])
        while (body := r.next()) is not None:
            got.append(protocol.decode(body))
    assert got == msgs and r.buffered == 0


def test_frames_over_the_cap_are_resource_exhausted() -> None:
    r = frames.FrameReader(max_frame=10)
    r.feed(struct.pack(">I", 11))  # the header alone says so
    with pytest.raises(ApiError) as e:
        r.next()
    assert e.value.code == protocol.RESOURCE_EXHAUSTED
    with pytest.raises(ApiError) as e:
        frames.frame(b"x" * 11, max_frame=10)
    assert e.value.code == protocol.RESOURCE_EXHAUSTED
    with pytest.raises(ApiError) as e:
        protocol.encode(protocol.Call(1, "WriteFile", {"data": b"x" * protocol.MAX_FRAME}))
    assert e.value.code == protocol.RESOURCE_EXHAUSTED


# --- FramedStream (Trio): what the server and the async SDK use --------------------------
def envelope_pair() -> tuple[frames.FramedStream, frames.FramedStream]:
    a, b = trio.testing.memory_stream_pair()
    return frames.FramedStream(a), frames.FramedStream(b)


async def test_framed_stream_round_trip_eof_and_truncation() -> None:
    a, b = envelope_pair()
    await a.send(protocol.Call(1, "List", {"limit": 3}))
    await a.send(protocol.End(1))
    assert await b.receive() == protocol.Call(1, "List", {"limit": 3})
    assert await b.receive() == protocol.End(1)
    await a.stream.send_all(protocol.encode(protocol.End(2))[:5])  # a frame cut short, then EOF
    await a.aclose()
    assert await b.receive() is None
    with pytest.raises(trio.ClosedResourceError):
        await a.send(protocol.End(3))
    await a.aclose()  # idempotent


async def test_framed_stream_typed_errors() -> None:
    x, y = trio.testing.memory_stream_pair()
    reader = frames.FramedStream(y, max_frame=100)
    await x.send_all(struct.pack(">I", 101))
    with pytest.raises(ApiError) as e:
        await reader.receive()
    assert e.value.code == protocol.RESOURCE_EXHAUSTED
    x, y = trio.testing.memory_stream_pair()
    reader = frames.FramedStream(y)
    await x.send_all(frames.frame(msgpack.packb({"t": "nonsense"})))
    with pytest.raises(ApiError) as e:
        await reader.receive()
    assert e.value.code == protocol.INVALID_ARGUMENT


async def test_framed_stream_concurrent_senders_never_interleave() -> None:
    a, b = envelope_pair()
    big = b"z" * 200_000  # many partial writes each
    sent = [protocol.Item(i, {"data": big}) for i in range(1, 9)]
    got: list[protocol.Envelope | None] = []
    async with trio.open_nursery() as n:
        for m in sent:
            n.start_soon(a.send, m)

        async def read() -> None:
            for _ in sent:
                got.append(await b.receive())

        n.start_soon(read)
    assert sorted(got, key=lambda m: getattr(m, "id", 0)) == sent


async def test_plain_maps_reach_a_framed_stream_as_envelopes() -> None:
    x, y = trio.testing.memory_stream_pair()
    await x.send_all(frames.pack({"t": "call", "id": 7, "method": "Inspect", "body": {"id": "x"}}))
    assert await frames.FramedStream(y).receive() == protocol.Call(7, "Inspect", {"id": "x"})


# --- a fake supervisor on a Unix socket (blocking; one connection at a time) ----------------
Handler = Callable[[dict[str, Any], Callable[[dict[str, Any]], None]], None]


@contextmanager
def fake_supervisor(path: Path, handle: Handler, hello: dict[str, Any] | None = None) -> Iterator[list[dict[str, Any]]]:
    """Answers the hello, then hands each envelope to ``handle(msg, send)``; records them."""
    seen: list[dict[str, Any]] = []
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen()
    srv.settimeout(0.1)
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        reader = frames.FrameReader()

        def send(m: dict[str, Any]) -> None:
            conn.sendall(frames.pack(m))

        with conn:
            first = True
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                reader.feed(data)
                while (body := reader.next()) is not None:
                    msg = frames.unpack(body)
                    seen.append(msg)
                    if first:
                        first = False
                        send(hello or {"t": "hello_ok", "version": 1, "server": "fake"})
                        if hello is not None and hello["t"] == "fail":
                            return
                    else:
                        try:
                            handle(msg, send)
                        except OSError:  # the client left, or the fake hangs up
                            return

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join()
        srv.close()


INFO = {
    "id": "web",
    "state": "ready",
    "labels": {"team": "x"},
    "limits": {"vcpus": 1, "memory_mib": 256},
    "network": {"ip_address": "", "gateway": "", "tap_name": ""},
    "created_at": 1700000000,
    "ready_at": 1700000001,
    "last_exited_at": 0,
    "last_exit_code": 0,
    "error": "",
}


def sandvisor_fake(msg: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> None:
    """Enough of the service for the tests below."""
    if msg["t"] != "call":
        return
    id, method, body = msg["id"], msg["method"], msg["body"]
    if body.get("id") == "nope":
        send({"t": "fail", "id": id, "code": "NOT_FOUND", "message": "no sandbox 'nope'"})
    elif method == "Inspect":
        send({"t": "reply", "id": id, "body": INFO})
    elif method == "List":
        summary = {k: INFO[k] for k in ("id", "state", "labels", "created_at")}
        send({"t": "reply", "id": id, "body": {"sandboxes": [{**summary, "ip_address": ""}], "next_cursor": ""}})
    elif method == "Run":
        send({"t": "item", "id": id, "body": {"stream": "stdout", "data": b"hi\n", "exit_code": 0, "done": False}})
        send({"t": "item", "id": id, "body": {"stream": "exit", "data": b"", "exit_code": 3, "done": True}})
        send({"t": "end", "id": id})
    elif method == "Events":
        for i in range(1000):  # a long stream: the client leaves early
            ev = {"sandbox_id": "web", "action": "ready", "timestamp": i, "attributes": {}}
            send({"t": "item", "id": id, "body": ev})
    elif method == "Hangup":
        raise OSError("the fake hangs up")
    else:
        send({"t": "fail", "id": id, "code": "UNIMPLEMENTED", "message": method})


@pytest.fixture
def sock_path() -> Iterator[Path]:
    # AF_UNIX paths are short: pytest's tmp_path can be too long
    d = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"svf-{os.getpid()}-{threading.get_ident() % 10000}"
    d.mkdir(exist_ok=True)
    try:
        yield d / "s.sock"
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def test_blocking_connection_calls_streams_and_errors(sock_path: Path) -> None:
    with fake_supervisor(sock_path, sandvisor_fake) as seen:
        with frames.BlockingConnection.open(sock_path) as c:
            assert c.call("Inspect", {"id": "web"}) == INFO
            items = list(c.stream("Run", {"id": "web", "cmd": ["true"]}))
            assert [i["stream"] for i in items] == ["stdout", "exit"] and items[1]["exit_code"] == 3
            with pytest.raises(NotFound, match="no sandbox 'nope'"):
                c.call("Inspect", {"id": "nope"})
            events = c.stream("Events", {})
            assert next(events)["timestamp"] == 0
            events.close()  # leaving early cancels the call ...
            assert c.call("Inspect", {"id": "web"})["id"] == "web"  # ... and the connection goes on
        assert seen[0] == {"t": "hello", "version": 1, "client": "sandvisor-cli"}
        assert {"t": "cancel", "id": 4} in seen
        with (
            frames.BlockingConnection.open(sock_path) as c,
            pytest.raises(Unavailable, match="connection to the supervisor lost"),
        ):
            c.call("Hangup")
    with pytest.raises(Unavailable, match="cannot reach the supervisor"):
        frames.BlockingConnection.open(sock_path)


def test_blocking_connection_refused_hello(sock_path: Path) -> None:
    refusal = {"t": "fail", "id": 0, "code": "FAILED_PRECONDITION", "message": "protocol 1 unsupported"}
    with (
        fake_supervisor(sock_path, sandvisor_fake, hello=refusal),
        frames.BlockingConnection.open(sock_path) as c,
        pytest.raises(ApiError) as e,
    ):
        c.call("List")  # the hello is pipelined: its refusal comes with the first call
    assert e.value.code == "FAILED_PRECONDITION"


async def test_the_sdk_sends_typed_requests_and_returns_typed_results(sock_path: Path) -> None:
    with fake_supervisor(sock_path, sandvisor_fake) as seen:
        sb = await AsyncSandbox.get("web", socket=sock_path)
        info = await sb.inspect()
        assert isinstance(info, SandboxInfo) and info.state == "ready" and info.limits.memory_mib == 256
        assert info == protocol.structure_body(INFO, SandboxInfo)
        page = await AsyncSandbox.list(socket=sock_path, labels={"team": "x"})
        assert [(s.id, s.labels) for s in page.sandboxes] == [("web", {"team": "x"})] and page.next_cursor == ""
        r = await sb.run("echo hi")
        assert (r.stdout, r.exit_code) == (b"hi\n", 3)
        with pytest.raises(NotFound):
            await AsyncSandbox.get("nope", socket=sock_path)
    calls = {m["method"]: m["body"] for m in seen if m["t"] == "call"}
    assert calls["List"] == protocol.unstructure_body(protocol.ListSandboxesRequest(labels={"team": "x"}, limit=20))
    assert calls["Run"] == protocol.unstructure_body(protocol.RunRequest(id="web", cmd=["sh", "-c", "echo hi"]))


async def test_a_supervisor_gone_mid_connection_is_unavailable_not_a_stream_error(sock_path: Path) -> None:
    """Chaos saw a client get trio.BrokenResourceError, no code, from a call it sent as
    the supervisor was killed: every error a caller sees has one of sandbox.v1's codes."""
    with fake_supervisor(sock_path, sandvisor_fake):
        async with connect(sock_path) as c:
            with pytest.raises(Unavailable):
                await c.call("Hangup")  # the supervisor hangs up
            with pytest.raises(Unavailable, match="connection to the supervisor lost"):
                await c._send(protocol.Call(99, "Inspect", {"id": "web"}))  # a send into the dead socket
            with pytest.raises(Unavailable):
                await c.call("Inspect", {"id": "web"})


def test_the_blocking_sdk_runs_the_same_plans_on_a_socket_without_loop_or_thread(sock_path: Path) -> None:
    """Sandbox (sync) runs the plans AsyncSandbox runs, on a plain socket: typed results,
    a live stream as a generator left early, Events and Inspect multiplexed on one
    connection (wait_ready), typed errors; and it starts no thread and imports no trio."""
    script = """import sys, threading
from supervisor.client.sdk.sync import Sandbox
from supervisor.wire.errors import NotFound
from supervisor.wire.protocol import SandboxInfo
path = sys.argv[1]
sb = Sandbox.get("web", socket=path)
info = sb.inspect()
assert isinstance(info, SandboxInfo) and info.limits.memory_mib == 256
r = sb.run("echo hi")
assert (r.stdout, r.exit_code) == (b"hi\\n", 3), r
assert [(o.stream, o.exit_code) for o in sb.run_stream(["true"])] == [("stdout", None), ("exit", 3)]
events = sb.events()
assert next(events).timestamp == 0 and threading.active_count() == 1
events.close()
assert sb.wait_ready(5).state == "ready"
assert [s.id for s in Sandbox.list(socket=path, labels={"team": "x"}).sandboxes] == ["web"]
try:
    Sandbox.get("nope", socket=path)
except NotFound:
    pass
else:
    raise AssertionError("no NotFound")
print("trio" in sys.modules, threading.active_count())
"""
    with fake_supervisor(sock_path, sandvisor_fake) as seen:
        p = subprocess.run(
            [sys.executable, "-c", script, str(sock_path)], capture_output=True, text=True, timeout=60, check=False
        )
    assert p.returncode == 0, p.stderr
    assert p.stdout == "False 1\n"
    calls = [(m["method"], m["body"]) for m in seen if m["t"] == "call"]
    assert ("Run", protocol.unstructure_body(protocol.RunRequest(id="web", cmd=["sh", "-c", "echo hi"]))) in calls
    assert ("List", protocol.unstructure_body(protocol.ListSandboxesRequest(labels={"team": "x"}, limit=20))) in calls
    assert {"t": "hello", "version": 1, "client": "sandvisor-client"} in seen


# --- the SDK's spec ------------------------------------------------------------------------
def test_spec_groups_and_settings_make_the_create_request() -> None:
    base = SandboxSpec(
        labels={"team": "a"},
        resources=Resources(cpus=2, memory_mib=512),
        workload=Workload(env={"A": "1"}, cmd=["sleep", "1"]),
        lifetime=Lifetime(ttl=60),
        boot=Boot(boot_args="quiet"),
    )
    spec = base.with_(env={"B": "2"}, labels={"n": "1"}, memory_mib=1024, ports={8080: 0}, network="user")
    req = spec.request("web")
    assert req == protocol.CreateSandboxRequest(
        id="web",
        labels={"team": "a", "n": "1"},
        boot_args="quiet",
        limits=protocol.ResourceLimits(vcpus=2, memory_mib=1024),
        cmd=["sleep", "1"],
        env={"A": "1", "B": "2"},
        network=protocol.NetworkSpec(mode="user"),
        ports=[protocol.PortMapping(sandbox_port=8080)],
        ttl_seconds=60,
        ttl_action="stop",  # (the SDK's TTL drains and stops, as the microsandbox SDK's)
    )
    assert base.with_() is base and base.workload.env == {"A": "1"}  # frozen, reused
    every = SandboxSpec().with_(
        cpus=1,
        memory_mib=300,
        env={"E": "e"},
        labels={"l": "v"},
        cmd=["true"],
        workdir="/w",
        user="u",
        hostname="h",
        network="user",
        ports={1: 2},
        ttl=5,
        idle_timeout=6,
        ephemeral=True,
    )
    assert every.request() == protocol.CreateSandboxRequest(
        labels={"l": "v"},
        limits=protocol.ResourceLimits(1, 300),
        cmd=["true"],
        env={"E": "e"},
        working_dir="/w",
        user="u",
        network=protocol.NetworkSpec(mode="user"),
        ports=[protocol.PortMapping(1, 2)],
        ttl_seconds=5,
        ttl_action="stop",
        idle_timeout_seconds=6,
        hostname="h",
        ephemeral=True,
    )
    with pytest.raises(TypeError):
        Workload(cmd="echo hi")  # type: ignore[arg-type]


# --- the CLI's tables are rich's, byte for byte ---------------------------------------------
def rich_text(
    headers: tuple[str, ...], rows: list[tuple[str, ...]], show_header: bool, terminal: bool, width: int
) -> str:
    buf = io.StringIO()
    console = Console(
        file=buf,
        width=width,
        force_terminal=terminal,
        color_system="standard" if terminal else None,
        force_jupyter=False,
        legacy_windows=False,
        _environ={},
    )
    console.print(rich_table(headers, rows, show_header=show_header))
    return buf.getvalue()


_cell = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12),
    st.sampled_from(["", "-", "2024-01-02 03:04:05", "team=x,n=1", "{'vcpus': 1}", "a:smile:b", ":100:", "[b]x[/b]"]),
    st.text(max_size=4),
)


@given(
    st.integers(1, 5).flatmap(
        lambda n: st.tuples(
            st.tuples(*[_cell] * n),
            st.lists(st.tuples(*[_cell] * n), max_size=5),
            st.booleans(),
            st.booleans(),
            st.integers(10, 120),
        )
    )
)
@settings(max_examples=400, deadline=None)
def test_plain_tables_are_what_rich_prints(case: Any) -> None:
    headers, rows, show_header, terminal, width = case
    text = plain_table(headers, rows, show_header=show_header, terminal=terminal, width=width)
    if text is not None:
        assert text == rich_text(headers, rows, show_header, terminal, width)


def test_plain_tables_serve_the_usual_output() -> None:
    headers = ("ID", "STATE", "LABELS", "IP", "CREATED")
    rows = [("web", "ready", "team=x", "-", "2024-01-02 03:04:05"), ("db-1", "stopped", "", "-", "-")]
    for terminal in (False, True):
        text = plain_table(headers, rows, show_header=True, terminal=terminal, width=80)
        assert text is not None and text == rich_text(headers, rows, True, terminal, 80)
    info = [("labels", "{'team': 'x'}"), ("limits", "{'vcpus': 1, 'memory_mib': 256}")]
    assert plain_table(("FIELD", "VALUE"), info, show_header=False, terminal=False, width=80) is not None


# --- one-shot commands load no event loop, converter or tables they do not print ------------
def test_one_shot_commands_import_no_event_loop_converter_or_rich(sock_path: Path) -> None:
    script = f"""from __future__ import annotations
import sys
{_fake_source()}
from supervisor.main.cli import main
path = Path({str(sock_path)!r})
with fake_supervisor(path, sandvisor_fake):
    for argv in (["ls", "--json"], ["ls"], ["inspect", "web"], ["inspect", "web", "--json"],
                 ["run", "web", "--", "true"]):
        code = main([*argv[:1], "--socket", str(path), *argv[1:]])
        print("EXIT", code)
heavy = {{m.split(".")[0] for m in sys.modules}} & {{"trio", "rich", "attrs", "attr", "cattrs", "actors", "images",
                                                  "typing", "shutil"}}
print("HEAVY", sorted(heavy))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "HEAVY []" in lines, p.stdout
    assert [x for x in lines if x.startswith("EXIT")] == ["EXIT 0"] * 4 + ["EXIT 3"]
    assert json.loads(lines[0])[0]["id"] == "web"
    assert " web  ready  team=x  -   2023-11-14 22:13:20 " in lines


def _fake_source() -> str:
    """This module's fake supervisor as source, for an interpreter that must not import
    this module (it imports trio and rich)."""
    import inspect

    parts = [
        "import os, socket, threading",
        "from contextlib import contextmanager",
        "from pathlib import Path",
        "from supervisor.wire import frames",
        f"INFO = {INFO!r}",
        inspect.getsource(fake_supervisor),
        inspect.getsource(sandvisor_fake),
    ]
    return "\n".join(parts)
