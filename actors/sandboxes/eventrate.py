"""The rate at which a guest's reports become events: a burst, then one per interval,
the rest counted (a hostile or looping guest fills no event log). One per stream of
events: each life's OOM kills (oomkills.py), each of its disks' errors (diskerrors.py)."""

from __future__ import annotations

import time
from collections.abc import Callable


class EventRate:
    """A token bucket of ``burst`` events, refilled one per ``interval`` seconds."""

    def __init__(self, burst: int, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._burst, self._interval, self._clock = float(burst), interval, clock
        self._tokens = float(burst)
        self._at = clock()
        self.suppressed = 0  # events left out since the last one allowed

    def allow(self) -> dict[str, str] | None:
        """None if this one is left out (counted); else the attributes the event carries
        for those left out before it (``suppressed``, when any), the count reset."""
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) / self._interval)
        self._at = now
        if self._tokens < 1:
            self.suppressed += 1
            return None
        self._tokens -= 1
        extra = {"suppressed": str(self.suppressed)} if self.suppressed else {}
        self.suppressed = 0
        return extra
