"""A trivial cell's round trip through sandvisor's own code interpreter (docs/code.md):
``Sandbox.run_code("1+1")`` with the sandvisor SDK (the method table's RunCode) on one
sandbox of the code-interpreter image booted by a throwaway ``serve``, after a first
cell that starts the kernel server. The relay to the guest's kernel server is open
only while calls are in flight (supervisor/serve/kernels.py), so each round times the
cell twice, interleaved under the same load: alone (it opens the relay and returns
once it is closed), and while another call is in flight (a cell sleeping in a second
context: the relay is open already, as it was all the time before), and
``run(["true"])`` on the same sandbox (the cost of an Exec, for comparison).

Medians (and 10th/90th percentiles) of ``-n`` rounds; the load average (1 min) before
and after is in the results: the machine is shared.

Usage: python -P benchmarks/run_code_cell.py [-n 50] [--out results/]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from images.build import Builder, default_cache, hold_parts
from images.profiles import build_profile
from supervisor.client import Sandbox
from supervisor.main.throwaway import supervisor_process, workdir


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    img = build_profile(Builder(default_cache()), "code-interpreter")
    samples: dict[str, list[float]] = {"cell": [], "cell_held": [], "exec_true": []}
    load_before = os.getloadavg()[0]
    with (
        hold_parts(img),
        workdir("sv-bench-cell-") as work,
        supervisor_process(work, "--allow-path", str(img.rootfs.parent)),
    ):
        sb = Sandbox.create("cell", socket=str(work.socket), image_disk=str(img.rootfs), memory_mib=1024, detached=True)
        try:
            assert sb.run_code("x = 1", timeout=600).error is None  # (the kernel server starts)
            other = sb.create_code_context()
            sb.run_code("import time", context=other)

            def held() -> float:
                """The cell while a cell of ``other`` is in flight (it prints, then sleeps)."""
                going = threading.Event()
                holder = threading.Thread(
                    target=lambda: sb.run_code(
                        "print('go', flush=True); time.sleep(1.5)", context=other, on_stdout=lambda _: going.set()
                    )
                )
                holder.start()
                try:
                    assert going.wait(120)
                    return _timed(lambda: sb.run_code("1+1"))
                finally:
                    holder.join()

            for i in range(a.n + 1):  # round 0 warms the paths up and is dropped
                r = {
                    "cell": _timed(lambda: sb.run_code("1+1")),
                    "cell_held": held(),
                    "exec_true": _timed(lambda: sb.run(["true"])),
                }
                if i:
                    for k, v in r.items():
                        samples[k].append(v)
        finally:
            sb.remove(force=True)
    load_after = os.getloadavg()[0]

    def q(v: list[float], p: int) -> float:
        return statistics.quantiles(v, n=10)[p // 10 - 1] * 1000

    stats = {k: {"median": statistics.median(v) * 1000, "p10": q(v, 10), "p90": q(v, 90)} for k, v in samples.items()}
    res = {"n": a.n, "load_avg_1m": [load_before, load_after], "ms": stats}
    md = (
        f"# run_code round trip (TCG; n={a.n}; load average {load_before:.1f} before, {load_after:.1f} after)\n\n"
        "| operation | median | p10 | p90 |\n|---|---|---|---|\n"
        + "".join(
            f"| {label} | {stats[k]['median']:.1f} ms | {stats[k]['p10']:.1f} ms | {stats[k]['p90']:.1f} ms |\n"
            for k, label in (
                ("cell", 'run_code("1+1") alone (opens and closes the relay)'),
                ("cell_held", 'run_code("1+1") while another call is in flight (the relay open)'),
                ("exec_true", 'run(["true"])'),
            )
        )
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_code_cell.json").write_text(json.dumps(res, indent=2))
    (out / "run_code_cell.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
