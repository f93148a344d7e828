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

Supervisor CPU per Create in a burst: ``--ab BEFORE_TREE`` runs paired rounds, a fresh
supervisor per side, the sides alternating which goes first: "before" is ``sandvisor
serve`` imported from another checkout (``PYTHONPATH``; e.g. a ``git worktree`` of the
base commit with its helpers built), "after" from this one. Each side: one Create + Run
(makes the boot template), then ``--waves`` (default warm16). Per wave: latency as above,
and the serve process's own CPU (utime + stime of /proc/<pid>/stat: all its threads, not
its QEMUs) over the burst and over the removal, per Create. ``--profile DIR`` runs serve
under cProfile (benchmarks/_profserve.py: each burst only; slower, for the where, not
the how much) and prints the top cumulative and own costs per Create.

    cd / && python /path/benchmarks/burst.py --ab /work/wt/base -n 3 --out /tmp/res
    cd / && python /path/benchmarks/burst.py --ab /work/wt/base -n 1 --profile /tmp/prof
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import trio
from _harness import pct

from supervisor.client import AsyncSandbox
from supervisor.client.sdk import sandbox_plans
from supervisor.client.sdk.sandbox_plans import READY_POLL_MAX
from supervisor.main.throwaway import supervisor_process, workdir


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


# -- supervisor CPU, paired before/after -----------------------------------------------
THIS_TREE = Path(__file__).resolve().parent.parent
IDLE_SAMPLE_S = 5.0  # s: the supervisor at rest before each wave (its CPU per second)


def cpu_s(pid: int, *, children: bool = False) -> float:
    """utime + stime of process ``pid`` (all its threads; not its children), in seconds;
    ``children``: cutime + cstime instead (its children reaped so far: helpers such as
    qemu-img during a burst; its QEMUs only once they end)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    i = 13 if children else 11
    return (int(fields[i]) + int(fields[i + 1])) / os.sysconf("SC_CLK_TCK")


async def cpu_wave(sock: str, pid: int, k: int, tag: str, *, profile: bool = False) -> dict[str, Any]:
    """One wave of ``k`` Create + Run, with the serve process's CPU over the burst and over
    the removal after. ``profile``: serve runs under benchmarks/_profserve.py, which
    profiles the burst (SIGUSR1 .. SIGUSR2)."""
    out: dict[str, Any] = {"lat": [], "ready": [], "failures": []}
    # the supervisor's own ticking (timers, pools) at rest, per second: a wave that the
    # host's load makes longer would otherwise count more of it per Create
    i0, ti = cpu_s(pid), time.monotonic()
    await trio.sleep(IDLE_SAMPLE_S)
    idle_rate = (cpu_s(pid) - i0) / (time.monotonic() - ti)
    if profile:
        os.kill(pid, signal.SIGUSR1)
    load0 = os.getloadavg()[0]
    c0, k0, t0 = cpu_s(pid), cpu_s(pid, children=True), time.monotonic()
    with trio.fail_after(600):
        async with trio.open_nursery() as n:
            for i in range(k):
                n.start_soon(one, sock, f"{tag}-{i}", out)
    c1, k1, wall = cpu_s(pid), cpu_s(pid, children=True), time.monotonic() - t0
    if profile:
        os.kill(pid, signal.SIGUSR2)
    await remove_all(sock)
    c2 = cpu_s(pid)
    lat = out["lat"]
    res = {
        "n": k,
        "ok": len(lat),
        "failures": out["failures"],
        "p50_s": pct(lat, 50),
        "p95_s": pct(lat, 95),
        "ready_p50_s": pct(out["ready"], 50),
        "wall_s": wall,
        "serve_cpu_per_create_s": (c1 - c0) / k,
        "lat_s": sorted(lat),
        "ready_s": sorted(out["ready"]),
        "serve_cpu_per_create_net_s": max(0.0, c1 - c0 - idle_rate * wall) / k,
        "serve_idle_cpu_per_s": idle_rate,
        "serve_cpu_per_remove_s": (c2 - c1) / k,
        "helpers_cpu_per_create_s": (k1 - k0) / k,
        "load_before": load0,
        "load_avg": os.getloadavg()[0],
    }
    shown = {k: v for k, v in res.items() if k not in ("failures", "lat_s", "ready_s")}
    print(f"  {tag}: {json.dumps(shown)} failures={len(res['failures'])}")
    for f in res["failures"][:5]:
        print("    ", f)
    return res


async def side_round(
    tree: Path, waves: list[tuple[str, int]], tag: str, profile: Path | None, args: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One side's supervisor: the template, then the waves. The SDK (this process) polls
    for ready as that side's SDK did: another tree's every second (sandbox_plans.READY_POLL_MAX 1 s)."""
    res: dict[str, Any] = {}
    sandbox_plans.READY_POLL_MAX = READY_POLL_MAX if tree == THIS_TREE else 1.0
    py: tuple[str, ...] = (
        (str(THIS_TREE / "benchmarks" / "_profserve.py"), str(profile / f"{tag}.prof")) if profile else ()
    )
    env = {"PYTHONPATH": str(tree)}
    with (
        workdir("sv-burst-") as work,
        supervisor_process(work, *args, extra_env=env, python_args=py, start_timeout=120) as (_env, proc),
    ):
        sock = str(work.socket)
        warm: dict[str, Any] = {"lat": [], "ready": [], "failures": []}
        await one(sock, f"{tag}-template", warm)  # the boot template
        await remove_all(sock)
        if warm["failures"]:
            print("  template:", warm["failures"])
        for name, k in waves:
            res[name] = await cpu_wave(sock, proc.pid, k, f"{tag}-{name}", profile=profile is not None)
    return res


