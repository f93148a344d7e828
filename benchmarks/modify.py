"""Modify: how long a live change takes to settle, and what the balloon gives
back to the host, for a cold-booted sandbox and a clone of a boot template.

Settle: a sandbox created with ``cpus 1 / max 2, memory 256 / max 1024``; per round,
Modify to 768 MiB and back to 256 (the balloon deflates, then inflates), and cpus 1 ->
2 -> 1. Wall time of the Modify call (its answer waits until the guest settled) and
the plan's ``settle_seconds``.

Host memory: QEMU's RSS (/proc/PID/status: anonymous, file, shmem) before and after
a Modify that takes memory back through the balloon (768 -> 256 MiB) while the guest
holds ~150 MiB of page cache (a file it wrote and read back):

* cold: the sandbox above (its RAM a shared file under the memory dir: an inflated
  page is a hole punched in it, freed on the host);
* template-mapped: a 768 MiB sandbox restored from its configuration's boot template
  (its RAM the template's memory file mapped privately: an inflated page drops the
  clone's private copy; the template's page stays in the template's file, shared by
  every clone), measured right after the restore and after the same page-cache fill.

Usage: python benchmarks/modify.py [-n 5] [--out results/]
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import trio
from _harness import main, summary, write_results

from actors.registry import Registry
from supervisor.client import AsyncSandbox
from supervisor.main.throwaway import supervisor, workdir

# a 150 MiB file written in steps, then read back with the guest's caches dropped: page
# cache the balloon can take. (A clone of a template pays twice for every guest page it
# touches first: the sealed memfd's hole becomes a page charged to its cgroup, and its
# private copy too: 400 MiB written OOM-killed a 768 MiB clone, 960 MiB limit; docs/modify.md)
FILL = (
    "for i in 0 1 2; do dd if=/dev/zero of=/root/fill bs=1M count=50 seek=$((i*50)) conv=notrunc "
    "oflag=direct status=none; sync; done; echo 3 > /proc/sys/vm/drop_caches; cat /root/fill > /dev/null"
)


def rss(reg: Registry, sb: AsyncSandbox) -> dict[str, float]:
    pid = reg.get(sb.id).record.qemu_pid
    cell = reg.get(sb.id).cell
    out = {}
    if cell is not None and cell.cgroup is not None:
        out["cgroup"] = round(cell.cgroup.stats().memory_bytes / (1 << 20), 1)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


async def timed(sb: AsyncSandbox, **change: Any) -> tuple[float, float]:
    t0 = time.monotonic()
    p = await sb.modify(**change)
    assert p.applied and p.settled, p
    return time.monotonic() - t0, p.settle_seconds


async def balloon_back(reg: Registry, sb: AsyncSandbox, label: str, fill: bool, raw: bool = False) -> dict[str, Any]:
    """``raw``: the balloon set over QMP (Modify refuses to shrink a mapped clone)."""
    if fill:
        r = await sb.run(FILL)
        assert r.exit_code == 0, r.stderr
    before = rss(reg, sb)
    if raw:
        t0 = time.monotonic()
        await set_balloon(reg, sb, 256)
        settle = time.monotonic() - t0
    else:
        _, settle = await timed(sb, memory_mib=256)
    after = rss(reg, sb)
    if raw:
        await set_balloon(reg, sb, 768)
    else:
        await timed(sb, memory_mib=768)
    if fill:
        await sb.run("rm -f /root/fill")
    freed = round(before["VmRSS"] - after["VmRSS"], 1)
    return {"case": label, "before": before, "after": after, "freed_mib": freed, "settle_s": round(settle, 2)}


async def set_balloon(reg: Registry, sb: AsyncSandbox, mib: int) -> None:
    guest = reg.get(sb.id).guest
    assert guest is not None
    await guest.machine.qmp_execute("balloon", {"value": mib << 20})
    while (await guest.machine.qmp_execute("query-balloon"))["actual"] != mib << 20:
        await trio.sleep(0.1)


async def bench(n: int, out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    with workdir("sv-bench-modify-") as work:
        async with supervisor(work) as (_cfg, reg):
            sock = str(work.socket)
            cold = await AsyncSandbox.create(
                "cold", socket=sock, cpus=1, max_cpus=2, memory_mib=256, max_memory_mib=1024, detached=True
            )
            walls: dict[str, list[float]] = {"mem 256->768": [], "mem 768->256": [], "cpu 1->2": [], "cpu 2->1": []}
            settles: dict[str, list[float]] = {k: [] for k in walls}
            for _ in range(n):
                for key, change in (
                    ("mem 256->768", {"memory_mib": 768}),
                    ("mem 768->256", {"memory_mib": 256}),
                    ("cpu 1->2", {"cpus": 2}),
                    ("cpu 2->1", {"cpus": 1}),
                ):
                    wall, settle = await timed(cold, **change)
                    walls[key].append(wall)
                    settles[key].append(settle)
            res["settle"] = {k: {"wall": summary(walls[k]), "settle": summary(settles[k])} for k in walls}
            await timed(cold, memory_mib=768)
            rows = [await balloon_back(reg, cold, "cold boot, 150 MiB page cache", fill=True)]
            # a template of the 768 MiB configuration (the first create), then a clone of it
            first = await AsyncSandbox.create("tpl-maker", socket=sock, memory_mib=768, detached=True)
            clone = await AsyncSandbox.create("tpl-clone", socket=sock, memory_mib=768, detached=True)
            restored = reg.get("tpl-clone").timings.get("mapped") == 1.0
            refused = await clone.modify(memory_mib=256)
            res["clone_modify"] = refused.changes[0].status
            rows.append(await balloon_back(reg, clone, "template-mapped clone, fresh (raw balloon)", False, raw=True))
            rows.append(
                await balloon_back(reg, clone, "template-mapped clone, 150 MiB page cache (raw)", True, raw=True)
            )
            res["host_memory"] = rows
            res["clone_mapped"] = restored
            for sb in (cold, first, clone):
                await sb.remove(force=True)
    md = ["# Modify: settle times and what the balloon gives back", ""]
    md += [f"TCG, {n} rounds; wall = the Modify call (it answers once settled), settle = the plan's.", ""]
    md += ["| change | wall p50 | wall p90 | settle p50 |", "|---|---|---|---|"]
    for k, v in res["settle"].items():
        md.append(f"| {k} | {v['wall']['p50']:.2f} s | {v['wall']['p90']:.2f} s | {v['settle']['p50']:.2f} s |")
    md += ["", f"QEMU RSS (MiB) around Modify 768 -> 256 MiB (clone restored mapped: {res['clone_mapped']};"]
    md += [f"Modify of the clone to 256 MiB: {res['clone_modify']}, so its rows set the balloon over QMP)", ""]
    md += ["| case | RSS before | RSS after | freed | anon before/after | shmem before/after | cgroup before/after |"]
    md += ["|---|---|---|---|---|---|---|"]
    for r in res["host_memory"]:
        b, a = r["before"], r["after"]
        md.append(
            f"| {r['case']} | {b['VmRSS']} | {a['VmRSS']} | {r['freed_mib']} | "
            f"{b.get('RssAnon')}/{a.get('RssAnon')} | {b.get('RssShmem')}/{a.get('RssShmem')} | "
            f"{b.get('cgroup')}/{a.get('cgroup')} |"
        )
    write_results(out, "modify", res, "\n".join(md) + "\n")
    return res


if __name__ == "__main__":
    main(bench, default_n=5)
