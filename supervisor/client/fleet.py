"""The fleet's client: ``Fleet(address, tls=...)`` (blocking; gRPC with mTLS).

``address`` is any member's advertised gRPC address (``HOST:PORT``). A Create reserves
a slot there (FleetService/Reserve: Ray's scheduler chooses the node), then creates on
the node it got, at that node's own address; a sandbox found by name
(FleetService/Resolve) is used the same way: the member asked never carries its
traffic. The client needs neither Ray nor a place in the cluster::

    fleet = Fleet("10.0.0.1:7443", tls=FleetTls.from_files("ca.pem", "me.pem", "me.key"))
    sb = fleet.create("job-1", memory_mib=512)
    print(sb.node, sb.run(["uname", "-a"]).stdout)
    snap = sb.checkpoint("warm")
    clone = fleet.restore(snap, "job-2")       # on the node that caches the snapshot if it has room
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

# isort: split
import supervisor.wire.grpc_env  # noqa: F401  grpc's fork support off before grpc is imported

# isort: split
import grpc

from supervisor.wire.errors import error_for
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as sb_pb
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2_grpc as sb_grpc
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as pb
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as pb_grpc

READY_POLL = 0.05  # a Create's readiness, read this often (Inspect)


@attrs.frozen
class FleetTls:
    """The CA that signs the fleet's certificates, and this client's certificate and key."""

    ca: bytes
    cert: bytes
    key: bytes = attrs.field(repr=False)

    @classmethod
    def from_files(cls, ca: Path | str, cert: Path | str, key: Path | str) -> FleetTls:
        return cls(Path(ca).read_bytes(), Path(cert).read_bytes(), Path(key).read_bytes())

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


@attrs.frozen
class RunResult:
    exit_code: int
    stdout: bytes
    stderr: bytes

    def text(self) -> str:
        return self.stdout.decode(errors="replace")


@attrs.frozen
class FleetNode:
    name: str
    address: str
    alive: bool
    slots: int
    slots_used: int
    memory_mib: int
    memory_used_mib: int
    snapshots: tuple[str, ...]


def _error(exc: grpc.RpcError) -> Exception:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for(code.name, details or code.name)


class _Node:
    """One node's stubs over one channel."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.sandbox: Any = sb_grpc.SandboxServiceStub(channel)  # type: ignore[no-untyped-call]
        self.snapshots: Any = sb_grpc.SandboxSnapshotServiceStub(channel)  # type: ignore[no-untyped-call]
        self.sandvisor: Any = pb_grpc.SandvisorServiceStub(channel)  # type: ignore[no-untyped-call]
        self.fleet: Any = pb_grpc.FleetServiceStub(channel)  # type: ignore[no-untyped-call]


