"""Fork against a real `sandvisor serve` and real VMs (docs/fork.md): one parent, running
a counter, forked three times through the SDK; the children's processes, identities and
files; the family by the CLI's tree; the parent's removal; the hidden snapshot going with
the last child; fresh secret placeholders and addresses (tap, in namespaces the test
makes); a read-write host mount refused."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

from actors.fork import fork
from actors.model import NetMode, Network, SandboxConfig, State
from actors.sandboxes.sandbox import Sandbox as LiveSandbox
from actors.secrets.model import PLACEHOLDER_PREFIX, SecretRef
from images.build import Image
from supervisor.client import AsyncSandbox, FailedPrecondition, Sandbox
from supervisor.main.throwaway import supervisor, supervisor_process, workdir
from tests.support.client import COUNTER
from tests.support.netlab import POOL, UPLINK_INET, link_internet, namespaces


@pytest.fixture(scope="module")
def served(image: Image) -> Iterator[dict[str, Any]]:
    allowed = Path(tempfile.mkdtemp(prefix="sv-fork-share-", dir="/tmp"))
    allowed.chmod(0o755)
    (allowed / "rw").mkdir()
    (allowed / "rw").chmod(0o777)  # (the cell's ids are others here)
    try:
        # reachable state: QEMU's user maps the fork's memory file in place
        with (
            workdir("sv-fork-", private_state=False) as work,
            supervisor_process(
                work, "--allow-path", str(allowed), log=Path(os.environ.get("FORK_LOG", "/dev/null"))
            ) as (env, _),
        ):
            sock = str(work.socket)
            # the first Create boots and saves the boot template; the parent is a restore of
            # it, as every later default Create is (its RAM mapped privately: the helper's copy)
            Sandbox.create("first", socket=sock, detached=True).remove(force=True)
            parent = Sandbox.create("fp", socket=sock, labels={"role": "parent"}, detached=True)
            parent.fs.write("/root/before", b"written before the fork")
            parent.run(["sh", "-c", f"({COUNTER}) >/dev/null 2>&1 &"])
            yield {"env": env, "sock": sock, "work": work, "allowed": allowed}
    finally:
        shutil.rmtree(allowed, ignore_errors=True)


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


async def sh(sb: AsyncSandbox, script: str) -> str:
    r = await sb.run(["sh", "-c", script])
    assert r.exit_code == 0, r
    return r.stdout.decode()


async def counted_past(sb: AsyncSandbox, n: int) -> None:
    """Until the counter in ``sb`` is past ``n`` (the caller's deadline bounds it)."""
    while int(await sh(sb, "cat /run/cnt")) <= n:
        await trio.sleep(0.05)


def snapshot_memory(work: Any, id: str) -> str:
    """How the recorded snapshot ``id`` holds its RAM (its record, from the database)."""
    with sqlite3.connect(f"file:{work.state / 'sandvisor.db'}?mode=ro", uri=True) as db:
        (data,) = db.execute("SELECT data FROM snapshots WHERE id = ?", (id,)).fetchone()
    return str(msgpack.unpackb(data)["memory"])


def recorded_snapshots(work: Any) -> set[str]:
    """Every snapshot the supervisor has on record, hidden ones too (its database, read-only)."""
    with sqlite3.connect(f"file:{work.state / 'sandvisor.db'}?mode=ro", uri=True) as db:
        return {row[0] for row in db.execute("SELECT id FROM snapshots")}


async def test_fork_three_children_of_a_running_sandbox(served: dict[str, Any]) -> None:
    sock, env, work = served["sock"], served["env"], served["work"]
    with trio.fail_after(600):
        parent = await AsyncSandbox.get("fp", socket=sock)
        dirs_before = set((work.state / "snapshots").iterdir())
        at_fork = int(await sh(parent, "cat /run/cnt"))
        kids = await parent.fork(3, name_prefix="fk", labels={"try": "x"})
        assert [k.id for k in kids] == ["fk1", "fk2", "fk3"]
        counts = {}
        for k in kids:
            assert await k.state() == "ready"
            # the counter came with the memory: it goes on from the fork point, in each child
            first = int(await sh(k, "cat /run/cnt"))
            assert first >= at_fork, (k.id, at_fork, first)
            counts[k.id] = first
            assert (await sh(k, "hostname")).strip() == k.id
            assert await k.fs.read("/root/before") == b"written before the fork"
            info = await k.inspect()
            assert (info.parent, info.labels) == ("fp", {"role": "parent", "try": "x"})
            assert info.fork_snapshot and info.forked_at > 0
            # memory per branch, the host's count: the family's file pages shared, its own private
            assert info.memory_shared_bytes > 0 and info.memory_own_bytes > 0, info
        for k in kids:  # still running: each child's counter goes on (however slowly TCG runs it)
            await counted_past(k, counts[k.id])
        assert len({(await k.inspect()).uid for k in kids}) == 3
        snapshot = (await kids[0].inspect()).fork_snapshot
        assert snapshot in recorded_snapshots(work)
        # the parent (a Create: a restore of its boot template, its RAM mapped privately)
        # was copied live into the fork's own memory, which the children map
        assert snapshot_memory(work, snapshot) == "mapped"
        assert snapshot not in {s.id for s in await AsyncSandbox.snapshots(socket=sock)}  # hidden
        # a file written in one child is in that child alone
        await kids[0].fs.write("/root/only-in-fk1", b"mine")
        for other in (*kids[1:], parent):
            assert (await sh(other, "test -e /root/only-in-fk1 && echo yes || echo no")).strip() == "no"
        assert await parent.state() == "ready"  # it ran on

        r = cli(env, "tree", "fk2")
        assert r.returncode == 0, r
        lines = r.stdout.splitlines()
        assert lines[0].startswith("fp  ready") and len(lines) == 4, r.stdout
        # (siblings by creation time, in seconds: restored side by side, any order)
        assert sorted(ln.split()[1] for ln in lines[1:]) == ["fk1", "fk2", "fk3"], r.stdout
        assert [ln.split()[0] for ln in lines[1:]] == ["├──", "├──", "└──"], r.stdout
        assert all("MiB" in ln and "shared" in ln for ln in lines), r.stdout
        r = cli(env, "ls", "--ancestor", "fp", "--json")
        assert r.returncode == 0 and sorted(x["id"] for x in json.loads(r.stdout)) == ["fk1", "fk2", "fk3"], r

        await parent.remove(force=True)  # the parent goes: its children run on
        for k in kids:
            assert await k.state() == "ready"
            assert int(await sh(k, "cat /run/cnt")) > counts[k.id]
        await kids[0].remove(force=True)
        await kids[1].remove(force=True)
        assert snapshot in recorded_snapshots(work)  # fk3 still stands on it
        r = cli(env, "rm", "-f", "--with-descendants", "fk3")
        assert r.returncode == 0, r
        with trio.fail_after(60):  # gone with the last child (the database commits it soon after)
            while snapshot in recorded_snapshots(work):
                await trio.sleep(0.1)
        with trio.fail_after(60):  # and its files, once the collector ran
            while set((work.state / "snapshots").iterdir()) - dirs_before:
                await trio.sleep(0.1)


async def output(sb: LiveSandbox, script: str) -> str:
    """A Run through the sandbox's workloads (its secrets' environment applies)."""
    out, code = b"", -1
    with trio.fail_after(120):
        async for stream, data, exit_code in sb.run_workload(["sh", "-c", script], env={}):
            if stream == "exit":
                code = exit_code if exit_code is not None else -1
            else:
                out += data
    assert code == 0, out
    return out.decode().strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, TAP, jail)")
