"""What the jail costs, on the production path: a jailed and an unjailed
supervisor side by side in one run, interleaved round by round (the side that goes
first alternates) so the load of a shared machine hits both alike. Medians and p90.

Two throwaway supervisors (``supervisor.main.throwaway``), root, TCG, 256 MiB guests:
``jail=True`` (every QEMU in its cell: own uid, namespaces, pivot_root, cgroup, sealed
snapshot memory; actors/cells/cell.py) and ``jail=False`` (``serve --no-jail``: QEMU as
``nobody``, no namespaces, no cgroup). Each round, for each side, with both sides
quiet first (their warm pools full, nothing starting):

* Create, boot path: Create RPC -> the sandbox's ready event (boot templates off);
* Create, boot template: the same with templates on (the default: a restore of the
  configuration's template);
* Restore: Restore RPC round trip (it answers once ready) of a mapped snapshot;
* pool acquire: Restore RPC round trip of a second mapped snapshot whose warm pool
  holds one ready member (``pools={"pooled": 1}``), waited for before each acquire.

Each ratio is jailed / unjailed of the medians (at most 1.10 each).

Memory: RSS and PSS (``/proc/<qemu>/smaps_rollup``) per idle sandbox created from the
boot template, with 1 and with 8 live at once (jailed; unjailed beside it for
reference), and a busy jailed sandbox (a default Create whose command is a loop
spawning processes) for ``--busy-seconds``, TCG's translation cache bounded (tb-size
64, the default): QEMU's max RSS and its cgroup's peak against guest RAM + 128 MiB.
A booted busy twin runs beside it: a booted guest's RAM file is charged to its own
cgroup, a restored guest's pages shared with the sealed memfd to the supervisor.

Usage: python benchmarks/jail.py [-n 8] [--busy-seconds 300] [--out results/]
(root: jails need it; ``--busy-seconds 0`` skips the busy part)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import attrs
import trio

# as a script, benchmarks/ comes first on sys.path, where benchmarks/images.py would
# shadow the images package (which actors imports): look here last
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE] + [_HERE]

from _harness import pct, summary, write_results  # noqa: E402

from actors.registry import Registry  # noqa: E402
from actors.sandboxes.sandbox import Sandbox  # noqa: E402
from supervisor.client import AsyncConnection, connect  # noqa: E402
from supervisor.main.daemon_config import DaemonConfig  # noqa: E402
from supervisor.main.throwaway import supervisor, workdir  # noqa: E402

MIB = 1 << 20
GUEST_MIB = 256  # the supervisor's default guest RAM
TARGET_RATIO = 1.10
BUSY_HEADROOM_MIB = 128
LOOP = "i=0; while true; do ls /usr/bin >/dev/null; python3 -c 1; i=$((i+1)); echo $i >/tmp/loops; done"
MEASURES = (
    ("create_boot", "Create, boot path (Create RPC to ready)"),
    ("create_template", "Create from the boot template (Create RPC to ready)"),
    ("restore", "Restore of a mapped snapshot (Restore RPC)"),
    ("pool_acquire", "pool acquire (Restore RPC, a ready member waiting)"),
)
PHASES = (  # (from, to, label) of Sandbox.timings; "loaded" only on restores
    ("accepted", "spawned", "overlay + cell"),
    ("spawned", "qmp_ready", "spawn to QMP ready"),
    ("qmp_ready", "loaded", "state load"),
    ("loaded", "hello", "to guestd's hello"),
    ("hello", "ready_event", "fixups to ready"),
)


@attrs.define
class Side:
    """One supervisor under test and a client connection to it."""

    name: str
    cfg: DaemonConfig
    reg: Registry
    client: AsyncConnection
    snaps: dict[str, str] = attrs.field(factory=dict)  # "mapped", "pooled" -> snapshot id
    times: dict[str, list[float]] = attrs.field(factory=dict)
    phases: dict[str, list[dict[str, float]]] = attrs.field(factory=dict)

    async def call(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.client.call(method, body)

    def pool_ready(self) -> int:
        return self.reg.pool_ready(self.reg.snapshots.get(self.snaps["pooled"]))


# -- the machine ---------------------------------------------------------------------------------


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def other_qemus() -> int:
    """QEMUs on this host that are not ours (other engineers' VMs: load we share)."""
    me, n = os.getpid(), 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if not (p / "comm").read_text().startswith("qemu-system"):
                continue
            ppid = next(int(line.split()[1]) for line in (p / "status").read_text().splitlines() if line[:5] == "PPid:")
        except (OSError, StopIteration, ValueError):
            continue
        n += ppid != me
    return n


def load_now() -> dict[str, Any]:
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "other_qemus": other_qemus()}