class Fleet:
    def __init__(self, address: str, *, tls: FleetTls | None = None, timeout: float = 120.0) -> None:
        self.address = address
        self.tls = tls
        self.timeout = timeout  # each call's deadline (a Create's wait for room is its own)
        self._nodes: dict[str, _Node] = {}

    # -- connections -----------------------------------------------------------------
    def _node(self, address: str) -> _Node:
        node = self._nodes.get(address)
        if node is None:
            if self.tls is not None:
                channel = grpc.secure_channel(address, self.tls.credentials())
            else:  # loopback tests with --grpc-insecure
                channel = grpc.insecure_channel(address)
            node = self._nodes[address] = _Node(channel)
        return node

    def _call(self, fn: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return fn(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def close(self) -> None:
        for node in self._nodes.values():
            node.channel.close()
        self._nodes.clear()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the fleet ---------------------------------------------------------------------------
    def reserve(
        self, name: str, *, memory_mib: int = 0, node: str = "", prefer_snapshot: str = "", wait: float = 0
    ) -> pb.FleetSandbox:
        req = pb.FleetReserveRequest(
            name=name, memory_mib=memory_mib, node=node, prefer_snapshot=prefer_snapshot, timeout_seconds=wait
        )
        lease: pb.FleetSandbox = self._call(
            self._node(self.address).fleet.Reserve, req, timeout=(wait or 60) + self.timeout
        )
        return lease

    def release(self, name: str) -> None:
        self._call(self._node(self.address).fleet.Release, pb.FleetNameRequest(name=name))

    def create(
        self,
        name: str,
        *,
        memory_mib: int = 0,
        cpus: int = 0,
        node: str = "",
        prefer_snapshot: str = "",
        labels: dict[str, str] | None = None,
        wait: float = 0,
    ) -> FleetSandbox:
        """A sandbox on a node Ray's scheduler chose, ready when this returns."""
        lease = self.reserve(name, memory_mib=memory_mib, node=node, prefer_snapshot=prefer_snapshot, wait=wait)
        try:
            target = self._node(lease.address)
            base = sb_pb.CreateSandboxRequest(
                id=name, labels=labels or {}, limits=sb_pb.ResourceLimits(vcpus=cpus, memory_mib=lease.memory_mib)
            )
            self._call(target.sandvisor.Create, pb.CreateRequest(base=base))
            sb = FleetSandbox(self, lease)
            try:
                sb.wait_ready()
            except BaseException:
                with contextlib.suppress(Exception):  # (its node then gives the slot back too)
                    sb.remove()
                raise
            return sb
        except BaseException:
            try:
                self.release(name)
            finally:
                raise

    def restore(self, snapshot_id: str, name: str, *, node: str = "", wait: float = 0) -> FleetSandbox:
        """A sandbox from a snapshot, on a node that caches it if one has room."""
        lease = self.reserve(name, node=node, prefer_snapshot=snapshot_id, wait=wait)
        try:
            target = self._node(lease.address)
            fetched = self.fetch(lease.address, snapshot_id)
            self._call(target.snapshots.Restore, sb_pb.RestoreRequest(id=name, snapshot_id=fetched.snapshot_id))
            return FleetSandbox(self, lease)
        except BaseException:
            try:
                self.release(name)
            finally:
                raise

    def fetch(self, address: str, snapshot_id: str) -> pb.FleetFetchResponse:
        """The fleet's snapshot on the node at ``address`` (pulled there from a node that
        caches it, node to node, unless it is there): its id on that node."""
        req = pb.FleetFetchRequest(snapshot_id=snapshot_id)
        out: pb.FleetFetchResponse = self._call(self._node(address).fleet.Fetch, req, timeout=3600)
        return out

    def get(self, name: str) -> FleetSandbox:
        """The sandbox of this name, wherever it runs (NOT_FOUND: none)."""
        return FleetSandbox(self, self._call(self._node(self.address).fleet.Resolve, pb.FleetNameRequest(name=name)))

    def ls(self) -> list[pb.FleetSandbox]:
        return list(self._call(self._node(self.address).fleet.ListSandboxes, pb.FleetListRequest()).sandboxes)

    def nodes(self) -> list[FleetNode]:
        out = self._call(self._node(self.address).fleet.ListNodes, pb.FleetListRequest())
        return [
            FleetNode(
                n.name,
                n.address,
                n.alive,
                n.slots,
                n.slots_used,
                n.memory_mib,
                n.memory_used_mib,
                tuple(n.snapshots),
            )
            for n in out.nodes
        ]


class FleetSandbox:
    """A sandbox of the fleet, used at its own node's address."""

    def __init__(self, fleet: Fleet, record: pb.FleetSandbox) -> None:
        self.fleet = fleet
        self.record = record

    @property
    def name(self) -> str:
        return str(self.record.name)

    @property
    def node(self) -> str:
        return str(self.record.node)

    @property
    def address(self) -> str:
        return str(self.record.address)

    @property
    def state(self) -> str:
        return str(self.record.state)

    def _target(self) -> _Node:
        if self.state == "lost":
            raise error_for(
                "FAILED_PRECONDITION",
                f"sandbox {self.name} was on node {self.node}, which is lost: restore its last checkpoint "
                "elsewhere (Fleet.restore), then remove it (its record goes)",
            )
        return self.fleet._node(self.address)

    def inspect(self) -> sb_pb.SandboxInfo:
        info: sb_pb.SandboxInfo = self.fleet._call(
            self._target().sandbox.Inspect, sb_pb.InspectSandboxRequest(id=self.name)
        )
        return info

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            info = self.inspect()
            if info.state == "ready":
                return
            if info.state in ("failed", "crashed", "stopped") or time.monotonic() > deadline:
                raise error_for("FAILED_PRECONDITION", f"sandbox {self.name} is {info.state}: {info.error}")
            time.sleep(READY_POLL)  # (polls a remote state: sandbox.v1's events would race the Create)

    def run(self, cmd: list[str], *, timeout: float | None = None) -> RunResult:
        out, err, code = bytearray(), bytearray(), -1
        try:
            stream: Iterator[sb_pb.RunOutput] = self._target().sandbox.Run(
                sb_pb.RunRequest(id=self.name, cmd=cmd), timeout=timeout or self.fleet.timeout
            )
            for item in stream:
                (err if item.stream == "stderr" else out).extend(item.data)
                if item.done:
                    code = item.exit_code
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return RunResult(code, bytes(out), bytes(err))

    def checkpoint(self, name: str = "") -> str:
        req = sb_pb.CheckpointRequest(sandbox_id=self.name, name=name)
        return str(self.fleet._call(self._target().snapshots.Checkpoint, req).snapshot_id)

    def remove(self) -> None:
        """Removed on its node; the node gives the slot back."""
        self.fleet._call(self._target().sandbox.Remove, sb_pb.RemoveSandboxRequest(id=self.name, force=True))
