"""The supervisor's own work per Create in a burst (docs/results/burst-fast.md):
an empty overlay written from the bytes qemu-img made once, the SDK's wait for ready
asking Inspect less often as the wait goes on."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from actors.machines import disk
from images.build import Image
from supervisor.client import AsyncSandbox
from supervisor.client.sdk import sandbox_plans
from supervisor.client.sdk.ops import TIMED_OUT, Now, Open, Receive, Unary
from supervisor.main.throwaway import supervisor, workdir

MIB = 1 << 20


@pytest.mark.host
async def test_an_empty_overlay_made_again_is_the_image_qemu_img_makes(tmp_path: Path) -> None:
    base = tmp_path / "base.raw"
    with open(base, "wb") as f:
        f.truncate(64 * MIB)
    disk._empty_overlays.clear()
    with trio.fail_after(120):
        await disk.create_overlay(base, tmp_path / "first.qcow2")  # qemu-img's, kept
        assert len(disk._empty_overlays) == 1
        await disk.create_overlay(base, tmp_path / "again.qcow2")  # written from what was kept
        # another name for the backing file (a checkpoint's next overlay) is another image
        await disk.create_overlay(base, tmp_path / "moved.qcow2", backing_as=tmp_path / "frozen.raw")
    assert len(disk._empty_overlays) == 2
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", str(base.resolve()), "-F", "raw"]
    subprocess.run([*argv, str(tmp_path / "ref.qcow2"), str(64 * MIB)], check=True)
    ref = (tmp_path / "ref.qcow2").read_bytes()
    assert (tmp_path / "again.qcow2").read_bytes() == ref == (tmp_path / "first.qcow2").read_bytes()
    assert (tmp_path / "again.qcow2").stat().st_mode & 0o777 == (tmp_path / "ref.qcow2").stat().st_mode & 0o777
    info = disk.inspect_disk(tmp_path / "again.qcow2")
    assert info.size == 64 * MIB and info.header is not None and info.header.backing == str(base.resolve())
    moved = disk.inspect_disk(tmp_path / "moved.qcow2").header
    assert moved is not None and moved.backing == str((tmp_path / "frozen.raw").resolve())
    subprocess.run(["qemu-img", "check", "-q", str(tmp_path / "again.qcow2")], check=True)
    # an overlay written over a file that was there: the file is the image, no tail left
    (tmp_path / "again.qcow2").write_bytes(b"x" * (1 << 20))
    await disk.create_overlay(base, tmp_path / "again.qcow2")
    assert (tmp_path / "again.qcow2").read_bytes() == ref


def test_the_kept_images_are_bounded(tmp_path: Path) -> None:
    disk._empty_overlays.clear()
    img = tmp_path / "img"
    img.write_bytes(disk.QCOW2_MAGIC + bytes(8000) + b"\1")
    for i in range(disk.OVERLAY_KEYS_MAX + 3):
        disk._keep_empty((f"/base{i}", "raw", i), img)
    assert len(disk._empty_overlays) == disk.OVERLAY_KEYS_MAX
    assert ("/base0", "raw", 0) not in disk._empty_overlays  # the oldest went
    kept = disk._empty_overlays[("/base3", "raw", 3)]
    assert kept.length == 8005 and [off for off, _ in kept.blocks] == [0, 4096]  # zero blocks are holes
    disk._write_empty(kept, tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == img.read_bytes()
    (tmp_path / "big").write_bytes(disk.QCOW2_MAGIC + bytes(disk.OVERLAY_KEEP_MAX))
    disk._keep_empty(("/big", "raw", 1), tmp_path / "big")
    assert ("/big", "raw", 1) not in disk._empty_overlays
    disk._empty_overlays.clear()


def test_the_wait_for_ready_asks_inspect_less_often_as_it_goes_on() -> None:
    """An event ends the wait at once; without one, Inspect is asked after 1, 2, 4, 8,
    8 ... s (a burst's callers waiting 10 s ask 4 times, not 10)."""
    plan = sandbox_plans._wait_ready("sb", 60.0)
    now = 100.0
    effect: Any = next(plan)
    assert isinstance(effect, Open)
    effect = plan.send(SimpleNamespace())  # the events call
    assert isinstance(effect, Unary) and effect.method == "Inspect"
    effect = plan.send(SimpleNamespace(state="starting", error=""))
    polls: list[float] = []
    inspects = 0
    while inspects < 6:
        if isinstance(effect, Now):
            effect = plan.send(now)
        elif isinstance(effect, Receive):
            assert effect.deadline is not None
            polls.append(effect.deadline - now)
            now = effect.deadline
            effect = plan.send(TIMED_OUT)
        else:
            assert isinstance(effect, Unary) and effect.method == "Inspect"
            inspects += 1
            effect = plan.send(SimpleNamespace(state="starting", error=""))
    assert polls == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert isinstance(effect, Now)
    effect = plan.send(now)
    assert isinstance(effect, Receive)
    effect = plan.send(SimpleNamespace(action="ready"))  # the event: Inspect at once
    assert isinstance(effect, Unary)
    with pytest.raises(StopIteration) as done:
        plan.send(SimpleNamespace(state="ready", error=""))
    assert done.value.value.state == "ready"


@pytest.mark.vm
async def test_clones_of_a_template_on_kept_overlays_each_write_their_own_disk(image: Image) -> None:
    """A real VM: the first Create boots (its overlay by qemu-img) and saves the boot
    template (the checkpoint's next overlay, on the frozen disk, by qemu-img); three at
    once restore it, each on an overlay of the template's disk written from the kept
    image, and each writes and reads back its own file through the SDK (the wait for
    ready backs off)."""
    disk._empty_overlays.clear()
    with workdir("sv-burst-", private_state=True) as work:
        async with supervisor(work, stop_timeout=5) as (cfg, registry):
            sock = str(cfg.socket)
            with trio.fail_after(600):
                first = await AsyncSandbox.create("first", socket=sock, detached=True, timeout=300)
                assert (await first.run(["true"])).exit_code == 0
                boots = len(disk._empty_overlays)
                names = [f"clone{i}" for i in range(3)]
                clones: list[AsyncSandbox] = []

                async def make(name: str) -> None:
                    clones.append(await AsyncSandbox.create(name, socket=sock, detached=True, timeout=300))

                async with trio.open_nursery() as n:
                    for name in names:
                        n.start_soon(make, name)
                for sb in clones:
                    r = await sb.run(["sh", "-c", f"echo {sb.id} > /root/mine && sync && cat /root/mine"])
                    assert r.exit_code == 0 and r.stdout.strip() == sb.id.encode(), r
                # the clones stand on the template's disk, whose image the template's
                # checkpoint kept (its next overlay names the frozen disk): no qemu-img
                assert len(disk._empty_overlays) == boots
                tpl = registry.snapshots.templates()
                assert len(tpl) == 1 and any(k[0] == str(tpl[0].disk.resolve()) for k in disk._empty_overlays)
                assert {(await sb.run(["cat", "/root/mine"])).stdout.strip() for sb in clones} == {
                    n.encode() for n in names
                }
