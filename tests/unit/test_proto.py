"""The guest protocol core and the host channel against a fake, hostile guest (no VM)."""

from __future__ import annotations

import struct

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.channel.guest import ChannelBroken, ChannelClosed, GuestChannel, GuestProtocolError, HelloTimeout
from guestd import proto

_text = st.text(max_size=50)
_STRATS = {
    "int": st.integers(min_value=-(2**63), max_value=2**63 - 1),
    "float": st.floats(allow_nan=False),
    "str": _text,
    "bytes": st.binary(max_size=200),
    "bool": st.booleans(),
    "int | None": st.none() | st.integers(min_value=0, max_value=2**32),
    "float | None": st.none() | st.floats(allow_nan=False),
    "str | None": st.none() | _text,
    "list[str]": st.lists(_text, max_size=5),
    "dict[str, str]": st.dictionaries(_text, _text, max_size=5),
    "dict[str, int]": st.dictionaries(_text, st.integers(min_value=0, max_value=2**62), max_size=5),
    "dict[str, float]": st.dictionaries(_text, st.floats(allow_nan=False), max_size=5),
    "list[dict[str, Any]]": st.lists(
        st.dictionaries(
            _text,
            st.one_of(st.integers(-(2**63), 2**63 - 1), _text, st.binary(max_size=50), st.booleans()),
            max_size=4,
        ),
        max_size=4,
    ),
}


def _message_strategy() -> st.SearchStrategy[proto.Message]:
    options = []
    for cls in proto.REGISTRY.values():
        anns = {k: v for k, v in cls.__annotations__.items() if not v.startswith("ClassVar")}
        options.append(st.builds(lambda c=cls, **kw: c(**kw), **{k: _STRATS[v] for k, v in anns.items()}))
    return st.one_of(options)


@given(_message_strategy())
def test_every_message_round_trips(msg: proto.Message) -> None:
    frame = proto.encode(msg)
    (n,) = struct.unpack(">I", frame[:4])
    assert n == len(frame) - 4
    assert proto.decode(frame[4:]) == msg


@settings(deadline=None)  # a correctness property: a loaded shared machine once took >200 ms
@given(st.lists(_message_strategy(), min_size=1, max_size=8), st.data())
def test_decoder_reassembles_any_chunking(msgs: list[proto.Message], data: st.DataObject) -> None:
    stream = b"".join(proto.encode(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    dec = proto.FrameDecoder()
    out: list[proto.Message] = []
    prev = 0
    for c in [*cuts, len(stream)]:
        dec.feed(stream[prev:c])
        prev = c
        out.extend(dec.messages())
    assert out == msgs
    assert dec.buffered == 0


@given(st.binary(max_size=300))
def test_garbage_bodies_only_raise_protocol_errors(body: bytes) -> None:
    try:
        proto.decode(body)
    except proto.ProtocolError:
        pass


@given(
    st.dictionaries(
        st.text(max_size=5),
        st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(), st.binary(), st.none()),
        max_size=6,
    )
)
def test_wrong_shapes_are_bad_messages(obj: dict[str, object]) -> None:
    obj = {**obj, "t": "exit"}
    try:
        msg = proto.decode(msgpack.packb(obj, use_bin_type=True))
    except proto.BadMessage:
        return
    assert isinstance(msg, proto.Exit) and isinstance(msg.code, int) and isinstance(msg.rid, int)


@given(st.binary(max_size=200), st.binary(max_size=200))
def test_resync_finds_the_marker_after_any_garbage(junk: bytes, tail: bytes) -> None:
    dec = proto.FrameDecoder()
    frame = proto.encode(proto.Ping(rid=3))
    stream = junk + proto.HOST_SYNC + frame + tail
    found = False
    msgs: list[proto.Message] = []
    for i in range(0, len(stream), 7):
        dec.feed(stream[i : i + 7])
        while not msgs:  # what guestd does: resync, parse, and resync again on an error
            if not found:
                found = dec.resync(proto.HOST_SYNC)
                if not found:
                    break
            try:
                for m in dec.messages():
                    msgs.append(m)
                break
            except proto.ProtocolError:
                if msgs:
                    break  # the random tail after the frame may well be garbage
                found = False
    assert msgs[:1] == [proto.Ping(rid=3)]


def test_markers_are_never_valid_frame_starts() -> None:
    for marker in (proto.HOST_SYNC, proto.GUEST_SYNC):
        dec = proto.FrameDecoder()
        dec.feed(marker)
        with pytest.raises(proto.FrameTooLarge):
            list(dec.messages())


def test_frame_above_cap_is_refused_before_buffering() -> None:
    dec = proto.FrameDecoder()
    dec.feed(struct.pack(">I", proto.MAX_FRAME + 1))
    with pytest.raises(proto.FrameTooLarge):
        list(dec.messages())


# --- the host channel against a fake guest ------------------------------------


class FakeGuest:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.dec = proto.FrameDecoder()

    async def recv(self) -> proto.Message:
        while True:
            for m in self.dec.messages():
                return m
            data = await self.stream.receive_some(65536)
            if not data:
                raise EOFError
            self.dec.feed(data)

    async def send(self, msg: proto.Message) -> None:
        await self.stream.send_all(proto.encode(msg))

    async def answer_hello(self) -> None:
        while not self.dec.resync(proto.HOST_SYNC):
            self.dec.feed(await self.stream.receive_some(65536))
        m = await self.recv()
        assert isinstance(m, proto.Hello)
        await self.stream.send_all(b"stale bytes of an old session" + proto.GUEST_SYNC)
        await self.send(proto.HelloOk(version=proto.PROTOCOL_VERSION, pid=1, boot_ns=1, ready_ns=2, activity=0))


async def _pair(nursery: trio.Nursery) -> tuple[GuestChannel, FakeGuest]:
    host, guest = trio.testing.memory_stream_pair()
    chan = GuestChannel(host)
    await nursery.start(chan._reader)
    fake = FakeGuest(guest)
    async with trio.open_nursery() as n:
        n.start_soon(fake.answer_hello)
        await chan.hello(5)
    return chan, fake


async def test_hello_timeout_when_guest_never_answers() -> None:
    host, _guest = trio.testing.memory_stream_pair()
    chan = GuestChannel(host)
    async with trio.open_nursery() as n:
        await n.start(chan._reader)
        with pytest.raises(HelloTimeout):
            await chan.hello(0.2)
        await chan.aclose()
        with pytest.raises(ChannelClosed):
            await chan.ping()
        n.cancel_scope.cancel()


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xff\xff\xff",  # a 4 GiB length prefix
        _frame(b"\xc1\xc1\xc1"),  # not msgpack
        proto.encode(proto.Pong(rid=1, activity=0, guest_ns=0))[:4],  # truncated: a length, then EOF
        _frame(msgpack.packb([1])),  # not a map
        _frame(msgpack.packb({"t": "pong", "rid": "x", "activity": 0, "guest_ns": 0})),  # wrong type
        _frame(msgpack.packb({"t": "nope"})),  # unknown tag
        _frame(msgpack.packb({"t": "exit", "rid": 99, "code": 0})),  # answer to nothing: dropped, then EOF
    ],
)
async def test_hostile_frames_break_the_channel_with_a_typed_error(garbage: bytes) -> None:
    async with trio.open_nursery() as n:
        chan, fake = await _pair(n)
        with trio.fail_after(5):

            async def pinger() -> BaseException | None:
                try:
                    await chan.ping()
                except ChannelBroken as exc:
                    return exc
                return None

            result: list[BaseException | None] = []

            async def run_ping() -> None:
                result.append(await pinger())

            n.start_soon(run_ping)
            await fake.recv()  # the ping
            await fake.stream.send_all(garbage)
            if len(garbage) == 4 or b"exit" in garbage:
                await fake.stream.aclose()  # then the guest goes away
            while not result:
                await trio.sleep(0.01)
        assert isinstance(result[0], ChannelBroken)
        assert chan.broken
        with pytest.raises(ChannelBroken):
            await chan.touch()
        n.cancel_scope.cancel()


