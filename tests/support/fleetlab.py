"""A two-host fleet on one machine: network namespaces on one cluster network (a bridge in a).

    netns svfa-* (host "a")  192.0.2.1/24  <---- veth ---->  192.0.2.2/24  netns svfb-* (host "b")
      sandvisor serve --fleet 192.0.2.1:6390 --fleet-head        sandvisor serve --fleet 192.0.2.1:6390
      (Ray's head + its node, gRPC mTLS on 192.0.2.1:7443)       (Ray worker node, gRPC on 192.0.2.2:7443)
          ^---- veth ----> 192.0.2.3/24  netns svfc-* ("outsider": on the network, no member)

Both members share one Ray token (made here, 0600, given with ``--fleet-token-file``, as
an operator would copy it) and list each other with ``--fleet-peer``. The supervisors run
on :attr:`FleetLab.interpreter`: an interpreter Ray's unprivileged user can execute (the
test's own when it can; else a venv of the system's Python of the same minor version
that reads the test's packages).

Each supervisor runs as ``ip netns exec NS python -m supervisor.main.cli serve ...`` (so its
pid is the supervisor's), on its own throwaway state dir; clients are ``sandvisor
--fleet ...`` (or a Python snippet using ``Fleet``) run in a host's namespace. A CA,
a certificate per node (server and client use: nodes call each other) and a client
certificate are made per run. Everything started is stopped by pid on the way out,
and the namespaces deleted (Ray's processes go with their supervisor: its child
process group). Used by tests/test_fleet.py and benchmarks/fleet.py.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from supervisor.main.throwaway import Workdir, kill_processes, workdir
from supervisor.serve.fleet.rayhost import RayUser, reachable_by
from supervisor.serve.fleet.raynode import ray_dir_for
from tests.support.netlab import namespaces, sh

NET = "192.0.2"  # TEST-NET-1: only ever inside the lab's namespaces
OUTSIDER = f"{NET}.3"
RAY_PORT = 6390
GRPC_PORT = 7443


def make_pki(dir: Path, nodes: dict[str, str]) -> None:
    """ca.pem; NAME.pem/NAME.key per node (its IP as SAN; server and client use);
    client.pem/client.key."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from tests.support.pki import Authority

    ca = Authority("fleet test CA", hours=4)
    (dir / "ca.pem").write_bytes(ca.pem)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    for cn, ip in [*nodes.items(), ("client", None)]:
        sans = [x509.IPAddress(ipaddress.ip_address(ip))] if ip is not None else None
        cert, key = ca.leaf(cn, usages, sans)
        (dir / f"{cn}.pem").write_bytes(cert)
        fd = os.open(dir / f"{cn}.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)


@attrs.define
class Host:
    name: str
    ns: str
    ip: str
    work: Workdir
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.ip}:{GRPC_PORT}"

    @property
    def log(self) -> Path:
        return self.work.root / "serve.log"

    def ray_group(self) -> int | None:
        try:
            return int((self.work.state / "fleet" / "ray.pid").read_text())
        except (OSError, ValueError):
            return None


def others_python(dir: Path) -> str:
    """An interpreter any user may run that imports this test's packages (Ray's user's and
    an attacker's): this one if it can, else a venv of /usr/bin/python3.X (the same X) in
    ``dir`` (0755) whose .pth adds this interpreter's site-packages."""
    import site

    nobody = RayUser("nobody", 65534, 65534)
    if reachable_by(Path(sys.executable), nobody) is None:
        return sys.executable
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    venv = dir / "py"
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True)
    (pth,) = venv.glob("lib/python*/site-packages")
    adds = "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages())
    (pth / "sandvisor-tests.pth").write_text(f"import site; {adds}\n")
    subprocess.run(["chmod", "-R", "a+rX", str(dir)], check=True)
    return str(venv / "bin" / "python")


