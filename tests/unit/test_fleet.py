"""The fleet's pieces without Ray or VMs: the placement logic on a fake Ray (slots,
names, waits, node loss), serve's fleet flags, the CLI's routing, the edge's checks; how
the Ray node is started (its user, environment, ports, token) and its nftables table (that
one in a network namespace of its own, as root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from actors.errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from actors.principals import Principal
from supervisor.main.cli import is_fleet_command
from supervisor.serve.fleet import service
from supervisor.serve.fleet.member import fleet_config
from supervisor.serve.fleet.placement import LOST, PLACED, NodeSpec, Want
from supervisor.serve.fleet.ray_backend import MEMORY, SLOT, RayPlacement, group_name, node_resource, resources
from supervisor.serve.fleet.rayhost import RayPorts, RayUser, check_peers, check_token, firewall, give_back, make_token
from supervisor.serve.fleet.raynode import LAUNCHER, RayNodeConfig, argv, environment
from supervisor.serve.fleet.transfer import NodeTls
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as pb


class FakePG:
    def __init__(self, name: str, bundle: dict[str, float]) -> None:
        self.name = name
        self.bundle = bundle
        self.node: str | None = None


class FakeRay:
    """Ray's scheduler in miniature: nodes with resources, groups placed where they fit."""

    def __init__(self, nodes: dict[str, dict[str, float]]) -> None:
        self.capacity = nodes  # ray node id -> resources
        self.alive = dict.fromkeys(nodes, True)
        self.kv: dict[str, bytes] = {}
        self.groups: dict[str, FakePG] = {}
        self.me = next(iter(nodes))

    def _free(self, node: str) -> dict[str, float]:
        free = dict(self.capacity[node])
        for g in self.groups.values():
            if g.node == node:
                for k, v in g.bundle.items():
                    free[k] = free.get(k, 0) - v
        return free

    def get(self, key: str) -> bytes | None:
        return self.kv.get(key)

    def put(self, key: str, value: bytes, *, overwrite: bool = True) -> bool:
        existed = key in self.kv
        if overwrite or not existed:
            self.kv[key] = value
        return existed

    def delete(self, key: str) -> None:
        self.kv.pop(key, None)

    def items(self, prefix: str) -> list[tuple[str, bytes]]:
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def request(self, name: str, bundle: dict[str, float]) -> FakePG:
        pg = self.groups[group_name(name)] = FakePG(name, bundle)
        return pg

    def ready(self, pg: FakePG, timeout: float) -> bool:
        if pg.node is None:
            for node in self.capacity:
                free = self._free(node)
                if self.alive[node] and all(free.get(k, 0) >= v for k, v in pg.bundle.items()):
                    pg.node = node
                    break
        return pg.node is not None

    def node_id_of(self, pg: FakePG) -> str:
        return pg.node or ""

    def remove(self, name: str) -> None:
        self.groups.pop(group_name(name), None)

    def remove_group(self, pg: FakePG) -> None:
        self.groups.pop(group_name(pg.name), None)

    def ray_nodes(self) -> list[dict[str, Any]]:
        return [{"NodeID": n, "Alive": a} for n, a in self.alive.items()]

    def own_node_id(self) -> str:
        return self.me


async def _fleet() -> tuple[RayPlacement, FakeRay]:
    a, b = NodeSpec("a", "10.0.0.1:7443", 2, 1024), NodeSpec("b", "10.0.0.2:7443", 2, 1024)
    ray = FakeRay({"ray-a": resources(a), "ray-b": resources(b)})
    placement = RayPlacement("10.0.0.1:6379", "10.0.0.1")
    placement.api = ray  # type: ignore[assignment]
    await placement.join(a)
    ray.me = "ray-b"
    await placement.join(b)
    return placement, ray


