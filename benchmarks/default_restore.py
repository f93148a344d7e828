"""The default path's snapshots: a default Create (served by its boot
template) checkpointed, then restored, before its conversion (streamed) and after
(mapped); against template-served Creates, measured in the same run.

* create: ``n`` template-served Creates alive at once, the Create RPC round trip
  each, and each one's QEMU PSS (``/proc/<pid>/smaps_rollup``) once all are up;
* streamed: the snapshot of a default Create, its conversion held off: ``n``
  Restores alive at once, the Restore RPC round trip each, PSS each;
* mapped: the same snapshot once converted: the same measures, and the restore's
  phases (the sandbox's timings; median);
* pool: Restore RPC when a warm member of the mapped snapshot is ready (pool size 1);
* conversion: how long the converter took (checkpoint to the record's switch).

Ratios: restore p50 streamed / mapped, clone PSS mapped / template-served Create.

Usage: python benchmarks/default_restore.py [-n 16] [--out results/]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import trio
from _harness import in_process_daemon, main, summary, write_results

from supervisor.client import connect

PHASES = [
    ("accepted", "spawned", "overlay + QEMU spawn"),
    ("spawned", "qmp_ready", "QMP ready"),
    ("qmp_ready", "connected", "channel connect"),
    ("connected", "loaded", "state load"),
    ("loaded", "hello", "hello (the guest's answer)"),
    ("hello", "ready_event", "fixups to ready"),
]
MiB = 2**20


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def pss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


async def wait_ready(registry: Any, name: str) -> None:
    with trio.fail_after(180):
        # (ready is set, then stored, then the ready_event mark taken: wait for the mark)
        while registry.get(name).state != "failed" and "ready_event" not in registry.get(name).timings:
            await trio.sleep(0.01)
    if registry.get(name).state != "ready":
        raise RuntimeError(f"{name} failed: {registry.get(name).record.error}")


async def fleet(c: Any, registry: Any, names: list[str], call: str, args: dict[str, Any]) -> dict[str, Any]:
    """Start ``names`` one after the other (RPC round trip each), all alive at once;
    then, settled, each QEMU's PSS; then remove them all."""
    lat, phases, mapped = [], [], []
    for name in names:
        t0 = time.monotonic()
        await c.call(call, {**args, "id": name})
        await wait_ready(registry, name)
        lat.append(time.monotonic() - t0)
        t = registry.get(name).timings
        phases.append({lab: t[b] - t[a] for a, b, lab in PHASES if a in t and b in t})
        mapped.append(t.get("mapped", -1.0))
    await trio.sleep(2)  # settled: the guests idle
    sizes = [pss(registry.get(n).record.qemu_pid) for n in names]
    for name in names:
        await c.call("Remove", {"id": name, "force": True})
    return {
        "rpc": summary(lat),
        "pss_mib_median": med([s / MiB for s in sizes]),
        "pss_mib_max": max(sizes) / MiB,
        "phases_median_ms": {lab: med([p[lab] * 1000 for p in phases if lab in p]) for _, _, lab in PHASES},
        "restored_mapped": sum(1 for m in mapped if m == 1.0),
    }


