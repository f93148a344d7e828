"""The snapshot export format: one file, framed, versioned, digest-checked. No I/O here.

An export is written and read as a stream (never whole in memory); its bytes were
chosen by whoever made the file, so the reader (:class:`Reader`, a push parser) bounds
every length before it buffers anything and checks every offset against the sizes
the manifest declared::

    MAGIC (8 bytes)  VERSION (u32, big-endian)
    frame*           kind (1 byte) | length (u32) | payload (length bytes)
      "M"  first and once: the manifest (msgpack map, at most MAX_MANIFEST bytes):
           {"files": [{"name", "size"}...], ...what the importer needs}
      "D"  file data: index (u32) | offset (u64) | bytes (at most MAX_CHUNK);
           files in manifest order, offsets rising, never past the file's size:
           the gaps are holes (sparse files stay sparse)
      "Z"  last: the SHA-256 of every byte before this frame (32 bytes); then EOF

A reader of version 1 refuses any other version with :class:`UnsupportedFormat`
(before it reads a frame), a bad magic, a malformed or oversized frame, an offset out
of bounds, a missing trailer (a truncated file) or trailing bytes with
:class:`~actors.errors.InvalidArgument`, and a digest that does not match with
:class:`CorruptExport` (INVALID_ARGUMENT too): whoever writes the data out must not
commit it before :meth:`Reader.close` returned.
"""

from __future__ import annotations

import hashlib
import re
import struct
from typing import Any

import attrs
import msgpack

from actors.errors import FailedPrecondition, InvalidArgument

MAGIC = b"SVSNAP\r\n"  # (\r\n: a text-mode transfer that mangles line ends is caught at once)
VERSION = 1
MAX_MANIFEST = 1 << 20
MAX_CHUNK = 4 << 20
MAX_FILES = 80
MAX_FILE_SIZE = 1 << 40
FRAME = struct.Struct(">cI")
DATA = struct.Struct(">IQ")
HEAD = len(MAGIC) + 4
DIGEST = 32
# the names a snapshot directory may hold (a manifest naming anything else is refused)
FILE_NAME = re.compile(r"(vmstate(-mapped)?|memory|disk\.qcow2|kernel|initrd|layer-[1-9][0-9]?)\Z")


class UnsupportedFormat(FailedPrecondition):
    """An export of a format version this supervisor does not read."""


class CorruptExport(InvalidArgument):
    """The export's bytes are not the ones its writer hashed."""


@attrs.frozen
class FileEntry:
    name: str
    size: int


@attrs.frozen
class Manifest:
    files: tuple[FileEntry, ...]
    body: dict[str, Any]  # the whole manifest, for the importer to check field by field


@attrs.frozen
class Data:
    index: int
    offset: int
    data: bytes


@attrs.frozen
class End:
    digest: bytes


Event = Manifest | Data | End


# --- writing ---------------------------------------------------------------------------------
def head(version: int = VERSION) -> bytes:
    return MAGIC + struct.pack(">I", version)


def frame(kind: bytes, payload: bytes) -> bytes:
    return FRAME.pack(kind, len(payload)) + payload


def manifest_frame(files: list[FileEntry], body: dict[str, Any]) -> bytes:
    data = {**body, "files": [{"name": f.name, "size": f.size} for f in files]}
    raw = msgpack.packb(data, use_bin_type=True)
    if len(raw) > MAX_MANIFEST:
        raise InvalidArgument(f"the manifest is {len(raw)} bytes; at most {MAX_MANIFEST}")
    return frame(b"M", raw)


def data_frame(index: int, offset: int, data: bytes) -> bytes:
    return FRAME.pack(b"D", DATA.size + len(data)) + DATA.pack(index, offset) + data


def end_frame(digest: bytes) -> bytes:
    return frame(b"Z", digest)


