"""The kernel runtime's relay (supervisor/serve/kernels.py) against a fake guest: it is
open only while requests are in flight, the answer that empties it comes once its Exec
has ended (the sandbox is idle when the caller hears), a request that comes while it
closes is served through the next one, and nothing is left running. The real guest:
tests/vm/test_run_code.py."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
import trio

from supervisor.serve.kernels import KernelHost, Kernels


@attrs.frozen
class Out:
    stream: str
    data: bytes


class FakeExec:
    """A relay as the guest runs it: "ready", then each request answered (an execute
    when its gate opens); its stdin's end ends it (the first relay's: once
    ``hold_close`` is set)."""

    def __init__(self, guest: FakeGuest) -> None:
        self.guest = guest
        self.send_ch, self.recv_ch = trio.open_memory_channel[Out](100)
        self.send_ch.send_nowait(Out("stdout", b'{"ready": true}\n'))
        self.stdin_closed = False
        self.first = guest.opened == 1

    async def send(self, data: bytes) -> None:
        assert not self.stdin_closed
        for line in data.splitlines():
            req = json.loads(line)
            self.guest.requests.append(req)
            if req["op"] == "interrupt":
                continue
            self.guest.nursery.start_soon(self._answer, req)

    async def _answer(self, req: dict[str, Any]) -> None:
        if req["op"] == "execute":
            await self.send_ch.send(Out("stdout", json.dumps({"id": req["id"], "msg": {"type": "stdout"}}).encode()))
            await self.send_ch.send(Out("stdout", b"\n"))
            await self.guest.gates.setdefault(req["code"], trio.Event()).wait()
        done = {"id": req["id"], "done": True, "value": req["op"]}
        await self.send_ch.send(Out("stdout", json.dumps(done).encode() + b"\n"))

    async def close_stdin(self) -> None:
        self.stdin_closed = True
        self.guest.nursery.start_soon(self._end)

    async def _end(self) -> None:
        if self.first:
            await self.guest.hold_close.wait()
        await self.send_ch.send(Out("exit", b""))
        self.send_ch.close()

    def __aiter__(self) -> FakeExec:
        return self

    async def __anext__(self) -> Out:
        try:
            return await self.recv_ch.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


@attrs.define(eq=False)
class FakeGuest:
    nursery: trio.Nursery
    open: int = 0  # exec sessions open (the sandbox's count)
    opened: int = 0
    requests: list[dict[str, Any]] = attrs.Factory(list)
    lives: list[str] = attrs.Factory(list)
    gates: dict[str, trio.Event] = attrs.Factory(dict)
    hold_close: trio.Event = attrs.Factory(trio.Event)

    # the target's shape
    sandbox = "sb"
    uid = "uid-1"

    @property
    def client(self) -> FakeGuest:
        return self

    def acting(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def handle(self) -> FakeGuest:
        return self

    @contextlib.asynccontextmanager
    async def exec(self, argv: list[str], *, workdir: str = "") -> AsyncIterator[FakeExec]:
        assert argv[-2] == "SOURCE"
        self.lives.append(argv[-1])  # (the host's first relay names the sandbox's life, later ones not)
        self.open += 1
        self.opened += 1
        try:
            yield FakeExec(self)
        finally:
            self.open -= 1


async def collect(host: KernelHost, guest: FakeGuest, op: str, **fields: Any) -> tuple[list[dict[str, Any]], int]:
    """A call's answers, and the exec sessions open when its "done" came."""
    _, recv = await host.call(op, **fields)
    got = []
    async with recv:
        async for msg in recv:
            got.append(msg)
            if msg.get("done"):
                return got, guest.open
    raise AssertionError(f"no done: {got}")


async def test_the_relay_is_closed_before_the_last_answer_and_reopened_by_the_next_call() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            guest = FakeGuest(nursery)
            guest.hold_close.set()
            guest.gates["1"] = trio.Event()
            guest.gates["1"].set()
            kernels = Kernels(nursery)
            kernels._source = "SOURCE"
            host = kernels.host(guest)
            got, open_then = await collect(host, guest, "execute", code="1")
            assert [m.get("done", False) for m in got] == [False, True] and open_then == 0
            assert host.idle and guest.open == 0
            assert (await host.unary("list"), guest.open, guest.opened) == ("list", 0, 2)
            assert guest.lives == [host.life, ""] and len(host.life) == 32
            kernels.forget(guest.uid)
            nursery.cancel_scope.cancel()


async def test_requests_in_flight_share_one_relay_which_closes_after_the_last() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            guest = FakeGuest(nursery)
            guest.hold_close.set()
            kernels = Kernels(nursery)
            kernels._source = "SOURCE"
            host = kernels.host(guest)
            results: dict[str, tuple[list[dict[str, Any]], int]] = {}

            async def one(code: str) -> None:
                results[code] = await collect(host, guest, "execute", code=code)

            async with trio.open_nursery() as calls:
                calls.start_soon(one, "a")
                calls.start_soon(one, "b")
                while len(guest.requests) < 2:
                    await trio.sleep(0.01)
                assert guest.open == 1
                guest.gates.setdefault("a", trio.Event()).set()
                while "a" not in results:
                    await trio.sleep(0.01)
                assert results["a"][1] == 1  # (b is in flight: the relay stays)
                rid = {r["code"]: r["id"] for r in guest.requests}
                await host.interrupt(rid["a"])  # (a is answered: nothing is sent)
                assert len(guest.requests) == 2
                await host.interrupt(rid["b"])
                assert guest.requests[-1] == {"id": 0, "op": "interrupt", "target": rid["b"]}
                guest.gates.setdefault("b", trio.Event()).set()
            assert results["b"][1] == 0 and guest.opened == 1 and host.idle
            nursery.cancel_scope.cancel()


async def test_a_call_that_comes_while_the_relay_closes_is_served_by_the_next() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            guest = FakeGuest(nursery)
            kernels = Kernels(nursery)
            kernels._source = "SOURCE"
            host = kernels.host(guest)
            first: list[Any] = []

            async def run_first() -> None:
                first.append(await collect(host, guest, "create"))

            nursery.start_soon(run_first)
            while not guest.requests or not (host.relay is None or host.relay.closing):
                await trio.sleep(0.01)
            # the first relay closes (held open by the guest): its caller has not heard yet
            assert guest.open == 1 and not first
            second, _ = await collect(host, guest, "list")
            assert second[-1]["value"] == "list" and guest.opened == 2 and not first
            guest.hold_close.set()
            while not first:
                await trio.sleep(0.01)
            assert first[0][0][-1]["value"] == "create" and first[0][1] == 0
            assert host.idle and guest.open == 0
            nursery.cancel_scope.cancel()


async def test_a_warm_up_opens_and_closes_and_a_forgotten_host_ends_its_relays() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            guest = FakeGuest(nursery)
            guest.hold_close.set()
            kernels = Kernels(nursery)
            kernels._source = "SOURCE"
            host = kernels.host(guest)
            host.warm()
            await trio.sleep(0.1)
            assert guest.opened == 1 and guest.open == 0 and host.idle
            guest.gates["long"] = trio.Event()
            _, recv = await host.call("execute", code="long")
            assert guest.open == 1
            kernels.forget(guest.uid)
            async with recv:
                got = [m async for m in recv]
            assert not any(m.get("done") for m in got) and guest.open == 0 and host.idle
            assert "let go" in host.failed
            nursery.cancel_scope.cancel()
