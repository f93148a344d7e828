"""The placement interface on Ray: slots are Ray custom resources, a reservation is a
named detached placement group, the records are in Ray's (GCS) key-value store.

Ray's API blocks: every call runs in a worker thread (``trio.to_thread``), never on the
Trio loop; :class:`RayPlacement` is the one owner of the driver connection (``ray.init``
in :meth:`RayPlacement.connect`, ``ray.shutdown`` in :meth:`RayPlacement.close`).

The driver is the supervisor's own process (root): it presents the fleet's token (Ray's
token authentication: ``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH`` the root-only
token file, set in this process before Ray is imported) and, with Ray's TLS on, the
node's certificate; it runs nothing for anyone: it
calls the GCS's key-value store and placement groups, submits no task, gets no object.
Ray's workers are the raylet's children, and so Ray's user's (supervisor/serve/fleet/raynode.py).

Each node's raylet is started with the resources::

    sandvisor_slot: SLOTS   sandvisor_memory_mib: MiB   sandvisor_node:NAME: 1

and a reservation is a placement group ``sandvisor:NAME`` (lifetime detached: it outlives
the client and the member that asked) of one bundle ``{sandvisor_slot: 1,
sandvisor_memory_mib: M}`` (plus ``sandvisor_node:N: 0.001`` to pin it): Ray's scheduler
chooses the node, and holds the slot until the group is removed. Keys, namespace
``sandvisor``: ``node/NAME`` (a member: address, capacity, Ray node id), ``sbx/NAME``
(a sandbox: node, state), ``snaps/NAME`` (a node's cached snapshot ids). A name is
claimed with a put that does not overwrite: two Creates of one name, one wins.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from actors.face import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from supervisor.serve.fleet.placement import LOST, PLACED, NodeSpec, NodeView, Placed, Source, Want

NAMESPACE = "sandvisor"
SLOT = "sandvisor_slot"
MEMORY = "sandvisor_memory_mib"
PIN = 0.001  # of a node's own resource: a bundle asking for it lands there, many fit
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
T = TypeVar("T")


def node_resource(name: str) -> str:
    return f"sandvisor_node:{name}"


def resources(node: NodeSpec) -> dict[str, float]:
    """The custom resources a member's raylet offers Ray's scheduler."""
    return {SLOT: float(node.slots), MEMORY: float(node.memory_mib), node_resource(node.name): 1.0}


def check_name(name: str, what: str = "sandbox name") -> str:
    if not _NAME.match(name):
        raise InvalidArgument(f"{what} {name!r}: 1-63 of A-Z a-z 0-9 _ . - (a letter or digit first)")
    return name


def group_name(name: str) -> str:
    return f"sandvisor:{name}"


def _dump(rec: Any) -> bytes:
    return json.dumps(attrs.asdict(rec)).encode()


def _placed(raw: bytes) -> Placed:
    return Placed(**json.loads(raw))


class RayApi:
    """The blocking calls into Ray (each one runs in a worker thread)."""

    def __init__(self, token: Path | None = None, tls: dict[str, str] | None = None) -> None:
        import importlib

        if token is not None:  # (read by Ray's C++ token loader: before ray is imported)
            os.environ["RAY_AUTH_MODE"] = "token"
            os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
            os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ.update(tls or {})
        import ray

        self.ray: Any = ray
        self.kv: Any = importlib.import_module("ray.experimental.internal_kv")
        self.pgs: Any = importlib.import_module("ray.util.placement_group")  # (ray.util's attribute is a function)

    def connect(self, address: str, node_ip: str) -> None:
        self.ray.init(
            address=address,
            namespace=NAMESPACE,
            _node_ip_address=node_ip,
            log_to_driver=False,
            configure_logging=False,
            include_dashboard=False,
        )

    def close(self) -> None:
        self.ray.shutdown()

    # -- the store -------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        value: bytes | None = self.kv._internal_kv_get(key.encode(), namespace=NAMESPACE)
        return value

    def put(self, key: str, value: bytes, *, overwrite: bool = True) -> bool:
        """True: the key existed (and, without ``overwrite``, was left as it was)."""
        return bool(self.kv._internal_kv_put(key.encode(), value, overwrite=overwrite, namespace=NAMESPACE))

    def delete(self, key: str) -> None:
        self.kv._internal_kv_del(key.encode(), namespace=NAMESPACE)

    def items(self, prefix: str) -> list[tuple[str, bytes]]:
        out = []
        for k in self.kv._internal_kv_list(prefix.encode(), namespace=NAMESPACE):
            v = self.get(k.decode())
            if v is not None:
                out.append((k.decode(), v))
        return out

    # -- the scheduler -----------------------------------------------------------------
    def request(self, name: str, bundle: dict[str, float]) -> Any:
        return self.pgs.placement_group([bundle], name=group_name(name), lifetime="detached")

    def ready(self, pg: Any, timeout: float) -> bool:
        return bool(pg.wait(timeout_seconds=timeout))

    def node_id_of(self, pg: Any) -> str:
        table = self.pgs.placement_group_table(pg)
        return str(table.get("bundles_to_node_id", {}).get(0, ""))

    def remove(self, name: str) -> None:
        try:
            pg = self.pgs.get_placement_group(group_name(name))
        except ValueError:
            return  # none (removed already)
        self.pgs.remove_placement_group(pg)

    def remove_group(self, pg: Any) -> None:
        self.pgs.remove_placement_group(pg)

    def ray_nodes(self) -> list[dict[str, Any]]:
        nodes: list[dict[str, Any]] = self.ray.nodes()
        return nodes

    def own_node_id(self) -> str:
        return str(self.ray.get_runtime_context().get_node_id())


class RayPlacement:
    """:class:`~supervisor.serve.fleet.placement.Placement` on a Ray cluster."""

    def __init__(
        self, address: str, node_ip: str, token: Path | None = None, tls: dict[str, str] | None = None
    ) -> None:
        self.address = address
        self.node_ip = node_ip
        self.token = token
        self.tls = tls  # Ray's TLS settings for the driver (rayhost.tls_env), if it is on
        self.api: RayApi | None = None
        self._limiter = trio.CapacityLimiter(8)  # threads in Ray calls at once

    async def _call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await trio.to_thread.run_sync(lambda: fn(*args, **kw), limiter=self._limiter)

    def _api(self) -> RayApi:
        if self.api is None:
            raise Unavailable("not connected to the fleet's Ray cluster")
        return self.api

    async def connect(self, timeout: float) -> None:
        """``ray.init`` as a driver on this node's raylet (retried until it is up)."""
        api = await self._call(RayApi, self.token, self.tls)
        last: Exception | None = None
        with trio.move_on_after(timeout) as scope:
            while True:
                try:
                    await self._call(api.connect, self.address, self.node_ip)
                    break
                except (ConnectionError, RuntimeError, ValueError) as exc:
                    last = exc
                    await trio.sleep(0.5)  # (the raylet is starting: Ray offers no event to wait on)
        if scope.cancelled_caught:
            raise Unavailable(f"Ray at {self.address}: not reachable in {timeout:.0f} s ({last})")
        self.api = api

    async def close(self) -> None:
        if self.api is not None:
            api, self.api = self.api, None
            with trio.CancelScope(shield=True):
                await self._call(api.close)

    # -- joining -----------------------------------------------------------------------
    async def join(self, node: NodeSpec) -> None:
        api = self._api()
        check_name(node.name, "node name")
        ray_id = await self._call(api.own_node_id)
        record = {**attrs.asdict(node), "ray_node_id": ray_id, "joined_at": time.time()}
        await self._call(api.put, f"node/{node.name}", json.dumps(record).encode())

    async def cached(self, node: str, snapshots: dict[str, str]) -> None:
        await self._call(self._api().put, f"snaps/{node}", json.dumps(snapshots, sort_keys=True).encode())

    async def sources(self, snapshot_id: str) -> list[Source]:
        """Live members that cache the fleet's snapshot ``snapshot_id``."""
        alive = await self._alive_ids()
        nodes = {n["name"]: n for n in await self._node_records() if alive.get(n["ray_node_id"], False)}
        out = []
        for key, raw in await self._call(self._api().items, "snaps/"):
            name = key.removeprefix("snaps/")
            local = json.loads(raw).get(snapshot_id)
            if local and name in nodes:
                out.append(Source(name, nodes[name]["address"], local))
        return sorted(out, key=lambda s: s.node)

    # -- the four verbs ------------------------------------------------------------------
    async def reserve(self, want: Want) -> Placed:
        api = self._api()
        check_name(want.name)
        if want.node:
            check_name(want.node, "node name")
        nodes = {n["name"]: n for n in await self._node_records()}
        if want.node and want.node not in nodes:
            raise NotFound(f"no node {want.node!r} in the fleet")
        claim = Placed(want.name, "", "", want.memory_mib, time.time(), state="reserving")
        if await self._call(api.put, f"sbx/{want.name}", _dump(claim), overwrite=False):
            old = await self._call(api.get, f"sbx/{want.name}")
            if old is None or _placed(old).state != LOST:
                raise AlreadyExists(f"a sandbox named {want.name!r} is in the fleet already")
            # a lost sandbox's name is free again (its restore elsewhere takes it): one claim wins
            await self._call(api.delete, f"sbx/{want.name}")
            if await self._call(api.put, f"sbx/{want.name}", _dump(claim), overwrite=False):
                raise AlreadyExists(f"a sandbox named {want.name!r} is in the fleet already")
        try:
            return await self._place(want, nodes)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._call(api.delete, f"sbx/{want.name}")
            raise

    async def _place(self, want: Want, nodes: dict[str, dict[str, Any]]) -> Placed:
        api = self._api()
        deadline = trio.current_time() + want.timeout
        pins: list[str | None] = [want.node] if want.node else []
        if not want.node and want.prefer_snapshot:
            caching = await self._caching(want.prefer_snapshot)
            pins += [n for n in caching if n in nodes]
        if not want.node:
            pins.append(None)
        for i, pin in enumerate(pins):
            last = i == len(pins) - 1
            bundle = {SLOT: 1.0, MEMORY: float(want.memory_mib)}
            if pin is not None:
                bundle[node_resource(pin)] = PIN
            pg = await self._call(api.request, want.name, bundle)
            # a preferred node gets a moment (room there now, or soon); the last try, the rest
            wait_until = deadline if last else min(deadline, trio.current_time() + 2.0)
            if await self._wait(pg, wait_until):
                ray_id = await self._call(api.node_id_of, pg)
                node = next((n for n in nodes.values() if n.get("ray_node_id") == ray_id), None)
                if node is None:  # a raylet that is no member (its resources were given by hand)
                    await self._call(api.remove_group, pg)
                    raise FailedPrecondition(f"Ray placed {want.name!r} on node {ray_id}, which is no member")
                placed = Placed(want.name, node["name"], node["address"], want.memory_mib, time.time())
                await self._call(api.put, f"sbx/{want.name}", _dump(placed))
                return placed
            with trio.CancelScope(shield=True):
                await self._call(api.remove_group, pg)
        where = f"on node {want.node!r}" if want.node else "on any node"
        raise ResourceExhausted(
            f"no room for {want.name!r} ({want.memory_mib} MiB) {where} within {want.timeout:.0f} s: "
            "every slot of the fleet is taken"
        )

    async def _wait(self, pg: Any, until: float) -> bool:
        api = self._api()
        try:
            while True:
                left = until - trio.current_time()
                if left <= 0:
                    return False
                if await self._call(api.ready, pg, min(left, 0.5)):  # short waits: cancellable between
                    return True
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._call(api.remove_group, pg)
            raise

    async def resolve(self, name: str) -> Placed:
        raw = await self._call(self._api().get, f"sbx/{check_name(name)}")
        if raw is None:
            raise NotFound(f"no sandbox named {name!r} in the fleet")
        rec = _placed(raw)
        if rec.state == "reserving":
            raise NotFound(f"sandbox {name!r} is being placed")
        return rec

    async def release(self, name: str) -> None:
        api = self._api()
        check_name(name)
        await self._call(api.remove, name)
        await self._call(api.delete, f"sbx/{name}")

    async def node_lost(self, node: str) -> list[Placed]:
        api = self._api()
        lost = []
        for rec in await self.placed():
            if rec.node != node or rec.state != PLACED:
                continue
            gone = attrs.evolve(rec, state=LOST, lost_at=time.time())
            await self._call(api.put, f"sbx/{rec.name}", _dump(gone))
            await self._call(api.remove, rec.name)  # its slot: Ray would move the group elsewhere
            lost.append(gone)
        return lost

    # -- views -----------------------------------------------------------------------------
    async def placed(self) -> list[Placed]:
        items = await self._call(self._api().items, "sbx/")
        return sorted((r for r in (_placed(v) for _, v in items) if r.state != "reserving"), key=lambda r: r.name)

    async def _node_records(self) -> list[dict[str, Any]]:
        items = await self._call(self._api().items, "node/")
        return [json.loads(v) for _, v in items]

    async def _caching(self, snapshot_id: str) -> list[str]:
        return [s.node for s in await self.sources(snapshot_id)]

    async def _alive_ids(self) -> dict[str, bool]:
        return {n["NodeID"]: bool(n["Alive"]) for n in await self._call(self._api().ray_nodes)}

    async def dead(self) -> list[str]:
        """Members whose raylet Ray reports dead (a member that rejoined has a new id)."""
        alive = await self._alive_ids()
        return [n["name"] for n in await self._node_records() if not alive.get(n["ray_node_id"], False)]

    async def nodes(self) -> list[NodeView]:
        alive = await self._alive_ids()
        placed = [p for p in await self.placed() if p.state == PLACED]
        snaps = dict(await self._call(self._api().items, "snaps/"))
        out = []
        for n in sorted(await self._node_records(), key=lambda n: str(n["name"])):
            mine = [p for p in placed if p.node == n["name"]]
            out.append(
                NodeView(
                    n["name"],
                    n["address"],
                    alive.get(n["ray_node_id"], False),
                    n["slots"],
                    len(mine),
                    n["memory_mib"],
                    sum(p.memory_mib for p in mine),
                    tuple(sorted(json.loads(snaps.get(f"snaps/{n['name']}", b"{}")))),
                )
            )
        return out
