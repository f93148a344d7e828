"""What freezing the guest's file systems adds to a pause and a checkpoint.

Two real ``sandvisor serve`` processes on this tree's image, one with freezing (the
default) and one with ``--no-fs-freeze``; in each, one sandbox (256 MiB, booted from
its boot template) with a writer appending and fsyncing in a loop. Rounds alternate
which supervisor goes first (interleaved: the machine's load falls on both alike);
each round, per supervisor:

* pause: the Pause RPC's round trip, then resume (the Resume RPC, warm: its hello
  thaws the guest's saved-frozen memory);
* checkpoint: the Checkpoint RPC's round trip (its snapshot kept: the sandbox's disk
  stands on it; both chains deepen alike);
* from the sandbox's log lines, per capture (pauses and checkpoints): the guest's
  stopped window and the freeze's own round trip (guestd's sync and FIFREEZE of every
  writable mount), which comes before the stop.

Medians (and p90) per measure and mode. Usage: python benchmarks/freeze.py [-n N] [--out results/]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import trio
from _harness import pct, write_results

from images.build import Builder, default_cache, hold_parts
from supervisor.client import AsyncSandbox, connect
from supervisor.main.throwaway import supervisor_process, workdir

WRITER = r"""
import os
os.makedirs("/var/tmp/fz", exist_ok=True)
i = 0
while True:
    with open("/var/tmp/fz/log", "a") as f:
        f.write(("%d\n" % i) * 64)
        f.flush()
        os.fsync(f.fileno())
    i += 1
"""
MODES = ("freeze", "no-freeze")
# a capture's line (a pause's too: it is a checkpoint that leaves the guest stopped)
CAPTURED = re.compile(rb"^checkpoint: \w+, paused (\d+) ms(?:; file systems frozen \((\d+) ms\))?")


@contextmanager
def serving(prefix: str, *args: str) -> Iterator[str]:
    """A supervisor on this tree's image (a manifest of its own: the shared cache's
    names whichever tree built last); its socket."""
    img = Builder(default_cache()).build()
    with hold_parts(img), tempfile.TemporaryDirectory(prefix=f"{prefix}cache-", dir="/tmp") as cache:
        os.chmod(cache, 0o755)
        (Path(cache) / "default.json").write_text(json.dumps(img.to_json()))
        with workdir(prefix, cache=Path(cache)) as work, supervisor_process(work, *args):
            yield str(work.socket)


@asynccontextmanager
async def writing(sock: str, name: str) -> AsyncIterator[AsyncSandbox]:
    async with await AsyncSandbox.create(name, socket=sock) as sb:
        await sb.fs.write("/run/writer.py", WRITER.encode())
        await sb.run(["sh", "-c", "(python3 /run/writer.py) >/dev/null 2>&1 &"])
        yield sb
        await sb.remove()


async def timed(f: Any) -> float:
    t0 = time.monotonic()
    await f()
    return time.monotonic() - t0


async def captures(sock: str, name: str, since: int) -> list[tuple[float, float | None]]:
    """The captures the sandbox's log reports after seq ``since``: (the guest's stopped
    window, the freeze's round trip or None), in seconds."""
    async with connect(sock) as c:
        logs = await c.collect("Logs", {"id": name})
    found = [CAPTURED.search(e["data"]) for e in logs if e["seq"] > since and e["source"] == "system"]
    return [(int(m[1]) / 1000, int(m[2]) / 1000 if m[2] else None) for m in found if m]


async def last_seq(sock: str, name: str) -> int:
    async with connect(sock) as c:
        logs = await c.collect("Logs", {"id": name, "tail": 1})
    return int(logs[-1]["seq"]) if logs else 0


async def round_of(sock: str, sb: AsyncSandbox, out: dict[str, list[float]]) -> None:
    since = await last_seq(sock, sb.id)
    out["pause"].append(await timed(sb.pause))
    out["resume"].append(await timed(sb.resume))
    await trio.sleep(0.5)  # (the writer runs again: the checkpoint meets it mid-write)
    out["checkpoint"].append(await timed(sb.checkpoint))  # (kept: the sandbox's disk stands on it)
    for stopped, froze in await captures(sock, sb.id, since):
        out["guest_stopped"].append(stopped)
        if froze is not None:
            out["freeze_round_trip"].append(froze)
    await trio.sleep(0.5)


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {
        m: {k: [] for k in ("pause", "resume", "checkpoint", "guest_stopped", "freeze_round_trip")} for m in MODES
    }
    with serving("sv-fzb-") as on, serving("sv-nofzb-", "--no-fs-freeze") as off:
        socks = {"freeze": on, "no-freeze": off}
        async with writing(on, "fz-bench") as a, writing(off, "nofz-bench") as b:
            sbs = {"freeze": a, "no-freeze": b}
            for mode in MODES:  # a warm-up round each (a first pause is mapped, later ones alternate)
                await round_of(socks[mode], sbs[mode], {k: [] for k in samples[mode]})
            for i in range(n):
                for mode in MODES if i % 2 == 0 else MODES[::-1]:
                    await round_of(socks[mode], sbs[mode], samples[mode])
                print(f"round {i + 1}/{n}", flush=True)
    res: dict[str, Any] = {"n": n, "samples": samples}
    for mode, by in samples.items():
        res[mode] = {k: {"p50": pct(v, 50), "p90": pct(v, 90), "n": len(v)} for k, v in by.items()}
    write_results(out_dir, "freeze", res, markdown(res))
    return res


def markdown(res: dict[str, Any]) -> str:
    ms = 1000.0
    on, off = res["freeze"], res["no-freeze"]
    r = [
        f"## Freezing the guest's file systems at pause and checkpoint (TCG, n={res['n']}, interleaved; "
        "a writer fsyncing in a loop)",
        "",
        "| measure | freeze p50 / p90 | no freeze p50 / p90 | p50 difference |",
        "|---|---|---|---|",
    ]
    for k in ("pause", "resume", "checkpoint", "guest_stopped"):
        a, b = on[k], off[k]
        both = f"{a['p50'] * ms:.0f} / {a['p90'] * ms:.0f} ms | {b['p50'] * ms:.0f} / {b['p90'] * ms:.0f} ms"
        what = "guest stopped (each capture's window, from the log)" if k == "guest_stopped" else f"{k} (RPC)"
        r.append(f"| {what} | {both} | {(a['p50'] - b['p50']) * ms:+.0f} ms |")
    f = on["freeze_round_trip"]
    r += [
        "",
        f"The freeze itself (sync + FIFREEZE, guest round trip): p50 {f['p50'] * ms:.0f} ms, "
        f"p90 {f['p90'] * ms:.0f} ms (n={f['n']}).",
        "",
    ]
    return "\n".join(r)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=10)
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    trio.run(bench, a.n, Path(a.out))


if __name__ == "__main__":
    main()
