"""The init hand-off without a VM: Init.Auto's choice, the kind of init and its stop
signal, the guard that keeps a guestd that is not PID 1 from handing off or signalling
PID 1, the configuration's rules and the SDK/wire surface (the VM side:
tests/vm/test_init.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from actors.errors import InvalidArgument
from actors.model import InitSpec, SandboxConfig, dump, load
from actors.rules import check_config
from guestd import initsys, proto
from guestd.common import ExecFailed
from supervisor.client import Init, SandboxSpec
from supervisor.serve import mapping
from supervisor.serve.grpc_convert import dict_to_message, message_to_dict
from supervisor.wire import protocol
from supervisor.wire.errors import InvalidArgument as ClientInvalidArgument
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2


def exists_of(*paths: str) -> Callable[[str], bool]:
    return lambda p: p in paths


@pytest.mark.parametrize(
    ("workload", "present", "chosen"),
    [
        # an ENTRYPOINT that starts with an init: it becomes PID 1 and runs the rest
        (
            ["/usr/bin/tini", "--", "app", "-v"],
            ("/usr/bin/tini", "/sbin/init"),
            ("/usr/bin/tini", ["--", "app", "-v"], True),
        ),
        (
            ["/sbin/tini-static", "-g", "--", "x"],
            ("/sbin/tini-static",),
            ("/sbin/tini-static", ["-g", "--", "x"], True),
        ),
        (["/usr/bin/dumb-init", "app"], ("/usr/bin/dumb-init",), ("/usr/bin/dumb-init", ["app"], True)),
        (["/init"], ("/init",), ("/init", [], True)),  # s6-overlay
        (["/lib/systemd/systemd"], ("/lib/systemd/systemd",), ("/lib/systemd/systemd", [], True)),
        # an ENTRYPOINT that is not an init: the probes, in order
        (["/docker-entrypoint.sh", "nginx"], ("/sbin/init", "/lib/systemd/systemd"), ("/sbin/init", [], False)),
        (["/docker-entrypoint.sh"], ("/lib/systemd/systemd",), ("/lib/systemd/systemd", [], False)),
        ([], ("/usr/lib/systemd/systemd",), ("/usr/lib/systemd/systemd", [], False)),
        # an init named by the ENTRYPOINT that the image does not have: probed instead
        (["/usr/bin/tini", "--", "app"], ("/sbin/init",), ("/sbin/init", [], False)),
    ],
)
def test_init_auto_choice(workload: list[str], present: tuple[str, ...], chosen: tuple[str, list[str], bool]) -> None:
    assert initsys.choose("", [], workload, exists_of(*present)) == chosen
    assert initsys.choose("auto", [], workload, exists_of(*present)) == chosen


def test_init_auto_without_an_init_and_init_cmd() -> None:
    with pytest.raises(ExecFailed) as e:
        initsys.choose("", [], ["/bin/app"], exists_of("/bin/app"))
    assert e.value.code == proto.E_NOT_FOUND
    assert "no init in the image" in e.value.message
    # Init.Cmd: that path, those arguments, whatever the image has; the workload is not its
    assert initsys.choose("/lib/systemd/systemd", ["--unit=multi-user.target"], ["/usr/bin/tini"], exists_of()) == (
        "/lib/systemd/systemd",
        ["--unit=multi-user.target"],
        False,
    )


def test_the_kind_of_init_and_its_stop_signal(tmp_path: Path) -> None:
    systemd = tmp_path / "lib" / "systemd" / "systemd"
    systemd.parent.mkdir(parents=True)
    systemd.write_text("")
    (tmp_path / "init").symlink_to(systemd)  # /sbin/init -> systemd, as systemd-sysv has it
    (tmp_path / "tini").write_text("")
    assert initsys.kind(str(tmp_path / "init")) == initsys.SYSTEMD
    assert initsys.kind(str(systemd)) == initsys.SYSTEMD
    assert initsys.kind(str(tmp_path / "tini")) == initsys.OTHER
    rtmin = initsys.SIGRTMIN
    assert initsys.POWEROFF[initsys.SYSTEMD] == rtmin + 4  # poweroff.target
    assert initsys.POWEROFF[initsys.OTHER] == 15  # SIGTERM
    assert initsys.REBOOT[initsys.SYSTEMD] == rtmin + 5


def test_a_guestd_that_is_not_pid_1_neither_hands_off_nor_signals_pid_1() -> None:
    assert os.getpid() != 1
    with pytest.raises(ExecFailed) as e:
        initsys.hand_off(0, proto.HandOff(rid=1, path="/sbin/init"))
    assert e.value.code == proto.E_FAILED
    assert initsys.HANDED_OFF == [False]
    with pytest.raises(RuntimeError, match="refused"):  # (PID 1 here is the host's)
        initsys.ask_init_to_stop(initsys.SYSTEMD, False)


def test_init_config_rules() -> None:
    check_config(SandboxConfig(init=InitSpec()))
    check_config(SandboxConfig(init=InitSpec("/sbin/init", ("--log-level=info",), {"container": "x"})))
    for bad in (InitSpec("sbin/init"), InitSpec("/sbin/in\0it"), InitSpec("/sbin/init", env={"A=B": "c"})):
        with pytest.raises(InvalidArgument):
            check_config(SandboxConfig(init=bad))


def test_sdk_wire_and_record_carry_the_init() -> None:
    assert SandboxSpec().request().init is None
    assert SandboxSpec(init=Init.auto()).request().init == protocol.InitSpec("auto", [], {})
    assert SandboxSpec(init="auto").init == Init.auto()  # (the CLI's --init)
    assert SandboxSpec(init="/sbin/init").init == Init.cmd("/sbin/init")
    spec = SandboxSpec().with_(init=Init.cmd("/lib/systemd/systemd", args=["--unit=x"], env={"container": "m"}))
    req = spec.request("a")
    assert req.init == protocol.InitSpec("/lib/systemd/systemd", ["--unit=x"], {"container": "m"})
    with pytest.raises(ClientInvalidArgument):
        Init.cmd("systemd")
    # sandvisor.v1: the field goes through gRPC's message and back
    pb = dict_to_message(protocol.unstructure_body(req), sandvisor_pb2.CreateRequest)
    assert pb.init.path == "/lib/systemd/systemd" and list(pb.init.args) == ["--unit=x"]
    back = protocol.structure_body(message_to_dict(pb), protocol.CreateSandboxRequest)
    assert back.init == req.init
    assert (
        protocol.structure_body(message_to_dict(sandvisor_pb2.CreateRequest()), protocol.CreateSandboxRequest).init
        is None
    )
    # the domain's configuration (what the record stores)
    cfg = mapping.config(back)
    assert cfg.init == InitSpec("/lib/systemd/systemd", ("--unit=x",), {"container": "m"})
    assert mapping.config(SandboxSpec().request()).init is None
    assert load(dump(cfg), SandboxConfig) == cfg
    assert load({k: v for k, v in dump(SandboxConfig()).items() if k != "init"}, SandboxConfig).init is None
