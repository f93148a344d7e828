"""Snapshot export and import between two supervisors (two state dirs, one image cache)
against real VMs, through the SDK, the CLI and sandvisor.v1 over gRPC; corrupt exports
refused with their codes and nothing left behind.

One boot for the file: ``origin`` on supervisor A (its first Create saves a boot
template, so the snapshot's disk chain has a template layer the export must carry),
checkpointed once; everything else restores."""

from __future__ import annotations

import os
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio

from actors.registry import Registry
from actors.snapshots import archive
from images.build import Image
from supervisor.client import AlreadyExists, AsyncSandbox, FailedPrecondition, InvalidArgument
from supervisor.main.throwaway import Workdir, supervisor, workdir
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as spb
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
from tests.support.client import COUNTER

MiB = 1 << 20


@pytest.fixture
def works(image: Image) -> Iterator[tuple[Workdir, Workdir]]:
    with workdir("sv-xa-") as a, workdir("sv-xb-") as b:
        yield a, b


@asynccontextmanager
async def two(works: tuple[Workdir, Workdir]) -> AsyncIterator[tuple[Registry, Registry, Path]]:
    a, b = works
    grpc_b = b.root / "g.sock"
    async with supervisor(a) as (_, ra), supervisor(b, grpc=(f"unix://{grpc_b}",)) as (_, rb):
        yield ra, rb, grpc_b


def snapshot_dirs(work: Workdir) -> set[str]:
    d = work.state / "snapshots"
    return {p.name for p in d.iterdir()} if d.exists() else set()


