"""Crash-consistent captures against a real `sandvisor serve` and real VMs: a pause or
a checkpoint taken while a guest process appends and fsyncs in a loop captures a disk
whose ext4 is clean (its file systems were frozen: no journal to replay, no orphan
list), the guest runs on thawed -- the checkpointed one at once, the paused one at its
resume, a restore of the checkpoint at its hello -- and the same pause with freezing
off (serve --no-fs-freeze) captures a disk that needs recovery, so the check can see
the difference.

The captured chain is read as the supervisor wrote it (its own headers) and copied
into a directory of the test's; every tool that parses those bytes (qemu-img,
dumpe2fs, e2fsck) runs on the copy as nobody, with no capabilities."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.machines.disk import backing_chain, is_qcow2
from images.build import Image
from supervisor.client import AsyncSandbox, connect
from supervisor.main.throwaway import supervisor_process, workdir

pytestmark = pytest.mark.vm

NOBODY = 65534
CONFINED = [
    "setpriv",
    "--reuid",
    str(NOBODY),
    "--regid",
    str(NOBODY),
    "--clear-groups",
    "--inh-caps=-all",
    "--bounding-set=-all",
    "--no-new-privs",
]
# appends a line block and fsyncs it, then replaces a small file (a journalled rename),
# forever; its progress in /run (tmpfs: never frozen)
WRITER = r"""
import os
d = "/var/tmp/fz"
os.makedirs(d, exist_ok=True)
i = 0
while True:
    with open(d + "/log", "a") as f:
        f.write(("%d\n" % i) * 64)
        f.flush()
        os.fsync(f.fileno())
    p = "%s/f%d" % (d, i % 32)
    with open(p + ".t", "w") as g:
        g.write("x" * 4096)
        g.flush()
        os.fsync(g.fileno())
    os.replace(p + ".t", p)
    i += 1
    with open("/run/fz.t", "w") as c:
        c.write(str(i))
    os.replace("/run/fz.t", "/run/fz")
"""


@contextmanager
def serving(image: Image, prefix: str, *args: str) -> Iterator[dict[str, Any]]:
    """A supervisor on this tree's image: its own manifest naming the parts the session
    built (the shared cache's manifest is whichever tree built last)."""
    with tempfile.TemporaryDirectory(prefix=f"{prefix}cache-", dir="/tmp") as cache:
        os.chmod(cache, 0o755)
        (Path(cache) / "default.json").write_text(json.dumps(image.to_json()))
        with workdir(prefix, cache=Path(cache)) as work, supervisor_process(work, *args):
            yield {"sock": str(work.socket), "state": work.root / "state"}


@pytest.fixture(scope="module")
def frozen(image: Image) -> Iterator[dict[str, Any]]:
    with serving(image, "sv-fz-") as served:
        yield served


@pytest.fixture(scope="module")
def unfrozen(image: Image) -> Iterator[dict[str, Any]]:
    with serving(image, "sv-nofz-", "--no-fs-freeze") as served:
        yield served


async def progress(sb: AsyncSandbox) -> int:
    r = await sb.run(["sh", "-c", "cat /run/fz 2>/dev/null || echo 0"])
    assert r.exit_code == 0, r
    return int(r.stdout)


async def start_writer(sb: AsyncSandbox) -> None:
    await sb.fs.write("/run/writer.py", WRITER.encode())
    await sb.run(["sh", "-c", "(python3 /run/writer.py) >/dev/null 2>&1 &"])
    await writes_go_on(sb)


async def writes_go_on(sb: AsyncSandbox, n: int = 5) -> None:
    """The writer makes progress (its file system is not frozen)."""
    first = await progress(sb)
    with trio.fail_after(60):
        while await progress(sb) < first + n:
            await trio.sleep(0.1)


def snapshot_dirs(state: Path) -> set[Path]:
    return {p for p in (state / "snapshots").iterdir() if (p / "disk.qcow2").exists()}


def ext4_of(top: Path, into: Path) -> dict[str, str]:
    """The captured chain from ``top`` down as one raw file in ``into`` (copies, relinked
    to each other and converted as nobody), and its ext4 checked as nobody: the
    superblock's fields (``dumpe2fs -h``) and ``e2fsck -fn``'s exit status ("fsck")."""
    chain = [top, *backing_chain(top)]  # (headers the supervisor wrote, read in Python)
    into.parent.chmod(0o755)
    into.mkdir(mode=0o755)
    copies = [into / f"layer{i}" for i in range(len(chain))]
    for src, dst in zip(chain, copies, strict=True):
        shutil.copyfile(src, dst)
        os.chown(dst, NOBODY, NOBODY)
    os.chown(into, NOBODY, NOBODY)

    def confined(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CONFINED, *argv], capture_output=True, text=True, timeout=600, check=False)

    for i, (src, copy) in enumerate(zip(chain[:-1], copies[:-1], strict=True)):
        assert is_qcow2(src)
        below = copies[i + 1]
        fmt = "qcow2" if is_qcow2(chain[i + 1]) else "raw"
        p = confined("qemu-img", "rebase", "-u", "-f", "qcow2", "-F", fmt, "-b", str(below), str(copy))
        assert p.returncode == 0, p.stderr
    raw = into / "disk.raw"
    p = confined("qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(copies[0]), str(raw))
    assert p.returncode == 0, p.stderr
    p = confined("dumpe2fs", "-h", str(raw))
    assert p.returncode == 0, p.stderr
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in p.stdout.splitlines()) if v}
    fsck = confined("e2fsck", "-fn", str(raw))
    fields["fsck"] = str(fsck.returncode)
    fields["fsck output"] = fsck.stdout[-600:]
    return fields


