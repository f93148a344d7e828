"""Time in tests: a mock clock for tests whose code under test also does real work,
and a deadline for work whose size scales.

Trio's autojump clock jumps virtual time to the next deadline whenever every task has
been blocked for ``autojump_threshold`` of real time. Trio cannot tell a task waiting
on a timer from one waiting on a worker thread (``trio.to_thread.run_sync``: the
store's commits, disk and snapshot files) or on a child process (``trio.run_process``:
qemu-img): on a loaded host such real work takes longer than the threshold, and each
time it does the clock jumps (25 virtual seconds seen during one fake Create of 1.5 s),
so deadlines of the code under test (a guest's 30 s answer, a 60 s boot) or of the
test fire while nothing is late.

:func:`work_aware_clock` jumps only while no such work is under way: each worker
thread and child process holds the clock (no autojump) until it returns. What the code
under test does in virtual time (timers, TTLs, a fake guest's sleeps) still costs no
wall time.

:func:`fail_when_stalled` bounds work whose duration scales with its size and the
host's load (megabytes through a TCG guest): a fixed total bound is either padded or
fails on a loaded host while every piece of the work still moves. It fails when no
piece made progress for its bound instead: a hang still fails, as fast as before."""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
import trio
from trio.testing import MockClock

T = TypeVar("T")

AUTOJUMP_AFTER = 0.02  # real seconds every task must be blocked before a jump (other real I/O)


def work_aware_clock(monkeypatch: pytest.MonkeyPatch, threshold: float = AUTOJUMP_AFTER) -> MockClock:
    """A MockClock that autojumps after ``threshold`` of real idleness, except while a
    worker thread or a child process of the test runs (for the test's duration:
    ``monkeypatch`` undoes the hold at its end)."""
    clock = MockClock(autojump_threshold=threshold)
    busy = 0

    def hold(call: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(call)
        async def held(*args: Any, **kwargs: Any) -> T:
            nonlocal busy
            busy += 1
            clock.autojump_threshold = math.inf
            try:
                return await call(*args, **kwargs)
            finally:
                busy -= 1
                if not busy:
                    clock.autojump_threshold = threshold

        return held

    monkeypatch.setattr(trio.to_thread, "run_sync", hold(trio.to_thread.run_sync))
    monkeypatch.setattr(trio, "run_process", hold(trio.run_process))
    return clock


@contextmanager
def fail_when_stalled(seconds: float) -> Iterator[Callable[[], None]]:
    """Like ``trio.fail_after(seconds)``, but the deadline moves on with each call of
    the function it yields (a piece of the work done): TooSlowError when the work made
    no progress for ``seconds``, however long all of it takes."""
    scope = trio.CancelScope(deadline=trio.current_time() + seconds)

    def progress() -> None:
        scope.deadline = trio.current_time() + seconds

    with scope:
        yield progress
    if scope.cancelled_caught:
        raise trio.TooSlowError(f"no progress for {seconds:g}s")
