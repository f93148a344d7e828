"""A sandbox against its fork point, against a real `sandvisor serve` and real VMs
(docs/fork.md, "What a branch changed"): the fork point's side is the hidden snapshot's
frozen disk, read on the host in a tool cell; the child's side is its own guest's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio

from images.build import Image
from supervisor.client import AsyncSandbox, FailedPrecondition, NotFound, Sandbox
from supervisor.main.throwaway import supervisor_process, workdir
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
from tests.support.peerclient import install

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a snapshot's disk is read in a tool cell (root's jail)"),
]
NOBODY = 65534


@pytest.fixture(scope="module")
def family(image: Image) -> Iterator[dict[str, Any]]:
    with (
        workdir("sv-fpdiff-", private_state=False) as work,
        supervisor_process(work, "--group", "nogroup", "--grpc", f"unix://{work.root / 'g.sock'}") as (env, _),
    ):
        sock = str(work.socket)
        parent = Sandbox.create("fp", socket=sock, detached=True)
        parent.run(["sh", "-c", "mkdir -p /srv/w/sub && echo keep > /srv/w/keep && echo old > /srv/w/edit"])
        parent.run(["sh", "-c", "echo bye > /srv/w/gone && echo m > /srv/w/sub/mode && chmod 000 /srv/w/keep"])
        before = set(os.listdir(work.state / "snapshots"))
        kid, liar = parent.fork(2, name_prefix="fpk-")
        kid.run(["sh", "-c", "echo new > /srv/w/sub/added && echo neu > /srv/w/edit && rm /srv/w/gone"])
        kid.run(["sh", "-c", "chmod 600 /srv/w/sub/mode"])
        # the parent runs on and changes its tree: the fork point does not move
        parent.run(["sh", "-c", "echo later > /srv/w/parent-after && echo changed > /srv/w/edit && sync"])
        # a guest that lies about its tree: /srv/w is a forged directory mounted over the real one
        liar.run(["sh", "-c", "mkdir /tmp/fake && echo forged > /tmp/fake/keep && mount --bind /tmp/fake /srv/w"])
        yield {"env": env, "sock": sock, "parent": parent, "kid": kid, "liar": liar, "work": work, "before": before}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_fork_point_diff_reports_exactly_what_the_child_changed(family: dict[str, Any]) -> None:
    kid = family["kid"]
    changes = {c.path: c for c in kid.diff(path="/srv/w")}
    assert {p: c.change for p, c in changes.items()} == {
        "sub/added": "added",
        "gone": "removed",
        "edit": "modified",
        "sub/mode": "modified",
    }
    edit, mode = changes["edit"], changes["sub/mode"]
    assert (edit.size_a, edit.size_b) == (4, 4) and edit.hash_a != edit.hash_b
    assert (mode.mode_a, mode.mode_b) == (0o644, 0o600) and mode.hash_a == mode.hash_b
    # the untouched sibling's tree is not the question: the fork point's is, and the parent's
    # changes after the fork are in neither
    assert "parent-after" not in changes
    # the same through the CLI, and both sides of one file (the 0000 file is read too)
    env = family["env"]
    r = cli(env, "diff", "fpk-1", "--fork-point", "--path", "/srv/w")
    assert r.returncode == 1, r
    got = sorted(" ".join(line.split()[:2]) for line in r.stdout.splitlines())
    assert got == ["A sub/added", "D gone", "M edit", "M sub/mode"], r.stdout
    c = cli(env, "diff", "fpk-1", "--fork-point", "--content", "/srv/w/edit")
    assert c.returncode == 0 and "-old" in c.stdout and "+neu" in c.stdout, c
    assert kid.diff_content("/srv/w/keep") == (b"keep\n", b"keep\n")
    assert kid.diff_content("/srv/w/sub/added") == (None, b"new\n")


async def test_the_async_sdk_is_the_same_operation(family: dict[str, Any]) -> None:
    kid = AsyncSandbox("fpk-1", socket=family["sock"])
    with trio.fail_after(300):
        changes = await kid.diff(path="/srv/w")
        assert sorted((c.path, c.change) for c in changes) == [
            ("edit", "modified"),
            ("gone", "removed"),
            ("sub/added", "added"),
            ("sub/mode", "modified"),
        ]
        assert await kid.diff_content("/srv/w/edit") == (b"old\n", b"neu\n")
        assert await kid.diff_content("/srv/w/edit", "fp") == (b"neu\n", b"changed\n")  # two sandboxes


def test_a_guest_that_lies_changes_only_its_own_side(family: dict[str, Any]) -> None:
    liar = family["liar"]
    changes = {c.path: c.change for c in liar.diff(path="/srv/w")}
    # what the fork point holds is the disk's, whatever the guest claims of its tree
    assert changes == {
        "gone": "removed",
        "edit": "removed",
        "sub": "removed",
        "sub/mode": "removed",
        "keep": "modified",
    }
    assert liar.diff_content("/srv/w/keep") == (b"keep\n", b"forged\n")


def test_sandvisor_v1_and_a_named_snapshot(family: dict[str, Any]) -> None:
    """The real gRPC client: Diff with fork_point; and a named checkpoint as the other side."""
    kid = family["kid"]
    with grpc.insecure_channel(f"unix:{family['work'].root / 'g.sock'}") as ch:
        stub = sv_grpc.SandvisorServiceStub(ch)
        r = stub.Diff(sv.DiffRequest(id="fpk-1", fork_point=True, path="/srv/w"), timeout=300)
        assert sorted((c.path, c.change) for c in r.changes) == [
            ("edit", "modified"),
            ("gone", "removed"),
            ("sub/added", "added"),
            ("sub/mode", "modified"),
        ]
        assert r.base and r.entries_a == 6 and r.entries_b == 6
        c = stub.Diff(sv.DiffRequest(id="fpk-1", fork_point=True, content="/srv/w/gone"), timeout=300)
        assert (c.found_a, c.content_a, c.found_b) == (True, b"bye\n", False)
    kid.checkpoint("fp-named")
    kid.run(["sh", "-c", "echo more > /srv/w/more"])
    assert [(c.path, c.change) for c in kid.diff(path="/srv/w", snapshot="fp-named")] == [("more", "added")]


def test_a_snapshot_deleted_while_a_diff_reads_it(family: dict[str, Any]) -> None:
    """The diff holds the snapshot's disk by descriptor: a delete during the read is not
    held up, and the diff answers from what it holds. The snapshot is the sibling's (any
    snapshot the caller sees will do); /usr/bin of the default image: a real tree
    (set-user-ID programs included) that neither changed."""
    kid, sock = family["kid"], family["sock"]
    sid = family["liar"].checkpoint("fp-held").snapshot_id
    family["liar"].remove(force=True)  # (a snapshot with no disk standing on it may be deleted)
    staging = family["work"].state / "treediff"
    got: dict[str, Any] = {}

    def read() -> None:
        try:
            got["changes"] = kid.diff(path="/usr/bin", snapshot=sid)
        except Exception as exc:  # (reported below, in the test's thread)
            got["error"] = exc
        got["ended"] = time.monotonic()

    t = threading.Thread(target=read)
    t.start()
    deadline = time.monotonic() + 120
    while not (staging.exists() and any(staging.iterdir())):  # the snapshot's side has begun
        assert t.is_alive() and time.monotonic() < deadline, got
        time.sleep(0.01)
    Sandbox.delete_snapshot(sid, socket=sock)
    deleted = time.monotonic()
    t.join(600)
    assert "error" not in got, got
    assert got["changes"] == [] and got["ended"] > deleted
    with pytest.raises(NotFound):
        kid.diff(path="/srv/w", snapshot=sid)


def test_refused_cases(family: dict[str, Any]) -> None:
    parent, env = family["parent"], family["env"]
    with pytest.raises(FailedPrecondition, match="was not forked"):
        parent.diff(path="/srv/w")
    with pytest.raises(NotFound):
        family["kid"].diff(path="/srv/nowhere")
    alone = cli(env, "diff", "fpk-1")
    assert alone.returncode == 2 and "--fork-point" in alone.stdout
    # another uid (a member of the supervisor's group) sees none of these sandboxes
    d = Path(tempfile.mkdtemp(prefix="sv-fpdiff-client-", dir="/tmp"))
    d.chmod(0o755)
    try:
        client = install(d / "client")
        p = subprocess.run(
            [
                "setpriv",
                f"--reuid={NOBODY}",
                f"--regid={NOBODY}",
                "--clear-groups",
                "/usr/bin/python3",
                str(client),
                family["sock"],
                "{}",
                json.dumps([("Diff", {"id": "fpk-1", "fork_point": True, "path": "/srv/w"})]),
            ],
            capture_output=True,
            timeout=120,
            check=True,
        )
        assert json.loads(p.stdout)["results"] == [{"fail": ["NOT_FOUND", "no sandbox 'fpk-1'"]}]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_family_goes_and_no_staging_is_left(family: dict[str, Any]) -> None:
    """Every diff's staging dir went with its call; the family removes as usual (the held
    disk is the diff's, not the snapshot's: retiring the fork point is not held up)."""
    staging = family["work"].state / "treediff"
    assert not staging.exists() or not any(staging.iterdir())
    for sb in (family["kid"], family["parent"]):
        sb.remove(force=True)
    Sandbox.delete_snapshot("fp-named", socket=family["sock"])  # (the child's checkpoint, on its chain)
    with pytest.raises(NotFound):
        family["kid"].diff(path="/srv/w")
    # the hidden fork point went with the last child, its frozen disk once no chain stood on it
    snaps = family["work"].state / "snapshots"
    deadline = time.monotonic() + 60
    while set(os.listdir(snaps)) - family["before"]:
        assert time.monotonic() < deadline, set(os.listdir(snaps)) - family["before"]
        time.sleep(0.1)
