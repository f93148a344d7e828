"""Fork's bookkeeping on fake VMs (tests/support/fakevm.py): the children's lineage (kept
in the store), the hidden snapshot's lifetime, remove with descendants, the refusals,
and who may fork what over the socket. Real VMs prove the children's processes, files
and identities (tests/vm/test_fork.py)."""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import attrs
import pytest
import trio
from trio.testing import MockClock

from actors.errors import AlreadyExists, FailedPrecondition, InvalidArgument, Unavailable
from actors.fork import check_forkable, descendants, fork, is_descendant, remove_with_descendants
from actors.model import HostMount, SandboxConfig, State
from actors.registry import Registry
from actors.sandboxes.sandbox import Sandbox
from actors.store import Store
from supervisor.client.cli_family import family_lines
from supervisor.client.sdk.aio import connect
from supervisor.serve.server import Server
from supervisor.wire.errors import SandboxError
from tests.support.clocks import work_aware_clock
from tests.support.fakevm import FakeLab, fake_settings


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> MockClock:
    # virtual time, frozen while the store's thread or qemu-img runs (tests/support/clocks.py)
    return work_aware_clock(monkeypatch)


@asynccontextmanager
async def registry(
    root: Path, lab: FakeLab, sock: Path | None = None, guest_timeout: float = 60
) -> AsyncIterator[Registry]:
    store = Store(root / "state" / "sandvisor.db")
    try:
        async with trio.open_nursery() as n:
            await n.start(lab.run)
            settings = fake_settings(root, lab, allowed_paths=(root,), guest_timeout=guest_timeout)
            reg = await n.start(Registry(settings, store, templates=False).run)
            try:
                if sock is not None:
                    await n.start(Server(reg, sock).serve)
                yield reg
            finally:
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


async def ready(sb: Sandbox) -> None:
    with trio.fail_after(120):
        await sb.ready_event.wait()
    assert sb.state == State.READY, sb.record.error


async def test_children_keep_their_lineage_and_the_hidden_snapshot_goes_with_the_last(
    tmp_path: Path, clock: MockClock
) -> None:
    async with registry(tmp_path, FakeLab()) as reg:
        parent = await reg.create("p", SandboxConfig(labels={"team": "a"}))
        await ready(parent)
        done = await fork(reg, "p", 3, name_prefix="c", labels={"try": "1"})
        kids = done.children
        assert [k.id for k in kids] == ["c1", "c2", "c3"]
        snap = done.snapshot
        for k in kids:
            assert k.state == State.READY
            assert k.config.labels == {"team": "a", "try": "1"}
            assert k.record.lineage is not None
            assert (k.record.lineage.parent_uid, k.record.lineage.parent_id) == (parent.record.uid, "p")
            assert k.record.lineage.snapshot_id == snap.id and k.record.origin == snap.id
        # the fork's snapshot is hidden: listed nowhere, no restore by its id
        assert snap.fork_only and snap.hidden and reg.list_snapshots() == []
        assert parent.state == State.READY  # it ran on
        grand = (await fork(reg, "c1", 1, names=["g"])).children[0]
        family = [d.id for d in descendants(reg, parent)]
        assert sorted(family) == ["c1", "c2", "c3", "g"] and family.index("g") < family.index("c1")  # deepest first
        assert is_descendant(reg, grand, parent) and not is_descendant(reg, parent, grand)
        await reg.store.flush()
        stored = {r.id: r.lineage for r in reg.store.all()}
        assert stored["g"] == grand.record.lineage and stored["p"] is None

        await reg.remove("p", force=True)  # the parent goes: its children run on
        assert all(reg.get(k.id).state == State.READY for k in kids)
        assert snap.id in reg.snapshots.snapshots
        await reg.remove("c2", force=True)
        await reg.remove("c3", force=True)
        assert snap.id in reg.snapshots.snapshots  # c1 still names it
        gone = await remove_with_descendants(reg, "c1", force=True)
        assert gone == ["g", "c1"]
        assert reg.sandboxes == {}
        assert reg.snapshots.snapshots == {}  # both forks' snapshots retired with their last child
        await reg.snapshots.collect()
        assert list((tmp_path / "state" / "snapshots").iterdir()) == []  # nothing stands on their disks


async def test_a_named_checkpoint_stays_and_children_of_a_restore_are_plain(tmp_path: Path, clock: MockClock) -> None:
    async with registry(tmp_path, FakeLab()) as reg:
        parent = await reg.create("p", SandboxConfig())
        await ready(parent)
        named, _ = await reg.checkpoint("p", name="keep")
        kid = (await fork(reg, "p", 1)).children[0]
        assert kid.id == kid.record.uid  # no name asked: its uid
        await reg.remove(kid.id, force=True)
        await reg.remove("p", force=True)
        assert list(reg.snapshots.snapshots) == [named.id]
        assert [s.id for s in reg.list_snapshots()] == [named.id]


