"""API overhead of ``sandvisor serve`` (in-process daemon, real VMs, TCG).

* Inspect and List round trips with 50 sandboxes registered (p50/p99).
* A Run of ``true`` end to end (client -> socket -> registry -> guest channel ->
  guestd and back) vs the same exec over the raw guest channel of the same VM.

Usage: python benchmarks/api.py [-n N] [--out results/]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import trio
from _harness import in_process_daemon, main, pct, write_results

from supervisor.client import connect


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"n": n}
    async with in_process_daemon("sv-api-") as (cfg, registry), connect(cfg.socket) as c:
        # 49 registered (stopped) sandboxes and one live one
        for i in range(49):
            await c.call("Create", {"id": f"reg{i}", "labels": {"i": str(i)}})
            await c.call("Kill", {"id": f"reg{i}"})
        await c.call("Create", {"id": "live"})
        with trio.fail_after(120):
            while (await c.call("Inspect", {"id": "live"}))["state"] != "ready":
                await trio.sleep(0.05)
        lat: dict[str, list[float]] = {"Inspect": [], "List": []}
        for _ in range(max(n, 200)):
            t = time.perf_counter()
            await c.call("Inspect", {"id": "live"})
            lat["Inspect"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await c.call("List", {"limit": 100})
            lat["List"].append(time.perf_counter() - t)
        for k, v in lat.items():
            res[k] = {"p50_ms": pct(v, 50) * 1e3, "p99_ms": pct(v, 99) * 1e3, "sandboxes": 50}
        chan = registry.get("live").guest.channel
        for _ in range(3):
            await chan.run(["true"])
        api, raw = [], []
        for _ in range(max(n, 30)):
            t = time.perf_counter()
            async with c.open_call("Run", {"id": "live", "cmd": ["true"]}) as call:
                async for _item in call:
                    pass
            api.append(time.perf_counter() - t)
            t = time.perf_counter()
            await chan.run(["true"])
            raw.append(time.perf_counter() - t)
        res["run_true"] = {
            "api_p50_ms": statistics.median(api) * 1e3,
            "raw_channel_p50_ms": statistics.median(raw) * 1e3,
            "ratio": statistics.median(api) / statistics.median(raw),
            "target_ratio": 1.5,
        }
    r = res["run_true"]
    md = "\n".join(
        [
            "## API overhead (TCG, in-process daemon, 50 sandboxes registered)",
            "",
            "| measure | p50 | p99 / peer | ratio | target |",
            "|---|---|---|---|---|",
            f"| Inspect round trip (ms) | {res['Inspect']['p50_ms']:.2f} | {res['Inspect']['p99_ms']:.2f} | | |",
            f"| List (100) round trip (ms) | {res['List']['p50_ms']:.2f} | {res['List']['p99_ms']:.2f} | | |",
            f"| Run `true` end to end (ms) | {r['api_p50_ms']:.1f} | raw channel {r['raw_channel_p50_ms']:.1f} "
            f"| {r['ratio']:.2f}x | <= {r['target_ratio']}x |",
            "",
        ]
    )
    write_results(out_dir, "api", res, md)
    return res


if __name__ == "__main__":
    main(bench)
