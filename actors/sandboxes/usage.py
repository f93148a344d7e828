"""The host's view of a sandbox's QEMU: its resident memory and CPU time (from /proc),
its CPU use between two looks, its cgroup's counters, and the guest's metrics with
all of that beside them (Metrics, the Prometheus exporter, the benchmarks)."""

from __future__ import annotations

import math
import time
from pathlib import Path

from actors.cells.cell import Cell
from actors.cells.cgroups import CgroupError, CgroupStats
from actors.model import SandboxMetrics
from guestd import proto


class CpuMeter:
    """QEMU's CPU use since the previous look (one per life: the first look counts from
    when the VM started)."""

    def __init__(self) -> None:
        self._prev: tuple[float, float] | None = None

    def percent(self, pid: int) -> float:
        now, cpu = time.monotonic(), proc_cpu_seconds(pid)
        prev = self._prev
        self._prev = (now, cpu)
        if prev is None or now <= prev[0]:
            return 0.0
        pct = 100.0 * (cpu - prev[1]) / (now - prev[0])
        return 0.0 if math.isnan(pct) else max(0.0, pct)


def cgroup_stats(cell: Cell | None) -> CgroupStats | None:
    """The counters of a life's cgroup (None: it has none, or it is gone)."""
    if cell is None or cell.cgroup is None:
        return None
    try:
        return cell.cgroup.stats()
    except (CgroupError, OSError):
        return None


def sandbox_metrics(
    m: proto.MetricsOk, id: str, pid: int, cell: Cell | None, cpu: CpuMeter, disk: Path
) -> SandboxMetrics:
    """The guest's ``m`` with the host's view of its QEMU (``pid``), cgroup and root disk
    (``disk``: its writable layer)."""
    cg = cgroup_stats(cell)
    shared, own = proc_memory_split(pid)
    return SandboxMetrics(
        cgroup_memory_bytes=cg.memory_bytes if cg is not None else 0,
        cgroup_memory_limit_bytes=(cg.memory_limit or 0) if cg is not None else 0,
        cgroup_oom_kills=cg.oom_kills if cg is not None else 0,
        id=id,
        timestamp=time.time_ns(),
        cpu_percent=round(cpu.percent(pid), 2),
        memory_total_bytes=int(m.mem.get("total", 0)),
        memory_available_bytes=int(m.mem.get("available", 0)),
        host_rss_bytes=proc_rss(pid),
        disk_read_bytes=int(m.disk.get("read_bytes", 0)),
        disk_write_bytes=int(m.disk.get("write_bytes", 0)),
        net_rx_bytes=int(m.net.get("rx_bytes", 0)),
        net_tx_bytes=int(m.net.get("tx_bytes", 0)),
        uptime_seconds=float(m.uptime),
        root_used_bytes=_guest_count(m.disk.get("root_used_bytes", 0)),
        root_free_bytes=_guest_count(m.disk.get("root_free_bytes", 0)),
        root_host_allocated_bytes=allocated_bytes(disk),
        memory_shared_bytes=shared,
        memory_own_bytes=own,
        guest_oom_kills=_guest_count(m.oom_kills),
    )


def _guest_count(v: object) -> int:
    """A byte count the guest reported: an int in 0..2**63-1, else 0 (its word only)."""
    return v if isinstance(v, int) and 0 <= v < 1 << 63 else 0


def allocated_bytes(path: Path) -> int:
    """What a (sparse) file takes on the host's disk (0: none there)."""
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def proc_rss(pid: int) -> int:
    """A process's resident set, in bytes (0: no such process)."""
    if not pid:
        return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class MemorySplit:
    """:func:`proc_memory_split` of one QEMU, read at most every ``MAX_AGE`` seconds:
    the kernel walks every page table of the process to answer (milliseconds for a
    guest of some size), too dear for every Inspect."""

    MAX_AGE = 2.0

    def __init__(self) -> None:
        self._pid = 0
        self._at = 0.0
        self._value = (0, 0)

    def read(self, pid: int) -> tuple[int, int]:
        now = time.monotonic()
        if pid != self._pid or now - self._at > self.MAX_AGE:
            self._pid, self._at, self._value = pid, now, proc_memory_split(pid)
        return self._value


def proc_memory_split(pid: int) -> tuple[int, int]:
    """A process's resident memory as the host's page tables count it, in bytes: (shared
    with other processes -- a fork's family mapping one memory file --, its own private
    pages) from /proc/PID/smaps_rollup; (0, 0): no such process, or not readable."""
    if not pid:
        return 0, 0
    shared = own = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Shared_Clean", "Shared_Dirty"):
                shared += int(rest.split()[0]) * 1024
            elif key in ("Private_Clean", "Private_Dirty"):
                own += int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return shared, own


def proc_cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds (0: no such process)."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / 100.0
    except (OSError, ValueError, IndexError):
        return 0.0
