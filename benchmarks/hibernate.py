"""Hibernation: pause and resume against a cold boot and a restore, in one run.

For a 256 MiB and a 1 GiB guest (booted: no boot templates, so its RAM is a shared
file and its first pause is "mapped"), with half its RAM touched (random data in a
guest tmpfs):

* pause: the Pause RPC's round trip, and per GiB of guest memory saved (the allocated
  size of the saved memory or stream);
* resume to ready: the Resume RPC's round trip (returns once ready), p50/p95, against a
  cold boot (Create to the ready event) and a Restore of a Checkpoint of the same
  sandbox (mapped: the same state, as a new sandbox);
* the first Run after a resume (``true``) against a Run on a sandbox that was running,
  and a Run on a paused sandbox (auto-resume: the resume is in it);
* host RAM: N paused + 4 running sandboxes against N + 4 running (the QEMUs' RSS
  summed; the host's MemAvailable, noisy on a shared machine).

A resumed guest's RAM maps its saved memory privately (copy-on-write, loaded lazily),
so its next pause streams the RAM (as a checkpoint of a restored sandbox does; the
converter makes it mapped in the background -- held off here): pauses and resumes
alternate mapped and streamed, and each is reported by kind.

Usage: python benchmarks/hibernate.py [-n N] [--paused N] [--out results/]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import trio
from _harness import in_process_daemon, pct, write_results

from actors.sandboxes.usage import proc_rss
from supervisor.client import connect

SIZES = (256, 1024)  # MiB of guest RAM
RUN_SAMPLES = 10
PHASES = [  # a resume's milestones (Sandbox.timings), as the snapshots benchmark's restore phases
    ("accepted", "spawned", "overlay + QEMU spawn"),
    ("spawned", "qmp_ready", "QMP ready"),
    ("qmp_ready", "loaded", "state load"),
    ("loaded", "hello", "hello"),
    ("hello", "ready_event", "fixups to ready"),
]


def p(xs: list[float]) -> dict[str, float]:
    return {"p50": pct(xs, 50), "p95": pct(xs, 95), "n": len(xs)}


async def ready(registry: Any, name: str, timeout: float = 300) -> None:
    with trio.fail_after(timeout):
        await registry.get(name).ready_event.wait()
    if registry.get(name).state != "ready":
        raise RuntimeError(f"{name} failed: {registry.get(name).record.error}")


async def run(c: Any, name: str, cmd: list[str]) -> float:
    """A Run's round trip (to its exit)."""
    t0 = time.monotonic()
    async with c.open_call("Run", {"id": name, "cmd": cmd}) as call:
        async for item in call:
            if item["done"] and item["exit_code"] != 0:
                raise RuntimeError(f"{cmd} in {name}: exit {item['exit_code']}")
    return time.monotonic() - t0


async def touch(c: Any, name: str, mib: int) -> None:
    """``mib`` of the guest's RAM written with random data (a tmpfs, kept)."""
    await run(
        c,
        name,
        [
            "sh",
            "-c",
            f"mkdir -p /mnt/fill && mount -t tmpfs -o size={mib + 8}m tmpfs /mnt/fill && "
            f"dd if=/dev/urandom of=/mnt/fill/x bs=1M count={mib} 2>/dev/null",
        ],
    )