def smaps(pid: int) -> dict[str, int]:
    """smaps_rollup of a process, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, _, v = line.partition(":")
        out[k.strip()] = int(v.split()[0])
    return out


def qemu_identity(pid: int) -> dict[str, Any]:
    st = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {
        "uid": int(st["Uid"].split()[0]),
        "no_new_privs": int(st["NoNewPrivs"]),
        "seccomp": int(st["Seccomp"]),
        "cap_eff": st["CapEff"].strip(),
        "own_net_ns": os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net"),
        "own_mnt_ns": os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"),
    }


# -- one measurement ---------------------------------------------------------------------------------


async def ready(sb: Sandbox) -> Sandbox:
    with trio.fail_after(180):
        await sb.ready_event.wait()
    if sb.state not in ("ready", "running"):
        raise RuntimeError(f"{sb.id} is {sb.state}: {sb.record.error}")
    return sb


async def create(
    side: Side, name: str, *, templates: bool, restored: bool | None = None, **body: Any
) -> tuple[float, Sandbox]:
    """Create RPC to the ready event, seconds (ready comes as an event, not the answer).
    ``restored``: whether the boot template must have served it (default: ``templates``)."""
    side.reg.pools.templates = templates
    t0 = time.monotonic()
    await side.call("Create", {"id": name, **body})
    sb = await ready(side.reg.get(name))
    dt = time.monotonic() - t0
    was_restored = "loaded" in sb.timings  # a restore (of the template) has a state-load mark
    if was_restored != (templates if restored is None else restored):
        raise RuntimeError(f"{side.name} {name}: {'restored' if was_restored else 'booted'}, expected the other")
    return dt, sb


async def restore(side: Side, snap: str, name: str, *, pooled: bool) -> tuple[float, Sandbox]:
    """Restore RPC round trip, seconds (it answers once the sandbox is ready)."""
    t0 = time.monotonic()
    await side.call("Restore", {"snapshot_id": side.snaps[snap], "id": name})
    dt = time.monotonic() - t0
    sb = await ready(side.reg.get(name))
    from_pool = "pool" in sb.timings  # (a taken member's timings say so)
    if from_pool != pooled:
        raise RuntimeError(f"{side.name} {name}: pool member {from_pool}, expected {pooled}")
    return dt, sb


async def remove(side: Side, name: str) -> None:
    await side.call("Remove", {"id": name, "force": True})


def phases(sb: Sandbox) -> dict[str, float]:
    """Where a life's time went (the supervisor's marks): the jail's own work is in the
    first two phases (the cell before QEMU; the spawn through the jail helper)."""
    t = sb.timings
    out = {}
    for a, b, label in PHASES:
        a = a if a in t else "qmp_ready"  # (a boot has no state load)
        if a in t and b in t:
            out[label] = t[b] - t[a]
    return out


async def quiet(sides: list[Side]) -> None:
    """Both sides settled: every warm pool full, nothing starting (a refill after an
    acquire must not run under the next measurement)."""
    with trio.fail_after(300):
        while True:
            busy = any(
                s.pool_ready() < 1 or any(sb.state == "starting" for sb in s.reg.sandboxes.values()) for s in sides
            )
            if not busy:
                break
            await trio.sleep(0.05)
    await trio.sleep(0.3)


async def one_round(sides: list[Side], i: int, record: bool) -> None:
    order = sides if i % 2 == 0 else sides[::-1]

    async def boot(s: Side) -> tuple[float, Sandbox]:
        return await create(s, f"boot{i}", templates=False)

    async def template(s: Side) -> tuple[float, Sandbox]:
        return await create(s, f"tpl{i}", templates=True)

    async def restored(s: Side) -> tuple[float, Sandbox]:
        return await restore(s, "mapped", f"rst{i}", pooled=False)

    async def acquired(s: Side) -> tuple[float, Sandbox]:
        return await restore(s, "pooled", f"pool{i}", pooled=True)

    steps: dict[str, Callable[[Side], Awaitable[tuple[float, Sandbox]]]] = {
        "create_boot": boot,
        "create_template": template,
        "restore": restored,
        "pool_acquire": acquired,
    }
    for key, fn in steps.items():
        for s in order:
            await quiet(sides)
            dt, sb = await fn(s)
            if record:
                s.times.setdefault(key, []).append(dt)
                s.phases.setdefault(key, []).append(phases(sb))
            await remove(s, sb.id)


# -- set-up ------------------------------------------------------------------------------------------


async def open_side(stack: AsyncExitStack, name: str, jail: bool) -> Side:
    """A throwaway supervisor (warm pool of one for the snapshot named "pooled") and a
    client of its socket, both closed by ``stack``."""
    work = stack.enter_context(workdir(f"sv-jailbench-{name}-"))
    made: list[Registry] = []

    def remove_cgroup_parent() -> None:  # serve leaves its sandvisor-<state dir key> parent behind
        for r in made:
            if r.settings.cells is not None and r.settings.cells.cgroups is not None:
                r.settings.cells.cgroups.remove_parent()

    stack.callback(remove_cgroup_parent)  # (runs after the supervisor has stopped)
    cfg, reg = await stack.enter_async_context(supervisor(work, jail=jail, pools={"pooled": 1}))
    made.append(reg)
    client = await stack.enter_async_context(connect(cfg.socket))
    if jail != (reg.settings.cells is not None):
        raise RuntimeError(f"{name}: jail={jail} but cells={reg.settings.cells}: run as root")
    return Side(name, cfg, reg, client)


async def prepare(s: Side) -> dict[str, Any]:
    """The boot template (a first default Create), two mapped snapshots of a booted
    origin (one restored, one pooled), and what the side's QEMUs run as."""
    _, sb = await create(s, "origin", templates=False)
    pid = sb.record.qemu_pid
    info: dict[str, Any] = {"qemu": qemu_identity(pid)}
    if sb.cell is not None and sb.cell.cgroup is not None:
        st = sb.cell.cgroup.stats()
        info["cgroup"] = {"version": sb.cell.cgroup.version, "memory_limit_mib": (st.memory_limit or 0) // MIB}
        info["jail_helper"] = str(s.reg.settings.cells.helper) if s.reg.settings.cells else None
    for snap in ("mapped", "pooled"):
        r = await s.call("Checkpoint", {"sandbox_id": "origin", "name": snap})
        if r["memory"] != "mapped":
            raise RuntimeError(f"{s.name}: snapshot {snap} is {r['memory']}, not mapped")
        s.snaps[snap] = r["snapshot_id"]
    await remove(s, "origin")
    await create(s, "tplmaker", templates=True, restored=False)  # boots, saves the template at its first ready
    await remove(s, "tplmaker")
    if not s.reg.snapshots.templates():
        raise RuntimeError(f"{s.name}: no boot template was saved")
    return info


# -- memory ------------------------------------------------------------------------------------------


async def idle_memory(s: Side, count: int) -> dict[str, Any]:
    """RSS/PSS per QEMU of ``count`` idle template-created sandboxes live at once."""
    names = [f"mem{count}-{k}" for k in range(count)]
    sbs = []
    for name in names:
        _, sb = await create(s, name, templates=True)
        sbs.append(sb)
    await trio.sleep(5)  # idle: the fixups and the first timer ticks are done
    per = [smaps(sb.record.qemu_pid) for sb in sbs]
    cg = []
    for sb in sbs:
        if sb.cell is not None and sb.cell.cgroup is not None:
            cg.append(sb.cell.cgroup.stats().memory_bytes / MIB)
    sealed = s.reg.settings.cells.sealed.cached_bytes / MIB if s.reg.settings.cells else 0.0
    for name in names:
        await remove(s, name)
    rss = [p["Rss"] / 1024 for p in per]
    pss = [p["Pss"] / 1024 for p in per]
    return {
        "sandboxes": count,
        "rss_mib_median": round(statistics.median(rss), 1),
        "pss_mib_median": round(statistics.median(pss), 1),
        "rss_mib_max": round(max(rss), 1),
        "pss_mib_max": round(max(pss), 1),
        "pss_mib_sum": round(sum(pss), 1),
        "private_dirty_mib_median": round(statistics.median(p["Private_Dirty"] / 1024 for p in per), 1),
        "cgroup_usage_mib_median": round(statistics.median(cg), 1) if cg else None,
        "sealed_memfds_mib": round(sealed, 1),  # held once by the supervisor (jailed), not in any QEMU's PSS
    }


async def busy_memory(s: Side, seconds: float) -> dict[str, Any]:
    """Two busy jailed sandboxes for ``seconds``: a default Create (restored from the
    boot template) and a booted one, each running LOOP as its command."""
    cmd = ["sh", "-c", LOOP]
    out: dict[str, Any] = {}
    sbs = {
        "template": (await create(s, "busy-tpl", templates=True, cmd=cmd))[1],
        "booted": (await create(s, "busy-boot", templates=False, cmd=cmd))[1],
    }
    samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in sbs}  # rss, cgroup usage, peak
    loads = []
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        await trio.sleep(5)
        loads.append(os.getloadavg()[0])
        for k, sb in sbs.items():
            if sb.state not in ("ready", "running"):
                raise RuntimeError(f"busy sandbox {sb.id} is {sb.state}: {sb.record.error}")
            rss = smaps(sb.record.qemu_pid)["Rss"] / 1024
            cgroup = sb.cell.cgroup if sb.cell is not None else None
            st = cgroup.stats() if cgroup is not None else None
            usage = st.memory_bytes / MIB if st else 0.0
            peak = (st.memory_peak or 0) / MIB if st else 0.0
            samples[k].append((rss, usage, peak))
    for k, sb in sbs.items():
        loops = await sb.guest_call(lambda g: g.channel.run(["cat", "/tmp/loops"]))
        cgroup = sb.cell.cgroup if sb.cell is not None else None
        st = cgroup.stats() if cgroup is not None else None
        rss_mib = [x[0] for x in samples[k]]
        peak = max(x[2] for x in samples[k])
        out[k] = {
            "busy_seconds": seconds,
            "loops": int(loops.stdout.strip() or 0),
            "rss_mib_max": round(max(rss_mib), 1),
            "rss_mib_end": round(rss_mib[-1], 1),
            "cgroup_usage_mib_max": round(max(x[1] for x in samples[k]), 1),
            "cgroup_peak_mib": round(peak, 1),
            "cgroup_limit_mib": (st.memory_limit or 0) // MIB if st else None,
            "oom_kills": st.oom_kills if st else None,
            "target_mib": GUEST_MIB + BUSY_HEADROOM_MIB,
            "rss_within_target": max(rss_mib) <= GUEST_MIB + BUSY_HEADROOM_MIB,
            "peak_within_target": peak <= GUEST_MIB + BUSY_HEADROOM_MIB,
        }
        await remove(s, sb.id)
    out["loadavg_1m_median"] = round(statistics.median(loads), 2) if loads else None
    return out


