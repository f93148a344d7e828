"""Disk-only snapshots and snapshot export/import on fake VMs (tests/support/fakevm.py), through
both edges: sandvisor.v1 over gRPC (server-streaming ExportSnapshot, client-streaming
ImportSnapshot, their status codes) and the msgpack socket (the SDK). The real-VM
counterpart is test_snapshot_transfer.py."""

from __future__ import annotations

import json
import shlex
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import trio

from actors.model import SandboxConfig, State
from actors.snapshots import archive
from supervisor.client import AsyncSandbox
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as pb
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
from tests.support.grpcstack import stack, status_of

SC = grpc.StatusCode


def import_requests(data: bytes, name: str = "", first_open: bool = True) -> Iterator[sv.ImportSnapshotRequest]:
    if first_open:
        yield sv.ImportSnapshotRequest(open=sv.ImportSnapshotOpen(name=name))
    for i in range(0, len(data), 1 << 20):
        yield sv.ImportSnapshotRequest(chunk=pb.FileChunk(data=data[i : i + (1 << 20)]))
    yield sv.ImportSnapshotRequest(chunk=pb.FileChunk(done=True))


async def test_disk_only_snapshots_and_transfer_over_both_edges(tmp_path: Path, short_dir: Path) -> None:
    with trio.fail_after(120):
        async with stack(tmp_path, short_dir) as st:
            reg = st.reg
            stub = sv_grpc.SandvisorServiceStub(st.channel)
            sock = str(st.msgpack)
            sb = await reg.create("o", SandboxConfig())
            await sb.ready_event.wait()
            live, _ = await reg.checkpoint("o", name="live")

            # --- gRPC: export (server stream), import (client stream) under a new name ---
            def export(ref: str) -> bytes:
                return b"".join(c.data for c in stub.ExportSnapshot(sv.ExportSnapshotRequest(snapshot_id=ref)))

            data = await trio.to_thread.run_sync(export, "live")
            got = await trio.to_thread.run_sync(lambda: stub.ImportSnapshot(import_requests(data, "moved")))
            assert (got.base.name, got.memory, got.disk_only) == ("moved", live.memory.value, False)
            assert got.base.id != live.id
            clone = await reg.restore("moved", id="clone")
            assert clone.state == State.READY and clone.record.chain[0] == str(reg.snapshots.get("moved").disk)

            # --- a stopped sandbox: disk-only (msgpack SDK), listed so on gRPC, restores boot ---
            o = await AsyncSandbox.get("o", socket=sock)
            await o.stop()
            ck = await o.checkpoint("cold")
            assert (ck.memory, ck.disk_only) == ("disk", True)
            listed = await trio.to_thread.run_sync(lambda: stub.ListSnapshots(pb.ListSnapshotsRequest()))
            assert {s.base.name: s.disk_only for s in listed.snapshots} == {"live": False, "moved": False, "cold": True}
            booted = await reg.restore("cold", id="booted")
            assert booted.state == State.READY and booted.record.chain[0] == str(reg.snapshots.get("cold").disk)
            assert reg.snapshots.get("cold").path.joinpath("disk.qcow2").exists()
            await o.start()  # the origin boots again, on a new overlay over the frozen disk
            assert sb.record.chain[0] == str(reg.snapshots.get("cold").disk)

            # --- the SDK over the socket: export the disk-only one, import it ---
            f = tmp_path / "cold.svsnap"
            await AsyncSandbox.export_snapshot("cold", f, socket=sock)
            cold2 = await AsyncSandbox.import_snapshot(f, name="cold-2", socket=sock)
            assert (cold2.memory, cold2.disk_only) == ("disk", True)

            # --- the CLI through a pipe (export ID - | import -): how a file moves between hosts ---
            cli = shlex.join([sys.executable, "-m", "supervisor.main.cli"])
            out, into = f"{cli} snapshot export live - --socket {sock}", f"{cli} snapshot import - --name piped"
            p = await trio.run_process(
                ["bash", "-c", f"set -o pipefail; {out} | {into} --socket {sock}"],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert p.returncode == 0, p.stderr
            q = await trio.run_process(
                [*shlex.split(cli), "snapshot", "inspect", "cold", "--socket", sock], capture_stdout=True
            )
            assert json.loads(q.stdout)["disk_only"] is True
            piped = reg.snapshots.get("piped")
            assert p.stdout.decode().strip() == piped.id and piped.memory == live.memory

            # --- the codes a gRPC client sees; nothing is kept by a refused import ---
            dirs = {p.name for p in reg.snapshots.root.iterdir()}
            future = archive.MAGIC + struct.pack(">I", 9) + data[archive.HEAD :]
            flipped = bytearray(data)
            flipped[len(data) // 2] ^= 4
            cases = [
                (SC.NOT_FOUND, lambda: list(stub.ExportSnapshot(sv.ExportSnapshotRequest(snapshot_id="nope")))),
                (SC.INVALID_ARGUMENT, lambda: stub.ImportSnapshot(import_requests(data, first_open=False))),
                (SC.INVALID_ARGUMENT, lambda: stub.ImportSnapshot(import_requests(b"garbage" * 99, "g"))),
                (SC.INVALID_ARGUMENT, lambda: stub.ImportSnapshot(import_requests(data[:-40], "t"))),
                (SC.INVALID_ARGUMENT, lambda: stub.ImportSnapshot(import_requests(bytes(flipped), "f"))),
                (SC.FAILED_PRECONDITION, lambda: stub.ImportSnapshot(import_requests(future, "v"))),
                (SC.ALREADY_EXISTS, lambda: stub.ImportSnapshot(import_requests(data, "moved"))),
            ]
            for want, call in cases:
                code, why = await status_of(call)
                assert code == want, (want, code, why)
            assert {p.name for p in reg.snapshots.root.iterdir()} == dirs
            await reg.remove("clone", force=True)
            await reg.remove("booted", force=True)
