"""Directory trees as tar streams, and patches: the file-system half of ``read_tree``,
``write_tree`` and ``patch``.

guestd imports this module only in the forked worker that serves one of those
requests (see ``workers.Worker``), never at boot: ``tarfile`` (with ``shutil``) costs
milliseconds of import that PID 1 should not pay to say hello. The host imports it
too (``actors.trees``): a tar stream that came out of a hostile guest is unpacked on
the host by the same code that unpacks the host's streams in the guest.

Unpacking is done with directory descriptors, never with path strings: each member's
parent is reached from the target directory one component at a time with
``O_DIRECTORY | O_NOFOLLOW``, so no name, however crafted, and no symlink, whether
the archive made it or a process planted it, leads outside the target. What is
refused (:class:`TreeError`, INVALID_ARGUMENT unless said otherwise)::

    /etc/passwd            absolute names
    a/../../x              '..' components
    l -> /etc, l/passwd    a name through a symlink (of the archive, or already there)
    hard link to ../x      a hard link to anything but a regular file of this archive
    char/block dev, FIFO   special files
    a 1 GiB pax header     header payloads above MAX_TREE_META
    no end-of-archive      a truncated or malformed stream
    a\0b, mtime=inf, uid   a NUL in a name or link, a time or owner out of range
    =2**70, bad records    (whatever tarfile's parser raises on a hostile header,
                           ValueError, OverflowError, ..., is a TreeError too)
    > MAX_TREE, entries    TOO_LARGE

An existing file at a member's name is replaced (unlinked first: neither a symlink
nor a hard link is ever written through); an existing directory is merged; a
directory is never replaced by a non-directory (IS_A_DIRECTORY). Directory modes and
times are applied last, deepest first, as tar does; with ``keep_existing`` (the host
unpacking a guest's tree) only to the directories this unpack made: one that was
already there keeps its mode, owner and times, as ``cp`` leaves them.

Packing walks with descriptors too (``O_NOFOLLOW``, ``fstat`` of what was opened):
symlinks are archived as links, regular files with their contents as of the fstat
(a file that shrinks meanwhile is padded with zeros, one that grows is cut), hard
links as links to their first name, directories on other file systems empty
(``tar --one-file-system``: no /proc in a tree of /); sockets, FIFOs and devices are
left out. Modes, numeric owners and whole-second mtimes (``tar``'s own precision:
no per-entry pax header); format POSIX pax (long names, big ids).
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
import struct
import tarfile

from guestd import proto as P
from guestd.fsops import DIR_FLAGS as _DIR
from guestd.fsops import TreeError

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

MAX_DEPTH = 256  # directory levels of a tree (each holds a descriptor while it is walked)


def _os_error(exc: OSError, what: str) -> TreeError:
    return TreeError(P.errcode(exc), f"{what}: {exc.strerror or exc}")


# ---------------------------------------------------------------------------
# pack
# ---------------------------------------------------------------------------


BATCH = 4 * P.CHUNK  # bytes handed to ``write`` at once (fewer pipe writes and wakeups)
_PAD = bytes(tarfile.RECORDSIZE)


class _Out:
    """The tar stream being written: batches small pieces, counts the total."""

    def __init__(self, write: Callable[[bytes], object]) -> None:
        self._write = write
        self.buf = bytearray()
        self.total = 0

    def put(self, data: bytes) -> None:
        self.total += len(data)
        if self.total > P.MAX_TREE_STREAM:
            raise TreeError(P.E_TOO_LARGE, f"the tree's tar stream exceeds {P.MAX_TREE_STREAM} bytes")
        self.buf += data
        if len(self.buf) >= BATCH:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            self._write(bytes(self.buf))
            self.buf.clear()

    def contents(self, fd: int, size: int) -> None:
        """Exactly ``size`` bytes of an open file, then the block padding: zeros after
        an early end of file (it shrank since the fstat, as tar pads), what it grew by
        is left out."""
        left = size
        while left > 0:
            b = os.read(fd, min(left, BATCH))
            if not b:
                b = bytes(min(left, BATCH))
            left -= len(b)
            self.put(b)
        self.put(_PAD[: -size % tarfile.BLOCKSIZE])


def write_fd(fd: int) -> Callable[[bytes], None]:
    """A ``write`` for :func:`pack` into a blocking descriptor."""

    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    return write


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


def _entry(name: str, st: os.stat_result, kind: bytes, size: int = 0, link: str = "") -> bytes:
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


def pack(root_fd: int, write: Callable[[bytes], object]) -> int:
    """Write the tree under the directory ``root_fd`` as a tar stream; returns the
    number of entries. The root itself is the entry ``.``; the rest are relative.

    Headers are tarfile's (``TarInfo.tobuf``: ustar, pax records where needed); the
    stream around them is written here, not by ``TarFile.addfile``, which copies
    every TarInfo and every byte through two more buffers (profiled: half of the
    time of a tree of small files went there)."""
    out = _Out(write)
    entries = 0
    total = 0
    links: dict[tuple[int, int], str] = {}

    def add(head: bytes, size: int = 0, fd: int = -1) -> None:
        nonlocal entries, total
        entries += 1
        total += size
        if entries > P.MAX_TREE_ENTRIES:
            raise TreeError(P.E_TOO_LARGE, f"the tree has more than {P.MAX_TREE_ENTRIES} entries")
        if total > P.MAX_TREE:
            raise TreeError(P.E_TOO_LARGE, f"the tree's files exceed {P.MAX_TREE} bytes")
        out.put(head)
        if fd >= 0:
            out.contents(fd, size)

    root_st = os.fstat(root_fd)
    add(_entry(".", root_st, tarfile.DIRTYPE))
    stack: list[tuple[int, str, list[tuple[str, bool]]]] = []

    def enter(fd: int, prefix: str) -> None:
        if len(stack) >= MAX_DEPTH:
            os.close(fd)
            raise TreeError(P.E_TOO_LARGE, f"the tree is deeper than {MAX_DEPTH} levels")
        with os.scandir(fd) as it:  # (whether an entry is a regular file: from readdir's d_type)
            names = sorted((e.name, e.is_file(follow_symlinks=False)) for e in it)
        names.reverse()  # popped from the end: in name order
        stack.append((fd, prefix, names))

    opened = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    enter(os.dup(root_fd), "")
    try:
        while stack:
            dfd, prefix, names = stack[-1]
            if not names:
                stack.pop()
                os.close(dfd)
                continue
            name, regular = names.pop()
            path = prefix + name
            if regular:  # the common case: opened and fstat'ed, no lstat first
                try:
                    fd = os.open(name, opened, dir_fd=dfd)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ELOOP):  # gone, or a symlink now
                        continue
                    raise _os_error(exc, path) from None
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        continue  # swapped for something else since the listing
                    if st.st_nlink > 1:
                        key = (st.st_dev, st.st_ino)
                        first = links.setdefault(key, path)
                        if first != path:
                            add(_entry(path, st, tarfile.LNKTYPE, link=first))
                            continue
                    add(_entry(path, st, tarfile.REGTYPE, st.st_size), st.st_size, fd)
                finally:
                    os.close(fd)
                continue
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone since the listing
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                add(_entry(path, st, tarfile.DIRTYPE))
                if st.st_dev == root_st.st_dev:
                    try:
                        sub = os.open(name, _DIR, dir_fd=dfd)
                    except FileNotFoundError:
                        continue
                    enter(sub, path + "/")
            elif stat.S_ISLNK(mode):
                try:
                    target = os.readlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    continue
                add(_entry(path, st, tarfile.SYMTYPE, link=target))
            elif stat.S_ISREG(mode):  # (a file that was something else at the listing)
                names.append((name, True))
            # sockets, FIFOs, devices: not archived
        out.put(bytes(2 * tarfile.BLOCKSIZE))  # the end-of-archive marker
        out.put(_PAD[: -out.total % tarfile.RECORDSIZE])  # whole records, as tar writes them
        out.flush()
    except OSError as exc:
        raise _os_error(exc, "read tree") from None
    finally:
        for dfd, _, _ in stack:
            os.close(dfd)
    return entries


# ---------------------------------------------------------------------------
# unpack
# ---------------------------------------------------------------------------


class _SourceError(Exception):
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
_SPECIAL_TYPES = frozenset(b"346")  # character and block devices, FIFOs: refused
_SIGNED = struct.Struct("148b8x356b")


class _Reader:
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
            raise _SourceError(exc) from exc
        if not data:
            return False
        self.count += len(data)
        if self.count > P.MAX_TREE_STREAM:
            raise TreeError(P.E_TOO_LARGE, f"the tar stream exceeds {P.MAX_TREE_STREAM} bytes")
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
                raise TreeError(P.E_INVALID, "truncated tar stream")
            k = min(n, len(self.buf) - self.pos)
            self.pos += k
            n -= k

    def copy(self, fd: int, n: int, name: str) -> None:
        """The next ``n`` bytes into ``fd``, then the member's block padding skipped."""
        pad = -n % _BLOCK
        while n > 0:
            if self.pos >= len(self.buf) and not self._more(n):
                raise TreeError(P.E_INVALID, f"{name}: truncated tar stream")
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
        while self._more(P.CHUNK):
            self.pos = len(self.buf)