async def default_restore_bench(n: int) -> dict[str, Any]:
    res: dict[str, Any] = {"n": n}
    async with in_process_daemon("sv-defrest-") as (cfg, registry), connect(cfg.socket) as c:
        await c.call("Create", {"id": "maker"})  # the cold boot that makes the boot template
        await wait_ready(registry, "maker")
        res["create"] = await fleet(c, registry, [f"create{i}" for i in range(n)], "Create", {})
        await c.call("Create", {"id": "origin"})
        await wait_ready(registry, "origin")
        await trio.sleep(1)
        store = registry.snapshots
        async with store.convert_lock:  # the conversion waits: restores of the stream
            t_ck = time.monotonic()
            snap = await c.call("Checkpoint", {"sandbox_id": "origin", "name": "default"})
            res["checkpoint_rpc_s"] = time.monotonic() - t_ck
            assert snap["memory"] == "streamed", snap
            res["streamed"] = await fleet(
                c, registry, [f"streamed{i}" for i in range(n)], "Restore", {"snapshot_id": snap["snapshot_id"]}
            )
            t_conv = time.monotonic()
        rec = store.get(snap["snapshot_id"])
        with trio.fail_after(600):
            while rec.memory != "mapped" or store.converting is not None:
                await trio.sleep(0.05)
        res["conversion_s"] = time.monotonic() - t_conv
        res["mapped"] = await fleet(
            c, registry, [f"mapped{i}" for i in range(n)], "Restore", {"snapshot_id": snap["snapshot_id"]}
        )
        # warm pool of the mapped snapshot, size 1
        registry.pools.resize(snapshot=snap["snapshot_id"], size=1)
        lat = []
        for i in range(n):
            with trio.fail_after(120):
                while registry.pool_ready(rec) < 1:
                    await trio.sleep(0.01)
            t0 = time.monotonic()
            await c.call("Restore", {"snapshot_id": snap["snapshot_id"], "id": f"pool{i}"})
            lat.append(time.monotonic() - t0)
            await c.call("Remove", {"id": f"pool{i}", "force": True})
        res["pool_acquire"] = summary(lat)
        registry.pools.resize(snapshot=snap["snapshot_id"], size=0)
    s, m, cr = res["streamed"], res["mapped"], res["create"]
    res["ratios"] = {
        "restore_p50_streamed_over_mapped": s["rpc"]["p50"] / m["rpc"]["p50"],
        "clone_pss_mapped_over_create": m["pss_mib_median"] / cr["pss_mib_median"],
        "clone_pss_streamed_over_create": s["pss_mib_median"] / cr["pss_mib_median"],
        "restore_p50_mapped_over_create_p50": m["rpc"]["p50"] / cr["rpc"]["p50"],
    }
    return res


def markdown(res: dict[str, Any]) -> str:
    ms = 1000.0
    r = [
        f"## Restores of a default Create's snapshot (TCG, 256 MiB guest, {res['n']} alive at once)",
        "",
        "| what | RPC p50 | RPC p90 | PSS per QEMU (median / max) | restored mapped |",
        "|---|---|---|---|---|",
    ]
    for label, key in (
        ("template-served Create", "create"),
        ("Restore before the conversion (streamed)", "streamed"),
        ("Restore after the conversion (mapped)", "mapped"),
    ):
        x = res[key]
        r.append(
            f"| {label} | {x['rpc']['p50'] * ms:.0f} ms | {x['rpc']['p90'] * ms:.0f} ms "
            f"| {x['pss_mib_median']:.1f} / {x['pss_mib_max']:.1f} MiB | {x['restored_mapped']}/{x['rpc']['n']} |"
        )
    q = res["ratios"]
    p = res["pool_acquire"]
    r += [
        f"| pool acquire (mapped snapshot, pool size 1) | {p['p50'] * ms:.1f} ms | {p['p90'] * ms:.1f} ms | | |",
        "",
        f"Restore p50 streamed / mapped: {q['restore_p50_streamed_over_mapped']:.2f}x; clone PSS mapped / "
        f"template-served Create: {q['clone_pss_mapped_over_create']:.2f}x (streamed: "
        f"{q['clone_pss_streamed_over_create']:.2f}x). Conversion (the helper, after the checkpoint): "
        f"{res['conversion_s']:.1f} s.",
        "",
        "Restore phases (median, ms): "
        + "; ".join(
            f"{key}: " + ", ".join(f"{k} {v:.0f}" for k, v in res[key]["phases_median_ms"].items())
            for key in ("create", "streamed", "mapped")
        ),
        "",
    ]
    return "\n".join(r)


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    res = await default_restore_bench(n)
    write_results(out_dir, "default_restore", res, markdown(res))
    return res


if __name__ == "__main__":
    main(bench, default_n=16)
