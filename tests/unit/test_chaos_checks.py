"""The chaos harness's invariants catch what they claim: each checker fed a product
broken on purpose (a lost write, stale content, a wrong state, memory lost, a leaked
QEMU, a stray run dir, an unbounded supervisor, an uncoded error, a traceback) reports
it; fed sound facts, nothing. The last tests go through the harness's own observation
of the host (a real stray dir, a real leaked process, a real log)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from benchmarks import chaos_checks as checks
from benchmarks.chaos_host import host_facts, saved_states
from supervisor.main.throwaway import Workdir
from supervisor.wire.errors import ApiError, NotFound

H1, H2 = "a" * 64, "b" * 64


def facts(**kw: object) -> checks.HostFacts:
    base: dict[str, object] = {
        "qemus": {},
        "others": {},
        "run_entries": frozenset(),
        "ram_files": frozenset(),
        "cgroups": frozenset(),
        "mounts": frozenset(),
        "netns": frozenset(),
        "stray_files": frozenset(),
    }
    return checks.HostFacts(**{**base, **kw})  # type: ignore[arg-type]


def test_a_lost_write_is_reported() -> None:
    expected = {"/root/chaos/f1": {H1}}
    assert checks.check_files("s", dict(expected), {"/root/chaos/f1": H1}) == []
    [(inv, what)] = checks.check_files("s", dict(expected), {})
    assert inv == "durability" and "f1 is missing" in what


def test_stale_content_after_a_resume_is_reported() -> None:
    [(inv, what)] = checks.check_files("s", {"/root/chaos/f1": {H2}}, {"/root/chaos/f1": H1})
    assert inv == "durability" and "acknowledged bbbb" in what


def test_a_cut_write_may_be_old_or_new_and_the_model_learns_which() -> None:
    expected = {"/root/chaos/f1": {checks.MISSING, H1}}
    assert checks.check_files("s", expected, {}) == []
    assert expected == {"/root/chaos/f1": {checks.MISSING}}
    [(inv, _)] = checks.check_files("s", expected, {"/root/chaos/f1": H1})  # (it came back later)
    assert inv == "durability"


def test_a_cut_write_is_not_settled_by_the_guests_cache() -> None:
    """A write cut by a kill may be in the guest's page cache and not on its disk: a
    look at the running guest settles nothing about it; a look after a reboot does."""
    m = checks.SandboxModel("s", {"ready"}, files={"/root/chaos/f5": {checks.MISSING, H1}})
    m.unsynced.add("/root/chaos/f5")
    assert checks.check_files("s", m.files, {"/root/chaos/f5": H1}, m.unsynced) == []
    assert m.files == {"/root/chaos/f5": {checks.MISSING, H1}}  # (the cache settles nothing)
    m.rebooted()  # the QEMU killed: the next look reads its disk, and settles it
    assert checks.check_files("s", m.files, {}, m.unsynced) == []
    assert m.files == {"/root/chaos/f5": {checks.MISSING}}
    [(inv, _)] = checks.check_files("s", m.files, {"/root/chaos/f5": H1}, m.unsynced)
    assert inv == "durability"


def test_a_write_whose_fsync_failed_may_leave_anything_until_the_next_acknowledged_one() -> None:
    """Seed 20261204, steps 4250 and 6305: a write's fsync failed (the host disk full),
    the guest ran out of memory, and its page -- clean after a writeback that failed --
    was read again from a disk holding neither the old nor the new content. POSIX
    leaves such a file unspecified; the model allows anything until a write of it is
    acknowledged, and then checks that one again, byte for byte."""
    files = {"/root/chaos/f5": {checks.ANY}, "/root/chaos/f1": {H1}}
    for seen in ({}, {"/root/chaos/f5": H1}, {"/root/chaos/f5": H2}):
        assert checks.check_files("s", files, {"/root/chaos/f1": H1, **seen}) == []
    assert files["/root/chaos/f5"] == {checks.ANY}  # (it stays unspecified)
    [(inv, what)] = checks.check_files("s", files, {"/root/chaos/f5": H2})  # (the others still count)
    assert inv == "durability" and "f1 is missing" in what
    files["/root/chaos/f5"] = {H1}  # acknowledged again
    [(inv, _)] = checks.check_files("s", files, {"/root/chaos/f1": H1, "/root/chaos/f5": H2})
    assert inv == "durability"


def test_a_file_no_write_made_is_reported() -> None:
    [(inv, what)] = checks.check_files("s", {}, {"/root/chaos/f9": H1})
    assert inv == "durability" and "no write" in what


def test_a_state_the_model_does_not_allow_is_reported() -> None:
    model = {"a": checks.SandboxModel("a", {"ready"}), "b": checks.SandboxModel("b", {"ready", "paused"})}
    assert checks.check_states(model, {"a": "running", "b": "paused"}) == []
    assert model["b"].allowed == {"paused"}  # (an uncertain outcome, settled by the look)
    found = checks.check_states(model, {"a": "stopped", "b": "paused", "ghost": "ready"})
    assert [inv for inv, _ in found] == ["state", "state"]
    assert "a is stopped" in found[0][1] and "ghost" in found[1][1]
    [(_, what)] = checks.check_states({"r": checks.SandboxModel("r", {checks.ABSENT})}, {"r": "ready"})
    assert "r is ready" in what  # (a removed sandbox came back)


def test_memory_lost_or_kept_against_the_model_is_reported() -> None:
    m = checks.SandboxModel("a", {"ready"}, boot="boot-1")
    assert checks.check_boot(m, "boot-1") == []
    [(inv, what)] = checks.check_boot(m, "boot-2")  # a resume that booted afresh
    assert inv == "state" and "memory was lost" in what
    m.rebooted()  # a stop: the next look must see a new boot id
    [(_, what)] = checks.check_boot(m, "boot-2")
    assert "kept boot id" in what
    m.rebooted()
    assert checks.check_boot(m, "boot-3") == []


def test_leaked_processes_and_files_are_reported() -> None:
    qemu = {10: "qemu-system-x86_64 ... 8:pids:/sandvisor-k/run-a"}
    sound = facts(qemus=qemu, run_entries=frozenset({"run-a"}), ram_files=frozenset({"run-a.ram"}))
    assert checks.check_orphans(sound, running=1, with_net=0) == []
    leaked = {**qemu, 11: "qemu-system-x86_64 ... 8:pids:/sandvisor-k/run-b"}
    [(inv, what)] = checks.check_orphans(facts(qemus=leaked, run_entries=frozenset({"run-a", "run-b"})), 1, 0)
    assert inv == "orphans" and "2 QEMU processes" in what
    cases = {
        "process 12": facts(others={12: "virtiofsd"}),
        "run dir stray": facts(run_entries=frozenset({"stray"})),
        "RAM file x.ram": facts(ram_files=frozenset({"x.ram"})),
        "cgroups": facts(cgroups=frozenset({"run-z"})),
        "mount /tmp/w/m": facts(mounts=frozenset({"/tmp/w/m"})),
        "network namespaces": facts(netns=frozenset({"svj-abc-1"})),
        "half-done file": facts(stray_files=frozenset({"state/snapshots/s/disk.part"})),
    }
    for needle, f in cases.items():
        found = checks.check_orphans(f, running=0, with_net=0)
        assert [inv for inv, _ in found] == ["orphans"] and needle in found[0][1], (needle, found)
    [(inv, _)] = checks.check_orphans(facts(), running=1, with_net=0)  # a running sandbox with no QEMU
    assert inv == "state"


def test_an_unbounded_supervisor_is_reported() -> None:
    assert checks.check_bounded(fds=80, rss_mib=150, live=2) == []
    found = checks.check_bounded(fds=5000, rss_mib=4096, live=2)
    assert [inv for inv, _ in found] == ["footprint", "footprint"]


def test_an_error_without_a_code_is_reported() -> None:
    assert checks.check_error("run", NotFound("NOT_FOUND", "no sandbox x")) == []
    [(inv, _)] = checks.check_error("run", EOFError("connection closed"))
    assert inv == "error-code"
    [(inv, _)] = checks.check_error("run", ApiError("WHATEVER", "made up"))
    assert inv == "error-code"


def test_a_refusal_with_no_fault_in_play_is_reported() -> None:
    assert checks.check_refusal("pause a", ApiError("RESOURCE_EXHAUSTED", "4 unmerged layers")) == []
    [(inv, what)] = checks.check_refusal("restore r1", ApiError("INTERNAL", "cannot open disk.qcow2"))
    assert inv == "refused" and "restore r1" in what


LOG = """\
2026-12-02 03:43:29,009 sandvisor.daemon INFO serving
2026-12-02 03:43:30,000 sandvisor.actor ERROR the sandbox's task failed
Traceback (most recent call last):
  File "actors/sandboxes/actor.py", line 1, in run
    raise ValueError("x")
