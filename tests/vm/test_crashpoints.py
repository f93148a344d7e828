"""A supervisor killed (SIGKILL) at each named step of its work, then started again:
every QEMU is adopted or gone, every recorded disk checks clean and stands on the
chain its record names, and nothing stray is left -- no sandbox or snapshot
directory without a record, no run dir, RAM file or cgroup of a life that is not
running. The steps are :data:`actors.crash.STEPS`; each test crashes at
the first time its step runs, in the production configuration (root: jailed QEMUs in
cgroups; boot templates on unless the scenario needs a plain checkpoint)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

from actors.cells.cgroups import detect
from actors.crash import STEPS
from actors.recovery import our_qemus
from images.build import Image
from supervisor.client import AsyncConnection, connect
from supervisor.main.throwaway import Workdir, supervisor_process, workdir
from supervisor.wire.config import default_memory_dir
from supervisor.wire.protocol import ApiError
from tests.support.client import run, wait_state

pytestmark = pytest.mark.vm

MARK = ["sh", "-c", "echo before-the-crash > /root/mark && sync"]


async def create_a(c: AsyncConnection) -> None:
    await c.call("Create", {"id": "a"})
    await wait_state(c, "a", "ready")
    await trio.sleep_forever()  # (the crash comes after ready: a template, a pool member)


async def checkpoint_a(c: AsyncConnection) -> None:
    await c.call("Create", {"id": "a"})
    await wait_state(c, "a", "ready")
    assert (await run(c, "a", MARK))[1] == 0
    await c.call("Checkpoint", {"sandbox_id": "a", "name": "snap"})


async def checkpoint_a_default(c: AsyncConnection) -> None:
    """A default Create (a restore of the boot template that the first Create made)
    checkpointed: streamed, so its conversion starts."""
    await c.call("Create", {"id": "t"})
    await wait_state(c, "t", "ready")
    await c.call("Remove", {"id": "t", "force": True})
    await checkpoint_a(c)
    assert await snapshot_memory(c, "snap") == "streamed"
    while True:  # the crash comes in the conversion, after the checkpoint: a call notices
        await snapshot_memory(c, "snap")
        await trio.sleep(0.2)


async def fork_a(c: AsyncConnection) -> None:
    """A default Create (a restore of the boot template the first Create made) forked:
    the helper's copy (the crash comes at the switchover)."""
    await c.call("Create", {"id": "t"})
    await wait_state(c, "t", "ready")
    await c.call("Remove", {"id": "t", "force": True})
    await c.call("Create", {"id": "a"})
    await wait_state(c, "a", "ready")
    assert (await run(c, "a", MARK))[1] == 0
    await c.call("Fork", {"id": "a", "count": 1})


async def listed_snapshot(c: AsyncConnection, name: str) -> dict[str, Any]:
    [snap] = [s for s in (await c.call("ListSnapshots", {}))["snapshots"] if s["name"] == name]
    return snap


async def snapshot_memory(c: AsyncConnection, name: str) -> str:
    memory: str = (await listed_snapshot(c, name))["memory"]
    return memory


async def pause_a(c: AsyncConnection) -> None:
    """A ready sandbox paused: a process counting in memory, a file on disk."""
    await c.call("Create", {"id": "a"})
    await wait_state(c, "a", "ready")
    assert (await run(c, "a", MARK))[1] == 0
    assert (
        await run(c, "a", ["sh", "-c", "(while true; do echo x >> /run/alive; sleep 0.1; done) >/dev/null 2>&1 &"])
    )[1] == 0
    await c.call("Pause", {"id": "a"})


async def resume_a(c: AsyncConnection) -> None:
    await pause_a(c)
    await c.call("Resume", {"id": "a"})


async def remove_a(c: AsyncConnection) -> None:
    await c.call("Create", {"id": "a"})
    await wait_state(c, "a", "ready")
    await c.call("Remove", {"id": "a", "force": True})


