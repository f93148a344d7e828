"""Image pull and convert: time and throughput for a ~100 MB image from a loopback
registry, against a floor doing the same work by hand in the same run. Medians of n.

* image: /usr/lib/python3.11 (many small files) plus shared libraries from
  /usr/lib/x86_64-linux-gnu up to ~100 MB of content, in 4 layers, built with umoci
  and pushed to Debian's docker-registry on 127.0.0.1;
* cold pull: ImageStore.pull into an empty store (resolve, skopeo copy, umoci unpack,
  mkfs.ext4 -d), with its phases from the progress callback;
* floor: the same steps by hand, no store: ``skopeo copy`` to an OCI dir, ``tar -xzf``
  of each layer (no whiteout handling), ``mkfs.ext4 -d``;
* shared base: a second image that shares 3 of the 4 layers, pulled after the first
  (only the new layer crosses the wire; unpack and convert are whole);
* cached: pull with if-missing (no registry contact) and with always (resolve only);
* two at once: two concurrent pulls of the image into an empty store (work done once).

Usage: python benchmarks/oci_images.py [-n N] [--out results/]
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

# this file is benchmarks/oci_images.py: as a script its directory comes first on sys.path,
# where "images" would name this file instead of the images package. Look here last.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE] + [_HERE]

from _harness import main, write_results  # noqa: E402

from images.oci import ImageStore, PullProgress  # noqa: E402
from images.ocilocal import Layer, LocalRegistry, build_image, push, run  # noqa: E402
from images.refs import RefPolicy  # noqa: E402

TARGET_BYTES = 100 << 20
LOOPBACK_REGISTRY = RefPolicy(registry_allow=("127.0.0.1",))  # the benchmark's own registry (serve --registry-allow)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def cpu_s() -> float:
    """CPU seconds of this process and its waited-for children: unlike wall time on a
    machine shared with TCG VMs, it does not count the time spent waiting for a core."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        total += ru.ru_utime + ru.ru_stime
    return total


def gather_tree(dest: Path) -> int:
    """~100 MB of real files in 4 top-level dirs (one layer each); their content size."""
    total = 0
    parts = [dest / f"part{i}" for i in range(4)]
    for p in parts:
        p.mkdir(parents=True)
    shutil.copytree("/usr/lib/python3.11", parts[0] / "usr/lib/python3.11", symlinks=True)
    for root, _dirs, files in os.walk(parts[0]):
        total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    libs = sorted(p for p in Path("/usr/lib/x86_64-linux-gnu").iterdir() if p.is_file() and not p.is_symlink())
    share = (TARGET_BYTES - total) // 3
    i, budget = 1, share
    for lib in libs:
        size = lib.stat().st_size
        if size > share // 2:
            continue  # many mid-sized files, as a real image has, not one giant
        if size > budget:
            i, budget = i + 1, share
            if i == 4:
                break
        d = parts[i] / "usr/lib/x86_64-linux-gnu"
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, d / lib.name)
        total += size
        budget -= size
    return total


async def timed_pull(store: ImageStore, ref: str, **kw: Any) -> tuple[float, dict[str, float], Any]:
    marks: dict[str, float] = {}

    def seen(p: PullProgress) -> None:
        marks.setdefault(p.phase, time.monotonic())

    t0 = time.monotonic()
    img = await store.pull(ref, progress=seen, **kw)
    t1 = time.monotonic()
    phases = {}
    order = ["resolving", "downloading", "unpacking", "converting", "done"]
    for a, b in itertools.pairwise(order):
        if a in marks and b in marks:
            phases[a] = marks[b] - marks[a]
    return t1 - t0, phases, img


async def pull_once(store: ImageStore, ref: str) -> None:
    await store.pull(ref, tls_verify=False)


