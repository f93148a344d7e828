"""Modify's plan (actors/modify.py): every change's status and why, with no VM."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from actors.errors import FailedPrecondition, InvalidArgument
from actors.model import Applied, Limits, SandboxConfig, State, Timers, Workload
from actors.modify import (
    BLOCKING,
    Kind,
    Machine,
    Modification,
    Status,
    check_disk_size,
    check_machine,
    plan,
)
from actors.rules import check_config
from actors.store import Record, Store

CFG = SandboxConfig(
    labels={"team": "a", "old": "x"},
    limits=Limits(vcpus=1, memory_mib=256, max_vcpus=2, max_memory_mib=1024),
    workload=Workload(env={"A": "1"}, working_dir="/srv"),
    timers=Timers(ttl_seconds=600),
)
EFFECTIVE = Limits(vcpus=1, memory_mib=256, max_vcpus=2, max_memory_mib=1024)
RUNNING = Machine(max_vcpus=2, max_memory_mib=1024, balloon=True, disk_mib=2048)


def status(p: object, kind: Kind) -> Status:
    return next(c.status for c in p.changes if c.kind == kind)  # type: ignore[attr-defined]


def test_within_the_ceilings_cpus_and_memory_apply_live() -> None:
    p = plan(CFG, EFFECTIVE, Modification(vcpus=2, memory_mib=768), RUNNING, disk_mib=2048)
    assert p.accepted and not p.restart
    assert status(p, Kind.CPUS) == status(p, Kind.MEMORY) == Status.APPLIED
    assert p.config.limits == Limits(vcpus=2, memory_mib=768, max_vcpus=2, max_memory_mib=1024)
    assert "ceiling 2" in p.changes[0].why


def test_above_a_ceiling_needs_a_restart_unless_asked() -> None:
    p = plan(CFG, EFFECTIVE, Modification(memory_mib=2048), RUNNING, disk_mib=2048)
    assert not p.accepted and status(p, Kind.MEMORY) == Status.NEEDS_RESTART
    assert "--restart" in p.changes[0].why
    p = plan(CFG, EFFECTIVE, Modification(memory_mib=2048, restart=True), RUNNING, disk_mib=2048)
    assert p.accepted and p.restart and status(p, Kind.MEMORY) == Status.RESTART
    assert p.config.limits.max_memory_mib == 2048 and p.config.limits.memory_mib == 2048
    assert "processes end" in p.note


def test_one_blocked_change_blocks_the_plan() -> None:
    p = plan(CFG, EFFECTIVE, Modification(vcpus=2, memory_mib=4096, labels={"x": "y"}), RUNNING, disk_mib=2048)
    assert not p.accepted
    assert {c.status for c in p.changes} & BLOCKING == {Status.NEEDS_RESTART}


def test_a_stopped_sandbox_takes_everything_at_its_next_boot() -> None:
    p = plan(CFG, EFFECTIVE, Modification(vcpus=4, memory_mib=2048, disk_mib=4096), None, disk_mib=2048)
    assert p.accepted and not p.restart
    assert {c.status for c in p.changes} == {Status.NEXT_BOOT}
    assert p.config.limits == Limits(vcpus=4, memory_mib=2048, max_vcpus=4, max_memory_mib=2048, disk_mib=4096)


def test_the_disk_only_grows_within_the_cap_and_not_while_running() -> None:
    assert status(plan(CFG, EFFECTIVE, Modification(disk_mib=1024), None, disk_mib=2048), Kind.DISK) == Status.REFUSED
    p = plan(CFG, EFFECTIVE, Modification(disk_mib=9000), None, disk_mib=2048, max_disk_mib=8192)
    assert status(p, Kind.DISK) == Status.REFUSED and "--max-sandbox-disk" in p.changes[0].why
    p = plan(CFG, EFFECTIVE, Modification(disk_mib=4096), RUNNING, disk_mib=2048)
    assert status(p, Kind.DISK) == Status.NEEDS_RESTART
    p = plan(CFG, EFFECTIVE, Modification(disk_mib=4096, restart=True), RUNNING, disk_mib=2048)
    assert status(p, Kind.DISK) == Status.RESTART and p.restart
    assert status(plan(CFG, EFFECTIVE, Modification(disk_mib=2048), None, disk_mib=2048), Kind.DISK) == Status.UNCHANGED


def test_without_a_balloon_memory_moves_only_with_a_restart() -> None:
    m = Machine(max_vcpus=2, max_memory_mib=256, balloon=False, disk_mib=2048)
    p = plan(CFG, EFFECTIVE, Modification(memory_mib=128), m, disk_mib=2048, balloon=False)
    assert status(p, Kind.MEMORY) == Status.NEEDS_RESTART and "balloon" in p.changes[0].why
    p = plan(CFG, EFFECTIVE, Modification(memory_mib=512), None, disk_mib=2048, balloon=False)
    assert p.config.limits.max_memory_mib == 512  # no ceiling above the value without a balloon


def test_env_workdir_labels_and_timers_apply_at_once() -> None:
    mod = Modification(
        env={"B": "2"}, working_dir="/app", labels={"old": "", "new": "1"}, ttl_seconds=60, idle_timeout_seconds=30
    )
    p = plan(CFG, EFFECTIVE, mod, RUNNING, disk_mib=2048)
    assert p.accepted and {c.status for c in p.changes} == {Status.APPLIED}
    assert p.config.workload.env == {"A": "1", "B": "2"} and p.config.workload.working_dir == "/app"
    assert p.config.labels == {"team": "a", "new": "1"}  # "" removes
    assert p.config.timers == Timers(ttl_seconds=60, idle_timeout_seconds=30)
    same = plan(CFG, EFFECTIVE, Modification(env={"A": "1"}, vcpus=1), RUNNING, disk_mib=2048)
    assert {c.status for c in same.changes} == {Status.UNCHANGED}


def test_a_dry_run_is_flagged_and_the_input_is_not_touched() -> None:
    p = plan(CFG, EFFECTIVE, Modification(vcpus=2, dry_run=True), RUNNING, disk_mib=2048)
    assert p.dry_run and not p.applied
    assert CFG.limits.vcpus == 1


@pytest.mark.parametrize(
    "mod",
    [
        Modification(vcpus=0),
        Modification(memory_mib=32),
        Modification(disk_mib=0),
        Modification(working_dir="rel"),
        Modification(ttl_seconds=-1),
        Modification(labels={"sandvisor.x": "1"}),
    ],
)
def test_bad_values_are_invalid_arguments(mod: Modification) -> None:
    with pytest.raises(InvalidArgument):
        plan(CFG, EFFECTIVE, mod, RUNNING, disk_mib=2048)


def test_ceilings_at_create() -> None:
    check_config(SandboxConfig(limits=Limits(vcpus=1, max_vcpus=2, memory_mib=256, max_memory_mib=1024)))
    with pytest.raises(InvalidArgument):
        check_config(SandboxConfig(limits=Limits(vcpus=4, max_vcpus=2)))
    with pytest.raises(InvalidArgument):
        check_config(SandboxConfig(limits=Limits(memory_mib=512, max_memory_mib=256)))
    with pytest.raises(FailedPrecondition):
        check_machine(Limits(vcpus=1, memory_mib=256, max_memory_mib=1024), balloon=False)
    check_machine(Limits(vcpus=1, memory_mib=256, max_vcpus=4, max_memory_mib=256), balloon=False)
    with pytest.raises(InvalidArgument):
        check_disk_size(1024, 2 << 30)
    check_disk_size(4096, 2 << 30)


def test_a_mapped_restore_does_not_shrink_through_the_balloon() -> None:
    """A clone's RAM is the snapshot's memory mapped copy-on-write: inflating would cost
    memory, not free it (docs/modify.md). Growing is fine."""
    m = Machine(max_vcpus=2, max_memory_mib=1024, balloon=True, disk_mib=2048, mapped=True)
    eff = Limits(vcpus=1, memory_mib=768, max_vcpus=2, max_memory_mib=1024)
    p = plan(CFG, eff, Modification(memory_mib=256), m, disk_mib=2048)
    assert status(p, Kind.MEMORY) == Status.NEEDS_RESTART and "snapshot" in p.changes[0].why
    assert status(plan(CFG, eff, Modification(memory_mib=1024), m, disk_mib=2048), Kind.MEMORY) == Status.APPLIED


def test_the_record_keeps_what_was_applied_and_when(tmp_path: Path) -> None:
    """Modify's config, Record.applied and updated_at survive the supervisor (store v4)."""
    store = Store(tmp_path / "db")
    r = Record(uid="u1", id="m", seq=store.next_seq(), config=CFG, state=State.READY, created_at=1)
    store.insert(r)
    r.config = attrs.evolve(CFG, labels={"new": "1"})
    r.applied = Applied(vcpus=1, memory_mib=256, max_vcpus=2, max_memory_mib=1024, disk_mib=3072, balloon=True)
    r.updated_at = 42
    store.update_tuning(r)
    store.close()
    (back,) = Store(tmp_path / "db").all()
    assert (back.config, back.applied, back.updated_at) == (r.config, r.applied, 42)
