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
_META_TYPES = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)


def _os_error(exc: OSError, what: str) -> TreeError:
    return TreeError(P.errcode(exc), f"{what}: {exc.strerror or exc}")


# ---------------------------------------------------------------------------
# pack
# ---------------------------------------------------------------------------


BATCH = 4 * P.CHUNK  # bytes handed to ``write`` at once (fewer pipe writes and wakeups)
_PAD = bytes(tarfile.RECORDSIZE)
READ_BUFFER = 16 * 1024


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
    name = ti.name + "/" if ti.type == tarfile.DIRTYPE and not ti.name.endswith("/") else ti.name
    link = ti.linkname
    mtime = ti.mtime
    if (
        len(name) > 100
        or len(link) > 100
        or not name.isascii()
        or not link.isascii()
        or not (0 <= ti.uid < _MAX7 and 0 <= ti.gid < _MAX7 and 0 <= ti.size < _MAX11)
        or type(mtime) is not int
        or not 0 <= mtime < _MAX11
        or ti.pax_headers
        or ti.uname
        or ti.gname
    ):
        return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    buf = bytearray(
        _USTAR.pack(
            name.encode(),
            b"%07o\0" % (ti.mode & 0o7777),
            b"%07o\0" % ti.uid,
            b"%07o\0" % ti.gid,
            b"%011o\0" % ti.size,
            b"%011o\0" % mtime,
            b"        ",
            ti.type,
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

    def add(ti: tarfile.TarInfo, fd: int = -1) -> None:
        nonlocal entries, total
        entries += 1
        total += ti.size
        if entries > P.MAX_TREE_ENTRIES:
            raise TreeError(P.E_TOO_LARGE, f"the tree has more than {P.MAX_TREE_ENTRIES} entries")
        if total > P.MAX_TREE:
            raise TreeError(P.E_TOO_LARGE, f"the tree's files exceed {P.MAX_TREE} bytes")
        out.put(header(ti))
        if fd >= 0:
            out.contents(fd, ti.size)

    root_st = os.fstat(root_fd)
    add(_info(".", root_st, tarfile.DIRTYPE))
    stack: list[tuple[int, str, list[str]]] = []

    def enter(fd: int, prefix: str) -> None:
        if len(stack) >= MAX_DEPTH:
            os.close(fd)
            raise TreeError(P.E_TOO_LARGE, f"the tree is deeper than {MAX_DEPTH} levels")
        with os.scandir(fd) as it:
            names = sorted(e.name for e in it)
        names.reverse()  # popped from the end: in name order
        stack.append((fd, prefix, names))

    enter(os.dup(root_fd), "")
    try:
        while stack:
            dfd, prefix, names = stack[-1]
            if not names:
                stack.pop()
                os.close(dfd)
                continue
            name = names.pop()
            path = prefix + name
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone since the listing
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                add(_info(path, st, tarfile.DIRTYPE))
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
                ti = _info(path, st, tarfile.SYMTYPE)
                ti.linkname = target
                add(ti)
            elif stat.S_ISREG(mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in links:
                    ti = _info(path, st, tarfile.LNKTYPE)
                    ti.linkname = links[key]
                    add(ti)
                    continue
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ELOOP):  # gone, or a symlink now
                        continue
                    raise _os_error(exc, path) from None
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        continue  # swapped for something else since the lstat
                    if st.st_nlink > 1:
                        links.setdefault((st.st_dev, st.st_ino), path)
                    ti = _info(path, st, tarfile.REGTYPE)
                    ti.size = st.st_size
                    add(ti, fd)
                finally:
                    os.close(fd)
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
    """The ``read`` callback's own exception, carried through tarfile unchanged."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _Source:
    """The file object tarfile's stream mode reads from; caps the stream's length."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read
        self.count = 0

    def read(self, n: int) -> bytes:
        try:
            data = self._read(n)
        except Exception as exc:
            raise _SourceError(exc) from exc
        self.count += len(data)
        if self.count > P.MAX_TREE_STREAM:
            raise TreeError(P.E_TOO_LARGE, f"the tar stream exceeds {P.MAX_TREE_STREAM} bytes")
        return data

    def close(self) -> None:
        pass


def read_fd(fd: int) -> Callable[[int], bytes]:
    """A ``read`` for :func:`unpack` from a blocking descriptor."""
    return lambda n: os.read(fd, n)


_EOFHeaderError: type[Exception] = tarfile.EOFHeaderError  # type: ignore[attr-defined]
_EmptyHeaderError: type[Exception] = tarfile.EmptyHeaderError  # type: ignore[attr-defined]


class _Info(tarfile.TarInfo):
    """TarInfo that refuses oversized pax and long-name headers before tarfile reads
    their payload into memory, and malformed headers instead of ending quietly."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> _Info:
        try:
            return super().fromtarfile(tarfile_)
        except _EOFHeaderError:
            raise  # the end-of-archive marker
        except _EmptyHeaderError:
            raise TreeError(P.E_INVALID, "truncated tar stream (no end-of-archive marker)") from None
        except tarfile.HeaderError as exc:
            raise TreeError(P.E_INVALID, f"malformed tar stream: {exc}") from None

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _META_TYPES and self.size > P.MAX_TREE_META:
            raise TreeError(P.E_INVALID, f"a tar header of {self.size} bytes (the limit is {P.MAX_TREE_META})")
        return super()._proc_member(tarfile_)  # type: ignore[misc,no-any-return]


MAX_ID = 2**32 - 2  # uid/gid: (2**32 - 1 is -1, "unchanged", to chown)
MAX_MTIME = 2**40  # seconds either side of the epoch (34,000 years; os.utime's range is wider)


def _check_header(ti: tarfile.TarInfo) -> None:
    """What tarfile parsed but the file system cannot take: refused here, typed, rather
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


def _parts(name: str) -> tuple[str, ...]:
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
        self._key: tuple[str, ...] | None = None
        self._fd = -1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._key = None

    def ids(self, uid: int, gid: int) -> tuple[int, int] | None:
        if self.owner is not None:
            return self.owner
        return (uid, gid) if self.keep_ids else None

    def walk(self, parts: tuple[str, ...], *, create: bool, name: str) -> int:
        """A new descriptor of the directory ``parts`` (from the target, no symlinks)."""
        fd = os.dup(self.dest)
        try:
            for i, comp in enumerate(parts):
                try:
                    nfd = os.open(comp, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(comp, 0o700, dir_fd=fd)
                    self.made.add(parts[: i + 1])
                    uid, gid = self.owner if self.owner is not None else (-1, -1)
                    self.dirs.setdefault(parts[: i + 1], (0o755, uid, gid, None))  # as tar makes parents
                    nfd = os.open(comp, _DIR, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file or a symlink in the way
                        where = "/".join(parts[: i + 1])
                        raise TreeError(P.E_INVALID, f"{name}: {where} is a symlink or not a directory") from None
                    raise
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def parent(self, parts: tuple[str, ...], name: str) -> int:
        key = parts[:-1]
        if key != self._key:
            self.close()
            self._fd = self.walk(key, create=True, name=name)
            self._key = key
        return self._fd

    def clear(self, pfd: int, leaf: str, name: str) -> None:
        """Make room for a non-directory at ``leaf``: unlink what is there, never a directory."""
        try:
            st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise TreeError(P.E_IS_DIR, f"{name}: a directory is in the way")
        os.unlink(leaf, dir_fd=pfd)

    def member(self, tf: tarfile.TarFile, ti: tarfile.TarInfo) -> int:
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
            try:  # (the common case first: a raised and caught ENOENT per file costs)
                fd = os.open(leaf, flags, 0o600, dir_fd=pfd)
            except FileExistsError:
                self.clear(pfd, leaf, name)
                fd = os.open(leaf, flags, 0o600, dir_fd=pfd)
            done = False
            try:
                # a plain member's data is the stream's next bytes: read them there, not
                # through extractfile's two more buffers (sparse members need those)
                src = tf.extractfile(ti) if ti.sparse is not None else tf.fileobj
                assert src is not None
                left = ti.size
                while left > 0:
                    chunk = src.read(min(left, BATCH))
                    if not chunk:
                        raise TreeError(P.E_INVALID, f"{name}: truncated tar stream")
                    left -= len(chunk)
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
                if ids is not None:
                    os.fchown(fd, *ids)
                os.fchmod(fd, mode)
                os.utime(fd, ns=(int(ti.mtime) * 10**9, int(ti.mtime) * 10**9))
                done = True
            finally:
                os.close(fd)
                if not done:  # no half file of a refused or broken stream
                    os.unlink(leaf, dir_fd=pfd)
            self.files.add(parts)
            return ti.size
        if ti.issym():
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
        if ti.islnk():
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
        if ti.ischr() or ti.isblk() or ti.isfifo():
            raise TreeError(P.E_INVALID, f"{name}: device nodes and FIFOs are refused")
        raise TreeError(P.E_INVALID, f"{name}: unsupported tar entry type {ti.type!r}")

    def finish_dirs(self) -> None:
        """Directory owners, modes and times, deepest first (their contents are in)."""
        self.close()
        for parts in sorted(self.dirs, key=len, reverse=True):
            mode, uid, gid, mtime = self.dirs[parts]
            fd = self.walk(parts, create=False, name="/".join(parts) or ".")
            try:
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
    src = _Source(read)
    u = _Unpacker(dest_fd, owner, keep_ids, root_meta, mode_mask, keep_existing)
    entries = 0
    total = 0
    try:
        try:
            tf = tarfile.open(  # type: ignore[call-overload]  # noqa: SIM115 - closed below
                fileobj=src,
                mode="r|",
                # small: tarfile's stream copies its whole remaining buffer on every read,
                # a 512-byte header too (measured, 1000 small files under TCG: 3.6 s with
                # 64 KiB, 13 s with 256 KiB; GNU tar over exec 2.8 s)
                bufsize=READ_BUFFER,
                tarinfo=_Info,
                encoding="utf-8",
                errors="surrogateescape",
            )
        except tarfile.ReadError as exc:
            raise TreeError(P.E_INVALID, f"not a tar stream: {exc}") from None
        except TreeError:
            raise
        except _SourceError as exc:
            raise exc.error from None
        except Exception as exc:  # the first header is parsed here: as in next() below
            raise TreeError(P.E_INVALID, f"malformed tar stream: {type(exc).__name__}: {exc}"[:300]) from None
        while True:
            try:
                ti = tf.next()
            except TreeError:
                raise
            except _SourceError as exc:
                raise exc.error from None
            except Exception as exc:  # tarfile's parser on hostile headers: TarError, ValueError, OverflowError, ...
                raise TreeError(P.E_INVALID, f"malformed tar stream: {type(exc).__name__}: {exc}"[:300]) from None
            tf.members.clear()
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
                u.member(tf, ti)
            except TreeError:
                raise
            except _SourceError as exc:
                raise exc.error from None
            except OSError as exc:
                raise _os_error(exc, ti.name[:200]) from None
            except Exception as exc:  # a sparse map, ... (never a hostile stream's exception of its own)
                what = f"{ti.name[:200]}: malformed tar stream: {type(exc).__name__}: {exc}"
                raise TreeError(P.E_INVALID, what[:400]) from None
        try:
            u.finish_dirs()
        except OSError as exc:
            raise _os_error(exc, "directory metadata") from None
        try:
            while src.read(P.CHUNK):  # the writer's padding after the end-of-archive marker
                pass
        except _SourceError as exc:
            raise exc.error from None
    finally:
        u.close()
    return entries
