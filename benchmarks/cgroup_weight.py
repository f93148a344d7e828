"""The sandboxes' parent cgroup's CPU weight under contention (cgroup v1's cpu.shares):
the parent at the default 1024 (before: all of a supervisor's sandboxes together weigh
one ordinary task) against the sum of its children's (after: ``CgroupManager.reweigh``),
interleaved round by round in one run (the side that goes first alternates), on the
production path (root, jailed QEMUs, TCG, 256 MiB guests, one vCPU each).

Each round, for each side: the parent's cpu.shares is set (1024, or reweighed), then
every sandbox writes ``--mib`` MiB to its root disk at once (``dd ... conv=fsync``);
the figure is each sandbox's MiB/s (host-side wall time of the call). The contention is
the shared machine's own load (reported with each run); nothing here adds load beyond
the sandboxes themselves.

Usage: python benchmarks/cgroup_weight.py [-n 5] [--sandboxes 3] [--mib 16] [--out docs/results] [--name N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

# as a script, benchmarks/ comes first on sys.path, where benchmarks/images.py would
# shadow the images package (which actors imports): look here last
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE] + [_HERE]

from _harness import write_results  # noqa: E402

from actors.cells.cgroups import CgroupManager  # noqa: E402
from actors.model import Limits, SandboxConfig, State  # noqa: E402
from actors.sandboxes.sandbox import Sandbox  # noqa: E402
from supervisor.main.throwaway import supervisor, workdir  # noqa: E402


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split(" ", 1)[0])


async def write_speed(sb: Sandbox, mib: int) -> float:
    script = f"dd if=/dev/zero of=/root/w bs=1M count={mib} conv=fsync 2>/dev/null; rm -f /root/w; sync"
    t = time.monotonic()
    res = await sb.guest_call(lambda g: g.channel.run(["sh", "-c", script], timeout=600))
    assert res.exit_code == 0, res.stderr
    return mib / (time.monotonic() - t)


async def bench(n: int, count: int, mib: int, out: Path, name: str) -> dict[str, Any]:
    with workdir("sv-bench-weight-") as work:
        async with supervisor(work, templates=False) as (_, reg):
            cells = reg.settings.cells
            cgroups: CgroupManager | None = cells.cgroups if cells is not None else None
            mounts: dict[str, Path] = getattr(cgroups, "mounts", {})
            if cgroups is None or cgroups.version != 1 or "cpu" not in mounts:
                raise SystemExit("needs root and cgroup v1's cpu controller")
            shares = mounts["cpu"] / cgroups.parent / "cpu.shares"
            sbs = []
            for i in range(count):
                sb = await reg.create(f"w{i}", SandboxConfig(limits=Limits(vcpus=1, memory_mib=256)))
                with trio.fail_after(600):
                    await sb.ready_event.wait()
                assert sb.state == State.READY, sb.record.error
                sbs.append(sb)

            def set_side(side: str) -> None:
                if side == "before":
                    shares.write_text("1024")
                else:
                    cgroups.reweigh()

            speeds: dict[str, list[float]] = {"before": [], "after": []}
            loads: list[float] = []
            weights: dict[str, str] = {}
            for r in range(n):
                for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    set_side(side)
                    weights[side] = shares.read_text().strip()
                    loads.append(loadavg())
                    got: list[float] = []

                    async def one(sb: Sandbox, got: list[float] = got) -> None:
                        got.append(await write_speed(sb, mib))

                    async with trio.open_nursery() as nursery:
                        for sb in sbs:
                            nursery.start_soon(one, sb)
                    speeds[side] += got
                    print(f"round {r} {side}: parent {weights[side]}: {[round(x, 2) for x in got]} MiB/s")
            cgroups.reweigh()
            for sb in sbs:
                await reg.remove(sb.id, force=True)
    med = {side: statistics.median(xs) for side, xs in speeds.items()}
    res = {
        "sandboxes": count,
        "mib": mib,
        "rounds": n,
        "parent_shares": weights,
        "mib_per_s": {side: {"median": med[side], "all": xs} for side, xs in speeds.items()},
        "ratio_after_before": med["after"] / med["before"],
        "loadavg_1m": loads,
    }
    md = (
        "# The parent cgroup's CPU weight under contention (cgroup v1)\n\n"
        f"{count} jailed sandboxes (1 vCPU, 256 MiB, TCG) each writing {mib} MiB (`dd conv=fsync`) at once, "
        f"{n} rounds interleaved; load (1 min) during the run: {min(loads)}-{max(loads)}.\n\n"
        "| parent cpu.shares | MiB/s per sandbox (median) |\n|---|---|\n"
        f"| before: {weights['before']} (the default) | {med['before']:.2f} |\n"
        f"| after: {weights['after']} (the sum of its children's) | {med['after']:.2f} |\n\n"
        f"Ratio after / before: {res['ratio_after_before']:.2f}.\n"
    )
    write_results(out, name, res, md)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--sandboxes", type=int, default=3)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--name", default="cgroup_weight", help="the results' file name (without .md/.json)")
    a = ap.parse_args()
    trio.run(bench, a.n, a.sandboxes, a.mib, Path(a.out), a.name)


if __name__ == "__main__":
    main()
