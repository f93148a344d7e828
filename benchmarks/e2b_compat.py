"""The E2B endpoint's cost: the ``e2b`` SDK through ``serve --e2b`` against the sandvisor
SDK on the supervisor's socket, on the same sandbox, in one run, interleaved.

* ``commands.run("true")``: E2B runs it as ``/bin/bash -l -c true``, so the sandvisor
  SDK runs the same argv, as a Run and as an Exec (the endpoint holds an Exec per
  process: that ratio is the endpoint's own overhead, HTTP and Connect); plain
  ``["true"]`` is shown too.
* a 16 MiB ``files.write`` + ``files.read`` (bytes) against ``fs.write`` + ``fs.read``.

Medians of ``-n`` rounds; the ratio is E2B's median / the SDK's.

Usage: python -P benchmarks/e2b_compat.py [-n 20] [--out results/]
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

from e2b import Sandbox as E2BSandbox

from supervisor.client.sdk.sync import Sandbox
from supervisor.main.throwaway import supervisor_process, workdir

KEY = "bench-key"
BIG = 16 << 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _exec(sb: Sandbox, argv: list[str]) -> int:
    """The path the endpoint takes: an Exec, stdin closed, to its end."""
    with sb.exec(argv) as proc:
        proc.close_stdin()
        return proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    keys = ("e2b_true", "sdk_bash_true", "sdk_exec_bash_true", "sdk_true", "e2b_file", "sdk_file")
    samples: dict[str, list[float]] = {k: [] for k in keys}
    data = os.urandom(BIG)
    with workdir("sv-bench-e2b-") as work:
        keys = work.root / "keys"
        keys.write_text(KEY + "\n")
        keys.chmod(0o600)
        port = _port()
        with supervisor_process(work, "--e2b", f"127.0.0.1:{port}", "--e2b-key-file", str(keys)):
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
            e = E2BSandbox.create(timeout=3600, api_url=url, sandbox_url=url, api_key=KEY, request_timeout=300)
            sb = Sandbox.get(e.sandbox_id, socket=work.socket)
            try:
                for i in range(a.n + 1):  # round 0 warms both paths up and is dropped
                    r = {
                        "e2b_true": _timed(lambda: e.commands.run("true")),
                        "sdk_bash_true": _timed(lambda: sb.run(["/bin/bash", "-l", "-c", "true"])),
                        "sdk_exec_bash_true": _timed(lambda: _exec(sb, ["/bin/bash", "-l", "-c", "true"])),
                        "sdk_true": _timed(lambda: sb.run(["true"])),
                        "e2b_file": _timed(
                            lambda: (e.files.write("/tmp/e.bin", data), e.files.read("/tmp/e.bin", format="bytes"))
                        ),
                        "sdk_file": _timed(lambda: (sb.fs.write("/tmp/s.bin", data), sb.fs.read("/tmp/s.bin"))),
                    }
                    if i:
                        for k, v in r.items():
                            samples[k].append(v)
                assert bytes(e.files.read("/tmp/e.bin", format="bytes")) == data == sb.fs.read("/tmp/s.bin")
            finally:
                e.kill()
    med = {k: statistics.median(v) * 1000 for k, v in samples.items()}
    res: dict[str, Any] = {
        "n": a.n,
        "median_ms": med,
        "ratio_run_true": med["e2b_true"] / med["sdk_bash_true"],
        "ratio_run_true_vs_exec": med["e2b_true"] / med["sdk_exec_bash_true"],
        "ratio_file_16mib": med["e2b_file"] / med["sdk_file"],
    }
    md = (
        f"# E2B endpoint vs sandvisor SDK (median of {a.n}, one run, interleaved, TCG)\n\n"
        "| operation | e2b SDK via serve --e2b | sandvisor SDK | ratio |\n|---|---|---|---|\n"
        f'| commands.run("true") (bash -l -c true) | {med["e2b_true"]:.1f} ms | {med["sdk_bash_true"]:.1f} ms '
        f"| {res['ratio_run_true']:.2f} |\n"
        f"| the same as an Exec (the endpoint's path) | | {med['sdk_exec_bash_true']:.1f} ms "
        f"| {res['ratio_run_true_vs_exec']:.2f} |\n"
        f'| run(["true"]) (no shell) | | {med["sdk_true"]:.1f} ms | |\n'
        f"| 16 MiB write + read | {med['e2b_file']:.0f} ms | {med['sdk_file']:.0f} ms "
        f"| {res['ratio_file_16mib']:.2f} |\n"
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2b_compat.json").write_text(json.dumps(res, indent=2))
    (out / "e2b_compat.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
