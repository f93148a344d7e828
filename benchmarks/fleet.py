"""The fleet (TCG, two hosts as two network namespaces on one machine; tests/support/fleetlab.py):

* fleet Create against a direct Create on the same node: both through the node's gRPC
  (mTLS), both to ready; the fleet's adds the Reserve (Ray placement group, KV records)
  through a member. Rounds interleaved, each sandbox removed right after;
* name lookup (FleetService/Resolve through a member: Ray's KV);
* snapshot transfer between the hosts (FleetService/Fetch on b: ExportSnapshot on a,
  digest-checked import on b, over the veth with mTLS);
* placement spread: 32 reservations (Ray's scheduler, no VMs: each released after the
  count) over 2 nodes of 32 slots each, and 32 over 16 + 16.

The measuring runs as a client process inside host a's namespace (``--inner``).

Usage: python benchmarks/fleet.py [-n N] [--out docs/results/]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def inner(a_address: str, b_address: str, n: int) -> dict[str, Any]:
    """In host a's namespace: the measurements, as JSON-able numbers."""
    from supervisor.client.fleet import Fleet, FleetTls
    from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as sb_pb
    from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as pb

    tls = FleetTls.from_files(*(os.environ[f"SANDVISOR_FLEET_{k}"] for k in ("CA", "CERT", "KEY")))
    fleet = Fleet(a_address, tls=tls)
    node = fleet._node(a_address)
    mem = 128

    def direct(name: str) -> float:
        t = time.perf_counter()
        base = sb_pb.CreateSandboxRequest(id=name, limits=sb_pb.ResourceLimits(memory_mib=mem))
        fleet._call(node.sandvisor.Create, pb.CreateRequest(base=base))
        from supervisor.client.fleet import FleetSandbox

        sb = FleetSandbox(fleet, pb.FleetSandbox(name=name, node="a", address=a_address, state="placed"))
        sb.wait_ready()
        dt = time.perf_counter() - t
        sb.remove()
        return dt

    def via_fleet(name: str) -> tuple[float, float]:
        t = time.perf_counter()
        lease = fleet.reserve(name, memory_mib=mem, node="a")
        reserve = time.perf_counter() - t
        base = sb_pb.CreateSandboxRequest(id=name, limits=sb_pb.ResourceLimits(memory_mib=lease.memory_mib))
        fleet._call(node.sandvisor.Create, pb.CreateRequest(base=base))
        sb = fleet.get(name)
        sb.wait_ready()
        dt = time.perf_counter() - t
        sb.remove()
        return dt, reserve

    direct("warm-0")  # the boot template of this configuration, made once
    d, f, r = [], [], []
    for i in range(n):
        d.append(direct(f"d{i}"))
        fd, fr = via_fleet(f"f{i}")
        f.append(fd)
        r.append(fr)
        while any(s.name == f"f{i}" for s in fleet.ls()):  # the node gives the slot back (an event)
            time.sleep(0.05)

    keep = fleet.create("lookup-me", memory_mib=256, node="a")  # (its snapshots go a -> b)
    lookups = []
    for _ in range(max(50, n * 10)):
        t = time.perf_counter()
        fleet.get("lookup-me")
        lookups.append(time.perf_counter() - t)

    # snapshot transfer a -> b (fresh snapshots: b caches what it pulled)
    transfers = []
    keep.run(["sh", "-c", "head -c 64M /dev/urandom > /root/blob && sync"])
    for i in range(3):
        snap = keep.checkpoint(f"t{i}")
        t = time.perf_counter()
        out = fleet.fetch(b_address, snap)
        wall = time.perf_counter() - t
        transfers.append({"bytes": out.bytes, "seconds": wall, "mib_s": out.bytes / 2**20 / wall})
    keep.remove()

    def spread(count: int, prefix: str) -> dict[str, int]:
        names = [f"{prefix}{i}" for i in range(count)]
        nodes = Counter(fleet.reserve(nm, memory_mib=mem).node for nm in names)
        for nm in names:
            fleet.release(nm)
        return dict(sorted(nodes.items()))

    placement = {"32 over 32+32 slots": spread(32, "p")}
    fleet.close()
    return {
        "create_direct_s": statistics.median(d),
        "create_fleet_s": statistics.median(f),
        "reserve_s": statistics.median(r),
        "ratio": statistics.median(f) / statistics.median(d),
        "create_direct_all": d,
        "create_fleet_all": f,
        "lookup_ms_p50": statistics.median(lookups) * 1000,
        "lookup_ms_p99": sorted(lookups)[int(0.99 * (len(lookups) - 1))] * 1000,
        "transfers": transfers,
        "placement": placement,
    }


def outer(n: int, out: Path) -> None:
    from _harness import write_results

    from tests.support.fleetlab import fleet_lab

    with tempfile.TemporaryDirectory() as tmp, fleet_lab(Path(tmp)) as lab, lab.reporting():
        lab.start("a", slots=32, memory_mib=32 * 128)
        lab.start("b", slots=32, memory_mib=32 * 128)
        argv = [
            "ip", "netns", "exec", lab.hosts["a"].ns, sys.executable, __file__,
            "--inner", lab.hosts["a"].address, lab.hosts["b"].address, "-n", str(n),
        ]  # fmt: skip
        r = subprocess.run(argv, env=lab.client_env(), capture_output=True, text=True, check=False, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-4000:])
        res = json.loads(r.stdout.strip().splitlines()[-1])
    tr = res["transfers"]
    md = "\n".join(
        [
            "# Fleet (two hosts as two network namespaces, TCG, 2 cores shared)",
            "",
            f"Fleet Create (Reserve through a member + Create on the node, to ready) "
            f"{res['create_fleet_s'] * 1000:.0f} ms vs direct Create on the same node "
            f"{res['create_direct_s'] * 1000:.0f} ms (median of {n}): ratio {res['ratio']:.2f}; "
            f"the Reserve alone {res['reserve_s'] * 1000:.1f} ms.",
            "",
            f"Name lookup (Resolve through a member, Ray KV): p50 {res['lookup_ms_p50']:.2f} ms, "
            f"p99 {res['lookup_ms_p99']:.2f} ms.",
            "",
            "Snapshot transfer a -> b (Fetch on b: export on a, digest-checked import on b, mTLS over the veth): "
            + ", ".join(f"{t['bytes'] / 2**20:.0f} MiB in {t['seconds']:.2f} s ({t['mib_s']:.0f} MiB/s)" for t in tr),
            "",
            f"Placement of 32 reservations over 2 nodes of 32 slots each: {res['placement']}.",
            "",
        ]
    )
    write_results(out, "fleet", res, md)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--out", default="results")
    ap.add_argument("--inner", nargs=2, metavar=("A", "B"))
    a = ap.parse_args()
    if a.inner:
        print(json.dumps(inner(a.inner[0], a.inner[1], a.n)))
    else:
        outer(a.n, Path(a.out))


if __name__ == "__main__":
    main()
