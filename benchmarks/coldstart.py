"""Cold-start harness: creates through a real daemon, side by side with plain QEMU.

* Sequential creates and 1/2/4/8 concurrent creates, create-to-ready p50/p90/p99 and
  throughput (sandboxes per second).
* A breakdown per phase of every start, from timestamps on both sides (the guest's
  boot marks are anchored to the host clock at the hello):
  accepted -> QEMU spawned -> QMP ready -> kernel started -> guest init -> modules
  -> rootfs -> guestd (python) -> hello -> ready event.
* In the same run: plain ``qemu-system-x86_64 -M microvm`` booting the same kernel to
  a serial marker (the floor), and the same on ``-M pc`` (what a naive user runs).
* Memory: host RSS per idle sandbox (QEMU RSS, plus the supervisor's share) at 1 and
  16 sandboxes.
* Output: JSON, a Markdown table and a PNG chart (stacked phases per mode) in --out.

Not yet here (they need the snapshot work): restore and pool-acquire rows.

Usage: python benchmarks/coldstart.py [-n N] [--out results/]
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _harness import in_process_daemon, main, write_results
from guest import boot_floor, floor_initrd
from rich.progress import Progress

from actors.vm import kernel_cmdline
from images.build import Builder, default_cache
from supervisor.client import connect

PHASES = [
    ("accepted", "spawned", "overlay + QEMU spawn"),
    ("spawned", "qmp_ready", "QMP ready"),
    ("qmp_ready", "kernel_started", "firmware/loader"),
    ("kernel_started", "guest_init", "kernel to /init"),
    ("guest_init", "guest_modules", "modules"),
    ("guest_modules", "guest_rootfs", "rootfs mount"),
    ("guest_rootfs", "guest_python", "python start"),
    ("guest_python", "hello", "guestd to hello"),
    ("hello", "ready_event", "to ready event"),
]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99), "n": len(xs)}


def breakdown(t: dict[str, float]) -> dict[str, float]:
    return {label: t[b] - t[a] for a, b, label in PHASES if a in t and b in t}


async def create_wave(c: Any, registry: Any, names: list[str]) -> tuple[float, list[float], list[dict[str, float]]]:
    t0 = time.monotonic()
    async with trio.open_nursery() as n:
        for name in names:
            n.start_soon(c.call, "Create", {"id": name})
    with trio.fail_after(300):
        while not all(registry.get(x).state in ("ready", "failed") for x in names):
            await trio.sleep(0.02)
    wall = time.monotonic() - t0
    failed = [x for x in names if registry.get(x).state != "ready"]
    if failed:
        raise RuntimeError(f"starts failed: {failed}: {registry.get(failed[0]).record.error}")
    lat, phases = [], []
    for x in names:
        t = registry.get(x).timings
        lat.append(t["ready_event"] - t["accepted"])
        phases.append(breakdown(t))
    return wall, lat, phases


async def remove_all(c: Any, names: list[str]) -> None:
    async with trio.open_nursery() as n:
        for name in names:
            n.start_soon(c.call, "Remove", {"id": name, "force": True})


def qemu_rss(registry: Any) -> list[int]:
    return [sb.host_rss() for sb in registry.sandboxes.values() if sb.state == "ready"]


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    image = Builder(default_cache()).build()
    res: dict[str, Any] = {"n": n, "kernel": image.kernel_version}
    floor_cmd = " ".join(w for w in kernel_cmdline("tcg", root=False).split() if not w.startswith("sandvisor."))
    with tempfile.TemporaryDirectory() as d, Progress() as progress:
        initrd = floor_initrd(Path(d))
        task = progress.add_task("floors", total=2 * n)
        floors, pc = [], []
        for _ in range(n):
            floors.append(await trio.to_thread.run_sync(boot_floor, image, initrd, floor_cmd))
            progress.advance(task)
            pc_cmd = floor_cmd.replace(" pci=off", "")
            pc.append(await trio.to_thread.run_sync(boot_floor, image, initrd, pc_cmd, "pc"))
            progress.advance(task)
        res["floor_microvm"] = summary(floors)
        res["floor_pc"] = summary(pc)

        async with in_process_daemon("sv-cold-") as (cfg, registry), connect(cfg.socket) as c:
            task = progress.add_task("sequential creates", total=n)
            seq_lat, seq_phases, seq_wall = [], [], 0.0
            for i in range(n):
                wall, lat, phases = await create_wave(c, registry, [f"seq{i}"])
                seq_wall += wall
                seq_lat += lat
                seq_phases += phases
                await remove_all(c, [f"seq{i}"])
                progress.advance(task)
            res["sequential"] = {**summary(seq_lat), "throughput_per_s": n / seq_wall}
            res["phases_median_s"] = {
                label: statistics.median(p[label] for p in seq_phases if label in p) for _, _, label in PHASES
            }
            res["concurrent"] = {}
            task = progress.add_task("concurrent creates", total=4)
            for k in (1, 2, 4, 8):
                names = [f"c{k}-{j}" for j in range(k)]
                wall, lat, _ = await create_wave(c, registry, names)
                res["concurrent"][str(k)] = {**summary(lat), "wall_s": wall, "throughput_per_s": k / wall, "failed": 0}
                await remove_all(c, names)
                progress.advance(task)
            task = progress.add_task("memory at 1 and 16", total=2)
            mem: dict[str, Any] = {}
            for k in (1, 16):
                names = [f"m{k}-{j}" for j in range(k)]
                await create_wave(c, registry, names)
                await trio.sleep(2)
                rss = qemu_rss(registry)
                sup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                mem[str(k)] = {
                    "qemu_rss_mib_median": statistics.median(rss) / 2**20,
                    "supervisor_maxrss_mib": sup / 2**20,
                    "per_sandbox_mib": statistics.median(rss) / 2**20 + sup / 2**20 / k,
                }
                await remove_all(c, names)
                progress.advance(task)
            res["memory"] = mem
    res["ratio_create_p50_to_floor"] = res["sequential"]["p50"] / res["floor_microvm"]["p50"]
    res["concurrency_4_vs_sequential_throughput"] = (
        res["concurrent"]["4"]["throughput_per_s"] / res["sequential"]["throughput_per_s"]
    )
    chart(res, out_dir)
    write_results(out_dir, "coldstart", res, markdown(res))
    return res


def chart(res: dict[str, Any], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(11, 4))
    left = 0.0
    for label, value in res["phases_median_s"].items():
        ax.barh("cold create", value, left=left, label=label)
        left += value
    ax.barh("floor (microvm)", res["floor_microvm"]["p50"], color="grey")
    ax.barh("floor (pc)", res["floor_pc"]["p50"], color="silver")
    ax.set_xlabel("seconds (median)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(f"sandvisor cold start, TCG, kernel {res['kernel']}")
    fig.tight_layout()
    fig.savefig(out_dir / "coldstart.png", dpi=120)
    plt.close(fig)


def markdown(res: dict[str, Any]) -> str:
    rows = [
        f"## Cold start (TCG, n={res['n']}, kernel {res['kernel']})",
        "",
        "| mode | p50 (s) | p90 (s) | p99 (s) | throughput (/s) | vs floor |",
        "|---|---|---|---|---|---|",
    ]
    fl = res["floor_microvm"]["p50"]
    for name, r in (("floor: plain QEMU microvm", res["floor_microvm"]), ("plain QEMU -M pc", res["floor_pc"])):
        rows.append(f"| {name} | {r['p50']:.3f} | {r['p90']:.3f} | {r['p99']:.3f} | | {r['p50'] / fl:.2f}x |")
    s = res["sequential"]
    rows.append(
        f"| cold create, sequential | {s['p50']:.3f} | {s['p90']:.3f} | {s['p99']:.3f} "
        f"| {s['throughput_per_s']:.2f} | {s['p50'] / fl:.2f}x |"
    )
    for k, r in res["concurrent"].items():
        rows.append(
            f"| cold create, {k} at once | {r['p50']:.3f} | {r['p90']:.3f} | {r['p99']:.3f} "
            f"| {r['throughput_per_s']:.2f} | {r['p50'] / fl:.2f}x |"
        )
    rows += ["", "Phases of a sequential create (median, s):", ""]
    rows += [f"- {label}: {v:.3f}" for label, v in res["phases_median_s"].items()]
    rows += ["", "Memory per idle sandbox:", ""]
    for k, m in res["memory"].items():
        rows.append(
            f"- {k} sandboxes: QEMU RSS {m['qemu_rss_mib_median']:.0f} MiB each, supervisor max RSS "
            f"{m['supervisor_maxrss_mib']:.0f} MiB, {m['per_sandbox_mib']:.0f} MiB per sandbox"
        )
    rows += [
        "",
        f"Throughput with 4 concurrent starts vs sequential: {res['concurrency_4_vs_sequential_throughput']:.2f}x",
        "",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    main(bench, default_n=10)