# step -> (serve arguments, what the client does until the supervisor dies). The
# supervisor started after the crash takes the same arguments but --template-pool:
# a pool refilling while the checks read /proc and the database would race them.
SCENARIOS: dict[str, tuple[list[str], Callable[[AsyncConnection], Awaitable[None]]]] = {
    "spawned": ([], create_a),
    "hello": ([], create_a),
    "template-checkpoint": ([], create_a),
    "checkpoint-swap": (["--no-templates"], checkpoint_a),
    "snapshot-record": (["--no-templates"], checkpoint_a),
    "pool-fill": (["--template-pool", "1"], create_a),
    "remove": (["--no-templates"], remove_a),
    "convert": ([], checkpoint_a_default),
    "pause-saved": ([], pause_a),
    "pause-stopping": ([], pause_a),
    "resume-loaded": ([], resume_a),
    "fork-switchover": ([], fork_a),
}
# a crash in a pause or a resume leaves the sandbox running or paused, never lost
PAUSE_STATES = {"pause-saved": "ready", "pause-stopping": "paused", "resume-loaded": "paused"}
RESTART_ARGS = {"pool-fill": []}


def test_every_step_has_a_scenario() -> None:
    assert set(SCENARIOS) == STEPS


@pytest.mark.parametrize("step", sorted(SCENARIOS))
def test_a_crash_at_each_step_leaves_nothing_behind(image: Image, step: str) -> None:
    args, action = SCENARIOS[step]

    async def until_the_crash(work: Workdir) -> None:
        with trio.fail_after(240):
            try:
                async with connect(work.socket) as c:
                    await action(c)
            except ApiError as exc:
                if exc.code != "UNAVAILABLE" or "connection to the supervisor lost" not in exc.message:
                    raise
                return  # the connection went with the supervisor
            except (OSError, trio.BrokenResourceError, EOFError):
                return
            raise AssertionError(f"the supervisor did not crash at {step}")

    async def converted(work: Workdir) -> None:
        """The restarted supervisor converts the snapshot again; wait for it, so the
        checks do not race its helper."""
        with trio.fail_after(240):
            async with connect(work.socket) as c:
                # mapped, and settled: the record flushed and the old stream unlinked after it
                mapped = {"disk.qcow2", "initrd", "kernel", "memory", "vmstate-mapped"}
                while True:
                    snap = await listed_snapshot(c, "snap")
                    files = set(os.listdir(snap["snapshot_dir"]))
                    if snap["memory"] == "mapped" and files == mapped and not list(work.run_root.glob("cv-*")):
                        break
                    await trio.sleep(0.2)

    async def after(work: Workdir) -> None:
        async with connect(work.socket) as c:
            listed = {s["id"]: s["state"] for s in (await c.call("List", {}))["sandboxes"]}
            if step == "remove":
                assert listed == {}
                return
            assert set(listed) == {"a"}, listed
            info = await c.call("Inspect", {"id": "a"})
            if step in ("checkpoint-swap", "fork-switchover"):
                # its QEMU was paused mid-checkpoint (a fork's: at the switchover): killed,
                # the disk kept; the fork's helper QEMU, named by no record, killed too
                assert info["state"] == "failed" and "checkpointed" in info["error"], info
            if step in PAUSE_STATES:
                assert info["state"] == PAUSE_STATES[step], info
                if info["state"] == "paused":
                    info = await c.call("Resume", {"id": "a"})
                # its processes came back with it (not a fresh boot): the loop's file is there
                assert (await run(c, "a", ["test", "-s", "/run/alive"]))[1] == 0
            if info["state"] != "ready":
                await c.call("Start", {"id": "a"})
                await wait_state(c, "a", "ready")
            out, _ = await run(c, "a", ["cat", "/root/mark"])
            if step == "convert":  # the snapshot the crash cut the conversion of restores, mapped
                assert out == b"before-the-crash\n"
                await c.call("Restore", {"snapshot_id": "snap", "id": "b"})
                await wait_state(c, "b", "ready")
                assert (await run(c, "b", ["cat", "/root/mark"]))[0] == b"before-the-crash\n"
                await c.call("Remove", {"id": "b", "force": True})
            if step in ("checkpoint-swap", "snapshot-record", "fork-switchover"):
                assert out == b"before-the-crash\n"  # the disk froze or not, nothing was lost
                # the chain is sound: one more checkpoint, and a restore of it
                snap = await c.call("Checkpoint", {"sandbox_id": "a", "name": "again"})
                await c.call("Restore", {"snapshot_id": snap["snapshot_id"], "id": "b"})
                await wait_state(c, "b", "ready")
                assert (await run(c, "b", ["cat", "/root/mark"]))[0] == b"before-the-crash\n"
            await c.call("Stop", {"id": "a", "timeout_seconds": 5})
            await wait_state(c, "a", "stopped")

    with workdir(f"sv-crash-{step}-", private_state=True) as work:
        log = work.root / "serve.log"
        with supervisor_process(work, *args, extra_env={"SANDVISOR_CRASH_AT": step}, log=log) as (_, proc):
            trio.run(until_the_crash, work)
            try:
                assert proc.wait(timeout=60) == -9
            except subprocess.TimeoutExpired:
                raise AssertionError(f"no crash at {step}; the supervisor's log ends:\n{log.read_text()[-3000:]}")
        if step == "convert":  # what the crash left: the helper's QEMU, its files (cleaned up below)
            assert any(p.name.endswith(".part") for p in (work.state / "snapshots").glob("*/*"))
        with supervisor_process(work, *RESTART_ARGS.get(step, args)) as (_, proc):
            if step == "convert":
                trio.run(converted, work)
            check_nothing_stray(work)
            trio.run(after, work)
        check_nothing_stray(work)


