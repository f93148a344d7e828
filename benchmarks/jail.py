"""What the jail costs (issue 12: at most 10% on create and restore), in one run,
jailed and plain interleaved so machine load hits both alike. Medians.

* spawn: spawn-to-exit of /usr/bin/true: plain ``trio.lowlevel.open_process`` as an
  unprivileged user (today's Machine.run) against ``jail.spawn`` (new netns / host
  netns / + cgroup join), and a whole jail life (build dir, cgroup, spawn, reap,
  remove both); optionally with ``--ballast-mib`` of heap (fork copies page tables);
* qemu-spawn: QEMU spawn to QMP ready, plain Machine against JailedMachine;
* boot: boot to guestd's hello, booted_guest (QEMU as nobody, RAM file in /dev/shm)
  against jailed_guest (jail + cgroup + tb-size 64 + RAM file in a private dir);
* restore: restore to hello from one mapped snapshot: today's (the snapshot file
  chowned to QEMU's user, mapped private) against jailed (a sealed memfd from the
  cache: filled once, fill time reported apart);
* share: PSS of 3 concurrent jailed restores of one snapshot (pages of the memfd are
  shared until written);
* tb: QEMU RSS and cgroup peak of a busy guest (a loop spawning processes) with TCG's
  default translation cache (1 GiB) and with tb-size 64 and 32.

Usage: python benchmarks/jail.py [-n N] [--busy-s S] [--only spawn,boot,...] [--out results/]
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from jailed import JailedMachine, JailOptions, OverlayFiles, jailed_guest

from actors import cgroups, guestmem, jail
from actors.disk import create_overlay
from actors.machine import Machine, MachineSpec, QemuUser, qmp_loop, unprivileged_user
from actors.snapshot import checkpoint_guest
from actors.vm import VmSpec, booted_guest, kernel_cmdline
from images.build import Image, load_default

MIB = 1 << 20


def allocator() -> jail.IdentityAllocator:
    alloc = jail.IdentityAllocator()
    alloc.adopt_running()  # uids of jailed processes of other runs on this host stay theirs
    return alloc


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def ms(xs: list[float]) -> dict[str, float]:
    return {"median_ms": round(med(xs) * 1000, 2), "min_ms": round(min(xs) * 1000, 2), "n": len(xs)}


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


# -- spawn -----------------------------------------------------------------------------------------


async def bench_spawn(n: int, shm: Path, mgr: cgroups.CgroupManager | None, helper: Path | None) -> dict[str, Any]:
    nobody = pwd.getpwnam("nobody")
    alloc = allocator()
    ident = alloc.allocate("bench")
    spec_new = jail.JailSpec(identity=ident, root=shm / "jail-spawn")
    spec_host = jail.JailSpec(identity=ident, root=shm / "jail-spawn", netns=jail.NetNS.HOST)
    jail.build_jail(spec_new)
    cg = mgr.create("bench-spawn", cgroups.CgroupLimits(memory_bytes=64 * MIB, pids=64)) if mgr else None

    async def plain() -> None:
        p = await trio.lowlevel.open_process(
            ["/usr/bin/true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            user=nobody.pw_uid,
            group=nobody.pw_gid,
            extra_groups=[],
        )
        await p.wait()
        assert p.stderr is not None
        await p.stderr.aclose()

    async def jailed(spec: jail.JailSpec, procs: tuple[Path, ...] = (), via: Path | None = None) -> None:
        p = await jail.spawn(["/usr/bin/true"], spec, cgroup_procs=procs, helper=via)
        rc = await p.wait()
        assert rc == 0, rc
        assert p.stderr is not None
        await p.stderr.aclose()

    async def whole_life(via: Path | None) -> None:
        spec = jail.JailSpec(identity=ident, root=shm / "jail-life")
        jail.build_jail(spec)
        c = mgr.create("bench-life", cgroups.CgroupLimits(memory_bytes=64 * MIB, pids=64)) if mgr else None
        await jailed(spec, c.procs_files() if c else (), via)
        if c is not None:
            c.remove()
        jail.remove_jail(spec.root)

    procs = cg.procs_files() if cg else ()
    variants: dict[str, Callable[[], Awaitable[None]]] = {
        "plain (open_process as nobody)": plain,
        "jail python stage, new netns": lambda: jailed(spec_new),
        "jail python stage, host netns": lambda: jailed(spec_host),
        "jail python stage, new netns + cgroup": lambda: jailed(spec_new, procs),
        "jail python stage, whole life (dir + cgroup + spawn + cleanup)": lambda: whole_life(None),
    }
    if helper is not None:
        variants |= {
            "jail helper, new netns": lambda: jailed(spec_new, via=helper),
            "jail helper, host netns": lambda: jailed(spec_host, via=helper),
            "jail helper, new netns + cgroup": lambda: jailed(spec_new, procs, helper),
            "jail helper, whole life (dir + cgroup + spawn + cleanup)": lambda: whole_life(helper),
        }
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for fn in variants.values():
            await fn()  # warm up
        for _ in range(n):
            for k, fn in variants.items():
                times[k].append(await timed(fn))
    finally:
        if cg is not None:
            cg.remove()
        jail.remove_jail(spec_new.root)
    base = med(times["plain (open_process as nobody)"])
    return {k: {**ms(v), "extra_ms": round((med(v) - base) * 1000, 2)} for k, v in times.items()}


async def bench_qemu_spawn(
    image: Image, n: int, work: Path, shm: Path, user: QemuUser | None, helper: Path | None
) -> dict[str, Any]:
    alloc = allocator()
    spec = MachineSpec(
        kernel=image.kernel, initrd=image.initrd, memory_mib=256, append=kernel_cmdline("tcg", root=False)
    )
    plain_t: list[float] = []
    jail_t: list[float] = []
    jail.make_root_dir(shm / "jail")
    for i in range(n):
        run = work / f"qs{i}"
        run.mkdir()
        m = Machine(attrs.evolve(spec, user=user), run)
        async with trio.open_nursery() as nursery:
            t0 = time.perf_counter()
            await nursery.start(m.run)
            plain_t.append(time.perf_counter() - t0)
            await m.shutdown()
        js = jail.JailSpec(identity=alloc.allocate(f"q{i}"), root=shm / "jail" / f"q{i}")
        jail.build_jail(js)
        jm = JailedMachine(spec, js, tb_size_mib=64, helper=helper)
        async with trio.open_nursery() as nursery:
            t0 = time.perf_counter()
            await nursery.start(jm.run)
            jail_t.append(time.perf_counter() - t0)
            await jm.shutdown()
        jail.remove_jail(js.root)
        shutil.rmtree(run, ignore_errors=True)
    return {"plain": ms(plain_t), "jailed": ms(jail_t), "ratio": round(med(jail_t) / med(plain_t), 3)}


# -- boot and restore ------------------------------------------------------------------------------


async def bench_boot(
    image: Image,
    n: int,
    work: Path,
    shm: Path,
    user: QemuUser | None,
    mgr: cgroups.CgroupManager | None,
    helper: Path | None,
) -> dict[str, Any]:
    alloc = allocator()
    plain_t: list[float] = []
    jail_t: list[float] = []
    for i in range(n):
        d = work / f"boot-plain{i}"
        d.mkdir()
        t0 = time.perf_counter()
        await create_overlay(image.rootfs, d / "disk.qcow2")
        ram = plain_ram(shm / f"plain{i}.ram", 256, user)
        async with booted_guest(VmSpec.boot(image, disk=d / "disk.qcow2", user=user, ram=ram), d):
            plain_t.append(time.perf_counter() - t0)
        ram.unlink()
        shutil.rmtree(d, ignore_errors=True)
        d = work / f"boot-jail{i}"
        d.mkdir()
        ident = alloc.allocate(f"b{i}")
        opts = JailOptions(identity=ident, base=shm, ram_dir=shm / "ram", cgroups=mgr, helper=helper)
        t0 = time.perf_counter()
        async with jailed_guest(image, f"boot{i}", opts, disk_dir=d):
            jail_t.append(time.perf_counter() - t0)
        alloc.release(ident)
        shutil.rmtree(d, ignore_errors=True)
    return {"plain": ms(plain_t), "jailed": ms(jail_t), "ratio": round(med(jail_t) / med(plain_t), 3)}


def plain_ram(path: Path, mib: int, user: QemuUser | None) -> Path:
    """Today's RAM file (SandboxFiles.make_ram): 0600, QEMU's shared user."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.ftruncate(fd, mib << 20)
    if user is not None:
        os.fchown(fd, user.uid, user.gid)
    os.close(fd)
    return path


