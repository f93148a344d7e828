"""Memory a guest frees goes back to the host: a virtio-balloon with free page
reporting, on a cold boot (its own RAM file: holes punched), on a clone of the boot
template (a private mapping of the template's sealed memory: the discard shim lets
QEMU drop its private copies, and the template's memory is never written), and on a
resumed sandbox (a private mapping of its saved memory file, which is never punched).

How fast it happens is the benchmark's business (benchmarks/memory.py); here only
that it happens, within a generous deadline, and that nothing else is touched."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from actors.model import MemoryKind
from actors.registry import Registry
from images.build import Image
from supervisor.client import AsyncSandbox
from supervisor.main.throwaway import Workdir, supervisor, workdir

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="balloons need a jailed (root) supervisor"),
]

MIB = 1 << 20
# touches 150 MiB, then exits: the guest kernel frees it all at once
ALLOC_FREE = "b = bytearray(150 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"


@pytest.fixture
def work(image: Image) -> Iterator[Workdir]:
    with workdir("svm-", private_state=True) as w:
        yield w


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def gives_back(registry: Registry, sb: AsyncSandbox) -> tuple[int, int]:
    """Allocate and free 150 MiB in the guest; its QEMU's RSS must fall by 100 MiB (most
    of them) from the peak within 10 s of the Run's exit (the guest reports
    free blocks after ~2 s). What stays is the page cache of python3's files. Returns
    (peak, after)."""
    pid = registry.get(sb.id).record.qemu_pid
    before = rss(pid)
    # the peak is sampled while the guest runs: the guest may report (and QEMU give back)
    # the freed pages before the Run's answer reaches us, and a peak read after it was
    # then already low (a full run saw +62 MiB "peak" and nothing left to give back)
    peak = before
    async with trio.open_nursery() as nursery:

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rss(pid))
                await trio.sleep(0.02)

        nursery.start_soon(sample)
        r = await sb.run(["python3", "-c", ALLOC_FREE])
        nursery.cancel_scope.cancel()
    assert r.exit_code == 0, r
    assert peak - before >= 100 * MIB, (before, peak)  # the guest's writes were there
    try:
        with trio.fail_after(10):
            while rss(pid) > peak - 100 * MIB:
                await trio.sleep(0.2)
    except trio.TooSlowError:
        raise AssertionError(f"RSS {before >> 20} MiB before, {peak >> 20} peak, {rss(pid) >> 20} after 10 s") from None
    return peak, rss(pid)


async def test_freed_guest_memory_goes_back_boot_and_clone(work: Workdir) -> None:
    with trio.fail_after(300):
        async with supervisor(work) as (cfg, registry):
            assert registry.settings.balloon and registry.settings.cells is not None
            sock = cfg.socket
            async with await AsyncSandbox.create("cold", socket=sock) as cold:  # boots; saves the template
                await gives_back(registry, cold)
                qemu_log = Path(registry.get("cold").files.run_dir) / "qemu.log"
                assert b"fallocate" not in qemu_log.read_bytes()
            [tpl] = registry.snapshots.templates()
            assert tpl.machine.balloon
            memory = tpl.path / "memory"
            before = digest(memory)
            async with await AsyncSandbox.create("clone", socket=sock) as clone:
                logs = b"".join(e.data for e in await clone.logs() if e.source == "system")
                assert b"restored from the boot template" in logs, logs
                life = registry.get("clone")
                assert life.guest is not None
                assert life.guest.machine.spec.preload is not None  # the discard shim, on a sealed memfd
                peak, after = await gives_back(registry, clone)
                qemu_log = Path(life.files.run_dir) / "qemu.log"
                assert b"fallocate" not in qemu_log.read_bytes()  # QEMU went on to its madvise
                # guestd set the reporting order to 0 once the balloon's driver was in
                order = await clone.run(["cat", "/sys/module/page_reporting/parameters/page_reporting_order"])
                assert order.stdout == b"0\n", order
                # the clone's memory is whole: what it wrote is there, freed pages read back
                assert (await clone.run(["sh", "-c", "echo ok > /run/x; cat /run/x"])).stdout == b"ok\n"
            assert digest(memory) == before  # the template's memory was never written
            assert peak - after >= 100 * MIB  # it had grown by them, and gave them back


def fd_digest(fd: int) -> str:
    h = hashlib.sha256()
    off = 0
    while chunk := os.pread(fd, 8 * MIB, off):
        h.update(chunk)
        off += len(chunk)
    return h.hexdigest()


async def test_a_resumed_guest_gives_memory_back_without_touching_its_saved_memory(work: Workdir) -> None:
    """A paused sandbox resumes with its saved memory mapped privately from the file
    itself (no sealed copy); its balloon gives freed memory back (the discard shim lets
    QEMU drop its private copies) but never punches that file: until the resume is done
    it is the sandbox's saved state (a resume cut short leaves it paused on it)."""
    with trio.fail_after(300):
        async with supervisor(work) as (cfg, registry), await AsyncSandbox.create("p", socket=cfg.socket) as sb:
            await sb.pause()
            saved = registry.hibernation.saved(registry.get("p"))
            assert saved is not None and saved.memory == MemoryKind.MAPPED
            fd = os.open(saved.path / "memory", os.O_RDONLY | os.O_CLOEXEC)  # (the resume unlinks it)
            try:
                st = os.fstat(fd)
                before = fd_digest(fd)
                await sb.resume()
                life = registry.get("p")
                assert life.guest is not None and life.guest.machine.spec.preload is not None
                environ = Path(f"/proc/{life.record.qemu_pid}/environ").read_bytes().split(b"\0")
                assert f"SANDVISOR_PRIVATE_RAM={st.st_dev}:{st.st_ino}".encode() in environ
                await gives_back(registry, sb)
                qemu_log = Path(life.files.run_dir) / "qemu.log"
                assert b"fallocate" not in qemu_log.read_bytes()
                after = os.fstat(fd)
                assert [after.st_size, after.st_mtime_ns, after.st_blocks] == [
                    st.st_size,
                    st.st_mtime_ns,
                    st.st_blocks,
                ]
                assert fd_digest(fd) == before
            finally:
                os.close(fd)
