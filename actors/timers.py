"""The registry's timers: a sandbox's TTL (from creation, or from its last start;
not reset by activity) drains and stops it (``ttl_action`` "remove": from creation,
removes it), its idle timeout stops (or pauses) it, its paused TTL removes it, and
an ephemeral sandbox goes once stopped. One tick a second over every sandbox.

Handle and tasks::

    Timers.run()                      started in the lives' nursery by Registry.run
      +-- remove(id, force=True)      one task per removal it starts (remove_later)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import trio

from actors.errors import DomainError
from actors.hibernation import Hibernation
from actors.model import ALIVE, State
from actors.quotas import Admission
from actors.sandboxes.sandbox import Sandbox


class Timers:
    def __init__(
        self,
        sandboxes: Mapping[str, Sandbox],
        admission: Admission,
        hibernation: Hibernation,
        remove: Callable[[str, bool], Awaitable[None]],
        stop_timeout: float,
    ) -> None:
        self.sandboxes = sandboxes
        self.admission = admission
        self.hibernation = hibernation
        self.remove = remove  # the registry's Remove (force)
        self.stop_timeout = stop_timeout  # an idle sandbox's Stop
        self.removing: set[str] = set()
        self._nursery: trio.Nursery | None = None

    async def run(self) -> None:
        """TTL (from creation; not reset by activity) removes; idle timeout stops;
        ephemeral sandboxes go once stopped."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await self._tick_forever()
            finally:
                self._nursery = None

    async def _tick_forever(self) -> None:
        while True:
            # (timers are whole seconds: a tick a second is precise enough, and under the
            # unit tests' mock clock every tick costs real time)
            await trio.sleep(1.0)
            await self.admission.measure()
            now = trio.current_time()
            for sb in list(self.sandboxes.values()):
                timers = sb.config.timers
                if timers.ephemeral and sb.stopped and sb.state != State.PAUSED:
                    self.remove_later(sb.id)
                    continue
                if timers.ttl_seconds and timers.ttl_action == "remove" and now >= sb.born + timers.ttl_seconds:
                    if sb.id not in self.removing:
                        sb.log.append("system", b"ttl expired: removing")
                        sb.request_stop(0, force=True, by="ttl")  # (its cause: the removal's stop is the TTL's)
                    self.remove_later(sb.id)
                    continue
                if (
                    timers.ttl_seconds
                    and timers.ttl_action != "remove"
                    and now >= max(sb.born, sb.began) + timers.ttl_seconds
                    and sb.state in (*ALIVE, State.STARTING)
                    and not sb.stopping
                ):
                    # its maximum duration: drained (no new work; that in flight gets the
                    # stop grace), then stopped; its next life has the same again
                    sb.log.append("system", b"ttl expired: draining, then stopping")
                    sb.drain(self.stop_timeout, by="ttl")
                    continue
                idle = timers.idle_timeout_seconds
                if (
                    idle
                    and sb.state == State.READY
                    and not sb.workloads
                    and not sb.execs
                    and now - sb.last_activity >= idle
                    and not sb.stopped
                ):
                    if timers.on_idle == "pause":
                        self.hibernation.pause_later(sb)
                        continue
                    sb.log.append("system", b"idle timeout: stopping")
                    sb.request_stop(self.stop_timeout, by="idle")
                    continue
                paused_ttl = timers.paused_ttl_seconds
                if paused_ttl and sb.state == State.PAUSED and self.hibernation.paused_seconds(sb) >= paused_ttl:
                    if sb.id not in self.removing:
                        sb.log.append("system", b"paused ttl expired: removing")
                    self.remove_later(sb.id)

    def remove_later(self, id: str) -> None:
        if id in self.removing or self._nursery is None:
            return
        self.removing.add(id)
        self._nursery.start_soon(self._remove_quietly, id)

    async def _remove_quietly(self, id: str) -> None:
        try:
            await self.remove(id, True)
        except DomainError:
            pass
        finally:
            self.removing.discard(id)
