"""Before/after of a refactoring, measured in one run on two source trees.

Each tree is a checkout with its own ``.venv`` (``pip install -e '.[test,dev]'``). Every
measurement runs in a fresh process with that tree's interpreter, importing only that
tree's code, alternately on BEFORE and AFTER (the order flips each round), and the
table shows medians over the rounds:

* Create (cold, boot path: ``serve --no-templates``), Inspect and Run ``true``
  latency through the tree's own SDK (``supervisor.client.AsyncSandbox``) against its
  own ``sandvisor serve`` child process, on a throwaway state dir and socket (the
  tree's ``throwaway.workdir``: never /run/sandvisor), real QEMU (TCG);
* the supervisor's RSS with 50 sandboxes: the registry and sandbox actors in one
  process with the tree's fake-VM lab (tests/support/fakevm.py: no QEMU, the fake
  guests live in the same process, the same for both trees), 50 default Creates
  ready; VmRSS of that process, and its growth over the empty registry;
* the unit session (``pytest -q -m "not vm and not host"``): once per tree, one after
  the other (too long to interleave), with the load average around each.

Usage: python benchmarks/house.py BEFORE_TREE AFTER_TREE [--rounds 3] [--no-units]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
SANDBOXES = 50


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _first(*names: str) -> Any:
    """The first of these modules the tree has (the two layouts name them differently)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(names[0])


# ---- children: run with a tree's own interpreter, print one JSON line ----


def child_latency(creates: int, inspects: int, runs: int) -> dict[str, Any]:
    import trio

    throwaway = _first("supervisor.main.throwaway", "supervisor.throwaway")
    client = importlib.import_module("supervisor.client")
    out: dict[str, Any] = {"create_s": [], "inspect_ms": [], "run_ms": []}

    async def measure(socket: Path) -> None:
        async def create(name: str) -> Any:
            t = time.perf_counter()
            sb = await client.AsyncSandbox.create(name, socket=socket, timeout=300)
            out["create_s"].append(time.perf_counter() - t)
            return sb

        for i in range(creates - 1):
            sb = await create(f"c{i}")
            await sb.remove(force=True)
        sb = await create("live")
        for _ in range(3):  # warm: the connection path, the guest's exec path
            await sb.inspect()
            await sb.run(["true"])
        for _ in range(inspects):
            t = time.perf_counter()
            await sb.inspect()
            out["inspect_ms"].append((time.perf_counter() - t) * 1e3)
        for _ in range(runs):
            t = time.perf_counter()
            await sb.run(["true"])
            out["run_ms"].append((time.perf_counter() - t) * 1e3)
        await sb.remove(force=True)

    with (
        throwaway.workdir("sv-house-") as work,
        throwaway.supervisor_process(work, "--no-templates", start_timeout=120),
    ):
        trio.run(measure, work.socket)
    return {k: statistics.median(v) for k, v in out.items()}


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child_rss(count: int) -> dict[str, Any]:
    import trio

    sys.path.insert(0, os.getcwd())  # tests.support of this tree
    fakevm = importlib.import_module("tests.support.fakevm")
    model = importlib.import_module("actors.model")
    registry_mod = importlib.import_module("actors.registry")
    store_mod = importlib.import_module("actors.store")
    out: dict[str, Any] = {}

    async def run(root: Path) -> None:
        lab = fakevm.FakeLab()
        store = store_mod.Store(root / "state" / "sandvisor.db")
        try:
            async with trio.open_nursery() as n:
                await n.start(lab.run)
                settings = fakevm.fake_settings(root, lab, allowed_paths=(root,))
                reg = await n.start(registry_mod.Registry(settings, store, templates=False).run)
                out["empty_mib"] = _rss() / 2**20
                for i in range(count):
                    sb = await reg.create(f"s{i}", model.SandboxConfig(labels={"i": str(i)}))
                    with trio.fail_after(120):
                        await sb.ready_event.wait()
                    if sb.state != model.State.READY:
                        raise RuntimeError(f"s{i}: {sb.state}: {sb.record.error}")
                await trio.sleep(0.5)
                out["rss_mib"] = _rss() / 2**20
                await reg.shutdown(10)
                n.cancel_scope.cancel()
        finally:
            store.close()

    with tempfile.TemporaryDirectory(prefix="sv-house-rss-") as d:
        trio.run(run, Path(d))
    out["per_sandbox_kib"] = (out["rss_mib"] - out["empty_mib"]) * 1024 / count
    return out