# -- the run ------------------------------------------------------------------------------------------


async def bench(n: int, busy_seconds: float) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/jail.py needs root: jails are only made by a root supervisor")
    res: dict[str, Any] = {
        "n": n,
        "guest_mib": GUEST_MIB,
        "cores": os.cpu_count(),
        "uptime_start": uptime(),
        "load_start": load_now(),
        "target_ratio": TARGET_RATIO,
    }
    loads: list[dict[str, Any]] = []
    async with AsyncExitStack() as stack:
        jailed = await open_side(stack, "jailed", True)
        plain = await open_side(stack, "unjailed", False)
        sides = [jailed, plain]
        res["sides"] = {s.name: await prepare(s) for s in sides}
        await one_round(sides, -1, record=False)  # warm-up: sealed memfds filled, caches hot
        for i in range(n):
            await one_round(sides, i, record=True)
            loads.append(load_now())
            print(f"round {i + 1}/{n}: load {loads[-1]['loadavg']}, other QEMUs {loads[-1]['other_qemus']}", flush=True)
        for key, _ in MEASURES:
            j, u = jailed.times[key], plain.times[key]
            res[key] = {
                "jailed": summary(j),
                "unjailed": summary(u),
                "ratio_p50": round(statistics.median(j) / statistics.median(u), 3),
                "ratio_p90": round(pct(j, 90) / pct(u, 90), 3),
                # each round's two samples ran back to back: their ratio is less at the
                # mercy of load that drifts over the run
                "ratio_paired_median": round(statistics.median(a / b for a, b in zip(j, u, strict=True)), 3),
                "samples_ms": {"jailed": [round(x * 1000, 1) for x in j], "unjailed": [round(x * 1000, 1) for x in u]},
                "phases_p50_ms": {s.name: phase_medians(s.phases[key]) for s in sides},
            }
        res["load_rounds"] = loads
        # memory: no pool members or other sandboxes beside the ones measured
        for s in sides:
            s.reg.pools.resize(snapshot="pooled", size=0)
            for sb in s.reg.pools.all_members():
                sb.request_stop(0, force=True)
        with trio.fail_after(120):
            while any(s.reg.pools.all_members() for s in sides):
                await trio.sleep(0.1)
        res["idle_memory"] = {s.name: {str(k): await idle_memory(s, k) for k in (1, 8)} for s in sides}
        res["load_after_memory"] = load_now()
        if busy_seconds > 0:
            res["busy"] = await busy_memory(jailed, busy_seconds)
    res["uptime_end"] = uptime()
    res["load_end"] = load_now()
    return res


