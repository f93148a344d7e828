"""Host-side consumers of guest bytes, on hostile input: the guest channel's
frame decoder and the copy-out tar reader as Hypothesis properties ("a typed error or a
valid result, never another exception"), and a hostile guestd's answers (out-of-range
values, garbage frames after its hello) through the registry and the server's
mappings: at most that call, or that sandbox, fails, with a typed error."""

from __future__ import annotations

import contextlib
import io
import math
import os
import stat
import struct
import tarfile
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from actors.channel.guest import GuestError, check_ranges, open_channel
from actors.errors import DomainError
from actors.model import SandboxConfig, State
from guestd import proto, tree
from guestd.fsops import TreeError
from supervisor.client.treecopy import umask
from supervisor.serve import mapping
from supervisor.serve.grpc_convert import dict_to_message
from supervisor.wire import protocol
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from tests.support.clocks import work_aware_clock
from tests.support.fakevm import FakeLab
from tests.unit.test_registry import ready, registry, run

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
def clock(monkeypatch: pytest.MonkeyPatch) -> MockClock:
    # virtual time, frozen while the store's thread or qemu-img runs (tests/support/clocks.py)
    return work_aware_clock(monkeypatch)


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
        body = protocol.unstructure_body(mapping.metrics(m))
        protocol.encode(protocol.Reply(1, body))
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
            hello = proto.encode(
                proto.HelloOk(version=proto.PROTOCOL_VERSION, pid=1, boot_ns=0, ready_ns=0, activity=0)
            )
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


# --- properties: the host's parsers of guest bytes ----------------------------------------

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=40),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def _frame(draw: st.DrawFn) -> bytes:
    """A frame of a guest -> host message with arbitrary field values (types, ranges), a
    raw msgpack value, or arbitrary bytes, behind a length prefix that may lie."""
    kind = draw(st.sampled_from(["message", "value", "bytes"]))
    if kind == "message":
        cls = draw(st.sampled_from(sorted(proto.REGISTRY.values(), key=lambda c: c.TAG)))
        body: dict[str, Any] = {"t": cls.TAG}
        for name, _, _ in cls._fields:
            if draw(st.booleans()):
                body[name] = draw(_values)
        if "rid" in body and draw(st.booleans()):
            body["rid"] = draw(st.integers(0, 3))  # a request the host has open, sometimes
        payload = msgpack.packb(body, use_bin_type=True)
    elif kind == "value":
        payload = msgpack.packb(draw(_values), use_bin_type=True)
    else:
        payload = draw(st.binary(max_size=64))
    length = draw(st.one_of(st.just(len(payload)), st.integers(0, 2**32 - 1)))
    return struct.pack(">I", length) + payload


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


@PROPERTY
@given(st.lists(_frame(), max_size=6), st.binary(max_size=64), st.lists(st.integers(0, 10_000), max_size=8))
def test_frame_decoding_is_a_protocol_error_or_messages(frames: list[bytes], tail: bytes, cuts: list[int]) -> None:
    """The host's decoder (FrameDecoder, decode, check_ranges) over any bytes, split
    anywhere: messages, or a ProtocolError; nothing else."""
    dec = proto.FrameDecoder()
    try:
        for piece in _split(b"".join(frames) + tail, cuts):
            dec.feed(piece)
            for msg in dec.messages():
                check_ranges(msg)
                assert isinstance(msg, proto.Message)
    except proto.ProtocolError:
        pass


