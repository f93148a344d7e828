"""Networking a Create gives: UDP ports, bind addresses, named network profiles, DNS.

I/O-free parts (the SDK's spec, the wire in both encodings, the profiles file, the
checks), and the API's refusals on fake VMs behind the real msgpack socket. The
real-VM half is tests/vm/test_net_create.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from ipaddress import IPv4Network
from pathlib import Path

import attrs
import pytest
import trio

from actors.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from actors.model import Dns, Egress, NetMode, Network, PortSpec, Protocol, SandboxConfig
from actors.net import bindaddr, profiles
from actors.net.egress import EgressPolicy, base_ruleset
from actors.registry import Registry
from actors.rules import check_config
from actors.sandboxes.guestsetup import resolv_conf
from actors.store import Store
from supervisor.client import AsyncSandbox, PortBinding, Sandbox
from supervisor.client import Dns as SdkDns
from supervisor.client import PermissionDenied as WirePermissionDenied
from supervisor.client.sdk.spec import SandboxSpec
from supervisor.serve import mapping
from supervisor.serve.grpc_service import _sandvisor_create, to_request
from supervisor.serve.server import Server
from supervisor.wire import protocol
from supervisor.wire.errors import InvalidArgument as WireInvalidArgument
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as pb
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from tests.support.fakevm import FakeLab, fake_settings
from tests.unit.test_net import chain_verdict
from tests.unit.test_principals import ALICE, ROOT_ONLY
from tests.unit.test_principals import lab as principals_lab

POOL = IPv4Network("10.88.0.0/16")


# -- the SDK and the CLI's --port --------------------------------------------------------
def test_port_bindings_parse_as_the_cli_writes_them() -> None:
    assert PortBinding.parse("5353:53/udp") == PortBinding(guest=53, host=5353, protocol="udp")
    assert PortBinding.parse("8080:80") == PortBinding(guest=80, host=8080)
    assert PortBinding.parse("80") == PortBinding(guest=80)
    assert PortBinding.parse("127.0.0.2:0:53/udp") == PortBinding(guest=53, protocol="udp", address="127.0.0.2")
    for bad in ("a:b", "1:2/sctp", ":1:2", "x"):
        with pytest.raises(ValueError):
            PortBinding.parse(bad)


def test_the_spec_carries_udp_ports_bindings_profile_and_dns_to_the_wire() -> None:
    spec = SandboxSpec().with_(
        network="tap",
        ports={8080: 0, "53/udp": 5353, "81/tcp": 0},
        port_bindings=["127.0.0.3:9000:90/udp"],
        port_address="127.0.0.2",
        network_profile="private",
        dns={"nameservers": ["192.0.2.53"], "search": ["corp.test"]},
    )
    again = spec.with_(ports={"54/udp": 0}, port_bindings=[PortBinding(guest=91)])
    req = again.request("n")
    assert sorted((p.sandbox_port, p.host_port, p.protocol, p.host_address) for p in req.ports) == [
        (53, 5353, "udp", ""),
        (54, 0, "udp", ""),
        (81, 0, "tcp", ""),
        (90, 9000, "udp", "127.0.0.3"),
        (91, 0, "tcp", ""),
        (8080, 0, "tcp", ""),
    ]
    assert (req.network_profile, req.port_address) == ("private", "127.0.0.2")
    assert req.dns == protocol.DnsSpec(["192.0.2.53"], ["corp.test"])
    assert SandboxSpec().request().dns is None
    assert again.network.dns == SdkDns(nameservers=("192.0.2.53",), search=("corp.test",))


def test_the_domain_config_keeps_each_port_s_address_or_the_sandbox_s() -> None:
    req = (
        SandboxSpec()
        .with_(
            network="tap",
            ports={"53/udp": 0},
            port_bindings=["127.0.0.3:0:90"],
            port_address="127.0.0.2",
            network_profile="public",
            dns=SdkDns(search=["a.test"]),
        )
        .request("n")
    )
    cfg = mapping.config(req)
    assert set(cfg.ports) == {PortSpec(53, 0, Protocol.UDP, "127.0.0.2"), PortSpec(90, 0, Protocol.TCP, "127.0.0.3")}
    assert cfg.network == Network(
        mode=NetMode.TAP, profile="public", port_address="127.0.0.2", dns=Dns((), ("a.test",))
    )


def test_sandvisor_v1_create_carries_the_new_fields() -> None:
    base = pb.CreateSandboxRequest(id="a", network=pb.NetworkSpec(mode="tap"))
    msg = sv.CreateRequest(
        base=base,
        ports=[sv.PortMapping(sandbox_port=53, host_port=5353, protocol="udp", host_address="127.0.0.2")],
        network_profile="corp",
        port_address="127.0.0.3",
        dns=sv.DnsSpec(nameservers=["192.0.2.53"], search=["x.test", "y.test"]),
    )
    for f, n in (("network_profile", 140), ("port_address", 141), ("dns", 142)):
        assert sv.CreateRequest.DESCRIPTOR.fields_by_name[f].number == n
    req = to_request(msg, protocol.CreateSandboxRequest, _sandvisor_create)
    assert req.ports == [protocol.PortMapping(53, 5353, "udp", "127.0.0.2")]  # the address is the caller's now
    assert (req.network_profile, req.port_address) == ("corp", "127.0.0.3")
    assert req.dns == protocol.DnsSpec(["192.0.2.53"], ["x.test", "y.test"])
    assert to_request(sv.CreateRequest(base=base), protocol.CreateSandboxRequest, _sandvisor_create).dns is None


# -- checks that need no supervisor -------------------------------------------------------
def test_dns_settings_are_checked() -> None:
    tap = Network(mode=NetMode.TAP)
    ok = attrs.evolve(tap, dns=Dns(("192.0.2.53",), ("corp.test", "b_x.example.", "svc")))
    check_config(SandboxConfig(network=ok))
    for dns, err in (
        (Dns(("::1",)), InvalidArgument),
        (Dns(("1.1.1.1", "1.0.0.1", "8.8.8.8", "9.9.9.9")), InvalidArgument),
        (Dns((), ("bad domain",)), InvalidArgument),
        (Dns((), ("-x.test",)), InvalidArgument),
        (Dns((), tuple(f"d{i}.test" for i in range(7))), InvalidArgument),
    ):
        with pytest.raises(err):
            check_config(SandboxConfig(network=attrs.evolve(tap, dns=dns)))
    with pytest.raises(FailedPrecondition):  # restricted user mode resolves nothing
        check_config(SandboxConfig(network=Network(mode=NetMode.USER, dns=Dns((), ("a.test",)))))


def test_a_udp_port_needs_a_network_that_carries_its_replies() -> None:
    udp = (PortSpec(53, 0, Protocol.UDP),)
    check_config(SandboxConfig(network=Network(mode=NetMode.TAP), ports=udp))
    check_config(SandboxConfig(network=Network(mode=NetMode.USER, outbound=True), ports=udp))
    with pytest.raises(FailedPrecondition, match="UDP"):
        check_config(SandboxConfig(network=Network(mode=NetMode.USER), ports=udp))
    with pytest.raises(InvalidArgument):
        check_config(SandboxConfig(network=Network(mode=NetMode.TAP), ports=(PortSpec(1, 0, Protocol.TCP, "lo"),)))


def test_bind_addresses_are_loopback_the_default_or_what_the_operator_lists() -> None:
    for address in ("", "127.0.0.1", "127.0.0.2", "192.0.2.7", "0.0.0.0"):
        bindaddr.check(address, "127.0.0.1", ("192.0.2.7", "0.0.0.0"))
    bindaddr.check("192.0.2.9", "192.0.2.9", ())  # the operator's --expose-address
    for address in ("0.0.0.0", "192.0.2.7", "10.0.0.1"):
        with pytest.raises(PermissionDenied, match="--port-address"):
            bindaddr.check(address, "127.0.0.1", ())
    with pytest.raises(InvalidArgument):
        bindaddr.check("localhost", "127.0.0.1", ())


# -- profiles -----------------------------------------------------------------------------
def test_builtin_profiles_expand_to_egress_rules() -> None:
    def verdict(name: str, addr: str) -> str:
        net = profiles.expand(Network(profile=name), {})
        assert net.mode == NetMode.TAP and net.egress is not None and net.profile == name
        return chain_verdict(EgressPolicy.parse(net.egress.to_dict()), addr, 443, POOL)

    assert verdict("public", "203.0.113.5") == "accept"
    assert verdict("public", "10.1.2.3") == "reject"  # private ranges stay closed
    assert verdict("private", "203.0.113.5") == "reject"
    assert verdict("private", "10.1.2.3") == "accept"
    assert verdict("private", "192.168.4.4") == "accept"
    assert verdict("private", "10.88.0.9") == "reject"  # other sandboxes: still closed
    assert verdict("private", "100.100.100.200") == "reject"  # 100.64/10: cloud metadata, not the LAN
    assert profiles.expand(Network(profile="none"), {}) == Network(profile="none")
    user = profiles.expand(Network(mode=NetMode.USER, outbound=True, profile="private"), {})
    assert user.mode == NetMode.USER and user.egress == profiles.BUILTIN["private"]


def test_profile_refusals() -> None:
    with pytest.raises(InvalidArgument, match=r"unknown network profile 'corp'.*public, private, none"):
        profiles.expand(Network(profile="corp"), {})
    with pytest.raises(InvalidArgument, match="exclude"):
        profiles.expand(Network(mode=NetMode.TAP, profile="public", egress=Egress()), {})
    with pytest.raises(InvalidArgument, match="contradict"):
        profiles.expand(Network(mode=NetMode.TAP, profile="none"), {})


def test_the_operator_s_profiles_file(tmp_path: Path) -> None:
    f = tmp_path / "profiles.toml"
    f.write_text('[profile.corp]\ndefault = "deny"\nallow = ["10.20.0.0/16", "pypi.org:443"]\n[profile.open]\n')
    loaded = profiles.load(f)
    assert loaded == {"corp": Egress("deny", ("10.20.0.0/16", "pypi.org:443")), "open": Egress()}
    net = profiles.expand(Network(profile="corp"), loaded)
    assert net.egress == loaded["corp"]
    for text, why in (
        ("[profile.public]\n", "built-in"),
        ('[profile.x]\nallow = ["not an entry!"]\n', "profile 'x'"),
        ('[profile.x]\ndefault = "maybe"\n', "profile 'x'"),
        ("[profile.x]\nallo = []\n", "default, allow, deny"),
        ("[profile.Bad]\n", "a name is"),
        ("[profiles.x]\n", "unknown top-level"),
        ("[profile.x\n", "network profiles"),
    ):
        f.write_text(text)
        with pytest.raises(profiles.ProfileFileError, match=why):
            profiles.load(f)


def test_serve_refuses_a_bad_profiles_file_or_port_address(tmp_path: Path) -> None:
    from supervisor.main.daemon import Refused, _check
    from supervisor.main.daemon_config import DaemonConfig

    bad = tmp_path / "p.toml"
    bad.write_text("[profile.public]\n")
    with pytest.raises(Refused, match="--network-profiles"):
        _check(DaemonConfig(socket=tmp_path / "s.sock", state_dir=tmp_path, network_profiles=bad))
    with pytest.raises(Refused, match="--port-address"):
        _check(DaemonConfig(socket=tmp_path / "s.sock", state_dir=tmp_path, port_addresses=("lan",)))


# -- DNS ----------------------------------------------------------------------------------
def test_every_dns_query_of_a_sandbox_goes_to_the_proxy() -> None:
    rules = base_ruleset(POOL[1], POOL)
    assert 'iifname "svn*" meta nfproto ipv4 meta l4proto { tcp, udp } th dport 53 dnat ip to 10.88.0.1:53' in rules


def test_resolv_conf_text() -> None:
    assert resolv_conf(("10.88.0.1",), ()) == "nameserver 10.88.0.1\n"
    assert resolv_conf(("192.0.2.53", "192.0.2.54"), ("a.test", "b.test")) == (
        "nameserver 192.0.2.53\nnameserver 192.0.2.54\nsearch a.test b.test\n"
    )


# -- the API's refusals (fake VMs behind the real socket) ----------------------------------
@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="n", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@asynccontextmanager
async def served(root: Path, sock: Path, **kw: object) -> AsyncIterator[Registry]:
    fake = FakeLab()
    store = Store(root / "state" / "sandvisor.db")
    try:
        async with trio.open_nursery() as n:
            await n.start(fake.run)
            reg = await n.start(Registry(fake_settings(root, fake, **kw), store, templates=False).run)
            try:
                await n.start(Server(reg, sock).serve)
                yield reg
            finally:
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


async def test_create_refuses_unknown_profiles_and_bind_addresses_the_operator_did_not_open(
    tmp_path: Path, short_dir: Path
) -> None:
    sock = short_dir / "s.sock"
    with trio.fail_after(60):
        async with served(tmp_path, sock, port_addresses=("192.0.2.7",)) as reg:
            with pytest.raises(WireInvalidArgument, match="unknown network profile 'corp'"):
                await AsyncSandbox.create("a", socket=sock, network_profile="corp", detached=True, wait=False)
            with pytest.raises(WirePermissionDenied, match=r"may not listen on 0\.0\.0\.0"):
                await AsyncSandbox.create(
                    "b", socket=sock, network="user", port_address="0.0.0.0", detached=True, wait=False
                )
            with pytest.raises(WirePermissionDenied, match=r"may not listen on 192\.0\.2\.8"):
                await AsyncSandbox.create(
                    "c", socket=sock, network="user", port_bindings=["192.0.2.8:0:80"], detached=True, wait=False
                )
            with pytest.raises(WireInvalidArgument, match="contradict"):
                await AsyncSandbox.create(
                    "d", socket=sock, network="user", network_profile="none", detached=True, wait=False
                )
            assert not reg.sandboxes  # nothing was made
            # a listed address, loopback, and the built-in "none" are accepted
            sb = await AsyncSandbox.create(
                "e",
                socket=sock,
                network="user",
                port_bindings=["127.0.0.2:0:80", "192.0.2.7:0:81"],
                detached=True,
                wait=False,
            )
            cfg = reg.sandboxes[sb.id].config
            assert {p.host_address for p in cfg.ports} == {"127.0.0.2", "192.0.2.7"}
            await AsyncSandbox.create("f", socket=sock, network_profile="none", detached=True, wait=False)
            assert reg.sandboxes["f"].config.network == Network(profile="none")

            # the blocking SDK takes the same settings (and gets the same refusals)
            def blocking() -> None:
                Sandbox.create(
                    "g",
                    socket=sock,
                    network="outbound",
                    port_bindings=["0:53/udp"],
                    dns=SdkDns(search=["s.test"]),
                    detached=True,
                    wait=False,
                )
                with pytest.raises(WirePermissionDenied):
                    Sandbox.create("h", socket=sock, network="outbound", port_address="192.0.2.9", wait=False)

            await trio.to_thread.run_sync(blocking)
            g = reg.sandboxes["g"].config
            assert g.ports == (PortSpec(53, 0, Protocol.UDP),) and g.network.dns == Dns((), ("s.test",))
            assert "h" not in reg.sandboxes


async def test_the_cli_s_create_flags(tmp_path: Path, short_dir: Path) -> None:
    """``create --port [ADDR:]HOST:GUEST[/udp] --port-address --dns --dns-search
    --network-profile``, the real CLI against the real socket."""
    sock = short_dir / "s.sock"

    async def cli(*args: str) -> subprocess.CompletedProcess[bytes]:
        argv = [sys.executable, "-m", "supervisor.main.cli", "create", "--socket", str(sock), "--no-wait", *args]
        return await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)

    with trio.fail_after(60):
        async with served(tmp_path, sock) as reg:
            done = await cli(
                "c",
                "--network",
                "outbound",
                "--port",
                "127.0.0.2:5353:53/udp",
                "--port",
                "8080",
                "--port-address",
                "127.0.0.3",
                "--dns",
                "192.0.2.53",
                "--dns-search",
                "a.test",
                "--dns-search",
                "b.test",
            )
            assert done.returncode == 0, done.stderr
            net = reg.sandboxes["c"].config.network
            assert (net.port_address, net.dns) == ("127.0.0.3", Dns(("192.0.2.53",), ("a.test", "b.test")))
            assert set(reg.sandboxes["c"].config.ports) == {
                PortSpec(53, 5353, Protocol.UDP, "127.0.0.2"),
                PortSpec(8080, 0, Protocol.TCP, "127.0.0.3"),
            }
            done = await cli("d", "--network-profile", "nope")
            assert done.returncode != 0 and b"unknown network profile 'nope'" in done.stderr, done.stderr
            done = await cli("e", "--port", "1:2/sctp")
            assert done.returncode != 0 and b"tcp or udp" in done.stderr, done.stderr
            assert set(reg.sandboxes) == {"c"}


@ROOT_ONLY
async def test_a_group_member_binds_only_where_the_operator_allows(tmp_path: Path) -> None:
    """The bind-address door for an unprivileged client (uid 65534 in --group, through
    setpriv's ids): 0.0.0.0 and a LAN address the operator did not list are refused
    (nothing made), on create and on a later expose; a listed one and loopback work."""
    d = Path(tempfile.mkdtemp(prefix="b", dir="/tmp"))
    d.chmod(0o755)  # the other uid reaches the socket in it
    try:
        with trio.fail_after(120):
            async with principals_lab(tmp_path, d, port_addresses=("192.0.2.7",)) as lb:
                user = {"mode": "user"}
                got = await lb.as_uid(
                    ALICE,
                    [
                        ("Create", {"id": "a", "network": user, "port_address": "0.0.0.0"}),
                        (
                            "Create",
                            {"id": "b", "network": user, "ports": [{"sandbox_port": 80, "host_address": "192.0.2.8"}]},
                        ),
                        (
                            "Create",
                            {"id": "c", "network": user, "ports": [{"sandbox_port": 80, "host_address": "192.0.2.7"}]},
                        ),
                        ("ExposePort", {"id": "c", "sandbox_port": 81, "host_address": "0.0.0.0"}),
                    ],
                )
                assert [g.get("fail", [""])[0] for g in got] == [
                    "PERMISSION_DENIED",
                    "PERMISSION_DENIED",
                    "",
                    "PERMISSION_DENIED",
                ]
                assert set(lb.reg.sandboxes) == {"c"}
                assert lb.reg.get("c").config.ports == (PortSpec(80, 0, Protocol.TCP, "192.0.2.7"),)
    finally:
        shutil.rmtree(d, ignore_errors=True)
