"""Cold boots through booted_guest / Machine: ladder, crashes, odd root filesystems."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import trio

from actors.channel.guest import ChannelBroken, GuestOpError
from actors.machines.machine import Runstate
from actors.machines.qemuproc import LaunchError
from actors.machines.vm import BootError, booted_guest
from images.build import Image
from tests.support.vms import cold_spec


def qemus_of(run_dir: Path) -> set[int]:
    """QEMU processes started on ``run_dir`` (not the host's others: other tests, other runs)."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].startswith(b"qemu-system") and any(str(run_dir).encode() in a for a in argv):
            found.add(int(proc.name))
    return found


async def test_boot_run_and_graceful_poweroff(image: Image, tmp_run: Path) -> None:
    with trio.fail_after(120):
        async with booted_guest(await cold_spec(image, tmp_run, hostname="cold"), tmp_run) as g:
            assert g.t_launch < g.t_qmp < g.t_ready
            status = await g.machine.qmp_execute("query-status")
            assert status["status"] == "running"
            r = await g.channel.run(["hostname"])
            assert r.stdout == b"cold\n"
            await g.channel.write_file("/root/persist", b"kept")
            pid = g.machine.pid
        # guestd powered the VM off (exit 0), the process is reaped
        assert g.machine.runstate is Runstate.EXITED
        assert g.machine.returncode == 0
        assert pid not in qemus_of(tmp_run)


async def test_cancelled_boot_leaves_no_process(image: Image, tmp_run: Path) -> None:
    with trio.move_on_after(0.5):
        async with booted_guest(await cold_spec(image, tmp_run), tmp_run):
            pytest.fail("cannot be ready in 0.5 s under TCG")
    assert qemus_of(tmp_run) == set()


async def test_qemu_killed_breaks_channel(image: Image, tmp_run: Path) -> None:
    with trio.fail_after(120):
        async with booted_guest(await cold_spec(image, tmp_run), tmp_run) as g:
            assert g.machine.pid is not None
            os.kill(g.machine.pid, signal.SIGKILL)
            rc = await g.machine.wait()
            assert rc == -signal.SIGKILL
            with pytest.raises(ChannelBroken):
                with trio.fail_after(10):
                    await g.channel.ping()
            assert "signal 9" in g.machine.describe_exit()


async def test_boot_timeout_is_a_typed_error(image: Image, tmp_run: Path) -> None:
    # init=/bin/false-like failure: point the guest at a port name guestd will not find
    with trio.fail_after(120), pytest.raises(BootError) as e:
        async with booted_guest(
            await cold_spec(image, tmp_run, extra_cmdline="sandvisor.port=nowhere", boot_timeout=8), tmp_run
        ):
            pass
    assert "within 8s" in str(e.value)


async def test_qemu_failing_at_start_is_a_typed_error(image: Image, tmp_run: Path) -> None:
    with trio.fail_after(60), pytest.raises(LaunchError) as e:
        async with booted_guest(await cold_spec(image, tmp_run, memory_mib=1 << 30), tmp_run):  # QEMU refuses 1 PiB
            pass
    assert "Cannot allocate memory" in str(e.value)  # QEMU's own words reach the caller


@pytest.fixture(scope="session")
def busybox_rootfs(image: Image, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ext4 root with nothing but a static busybox: no Python, no libc."""
    d = tmp_path_factory.mktemp("bbroot")
    tree = d / "tree"
    (tree / "bin").mkdir(parents=True)
    bb = shutil.which("busybox")
    assert bb, "busybox-static is a test dependency"
    shutil.copy(bb, tree / "bin" / "busybox")
    for applet in ("sh", "echo", "cat", "ls", "id", "uname"):
        (tree / "bin" / applet).symlink_to("busybox")
    (tree / "etc").mkdir()
    (tree / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\n")
    img = d / "bb.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), str(img), "32M"], check=True)
    return img


async def test_rootfs_without_python(image: Image, tmp_run: Path, busybox_rootfs: Path) -> None:
    with trio.fail_after(120):
        async with booted_guest(await cold_spec(image, tmp_run, rootfs=busybox_rootfs), tmp_run) as g:
            r = await g.channel.run(["/bin/sh", "-c", "echo hi from $(uname -s); ls /"])
            assert r.exit_code == 0
            assert r.stdout.startswith(b"hi from Linux\n")
            assert b"usr" not in r.stdout.split(b"\n", 1)[1]  # it is the busybox root, not guestd's
            with pytest.raises(GuestOpError) as e:
                await g.channel.run(["python3", "-c", "1"])
            assert e.value.code == "NOT_FOUND"
