"""A sandbox's log: every Run/Exec output and system message, persisted with timestamps.

Records are length-prefixed msgpack ``[seq, unix_ns, source, data]`` (and the Run
session that wrote it, a fifth element, when there is one) appended to
``log``; at ``max_bytes`` the file rotates to ``log.1`` (the previous ``log.1`` goes),
so a flooding workload costs at most twice that on disk.

Appending never raises: a full disk or an I/O error drops the record (the file is
cut back to the last whole record), counts it in :attr:`SandboxLog.dropped`, and the
next record that fits is preceded by a system record saying how many were lost.

Readers: :meth:`SandboxLog.read` scans both files (in a worker thread: up to
``2 * max_bytes``); followers (:meth:`SandboxLog.follow`) read only what was
appended since their offset, woken by a Trio event that every append sets, so a
guest flooding its output costs a follower what is new, not the whole file again.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from pathlib import Path

import attrs
import msgpack
import trio

_HDR = struct.Struct(">I")
SOURCES = ("stdout", "stderr", "output", "system")
Sources = tuple[str, ...] | frozenset[str]  # a filter of SOURCES (empty: all)
FOLLOW_CHUNK = 1 << 20  # a follower reads at most this much per wakeup, then yields


@attrs.frozen
class LogRecord:
    seq: int
    timestamp: int
    source: str
    data: bytes
    session: int = 0  # the Run session that wrote it (SandboxLog.new_session); 0: none (system)


def _records(data: bytes) -> Iterator[tuple[int, LogRecord]]:
    """Whole records in ``data`` with the offset just past each; stops at a torn one."""
    i = 0
    while i + 4 <= len(data):
        (n,) = _HDR.unpack_from(data, i)
        if i + 4 + n > len(data):
            return
        try:
            seq, ts, src, chunk, *more = msgpack.unpackb(data[i + 4 : i + 4 + n], raw=False)
            session = int(more[0]) if more else 0
        except Exception:
            return
        i += 4 + n
        yield i, LogRecord(seq, ts, src, chunk, session)


def _tail(path: Path) -> tuple[int, int]:
    """(end of the last whole record, its seq) of a log file, walking the headers only."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return 0, 0
    with f:
        size = os.fstat(f.fileno()).st_size
        end = last = 0
        while end + 4 <= size:
            f.seek(end)
            (n,) = _HDR.unpack(f.read(4))
            if end + 4 + n > size:
                break
            last, end = end, end + 4 + n
        if end == 0:
            return 0, 0
        f.seek(last)
        (n,) = _HDR.unpack(f.read(4))
        try:
            seq = int(msgpack.unpackb(f.read(n), raw=False)[0])
        except Exception:
            return last, 0
        return end, seq


