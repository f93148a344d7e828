"""The tar archive format of ``read_tree`` and ``write_tree`` (POSIX pax, as tarfile writes
it): headers written (:func:`header`, :func:`entry`: ustar computed here for the common
entry, tarfile's ``tobuf`` for the rest) and the stream read back (:class:`Reader` over
a ``read`` callback, :func:`next_member` for each header with its pax and GNU long-name
headers applied, :func:`check_header` for what the file system cannot take). Every
malformed or hostile header is a :class:`TreeError`; no file is touched here: walking
and writing trees is :mod:`guestd.tree`'s.

Imported with :mod:`guestd.tree` only (never at guestd's boot: ``tarfile`` is costly).
"""

from __future__ import annotations

import math
import os
import re
import stat
import struct
import tarfile

from guestd import proto
from guestd.fsops import TreeError

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable


_USTAR = struct.Struct("100s8s8s8s12s12s8sc100s8s32s32s8s8s155s12x")
_MAX7, _MAX11 = 8**7, 8**11


def header(ti: tarfile.TarInfo) -> bytes:
    """``ti.tobuf(PAX_FORMAT, "utf-8", "surrogateescape")``, byte for byte, computed
    here for the common entry (an ASCII name and link target within ustar's fields,
    no pax record needed) and by tarfile for every other. tarfile's costs half of
    packing a tree of small files (a dict of fields, per-field encoding, two
    checksums); this, a fifth of it (profiled)."""
    if not (ti.pax_headers or ti.uname or ti.gname):
        fast = _ustar(ti.name, ti.type, ti.mode, ti.uid, ti.gid, ti.size, ti.mtime, ti.linkname)
        if fast is not None:
            return fast
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _ustar(name: str, kind: bytes, mode: int, uid: int, gid: int, size: int, mtime: object, link: str) -> bytes | None:
    """:func:`header`'s common entry from its fields (no TarInfo made: pack's per-entry
    cost under TCG); None when it needs tarfile (long or non-ASCII names, big numbers)."""
    if kind == b"5" and not name.endswith("/"):
        name += "/"
    if (
        len(name) > 100
        or len(link) > 100
        or not name.isascii()
        or not link.isascii()
        or not (0 <= uid < _MAX7 and 0 <= gid < _MAX7 and 0 <= size < _MAX11)
        or type(mtime) is not int
        or not 0 <= mtime < _MAX11
    ):
        return None
    buf = bytearray(
        _USTAR.pack(
            name.encode(),
            b"%07o\0" % (mode & 0o7777),
            b"%07o\0" % uid,
            b"%07o\0" % gid,
            b"%011o\0" % size,
            b"%011o\0" % mtime,
            b"        ",
            kind,
            link.encode(),
            tarfile.POSIX_MAGIC,
            b"",
            b"",
            b"",  # devmajor, devminor: empty but for devices (never packed), as tarfile writes them
            b"",
            b"",
        )
    )
    buf[148:155] = b"%06o\0" % sum(buf)  # the checksum, its own field counted as spaces
    return bytes(buf)