async def ab(
    before: Path,
    rounds: int,
    waves: list[tuple[str, int]],
    profile: Path | None,
    only: str = "",
    side_args: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, Any]:
    res: dict[str, Any] = {"rounds": rounds, "before_tree": str(before), "after_tree": str(THIS_TREE), "pairs": []}
    for r in range(rounds):
        order = [("before", before), ("after", THIS_TREE)]
        if r % 2:
            order.reverse()
        pair: dict[str, Any] = {"first": order[0][0]}
        for side, tree in order:
            if only and side != only:
                continue
            print(f"round {r} {side} ({tree})")
            args = (side_args or {}).get(side, ())
            pair[side] = await side_round(tree, waves, f"{side}-r{r}", profile, args)
        res["pairs"].append(pair)
    return res


KEYS = (
    "serve_cpu_per_create_s",
    "serve_cpu_per_create_net_s",
    "helpers_cpu_per_create_s",
    "serve_cpu_per_remove_s",
    "p50_s",
    "p95_s",
)


def ab_summary(res: dict[str, Any], waves: list[tuple[str, int]]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for name, _k in waves:
        w: dict[str, Any] = {}
        for key in KEYS:
            b = [p["before"][name][key] for p in res["pairs"]]
            a = [p["after"][name][key] for p in res["pairs"]]
            ratios = sorted(x / y for x, y in zip(a, b, strict=True) if y)
            w[key] = {
                "before_median": sorted(b)[len(b) // 2],
                "after_median": sorted(a)[len(a) // 2],
                "after_over_before_median": ratios[len(ratios) // 2] if ratios else 0.0,
            }
        w["failures"] = {
            side: sum(len(p[side][name]["failures"]) for p in res["pairs"]) for side in ("before", "after")
        }
        s[name] = w
    return s


def ab_markdown(res: dict[str, Any], s: dict[str, Any]) -> str:
    lines = [
        f"## Supervisor CPU per Create, paired rounds ({res['rounds']}), TCG, {os.cpu_count()} cores",
        "",
        f"before: `{res['before_tree']}` {' '.join(res['side_args']['before'])}; after: `{res['after_tree']}` "
        f"{' '.join(res['side_args']['after'])}. Medians over rounds; the ratio is "
        "the median of the per-round after/before ratios.",
        "",
        "| wave | figure | before | after | after/before |",
        "|---|---|---|---|---|",
    ]
    for name, w in s.items():
        for key, label in (
            ("serve_cpu_per_create_s", "serve CPU per Create + Run (s)"),
            ("serve_cpu_per_create_net_s", "the same, less serve's CPU at rest over the wave (s)"),
            ("helpers_cpu_per_create_s", "serve's reaped children's CPU per Create (s)"),
            ("serve_cpu_per_remove_s", "serve CPU per Remove (s)"),
            ("p50_s", "p50 latency (s)"),
            ("p95_s", "p95 latency (s)"),
        ):
            f = w[key]
            lines.append(
                f"| {name} | {label} | {f['before_median']:.3f} | {f['after_median']:.3f} "
                f"| {f['after_over_before_median']:.2f} |"
            )
        lines.append(f"| {name} | failures | {w['failures']['before']} | {w['failures']['after']} | |")
    lines += ["", "Per round (side, serve CPU per Create s, p95 s, 1-minute load before -> after the wave):"]
    for r, p in enumerate(res["pairs"]):
        parts = []
        for side in (p["first"], "after" if p["first"] == "before" else "before"):
            for name in s:
                x = p[side][name]
                parts.append(
                    f"{side} {name} {x['serve_cpu_per_create_s']:.3f} / {x['p95_s']:.2f} "
                    f"(load {x['load_before']:.1f} -> {x['load_avg']:.1f})"
                )
        lines.append(f"- round {r}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def print_profile(profile: Path, res: dict[str, Any], waves: list[tuple[str, int]], top: int = 40) -> None:
    """The top cumulative and own costs per Create of each profiled burst (serve's main
    thread, from the first Create to the last Run's exit)."""
    for f in sorted(profile.glob("*.prof.*")):
        creates = waves[int(f.name.rsplit(".", 1)[1])][1]
        print(f"=== {f.name}: per Create (of {creates}), ms")
        st = pstats.Stats(str(f))
        for sort in ("cumulative", "tottime"):
            st.sort_stats(sort)
            rows = []
            for func in st.fcn_list[:top]:  # type: ignore[attr-defined]
                _cc, nc, tt, ct, _callers = st.stats[func]  # type: ignore[attr-defined]
                name = pstats.func_std_string(func)
                rows.append(f"{ct / creates * 1e3:9.2f} {tt / creates * 1e3:9.2f} {nc / creates:8.1f}  {name}")
            print(f"--- by {sort}: cum_ms own_ms calls/Create function")
            print("\n".join(rows))


def main() -> None:
    if "--ab" in sys.argv:
        ab_main()
        return
    legacy_main()


def ab_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ab", required=True, help="the before checkout (its root)")
    ap.add_argument("-n", type=int, default=3, help="paired rounds")
    ap.add_argument("--waves", default="warm16", help="comma-separated wave sizes by name: warm16,warm32")
    ap.add_argument("--out", default="results")
    ap.add_argument("--profile", help="run serve under cProfile; its .prof files go here")
    ap.add_argument("--only", choices=("before", "after"), help="one side only (profiling: no summary)")
    ap.add_argument("--before-args", default="", help="extra serve arguments of the before side (shlex)")
    ap.add_argument("--after-args", default="", help="extra serve arguments of the after side (shlex)")
    a = ap.parse_args()
    waves = [(w, int(w.removeprefix("warm"))) for w in a.waves.split(",")]
    profile = Path(a.profile) if a.profile else None
    if profile:
        profile.mkdir(parents=True, exist_ok=True)
    side_args = {"before": tuple(shlex.split(a.before_args)), "after": tuple(shlex.split(a.after_args))}
    res = trio.run(ab, Path(a.ab).resolve(), a.n, waves, profile, a.only or "", side_args)
    res["side_args"] = {k: list(v) for k, v in side_args.items()}
    if a.only:
        if profile:
            print_profile(profile, res, waves)
        return
    s = ab_summary(res, waves)
    res["summary"] = s
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "burst-fast.json").write_text(json.dumps(res, indent=2))
    md = ab_markdown(res, s)
    (out / "burst-fast.md").write_text(md)
    print(md)
    if profile:
        print_profile(profile, res, waves)


def legacy_main() -> None:
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