@attrs.define
class FleetLab:
    hosts: dict[str, Host]
    pki: Path
    outsider: str  # the namespace of a host on the cluster network that is no member
    interpreter: str  # the supervisors' (and Ray's) interpreter
    token: Path

    def ray_address(self) -> str:
        return f"{self.hosts['a'].ip}:{RAY_PORT}"

    def client_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "SANDVISOR_FLEET_CA": str(self.pki / "ca.pem"),
            "SANDVISOR_FLEET_CERT": str(self.pki / "client.pem"),
            "SANDVISOR_FLEET_KEY": str(self.pki / "client.key"),
        }

    def cli(
        self, host: str, *args: str, via: str | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """``sandvisor --fleet ADDRESS ARGS`` run in ``host``'s namespace, asking ``via``'s member
        (default: the same host's)."""
        h = self.hosts[host]
        address = self.hosts[via or host].address
        argv = ["ip", "netns", "exec", h.ns, sys.executable, "-m", "supervisor.main.cli", "--fleet", address, *args]
        return subprocess.run(argv, check=False, env=self.client_env(), capture_output=True, text=True, timeout=timeout)

    def ok(self, host: str, *args: str, via: str | None = None, timeout: float = 600) -> str:
        r = self.cli(host, *args, via=via, timeout=timeout)
        assert r.returncode == 0, f"sandvisor --fleet {' '.join(args)}: exit {r.returncode}: {r.stderr[-2000:]}"
        return r.stdout

    def python(self, host: str, code: str, timeout: float = 600) -> str:
        """A Python snippet (the SDK) in ``host``'s namespace; its stdout."""
        argv = ["ip", "netns", "exec", self.hosts[host].ns, sys.executable, "-c", code]
        r = subprocess.run(argv, check=False, env=self.client_env(), capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    @contextlib.contextmanager
    def events(self, host: str, action: str) -> Iterator[list[dict[str, Any]]]:
        """``sandvisor events --action ACTION --json`` on ``host``'s own socket, read by a
        thread into the list yielded; stopped (by pid) after."""
        argv = [sys.executable, "-m", "supervisor.main.cli", "events", "--action", action, "--json"]
        proc = subprocess.Popen(argv, env=self.hosts[host].work.env(), stdout=subprocess.PIPE, text=True)
        seen: list[dict[str, Any]] = []

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                seen.append(json.loads(line))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            yield seen
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            reader.join(timeout=30)
            assert proc.stdout is not None
            proc.stdout.close()

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """On an error: the supervisors' logs on stdout (pytest shows them with the failure)."""
        try:
            yield
        except BaseException:
            for h in self.hosts.values():
                if h.log.exists():
                    print(f"--- serve on {h.name} ---\n{h.log.read_text()[-6000:]}")
                ray_log = h.work.state / "fleet" / "ray.log"
                if ray_log.exists():
                    print(f"--- Ray on {h.name} ---\n{ray_log.read_text()[-6000:]}")
            raise

    def nodes(self, host: str = "a") -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = json.loads(self.ok(host, "nodes", "--json"))
        return out

    def sandboxes(self, host: str = "a") -> dict[str, dict[str, Any]]:
        return {r["name"]: r for r in json.loads(self.ok(host, "ls", "--json"))}

    def wait_for(self, what: str, check: Any, timeout: float = 300, every: float = 0.5) -> Any:
        """Polls ``check()`` (a remote state: nothing to wait on) until it is truthy."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = check()
            except AssertionError:
                got = None
            if got:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s")
            time.sleep(every)

    def start(self, name: str, *, slots: int = 2, memory_mib: int = 2048, extra: tuple[str, ...] = ()) -> Host:
        h = self.hosts[name]
        head = self.hosts["a"]
        argv = [
            "ip", "netns", "exec", h.ns, self.interpreter, "-m", "supervisor.main.cli", "serve",
            "--accel", "tcg", "--run-root", str(h.work.run_root), "--ip-pool", "none",
            "--grpc", h.address,
            "--grpc-cert", str(self.pki / f"{name}.pem"), "--grpc-key", str(self.pki / f"{name}.key"),
            "--grpc-client-ca", str(self.pki / "ca.pem"),
            "--fleet", f"{head.ip}:{RAY_PORT}", "--advertise", h.address, "--fleet-node", name,
            "--fleet-slots", str(slots), "--fleet-memory", str(memory_mib),
            "--fleet-token-file", str(self.token),
            *(a for other in self.hosts.values() for a in ("--fleet-peer", other.ip)),
            *(["--fleet-head"] if name == "a" else []),
            *extra,
        ]  # fmt: skip
        with open(h.log, "ab") as err:
            h.proc = subprocess.Popen(argv, env=h.work.env(), stderr=err)
        self.wait_for(
            f"host {name} joins the fleet",
            lambda: self._serving(h) and any(n["name"] == name and n["alive"] for n in self.nodes(name)),
            timeout=240,
        )
        return h

    def _serving(self, h: Host) -> bool:
        if h.proc is not None and h.proc.poll() is not None:
            ray_log = h.work.state / "fleet" / "ray.log"
            ray = ray_log.read_text()[-3000:] if ray_log.exists() else ""
            raise RuntimeError(f"serve on host {h.name} exited ({h.proc.returncode}): {h.log.read_text()[-3000:]}{ray}")
        return h.work.socket.exists()

    def kill_host(self, name: str, *, cells: bool = True) -> list[int]:
        """Every process of the host, by pid: the supervisor, Ray's group, the rest of the
        namespace, and (``cells``) its QEMUs and cells -- each in a network namespace of
        its own, found by their cgroups (supervisor/main/throwaway.py): a host that dies takes
        its sandboxes with it. The pids killed."""
        h = self.hosts[name]
        pids: list[int] = []
        if h.proc is not None and h.proc.poll() is None:
            pids.append(h.proc.pid)
            h.proc.kill()
        group = h.ray_group()
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
                pids.append(group)
        out = subprocess.run(["ip", "netns", "pids", h.ns], check=False, capture_output=True, text=True).stdout
        for pid in map(int, out.split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                pids.append(pid)
        if h.proc is not None:
            h.proc.wait(timeout=60)
        if cells:  # (after the supervisor: it starts no more)
            pids.extend(kill_processes(h.work))
        return pids

    def stop(self, name: str) -> None:
        h = self.hosts[name]
        if h.proc is not None and h.proc.poll() is None:
            h.proc.send_signal(signal.SIGTERM)
            try:
                h.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
        self.kill_host(name, cells=False)  # whatever is left in its namespace (its QEMUs: its own to stop)
        shutil.rmtree(ray_dir_for(h.work.run_root), ignore_errors=True)  # (a killed one's Ray session)


@contextlib.contextmanager
def fleet_lab(tmp: Path) -> Iterator[FleetLab]:
    with contextlib.ExitStack() as stack:
        a_ns, b_ns, c_ns = stack.enter_context(namespaces("svfa", "svfb", "svfc"))
        assert a_ns.name and b_ns.name and c_ns.name
        a = a_ns.name
        sh("ip", "-n", a, "link", "add", "flbr", "type", "bridge")
        for peer_ns, dev in ((b_ns.name, "fl1"), (c_ns.name, "fc1")):
            sh("ip", "-n", a, "link", "add", f"{dev}a", "type", "veth", "peer", "name", dev, "netns", peer_ns)
            sh("ip", "-n", a, "link", "set", f"{dev}a", "master", "flbr")
            sh("ip", "-n", a, "link", "set", f"{dev}a", "up")
        for ns, dev, ip in ((a, "flbr", f"{NET}.1"), (b_ns.name, "fl1", f"{NET}.2"), (c_ns.name, "fc1", OUTSIDER)):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        pki = tmp / "pki"
        pki.mkdir()
        make_pki(pki, {"a": f"{NET}.1", "b": f"{NET}.2"})
        token = pki / "ray-token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        shared = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sv-fleet-py-")))
        shared.chmod(0o755)
        hosts = {
            "a": Host("a", a_ns.name, f"{NET}.1", stack.enter_context(workdir("sv-fleet-a-"))),
            "b": Host("b", b_ns.name, f"{NET}.2", stack.enter_context(workdir("sv-fleet-b-"))),
        }
        lab = FleetLab(hosts, pki, c_ns.name, others_python(shared), token)
        try:
            yield lab
        finally:
            for name in ("b", "a"):  # workers first, the head last
                lab.stop(name)


# A would-be Ray driver: connects (the GCS, or Ray Client with ray://) and asks for a task on
# node b that tells the uid it ran as. Prints RAN <uid>, or REFUSED and why.
ATTACK = """
import os, sys
import ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False, include_dashboard=False)

    @ray.remote(num_cpus=0, resources={"sandvisor_node:b": 0.001})
    def who():
        return os.getuid()

    print("RAN", ray.get(who.remote(), timeout=180), flush=True)
except BaseException as exc:
    print("REFUSED", type(exc).__name__, str(exc)[:500].replace(chr(10), " "), flush=True)
"""


def attack_argv(lab: FleetLab, ns: str, address: str, *, uid: int | None) -> list[str]:
    """The would-be driver in namespace ``ns``, as ``uid`` (None: root)."""
    who = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return ["ip", "netns", "exec", ns, *who, lab.interpreter, "-c", ATTACK, address]


def attack_env(dir: Path, token: Path | None, tls: Path | None) -> dict[str, str]:
    """A clean environment for a would-be driver (its temp files in ``dir``): Ray's token
    mode on; ``token``, the token file it presents; ``tls``, a dir with ca.pem, node.pem and
    node.key it presents for Ray's TLS (None: neither)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(dir), "TMPDIR": str(dir), "RAY_TMPDIR": str(dir)}
    env["RAY_gcs_rpc_server_reconnect_timeout_s"] = "20"  # (a refused driver gives up sooner)
    env["RAY_AUTH_MODE"] = "token"
    if token is not None:
        env["RAY_AUTH_TOKEN_PATH"] = str(token)
    if tls is not None:
        env |= {
            "RAY_USE_TLS": "1",
            "RAY_TLS_CA_CERT": str(tls / "ca.pem"),
            "RAY_TLS_SERVER_CERT": str(tls / "node.pem"),
            "RAY_TLS_SERVER_KEY": str(tls / "node.key"),
        }
    return env


def run_attacks(cases: dict[str, tuple[list[str], dict[str, str]]], timeout: float = 300) -> dict[str, str]:
    """Every case at once (each is slow to give up); case -> its last output line (or TIMEOUT)."""
    procs = {
        name: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, (argv, env) in cases.items()
    }
    out: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = stdout.strip().splitlines()
            # (Ray's C++ side may abort the process instead: its last words then)
            out[name] = lines[-1] if lines else f"EXIT {proc.returncode}: {stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out[name] = "TIMEOUT"
    return out


def listeners(ns: str) -> list[tuple[int, set[int]]]:
    """(port, pids) of every TCP listener in namespace ``ns``."""
    import re

    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Hltnp"], check=True, capture_output=True, text=True)
    rows = []
    for line in out.stdout.splitlines():
        local = line.split()[3]
        rows.append((int(local.rpartition(":")[2]), {int(p) for p in re.findall(r"pid=(\d+)", line)}))
    return rows


def group_pids(pgid: int) -> list[int]:
    """Every live process of process group ``pgid``."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                pids.append(int(d.name))
    return pids


def uids(pid: int) -> set[int]:
    """Real, effective, saved and fs uids of ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return {int(u) for u in line.split()[1:]}
    raise AssertionError(f"no Uid line for {pid}")
