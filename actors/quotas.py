"""Admission: what the supervisor takes on, so no burst of Creates, pools or
checkpoints can exhaust the host.

Counted: every live sandbox, warm pool members and boot template boots included
(``max_sandboxes``); the guest RAM they were given (``max_memory_mib``; default: the
host's RAM less 1 GiB); the state dir's disk use -- logs, overlays, snapshots
(``max_disk_mib``, none by default; measured in a worker thread, at most every
``DISK_SCAN_INTERVAL``), and the free space of the filesystems new files go to: a
RAM file must fit in the RAM dir (a full tmpfs kills QEMUs with SIGBUS), and the
state dir keeps ``min_free_mib``. Each refusal is RESOURCE_EXHAUSTED naming the limit.

One sandbox's disks are capped too (:func:`check_sandbox_disk`, ``--max-sandbox-disk``,
16 GiB by default): what its guest can make the host store is its overlay, which grows
to at most its virtual size plus qcow2 metadata (:func:`actors.machines.disk.overlay_bound`),
and its read-write volumes (sparse raw files of their size). So the sum of those
virtual sizes is the bound a guest meets as ENOSPC in its own file systems, never
the host's or its neighbours'. A checkpoint freezes the overlay into the snapshot
(the client's doing, counted by ``--max-disk``) and the guest goes on in a new overlay
of the same virtual size: per life between checkpoints, the bound holds.

Admitted work then queues for a start slot (:func:`gated`): at most ``max_starting``
VMs come up at once, QEMU's launch to the guest's hello, boots and restores alike.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path

import attrs
import trio

from actors.errors import ResourceExhausted
from actors.machines.vm import Attach, Guest, VmSpec

Launcher = Callable[[VmSpec, Attach], AbstractAsyncContextManager[Guest]]

DISK_SCAN_INTERVAL = 10.0
CAPTURE_MARGIN_MIB = 64  # free space a capture needs beyond the guest's RAM (device state, the disk swap)


@attrs.frozen
class Quotas:
    max_sandboxes: int = 64
    max_memory_mib: int = 0  # 0: the host's RAM less 1 GiB
    max_disk_mib: int = 0  # 0: no limit on the state dir's use
    min_free_mib: int = 256  # free space the state dir's filesystem keeps
    max_paused: int = 0  # paused (hibernated) sandboxes at once; 0: no limit (they hold disk, not RAM)


def check_sandbox_disk(cap_mib: int, disk: int, volumes: Iterable[tuple[str, int]] = ()) -> None:
    """May one sandbox have a disk of virtual size ``disk`` and these read-write
    volumes (name, size)? RESOURCE_EXHAUSTED naming the sizes, else nothing (cap 0: no cap)."""
    if not cap_mib:
        return
    vols = list(volumes)
    total = disk + sum(size for _, size in vols)
    if total > cap_mib << 20:
        parts = [f"disk {-(-disk // (1 << 20))} MiB"] + [f"volume {n} {-(-s // (1 << 20))} MiB" for n, s in vols]
        raise ResourceExhausted(
            f"one sandbox's disks may take at most {cap_mib} MiB (--max-sandbox-disk); "
            f"this one's would take {-(-total // (1 << 20))} MiB: {', '.join(parts)}"
        )


def host_memory_mib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError):
        pass
    return 1 << 20


def short_of_space(exc: BaseException, path: Path) -> bool:
    """Did a capture writing under ``path`` fail for want of space? Its error says so
    (ENOSPC or EDQUOT, or QEMU's words for them), or gives no reason (QEMU 7.2 ends a
    migration whose last flush failed with none) while the filesystem has less than
    :data:`CAPTURE_MARGIN_MIB` free."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    if os.strerror(errno.ENOSPC) in text or os.strerror(errno.EDQUOT) in text:
        return True
    return free_mib(path) < CAPTURE_MARGIN_MIB


