"""Exposed-port performance (TCG): an HTTP GET and a 64 MiB download through a port
exposed on the host, vs the same requests made inside the guest to itself.

Usage: python benchmarks/network.py [-n N] [--out results/]
"""

from __future__ import annotations

import socket
import statistics
import time
from pathlib import Path
from typing import Any

import trio
from _harness import in_process_daemon, main, write_results

from actors.net.ports import free_port
from supervisor.client import connect

IN_GUEST = """
import socket, statistics, sys, time
def get(path):
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", 8000)) as c:
        c.sendall(b"GET /" + path + b" HTTP/1.0\\r\\n\\r\\n")
        n = 0
        while chunk := c.recv(1 << 20):
            n += len(chunk)
    return time.perf_counter() - t, n
n = int(sys.argv[1])
small = [get(b"small.txt")[0] for _ in range(n)]
big = [get(b"big.bin") for _ in range(3)]
print(statistics.median(small) * 1000, statistics.median([64 / t for t, _ in big]))
"""


def host_get(port: int, path: bytes) -> tuple[float, int]:
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
        c.sendall(b"GET /" + path + b" HTTP/1.0\r\n\r\n")
        n = 0
        while chunk := c.recv(1 << 20):
            n += len(chunk)
    return time.perf_counter() - t, n


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    port = free_port("127.0.0.1", "tcp")
    res: dict[str, Any] = {"n": n}
    async with in_process_daemon("sv-net-") as (cfg, _registry), connect(cfg.socket) as c:
        body = {"id": "net", "network": {"mode": "user"}, "limits": {"memory_mib": 512}}
        body["ports"] = [{"sandbox_port": 8000, "host_port": port}]
        await c.call("Create", body)
        with trio.fail_after(120):
            while (info := await c.call("Inspect", {"id": "net"}))["state"] != "ready":
                if info["state"] == "failed":
                    raise RuntimeError(f"the benchmark sandbox failed: {info['error']}")
                await trio.sleep(0.1)
        setup = (
            "cd /tmp && echo ok > small.txt && head -c 67108864 /dev/urandom > big.bin && "
            "(python3 -m http.server 8000 >/dev/null 2>&1 &)"
        )
        async with c.open_call("Run", {"id": "net", "cmd": ["sh", "-c", setup]}) as call:
            async for _ in call:
                pass
        with trio.fail_after(60):
            while True:
                try:
                    await trio.to_thread.run_sync(host_get, port, b"small.txt")
                    break
                except OSError:
                    await trio.sleep(0.3)
        small = [(await trio.to_thread.run_sync(host_get, port, b"small.txt"))[0] for _ in range(n)]
        big = [await trio.to_thread.run_sync(host_get, port, b"big.bin") for _ in range(3)]
        assert all(nbytes > 64 << 20 for _, nbytes in big)
        out = b""
        async with c.open_call("Run", {"id": "net", "cmd": ["python3", "-c", IN_GUEST, str(n)]}) as call:
            async for item in call:
                out += item.get("data", b"")
        g_small_ms, g_big_mibs = (float(x) for x in out.split())
        res["http_get"] = {"exposed_p50_ms": statistics.median(small) * 1e3, "in_guest_p50_ms": g_small_ms}
        res["download_64mib"] = {
            "exposed_mib_s": statistics.median([64 / t for t, _ in big]),
            "in_guest_mib_s": g_big_mibs,
        }
    h, d = res["http_get"], res["download_64mib"]
    md = "\n".join(
        [
            "## Exposed port (TCG, user networking, python3 -m http.server in the guest)",
            "",
            "| measure | through the exposed port (host) | inside the guest, to itself |",
            "|---|---|---|",
            f"| HTTP GET, p50 (ms) | {h['exposed_p50_ms']:.1f} | {h['in_guest_p50_ms']:.1f} |",
            f"| 64 MiB download (MiB/s) | {d['exposed_mib_s']:.1f} | {d['in_guest_mib_s']:.1f} |",
            "",
        ]
    )
    write_results(out_dir, "network", res, md)
    return res


if __name__ == "__main__":
    main(bench)