def read_fd(fd: int) -> Callable[[int], bytes]:
    """A ``read`` for :func:`unpack` from a blocking descriptor."""
    return lambda n: os.read(fd, n)


class _Member:
    """One archive entry, as the header (and the pax or GNU long-name headers before
    it) described it. Numbers are as parsed: :func:`_check_header` bounds them."""

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
    return TreeError(P.E_INVALID, f"malformed tar stream: {what}"[:300])


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


def _next_member(r: _Reader, glob: dict[str, bytes]) -> _Member | None:
    """The next entry (None at the end-of-archive marker), its pax and GNU long-name
    headers applied; its contents are the stream's next bytes (regular files only)."""
    pax: dict[str, bytes] = {}
    long_name: str | None = None
    long_link: str | None = None
    meta = 0  # this member's metadata headers' bytes: MAX_TREE_META in all, not each
    while True:
        block = r.take(_BLOCK)
        if not block:
            raise TreeError(P.E_INVALID, "truncated tar stream (no end-of-archive marker)")
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
            if meta > P.MAX_TREE_META:
                raise TreeError(P.E_INVALID, f"tar headers of {meta} bytes (the limit is {P.MAX_TREE_META})")
            payload = r.take(size)
            if len(payload) < size:
                raise TreeError(P.E_INVALID, "truncated tar stream")
            r.skip(-size % _BLOCK)
            if kind == 0x4C:  # "L"
                long_name = _text(payload)
            elif kind == 0x4B:  # "K"
                long_link = _text(payload)
            elif kind == 0x67:  # "g": for every member after it
                glob.update(_pax_records(payload))
                if sum(len(k) + len(v) for k, v in glob.items()) > P.MAX_TREE_META:  # they add up over members
                    raise TreeError(P.E_INVALID, f"global pax records over {P.MAX_TREE_META} bytes")
            else:
                pax.update(_pax_records(payload))
            continue
        name = _text(block[_NAME[0] : _NAME[1]])
        if block[_MAGIC[0] : _MAGIC[1]] == _POSIX_MAGIC and block[_PREFIX[0]]:
            name = _text(block[_PREFIX[0] : _PREFIX[1]]) + "/" + name
        if fast is None:
            mode, uid, gid = _octal(block, _MODE, "mode"), _octal(block, _UID, "uid"), _octal(block, _GID, "gid")
            mtime = _octal(block, _MTIME, "mtime")
        m = _Member(name, _text(block[_LINK[0] : _LINK[1]]), kind, mode)
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
                raise TreeError(P.E_INVALID, f"{m.name[:200]!r}: sparse files are not supported")
        if m.type == 0 and m.name.endswith("/"):
            m.type = 0x35  # an old-style directory
        if m.isdir():
            m.name = m.name.rstrip("/")
        return m


