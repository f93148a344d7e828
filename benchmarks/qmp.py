"""QMP round trip: actors/machines/qmp.py (Trio-native) against qemu.qmp on trio-asyncio (before).

One QEMU (microvm, paused with ``-S``: no guest runs, so only QMP is measured), one
client connected at a time (QEMU's QMP socket takes one). ``query-status`` round trips,
``-n`` per client in all (default 200), in interleaved rounds of 50 so that the shared
machine's noise hits both alike; medians and p90 in microseconds. Also the start-up:
connect + greeting + qmp_capabilities.

The "before" client needs ``trio-asyncio`` (not a dependency: ``pip install trio-asyncio``);
without it only the Trio-native client is measured.

``--parse`` (no QEMU): the protocol core's cost per message QEMU sends (events and
replies as QEMU 7.2 words them, fed in 64 KiB chunks through ``QMPProtocol.receive_data``),
next to qemu.qmp's bare ``Message(line)`` (JSON only: no shape checks, no bounds) as a
reference; CPU time (the shared machine's other load counts less), the best of 7
runs, in microseconds per message.

Usage: python -P benchmarks/qmp.py [-n 200] [--parse] [--out results/]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from qemu.qmp.message import Message

from actors.machines.qmp import QMPClient, QMPProtocol

ROUND = 50


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def connect(path: Path) -> socket.socket:
    with trio.fail_after(10):
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                s.connect(str(path))
                return s
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                await trio.sleep(0.01)


Session = Callable[[Path, int], Awaitable[tuple[float, list[float]]]]


async def ours(path: Path, n: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    client = QMPClient("bench")
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run, await connect(path))
        setup = time.perf_counter() - t0
        times = []
        for _ in range(n):
            t = time.perf_counter()
            assert (await client.execute("query-status"))["status"] == "prelaunch"
            times.append(time.perf_counter() - t)
        await client.aclose()
    return setup, times


async def before(path: Path, n: int) -> tuple[float, list[float]]:
    import trio_asyncio
    from qemu.qmp import QMPClient as OldClient

    t0 = time.perf_counter()
    client = OldClient("bench")
    sock = await connect(path)
    await trio_asyncio.aio_as_trio(client.connect)(sock)
    setup = time.perf_counter() - t0
    times = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            r = await trio_asyncio.aio_as_trio(client.execute)("query-status")
            assert r["status"] == "prelaunch"
            times.append(time.perf_counter() - t)
    finally:
        await trio_asyncio.aio_as_trio(client.disconnect)()
        sock.close()
    return setup, times


def have_before() -> bool:
    try:
        import trio_asyncio  # noqa: F401
    except ImportError:
        return False
    return True


async def measure(n: int, work: Path) -> dict[str, Any]:
    path = work / "qmp.sock"
    argv = [
        "qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-nodefaults", "-no-user-config",
        "-nographic", "-S", "-m", "64M", "-chardev", f"socket,id=qmp,path={path},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
    ]  # fmt: skip
    sessions: dict[str, Session] = {"trio-native (actors/machines/qmp.py)": ours}
    if have_before():
        sessions["qemu.qmp on trio-asyncio (before)"] = before
    qemu = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    rtt: dict[str, list[float]] = {k: [] for k in sessions}
    setup: dict[str, list[float]] = {k: [] for k in sessions}
    try:

        async def run_all() -> None:
            for _ in range(max(1, n // ROUND)):
                for name, session in sessions.items():
                    s, t = await session(path, ROUND)
                    setup[name].append(s)
                    rtt[name] += t

        if len(sessions) > 1:
            import trio_asyncio

            async with trio_asyncio.open_loop():
                await run_all()
        else:
            await run_all()
    finally:
        qemu.kill()
        qemu.wait()
    return {
        name: {
            "n": len(rtt[name]),
            "rtt_p50_us": statistics.median(rtt[name]) * 1e6,
            "rtt_p90_us": pct(rtt[name], 0.9) * 1e6,
            "connect_p50_ms": statistics.median(setup[name]) * 1e3,
        }
        for name in sessions
    }


GREETING = (
    b'{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}, "capabilities": ["oob"]}}'
)
TS = b'"timestamp": {"seconds": 1733100000, "microseconds": 123456}'
PARSE_SAMPLES = {
    "event STOP": b"{" + TS + b', "event": "STOP"}',
    "event MIGRATION": b"{" + TS + b', "event": "MIGRATION", "data": {"status": "completed"}}',
    "reply query-status": b'{"return": {"status": "running", "singlestep": false, "running": true}, "id": %d}',
    "reply query-migrate": (
        b'{"return": {"expected-downtime": 300, "status": "completed", "setup-time": 2, "total-time": 412,'
        b' "ram": {"total": 268435456, "postcopy-requests": 0, "dirty-sync-count": 3, "multifd-bytes": 0,'
        b' "pages-per-second": 81920, "downtime-bytes": 4096, "page-size": 4096, "remaining": 0,'
        b' "postcopy-bytes": 0, "mbps": 2560.5, "transferred": 9437184, "dirty-sync-missed-zero-copy": 0,'
        b' "precopy-bytes": 9433088, "duplicate": 62464, "dirty-pages-rate": 0, "skipped": 0,'
        b' "normal-bytes": 9330688, "normal": 2278}, "downtime": 12}, "id": %d}'
    ),
    "reply error": b'{"id": %d, "error": {"class": "GenericError", "desc": "Device \'x\' not found"}}',
}


def parse_cost(count: int = 20_000, runs: int = 7) -> dict[str, dict[str, float]]:
    """Per message (µs): the protocol core on a stream of one kind, and the bare Message."""
    out: dict[str, dict[str, float]] = {}
    for kind, line in PARSE_SAMPLES.items():
        best_core = best_msg = math.inf
        for _ in range(runs):
            proto = QMPProtocol()
            proto.receive_data(GREETING + b"\n")
            lines = []
            for _ in range(count):
                ident = proto.command("query-status")[0]
                lines.append(line % ident if b"%d" in line else line)
            stream = b"\n".join(lines) + b"\n"
            t = time.process_time()
            got = 0
            for i in range(0, len(stream), 65536):
                got += len(proto.receive_data(stream[i : i + 65536]))
            best_core = min(best_core, (time.process_time() - t) / count)
            assert got == count, (kind, got)
            t = time.process_time()
            for x in lines:
                Message(x)
            best_msg = min(best_msg, (time.process_time() - t) / count)
        out[kind] = {"core_us": best_core * 1e6, "message_us": best_msg * 1e6}
    return out


def parse_main(out: Path) -> None:
    res = parse_cost()
    (out / "qmp_parse.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [
        "## QMP parse cost per message (µs of CPU, best of 7 runs of 20,000)",
        "",
        "| message | protocol core (receive_data) | qemu.qmp Message(line) alone |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {r['core_us']:.2f} | {r['message_us']:.2f} |" for k, r in res.items()]
    text = "\n".join(lines) + "\n"
    (out / "qmp_parse.md").write_text(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--parse", action="store_true", help="the protocol core's parse cost only (no QEMU)")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    if args.parse:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        parse_main(out)
        return
    work = Path(tempfile.mkdtemp(prefix="sv-bench-qmp-"))
    try:
        load0 = os.getloadavg()[0]
        res = trio.run(measure, args.n, work)
        load1 = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "qmp.json").write_text(json.dumps({"load": [load0, load1], "results": res}, indent=2) + "\n")
    lines = [
        f"## QMP round trip (`query-status`, QEMU 7.2 microvm paused), load average {load0:.1f} before,"
        f" {load1:.1f} after",
        "",
        "| client | n | round trip p50 (µs) | p90 (µs) | connect + negotiate p50 (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, r in res.items():
        lines.append(
            f"| {name} | {r['n']} | {r['rtt_p50_us']:.0f} | {r['rtt_p90_us']:.0f} | {r['connect_p50_ms']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "qmp.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
