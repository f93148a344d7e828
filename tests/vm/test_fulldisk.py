"""A full disk against real VMs: the state dir on a small tmpfs this test
mounts, filled to the last block. What needs space fails with RESOURCE_EXHAUSTED,
the supervisor and its sandboxes keep running, log writes are dropped and counted
instead of raising, nothing stored is corrupted, and all of it works again once
space is back. A RAM dir too small for a guest refuses its Create up front."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from images.build import Image, default_cache
from supervisor.client import AsyncVolumes, connect
from supervisor.main.throwaway import Workdir, supervisor, workdir
from supervisor.wire.protocol import ApiError
from tests.support.client import run, wait_state

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> int:
    """Write ``path`` until the filesystem has not one block left; its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    size = 0
    try:
        for chunk in (b"\xa5" * (1 << 20), b"\xa5" * 4096, b"\xa5"):
            while True:
                try:
                    size += os.write(fd, chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    return size


async def expect(code: str, coro: object) -> str:
    with pytest.raises(ApiError) as e:
        await coro  # type: ignore[misc]
    assert e.value.code == code, e.value
    return e.value.message


async def test_a_full_state_disk_refuses_work_and_loses_nothing(image: Image) -> None:
    with workdir("sv-full-", private_state=True) as work, tmpfs(work.state, "700m"):
        (work.state / "images").symlink_to(default_cache())  # (the mount hid workdir's link)
        with trio.fail_after(600):
            await _full_disk(work)


async def _full_disk(work: Workdir) -> None:
    async with supervisor(work, templates=False) as (_, reg), connect(work.socket) as c:
        await AsyncVolumes(str(work.socket)).create("v", "256M")  # (sparse: written, it needs space)
        await c.call("Create", {"id": "a"})
        await c.call("Create", {"id": "c", "volumes": [{"volume": "v", "target": "/data"}]})
        await wait_state(c, "a", "ready")
        await wait_state(c, "c", "ready")
        assert (await run(c, "a", ["sh", "-c", "echo kept > /root/mark && sync"]))[1] == 0

        # each disk that fails says so (disk_error, checked below), heard live from before the
        # host fills: the event log cannot store the events then, and the first of each
        # disk's errors are the ones sure to be told (later ones are rate-limited)
        async with connect(work.socket) as listener, listener.open_call("Events", {"action": "disk_error"}) as events:
            filler = work.state / "filler"
            await trio.to_thread.run_sync(fill, filler)
            # what needs space is refused, with the limit named
            assert "MiB free" in await expect("RESOURCE_EXHAUSTED", c.call("Create", {"id": "b"}))
            await expect("RESOURCE_EXHAUSTED", c.call("Checkpoint", {"sandbox_id": "a"}))
            # a pause is refused before anything stops: the sandbox keeps running
            await expect("RESOURCE_EXHAUSTED", c.call("Pause", {"id": "a"}))
            assert (await c.call("Inspect", {"id": "a"}))["state"] == "ready"
            # the sandbox runs on: its output reaches the caller, its log drops and counts
            out, code = await run(c, "a", ["sh", "-c", "seq 1 50000"])
            assert (code, out.count(b"\n")) == (0, 50000)
            assert reg.get("a").log.dropped > 0
            # the guest filling its own disk gets an I/O error; the VM is not stopped; and
            # each sandbox says why: QEMU's BLOCK_IO_ERROR is a disk_error event naming the disk
            _, code = await run(c, "a", ["sh", "-c", "dd if=/dev/zero of=/root/big bs=1M count=64 conv=fsync"])
            assert code != 0
            assert (await c.call("Inspect", {"id": "a"}))["state"] == "ready"
            assert (await run(c, "a", ["echo", "alive"]))[0] == b"alive\n"
            # so does the guest writing a volume whose file cannot grow
            _, code = await run(c, "c", ["sh", "-c", "dd if=/dev/urandom of=/data/big bs=1M count=64 conv=fsync"])
            assert code != 0
            assert (await c.call("Inspect", {"id": "c"}))["state"] == "ready"
            assert (await run(c, "c", ["echo", "alive"]))[0] == b"alive\n"
            # (c's root disk may fail a write too -- its journal, its logs: each disk's own)
            want = {("a", "root"), ("c", "v")}
            heard: dict[tuple[str, str], dict[str, str]] = {}
            with trio.fail_after(30):
                while not want <= set(heard):
                    event = await events.__anext__()
                    heard.setdefault((event["sandbox_id"], event["attributes"]["disk"]), event["attributes"])
        for key in sorted(want):
            got = heard[key]
            assert (got["operation"], got["nospace"]) == ("write", "true"), (key, got)
        await c.call("Stop", {"id": "a", "timeout_seconds": 10})  # stored once the disk takes it
        await wait_state(c, "a", "stopped")

        filler.unlink()  # space is back: the queued writes land, work is taken again
        await reg.store.flush()
        await c.call("Start", {"id": "a"})
        await wait_state(c, "a", "ready")
        assert (await run(c, "a", ["cat", "/root/mark"]))[0] == b"kept\n"
        logs = await c.collect("Logs", {"id": "a"})
        assert any(b"log records dropped" in e["data"] for e in logs), logs[-5:]
        await c.call("Create", {"id": "b"})
        await wait_state(c, "b", "ready")
        await c.call("Stop", {"id": "a", "timeout_seconds": 10})
        await wait_state(c, "a", "stopped")
        disk = reg.get("a").files.disk
        check = subprocess.run(["qemu-img", "check", "-U", str(disk)], capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
    db = sqlite3.connect(str(work.state / "sandvisor.db"))
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        states = dict(db.execute("SELECT id, state FROM sandboxes").fetchall())
    finally:
        db.close()
    assert set(states) == {"a", "b", "c"}


async def test_a_checkpoint_that_runs_out_of_room_says_so_and_loses_nothing(
    image: Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission saw room, then another writer took it: the filesystem fills right before
    QEMU saves the state (past the disk swap). sandbox.v1's code for it, not INTERNAL; the
    guest runs on, on a disk that keeps every layer through a stop and a start."""
    with workdir("sv-ckfull-", private_state=True) as work, tmpfs(work.state, "900m"), trio.fail_after(300):
        (work.state / "images").symlink_to(default_cache())
        async with supervisor(work, templates=False) as (_, reg), connect(work.socket) as c:
            await c.call("Create", {"id": "a"})
            await wait_state(c, "a", "ready")
            assert (await run(c, "a", ["sh", "-c", "echo kept > /root/mark && sync"]))[1] == 0
            guest = reg.get("a").guest
            assert guest is not None
            save = guest.machine.migrate_prepared
            taken = work.state / "taken"

            async def filled_first(*, timeout: float = 120.0) -> dict[str, object]:
                await trio.to_thread.run_sync(fill, taken)
                try:
                    return await save(timeout=timeout)
                finally:  # room again before the guest runs: only the capture met the full disk
                    taken.unlink()

            monkeypatch.setattr(guest.machine, "migrate_prepared", filled_first)
            assert "full" in await expect("RESOURCE_EXHAUSTED", c.call("Checkpoint", {"sandbox_id": "a"}))
            monkeypatch.undo()
            assert (await c.call("Inspect", {"id": "a"}))["state"] == "ready"
            out, code = await run(c, "a", ["sh", "-c", "echo after > /root/after && sync && cat /root/mark"])
            assert (out, code) == (b"kept\n", 0)
            await c.call("Stop", {"id": "a", "timeout_seconds": 10})
            await wait_state(c, "a", "stopped")
            await c.call("Start", {"id": "a"})
            await wait_state(c, "a", "ready")
            assert (await run(c, "a", ["cat", "/root/mark", "/root/after"]))[0] == b"kept\nafter\n"


async def test_a_guest_whose_ram_would_not_fit_is_refused_up_front(image: Image) -> None:
    with workdir("sv-ramfull-") as work, tmpfs(work.root / "ram", "200m") as ram, trio.fail_after(120):
        async with supervisor(work, memory_dir=ram, templates=False) as _, connect(work.socket) as c:
            message = await expect("RESOURCE_EXHAUSTED", c.call("Create", {"id": "big", "limits": {"memory_mib": 256}}))
            assert str(ram) in message and "MiB free" in message
            assert (await c.call("List", {}))["sandboxes"] == []
