"""The placement interface of a fleet, and what it records.

Four verbs (docs/fleet.md), one backend today (:mod:`supervisor.serve.fleet.ray_backend`)::

    reserve(want)   a slot on a node with room, by the backend's scheduler -> Placed
    resolve(name)   where a sandbox of the fleet lives                       -> Placed
    release(name)   its slot back (its sandbox was removed, or never made)
    node_lost(node) every sandbox of a dead node marked lost, slots back     -> [Placed]

plus what the edges show (``placed()``, ``nodes()``), how a member joins (``join``),
reports the snapshots it caches (``cached``: fleet id -> its local id; ``sources``
finds them) and learns of dead nodes (``dead``). A
Kubernetes backend (agent-sandbox's CRDs) would implement the same protocol.
"""

from __future__ import annotations

from typing import Protocol

import attrs

PLACED, LOST = "placed", "lost"


@attrs.frozen
class NodeSpec:
    """A member as it joins: its name, its advertised gRPC address, its capacity."""

    name: str
    address: str
    slots: int
    memory_mib: int


@attrs.frozen
class Want:
    """What a fleet Create asks for."""

    name: str
    memory_mib: int
    node: str = ""  # only this node
    prefer_snapshot: str = ""  # rather where this snapshot is cached
    timeout: float = 60.0


@attrs.frozen
class Placed:
    """A sandbox of the fleet: its node, and whether that node lives."""

    name: str
    node: str
    address: str
    memory_mib: int
    created_at: float
    state: str = PLACED
    lost_at: float = 0.0


@attrs.frozen
class NodeView:
    name: str
    address: str
    alive: bool
    slots: int
    slots_used: int
    memory_mib: int
    memory_used_mib: int
    snapshots: tuple[str, ...] = ()


@attrs.frozen
class Source:
    """A live member that caches a snapshot of the fleet, and its id there."""

    node: str
    address: str
    snapshot_id: str


class Placement(Protocol):
    async def join(self, node: NodeSpec) -> None: ...

    async def reserve(self, want: Want) -> Placed: ...

    async def resolve(self, name: str) -> Placed: ...

    async def release(self, name: str) -> None: ...

    async def node_lost(self, node: str) -> list[Placed]: ...

    async def placed(self) -> list[Placed]: ...

    async def nodes(self) -> list[NodeView]: ...

    async def cached(self, node: str, snapshots: dict[str, str]) -> None: ...

    async def sources(self, snapshot_id: str) -> list[Source]: ...

    async def dead(self) -> list[str]: ...
