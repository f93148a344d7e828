"""Run a module under cProfile switched by signals (benchmarks/burst.py --profile):
SIGUSR1 starts profiling the main thread (its CPU time), SIGUSR2 stops it and writes the stats to
``OUT`` (appending ``.N`` for the N-th window). Usage::

    python benchmarks/_profserve.py OUT -m supervisor.main.cli serve ...
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
import time
from types import FrameType


def main() -> None:
    out, dash_m, module, *rest = sys.argv[1:]
    if dash_m != "-m":
        raise SystemExit(__doc__)
    prof = cProfile.Profile(time.thread_time)  # CPU, not wall: the host is loaded
    windows = 0

    def start(_sig: int, _frame: FrameType | None) -> None:
        prof.enable()

    def stop(_sig: int, _frame: FrameType | None) -> None:
        nonlocal prof, windows
        prof.disable()
        prof.dump_stats(f"{out}.{windows}")
        windows += 1
        prof = cProfile.Profile(time.thread_time)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
