"""A sandbox's log (actors/sandboxes/logs.py): rotation, follow, a full disk and torn records."""

from __future__ import annotations

import os
from contextlib import aclosing
from pathlib import Path

import pytest
import trio

from actors.sandboxes.logs import SandboxLog


async def test_log_rotates_and_follow_sees_new_records(tmp_path: Path) -> None:
    log = SandboxLog(tmp_path / "log", max_bytes=1000)
    for i in range(200):
        log.append("stdout", f"line {i}\n".encode())
    recs = log.read_sync()
    assert recs[-1].data == b"line 199\n" and (tmp_path / "log.1").exists()
    assert len(recs) < 100  # the oldest rotated away: disk use stays bounded
    assert [r.seq for r in recs] == sorted(r.seq for r in recs)
    seen: list[bytes] = []
    async with trio.open_nursery() as n:

        async def follow() -> None:
            async with aclosing(log.follow(cursor=log.seq)) as records:
                async for r in records:
                    seen.append(r.data)
                    if r.data == b"last":
                        return

        n.start_soon(follow)
        await trio.sleep(0.01)
        log.append("stderr", b"new")
        log.append("system", b"last")
    assert seen == [b"new", b"last"]
    log.close()
    reopened = SandboxLog(tmp_path / "log")
    assert reopened.seq == 202  # numbering survives a reopen
    reopened.close()


def test_log_survives_a_full_disk_and_torn_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    log = SandboxLog(tmp_path / "log")
    log.append("stdout", b"before")
    real = os.pwrite
    calls = {"n": 0}

    def full(fd: int, data: bytes, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 1:  # a torn write: half a record lands, then the disk is full
            real(fd, bytes(data)[: len(data) // 2], offset)
            return len(data) // 2
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    for i in range(3):
        log.append("stdout", f"lost {i}".encode())  # never raises
    monkeypatch.setattr(os, "pwrite", real)
    assert log.dropped == 3
    log.append("stdout", b"after")
    recs = log.read_sync()
    assert [(r.source, r.data) for r in recs] == [
        ("stdout", b"before"),
        ("system", b"3 log records dropped"),
        ("stdout", b"after"),
    ]
    assert [r.seq for r in recs] == [1, 2, 3]
    log.close()
    with open(tmp_path / "log", "ab") as f:  # a crash mid-record leaves a torn tail
        f.write(b"\x00\x00\x01\x00partial")
    again = SandboxLog(tmp_path / "log")
    assert again.seq == 3
    again.append("stdout", b"next")
    assert [r.data for r in again.read_sync()][-1] == b"next"
    again.close()


async def test_log_follow_reads_only_what_is_new_across_rotations(tmp_path: Path) -> None:
    log = SandboxLog(tmp_path / "log", max_bytes=4096)
    log.append("stdout", b"old")
    seen: list[bytes] = []
    async with trio.open_nursery() as n:

        async def follow() -> None:
            async with aclosing(log.follow(tail=1)) as records:
                async for r in records:
                    seen.append(r.data)
                    if r.data == b"999":
                        return

        n.start_soon(follow)
        with trio.fail_after(10):  # following (its tail is "old") before anything new is written
            while not seen:
                await trio.sleep(0.001)
        for i in range(1000):  # many rotations of a 4 KiB log while the follower keeps up
            log.append("stdout", str(i).encode())
            if i % 7 == 0:  # it keeps up: at most 7 records (well inside 4 KiB) between its reads
                with trio.fail_after(10):
                    while seen[-1] != str(i).encode():
                        await trio.sleep(0.001)
    assert seen[0] == b"old"
    got = [int(x) for x in seen[1:]]
    assert got == sorted(got) and got[-1] == 999 and len(set(got)) == len(got)
    assert got == list(range(1000)) and log.generation > 3
    log.close()