@PROPERTY
@given(st.lists(_frame(), max_size=6), st.binary(max_size=64), st.lists(st.integers(0, 10_000), max_size=8))
def test_a_channel_fed_anything_fails_typed(frames: list[bytes], tail: bytes, cuts: list[int]) -> None:
    """A real GuestChannel whose guest says hello and then sends anything: the calls in
    flight end with a GuestError (or an answer), the channel's reader never raises into
    its nursery."""
    hello = proto.GUEST_SYNC + proto.encode(
        proto.HelloOk(version=proto.PROTOCOL_VERSION, pid=1, boot_ns=0, ready_ns=0, activity=0)
    )

    async def main() -> None:
        host, guest = trio.testing.memory_stream_pair()
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def fake() -> None:
                    await guest.receive_some()  # HOST_SYNC + Hello (a memory stream: one piece)
                    await guest.send_all(hello)
                    with contextlib.suppress(trio.BrokenResourceError):  # the host hung up on it
                        for piece in _split(b"".join(frames) + tail, cuts):
                            await guest.send_all(piece)
                    await guest.aclose()

                nursery.start_soon(fake)
                async with open_channel(host, hello_timeout=10, answer_timeout=5) as chan:
                    for call in (chan.ping, chan.metrics, chan.touch):
                        with contextlib.suppress(GuestError):
                            await call()

    trio.run(main, clock=MockClock(autojump_threshold=0))


def _tar(*members: tuple[str, bytes, bytes | str], records: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, payload in members:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.mtime, ti.uid, ti.gid = kind, 0o4777, 1_700_000_000, 1000, 1000
            ti.pax_headers = dict(records or {})
            if kind == tarfile.REGTYPE:
                assert isinstance(payload, bytes)
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
            else:
                ti.linkname = payload if isinstance(payload, str) else ""
                tf.addfile(ti)
    return out.getvalue()


VALID = _tar(
    ("d", tarfile.DIRTYPE, b""),
    ("d/f", tarfile.REGTYPE, b"contents" * 100),
    ("d/l", tarfile.SYMTYPE, "f"),
    ("d/h", tarfile.LNKTYPE, "d/f"),
    ("n" * 120, tarfile.REGTYPE, b"long name"),
)
_PAX_KEYS = ["path", "linkpath", "size", "uid", "gid", "mtime", "atime", "uname", "hdrcharset"]
_PAX_KEYS += ["GNU.sparse.map", "GNU.sparse.size", "GNU.sparse.major", "GNU.sparse.minor", "GNU.sparse.name"]


def _unpack_into_fresh_dir(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        dest, outside = Path(d) / "dest", Path(d) / "outside"
        (dest / "pre").mkdir(parents=True)
        outside.mkdir()
        (dest / "planted").symlink_to(outside)
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            n = tree.unpack(io.BytesIO(data).read, fd, keep_ids=ROOT, mode_mask=0o777, keep_existing=True)
            assert n >= 0
        except TreeError as exc:
            assert exc.code in (
                proto.E_INVALID,
                proto.E_TOO_LARGE,
                proto.E_IS_DIR,
                proto.E_NOT_FOUND,
                proto.E_EXISTS,
            ), exc.code
        finally:
            os.close(fd)
        assert os.listdir(outside) == []
        assert stat.S_IMODE((dest / "pre").stat().st_mode) == 0o755 & ~_UMASK


_UMASK = umask()
ROOT = os.geteuid() == 0


@PROPERTY
@given(st.binary(max_size=4096))
def test_tar_reader_on_arbitrary_bytes(data: bytes) -> None:
    _unpack_into_fresh_dir(data)


@PROPERTY
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=12))
def test_tar_reader_on_mutated_archives(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for at, byte in flips:
        data[at] = byte
    _unpack_into_fresh_dir(bytes(data))


@PROPERTY
@given(
    st.dictionaries(st.sampled_from(_PAX_KEYS), st.text(max_size=30), min_size=1, max_size=4),
    st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE]),
    st.integers(0, 600),
)
def test_tar_reader_on_arbitrary_pax_records(records: dict[str, str], kind: bytes, cut: int) -> None:
    data = _tar(("x", kind, b"payload" if kind == tarfile.REGTYPE else "d"), records=records)
    _unpack_into_fresh_dir(data)
    _unpack_into_fresh_dir(data[: len(data) - cut])  # and truncated
