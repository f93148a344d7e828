"""fork(3) of one running parent, again and again: how often a fork's children fail to
come up (a measure for the live copy's open bug; docs/results/fork.md).

Usage: python benchmarks/fork_loop.py [ROUNDS] [FREEZE 0|1]. Prints one line per round
(ok and the call's seconds, or FAILED and the error), then the count."""

from __future__ import annotations

import sys
import time

import trio
from _harness import in_process_daemon

from supervisor.client import AsyncSandbox

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /run/cnt.new; mv /run/cnt.new /run/cnt; sleep 0.05; done"


async def main(rounds: int, freeze: bool) -> None:
    async with in_process_daemon("sv-floop-", freeze_fs=freeze) as (cfg, _registry):
        sock = str(cfg.socket)
        # the first Create boots and saves the boot template; the parent is the second,
        # a restore of it (its RAM mapped privately), as a default Create is
        first = await AsyncSandbox.create("t", detached=True, socket=sock)
        await first.remove(force=True)
        p = await AsyncSandbox.create("fp", detached=True, socket=sock)
        await p.run(["sh", "-c", f"({COUNTER}) >/dev/null 2>&1 &"])
        failed = 0
        for i in range(rounds):
            t0 = time.monotonic()
            try:
                kids = await p.fork(3)
            except Exception as exc:  # (the measure: every failure, said and counted)
                failed += 1
                print(i, "FAILED", str(exc)[:200], flush=True)
                continue
            print(i, "ok", round(time.monotonic() - t0, 2), flush=True)
            for k in kids:
                await k.remove(force=True)
        print(f"{failed} of {rounds} forks failed")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 20, (sys.argv[2] if len(sys.argv) > 2 else "1") == "1")
