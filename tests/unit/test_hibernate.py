"""Hibernation's settings on every edge, without a VM (the VM tests: test_hibernate.py):
the idle policy and auto-resume from the SDK, the CLI and the wire into the domain,
checked; the saved state hidden from callers; the crash points named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.crash import STEPS
from actors.errors import InvalidArgument
from actors.model import MemoryKind, SandboxConfig, Timers
from actors.rules import check_config
from actors.store import MachineRecord, SnapshotRecord
from supervisor.client.sdk.spec import Lifetime, SandboxSpec
from supervisor.main.cli import build_parser
from supervisor.serve import mapping
from supervisor.wire import protocol


def test_the_idle_policy_and_auto_resume_reach_the_domain_from_the_sdk() -> None:
    spec = SandboxSpec(lifetime=Lifetime(idle_timeout=300, on_idle="pause", paused_ttl=60, auto_resume=False))
    req = spec.request("h")
    assert (req.on_idle, req.paused_ttl_seconds, req.no_auto_resume) == ("pause", 60, True)
    timers = mapping.config(req).timers
    assert timers == Timers(
        idle_timeout_seconds=300, on_idle="pause", paused_ttl_seconds=60, auto_resume=False, ttl_action="stop"
    )
    # the defaults say nothing on the wire (a seed-shaped request), and mean stop + auto-resume
    plain = SandboxSpec().request("p")
    assert (plain.on_idle, plain.paused_ttl_seconds, plain.no_auto_resume) == ("", 0, False)
    assert mapping.config(plain).timers == Timers(ttl_action="stop")  # (the SDK's TTL drains and stops)
    assert SandboxSpec().with_(on_idle="pause").lifetime.on_idle == "pause"


def test_the_cli_says_the_idle_policy() -> None:
    a = build_parser().parse_args(
        ["create", "h", "--idle-timeout", "300", "--on-idle", "pause", "--paused-ttl", "9", "--no-auto-resume"]
    )
    assert (a.idle_timeout, a.on_idle, a.paused_ttl, a.auto_resume) == (300, "pause", 9, False)
    a = build_parser().parse_args(["create", "h"])
    assert (a.on_idle, a.paused_ttl, a.auto_resume) == ("stop", 0, True)
    for cmd in ("pause", "resume"):
        assert build_parser().parse_args([cmd, "a", "b"]).names == ["a", "b"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["create", "h", "--on-idle", "sleep"])


@pytest.mark.parametrize(
    "timers", [Timers(on_idle="sleep"), Timers(paused_ttl_seconds=-1)], ids=["unknown on_idle", "negative ttl"]
)
def test_a_bad_idle_policy_is_invalid(timers: Timers) -> None:
    with pytest.raises(InvalidArgument):
        check_config(SandboxConfig(timers=timers))


def test_a_wire_on_idle_that_is_unknown_is_invalid() -> None:
    with pytest.raises(InvalidArgument):
        check_config(mapping.config(protocol.CreateSandboxRequest(id="x", on_idle="hibernate")))


def test_a_paused_sandboxs_saved_state_is_hidden() -> None:
    rec = SnapshotRecord(
        uid="u",
        id="snap-1",
        name="",
        labels={},
        sandbox_id="s",
        origin_uid="o",
        created_ns=0,
        dir="/nowhere",
        memory=MemoryKind.MAPPED,
        machine=MachineRecord(append="", memory_mib=256, cpus=1, accel="tcg"),
        config=SandboxConfig(),
    )
    assert not rec.hidden
    rec.paused_for = "o"
    assert rec.hidden


def test_the_pause_and_resume_crash_points_exist() -> None:
    assert {"pause-saved", "pause-stopping", "resume-loaded"} <= STEPS


def test_the_layers_a_resume_merges_are_the_sandboxs_alone(tmp_path: Path) -> None:
    """Hibernation.own_layers: from the top of the chain, the frozen disks in the
    snapshot store with no record that no other sandbox or snapshot stands on; never
    a recorded snapshot's (nor what is below it), one another chain holds, one outside
    the store, or the base."""
    from types import SimpleNamespace

    from actors.hibernation import Hibernation

    root = tmp_path / "snapshots"
    layer = {n: str(root / n / "disk.qcow2") for n in ("p2", "p1", "kept", "shared", "tmpl")}
    base = str(tmp_path / "images" / "rootfs.img")

    def sandbox(*chain: str) -> Any:
        return SimpleNamespace(record=SimpleNamespace(chain=list(chain)))

    mine = sandbox(layer["p2"], layer["p1"], layer["kept"], layer["tmpl"], base)
    other = sandbox(layer["shared"], layer["tmpl"], base)
    recorded = SimpleNamespace(dir=str(root / "kept"), chain=(layer["tmpl"], base))
    template = SimpleNamespace(dir=str(root / "tmpl"), chain=(base,))
    snaps = SimpleNamespace(root=root, snapshots={"k": recorded, "t": template}, pending=set())
    reg = SimpleNamespace(
        snapshots=snaps, sandboxes={"a": mine, "b": other}, pools=SimpleNamespace(all_members=lambda: [])
    )
    h = Hibernation(reg)  # type: ignore[arg-type]
    assert h.own_layers(mine) == 2  # p2, p1: "kept" is a snapshot's
    mine.record.chain = [layer["p1"], layer["shared"], layer["tmpl"], base]
    assert h.own_layers(mine) == 1  # "shared" is another sandbox's too
    mine.record.chain = [layer["p1"], base]
    snaps.pending = {(root / "p1").resolve()}  # a checkpoint in progress there
    assert h.own_layers(mine) == 0
    snaps.pending = set()
    assert h.own_layers(mine) == 1
    mine.record.chain = [base]
    assert h.own_layers(mine) == 0  # the base never
    mine.record.chain = [str(tmp_path / "elsewhere" / "disk.qcow2"), base]
    assert h.own_layers(mine) == 0  # not the store's
