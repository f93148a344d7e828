"""Bursts: N concurrent default Creates, each followed by one Run of ``true``, through
the SDK against ``sandvisor serve`` as a child process (TCG).

Waves, on one supervisor:

* cold 16: the supervisor's first work (no boot template yet: the first Create boots,
  the others wait for its template, or boot);
* warm 16 and warm 32: the template exists;
* alone: one Create + Run at a time (the peer: what a burst costs each caller).

Each caller's time runs from its Create call to its Run's exit code; a failure is any
error on the way (reported by type and message). Sandboxes are removed between waves.

Usage: python benchmarks/burst.py [-n ROUNDS] [--out results/]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import trio
from _harness import pct

from supervisor.client import AsyncSandbox
from supervisor.throwaway import supervisor_process, workdir


async def one(sock: str, name: str, out: dict[str, Any]) -> None:
    t0 = time.monotonic()
    try:
        sb = await AsyncSandbox.create(name, socket=sock, detached=True, timeout=300)
        t_ready = time.monotonic()
        r = await sb.run(["true"])
        if r.exit_code != 0:
            raise RuntimeError(f"true exited {r.exit_code}: {r.stderr[-200:]!r}")
        t1 = time.monotonic()
        out["lat"].append(t1 - t0)
        out["ready"].append(t_ready - t0)
    except Exception as exc:
        out["failures"].append(f"{name}: {type(exc).__name__}: {exc}"[:300])


async def remove_all(sock: str) -> None:
    while True:
        page = await AsyncSandbox.list(socket=sock, limit=100)
        if not page.sandboxes:
            return
        async with trio.open_nursery() as n:
            for s in page.sandboxes:
                n.start_soon(lambda i=s.id: AsyncSandbox(i, socket=sock, detached=True).remove(force=True))


async def wave(sock: str, k: int, tag: str) -> dict[str, Any]:
    out: dict[str, Any] = {"lat": [], "ready": [], "failures": []}
    t0 = time.monotonic()
    with trio.fail_after(600):
        async with trio.open_nursery() as n:
            for i in range(k):
                n.start_soon(one, sock, f"{tag}-{i}", out)
    wall = time.monotonic() - t0
    await remove_all(sock)
    lat = out["lat"]
    res = {
        "n": k,
        "ok": len(lat),
        "failures": out["failures"],
        "p50_s": pct(lat, 50),
        "p95_s": pct(lat, 95),
        "max_s": max(lat, default=0.0),
        "ready_p50_s": pct(out["ready"], 50),
        "wall_s": wall,
        "load_avg": os.getloadavg()[0],
    }
    print(f"  {tag}: {json.dumps({k: v for k, v in res.items() if k != 'failures'})} failures={len(res['failures'])}")
    for f in res["failures"][:5]:
        print("    ", f)
    return res


async def bench(rounds: int, args: tuple[str, ...], log: Path | None) -> dict[str, Any]:
    res: dict[str, Any] = {"rounds": rounds, "serve_args": list(args), "waves": {}}
    for r in range(rounds):
        with workdir("sv-burst-") as work, supervisor_process(work, *args, log=log) as (_env, _proc):
            sock = str(work.socket)
            waves = [("cold16", 16), ("warm16", 16), ("warm32", 32)]
            for tag, k in waves:
                res["waves"].setdefault(tag, []).append(await wave(sock, k, f"{tag}r{r}"))
            alone: list[float] = []
            for i in range(5):
                out: dict[str, Any] = {"lat": [], "ready": [], "failures": []}
                await one(sock, f"alone{r}-{i}", out)
                alone += out["lat"]
                await remove_all(sock)
            res.setdefault("alone_s", []).extend(alone)
    return res


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    alone = pct(res["alone_s"], 50)
    s: dict[str, Any] = {"alone_p50_s": alone}
    for tag, ws in res["waves"].items():
        lat_p50 = sorted(w["p50_s"] for w in ws)[len(ws) // 2]
        lat_p95 = sorted(w["p95_s"] for w in ws)[len(ws) // 2]
        s[tag] = {
            "p50_s": lat_p50,
            "p95_s": lat_p95,
            "failures": sum(len(w["failures"]) for w in ws),
            "callers": sum(w["n"] for w in ws),
            "p95_vs_alone": lat_p95 / alone if alone else 0.0,
        }
    return s


def markdown(res: dict[str, Any], s: dict[str, Any]) -> str:
    lines = [
        f"## Bursts (TCG, {os.cpu_count()} cores, `sandvisor serve` as a child process, {res['rounds']} round(s))",
        "",
        "Each caller: Create (default configuration, SDK, waits until ready) then Run `true`; "
        "time from the Create call to the Run's exit code. Medians over rounds of each wave's p50/p95.",
        "",
        "| wave | callers | failures | p50 (s) | p95 (s) | p95 vs one alone | target |",
        "|---|---|---|---|---|---|---|",
    ]
    targets = {"cold16": "", "warm16": "p95 <= 3 s, 0 failures", "warm32": "0 failures"}
    names = {
        "cold16": "16 at once, fresh supervisor (no template yet)",
        "warm16": "16 at once",
        "warm32": "32 at once",
    }
    for tag in ("cold16", "warm16", "warm32"):
        if tag in s:
            w = s[tag]
            lines.append(
                f"| {names[tag]} | {w['callers']} | {w['failures']} | {w['p50_s']:.2f} | {w['p95_s']:.2f} "
                f"| {w['p95_vs_alone']:.1f}x | {targets[tag]} |"
            )
    lines += ["", f"One Create + Run alone: p50 {s['alone_p50_s']:.2f} s.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=1, help="rounds (a fresh supervisor each)")
    ap.add_argument("--out", default="results")
    ap.add_argument("--log", help="append the supervisor's log here")
    ap.add_argument("serve_args", nargs="*", help="extra arguments for sandvisor serve")
    a = ap.parse_args()
    res = trio.run(bench, a.n, tuple(a.serve_args), Path(a.log) if a.log else None)
    s = summarize(res)
    res["summary"] = s
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "burst.json").write_text(json.dumps(res, indent=2))
    md = markdown(res, s)
    (out / "burst.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
