"""A cgroup per QEMU under a ``sandvisor`` parent: memory, pids and CPU limits, usage,
and "killed by its memory limit". cgroup v2 where the host's unified hierarchy has the
controllers; v1 (memory, pids, cpu, cpuacct mounted under /sys/fs/cgroup/<ctrl>/)
where it does not. One interface for both::

    manager = detect()                         # None: no usable cgroup controllers (serve refuses)
    cg = manager.create("sbx-1a2b", CgroupLimits.for_guest(memory_mib=256, vcpus=1))
    proc = await jail.spawn(argv, spec, cgroup_procs=cg.procs_files())   # joins before exec
    ... await proc.wait()
    if cg.oom_kills(): ...                     # SIGKILLed by the memory limit
    cg.remove()                                # after the reap

The process joins its cgroup itself, before it execs (``jail.spawn`` writes "0" to each
``cgroup.procs``): no allocation of QEMU's is ever outside the limit.

Memory is charged to the cgroup of whoever first touches a page: a guest's RAM file
(tmpfs, share=on) is QEMU's; a restore's pages shared with the snapshot (a sealed memfd
the supervisor filled, see actors/cells/guestmem.py) stay the supervisor's, only the pages the
guest writes (copy-on-write) are QEMU's. Swap is capped at 0 (memsw = memory in v1,
memory.swap.max = 0 in v2): a guest cannot grow past its limit into swap.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import logging
import os
import re
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from actors.defaults import JAIL_CPU_HEADROOM, JAIL_OVERHEAD_MIB

log = logging.getLogger("sandvisor.cgroups")

MIB = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
CPU_PERIOD_US = 100_000
V1_SHARES = (2, 1024, 262144)  # cpu.shares: the kernel's min, default, max
V2_WEIGHT = (1, 100, 10000)  # cpu.weight: min, default, max


class CgroupError(Exception):
    """A cgroup could not be made, limited, read or removed."""


@attrs.frozen
class CgroupLimits:
    memory_bytes: int | None = None  # RAM + page cache + kernel memory of the process
    pids: int | None = None  # processes and threads
    cpus: float | None = None  # CPU time, in CPUs (quota = cpus x period): the ceiling
    cpu_weight: int | None = None  # share under contention, 100 = one vCPU's (v2 cpu.weight; v1 cpu.shares x 10.24)
    swap_bytes: int = 0  # swap on top of memory

    @classmethod
    def for_guest(
        cls,
        memory_mib: int,
        vcpus: int,
        *,
        overhead_mib: int = JAIL_OVERHEAD_MIB,
        pids: int = 256,
        cpu_headroom: float = JAIL_CPU_HEADROOM,
    ) -> CgroupLimits:
        """Guest RAM + ``overhead_mib``: QEMU itself, the TCG translation cache up to its
        ``tb-size`` (bound it: 1 GiB by default), page cache of the disk layers (reclaim
        evicts it under the limit). Measured, 256 MiB guests busy 4 minutes spawning
        processes: cgroup peak 237 MiB with tb-size=64, 165 MiB with 32, 1343 MiB with
        the default. CPU: vCPUs + ``cpu_headroom`` as the ceiling (QEMU's main loop,
        which moves every byte of virtio-serial and disk I/O, runs beside the vCPU
        threads: with the quota at exactly the vCPUs a 64 MiB file write throttled to
        half its speed), and a weight by vCPUs so that under contention sandboxes share
        the host's CPUs in proportion to their size, not to their headroom."""
        return cls(
            memory_bytes=(memory_mib + overhead_mib) * MIB,
            pids=pids,
            cpus=vcpus + cpu_headroom,
            cpu_weight=100 * vcpus,
        )


@attrs.frozen
class CgroupStats:
    memory_bytes: int
    memory_limit: int | None
    memory_peak: int | None
    oom_kills: int
    pids: int
    pids_limit: int | None
    cpu_usage_ns: int | None
    cpu_limit: float | None  # CPUs (quota / period)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise CgroupError(f"cannot read {path}: {exc.strerror}") from None


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror}") from None