class SandboxLog:
    def __init__(self, path: Path, *, max_bytes: int = 32 << 20) -> None:
        self.path = path
        self.old = path.with_name(path.name + ".1")
        self.max_bytes = max_bytes
        self._changed = trio.Event()
        self._closed = False
        self.dropped = 0  # records lost to a full disk or an I/O error
        self._unreported = 0
        self.generation = 0  # rotations since open: a follower's offset is in one generation's file
        end, self.seq = _tail(path)
        if not self.seq:
            self.seq = _tail(self.old)[1]
        self.session = self.seq  # the last session id given (kept above every seq before it)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.ftruncate(self._fd, end)  # a torn last record (a crash mid-write) goes
        self._size = end

    def new_session(self) -> int:
        """A new session id for the records of one Run: increasing, and above every
        record's seq at the time, so no id of an earlier life of the log is given again."""
        self.session = max(self.session, self.seq) + 1
        return self.session

    def append(self, source: str, data: bytes, session: int = 0) -> int:
        """Add a record (of Run ``session``; 0: none); returns its seq (the previous one
        if the record was dropped)."""
        if self._closed:
            return self.seq
        if self._unreported and not self._write("system", f"{self._unreported} log records dropped".encode()):
            self._unreported += 1
            self.dropped += 1
            return self.seq
        self._unreported = 0
        if not self._write(source, data, session):
            self._unreported += 1
            self.dropped += 1
        return self.seq

    def _write(self, source: str, data: bytes, session: int = 0) -> bool:
        fields: list[object] = [self.seq + 1, time.time_ns(), source, bytes(data)]
        if session:
            fields.append(session)
        body = msgpack.packb(fields, use_bin_type=True)
        frame = _HDR.pack(len(body)) + body
        try:
            view = memoryview(frame)
            while view:
                view = view[os.pwrite(self._fd, view, self._size + len(frame) - len(view)) :]
        except OSError:
            try:
                os.ftruncate(self._fd, self._size)  # no torn record stays behind
            except OSError:
                pass
            return False
        self.seq += 1
        self._size += len(frame)
        if self._size > self.max_bytes:
            self._rotate()
        self._changed.set()
        self._changed = trio.Event()
        return True

    def _rotate(self) -> None:
        try:
            os.replace(self.path, self.old)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError:
            return  # keep appending to the full file; the next append tries again
        os.close(self._fd)
        self._fd, self._size = fd, 0
        self.generation += 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)
            self._changed.set()

    def _scan(self) -> Iterator[LogRecord]:
        for p in (self.old, self.path):
            try:
                data = p.read_bytes()
            except FileNotFoundError:
                continue
            for _, rec in _records(data):
                yield rec

    def read_sync(
        self, *, tail: int = 0, since: int = 0, until: int = 0, cursor: int = 0, sources: Sources = ()
    ) -> list[LogRecord]:
        """Records after ``cursor``, from ``since`` to ``until`` (unix ns; 0: open), of
        ``sources`` (empty: every source); ``tail``: the last so many of those."""
        recs = [
            r
            for r in self._scan()
            if r.seq > cursor
            and r.timestamp >= since
            and (not until or r.timestamp <= until)
            and (not sources or r.source in sources)
        ]
        return recs[-tail:] if tail else recs

    async def read(
        self, *, tail: int = 0, since: int = 0, until: int = 0, cursor: int = 0, sources: Sources = ()
    ) -> list[LogRecord]:
        """Records of both files (a scan of up to twice ``max_bytes``, in a worker thread)."""
        return await trio.to_thread.run_sync(
            lambda: self.read_sync(tail=tail, since=since, until=until, cursor=cursor, sources=sources)
        )

    async def follow(
        self, *, tail: int = 0, since: int = 0, cursor: int = 0, sources: Sources = ()
    ) -> AsyncGenerator[LogRecord, None]:
        """What is there (as :meth:`read`), then each record as it is appended (of
        ``sources``, if given)."""
        async with aclosing(self._follow(tail=tail, since=since, cursor=cursor, sources=sources)) as records:
            async for r in records:
                if not sources or r.source in sources:
                    yield r

    async def _follow(self, *, tail: int, since: int, cursor: int, sources: Sources) -> AsyncGenerator[LogRecord, None]:
        generation, offset = self.generation, self._size  # new records start here
        for r in await self.read(tail=tail, since=since, cursor=cursor, sources=sources):
            cursor = r.seq
            yield r
        while not self._closed:
            if generation == self.generation and offset >= self._size:
                await self._changed.wait()
                continue
            if generation != self.generation:  # rotated: the rest of the old file, then the new one
                path = self.old if generation + 1 == self.generation else None
                generation, start = self.generation, offset
                offset = 0
                if path is not None:
                    for r in self._read_from(path, start, start + 2 * self.max_bytes):
                        if r.seq > cursor:
                            cursor = r.seq
                            yield r
                continue
            data = self._read_range(self.path, offset, min(self._size, offset + FOLLOW_CHUNK))
            used = 0
            for end, r in _records(data):
                used = end
                if r.seq > cursor:
                    cursor = r.seq
                    yield r
            if not used:  # a record larger than a chunk: read it whole
                data = self._read_range(self.path, offset, self._size)
                used = next((end for end, _ in _records(data)), len(data))
            offset += used
            await trio.lowlevel.checkpoint()

    @staticmethod
    def _read_range(path: Path, start: int, end: int) -> bytes:
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read(max(0, end - start))  # (end may be past EOF: read stops there)
        except FileNotFoundError:
            return b""

    def _read_from(self, path: Path, start: int, end: int) -> Iterator[LogRecord]:
        for _, rec in _records(self._read_range(path, start, end)):
            yield rec