def floor_once(ref: str, work: Path) -> dict[str, float]:
    t0 = time.monotonic()
    run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", ref, f"oci:{work / 'layout'}:img"])
    t1 = time.monotonic()
    index = json.loads((work / "layout/index.json").read_text())
    blobs = work / "layout/blobs/sha256"
    manifest = json.loads((blobs / index["manifests"][0]["digest"].split(":")[1]).read_text())
    tree = work / "tree"
    tree.mkdir()
    for layer in manifest["layers"]:
        run(["tar", "-xzf", str(blobs / layer["digest"].split(":")[1]), "-C", str(tree)])
    t2 = time.monotonic()
    size = sum(os.lstat(os.path.join(r, f)).st_size for r, _d, fs in os.walk(tree) for f in fs)
    run(["mkfs.ext4", "-q", "-F", "-m", "0", "-d", str(tree), str(work / "fs.ext4"), f"{(size >> 20) + 1200}M"])
    t3 = time.monotonic()
    return {"total": t3 - t0, "copy": t1 - t0, "unpack": t2 - t1, "mkfs": t3 - t2}


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="sandvisor-bench-images-", dir="/var/tmp"))
    reg = LocalRegistry(work / "registry")
    try:
        print("building the image ...", flush=True)
        content = gather_tree(work / "src")
        layout = work / "layout"
        parts = sorted((work / "src").iterdir())
        build_image(layout, "big", [Layer(p) for p in parts])
        (work / "extra/etc").mkdir(parents=True)
        (work / "extra/etc/rebuilt").write_text("a new top layer\n")
        build_image(layout, "big2", [Layer(p) for p in parts[:3]] + [Layer(work / "extra")])
        reg.start()
        ref = reg.ref("bench/big:1")
        ref2 = reg.ref("bench/big:2")
        push(layout, "big", ref)
        push(layout, "big2", ref2)
        manifest = json.loads(run(["skopeo", "inspect", "--raw", "--tls-verify=false", ref]))
        compressed = sum(int(layer["size"]) for layer in manifest["layers"])
        print(f"image: {content / 1e6:.1f} MB content, {compressed / 1e6:.1f} MB compressed", flush=True)

        cold: list[float] = []
        phases: dict[str, list[float]] = {}
        floor: list[dict[str, float]] = []
        cold_cpu: list[float] = []
        floor_cpu: list[float] = []
        ratios: list[float] = []  # cold / floor of the same round: paired, so load cancels
        shared: list[float] = []
        cached: list[float] = []
        always: list[float] = []
        pair: list[float] = []
        disk_used = disk_virtual = 0
        for i in range(n):
            store = ImageStore(work / f"store{i}", refs=LOOPBACK_REGISTRY)
            c0 = cpu_s()
            with trio.fail_after(600):
                t, ph, img = await timed_pull(store, ref, tls_verify=False)
            cold_cpu.append(cpu_s() - c0)
            cold.append(t)
            for k, v in ph.items():
                phases.setdefault(k, []).append(v)
            disk_used, disk_virtual = img.rootfs.stat().st_blocks * 512, img.rootfs.stat().st_size
            t, _, _ = await timed_pull(store, ref2, tls_verify=False)
            shared.append(t)
            for _ in range(5):
                t, _, _ = await timed_pull(store, ref, tls_verify=False)
                cached.append(t)
                t, _, _ = await timed_pull(store, ref, tls_verify=False, policy="always")
                always.append(t)
            shutil.rmtree(work / f"store{i}")
            fw = work / f"floor{i}"
            fw.mkdir()
            c0 = cpu_s()
            floor.append(await trio.to_thread.run_sync(floor_once, ref, fw))
            floor_cpu.append(cpu_s() - c0)
            ratios.append(cold[-1] / floor[-1]["total"])
            shutil.rmtree(fw)
            store = ImageStore(work / f"pair{i}", refs=LOOPBACK_REGISTRY)
            t0 = time.monotonic()
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(pull_once, store, ref)
            pair.append(time.monotonic() - t0)
            assert store.stats.conversions == 1
            shutil.rmtree(work / f"pair{i}")
            print(f"run {i + 1}/{n}: cold {cold[-1]:.2f} s, floor {floor[-1]['total']:.2f} s", flush=True)
    finally:
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)
    floor_total = med([f["total"] for f in floor])
    res = {
        "n": n,
        "content_bytes": content,
        "compressed_bytes": compressed,
        "cold_s": med(cold),
        "cold_phases_s": {k: med(v) for k, v in phases.items()},
        "floor_s": floor_total,
        "floor_phases_s": {k: med([f[k] for f in floor]) for k in ("copy", "unpack", "mkfs")},
        "cold_vs_floor": med(ratios),
        "cold_cpu_s": med(cold_cpu),
        "floor_cpu_s": med(floor_cpu),
        "cold_vs_floor_cpu": med(cold_cpu) / med(floor_cpu) if floor_cpu else 0.0,
        "throughput_content_mb_s": content / 1e6 / med(cold),
        "shared_base_s": med(shared),
        "cached_if_missing_ms": med(cached) * 1000,
        "cached_always_ms": med(always) * 1000,
        "two_at_once_s": med(pair),
        "two_at_once_vs_one": med(pair) / med(cold),
        "rootfs_disk_bytes": disk_used,
        "rootfs_virtual_bytes": disk_virtual,
        "raw_s": {
            "cold": cold,
            "floor": [f["total"] for f in floor],
            "ratios": ratios,
            "shared": shared,
            "pair": pair,
            "cold_cpu": cold_cpu,
            "floor_cpu": floor_cpu,
        },
    }
    return res


