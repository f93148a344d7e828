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

* Restore (from a snapshot of an idle sandbox) and warm-pool acquire rows, with the
  restore's phases: overlay + QEMU spawn -> QMP -> state load -> hello -> ready.

Usage: python benchmarks/coldstart.py [-n N] [--out results/]

A/B of the boot path, both in the same rounds as the floors:
``SANDVISOR_BENCH_RUNTIME_B=<initrd>`` and/or ``SANDVISOR_BENCH_TCG_CPU_B=<model>`` add a
"B" row of cold creates with that runtime / TCG CPU model, interleaved with the A row;
``SANDVISOR_BENCH_BOOT_ONLY=1`` stops after those rounds (results: coldstart_boot.*).
"""

from __future__ import annotations

import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import trio
from _harness import in_process_daemon, main, summary, write_results
from guest import boot_floor, boot_floor_phases, floor_initrd
from rich.progress import Progress
from snapshots import RESTORE_PHASES, restore_runs, wait_ready

from actors.machines import qemuspec
from actors.machines.vm import kernel_cmdline
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
        for x in names:  # READY is set before its flush; the "ready_event" stamp after it
            await registry.get(x).ready_event.wait()
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


def qemu_pss(registry: Any) -> list[int]:
    """Proportional set size: shared pages (kernel ROM, initrd, a template's RAM file)
    divided among the processes that map them; what a sandbox really costs."""
    out = []
    for sb in registry.sandboxes.values():
        if sb.state != "ready" or not sb.record.qemu_pid:
            continue
        try:
            for line in Path(f"/proc/{sb.record.qemu_pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    out.append(int(line.split()[1]) * 1024)
        except OSError:
            pass
    return out


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    image = Builder(default_cache()).build()
    res: dict[str, Any] = {"n": n, "kernel": image.kernel_version}
    floor_cmd = " ".join(w for w in kernel_cmdline("tcg", root=False).split() if not w.startswith("sandvisor."))
    # A/B: SANDVISOR_BENCH_RUNTIME_B names another runtime initrd (e.g. an
    # older build's, hard-linked aside); each round then creates with both, interleaved
    # with the floors, so the two rows and the floor see the same machine load
    # and SANDVISOR_BENCH_TCG_CPU_B the B row's TCG CPU model (e.g. "max", before ERMS went)
    runtime_b = os.environ.get("SANDVISOR_BENCH_RUNTIME_B")
    cpu_b = os.environ.get("SANDVISOR_BENCH_TCG_CPU_B")
    boot_only = bool(os.environ.get("SANDVISOR_BENCH_BOOT_ONLY"))
    with tempfile.TemporaryDirectory() as d, Progress() as progress:
        initrd = floor_initrd(Path(d))
        async with in_process_daemon("sv-cold-") as (cfg, registry), connect(cfg.socket) as c:
            registry.pools.templates = False  # the boot path first: every create boots
            settings = {"A": registry.settings}
            if runtime_b or cpu_b:
                img_b = attrs.evolve(registry.settings.image, initrd=Path(runtime_b or image.initrd))
                settings["B"] = attrs.evolve(registry.settings, image=img_b)
            cpus = {"A": qemuspec.TCG_CPU, "B": cpu_b or qemuspec.TCG_CPU}
            # rounds: floor (microvm), floor (pc), a cold create per runtime
            task = progress.add_task("floors and sequential creates", total=n)
            floors, pc, pre_clock = [], [], []
            Rows = tuple[list[float], list[dict[str, float]], list[float]]
            seq: dict[str, Rows] = {k: ([], [], []) for k in settings}
            for i in range(n):
                t, pre = await trio.to_thread.run_sync(boot_floor_phases, image, initrd, floor_cmd)
                floors.append(t)
                pre_clock.append(pre)
                pc_cmd = floor_cmd.replace(" pci=off", "")
                pc.append(await trio.to_thread.run_sync(boot_floor, image, initrd, pc_cmd, "pc"))
                for k, st in settings.items():
                    registry.settings = st  # (read by each new sandbox)
                    qemuspec.TCG_CPU = cpus[k]  # (read by each QEMU command line)
                    wall, lat, phases = await create_wave(c, registry, [f"seq{k}{i}"])
                    seq[k][0].extend(lat)
                    seq[k][1].extend(phases)
                    seq[k][2].append(wall)
                    await remove_all(c, [f"seq{k}{i}"])
                registry.settings, qemuspec.TCG_CPU = settings["A"], cpus["A"]
                progress.advance(task)
            res["floor_microvm"] = summary(floors)
            res["floor_pc"] = summary(pc)
            res["floor_phases_median_s"] = {
                "QEMU spawn to kernel clock": statistics.median(pre_clock),
                "kernel clock to marker": statistics.median(f - p for f, p in zip(floors, pre_clock, strict=True)),
            }
            for k, (lat, phases, walls) in seq.items():
                key = "sequential" if k == "A" else "sequential_b"
                res[key] = {**summary(lat), "throughput_per_s": n / sum(walls)}
                res["phases_median_s" if k == "A" else "phases_b_median_s"] = {
                    label: statistics.median(p[label] for p in phases if label in p) for _, _, label in PHASES
                }
            if "B" in settings:
                res["runtime_b"] = f"initrd {runtime_b or 'A'}, TCG CPU {cpus['B']}"
            if boot_only:  # SANDVISOR_BENCH_BOOT_ONLY: the rounds above only
                return finish(res, out_dir, "coldstart_boot")
            res["concurrent"] = {}
            task = progress.add_task("concurrent creates", total=4)
            for k in (1, 2, 4, 8):
                names = [f"c{k}-{j}" for j in range(k)]
                wall, lat, _ = await create_wave(c, registry, names)
                res["concurrent"][str(k)] = {**summary(lat), "wall_s": wall, "throughput_per_s": k / wall, "failed": 0}
                await remove_all(c, names)
                progress.advance(task)
            # creates restored from the boot template of their configuration (the default):
            # the first boots and saves the template, the next n restore it
            registry.pools.templates = True
            await create_wave(c, registry, ["tpl-first"])
            await remove_all(c, ["tpl-first"])
            task = progress.add_task("template creates", total=n)
            tpl_lat: list[float] = []
            for i in range(n):
                _, lat, _ = await create_wave(c, registry, [f"tpl{i}"])
                tpl_lat += lat
                await remove_all(c, [f"tpl{i}"])
                progress.advance(task)
            res["template_create"] = summary(tpl_lat)
            names = [f"tc4-{j}" for j in range(4)]
            wall, lat, _ = await create_wave(c, registry, names)
            res["template_concurrent_4"] = {**summary(lat), "wall_s": wall, "throughput_per_s": 4 / wall}
            await remove_all(c, names)
            # serve --template-pool 1: a Create takes a restored member
            registry.pools.resize(template_pool=1)
            task = progress.add_task("template pool creates", total=n)
            tp_lat: list[float] = []
            for i in range(n):
                with trio.fail_after(120):
                    while not any(m.state == "ready" for m in registry.pools.all_members()):
                        await trio.sleep(0.01)
                _, lat, _ = await create_wave(c, registry, [f"tp{i}"])
                tp_lat += lat
                await remove_all(c, [f"tp{i}"])
                progress.advance(task)
            res["template_pool_create"] = summary(tp_lat)
            registry.pools.resize(template_pool=0)
            # the path users take: a default Create (template-served) checkpointed
            # -- streamed, then converted to mapped in the background -- and restored
            await create_wave(c, registry, ["dorigin"])
            await trio.sleep(1)
            dsnap = (await c.call("Checkpoint", {"sandbox_id": "dorigin"}))["snapshot_id"]
            await c.call("Remove", {"id": "dorigin", "force": True})
            with trio.fail_after(120):
                while registry.snapshots.get(dsnap).memory != "mapped":
                    await trio.sleep(0.05)
            lat, _ = await restore_runs(c, registry, dsnap, n, progress, "default-path restores")
            res["restore_default"] = summary(lat)
            await c.call("DeleteSnapshot", {"snapshot_id": dsnap})
            registry.pools.templates = False
            # restore and pool acquire: a snapshot of an idle sandbox
            await c.call("Create", {"id": "origin"})
            await wait_ready(registry, "origin")
            await trio.sleep(1)
            snap = (await c.call("Checkpoint", {"sandbox_id": "origin"}))["snapshot_id"]
            await c.call("Remove", {"id": "origin", "force": True})
            lat, phases = await restore_runs(c, registry, snap, n, progress, "restores")
            res["restore"] = summary(lat)
            res["restore_phases_median_s"] = {
                label: statistics.median(p[label] for p in phases if label in p) for _, _, label in RESTORE_PHASES
            }
            registry.pools.resize(snapshot=snap, size=1)
            lat, _ = await restore_runs(c, registry, snap, n, progress, "pool acquires", pool=True)
            res["pool_acquire"] = summary(lat)
            registry.pools.resize(snapshot=snap, size=0)
            await c.call("DeleteSnapshot", {"snapshot_id": snap})
            task = progress.add_task("memory at 1 and 16", total=4)
            mem: dict[str, Any] = {}
            for mode in ("boot", "template"):
                registry.pools.templates = mode == "template"
                for k in (1, 16):
                    names = [f"m{mode}{k}-{j}" for j in range(k)]
                    await create_wave(c, registry, names)
                    await trio.sleep(2)
                    rss, pss = qemu_rss(registry), qemu_pss(registry)
                    sup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                    mem[f"{mode}-{k}"] = {
                        "qemu_rss_mib_median": statistics.median(rss) / 2**20,
                        "qemu_pss_mib_median": statistics.median(pss) / 2**20 if pss else 0.0,
                        "supervisor_maxrss_mib": sup / 2**20,
                        "per_sandbox_mib": (statistics.median(pss or rss) + sup / k) / 2**20,
                    }
                    await remove_all(c, names)
                    progress.advance(task)
            res["memory"] = mem
    res["concurrency_4_vs_sequential_throughput"] = (
        res["concurrent"]["4"]["throughput_per_s"] / res["sequential"]["throughput_per_s"]
    )
    return finish(res, out_dir, "coldstart")


def finish(res: dict[str, Any], out_dir: Path, name: str) -> dict[str, Any]:
    res["ratio_create_p50_to_floor"] = res["sequential"]["p50"] / res["floor_microvm"]["p50"]
    if "sequential_b" in res:
        res["ratio_create_b_p50_to_floor"] = res["sequential_b"]["p50"] / res["floor_microvm"]["p50"]
    res["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    write_results(out_dir, name, res, markdown(res))
    chart(res, out_dir, name)
    return res


def chart(res: dict[str, Any], out_dir: Path, name: str = "coldstart") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(11, 4))
    left = 0.0
    for label, value in res["phases_median_s"].items():
        ax.barh("cold create (boot)", value, left=left, label=label)
        left += value
    left = 0.0
    for value in res.get("phases_b_median_s", {}).values():
        ax.barh("cold create (boot), runtime B", value, left=left, hatch="..")
        left += value
    left = 0.0
    for label, value in res.get("restore_phases_median_s", {}).items():
        ax.barh("restore", value, left=left, label=f"restore: {label}", hatch="//")
        left += value
    if "template_create" in res:
        ax.barh("create (template)", res["template_create"]["p50"], color="tab:olive")
    if "restore_default" in res:
        ax.barh("restore (default Create's snapshot)", res["restore_default"]["p50"], color="tab:cyan")
    if "pool_acquire" in res:
        ax.barh("pool acquire", res["pool_acquire"]["p50"], color="black")
    ax.barh("floor (microvm)", res["floor_microvm"]["p50"], color="grey")
    ax.barh("floor (pc)", res["floor_pc"]["p50"], color="silver")
    ax.set_xlabel("seconds (median)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(f"sandvisor cold start, TCG, kernel {res['kernel']}")
    fig.tight_layout()
    fig.savefig(out_dir / f"{name}.png", dpi=120)
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
        f"| cold create (boot path), sequential | {s['p50']:.3f} | {s['p90']:.3f} | {s['p99']:.3f} "
        f"| {s['throughput_per_s']:.2f} | {s['p50'] / fl:.2f}x |"
    )
    if "sequential_b" in res:
        s = res["sequential_b"]
        rows.append(
            f"| cold create (boot path), sequential, B | {s['p50']:.3f} | {s['p90']:.3f} | {s['p99']:.3f} "
            f"| {s['throughput_per_s']:.2f} | {s['p50'] / fl:.2f}x |"
        )
    for k, r in res.get("concurrent", {}).items():
        rows.append(
            f"| cold create (boot path), {k} at once | {r['p50']:.3f} | {r['p90']:.3f} | {r['p99']:.3f} "
            f"| {r['throughput_per_s']:.2f} | {r['p50'] / fl:.2f}x |"
        )
    for name, key in (
        ("create from the boot template (default)", "template_create"),
        ("create from the boot template, 4 at once", "template_concurrent_4"),
        ("create from the template's warm pool (--template-pool 1)", "template_pool_create"),
        ("restore from a snapshot (Restore RPC)", "restore"),
        ("restore of a default Create's snapshot (converted to mapped)", "restore_default"),
        ("warm pool acquire", "pool_acquire"),
    ):
        if key in res:
            r = res[key]
            tp = f"{r['throughput_per_s']:.2f}" if "throughput_per_s" in r else ""
            rows.append(f"| {name} | {r['p50']:.3f} | {r['p90']:.3f} | {r['p99']:.3f} | {tp} | {r['p50'] / fl:.2f}x |")
    rows += ["", "Phases of a sequential create (median, s):", ""]
    rows += [f"- {label}: {v:.3f}" for label, v in res["phases_median_s"].items()]
    if "phases_b_median_s" in res:
        rows += ["", f"Phases of a sequential create, B ({res['runtime_b']}) (median, s):", ""]
        rows += [f"- {label}: {v:.3f}" for label, v in res["phases_b_median_s"].items()]
    if "floor_phases_median_s" in res:
        rows += ["", "Phases of the floor (median, s):", ""]
        rows += [f"- {label}: {v:.3f}" for label, v in res["floor_phases_median_s"].items()]
        rows += [
            "",
            '("firmware/loader" runs from QMP ready to the guest kernel\'s clock: no firmware runs (PVH',
            "direct boot); it is QEMU loading the kernel and initramfs and the kernel's early setup",
            "before its clock starts, the floor's \"QEMU spawn to kernel clock\" less QEMU's spawn.)",
        ]
    if "restore_phases_median_s" in res:
        rows += ["", "Phases of a restore (median, s):", ""]
        rows += [f"- {label}: {v:.3f}" for label, v in res["restore_phases_median_s"].items()]
    rows += ["", "Memory per idle sandbox:", ""] if "memory" in res else []
    for k, m in res.get("memory", {}).items():
        mode, count = k.split("-")
        rows.append(
            f"- {count} sandboxes ({mode}): QEMU RSS {m['qemu_rss_mib_median']:.0f} MiB, PSS "
            f"{m['qemu_pss_mib_median']:.0f} MiB each; supervisor max RSS {m['supervisor_maxrss_mib']:.0f} MiB; "
            f"{m['per_sandbox_mib']:.0f} MiB per sandbox (PSS + supervisor share)"
        )
    if "concurrency_4_vs_sequential_throughput" in res:
        rows += [
            "",
            f"Throughput with 4 concurrent starts vs sequential: {res['concurrency_4_vs_sequential_throughput']:.2f}x",
        ]
    rows += ["", f"Load average at the end: {' '.join(res.get('loadavg', []))}", ""]
    return "\n".join(rows)


if __name__ == "__main__":
    main(bench, default_n=10)