async def test_reserve_fills_the_nodes_then_waits_and_is_exhausted() -> None:
    with trio.fail_after(30):
        placement, ray = await _fleet()
        got = [await placement.reserve(Want(f"s{i}", 256, timeout=1)) for i in range(4)]
        assert sorted(p.node for p in got) == ["a", "a", "b", "b"]
        assert {p.address for p in got} == {"10.0.0.1:7443", "10.0.0.2:7443"}
        with pytest.raises(AlreadyExists):
            await placement.reserve(Want("s0", 256, timeout=1))
        t = trio.current_time()
        with pytest.raises(ResourceExhausted):
            await placement.reserve(Want("s4", 256, timeout=0.6))
        assert trio.current_time() - t >= 0.6
        assert "sbx/s4" not in ray.kv and group_name("s4") not in ray.groups  # nothing of it left
        views = {n.name: n for n in await placement.nodes()}
        assert views["a"].slots_used == 2 and views["a"].memory_used_mib == 512
        await placement.release("s0")
        assert group_name("s0") not in ray.groups
        with pytest.raises(NotFound):
            await placement.resolve("s0")
        assert (await placement.reserve(Want("s5", 256, timeout=1))).name == "s5"


async def test_the_fleet_service_is_for_admins_only() -> None:
    """Placement records are the fleet's: a principal the gRPC edge lets in but who is no
    admin (a labelled token, a certificate not in --grpc-admin-cert-cn, a --group uid)
    may neither list nor release them; a member's admin certificate may."""
    with trio.fail_after(30):
        placement, _ray = await _fleet()
        await placement.reserve(Want("s0", 256, timeout=1))

        @attrs.define
        class Member:
            placement: RayPlacement

        caller = Principal("token:ci")
        table = {m.name: m.handler for m in service.methods(Member(placement), lambda call: caller)}  # type: ignore[arg-type]
        for name, msg in [("ListSandboxes", pb.FleetListRequest()), ("Release", pb.FleetNameRequest(name="s0"))]:
            with pytest.raises(PermissionDenied):
                await table[name](msg, None)
        assert [p.name for p in await placement.placed()] == ["s0"]  # nothing released
        caller = Principal("cert:member-b", admin=True)
        listed = await table["ListSandboxes"](pb.FleetListRequest(), None)
        assert [p.name for p in listed.sandboxes] == ["s0"]


async def test_pins_prefers_a_snapshot_and_checks_names() -> None:
    with trio.fail_after(30):
        placement, ray = await _fleet()
        assert (await placement.reserve(Want("p", 128, node="b"))).node == "b"
        assert ray.groups[group_name("p")].bundle[node_resource("b")] > 0
        with pytest.raises(NotFound):
            await placement.reserve(Want("q", 128, node="nowhere"))
        await placement.cached("b", {"snap-1": "snap-9"})
        assert (await placement.reserve(Want("r", 128, prefer_snapshot="snap-1"))).node == "b"
        assert [(s.node, s.snapshot_id) for s in await placement.sources("snap-1")] == [("b", "snap-9")]
        # b is full now: a preference gives way to any node with room
        assert (await placement.reserve(Want("s", 128, prefer_snapshot="snap-1", timeout=5))).node == "a"
        for bad in ("", "a/b", "x" * 64, "-lead"):
            with pytest.raises(InvalidArgument):
                await placement.reserve(Want(bad, 128))


async def test_a_dead_node_loses_its_sandboxes_and_slots() -> None:
    with trio.fail_after(30):
        placement, ray = await _fleet()
        for i in range(4):
            await placement.reserve(Want(f"s{i}", 256, timeout=1))
        assert await placement.dead() == []
        ray.alive["ray-b"] = False
        assert await placement.dead() == ["b"]
        lost = await placement.node_lost("b")
        assert len(lost) == 2 and all(p.state == LOST and p.lost_at > 0 for p in lost)
        assert await placement.node_lost("b") == []  # idempotent: another member did it
        states = {p.name: p.state for p in await placement.placed()}
        assert sorted(states.values()) == [LOST, LOST, PLACED, PLACED]
        assert all(g.node == "ray-a" for g in ray.groups.values())  # b's slots released
        views = {n.name: n for n in await placement.nodes()}
        assert not views["b"].alive and views["b"].slots_used == 0
        # a lost sandbox's name can be taken again (restored elsewhere); a placed one's cannot
        await placement.release("s0" if states["s0"] == PLACED else "s1")
        back = next(p.name for p in lost)
        assert (await placement.reserve(Want(back, 256, timeout=1))).node == "a"
        with pytest.raises(AlreadyExists):
            await placement.reserve(Want(back, 256, timeout=1))