def markdown(r: dict[str, Any]) -> str:
    ph = r["cold_phases_s"]
    fp = r["floor_phases_s"]
    return "\n".join(
        [
            f"## Image pull and convert (loopback registry, n={r['n']}, medians)",
            "",
            f"Image: {r['content_bytes'] / 1e6:.1f} MB of files in 4 layers, "
            f"{r['compressed_bytes'] / 1e6:.1f} MB compressed. Root filesystem: "
            f"{r['rootfs_virtual_bytes'] / 1e6:.0f} MB virtual, "
            f"{r['rootfs_disk_bytes'] / 1e6:.1f} MB on disk (sparse).",
            "",
            "| measure | wall time | throughput | vs floor (paired median) |",
            "|---|---|---|---|",
            f"| floor: skopeo copy + tar -xzf + mkfs.ext4 -d by hand | {r['floor_s']:.2f} s | "
            f"{r['content_bytes'] / 1e6 / r['floor_s']:.1f} MB/s | 1.00x |",
            f"| cold pull (empty store) | {r['cold_s']:.2f} s | {r['throughput_content_mb_s']:.1f} MB/s | "
            f"{r['cold_vs_floor']:.2f}x |",
            f"| CPU time: cold pull / floor | {r['cold_cpu_s']:.2f} s / {r['floor_cpu_s']:.2f} s | | "
            f"{r['cold_vs_floor_cpu']:.2f}x |",
            f"| pull of an image sharing 3 of 4 layers | {r['shared_base_s']:.2f} s | | "
            f"{r['shared_base_s'] / r['floor_s']:.2f}x |",
            f"| two concurrent pulls of one image (empty store) | {r['two_at_once_s']:.2f} s | | "
            f"{r['two_at_once_vs_one']:.2f}x one pull |",
            f"| cached, if-missing (no registry contact) | {r['cached_if_missing_ms']:.1f} ms | | |",
            f"| cached, always (manifest resolve only) | {r['cached_always_ms']:.1f} ms | | |",
            "",
            "Phases of a cold pull (s): "
            + ", ".join(f"{k} {v:.2f}" for k, v in ph.items())
            + f". Floor: copy {fp['copy']:.2f}, unpack {fp['unpack']:.2f}, mkfs {fp['mkfs']:.2f}.",
            "",
        ]
    )


async def _run(n: int, out: Path) -> dict[str, Any]:
    res = await bench(n, out)
    write_results(out, "images", res, markdown(res))
    return res


if __name__ == "__main__":
    main(_run, default_n=3)
