"""The host's side of a capture's freeze (actors/sandboxes/savedstate.py) without a VM:
a freeze that answers, one that fails, one that does not answer in time (abandoned: the
capture goes on crash-consistent and a thaw is owed), an older guest not asked, and a
thaw that does not answer bounded. (Real guests: tests/vm/test_freeze.py.)"""

from __future__ import annotations

from typing import Any, cast

import pytest
import trio

from actors.channel.guest import GuestOpError
from actors.machines.vm import Guest
from actors.sandboxes import savedstate


class Chan:
    def __init__(self, *, features: tuple[str, ...] = ("freeze",), answer: Any = 2) -> None:
        self.features, self.answer = features, answer
        self.calls: list[str] = []

    def has_feature(self, name: str) -> bool:
        return name in self.features

    async def freeze(self, timeout: float) -> int:
        self.calls.append("freeze")
        if isinstance(self.answer, Exception):
            raise self.answer
        if self.answer is None:
            await trio.sleep_forever()
        return int(self.answer)

    async def thaw(self) -> int:
        self.calls.append("thaw")
        if self.answer is None:
            await trio.sleep_forever()
        return 0


class Machine:
    name, exited = "vm", False


def guest(chan: Chan) -> Guest:
    return cast(Guest, type("G", (), {"channel": chan, "machine": Machine()})())


async def test_a_freeze_that_answers() -> None:
    consistency, _, thaw = await savedstate.freeze_guest(guest(Chan()))
    assert (consistency, thaw) == ("frozen", True)


async def test_nothing_frozen_owes_no_thaw() -> None:
    assert (await savedstate.freeze_guest(guest(Chan(answer=0))))[::2] == ("frozen", False)


async def test_an_older_guest_is_not_asked() -> None:
    chan = Chan(features=())
    assert await savedstate.freeze_guest(guest(chan)) == ("", 0.0, False)
    await savedstate.thaw_guest(guest(chan))
    assert chan.calls == []


async def test_a_freeze_that_fails_is_crash_consistent_and_thawed() -> None:
    chan = Chan(answer=GuestOpError("INTERNAL", "boom"))
    consistency, _, thaw = await savedstate.freeze_guest(guest(chan))
    assert consistency.startswith("crash-consistent (the freeze failed") and thaw


async def test_a_freeze_that_does_not_answer_is_abandoned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(savedstate, "FREEZE_ANSWER", 0.05)
    monkeypatch.setattr(savedstate, "THAW_ANSWER", 0.05)
    chan = Chan(answer=None)
    with trio.fail_after(5):
        consistency, _, thaw = await savedstate.freeze_guest(guest(chan))
        assert consistency == "crash-consistent (the freeze did not answer in 0.05 s)" and thaw
        await savedstate.thaw_guest(guest(chan))  # bounded: guestd's own timeout is the net
    assert chan.calls == ["freeze", "thaw"]