async def make_snapshot(image: Image, work: Path, shm: Path) -> Path:
    snap = work / "snap"
    snap.mkdir()
    src = work / "src"
    src.mkdir()
    await create_overlay(image.rootfs, src / "disk.qcow2")
    ram = plain_ram(shm / "src.ram", 256, None)
    async with booted_guest(VmSpec.boot(image, disk=src / "disk.qcow2", ram=ram), src) as g:
        await g.channel.run(["sh", "-c", "echo snapshot > /run/mark"])
        await checkpoint_guest(g, files=OverlayFiles(src / "disk.qcow2"), snap_dir=snap, user=None)  # type: ignore[arg-type]
    ram.unlink()
    return snap


async def bench_restore(
    image: Image,
    n: int,
    work: Path,
    shm: Path,
    snap: Path,
    user: QemuUser | None,
    mgr: cgroups.CgroupManager | None,
    helper: Path | None,
) -> dict[str, Any]:
    # today's path: the snapshot's memory chowned to QEMU's user, mapped private
    plain_snap = work / "snap-plain"
    plain_snap.mkdir()
    for f in snap.iterdir():
        os.link(f, plain_snap / f.name)
    # a sparse copy, as checkpoints make it (a dense one restores faster: no holes to fill)
    subprocess.run(["cp", "--sparse=always", str(snap / "memory"), str(plain_snap / "memory.tmp")], check=True)
    os.replace(plain_snap / "memory.tmp", plain_snap / "memory")
    if user is not None:
        os.chown(plain_snap / "memory", user.uid, user.gid)
    fills: list[float] = []
    for _ in range(5):
        t0 = time.perf_counter()
        fd = guestmem.sealed_copy(snap / "memory")
        fills.append(time.perf_counter() - t0)
        os.close(fd)
    cache = guestmem.SealedMemoryCache()
    alloc = allocator()
    plain_t: list[float] = []
    jail_t: list[float] = []
    try:
        for i in range(n):
            d = work / f"r-plain{i}"
            d.mkdir()
            t0 = time.perf_counter()
            await create_overlay(plain_snap / "disk.qcow2", d / "disk.qcow2")
            spec = VmSpec(
                kernel=image.kernel,
                initrd=image.initrd,
                append=kernel_cmdline("tcg"),
                disk=d / "disk.qcow2",
                user=user,
                ram=plain_snap / "memory",
                ram_shared=False,
                restore=plain_snap / "vmstate",
            )
            async with booted_guest(spec, d) as g:
                plain_t.append(time.perf_counter() - t0)
                assert (await g.channel.run(["cat", "/run/mark"])).stdout == b"snapshot\n"
            shutil.rmtree(d, ignore_errors=True)
            d = work / f"r-jail{i}"
            d.mkdir()
            ident = alloc.allocate(f"r{i}")
            opts = JailOptions(identity=ident, base=shm, ram_dir=shm / "ram", cgroups=mgr, helper=helper)
            t0 = time.perf_counter()
            mfd = await trio.to_thread.run_sync(cache.acquire, "snap", snap / "memory")
            try:
                async with jailed_guest(
                    image,
                    f"r{i}",
                    opts,
                    disk_dir=d,
                    restore=snap / "vmstate",
                    restore_memory=snap / "memory",
                    restore_memory_fd=mfd,
                    restore_disk=snap / "disk.qcow2",
                ) as jg:
                    jail_t.append(time.perf_counter() - t0)
                    assert (await jg.guest.channel.run(["cat", "/run/mark"])).stdout == b"snapshot\n"
            finally:
                cache.release("snap", mfd)
            alloc.release(ident)
            shutil.rmtree(d, ignore_errors=True)
    finally:
        cache.close()
    return {
        "plain": ms(plain_t),
        "jailed": ms(jail_t),
        "ratio": round(med(jail_t) / med(plain_t), 3),
        "memfd_fill": ms(fills),
        "snapshot_memory_data_mib": round((snap / "memory").stat().st_blocks * 512 / MIB, 1),
    }


