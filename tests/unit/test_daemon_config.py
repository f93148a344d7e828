"""``sandvisor serve``'s flags are made from DaemonConfig's declaration: every flag is a
field and every field (but the stop bound) a flag, and a configuration said as flags
parses back to itself."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs
import pytest

from actors import defaults
from supervisor.main.cli import build_parser
from supervisor.main.daemon_config import FLAG, DaemonConfig, flags, from_args, to_argv

NOT_FLAGS = {"stop_timeout"}  # set by code (tests, benchmarks), not by a serve flag


def serve_parser() -> argparse.ArgumentParser:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    sv = sub.choices["serve"]
    sv.fill()  # type: ignore[attr-defined]
    return sv


def parse(argv: list[str]) -> DaemonConfig:
    return from_args(build_parser().parse_args(["serve", *argv]))


def test_every_serve_flag_is_a_field_and_every_field_a_flag() -> None:
    options = {o for a in serve_parser()._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    assert options == {f.name for _a, f in flags()}
    unflagged = {a.name for a in attrs.fields(DaemonConfig) if FLAG not in a.metadata}
    assert unflagged == NOT_FLAGS


def test_a_config_said_as_flags_parses_back_to_itself(tmp_path: Path) -> None:
    """Every flagged field set away from its default, through to_argv and the parser."""
    cfg = DaemonConfig(
        socket=tmp_path / "s.sock",
        state_dir=tmp_path / "state",
        accel="tcg",
        run_root=tmp_path / "run",
        boot_timeout=12.5,
        jail_overhead_mib=300,
        jail_uids=(2000000000, 1024),
        guest_timeout=7.0,
        max_sandboxes=3,
        max_paused=5,
        group="wheel",
        admin_group="adm",
        qemu_user="",
        expose_address="0.0.0.0",
        memory_dir=tmp_path / "shm",
        anonymous_memory=True,
        templates=False,
        template_pool=2,
        pool_size=1,
        keep_sandboxes=True,
        jail=False,
        cgroups=False,
        allow_paths=(tmp_path / "a", tmp_path / "b"),
        registry_allow=("127.0.0.1:5000", "example.org"),
        registry_mirrors=("docker.io=http://127.0.0.1:5000",),
        max_memory_mib=4096,
        max_disk_mib=9000,
        max_sandbox_disk_mib=0,
        max_image_bytes=512 << 20,
        max_starting=5,
        balloon=False,
        tb_size_mib=0,
        pools={"snap-a": 2, "base=x": 1},
        grpc=("unix:///tmp/x.sock", "127.0.0.1:9999"),
        grpc_cert=tmp_path / "c.pem",
        grpc_key=tmp_path / "k.pem",
        grpc_client_ca=tmp_path / "ca.pem",
        grpc_token_file=tmp_path / "token",
        grpc_admin_cert_cn=("ops", "fleet-admin"),
        grpc_insecure=True,
        metrics="127.0.0.1:9100",
        metrics_token_file=tmp_path / "metrics.token",
        e2b="127.0.0.1:3000",
        e2b_key_file=tmp_path / "e2b.keys",
        ssh="127.0.0.1:2222",
        ip_pool="10.99.0.0/16",
        dns_upstreams=("1.1.1.1", "9.9.9.9:5353"),
        egress_never=("192.168.0.0/16",),
        fleet="10.0.0.1:6379",
        fleet_head=True,
        advertise="10.0.0.1:7443",
        fleet_node="n1",
        fleet_slots=3,
        fleet_memory_mib=1024,
        fleet_token_file=tmp_path / "ray-token",
        fleet_peers=("10.0.0.0/29", "10.0.1.5"),
        fleet_user="ray-here",
        fleet_python="/usr/bin/python3",
        secrets_key=tmp_path / "secrets.key",
        upstream_ca=tmp_path / "upstream-ca.pem",
        webhooks=("https://hooks.example/in", "http://127.0.0.1:8080/x"),
        webhook_secrets=(tmp_path / "wh1", tmp_path / "wh2"),
        port_addresses=("192.0.2.10", "0.0.0.0"),
        network_profiles=tmp_path / "profiles.toml",
        freeze_fs=False,
    )
    default_cfg = DaemonConfig(socket=cfg.socket, state_dir=cfg.state_dir)
    left_at_default = [
        a.name
        for a in attrs.fields(DaemonConfig)
        if a.name not in NOT_FLAGS and getattr(cfg, a.name) == getattr(default_cfg, a.name)
    ]
    assert left_at_default == ["socket", "state_dir"]  # (required: no default to differ from)
    assert parse(to_argv(cfg)) == cfg
    assert parse(to_argv(default_cfg)) == default_cfg  # (ip_pool "" said as --ip-pool none)


def test_no_flags_give_the_declared_defaults(tmp_path: Path) -> None:
    cfg = parse(["--socket", str(tmp_path / "s"), "--state-dir", str(tmp_path / "st")])
    # the one flag whose default is not the field's: serve has tap networking on by default
    assert cfg == DaemonConfig(socket=tmp_path / "s", state_dir=tmp_path / "st", ip_pool=defaults.IP_POOL)
    assert (cfg.tb_size_mib, cfg.boot_timeout, cfg.guest_timeout, cfg.jail_overhead_mib) == (
        defaults.TB_SIZE_MIB,
        defaults.BOOT_TIMEOUT,
        defaults.GUEST_TIMEOUT,
        defaults.JAIL_OVERHEAD_MIB,
    )


def test_the_flags_that_parse_their_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    base = ["--socket", "s", "--state-dir", "st"]
    cfg = parse([*base, "--ip-pool", "NONE", "--allow-path", "rel", "--max-sandbox-disk", "2G"])
    assert cfg.ip_pool == "" and cfg.allow_paths == (tmp_path / "rel",) and cfg.max_sandbox_disk_mib == 2048
    assert parse([*base, "--max-image-size", "8G", "--jail-uids", "5:6"]).jail_uids == (5, 6)
    assert parse([*base, "--pool", "a=b=3"]).pools == {"a=b": 3}
    assert parse([*base, "--run-root", ""]).run_root is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--pool", "x"],
        ["--jail-uids", "5"],
        ["--max-image-size", "1K"],
        ["--max-sandbox-disk", "lots"],
        ["--accel", "x"],
    ],
)
def test_a_bad_flag_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """(--pool's value was checked after parsing: a bad one was a traceback.)"""
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_the_defaults_are_defined_once() -> None:
    """The domain's settings, the VM specs, the jailer and the daemon take their defaults
    from actors/defaults.py."""
    from actors import settings
    from actors.cells import cell, cgroups, identities
    from actors.machines import qemuspec, vm
    from actors.net import ippool
    from actors.sandboxes import savedstate

    def default(cls: type, name: str) -> object:
        return attrs.fields_dict(cls)[name].default

    assert (
        default(settings.Settings, "tb_size_mib")
        == default(qemuspec.MachineSpec, "tb_size_mib")
        == defaults.TB_SIZE_MIB
    )
    assert default(settings.Settings, "boot_timeout") == default(vm.VmSpec, "boot_timeout") == defaults.BOOT_TIMEOUT
    assert default(settings.Settings, "guest_timeout") == defaults.GUEST_TIMEOUT
    assert default(cell.JailConfig, "overhead_mib") == defaults.JAIL_OVERHEAD_MIB
    assert cgroups.CgroupLimits.for_guest.__kwdefaults__["overhead_mib"] == defaults.JAIL_OVERHEAD_MIB  # type: ignore[index]
    assert savedstate.resume_spec.__kwdefaults__["boot_timeout"] == defaults.BOOT_TIMEOUT  # type: ignore[index]
    assert (identities.DEFAULT_ID_FIRST, identities.DEFAULT_ID_COUNT) == (
        defaults.JAIL_ID_FIRST,
        defaults.JAIL_ID_COUNT,
    )
    assert ippool.DEFAULT_POOL == defaults.IP_POOL


def test_serve_pool_argument() -> None:
    from supervisor.main.daemon_config import _pool_arg

    assert _pool_arg("base=2") == ("base", 2)
    assert _pool_arg("a=b=3") == ("a=b", 3)
    for bad in ("base", "=2", "base=x", "base=-1"):
        with pytest.raises(Exception, match="SNAPSHOT=N"):
            _pool_arg(bad)
