"""Agent overhead of an exec: the ``exec true`` round trip over the guest
channel minus the in-guest spawn of ``true`` measured alone, for two guest runtimes
booted side by side and measured interleaved (A: a baseline runtime's initrd, e.g.
main's; B: this tree's), so drift in the machine's load hits both alike.

``--profile`` boots a third guest (this tree's runtime with ``sandvisor.execprof=1``):
guestd then sends the time marks of each exec (guestd/exec.py), the guest's own
breakdown of where an exec's time goes.

Usage: python benchmarks/exec.py [--baseline-initrd OLD.cpio] [--a-extra CMDLINE] [--b-extra CMDLINE]
       [-n N] [--profile] [--out results/]

QEMU CPU per exec (all its threads' schedstat, idle ticks taken out) is the guest's
emulated work: host load inflates wall times many times over, this much less.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.channel.guest import GuestChannel
from actors.machines.disk import create_overlay
from actors.machines.vm import VmSpec, booted_guest
from images.build import Builder, Image, default_cache

FLOOR = (
    "import os,sys,time\n"
    "ts=[0.0]\n"
    "for _ in range(int(sys.argv[1])):\n"
    "  t=time.perf_counter(); os.waitpid(os.posix_spawn('/bin/true',['true'],{}),0); ts.append(time.perf_counter()-t)\n"
    "ts.sort(); print(ts[len(ts)//2])"
)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


QEMU: dict[int, int] = {}  # id(channel) -> its QEMU's pid


def qemu_cpu(chan: GuestChannel) -> float:
    """CPU seconds QEMU spent so far, all its threads (schedstat: ns, not 10 ms ticks).
    Under TCG that is the guest's emulated work, which load on the host does not
    inflate as it inflates wall time."""
    total = 0
    task_dir = Path(f"/proc/{QEMU[id(chan)]}/task")
    for t in task_dir.iterdir():
        try:
            total += int((t / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            pass
    return total / 1e9


async def boot(stack: AsyncExitStack, image: Image, run_dir: Path, extra: str = "") -> GuestChannel:
    run_dir.mkdir(parents=True)
    await create_overlay(image.rootfs, run_dir / "disk.qcow2")
    spec = VmSpec.boot(image, disk=run_dir / "disk.qcow2", extra_cmdline=extra)
    g = await stack.enter_async_context(booted_guest(spec, run_dir))
    pid = g.machine.pid
    assert pid is not None
    QEMU[id(g.channel)] = pid
    return g.channel


async def idle_rate(chan: GuestChannel, seconds: float = 3.0) -> float:
    """QEMU CPU seconds per wall second of an idle guest (its timer ticks)."""
    c0, t0 = qemu_cpu(chan), time.perf_counter()
    await trio.sleep(seconds)
    return (qemu_cpu(chan) - c0) / (time.perf_counter() - t0)


async def spawn_floor(chan: GuestChannel, idle: float = 0.0) -> tuple[float, float]:
    """In-guest posix_spawn + wait of /bin/true: (median wall seconds, QEMU CPU seconds
    per spawn: a run of 40 minus a run of 0, idle ticks taken out)."""
    cpu = []
    for n in (40, 0):
        c0, t0 = qemu_cpu(chan), time.perf_counter()
        r = await chan.run(["python3", "-c", FLOOR, str(n)])
        cpu.append(qemu_cpu(chan) - c0 - idle * (time.perf_counter() - t0))
        if n:
            wall = float(r.stdout)
    return wall, (cpu[0] - cpu[1]) / 40


async def timed_run(chan: GuestChannel, argv: list[str], idle: float = 0.0, **kw: Any) -> tuple[float, float, float]:
    """(wall, QEMU CPU minus idle ticks, our own CPU) of one exec, in seconds."""
    c0, h0, t = qemu_cpu(chan), time.process_time(), time.perf_counter()
    r = await chan.run(argv, **kw)
    dt = time.perf_counter() - t
    host = time.process_time() - h0
    cpu = qemu_cpu(chan) - c0 - idle * dt
    assert r.exit_code == 0, r
    return dt, cpu, host


def parse_marks(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for word in text.split():
        k, _, v = word.partition("=")
        while k in out:
            k += "'"
        out[k] = float(v) / 1e3  # ms
    return out


async def bench(
    n: int, baseline: Path | None, profile: bool, out_dir: Path, a_extra: str, b_extra: str
) -> dict[str, Any]:
    image = Builder(default_cache()).build()
    old = attrs.evolve(image, initrd=baseline) if baseline else image
    work = Path(tempfile.mkdtemp(prefix="sandvisor-bench-exec-"))
    res: dict[str, Any] = {
        "n": n,
        "loadavg_start": os.getloadavg(),
        "A": {"initrd": str(old.initrd), "cmdline": a_extra},
        "B": {"initrd": str(image.initrd), "cmdline": b_extra},
    }
    try:
        async with AsyncExitStack() as stack:
            chans = {}
            if n:
                chans = {
                    "A": await boot(stack, old, work / "a", a_extra),
                    "B": await boot(stack, image, work / "b", b_extra),
                }
            cases: dict[str, tuple[list[str], dict[str, Any]]] = {
                "true": (["/bin/true"], {}),
                "true_path": (["true"], {}),  # argv[0] resolved on PATH
                "true_user": (["/bin/true"], {"user": "nobody"}),  # setuid: fork path
                "echo": (["/bin/echo", "hi"], {}),  # one output chunk and its credit
            }
            if n:
                await ab(chans, cases, n, res)
            if profile:
                await profile_run(stack, image, work, cases, res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "exec.json").write_text(json.dumps(res, indent=2))
    md = markdown(res)
    (out_dir / "exec.md").write_text(md)
    print(md)
    return res


async def ab(
    chans: dict[str, GuestChannel], cases: dict[str, tuple[list[str], dict[str, Any]]], n: int, res: dict[str, Any]
) -> None:
    for c in chans.values():  # warm both
        for argv, kw in cases.values():
            for _ in range(3):
                await timed_run(c, argv, **kw)
    idle = {k: await idle_rate(c) for k, c in chans.items()}
    floors: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
    rt: dict[str, dict[str, list[tuple[float, float, float]]]] = {k: {"A": [], "B": []} for k in cases}
    ping: dict[str, list[float]] = {"A": [], "B": []}
    rounds = n
    for i in range(rounds):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        if i % 5 == 0:
            for k in order:
                floors[k].append(await spawn_floor(chans[k], idle[k]))
        for case, (argv, kw) in cases.items():
            for k in order:
                rt[case][k].append(await timed_run(chans[k], argv, idle[k], **kw))
        for k in order:
            t = time.perf_counter()
            await chans[k].ping()
            ping[k].append(time.perf_counter() - t)
    res["loadavg_end"] = os.getloadavg()
    res["rounds"] = rounds
    for k in ("A", "B"):
        fl = med([f[0] for f in floors[k]])
        fl_cpu = med([f[1] for f in floors[k]])
        res[k] |= {
            "idle_qemu_cpu_per_s": idle[k],
            "in_guest_spawn_ms": fl * 1e3,
            "in_guest_spawn_cpu_ms": fl_cpu * 1e3,
            "ping_ms": med(ping[k]) * 1e3,
            **{f"{case}_ms": med([x[0] for x in rt[case][k]]) * 1e3 for case in cases},
            **{f"{case}_cpu_ms": med([x[1] for x in rt[case][k]]) * 1e3 for case in cases},
            **{f"{case}_host_cpu_ms": med([x[2] for x in rt[case][k]]) * 1e3 for case in cases},
            "overhead_ms": (med([x[0] for x in rt["true"][k]]) - fl) * 1e3,
            "overhead_cpu_ms": (med([x[1] for x in rt["true"][k]]) - fl_cpu) * 1e3,
        }
    res["overhead_ratio_A_over_B"] = res["A"]["overhead_ms"] / max(res["B"]["overhead_ms"], 1e-6)
    res["overhead_cpu_ratio_A_over_B"] = res["A"]["overhead_cpu_ms"] / max(res["B"]["overhead_cpu_ms"], 1e-6)
    res["raw"] = {"floors": floors, "rt": rt}


async def profile_run(
    stack: AsyncExitStack,
    image: Image,
    work: Path,
    cases: dict[str, tuple[list[str], dict[str, Any]]],
    res: dict[str, Any],
) -> None:
    res.setdefault("loadavg_start", os.getloadavg())
    chan = await boot(stack, image, work / "p", extra="sandvisor.execprof=1 clocksource=tsc tsc=reliable")
    fl, _ = await spawn_floor(chan)
    prof: dict[str, list[dict[str, float]]] = {}
    for case, (argv, kw) in cases.items():
        for _ in range(3):
            await timed_run(chan, argv, **kw)
        chan.guest_logs.clear()
        rts = []
        for _ in range(20):
            rts.append((await timed_run(chan, argv, **kw))[0])
            await chan.ping()  # the marks' Log arrives after the exit
        marks = [parse_marks(x.partition(": ")[2]) for x in chan.guest_logs if x.startswith("execprof")]
        prof[case] = marks
        res.setdefault("profile", {})[case] = {
            "round_trip_ms": med(rts) * 1e3,
            "in_guest_spawn_ms": fl * 1e3,
            "marks_median_ms": {k: med([m[k] for m in marks if k in m]) for k in marks[0]},
        }
    res["loadavg_end"] = os.getloadavg()


def markdown(r: dict[str, Any]) -> str:
    lines = [f"load average start {r['loadavg_start'][0]:.2f}, end {r['loadavg_end'][0]:.2f} (2 cores)", ""]
    if "A" in r:
        a, b = r["A"], r["B"]
        lines += [
            f"## exec agent overhead, A (baseline runtime) vs B (this tree), interleaved, TCG, {r['rounds']} rounds",
            "",
            "| measure (median) | A | B | A/B |",
            "|---|---|---|---|",
        ]
        lines.insert(-2, f"A: {a['initrd']} `{a['cmdline']}`; B: {b['initrd']} `{b['cmdline']}`")
        lines.insert(-2, "")
        for key in (k for k in a if k.endswith("_ms")):
            lines.append(f"| {key} | {a[key]:.2f} | {b[key]:.2f} | {a[key] / max(b[key], 1e-6):.2f}x |")
    for case, p in r.get("profile", {}).items():
        marks = " ".join(f"{k}={v:.2f}" for k, v in p["marks_median_ms"].items())
        lines += [
            "",
            f"profile `{case}` (B with sandvisor.execprof=1): round trip {p['round_trip_ms']:.2f} ms, "
            f"in-guest spawn {p['in_guest_spawn_ms']:.2f} ms; guest marks (ms since the frame's read): {marks}",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30)
    ap.add_argument("--baseline-initrd", type=Path, help="A's runtime (default: this tree's, as B's)")
    # the same clocksource for both: without it the watchdog picks tsc or refined-jiffies
    # per boot (load decides), and the two guests' clocks and idle ticks differ
    ap.add_argument("--a-extra", default="tsc=reliable", help="A's extra kernel command line")
    ap.add_argument("--b-extra", default="tsc=reliable", help="B's extra kernel command line")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="results", type=Path)
    a = ap.parse_args()
    trio.run(bench, a.n, a.baseline_initrd, a.profile, a.out, a.a_extra, a.b_extra)


if __name__ == "__main__":
    main()