def check_clean(fs: dict[str, str]) -> None:
    assert fs["Filesystem state"] == "clean", fs
    assert "needs_recovery" not in fs["Filesystem features"].split(), fs["Filesystem features"]
    assert "First orphan inode" not in fs, fs  # (dumpe2fs shows it only when the list is not empty)
    assert fs["fsck"] == "0", fs["fsck output"]


async def paused_event(sock: str, name: str, act: Any) -> dict[str, Any]:
    """``act()`` with the Events stream open; the paused event of ``name`` it caused."""
    seen: list[dict[str, Any]] = []
    async with connect(sock) as ec, ec.open_call("Events", {}) as stream:

        async def watch() -> None:
            async for ev in stream:
                if ev["sandbox_id"] == name and ev["action"] == "paused":
                    seen.append(ev)
                    return

        async with trio.open_nursery() as n:
            n.start_soon(watch)
            await act()
            with trio.fail_after(10):
                while not seen:
                    await trio.sleep(0.05)
    return seen[0]


async def test_pause_mid_write_captures_a_clean_disk_and_resumes_thawed(frozen: dict[str, Any]) -> None:
    sock, state = frozen["sock"], frozen["state"]
    with trio.fail_after(600), tempfile.TemporaryDirectory(prefix="fz-", dir="/tmp") as tmp:
        async with await AsyncSandbox.create("fz-pause", socket=sock) as sb:
            await start_writer(sb)
            before = snapshot_dirs(state)
            ev = await paused_event(sock, "fz-pause", sb.pause)
            assert ev.get("attributes", {}).get("consistency") == "frozen", ev
            [saved] = snapshot_dirs(state) - before
            fs = await trio.to_thread.run_sync(ext4_of, saved / "disk.qcow2", Path(tmp) / "pause")
            check_clean(fs)
            # resumed, its memory saved frozen: thawed at the hello, the writer goes on
            await sb.resume()
            await writes_go_on(sb)
            await sb.remove()


async def test_checkpoint_mid_write_captures_a_clean_disk_and_thaws(frozen: dict[str, Any]) -> None:
    sock = frozen["sock"]
    with trio.fail_after(600), tempfile.TemporaryDirectory(prefix="fz-", dir="/tmp") as tmp:
        async with await AsyncSandbox.create("fz-ck", socket=sock) as sb:
            await start_writer(sb)
            snap = (await sb.checkpoint("fz-ck-snap")).snapshot_id
            await writes_go_on(sb)  # the checkpointed guest is thawed at once
            [info] = [s for s in await AsyncSandbox.snapshots(socket=sock) if s.id == snap]
            fs = await trio.to_thread.run_sync(ext4_of, Path(info.snapshot_dir) / "disk.qcow2", Path(tmp) / "ck")
            check_clean(fs)
            async with connect(sock) as c:
                logs = [e["data"] for e in await c.collect("Logs", {"id": "fz-ck"}) if e["source"] == "system"]
            assert any(b"file systems frozen" in line for line in logs), logs
            # a restore of that memory (saved frozen) is thawed at its hello
            async with await AsyncSandbox.restore(snap, name="fz-ck-r", socket=sock) as clone:
                await writes_go_on(clone)
            await sb.remove()
            await AsyncSandbox.delete_snapshot(snap, socket=sock)


async def test_without_freezing_a_pause_captures_a_disk_that_needs_recovery(unfrozen: dict[str, Any]) -> None:
    sock, state = unfrozen["sock"], unfrozen["state"]
    with trio.fail_after(600), tempfile.TemporaryDirectory(prefix="nofz-", dir="/tmp") as tmp:
        async with await AsyncSandbox.create("nofz", socket=sock) as sb:
            await start_writer(sb)
            before = snapshot_dirs(state)
            ev = await paused_event(sock, "nofz", sb.pause)
            assert "consistency" not in ev.get("attributes", {}), ev
            [saved] = snapshot_dirs(state) - before
            fs = await trio.to_thread.run_sync(ext4_of, saved / "disk.qcow2", Path(tmp) / "pause")
            assert "needs_recovery" in fs["Filesystem features"].split(), fs
            await sb.resume()
            await writes_go_on(sb)
            await sb.remove()
