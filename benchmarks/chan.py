"""The guest channel's data path: a 64 MiB ``write_file`` (to /tmp, a tmpfs, and to
/root, the disk) and ``read_bytes`` back, straight through GuestChannel (no
supervisor), per guest runtime, interleaved in one run. Besides MiB/s (which a
shared machine's load decides) it reports QEMU's CPU seconds per 64 MiB, by thread
(the vCPU runs the guest; the main thread moves the virtio-serial bytes), and the
host process's: CPU time is what a change of the data path changes, whatever the load.

Variants: ``NAME=IMAGE_DIR`` (a directory holding the default.json of an image cache,
e.g. an older runtime built into a private cache); ``NAME=IMAGE_DIR:window=N,chunk=M``
sets the host's file window and write frames (``window=262144,chunk=65536``: the
host's path before the file window).

Usage: python benchmarks/chan.py [-n 2] --variant base=OLD_IMAGES:window=262144,chunk=65536
       --variant new=$SANDVISOR_STATE_DIR/images [--out results/]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _harness import write_results

from actors.machines.disk import create_overlay
from actors.machines.vm import VmSpec, booted_guest
from guestd import proto
from images.build import load_default

SIZE = 64 << 20
TCK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each of QEMU's threads: 'main' and the others by tid."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            f = Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out["main" if int(t) == pid else t] = (int(f[11]) + int(f[12])) / TCK
    return out


def host_cpu() -> float:
    t = os.times()
    return t.user + t.system


async def one_round(name: str, image_dir: Path, window: int, chunk: int, data: bytes) -> dict[str, Any]:
    image = load_default(image_dir)
    if image is None:
        raise SystemExit(f"{name}: no image in {image_dir}")
    saved = proto.FILE_WINDOW, proto.FILE_CHUNK
    proto.FILE_WINDOW, proto.FILE_CHUNK = window, chunk
    work = Path(tempfile.mkdtemp(prefix="sv-chan-"))
    res: dict[str, Any] = {"load": os.getloadavg()[0]}
    try:
        await create_overlay(image.rootfs, work / "disk.qcow2")
        async with booted_guest(VmSpec.boot(image, disk=work / "disk.qcow2", memory_mib=512), work) as g:
            chan, pid = g.channel, g.machine.pid
            assert pid is not None
            await chan.write_file("/tmp/warm", data[: 1 << 20])

            async def timed(key: str, op: Any) -> Any:
                q0, h0, t0 = thread_cpu(pid), host_cpu(), time.perf_counter()
                out = await op
                dt = time.perf_counter() - t0
                q1, h1 = thread_cpu(pid), host_cpu()
                per = {k: v - q0.get(k, 0.0) for k, v in q1.items()}
                vcpu = max((v for k, v in per.items() if k != "main"), default=0.0)
                res[key] = {
                    "mib_s": SIZE / dt / (1 << 20),
                    "qemu_vcpu_s": vcpu,
                    "qemu_main_s": per.get("main", 0.0),
                    "host_s": h1 - h0,
                }
                return out

            await timed("write_tmp", chan.write_file("/tmp/bench.bin", data))
            await chan.run(["rm", "-f", "/tmp/bench.bin"])
            await timed("write_root", chan.write_file("/root/bench.bin", data))
            back = await timed("read_root", chan.read_bytes("/root/bench.bin"))
            assert back == data
    finally:
        proto.FILE_WINDOW, proto.FILE_CHUNK = saved
        shutil.rmtree(work, ignore_errors=True)
    return res


async def bench(n: int, out_dir: Path, variants: list[tuple[str, Path, int, int]]) -> dict[str, Any]:
    data = os.urandom(SIZE)
    rounds: dict[str, list[dict[str, Any]]] = {v[0]: [] for v in variants}
    for i in range(n):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for name, image_dir, window, chunk in order:
            r = await one_round(name, image_dir, window, chunk, data)
            rounds[name].append(r)
            print(
                f"round {i + 1}/{n} {name} (load {r['load']:.1f}): "
                + ", ".join(f"{k} {r[k]['mib_s']:.1f} MiB/s vCPU {r[k]['qemu_vcpu_s']:.2f}s" for k in OPS),
                flush=True,
            )
    res: dict[str, Any] = {"n": n, "cpus": os.cpu_count(), "variants": {}}
    lines = [
        f"# 64 MiB through GuestChannel per guest runtime (TCG, medians of {n}, interleaved)",
        "",
        "| variant | op | MiB/s | QEMU vCPU s | QEMU main s | host s | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, image_dir, window, chunk in variants:
        rs = rounds[name]
        entry: dict[str, Any] = {"image_dir": str(image_dir), "window": window, "chunk": chunk, "rounds": rs}
        for op in OPS:
            med = {k: statistics.median(r[op][k] for r in rs) for k in rs[0][op]}
            entry[op] = med
            lines.append(
                f"| {name} | {op} | {med['mib_s']:.1f} | {med['qemu_vcpu_s']:.2f} | {med['qemu_main_s']:.2f} "
                f"| {med['host_s']:.2f} | {statistics.median(r['load'] for r in rs):.1f} |"
            )
        res["variants"][name] = entry
    write_results(out_dir, "chan", res, "\n".join(lines) + "\n")
    return res


OPS = ("write_tmp", "write_root", "read_root")


def parse_variant(text: str) -> tuple[str, Path, int, int]:
    name, _, rest = text.partition("=")
    where, _, opts = rest.partition(":")
    o = {"window": proto.FILE_WINDOW, "chunk": proto.FILE_CHUNK}
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        if key not in o:
            raise SystemExit(f"unknown variant option {key!r}")
        o[key] = int(value)
    return name, Path(where), o["window"], o["chunk"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    trio.run(bench, a.n, Path(a.out), [parse_variant(v) for v in a.variant])


if __name__ == "__main__":
    main()
