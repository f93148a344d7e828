"""File throughput through the SDK: a 64 MiB ``fs.write`` and ``fs.read`` against an
in-process supervisor as users run it (root: jailed, balloon on, tb-size default), and
the variants that explain a difference, interleaved in one run (the machine is shared:
each round writes and reads once per variant, in a rotating order; ratios count).

Variants (each its own throwaway supervisor and one sandbox):

* ``jailed``: the default, as ``sandvisor serve`` runs as root;
* ``tb1024``: jailed, ``--tb-size 0`` (QEMU's own 1 GiB translation cache);
* ``no-balloon``: jailed, ``--no-balloon`` (no free page reporting);
* ``no-jail``: ``--no-jail``.

Usage: python benchmarks/files.py [-n 3] [--variants jailed,no-jail] [--out results/]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio
from _harness import write_results

from supervisor.client.sdk.aio import AsyncSandbox
from supervisor.main.throwaway import supervisor, workdir

SIZE = 64 << 20
VARIANTS: dict[str, dict[str, Any]] = {
    "jailed": {},
    "tb1024": {"tb_size_mib": 0},
    "no-balloon": {"balloon": False},
    "no-jail": {"jail": False},
}


async def bench(n: int, out_dir: Path, names: list[str]) -> dict[str, Any]:
    data = os.urandom(SIZE)
    w: dict[str, list[float]] = {v: [] for v in names}
    r: dict[str, list[float]] = {v: [] for v in names}
    loads: list[float] = []
    async with AsyncExitStack() as stack:
        sbs: dict[str, AsyncSandbox] = {}
        socks = {}
        for v in names:
            work = stack.enter_context(workdir(f"sv-files-{v}-"))
            cfg, _reg = await stack.enter_async_context(supervisor(work, templates=False, **VARIANTS[v]))
            socks[v] = cfg.socket

        async def create(v: str) -> None:  # (side by side: boots are slow on a busy machine)
            sbs[v] = await AsyncSandbox.create(f"f-{v}", socket=socks[v], timeout=1200)

        async with trio.open_nursery() as nursery:
            for v in names:
                nursery.start_soon(create, v)
        for i in range(n):
            order = names[i % len(names) :] + names[: i % len(names)]
            for v in order:
                loads.append(os.getloadavg()[0])
                t0 = time.perf_counter()
                await sbs[v].fs.write("/root/bench.bin", data)
                w[v].append(SIZE / (time.perf_counter() - t0) / (1 << 20))
                t0 = time.perf_counter()
                back = await sbs[v].fs.read("/root/bench.bin")
                r[v].append(SIZE / (time.perf_counter() - t0) / (1 << 20))
                assert back == data
                await sbs[v].run(["rm", "-f", "/root/bench.bin"])
            print(
                f"round {i + 1}/{n}: " + ", ".join(f"{v} w {w[v][-1]:.1f} r {r[v][-1]:.1f}" for v in names), flush=True
            )
        for sb in sbs.values():
            await sb.remove(force=True)
    res: dict[str, Any] = {
        "n": n,
        "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "cpus": os.cpu_count(),
        **{v: {"write_mib_s": w[v], "read_mib_s": r[v]} for v in names},
    }
    base = names[0]
    lines = [
        f"# 64 MiB fs.write / fs.read through the SDK (TCG, medians of {n}; "
        f"load {res['load_1min']['median']:.1f} on {os.cpu_count()} CPUs)",
        "",
        f"| variant | write MiB/s | read MiB/s | write / {base} | read / {base} |",
        "|---|---|---|---|---|",
    ]
    for v in names:
        # each round's own ratio: adjacent runs share the machine's load
        wr = statistics.median(a / b for a, b in zip(w[v], w[base], strict=True))
        rr = statistics.median(a / b for a, b in zip(r[v], r[base], strict=True))
        res[v]["write_ratio"], res[v]["read_ratio"] = wr, rr
        lines.append(f"| {v} | {statistics.median(w[v]):.1f} | {statistics.median(r[v]):.1f} | {wr:.2f} | {rr:.2f} |")
    write_results(out_dir, "files", res, "\n".join(lines) + "\n")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    names = a.variants.split(",")
    for v in names:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    trio.run(bench, a.n, Path(a.out), names)


if __name__ == "__main__":
    main()
