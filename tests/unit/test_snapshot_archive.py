"""The snapshot export format's reader (actors/snapshots/archive.py): round trips at any
chunking, and hostile bytes only ever raise its typed errors (fuzzed)."""

from __future__ import annotations

import hashlib
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.errors import DomainError, FailedPrecondition, InvalidArgument
from actors.snapshots import archive


def build(files: dict[str, list[tuple[int, bytes]]], sizes: dict[str, int], version: int = archive.VERSION) -> bytes:
    entries = [archive.FileEntry(n, sizes[n]) for n in files]
    out = archive.head(version) + archive.manifest_frame(entries, {"snapshot": {"memory": "disk"}})
    for i, name in enumerate(files):
        for off, data in files[name]:
            out += archive.data_frame(i, off, data)
    return out + archive.end_frame(hashlib.sha256(out).digest())


SAMPLE = build(
    {"disk.qcow2": [(0, b"QFI\xfb" + b"x" * 100), (4096, b"y" * 50)], "layer-1": [(10, b"z" * 10)]},
    {"disk.qcow2": 8192, "layer-1": 20},
)


def read_all(stream: bytes, cuts: list[int] | None = None) -> list[archive.Event]:
    r = archive.Reader()
    events: list[archive.Event] = []
    last = 0
    for c in [*(cuts or []), len(stream)]:
        events += r.feed(stream[last:c])
        last = c
    r.close()
    return events


def test_round_trip() -> None:
    events = read_all(SAMPLE)
    m = events[0]
    assert isinstance(m, archive.Manifest)
    assert [(f.name, f.size) for f in m.files] == [("disk.qcow2", 8192), ("layer-1", 20)]
    data = [(e.index, e.offset, e.data) for e in events if isinstance(e, archive.Data)]
    assert data == [(0, 0, b"QFI\xfb" + b"x" * 100), (0, 4096, b"y" * 50), (1, 10, b"z" * 10)]
    assert isinstance(events[-1], archive.End)


@settings(deadline=None)
@given(st.lists(st.integers(0, len(SAMPLE)), max_size=12))
def test_any_chunking_reads_the_same(cuts: list[int]) -> None:
    assert read_all(SAMPLE, sorted(cuts)) == read_all(SAMPLE)


def test_every_truncation_is_refused() -> None:
    for n in range(len(SAMPLE)):
        r = archive.Reader()
        with pytest.raises(InvalidArgument):
            r.feed(SAMPLE[:n])
            r.close()


def test_every_flipped_byte_is_refused() -> None:
    for i in range(len(SAMPLE)):
        bad = bytearray(SAMPLE)
        bad[i] ^= 0x01
        with pytest.raises(DomainError):
            read_all(bytes(bad))


def test_version_and_magic() -> None:
    future = build({"disk.qcow2": []}, {"disk.qcow2": 0}, version=2)
    with pytest.raises(archive.UnsupportedFormat) as e:
        archive.Reader().feed(future)
    assert isinstance(e.value, FailedPrecondition)
    assert "version 2" in e.value.message
    with pytest.raises(InvalidArgument, match="magic"):
        archive.Reader().feed(b"PK\x03\x04" + b"\0" * 20)
    with pytest.raises(archive.CorruptExport):
        read_all(SAMPLE[:-1] + bytes([SAMPLE[-1] ^ 1]))
    with pytest.raises(InvalidArgument, match="after the export's trailer"):
        read_all(SAMPLE + b"x")


def _with_manifest(body: object, frames: bytes = b"") -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    out = archive.head() + archive.frame(b"M", raw) + frames
    return out + archive.end_frame(hashlib.sha256(out).digest())


@pytest.mark.parametrize(
    ("body", "frames", "match"),
    [
        ({"files": [{"name": "../etc/passwd", "size": 1}]}, b"", "does not hold"),
        ({"files": [{"name": "disk.qcow2", "size": -1}]}, b"", "out of range"),
        ({"files": [{"name": "disk.qcow2", "size": 1 << 41}]}, b"", "out of range"),
        ({"files": [{"name": "disk.qcow2", "size": 1}, {"name": "disk.qcow2", "size": 1}]}, b"", "twice"),
        ({"files": "x"}, b"", "list of files"),
        ([1, 2], b"", "list of files"),
        ({"files": [{"name": "disk.qcow2", "size": 4}]}, archive.data_frame(0, 2, b"abc"), "out of bounds"),
        ({"files": [{"name": "disk.qcow2", "size": 4}]}, archive.data_frame(1, 0, b"a"), "out of order"),
        (
            {"files": [{"name": "disk.qcow2", "size": 4}]},
            archive.data_frame(0, 2, b"ab") + archive.data_frame(0, 0, b"a"),
            "out of bounds",
        ),
        ({"files": []}, archive.frame(b"Q", b""), "unknown frame"),
        ({"files": []}, archive.frame(b"M", b"\x80"), "unknown frame"),
    ],
)
def test_hostile_manifests_and_frames(body: object, frames: bytes, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        read_all(_with_manifest(body, frames))


def test_oversized_frames_are_refused_before_they_are_buffered() -> None:
    r = archive.Reader()
    with pytest.raises(InvalidArgument, match="manifest is"):
        r.feed(archive.head() + struct.pack(">cI", b"M", archive.MAX_MANIFEST + 1))
    r = archive.Reader()
    r.feed(archive.head() + archive.frame(b"M", msgpack.packb({"files": []})))
    with pytest.raises(InvalidArgument, match="data frame"):
        r.feed(struct.pack(">cI", b"D", archive.MAX_CHUNK + archive.DATA.size + 1))


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400), st.integers(0, 400))
def test_garbage_only_raises_typed_errors(tail: bytes, cut: int) -> None:
    for stream in (tail, archive.head() + tail, SAMPLE[:cut] + tail):
        r = archive.Reader()
        try:
            r.feed(stream)
            r.close()
        except DomainError:
            pass


@settings(deadline=None, max_examples=200)
@given(st.data())
def test_mutated_exports_never_pass_unnoticed(data: st.DataObject) -> None:
    """Any change to a valid export (bytes replaced, cut or inserted) is refused."""
    i = data.draw(st.integers(0, len(SAMPLE) - 1))
    kind = data.draw(st.sampled_from(["replace", "cut", "insert"]))
    junk = data.draw(st.binary(min_size=1, max_size=8))
    if kind == "replace":
        mutated = SAMPLE[:i] + junk + SAMPLE[i + len(junk) :]
    elif kind == "cut":
        mutated = SAMPLE[:i] + SAMPLE[i + len(junk) :]
    else:
        mutated = SAMPLE[:i] + junk + SAMPLE[i:]
    if mutated == SAMPLE:
        return
    with pytest.raises(DomainError):
        read_all(mutated)
