"""The file window (proto.FILE_WINDOW): a write_file asks the guest for a deeper pipe and
runs that far ahead of its credit, never further; a guest that grants more than was
asked breaks the channel; a read_file grants the guest the file window in all, and
data beyond it breaks the channel. A hand-written guest on a memory stream."""

from __future__ import annotations

import signal
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from actors.channel.guest import GuestChannel, GuestProtocolError, open_channel
from guestd import proto


class RawGuest:
    """Answers hello, then hands every other message to ``on_message``."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.decoder = proto.FrameDecoder()
        self.got: list[proto.Message] = []

    async def send(self, msg: proto.Message) -> None:
        await self.stream.send_all(proto.encode(msg))

    async def serve(self, on_message: Callable[[proto.Message], object]) -> None:
        synced = False
        while True:
            data = await self.stream.receive_some(1 << 16)
            if not data:
                return
            self.decoder.feed(data)
            if not synced:
                if not self.decoder.resync(proto.HOST_SYNC):
                    continue
                synced = True
            for msg in self.decoder.messages():
                if isinstance(msg, proto.Hello):
                    await self.stream.send_all(proto.GUEST_SYNC)
                    await self.send(
                        proto.HelloOk(
                            version=proto.PROTOCOL_VERSION, pid=1, boot_ns=0, ready_ns=0, activity=0, features=["files"]
                        )
                    )
                    continue
                self.got.append(msg)
                reply = on_message(msg)
                if isinstance(reply, proto.Message):
                    await self.send(reply)
                elif isinstance(reply, list):
                    for m in reply:
                        await self.send(m)


@asynccontextmanager
async def channel_to(on_message: Callable[[proto.Message], object]) -> AsyncIterator[tuple[GuestChannel, RawGuest]]:
    host_end, guest_end = trio.testing.memory_stream_pair()
    guest = RawGuest(guest_end)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(guest.serve, on_message)
        try:
            async with open_channel(host_end, hello_timeout=5) as chan:
                yield chan, guest
        finally:
            nursery.cancel_scope.cancel()


def data_bytes(guest: RawGuest) -> int:
    return sum(len(m.data) for m in guest.got if isinstance(m, proto.Data))


async def test_a_write_file_runs_one_file_window_ahead_and_no_further() -> None:
    extra = proto.FILE_WINDOW - proto.WINDOW
    stalled = trio.Event()

    def on_message(msg: proto.Message) -> object:
        if isinstance(msg, proto.WriteFile):
            assert msg.window == proto.FILE_WINDOW  # the host asks for the deeper pipe
            return proto.Credit(rid=msg.rid, ch=proto.STDIN, n=extra)
        if isinstance(msg, proto.Data) and data_bytes(guest) >= proto.FILE_WINDOW:
            stalled.set()  # every granted byte came; nothing more is credited
        return None

    with trio.fail_after(30):
        async with channel_to(on_message) as (chan, guest), trio.open_nursery() as nursery:
            nursery.start_soon(chan.write_file, "/tmp/f", bytes(4 * proto.FILE_WINDOW))
            await stalled.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert data_bytes(guest) == proto.FILE_WINDOW
            nursery.cancel_scope.cancel()


async def test_a_guest_granting_more_than_the_asked_window_breaks_the_channel() -> None:
    def on_message(msg: proto.Message) -> object:
        if isinstance(msg, proto.WriteFile):
            # more than asked for in all, whatever the host sent meanwhile
            return proto.Credit(rid=msg.rid, ch=proto.STDIN, n=proto.FILE_WINDOW + 1)
        return None

    with trio.fail_after(30):
        async with channel_to(on_message) as (chan, _guest):
            with pytest.raises(GuestProtocolError, match="more stdin credit"):
                await chan.write_file("/tmp/f", bytes(4 * proto.FILE_WINDOW))


async def test_a_read_file_grants_the_file_window_and_data_beyond_it_breaks_the_channel() -> None:
    size = 4 * proto.FILE_WINDOW
    credit: dict[int, int] = {}

    def on_message(msg: proto.Message) -> object:
        if isinstance(msg, proto.ReadFile):
            credit[msg.rid] = proto.WINDOW
            return proto.FileInfo(rid=msg.rid, size=size, mode=0o644)
        if isinstance(msg, proto.Credit):
            credit[msg.rid] += msg.n
            if credit[msg.rid] == proto.FILE_WINDOW:  # the whole window granted up front: overrun it
                return [
                    proto.Data(rid=msg.rid, ch=proto.STDOUT, data=bytes(proto.CHUNK))
                    for _ in range(proto.FILE_WINDOW // proto.CHUNK + 1)
                ]
        return None

    with trio.fail_after(30):
        async with channel_to(on_message) as (chan, _guest), chan.read_file("/tmp/f") as f:
            await trio.testing.wait_all_tasks_blocked()  # nothing consumed: nothing granted again
            with pytest.raises(GuestProtocolError, match="beyond granted credit"):
                async for _chunk in f:
                    pass


# --- guestd's end of the pipe: Conn's readv / writev (guestd/session.py) ------------------


class _Agent:
    """What Conn asks of the agent."""

    def __init__(self) -> None:
        self.dirty: set[object] = set()
        self.seen: list[proto.Message] = []

    def update_conn(self, conn: object) -> None:
        pass

    def remove_conn(self, conn: object) -> None:
        pass

    def dispatch(self, conn: object, msg: proto.Message) -> None:
        self.seen.append(msg)


def _conn() -> tuple[object, _Agent, socket.socket, socket.socket]:
    from guestd.session import Conn

    ours, peer = socket.socketpair()
    ours.setblocking(False)
    agent = _Agent()
    return Conn(agent, ours.fileno(), "vsock"), agent, ours, peer  # type: ignore[arg-type]


def test_guestd_reads_frames_split_across_its_read_pieces() -> None:
    conn, agent, ours, peer = _conn()
    with ours, peer:
        frames = [proto.encode(proto.Data(rid=1, ch=0, data=bytes([i]) * (proto.FILE_CHUNK + i))) for i in range(3)]
        stream = proto.HOST_SYNC + b"".join(frames)
        for i in range(0, len(stream), 100_001):  # pieces cut inside frames
            peer.sendall(stream[i : i + 100_001])
            conn.on_readable()  # type: ignore[attr-defined]
        assert [len(m.data) for m in agent.seen] == [proto.FILE_CHUNK + i for i in range(3)]  # type: ignore[attr-defined]


def test_guestd_writes_through_a_full_pipe_and_drops_a_peer_that_went() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # (as guestd does)
    conn, _agent, ours, peer = _conn()
    with ours:
        conn.out += b"x" * (4 << 20)  # type: ignore[attr-defined]
        conn.flush()  # type: ignore[attr-defined]
        left = len(conn.out)  # type: ignore[attr-defined]
        assert 0 < left < 4 << 20  # the socket took what it could, the rest waits
        peer.close()
        conn.flush()  # type: ignore[attr-defined]  # EPIPE: dropped, and its buffer cleared
        assert not conn.out  # type: ignore[attr-defined]
