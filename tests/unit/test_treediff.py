"""The host's half of a diff between two sandboxes: a guest's tar stream parsed as hostile
input into a listing (names checked, bounds kept, contents hashed), and two listings compared."""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from actors.errors import InvalidArgument, ResourceExhausted
from actors.treediff import Entry, Limits, compare, diff, listing
from supervisor.client.cli_family import content_lines


def _tar(*members: tuple[str, str, bytes | str], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for name, kind, data in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                assert isinstance(data, bytes)
                ti.size, ti.mode = len(data), 0o644
                t.addfile(ti, io.BytesIO(data))
            elif kind == "dir":
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                t.addfile(ti)
            elif kind == "link":
                ti.type, ti.linkname = tarfile.SYMTYPE, str(data)
                t.addfile(ti)
            elif kind == "hard":
                ti.type, ti.linkname = tarfile.LNKTYPE, str(data)
                t.addfile(ti)
            elif kind == "fifo":
                ti.type = tarfile.FIFOTYPE
                t.addfile(ti)
    return buf.getvalue()


def _reader(data: bytes, piece: int = 700) -> object:
    view = memoryview(data)
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        out = bytes(view[pos : pos + min(n, piece)])
        pos += len(out)
        return out

    return read


def _list(data: bytes, limits: Limits | None = None) -> dict[str, Entry]:
    return listing(_reader(data), limits or Limits())  # type: ignore[arg-type]


def test_a_listing_hashes_files_and_keeps_kinds_modes_and_links() -> None:
    got = _list(
        _tar(
            (".", "dir", b""),
            ("a", "dir", b""),
            ("a/f", "file", b"x" * 5000),
            ("l", "link", "a/f"),
            ("h", "hard", "a/f"),
        )
    )
    f = got["a/f"]
    assert f == Entry("file", 5000, 0o644, hashlib.sha256(b"x" * 5000).hexdigest())
    assert got["a"].kind == "dir" and got["l"] == Entry("link", 3, got["l"].mode, "a/f")
    assert got["h"] == f and got["."].kind == "dir"


def test_compare_reports_exactly_what_was_added_removed_and_modified() -> None:
    a = _list(_tar(("keep", "file", b"same"), ("gone", "file", b"1"), ("edit", "file", b"old"), ("d", "dir", b"")))
    b = _list(_tar(("keep", "file", b"same"), ("edit", "file", b"new"), ("d", "dir", b""), ("d/new", "file", b"n")))
    changes = {c.path: c.change for c in compare(a, b)}
    assert changes == {"gone": "removed", "edit": "modified", "d/new": "added"}
    same_size = next(c for c in compare(a, b) if c.path == "edit")
    assert same_size.a is not None and same_size.b is not None and same_size.a.digest != same_size.b.digest


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "a//b"])
def test_a_hostile_name_is_refused(name: str) -> None:
    data = _tar(("ok", "file", b""), fmt=tarfile.GNU_FORMAT).replace(b"ok\0", name.encode() + b"\0", 1)
    data = _fix_checksum(data)
    with pytest.raises(InvalidArgument):
        _list(data)


def _fix_checksum(data: bytes) -> bytes:
    block = bytearray(data[:512])
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}\0 ".encode()
    return bytes(block) + data[512:]


def test_a_name_seen_twice_and_a_fifo_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="twice"):
        _list(_tar(("f", "file", b"1"), ("f", "file", b"2")))
    with pytest.raises(InvalidArgument, match="type"):
        _list(_tar(("p", "fifo", b"")))


def test_the_bounds_entries_depth_and_bytes_hashed() -> None:
    with pytest.raises(ResourceExhausted, match="entries"):
        _list(_tar(*((f"f{i}", "file", b"") for i in range(5))), Limits(entries=4))
    with pytest.raises(ResourceExhausted, match="deeper"):
        _list(_tar(("a/b/c/d", "file", b"")), Limits(depth=3))
    with pytest.raises(ResourceExhausted, match="bytes to hash"):
        _list(_tar(("a", "file", b"x" * 600), ("b", "file", b"y" * 600)), Limits(hashed=1000))


def test_a_truncated_or_garbled_stream_is_a_typed_error() -> None:
    data = _tar(("a", "file", b"x" * 5000))
    with pytest.raises(InvalidArgument):
        _list(data[:3000])
    with pytest.raises(InvalidArgument):
        _list(b"\x01" * 1024)


def test_content_shows_a_unified_diff_for_text_and_hashes_for_binary() -> None:
    lines = content_lines("a", b"one\ntwo\n", "b", b"one\nthree\n", "/f")
    assert "-two" in lines and "+three" in lines
    binary = content_lines("a", b"\xff\x00", "b", None, "/f")
    assert "absent" in binary[1] and "sha256" in binary[0]


class _Chunks:
    """A guest's tar stream as the channel gives it: chunks, with a checkpoint each."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        await trio.sleep(0)
        if self.pos >= len(self.data):
            raise StopAsyncIteration
        self.pos += 1000
        return self.data[self.pos - 1000 : self.pos]


def _fake_tree(data: bytes, closed: list[bool]) -> Any:
    @asynccontextmanager
    async def read_tree(path: str) -> AsyncIterator[AsyncIterator[bytes]]:
        try:
            yield _Chunks(data)
        finally:
            closed.append(True)

    return read_tree


async def test_two_sandboxes_trees_are_read_side_by_side_and_compared() -> None:
    a = _tar(("same", "file", b"s" * 3000), ("old", "file", b"o"))
    b = _tar(("same", "file", b"s" * 3000), ("new", "file", b"n" * 2500))
    closed: list[bool] = []
    with trio.fail_after(10):
        changes, n_a, n_b = await diff(_fake_tree(a, closed), _fake_tree(b, closed), "/w")
    assert [(c.path, c.change) for c in changes] == [("new", "added"), ("old", "removed")]
    assert (n_a, n_b, closed) == (2, 2, [True, True])


async def test_a_side_past_a_bound_ends_its_stream_and_fails_typed() -> None:
    big = _tar(*((f"f{i}", "file", b"x") for i in range(50)))
    closed: list[bool] = []
    with trio.fail_after(10), pytest.raises(ResourceExhausted, match="entries"):
        await diff(_fake_tree(big, closed), _fake_tree(_tar(), closed), "/", Limits(entries=10))
    assert closed == [True, True]
