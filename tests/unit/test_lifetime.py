"""Lifetime on fake VMs: draining refuses new work and stops once the work in flight
ends (or its grace does), the TTL drains and stops (or, ``ttl_action`` "remove",
removes), RequestStop returns at once and WaitUntilStopped gives the stop's source,
replace stops the old sandbox gracefully, and each death's cause (a guest poweroff,
a panic on the console, QEMU killed) with the state it leaves (stopped, crashed).
Real VMs produce every cause for real in tests/vm/test_lifetime.py."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import cast

import pytest
import trio
from trio.testing import MockClock

from actors.errors import FailedPrecondition, NotFound, Unavailable
from actors.model import Action, Cause, Ending, SandboxConfig, State, Timers
from actors.registry import Registry
from actors.store import Store
from supervisor.client import AsyncSandbox
from supervisor.serve import mapping
from supervisor.serve.server import Server
from supervisor.wire.errors import Unavailable as SdkUnavailable
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as pb
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
from tests.support.clocks import work_aware_clock
from tests.support.fakevm import FakeLab, FakeMachine, fake_settings
from tests.support.grpcstack import stack
from tests.unit.test_grpc_service import in_thread, seed, until
from tests.unit.test_registry import next_actions, ready, registry, run

__all__ = ["seed"]  # (a fixture of the gRPC tests, shared)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> MockClock:
    # virtual time, frozen while the store's thread or qemu-img runs (tests/support/clocks.py)
    return work_aware_clock(monkeypatch)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="lt", dir="/tmp"))  # Unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_a_draining_sandbox_refuses_new_work_and_stops_when_its_work_ends(
    tmp_path: Path, clock: MockClock
) -> None:
    lab = FakeLab()
    async with registry(tmp_path, lab) as reg:
        sb = await reg.create("a", SandboxConfig())
        await ready(sb)
        sub = reg.events.subscribe("a")
        results: list[tuple[bytes, int]] = []
        async with trio.open_nursery() as n:

            async def work() -> None:
                results.append(await run(sb, "sleep", "50"))

            n.start_soon(work)
            await trio.sleep(1)
            assert sb.state == State.RUNNING
            reg.drain("a")
            assert reg.get("a").state == State.DRAINING
            assert mapping.info(sb).state == "draining"
            with pytest.raises(FailedPrecondition, match="draining"):
                await run(sb, "echo", "no")
            with pytest.raises(FailedPrecondition, match="draining"):
                sb.require_alive()
            with trio.fail_after(120):
                await sb.wait_stopped()
        assert results == [(b"", 0)]  # the work in flight finished
        assert reg.get("a").state == State.STOPPED
        assert sb.cause == Cause(Ending.STOPPED, by="drain", exit_code=0)
        assert await next_actions(sub, 4) == ["a:running", "a:draining", "a:stopping", "a:stopped"]
        assert mapping.info(sb).cause is not None and mapping.info(sb).cause.source == "drain"


async def test_a_drain_s_grace_ends_the_work_in_flight(tmp_path: Path, clock: MockClock) -> None:
    lab = FakeLab()
    async with registry(tmp_path, lab) as reg:
        sb = await reg.create("a", SandboxConfig())
        await ready(sb)
        async with trio.open_nursery() as n:
            n.start_soon(_ended_by_the_stop, run(sb, "sleep", "3600"))
            await trio.sleep(1)
            start = trio.current_time()
            reg.drain("a", grace=5)
            with trio.fail_after(120):
                await sb.wait_stopped()
            assert trio.current_time() - start < 60
            n.cancel_scope.cancel()
        assert sb.state == State.STOPPED and sb.cause is not None and sb.cause.by == "drain"


async def test_the_ttl_drains_and_stops_and_each_start_gets_it_again(tmp_path: Path, clock: MockClock) -> None:
    lab = FakeLab()
    async with registry(tmp_path, lab) as reg:
        sb = await reg.create("a", SandboxConfig(timers=Timers(ttl_seconds=100, ttl_action="stop")))
        await ready(sb)
        sub = reg.events.subscribe("a", action=Action.STOPPED)
        with trio.fail_after(300):
            await sb.wait_stopped()
        assert sb.state == State.STOPPED and reg.get("a") is sb  # stopped, kept
        assert sb.cause is not None and (sb.cause.ending, sb.cause.source) == (Ending.STOPPED, "ttl")
        [ev] = [e async for e in _take(sub, 1)]
        assert (ev.attributes["cause"], ev.attributes["source"]) == ("stopped", "ttl")
        await trio.sleep(200)  # a stopped sandbox is not touched again
        assert reg.get("a").state == State.STOPPED
        began = trio.current_time()
        await reg.start("a")
        await ready(sb)
        assert sb.cause is None  # a new life: nothing ended yet
        with trio.fail_after(300):
            await sb.wait_stopped()
        assert 100 <= trio.current_time() - began < 110  # from its start, not from its creation
        assert sb.cause is not None and sb.cause.source == "ttl"


async def test_ttl_action_remove_keeps_the_removal(tmp_path: Path, clock: MockClock) -> None:
    lab = FakeLab()
    async with registry(tmp_path, lab) as reg:
        sb = await reg.create("a", SandboxConfig(timers=Timers(ttl_seconds=100, ttl_action="remove")))
        await ready(sb)
        sub = reg.events.subscribe("a", action=Action.REMOVED)
        [ev] = [e async for e in _take(sub, 1)]
        assert (ev.attributes["cause"], ev.attributes["by"]) == ("stopped", "ttl")
        with pytest.raises(NotFound):
            reg.get("a")


async def test_deaths_and_their_causes(tmp_path: Path, clock: MockClock) -> None:
    """A guest's poweroff stops it (exited); a panic on its console, or QEMU killed,
    crashes it; the failed event and sandbox.v1's error carry the cause."""
    lab = FakeLab()
    async with registry(tmp_path, lab) as reg:
        off, panic, killed = [await reg.create(n, SandboxConfig()) for n in ("off", "panic", "killed")]
        for sb in (off, panic, killed):
            await ready(sb)
        sub = reg.events.subscribe(action=Action.FAILED)
        cast(FakeMachine, off.guest.machine).die(0)  # type: ignore[union-attr]
        machine = cast(FakeMachine, panic.guest.machine)  # type: ignore[union-attr]
        machine.console.output = (
            "[ 9.1] sysrq: Trigger a crash\n[ 9.2] Kernel panic - not syncing: sysrq triggered crash\n"
        )
        machine.die(0)
        killed.guest.machine.proc.kill()  # type: ignore[union-attr]
        with trio.fail_after(60):
            for sb in (off, panic, killed):
                await sb.wait_stopped()
        assert (off.state, off.cause) == (State.STOPPED, Cause(Ending.EXITED, exit_code=0))
        assert panic.state == State.CRASHED and panic.cause is not None
        assert (panic.cause.ending, panic.cause.source) == (Ending.GUEST_PANIC, "guest-panic")
        assert "sysrq triggered crash" in panic.cause.detail
        assert killed.state == State.CRASHED and killed.cause is not None
        assert (killed.cause.ending, killed.cause.signal) == (Ending.QEMU_DIED, 9)
        events = {e.sandbox_id: e async for e in _take(sub, 2)}
        assert events["panic"].attributes["cause"] == "guest_panic"
        assert events["killed"].attributes["signal"] == "9"
        info = mapping.info(killed)
        assert info.state == "crashed" and info.error == "crashed: QEMU killed by signal 9"
        await reg.start("killed")  # a crashed sandbox starts again
        await ready(killed)


