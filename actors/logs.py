"""A sandbox's log: every Run/Exec output and system message, persisted with timestamps.

Records are length-prefixed msgpack ``[seq, unix_ns, source, data]`` appended to
``log``; at ``max_bytes`` the file rotates to ``log.1`` (the previous ``log.1`` goes),
so a flooding workload costs at most twice that on disk. Readers see both files;
followers wait on a Trio event that every append sets.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import attrs
import msgpack
import trio

_HDR = struct.Struct(">I")
SOURCES = ("stdout", "stderr", "output", "system")


@attrs.frozen
class LogRecord:
    seq: int
    timestamp: int
    source: str
    data: bytes


class SandboxLog:
    def __init__(self, path: Path, *, max_bytes: int = 32 << 20) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._changed = trio.Event()
        self._closed = False
        self.seq = max((r.seq for r in self._scan()), default=0)
        self._f = open(self.path, "ab")  # noqa: SIM115 - owned for the log's lifetime

    def append(self, source: str, data: bytes) -> int:
        if self._closed:
            return self.seq
        self.seq += 1
        body = msgpack.packb([self.seq, time.time_ns(), source, bytes(data)], use_bin_type=True)
        self._f.write(_HDR.pack(len(body)) + body)
        self._f.flush()
        if self._f.tell() > self.max_bytes:
            self._f.close()
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self._f = open(self.path, "ab")  # noqa: SIM115
        self._changed.set()
        self._changed = trio.Event()
        return self.seq

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._f.close()
            self._changed.set()

    def _scan(self) -> Iterator[LogRecord]:
        for p in (self.path.with_name(self.path.name + ".1"), self.path):
            try:
                data = p.read_bytes()
            except FileNotFoundError:
                continue
            i = 0
            while i + 4 <= len(data):
                (n,) = _HDR.unpack_from(data, i)
                if i + 4 + n > len(data):
                    break  # a torn last record (crash mid-write): ignore it
                try:
                    seq, ts, src, chunk = msgpack.unpackb(data[i + 4 : i + 4 + n], raw=False)
                except Exception:
                    break
                yield LogRecord(seq, ts, src, chunk)
                i += 4 + n

    def read(self, *, tail: int = 0, since: int = 0, until: int = 0, cursor: int = 0) -> list[LogRecord]:
        recs = [
            r for r in self._scan() if r.seq > cursor and r.timestamp >= since and (not until or r.timestamp <= until)
        ]
        return recs[-tail:] if tail else recs

    async def follow(self, *, tail: int = 0, since: int = 0, cursor: int = 0) -> AsyncGenerator[LogRecord, None]:
        for r in self.read(tail=tail, since=since, cursor=cursor):
            cursor = r.seq
            yield r
        while not self._closed:
            changed = self._changed
            await changed.wait()
            for r in self.read(cursor=cursor):
                cursor = r.seq
                yield r


def read_log_file(path: Path, **kw: int) -> list[LogRecord]:
    """Read a stopped sandbox's log without opening it for appending."""
    log = SandboxLog.__new__(SandboxLog)
    log.path = path
    return log.read(**kw)
