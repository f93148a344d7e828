"""The one-shot control plane: wall time of ``sandvisor ls``, ``inspect`` and ``run -- true``
against the bare interpreter's start-up, measured in one run.

A user's ``sandvisor ls`` pays the interpreter's start-up, the CLI's imports, a
connection and the call. The floor is ``python -c pass`` of the same venv's python,
with the same environment; the call itself is measured in-process on an open
connection. The figure of merit is ``(wall - call) / bare`` (target <= 2.5).

    bench process                                  sandvisor CLI (a child)
    +----------------------------+     fork/exec   +--------------------------+
    | in-process supervisor      | --------------> | interpreter start-up     |
    | (its own trio loop)        |                 | imports, parse argv      |
    |   <------------------------------ connect ---- | hello                    |
    |   serves the call  ----------------- reply --> | print, exit              |
    +----------------------------+                 +--------------------------+

The commands run round-robin (bare, ls, ls --json, inspect, run, import), n rounds;
each ratio is taken within its round (the machine is shared: load drifts), and the
median of the rounds is reported.

Usage: python benchmarks/control.py [-n N] [--out results/]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from _harness import in_process_daemon, main, pct, write_results

from supervisor.client import connect

TARGET = 2.5
OTHERS = 4  # stopped sandboxes besides the live one, so ls prints a table of 5


def sandvisor_argv() -> list[str]:
    """The ``sandvisor`` console script of this interpreter's venv (what users run)."""
    script = Path(sys.executable).parent / "sandvisor"
    if script.exists():
        return [str(script)]
    found = shutil.which("sandvisor")
    return [found] if found else [sys.executable, "-m", "supervisor.main.cli"]


def wall(argv: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, check=False)
    dt = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{argv} exited {p.returncode}: {p.stderr.decode(errors='replace')[-500:]}")
    return dt


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"n": n, "loadavg_before": os.getloadavg()[0]}
    async with in_process_daemon("sv-ctl-") as (cfg, _registry), connect(cfg.socket) as c:
        for i in range(OTHERS):
            await c.call("Create", {"id": f"other{i}", "labels": {"i": str(i)}})
            await c.call("Kill", {"id": f"other{i}"})
        await c.call("Create", {"id": "bench", "labels": {"role": "bench"}})
        with trio.fail_after(120):
            while (await c.call("Inspect", {"id": "bench"}))["state"] != "ready":
                await trio.sleep(0.05)

        # the calls themselves, on an open connection (no start-up, no connect)
        async def run_true() -> None:
            async with c.open_call("Run", {"id": "bench", "cmd": ["true"]}) as call:
                async for _ in call:
                    pass

        for _ in range(3):
            await run_true()
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "ls": lambda: c.call("List", {"limit": 100}),
            "ls --json": lambda: c.call("List", {"limit": 100}),
            "inspect": lambda: c.call("Inspect", {"id": "bench"}),
            "run": run_true,
        }

        # as installed: bytecode is cached (the warm-up round writes it where it may)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["SANDVISOR_SOCKET"] = str(cfg.socket)
        sv = sandvisor_argv()
        commands = {
            "bare": [sys.executable, "-c", "pass"],
            "ls": [*sv, "ls"],
            "ls --json": [*sv, "ls", "--json"],
            "inspect": [*sv, "inspect", "bench"],
            "run": [*sv, "run", "bench", "--", "true"],
            "import supervisor.main.cli": [sys.executable, "-c", "import supervisor.main.cli"],
        }
        for argv in commands.values():  # warm the page cache and __pycache__
            await trio.to_thread.run_sync(wall, argv, env)
        # round-robin; each command's call is measured right before it, so both see the
        # same load (this machine is shared), and each ratio is taken within its round
        walls: dict[str, list[float]] = {k: [] for k in commands}
        call_t: dict[str, list[float]] = {k: [] for k in commands}
        for _ in range(n):
            for name, argv in commands.items():
                dt = 0.0
                if name in calls:
                    t = time.perf_counter()
                    await calls[name]()
                    dt = time.perf_counter() - t
                call_t[name].append(dt)
                walls[name].append(await trio.to_thread.run_sync(wall, argv, env))

    res["loadavg_after"] = os.getloadavg()[0]
    bare = statistics.median(walls["bare"])
    res["sandvisor"] = " ".join(sv)
    res["bare_ms"] = {"p50": bare * 1e3, "p90": pct(walls["bare"], 90) * 1e3}
    res["commands"] = {}
    for name in ("ls", "ls --json", "inspect", "run", "import supervisor.main.cli"):
        w, call = statistics.median(walls[name]), statistics.median(call_t[name])
        per_round = [(x - cx) / b for x, cx, b in zip(walls[name], call_t[name], walls["bare"], strict=True)]
        res["commands"][name] = {
            "wall_p50_ms": w * 1e3,
            "wall_p90_ms": pct(walls[name], 90) * 1e3,
            "call_p50_ms": call * 1e3,
            "over_bare_ms": (w - bare) * 1e3,
            "ratio": statistics.median(per_round),
            "ratio_of_medians": (w - call) / bare,
            "target": TARGET if name in ("ls", "inspect", "run") else None,
        }
    rows = [
        f"| `{name}` | {r['wall_p50_ms']:.1f} | {r['call_p50_ms']:.1f} | {r['over_bare_ms']:.1f} "
        f"| {r['ratio']:.2f}x | {'<= ' + str(r['target']) + 'x' if r['target'] else ''} |"
        for name, r in res["commands"].items()
    ]
    md = "\n".join(
        [
            "## One-shot control plane (TCG, in-process daemon, 5 sandboxes, 1 ready)",
            "",
            f"Bare interpreter (`python -c pass`, same venv): p50 {bare * 1e3:.1f} ms "
            f"(p90 {res['bare_ms']['p90']:.1f}); n={n} rounds, medians; load average "
            f"{res['loadavg_before']:.1f} before, {res['loadavg_after']:.1f} after.",
            "ratio = (wall - call) / bare within each round, median of the rounds; the call is",
            "measured on an open connection right before the command.",
            "",
            "| command | wall p50 (ms) | call p50 (ms) | wall - bare (ms) | ratio | target |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    write_results(out_dir, "control", res, md)
    return res


if __name__ == "__main__":
    main(bench, default_n=20)