async def sh(sb: AsyncSandbox, script: str) -> str:
    r = await sb.run(["sh", "-c", script])
    assert r.exit_code == 0, r
    return r.stdout.decode()


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def test_export_import_restore_on_another_supervisor(works: tuple[Workdir, Workdir], tmp_path: Path) -> None:
    wa, wb = works
    with trio.fail_after(900):
        async with two(works) as (ra, rb, grpc_b):
            sa, sb_ = str(wa.socket), str(wb.socket)
            origin = await AsyncSandbox.create("origin", socket=sa)
            await origin.fs.write("/root/state", b"written on supervisor A")
            await origin.run(["sh", "-c", f"({COUNTER}) >/dev/null 2>&1 &"])
            await trio.sleep(0.5)
            snap = (await origin.checkpoint("moving", labels={"k": "v"})).snapshot_id
            at_checkpoint = int(await sh(origin, "cat /run/cnt"))
            rec = ra.snapshots.get(snap)
            assert len(rec.chain) == 2  # the boot template's disk, the image's rootfs

            # --- export (SDK) ---
            f = tmp_path / "moving.svsnap"
            t0 = time.monotonic()
            size = await AsyncSandbox.export_snapshot(snap, f, socket=sa)
            t_export = time.monotonic() - t0
            assert size == f.stat().st_size
            assert [p.name for p in tmp_path.iterdir()] == ["moving.svsnap"]  # no temporary left

            # --- import (SDK) on B, restore there: disk and memory came along ---
            before = snapshot_dirs(wb)
            t0 = time.monotonic()
            imported = await AsyncSandbox.import_snapshot(f, socket=sb_)
            t_import = time.monotonic() - t0
            assert imported.id != snap and imported.name == "moving" and imported.labels == {"k": "v"}
            assert imported.memory == rec.memory.value
            assert len(snapshot_dirs(wb) - before) == 1
            async with await AsyncSandbox.restore(imported.id, name="there", socket=sb_) as there:
                assert await there.fs.read("/root/state") == b"written on supervisor A"
                first = int(await sh(there, "cat /run/cnt"))
                assert at_checkpoint - 40 < first, (at_checkpoint, first)  # the process came along
            mib = size / MiB
            print(
                f"\nexport {mib:.0f} MiB ({rec.memory}, 256 MiB guest): {t_export:.2f} s = {mib / t_export:.0f} MiB/s; "
                f"import {t_import:.2f} s = {mib / t_import:.0f} MiB/s",
                file=sys.stderr,
            )

            # --- names: a second import of the same export collides; another name works ---
            with pytest.raises(AlreadyExists):
                await AsyncSandbox.import_snapshot(f, socket=sb_)
            assert len(snapshot_dirs(wb) - before) == 1

            # --- sandvisor.v1 over gRPC: the same import, streamed, under another name ---
            def grpc_import() -> Any:
                with grpc.insecure_channel(f"unix:{grpc_b}") as ch, open(f, "rb") as src:
                    stub = sv_grpc.SandvisorServiceStub(ch)

                    def requests() -> Iterator[sv.ImportSnapshotRequest]:
                        yield sv.ImportSnapshotRequest(open=sv.ImportSnapshotOpen(name="via-grpc"))
                        while piece := src.read(MiB):
                            yield sv.ImportSnapshotRequest(chunk=spb.FileChunk(data=piece))
                        yield sv.ImportSnapshotRequest(chunk=spb.FileChunk(done=True))

                    summary = stub.ImportSnapshot(requests(), timeout=300)
                    exported = b"".join(
                        c.data for c in stub.ExportSnapshot(sv.ExportSnapshotRequest(snapshot_id="via-grpc"))
                    )
                    return summary, exported

            summary, exported = await in_thread(grpc_import)
            assert (summary.base.name, summary.memory) == ("via-grpc", imported.memory)
            assert exported[: len(archive.MAGIC)] == archive.MAGIC and len(exported) > 50 * MiB

            # --- the CLI: export from A, import into B under a name ---
            cli = [sys.executable, "-m", "supervisor.main.cli"]
            g = tmp_path / "cli.svsnap"
            await trio.run_process([*cli, "snapshot", "export", snap, str(g), "--socket", sa])
            p = await trio.run_process(
                [*cli, "snapshot", "import", str(g), "--name", "cli-copy", "--socket", sb_], capture_stdout=True
            )
            cli_id = p.stdout.decode().strip()
            assert [s.name for s in await AsyncSandbox.snapshots(socket=sb_) if s.id == cli_id] == ["cli-copy"]

            # --- corrupt exports: refused with their codes, nothing left behind ---
            recorded = snapshot_dirs(wb)
            data = f.read_bytes()
            flipped = bytearray(data)
            flipped[len(data) // 2] ^= 0x40
            truncated = data[: len(data) * 2 // 3]
            future = archive.MAGIC + struct.pack(">I", archive.VERSION + 1) + data[archive.HEAD :]
            cases: list[tuple[str, bytes, type[Exception], str]] = [
                ("flipped", bytes(flipped), InvalidArgument, "SHA-256"),
                ("truncated", truncated, InvalidArgument, "truncated"),
                ("future", future, FailedPrecondition, "version"),
                ("not-an-export", b"hello world, not a snapshot" * 100, InvalidArgument, "magic"),
            ]
            for what, content, exc, words in cases:
                bad = tmp_path / f"{what}.svsnap"
                bad.write_bytes(content)
                with pytest.raises(exc, match=words):
                    await AsyncSandbox.import_snapshot(bad, name=f"bad-{what}", socket=sb_)
                assert snapshot_dirs(wb) == recorded, what
                assert all(not s.name.startswith("bad-") for s in await AsyncSandbox.snapshots(socket=sb_))
            # a base image B does not have: named, refused before anything is kept
            assert rb.snapshots.get("cli-copy")

            # B still serves: the origin's clone is restorable from every copy
            async with await AsyncSandbox.restore("via-grpc", socket=sb_) as again:
                assert await again.fs.read("/root/state") == b"written on supervisor A"

            # --- a stopped sandbox: a disk-only snapshot, exported; its restore boots ---
            await origin.fs.write("/root/state", b"written before the stop")
            await origin.stop()
            ck = await origin.checkpoint("cold")
            assert (ck.memory, ck.disk_only, ck.paused_ms) == ("disk", True, 0)
            [s] = [s for s in await AsyncSandbox.snapshots(socket=sa) if s.id == ck.snapshot_id]
            assert (s.memory, s.disk_only) == ("disk", True)
            h = tmp_path / "cold.svsnap"
            await AsyncSandbox.export_snapshot(ck.snapshot_id, h, socket=sa)
            assert h.stat().st_size < 64 * MiB  # the disk alone: no memory, kernel or initrd
            cold = await AsyncSandbox.import_snapshot(h, socket=sb_)
            assert (cold.memory, cold.disk_only, cold.name) == ("disk", True, "cold")
            async with await AsyncSandbox.restore(cold.id, name="booted", socket=sb_) as booted:
                assert await booted.fs.read("/root/state") == b"written before the stop"
                assert (await sh(booted, "test -e /run/cnt && echo yes || echo no")).strip() == "no"  # booted
            # the origin goes on, on a new overlay over the frozen disk
            await origin.start(wait=True)
            assert await origin.fs.read("/root/state") == b"written before the stop"
            await origin.remove()
        assert not os.listdir(wb.state / "sandboxes")
