"""Snapshot export and import throughput for a checkpoint of a 256 MiB guest.

Two in-process supervisors (two state dirs, one image cache). The origin (256 MiB,
the default) dirties 64 MiB of its RAM (a tmpfs file of random bytes) and is
checkpointed once (mapped). Then ``-n`` rounds, each:

* SDK export from A to a file, and SDK import of it into B (client, socket, server:
  the whole path a user takes), timed separately; the imported copy is deleted;
* the same export and import without the socket (``export_stream`` into /dev/null,
  ``Importer`` fed from the file in 1 MiB pieces): the supervisor's own cost.

MiB/s are of the export file's bytes (data extents: the RAM file's holes are not
sent; the kernel, initrd and rootfs are named, not carried). Medians; the machine
is shared, so rounds interleave the four measurements.

Usage: python benchmarks/snapshot_transfer.py [-n 5] [--out docs/results]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _harness import main, write_results

from actors.snapshots.transfer import Importer, export_stream
from supervisor.client import AsyncSandbox
from supervisor.main.throwaway import supervisor, workdir

MIB = 1 << 20


async def bench(n: int, out: Path) -> dict[str, Any]:
    rows: dict[str, list[float]] = {"sdk_export": [], "sdk_import": [], "core_export": [], "core_import": []}
    with workdir("bx-a-") as wa, workdir("bx-b-") as wb, tempfile.TemporaryDirectory() as tmp:
        async with supervisor(wa) as (_ca, ra), supervisor(wb) as (_cb, rb):
            sa, sb = str(wa.socket), str(wb.socket)
            origin = await AsyncSandbox.create("origin", socket=sa)
            r = await origin.run(["sh", "-c", "head -c 64M /dev/urandom > /dev/shm/fill && sync"])
            assert r.exit_code == 0, r
            snap = (await origin.checkpoint("bench")).snapshot_id
            rec = ra.snapshots.get(snap)
            f = Path(tmp) / "x.svsnap"
            size = 0
            for i in range(n):
                t0 = time.monotonic()
                size = await AsyncSandbox.export_snapshot(snap, f, socket=sa)
                rows["sdk_export"].append(time.monotonic() - t0)
                t0 = time.monotonic()
                got = await AsyncSandbox.import_snapshot(f, name=f"sdk-{i}", socket=sb)
                rows["sdk_import"].append(time.monotonic() - t0)
                await AsyncSandbox.delete_snapshot(got.id, socket=sb)

                t0 = time.monotonic()
                with open(os.devnull, "wb") as null:
                    async for piece in export_stream(rec, ra.settings):
                        null.write(piece)
                rows["core_export"].append(time.monotonic() - t0)
                t0 = time.monotonic()
                imp = Importer(rb.snapshots, rb.settings, name=f"core-{i}")
                imp.open()
                try:
                    with open(f, "rb") as src:
                        while piece := await trio.to_thread.run_sync(src.read, MIB):
                            await imp.feed(piece)
                    done = await imp.commit()
                except BaseException:
                    await imp.abort()
                    raise
                rows["core_import"].append(time.monotonic() - t0)
                await rb.delete_snapshot(done.id)
            sizes = dict(rec.sizes)
            await origin.remove()
    mib = size / MIB
    res: dict[str, Any] = {
        "export_file_mib": round(mib, 1),
        "snapshot_sizes": sizes,
        "memory": str(rec.memory),
        "load": os.getloadavg()[0],
        **{
            k: {"median_s": statistics.median(v), "mib_s": mib / statistics.median(v), "runs": v}
            for k, v in rows.items()
        },
    }
    lines = [
        f"# Snapshot export/import throughput (256 MiB guest, {rec.memory} checkpoint, medians of {n})",
        "",
        f"Export file: {mib:.1f} MiB (RAM file data extents, vmstate, disk, boot template layer; "
        "kernel, initrd and rootfs named, not carried). Load average at the end: "
        f"{res['load']:.1f} (shared 2-core machine, TCG VMs of other sessions).",
        "",
        "| path | export s | MiB/s | import s | MiB/s |",
        "|---|---|---|---|---|",
    ]
    for label, e, i in (
        ("SDK over the socket", "sdk_export", "sdk_import"),
        ("supervisor core", "core_export", "core_import"),
    ):
        ex, im = res[e], res[i]
        lines.append(
            f"| {label} | {ex['median_s']:.2f} | {ex['mib_s']:.0f} | {im['median_s']:.2f} | {im['mib_s']:.0f} |"
        )
    lines += [
        "",
        "Import includes the SHA-256 check, the qcow2 header checks and an fsync of every file",
        "before the snapshot is recorded; export reads the files in worker threads, 1 MiB per frame.",
    ]
    write_results(out, "snapshot_transfer", res, "\n".join(lines) + "\n")
    return res


if __name__ == "__main__":
    main(bench, default_n=5)
