"""A registry on fake VMs behind both edges (gRPC and the msgpack socket), for the
tests that call the edges with real gRPC clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import trio

from actors.registry import Registry
from actors.store import Store
from supervisor.serve import grpc_bridge, grpc_service
from supervisor.serve.server import Server
from tests.support.fakevm import FakeLab, fake_settings


class Stack:
    def __init__(self, reg: Registry, lab: FakeLab, target: str, msgpack: Path, edge: grpc_bridge.GrpcEdge) -> None:
        self.reg = reg
        self.lab = lab
        self.target = target
        self.msgpack = msgpack
        self.edge = edge
        self.channel = grpc.insecure_channel(target)


@asynccontextmanager
async def stack(root: Path, sock_dir: Path) -> AsyncIterator[Stack]:
    """A registry on fake VMs behind both edges: gRPC and the msgpack socket."""
    lab = FakeLab()
    store = Store(root / "state" / "sandvisor.db")
    try:
        async with trio.open_nursery() as n:
            await n.start(lab.run)
            reg = await n.start(Registry(fake_settings(root, lab), store, templates=False).run)
            try:
                # as the daemon makes them: the peer-credential policy on, so through the relay
                edge = await n.start(
                    grpc_service.build_edge(reg, grpc_service.addresses([f"unix://{sock_dir / 'g.sock'}"])).run
                )
                await n.start(Server(reg, sock_dir / "m.sock").serve)
                st = Stack(reg, lab, f"unix:{sock_dir / 'g.sock'}", sock_dir / "m.sock", edge)
                try:
                    yield st
                finally:
                    st.channel.close()
            finally:
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


async def status_of(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[grpc.StatusCode, str]:
    def call() -> tuple[grpc.StatusCode, str]:
        try:
            result = fn(*args, **kw)
            if hasattr(result, "__next__"):
                list(result)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        raise AssertionError("no error")

    return await trio.to_thread.run_sync(call)