def test_resources_and_config(tmp_path: Path) -> None:
    spec = NodeSpec("a", "10.0.0.1:7443", 3, 2048)
    assert resources(spec) == {SLOT: 3.0, MEMORY: 2048.0, "sandvisor_node:a": 1.0}
    fc = fleet_config("10.0.0.1:6379", "10.0.0.1:7443", None, 2, 1024, tmp_path, True)
    assert fc.node == "10.0.0.1" and fc.node_ip == "10.0.0.1" and fc.dir == tmp_path / "fleet"
    assert fc.token == tmp_path / "fleet" / "ray-token" and fc.peers == ("10.0.0.1/32",)
    token = tmp_path / "token"
    fc = fleet_config("10.0.0.1:6379", "10.0.0.2:7443", None, 2, 1024, tmp_path, False, token_file=token)
    assert fc.token == token and fc.peers == ("10.0.0.1/32", "10.0.0.2/32")  # the head's, its own
    fc = fleet_config(
        "10.0.0.1:6379", "10.0.0.2:7443", None, 2, 1024, tmp_path, False, token_file=token, peers=("10.0.0.0/29",)
    )
    assert fc.peers == ("10.0.0.0/29", "10.0.0.2/32")
    for bad in (("nohost", "10.0.0.1:7443"), ("10.0.0.1:6379", "10.0.0.1")):
        with pytest.raises(ValueError):
            fleet_config(*bad, None, 2, 1024, tmp_path, True)
    with pytest.raises(ValueError):
        fleet_config("10.0.0.1:6379", "10.0.0.1:7443", None, 0, 1024, tmp_path, True)
    with pytest.raises(ValueError, match="--fleet-token-file"):  # a member needs the head's token
        fleet_config("10.0.0.1:6379", "10.0.0.2:7443", None, 2, 1024, tmp_path, False)
    with pytest.raises(ValueError, match="Ray node's own"):
        fleet_config(f"10.0.0.1:{RayPorts(0).node_manager}", "10.0.0.1:7443", None, 2, 1024, tmp_path, True)
    with pytest.raises(ValueError, match="--fleet-peer"):
        check_peers(["10.0.0.300"])
    with pytest.raises(ValueError, match="not names"):
        fleet_config("head.example:6379", "10.0.0.1:7443", None, 2, 1024, tmp_path, True)