# --- reading ---------------------------------------------------------------------------------
def parse_manifest(raw: bytes) -> Manifest:
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise InvalidArgument(f"the export's manifest is not msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict) or not isinstance(body.get("files"), list):
        raise InvalidArgument("the export's manifest is not a map with a list of files")
    files: list[FileEntry] = []
    for f in body["files"]:
        if not isinstance(f, dict):
            raise InvalidArgument("a file entry of the manifest is not a map")
        name, size = f.get("name"), f.get("size")
        if not isinstance(name, str) or not FILE_NAME.match(name):
            raise InvalidArgument(f"the manifest names a file {str(name)[:80]!r} a snapshot does not hold")
        if type(size) is not int or not 0 <= size <= MAX_FILE_SIZE:
            raise InvalidArgument(f"file {name}: size out of range")
        if any(e.name == name for e in files):
            raise InvalidArgument(f"the manifest names {name} twice")
        files.append(FileEntry(name, size))
    if len(files) > MAX_FILES:
        raise InvalidArgument(f"the manifest names {len(files)} files; at most {MAX_FILES}")
    return Manifest(tuple(files), body)


class Reader:
    """A push parser: :meth:`feed` bytes as they come, get the events they complete;
    :meth:`close` at EOF (raises unless the trailer was read and matched)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._hash = hashlib.sha256()
        self._state = "head"  # head, manifest, frames, done
        self.manifest: Manifest | None = None
        self._file = 0  # the file data may come for (files in order)
        self._next = 0  # the lowest offset its next data may start at
        self.received = 0  # bytes fed

    def feed(self, data: bytes) -> list[Event]:
        if self._state == "done":
            if data:
                raise InvalidArgument("bytes after the export's trailer")
            return []
        self.received += len(data)
        self._buf += data
        events: list[Event] = []
        while (ev := self._step()) is not None:
            events.append(ev)
            if isinstance(ev, End):
                break
        if self._state == "done" and self._buf:
            raise InvalidArgument("bytes after the export's trailer")
        return events

    def close(self) -> None:
        """At the stream's end: INVALID_ARGUMENT unless the trailer was read (and matched)."""
        if self._state != "done":
            raise InvalidArgument(f"the export is truncated (it ended after {self.received} bytes)")

    def _take(self, n: int) -> bytes:
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def _step(self) -> Event | None:
        if self._state == "head":
            if len(self._buf) < HEAD:
                if not MAGIC.startswith(bytes(self._buf[: len(MAGIC)])):
                    raise InvalidArgument("not a sandvisor snapshot export (bad magic)")
                return None
            raw = self._take(HEAD)
            if raw[: len(MAGIC)] != MAGIC:
                raise InvalidArgument("not a sandvisor snapshot export (bad magic)")
            (version,) = struct.unpack(">I", raw[len(MAGIC) :])
            if version != VERSION:
                raise UnsupportedFormat(
                    f"the export is of format version {version}; this supervisor reads version {VERSION}"
                )
            self._hash.update(raw)
            self._state = "manifest"
        if len(self._buf) < FRAME.size:
            return None
        kind, length = FRAME.unpack_from(self._buf)
        if self._state == "manifest":
            if kind != b"M":
                raise InvalidArgument("the export does not start with its manifest")
            if length > MAX_MANIFEST:
                raise InvalidArgument(f"the export's manifest is {length} bytes; at most {MAX_MANIFEST}")
        elif kind == b"D":
            if not DATA.size <= length <= DATA.size + MAX_CHUNK:
                raise InvalidArgument(f"a data frame of {length} bytes")
        elif kind == b"Z":
            if length != DIGEST:
                raise InvalidArgument("the export's trailer is malformed")
        else:
            raise InvalidArgument(f"unknown frame kind {kind!r} in the export")
        if len(self._buf) < FRAME.size + length:
            return None
        raw = self._take(FRAME.size + length)
        payload = memoryview(raw)[FRAME.size :]
        if kind == b"Z":
            if self._hash.digest() != bytes(payload):
                raise CorruptExport("the export is corrupt: its SHA-256 does not match its trailer")
            self._state = "done"
            return End(bytes(payload))
        self._hash.update(raw)
        if kind == b"M":
            self.manifest = parse_manifest(bytes(payload))
            self._state = "frames"
            return self.manifest
        return self._data(payload)

    def _data(self, payload: memoryview) -> Data:
        assert self.manifest is not None
        index, offset = DATA.unpack_from(payload)
        files = self.manifest.files
        if index >= len(files) or index < self._file:
            raise InvalidArgument(f"data for file {index} out of order")
        if index != self._file:
            self._file, self._next = index, 0
        data = bytes(payload[DATA.size :])
        end = offset + len(data)
        if offset < self._next or end > files[index].size:
            raise InvalidArgument(f"{files[index].name}: data at {offset}..{end} out of bounds")
        self._next = end
        return Data(index, offset, data)
