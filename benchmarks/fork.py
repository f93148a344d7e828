"""Fork against checkpoint + N restores, interleaved in one run, and the memory of a family.

Latency: a running sandbox (``--mem`` MiB, its guest holding ``--touch`` MiB of non-zero
pages in a tmpfs) is made into ``--forks`` copies, each round both ways, in alternating
order, through the async SDK:

* fork: ``await sb.fork(N)`` -- the parent's pause (ForkResponse.paused_ms), and the time
  until all N children have answered a Run;
* by hand: ``await sb.checkpoint()`` then N ``AsyncSandbox.restore`` side by side, then a
  Run in each -- the checkpoint's pause, the time until all N answered;
* one restore of the same snapshot alone (the "within 2x a single restore" reference).

Density: a ``--dmem`` MiB sandbox with ``--dtouch`` MiB touched, forked ``--dforks``
times; with every child alive: the sum of the QEMU processes' PSS (smaps_rollup: a page
mapped by k processes counts 1/k in each, so the family's shared memory file is counted
once) and each child's private pages right after the fork; then the same number of
cold-booted sandboxes, each touching the same memory, alive at once: their PSS sum.

Where the time goes: each checkpoint's steps (its log line: stage, freeze, stop, disk,
state, memory, cont, write, finish), and the CPU seconds of each child's QEMU and of the
single restore's by the time they answered (with N children on C cores, N x that / C is
what the host must at least spend before all N answer).

Before/after in one run: ``--ab BASE_TREE`` runs this file of BASE_TREE (a ``git worktree``
of the base; its own ``actors``, by PYTHONPATH) and of this tree as alternating
subprocesses, ``--ab-rounds`` each, and writes both columns (fork-ab.json, fork-ab.md).

Usage: python benchmarks/fork.py [-n ROUNDS] [--out results/] [--mem 512 --touch 300 --forks 8]
       [--dmem 256 --dtouch 200 --dforks 16] [--ab ../../base --ab-rounds 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _harness import in_process_daemon, summary, write_results

from actors.sandboxes.usage import proc_memory_split
from supervisor.client import AsyncSandbox, SandboxError
from supervisor.client.sdk import snapshot_plans
from supervisor.client.sdk.aio import drive


def touch(mib: int) -> list[str]:
    """Fill ``mib`` MiB of guest memory with non-zero pages (a tmpfs: page cache stays)."""
    return [
        "sh",
        "-c",
        f"mkdir -p /mnt/t && mount -t tmpfs -o size={mib + 16}m none /mnt/t && "
        f"yes abcdefghijklmnop | head -c {mib}m > /mnt/t/fill",
    ]


def pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Steps(logging.Handler):
    """The checkpoints' steps, from their log lines (actors/sandboxes/checkpoint.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = re.search(r"\(ms: ([^)]*)\)", record.getMessage())
        if m:
            self.last = {k: float(v) for k, v in (x.rsplit(" ", 1) for x in m.group(1).split(", "))}

    def take(self) -> dict[str, float]:
        out, self.last = self.last, {}
        return out


STEPS = Steps()


def cpu_s(registry: Any, ids: list[str]) -> list[float]:
    return [registry.get(i).host_cpu_seconds() for i in ids]


async def all_answer(kids: list[AsyncSandbox]) -> None:
    async with trio.open_nursery() as n:
        for k in kids:
            n.start_soon(k.run, ["true"])


async def remove_all(kids: list[AsyncSandbox]) -> None:
    async with trio.open_nursery() as n:
        for k in kids:
            n.start_soon(lambda k=k: k.remove(force=True))


async def by_fork(parent: AsyncSandbox, n: int, registry: Any, extra: dict[str, list[Any]]) -> tuple[float, float]:
    t0 = time.monotonic()
    r = await drive(parent.socket, snapshot_plans.fork(parent, n))
    t_call = time.monotonic() - t0
    kids = [AsyncSandbox(c.id, socket=parent.socket, detached=True) for c in r.sandboxes]
    await all_answer(kids)
    took = time.monotonic() - t0
    extra["fork_call_s"].append(t_call)
    extra["fork_child_cpu_s"].extend(cpu_s(registry, [k.id for k in kids]))
    extra["fork_steps_ms"].append(STEPS.take())
    await remove_all(kids)  # (the hidden snapshot goes with the last child)
    return took, r.paused_ms / 1e3