async def test_a_child_that_fails_takes_its_siblings_and_the_parent_runs_on(tmp_path: Path, clock: MockClock) -> None:
    lab = FakeLab()
    async with registry(tmp_path, lab, guest_timeout=30) as reg:
        parent = await reg.create("p", SandboxConfig())
        await ready(parent)
        lab.hostile.silent_after_hello = True  # the children's guests: their fix-ups time out
        with pytest.raises(Unavailable, match="post-restore fixups failed"):
            await fork(reg, "p", 2, name_prefix="c")
        assert set(reg.sandboxes) == {"p"} and parent.state == State.READY
        assert reg.snapshots.snapshots == {}  # the fork's snapshot went with the children it had


async def test_what_a_fork_refuses(tmp_path: Path, clock: MockClock) -> None:
    async with registry(tmp_path, FakeLab()) as reg:
        # (host directories need the root supervisor's cells: tests/vm/test_fork.py refuses a real one)
        mount = HostMount(source=str(tmp_path / "share"), path="/mnt/share", writable=True)
        rw = SimpleNamespace(id="rw", state=State.READY, config=SandboxConfig(host_mounts=(mount,)))
        with pytest.raises(FailedPrecondition, match="mounted read-write at /mnt/share"):
            check_forkable(cast(Sandbox, rw))
        ro = SimpleNamespace(
            id="ro", state=State.READY, config=SandboxConfig(host_mounts=(attrs.evolve(mount, writable=False),))
        )
        with pytest.raises(FailedPrecondition, match="virtio-fs"):
            check_forkable(cast(Sandbox, ro))
        p = await reg.create("p", SandboxConfig())
        await ready(p)
        await reg.create("taken", SandboxConfig())
        for bad, kw in (
            (InvalidArgument, {"n": 0}),
            (InvalidArgument, {"n": 101}),
            (InvalidArgument, {"n": 2, "names": ["a"]}),
            (InvalidArgument, {"n": 2, "names": ["a", "a"]}),
            (InvalidArgument, {"n": 1, "names": ["a"], "name_prefix": "x"}),
            (AlreadyExists, {"n": 1, "names": ["taken"]}),
        ):
            with pytest.raises(bad):
                await fork(reg, "p", **kw)
        assert reg.snapshots.snapshots == {}  # refused before anything was paused
        reg.stop("p", 5)
        await p.wait_stopped()
        with pytest.raises(FailedPrecondition, match="fork needs it ready"):
            await fork(reg, "p", 1)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="f", dir="/tmp"))  # Unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_only_who_sees_the_parent_forks_it_and_the_children_are_the_callers(
    tmp_path: Path, short_dir: Path
) -> None:
    sock = short_dir / "m.sock"
    with trio.fail_after(120):
        async with registry(tmp_path, FakeLab(), sock) as reg:
            async with connect(sock, act_as="e2b:k1") as k1:
                await k1.call("Create", {"id": "p"})
                await ready(reg.get("p"))
            async with connect(sock, act_as="e2b:k2") as k2:
                with pytest.raises(SandboxError, match="no sandbox 'p'") as refused:
                    await k2.call("Fork", {"id": "p", "count": 1})
                assert refused.value.code == "NOT_FOUND"
            assert reg.snapshots.snapshots == {}
            async with connect(sock, act_as="e2b:ops", act_as_admin=True) as ops:
                got = await ops.call("Fork", {"id": "p", "count": 1, "names": ["theirs"]})
                assert [c["id"] for c in got["sandboxes"]] == [
                    "theirs"
                ] and "paused_ms" in got  # (a fake VM pauses for no time)
            assert reg.get("theirs").record.owner == "e2b:ops"
            async with connect(sock, act_as="e2b:k1") as k1:
                mine = await k1.call("Fork", {"id": "p", "count": 2, "name_prefix": "m"})
                assert [c["id"] for c in mine["sandboxes"]] == ["m1", "m2"]
                listed = await k1.call("ListAll", {"ancestor": "p"})
                assert {s["id"] for s in listed["sandboxes"]} == {"m1", "m2"}  # (not the admin's child)
                info = await k1.call("Inspect", {"id": "m1"})
                assert (info["parent"], info["parent_uid"]) == ("p", reg.get("p").record.uid)
                every = (await k1.call("ListAll", {}))["sandboxes"]
                lines = family_lines(every, "m2", now=0)
                assert [ln.split()[0] for ln in lines] == ["p", "├──", "└──"]
                await k1.call("Remove", {"id": "p", "force": True, "with_descendants": True})
            assert set(reg.sandboxes) == {"theirs"}  # another's fork stays, its line ended


def test_a_version_5_store_gains_the_lineage_column(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    Store(db).close()
    con = sqlite3.connect(db)
    con.execute("ALTER TABLE sandboxes DROP COLUMN lineage")
    con.execute("PRAGMA user_version=5")
    con.commit()
    con.close()
    store = Store(db)
    try:
        assert int(store.db.execute("PRAGMA user_version").fetchone()[0]) == 6
        assert "lineage" in {row[1] for row in store.db.execute("PRAGMA table_info(sandboxes)")}
        assert store.all() == []
    finally:
        store.close()