def _keyed(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _limit(text: str) -> int | None:
    v = text.strip()
    if v == "max":
        return None
    n = int(v)
    return None if n >= 1 << 62 else n  # v1 "unlimited" is 0x7FFFFFFFFFFFF000


def _rmdir(path: Path) -> None:
    # after the reap, the kernel can take a moment to let go of the exiting task
    for attempt in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or attempt == 49:
                raise CgroupError(f"cannot remove cgroup {path}: {exc.strerror}") from None
            time.sleep(0.002)


def _shares(weight: int) -> int:
    """v1 cpu.shares of a weight (100 = one vCPU's = the default share, 1024)."""
    low, default, high = V1_SHARES
    return max(low, min(high, weight * default // V2_WEIGHT[1]))


def _weight(weight: int) -> int:
    low, _, high = V2_WEIGHT
    return max(low, min(high, weight))


def check_name(name: str) -> None:
    if not _NAME.match(name):
        raise CgroupError(f"bad cgroup name {name!r} (letters, digits, '.', '_', '-'; at most 64)")


class Cgroup(abc.ABC):
    """One QEMU's cgroup (in each v1 controller hierarchy, or one v2 directory)."""

    version: int

    def __init__(self, name: str, dirs: tuple[Path, ...], reweigh: Callable[[], None] | None = None) -> None:
        self.name = name
        self.dirs = tuple(dict.fromkeys(dirs))  # co-mounted v1 controllers share a directory
        self.reweigh = reweigh or (lambda: None)  # the manager's: the parent's CPU weight follows ours

    def procs_files(self) -> tuple[Path, ...]:
        """The ``cgroup.procs`` files a process writes "0" to, to join."""
        return tuple(d / "cgroup.procs" for d in self.dirs)

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(CgroupError):
                out |= {int(x) for x in _read(d / "cgroup.procs").split()}
        return out

    def kill_all(self) -> None:
        """SIGKILL every process in the cgroup (an orphan after a crash)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    @abc.abstractmethod
    def oom_kills(self) -> int:
        """How many processes the memory limit killed."""

    @abc.abstractmethod
    def stats(self) -> CgroupStats: ...

    def set_cpu(self, limits: CgroupLimits) -> None:
        """``limits``' CPU ceiling and weight, now (Modify: enforced at once; no cpu
        controller: nothing); the parent's weight follows."""
        self._set_cpu(limits)
        self.reweigh()

    @abc.abstractmethod
    def _set_cpu(self, limits: CgroupLimits) -> None: ...

    def remove(self) -> None:
        """rmdir (after every process in it is reaped); the parent's weight follows."""
        try:
            for d in self.dirs:
                _rmdir(d)
        finally:
            self.reweigh()


class CgroupManager(abc.ABC):
    """The ``sandvisor`` parent and the cgroups under it."""

    version: int

    def __init__(self, parent: str) -> None:
        for part in parent.split("/"):
            check_name(part)
        self.parent = parent
        self._weighing = threading.Lock()  # (cells are closed from worker threads too)

    def reweigh(self) -> None:
        """The parent's CPU weight := the sum of its children's, within the kernel's
        bounds (none left: the default). Under contention the parent's siblings (the
        host's other tasks and cgroups) then meet our sandboxes as if each were a task of
        its own weight, not all of them together as one ordinary task (v1, three sandboxes
        writing at load 11.7: 6.6 MiB/s each under the default 1024, 9.9 under the sum;
        benchmarks/cgroup_weight.py). Called when a child is made, removed or its CPU changed; best effort: a
        failure is logged, never raised (the children's own limits stand)."""
        found = self._weight_files()
        if found is None:
            return
        parent, name, (low, default, high) = found
        with self._weighing:
            try:
                if not parent.is_dir():  # (gone with the last child: remove_parent)
                    return
                total = 0
                for child in parent.iterdir():
                    if not child.is_dir():
                        continue
                    try:
                        total += int(_read(child / name))
                    except (CgroupError, ValueError):
                        total += default if child.is_dir() else 0  # (one going away meanwhile: none)
                _write(parent / name, str(max(low, min(high, total)) if total else default))
            except (CgroupError, OSError) as exc:
                log.warning("cgroup %s: CPU weight not set: %s", parent, exc)

    def _weight_files(self) -> tuple[Path, str, tuple[int, int, int]] | None:
        """(the parent's directory in the cpu hierarchy, the weight file's name, the
        kernel's bounds); None: no cpu controller."""
        return None

    @abc.abstractmethod
    def create(self, name: str, limits: CgroupLimits) -> Cgroup:
        """A new cgroup with ``limits`` (one left by a crash under that name is reused
        if empty, refused if it holds a process)."""

    @abc.abstractmethod
    def open(self, name: str) -> Cgroup:
        """An existing cgroup (after a supervisor restart)."""

    @abc.abstractmethod
    def names(self) -> set[str]:
        """The cgroups under the parent."""

    @abc.abstractmethod
    def parent_dirs(self) -> tuple[Path, ...]:
        """The parent's directory in each hierarchy."""

    def remove_parent(self) -> bool:
        """rmdir the parent in every hierarchy when no cgroup is left under it
        (supervisor exit); False when one is. A hierarchy whose parent cannot go does
        not keep the others': each is tried, then CgroupError names the ones left."""
        if self.names():
            return False
        errors = []
        for d in self.parent_dirs():
            try:
                _rmdir(d)
            except CgroupError as exc:
                errors.append(str(exc))
        if errors:
            raise CgroupError("; ".join(errors))
        return True

    def remove_empty(self) -> bool:
        """At supervisor exit: every cgroup under the parent that holds no process (one
        whose removal failed when its cell closed: a process of it not yet reaped keeps a
        cgroup busy while ``cgroup.procs`` no longer lists it), then the parent in every
        hierarchy. False when a cgroup holds a process (--keep-sandboxes: it stays, and
        the parent with it)."""
        return not self.collect(keep=set()) and self.remove_parent()

    def collect(self, keep: set[str]) -> dict[str, set[int]]:
        """Remove empty cgroups not in ``keep`` (left by a crash); returns the ones
        that still hold processes (an unrecorded QEMU: the caller decides)."""
        busy: dict[str, set[int]] = {}
        for name in self.names() - keep:
            cg = self.open(name)
            pids = cg.pids()
            if pids:
                busy[name] = pids
            else:
                with contextlib.suppress(CgroupError):
                    cg.remove()
        return busy


# -- v1 -------------------------------------------------------------------------------------


class CgroupV1(Cgroup):
    version = 1

    def __init__(self, name: str, ctrl: dict[str, Path], reweigh: Callable[[], None] | None = None) -> None:
        super().__init__(name, tuple(ctrl.values()), reweigh)
        self.ctrl = ctrl

    def oom_kills(self) -> int:
        mem = self.ctrl.get("memory")
        if mem is None:
            return 0
        return _keyed(_read(mem / "memory.oom_control")).get("oom_kill", 0)

    def stats(self) -> CgroupStats:
        mem = self.ctrl.get("memory")
        pids = self.ctrl.get("pids")
        acct = self.ctrl.get("cpuacct")
        return CgroupStats(
            memory_bytes=int(_read(mem / "memory.usage_in_bytes")) if mem else 0,
            memory_limit=_limit(_read(mem / "memory.limit_in_bytes")) if mem else None,
            memory_peak=int(_read(mem / "memory.max_usage_in_bytes")) if mem else None,
            oom_kills=self.oom_kills(),
            pids=int(_read(pids / "pids.current")) if pids else 0,
            pids_limit=_limit(_read(pids / "pids.max")) if pids else None,
            cpu_usage_ns=int(_read(acct / "cpuacct.usage")) if acct else None,
            cpu_limit=self._cpu_limit(),
        )

    def _set_cpu(self, limits: CgroupLimits) -> None:
        cpu = self.ctrl.get("cpu")
        if cpu is None:
            return
        if limits.cpus is not None:
            _write(cpu / "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * CPU_PERIOD_US))))
        if limits.cpu_weight is not None:
            _write(cpu / "cpu.shares", str(_shares(limits.cpu_weight)))

    def _cpu_limit(self) -> float | None:
        cpu = self.ctrl.get("cpu")
        if cpu is None:
            return None
        quota = int(_read(cpu / "cpu.cfs_quota_us"))
        return None if quota < 0 else quota / int(_read(cpu / "cpu.cfs_period_us"))


class CgroupV1Manager(CgroupManager):
    """``mounts``: controller -> its hierarchy's mount point (memory, pids, cpu, and
    cpuacct for usage; co-mounted ones like cpu,cpuacct share a path)."""

    version = 1
    CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")

    def __init__(self, mounts: dict[str, Path], parent: str = "sandvisor") -> None:
        super().__init__(parent)
        self.mounts = {c: p for c, p in mounts.items() if c in self.CONTROLLERS}
        missing = {"memory", "pids"} - set(self.mounts)
        if missing:
            raise CgroupError(f"cgroup v1 lacks the {', '.join(sorted(missing))} controller")

    def _dirs(self, name: str) -> dict[str, Path]:
        check_name(name)
        return {c: m / self.parent / name for c, m in self.mounts.items()}

    def create(self, name: str, limits: CgroupLimits) -> Cgroup:
        dirs = self._dirs(name)
        made: list[Path] = []
        try:
            for d in dict.fromkeys(dirs.values()):
                d.parent.mkdir(mode=0o755, exist_ok=True)
                try:
                    d.mkdir(mode=0o755)
                    made.append(d)
                except FileExistsError:
                    if _read(d / "cgroup.procs").split():
                        raise CgroupError(f"cgroup {d} exists and holds processes") from None
            cg = CgroupV1(name, dirs, self.reweigh)
            self._limit(cg, limits)
        except BaseException:
            for d in made:
                with contextlib.suppress(CgroupError):
                    _rmdir(d)
            raise
        self.reweigh()
        return cg

    def _limit(self, cg: CgroupV1, limits: CgroupLimits) -> None:
        mem = cg.ctrl["memory"]
        if limits.memory_bytes is not None:
            _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
            memsw = mem / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # swap accounting on: memory + swap <= memory + swap_bytes
                _write(memsw, str(limits.memory_bytes + limits.swap_bytes))
        if limits.pids is not None:
            _write(cg.ctrl["pids"] / "pids.max", str(limits.pids))
        cpu = cg.ctrl.get("cpu")
        if limits.cpus is not None and cpu is not None:
            _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * CPU_PERIOD_US))))
        if limits.cpu_weight is not None and cpu is not None:  # v1's default share 1024 = weight 100
            _write(cpu / "cpu.shares", str(_shares(limits.cpu_weight)))

    def open(self, name: str) -> Cgroup:
        dirs = self._dirs(name)
        if not dirs["memory"].is_dir():
            raise CgroupError(f"no cgroup {name}")
        return CgroupV1(name, dirs, self.reweigh)

    def _weight_files(self) -> tuple[Path, str, tuple[int, int, int]] | None:
        cpu = self.mounts.get("cpu")
        return None if cpu is None else (cpu / self.parent, "cpu.shares", V1_SHARES)

    def parent_dirs(self) -> tuple[Path, ...]:
        return tuple(dict.fromkeys(m / self.parent for m in self.mounts.values()))

    def names(self) -> set[str]:
        base = self.mounts["memory"] / self.parent
        if not base.is_dir():
            return set()
        return {p.name for p in base.iterdir() if p.is_dir()}