def free_mib(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 30
    return st.f_bavail * st.f_frsize >> 20


def _usage_mib(root: Path) -> int:
    """Allocated MiB under ``root`` (not following links: the image cache is a link in tests)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total >> 20


class Admission:
    def __init__(self, quotas: Quotas, state_dir: Path, memory_dir: Path | None) -> None:
        self.quotas = quotas
        self.state_dir = state_dir
        self.memory_dir = memory_dir
        self.max_memory_mib = quotas.max_memory_mib or max(256, host_memory_mib() - 1024)
        self.disk_mib = 0  # the last measurement of the state dir's use
        self._measured = -DISK_SCAN_INTERVAL

    async def measure(self) -> int:
        """The state dir's use now (a scan in a worker thread), at most every interval."""
        if self.quotas.max_disk_mib and time.monotonic() - self._measured >= DISK_SCAN_INTERVAL:
            self._measured = time.monotonic()
            self.disk_mib = await trio.to_thread.run_sync(_usage_mib, self.state_dir)
        return self.disk_mib

    def check(self, live_memory_mib: Iterable[int], memory_mib: int, *, ram_file: bool, disk: bool = True) -> None:
        """May one more sandbox of ``memory_mib`` run beside the live ones?"""
        live = list(live_memory_mib)
        q = self.quotas
        if len(live) + 1 > q.max_sandboxes:
            raise ResourceExhausted(
                f"at most {q.max_sandboxes} sandboxes may run at once (warm pool members included; --max-sandboxes)"
            )
        if sum(live) + memory_mib > self.max_memory_mib:
            raise ResourceExhausted(
                f"guest memory would reach {sum(live) + memory_mib} MiB; the limit is {self.max_memory_mib} MiB "
                "(--max-memory)"
            )
        if ram_file and self.memory_dir is not None and free_mib(self.memory_dir) < memory_mib:
            raise ResourceExhausted(
                f"the RAM dir {self.memory_dir} has {free_mib(self.memory_dir)} MiB free; the guest needs {memory_mib}"
            )
        if disk:
            self.check_disk()

    def check_capture(self, what: str, memory_mib: int) -> None:
        """Room on the state dir's filesystem for a capture of a guest of ``memory_mib``
        (a checkpoint, a pause: all its RAM may go to a file there) beyond what the
        supervisor keeps free; RESOURCE_EXHAUSTED before anything is stopped, else none."""
        self.check_disk()
        need = memory_mib + CAPTURE_MARGIN_MIB + self.quotas.min_free_mib
        free = free_mib(self.state_dir)
        if free < need:
            raise ResourceExhausted(
                f"{what} needs up to {need} MiB free on the state dir's filesystem; it has {free} MiB"
            )

    def check_disk(self) -> None:
        q = self.quotas
        if q.max_disk_mib and self.disk_mib >= q.max_disk_mib:
            raise ResourceExhausted(
                f"the state dir uses {self.disk_mib} MiB; the limit is {q.max_disk_mib} MiB (--max-disk)"
            )
        free = free_mib(self.state_dir)
        if free < q.min_free_mib:
            raise ResourceExhausted(
                f"the state dir's filesystem has {free} MiB free; the supervisor keeps {q.min_free_mib} MiB"
            )


def start_slots() -> int:
    """VMs that may come up at once by default: one per core (a TCG boot keeps one core
    busy from QEMU's launch to the hello), at least two."""
    return max(2, os.cpu_count() or 2)


def gated(launch: Launcher, slots: trio.CapacityLimiter) -> Launcher:
    """``launch`` (booted_guest), but a VM is brought up only with one of ``slots``
    held, from QEMU's launch to the guest's hello; the slot is free again while the
    VM serves. Adopting a running QEMU takes no slot. Admitted starts beyond the
    slots wait their turn, their boot deadlines not yet running.

    Why: 16 boots at once on 2 cores all ran out of their 60 s boot timeout (each
    got 1/8 of a core; measured, benchmarks/burst.py), and one template restore
    timing out under such load dropped the template for every later Create. Queued,
    the same work finishes, and each start takes what it takes alone."""

    @asynccontextmanager
    async def gated_launch(spec: VmSpec, at: Attach) -> AsyncIterator[Guest]:
        if at.adopt is not None:
            async with launch(spec, at) as guest:
                yield guest
            return
        async with AsyncExitStack() as stack:
            async with slots:
                guest = await stack.enter_async_context(launch(spec, at))
            yield guest

    return gated_launch
