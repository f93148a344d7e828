"""The event bus: lifecycle events to every subscriber, without ever blocking a publisher.

Each subscriber has a bounded buffer; one that falls behind by more than that is
told it lagged (:class:`Lagged` at its next receive) and dropped. Subscribers filter
by sandbox id and action, and see only the events of sandboxes their principal may
see (``viewer``: actors/principals.py).

A ``journal`` (the supervisor's durable event log: supervisor/serve/eventlog.py) sees each
event first, in the publisher's step, and numbers it (``cursor``, ``sequence``): the
subscribers get the numbered event, so a client can resume after the last it saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import trio

from actors.model import Action, SandboxEvent
from actors.principals import LEGACY_OWNER, Principal


class Lagged(Exception):
    """The subscriber fell behind the event bus and was dropped."""


@attrs.define(eq=False)
class Subscription:
    id: str
    action: str
    send: trio.MemorySendChannel[SandboxEvent]
    receive: trio.MemoryReceiveChannel[SandboxEvent]
    lagged: bool = False
    viewer: Principal | None = None  # None: every event

    def wants(self, ev: SandboxEvent) -> bool:
        """``ev`` passes this subscription's filters (sandbox, action, viewer)."""
        if (self.id and self.id != ev.sandbox_id) or (self.action and self.action != ev.action):
            return False
        return self.viewer is None or self.viewer.may_see(ev.owner)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> SandboxEvent:
        try:
            return await self.receive.receive()
        except trio.EndOfChannel:
            if self.lagged:
                raise Lagged("event subscriber fell behind and was dropped") from None
            raise StopAsyncIteration from None


class EventBus:
    def __init__(self, buffer: int = 256) -> None:
        self.buffer = buffer
        self.subs: list[Subscription] = []
        self.journal: Callable[[SandboxEvent], SandboxEvent] | None = None
        # the journal's events after a cursor (up to a limit), oldest first (None: no journal)
        self.backlog: Callable[[int, int], list[SandboxEvent]] | None = None

    def subscribe(self, id: str = "", action: str = "", viewer: Principal | None = None) -> Subscription:
        send, receive = trio.open_memory_channel[SandboxEvent](self.buffer)
        sub = Subscription(id, action, send, receive, viewer=viewer)
        self.subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self.subs:
            self.subs.remove(sub)
        sub.send.close()

    def publish(self, ev: SandboxEvent) -> None:
        if self.journal is not None:
            ev = self.journal(ev)
        for sub in list(self.subs):
            if not sub.wants(ev):
                continue
            try:
                sub.send.send_nowait(ev)
            except trio.WouldBlock:
                sub.lagged = True
                self.unsubscribe(sub)
            except trio.ClosedResourceError:
                self.unsubscribe(sub)

    def emit(
        self, sandbox_id: str, action: Action, attributes: dict[str, str] | None = None, owner: str = LEGACY_OWNER
    ) -> None:
        self.publish(SandboxEvent(sandbox_id, action, time.time_ns(), dict(attributes or {}), owner))