# -- v2 -------------------------------------------------------------------------------------


class CgroupV2(Cgroup):
    version = 2

    def __init__(self, name: str, path: Path, reweigh: Callable[[], None] | None = None) -> None:
        super().__init__(name, (path,), reweigh)
        self.path = path

    def oom_kills(self) -> int:
        return _keyed(_read(self.path / "memory.events")).get("oom_kill", 0)

    def stats(self) -> CgroupStats:
        p = self.path
        peak = p / "memory.peak"  # 5.19+
        cpu = _keyed(_read(p / "cpu.stat")) if (p / "cpu.stat").exists() else {}
        return CgroupStats(
            memory_bytes=int(_read(p / "memory.current")),
            memory_limit=_limit(_read(p / "memory.max")),
            memory_peak=int(_read(peak)) if peak.exists() else None,
            oom_kills=self.oom_kills(),
            pids=int(_read(p / "pids.current")),
            pids_limit=_limit(_read(p / "pids.max")),
            cpu_usage_ns=cpu["usage_usec"] * 1000 if "usage_usec" in cpu else None,
            cpu_limit=self._cpu_limit(),
        )

    def _set_cpu(self, limits: CgroupLimits) -> None:
        if limits.cpus is not None and (self.path / "cpu.max").exists():
            _write(self.path / "cpu.max", f"{max(1000, int(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
        if limits.cpu_weight is not None and (self.path / "cpu.weight").exists():
            _write(self.path / "cpu.weight", str(_weight(limits.cpu_weight)))

    def _cpu_limit(self) -> float | None:
        f = self.path / "cpu.max"
        if not f.exists():
            return None
        quota, _, period = _read(f).strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or CPU_PERIOD_US)

    def kill_all(self) -> None:
        kill = self.path / "cgroup.kill"  # 5.14+: atomic, no pid races
        if kill.exists():
            _write(kill, "1")
        else:
            super().kill_all()


