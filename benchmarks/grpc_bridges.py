"""How gRPC meets Trio: one echo service behind each candidate bridge, measured the same way.

Every server runs in its own process (``serve MODE ADDR``) and does its work in Trio
(except ``aio``, the floor: grpc.aio with no Trio at all). The client is grpcio's sync
client in this process (one process each, so the two ends do not share a GIL):

* unary: 2000 round trips of 64 bytes, after 200 warm-up (p50/p99 in microseconds)
* stream: one server stream of 20000 x 1 KiB and one of 1000 x 64 KiB (msg/s, MB/s)
* cancel: a client cancels a server stream whose Trio task sleeps; time until the
  task sees ``Cancelled`` (CLOCK_MONOTONIC is shared by the processes), 20 times
* deadline: a 200 ms deadline on the same stream; time from the deadline to the Trio
  task's ``Cancelled``, 10 times

Modes:

* ``thread``: supervisor.serve.grpc_bridge (grpc.aio on its own loop in a thread, Trio tasks)
* ``trio-asyncio``: grpc.aio on a trio-asyncio loop in Trio's thread (trio_as_aio per call);
  needs trio-asyncio installed (no longer a dependency: pip install trio-asyncio)
* ``sync-pool``: grpcio's sync server, 16 pool threads calling into Trio (from_thread)
* ``purerpc``: purerpc 0.8 (h2 in Python, anyio on Trio); TCP only: run with a python
  that has purerpc (``--purerpc-python``), compared with ``thread`` over TCP too
* ``aio``: grpc.aio alone (no Trio): the floor the bridges add to
* ``msgpack``: the project's own msgpack Unix-socket server and client (supervisor.serve.server)

Usage: python benchmarks/grpc_bridges.py [--modes thread,aio,...] [--rounds 3] [--out results/]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# --- the work, in Trio (shared by every server mode) ----------------------------------------
CANCELS: list[float] = []


async def w_unary(req: bytes) -> bytes:
    return req


async def w_stream(req: bytes, send: Any) -> None:
    n, size = (int(x) for x in req.split(b","))
    payload = b"x" * size
    for _ in range(n):
        await send(payload)


async def w_hang(req: bytes, send: Any) -> None:
    import trio

    await send(b"first")
    try:
        await trio.sleep_forever()
    finally:
        CANCELS.append(time.monotonic())


async def w_cancel_time(req: bytes) -> bytes:
    """The monotonic time of the k-th cancellation seen (k = req), waiting up to 5 s."""
    import trio

    k = int(req)
    with trio.move_on_after(5):
        while len(CANCELS) <= k:
            await trio.sleep(0.001)
    return repr(CANCELS[k]).encode() if len(CANCELS) > k else b""


UNARY = {"Unary": w_unary, "CancelTime": w_cancel_time}
STREAM = {"Stream": w_stream, "Hang": w_hang}


def ready() -> None:
    print("READY", flush=True)


# --- servers ----------------------------------------------------------------------------------
def serve_thread(addr: str) -> None:
    import trio

    from supervisor.serve.grpc_addresses import parse_address
    from supervisor.serve.grpc_auth import TcpAuth
    from supervisor.serve.grpc_bridge import GrpcEdge, Kind, Method

    async def main() -> None:
        # the bridge alone, on loopback: no client authentication (the daemon's TCP needs one)
        edge = GrpcEdge([parse_address(addr)], health=False, reflection=False, tcp_auth=TcpAuth(insecure=True))
        for name, fn in UNARY.items():
            edge.add_method(Method("bench.Echo", name, Kind.UNARY_UNARY, lambda r, c, fn=fn: fn(r)))
        for name, sfn in STREAM.items():
            edge.add_method(Method("bench.Echo", name, Kind.UNARY_STREAM, lambda r, c, fn=sfn: fn(r, c.send)))
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.run)
            ready()

    trio.run(main)


def _aio_server(handlers: dict[str, Any]) -> Any:
    import grpc
    import grpc.aio

    server = grpc.aio.server()
    rpc = {
        name: (grpc.unary_unary_rpc_method_handler if name in UNARY else grpc.unary_stream_rpc_method_handler)(h)
        for name, h in handlers.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", rpc),))
    return server


def serve_trio_asyncio(addr: str) -> None:
    import asyncio

    import trio
    import trio_asyncio

    def unary(fn: Any) -> Any:
        async def h(req: bytes, ctx: Any) -> bytes:
            return await trio_asyncio.trio_as_aio(fn)(req)

        return h

    def stream(fn: Any) -> Any:
        async def h(req: bytes, ctx: Any) -> None:
            async def send(m: bytes) -> None:
                await trio_asyncio.aio_as_trio(ctx.write)(m)

            await trio_asyncio.trio_as_aio(fn)(req, send)

        return h

    async def aio_main() -> None:
        server = _aio_server({**{n: unary(f) for n, f in UNARY.items()}, **{n: stream(f) for n, f in STREAM.items()}})
        server.add_insecure_port(addr)
        await server.start()
        ready()
        await asyncio.Event().wait()

    async def main() -> None:
        async with trio_asyncio.open_loop():
            await trio_asyncio.aio_as_trio(aio_main)()

    trio.run(main)


def serve_sync_pool(addr: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    import trio

    async def main() -> None:
        token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:

            def unary(fn: Any) -> Any:
                return lambda req, ctx: trio.from_thread.run(fn, req, trio_token=token)

            def stream(fn: Any) -> Any:
                def h(req: bytes, ctx: Any) -> Any:
                    send, recv = trio.open_memory_channel[bytes](16)
                    scope = trio.CancelScope()

                    async def task() -> None:
                        async with send:
                            with scope:
                                await fn(req, send.send)

                    ctx.add_callback(lambda: token.run_sync_soon(scope.cancel))
                    trio.from_thread.run_sync(nursery.start_soon, task, trio_token=token)
                    while True:
                        try:
                            yield trio.from_thread.run(recv.receive, trio_token=token)
                        except trio.EndOfChannel:
                            return

                return h

            server = grpc.server(ThreadPoolExecutor(16))
            rpc = {n: grpc.unary_unary_rpc_method_handler(unary(f)) for n, f in UNARY.items()}
            rpc |= {n: grpc.unary_stream_rpc_method_handler(stream(f)) for n, f in STREAM.items()}
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", rpc),))
            server.add_insecure_port(addr)
            server.start()
            ready()
            try:
                await trio.sleep_forever()
            finally:
                server.stop(0)

    trio.run(main)


def serve_aio(addr: str) -> None:
    import asyncio

    async def a_unary(req: bytes, ctx: Any) -> bytes:
        return req

    async def a_cancel_time(req: bytes, ctx: Any) -> bytes:
        k = int(req)
        for _ in range(5000):
            if len(CANCELS) > k:
                return repr(CANCELS[k]).encode()
            await asyncio.sleep(0.001)
        return b""

    async def a_stream(req: bytes, ctx: Any) -> None:
        n, size = (int(x) for x in req.split(b","))
        payload = b"x" * size
        for _ in range(n):
            await ctx.write(payload)

    async def a_hang(req: bytes, ctx: Any) -> None:
        await ctx.write(b"first")
        try:
            await asyncio.Event().wait()
        finally:
            CANCELS.append(time.monotonic())

    async def main() -> None:
        server = _aio_server({"Unary": a_unary, "CancelTime": a_cancel_time, "Stream": a_stream, "Hang": a_hang})
        server.add_insecure_port(addr)
        await server.start()
        ready()
        await asyncio.Event().wait()

    asyncio.run(main())


def serve_purerpc(addr: str) -> None:
    import purerpc
    import trio

    class Raw:
        def __init__(self, data: bytes = b"") -> None:
            self.data = data

        def SerializeToString(self) -> bytes:
            return self.data

        def ParseFromString(self, data: bytes) -> None:
            self.data = data

    svc = purerpc.Service("bench.Echo")
    unary_sig = purerpc.RPCSignature(purerpc.Cardinality.UNARY_UNARY, Raw, Raw)
    stream_sig = purerpc.RPCSignature(purerpc.Cardinality.UNARY_STREAM, Raw, Raw)

    def unary(fn: Any) -> Any:
        async def u(msg: Raw) -> Raw:
            return Raw(await fn(msg.data))

        return u

    def stream(fn: Any) -> Any:
        # purerpc streams are async generators: the work runs in a task feeding a channel
        async def s(msg: Raw) -> Any:
            send, recv = trio.open_memory_channel[bytes](16)

            async def work() -> None:
                async with send:
                    await fn(msg.data, send.send)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(work)
                async for item in recv:
                    yield Raw(item)

        return s

    for name, fn in UNARY.items():
        svc.add_method(name, unary(fn), unary_sig)
    for name, fn in STREAM.items():
        svc.add_method(name, stream(fn), stream_sig)
    port = int(addr.rsplit(":", 1)[1])

    async def main() -> None:
        server = purerpc.Server(port)
        server.add_service(svc)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve_async)
            ready()

    trio.run(main)


def serve_msgpack(addr: str) -> None:
    import attrs
    import trio

    from supervisor.serve import server

    @attrs.frozen
    class Blob:
        data: bytes = b""

    @server.method("BenchUnary")
    async def _u(srv: Any, ctx: Any, body: dict[str, Any]) -> Any:
        return Blob(await w_unary(body["data"]))

    @server.method("BenchStream", server.STREAM)
    async def _s(srv: Any, ctx: Any, body: dict[str, Any]) -> Any:
        await w_stream(body["data"], lambda b: ctx.item(Blob(b)))

    @server.method("BenchHang", server.STREAM)
    async def _h(srv: Any, ctx: Any, body: dict[str, Any]) -> Any:
        await w_hang(body["data"], lambda b: ctx.item(Blob(b)))

    @server.method("BenchCancelTime")
    async def _c(srv: Any, ctx: Any, body: dict[str, Any]) -> Any:
        return Blob(await w_cancel_time(body["data"]))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.Server(None, Path(addr)).serve)  # type: ignore[arg-type]
            ready()

    trio.run(main)


SERVERS = {
    "thread": serve_thread,
    "trio-asyncio": serve_trio_asyncio,
    "sync-pool": serve_sync_pool,
    "aio": serve_aio,
    "purerpc": serve_purerpc,
    "msgpack": serve_msgpack,
}


# --- clients ------------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] if xs else 0.0


def measure_grpc(target: str) -> dict[str, Any]:
    import grpc

    ch = grpc.insecure_channel(target)
    unary = ch.unary_unary("/bench.Echo/Unary")
    stream = ch.unary_stream("/bench.Echo/Stream")
    hang = ch.unary_stream("/bench.Echo/Hang")
    cancel_time = ch.unary_unary("/bench.Echo/CancelTime")
    payload = b"p" * 64
    for _ in range(200):
        unary(payload)
    lat = []
    for _ in range(2000):
        t = time.perf_counter()
        unary(payload)
        lat.append(time.perf_counter() - t)
    res: dict[str, Any] = {"unary_p50_us": pct(lat, 50) * 1e6, "unary_p99_us": pct(lat, 99) * 1e6}
    for label, n, size in (("1KiB", 20000, 1024), ("64KiB", 1000, 65536)):
        t = time.perf_counter()
        got = sum(1 for _ in stream(f"{n},{size}".encode()))
        dt = time.perf_counter() - t
        assert got == n, (got, n)
        res[f"stream_{label}_msgs_s"] = n / dt
        res[f"stream_{label}_MB_s"] = n * size / dt / 1e6
    k = 0
    cancel = []
    for _ in range(20):
        it = hang(b"")
        next(it)
        t0 = time.monotonic()
        it.cancel()
        seen = cancel_time(str(k).encode())
        k += 1
        cancel.append((float(seen) - t0) * 1e3 if seen else float("inf"))
    res["cancel_ms_median"] = statistics.median(cancel)
    res["cancel_ms_max"] = max(cancel)
    dl = []
    for _ in range(10):
        t0 = time.monotonic()
        try:
            for _ in hang(b"", timeout=0.2):
                pass
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
        seen = cancel_time(str(k).encode())
        k += 1
        dl.append((float(seen) - t0 - 0.2) * 1e3 if seen else float("inf"))
    res["deadline_ms_median"] = statistics.median(dl)
    res["deadline_ms_max"] = max(dl)
    ch.close()
    return res


def measure_msgpack(path: str) -> dict[str, Any]:
    import trio

    from supervisor.client import connect

    async def main() -> dict[str, Any]:
        async with connect(path) as c:
            payload = {"data": b"p" * 64}
            for _ in range(200):
                await c.call("BenchUnary", payload)
            lat = []
            for _ in range(2000):
                t = time.perf_counter()
                await c.call("BenchUnary", payload)
                lat.append(time.perf_counter() - t)
            res: dict[str, Any] = {"unary_p50_us": pct(lat, 50) * 1e6, "unary_p99_us": pct(lat, 99) * 1e6}
            for label, n, size in (("1KiB", 20000, 1024), ("64KiB", 1000, 65536)):
                t = time.perf_counter()
                got = len(await c.collect("BenchStream", {"data": f"{n},{size}".encode()}))
                dt = time.perf_counter() - t
                assert got == n
                res[f"stream_{label}_msgs_s"] = n / dt
                res[f"stream_{label}_MB_s"] = n * size / dt / 1e6
            cancel = []
            for k in range(20):
                async with c.open_call("BenchHang", {"data": b""}) as call:
                    await call.__anext__()
                    t0 = time.monotonic()
                    await call.cancel()
                seen = (await c.call("BenchCancelTime", {"data": str(k).encode()}))["data"]
                cancel.append((float(seen) - t0) * 1e3 if seen else float("inf"))
            res["cancel_ms_median"] = statistics.median(cancel)
            res["cancel_ms_max"] = max(cancel)
            return res

    return trio.run(main)


def run_mode(mode: str, tcp: bool, python: str) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="grpc-bench-"))
    if mode == "msgpack":
        addr = target = str(work / "m.sock")
    elif tcp:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        addr = target = f"127.0.0.1:{port}"
    else:
        addr = f"unix://{work / 'g.sock'}"
        target = f"unix:{work / 'g.sock'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [python, __file__, "serve", mode, addr], stdout=subprocess.PIPE, env=env, text=True, cwd=str(ROOT)
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"{mode} did not start: {line!r}")
        return measure_msgpack(addr) if mode == "msgpack" else measure_grpc(target)
    finally:
        proc.kill()
        proc.wait()
        for f in work.iterdir():
            f.unlink()
        work.rmdir()


COLS = [
    ("unary_p50_us", "unary p50 µs", "{:.0f}"),
    ("unary_p99_us", "unary p99 µs", "{:.0f}"),
    ("stream_1KiB_msgs_s", "stream 1 KiB msg/s", "{:.0f}"),
    ("stream_64KiB_MB_s", "stream 64 KiB MB/s", "{:.0f}"),
    ("cancel_ms_median", "cancel→Trio ms (med/max)", None),
    ("deadline_ms_median", "deadline→Trio ms (med/max)", None),
]


def table(rows: dict[str, dict[str, float]]) -> str:
    out = ["| mode | " + " | ".join(c[1] for c in COLS) + " |", "|---" * (len(COLS) + 1) + "|"]
    for mode, r in rows.items():
        cells = []
        for key, _, fmt in COLS:
            if fmt is None:
                base = key.removesuffix("_median")
                cells.append(f"{r[key]:.1f} / {r[base + '_max']:.1f}" if key in r else "n/a")
            else:
                cells.append(fmt.format(r[key]) if key in r else "n/a")
        out.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) >= 4 and sys.argv[1] == "serve":
        SERVERS[sys.argv[2]](sys.argv[3])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="aio,thread,sync-pool,msgpack")
    ap.add_argument("--tcp-modes", default="", help="modes also measured over TCP loopback (e.g. thread,purerpc)")
    ap.add_argument("--purerpc-python", default="", help="a python with purerpc and trio installed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    plan = [(m, False) for m in args.modes.split(",") if m] + [(m, True) for m in args.tcp_modes.split(",") if m]
    runs: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):  # interleaved rounds: noise on this shared machine hits every mode alike
        for mode, tcp in plan:
            label = f"{mode} (tcp)" if tcp else mode
            python = args.purerpc_python if mode == "purerpc" and args.purerpc_python else sys.executable
            r = run_mode(mode, tcp, python)
            runs.setdefault(label, []).append(r)
            print(f"round {rnd + 1} {label}: " + ", ".join(f"{k}={v:.1f}" for k, v in r.items()), flush=True)
    med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
    md = (
        "# gRPC bridges to Trio (benchmarks/grpc_bridges.py)\n\n"
        f"Medians of {args.rounds} interleaved rounds; each round: 2000 unary calls, a 20000 x 1 KiB and a "
        "1000 x 64 KiB server stream, 20 client cancels, 10 deadlines of 200 ms. Server in its own process, "
        "client grpcio sync (msgpack: the project's Trio client). Unix socket unless (tcp).\n\n" + table(med) + "\n"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grpc_bridges.json").write_text(json.dumps({"medians": med, "runs": runs}, indent=2))
    (out / "grpc_bridges.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