async def test_data_beyond_credit_is_a_protocol_error() -> None:
    async with trio.open_nursery() as n:
        chan, fake = await _pair(n)
        with trio.fail_after(5):

            async def guest() -> None:
                m = await fake.recv()
                assert isinstance(m, proto.Exec)
                await fake.send(proto.ExecStarted(rid=m.rid, pid=5))
                for _ in range(proto.WINDOW // proto.CHUNK + 1):  # one chunk more than granted
                    await fake.send(proto.Data(rid=m.rid, ch=proto.STDOUT, data=b"x" * proto.CHUNK))

            n.start_soon(guest)
            async with chan.exec(["x"]) as h:  # a consumer that never reads
                while not chan.broken:
                    await trio.sleep(0.01)
                with pytest.raises(GuestProtocolError):
                    await h.wait()
        n.cancel_scope.cancel()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=6))
def test_fuzzed_guest_bytes_never_crash_the_host(chunks: list[bytes]) -> None:
    """Whatever the guest sends after hello: the host ends up healthy or broken, typed."""

    async def main() -> None:
        async with trio.open_nursery() as n:
            chan, fake = await _pair(n)
            with trio.fail_after(5):
                try:
                    for c in chunks:
                        await fake.stream.send_all(c)
                    await fake.stream.send_all(proto.encode(proto.Log(level="x", text="y")))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the host already hung up on us
                await trio.testing.wait_all_tasks_blocked()
                # the guest answers a ping; with a partial frame in the way the answer may
                # be swallowed (the caller's timeout covers a guest that never answers)
                with trio.move_on_after(1):
                    try:
                        async with trio.open_nursery() as inner:
                            inner.start_soon(chan.ping)
                            m = await fake.recv()
                            await fake.send(proto.Pong(rid=getattr(m, "rid", 0), activity=0, guest_ns=0))
                    except* ChannelBroken:
                        assert chan.broken
                    except* (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                        assert chan.broken
            assert chan._decoder.buffered <= proto.MAX_FRAME + 4
            assert chan.statistics().requests_in_flight <= 1
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_marker_at_a_frame_boundary_is_told_from_garbage() -> None:
    """guestd resyncs quietly on a new host's marker where a frame would start (a
    restored session: no protocol error on the console), and says so for garbage."""
    dec = proto.FrameDecoder()
    dec.feed(proto.encode(proto.Ping(rid=1)) + proto.HOST_SYNC[:5])
    with pytest.raises(proto.FrameTooLarge):
        list(dec.messages())
    assert dec.at(proto.HOST_SYNC)  # (the first bytes of it are enough)
    dec.feed(proto.HOST_SYNC[5:] + proto.encode(proto.Ping(rid=2)))
    assert dec.at(proto.HOST_SYNC) and dec.resync(proto.HOST_SYNC)
    assert [m.rid for m in dec.messages()] == [2]  # type: ignore[attr-defined]
    junk = proto.FrameDecoder()
    junk.feed(b"\xfe" * 8)
    with pytest.raises(proto.FrameTooLarge):
        list(junk.messages())
    assert not junk.at(proto.HOST_SYNC) and not proto.FrameDecoder().at(proto.HOST_SYNC)
