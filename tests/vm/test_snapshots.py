"""Checkpoint, restore, snapshots and warm pools against a real `sandvisor serve` and
real VMs. One supervisor and one checkpointed origin for the module: restores take
~0.3 s, so most tests restore rather than boot."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.snapshots.pools import takeable
from images.build import Image
from supervisor.client import (
    AlreadyExists,
    AsyncSandbox,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Sandbox,
    connect,
)
from supervisor.main.daemon_config import DaemonConfig
from supervisor.main.throwaway import Workdir, supervisor, workdir
from tests.support.client import COUNTER
from tests.support.vms import serve_process


@pytest.fixture(scope="module")
def served(image: Image) -> Iterator[dict[str, Any]]:
    # reachable: QEMU's user maps the snapshots' memory files in place
    with serve_process("sv-snap-", reachable=True) as (env, work):
        sock = str(work / "s.sock")
        # the origin: a file on disk, a process counting in memory, then a checkpoint
        origin = Sandbox.create("origin", socket=sock, labels={"role": "origin"}, detached=True)
        origin.fs.write("/root/marker", b"written before the checkpoint")
        origin.run(["sh", "-c", f"({COUNTER}) >/dev/null 2>&1 &"])
        time.sleep(0.5)
        snap = origin.checkpoint("base", labels={"kind": "test"}).snapshot_id
        yield {"env": env, "sock": sock, "snap": snap, "work": work}


async def sh(sb: AsyncSandbox, script: str) -> str:
    r = await sb.run(["sh", "-c", script])
    assert r.exit_code == 0, r
    return r.stdout.decode()


async def test_restore_keeps_disk_memory_and_processes(served: dict[str, Any]) -> None:
    sock = served["sock"]
    origin = await AsyncSandbox.get("origin", socket=sock)
    at_checkpoint = int(await sh(origin, "cat /run/cnt"))
    with trio.fail_after(60):
        async with await AsyncSandbox.restore(served["snap"], name="r-basic", socket=sock) as sb:
            assert await sb.state() == "ready"
            assert await sb.fs.read("/root/marker") == b"written before the checkpoint"
            first = int(await sh(sb, "cat /run/cnt"))
            await trio.sleep(0.5)
            second = int(await sh(sb, "cat /run/cnt"))
            # the loop's variable came back from memory: it goes on from where it was
            assert at_checkpoint - 40 < first < second, (at_checkpoint, first, second)
            before = time.time()
            guest_now = float(await sh(sb, "date +%s.%N"))
            after = time.time()
            assert before - 1 <= guest_now <= after + 1, (before, guest_now, after)
            assert (await sh(sb, "hostname")).strip() == "r-basic"  # (an empty hostname: the sandbox id)
            info = await sb.inspect()
            assert info.labels == {}


async def test_concurrent_restores_are_independent(served: dict[str, Any]) -> None:
    sock, snap = served["sock"], served["snap"]
    names = [f"r-par{i}" for i in range(4)]
    random: dict[str, str] = {}
    events: list[tuple[str, str]] = []
    async with connect(sock) as ec, ec.open_call("Events", {}) as stream:
        with trio.fail_after(120):
            async with trio.open_nursery() as n:

                async def watch() -> None:
                    async for ev in stream:
                        if ev["sandbox_id"] in names:
                            events.append((ev["sandbox_id"], ev["action"]))

                n.start_soon(watch)
                sandboxes: dict[str, AsyncSandbox] = {}

                async def one(name: str) -> None:
                    sandboxes[name] = await AsyncSandbox.restore(snap, name=name, labels={"n": name}, socket=sock)

                async with trio.open_nursery() as rn:
                    for name in names:
                        rn.start_soon(one, name)
                try:
                    for name, sb in sandboxes.items():
                        await sb.fs.write("/root/mine", name.encode())
                        random[name] = await sh(sb, "head -c 16 /dev/urandom | od -An -tx1")
                    for name, sb in sandboxes.items():
                        assert await sb.fs.read("/root/mine") == name.encode()
                    origin = await AsyncSandbox.get("origin", socket=sock)
                    assert "no" in await sh(origin, "test -e /root/mine && echo yes || echo no")
                    listed = await AsyncSandbox.list(labels={"n": "r-par2"}, socket=sock)
                    assert [s.id for s in listed.sandboxes] == ["r-par2"]
                finally:
                    for sb in sandboxes.values():
                        await sb.remove()
                n.cancel_scope.cancel()
    assert len(set(random.values())) == 4, random  # the CRNG was reseeded in each clone
    for name in names:
        mine = [a for i, a in events if i == name]
        assert mine[:2] == ["created", "ready"], mine


async def test_bad_requests(served: dict[str, Any]) -> None:
    sock, snap = served["sock"], served["snap"]
    async with connect(sock) as c:
        with pytest.raises(NotFound):
            await c.call("Checkpoint", {"sandbox_id": "nobody-here"})
        with pytest.raises(NotFound):
            await c.call("Restore", {"snapshot_id": "snap-000000000000"})
        with pytest.raises(InvalidArgument):
            await c.call("Restore", {"snapshot_id": ""})
        with pytest.raises(AlreadyExists):
            await c.call("Restore", {"snapshot_id": snap, "id": "origin"})
        with pytest.raises(InvalidArgument):
            await c.call("Restore", {"snapshot_id": snap, "labels": {"sandvisor.x": "1"}})
        with pytest.raises(NotFound):
            await c.call("DeleteSnapshot", {"snapshot_id": "snap-000000000000"})
        with pytest.raises(FailedPrecondition, match="in use"):
            await c.call("DeleteSnapshot", {"snapshot_id": snap})  # the origin's disk sits on it
        # a sandbox running a workload is refused, then accepted once idle
        origin = await AsyncSandbox.get("origin", socket=sock)
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(origin.run, ["sleep", "1.5"])
                while await origin.state() != "running":
                    await trio.sleep(0.02)
                with pytest.raises(FailedPrecondition, match="running"):
                    await c.call("Checkpoint", {"sandbox_id": "origin"})
        # the daemon keeps serving: the snapshot still restores
        async with await AsyncSandbox.restore(snap, socket=sock) as sb:
            assert (await sh(sb, "echo ok")).strip() == "ok"


async def test_restored_sandbox_checkpoints_again(served: dict[str, Any]) -> None:
    sock, snap = served["sock"], served["snap"]
    with trio.fail_after(120):
        async with await AsyncSandbox.restore(snap, name="r-gen1", socket=sock) as gen1:
            await gen1.fs.write("/root/gen", b"1")
            s2 = (await gen1.checkpoint("gen1")).snapshot_id
            await gen1.fs.write("/root/gen", b"after")  # not in the snapshot
            listed = {s.id: s for s in await AsyncSandbox.snapshots(sandbox="r-gen1", socket=sock)}
            assert list(listed) == [s2]
            assert listed[s2].memory == "streamed"  # its RAM was a private map of the first snapshot
            async with await AsyncSandbox.restore(s2, name="r-gen2", socket=sock) as gen2:
                assert await gen2.fs.read("/root/gen") == b"1"
                assert await gen2.fs.read("/root/marker") == b"written before the checkpoint"
                s3 = (await gen2.checkpoint("gen2")).snapshot_id
                async with await AsyncSandbox.restore("gen2", socket=sock) as gen3:  # by unique name
                    assert await gen3.fs.read("/root/gen") == b"1"
                    int(await sh(gen3, "cat /run/cnt"))  # the counter still runs, three generations on
            info = {s.id: s for s in await AsyncSandbox.snapshots(socket=sock)}
            assert info[s3].memory == "mapped"
        # gen1..gen3 are removed: their snapshots can go, and take their files along
        for sid in (s3, s2):
            d = Path(info[sid].snapshot_dir)
            await AsyncSandbox.delete_snapshot(sid, socket=sock)
            assert not d.exists()
        assert {s.id for s in await AsyncSandbox.snapshots(socket=sock)} == {snap}


def test_cli_snapshots(served: dict[str, Any]) -> None:
    env = served["env"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor.main.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    r = cli("snapshots", "--label", "kind=test")
    assert r.returncode == 0 and "base" in r.stdout and "mapped" in r.stdout, r
    r = cli("restore", "base", "--name", "cli-r", "--label", "via=cli")
    assert (r.returncode, r.stdout.strip()) == (0, "cli-r"), r
    r = cli("exec", "cli-r", "--", "cat", "/root/marker")
    assert r.stdout == "written before the checkpoint", r
    assert cli("rm", "-f", "cli-r").returncode == 0
    r = cli("checkpoint", "origin", "--name", "again")
    assert r.returncode == 0 and r.stdout.startswith("snap-"), r
    again = r.stdout.strip()
    r = cli("snapshot", "rm", again)  # the origin now runs on top of it
    assert r.returncode == 1 and "in use" in r.stderr, r
    r = cli("restore", "no-such-snapshot")
    assert r.returncode == 1 and "no snapshot 'no-such-snapshot'" in r.stderr, r


async def test_a_changed_memory_file_is_refused(served: dict[str, Any]) -> None:
    """QEMU's user can write a snapshot's memory file (QEMU 7.2 needs it read-write):
    a file written since the checkpoint is refused, not restored."""
    sock = served["sock"]
    origin = await AsyncSandbox.get("origin", socket=sock)
    snap = (await origin.checkpoint("tampered")).snapshot_id
    [info] = [s for s in await AsyncSandbox.snapshots(socket=sock) if s.id == snap]
    mem = Path(info.snapshot_dir) / "memory"
    st = mem.stat()
    os.utime(mem, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(FailedPrecondition, match="changed"):
        await AsyncSandbox.restore(snap, socket=sock)
    os.remove(Path(info.snapshot_dir) / "vmstate")
    os.utime(mem, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(FailedPrecondition, match="vmstate is missing"):
        await AsyncSandbox.restore(snap, socket=sock)


async def test_creates_restore_the_boot_template(served: dict[str, Any]) -> None:
    """The origin was the first fresh boot of the default configuration: its boot was
    saved as the template, and later Creates of that configuration restore it, yet
    get their own hostname, env, clock and entropy."""
    sock = served["sock"]
    with trio.fail_after(120):
        async with (
            await AsyncSandbox.create("tpl-a", hostname="alpha", env={"WHO": "a"}, socket=sock) as a,
            await AsyncSandbox.create("tpl-b", socket=sock) as b,
        ):
            for sb in (a, b):
                logs = b"".join(e.data for e in await sb.logs() if e.source == "system")
                assert b"restored from the boot template" in logs, logs
            assert (await sh(a, "hostname; echo $WHO")).split() == ["alpha", "a"]
            assert (await sh(b, "hostname")).strip() == "tpl-b"  # (an empty hostname: its own id)
            assert "no" in await sh(b, "test -e /root/marker && echo yes || echo no")  # a fresh boot's disk
            ra, rb = (
                await sh(a, "head -c 16 /dev/urandom | od -An -tx1"),
                await sh(b, "head -c 16 /dev/urandom | od -An -tx1"),
            )
            assert ra != rb
            listed = await AsyncSandbox.snapshots(socket=sock)
            assert listed and not any("sandvisor.template" in x.labels for x in listed)  # templates are hidden
    # stopped and started again, a template-made sandbox boots from its disk
    async with await AsyncSandbox.create("tpl-c", socket=sock) as c:
        await c.fs.write("/root/kept", b"yes")
        await c.stop()
        await c.wait_until_stopped()
        await c.start(wait=True)
        assert await c.fs.read("/root/kept") == b"yes"


# --- restart and warm pool: in-process supervisors on one state dir ----------------------
@pytest.fixture
def fresh_state(image: Image) -> Iterator[Workdir]:
    """A throwaway work dir whose state dir QEMU's user cannot reach (restores then link
    the memory file into the run dir instead of mapping it in place): in-process
    supervisors come and go on it."""
    with workdir("svs-", private_state=True) as work:
        yield work


@asynccontextmanager
async def daemon_on(work: Workdir, **kw: Any) -> AsyncIterator[DaemonConfig]:
    async with supervisor(work, **kw) as (cfg, _):
        yield cfg


async def test_snapshots_survive_restart_and_pool(fresh_state: Workdir) -> None:
    with trio.fail_after(240):
        async with daemon_on(fresh_state) as cfg:
            sock = cfg.socket
            async with await AsyncSandbox.create("pool-origin", socket=sock) as sb:
                await sb.fs.write("/root/x", b"pooled")
                snap = (await sb.checkpoint("pooled")).snapshot_id
        # the origin is gone, the snapshot stays; a new supervisor keeps one restore warm
        async with daemon_on(fresh_state, pool_size=1) as cfg:
            sock = cfg.socket
            [s] = await AsyncSandbox.snapshots(socket=sock)
            assert (s.id, s.name, s.sandbox_id) == (snap, "pooled", "pool-origin")
            while (await AsyncSandbox.snapshots(socket=sock))[0].pool_ready < 1:
                await trio.sleep(0.1)
            assert (await AsyncSandbox.list(socket=sock)).sandboxes == []  # pool members are not listed
            async with connect(sock) as ec, ec.open_call("Events", {}) as events:
                sb = await AsyncSandbox.restore(snap, name="from-pool", socket=sock)
                ev = await events.__anext__()
                assert (ev["sandbox_id"], ev["action"], ev["attributes"].get("pool")) == (
                    "from-pool",
                    "created",
                    "1",
                )
            async with sb:
                assert await sb.fs.read("/root/x") == b"pooled"
                assert [s.id for s in (await AsyncSandbox.list(socket=sock)).sandboxes] == ["from-pool"]
                while (await AsyncSandbox.snapshots(socket=sock))[0].pool_ready < 1:
                    await trio.sleep(0.1)  # refilled in the background
            await AsyncSandbox.delete_snapshot(snap, socket=sock)  # drains the pool first
            assert await AsyncSandbox.snapshots(socket=sock) == []
        assert not Path(s.snapshot_dir).exists()
        assert not list((fresh_state.state / "sandboxes").iterdir())  # pool members leave nothing behind


async def test_anonymous_memory_checkpoints_stream(fresh_state: Workdir) -> None:
    """serve --anonymous-memory: no RAM files; checkpoints carry RAM in vmstate."""
    with trio.fail_after(120):
        async with daemon_on(fresh_state, anonymous_memory=True, templates=False) as cfg:
            sock = cfg.socket
            async with await AsyncSandbox.create("anon", socket=sock) as sb:
                await sb.fs.write("/root/a", b"anon")
                snap = (await sb.checkpoint("anon")).snapshot_id
            [s] = await AsyncSandbox.snapshots(socket=sock)
            assert s.memory == "streamed"
            async with await AsyncSandbox.restore(snap, socket=sock) as r:
                assert await r.fs.read("/root/a") == b"anon"


async def test_template_pool_makes_creates_ready_at_once(fresh_state: Workdir) -> None:
    """serve --template-pool 1: a Create takes a restored member of its boot template
    and is ready when Create returns, with its own hostname, env and initial command."""
    with trio.fail_after(180):
        async with supervisor(fresh_state, template_pool=1) as (cfg, registry):
            sock = cfg.socket
            first = await AsyncSandbox.create("first", socket=sock)  # boots; saves the template
            while not any(takeable(m) for m in registry.pools.all_members()):
                await trio.sleep(0.05)
            async with connect(sock) as c:
                r = await c.call(
                    "Create",
                    {
                        "id": "quick",
                        "hostname": "quick",
                        "env": {"WHO": "q"},
                        "cmd": ["sh", "-c", "echo $WHO > /root/cmd"],
                    },
                )
                assert r["state"] == "starting"  # as sandbox.v1 says, always; yet ready already:
                assert (await c.call("Inspect", {"id": "quick"}))["state"] in ("ready", "running")
            quick = await AsyncSandbox.get("quick", socket=sock)
            logs = b"".join(e.data for e in await quick.logs() if e.source == "system")
            assert b"warm pool" in logs, logs
            while await quick.state() != "ready":  # the initial command runs, then ends
                await trio.sleep(0.05)
            assert await quick.fs.read("/root/cmd") == b"q\n"
            assert (await sh(quick, "hostname; echo $WHO")).split() == ["quick", "q"]
            assert sorted(s.id for s in (await AsyncSandbox.list(socket=sock)).sandboxes) == ["first", "quick"]
            await quick.remove()
            await first.remove()


async def test_a_broken_boot_template_falls_back_to_booting(fresh_state: Workdir) -> None:
    """A template whose state does not load is dropped and that Create boots instead
    (the caller sees a ready sandbox, not an error)."""
    with trio.fail_after(180):
        async with supervisor(fresh_state) as (cfg, registry):
            sock = cfg.socket
            first = await AsyncSandbox.create("first", socket=sock)  # boots; saves the template
            [tpl] = registry.snapshots.snapshots.values()
            (Path(tpl.dir) / "vmstate").write_bytes(b"QEVM but not really" * 100)
            second = await AsyncSandbox.create("second", socket=sock)
            assert await second.state() == "ready"
            logs = b"".join(e.data for e in await second.logs() if e.source == "system")
            assert b"template restore failed" in logs, logs
            assert (await sh(second, "echo booted")).strip() == "booted"
            assert not registry.snapshots.snapshots  # dropped, and not made again
            for sb in (first, second):
                await sb.remove()