async def by_hand(
    parent: AsyncSandbox, n: int, tag: str, registry: Any, extra: dict[str, list[Any]]
) -> tuple[float, float, float]:
    sock = parent.socket
    t0 = time.monotonic()
    cp = await parent.checkpoint()
    extra["hand_steps_ms"].append(STEPS.take())
    kids: list[AsyncSandbox] = []

    async def one(i: int) -> None:
        kids.append(await AsyncSandbox.restore(cp.snapshot_id, name=f"{tag}-{i}", detached=True, socket=sock))

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    await all_answer(kids)
    took = time.monotonic() - t0
    await remove_all(kids)
    t1 = time.monotonic()
    single = await AsyncSandbox.restore(cp.snapshot_id, name=f"{tag}-one", detached=True, socket=sock)
    await single.run(["true"])
    one_s = time.monotonic() - t1
    extra["single_cpu_s"].extend(cpu_s(registry, [single.id]))
    await single.remove(force=True)  # (the snapshot stays: the parent's disk now stands on it)
    return took, cp.paused_ms / 1e3, one_s


def qemu_pid(registry: Any, id: str) -> int:
    return int(registry.get(id).record.qemu_pid)


async def density(registry: Any, sock: str, mem: int, touch_mib: int, k: int, cold_k: int = 0) -> dict[str, Any]:
    """``k`` forks alive at once, then ``cold_k`` cold boots (default ``k``); with fewer
    cold boots than forks, their sum is scaled to ``k`` (cold boots share nothing but
    the host's page cache of the image, so each costs the same: said in the report)."""
    cold_k = cold_k or k
    out: dict[str, Any] = {"mem_mib": mem, "touch_mib": touch_mib, "count": k, "cold_count": cold_k}
    parent = await AsyncSandbox.create("dens", memory_mib=mem, detached=True, socket=sock)
    await parent.run(touch(touch_mib))
    r = await drive(sock, snapshot_plans.fork(parent, k, name_prefix="dk"))
    kids = [AsyncSandbox(c.id, socket=sock, detached=True) for c in r.sandboxes]
    await trio.sleep(2)
    own = [proc_memory_split(qemu_pid(registry, c.id))[1] for c in kids]
    out["fork_private_mib"] = summary([o / 2**20 for o in own])
    out["fork_pss_sum_mib"] = sum(pss(qemu_pid(registry, c.id)) for c in kids) / 2**20
    out["parent_pss_mib"] = pss(qemu_pid(registry, "dens")) / 2**20
    # the family's memory: the sealed memfd the children map (kept by the supervisor; its
    # pages a child maps are in that child's PSS too: this over-counts them) and the file
    cells = registry.settings.cells
    out["shared_memfd_mib"] = (cells.sealed.cached_bytes if cells is not None else 0) / 2**20
    snap = registry.snapshots.snapshots.get(r.snapshot_id)
    out["memory_file_mib"] = (snap.sizes.get("memory", 0) if snap is not None else 0) / 2**20
    out["load_at_fork"] = Path("/proc/loadavg").read_text().split()[:3]
    await remove_all([*kids, parent])
    cold: list[AsyncSandbox] = []

    booting = trio.CapacityLimiter(4)  # (all alive at the end; 64 TCG boots at once would time out)

    touched: list[AsyncSandbox] = []
    failures: list[str] = []  # (a cold guest that died touching its memory: said, not counted)

    async def boot(i: int) -> None:
        async with booting:
            sb = await AsyncSandbox.create(f"cold{i}", memory_mib=mem, detached=True, socket=sock)
            cold.append(sb)
            try:
                await sb.run(touch(touch_mib))
            except SandboxError as exc:
                info = await sb.inspect()
                failures.append(f"{sb.id}: {exc.code}: {exc.message} (then {info.state}: {info.error})")
                return
        touched.append(sb)

    async with trio.open_nursery() as n:
        for i in range(cold_k):
            n.start_soon(boot, i)
    await trio.sleep(2)
    measured = sum(pss(qemu_pid(registry, c.id)) for c in touched) / 2**20
    out["cold_failures"] = failures
    out["cold_pss_measured_mib"] = measured
    out["cold_pss_sum_mib"] = measured * k / max(len(touched), 1)
    await remove_all(cold)
    out["ratio_fork_to_cold"] = out["fork_pss_sum_mib"] / max(out["cold_pss_sum_mib"], 1)
    family = out["fork_pss_sum_mib"] + out["shared_memfd_mib"]
    out["family_total_mib"] = family
    out["ratio_family_to_cold"] = family / max(out["cold_pss_sum_mib"], 1)
    return out


