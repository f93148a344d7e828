"""Tap networking (TCG): host <-> sandbox TCP throughput and connection latency for
tap vs user mode (slirp) vs passt, in one boot of one guest with three NICs; the
port-exposure variants on tap (direct, userspace relay, nftables DNAT); the egress
policy's cost on connection setup and the DNS proxy's on a lookup (veth guests, no
VM); per-sandbox link setup and the nftables/iproute2 call costs behind the design.

Every packet stays on loopback or inside namespaces this script makes (the lab of
tests/netlab.py): the TAP lives in the lab's "host" namespace; slirp's and passt's
forwarded ports listen on 127.0.0.1.

Usage: python benchmarks/network_tap.py [-n N] [--out results/]
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _harness import main, write_results

from actors import dnsmsg as D
from actors import egress
from actors.disk import backing_chain, create_overlay
from actors.egress import EgressPolicy
from actors.ippool import link_name
from actors.machine import Machine, MachineSpec, qmp_loop
from actors.netns import NetNS
from actors.portfwd import Target, bind_listener, dnat_base, dnat_rules, relay_tcp
from actors.sandbox import free_port
from actors.vm import Guest, _running, kernel_cmdline
from images.build import Builder, default_cache
from tests.netlab import SERVERS, UPLINK_INET, lab_env, probe, resolve

MIB = 16
NAT_ONLY = """table inet floor {
  chain post {
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr 10.88.0.0/16 oifname != "svn*" masquerade
  }
}"""
SNIPPET = Path(__file__).resolve().parent.parent / "contrib" / "guestd_netcfg.py"
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


@attrs.frozen
class FdSpec(MachineSpec):
    """MachineSpec plus descriptors for the -netdev arguments (``{fd:NAME}``)."""

    net_fds: tuple[tuple[str, int], ...] = ()

    def open_files(self) -> dict[str, int]:
        fds = super().open_files()
        for name, fd in self.net_fds:
            fds[f"net:{name}"] = os.dup(fd)
        return fds

    def argv(self, run_dir: Path, qmp_fd: int, console_fd: int, fds: dict[str, int] | None = None) -> list[str]:
        a = super().argv(run_dir, qmp_fd, console_fd, fds)
        for key, fd in (fds or {}).items():
            if key.startswith("net:"):
                a = [x.replace("{fd:" + key[4:] + "}", str(fd)) for x in a]
        return a


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


# -- the VM -------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def passt_process(fd: int, forwards: dict[int, int]) -> AsyncIterator[subprocess.Popen[bytes]]:
    argv = ["passt", "-f", "-q", "-4", "--fd", str(fd), "-a", "10.0.3.15", "-n", "24", "-g", "10.0.3.2"]
    argv += ["--no-dhcp", "-u", "none"]
    for g, h in forwards.items():
        argv += ["-t", f"127.0.0.1/{h}:{g}"]
    p = subprocess.Popen(argv, pass_fds=(fd,), stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


async def in_guest(guest: Guest, script: str) -> str:
    res = await guest.channel.run(["sh", "-c", script])
    if res.exit_code != 0:
        raise RuntimeError(f"{script}: {res.stderr.decode(errors='replace')}")
    return res.stdout.decode()


async def bench_vm(lab: Any, n: int, res: dict[str, Any], work: Path) -> None:
    image = Builder(default_cache()).build()
    address = lab.pool.allocate("bench-vm")
    link = lab.net.open_tap(link_name("bench-vm"), address, EgressPolicy.parse(None))
    user_fwd = {p: free_port("127.0.0.1", "tcp") for p in (7001, 7002, 7003)}
    passt_fwd = {p: free_port("127.0.0.1", "tcp") for p in (7001, 7002, 7003)}
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        overlay = work / "disk.qcow2"
        work.mkdir(parents=True, exist_ok=True)
        await create_overlay(image.rootfs, overlay)
        hostfwd = "".join(f",hostfwd=tcp:127.0.0.1:{h}-:{g}" for g, h in user_fwd.items())
        netdev = (
            *link.netdev_args("{fd:tap}"),  # type: ignore[arg-type]
            "-netdev",
            f"user,id=u0,net=10.0.2.0/24,restrict=on{hostfwd}",
            "-device",
            "{net},netdev=u0,mac=52:54:00:12:34:56",
            "-netdev",
            "stream,id=p0,server=off,addr.type=fd,addr.str={fd:passt}",
            "-device",
            "{net},netdev=p0,mac=52:54:00:12:34:57",
        )
        assert link.tap_fd is not None
        spec = FdSpec(
            kernel=image.kernel,
            initrd=image.initrd,
            disk=overlay,
            disk_chain=backing_chain(overlay),
            memory_mib=512,
            append=kernel_cmdline("tcg", hostname="bench"),
            netdev=netdev,
            net_fds=(("tap", link.tap_fd), ("passt", mine.fileno())),
        )
        vm = Machine(spec, work, name="bench")
        async with passt_process(theirs.fileno(), passt_fwd), _running(vm, time.monotonic(), 120, None) as guest:
            theirs.close()
            await guest.channel.write_file("/tmp/netcfg.py", SNIPPET.read_bytes())
            await guest.channel.write_file("/tmp/srv.py", GUEST_SERVER.encode())
            g = link.guest
            by_mac = {}
            for line in (
                await in_guest(guest, "for d in /sys/class/net/eth*; do echo $d $(cat $d/address); done")
            ).split("\n"):
                if line.strip():
                    path, mac = line.split()
                    by_mac[mac] = path.rsplit("/", 1)[1]
            await in_guest(guest, f"python3 /tmp/netcfg.py {by_mac['52:54:00:12:34:56']} 10.0.2.15 24 - -")
            await in_guest(guest, f"python3 /tmp/netcfg.py {by_mac['52:54:00:12:34:57']} 10.0.3.15 24 - -")
            await in_guest(guest, f"python3 /tmp/netcfg.py {by_mac[g.mac]} {g.address} {g.prefix} {g.gateway}")
            await in_guest(guest, "python3 /tmp/srv.py >/dev/null 2>&1 &")
            # passt learns the guest's MAC from the guest's first frame: send one (ARP + UDP)
            hail = "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('10.0.3.2', 9))"
            await in_guest(guest, f'python3 -c "{hail}"')
            root = NetNS()
            direct = {p: p for p in (7001, 7002, 7003)}
            with trio.fail_after(60):
                while await probe(lab.host, str(g.address), 7001) != "x":
                    await trio.sleep(0.3)
            # the exposure variants on tap: userspace relay and nftables DNAT
            relay_ports: dict[int, int] = {}
            async with trio.open_nursery() as nursery:
                for p in (7001, 7002, 7003):
                    lst = bind_listener("127.0.0.1", 0, socket.SOCK_STREAM, lab.host)
                    relay_ports[p] = await nursery.start(relay_tcp, lst, Target(str(g.address), p, lab.host))
                lab.net.nft.run(dnat_base())
                lab.host.sysctl(f"ipv4/conf/{link.name}/route_localnet", 1)
                dnat_ports = {p: 17000 + p for p in (7001, 7002, 7003)}
                for p, h in dnat_ports.items():
                    lab.net.nft.run(dnat_rules("tcp", h, g.address, p))
                rounds: dict[str, list[dict[str, float]]] = {}
                paths: dict[str, tuple[NetNS, str, dict[int, int]]] = {
                    "tap (host -> sandbox IP)": (lab.host, str(g.address), direct),
                    "tap via relay (127.0.0.1)": (lab.host, "127.0.0.1", relay_ports),
                    "tap via nft DNAT (127.0.0.1)": (lab.host, "127.0.0.1", dnat_ports),
                    "user (slirp hostfwd)": (root, "127.0.0.1", user_fwd),
                    "passt (-netdev stream)": (root, "127.0.0.1", passt_fwd),
                }
                for name, (ns, addr, ports) in list(paths.items()):  # each path answers before we time any
                    with trio.move_on_after(30):
                        while (got := await probe(ns, addr, ports[7001])) != "x":
                            await trio.sleep(0.3)
                    if got != "x":
                        print(f"{name}: not reachable ({got}); left out", file=sys.stderr)
                        res.setdefault("unreachable", {})[name] = got
                        del paths[name]
                for _ in range(3):  # interleaved rounds: the machine's noise hits every path alike
                    for name, (ns, addr, ports) in paths.items():
                        try:
                            rounds.setdefault(name, []).append(await path_numbers(ns, addr, ports, n))
                        except (AssertionError, OSError, ValueError) as exc:
                            print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                            res.setdefault("errors", {}).setdefault(name, []).append(f"{type(exc).__name__}: {exc}")
                nursery.cancel_scope.cancel()
            res["paths"] = {name: {k: med([r[k] for r in rs]) for k in rs[0]} for name, rs in rounds.items()}
    finally:
        link.close()
        mine.close()
        with contextlib.suppress(OSError):
            theirs.close()


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
            assert (await resolve(small.ns, gw, "allowed.test"))[0] == D.NOERROR
            t_proxy.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert (await resolve(plain.ns, UPLINK_INET, "allowed.test"))[0] == D.NOERROR
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
    work = Path("/tmp") / f"sv-nettap-{os.getpid()}"
    try:
        async with qmp_loop(), lab_env(timeout=1500) as lab:
            with trio.fail_after(1200):
                await bench_vm(lab, n, res, work)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    lines = [
        "## Tap networking (TCG, one guest with a TAP, a slirp and a passt NIC)",
        "",
        f"Host <-> sandbox, medians of 3 interleaved rounds ({n} connects, 3 x {MIB} MiB each way):",
        "",
        "| path | connect + first byte p50 (ms) | download MiB/s | upload MiB/s |",
        "|---|---|---|---|",
    ]
    for name, r in res.get("paths", {}).items():
        lines.append(f"| {name} | {r['connect_p50_ms']:.2f} | {r['download_mib_s']:.1f} | {r['upload_mib_s']:.1f} |")
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
