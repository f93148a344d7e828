"""A checkpoint's memory copy (taken while the guest is stopped) and the sealed cache
that hands it to restores: every byte once, holes kept, sealed; one fill for restores
side by side; a fork's memory (no file behind it) kept until its snapshot goes."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import pytest
import trio

from actors.cells import guestmem
from actors.sandboxes.savedstate import _write_memory, copy_ram

MIB = 1 << 20


def sparse(path: Path, size: int, pieces: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in pieces.items():
            f.seek(off)
            f.write(data)


@pytest.mark.parametrize(
    ("extents", "parts"),
    [
        ([], 2),
        ([(0, 4096)], 2),
        ([(0, 100 * MIB), (200 * MIB, 50 * MIB)], 2),
        ([(0, 7 * MIB), (10 * MIB, MIB), (64 * MIB, 3 * MIB)], 3),
        ([(4096 * i * 2, 4096) for i in range(1000)], 2),
    ],
)
def test_split_extents_covers_every_byte_once(extents: list[tuple[int, int]], parts: int) -> None:
    split = guestmem.split_extents(extents, parts)
    assert len(split) <= parts
    got = sorted(e for part in split for e in part)
    covered = [(o, o + n) for o, n in got]
    assert all(n > 0 for _, n in got)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(covered))  # no byte twice
    assert sum(n for _, n in got) == sum(n for _, n in extents)
    want = {(o + k) for o, n in extents for k in range(0, n, 4096)}
    assert {(o + k) for o, n in got for k in range(0, n, 4096)} == want


def test_the_ram_copy_keeps_contents_and_holes_and_is_sealed(tmp_path: Path) -> None:
    ram = tmp_path / "ram"
    pieces = {MIB: b"A" * 4096, 6 * MIB: b"B" * 8192, 9 * MIB: os.urandom(3 * MIB)}
    sparse(ram, 16 * MIB, pieces)

    async def main() -> int:
        fd = guestmem.new_memfd(16 * MIB)
        src = os.open(ram, os.O_RDONLY)
        try:
            guestmem.preallocate(src, fd)  # (before the pause: the copy then only writes)
        finally:
            os.close(src)
        assert os.pread(fd, 16 * MIB, 0) == bytes(16 * MIB)  # allocated, not yet written
        await copy_ram(ram, fd)
        return fd

    fd = trio.run(main)
    try:
        assert guestmem.is_sealed(fd)
        st = os.fstat(fd)
        assert st.st_size == 16 * MIB and st.st_blocks * 512 < 4 * MIB  # the holes stayed holes
        assert os.pread(fd, 16 * MIB, 0) == ram.read_bytes()
        _write_memory(fd, tmp_path / "memory")  # the file written after the guest runs again
        assert (tmp_path / "memory").read_bytes() == ram.read_bytes()
        assert (tmp_path / "memory").stat().st_blocks * 512 < 4 * MIB
        with pytest.raises(FileExistsError):  # never over an existing file
            _write_memory(fd, tmp_path / "memory")
    finally:
        os.close(fd)


def test_restores_side_by_side_fill_a_snapshot_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "memory"
    src.write_bytes(b"m" * MIB)
    fills = []
    real = guestmem.sealed_copy

    def slow_copy(source: Path | int) -> int:
        fills.append(source)
        time.sleep(0.2)  # the others arrive while this one fills
        return real(source)

    monkeypatch.setattr(guestmem, "sealed_copy", slow_copy)
    cache = guestmem.SealedMemoryCache()
    fds: list[int] = []
    try:
        threads = [threading.Thread(target=lambda: fds.append(cache.acquire("s", src))) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(fills) == 1 and len(fds) == 6
        assert len({os.fstat(fd).st_ino for fd in fds}) == 1  # one memfd, shared
        assert cache.cached_bytes == MIB
    finally:
        for fd in fds:
            cache.release("s", fd)
        cache.close()


def test_a_forks_memory_stays_until_its_snapshot_goes(tmp_path: Path) -> None:
    cache = guestmem.SealedMemoryCache(budget=MIB)
    try:
        fork = guestmem.new_memfd(2 * MIB)
        os.pwrite(fork, b"f" * 2 * MIB, 0)
        guestmem.seal(fork)
        cache.put("fork", fork, pinned=True)  # over the budget, and nobody holds it yet
        (tmp_path / "other").write_bytes(b"o" * MIB)
        other = cache.acquire("other", tmp_path / "other")
        cache.release("other", other)  # idle, over budget: trimmed; the fork's memory is not
        assert cache.cached_bytes == 2 * MIB
        kid = cache.acquire("fork", tmp_path / "no-such-file")  # a hit: no file is read
        assert os.pread(kid, 4, 0) == b"ffff"
        cache.release("fork", kid)
        assert cache.cached_bytes == 2 * MIB
        cache.drop("fork")  # retired
        assert cache.cached_bytes == 0
        with pytest.raises(guestmem.MemoryFileError, match="unsealed"):
            cache.put("x", guestmem.new_memfd(MIB), pinned=True)  # (closed by put)
    finally:
        cache.close()


def test_a_restores_memfd_has_no_hole_when_handed_out(tmp_path: Path) -> None:
    """The cache allocates a snapshot's holes before any QEMU maps its memfd (on the
    first acquire, and on the first after a checkpoint's put): a hole a QEMU touched
    would be charged to that QEMU's cgroup (test_jail's cgroup test shows the cost)."""
    src = tmp_path / "memory"
    with open(src, "wb") as f:
        f.truncate(4 * MIB)
        f.seek(MIB)
        f.write(b"d" * 4096)
    cache = guestmem.SealedMemoryCache()
    try:
        fd = cache.acquire("s", src)
        assert guestmem.is_sealed(fd) and os.fstat(fd).st_blocks * 512 == 4 * MIB
        assert os.pread(fd, 4096, MIB) == b"d" * 4096 and os.pread(fd, 8, 0) == bytes(8)
        assert cache.cached_bytes == 4 * MIB  # (the budget counts what it holds)
        cache.release("s", fd)
        fork = guestmem.new_memfd(2 * MIB)
        os.pwrite(fork, b"f" * 4096, 0)
        guestmem.seal(fork)
        cache.put("fork", fork, pinned=True)
        kid = cache.acquire("fork", tmp_path / "no-such-file")
        assert os.fstat(kid).st_blocks * 512 == 2 * MIB and os.pread(kid, 4, 0) == b"ffff"
        cache.release("fork", kid)
    finally:
        cache.close()
