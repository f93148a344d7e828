"""The tests' own clocks (tests/support/clocks.py): virtual time that stands still
while real work runs, and a deadline that moves on with the work's progress."""

from __future__ import annotations

import subprocess
import sys
import time

import hypothesis
import pytest
import trio
from trio.testing import MockClock

from tests.support.clocks import fail_when_stalled, work_aware_clock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> MockClock:
    return work_aware_clock(monkeypatch)


async def test_no_jump_while_a_worker_thread_or_a_child_process_runs(clock: MockClock) -> None:
    # a timer waits meanwhile: a plain autojump clock jumps to it 20 ms into the real work
    async with trio.open_nursery() as n:
        n.start_soon(trio.sleep, 3600)
        t0 = trio.current_time()
        await trio.to_thread.run_sync(time.sleep, 0.3)
        await trio.run_process([sys.executable, "-c", "import time; time.sleep(0.3)"], stdout=subprocess.DEVNULL)
        assert trio.current_time() == t0
        await trio.sleep(60)  # and virtual time costs no wall time once the work is done
        assert trio.current_time() == t0 + 60
        n.cancel_scope.cancel()


async def test_work_that_moves_passes_however_long_and_a_stall_fails(clock: MockClock) -> None:
    with fail_when_stalled(5) as progress:
        for _ in range(100):  # 100 s in all, each piece within 5 s
            await trio.sleep(1)
            progress()
    t0 = trio.current_time()
    with pytest.raises(trio.TooSlowError), fail_when_stalled(5) as progress:
        await trio.sleep(1)
        progress()
        await trio.sleep_forever()
    assert trio.current_time() - t0 == pytest.approx(6)


@hypothesis.given(hypothesis.strategies.integers())
def test_a_property_has_no_wall_clock_deadline(n: int) -> None:
    # (tests/conftest.py's profile: an example slowed by a loaded host is not wrong)
    assert hypothesis.settings().deadline is None
    assert hypothesis.settings.default.deadline is None