def smaps(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, v = line.split(":")
        out[k] = int(v.split()[0])
    return out


async def bench_share(
    image: Image, work: Path, shm: Path, snap: Path, mgr: cgroups.CgroupManager | None, helper: Path | None
) -> dict[str, Any]:
    alloc = allocator()
    mfd = guestmem.sealed_copy(snap / "memory")
    result: dict[str, Any] = {}
    try:
        async with trio.open_nursery() as nursery:
            ready = trio.Event()
            done = trio.Event()
            pids: list[int] = []

            async def one(i: int) -> None:
                d = work / f"share{i}"
                d.mkdir()
                opts = JailOptions(
                    identity=alloc.allocate(f"s{i}"), base=shm, ram_dir=shm / "ram", cgroups=mgr, helper=helper
                )
                async with jailed_guest(
                    image,
                    f"share{i}",
                    opts,
                    disk_dir=d,
                    restore=snap / "vmstate",
                    restore_memory=snap / "memory",
                    restore_memory_fd=mfd,
                    restore_disk=snap / "disk.qcow2",
                ) as jg:
                    assert jg.guest.machine.pid is not None
                    pids.append(jg.guest.machine.pid)
                    if len(pids) == 3:
                        ready.set()
                    await done.wait()

            for i in range(3):
                nursery.start_soon(one, i)
            await ready.wait()
            await trio.sleep(2)
            per = [smaps(p) for p in pids]
            result = {
                "memfd_data_mib": round(os.fstat(mfd).st_blocks * 512 / MIB, 1),
                "per_clone_kib": [
                    {k: s[k] for k in ("Rss", "Pss", "Pss_Shmem", "Shared_Clean", "Private_Dirty")} for s in per
                ],
                "sum_pss_mib": round(sum(s["Pss"] for s in per) / 1024, 1),
                "sum_rss_mib": round(sum(s["Rss"] for s in per) / 1024, 1),
            }
            done.set()
    finally:
        os.close(mfd)
    return result


BUSY = (
    "while true; do for i in 1 2 3 4 5 6 7 8; do sh -c 'ls -R /usr/lib >/dev/null; "
    'cat /proc/meminfo /proc/cpuinfo | sort | uniq -c >/dev/null; python3 -c "import json, re, zlib"\'; done; done'
)


async def bench_tb(
    image: Image, work: Path, shm: Path, busy_s: float, mgr: cgroups.CgroupManager | None, helper: Path | None
) -> dict[str, Any]:
    """Concurrent busy guests, default translation cache against bounded ones."""
    alloc = allocator()
    out: dict[str, Any] = {}

    async def one(tb: int | None) -> None:
        key = f"tb-size={tb}" if tb else "tb-size default (1 GiB)"
        d = work / f"tb{tb}"
        d.mkdir()
        opts = JailOptions(
            identity=alloc.allocate(key),
            base=shm,
            ram_dir=shm / "ram",
            cgroups=mgr,
            tb_size_mib=tb,
            overhead_mib=2048,
            helper=helper,
        )
        async with jailed_guest(image, f"tb{tb or 0}", opts, disk_dir=d) as jg:
            pid = jg.guest.machine.pid
            assert pid is not None
            idle = smaps(pid)["Rss"]
            await jg.guest.channel.run(["sh", "-c", f"({BUSY}) >/dev/null 2>&1 &"])
            samples = []
            t_end = time.monotonic() + busy_s
            while time.monotonic() < t_end:
                await trio.sleep(5)
                samples.append(smaps(pid)["Rss"])
            st = jg.cgroup.stats() if jg.cgroup else None
            out[key] = {
                "idle_rss_mib": round(idle / 1024, 1),
                "busy_rss_mib_max": round(max(samples) / 1024, 1),
                "busy_rss_mib_end": round(samples[-1] / 1024, 1),
                "cgroup_peak_mib": round(st.memory_peak / MIB, 1) if st and st.memory_peak else None,
                "guest_ram_mib": 256,
            }

    async with trio.open_nursery() as nursery:
        for tb in (None, 64, 32):
            nursery.start_soon(one, tb)
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    image = load_default()
    assert image is not None, "build the default image first"
    only = set(args.only.split(",")) if args.only else {"spawn", "qemu-spawn", "boot", "restore", "share", "tb"}
    work = Path(tempfile.mkdtemp(prefix="bench-jail-", dir="/tmp"))
    work.chmod(0o755)  # disks, snapshots (QEMU's user reaches today's snapshot memory)
    shm = Path(tempfile.mkdtemp(prefix="bench-jail-", dir="/dev/shm"))
    shm.chmod(0o755)  # RAM files and jail dirs: tmpfs, as /run is on real hosts
    mgr = cgroups.detect(parent="sandvisor-bench")
    user = unprivileged_user()
    helper = None if args.no_helper else jail.build_helper(work / "bin")
    res_helper = str(helper) if helper else "none: the Python stage"
    ballast = bytearray(args.ballast_mib * MIB)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    res: dict[str, Any] = {
        "load_avg_start": os.getloadavg(),
        "cgroups": f"v{mgr.version}" if mgr else None,
        "plain_user": user.name if user else None,
        "bench_rss_mib": round(smaps(os.getpid())["Rss"] / 1024, 1),
        "jail_helper": res_helper,
    }
    try:
        async with qmp_loop():
            if "spawn" in only:
                res["spawn"] = await bench_spawn(max(20, args.n), shm, mgr, helper)
                print(json.dumps(res["spawn"], indent=1), flush=True)
            if "qemu-spawn" in only:
                res["qemu_spawn"] = await bench_qemu_spawn(image, args.n, work, shm, user, helper)
                print(json.dumps(res["qemu_spawn"]), flush=True)
            if "boot" in only:
                res["boot"] = await bench_boot(image, args.n, work, shm, user, mgr, helper)
                print(json.dumps(res["boot"]), flush=True)
            snap = None
            if only & {"restore", "share"}:
                snap = await make_snapshot(image, work, shm)
            if "restore" in only and snap is not None:
                res["restore"] = await bench_restore(image, args.n, work, shm, snap, user, mgr, helper)
                print(json.dumps(res["restore"]), flush=True)
            if "share" in only and snap is not None:
                res["share"] = await bench_share(image, work, shm, snap, mgr, helper)
                print(json.dumps(res["share"]), flush=True)
            if "tb" in only:
                res["tb"] = await bench_tb(image, work, shm, args.busy_s, mgr, helper)
                print(json.dumps(res["tb"], indent=1), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        if mgr is not None:
            mgr.remove_parent()
    res["load_avg_end"] = os.getloadavg()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=10)
    ap.add_argument("--busy-s", type=float, default=180)
    ap.add_argument("--ballast-mib", type=int, default=0, help="extra heap in this process (fork cost)")
    ap.add_argument("--only", default="")
    ap.add_argument("--no-helper", action="store_true", help="jail through the Python stage, not sandvisor-jail-exec")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    res = trio.run(bench, a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"-{a.only.replace(',', '-')}" if a.only else ""
    (out / f"jail{suffix}.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