def test_ray_node_runs_as_its_user_on_pinned_ports(tmp_path: Path) -> None:
    user = RayUser("sandvisor-ray", 990, 980)
    token_copy = tmp_path / "ray" / "auth_token"
    spec = NodeSpec("a", "10.0.0.1:7443", 3, 2048)
    cfg = RayNodeConfig("10.0.0.1:6390", "10.0.0.1", spec, tmp_path, tmp_path / "ray", tmp_path / "t", head=True)
    cmd = argv(cfg, user)
    # setpriv: the user and its group only, no capabilities, no way back up
    assert cmd[:8] == [
        "setpriv", "--reuid=990", "--regid=980", "--clear-groups", "--no-new-privs",
        "--inh-caps=-all", "--bounding-set=-all", "--",
    ]  # fmt: skip
    assert cmd[8:12] == [sys.executable, "-m", LAUNCHER, "start"]
    flags = {cmd[i]: cmd[i + 1] for i in range(12, len(cmd) - 1)}
    ports = cfg.ports
    assert flags["--port"] == "6390" and flags["--temp-dir"] == str(tmp_path / "ray")
    for flag, port in (
        ("--node-manager-port", ports.node_manager),
        ("--object-manager-port", ports.object_manager),
        ("--metrics-export-port", ports.metrics_export),
        ("--dashboard-agent-grpc-port", ports.agent_grpc),
        ("--dashboard-agent-listen-port", ports.agent_http),
        ("--runtime-env-agent-port", ports.runtime_env_agent),
        ("--min-worker-port", ports.workers[0]),
        ("--max-worker-port", ports.workers[1]),
    ):
        assert flags[flag] == str(port)
    assert "--include-dashboard=false" in cmd and not any("client-server" in a for a in cmd)
    env = environment(cfg, user, token_copy)
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(token_copy)
    assert "RAY_AUTH_TOKEN" not in env and env["HOME"] == env["TMPDIR"] == str(tmp_path / "ray")
    assert env["AUTOSCALER_METRIC_PORT"] == str(ports.autoscaler_metrics)
    assert not set(env) & {"SANDVISOR_SOCKET", "SANDVISOR_STATE_DIR", "PYTHONPATH"}  # nothing of serve's
    listed = ports.all()
    assert "10001" in listed and "6390" in listed and f"{ports.workers[0]}-{ports.workers[1]}" in listed
    assert "RAY_USE_TLS" not in env  # (no certificate given: --grpc-insecure set-ups)
    tls = attrs.evolve(cfg, tls=NodeTls(tmp_path / "ca", tmp_path / "c", tmp_path / "k"))
    env = environment(tls, user, token_copy)
    assert env["RAY_USE_TLS"] == "1" and env["RAY_TLS_SERVER_KEY"] == str(tmp_path / "ray" / "node.key")
    assert env["RAY_TLS_CA_CERT"] == str(tmp_path / "ray" / "ca.pem")  # (copies in Ray's dir)
    assert not any(str(tmp_path / "k") == v for v in env.values())


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_what_root_made_in_rays_dir_goes_to_rays_user(tmp_path: Path) -> None:
    ray = tmp_path / "ray"
    (ray / "logs" / "export_events").mkdir(parents=True)
    (ray / "logs" / "driver.log").write_text("x")
    outside = tmp_path / "outside"
    outside.write_text("root's")
    (ray / "logs" / "link").symlink_to(outside)  # (Ray's user's link: not followed)
    os.chown(ray / "logs", 4242, 4242)
    assert give_back(ray, RayUser("ray", 4242, 4242)) == 3  # export_events, driver.log, the link
    assert (ray / "logs" / "export_events").stat().st_uid == 4242
    assert (ray / "logs" / "driver.log").stat().st_uid == 4242
    assert outside.stat().st_uid == 0 and (ray / "logs" / "link").lstat().st_uid == 4242


def test_token_files(tmp_path: Path) -> None:
    made = make_token(tmp_path / "t")
    assert made.stat().st_mode & 0o777 == 0o600 and len(made.read_text().strip()) == 64
    assert make_token(made).read_text() == made.read_text()  # kept
    from actors.errors import FailedPrecondition

    loose = tmp_path / "loose"
    loose.write_text("x")
    loose.chmod(0o644)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(made)
    for bad, why in ((loose, "mode 0600"), (empty, "empty"), (link, "regular file"), (tmp_path / "no", "No such")):
        with pytest.raises(FailedPrecondition, match=why):
            check_token(bad)


PROBED = ("6390", "17301", "17320", "5555")  # the GCS, the object manager, a worker's, no one's