def check_nothing_stray(work: Workdir) -> None:
    """What is on the host is what the records say, and every recorded disk is sound."""
    db = sqlite3.connect(str(work.state / "sandvisor.db"))
    rows = db.execute("SELECT uid, id, state, chain, life, swap FROM sandboxes").fetchall()
    snaps = [msgpack.unpackb(d) for (d,) in db.execute("SELECT data FROM snapshots")]
    db.close()
    lives = {uid: msgpack.unpackb(life) for uid, _, _, _, life, _ in rows if life and msgpack.unpackb(life)}
    assert all(not swap for *_, swap in rows), "a checkpoint's journal was left set"
    # every QEMU under our run root is a recorded, running life
    assert our_qemus(work.run_root) == {life["pid"] for life in lives.values()}
    # sandbox directories: one per record, and each disk checks clean on its recorded chain
    sandboxes = work.state / "sandboxes"
    assert {d.name for d in sandboxes.iterdir()} == {uid for uid, *_ in rows}
    for uid, id, _, chain, _, _ in rows:
        disk = sandboxes / uid / "disk.qcow2"
        assert not (sandboxes / uid / "disk.next.qcow2").exists(), id
        recorded = [str(disk), *(msgpack.unpackb(chain) if chain else [])]
        assert backing_chain(disk)[: len(recorded)] == recorded, id
        check = subprocess.run(["qemu-img", "check", "-U", str(disk)], capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
    # snapshot directories: recorded, or a layer some chain stands on
    used = {str(Path(p).parent) for _, _, _, chain, _, _ in rows if chain for p in msgpack.unpackb(chain)}
    used |= {str(Path(p).parent) for s in snaps for p in s.get("chain", [])}
    snapshots = work.state / "snapshots"
    if snapshots.is_dir():
        assert {str(d) for d in snapshots.iterdir()} <= {s["dir"] for s in snaps} | used
    # a recorded snapshot holds its files, none of a conversion (a *.part, a second stream)
    for s in snaps:
        memory = ["memory"] if s["memory"] == "mapped" else []
        named = {"disk.qcow2", "kernel", "initrd", s.get("vmstate", "vmstate"), *memory}
        assert set(os.listdir(s["dir"])) == named, s["dir"]
    # run dirs, RAM files, cgroups: only of the lives running now
    running = {Path(life["run_dir"]).name for life in lives.values()}
    assert {d.name for d in work.run_root.glob("*")} <= running  # (a stopped serve removes it when empty)
    ram_dir = default_memory_dir(work.state)
    if ram_dir is not None and ram_dir.is_dir():
        assert {f.name for f in ram_dir.iterdir()} <= {Path(life["ram"]).name for life in lives.values()}
    key = hashlib.sha256(str(work.state.resolve()).encode()).hexdigest()[:12]
    cgroups = detect(parent=f"sandvisor-{key}")
    if cgroups is not None:
        assert cgroups.names() <= {life["cgroup"] for life in lives.values()}


def backing_chain(disk: Path) -> list[str]:
    qemu_img = shutil.which("qemu-img")
    assert qemu_img is not None
    info = subprocess.run(
        [qemu_img, "info", "-U", "--backing-chain", "--output=json", str(disk)],
        capture_output=True,
        text=True,
        check=True,
    )
    images: list[dict[str, Any]] = json.loads(info.stdout)
    return [i["filename"] for i in images]
