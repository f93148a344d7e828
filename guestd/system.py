"""Machine-wide requests: the clock, the hostname, the kernel's entropy, metrics."""

from __future__ import annotations

import fcntl
import os
import struct
import time

from guestd import proto
from guestd.common import read_text

RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207


def set_clock(ns: int) -> None:
    time.clock_settime_ns(time.CLOCK_REALTIME, ns)


def set_hostname(name: str) -> None:
    if not name or len(name) > 64:
        raise LookupError("hostname must be 1-64 characters")
    with open("/proc/sys/kernel/hostname", "w") as f:
        f.write(name)


def add_entropy(data: bytes) -> None:
    if len(data) > 4096:
        raise LookupError("at most 4096 bytes of entropy at once")
    buf = struct.pack("ii", len(data) * 8, len(data)) + data
    fd = os.open("/dev/urandom", os.O_WRONLY)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, buf)
        # credited entropy alone does not rekey a CRNG that is already seeded: after a
        # restore, clones of one snapshot would read the same /dev/urandom stream
        # until the next scheduled reseed (up to a minute). Reseed now.
        try:
            fcntl.ioctl(fd, RNDRESEEDCRNG)
        except OSError:
            pass  # ENODATA: not seeded yet (then it will seed from the pool anyway)
    finally:
        os.close(fd)


def metrics(rid: int) -> proto.MetricsOk:
    hz = os.sysconf("SC_CLK_TCK")
    cpu: dict[str, float] = {}
    ncpu = 0
    procs = 0
    for line in read_text("/proc/stat").splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
            cpu = {n: int(v) / hz for n, v in zip(names, parts[1:9], strict=False)}
        elif parts and parts[0].startswith("cpu"):
            ncpu += 1
        elif parts and parts[0] == "processes":
            procs = int(parts[1])
    mem: dict[str, int] = {}
    keys = {
        "MemTotal": "total",
        "MemAvailable": "available",
        "MemFree": "free",
        "Buffers": "buffers",
        "Cached": "cached",
    }
    for line in read_text("/proc/meminfo").splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            mem[keys[k]] = int(v.split()[0]) * 1024
    disk = {"read_bytes": 0, "write_bytes": 0, "reads": 0, "writes": 0}
    for line in read_text("/proc/diskstats").splitlines():
        f = line.split()
        if len(f) >= 10 and f[2].startswith("vd") and not f[2][-1].isdigit():
            disk["reads"] += int(f[3])
            disk["read_bytes"] += int(f[5]) * 512
            disk["writes"] += int(f[7])
            disk["write_bytes"] += int(f[9]) * 512
    try:  # the root file system: used, and free for unprivileged writers (as df shows them)
        st = os.statvfs("/")
        disk["root_used_bytes"] = (st.f_blocks - st.f_bfree) * st.f_frsize
        disk["root_free_bytes"] = st.f_bavail * st.f_frsize
    except OSError:
        pass
    net = {"rx_bytes": 0, "tx_bytes": 0, "rx_packets": 0, "tx_packets": 0}
    for line in read_text("/proc/net/dev").splitlines()[2:]:
        name, _, rest = line.partition(":")
        f = rest.split()
        if name.strip() != "lo" and len(f) >= 10:
            net["rx_bytes"] += int(f[0])
            net["rx_packets"] += int(f[1])
            net["tx_bytes"] += int(f[8])
            net["tx_packets"] += int(f[9])
    up = read_text("/proc/uptime").split()
    vmstat = read_text("/proc/vmstat")
    at = vmstat.find("\noom_kill ")
    oom_kills = int(vmstat[at + 10 :].split("\n", 1)[0]) if at >= 0 else 0
    return proto.MetricsOk(
        rid=rid,
        uptime=float(up[0]) if up else 0.0,
        cpu_seconds=cpu,
        ncpu=ncpu,
        mem=mem,
        disk=disk,
        net=net,
        load=read_text("/proc/loadavg").split()[:3],
        procs=procs,
        oom_kills=oom_kills,
    )


CPU_DIR = "/sys/devices/system/cpu"
EXT4_IOC_RESIZE_FS = 0x40086610  # _IOW('f', 16, __u64)


def set_cpus(online: int) -> int:
    """vCPUs 0..online-1 online, the others offline; how many are online after. CPU 0
    cannot go offline; a CPU without an ``online`` file (not hotpluggable) stays."""
    present = _cpu_range(read_text(f"{CPU_DIR}/present"))
    if online < 1:
        raise LookupError("set_cpus: at least one CPU stays online")
    for n in sorted(present, reverse=True):  # offline from the top, online from the bottom
        if n >= online:
            _cpu_online(n, False)
    for n in sorted(present):
        if 0 < n < online:
            _cpu_online(n, True)
    return len(_cpu_range(read_text(f"{CPU_DIR}/online")))


def _cpu_online(n: int, on: bool) -> None:
    path = f"{CPU_DIR}/cpu{n}/online"
    want = "1" if on else "0"
    if not os.path.exists(path) or read_text(path).strip() == want:
        return
    with open(path, "w") as f:
        f.write(want)


def _cpu_range(text: str) -> set[int]:
    """A kernel CPU list (``0-3,5``) as a set."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def grow_root(device: str) -> int:
    """The root ext4 filesystem grown online to ``device``'s size (/dev/vda: its size
    from sysfs); its size in bytes after. A filesystem as big as its device stays."""
    name = device.rsplit("/", 1)[-1]
    sectors = read_text(f"/sys/class/block/{name}/size").strip()
    if not sectors.isdigit():
        raise LookupError(f"grow_root: no block device {device}")
    bsize = os.statvfs("/").f_bsize
    blocks = int(sectors) * 512 // bsize
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_RESIZE_FS, struct.pack("Q", blocks))
    finally:
        os.close(fd)
    st = os.statvfs("/")
    return st.f_blocks * st.f_frsize
