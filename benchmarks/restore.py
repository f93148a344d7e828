"""Restore and warm-pool acquire, the new path against the old one, interleaved in one run.

Each round restores a snapshot of an idle sandbox twice -- once with
``SANDVISOR_LEGACY_RESTORE=1`` (the older path: QMP and the guest channel
found by path with a connect loop, the saved state fed by QMP round trips, the hello
and each fix-up its own round trip) and once without, in alternating order -- and then
takes a warm pool member both ways. Each path restores a snapshot saved by its own
machines (the new path's carry no runstate: they restore running, without a ``cont``).
The in-process daemon reads the variable at each restore, so both run against the same
host load.

Rows: Restore RPC round trip (ready on return) and the restore's phases
(benchmarks/snapshots.py's RESTORE_PHASES), pool acquire round trip; p50/p90 and the
new/old ratio of the p50s, with the load average at the start and the end.

Usage: python benchmarks/restore.py [-n N] [--out results/]
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import trio
from _harness import in_process_daemon, main, summary, write_results
from rich.progress import Progress
from snapshots import RESTORE_PHASES, wait_ready

from supervisor.client import connect

MODES = ("old", "new")


def _mode(mode: str) -> None:
    if mode == "old":
        os.environ["SANDVISOR_LEGACY_RESTORE"] = "1"
    else:
        os.environ.pop("SANDVISOR_LEGACY_RESTORE", None)


async def _restore(c: Any, registry: Any, snap: str, name: str) -> tuple[float, dict[str, float]]:
    t0 = time.monotonic()
    await c.call("Restore", {"snapshot_id": snap, "id": name})
    lat = time.monotonic() - t0
    t = registry.get(name).timings
    phases = {lab: t[b] - t[a] for a, b, lab in RESTORE_PHASES if a in t and b in t}
    await c.call("Remove", {"id": name, "force": True})
    return lat, phases


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"n": n, "load_start": Path("/proc/loadavg").read_text().split()[:3]}
    lat: dict[str, list[float]] = {m: [] for m in MODES}
    phases: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    pool: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        async with in_process_daemon("sv-restore-") as (cfg, registry), connect(cfg.socket) as c:
            registry.pools.templates = False
            snaps = {}
            for mode in MODES:  # each path restores a snapshot its own machines saved
                _mode(mode)
                await c.call("Create", {"id": f"origin-{mode}"})
                await wait_ready(registry, f"origin-{mode}")
                await trio.sleep(1)
                snaps[mode] = (await c.call("Checkpoint", {"sandbox_id": f"origin-{mode}"}))["snapshot_id"]
                await c.call("Remove", {"id": f"origin-{mode}", "force": True})
            res["memory"] = registry.snapshots.get(snaps["new"]).memory
            with Progress() as progress:
                task = progress.add_task("restores (old/new interleaved)", total=2 * n)
                for i in range(n):
                    for mode in MODES if i % 2 == 0 else MODES[::-1]:
                        _mode(mode)
                        x, ph = await _restore(c, registry, snaps[mode], f"r{mode}{i}")
                        lat[mode].append(x)
                        phases[mode].append(ph)
                        progress.advance(task)
                for snap in snaps.values():
                    registry.pools.resize(snapshot=snap, size=1)
                task = progress.add_task("pool acquires (old/new interleaved)", total=2 * n)
                for i in range(n):
                    for mode in MODES if i % 2 == 0 else MODES[::-1]:
                        with trio.fail_after(120):
                            while registry.pool_ready(registry.snapshots.get(snaps[mode])) < 1:
                                await trio.sleep(0.01)
                        await trio.sleep(0.2)  # the member's own fix-ups are done
                        _mode(mode)
                        x, _ = await _restore(c, registry, snaps[mode], f"p{mode}{i}")
                        pool[mode].append(x)
                        progress.advance(task)
                _mode("new")
                for snap in snaps.values():
                    registry.pools.resize(snapshot=snap, size=0)
                    await c.call("DeleteSnapshot", {"snapshot_id": snap})
    finally:
        _mode("new")
    res["load_end"] = Path("/proc/loadavg").read_text().split()[:3]
    for m in MODES:
        res[f"restore_{m}"] = summary(lat[m])
        res[f"restore_{m}_phases_median_s"] = {
            label: statistics.median([p[label] for p in phases[m] if label in p]) for _, _, label in RESTORE_PHASES
        }
        res[f"pool_acquire_{m}"] = summary(pool[m])
    res["ratio_restore_p50_new_to_old"] = res["restore_new"]["p50"] / res["restore_old"]["p50"]
    res["ratio_pool_p50_new_to_old"] = res["pool_acquire_new"]["p50"] / res["pool_acquire_old"]["p50"]
    write_results(out_dir, "restore", res, markdown(res))
    return res


def markdown(res: dict[str, Any]) -> str:
    rows = [
        f"## Restore and pool acquire, old path vs new, interleaved (TCG, n={res['n']}, memory {res['memory']})",
        "",
        f"Load average at start {' '.join(res['load_start'])}, at end {' '.join(res['load_end'])}.",
        "",
        "| row | old p50 (ms) | old p90 | new p50 (ms) | new p90 | new/old p50 |",
        "|---|---|---|---|---|---|",
    ]
    for name, key in (("restore (Restore RPC, ready on return)", "restore"), ("warm pool acquire", "pool_acquire")):
        o, w = res[f"{key}_old"], res[f"{key}_new"]
        rows.append(
            f"| {name} | {o['p50'] * 1e3:.1f} | {o['p90'] * 1e3:.1f} | {w['p50'] * 1e3:.1f} | {w['p90'] * 1e3:.1f} "
            f"| {w['p50'] / o['p50']:.2f} |"
        )
    rows += ["", "Restore phases (median, ms):", "", "| phase | old | new |", "|---|---|---|"]
    for _, _, label in RESTORE_PHASES:
        o, w = res["restore_old_phases_median_s"].get(label), res["restore_new_phases_median_s"].get(label)
        rows.append(f"| {label} | {(o or 0) * 1e3:.1f} | {(w or 0) * 1e3:.1f} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main(bench, default_n=10)