# ---- the parent: stdlib only, imports neither tree ----


def in_tree(tree: Path, mode: str, *args: str, timeout: float = 900) -> dict[str, Any]:
    argv = [str(tree / ".venv" / "bin" / "python"), str(HERE), "--child", mode, *args]
    p = subprocess.run(argv, cwd=tree, capture_output=True, text=True, timeout=timeout, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} in {tree} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def unit_session(tree: Path) -> dict[str, Any]:
    before = loadavg()
    t = time.monotonic()
    p = subprocess.run(
        [str(tree / ".venv" / "bin" / "pytest"), "-q", "-m", "not vm and not host", "-p", "no:cacheprovider", "-rf"],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.monotonic() - t
    tail = [line for line in p.stdout.strip().splitlines() if line.strip()][-1:]
    failed = [line for line in p.stdout.splitlines() if line.startswith("FAILED")]
    return {
        "wall_s": wall,
        "rc": p.returncode,
        "summary": tail[0] if tail else "",
        "failed": failed,
        "load": f"{before} -> {loadavg()}",
    }


def table(res: dict[str, Any]) -> str:
    rows = [
        f"## House before/after ({res['rounds']} interleaved rounds, medians; TCG, 2 cores shared)",
        "",
        "| measure | before | after | after/before |",
        "|---|---|---|---|",
    ]

    def row(label: str, key: str, fmt: str) -> None:
        b, a = res["before"].get(key), res["after"].get(key)
        if b is None or a is None:
            return
        rows.append(f"| {label} | {b:{fmt}} | {a:{fmt}} | {a / b:.2f}x |")

    row("Create, cold boot path, SDK to ready (s)", "create_s", ".2f")
    row("Inspect round trip, SDK (ms)", "inspect_ms", ".2f")
    row("Run `true` end to end, SDK (ms)", "run_ms", ".1f")
    row(f"supervisor RSS, {SANDBOXES} sandboxes, fake VMs (MiB)", "rss_mib", ".1f")
    row("supervisor RSS, empty registry, fake VMs (MiB)", "empty_mib", ".1f")
    row("RSS per sandbox, fake VMs (KiB)", "per_sandbox_kib", ".0f")
    row("unit session `pytest -m 'not vm and not host'` (s, one run each)", "unit_s", ".1f")
    rows.append("")
    for side in ("before", "after"):
        u = res["units"].get(side)
        if u:
            rows.append(f"- unit session, {side}: {u['wall_s']:.1f} s, `{u['summary']}`, load {u['load']}")
            rows += [f"  - {line}" for line in u.get("failed", [])]
    rows.append(f"- load average during the interleaved rounds: {', '.join(res['loads'])}")
    rows.append("")
    return "\n".join(rows)


def parent(before: Path, after: Path, rounds: int, units: bool, out: Path | None) -> dict[str, Any]:
    trees = {"before": before.resolve(), "after": after.resolve()}
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in trees}
    loads = [loadavg()]
    for r in range(rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for side in order:
            for mode, args in (("latency", ["--creates", "2"]), ("rss", [])):
                got = in_tree(trees[side], mode, *args)
                for k, v in got.items():
                    samples[side].setdefault(k, []).append(v)
                print(f"round {r} {side} {mode}: {got}", file=sys.stderr)
        loads.append(loadavg())
    res: dict[str, Any] = {
        "rounds": rounds,
        "loads": loads,
        "samples": samples,
        "units": {},
        **{side: {k: statistics.median(v) for k, v in samples[side].items()} for side in trees},
    }
    if units:
        for side in ("before", "after"):
            res["units"][side] = unit_session(trees[side])
            res[side]["unit_s"] = res["units"][side]["wall_s"]
            print(f"units {side}: {res['units'][side]}", file=sys.stderr)
    md = table(res)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "house.json").write_text(json.dumps(res, indent=2))
        (out / "house.md").write_text(md)
    print(md)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*", type=Path, help="BEFORE_TREE AFTER_TREE")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-units", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=["latency", "rss"], help=argparse.SUPPRESS)
    ap.add_argument("--creates", type=int, default=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child == "latency":
        print(json.dumps(child_latency(a.creates, inspects=100, runs=20)))
    elif a.child == "rss":
        print(json.dumps(child_rss(SANDBOXES)))
    else:
        if len(a.trees) != 2:
            ap.error("give BEFORE_TREE AFTER_TREE")
        parent(a.trees[0], a.trees[1], a.rounds, not a.no_units, a.out)


if __name__ == "__main__":
    main()
