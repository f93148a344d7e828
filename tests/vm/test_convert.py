"""Streamed snapshots become mapped: a checkpoint of a default Create (a
restore of its boot template, RAM mapped privately) streams its RAM; the snapshot
store's converter turns it into a mapped snapshot in a jailed helper QEMU, and the
restores that race it still work. Real VMs, in-process supervisors (the tests reach
the registry to order the converter against restores)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.recovery import our_qemus
from actors.registry import Registry
from actors.store import SnapshotRecord
from images.build import Image
from supervisor.client import AsyncSandbox
from supervisor.main.throwaway import Workdir, supervisor, workdir
from tests.support.client import COUNTER

CLONES = 4  # (the benchmark runs 16: benchmarks/snapshots.py)


@pytest.fixture
def work(image: Image) -> Iterator[Workdir]:
    with workdir("svc-", private_state=True) as w:
        yield w


async def sh(sb: AsyncSandbox, script: str) -> str:
    r = await sb.run(["sh", "-c", script])
    assert r.exit_code == 0, r
    return r.stdout.decode()


async def system_log(sb: AsyncSandbox) -> bytes:
    return b"".join(e.data for e in await sb.logs() if e.source == "system")


async def default_created(sock: str) -> tuple[AsyncSandbox, AsyncSandbox]:
    """The boot template's maker, and a default Create that restores the template
    (its RAM: the template's memory, mapped privately), with a file and a process."""
    maker = await AsyncSandbox.create("maker", socket=sock)
    origin = await AsyncSandbox.create("origin", socket=sock)
    assert b"restored from the boot template (memory mapped)" in await system_log(origin)
    await origin.fs.write("/root/marker", b"before the checkpoint")
    await sh(origin, f"({COUNTER}) >/dev/null 2>&1 &")
    await trio.sleep(0.3)
    return maker, origin


def leftovers(work: Workdir, rec: SnapshotRecord) -> dict[str, Any]:
    """What a conversion may leave, if it does not clean up."""
    return {
        "part files": sorted(p.name for p in rec.path.iterdir() if p.name.endswith(".part")),
        "helper run dirs": sorted(d.name for d in work.run_root.glob("cv-*")),  # (gone with serve when empty)
    }


async def until_mapped(registry: Registry, rec: SnapshotRecord, timeout: float = 120) -> None:
    with trio.fail_after(timeout):
        while rec.memory != "mapped" or registry.snapshots.converting is not None:
            await trio.sleep(0.05)


async def test_a_default_create_checkpoints_streamed_and_restores_mapped(work: Workdir) -> None:
    with trio.fail_after(600):
        async with supervisor(work) as (cfg, registry):
            sock = str(cfg.socket)
            maker, origin = await default_created(sock)
            # the converter waits while we hold its lock: the first restore comes first
            async with registry.snapshots.convert_lock:
                snap = await origin.checkpoint("default")
                assert snap.memory == "streamed"
                rec = registry.snapshots.get(snap.snapshot_id)
                early = await AsyncSandbox.restore(snap.snapshot_id, name="early", socket=sock)
                assert registry.get("early").timings["mapped"] == 0.0
                assert b"(memory streamed)" in await system_log(early)
                assert await early.fs.read("/root/marker") == b"before the checkpoint"
            # restores race the conversion (and its switch of the record): each one works,
            # streamed or mapped, whichever record it read
            kinds = []
            n = 0
            while rec.memory != "mapped" or registry.snapshots.converting is not None:
                sb = await AsyncSandbox.restore(snap.snapshot_id, name=f"race{n}", socket=sock)
                kinds.append(registry.get(f"race{n}").timings["mapped"])
                assert await sb.fs.read("/root/marker") == b"before the checkpoint"
                await sb.remove()
                n += 1
            await until_mapped(registry, rec)
            [listed] = [s for s in await AsyncSandbox.snapshots(socket=sock) if s.id == snap.snapshot_id]
            assert listed.memory == "mapped"
            with trio.fail_after(30):  # the old stream goes once the new record is on disk
                while (rec.path / "vmstate").exists():
                    await trio.sleep(0.05)
            assert rec.vmstate == "vmstate-mapped" and (rec.path / "memory").is_file()
            assert leftovers(work, rec) == {"part files": [], "helper run dirs": []}
            assert not any(d.name.startswith("cv-") for d in work.run_root.iterdir())
            # the streamed restore taken before the switch runs on
            assert int(await sh(early, "cat /run/cnt")) > 0
            # 16 clones, all restored mapped, all alive at once, each its own
            clones = []
            for i in range(CLONES):
                clones.append(await AsyncSandbox.restore(snap.snapshot_id, name=f"clone{i}", socket=sock))
                assert registry.get(f"clone{i}").timings["mapped"] == 1.0
            for i, sb in enumerate(clones):
                assert await sb.fs.read("/root/marker") == b"before the checkpoint"
                await sb.fs.write("/root/mine", str(i).encode())
                first = int(await sh(sb, "cat /run/cnt"))  # the counter came back from memory
                assert first > 0
            for i, sb in enumerate(clones):
                assert await sb.fs.read("/root/mine") == str(i).encode()
                assert b"(memory mapped)" in await system_log(sb)
            assert "no" in await sh(origin, "test -e /root/mine && echo yes || echo no")
            for sb in [*clones, early, origin, maker]:
                await sb.remove()
            await AsyncSandbox.delete_snapshot(snap.snapshot_id, socket=sock)
            assert not rec.path.exists()
        print(f"restores during the conversion: {len(kinds)}, mapped: {sum(kinds):.0f}")


async def held_mid_way(work: Workdir, registry: Registry, rec: SnapshotRecord) -> None:
    """Until ``rec``'s conversion waits at the store's hold (the caller holds it): its
    helper QEMU is up, paused, and both of its files are written, the record not switched."""
    with trio.fail_after(120):
        while (
            registry.snapshots.converting is not rec or not registry.snapshots.convert_hold.statistics().tasks_waiting
        ):
            await trio.sleep(0.01)
    assert leftovers(work, rec) == {
        "part files": ["memory.part", "vmstate-mapped.part"],
        "helper run dirs": [f"cv-{rec.uid}"],
    }
    assert rec.memory == "streamed"


async def test_a_conversion_cut_short_leaves_nothing(work: Workdir) -> None:
    """A snapshot deleted while its conversion runs, and a supervisor that exits during
    one: the helper QEMU is reaped, its cell, run dir and files go; the snapshot that
    stayed converts at the next start. Each conversion is held at its last step (the
    store's hold), so the delete and the exit cut it there, however fast it ran."""
    with trio.fail_after(600):
        async with supervisor(work) as (cfg, registry):
            sock = str(cfg.socket)
            _maker, origin = await default_created(sock)
            ours = {registry.get(i).record.qemu_pid for i in ("maker", "origin")}
            hold = registry.snapshots.convert_hold
            await hold.acquire()  # (released after this supervisor exited)
            async with registry.snapshots.convert_lock:  # (no disk may stand on it: deletable)
                other = await AsyncSandbox.create("other", socket=sock)
                doomed = await other.checkpoint("doomed")
                await other.remove()
            rec = registry.snapshots.get(doomed.snapshot_id)
            await held_mid_way(work, registry, rec)
            assert len(our_qemus(work.run_root) - ours) == 1  # (its helper)
            await AsyncSandbox.delete_snapshot(doomed.snapshot_id, socket=sock)
            assert not rec.path.exists()
            assert our_qemus(work.run_root) == ours
            assert not any(d.name.startswith("cv-") for d in work.run_root.iterdir())
            # this one's conversion is under way when the supervisor exits
            kept = await origin.checkpoint("kept")
            rec = registry.snapshots.get(kept.snapshot_id)
            await held_mid_way(work, registry, rec)
        hold.release()
        assert rec.memory == "streamed"
        assert leftovers(work, rec) == {"part files": [], "helper run dirs": []}
        assert not our_qemus(work.run_root)
        assert sorted(os.listdir(rec.path)) == ["disk.qcow2", "initrd", "kernel", "vmstate"]
        async with supervisor(work) as (cfg, registry):
            rec = registry.snapshots.get(kept.snapshot_id)
            await until_mapped(registry, rec)
            sb = await AsyncSandbox.restore(kept.snapshot_id, name="after", socket=str(cfg.socket))
            assert registry.get("after").timings["mapped"] == 1.0
            assert await sb.fs.read("/root/marker") == b"before the checkpoint"
            await sb.remove()
        assert sorted(os.listdir(Path(rec.dir))) == ["disk.qcow2", "initrd", "kernel", "memory", "vmstate-mapped"]
