"""What the in-process-daemon benchmarks share: a throwaway supervisor, results, argv."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from actors.registry import Registry
from supervisor.main.daemon_config import DaemonConfig
from supervisor.main.throwaway import supervisor, workdir


@asynccontextmanager
async def in_process_daemon(prefix: str, **options: Any) -> AsyncIterator[tuple[DaemonConfig, Registry]]:
    """A supervisor on a fresh state dir that shares the built image (``options``: serve's
    settings, e.g. ``max_sandboxes``); removed after."""
    with workdir(prefix) as work:
        async with supervisor(work, **options) as (cfg, registry):
            yield cfg, registry


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile (nearest rank); 0 for no samples."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99), "n": len(xs)}


def write_results(out_dir: Path, name: str, res: dict[str, Any], md: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(res, indent=2))
    (out_dir / f"{name}.md").write_text(md)
    print(md)


def main(bench: Callable[[int, Path], Awaitable[dict[str, Any]]], default_n: int = 30) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=default_n)
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    trio.run(bench, a.n, Path(a.out))
