"""E2B's fork and snapshot calls, by the ``e2b`` SDK unchanged, against ``sandvisor serve
--e2b`` on loopback (a throwaway supervisor shared by the module, as tests/vm/test_e2b.py):
``Sandbox.fork`` (the children have the parent's files and running processes at the fork
point, and their own files after it), ``create_snapshot``, ``list_snapshots``, a snapshot as
a template, ``delete_snapshot``; another key gets E2B's not-found for all of them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

e2b = pytest.importorskip("e2b")

from e2b import Sandbox, SandboxException, SandboxNotFoundException  # noqa: E402

from tests.support.e2bserve import e2b_endpoint  # noqa: E402

ALICE, BOB = "e2b_fork_alice_key", "e2b_fork_bob_key"
# (written aside and renamed: a read never sees the file half-written)
COUNTER = (
    "nohup setsid sh -c 'i=0; while true; do i=$((i+1)); "
    "echo $i > /tmp/cnt.new; mv /tmp/cnt.new /tmp/cnt; sleep 0.05; done' >/dev/null 2>&1 &"
)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with e2b_endpoint("sv-e2b-fork-", f"alice {ALICE}\nbob {BOB}\n") as (url, _):
        yield url


def _as(endpoint: str, key: str) -> dict[str, Any]:
    return {"api_url": endpoint, "sandbox_url": endpoint, "api_key": key, "request_timeout": 300}


@pytest.fixture(scope="module")
def parent(endpoint: str) -> Iterator[Sandbox]:
    sb = Sandbox.create(timeout=1800, **_as(endpoint, ALICE))
    try:
        sb.files.write("/tmp/before.txt", "written before the fork")
        sb.commands.run(COUNTER)
        yield sb
    finally:
        sb.kill()


def _count(sb: Sandbox) -> int:
    return int(sb.commands.run("cat /tmp/cnt").stdout)


def _grows(sb: Sandbox) -> bool:
    """The counter runs: a later read is larger (bounded)."""
    first = _count(sb)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if _count(sb) > first:
            return True
    return False


def test_fork_children_have_the_parent_at_the_fork_point(parent: Sandbox, endpoint: str) -> None:
    at_fork = _count(parent)
    kids = parent.fork(count=2, timeout=600)
    try:
        assert all(isinstance(k, Sandbox) for k in kids), kids
        children = [k for k in kids if isinstance(k, Sandbox)]
        ids = {k.sandbox_id for k in children}
        assert len(ids) == 2 and parent.sandbox_id not in ids
        listed = {s.sandbox_id for s in Sandbox.list(**_as(endpoint, ALICE)).next_items()}
        assert ids <= listed
        for k in children:
            assert k.files.read("/tmp/before.txt") == "written before the fork"
            # the counter came with the memory: it goes on from the fork point, in each child
            assert _count(k) >= at_fork
            assert _grows(k)
            assert Sandbox.get_info(k.sandbox_id, **_as(endpoint, ALICE)).state.value == "running"
        one, other = children
        one.files.write("/tmp/only-in-one.txt", "mine")
        assert not other.files.exists("/tmp/only-in-one.txt")
        assert not parent.files.exists("/tmp/only-in-one.txt")
        assert _grows(parent)  # the parent runs on
        # children of children
        [made] = one.fork()
        assert isinstance(made, Sandbox), made
        grandchild = made
        try:
            assert grandchild.files.read("/tmp/only-in-one.txt") == "mine"
        finally:
            grandchild.kill()
    finally:
        for kid in kids:
            if isinstance(kid, Sandbox):
                kid.kill()


def test_snapshot_list_template_delete(endpoint: str) -> None:
    alice = _as(endpoint, ALICE)
    src = Sandbox.create(timeout=600, **alice)
    try:
        src.files.write("/tmp/snapped.txt", "in the snapshot")
        src.commands.run(COUNTER)
        snap = src.create_snapshot()
        assert snap.snapshot_id
        listed = [s.snapshot_id for s in Sandbox.list_snapshots(**alice).next_items()]
        assert snap.snapshot_id in listed
        mine = [s.snapshot_id for s in Sandbox.list_snapshots(src.sandbox_id, **alice).next_items()]
        assert mine == [snap.snapshot_id]
        clone = Sandbox.create(snap.snapshot_id, timeout=600, **alice)
        try:
            assert clone.files.read("/tmp/snapped.txt") == "in the snapshot"
            assert _grows(clone)  # a snapshot keeps the running processes
        finally:
            clone.kill()
        # while its origin runs on the snapshot's disk, it stays (409, with the reason)
        with pytest.raises(SandboxException, match="in use"):
            Sandbox.delete_snapshot(snap.snapshot_id, **alice)
        with pytest.raises(SandboxException):
            src.create_snapshot(mode="filesystem")  # a snapshot here always keeps memory
    finally:
        src.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id, **alice) is True
    assert snap.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots(**alice).next_items()]
    assert Sandbox.delete_snapshot(snap.snapshot_id, **alice) is False


def test_another_key_is_refused(parent: Sandbox, endpoint: str) -> None:
    alice, bob = _as(endpoint, ALICE), _as(endpoint, BOB)
    # (the parent runs on its snapshot's disk: the snapshot stays until the module's supervisor goes)
    snap = parent.create_snapshot()
    sid = parent.sandbox_id
    with pytest.raises(SandboxNotFoundException):
        Sandbox.fork(sid, **bob)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.create_snapshot(sid, **bob)
    assert Sandbox.list_snapshots(**bob).next_items() == []
    with pytest.raises(SandboxException, match="404"):
        Sandbox.create(snap.snapshot_id, timeout=60, **bob)
    assert Sandbox.delete_snapshot(snap.snapshot_id, **bob) is False
    assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots(**alice).next_items()]