@pytest.mark.host
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_firewall_lets_root_and_ray_in_and_no_other_local_user(tmp_path: Path) -> None:
    """The table in a namespace of its own: root and Ray's uid connect to a Ray port on this
    host; uid 65534 is reset (``meta skuid``); a port of no one's is left alone."""
    from tests.support.netlab import namespaces

    ports = RayPorts(6390)
    script = firewall(ports, ["192.0.2.7/32"], RayUser("ray", 4242, 4242))
    server = (
        "import socket, sys\n"
        "ss = [socket.create_server(('127.0.0.1', p)) for p in (6390, 17301, 17320, 5555)]\n"
        "print('up', flush=True)\n"
        "sys.stdin.read()\n"
    )
    client = (
        "import socket, sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', int(p)), timeout=10).close(); print(p, 'ok')\n"
        "    except OSError as e:\n"
        "        print(p, type(e).__name__)\n"
    )
    with namespaces("svft") as (ns,):
        assert ns.name
        nft = subprocess.run(["ip", "netns", "exec", ns.name, "nft", "-f", "-"], input=script, text=True, check=False)
        assert nft.returncode == 0
        with subprocess.Popen(
            ["ip", "netns", "exec", ns.name, "/usr/bin/python3", "-c", server],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as srv:
            assert srv.stdout is not None and srv.stdin is not None
            assert srv.stdout.readline().strip() == "up"
            try:
                got = {}
                for uid in (0, 4242, 65534):
                    who = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
                    r = subprocess.run(
                        ["ip", "netns", "exec", ns.name, *who, "/usr/bin/python3", "-c", client, *PROBED],
                        capture_output=True,
                        text=True,
                        check=True,
                        timeout=60,
                    )
                    got[uid] = dict(line.split() for line in r.stdout.splitlines())
            finally:
                srv.stdin.close()
        assert got[0] == got[4242] == {"6390": "ok", "17301": "ok", "17320": "ok", "5555": "ok"}
        assert got[65534] == {
            "6390": "ConnectionRefusedError",
            "17301": "ConnectionRefusedError",
            "17320": "ConnectionRefusedError",
            "5555": "ok",
        }


def test_cli_routing() -> None:
    assert is_fleet_command(["--fleet", "h:1", "ls"])
    assert is_fleet_command(["-v", "fleet", "nodes"])
    assert not is_fleet_command(["serve", "--fleet", "h:1"])
    assert not is_fleet_command(["ls"])


def test_reserve_request_checked() -> None:
    w = service.want(pb.FleetReserveRequest(name="x"))
    assert w.memory_mib > 0 and w.timeout > 0
    with pytest.raises(InvalidArgument):
        service.want(pb.FleetReserveRequest(name="x", timeout_seconds=-1))
    assert json.loads(json.dumps({"ok": True}))  # (the CLI's --json is plain JSON)


def test_serve_refuses_half_a_fleet(tmp_path: Path) -> None:
    from supervisor.main.daemon import Refused, _fleet_config
    from supervisor.main.daemon_config import DaemonConfig
    from supervisor.serve.grpc_addresses import TcpAddress

    base = {"socket": tmp_path / "s.sock", "state_dir": tmp_path}
    assert _fleet_config(DaemonConfig(**base), []) is None
    for cfg, why in (
        (DaemonConfig(**base, advertise="10.0.0.1:7443"), "--fleet RAY_ADDRESS"),
        (DaemonConfig(**base, fleet="10.0.0.1:6379"), "--advertise"),
        (DaemonConfig(**base, fleet="10.0.0.1:6379", advertise="10.0.0.1:7443"), "--fleet-token-file"),
        (
            DaemonConfig(**base, fleet="10.0.0.1:6379", advertise="10.0.0.1:7443", fleet_head=True),
            "not one of the --grpc",
        ),
    ):
        with pytest.raises(Refused, match=why):
            _fleet_config(cfg, [])
    plain = TcpAddress("127.0.0.1", 7443)  # no client certificates: refused for a fleet
    with pytest.raises(Refused, match="mTLS"):
        _fleet_config(
            DaemonConfig(**base, fleet="127.0.0.1:6379", advertise="127.0.0.1:7443", fleet_head=True), [plain]
        )
