"""The throwaway workdir's guard (supervisor/main/throwaway.py): what its supervisors leave
running -- in one of its cgroups, or naming its dir -- is found at its exit, killed,
and recorded (tests/conftest.py fails the test it happened in); nothing of another
workdir is touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from actors.cells.cgroups import CgroupLimits, detect
from supervisor.main import throwaway
from supervisor.main.throwaway import workdir


@pytest.fixture
def recorded() -> Iterator[Callable[[], list[str]]]:
    """What workdirs recorded since the test began (taken out after: this test's own
    leftovers are its subject, not a failure)."""
    before = len(throwaway.LEFT_BEHIND)
    try:
        yield lambda: throwaway.LEFT_BEHIND[before:]
    finally:
        del throwaway.LEFT_BEHIND[before:]


def sleeper(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", *args])


def test_a_process_naming_the_workdir_is_killed_and_recorded(recorded: Callable[[], list[str]]) -> None:
    with workdir("sv-bystander-") as other:
        bystander = sleeper(str(other.run_root / "x"))
        try:
            with workdir("sv-orphan-") as work:
                orphan = sleeper(str(work.run_root / "x"))
                assert set(work.processes()) == {orphan.pid}
            assert orphan.wait(timeout=30) == -signal.SIGKILL
            assert bystander.poll() is None  # another workdir's (another test run's): untouched
        finally:
            bystander.kill()
            bystander.wait()
    assert recorded() == [f"{work.root}: process {orphan.pid} ({sys.executable}, uid {os.geteuid()}, names its dir)"]


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups are root's")
def test_a_process_in_the_workdirs_cgroups_is_killed_and_the_cgroups_go(recorded: Callable[[], list[str]]) -> None:
    with workdir("sv-orphan-") as work:
        cgroups = detect(parent=f"sandvisor-{work.key}")
        if cgroups is None:
            pytest.skip("no cgroup controllers")
        cg = cgroups.create("cell", CgroupLimits(memory_bytes=64 << 20, pids=16))
        orphan = sleeper()  # (no path of the workdir: found by its cgroup)
        for procs in cg.procs_files():
            procs.write_text(str(orphan.pid))
        assert set(work.processes()) == {orphan.pid}
    assert orphan.wait(timeout=30) == -signal.SIGKILL
    assert recorded() == [f"{work.root}: process {orphan.pid} ({sys.executable}, uid 0, in its cgroups)"]
    assert not any(d.exists() for d in cgroups.parent_dirs())


def test_a_clean_workdir_records_nothing(recorded: Callable[[], list[str]]) -> None:
    with workdir("sv-clean-") as work:
        assert work.processes() == {}
    assert recorded() == []
