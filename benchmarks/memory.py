"""Bounded memory: TCG's translation cache size chosen by measurement,
and memory a guest frees going back to the host.

tb-size sweep: one throwaway supervisor per size (``DaemonConfig.tb_size_mib``; 0 is
QEMU's default, 1 GiB), all in one run, side by side, so a shared machine's load hits
every size alike. Per round, for each size in turn (the order rotates):

* boot: a Create with boot templates off (Create RPC to ready: the boot path runs
  the guest kernel's and guestd's code through the translator the first time);
* exec: Runs of ``true`` (``EXECS``) and ``python3 -c pass`` (a quarter as many),
  one call per size in turn across the round's live sandboxes (p50 of each round).

Then busy: one sandbox per size, all at once, each running LOOP (processes spawned
in a shell loop: the translation cache's worst case) for ``--busy-seconds``; QEMU's
max RSS (sampled every 2 s) against guest RAM + 128 MiB, and loops done (throughput).

Free page reporting: on a supervisor with the defaults (root: balloons need the
jail), a guest allocates and frees 150 MiB; seconds until its QEMU's RSS fell by 100
MiB from the peak (most of it back), for a cold boot and clones of its template.

Usage: python benchmarks/memory.py [-n 3] [--busy-seconds 90] [--out results/]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio
from _harness import pct, write_results

from actors.errors import DomainError
from actors.registry import Registry
from supervisor.client import AsyncSandbox
from supervisor.main.throwaway import supervisor, workdir

MIB = 1 << 20
GUEST_MIB = 256  # the supervisor's default guest RAM
HEADROOM_MIB = 128  # the budget: a busy sandbox within guest RAM + 128 MiB
SIZES = (32, 64, 128, 256, 0)  # MiB; 0: QEMU's default (1 GiB)
EXECS = 20
LOOP = "i=0; while true; do ls /usr/bin >/dev/null; python3 -c 1; i=$((i+1)); echo $i >/tmp/loops; done"
ALLOC_FREE = "b = bytearray(150 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def label(tb: int) -> str:
    return f"{tb}" if tb else "default (1024)"


async def sweep(n: int, busy_seconds: float) -> dict[str, Any]:
    boot: dict[int, list[float]] = {tb: [] for tb in SIZES}
    execs: dict[int, list[float]] = {tb: [] for tb in SIZES}
    pys: dict[int, list[float]] = {tb: [] for tb in SIZES}
    busy: dict[int, dict[str, Any]] = {}
    async with AsyncExitStack() as stack:
        socks: dict[int, Path] = {}
        regs: dict[int, Registry] = {}
        for tb in SIZES:
            work = stack.enter_context(workdir(f"sv-mem-{tb}-"))
            cfg, reg = await stack.enter_async_context(supervisor(work, templates=False, tb_size_mib=tb))
            socks[tb], regs[tb] = cfg.socket, reg
        for r in range(n):
            order = SIZES[r % len(SIZES) :] + SIZES[: r % len(SIZES)]
            live: dict[int, AsyncSandbox] = {}
            for tb in order:
                t0 = time.monotonic()
                live[tb] = await AsyncSandbox.create(f"b{r}", socket=socks[tb], timeout=300)
                boot[tb].append(time.monotonic() - t0)
            # one call per size in turn: a load spike hits every size alike
            lat: dict[str, dict[int, list[float]]] = {"true": {tb: [] for tb in SIZES}, "py": {tb: [] for tb in SIZES}}
            for j in range(EXECS):
                for tb in order:
                    for kind, cmd in (("true", ["true"]), ("py", ["python3", "-c", "pass"])):
                        if kind == "py" and j % 4:
                            continue
                        t1 = time.monotonic()
                        res = await live[tb].run(cmd)
                        lat[kind][tb].append(time.monotonic() - t1)
                        assert res.exit_code == 0, res
            for tb in SIZES:
                execs[tb].append(pct(lat["true"][tb], 50))
                pys[tb].append(pct(lat["py"][tb], 50))
                await live[tb].remove(force=True)
            print(f"round {r + 1}/{n}: load {os.getloadavg()[0]:.1f}", flush=True)
        print(json.dumps({tb: [boot[tb], execs[tb], pys[tb]] for tb in SIZES}), flush=True)  # (kept if busy fails)
        if busy_seconds > 0:
            sbs = {}
            for tb in SIZES:
                sbs[tb] = await AsyncSandbox.create("busy", socket=socks[tb], timeout=300, cmd=["sh", "-c", LOOP])
            pids = {tb: regs[tb].get("busy").record.qemu_pid for tb in SIZES}
            samples: dict[int, list[float]] = {tb: [] for tb in SIZES}
            died: dict[int, str] = {}  # a cell's memory limit (guest RAM + overhead) kills a QEMU that outgrows it
            t_end = time.monotonic() + busy_seconds
            while time.monotonic() < t_end:
                await trio.sleep(2)
                for tb in SIZES:
                    if tb in died:
                        continue
                    try:
                        samples[tb].append(rss_mib(pids[tb]))
                    except (FileNotFoundError, ProcessLookupError):
                        await trio.sleep(0.5)  # its sandbox's record says why
                        died[tb] = regs[tb].get("busy").record.error or "QEMU exited"
            for tb, sb in sbs.items():
                loops = b""
                if tb not in died:
                    try:  # (a Run beside the sandbox's own command is refused: the channel's, as jail.py)
                        got = await regs[tb].get("busy").guest_call(lambda g: g.channel.run(["cat", "/tmp/loops"]))
                        loops = got.stdout.strip()
                    except DomainError:  # killed since the last sample
                        died[tb] = regs[tb].get("busy").record.error or "QEMU exited"
                if tb in died:
                    busy[tb] = {"died": died[tb], "rss_mib_max": round(max(samples[tb], default=0.0), 1)}
                    await sb.remove(force=True)
                    continue
                busy[tb] = {
                    "loops": int(loops or 0),
                    "rss_mib_max": round(max(samples[tb]), 1),
                    "rss_mib_end": round(samples[tb][-1], 1),
                    "within_target": max(samples[tb]) <= GUEST_MIB + HEADROOM_MIB,
                }
                await sb.remove(force=True)
    return {
        str(tb): {
            "boot_s": {"p50": statistics.median(boot[tb]), "samples": [round(x, 3) for x in boot[tb]]},
            "exec_true_ms": {
                "p50": statistics.median(execs[tb]) * 1000,
                "samples": [round(x * 1000, 2) for x in execs[tb]],
            },
            "exec_python_ms": {
                "p50": statistics.median(pys[tb]) * 1000,
                "samples": [round(x * 1000, 2) for x in pys[tb]],
            },
            "busy": busy.get(tb),
        }
        for tb in SIZES
    }


async def gives_back(reg: Registry, sb: AsyncSandbox) -> dict[str, float]:
    pid = reg.get(sb.id).record.qemu_pid
    before = rss_mib(pid)
    r = await sb.run(["python3", "-c", ALLOC_FREE])
    assert r.exit_code == 0, r
    t0 = time.monotonic()
    peak = rss_mib(pid)
    with trio.fail_after(60):
        while rss_mib(pid) > peak - 100:
            await trio.sleep(0.1)
    back_s = time.monotonic() - t0
    with trio.move_on_after(5):  # what it settles at (the page cache of python3's files stays)
        while rss_mib(pid) > before + 50:
            await trio.sleep(0.1)
    return {
        "before_mib": round(before, 1),
        "peak_mib": round(peak, 1),
        "back_s": round(back_s, 2),
        "settled_mib": round(rss_mib(pid), 1),
    }


async def reporting(n: int) -> dict[str, Any]:
    out: dict[str, list[dict[str, float]]] = {"boot": [], "clone": []}
    with workdir("sv-mem-fpr-") as work:
        async with supervisor(work) as (cfg, reg):
            if not reg.settings.balloon:
                return {"skipped": "no balloons (not root)"}
            for i in range(n):
                async with await AsyncSandbox.create(f"c{i}", socket=cfg.socket, timeout=300) as sb:
                    kind = "clone" if reg.snapshots.templates() and i else "boot"
                    out[kind].append(await gives_back(reg, sb))
    return {k: {"back_s_p50": statistics.median(x["back_s"] for x in v), "samples": v} for k, v in out.items() if v}


async def bench(n: int, busy_seconds: float) -> dict[str, Any]:
    res: dict[str, Any] = {"n": n, "cores": os.cpu_count(), "guest_mib": GUEST_MIB, "load_start": os.getloadavg()}
    res["tb_size"] = await sweep(n, busy_seconds)
    res["busy_seconds"] = busy_seconds
    res["free_page_reporting"] = await reporting(n + 1)
    res["load_end"] = os.getloadavg()
    return res


def markdown(res: dict[str, Any]) -> str:
    tb = res["tb_size"]
    ref = tb["0"]
    lines = [
        f"## Bounded memory: TCG's tb-size (TCG, {res['cores']} cores, {res['guest_mib']} MiB guests, n={res['n']})",
        "",
        f"One supervisor per size, side by side in one run (1-minute load {res['load_start'][0]:.1f} at the start, "
        f"{res['load_end'][0]:.1f} at the end). Boot: Create with templates off, to ready. Exec: Run `true` "
        f"({EXECS} per round) and `python3 -c pass` ({EXECS // 4}), one call per size in turn; p50 per round, "
        "median of rounds. Busy: all sizes at once, a shell loop spawning processes "
        f"for {res['busy_seconds']:g} s; target RSS <= guest RAM + {HEADROOM_MIB} MiB "
        f"= {GUEST_MIB + HEADROOM_MIB} MiB. "
        "Ratios against QEMU's default (1 GiB) measured in the same run.",
        "",
        "| tb-size (MiB) | boot p50 (s) | vs default | exec `true` p50 (ms) | vs default | `python3 -c pass` p50 (ms) "
        "| vs default | busy loops | vs most | busy RSS max (MiB) | within target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # the busy loops' peer: the size that did most (QEMU's default may be killed by its cell's limit)
    most = max(((tb[str(x)]["busy"] or {}).get("loops", 0) for x in SIZES), default=0)
    for size in SIZES:
        m = tb[str(size)]
        b = m["busy"] or {}
        loops_ratio = f"{b['loops'] / most:.2f}" if b.get("loops") and most else "-"
        if "died" in b:
            b = {"loops": "killed", "rss_mib_max": f">{b['rss_mib_max']}", "within_target": f"no: {b['died']}"}
        lines.append(
            f"| {label(size)} | {m['boot_s']['p50']:.2f} | {m['boot_s']['p50'] / ref['boot_s']['p50']:.2f} "
            f"| {m['exec_true_ms']['p50']:.1f} | {m['exec_true_ms']['p50'] / ref['exec_true_ms']['p50']:.2f} "
            f"| {m['exec_python_ms']['p50']:.0f} | {m['exec_python_ms']['p50'] / ref['exec_python_ms']['p50']:.2f} "
            f"| {b.get('loops', '-')} | {loops_ratio} | {b.get('rss_mib_max', '-')} | {b.get('within_target', '-')} |"
        )
    fpr = res["free_page_reporting"]
    lines += ["", "## Free page reporting (virtio-balloon)", ""]
    if "skipped" in fpr:
        lines.append(f"Skipped: {fpr['skipped']}.")
    else:
        lines += [
            "A guest allocates and frees 150 MiB (python3); seconds from the Run's exit until its QEMU's RSS "
            "fell by 100 MiB from the peak (issue 14: most of it back within 10 s).",
            "",
            "| sandbox | runs | 100 MiB back within (s, p50) | RSS before / peak / settled (MiB, first run) |",
            "|---|---|---|---|",
        ]
        for k, v in fpr.items():
            s0 = v["samples"][0]
            runs = len(v["samples"])
            mib = f"{s0['before_mib']} / {s0['peak_mib']} / {s0['settled_mib']}"
            lines.append(f"| {k} | {runs} | {v['back_s_p50']:.2f} | {mib} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=3)
    ap.add_argument("--busy-seconds", type=float, default=90)
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    res = trio.run(bench, a.n, a.busy_seconds)
    write_results(Path(a.out), "memory", res, markdown(res))


if __name__ == "__main__":
    main()
