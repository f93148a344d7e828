"""A supervisor as a member of a fleet: owns its Ray node and its driver connection.

``serve --fleet RAY_ADDRESS --advertise HOST:PORT`` starts one :class:`FleetMember` in
the daemon's nursery, after the registry and before the gRPC edge (which serves its
:mod:`supervisor.serve.fleet.service`). It:

* starts this host's Ray node (:class:`~supervisor.serve.fleet.raynode.RayNode`, as Ray's
  own unprivileged user, token authentication on, its ports filtered) with the host's
  capacity as custom resources, connects as a driver (with the fleet's token), records
  itself (``join``);
* gives a slot back when a sandbox of the fleet placed here is removed (whatever edge
  removed it), and sweeps reservations no Create followed;
* tells the fleet which snapshots it caches (``--prefer-snapshot`` reads that);
* watches Ray's node table: a member Ray reports dead has its sandboxes marked
  ``lost`` and their slots released (any member may do it first; it is idempotent).

Everything Ray does blocks, and runs in worker threads (:mod:`supervisor.serve.fleet.ray_backend`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import trio

from actors.face import Action, InvalidArgument, Lagged, NotFound, Registry, defaults
from supervisor.serve.fleet.placement import LOST, PLACED, NodeSpec, Placed, Placement, Want
from supervisor.serve.fleet.ray_backend import RayPlacement
from supervisor.serve.fleet.rayhost import check_peers, check_token, make_token, tls_env
from supervisor.serve.fleet.raynode import RayNode, RayNodeConfig, ray_dir_for
from supervisor.serve.fleet.transfer import NodeTls, Pulled, fleet_id, pull

log = logging.getLogger("sandvisor.fleet")

CONNECT_TIMEOUT = 120.0  # the Ray node's start and the driver's connection, on a loaded host
WATCH_PERIOD = 1.0  # Ray's node table and our snapshots, read this often
ORPHAN_GRACE = 120.0  # a reservation with no sandbox behind it is released after this
SOURCE_GRACE = 3 * WATCH_PERIOD + 1.0  # a fetch waits this long for a node to tell it has the snapshot


@attrs.frozen
class FleetConfig:
    ray_address: str
    advertise: str  # HOST:PORT of this supervisor's gRPC listener
    node: str
    slots: int
    memory_mib: int
    dir: Path  # <state>/fleet
    head: bool = False
    tls: NodeTls | None = None  # towards the other members (None: --grpc-insecure, loopback tests)
    run_root: Path = Path("/run/sandvisor/vms")  # Ray's own dir goes under it
    token_file: Path | None = None  # the fleet's Ray token (None: the head makes <dir>/ray-token)
    peers: tuple[str, ...] = ()  # networks that may reach this host's Ray ports
    ray_user: str = defaults.FLEET_RAY_USER
    ray_python: str = sys.executable

    @property
    def node_ip(self) -> str:
        return self.advertise.rpartition(":")[0].strip("[]")

    @property
    def token(self) -> Path:
        return self.token_file or self.dir / "ray-token"

    @property
    def spec(self) -> NodeSpec:
        return NodeSpec(self.node, self.advertise, self.slots, self.memory_mib)


class FleetMember:
    def __init__(self, cfg: FleetConfig, registry: Registry, placement: Placement | None = None) -> None:
        self.cfg = cfg
        self.registry = registry
        tls = tls_env(cfg.tls.ca, cfg.tls.cert, cfg.tls.key) if cfg.tls is not None else None
        self.backend = RayPlacement(cfg.ray_address, cfg.node_ip, cfg.token, tls)
        self.placement: Placement = placement or self.backend
        self.raynode = RayNode(
            RayNodeConfig(
                cfg.ray_address,
                cfg.node_ip,
                cfg.spec,
                cfg.dir,
                ray_dir_for(cfg.run_root),
                cfg.token,
                peers=cfg.peers,
                user=cfg.ray_user,
                python=cfg.ray_python,
                head=cfg.head,
                tls=cfg.tls,
            )
        )
        self.handled_dead: set[str] = set()
        self.lost_events: list[Placed] = []  # what this member marked lost (newest last)
        self.told_lost: set[str] = set()  # lost sandboxes this member's Events told of
        self._fetching = trio.Lock()  # one pull at a time: a second of the same finds it here

    @property
    def name(self) -> str:
        return self.cfg.node

    async def run(self, task_status: trio.TaskStatus[FleetMember] = trio.TASK_STATUS_IGNORED) -> None:
        self.cfg.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.cfg.token_file is None:
            make_token(self.cfg.token)  # (the head's: members are given a copy)
        check_token(self.cfg.token)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.raynode.run)
            try:
                await self.backend.connect(CONNECT_TIMEOUT)
                await self.raynode.driver_connected()
                await self.placement.join(self.cfg.spec)
                log.info(
                    "fleet: joined %s as %s (%d slots, %d MiB), advertised at %s",
                    self.cfg.ray_address,
                    self.name,
                    self.cfg.slots,
                    self.cfg.memory_mib,
                    self.cfg.advertise,
                )
                nursery.start_soon(self._watch_removals)
                nursery.start_soon(self._watch)
                task_status.started(self)
                await trio.sleep_forever()
            finally:
                await self.backend.close()
                nursery.cancel_scope.cancel()

    # -- the edge's verbs (supervisor/serve/fleet/service.py) ------------------------------------
    async def reserve(self, want: Want) -> Placed:
        return await self.placement.reserve(want)

    def cached(self) -> dict[str, str]:
        """The fleet's snapshots here: fleet id -> local id."""
        return {fleet_id(r): r.id for r in self.registry.snapshots.select()}

    async def fetch(self, snapshot_id: str) -> tuple[str, Pulled | None]:
        """The local id of the fleet's snapshot ``snapshot_id``, pulled from a member that
        caches it unless it is here (and the pull, if there was one)."""
        async with self._fetching:
            local = self.cached().get(snapshot_id)
            if local is not None:
                return local, None
            # a snapshot just taken is told to the fleet within a watch period: a few rounds' grace
            with trio.move_on_after(SOURCE_GRACE):
                while not (sources := [s for s in await self.placement.sources(snapshot_id) if s.node != self.name]):
                    await trio.sleep(WATCH_PERIOD / 4)
            if not sources:
                raise NotFound(f"snapshot {snapshot_id} is cached on no live node of the fleet")
            source = sources[0]
            pulled = await pull(self.registry, source, snapshot_id, self.cfg.tls)
            log.info(
                "fleet: snapshot %s pulled from %s as %s: %.1f MiB in %.2f s",
                snapshot_id,
                source.node,
                pulled.record.id,
                pulled.bytes / 2**20,
                pulled.seconds,
            )
            await self.placement.cached(self.name, self.cached())
            return pulled.record.id, pulled

    # -- slots back when sandboxes go -------------------------------------------------------
    async def _watch_removals(self) -> None:
        while True:
            sub = self.registry.events.subscribe(action="removed")
            try:
                async for ev in sub:
                    with _logged("releasing the slot of " + ev.sandbox_id):
                        await self._release_if_mine(ev.sandbox_id)
            except Lagged:
                log.info("fleet: removal events lagged: the sweep catches up")
            finally:
                self.registry.events.unsubscribe(sub)

    async def _release_if_mine(self, name: str) -> None:
        try:
            rec = await self.placement.resolve(name)
        except (NotFound, InvalidArgument):  # not the fleet's (a template's boot, a local Create)
            return
        if rec.node == self.name and rec.state == PLACED:
            await self.placement.release(name)
            log.info("fleet: %s removed here: its slot is released", name)

    async def _sweep(self) -> None:
        """Reservations placed here that no sandbox followed (a client that died between
        Reserve and Create) go back after a grace."""
        now = time.time()
        for rec in await self.placement.placed():
            if (
                rec.node == self.name
                and rec.state == PLACED
                and rec.name not in self.registry.sandboxes
                and now - rec.created_at > ORPHAN_GRACE
            ):
                await self.placement.release(rec.name)
                log.info("fleet: reservation %s had no sandbox after %.0f s: released", rec.name, ORPHAN_GRACE)

    # -- Ray's view of the nodes, our snapshots ---------------------------------------------------
    async def _watch(self) -> None:
        reported: dict[str, str] | None = None
        sweep_at = trio.current_time() + ORPHAN_GRACE / 4
        while True:
            with _logged("watching the fleet"):
                reported = await self._watch_once(reported)
            if trio.current_time() >= sweep_at:
                with _logged("sweeping reservations"):
                    await self._sweep()
                sweep_at = trio.current_time() + ORPHAN_GRACE / 4
            await trio.sleep(WATCH_PERIOD)

    async def _watch_once(self, reported: dict[str, str] | None) -> dict[str, str] | None:
        """Dead members' sandboxes marked lost; this node's snapshots told (if they changed)."""
        for node in await self.placement.dead():
            if node == self.name:
                continue
            lost = await self.placement.node_lost(node)
            if node not in self.handled_dead or lost:
                self.handled_dead.add(node)
                self.lost_events += lost
                log.warning(
                    "fleet: node %s is dead (Ray): %s lost, slots released",
                    node,
                    ", ".join(p.name for p in lost) or "no sandbox",
                )
        for rec in await self.placement.placed():
            if rec.state == LOST and rec.name not in self.told_lost:
                self.told_lost.add(rec.name)
                self.registry.events.emit(rec.name, Action.LOST, {"node": rec.node, "fleet": self.cfg.ray_address})
        snaps = self.cached()
        if snaps != reported:
            await self.placement.cached(self.name, snaps)
        return snaps


