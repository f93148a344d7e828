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

This module walks and writes the file system; the archive format (headers written,
the stream parsed, hostile headers refused) is :mod:`guestd.tarformat`'s.
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile

from guestd import proto
from guestd.fsops import DIR_FLAGS as _DIR
from guestd.fsops import TreeError
from guestd.tarformat import SPECIAL_TYPES, Member, Reader, SourceError, check_header, entry, next_member

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

MAX_DEPTH = 256  # directory levels of a tree (each holds a descriptor while it is walked)


def _os_error(exc: OSError, what: str) -> TreeError:
    return TreeError(proto.errcode(exc), f"{what}: {exc.strerror or exc}")


# ---------------------------------------------------------------------------
# pack
# ---------------------------------------------------------------------------


BATCH = 4 * proto.CHUNK  # bytes handed to ``write`` at once (fewer pipe writes and wakeups)
_PAD = bytes(tarfile.RECORDSIZE)


class _Out:
    """The tar stream being written: batches small pieces, counts the total."""

    def __init__(self, write: Callable[[bytes], object]) -> None:
        self._write = write
        self.buf = bytearray()
        self.total = 0

    def put(self, data: bytes) -> None:
        self.total += len(data)
        if self.total > proto.MAX_TREE_STREAM:
            raise TreeError(proto.E_TOO_LARGE, f"the tree's tar stream exceeds {proto.MAX_TREE_STREAM} bytes")
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
        if entries > proto.MAX_TREE_ENTRIES:
            raise TreeError(proto.E_TOO_LARGE, f"the tree has more than {proto.MAX_TREE_ENTRIES} entries")
        if total > proto.MAX_TREE:
            raise TreeError(proto.E_TOO_LARGE, f"the tree's files exceed {proto.MAX_TREE} bytes")
        out.put(head)
        if fd >= 0:
            out.contents(fd, size)

    root_st = os.fstat(root_fd)
    add(entry(".", root_st, tarfile.DIRTYPE))
    stack: list[tuple[int, str, list[tuple[str, bool]]]] = []

    def enter(fd: int, prefix: str) -> None:
        if len(stack) >= MAX_DEPTH:
            os.close(fd)
            raise TreeError(proto.E_TOO_LARGE, f"the tree is deeper than {MAX_DEPTH} levels")
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
                            add(entry(path, st, tarfile.LNKTYPE, link=first))
                            continue
                    add(entry(path, st, tarfile.REGTYPE, st.st_size), st.st_size, fd)
                finally:
                    os.close(fd)
                continue
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone since the listing
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                add(entry(path, st, tarfile.DIRTYPE))
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
                add(entry(path, st, tarfile.SYMTYPE, link=target))
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


def read_fd(fd: int) -> Callable[[int], bytes]:
    """A ``read`` for :func:`unpack` from a blocking descriptor."""
    return lambda n: os.read(fd, n)


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
        raise TreeError(proto.E_INVALID, f"absolute name in the archive: {name[:200]!r}")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise TreeError(proto.E_INVALID, f"'..' in an archive name: {name[:200]!r}")
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
                raise TreeError(proto.E_INVALID, f"{name}: {where} is a symlink or not a directory") from None
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
            raise TreeError(proto.E_IS_DIR, f"{name}: a directory is in the way")
        os.unlink(leaf, dir_fd=pfd)

    def member(self, r: Reader, ti: Member) -> int:
        name = ti.name
        parts = _parts(name)
        if len(parts) > MAX_DEPTH:
            raise TreeError(proto.E_INVALID, f"a name deeper than {MAX_DEPTH} levels: {name[:200]!r}")
        mode = ti.mode & self.mask
        if not parts:
            if not ti.isdir():
                raise TreeError(proto.E_INVALID, "the archive's root entry is not a directory")
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
                raise TreeError(proto.E_INVALID, f"{name}: {what}")
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
        if ti.type in SPECIAL_TYPES:
            raise TreeError(proto.E_INVALID, f"{name}: device nodes and FIFOs are refused")
        raise TreeError(proto.E_INVALID, f"{name}: unsupported tar entry type {bytes([ti.type])!r}")

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
    r = Reader(read)
    u = _Unpacker(dest_fd, owner, keep_ids, root_meta, mode_mask, keep_existing)
    glob: dict[str, bytes] = {}
    entries = 0
    total = 0
    try:
        while True:
            ti = next_member(r, glob)
            if ti is None:
                break
            entries += 1
            if entries > proto.MAX_TREE_ENTRIES:
                raise TreeError(proto.E_TOO_LARGE, f"the archive has more than {proto.MAX_TREE_ENTRIES} entries")
            if ti.isreg():
                total += ti.size
                if total > proto.MAX_TREE:
                    raise TreeError(proto.E_TOO_LARGE, f"the archive's files exceed {proto.MAX_TREE} bytes")
            try:
                check_header(ti)
                u.member(r, ti)
            except OSError as exc:
                raise _os_error(exc, ti.name[:200]) from None
        try:
            u.finish_dirs()
        except OSError as exc:
            raise _os_error(exc, "directory metadata") from None
        r.drain()
    except SourceError as exc:
        raise exc.error from None
    finally:
        u.close()
    return entries