def entry(name: str, st: os.stat_result, kind: bytes, size: int = 0, link: str = "") -> bytes:
    """The header of one packed entry (numeric owners, whole-second mtime)."""
    mode, mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
    fast = _ustar(name, kind, mode, st.st_uid, st.st_gid, size, mtime, link)
    if fast is not None:
        return fast
    ti = _info(name, st, kind)
    ti.size, ti.linkname = size, link
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _info(name: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = stat.S_IMODE(st.st_mode)
    ti.uid, ti.gid = st.st_uid, st.st_gid
    ti.uname = ti.gname = ""  # numeric owners only: names mean nothing on the other side
    ti.mtime = int(st.st_mtime)
    return ti


class SourceError(Exception):
    """The ``read`` callback's own exception, carried out of the parser unchanged."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


READ_SIZE = 64 * 1024  # bytes asked of the ``read`` callback at once (below malloc's mmap threshold)
_BLOCK = 512
_NAME, _MODE, _UID, _GID, _SIZE, _MTIME = (0, 100), (100, 108), (108, 116), (116, 124), (124, 136), (136, 148)
_CHKSUM, _TYPE, _LINK, _MAGIC, _PREFIX = (148, 156), 156, (157, 257), (257, 265), (345, 500)
_POSIX_MAGIC = b"ustar\x0000"
_NUMBER_MAX = 24  # digits of a pax record's length, or of a number in one
_REG_TYPES = frozenset(b"0\x007")  # regular file (old "\0", contiguous "7" too, as tar reads them)
SPECIAL_TYPES = frozenset(b"346")  # character and block devices, FIFOs: refused
_SIGNED = struct.Struct("148b8x356b")


class Reader:
    """The tar stream: a buffer over the ``read`` callback, capped at MAX_TREE_STREAM.
    Headers come out of the buffer; file contents go from it straight to the file in
    pieces as large as the source gives (no per-block copies, as tarfile makes)."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read
        self.buf = bytearray()
        self.pos = 0
        self.count = 0

    def _more(self, want: int) -> bool:
        try:
            data = self._read(READ_SIZE)  # (a pipe gives what it holds: asking for more only allocates more)
        except Exception as exc:
            raise SourceError(exc) from exc
        if not data:
            return False
        self.count += len(data)
        if self.count > proto.MAX_TREE_STREAM:
            raise TreeError(proto.E_TOO_LARGE, f"the tar stream exceeds {proto.MAX_TREE_STREAM} bytes")
        if self.pos:
            del self.buf[: self.pos]  # (a front delete of a bytearray moves no bytes)
            self.pos = 0
        self.buf += data
        return True

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes, fewer only at the end of the stream."""
        while len(self.buf) - self.pos < n and self._more(n - (len(self.buf) - self.pos)):
            pass
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += len(out)
        return out

    def skip(self, n: int) -> None:
        while n > 0:
            if self.pos >= len(self.buf) and not self._more(n):
                raise TreeError(proto.E_INVALID, "truncated tar stream")
            k = min(n, len(self.buf) - self.pos)
            self.pos += k
            n -= k

    def copy(self, fd: int, n: int, name: str) -> None:
        """The next ``n`` bytes into ``fd``, then the member's block padding skipped."""
        pad = -n % _BLOCK
        while n > 0:
            if self.pos >= len(self.buf) and not self._more(n):
                raise TreeError(proto.E_INVALID, f"{name}: truncated tar stream")
            with memoryview(self.buf) as mv:
                view = mv[self.pos : self.pos + n]
                k = len(view)
                while view:
                    view = view[os.write(fd, view) :]
                view.release()  # (else the buffer cannot grow)
            self.pos += k
            n -= k
        self.skip(pad)

    def drain(self) -> None:
        """Read to the end (the writer's padding after the end-of-archive marker)."""
        self.pos = len(self.buf)
        while self._more(proto.CHUNK):
            self.pos = len(self.buf)


class Member:
    """One archive entry, as the header (and the pax or GNU long-name headers before
    it) described it. Numbers are as parsed: :func:`check_header` bounds them."""

    __slots__ = ("gid", "linkname", "mode", "mtime", "name", "size", "type", "uid")

    def __init__(self, name: str, linkname: str, type_: int, mode: int) -> None:
        self.name, self.linkname, self.type, self.mode = name, linkname, type_, mode
        self.uid = self.gid = self.size = 0
        self.mtime: int | float = 0

    def isreg(self) -> bool:
        return self.type in _REG_TYPES

    def isdir(self) -> bool:
        return self.type == 0x35  # "5"


def _malformed(what: str) -> TreeError:
    return TreeError(proto.E_INVALID, f"malformed tar stream: {what}"[:300])


# mode, uid, gid, size, mtime and checksum as tar writes them (zero-padded, NUL-ended;
# the checksum "%06o\0 "): every other spelling goes through _octal, field by field
_NUMBERS = re.compile(rb"([0-7]{7})\0([0-7]{7})\0([0-7]{7})\0([0-7]{11})\0([0-7]{11})\0([0-7]{6})\0 ")


def _octal(block: bytes, field: tuple[int, int], what: str) -> int:
    raw = block[field[0] : field[1]]
    if raw[:1] in (b"\x80", b"\xff"):  # GNU base-256 (big ids, sizes, times)
        n = int.from_bytes(raw[1:], "big")
        return n - 256 ** (len(raw) - 1) if raw[0] == 0xFF else n
    digits = raw.split(b"\0", 1)[0].strip(b" ")
    if not digits:
        return 0
    if not digits.isdigit():  # (ASCII digits only: int() alone takes "0o", "_", ...)
        raise _malformed(f"bad {what} field {raw!r}")
    try:
        return int(digits, 8)
    except ValueError:  # an 8 or a 9
        raise _malformed(f"bad {what} field {raw!r}") from None


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax_number(value: bytes, key: str, kind: type[int] | type[float]) -> int | float:
    if len(value) > _NUMBER_MAX:
        raise _malformed(f"pax {key} of {len(value)} digits")
    try:
        return kind(value.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        raise _malformed(f"pax {key} {value[:40]!r}") from None


def _pax_records(payload: bytes) -> dict[str, bytes]:
    """``"%d %s=%s\\n"`` records (the length counts the whole record); NULs after them
    are padding. Any other shape is malformed."""
    out: dict[str, bytes] = {}
    pos = 0
    while pos < len(payload) and payload[pos]:
        sp = payload.find(b" ", pos, pos + _NUMBER_MAX)
        digits = payload[pos:sp] if sp > pos else b""
        if not digits.isdigit():
            raise _malformed("a pax record without a length")
        end = pos + int(digits)
        if end > len(payload) or end < sp + 3 or payload[end - 1] != 0x0A:
            raise _malformed("a pax record's length is out of its header")
        eq = payload.find(b"=", sp + 1, end)
        if eq <= sp + 1:
            raise _malformed("a pax record without a key")
        try:
            key = payload[sp + 1 : eq].decode("utf-8")
        except UnicodeDecodeError:
            raise _malformed("a pax key that is not UTF-8") from None
        out[key] = payload[eq + 1 : end - 1]
        pos = end
    if payload[pos:].strip(b"\0"):
        raise _malformed("junk after the pax records")
    return out


def next_member(r: Reader, glob: dict[str, bytes]) -> Member | None:
    """The next entry (None at the end-of-archive marker), its pax and GNU long-name
    headers applied; its contents are the stream's next bytes (regular files only)."""
    pax: dict[str, bytes] = {}
    long_name: str | None = None
    long_link: str | None = None
    meta = 0  # this member's metadata headers' bytes: MAX_TREE_META in all, not each
    while True:
        block = r.take(_BLOCK)
        if not block:
            raise TreeError(proto.E_INVALID, "truncated tar stream (no end-of-archive marker)")
        if len(block) < _BLOCK:
            raise _malformed("truncated header")
        if not any(block):
            return None  # the end-of-archive marker
        fast = _NUMBERS.match(block, 100, 156)
        if fast is not None:  # (the fields as tar and tarfile write them: one match for six)
            mode, uid, gid, size, mtime, chksum = (int(g, 8) for g in fast.groups())
        else:
            chksum = _octal(block, _CHKSUM, "checksum")
            size = _octal(block, _SIZE, "size")
        unsigned = 256 + sum(block[:148]) + sum(block[156:])
        if chksum != unsigned and chksum != 256 + sum(_SIGNED.unpack_from(block)):
            raise _malformed("bad checksum in a header")
        kind = block[_TYPE]
        if size < 0:
            raise _malformed("negative size")
        if kind in b"xXgLK":  # pax (local, Solaris, global) and GNU long-name headers
            meta += size
            if meta > proto.MAX_TREE_META:
                raise TreeError(proto.E_INVALID, f"tar headers of {meta} bytes (the limit is {proto.MAX_TREE_META})")
            payload = r.take(size)
            if len(payload) < size:
                raise TreeError(proto.E_INVALID, "truncated tar stream")
            r.skip(-size % _BLOCK)
            if kind == 0x4C:  # "L"
                long_name = _text(payload)
            elif kind == 0x4B:  # "K"
                long_link = _text(payload)
            elif kind == 0x67:  # "g": for every member after it
                glob.update(_pax_records(payload))
                if sum(len(k) + len(v) for k, v in glob.items()) > proto.MAX_TREE_META:  # they add up over members
                    raise TreeError(proto.E_INVALID, f"global pax records over {proto.MAX_TREE_META} bytes")
            else:
                pax.update(_pax_records(payload))
            continue
        name = _text(block[_NAME[0] : _NAME[1]])
        if block[_MAGIC[0] : _MAGIC[1]] == _POSIX_MAGIC and block[_PREFIX[0]]:
            name = _text(block[_PREFIX[0] : _PREFIX[1]]) + "/" + name
        if fast is None:
            mode, uid, gid = _octal(block, _MODE, "mode"), _octal(block, _UID, "uid"), _octal(block, _GID, "gid")
            mtime = _octal(block, _MTIME, "mtime")
        m = Member(name, _text(block[_LINK[0] : _LINK[1]]), kind, mode)
        m.uid, m.gid, m.size, m.mtime = uid, gid, size, mtime
        if long_name is not None:
            m.name = long_name
        if long_link is not None:
            m.linkname = long_link
        records = {**glob, **pax} if glob else pax
        for key, value in records.items():
            if key == "path":
                m.name = value.decode("utf-8", "surrogateescape")
            elif key == "linkpath":
                m.linkname = value.decode("utf-8", "surrogateescape")
            elif key in ("size", "uid", "gid"):
                setattr(m, key, _pax_number(value, key, int))
            elif key == "mtime":
                m.mtime = _pax_number(value, key, float)
            elif key.startswith("GNU.sparse."):
                raise TreeError(proto.E_INVALID, f"{m.name[:200]!r}: sparse files are not supported")
        if m.type == 0 and m.name.endswith("/"):
            m.type = 0x35  # an old-style directory
        if m.isdir():
            m.name = m.name.rstrip("/")
        return m


MAX_ID = 2**32 - 2  # uid/gid: (2**32 - 1 is -1, "unchanged", to chown)
MAX_MTIME = 2**40  # seconds either side of the epoch (34,000 years; os.utime's range is wider)


def check_header(ti: Member) -> None:
    """What the header said but the file system cannot take: refused here, typed, rather
    than as a ValueError or OverflowError of the system call that would meet it."""
    name = ti.name[:200]
    if "\0" in ti.name or "\0" in ti.linkname:
        raise TreeError(proto.E_INVALID, f"a NUL in an archive name or link: {name!r}")
    mtime = ti.mtime
    if not isinstance(mtime, (int, float)) or not math.isfinite(mtime) or not -MAX_MTIME < mtime < MAX_MTIME:
        raise TreeError(proto.E_INVALID, f"{name!r}: mtime out of range: {str(mtime)[:40]}")
    for what, v in (("uid", ti.uid), ("gid", ti.gid)):
        if not isinstance(v, int) or not 0 <= v <= MAX_ID:
            raise TreeError(proto.E_INVALID, f"{name!r}: {what} out of range: {str(v)[:40]}")
    if not isinstance(ti.size, int) or ti.size < 0 or not isinstance(ti.mode, int):
        raise TreeError(proto.E_INVALID, f"{name!r}: bad size or mode")