MAX_ID = 2**32 - 2  # uid/gid: (2**32 - 1 is -1, "unchanged", to chown)
MAX_MTIME = 2**40  # seconds either side of the epoch (34,000 years; os.utime's range is wider)


def _check_header(ti: _Member) -> None:
    """What the header said but the file system cannot take: refused here, typed, rather
    than as a ValueError or OverflowError of the system call that would meet it."""
    name = ti.name[:200]
    if "\0" in ti.name or "\0" in ti.linkname:
        raise TreeError(P.E_INVALID, f"a NUL in an archive name or link: {name!r}")
    mtime = ti.mtime
    if not isinstance(mtime, (int, float)) or not math.isfinite(mtime) or not -MAX_MTIME < mtime < MAX_MTIME:
        raise TreeError(P.E_INVALID, f"{name!r}: mtime out of range: {str(mtime)[:40]}")
    for what, v in (("uid", ti.uid), ("gid", ti.gid)):
        if not isinstance(v, int) or not 0 <= v <= MAX_ID:
            raise TreeError(P.E_INVALID, f"{name!r}: {what} out of range: {str(v)[:40]}")
    if not isinstance(ti.size, int) or ti.size < 0 or not isinstance(ti.mode, int):
        raise TreeError(P.E_INVALID, f"{name!r}: bad size or mode")