def phase_medians(runs: list[dict[str, float]]) -> dict[str, float]:
    labels = [label for _, _, label in PHASES if any(label in r for r in runs)]
    return {label: round(statistics.median(r[label] for r in runs if label in r) * 1000, 1) for label in labels}


def markdown(res: dict[str, Any]) -> str:
    ms = 1000.0
    rounds = res["load_rounds"]
    la = [r["loadavg"][0] for r in rounds]
    others = [r["other_qemus"] for r in rounds]
    r = [
        f"## The jail's cost (issue 12): jailed vs unjailed supervisors, one run (TCG, {res['guest_mib']} MiB guests, "
        f"n={res['n']})",
        "",
        f"Machine: {res['cores']} cores shared with other engineers' VMs. At the start: `{res['uptime_start']}`, "
        f"{res['load_start']['other_qemus']} QEMUs not ours. During the rounds: 1-minute load "
        f"{min(la):.1f}-{max(la):.1f} (median {statistics.median(la):.1f}), {min(others)}-{max(others)} other QEMUs. "
        f"At the end: `{res['uptime_end']}`.",
        "",
        "Ratios are jailed / unjailed: of the medians (p50), of the p90s, and the median of each round's "
        "own ratio (its two samples ran back to back). The target is on the medians.",
        "",
        "| measure | unjailed p50 | jailed p50 | ratio p50 | unjailed p90 | jailed p90 | ratio p90 "
        "| paired ratio (median) | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, label in MEASURES:
        m = res[key]
        u, j = m["unjailed"], m["jailed"]
        ok = "ok" if m["ratio_p50"] <= res["target_ratio"] else "OVER"
        r.append(
            f"| {label} | {u['p50'] * ms:.1f} ms | {j['p50'] * ms:.1f} ms | **{m['ratio_p50']:.2f}** "
            f"| {u['p90'] * ms:.1f} ms | {j['p90'] * ms:.1f} ms | {m['ratio_p90']:.2f} "
            f"| {m['ratio_paired_median']:.2f} | <= {res['target_ratio']:.2f} ({ok}) |"
        )
    r += [
        "",
        "Where the time goes (medians of the supervisor's marks, ms, unjailed / jailed): the jail's own work "
        "is in the first two phases (overlay and cell before QEMU; the spawn through the jail helper).",
        "",
        "| measure | " + " | ".join(label for _, _, label in PHASES) + " |",
        "|---|" + "---|" * len(PHASES),
    ]
    for key, label in MEASURES:
        ph = res[key]["phases_p50_ms"]
        if not ph["jailed"]:
            continue
        cells = []
        for _, _, phase in PHASES:
            u, j = ph["unjailed"].get(phase), ph["jailed"].get(phase)
            cells.append(f"{u:.1f} / {j:.1f}" if u is not None and j is not None else "")
        r.append(f"| {label} | " + " | ".join(cells) + " |")
    jq = res["sides"]["jailed"]
    r += [
        "",
        f"Jailed QEMUs: uid {jq['qemu']['uid']}, NoNewPrivs {jq['qemu']['no_new_privs']}, Seccomp "
        f"{jq['qemu']['seccomp']}, CapEff {jq['qemu']['cap_eff']}, own net/mnt namespaces "
        f"{jq['qemu']['own_net_ns']}/{jq['qemu']['own_mnt_ns']}, cgroup v{jq.get('cgroup', {}).get('version')} "
        f"limit {jq.get('cgroup', {}).get('memory_limit_mib')} MiB; unjailed: uid "
        f"{res['sides']['unjailed']['qemu']['uid']}.",
        "",
        "### Idle memory per sandbox (created from the boot template; QEMU's smaps_rollup)",
        "",
        "| supervisor | live sandboxes | RSS p50 | PSS p50 | PSS max | PSS sum | private dirty p50 | cgroup usage p50 "
        "| sealed memfds (supervisor) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side in ("jailed", "unjailed"):
        for k, m in res["idle_memory"][side].items():
            cg = f"{m['cgroup_usage_mib_median']:.1f} MiB" if m["cgroup_usage_mib_median"] is not None else "-"
            r.append(
                f"| {side} | {k} | {m['rss_mib_median']:.1f} MiB | {m['pss_mib_median']:.1f} MiB "
                f"| {m['pss_mib_max']:.1f} MiB | {m['pss_mib_sum']:.1f} MiB | {m['private_dirty_mib_median']:.1f} MiB "
                f"| {cg} | {m['sealed_memfds_mib']:.1f} MiB |"
            )
    if "busy" in res:
        b = res["busy"]
        r += [
            "",
            f"### A busy jailed sandbox ({b['template']['busy_seconds']:.0f} s of `{LOOP}`, tb-size 64; "
            f"1-minute load median {b['loadavg_1m_median']})",
            "",
            "| created by | loops | QEMU RSS max | RSS at the end | cgroup peak | cgroup limit | target "
            "(guest RAM + 128 MiB) | OOM kills |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for k, label in (("template", "default Create (boot template)"), ("booted", "boot path")):
            m = b[k]
            verdict = "within" if m["rss_within_target"] and m["peak_within_target"] else "OVER"
            r.append(
                f"| {label} | {m['loops']} | {m['rss_mib_max']:.1f} MiB | {m['rss_mib_end']:.1f} MiB "
                f"| {m['cgroup_peak_mib']:.1f} MiB | {m['cgroup_limit_mib']} MiB | {m['target_mib']} MiB ({verdict}) "
                f"| {m['oom_kills']} |"
            )
        r += [
            "",
            "A restored guest's pages still shared with the snapshot's sealed memfd are charged to the "
            "supervisor's cgroup (which filled the memfd), not the sandbox's: its cgroup peak counts only what "
            "it wrote, QEMU itself and the translation cache; RSS counts all it maps.",
        ]
    r.append("")
    return "\n".join(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=8, help="timed rounds (each: every measure on both sides)")
    ap.add_argument("--busy-seconds", type=float, default=300.0, help="the busy sandbox's run (0: skip it)")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    res = trio.run(bench, a.n, a.busy_seconds)
    write_results(Path(a.out), "jail", res, markdown(res))


if __name__ == "__main__":
    main()