class CgroupV2Manager(CgroupManager):
    """``root``: the cgroup2 mount. The parent gets memory, pids and cpu enabled for its
    children (every level above too; the parent itself must hold no process)."""

    version = 2
    WANTED = ("memory", "pids", "cpu")

    def __init__(self, root: Path, parent: str = "sandvisor") -> None:
        super().__init__(parent)
        self.root = root
        have = set(_read(root / "cgroup.controllers").split())
        missing = {"memory", "pids"} - have
        if missing:
            raise CgroupError(f"cgroup v2 at {root} lacks the {', '.join(sorted(missing))} controller")
        self.controllers = [c for c in self.WANTED if c in have]
        self._ready = False

    @property
    def base(self) -> Path:
        return self.root / self.parent

    def _prepare(self) -> None:
        if self._ready:
            return
        want = " ".join(f"+{c}" for c in self.controllers)
        d = self.root
        for part in self.parent.split("/"):
            enabled = set(_read(d / "cgroup.subtree_control").split())
            if not set(self.controllers) <= enabled:
                _write(d / "cgroup.subtree_control", want)
            d = d / part
            d.mkdir(mode=0o755, exist_ok=True)
        enabled = set(_read(d / "cgroup.subtree_control").split())
        if not set(self.controllers) <= enabled:
            _write(d / "cgroup.subtree_control", want)
        self._ready = True

    def create(self, name: str, limits: CgroupLimits) -> Cgroup:
        check_name(name)
        self._prepare()
        path = self.base / name
        made = False
        try:
            try:
                path.mkdir(mode=0o755)
                made = True
            except FileExistsError:
                if _read(path / "cgroup.procs").split():
                    raise CgroupError(f"cgroup {path} exists and holds processes") from None
            if limits.memory_bytes is not None:
                _write(path / "memory.max", str(limits.memory_bytes))
                if (path / "memory.swap.max").exists():
                    _write(path / "memory.swap.max", str(limits.swap_bytes))
            if (path / "memory.oom.group").exists():
                _write(path / "memory.oom.group", "1")
            if limits.pids is not None:
                _write(path / "pids.max", str(limits.pids))
            if limits.cpus is not None and "cpu" in self.controllers:
                _write(path / "cpu.max", f"{max(1000, int(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
            if limits.cpu_weight is not None and "cpu" in self.controllers:
                _write(path / "cpu.weight", str(_weight(limits.cpu_weight)))
        except BaseException:
            if made:
                with contextlib.suppress(CgroupError):
                    _rmdir(path)
            raise
        self.reweigh()
        return CgroupV2(name, path, self.reweigh)

    def open(self, name: str) -> Cgroup:
        check_name(name)
        path = self.base / name
        if not path.is_dir():
            raise CgroupError(f"no cgroup {name}")
        return CgroupV2(name, path, self.reweigh)

    def _weight_files(self) -> tuple[Path, str, tuple[int, int, int]] | None:
        # the parent is ours (made by _prepare, cpu enabled for its children by us); the
        # levels above it are not: their weights are left alone
        return (self.base, "cpu.weight", V2_WEIGHT) if "cpu" in self.controllers else None

    def parent_dirs(self) -> tuple[Path, ...]:
        return (self.base,)

    def names(self) -> set[str]:
        if not self.base.is_dir():
            return set()
        return {p.name for p in self.base.iterdir() if p.is_dir()}


# -- detection --------------------------------------------------------------------------------


def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def cgroup_mounts(mountinfo: str) -> tuple[Path | None, dict[str, Path]]:
    """(the cgroup2 mount, {v1 controller: mount}) from /proc/self/mountinfo text."""
    v2: Path | None = None
    v1: dict[str, Path] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        mp = Path(_unescape(fields[4]))
        if rest[0] == "cgroup2" and v2 is None:
            v2 = mp
        elif rest[0] == "cgroup":
            for opt in rest[2].split(","):
                if opt in CgroupV1Manager.CONTROLLERS:
                    v1.setdefault(opt, mp)
    return v2, v1


def detect(parent: str = "sandvisor", mountinfo: str | None = None) -> CgroupManager | None:
    """v2 when the unified hierarchy has memory and pids, else v1 when memory and pids
    are mounted, else None (no limits: serve refuses, or warns when told to run without)."""
    if mountinfo is None:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    v2, v1 = cgroup_mounts(mountinfo)
    if v2 is not None:
        with contextlib.suppress(CgroupError, OSError):
            return CgroupV2Manager(v2, parent)
    if v1:
        with contextlib.suppress(CgroupError):
            return CgroupV1Manager(v1, parent)
    return None


def hierarchy_mounts(proc_cgroup: str) -> list[tuple[str, str]]:
    """(filesystem type, controllers) of each hierarchy this process is in that detect()
    can use, from /proc/self/cgroup text: the unified one (``0::/...``), and each v1 one
    with memory, pids, cpu or cpuacct, with its exact controller set (a v1 hierarchy
    mounts again only with the options it has: cpu,cpuacct together)."""
    out: list[tuple[str, str]] = []
    for line in proc_cgroup.splitlines():
        hid, _, rest = line.partition(":")
        ctrls, _, _ = rest.partition(":")
        if hid == "0" and not ctrls:
            out.append(("cgroup2", ""))
        elif ctrls and set(ctrls.split(",")) & set(CgroupV1Manager.CONTROLLERS) and "=" not in ctrls:
            out.append(("cgroup", ctrls))
    return out


def mount_hierarchies(where: Path, proc_cgroup: str | None = None) -> list[Path]:
    """Mount the cgroup hierarchies this process is in under ``where`` (root's, 0700:
    ``where/unified``, ``where/<controllers>``), where none is visible: ``ip netns exec``
    runs its command in a mount namespace of its own whose fresh /sys has an empty
    /sys/fs/cgroup (the mounts stay in that namespace: it is a slave of the host's, and
    they go with it). The kernel's hierarchies are the same ones the host's /sys/fs/cgroup
    shows, so the limits are too. Returns the mount points made (CgroupError: none)."""
    if proc_cgroup is None:
        with open("/proc/self/cgroup") as f:
            proc_cgroup = f.read()
    wanted = hierarchy_mounts(proc_cgroup)
    if not wanted:
        raise CgroupError("this process is in no cgroup hierarchy with memory or pids")
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = where.lstat()
    except OSError as exc:
        raise CgroupError(f"cannot make {where}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise CgroupError(f"{where} is not a 0700 directory of uid {os.geteuid()}: not mounting cgroups there")
    made: list[Path] = []
    errors: list[str] = []
    for fstype, ctrls in wanted:
        mp = where / (ctrls or "unified")
        mp.mkdir(mode=0o700, exist_ok=True)
        opts = ",".join(x for x in (ctrls, "nosuid,nodev,noexec") if x)
        argv = ["mount", "-t", fstype, "-o", opts, fstype, str(mp)]
        res = subprocess.run(argv, check=False, capture_output=True, text=True)
        if res.returncode == 0:
            made.append(mp)
        else:
            errors.append(f"{fstype} {ctrls or ''}: {res.stderr.strip() or res.returncode}".strip())
    if not made:
        raise CgroupError("mounting the cgroup hierarchies failed: " + "; ".join(errors))
    return made


MOUNT_DIR = Path("/run/sandvisor-cgroup")  # where mount_hierarchies puts them (root's, 0700)


def find(parent: str, mount_dir: Path | None = None) -> CgroupManager:
    """The hierarchy :func:`detect` finds, else the one :func:`mount_hierarchies` makes
    visible (under ``mount_dir``, default MOUNT_DIR); CgroupError (why) when neither
    gives memory and pids."""
    mount_dir = mount_dir or MOUNT_DIR
    found = detect(parent)
    if found is not None:
        return found
    try:
        mount_hierarchies(mount_dir)
    except CgroupError as exc:
        raise CgroupError(f"no cgroup hierarchy with memory and pids is mounted, and {exc}") from None
    found = detect(parent)
    if found is None:
        raise CgroupError(f"no cgroup hierarchy with memory and pids (mounted what there is under {mount_dir})")
    return found