async def _ended_by_the_stop(work: Awaitable[object]) -> None:
    """Work in flight that the stop ends: its guest goes (UNAVAILABLE), as a stop says."""
    with contextlib.suppress(Unavailable, SdkUnavailable):
        await work


async def _take(sub: object, n: int) -> AsyncIterator:  # type: ignore[type-arg]
    got = 0
    with trio.fail_after(600):
        async for ev in sub:  # type: ignore[attr-defined]
            yield ev
            got += 1
            if got == n:
                return


@asynccontextmanager
async def serving(root: Path, sock: Path) -> AsyncIterator[Registry]:
    fake = FakeLab()
    store = Store(root / "state" / "sandvisor.db")
    try:
        async with trio.open_nursery() as n:
            await n.start(fake.run)
            reg = await n.start(Registry(fake_settings(root, fake), store, templates=False).run)
            try:
                await n.start(Server(reg, sock).serve)
                yield reg
            finally:
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


async def test_request_stop_returns_at_once_and_wait_gives_the_source(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "s.sock"
    async with serving(tmp_path, sock) as reg:
        with trio.fail_after(60):
            sb = await AsyncSandbox.create("a", socket=sock, detached=True, kill_timeout=7)
            assert (await sb.config())["kill_timeout"] == 7
            async with trio.open_nursery() as n:
                n.start_soon(_ended_by_the_stop, sb.run(["sleep", "3600"]))  # it keeps the stop waiting
                await trio.sleep(0.5)
                await sb.request_stop(timeout=30)  # returns while the workload runs on
                assert reg.get("a").state == State.STOPPING
                result = await sb.wait_until_stopped()
                n.cancel_scope.cancel()
            assert (result.status, result.source) == ("stopped", "user")
            assert result.cause is not None and result.cause.ending == "stopped"
            b = await AsyncSandbox.create("b", socket=sock, detached=True)
            await b.request_kill()
            result = await b.wait_until_stopped()
            assert (result.status, result.source) == ("stopped", "user")
            c = await AsyncSandbox.create("c", socket=sock, detached=True, ttl=600)
            assert (await c.config())["ttl_action"] == "stop"  # the SDK's: drain, then stop
            await c.drain(grace=1)
            result = await c.wait_until_stopped()
            assert (result.status, result.source) == ("stopped", "drain")


async def test_replace_stops_the_old_sandbox_gracefully_then_creates(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "s.sock"
    async with serving(tmp_path, sock) as reg:
        with trio.fail_after(60):
            old = await AsyncSandbox.create("a", socket=sock, detached=True)
            old_uid = reg.get("a").record.uid
            sub = reg.events.subscribe("a")
            new = await AsyncSandbox.create("a", socket=sock, detached=True, replace_timeout=3)
            assert new.id == old.id and reg.get("a").record.uid != old_uid
            seen = [e.action async for e in _take(sub, 4)]
            assert seen == [Action.STOPPING, Action.STOPPED, Action.REMOVED, Action.CREATED]


async def test_the_grpc_edges_say_it_in_their_own_words(
    tmp_path: Path, short_dir: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    """sandvisor.v1: RequestStop returns at once, WaitUntilStoppedResult carries the cause,
    Kill takes a timeout, Drain a grace; sandbox.v1 (its fixed state list): a draining
    sandbox is "stopping", a crashed one "failed" with the cause's sentence."""
    spb, sgrpc = seed
    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            ours = sv_grpc.SandvisorServiceStub(st.channel)
            theirs = sgrpc.SandboxServiceStub(st.channel)
            for name in ("u", "w", "x"):
                await in_thread(
                    ours.Create, sv.CreateRequest(base=pb.CreateSandboxRequest(id=name), kill_timeout_seconds=9)
                )
                await until(lambda n=name: st.reg.get(n).state == State.READY)  # type: ignore[misc]
            await in_thread(ours.RequestStop, sv.RequestStopRequest(id="u", timeout_seconds=5))
            done = await in_thread(ours.WaitUntilStoppedResult, sv.WaitUntilStoppedRequest(id="u"))
            assert (done.base.state, done.cause.ending, done.cause.source) == ("stopped", "stopped", "user")
            assert not done.cause.HasField("signal")

            async with (
                aclosing(st.reg.get("w").run_workload(["sleep", "3600"], env={})) as items,
                trio.open_nursery() as n,
            ):
                n.start_soon(_ended_by_the_stop, _drained(items))
                await until(lambda: st.reg.get("w").state == State.RUNNING)
                await in_thread(ours.Drain, sv.DrainRequest(id="w", grace_seconds=30))
                seen = await in_thread(theirs.Inspect, spb.InspectSandboxRequest(id="w"))
                assert seen.state == "stopping"  # sandbox.v1's word for draining
                details = await in_thread(ours.Inspect, sv.InspectRequest(id="w"))
                assert details.base.state == "draining"
                await in_thread(ours.Kill, sv.KillRequest(id="w", timeout_seconds=20))

            cast(FakeMachine, st.reg.get("x").guest.machine).proc.kill()  # type: ignore[union-attr]
            await until(lambda: st.reg.get("x").state == State.CRASHED)
            seen = await in_thread(theirs.Inspect, spb.InspectSandboxRequest(id="x"))
            assert (seen.state, seen.error) == ("failed", "crashed: QEMU killed by signal 9")
            listed = await in_thread(theirs.List, spb.ListSandboxesRequest())
            assert {s.id: s.state for s in listed.sandboxes} == {"u": "stopped", "w": "stopped", "x": "failed"}


async def _drained(items: AsyncIterator[object]) -> None:
    async for _ in items:
        pass
