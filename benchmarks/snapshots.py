"""Checkpoint and restore: restore-to-ready against cold boot-to-ready, warm-pool
acquire, checkpoint time and pause, snapshot size on disk. One run, medians of n.

* cold: Create to the ready event (timings on the supervisor's clock);
* restore: Restore RPC round trip from the client (returns once ready), mapped
  snapshot (RAM file mapped copy-on-write) and streamed snapshot (RAM in vmstate);
* pool: Restore RPC round trip when a warm pool member is ready (pool size 1);
* checkpoint: Checkpoint RPC round trip and the guest's pause inside it.

Usage: python benchmarks/snapshots.py [-n N] [--out results/]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import trio
from _harness import in_process_daemon, main, summary, write_results
from rich.progress import Progress

from supervisor.client import connect

RESTORE_PHASES = [
    ("accepted", "spawned", "overlay + QEMU spawn"),
    ("spawned", "qmp_ready", "QMP ready"),
    ("qmp_ready", "loaded", "state load"),
    ("loaded", "hello", "hello (channel connected before the load)"),
    ("hello", "ready_event", "fixups to ready"),
]


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


async def wait_ready(registry: Any, name: str) -> None:
    with trio.fail_after(120):
        # (ready is set, then stored, then the ready_event mark taken: wait for the mark)
        while registry.get(name).state != "failed" and "ready_event" not in registry.get(name).timings:
            await trio.sleep(0.01)
        # READY is set, then flushed, then the life stamps "ready_event": wait for all of it
        await registry.get(name).ready_event.wait()
    if registry.get(name).state != "ready":
        raise RuntimeError(f"{name} failed: {registry.get(name).record.error}")


async def cold_runs(c: Any, registry: Any, n: int, progress: Any) -> list[float]:
    task = progress.add_task("cold creates", total=n)
    out = []
    for i in range(n):
        await c.call("Create", {"id": f"cold{i}"})
        await wait_ready(registry, f"cold{i}")
        t = registry.get(f"cold{i}").timings
        out.append(t["ready_event"] - t["accepted"])
        await c.call("Remove", {"id": f"cold{i}", "force": True})
        progress.advance(task)
    return out


async def restore_runs(
    c: Any, registry: Any, snap: str, n: int, progress: Any, label: str, *, pool: bool = False
) -> tuple[list[float], list[dict[str, float]]]:
    """Restore RPC round trips (ready on return); with ``pool``, each waits for a
    ready pool member first."""
    task = progress.add_task(label, total=n)
    lat, phases = [], []
    for i in range(n):
        if pool:
            with trio.fail_after(120):
                while registry.pool_ready(registry.snapshots.get(snap)) < 1:
                    await trio.sleep(0.01)
        name = f"{label.split(maxsplit=1)[0]}{i}"
        t0 = time.monotonic()
        await c.call("Restore", {"snapshot_id": snap, "id": name})
        lat.append(time.monotonic() - t0)
        t = registry.get(name).timings
        phases.append({lab: t[b] - t[a] for a, b, lab in RESTORE_PHASES if a in t and b in t})
        await c.call("Remove", {"id": name, "force": True})
        progress.advance(task)
    return lat, phases


async def checkpoint_runs(c: Any, origin: str, n: int, progress: Any) -> tuple[list[float], list[float], list[Any]]:
    task = progress.add_task(f"checkpoints of {origin}", total=n)
    lat, paused, snaps = [], [], []
    for _ in range(n):
        t0 = time.monotonic()
        r = await c.call("Checkpoint", {"sandbox_id": origin})
        lat.append(time.monotonic() - t0)
        paused.append(r["paused_ms"] / 1000)
        snaps.append(r)
        progress.advance(task)
    return lat, paused, snaps


def du(path: str) -> int:
    """Allocated bytes the snapshot adds (kernel and initrd are hard links to the image)."""
    return sum(p.stat().st_blocks * 512 for p in Path(path).iterdir() if p.is_file() and p.stat().st_nlink == 1)


async def snapshot_bench(n: int, progress: Any) -> dict[str, Any]:
    """The numbers of the snapshot issue (and the restore/pool rows of coldstart)."""
    res: dict[str, Any] = {"n": n}
    async with in_process_daemon("sv-snap-") as (cfg, registry), connect(cfg.socket) as c:
        registry.pools.templates = False  # cold means booted here: no boot templates
        cold = await cold_runs(c, registry, n, progress)
        res["cold_create_to_ready"] = summary(cold)
        await c.call("Create", {"id": "origin"})
        await wait_ready(registry, "origin")
        await trio.sleep(1)
        lat, paused, snaps = await checkpoint_runs(c, "origin", n, progress)
        res["checkpoint_mapped"] = {"rpc": summary(lat), "paused": summary(paused)}
        snap = snaps[0]
        res["snapshot_mapped_bytes"] = {
            "total": du(snap["snapshot_dir"]),
            **{p.name: p.stat().st_blocks * 512 for p in Path(snap["snapshot_dir"]).iterdir() if p.is_file()},
        }
        lat, phases = await restore_runs(c, registry, snap["snapshot_id"], n, progress, "mapped restores")
        res["restore_mapped"] = summary(lat)
        res["restore_mapped_phases_median_s"] = {
            label: med([p[label] for p in phases if label in p]) for _, _, label in RESTORE_PHASES
        }
        # streamed: checkpoint a restored sandbox (its RAM is a private map, so it streams)
        # (the converter would make them mapped within a second: it waits meanwhile)
        async with registry.snapshots.convert_lock:
            await c.call("Restore", {"snapshot_id": snap["snapshot_id"], "id": "gen1"})
            lat_s, paused_s, ssnaps = await checkpoint_runs(c, "gen1", max(3, n // 3), progress)
            res["checkpoint_streamed"] = {"rpc": summary(lat_s), "paused": summary(paused_s)}
            res["snapshot_streamed_bytes"] = {"total": du(ssnaps[0]["snapshot_dir"])}
            lat, _ = await restore_runs(c, registry, ssnaps[0]["snapshot_id"], n, progress, "streamed restores")
            res["restore_streamed"] = summary(lat)
        await c.call("Remove", {"id": "gen1", "force": True})
        # warm pool: pool size 1 for the mapped snapshot
        registry.pools.resize(snapshot=snap["snapshot_id"], size=1)
        lat, _ = await restore_runs(c, registry, snap["snapshot_id"], n, progress, "pool acquires", pool=True)
        res["pool_acquire"] = summary(lat)
        registry.pools.resize(snapshot=snap["snapshot_id"], size=0)
    res["restore_vs_cold_speedup"] = res["cold_create_to_ready"]["p50"] / res["restore_mapped"]["p50"]
    return res


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    with Progress() as progress:
        res = await snapshot_bench(n, progress)
    write_results(out_dir, "snapshots", res, markdown(res))
    return res


def markdown(res: dict[str, Any]) -> str:
    ms = 1000.0
    r = [
        f"## Checkpoint and restore (TCG, 256 MiB guest, n={res['n']})",
        "",
        "| measure | p50 | p90 | p99 |",
        "|---|---|---|---|",
    ]
    for label, key in (
        ("cold create to ready", "cold_create_to_ready"),
        ("restore to ready, mapped snapshot (Restore RPC)", "restore_mapped"),
        ("restore to ready, streamed snapshot (Restore RPC)", "restore_streamed"),
        ("pool acquire to ready (Restore RPC)", "pool_acquire"),
    ):
        s = res[key]
        r.append(f"| {label} | {s['p50'] * ms:.1f} ms | {s['p90'] * ms:.1f} ms | {s['p99'] * ms:.1f} ms |")
    for label, key in (("checkpoint, mapped", "checkpoint_mapped"), ("checkpoint, streamed", "checkpoint_streamed")):
        s = res[key]
        r.append(
            f"| {label}: RPC / guest paused | {s['rpc']['p50'] * ms:.0f} / {s['paused']['p50'] * ms:.0f} ms "
            f"| {s['rpc']['p90'] * ms:.0f} / {s['paused']['p90'] * ms:.0f} ms "
            f"| {s['rpc']['p99'] * ms:.0f} / {s['paused']['p99'] * ms:.0f} ms |"
        )
    b = res["snapshot_mapped_bytes"]
    r += [
        "",
        f"Restore is {res['restore_vs_cold_speedup']:.1f}x faster than a cold boot (p50).",
        "",
        "Snapshot size on disk (allocated, without the kernel and initrd, which are hard links to the "
        + f"image's): mapped {b['total'] / 2**20:.1f} MiB ("
        + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in b.items() if k not in ("total", "kernel", "initrd"))
        + f"); streamed {res['snapshot_streamed_bytes']['total'] / 2**20:.1f} MiB.",
        "",
        "Mapped restore phases (median, ms): "
        + ", ".join(f"{k} {v * ms:.1f}" for k, v in res["restore_mapped_phases_median_s"].items()),
        "",
    ]
    return "\n".join(r)


if __name__ == "__main__":
    main(bench, default_n=10)
