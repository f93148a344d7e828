"""A fleet of two hosts placed by Ray's scheduler, with real VMs (docs/fleet.md).

First, who the fleet's Ray cluster refuses: an unprivileged local user on member b and a
host on the cluster network that is no member each try to run a Ray task through the
head's GCS port and through the Ray Client port, and fail; so does root on b without the
token. Root on b with the token runs one, as Ray's own user, not root. Ray's processes
are that user's, its dir is theirs and private, its ports are the pinned ones, and the
token is on no command line.

Two network namespaces joined by a veth act as two hosts (tests/fleetlab.py): Ray's
head and a supervisor with 2 slots in "a", a Ray worker and a supervisor with 2 slots
in "b". One cluster for the module, one test that walks through it in order (it ends
by killing host b): four fleet Creates use both hosts, a fifth waits and then gets
RESOURCE_EXHAUSTED; every sandbox is found by name and runs a command from the other
host's client; a checkpoint taken on a is restored on b (pulled node to node) with its
state; host b's processes are killed by pid: its sandboxes are reported lost (records
and a ``lost`` event on a member's Events), their slots freed, and the checkpoint is restored on a.

Synchronous (the clients are CLI processes and SDK snippets in the hosts' namespaces):
every subprocess has a timeout, every wait for a remote state a deadline (large: two
supervisors, Ray and four TCG guests on a loaded 2-core machine). Run it under
``flock /tmp/sandvisor-net.lock``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors import defaults
from supervisor.serve.fleet.rayhost import RayPorts
from supervisor.serve.fleet.raynode import ray_dir_for
from tests.support.fleetlab import (
    GRPC_PORT,
    OUTSIDER,
    RAY_PORT,
    FleetLab,
    attack_argv,
    attack_env,
    fleet_lab,
    group_pids,
    listeners,
    run_attacks,
    uids,
)

pytestmark = [
    pytest.mark.vm,
    pytest.mark.host,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the fleet extra (ray) is not installed"),
]

MEMORY = "256"  # MiB per guest: four of them and Ray on a shared machine


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetLab]:
    with fleet_lab(Path(tmp_path_factory.mktemp("fleet"))) as lab:
        with lab.reporting():
            lab.start("a")
            lab.start("b")
        yield lab


def _slots_used(lab: FleetLab, node: str) -> int:
    return next(int(n["slots_used"]) for n in lab.nodes("a") if n["name"] == node)


def test_ray_refuses_local_users_outsiders_and_no_token(lab: FleetLab) -> None:
    """(First: the walk below ends by killing host b.)"""
    with lab.reporting():
        _ray_is_closed(lab)


def _ray_is_closed(lab: FleetLab) -> None:
    ray_uid = pwd.getpwnam(defaults.FLEET_RAY_USER).pw_uid
    token = lab.token.read_text().strip()
    ports = RayPorts(RAY_PORT)
    allowed = {RAY_PORT, GRPC_PORT} | {int(p) for p in ports.all() if "-" not in p}
    lo, hi = ports.workers
    for h in lab.hosts.values():
        group = h.ray_group()
        assert group is not None
        pids = group_pids(group)
        assert len(pids) >= 3, pids  # ray start, the raylet, its agents (and the GCS on a)
        for pid in pids:
            assert uids(pid) == {ray_uid}, (h.name, pid, Path(f"/proc/{pid}/cmdline").read_bytes())
            assert token.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        # Ray's dir: its user's, private, under the run root (not /tmp's shared space)
        st = ray_dir_for(h.work.run_root).stat()
        assert st.st_uid == ray_uid and st.st_mode & 0o777 == 0o700
        # every listener of the host is a pinned port (the driver's in the workers' range),
        # none is Ray Client's
        for port, _ in listeners(h.ns):
            assert port in allowed or lo <= port <= hi, (h.name, port, listeners(h.ns))
        assert all(port != RayPorts.RAY_CLIENT for port, _ in listeners(h.ns))
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):  # the token is on no command line
        try:
            assert token.encode() not in cmdline.read_bytes(), cmdline
        except OSError:
            continue
    # Ray's user reaches none of the supervisor's state
    state = lab.hosts["b"].work.state
    r = subprocess.run(["setpriv", f"--reuid={ray_uid}", f"--regid={ray_uid}", "--clear-groups", "ls", str(state)],
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode != 0 and "Permission denied" in r.stderr, r

    gcs, client = lab.ray_address(), f"ray://{lab.hosts['a'].ip}:{RayPorts.RAY_CLIENT}"
    b, c = lab.hosts["b"].ns, lab.outsider
    with tempfile.TemporaryDirectory(prefix="sv-fleet-attack-") as tmp:
        dir = Path(tmp)
        dir.chmod(0o1777)
        # the worst case: the token and b's Ray certificate leaked to the attackers (readable by all)
        leaked = dir / "leaked"
        leaked.mkdir(mode=0o755)
        for src, name in ((lab.token, "token"), (lab.pki / "ca.pem", "ca.pem"), (lab.pki / "b.pem", "node.pem")):
            shutil.copy(src, leaked / name)
        shutil.copy(lab.pki / "b.key", leaked / "node.key")
        wrong = leaked / "wrong-token"
        wrong.write_text("0" * 64)
        for f in leaked.iterdir():
            f.chmod(0o644)
        token_file = leaked / "token"
        cases = {
            # refused by the filter on b (a local uid that is neither root nor Ray's)
            "nobody on b, GCS": (attack_argv(lab, b, gcs, uid=65534), attack_env(dir, token_file, leaked)),
            "nobody on b, Ray Client": (attack_argv(lab, b, client, uid=65534), attack_env(dir, token_file, leaked)),
            # refused by the filter on a (no peer)
            "outsider, GCS": (attack_argv(lab, c, gcs, uid=None), attack_env(dir, token_file, leaked)),
            "outsider, Ray Client": (attack_argv(lab, c, client, uid=None), attack_env(dir, token_file, leaked)),
            # let through by the filters; refused by Ray's token check, by Ray's TLS
            "root on b, a wrong token": (attack_argv(lab, b, gcs, uid=None), attack_env(dir, wrong, leaked)),
            "root on b, no certificate": (attack_argv(lab, b, gcs, uid=None), attack_env(dir, token_file, None)),
            # all of it: runs, and as Ray's user
            "root on b, the token": (attack_argv(lab, b, gcs, uid=None), attack_env(dir, token_file, leaked)),
        }
        got = run_attacks(cases)
    print(f"(outsider at {OUTSIDER})", json.dumps(got, indent=1))
    assert got.pop("root on b, the token") == f"RAN {ray_uid}"
    for case, line in got.items():
        assert not line.startswith("RAN"), (case, line)
    assert "Failed to connect" in got["root on b, a wrong token"], got


def test_fleet_places_finds_moves_and_survives_a_node(lab: FleetLab) -> None:
    with lab.reporting():
        _walk(lab)


def _walk(lab: FleetLab) -> None:
    nodes = {n["name"]: n for n in lab.nodes("b")}
    assert set(nodes) == {"a", "b"} and all(n["alive"] and n["slots"] == 2 for n in nodes.values())

    # four fleet Creates, from both hosts' clients through either member: Ray's
    # scheduler fills both hosts (2 slots each)
    placed: dict[str, str] = {}
    for i, (client, via) in enumerate((("a", "a"), ("b", "b"), ("a", "b"), ("b", "a"))):
        name, node = lab.ok(client, "create", f"s{i}", "--memory", MEMORY, via=via).split()
        placed[name] = node
    assert sorted(placed.values()) == ["a", "a", "b", "b"], placed
    r = lab.cli("a", "create", "s0", "--memory", MEMORY)
    assert r.returncode == 1 and "ALREADY_EXISTS" in r.stderr, r.stderr

    # a fifth waits for room, then RESOURCE_EXHAUSTED; nothing of it is left
    t = time.monotonic()
    r = lab.cli("b", "create", "s4", "--memory", MEMORY, "--wait", "4")
    assert r.returncode == 1 and "RESOURCE_EXHAUSTED" in r.stderr, r.stderr
    assert time.monotonic() - t >= 4
    listed = lab.sandboxes("b")
    assert {k: v["node"] for k, v in listed.items()} == placed
    assert all(v["state"] == "placed" for v in listed.values())

    # found by name from the other host's client, which then talks to the owner itself
    for name, node in placed.items():
        lab.ok(node, "run", name, "--", "sh", "-c", f"echo {name} > /root/me")
    for name, node in placed.items():
        other = "b" if node == "a" else "a"
        assert lab.ok(other, "run", name, "--", "cat", "/root/me").strip() == name
    on_a = sorted(n for n, v in placed.items() if v == "a")
    on_b = sorted(n for n, v in placed.items() if v == "b")
    sdk = (
        "import os; from supervisor.client.fleet import Fleet, FleetTls\n"
        "tls = FleetTls.from_files(*(os.environ[f'SANDVISOR_FLEET_{k}'] for k in ('CA', 'CERT', 'KEY')))\n"
        f"with Fleet({lab.hosts['b'].address!r}, tls=tls) as f:\n"
        f"    sb = f.get({on_a[0]!r}); print(sb.node, sb.address, sb.run(['sh', '-c', 'echo sdk']).text().strip())\n"
    )
    assert lab.python("b", sdk).split() == ["a", lab.hosts["a"].address, "sdk"]

    # checkpoint on a, restore on b: the snapshot is pulled from a (digest-checked), the state is there
    lab.ok("a", "run", on_a[0], "--", "sh", "-c", "echo moved-state > /root/state && sync")
    snap = lab.ok("b", "checkpoint", on_a[0], "--name", "warm").strip()
    lab.ok("b", "rm", on_b[0])  # a slot on b
    lab.wait_for("b's slot back", lambda: _slots_used(lab, "b") == 1, timeout=60)
    assert lab.ok("a", "restore", snap, "--name", "moved", "--node", "b").split() == ["moved", "b"]
    assert lab.ok("a", "run", "moved", "--", "cat", "/root/state") == "moved-state\n"
    cached = {n["name"]: n["snapshots"] for n in lab.nodes("a")}
    assert snap in cached["a"] and snap in cached["b"], cached

    # host b dies (every process of it, by pid): its sandboxes are lost (an event), its slots released
    with lab.events("a", "lost") as told:
        assert lab.kill_host("b")
        lost = lab.wait_for(
            "b's sandboxes lost",
            lambda: (s := lab.sandboxes("a")) and all(s[n]["state"] == "lost" for n in (on_b[1], "moved")) and s,
            timeout=180,
        )
        lab.wait_for("the lost events", lambda: {e["sandbox_id"] for e in told} == {on_b[1], "moved"}, timeout=60)
    assert all(e["attributes"]["node"] == "b" for e in told), told
    assert all(lost[n]["state"] == "placed" for n in on_a), lost
    b = next(n for n in lab.nodes("a") if n["name"] == "b")
    assert not b["alive"] and b["slots_used"] == 0, b
    r = lab.cli("a", "run", "moved", "--", "true")
    assert r.returncode == 1 and "FAILED_PRECONDITION" in r.stderr and "lost" in r.stderr, r.stderr

    # the lost sandbox's checkpoint restored on a (a slot freed there first): the state is there
    lab.ok("a", "rm", on_a[1])
    lab.wait_for("a's slot back", lambda: _slots_used(lab, "a") == 1, timeout=60)
    # (by its own name: a lost sandbox's name is free for its restore)
    assert lab.ok("a", "restore", snap, "--name", "moved").split() == ["moved", "a"]
    assert lab.ok("a", "run", "moved", "--", "cat", "/root/state") == "moved-state\n"
    lab.ok("a", "rm", on_b[1])  # a lost one: its record goes
    assert {k: (v["node"], v["state"]) for k, v in lab.sandboxes("a").items()} == {
        on_a[0]: ("a", "placed"),
        "moved": ("a", "placed"),
    }
