"""A short seeded chaos run (benchmarks/chaos.py) against a real serve: operations and
faults mixed at random, every invariant checked after every step, zero violations.
The invariants themselves are proven to catch what they claim in
tests/unit/test_chaos_checks.py; longer runs: ``nox -s chaos -- --seed N --minutes M``."""

from __future__ import annotations

from pathlib import Path

from benchmarks.chaos import FAULTS, run_chaos
from images.build import Image

SEED = 20261202
MINUTES = 4.0  # (the whole suite's CI budget: a longer run is the nox session's)
# fault kinds left out of the CI seed, each for a bug the harness reports (see the report)
EXCLUDED: set[str] = set()


def test_a_seeded_chaos_run_breaks_no_invariant(image: Image, tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    report = run_chaos(SEED, MINUTES, faults=set(FAULTS) - EXCLUDED, trace=trace)
    assert report.steps >= 5 and sum(report.ops.values()) >= 5, report.text()
    assert sum(report.faults.values()) >= 1, report.text()
    assert not report.violations, report.text()
    # the run's account: a line for each call made, and its answers
    lines = trace.read_text().splitlines()
    assert len(lines) > sum(report.ops.values()), lines[-5:]
    assert all(" step " in line for line in lines) and any(line.endswith(": done") for line in lines)
