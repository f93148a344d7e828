"""The fleet's pieces without Ray or VMs: the placement logic on a fake Ray (slots,
names, waits, node loss), serve's fleet flags, the CLI's routing, the edge's checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from supervisor.cli import is_fleet_command
from supervisor.fleet import service
from supervisor.fleet.member import fleet_config
from supervisor.fleet.placement import LOST, PLACED, NodeSpec, Want
from supervisor.fleet.ray_backend import MEMORY, SLOT, RayPlacement, group_name, node_resource, resources
from supervisor.proto.sandvisor.v1 import sandvisor_pb2 as pb


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
    fc = fleet_config("10.0.0.1:6379", "10.0.0.1:7443", None, 2, 1024, tmp_path, False)
    assert fc.node == "10.0.0.1" and fc.node_ip == "10.0.0.1" and fc.dir == tmp_path / "fleet"
    for bad in (("nohost", "10.0.0.1:7443"), ("10.0.0.1:6379", "10.0.0.1")):
        with pytest.raises(ValueError):
            fleet_config(*bad, None, 2, 1024, tmp_path, False)
    with pytest.raises(ValueError):
        fleet_config("10.0.0.1:6379", "10.0.0.1:7443", None, 0, 1024, tmp_path, False)


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
    from supervisor.daemon import Refused, _fleet_config
    from supervisor.daemon_config import DaemonConfig
    from supervisor.grpc_addresses import TcpAddress

    base = {"socket": tmp_path / "s.sock", "state_dir": tmp_path}
    assert _fleet_config(DaemonConfig(**base), []) is None
    for cfg, why in (
        (DaemonConfig(**base, advertise="10.0.0.1:7443"), "--fleet RAY_ADDRESS"),
        (DaemonConfig(**base, fleet="10.0.0.1:6379"), "--advertise"),
        (DaemonConfig(**base, fleet="10.0.0.1:6379", advertise="10.0.0.1:7443"), "not one of the --grpc"),
    ):
        with pytest.raises(Refused, match=why):
            _fleet_config(cfg, [])
    plain = TcpAddress("127.0.0.1", 7443)  # no client certificates: refused for a fleet
    with pytest.raises(Refused, match="mTLS"):
        _fleet_config(DaemonConfig(**base, fleet="127.0.0.1:6379", advertise="127.0.0.1:7443"), [plain])