@contextlib.contextmanager
def _logged(what: str) -> Iterator[None]:
    """A background step that failed is logged; the member goes on (the next round retries)."""
    try:
        yield
    except Exception as exc:  # (Ray's errors too: the cluster may be busy or a head restarting)
        log.warning("fleet: %s failed: %s: %s", what, type(exc).__name__, exc)


def fleet_config(
    ray_address: str,
    advertise: str,
    node: str | None,
    slots: int,
    memory_mib: int,
    state_dir: Path,
    head: bool,
    tls: NodeTls | None = None,
    *,
    run_root: Path = Path("/run/sandvisor/vms"),
    token_file: Path | None = None,
    peers: tuple[str, ...] = (),
    ray_user: str = defaults.FLEET_RAY_USER,
    ray_python: str | None = None,
) -> FleetConfig:
    """``serve``'s fleet flags as a :class:`FleetConfig` (ValueError names the flag).
    The peers: those given, else the head's host; this host's own address is always one."""
    host, sep, port = ray_address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--fleet {ray_address!r}: expected HOST:PORT of the Ray head")
    ahost, sep, aport = advertise.rpartition(":")
    if not sep or not ahost or not aport.isdigit():
        raise ValueError(f"--advertise {advertise!r}: expected HOST:PORT")
    if slots <= 0 or memory_mib <= 0:
        raise ValueError("--fleet-slots and --fleet-memory must be more than 0")
    if token_file is None and not head:
        raise ValueError("--fleet without --fleet-head needs --fleet-token-file (a copy of the head's Ray token)")
    first, last = defaults.FLEET_RAY_PORT_BASE, defaults.FLEET_RAY_PORT_BASE + 41
    if first <= int(port) <= last:
        raise ValueError(f"--fleet {ray_address!r}: ports {first}-{last} are the Ray node's own")
    try:  # (the head's and this host's addresses: the filter admits addresses, not names)
        implicit = check_peers([*(() if peers else (host,)), ahost])
    except ValueError:
        raise ValueError(f"--fleet {ray_address!r} and --advertise {advertise!r}: addresses, not names") from None
    nets = tuple(dict.fromkeys(check_peers(peers) + implicit))
    return FleetConfig(
        ray_address,
        advertise,
        node or ahost.strip("[]"),
        slots,
        memory_mib,
        state_dir / "fleet",
        head=head,
        tls=tls,
        run_root=run_root,
        token_file=token_file,
        peers=nets,
        ray_user=ray_user,
        ray_python=ray_python or sys.executable,
    )
