"""The supervisor's one thread under an output flood.

``sandvisor serve`` as a child process; a guest floods output (``yes`` of an 80-byte
line) through a Run whose client drains it, while another client follows the log
(``logs -f``), both as CLI processes. This process measures Inspect round trips on
its own connection: idle first, then during the flood. Target: the flood's p99 under
50 ms, reported next to the idle p99 and the log throughput the supervisor wrote.

Usage: python benchmarks/flood.py [-n N] [--out results/] [--seconds S]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
from _harness import summary, write_results

from supervisor.client import AsyncConnection, connect
from supervisor.main.throwaway import Workdir, supervisor_process, workdir

LINE = "0123456789" * 8  # 80 bytes + newline
TARGET_P99_MS = 50.0


async def inspect_latencies(c: AsyncConnection, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await c.call("Inspect", {"id": "flood"})
        out.append(time.perf_counter() - t)
        await trio.sleep(0.005)  # a poller, not a tight loop: the flood gets its turns
    return out


def log_bytes(work: Workdir) -> int:
    return sum(p.stat().st_size for p in (work.state / "sandboxes").glob("*/log*") if p.is_file())


async def bench(work: Workdir, env: dict[str, str], n: int, seconds: int) -> dict[str, Any]:
    cli = [sys.executable, "-m", "supervisor.main.cli"]
    async with connect(work.socket) as c:
        await c.call("Create", {"id": "flood"})
        with trio.fail_after(180):
            while (await c.call("Inspect", {"id": "flood"}))["state"] != "ready":
                await trio.sleep(0.1)
        idle = await inspect_latencies(c, n)
        flood = [*cli, "run", "flood", "--", "sh", "-c", f"timeout {seconds + 5} yes {LINE}"]
        runner = subprocess.Popen(flood, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        follower = subprocess.Popen(
            [*cli, "logs", "-f", "flood"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            await trio.sleep(2)  # the flood is under way
            b0, t0 = log_bytes(work), time.monotonic()
            busy: list[float] = []
            while time.monotonic() - t0 < seconds:
                busy += await inspect_latencies(c, 20)
            rate = (log_bytes(work) - b0) / (time.monotonic() - t0)
            flooding = runner.poll() is None
        finally:
            for p in (runner, follower):
                p.kill()
                p.wait()
    idle_s, busy_s = summary([x * 1e3 for x in idle]), summary([x * 1e3 for x in busy])
    return {
        "idle_ms": idle_s,
        "flood_ms": busy_s,
        "log_mb_per_s": rate / 1e6,
        "flood_ran_throughout": flooding,
        "target_p99_ms": TARGET_P99_MS,
        "pass": busy_s["p99"] < TARGET_P99_MS and flooding,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=300, help="idle Inspects")
    ap.add_argument("--seconds", type=int, default=15, help="how long the flood is measured")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    with workdir("sv-flood-") as work, supervisor_process(work, "--no-templates") as (env, _):
        res = trio.run(bench, work, env, a.n, a.seconds)
    md = "\n".join(
        [
            "# Inspect while a guest floods output (supervisor as a process, TCG)",
            "",
            "| | p50 ms | p90 ms | p99 ms | n |",
            "|---|---|---|---|---|",
            *(
                f"| {k} | {v['p50']:.2f} | {v['p90']:.2f} | {v['p99']:.2f} | {v['n']} |"
                for k, v in (("idle", res["idle_ms"]), ("during the flood", res["flood_ms"]))
            ),
            "",
            f"Log written during the flood: {res['log_mb_per_s']:.1f} MB/s (a Run draining it and a `logs -f` "
            f"following it). Target: p99 under {TARGET_P99_MS:.0f} ms -- "
            f"{'met' if res['pass'] else 'NOT met'}.",
            "",
        ]
    )
    write_results(Path(a.out), "flood", res, md)


if __name__ == "__main__":
    main()
