"""tmpfs mounts and the ports of restored clones, end to end: a real ``sandvisor serve``
(jailed QEMUs), the CLI and the SDK, real VMs. One supervisor
and one origin sandbox for the module."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from images.build import Image
from supervisor.client import InvalidArgument, Sandbox
from tests.support.vms import serve_process

# answers each connection with "port <n>" (one per guest port)
SERVER = (
    "import socket, sys, threading\n"
    "def serve(p):\n"
    "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "    s.bind(('0.0.0.0', p)); s.listen(8)\n"
    "    while True:\n"
    "        c, _ = s.accept(); c.sendall(b'port %d\\n' % p); c.close()\n"
    "for p in (8000, 8001):\n"
    "    threading.Thread(target=serve, args=(p,)).start()\n"
)


@pytest.fixture(scope="module")
def served(image: Image) -> Iterator[dict[str, str]]:
    with serve_process("sv-mnt-") as (env, _):
        yield env


def cli(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def fetch(port: int, timeout: float = 90) -> bytes:
    """The first line a host port answers, retried until the relay and the guest's server are up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                data = s.recv(100)
                if data:
                    return data
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"host port {port} answered nothing in {timeout} s")
        time.sleep(0.3)


def df_kib(sb: Sandbox, path: str) -> int:
    out = sb.run(["df", "-k", path]).stdout.decode().splitlines()
    return int(out[-1].split()[1])


@pytest.fixture(scope="module")
def origin(served: dict[str, str]) -> Iterator[Sandbox]:
    """Made by the CLI: user-mode networking, a port at create, two tmpfs mounts."""
    r = cli(
        served,
        *("create", "mnt", "--network", "user", "--port", "0:8000"),
        *("--tmpfs", "/scratch:16M", "--tmpfs", "/plain"),
    )
    assert r.returncode == 0, r.stderr
    sb = Sandbox.get("mnt", socket=served["SANDVISOR_SOCKET"])
    try:
        yield sb
    finally:
        sb.remove(force=True)


def test_tmpfs_mounted_with_its_size_limit(origin: Sandbox) -> None:
    assert df_kib(origin, "/scratch") == 16 * 1024
    mounts = {line.split()[1]: line.split() for line in origin.run("cat /proc/mounts").stdout.decode().splitlines()}
    fs, opts = mounts["/scratch"][2], mounts["/scratch"][3].split(",")
    assert fs == "tmpfs" and {"nosuid", "nodev", "size=16384k"} <= set(opts)
    assert origin.run("stat -c %a /scratch").stdout == b"1777\n"  # (the default mode: /proc/mounts omits it)
    assert mounts["/plain"][2] == "tmpfs"  # no size: the kernel's default (half the guest's RAM)
    full = origin.run("dd if=/dev/zero of=/scratch/big bs=1M count=32 2>&1")
    assert full.exit_code != 0 and b"No space left" in full.stdout
    assert origin.run("stat -c %s /scratch/big").stdout == b"16777216\n"
    assert origin.run("rm /scratch/big && echo ok > /scratch/x && cat /scratch/x").stdout == b"ok\n"


def test_bad_tmpfs_refused(served: dict[str, str]) -> None:
    sock = served["SANDVISOR_SOCKET"]
    for bad in ("scratch:16M", "/proc", "/x:lots"):
        with pytest.raises(InvalidArgument):
            Sandbox.create("bad-tmpfs", socket=sock, tmpfs=[bad])
    # mounts are keyed by guest path, a later entry replacing an earlier one (as the
    # microsandbox SDK's WithMounts map): the CLI's two at /a make one
    r = cli(served, "create", "bad-tmpfs", "--tmpfs", "/a:8M", "--tmpfs", "/a/")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(cli(served, "config", "bad-tmpfs").stdout)
    assert [t.rstrip("/") for t in cfg["tmpfs"]] == ["/a"]
    assert cli(served, "rm", "-f", "bad-tmpfs").returncode == 0


def test_restored_clone_keeps_its_ports_and_tmpfs(served: dict[str, str], origin: Sandbox) -> None:
    """Ports given at create and exposed later are both carried, each on a new host port,
    listed by ``port ls``, and served; the clone's tmpfs holds what the origin's did."""
    assert origin.run(f'(python3 -c "{SERVER}" >/dev/null 2>&1 &)').exit_code == 0
    later = cli(served, "port", "add", "mnt", "8001")
    assert later.returncode == 0, later.stderr
    origin_ports = {p.sandbox_port: p.host_port for p in origin.ports()}
    assert set(origin_ports) == {8000, 8001}
    assert fetch(origin_ports[8001]) == b"port 8001\n"
    origin.run("echo kept > /scratch/state")
    snap = origin.checkpoint("mnt-snap")
    with Sandbox.restore(snap, name="mnt-clone", socket=served["SANDVISOR_SOCKET"]) as clone:
        r = cli(served, "port", "ls", "mnt-clone", "--json")
        assert r.returncode == 0, r.stderr
        listed = {p["sandbox_port"]: p["host_port"] for p in json.loads(r.stdout)}
        assert set(listed) == {8000, 8001}
        assert all(listed[p] and listed[p] != origin_ports[p] for p in listed)
        assert fetch(listed[8000]) == b"port 8000\n"  # the server the snapshot holds, at the clone's port
        assert fetch(listed[8001]) == b"port 8001\n"
        assert clone.run("cat /scratch/state").stdout == b"kept\n"
        assert df_kib(clone, "/scratch") == 16 * 1024


def test_multi_name_commands_try_each_name(served: dict[str, str], origin: Sandbox) -> None:
    """rm, stop, kill and start take several names, as docker's do: each is tried, the
    failures named, the exit status 1 if any failed."""
    for command in (("rm", "-f"), ("stop",), ("kill",), ("start",)):
        r = cli(served, *command, "no-such-a", "no-such-b")
        assert r.returncode == 1, (command, r.stderr)
        assert "no-such-a:" in r.stderr and "no-such-b:" in r.stderr, (command, r.stderr)
    r = cli(served, "start", "mnt", "no-such-c")  # a running one cannot start: both reported
    assert r.returncode == 1 and "mnt:" in r.stderr and "no-such-c:" in r.stderr
