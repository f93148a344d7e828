"""The code interpreter through the E2B endpoint: ``e2b-code-interpreter``'s SDK against
``serve --e2b`` and the code-interpreter image (``sandvisor image build --profile
code-interpreter``; built first if it is not).

* create-to-first-result: ``Sandbox.create()`` (template ``code-interpreter-v1``) then
  ``run_code("1+1")`` until its result, and the two parts of it, three ways, on one
  ``serve --template-pool 1``: cold (the first create: a boot, then the kernel server
  started and warmed, then the boot template saved), pool (a warm member taken, once
  the keeper had ``--pool-wait`` seconds to restore it) and template (a create right
  after that, while the keeper restores the next member: a restore of the template);
* a trivial cell's round trip (``run_code("1+1")`` after the first), against the
  sandvisor SDK's ``run(["python3", "-c", "print(1+1)"])`` on the same sandbox,
  interleaved;
* a matplotlib chart cell's time to its PNG.

Medians of ``-n`` rounds (pool and template creates: ``--creates`` rounds). The load
average (1 min) before and after is in the results: the machine is shared.

Usage: python -P benchmarks/code_interpreter.py [-n 20] [--creates 2] [--pool-wait 60] [--out results/]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2b_code_interpreter import Sandbox as CodeSandbox

from images.build import Builder, default_cache, hold_parts
from images.profiles import build_profile
from supervisor.client.sdk.sync import Sandbox
from supervisor.main.throwaway import supervisor_process, workdir

KEY = "bench-key"
PARTS = ("create", "first_cell", "first_result")
CHART = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _first(opts: dict[str, Any], samples: dict[str, list[float]], kind: str) -> None:
    """One create and its first cell, timed into ``kind``'s samples."""
    t0 = time.perf_counter()
    e = CodeSandbox.create(timeout=3600, **opts)
    t1 = time.perf_counter()
    try:
        assert e.run_code("1+1", timeout=600).text == "2"
        t2 = time.perf_counter()
    finally:
        e.kill()
    samples[f"{kind}_create"].append(t1 - t0)
    samples[f"{kind}_first_cell"].append(t2 - t1)
    samples[f"{kind}_first_result"].append(t2 - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--creates", type=int, default=2)
    ap.add_argument("--pool-wait", type=float, default=60.0)
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    img = build_profile(Builder(default_cache()), "code-interpreter")
    samples: dict[str, list[float]] = {
        f"{k}_{p}": [] for k in ("cold", "pool", "template") for p in ("create", "first_cell", "first_result")
    }
    samples.update(cell=[], sdk_run=[], chart=[])
    load_before = os.getloadavg()[0]
    with hold_parts(img), workdir("sv-bench-ci-") as work:
        keys = work.root / "keys"
        keys.write_text(KEY + "\n")
        keys.chmod(0o600)
        port = _port()
        args = ("--e2b", f"127.0.0.1:{port}", "--e2b-key-file", str(keys), "--template-pool", "1")
        with supervisor_process(work, *args):
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            opts: dict[str, Any] = {"api_url": url, "sandbox_url": url, "api_key": KEY, "request_timeout": 900}
            _first(opts, samples, "cold")
            for _ in range(a.creates):
                time.sleep(a.pool_wait)  # (the keeper restores a member of the new template)
                _first(opts, samples, "pool")
                _first(opts, samples, "template")
            e = CodeSandbox.create(timeout=3600, **opts)
            sb = Sandbox.get(e.sandbox_id, socket=work.socket)
            try:
                e.run_code("1+1", timeout=300)
                for i in range(a.n + 1):  # round 0 warms both paths up and is dropped
                    r = {
                        "cell": _timed(lambda: e.run_code("1+1")),
                        "sdk_run": _timed(lambda: sb.run(["python3", "-c", "print(1+1)"])),
                        "chart": _timed(lambda: next(x.png for x in e.run_code(CHART).results if x.png)),
                    }
                    if i:
                        for k, v in r.items():
                            samples[k].append(v)
            finally:
                e.kill()
    load_after = os.getloadavg()[0]
    med = {k: statistics.median(v) * 1000 for k, v in samples.items() if v}
    res: dict[str, Any] = {
        "n": a.n,
        "creates": a.creates,
        "load_avg_1m": [load_before, load_after],
        "median_ms": med,
    }
    rows = "".join(
        f"| {label} | " + " | ".join(f"{med[f'{k}_{p}']:.0f} ms" for p in PARTS) + " |\n"
        for k, label in (
            ("cold", "cold (boot, kernel started and warmed, template saved)"),
            ("template", "template (a restore of it)"),
            ("pool", "pool (a warm member)"),
        )
    )
    md = (
        f"# Code interpreter via serve --e2b (medians; TCG; n={a.n}, creates={a.creates}; "
        f"load average {load_before:.1f} before, {load_after:.1f} after)\n\n"
        '| create of code-interpreter-v1 | create | first run_code("1+1") | create-to-first-result |\n'
        "|---|---|---|---|\n" + rows + "\n| operation | median |\n|---|---|\n"
        f'| run_code("1+1") round trip, after the first | {med["cell"]:.1f} ms |\n'
        f'| sandvisor SDK run(["python3","-c","print(1+1)"]) | {med["sdk_run"]:.1f} ms |\n'
        f"| matplotlib chart cell to its PNG | {med['chart']:.0f} ms |\n"
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "code_interpreter.json").write_text(json.dumps(res, indent=2))
    (out / "code_interpreter.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