ValueError: x

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "actors/sandboxes/actor.py", line 3, in run
KeyError: 'y'
2026-12-02 03:43:31,000 sandvisor.daemon INFO still serving
"""


def test_a_traceback_in_the_log_is_reported() -> None:
    assert checks.check_log(["2026-12-02 sandvisor.daemon INFO serving", "no trace here"]) == []
    found = checks.check_log(LOG.splitlines())
    assert found == [("traceback", "ValueError: x"), ("traceback", "KeyError: 'y'")]
    [(_, last)] = checks.check_log(["Traceback (most recent call last):", '  File "x.py", line 1'])
    assert "x.py" in last  # (the log ends inside it)


def test_the_harness_sees_a_stray_run_dir_and_a_leaked_process_on_the_host() -> None:
    with tempfile.TemporaryDirectory(prefix="sv-chaos-unit-") as d:
        work = Workdir(Path(d))
        (work.run_root / "0123-stray").mkdir(parents=True)
        work.state.mkdir()
        (work.state / "snapshots" / "s1").mkdir(parents=True)
        (work.state / "snapshots" / "s1" / "disk.qcow2.part").write_bytes(b"")
        leaked = subprocess.Popen(["sh", "-c", "sleep 60", str(work.root / "helper")])
        try:
            f = host_facts(work, serve_pid=0, state_mount=None)
            found = checks.check_orphans(f, running=0, with_net=0)
        finally:
            leaked.kill()
            leaked.wait()
        whats = " ; ".join(what for _, what in found)
        assert f"process {leaked.pid}" in whats
        assert "run dir 0123-stray" in whats
        assert "half-done file state/snapshots/s1/disk.qcow2.part" in whats


def test_a_snapshot_removed_while_the_harness_looks_is_not_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the supervisor runs on during the look: a snapshot dir listed, then deleted
    with tempfile.TemporaryDirectory(prefix="sv-chaos-unit-") as d:
        work = Workdir(Path(d))
        for name in ("s1", "s2"):
            (work.state / "snapshots" / name).mkdir(parents=True)
            (work.state / "snapshots" / name / "memory.part").write_bytes(b"")
        listdir = os.listdir

        def deleted_first(path: str) -> list[str]:
            if path.endswith("/s1"):
                shutil.rmtree(path)
            return listdir(path)

        monkeypatch.setattr(os, "listdir", deleted_first)
        f = host_facts(work, serve_pid=0, state_mount=None)
    assert f.stray_files == {"state/snapshots/s2/memory.part"}


def test_a_saved_state_no_one_holds_is_reported() -> None:
    # a fork point whose last child went, a pause's state after its resume, memory
    # left behind by a retired record: each is reported
    with tempfile.TemporaryDirectory(prefix="sv-chaos-unit-") as d:
        work = Workdir(Path(d))
        for name, file in (("s1", "memory"), ("s2", "vmstate.0"), ("s3", "disk.qcow2")):
            (work.state / "snapshots" / name).mkdir(parents=True)
            (work.state / "snapshots" / name / file).write_bytes(b"")
        saved = saved_states(work)
    s1, s2 = (str(work.state / "snapshots" / n) for n in ("s1", "s2"))
    assert saved.memory == [s1, s2] and (saved.forks, saved.paused) == (0, 0)
    held = checks.SavedStates(saved.memory, frozenset({s1, s2}), forks=1, paused=1)
    assert checks.check_saved_states(held, live_forks=1, may_be_paused=1) == []
    found = checks.check_saved_states(checks.SavedStates(saved.memory, frozenset({s1}), 2, 1), 1, 0)
    whats = " ; ".join(w for _, w in found)
    assert f"saved memory in {s2}" in whats
    assert "2 hidden fork snapshots, 1 forks" in whats
    assert "1 paused saved states, 0 sandboxes" in whats
