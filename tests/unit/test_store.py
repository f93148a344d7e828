"""The sandbox store (actors/store.py): writes behind, in order, through a full disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio


async def test_store_writes_behind_in_order_and_survives_a_full_disk(tmp_path: Path) -> None:
    from actors.errors import ResourceExhausted
    from actors.model import SandboxConfig, State, Workload
    from actors.store import Record, Store

    store = Store(tmp_path / "db")
    store.retry_after = 0.05
    big = Workload(env={"X": "y" * 20_000})  # a page or more per record
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(store.run)
            rec = Record("u0", "first", store.next_seq(), SandboxConfig(), State.STARTING, 1)
            store.insert(rec)
            await store.flush()
            pages = store.db.execute("PRAGMA page_count").fetchone()[0]
            store.db.execute(f"PRAGMA max_page_count={pages + 2}")  # the disk is full from here
            for i in range(1, 6):
                store.insert(Record(f"u{i}", f"sb{i}", store.next_seq(), SandboxConfig(workload=big), State.READY, i))
            rec.state = State.FAILED
            store.update(rec)
            with pytest.raises(ResourceExhausted, match="full"):
                await store.flush()
            with pytest.raises(ResourceExhausted):
                store.check_writable()
            store.db.execute("PRAGMA max_page_count=1073741823")  # room again: the queue goes through, in order
            await store.flush()
            store.check_writable()
            n.cancel_scope.cancel()
    store.close()
    again = Store(tmp_path / "db")
    recs = again.all()
    assert [r.id for r in recs] == ["first", "sb1", "sb2", "sb3", "sb4", "sb5"]
    assert recs[0].state == State.FAILED and recs[1].config.workload == big
    assert again.next_seq() == 7
    again.close()
