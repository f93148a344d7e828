"""Tap networking (TCG), through the supervisor: host <-> sandbox TCP throughput and
connection latency for a tap sandbox (at its address; through its exposed port's
relay; through an nftables DNAT for comparison) vs a user-mode sandbox (its exposed
port: the relay into the jail, slirp's forward there), in one run, rounds
interleaved; the egress policy's cost on connection setup and the DNS proxy's on a
lookup (veth guests, no VM); per-sandbox link setup and the nftables/iproute2 call
costs behind the design.

The supervisor runs in a namespace this script makes (as tests/vm/test_net_supervisor.py
does); every packet stays there or on its loopback.

Usage: python benchmarks/network_tap.py [-n N] [--out docs/results/]
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _harness import main, write_results

from actors.model import Limits, NetMode, Network, PortSpec, SandboxConfig, State
from actors.net import dnsmsg, egress
from actors.net.egress import EgressPolicy
from actors.net.ippool import link_name
from actors.net.netns import NetNS
from actors.net.portfwd import dnat_base, dnat_rules
from actors.sandboxes.sandbox import Sandbox
from supervisor.main.throwaway import supervisor, workdir
from tests.support.netlab import POOL, SERVERS, UPLINK_INET, lab_env, namespaces, probe, resolve

MIB = 16
NAT_ONLY = """table inet floor {
  chain post {
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr 10.88.0.0/16 oifname != "svn*" masquerade
  }
}"""
GUEST_SERVER = """
import socket, sys, threading
BLOB = b"x" * (1 << 20)
def serve(port, fn):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=fn, args=(c,), daemon=True).start()
def hello(c):
    c.sendall(b"x"); c.close()
def source(c):
    n = int(c.recv(16))
    for _ in range(n): c.sendall(BLOB)
    c.close()
def sink(c):
    n = 0
    while d := c.recv(1 << 20): n += len(d)
    c.sendall(str(n).encode()); c.close()
for port, fn in ((7001, hello), (7002, source)):
    threading.Thread(target=serve, args=(port, fn), daemon=True).start()