async def latency(
    a: argparse.Namespace,
    sock: str,
    registry: Any,
    extra: dict[str, list[Any]],
    fork_t: list[float],
    fork_pause: list[float],
    hand_t: list[float],
    hand_pause: list[float],
    single: list[float],
) -> None:
    parent = await AsyncSandbox.create("fbp", memory_mib=a.mem, detached=True, socket=sock)
    if a.parent == "restored":
        # what a default Create (a restore of its boot template) or a fork's child is:
        # RAM mapped privately from a snapshot's memory, the guest's writes its own pages
        cp = await parent.checkpoint()
        await parent.remove(force=True)
        parent = await AsyncSandbox.restore(cp.snapshot_id, name="fbr", detached=True, socket=sock)
    await parent.run(touch(a.touch))
    for i in range(a.n):
        for way in ("fork", "hand") if i % 2 == 0 else ("hand", "fork"):
            print(f"round {i}: {way}", flush=True)
            if way == "fork":
                t, p = await by_fork(parent, a.forks, registry, extra)
                fork_t.append(t)
                fork_pause.append(p)
            else:
                t, p, s = await by_hand(parent, a.forks, f"h{i}", registry, extra)
                hand_t.append(t)
                hand_pause.append(p)
                single.append(s)
    await parent.remove(force=True)


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"rounds": a.n, "mem_mib": a.mem, "touch_mib": a.touch, "forks": a.forks}
    res["parent"] = a.parent
    res["load_start"] = Path("/proc/loadavg").read_text().split()[:3]
    fork_t: list[float] = []
    fork_pause: list[float] = []
    hand_t: list[float] = []
    hand_pause: list[float] = []
    single: list[float] = []
    extra: dict[str, list[Any]] = {
        k: [] for k in ("fork_call_s", "fork_child_cpu_s", "single_cpu_s", "fork_steps_ms", "hand_steps_ms")
    }
    logging.getLogger("sandvisor.checkpoint").addHandler(STEPS)
    logging.getLogger("sandvisor.checkpoint").setLevel(logging.INFO)
    # (a density run's forks and their parent, beside serve's default cap of 64)
    async with in_process_daemon("sv-forkb-", max_sandboxes=max(64, a.dforks + 8)) as (cfg, registry):
        registry.pools.templates = False
        sock = str(cfg.socket)
        if a.n:
            await latency(a, sock, registry, extra, fork_t, fork_pause, hand_t, hand_pause, single)
        if a.dforks:
            print("density", flush=True)
            res["density"] = await density(registry, sock, a.dmem, a.dtouch, a.dforks, a.dcold)
    res["load_end"] = Path("/proc/loadavg").read_text().split()[:3]
    res["fork_all_answer_s"] = summary(fork_t)
    res["fork_parent_pause_s"] = summary(fork_pause)
    res["hand_all_answer_s"] = summary(hand_t)
    res["hand_checkpoint_pause_s"] = summary(hand_pause)
    res["single_restore_s"] = summary(single)
    res["fork_call_s"] = summary(extra["fork_call_s"])
    res["fork_child_cpu_s"] = summary(extra["fork_child_cpu_s"])
    res["single_cpu_s"] = summary(extra["single_cpu_s"])
    res["fork_steps_ms"] = extra["fork_steps_ms"]
    res["hand_steps_ms"] = extra["hand_steps_ms"]
    res["cores"] = os.cpu_count()
    write_results(Path(a.out), "fork" if a.n else "fork-density", res, markdown(res))
    return res


def markdown(res: dict[str, Any]) -> str:
    rows = [] if not res["rounds"] else latency_rows(res)
    if "density" in res:
        rows += density_rows(res["density"])
    return "\n".join(rows) + "\n"


def latency_rows(res: dict[str, Any]) -> list[str]:
    ms = lambda s: f"{s['p50'] * 1e3:.0f}"
    return [
        f"## fork({res['forks']}) of a running {res['mem_mib']} MiB sandbox ({res['touch_mib']} MiB touched), "
        f"against checkpoint + {res['forks']} restores (TCG, {res['rounds']} rounds interleaved)",
        "",
        f"Load average at start {' '.join(res['load_start'])}, at end {' '.join(res['load_end'])}.",
        "",
        "| row | p50 (ms) | runs |",
        "|---|---|---|",
        f"| fork: parent paused | {ms(res['fork_parent_pause_s'])} | {res['fork_parent_pause_s']['n']} |",
        f"| fork: all children answered a Run | {ms(res['fork_all_answer_s'])} | {res['fork_all_answer_s']['n']} |",
        f"| by hand: checkpoint's pause | {ms(res['hand_checkpoint_pause_s'])} "
        f"| {res['hand_checkpoint_pause_s']['n']} |",
        f"| by hand: checkpoint + restores, all answered | {ms(res['hand_all_answer_s'])} "
        f"| {res['hand_all_answer_s']['n']} |",
        f"| one restore alone, answered a Run | {ms(res['single_restore_s'])} | {res['single_restore_s']['n']} |",
        f"| CPU s of a fork child's QEMU by then (p50) | {res['fork_child_cpu_s']['p50']:.2f} "
        f"| {res['fork_child_cpu_s']['n']} |",
        f"| CPU s of the single restore's QEMU by then (p50) | {res['single_cpu_s']['p50']:.2f} "
        f"| {res['single_cpu_s']['n']} |",
        "",
        f"Checkpoint steps (ms), fork: {res['fork_steps_ms']}; by hand: {res['hand_steps_ms']}",
    ]


