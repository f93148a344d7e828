"""Snapshots move between members: this node pulls another's export into its own import.

Node to node over the fleet's mTLS (this member's --grpc-cert/--grpc-key as its client
identity, --grpc-client-ca as the CA the other node's certificate must chain to):
``SandvisorService/ExportSnapshot`` there, streamed into :meth:`Registry.import_snapshot`
here, which checks the export's SHA-256 trailer before it records anything (a
truncated or altered stream leaves nothing). The import carries the label
``fleet.origin`` = the snapshot's fleet id (its id on the node that took it), so the
fleet finds it here too, and a later export from here keeps it.

The gRPC client is blocking (grpcio's), in a worker thread; chunks cross to Trio through
a small memory channel (back-pressure: the thread waits while the import writes).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import trio

# isort: split
import supervisor.wire.grpc_env  # noqa: F401  grpc's fork support off before grpc is imported

# isort: split
import grpc

from actors.face import Registry, SnapshotRecord, Unavailable
from supervisor.serve.fleet.placement import Source
from supervisor.wire.errors import collapse_single
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as pb
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as pb_grpc

ORIGIN = "fleet.origin"  # a snapshot's label: its fleet id, where it was imported
PULL_TIMEOUT = 3600.0


@attrs.frozen
class NodeTls:
    """This member's identity towards the others: the fleet's CA, its certificate and key."""

    ca: Path
    cert: Path
    key: Path

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes(),
            certificate_chain=self.cert.read_bytes(),
        )


def fleet_id(rec: SnapshotRecord) -> str:
    return rec.labels.get(ORIGIN) or rec.id


@attrs.define
class Pulled:
    record: SnapshotRecord
    source: str  # the node it came from
    bytes: int
    seconds: float


async def pull(registry: Registry, source: Source, snapshot_id: str, tls: NodeTls | None) -> Pulled:
    """``snapshot_id`` (a fleet id) from ``source`` into this node's store."""
    send, receive = trio.open_memory_channel[bytes](4)
    token = trio.lowlevel.current_trio_token()
    calls: list[Any] = []  # (the stream call, to cancel it from here)
    counted = [0]
    started = time.monotonic()

    def export() -> None:
        creds = tls.credentials() if tls is not None else None
        channel = (
            grpc.secure_channel(source.address, creds) if creds is not None else grpc.insecure_channel(source.address)
        )
        with channel:
            stub = pb_grpc.SandvisorServiceStub(channel)  # type: ignore[no-untyped-call]
            call = stub.ExportSnapshot(pb.ExportSnapshotRequest(snapshot_id=source.snapshot_id), timeout=PULL_TIMEOUT)
            calls.append(call)
            try:
                for chunk in call:
                    if chunk.data:
                        counted[0] += len(chunk.data)
                        trio.from_thread.run(send.send, chunk.data, trio_token=token)
                    if chunk.done:
                        break
            finally:
                trio.from_thread.run_sync(send.close, trio_token=token)

    async def chunks() -> AsyncIterator[bytes]:
        async for data in receive:
            yield data

    async def run_export() -> None:
        try:
            await trio.to_thread.run_sync(export)
        except trio.BrokenResourceError:
            return  # the import stopped reading: its own error is the one that counts
        except grpc.RpcError as exc:
            if calls and calls[0].cancelled():
                return  # cancelled from here (below)
            code, details = exc.code(), exc.details()
            raise Unavailable(f"snapshot {snapshot_id} from node {source.node}: {code.name}: {details}") from None

    async def cancel_when_done() -> None:
        try:
            await trio.sleep_forever()
        finally:
            for call in calls:  # a stream still running: the thread's iteration ends
                call.cancel()

    result: list[SnapshotRecord] = []
    with collapse_single():  # the import's error, or the export's, as itself
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_when_done)
            nursery.start_soon(run_export)
            with receive:
                result.append(await registry.import_snapshot(chunks(), labels={ORIGIN: snapshot_id}))
            nursery.cancel_scope.cancel()
    return Pulled(result[0], source.node, counted[0], time.monotonic() - started)
