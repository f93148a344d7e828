"""Modify's additions (actors/modify.py, actors/modify_secrets.py): env keys removed,
ceilings by themselves, the next_start policy, conflicts and warnings, per-resource
resize status, secrets added, re-hosted and given a new placeholder. Plans with no VM;
the registry's part on fake VMs."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from actors.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from actors.model import Limits, SandboxConfig, State, Timers, Workload
from actors.modify import Kind, Machine, Modification, Policy, SecretChange, Status, modify, plan
from actors.registry import Registry
from actors.sandboxes.sandbox import Sandbox
from actors.secrets.model import SecretRef
from actors.secrets.vault import Vault
from actors.store import Record, Store
from supervisor.serve import mapping
from supervisor.wire import protocol
from tests.support.fakevm import FakeLab, fake_settings

CFG = SandboxConfig(
    labels={"team": "a"},
    limits=Limits(vcpus=1, memory_mib=256, max_vcpus=2, max_memory_mib=1024),
    workload=Workload(env={"A": "1", "B": "2"}, working_dir="/srv"),
    timers=Timers(ttl_seconds=600),
    secrets=(SecretRef("API_KEY", ("api.example.com",), placeholder="SANDVISOR_SECRET_API_KEY_0123456789abcdef"),),
)
EFFECTIVE = Limits(vcpus=1, memory_mib=256, max_vcpus=2, max_memory_mib=1024)
RUNNING = Machine(max_vcpus=2, max_memory_mib=1024, balloon=True, disk_mib=2048)


def change(p: Any, kind: Kind) -> Any:
    return next(c for c in p.changes if c.kind == kind)


# -- env keys removed ----------------------------------------------------------------------
def test_env_keys_are_removed_for_future_runs() -> None:
    p = plan(CFG, EFFECTIVE, Modification(env={"C": "3"}, env_remove=("A", "Z")), RUNNING, disk_mib=2048)
    assert p.accepted and p.config.workload.env == {"B": "2", "C": "3"}
    c = change(p, Kind.ENV_REMOVE)
    assert (c.status, c.value, c.previous) == (Status.APPLIED, "A,Z", "A")
    assert [w.field for w in p.warnings] == ["env"] and "running processes keep theirs" in p.warnings[0].message
    absent = plan(CFG, EFFECTIVE, Modification(env_remove=("Z",)), None, disk_mib=2048)
    assert change(absent, Kind.ENV_REMOVE).status == Status.UNCHANGED and not absent.warnings
    with pytest.raises(InvalidArgument, match="both set and removed"):
        plan(CFG, EFFECTIVE, Modification(env={"A": "9"}, env_remove=("A",)), RUNNING, disk_mib=2048)


# -- ceilings by themselves ----------------------------------------------------------------
def test_a_ceiling_alone_needs_a_restart_on_a_running_machine() -> None:
    p = plan(CFG, EFFECTIVE, Modification(max_vcpus=4, max_memory_mib=2048), RUNNING, disk_mib=2048)
    assert not p.accepted
    assert change(p, Kind.MAX_CPUS).status == change(p, Kind.MAX_MEMORY).status == Status.NEEDS_RESTART
    assert "-smp maxcpus" in change(p, Kind.MAX_CPUS).why and "no memory hotplug" in change(p, Kind.MAX_MEMORY).why
    assert {c.field for c in p.conflicts} == {"max_cpus", "max_memory"}
    p = plan(CFG, EFFECTIVE, Modification(max_vcpus=4, max_memory_mib=2048, restart=True), RUNNING, disk_mib=2048)
    assert p.accepted and p.restart and change(p, Kind.MAX_CPUS).status == Status.RESTART
    assert p.config.limits == Limits(vcpus=1, memory_mib=256, max_vcpus=4, max_memory_mib=2048)
    assert any(w.field == "restart" for w in p.warnings) and not p.conflicts


def test_a_ceiling_on_a_stopped_sandbox_is_for_its_next_boot_and_may_go_down() -> None:
    p = plan(CFG, EFFECTIVE, Modification(max_vcpus=1, max_memory_mib=512), None, disk_mib=2048)
    assert p.accepted and {c.status for c in p.changes} == {Status.NEXT_BOOT}
    assert p.config.limits == Limits(vcpus=1, memory_mib=256, max_vcpus=1, max_memory_mib=512)
    same = plan(CFG, EFFECTIVE, Modification(max_vcpus=2), RUNNING, disk_mib=2048)
    assert change(same, Kind.MAX_CPUS).status == Status.UNCHANGED


@pytest.mark.parametrize(
    "mod",
    [
        Modification(max_vcpus=0),
        Modification(max_memory_mib=32),
        Modification(vcpus=2, max_vcpus=1),  # below its value
        Modification(max_memory_mib=128),  # below the memory (256)
        Modification(restart=True, policy=Policy.NEXT_START),
    ],
)
def test_bad_ceilings_are_invalid_arguments(mod: Modification) -> None:
    with pytest.raises(InvalidArgument):
        plan(CFG, EFFECTIVE, mod, None, disk_mib=2048)


def test_a_memory_ceiling_above_the_value_needs_the_balloon() -> None:
    p = plan(CFG, EFFECTIVE, Modification(max_memory_mib=2048), None, disk_mib=2048, balloon=False)
    assert change(p, Kind.MAX_MEMORY).status == Status.REFUSED and "balloon" in p.conflicts[0].message


# -- next_start on a running sandbox -------------------------------------------------------
def test_next_start_saves_everything_and_changes_nothing_now() -> None:
    mod = Modification(
        vcpus=4, memory_mib=2048, max_vcpus=4, env_remove=("A",), labels={"x": "1"}, policy=Policy.NEXT_START
    )
    p = plan(CFG, EFFECTIVE, mod, RUNNING, disk_mib=2048)
    assert p.accepted and p.pending and not p.restart and p.policy == Policy.NEXT_START
    assert {c.status for c in p.changes} == {Status.NEXT_BOOT}
    assert all("next_start" in c.why for c in p.changes)
    assert p.config.limits.vcpus == 4 and p.config.workload.env == {"B": "2"} and p.config.labels["x"] == "1"
    stopped = plan(CFG, EFFECTIVE, attrs.evolve(mod, policy=Policy.NEXT_START), None, disk_mib=2048)
    assert not stopped.pending  # a stopped sandbox: its configuration, as any Modify


# -- secrets -------------------------------------------------------------------------------
STORE = {"shared": ["*.example.com"], "bare": []}


def secrets_plan(*changes: SecretChange, machine: Machine | None = RUNNING, **kw: Any) -> Any:
    kw.setdefault("proxy_ports", (443,))
    return plan(
        CFG,
        EFFECTIVE,
        Modification(secrets=changes, **kw.pop("mod", {})),
        machine,
        disk_mib=2048,
        store_hosts=STORE,
        **kw,
    )


def test_a_secret_is_added_live_where_the_proxy_runs_else_by_restart() -> None:
    new = SecretChange("TOKEN", value=b"t0ken-value", hosts=("api.example.com",))
    p = secrets_plan(new)
    c = change(p, Kind.SECRET)
    assert (c.status, c.value) == (Status.APPLIED, "TOKEN: added")
    ref = next(r for r in p.config.secrets if r.name == "TOKEN")
    assert ref.generated and ref.placeholder.startswith("SANDVISOR_SECRET_TOKEN_")
    assert dict(p.secret_values) == {"TOKEN": b"t0ken-value"}
    assert "t0ken-value" not in repr(p.changes) + repr(new) + repr(p)
    no_proxy = secrets_plan(new, proxy_ports=None)
    assert change(no_proxy, Kind.SECRET).status == Status.NEEDS_RESTART and "booted without secrets" in (
        change(no_proxy, Kind.SECRET).why
    )
    other_port = secrets_plan(attrs.evolve(new, hosts=("api.example.com:8443",)))
    assert change(other_port, Kind.SECRET).status == Status.NEEDS_RESTART and "443" in other_port.conflicts[0].message
    restart = secrets_plan(new, proxy_ports=None, mod={"policy": Policy.RESTART})
    assert change(restart, Kind.SECRET).status == Status.RESTART and restart.restart
    stopped = secrets_plan(new, machine=None)
    assert change(stopped, Kind.SECRET).status == Status.NEXT_BOOT


def test_a_secret_is_rehosted_and_given_a_new_placeholder() -> None:
    p = secrets_plan(
        SecretChange(
            "API_KEY", hosts=("api.example.com", "*.api.example.com"), placeholder="PLACEHOLDER_NEW_0123456789"
        )
    )
    c = change(p, Kind.SECRET)
    assert c.status == Status.APPLIED and c.value == "API_KEY: hosts updated, placeholder updated"
    (ref,) = p.config.secrets
    assert ref.hosts == ("api.example.com", "*.api.example.com") and ref.placeholder == "PLACEHOLDER_NEW_0123456789"
    assert not ref.generated and not p.secret_values
    assert any("old placeholder" in w.message for w in p.warnings)
    same = secrets_plan(SecretChange("API_KEY", hosts=("api.example.com",)))
    assert change(same, Kind.SECRET).status == Status.UNCHANGED


def test_a_store_secret_narrows_its_entry_never_widens_it() -> None:
    ok = secrets_plan(SecretChange("S", store="shared", hosts=("a.example.com",)))
    assert change(ok, Kind.SECRET).status == Status.APPLIED and not ok.secret_values
    with pytest.raises(PermissionDenied, match="not within"):
        secrets_plan(SecretChange("S", store="shared", hosts=("example.org",)))
    with pytest.raises(PermissionDenied, match="no hosts"):
        secrets_plan(SecretChange("S", store="bare", hosts=("a.example.com",)))
    with pytest.raises(NotFound):
        secrets_plan(SecretChange("S", store="missing", hosts=("a.example.com",)))
    with pytest.raises(PermissionDenied):  # re-hosting a store secret beyond its entry
        plan(
            attrs.evolve(CFG, secrets=(SecretRef("S", ("a.example.com",), placeholder="P" * 20, store="shared"),)),
            EFFECTIVE,
            Modification(secrets=(SecretChange("S", hosts=("example.org",)),)),
            RUNNING,
            disk_mib=2048,
            store_hosts=STORE,
            proxy_ports=(443,),
        )


@pytest.mark.parametrize(
    "sc",
    [
        SecretChange("NEW", hosts=("api.example.com",)),  # no source
        SecretChange("NEW", value=b"v"),  # no hosts
        SecretChange("API_KEY", value=b"v", store="shared"),  # two sources
        SecretChange("API_KEY", placeholder="short"),
        SecretChange("API_KEY", hosts=("*.com",)),  # a public suffix
        SecretChange("bad-name", value=b"v", hosts=("api.example.com",)),
        SecretChange("API_KEY", value=b"a\nb"),
    ],
)
def test_bad_secret_changes_are_invalid_arguments(sc: SecretChange) -> None:
    with pytest.raises(InvalidArgument):
        secrets_plan(sc)


def test_a_new_value_does_not_wait_for_the_next_start() -> None:
    p = secrets_plan(SecretChange("API_KEY", value=b"v2-value"), mod={"policy": Policy.NEXT_START})
    assert change(p, Kind.SECRET).status == Status.REFUSED and "vault" in p.conflicts[0].message
    hosts = secrets_plan(SecretChange("API_KEY", hosts=("b.example.com",)), mod={"policy": Policy.NEXT_START})
    assert change(hosts, Kind.SECRET).status == Status.NEXT_BOOT and hosts.pending


# -- the wire ------------------------------------------------------------------------------
def test_the_request_and_the_plan_on_the_wire() -> None:
    req = protocol.ModifyRequest(
        id="m",
        env_remove=["A"],
        max_vcpus=4,
        policy="next_start",
        secrets=[protocol.SecretSpec("T", ["api.example.com"], b"v4lue-x", "", "", "")],
    )
    mod = mapping.modification(req)
    assert mod.env_remove == ("A",) and mod.max_vcpus == 4 and mod.policy == Policy.NEXT_START
    assert mod.secrets[0].value == b"v4lue-x" and mod.secrets[0].hosts == ("api.example.com",)
    with pytest.raises(InvalidArgument, match="policy"):
        mapping.modification(protocol.ModifyRequest(id="m", policy="later"))
    p = plan(CFG, EFFECTIVE, Modification(max_vcpus=4, env={"X": "1"}), RUNNING, disk_mib=2048)
    r = mapping.modify_response(p)
    assert r.policy == "no_restart" and [c.field for c in r.conflicts] == ["max_cpus"]
    assert [w.field for w in r.warnings] == ["env"] and r.resize == []


def test_the_pending_configuration_survives_the_supervisor(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    r = Record(uid="u1", id="m", seq=store.next_seq(), config=CFG, state=State.READY, created_at=1)
    store.insert(r)
    r.pending = attrs.evolve(CFG, labels={"later": "1"})
    store.update_tuning(r)
    store.close()
    (back,) = Store(tmp_path / "db").all()
    assert back.pending == r.pending and back.config == CFG


# -- on fake VMs: the registry's part --------------------------------------------------------
@asynccontextmanager
async def registry(root: Path) -> AsyncIterator[Registry]:
    lab = FakeLab()
    store = Store(root / "state" / "sandvisor.db")
    try:
        async with trio.open_nursery() as n:
            await n.start(lab.run)
            reg = await n.start(Registry(fake_settings(root, lab), store, templates=False).run)
            try:
                yield reg
            finally:
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


async def ready(sb: Sandbox) -> None:
    with trio.fail_after(60):
        await sb.ready_event.wait()
    assert sb.state == State.READY, sb.record.error


async def test_next_start_on_a_running_sandbox_waits_for_its_next_boot(tmp_path: Path) -> None:
    cfg = SandboxConfig(limits=Limits(vcpus=1, memory_mib=256), workload=Workload(env={"A": "1", "B": "2"}))
    async with registry(tmp_path) as reg:
        sb = await reg.create("n", cfg)
        await ready(sb)
        p = await modify(
            reg, "n", Modification(env_remove=("A",), max_vcpus=2, labels={"x": "1"}, policy=Policy.NEXT_START)
        )
        assert p.applied and p.pending and not p.restart
        assert sb.config.workload.env == {"A": "1", "B": "2"} and "x" not in sb.config.labels  # not now
        assert sb.record.pending is not None and sb.limits.max_vcpus == 1
        shown = mapping.info(sb).pending  # Inspect shows what waits
        assert shown is not None and shown.max_vcpus == 2 and shown.env == {"B": "2"}
        with pytest.raises(FailedPrecondition, match="next start"):  # a plain Modify would be lost at the start
            await modify(reg, "n", Modification(env={"C": "3"}))
        more = await modify(reg, "n", Modification(env={"C": "3"}, policy=Policy.NEXT_START))  # they add up
        assert more.pending and more.config.workload.env == {"B": "2", "C": "3"}
        with trio.fail_after(60):
            await reg.stop("n").wait_stopped()
        await reg.start("n")
        await ready(sb)
        assert sb.config.workload.env == {"B": "2", "C": "3"} and sb.config.labels["x"] == "1"
        assert sb.record.pending is None and sb.limits.vcpu_ceiling == 2 and mapping.info(sb).pending is None
        assert sb.guest is not None and sb.guest.machine.spec.cpus == 2  # the new machine's ceiling


async def test_a_live_resize_reports_each_resource(tmp_path: Path) -> None:
    cfg = SandboxConfig(limits=Limits(vcpus=1, memory_mib=256, max_vcpus=2))
    async with registry(tmp_path) as reg:
        sb = await reg.create("r", cfg)
        await ready(sb)
        p = await modify(reg, "r", Modification(vcpus=2, env_remove=("NONE",)))
        assert p.applied and change(p, Kind.CPUS).status == Status.APPLIED
        by = {r.resource: r for r in p.resize}
        assert set(by) == {"cpus", "memory"}
        assert (by["cpus"].requested, by["cpus"].actual, by["cpus"].state) == (2, 2, "settled")
        # the fake machines have no balloon: their memory is their RAM, and says so
        assert by["memory"].state == "settled" and "no balloon" in by["memory"].why
        with pytest.raises(InvalidArgument, match="above max_vcpus"):  # a ceiling below its value
            await modify(reg, "r", Modification(max_vcpus=1))


async def test_a_principal_names_only_store_entries_it_may_see(tmp_path: Path) -> None:
    """Modify's ``store:`` secret, like Create's: another principal's entry is NOT_FOUND
    with the text of a real miss (no existence oracle); its own gets past that door."""
    from supervisor.client.sdk.aio import connect
    from supervisor.wire.errors import SandboxError
    from tests.unit.test_principals import lab

    (tmp_path / "vault").mkdir()
    vault = Vault(tmp_path / "vault", tmp_path / "vault.key")
    short = Path(tempfile.mkdtemp(prefix="p", dir="/tmp"))
    try:
        with trio.fail_after(120):
            async with (
                lab(tmp_path, short, vault=vault) as lb,
                connect(lb.sock, act_as="uid:7") as seven,
                connect(lb.sock, act_as="uid:8") as eight,
            ):
                await seven.call("SetSecret", {"name": "gh", "value": b"seven's", "hosts": ["api.github.com"]})
                await eight.call("Create", {"id": "s8"})
                spec = {"name": "GH", "store": "gh", "hosts": ["api.github.com"]}
                with pytest.raises(SandboxError, match="no secret 'gh' in the store") as e:
                    await eight.call("Modify", {"id": "s8", "secrets": [spec]})
                assert e.value.code == "NOT_FOUND"
                await seven.call("Create", {"id": "s7"})
                await ready(lb.reg.get("s7"))
                # its own: past the door; the fake VM booted without secrets: by restart only
                r = await seven.call("Modify", {"id": "s7", "secrets": [spec]})
                assert not r["applied"] and [c["status"] for c in r["changes"]] == ["needs_restart"]
                assert "booted without secrets" in r["conflicts"][0]["message"]
                assert lb.reg.get("s8").config.secrets == () == lb.reg.get("s7").config.secrets
    finally:
        shutil.rmtree(short, ignore_errors=True)


async def test_the_blocking_sdk_sends_every_addition(tmp_path: Path) -> None:
    """The blocking Sandbox runs the same Modify plan: env_remove, a ceiling, the policy,
    a secret update, and reads back conflicts, warnings and pending."""
    from supervisor.client.sdk.modify_spec import SecretUpdate
    from supervisor.client.sdk.sync import Sandbox as SyncSandbox
    from supervisor.wire.errors import InvalidArgument as ClientInvalidArgument
    from tests.unit.test_principals import lab

    short = Path(tempfile.mkdtemp(prefix="p", dir="/tmp"))
    try:
        with trio.fail_after(120):
            async with lab(tmp_path, short) as lb:
                sb = await lb.reg.create("b", SandboxConfig(workload=Workload(env={"A": "1"})))
                await ready(sb)

                def calls() -> tuple[Any, Any]:
                    box = SyncSandbox.get("b", socket=lb.sock)
                    now = box.modify(env_remove=["A"], max_cpus=2, dry_run=True)
                    later = box.modify(env_remove=["A"], max_cpus=2, policy="next_start")
                    with pytest.raises(ClientInvalidArgument):  # a secret update names one source at most
                        SecretUpdate(name="K", value="v", store="s").spec()
                    return now, later

                now, later = await trio.to_thread.run_sync(calls)
                assert not now.applied and [c.field for c in now.conflicts] == ["max_cpus"]
                assert [w.field for w in now.warnings] == ["env"] and now.policy == "no_restart"
                assert later.applied and later.pending and later.policy == "next_start"
                assert sb.record.pending is not None and sb.config.workload.env == {"A": "1"}
    finally:
        shutil.rmtree(short, ignore_errors=True)