async def size_bench(c: Any, registry: Any, mib: int, n: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    limits = {"limits": {"memory_mib": mib}}
    cold = []
    for i in range(n):
        name = f"cold{mib}-{i}"
        await c.call("Create", {"id": name, **limits})
        await ready(registry, name)
        t = registry.get(name).timings
        cold.append(t["ready_event"] - t["accepted"])
        await c.call("Remove", {"id": name, "force": True})
    res["cold_create_to_ready"] = p(cold)

    name = f"h{mib}"
    await c.call("Create", {"id": name, **limits})
    await ready(registry, name)
    await touch(c, name, mib // 2)
    res["run_running"] = p([await run(c, name, ["true"]) for _ in range(RUN_SAMPLES)])

    snap = await c.call("Checkpoint", {"sandbox_id": name})
    restores, after_restore = [], []
    for i in range(n):
        t0 = time.monotonic()
        await c.call("Restore", {"snapshot_id": snap["snapshot_id"], "id": f"r{mib}-{i}"})
        restores.append(time.monotonic() - t0)
        after_restore.append(await run(c, f"r{mib}-{i}", ["true"]))
        await c.call("Remove", {"id": f"r{mib}-{i}", "force": True})
    res["restore_mapped"] = p(restores)
    res["first_run_after_restore"] = p(after_restore)

    sb = registry.get(name)
    pauses: dict[str, list[float]] = {"mapped": [], "streamed": []}
    per_gib: dict[str, list[float]] = {"mapped": [], "streamed": []}
    resumes: dict[str, list[float]] = {"mapped": [], "streamed": []}
    first_run, auto_run = [], []
    phases: list[dict[str, float]] = []
    async with registry.snapshots.convert_lock:  # (no conversion between a pause and its resume)
        for i in range(n):
            for explicit in (True, False) if i % 2 == 0 else (False, True):
                t0 = time.monotonic()
                await c.call("Pause", {"id": name})
                took = time.monotonic() - t0
                saved = registry.hibernation.saved(sb)
                kind = str(saved.memory)
                saved_bytes = sum(v for k, v in saved.sizes.items() if k != "disk.qcow2")
                pauses[kind].append(took)
                per_gib[kind].append(took / max(saved_bytes / 2**30, 1e-9))
                if explicit:
                    t0 = time.monotonic()
                    await c.call("Resume", {"id": name})
                    resumes[kind].append(time.monotonic() - t0)
                    t = sb.timings
                    phases.append({lab: t[b] - t[a] for a, b, lab in PHASES if a in t and b in t})
                    first_run.append(await run(c, name, ["true"]))
                else:
                    auto_run.append(await run(c, name, ["true"]))  # auto-resume, then the Run
    res["pause"] = {k: p(v) for k, v in pauses.items() if v}
    res["pause_s_per_gib_saved"] = {k: p(v) for k, v in per_gib.items() if v}
    res["resume_to_ready"] = {k: p(v) for k, v in resumes.items() if v}
    res["resume_phases_median_s"] = {lab: pct([x[lab] for x in phases if lab in x], 50) for _, _, lab in PHASES}
    res["first_run_after_resume"] = p(first_run)
    res["run_on_paused_auto_resume"] = p(auto_run)
    allres = [x for v in resumes.values() for x in v]
    res["resume_all"] = p(allres)
    res["resume_vs_restore"] = pct(allres, 50) / res["restore_mapped"]["p50"]
    mapped = resumes["mapped"] or allres
    res["resume_mapped_vs_restore"] = pct(mapped, 50) / res["restore_mapped"]["p50"]
    res["resume_vs_cold"] = pct(allres, 50) / res["cold_create_to_ready"]["p50"]
    res["first_run_vs_running"] = res["first_run_after_resume"]["p50"] / res["run_running"]["p50"]
    await c.call("Remove", {"id": name, "force": True})
    return res


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) >> 10
    return 0


async def ram_bench(c: Any, registry: Any, paused: int, running: int = 4) -> dict[str, Any]:
    names = []
    base = mem_available_mib()
    for i in range(paused + running):  # one boot at a time: a loaded host times out boots in a crowd
        nm = f"m{i}"
        for _ in range(3):
            await c.call("Create", {"id": nm})
            try:
                await ready(registry, nm, timeout=900)
                break
            except RuntimeError:  # (a boot timed out on a loaded host: again)
                await c.call("Remove", {"id": nm, "force": True})
        else:
            raise RuntimeError(f"{nm} did not boot in 3 attempts")
        await touch(c, nm, 64)
        names.append(nm)

    def rss() -> int:
        return sum(proc_rss(registry.get(nm).record.qemu_pid) for nm in names) >> 20

    all_running = {"qemu_rss_mib": rss(), "mem_available_drop_mib": base - mem_available_mib()}
    for nm in names[:paused]:
        await c.call("Pause", {"id": nm})
    some_paused = {"qemu_rss_mib": rss(), "mem_available_drop_mib": base - mem_available_mib()}
    for nm in names:
        await c.call("Remove", {"id": nm, "force": True})
    return {
        "paused": paused,
        "running": running,
        f"{paused + running}_running": all_running,
        f"{paused}_paused_{running}_running": some_paused,
    }


async def bench(n: int, paused: int, out_dir: Path, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    res: dict[str, Any] = {"n": n, "sizes": list(sizes)}
    async with in_process_daemon("sv-hib-bench-") as (cfg, registry), connect(cfg.socket) as c:
        registry.pools.templates = False  # booted guests: RAM in a shared file, first pauses mapped
        for mib in sizes:
            res[f"{mib}MiB"] = await size_bench(c, registry, mib, n)
            print(markdown(res), flush=True)  # (so far: the RAM part takes a while)
        if paused:
            res["host_ram"] = await ram_bench(c, registry, paused)
    write_results(out_dir, "hibernate", res, markdown(res))
    return res


def markdown(res: dict[str, Any]) -> str:
    ms = 1000.0

    def f(s: dict[str, float]) -> str:
        return f"{s['p50'] * ms:.0f} / {s['p95'] * ms:.0f} ms"

    r = [f"## Hibernation (TCG, n={res['n']}; p50 / p95)", ""]
    for mib in [m for m in res["sizes"] if f"{m}MiB" in res]:
        s = res[f"{mib}MiB"]
        r += [f"### {mib} MiB guest, {mib // 2} MiB touched", "", "| measure | p50 / p95 |", "|---|---|"]
        r.append(f"| cold create to ready | {f(s['cold_create_to_ready'])} |")
        r.append(f"| restore to ready, mapped (Restore RPC) | {f(s['restore_mapped'])} |")
        for kind, v in s["pause"].items():
            g = s["pause_s_per_gib_saved"][kind]
            r.append(f"| pause, {kind} (Pause RPC) | {f(v)} ({g['p50']:.2f} s per GiB saved) |")
        for kind, v in s["resume_to_ready"].items():
            r.append(f"| resume to ready, {kind} (Resume RPC) | {f(v)} |")
        r.append(f"| Run `true` on a running sandbox | {f(s['run_running'])} |")
        r.append(f"| first Run `true` after a resume | {f(s['first_run_after_resume'])} |")
        r.append(f"| first Run `true` after a restore (the same state) | {f(s['first_run_after_restore'])} |")
        r.append(f"| Run `true` on a paused sandbox (auto-resume included) | {f(s['run_on_paused_auto_resume'])} |")
        r += [
            "",
            f"Resume (all, p50) is {s['resume_vs_restore']:.2f}x a mapped restore "
            f"({s['resume_mapped_vs_restore']:.2f}x for mapped resumes) and {s['resume_vs_cold']:.2f}x a cold boot; "
            f"the first Run after a resume is {s['first_run_vs_running']:.2f}x a Run on a running sandbox.",
            "",
            "Resume phases (median, ms): "
            + ", ".join(f"{k} {v * ms:.0f}" for k, v in s["resume_phases_median_s"].items()),
            "",
        ]
    h = res.get("host_ram")
    if h is None:
        return "\n".join(r)
    a, b = h[f"{h['paused'] + h['running']}_running"], h[f"{h['paused']}_paused_{h['running']}_running"]
    r += [
        f"### Host RAM: {h['paused']} paused + {h['running']} running against {h['paused'] + h['running']} running "
        "(256 MiB guests, 64 MiB touched each)",
        "",
        "| | QEMU RSS summed | host MemAvailable drop |",
        "|---|---|---|",
        f"| {h['paused'] + h['running']} running | {a['qemu_rss_mib']} MiB | {a['mem_available_drop_mib']} MiB |",
        f"| {h['paused']} paused + {h['running']} running | {b['qemu_rss_mib']} MiB "
        f"| {b['mem_available_drop_mib']} MiB |",
        "",
    ]
    return "\n".join(r)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--paused", type=int, default=32, help="N paused sandboxes beside 4 running (issue: 32)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="guest RAM sizes, MiB")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    trio.run(bench, a.n, a.paused, Path(a.out), tuple(int(x) for x in a.sizes.split(",")))
