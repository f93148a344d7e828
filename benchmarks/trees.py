"""``cp -r`` throughput: guestd's read_tree/write_tree against tar over exec, one VM.

Both directions, two trees, in the same run and interleaved (the machine is shared):

* ``cp -r`` in: a host directory packed on the host (supervisor.client.treecopy.packed_tree) into
  ``write_tree`` (guestd's worker unpacks), against the same host-packed stream fed
  to ``tar x`` run by ``exec`` in the guest (its stdin over the same channel): the
  floor, GNU tar at the far end of the same pipe.
* ``cp -r`` out: ``read_tree`` unpacked on the host (supervisor.client.treecopy.unpack_tree),
  against ``tar c`` run by ``exec`` in the guest, its stdout unpacked the same way.

Trees: 1000 small files (about 4.5 KB on average, modes, symlinks, empty dirs: the
issue's case, where per-file cost dominates), one of 16 files of 4 MiB (bulk
throughput) and a real one (``--real``, default the first of CPython's test directory,
/usr/lib/python3/dist-packages, /usr/share/doc with over 1,000 files; ``--real ''``:
none). Medians of ``-n`` rounds; ratios are the median over rounds of ours / tar's
time in that round (below 1: faster). The last column: the CPU seconds the guest's
QEMU process spent on each (medians), and the median of each round's ratio: on a
shared, loaded host that is the steadier measure of what the copy costs the guest.

A/B in one run (``--baseline DIR``): DIR holds a ``default.json`` of another image
(e.g. one built from main's guestd, copied aside before building this branch's); a
second VM boots from it and every round times ``cp -r`` (and tar) on both VMs, back to
back: rows marked "(baseline)", and ``ours/baseline``, the median of each round's
ratio of this tree's times on the two guests.

Usage: python -P benchmarks/trees.py [-n 5] [--out results/] [--baseline DIR]
(-P: benchmarks/images.py would shadow the images package)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from actors.channel.guest import GuestChannel
from actors.machines.disk import create_overlay
from actors.machines.vm import VmSpec, booted_guest
from images.build import Builder, Image, default_cache, load_default
from supervisor.client.treecopy import packed_tree, unpack_tree


def small_tree(root: Path) -> None:
    for i in range(1000):
        d = root / f"d{i % 10}" / f"e{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"f{i}"
        p.write_bytes(os.urandom(i * 37 % 9000))
        p.chmod(0o600 | (i % 0o200))
    (root / "empty" / "a" / "b").mkdir(parents=True)
    (root / "link").symlink_to("d1/e1")


def bulk_tree(root: Path) -> None:
    root.mkdir(exist_ok=True)
    for i in range(16):
        (root / f"blob{i}").write_bytes(os.urandom(4 << 20))


REAL_TREES = ("/usr/lib/python3.11/test", "/usr/lib/python3/dist-packages", "/usr/share/doc")


def real_tree() -> str:
    for cand in REAL_TREES:
        if os.path.isdir(cand) and sum(len(f) for _, _, f in os.walk(cand)) > 1000:
            return cand
    return ""


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` (a guest's QEMU: its vCPU and I/O
    threads) has used: what a copy costs the guest, without the waits a loaded host adds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def size_of(root: Path) -> int:
    return sum((Path(d) / f).lstat().st_size for d, _, fs in os.walk(root) for f in fs)


async def cp_in(chan: GuestChannel, src: Path, dest: str) -> None:
    async with packed_tree(src) as chunks:
        await chan.write_tree(dest, chunks)


async def tar_in(chan: GuestChannel, src: Path, dest: str) -> None:
    await chan.run(["mkdir", "-p", dest])
    async with (
        packed_tree(src) as chunks,
        chan.exec(["tar", "x", "-C", dest], stdin=True) as h,
        trio.open_nursery() as n,
    ):

        async def feed() -> None:
            async for c in chunks:
                await h.send_stdin(c)
            await h.close_stdin()

        n.start_soon(feed)
        ex = await h.wait()
    assert ex.code == 0, ex


async def cp_out(chan: GuestChannel, src: str, dest: Path) -> None:
    async with chan.read_tree(src) as tar:
        await unpack_tree(tar, dest)


async def tar_out(chan: GuestChannel, src: str, dest: Path) -> None:
    async with chan.exec(["tar", "c", "-C", src, "."]) as h:

        async def stdout() -> AsyncIterator[bytes]:
            async for ch, data in h:
                if ch == 1:
                    yield data

        await unpack_tree(stdout(), dest)
    assert h.exit is not None and h.exit.code == 0


GUESTS = ("", "baseline")  # this checkout's image; --baseline's


async def bench(
    n: int, out_dir: Path, real: str = "", which: list[str] | None = None, baseline: Path | None = None
) -> dict[str, Any]:
    images: dict[str, Image] = {"": Builder(default_cache()).build()}
    if baseline is not None:
        other = load_default(baseline)
        if other is None:
            raise SystemExit(f"no built image in {baseline} (default.json)")
        images["baseline"] = other
    work = Path(tempfile.mkdtemp(prefix="sandvisor-bench-trees-"))
    try:
        trees = {"small": work / "small", "bulk": work / "bulk"}
        trees["small"].mkdir()
        small_tree(trees["small"])
        bulk_tree(trees["bulk"])
        if real:
            trees["real"] = Path(real)
        trees = {k: v for k, v in trees.items() if which is None or k in which}
        res: dict[str, Any] = {"n": n, "baseline": str(baseline or "")}
        times: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}  # the guest's QEMU process: CPU seconds (the load's waits left out)
        async with contextlib.AsyncExitStack() as stack:
            chans: dict[str, GuestChannel] = {}
            pids: dict[str, int] = {}
            for label, image in images.items():
                run = work / f"run{label}"
                run.mkdir()
                await create_overlay(image.rootfs, run / "disk.qcow2")
                spec = VmSpec.boot(image, disk=run / "disk.qcow2", hostname="bench", memory_mib=512)
                guest = await stack.enter_async_context(booted_guest(spec, run))
                chan = guest.channel
                pids[label] = guest.machine.pid or 0
                warm = work / f"warm{label}"
                warm.mkdir()
                await cp_out(chan, "/etc/apt", warm)  # PID 1 imports the tree module once: not part of any round
                chans[label] = chan
            for i in range(n):
                for name, src in trees.items():
                    order = list(chans.items())  # which guest goes first alternates (the load drifts)
                    for label, chan in order if i % 2 == 0 else order[::-1]:
                        key = f"{name}{'@' + label if label else ''}"
                        for how, fn in (("cp_in", cp_in), ("tar_in", tar_in)):
                            dest = f"/tmp/{how}-{name}-{i}"
                            t, c = time.perf_counter(), cpu_s(pids[label])
                            await fn(chan, src, dest)
                            times.setdefault(f"{key}.{how}", []).append(time.perf_counter() - t)
                            cpu.setdefault(f"{key}.{how}", []).append(cpu_s(pids[label]) - c)
                        for how, fn2 in (("cp_out", cp_out), ("tar_out", tar_out)):
                            dest_dir = work / f"{how}-{name}-{i}"
                            dest_dir.mkdir()
                            t, c = time.perf_counter(), cpu_s(pids[label])
                            await fn2(chan, f"/tmp/cp_in-{name}-{i}", dest_dir)
                            times.setdefault(f"{key}.{how}", []).append(time.perf_counter() - t)
                            cpu.setdefault(f"{key}.{how}", []).append(cpu_s(pids[label]) - c)
                            shutil.rmtree(dest_dir)
                        await chan.run(["rm", "-rf", f"/tmp/cp_in-{name}-{i}", f"/tmp/tar_in-{name}-{i}"])
        rows: list[str] = []
        for name, src in trees.items():
            size = size_of(src)
            entries = sum(len(d) + len(f) for _, d, f in os.walk(src))
            for label in chans:
                key = f"{name}{'@' + label if label else ''}"
                entry: dict[str, Any] = {"bytes": size, "entries": entries}
                for how in ("cp_in", "tar_in", "cp_out", "tar_out"):
                    med = statistics.median(times[f"{key}.{how}"])
                    entry[how] = {
                        "median_s": med,
                        "mib_s": size / med / (1 << 20),
                        "all_s": times[f"{key}.{how}"],
                        "vm_cpu_s": cpu[f"{key}.{how}"],
                    }
                # the median of each round's own ratio: a round's two runs are adjacent, so
                # they share the machine's load (the medians of times do not, on a busy host)
                for d, ours, tar in (("in", "cp_in", "tar_in"), ("out", "cp_out", "tar_out")):
                    pairs = zip(times[f"{key}.{ours}"], times[f"{key}.{tar}"], strict=True)
                    entry[f"ratio_{d}"] = statistics.median(a / b for a, b in pairs)
                    cpairs = zip(cpu[f"{key}.{ours}"], cpu[f"{key}.{tar}"], strict=True)
                    entry[f"cpu_ratio_{d}"] = statistics.median(a / b for a, b in cpairs if b > 0)
                    if label:  # this tree's cp on this checkout's guest against the baseline's, round by round
                        pairs = zip(times[f"{name}.{ours}"], times[f"{key}.{ours}"], strict=True)
                        entry[f"ours_vs_baseline_{d}"] = statistics.median(a / b for a, b in pairs)
                        cpairs = zip(cpu[f"{name}.{ours}"], cpu[f"{key}.{ours}"], strict=True)
                        entry[f"ours_vs_baseline_cpu_{d}"] = statistics.median(a / b for a, b in cpairs if b > 0)
                res[key] = entry
                for d, ours, tar in (("in", "cp_in", "tar_in"), ("out", "cp_out", "tar_out")):
                    vs = ""
                    if label:
                        vs = f" | {entry[f'ours_vs_baseline_{d}']:.2f} (CPU {entry[f'ours_vs_baseline_cpu_{d}']:.2f})"
                    elif len(chans) > 1:
                        vs = " | "
                    ours_cpu, tar_cpu = (statistics.median(entry[h]["vm_cpu_s"]) for h in (ours, tar))
                    rows.append(
                        f"| {name}{' (' + label + ')' if label else ''} ({entries} entries, "
                        f"{size / (1 << 20):.1f} MiB) | {d} | "
                        f"{entry[ours]['median_s']:.2f} | {entry[ours]['mib_s']:.1f} | {entry[tar]['median_s']:.2f} | "
                        f"{entry[tar]['mib_s']:.1f} | {entry[f'ratio_{d}']:.2f}{vs} | "
                        f"{ours_cpu:.2f} / {tar_cpu:.2f} = {entry[f'cpu_ratio_{d}']:.2f} |"
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "trees.json").write_text(json.dumps(res, indent=2))
    res["real_tree"] = real
    ab = len(images) > 1
    lines = [
        f"# cp -r vs tar over exec (TCG, medians of {n}; real tree: {real or 'none'}; "
        f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)",
        "",
        "| tree | direction | ours s | MiB/s | tar over exec s | MiB/s | ours/tar (paired) |"
        + (" ours/baseline (paired) |" if ab else "")
        + " VM CPU s, ours / tar = ratio |",
        "|---|---|---|---|---|---|---|" + ("---|" if ab else "") + "---|",
        *rows,
    ]
    md = "\n".join(lines) + "\n"
    (out_dir / "trees.md").write_text(md)
    print(md)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--out", default="results")
    ap.add_argument("--real", default=None, help="a real tree to copy too (default: found; '': none)")
    ap.add_argument("--trees", default="small,bulk,real", help="which trees (comma-separated)")
    ap.add_argument("--baseline", type=Path, help="a directory with another image's default.json: A/B in one run")
    a = ap.parse_args()
    real = real_tree() if a.real is None else a.real
    trio.run(bench, a.n, Path(a.out), real, a.trees.split(","), a.baseline)


if __name__ == "__main__":
    main()
