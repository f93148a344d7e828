"""The event bus (actors/events.py): a slow subscriber is told it lagged, the others go on."""

from __future__ import annotations

import pytest
import trio

from actors.events import EventBus, Lagged
from actors.model import Action, SandboxEvent


async def test_slow_event_subscriber_is_told_it_lagged_and_others_are_not_blocked() -> None:
    bus = EventBus(buffer=4)
    slow = bus.subscribe()
    fast = bus.subscribe(action="ready")
    got: list[str] = []
    async with trio.open_nursery() as n:

        async def drain_fast() -> None:
            async for ev in fast:
                got.append(ev.sandbox_id)

        n.start_soon(drain_fast)
        for i in range(10):
            bus.publish(SandboxEvent(f"s{i}", Action.READY, i))
            await trio.sleep(0)  # publishing never blocks; the fast reader keeps up
        with pytest.raises(Lagged):
            async for _ in slow:
                pass
        assert slow not in bus.subs
        bus.unsubscribe(fast)
    assert got == [f"s{i}" for i in range(10)]
