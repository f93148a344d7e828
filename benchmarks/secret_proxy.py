"""The secret proxy's cost, TCG, through the whole supervisor: HTTPS from a
tap sandbox's guest to one stand-in server (tests/support/httpslab.py, in a namespace this
script makes), three ways, rounds interleaved:

- ``intercepted``: api.test:443, named by the sandbox's secret: the proxy terminates
  TLS with a leaf of the sandbox's CA, puts the value in, and opens its own verified
  TLS to the server;
- ``spliced``: plain.test:443 (the same server), named by no secret: the proxy peeks
  the ClientHello and splices bytes (no TLS termination);
- ``direct``: api.test:8443 (the same server, a port no secret names): not redirected
  at all, the guest's own TLS.

Latency: a fresh connection per request (TCP, TLS handshake, one GET), from the
guest's Python (one exec for the whole series); p50 and p95 and their ratios to
``direct``. Throughput: a 64 MiB download by the guest's curl, intercepted vs direct
(and spliced).

(Not benchmarks/secrets.py: the script's directory is first on sys.path, and that name
would shadow the standard library's ``secrets`` for every module it imports.)

Usage: python benchmarks/secret_proxy.py [-n N] [--out docs/results/]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _harness import main, write_results

from actors.model import NetMode, Network, SandboxConfig, State
from actors.secrets.model import SecretRef
from supervisor.main.throwaway import supervisor, workdir
from tests.support.httpslab import https_server
from tests.support.netlab import POOL, UPLINK_INET, dns_server, link_internet, namespaces

DOWNLOAD = 64 << 20
GUEST = r"""
import http.client, json, os, ssl, sys, time
n, rounds = int(sys.argv[1]), int(sys.argv[2])
system = ssl.create_default_context()                       # the guest's store: the sandbox CA in it
test_ca = ssl.create_default_context(cafile="/tmp/test-ca.pem")  # the real server's CA alone
ways = {"intercepted": ("api.test", 443, system), "spliced": ("plain.test", 443, test_ca),
        "direct": ("api.test", 8443, test_ca)}
auth = {"Authorization": "Bearer " + os.environ["TOKEN"]}
def get(host, port, ctx, path):
    t = time.perf_counter()
    c = http.client.HTTPSConnection(host, port, context=ctx, timeout=120)
    c.request("GET", path, headers=auth)
    r = c.getresponse()
    size = 0
    while chunk := r.read(1 << 20):
        size += len(chunk)
    c.close()
    assert r.status == 200, r.status
    return time.perf_counter() - t, size
lat = {w: [] for w in ways}
for _ in range(n):
    for w, (h, p, ctx) in ways.items():
        lat[w].append(get(h, p, ctx, "/x")[0])
import subprocess
cafiles = {"intercepted": "/etc/sandvisor/ca-bundle.pem", "spliced": "/tmp/test-ca.pem", "direct": "/tmp/test-ca.pem"}
dl = {w: [] for w in ways}
for _ in range(rounds):  # curl (C, OpenSSL): the guest's Python would be the bottleneck here
    for w, (h, p, ctx) in ways.items():
        argv = ["curl", "-sS", "--cacert", cafiles[w], "-o", "/dev/null", "-w", "%{time_total} %{size_download}",
                "https://%s:%d/bytes/%d" % (h, p, 64 << 20)]
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        t, size = out.split()
        assert int(size) == 64 << 20, out
        dl[w].append(float(t))
print(json.dumps({"latency": lat, "download": dl}))
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    rounds = 3
    with namespaces("svh", "svi") as (host, inet):
        link_internet(host, inet)
        with host.entered():
            async with trio.open_nursery() as nursery:
                server = await nursery.start(https_server, inet, "0.0.0.0")
                await nursery.start(
                    lambda task_status: https_server(inet, "0.0.0.0", 8443, ca=server.ca, task_status=task_status)
                )
                await nursery.start(dns_server, inet, UPLINK_INET)
                with workdir("sv-bench-secrets-", private_state=True) as work:
                    (work.root / "ca.pem").write_bytes(server.ca_pem())
                    opts: dict[str, Any] = {
                        "ip_pool": POOL,
                        "dns_upstreams": (UPLINK_INET,),
                        "upstream_ca": work.root / "ca.pem",
                        "stop_timeout": 5,
                    }
                    async with supervisor(work, **opts) as (_, reg):
                        config = SandboxConfig(
                            network=Network(mode=NetMode.TAP), secrets=(SecretRef("TOKEN", ("api.test",)),)
                        )
                        sb = await reg.create("bench", config, {"TOKEN": b"sk-bench-value-0123456789"})
                        with trio.fail_after(300):
                            await sb.ready_event.wait()
                        assert sb.state == State.READY, sb.record.error
                        await sb.guest_call(lambda g: g.channel.write_file("/tmp/bench.py", GUEST.encode()))
                        await sb.guest_call(lambda g: g.channel.write_file("/tmp/test-ca.pem", server.ca_pem()))
                        out = b""
                        with trio.fail_after(3600):
                            async for stream, data, _code in sb.run_workload(
                                ["python3", "/tmp/bench.py", str(n), str(rounds)], env={}
                            ):
                                if stream == "stdout":
                                    out += data
                                elif stream == "stderr":
                                    sys.stderr.buffer.write(data)
                        raw = json.loads(out)
                        await reg.remove("bench", force=True)
                nursery.cancel_scope.cancel()
    lat, dl = raw["latency"], raw["download"]
    res: dict[str, Any] = {"n": n, "rounds": rounds, "raw": raw}
    for w in lat:
        res[f"{w}_p50_ms"] = pct(lat[w], 0.5) * 1e3
        res[f"{w}_p95_ms"] = pct(lat[w], 0.95) * 1e3
        res[f"{w}_mib_s"] = statistics.median(DOWNLOAD / s / (1 << 20) for s in dl[w])
    for w in ("intercepted", "spliced"):
        res[f"{w}_p50_ratio"] = res[f"{w}_p50_ms"] / res["direct_p50_ms"]
        res[f"{w}_p95_ratio"] = res[f"{w}_p95_ms"] / res["direct_p95_ms"]
        res[f"{w}_throughput_ratio"] = res[f"{w}_mib_s"] / res["direct_mib_s"]
    rows = "\n".join(
        f"| {w} | {res[f'{w}_p50_ms']:.1f} | {res[f'{w}_p95_ms']:.1f} | "
        f"{res.get(f'{w}_p50_ratio', 1.0):.2f} / {res.get(f'{w}_p95_ratio', 1.0):.2f} | "
        f"{res[f'{w}_mib_s']:.1f} | {res.get(f'{w}_throughput_ratio', 1.0):.2f} |"
        for w in ("direct", "spliced", "intercepted")
    )
    md = f"""# The secret proxy (benchmarks/secret_proxy.py)

TCG, shared loaded 2-core machine; one tap sandbox with a secret for api.test, the
stand-in server in a namespace; {n} fresh-connection HTTPS requests per way (rounds
interleaved; the guest's Python), {rounds} downloads of 64 MiB per way (the guest's curl).

| way | p50 ms | p95 ms | ratio to direct p50 / p95 | 64 MiB download MiB/s | throughput ratio |
|---|---|---|---|---|---|
{rows}
"""
    write_results(out_dir, "secret_proxy", res, md)
    return res


if __name__ == "__main__":
    main(bench, default_n=40)