def _umask() -> int:
    """This process's umask, read without changing it (another thread may be creating
    files): /proc/self/status; unknown, every bit (each file then gets its fchmod)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o777


def _parts(name: str) -> tuple[str, ...]:
    parts = tuple(name.split("/"))
    if "" not in parts and "." not in parts and ".." not in parts:
        return parts  # (the common name: no empty, '.' or '..' component)
    if name.startswith("/"):
        raise TreeError(P.E_INVALID, f"absolute name in the archive: {name[:200]!r}")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise TreeError(P.E_INVALID, f"'..' in an archive name: {name[:200]!r}")
    return parts


class _Unpacker:
    def __init__(
        self,
        dest_fd: int,
        owner: tuple[int, int] | None,
        keep_ids: bool,
        root_meta: bool,
        mode_mask: int,
        keep_existing: bool = False,
    ) -> None:
        self.dest = dest_fd
        self.keep_existing = keep_existing
        self.made: set[tuple[str, ...]] = set()  # directories this unpack created
        self.owner = owner
        self.keep_ids = keep_ids
        self.root_meta = root_meta
        self.mask = mode_mask
        self.files: set[tuple[str, ...]] = set()  # regular files of this archive: hard link targets
        self.dirs: dict[tuple[str, ...], tuple[int, int, int, int | None]] = {}  # mode, uid, gid, mtime
        # the current parent directory and its ancestors, open from the target down:
        # a member in another directory opens only what differs from the last one's path
        self._path: list[str] = []
        self._fds: list[int] = []
        self._key: tuple[str, ...] | None = ()
        self._sgid: bool | None = None  # whether the current parent has the setgid bit
        self.me = (os.geteuid(), os.getegid())  # the owner of what this process creates
        self.later = 0o7022 | _umask()  # mode bits a new file gets only by fchmod, once whole

    def close(self, keep: int = 0) -> None:
        """Close the open path below its first ``keep`` directories."""
        while len(self._fds) > keep:
            os.close(self._fds.pop())
            self._path.pop()
        self._key = None
        self._sgid = None

    def setgid_parent(self, pfd: int) -> bool:
        """Whether the current parent directory gives its group to new files."""
        if self._sgid is None:
            self._sgid = bool(os.fstat(pfd).st_mode & stat.S_ISGID)
        return self._sgid

    def ids(self, uid: int, gid: int) -> tuple[int, int] | None:
        if self.owner is not None:
            return self.owner
        return (uid, gid) if self.keep_ids else None

    def step(self, fd: int, parts: tuple[str, ...], i: int, *, create: bool, name: str) -> int:
        """A new descriptor of the directory ``parts[i]`` in ``fd`` (``parts[:i]``): never a
        symlink; made (0700 until :meth:`finish_dirs`) if missing and ``create``."""
        comp = parts[i]
        try:
            return os.open(comp, _DIR, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
            os.mkdir(comp, 0o700, dir_fd=fd)
            self.made.add(parts[: i + 1])
            uid, gid = self.owner if self.owner is not None else (-1, -1)
            self.dirs.setdefault(parts[: i + 1], (0o755, uid, gid, None))  # as tar makes parents
            return os.open(comp, _DIR, dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file or a symlink in the way
                where = "/".join(parts[: i + 1])
                raise TreeError(P.E_INVALID, f"{name}: {where} is a symlink or not a directory") from None
            raise

    def walk(self, parts: tuple[str, ...], *, create: bool, name: str) -> int:
        """A new descriptor of the directory ``parts`` (from the target, no symlinks)."""
        fd = os.dup(self.dest)
        try:
            for i in range(len(parts)):
                nfd = self.step(fd, parts, i, create=create, name=name)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def parent(self, parts: tuple[str, ...], name: str) -> int:
        key = parts[:-1]
        if key == self._key:
            return self._fds[-1] if self._fds else self.dest
        path = self._path
        common = 0
        for have, want in zip(path, key, strict=False):
            if have != want:
                break
            common += 1
        self.close(common)
        fd = self._fds[-1] if self._fds else self.dest
        for i in range(common, len(key)):
            fd = self.step(fd, key, i, create=True, name=name)
            self._fds.append(fd)
            path.append(key[i])
        self._key = key
        return fd

    def clear(self, pfd: int, leaf: str, name: str) -> None:
        """Make room for a non-directory at ``leaf``: unlink what is there, never a directory."""
        try:
            st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise TreeError(P.E_IS_DIR, f"{name}: a directory is in the way")
        os.unlink(leaf, dir_fd=pfd)

    def member(self, r: _Reader, ti: _Member) -> int:
        name = ti.name
        parts = _parts(name)
        if len(parts) > MAX_DEPTH:
            raise TreeError(P.E_INVALID, f"a name deeper than {MAX_DEPTH} levels: {name[:200]!r}")
        mode = ti.mode & self.mask
        if not parts:
            if not ti.isdir():
                raise TreeError(P.E_INVALID, "the archive's root entry is not a directory")
            if self.root_meta:
                uid, gid = self.ids(ti.uid, ti.gid) or (-1, -1)
                self.dirs[()] = (mode, uid, gid, int(ti.mtime))
            return 0
        pfd = self.parent(parts, name)
        leaf = parts[-1]
        ids = self.ids(ti.uid, ti.gid)
        if ti.isdir():
            try:
                os.mkdir(leaf, 0o700, dir_fd=pfd)
                self.made.add(parts)
            except FileExistsError:
                st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(leaf, dir_fd=pfd)
                    os.mkdir(leaf, 0o700, dir_fd=pfd)
                    self.made.add(parts)
            if self.keep_existing and parts not in self.made:
                return 0  # already there: its mode, owner and times stay
            uid, gid = ids or (-1, -1)
            self.dirs[parts] = (mode, uid, gid, int(ti.mtime))
            return 0
        if ti.isreg():
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            # made with its final mode where that is safe (no setuid/setgid/sticky bit, no
            # write bit for group or others before the owner is set, nothing the umask
            # takes): one fchmod less per file; else 0600 and fchmod once it is whole
            first = mode if not mode & self.later else 0o600
            try:  # (the common case first: a raised and caught ENOENT per file costs)
                fd = os.open(leaf, flags, first, dir_fd=pfd)
            except FileExistsError:
                self.clear(pfd, leaf, name)
                fd = os.open(leaf, flags, first, dir_fd=pfd)
            done = False
            try:
                r.copy(fd, ti.size, name)
                if ids is not None and (ids != self.me or self.setgid_parent(pfd)):
                    os.fchown(fd, *ids)  # (not when it is ours already: root's own files)
                if first != mode:
                    os.fchmod(fd, mode)
                t = int(ti.mtime) * 1_000_000_000
                os.utime(fd, ns=(t, t))
                done = True
            finally:
                os.close(fd)
                if not done:  # no half file of a refused or broken stream
                    os.unlink(leaf, dir_fd=pfd)
            self.files.add(parts)
            return ti.size
        if ti.type == 0x32:  # symlink
            try:
                os.symlink(ti.linkname, leaf, dir_fd=pfd)
            except FileExistsError:
                self.clear(pfd, leaf, name)
                os.symlink(ti.linkname, leaf, dir_fd=pfd)
            if ids is not None:
                os.chown(leaf, *ids, dir_fd=pfd, follow_symlinks=False)
            t = int(ti.mtime) * 10**9
            os.utime(leaf, ns=(t, t), dir_fd=pfd, follow_symlinks=False)
            return 0
        if ti.type == 0x31:  # hard link
            target = _parts(ti.linkname)
            if target not in self.files:
                what = f"a hard link to {ti.linkname[:200]!r}, not a file of this archive"
                raise TreeError(P.E_INVALID, f"{name}: {what}")
            if target == parts:
                return 0
            self.clear(pfd, leaf, name)
            tfd = self.walk(target[:-1], create=False, name=name)
            try:
                os.link(target[-1], leaf, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
            finally:
                os.close(tfd)
            self.files.add(parts)
            return 0
        if ti.type in _SPECIAL_TYPES:
            raise TreeError(P.E_INVALID, f"{name}: device nodes and FIFOs are refused")
        raise TreeError(P.E_INVALID, f"{name}: unsupported tar entry type {bytes([ti.type])!r}")

    def finish_dirs(self) -> None:
        """Directory owners, modes and times, deepest first (their contents are in): in
        name order, each directory opened once from its parent's descriptor, and set
        when the walk leaves it (every directory below it is done by then)."""
        self.close()
        stack: list[tuple[tuple[str, ...], int]] = [((), os.dup(self.dest))]
        try:
            for parts in sorted(self.dirs):
                while parts[: len(stack[-1][0])] != stack[-1][0]:
                    self._set_dir(*stack.pop())
                have, fd = stack[-1]
                for i in range(len(have), len(parts)):
                    fd = self.step(fd, parts, i, create=False, name="/".join(parts))
                    stack.append((parts[: i + 1], fd))
            while stack:
                self._set_dir(*stack.pop())
        finally:
            for _, fd in stack:
                os.close(fd)

    def _set_dir(self, parts: tuple[str, ...], fd: int) -> None:
        try:
            meta = self.dirs.get(parts)
            if meta is not None:
                mode, uid, gid, mtime = meta
                if uid >= 0:
                    os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
                if mtime is not None:
                    os.utime(fd, ns=(mtime * 10**9, mtime * 10**9))
        finally:
            os.close(fd)


def unpack(
    read: Callable[[int], bytes],
    dest_fd: int,
    *,
    owner: tuple[int, int] | None = None,
    keep_ids: bool = True,
    root_meta: bool = False,
    mode_mask: int = 0o7777,
    keep_existing: bool = False,
) -> int:
    """Unpack the tar stream ``read`` yields into the directory ``dest_fd``; returns
    the number of entries. ``owner``: every entry gets this uid/gid; else the
    archive's numeric ids (``keep_ids``, as root) or the caller's. ``root_meta``: the
    archive's root entry (``.``) sets the target's mode and times (the caller made it).
    ``mode_mask``: 0o777 drops setuid, setgid and sticky bits (a host unpacking a
    guest's tree must: the guest chose them; a client's umask too).
    ``keep_existing``: directories that were there before keep their mode, owner and
    times; only what this unpack made gets the archive's.
    Every refusal or malformation is a :class:`TreeError` (an OSError of the target's
    file system too, with its errno's code); the ``read`` callback's own exceptions
    pass through as they are.
    The stream is read to its end, so a writer never sees a broken pipe on success."""
    r = _Reader(read)
    u = _Unpacker(dest_fd, owner, keep_ids, root_meta, mode_mask, keep_existing)
    glob: dict[str, bytes] = {}
    entries = 0
    total = 0
    try:
        while True:
            ti = _next_member(r, glob)
            if ti is None:
                break
            entries += 1
            if entries > P.MAX_TREE_ENTRIES:
                raise TreeError(P.E_TOO_LARGE, f"the archive has more than {P.MAX_TREE_ENTRIES} entries")
            if ti.isreg():
                total += ti.size
                if total > P.MAX_TREE:
                    raise TreeError(P.E_TOO_LARGE, f"the archive's files exceed {P.MAX_TREE} bytes")
            try:
                _check_header(ti)
                u.member(r, ti)
            except OSError as exc:
                raise _os_error(exc, ti.name[:200]) from None
        try:
            u.finish_dirs()
        except OSError as exc:
            raise _os_error(exc, "directory metadata") from None
        r.drain()
    except _SourceError as exc:
        raise exc.error from None
    finally:
        u.close()
    return entries
