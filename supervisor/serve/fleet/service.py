"""``sandvisor.v1.FleetService`` on a member's gRPC edge: the placement verbs, remote.

A client (``supervisor.client.fleet.Fleet``) reserves through any member, then talks to
the owning node's own SandboxService/SandvisorService at the address it got: no
sandbox traffic goes through the member it asked.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from actors.face import InvalidArgument, Principal, defaults
from supervisor.serve import access, grpc_bridge
from supervisor.serve.fleet.member import FleetMember
from supervisor.serve.fleet.placement import NodeView, Placed, Want
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as pb

SERVICE = "sandvisor.v1.FleetService"
MAX_WAIT = 3600.0


def placed_pb(p: Placed) -> pb.FleetSandbox:
    return pb.FleetSandbox(
        name=p.name,
        node=p.node,
        address=p.address,
        state=p.state,
        memory_mib=p.memory_mib,
        created_at=p.created_at,
        lost_at=p.lost_at,
    )


def node_pb(n: NodeView) -> pb.FleetNode:
    return pb.FleetNode(
        name=n.name,
        address=n.address,
        alive=n.alive,
        slots=n.slots,
        slots_used=n.slots_used,
        memory_mib=n.memory_mib,
        memory_used_mib=n.memory_used_mib,
        snapshots=list(n.snapshots),
    )


def want(req: pb.FleetReserveRequest) -> Want:
    timeout = req.timeout_seconds or defaults.FLEET_WAIT
    if not 0 < timeout <= MAX_WAIT:
        raise InvalidArgument(f"timeout_seconds {req.timeout_seconds}: 0 < t <= {MAX_WAIT:.0f}")
    return Want(
        req.name,
        int(req.memory_mib or defaults.FLEET_GUEST_MEMORY_MIB),
        node=req.node,
        prefer_snapshot=req.prefer_snapshot,
        timeout=timeout,
    )


def methods(member: FleetMember, who: Callable[[Any], Principal]) -> list[grpc_bridge.Method]:
    """The service's methods, each for admins only (``who``: a call's principal): members
    call each other with admin certificates, and placement records are the fleet's, not
    any one principal's (a Release frees anyone's name)."""
    placement = member.placement

    async def reserve(msg: pb.FleetReserveRequest, call: Any) -> pb.FleetSandbox:
        return placed_pb(await member.reserve(want(msg)))

    async def resolve(msg: pb.FleetNameRequest, call: Any) -> pb.FleetSandbox:
        return placed_pb(await placement.resolve(msg.name))

    async def release(msg: pb.FleetNameRequest, call: Any) -> sandbox_pb2.Empty:
        await placement.release(msg.name)
        return sandbox_pb2.Empty()

    async def sandboxes(msg: pb.FleetListRequest, call: Any) -> pb.FleetSandboxes:
        return pb.FleetSandboxes(sandboxes=[placed_pb(p) for p in await placement.placed()])

    async def nodes(msg: pb.FleetListRequest, call: Any) -> pb.FleetNodes:
        return pb.FleetNodes(nodes=[node_pb(n) for n in await placement.nodes()])

    async def fetch(msg: pb.FleetFetchRequest, call: Any) -> pb.FleetFetchResponse:
        local, pulled = await member.fetch(msg.snapshot_id)
        if pulled is None:
            return pb.FleetFetchResponse(snapshot_id=local)
        return pb.FleetFetchResponse(
            snapshot_id=local, source=pulled.source, bytes=pulled.bytes, seconds=pulled.seconds
        )

    def admins_only(fn: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
        async def gated(msg: Any, call: Any) -> Any:
            access.admin_only(who(call), "the fleet service")
            return await fn(msg, call)

        return gated

    table: list[tuple[str, Any, type[Any], type[Any]]] = [
        ("Reserve", reserve, pb.FleetReserveRequest, pb.FleetSandbox),
        ("Resolve", resolve, pb.FleetNameRequest, pb.FleetSandbox),
        ("Release", release, pb.FleetNameRequest, sandbox_pb2.Empty),
        ("ListSandboxes", sandboxes, pb.FleetListRequest, pb.FleetSandboxes),
        ("ListNodes", nodes, pb.FleetListRequest, pb.FleetNodes),
        ("Fetch", fetch, pb.FleetFetchRequest, pb.FleetFetchResponse),
    ]
    return [
        grpc_bridge.Method(
            SERVICE,
            name,
            grpc_bridge.Kind.UNARY_UNARY,
            admins_only(fn),
            request_deserializer=req.FromString,
            response_serializer=resp.SerializeToString,
        )
        for name, fn, req, resp in table
    ]