async def test_fork_gives_fresh_secret_placeholders_and_addresses(image: Image) -> None:
    """Tap networking in namespaces the test makes (the secret proxy needs it)."""
    value = b"fork-secret-value-0123456789"
    with namespaces("svfh", "svfi") as (host, inet):
        link_internet(host, inet)
        with host.entered(), workdir("sv-fork-sec-", private_state=True) as work:
            opts = {"ip_pool": POOL, "dns_upstreams": (UPLINK_INET,), "stop_timeout": 5}
            async with supervisor(work, **opts) as (_, reg):
                config = SandboxConfig(network=Network(mode=NetMode.TAP), secrets=(SecretRef("TOKEN", ("api.test",)),))
                sb = await reg.create("fsec", config, {"TOKEN": value})
                with trio.fail_after(600):
                    await sb.ready_event.wait()
                    assert sb.state == State.READY, sb.record.error
                    mine = await output(sb, "echo $TOKEN")
                    assert mine.startswith(PLACEHOLDER_PREFIX)
                    kids = (await fork(reg, "fsec", 2)).children
                    seen, addresses = {mine}, {sb.ip_address}
                    for k in kids:
                        theirs = await output(k, "echo $TOKEN")
                        (ref,) = k.config.secrets
                        assert theirs == ref.placeholder and theirs not in seen, (theirs, seen)
                        assert value.decode() not in theirs
                        seen.add(theirs)
                        assert k.ip_address and k.ip_address not in addresses  # its own address
                        addresses.add(k.ip_address)
                        assert await output(k, "cat /sys/class/net/eth0/address") != await output(
                            sb, "cat /sys/class/net/eth0/address"
                        )
                    for k in kids:
                        await reg.remove(k.id, force=True)
                    await reg.remove("fsec", force=True)


async def test_fork_refuses_a_read_write_host_mount(served: dict[str, Any]) -> None:
    sock, rw = served["sock"], served["allowed"] / "rw"
    with trio.fail_after(600):
        async with await AsyncSandbox.create("fmnt", socket=sock, mounts=[f"{rw}:/mnt/rw:rw"]) as sb:
            with pytest.raises(FailedPrecondition, match="mounted read-write at /mnt/rw"):
                await sb.fork(2)
            assert await sb.state() == "ready"


async def test_a_restored_sandbox_uses_its_memory_and_forks(served: dict[str, Any]) -> None:
    """A Create restored from its boot template maps the template's sealed memory
    privately; its guest writes 320 of its 512 MiB, then it forks and checkpoints
    (both read all its RAM through its QEMU). Its cgroup (RAM + 192 MiB) holds only
    what the guest wrote: the memory's holes were the supervisor's to allocate. (Before,
    each page the guest first wrote cost its cgroup twice, and this QEMU was killed.)"""
    sock = served["sock"]
    with trio.fail_after(600):
        await (await AsyncSandbox.create("big0", memory_mib=512, socket=sock)).remove(force=True)
        async with await AsyncSandbox.create("big1", memory_mib=512, socket=sock) as sb:
            logs = b"".join(e.data for e in await sb.logs() if e.source == "system")
            assert b"restored from the boot template" in logs, logs
            await sh(sb, "mkdir -p /mnt/t && mount -t tmpfs -o size=336m none /mnt/t")
            await sh(sb, "yes abcdefghijklmnop | head -c 320m > /mnt/t/fill; echo done")
            [kid] = await sb.fork(1, names=["big1-k"])
            try:
                assert (await sh(kid, "wc -c < /mnt/t/fill")).strip() == str(320 << 20)
            finally:
                await kid.remove(force=True)
            await sb.checkpoint("big1-ck")  # (its disk stands on it now: it stays)
            assert (await sh(sb, "wc -c < /mnt/t/fill")).strip() == str(320 << 20)
            assert await sb.state() == "ready"