def density_rows(d: dict[str, Any]) -> list[str]:
    return [
        "",
        f"## Density: {d['count']} forks of a {d['mem_mib']} MiB sandbox ({d['touch_mib']} MiB touched) "
        f"against {d['count']} cold boots touching the same",
        "",
        "| row | MiB |",
        "|---|---|",
        f"| forks alive: sum of PSS (the shared memory file counted once) | {d['fork_pss_sum_mib']:.0f} |",
        f"| their parent's PSS | {d['parent_pss_mib']:.0f} |",
        f"| forks + parent | {d['fork_pss_sum_mib'] + d['parent_pss_mib']:.0f} |",
        f"| {d.get('cold_count', d['count'])} cold boots alive: sum of PSS | "
        f"{d.get('cold_pss_measured_mib', d['cold_pss_sum_mib']):.0f} |",
        f"| {d['count']} cold boots (scaled from them) | {d['cold_pss_sum_mib']:.0f} |",
        f"| forks / cold | {d['ratio_fork_to_cold']:.2f} |",
        f"| a fork's private memory right after the fork (p50) | {d['fork_private_mib']['p50']:.1f} |",
        f"| the family's sealed memory (memfd) | {d['shared_memfd_mib']:.0f} |",
        f"| forks' PSS + that memory | {d['family_total_mib']:.0f} |",
        f"| (forks' PSS + memory) / cold | {d['ratio_family_to_cold']:.2f} |",
    ]


def ab(a: argparse.Namespace) -> None:
    """Before/after: this file of ``a.ab`` (the base tree) and of this tree, alternating."""
    here = Path(__file__).resolve().parents[1]
    trees = {"before": Path(a.ab).resolve(), "after": here}
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for i in range(a.ab_rounds):
        for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
            tree = trees[name]
            with tempfile.TemporaryDirectory() as out:
                # (this file, the tree's code: the base's own benchmark may lack an option)
                cmd = [sys.executable, __file__, "-n", "1", "--dforks", "0", "--out", out, "--parent", a.parent]
                cmd += ["--mem", str(a.mem), "--touch", str(a.touch), "--forks", str(a.forks)]
                print(f"ab round {i}: {name}", flush=True)
                env = {**os.environ, "PYTHONPATH": str(tree)}
                subprocess.run(cmd, cwd=tree / "benchmarks", env=env, check=True, stdout=subprocess.DEVNULL)
                runs[name].append(json.loads((Path(out) / "fork.json").read_text()))
    keys = [
        ("fork_parent_pause_s", "fork: parent paused"),
        ("fork_all_answer_s", "fork: all children answered a Run"),
        ("hand_checkpoint_pause_s", "by hand: checkpoint's pause"),
        ("hand_all_answer_s", "by hand: checkpoint + restores, all answered"),
        ("single_restore_s", "one restore alone, answered a Run"),
    ]
    res: dict[str, Any] = {"runs": runs, "mem_mib": a.mem, "touch_mib": a.touch, "forks": a.forks, "parent": a.parent}
    rows = [
        f"## Before/after: fork({a.forks}) of a {a.mem} MiB sandbox ({a.touch} MiB touched; {a.parent}), "
        f"{a.ab_rounds} runs each, alternating",
        "",
        "Load average at each run's start: "
        + "; ".join(f"{n} {' '.join(r['load_start'])}" for n in runs for r in runs[n]),
        "",
        "| row | before (ms, each run) | after (ms, each run) |",
        "|---|---|---|",
    ]
    for k, label in keys:
        cell = {n: ", ".join(f"{r[k]['p50'] * 1e3:.0f}" for r in runs[n]) for n in runs}
        rows.append(f"| {label} | {cell['before']} | {cell['after']} |")
    write_results(Path(a.out), "fork-ab", res, "\n".join(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=2, help="rounds (each: one fork, one by hand)")
    ap.add_argument("--out", default="results")
    ap.add_argument("--mem", type=int, default=512)
    ap.add_argument("--touch", type=int, default=300)
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--dmem", type=int, default=256)
    ap.add_argument("--dtouch", type=int, default=200)
    ap.add_argument("--dforks", type=int, default=16, help="0: no density run")
    ap.add_argument("--dcold", type=int, default=0, help="cold boots to compare (0: as many as --dforks)")
    ap.add_argument("--ab", default="", help="a base tree: before/after latency runs, alternating")
    ap.add_argument("--ab-rounds", type=int, default=2)
    ap.add_argument(
        "--parent",
        choices=("cold", "restored"),
        default="cold",
        help="the parent: cold-booted (its RAM a shared file) or restored from a snapshot (mapped privately)",
    )
    a = ap.parse_args()
    if a.ab:
        ab(a)
    else:
        trio.run(bench, a)


if __name__ == "__main__":
    main()
