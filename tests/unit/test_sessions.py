"""Detachable exec sessions (actors/sandboxes/sessions.py) on a fake exec: output kept
while detached (bounded), handed over at attach without loss, the idle limit, one
client at a time, and the end with the life's nursery."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from actors.errors import FailedPrecondition, NotFound
from actors.sandboxes import sessions
from actors.sandboxes.sessions import HeldSessions
from guestd import proto
from supervisor.client.sdk.detach import DetachMatcher, parse_detach_keys


class FakeExec:
    """A process whose output the test writes; ``killed`` once its context was left early."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[tuple[int, bytes]](100)
        self.exit: Any = None
        self.killed = False
        self.stdin: list[bytes] = []

    def __aiter__(self) -> FakeExec:
        return self

    async def __anext__(self) -> tuple[int, bytes]:
        try:
            return await self.receive.receive()
        except trio.EndOfChannel:
            self.exit = proto.Exit(rid=1, code=3)
            raise StopAsyncIteration from None

    async def send_stdin(self, data: bytes) -> None:
        self.stdin.append(data)

    @asynccontextmanager
    async def opened(self) -> AsyncIterator[FakeExec]:
        try:
            yield self
        except BaseException:
            self.killed = True
            raise


def _log() -> tuple[list[tuple[str, bytes]], Any]:
    seen: list[tuple[str, bytes]] = []
    return seen, lambda src, data: seen.append((src, data))


async def test_output_is_kept_while_detached_and_handed_over_at_attach() -> None:
    async with trio.open_nursery() as n:
        held = HeldSessions(n)
        fake = FakeExec()
        logged, log = _log()
        s = await held.open(7, False, fake.opened, log)
        assert held.get(7) is s and s.handle is fake
        send, receive = trio.open_memory_channel[tuple[str, bytes]](16)
        assert s.attach(send) == []
        with pytest.raises(FailedPrecondition):
            s.attach(trio.open_memory_channel[tuple[str, bytes]](1)[0])  # one client at a time
        await fake.send.send((proto.STDOUT, b"live"))
        assert await receive.receive() == ("stdout", b"live")
        s.detach()
        await fake.send.send((proto.STDERR, b"while away"))
        await fake.send.send((proto.STDOUT, b"and more"))
        await trio.testing.wait_all_tasks_blocked()
        send2, receive2 = trio.open_memory_channel[tuple[str, bytes]](16)
        assert s.attach(send2) == [("stderr", b"while away"), ("stdout", b"and more")]
        assert ("stderr", b"while away") in logged  # the log has it too
        fake.send.close()  # the process ends while attached: the client's stream ends
        assert [x async for x in receive2] == []
        await s.ended.wait()
        s.finish()
    assert held.sessions == {} and not fake.killed
    with pytest.raises(NotFound):
        held.get(7)


async def test_the_buffer_is_bounded_and_says_what_it_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions, "MAX_BUFFER", 10)
    async with trio.open_nursery() as n:
        fake = FakeExec()
        s = await HeldSessions(n).open(1, True, fake.opened, _log()[1])
        s.detach()
        for i in range(5):
            await fake.send.send((proto.STDOUT, b"%d234" % i))
        await trio.testing.wait_all_tasks_blocked()
        got = s.attach(trio.open_memory_channel[tuple[str, bytes]](16)[0])
        note = ("stderr", b"[12 bytes of output dropped while detached]\r\n")
        assert got == [note, ("stdout", b"3234"), ("stdout", b"4234")]
        s.end()


async def test_a_detached_session_nobody_comes_back_to_is_ended(autojump_clock: MockClock) -> None:
    async with trio.open_nursery() as n:
        held = HeldSessions(n, idle=60)
        fake = FakeExec()
        s = await held.open(1, False, fake.opened, _log()[1])
        s.detach()
        await trio.sleep(59)
        assert not s.ended.is_set()
        await trio.sleep(2)
        assert s.ended.is_set() and fake.killed and held.sessions == {}


async def test_a_client_gone_without_detaching_ends_it_and_the_life_ends_them_all() -> None:
    async with trio.open_nursery() as n:
        held = HeldSessions(n)
        a, b = FakeExec(), FakeExec()
        sa = await held.open(1, False, a.opened, _log()[1])
        await held.open(2, False, b.opened, _log()[1])
        sa.attach(trio.open_memory_channel[tuple[str, bytes]](1)[0])
        sa.end()
        await sa.ended.wait()
        assert a.killed and list(held.sessions) == [2]
        n.cancel_scope.cancel()  # the life ends
    assert b.killed and held.sessions == {}


def test_detach_keys() -> None:
    assert parse_detach_keys("ctrl-p,ctrl-q") == b"\x10\x11"
    assert parse_detach_keys("ctrl-]") == b"\x1d" and parse_detach_keys("q") == b"q"
    for bad in ("ctrl-", "ctrl-pp", "", "ctrl-1"):
        with pytest.raises(Exception, match="detach keys"):
            parse_detach_keys(bad)
    m = DetachMatcher(b"\x10\x11")
    assert m.feed(b"ab\x10") == (b"ab", False)  # held back: it may start the sequence
    assert m.feed(b"x\x10") == (b"\x10x", False)  # it did not: sent on, in order
    assert m.feed(b"\x11rest") == (b"", True)
    assert DetachMatcher(b"").feed(b"\x10\x11") == (b"\x10\x11", False)
    from supervisor.client import cli_client
    from supervisor.client.sdk import detach

    assert cli_client.DEFAULT_DETACH_KEYS == detach.DEFAULT_DETACH_KEYS