serve(7003, sink)
"""


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- client side ------------------------------------------------------------------
def _connect(ns: NetNS, addr: str, port: int) -> socket.socket:
    s = ns.socket()
    s.settimeout(30)
    s.connect((addr, port))
    return s


def latency(ns: NetNS, addr: str, port: int) -> float:
    t = time.perf_counter()
    with _connect(ns, addr, port) as s:
        assert s.recv(1) == b"x"
    return time.perf_counter() - t


def download(ns: NetNS, addr: str, port: int, mib: int) -> float:
    t = time.perf_counter()
    n = 0
    with _connect(ns, addr, port) as s:
        s.sendall(str(mib).encode())
        while chunk := s.recv(1 << 20):
            n += len(chunk)
    assert n == mib << 20, n
    return mib / (time.perf_counter() - t)


def upload(ns: NetNS, addr: str, port: int, mib: int) -> float:
    blob = b"y" * (1 << 20)
    t = time.perf_counter()
    with _connect(ns, addr, port) as s:
        for _ in range(mib):
            s.sendall(blob)
        s.shutdown(socket.SHUT_WR)
        got = int(s.recv(64))
    assert got == mib << 20, got
    return mib / (time.perf_counter() - t)


async def path_numbers(ns: NetNS, addr: str, ports: dict[int, int], n: int) -> dict[str, float]:
    run = trio.to_thread.run_sync
    lat = [await run(latency, ns, addr, ports[7001]) for _ in range(n)]
    down = [await run(download, ns, addr, ports[7002], MIB) for _ in range(3)]
    up = [await run(upload, ns, addr, ports[7003], MIB) for _ in range(3)]
    return {"connect_p50_ms": med(lat) * 1e3, "download_mib_s": med(down), "upload_mib_s": med(up)}


# -- the VMs, through the supervisor ---------------------------------------------------
async def in_guest(sb: Sandbox, script: str) -> str:
    res = await sb.guest_call(lambda g: g.channel.run(["sh", "-c", script]))
    if res.exit_code != 0:
        raise RuntimeError(f"{script}: {res.stderr.decode(errors='replace')}")
    return res.stdout.decode()


def exposed(sb: Sandbox) -> dict[int, int]:
    return {p.sandbox_port: p.host_port for p in sb.ports()}


async def bench_vm(n: int, res: dict[str, Any]) -> None:
    ports = tuple(PortSpec(p) for p in (7001, 7002, 7003))
    with namespaces("svh") as (host,), host.entered(), workdir("sv-bench-tap-", private_state=True) as work:
        async with supervisor(work, ip_pool=POOL, dns_upstreams=("127.0.0.1",)) as (_, reg):
            limits = Limits(memory_mib=512)
            t = await reg.create("tap", SandboxConfig(network=Network(NetMode.TAP), limits=limits, ports=ports))
            u = await reg.create("user", SandboxConfig(network=Network(NetMode.USER), limits=limits, ports=ports))
            for sb in (t, u):
                with trio.fail_after(300):
                    await sb.ready_event.wait()
                if sb.state != State.READY:
                    raise RuntimeError(f"{sb.id}: {sb.record.error}")
                await sb.guest_call(lambda g: g.channel.write_file("/tmp/srv.py", GUEST_SERVER.encode()))
                await in_guest(sb, "python3 /tmp/srv.py >/dev/null 2>&1 &")
            hn = reg.settings.hostnet
            assert hn is not None
            # the DNAT variant (not what ExposePort does: see actors/net/portfwd.py), for comparison
            hn.nft.run(dnat_base())
            host.sysctl(f"ipv4/conf/{t.tap_name}/route_localnet", 1)
            dnat_ports = {p: 17000 + p for p in (7001, 7002, 7003)}
            for p, h in dnat_ports.items():
                hn.nft.run(dnat_rules("tcp", h, IPv4Address(t.ip_address), p))
            direct = {p: p for p in (7001, 7002, 7003)}
            paths: dict[str, tuple[NetNS, str, dict[int, int]]] = {
                "tap (host -> sandbox IP)": (host, t.ip_address, direct),
                "tap, exposed port (relay)": (host, "127.0.0.1", exposed(t)),
                "tap, nft DNAT (comparison)": (host, "127.0.0.1", dnat_ports),
                "user, exposed port (relay + slirp in the jail)": (host, "127.0.0.1", exposed(u)),
            }
            for ns, addr, pmap in paths.values():  # each path answers before we time any
                with trio.fail_after(60):
                    while await probe(ns, addr, pmap[7001]) != "x":
                        await trio.sleep(0.3)
            rounds: dict[str, list[dict[str, float]]] = {}
            for _ in range(3):  # interleaved rounds: the machine's noise hits every path alike
                for name, (ns, addr, pmap) in paths.items():
                    rounds.setdefault(name, []).append(await path_numbers(ns, addr, pmap, n))
            res["paths"] = {name: {k: med([r[k] for r in rs]) for k in rs[0]} for name, rs in rounds.items()}
            tap, user = (
                res["paths"]["tap (host -> sandbox IP)"],
                res["paths"]["user, exposed port (relay + slirp in the jail)"],
            )
            res["tap_over_user"] = {
                "connect": user["connect_p50_ms"] / tap["connect_p50_ms"],
                "download": tap["download_mib_s"] / user["download_mib_s"],
                "upload": tap["upload_mib_s"] / user["upload_mib_s"],
            }


# -- policy and DNS costs (veth guests, no VM) ------------------------------------------
def _connect_close(ns: NetNS, addr: str, port: int) -> float:
    t = time.perf_counter()
    with _connect(ns, addr, port) as s:
        s.recv(100)
    return time.perf_counter() - t


async def bench_policy(n: int, res: dict[str, Any]) -> None:
    big_allow = [f"{a}.{b}.0.0/16" for a in (11, 12, 13, 14) for b in range(60)] + [SERVERS[0]]
    big_allow += [f"name{i}.allowed.test" for i in range(10)] + ["allowed.test:80"]
    async with lab_env(timeout=600) as lab:
        plain = lab.guest("plain", None)
        small = lab.guest("small", {"default": "deny", "allow": [SERVERS[0], "allowed.test"]})
        big = lab.guest("big", {"default": "deny", "allow": big_allow, "deny": ["11.0.0.0/8:22"]})
        run = trio.to_thread.run_sync
        cases: dict[str, list[float]] = {}
        for _ in range(3):
            lab.net.nft.run("delete table inet sandvisor")  # the floor: source NAT only, no filter
            lab.net.nft.run(NAT_ONLY)
            cases.setdefault("no filter", []).extend(
                [await run(_connect_close, plain.ns, SERVERS[0], 80) for _ in range(n)]
            )
            lab.net.nft.run("delete table inet floor")
            lab.net.nft.run(egress.base_ruleset(lab.pool.gateway, lab.pool.network))  # the table back
            for g in (plain, small, big):
                lab.net.nft.run(
                    egress.sandbox_rules(g.link.name, g.link.guest.address, g.link.policy, lab.pool.network)
                )
            for name, g in (
                ("default allow", plain),
                ("deny + 2 entries", small),
                (f"deny + {len(big_allow)} entries", big),
            ):
                cases.setdefault(name, []).extend([await run(_connect_close, g.ns, SERVERS[0], 80) for _ in range(n)])
        res["policy_connect_us"] = {k: med(v) * 1e6 for k, v in cases.items()}
        # DNS: the proxy (forward + open the answer in the filter) vs the upstream directly
        gw = str(lab.pool.gateway)
        t_proxy, t_direct = [], []
        for _ in range(n):
            t = time.perf_counter()
            assert (await resolve(small.ns, gw, "allowed.test"))[0] == dnsmsg.NOERROR
            t_proxy.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert (await resolve(plain.ns, UPLINK_INET, "allowed.test"))[0] == dnsmsg.NOERROR
            t_direct.append(time.perf_counter() - t)
        res["dns_lookup_ms"] = {
            "via proxy (allowed, opens the filter)": med(t_proxy) * 1e3,
            "upstream directly": med(t_direct) * 1e3,
        }
        # per-sandbox link setup and teardown (TAP + ip batch + nft transaction)
        setup, teardown = [], []
        for i in range(n):
            addr = lab.pool.allocate(f"setup{i}")
            t = time.perf_counter()
            link = lab.net.open_tap(
                link_name(f"setup{i}"), addr, EgressPolicy.parse({"default": "deny", "allow": big_allow})
            )
            setup.append(time.perf_counter() - t)
            t = time.perf_counter()
            link.close()
            teardown.append(time.perf_counter() - t)
        res["link_ms"] = {
            f"setup (policy of {len(big_allow)} entries)": med(setup) * 1e3,
            "teardown": med(teardown) * 1e3,
        }
        # the tool calls behind the choices
        nft_lib, nft_exec, ip_exec = [], [], []
        lab.net.nft.run("add set inet sandvisor bench { type ipv4_addr; flags timeout; }")
        for i in range(n):
            t = time.perf_counter()
            lab.net.nft.run(f"add element inet sandvisor bench {{ 10.1.{i}.1 timeout 60s }}")
            nft_lib.append(time.perf_counter() - t)
            t = time.perf_counter()
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    str(lab.host.name),
                    "nft",
                    f"add element inet sandvisor bench {{ 10.2.{i}.1 timeout 60s }}",
                ],
                check=True,
            )
            nft_exec.append(time.perf_counter() - t)
            t = time.perf_counter()
            lab.host.ip(f"route add 10.3.{i}.0/24 dev sandvisor0")
            ip_exec.append(time.perf_counter() - t)
        res["tool_call_ms"] = {
            "libnftables (in process)": med(nft_lib) * 1e3,
            "nft (fork+exec, ip netns exec)": med(nft_exec) * 1e3,
            "ip -batch (fork+exec)": med(ip_exec) * 1e3,
        }


async def bench(n: int, out_dir: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"n": n, "transfer_mib": MIB}
    await bench_policy(max(n, 50), res)
    with trio.fail_after(1800):
        await bench_vm(n, res)
    lines = [
        "## Tap networking (TCG; a tap and a user-mode sandbox of one supervisor, 512 MiB each)",
        "",
        f"Host <-> sandbox, medians of 3 interleaved rounds ({n} connects, 3 x {MIB} MiB each way):",
        "",
        "| path | connect + first byte p50 (ms) | download MiB/s | upload MiB/s |",
        "|---|---|---|---|",
    ]
    for name, r in res.get("paths", {}).items():
        lines.append(f"| {name} | {r['connect_p50_ms']:.2f} | {r['download_mib_s']:.1f} | {r['upload_mib_s']:.1f} |")
    ratio = res["tap_over_user"]
    lines += [
        "",
        f"tap at its address vs user mode's exposed port: connect {ratio['connect']:.2f}x faster, "
        f"download {ratio['download']:.2f}x, upload {ratio['upload']:.2f}x.",
    ]
    lines += ["", "Egress policy on connection setup (veth guest, connect + 1 line + close, p50 us):", ""]
    lines += ["| filter | p50 (us) |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in res["policy_connect_us"].items()]
    lines += ["", "| DNS lookup | p50 (ms) |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in res["dns_lookup_ms"].items()]
    lines += ["", "| per sandbox | p50 (ms) |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in res["link_ms"].items()]
    lines += ["", "| one call | p50 (ms) |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in res["tool_call_ms"].items()]
    write_results(out_dir, "network_tap", res, "\n".join(lines) + "\n")
    return res


if __name__ == "__main__":
    main(bench, default_n=20)
