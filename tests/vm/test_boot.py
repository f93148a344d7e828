"""The boot path's cuts against a real VM (TCG): the modules the runtime carries are
stripped of their signatures and BTF (images/build.py strip_module) and still load;
the hello reports every boot mark the phases of benchmarks/coldstart.py are made of."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio

from actors.channel.guest import GuestChannel
from images.build import MODULE_SIG_MAGIC, MODULES, Image, strip_module


def test_strip_module_drops_signature_and_btf(image: Image, tmp_path: Path) -> None:
    src = image.kernel.parent / "modules" / "virtio_blk.ko"
    assert src.read_bytes().endswith(MODULE_SIG_MAGIC)  # Debian's, signed
    out = tmp_path / "virtio_blk.ko"
    strip_module(src, out)
    data = out.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert not data.endswith(MODULE_SIG_MAGIC)
    assert b".BTF" not in data  # (section names live in .shstrtab)
    # what modules.dep is written from survives
    assert re.search(rb"depends=virtio,virtio_ring", data) or re.search(rb"depends=virtio_ring,virtio", data)


async def test_the_boot_modules_are_the_stripped_ones(chan: GuestChannel) -> None:
    with trio.fail_after(120):
        # /sys/module/<name>/taint: "E" for a module loaded unsigned (the kernel does not
        # enforce signatures); every module /init loaded for the channel and the disk
        for mod in ("virtio_mmio", "virtio_console", "virtio_blk"):
            assert mod in MODULES
            r = await chan.run(["cat", f"/sys/module/{mod}/taint"])
            assert r.exit_code == 0, r.stderr
            assert b"E" in r.stdout, (mod, r.stdout)


async def test_hello_reports_every_boot_mark(chan: GuestChannel) -> None:
    info = chan.hello_info
    assert info is not None
    marks = info.marks
    for k in ("init", "modules", "rootfs", "python", "ready"):
        assert k in marks, marks
    assert 0 < marks["init"] <= marks["modules"] <= marks["rootfs"] <= marks["python"] <= marks["ready"]


async def test_the_guest_keeps_the_tsc_clocksource(chan: GuestChannel) -> None:
    """Under TCG the command line says ``tsc=reliable``: the watchdog must not swap the
    TSC for refined-jiffies (a 250 Hz tick even when idle) on a loaded host."""
    with trio.fail_after(120):
        cmdline = (await chan.run(["cat", "/proc/cmdline"])).stdout
        if b"tsc=reliable" not in cmdline:
            pytest.skip("not TCG: the guest has its hypervisor's clock")
        r = await chan.run(["cat", "/sys/devices/system/clocksource/clocksource0/current_clocksource"])
        assert r.exit_code == 0, r.stderr
        assert r.stdout.strip() == b"tsc", r.stdout
