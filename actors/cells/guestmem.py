"""Guest RAM files nobody else can touch, and snapshot memory no QEMU can write.

RAM files (a booted guest's RAM, mapped shared so a checkpoint can copy it) live in a
root-owned 0700 directory the supervisor makes and checks; each is created with
``O_EXCL|O_NOFOLLOW``, owned by its sandbox's uid, and handed to QEMU as
``mem-path=/proc/self/fd/N`` (QEMU opens no path of ours; the reopen through /proc
checks the file's owner: the sandbox's uid, and no other).

Snapshot memory: QEMU 7.2 opens a ``memory-backend-file`` with ``O_RDWR`` unless
``readonly=on``, and ``readonly=on`` maps it ``PROT_READ`` (the guest faults on its
first write); 7.2 has no ``rom=``. So whatever QEMU maps must be openable read-write by
QEMU's uid. A *sealed memfd* is: the supervisor fills it once from the snapshot's file
and adds ``F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL``; QEMU reopens it via
``/proc/self/fd/N`` read-write and maps it ``MAP_PRIVATE`` (copy-on-write) as usual, but
no one -- not QEMU, not its uid, not root -- can change its contents any more: write(2),
a shared writable mapping, fallocate (punch hole) and ftruncate all fail with EPERM.
Restores of one snapshot share the memfd's pages until they write them.

Measured (2 cores, nested virtualization; a 256 MiB snapshot with 75 MiB of data):
filling the memfd 32-50 ms (sendfile per data extent; pread/pwrite the same; via mmap
64 ms), once per snapshot per supervisor life, and none at all when a checkpoint copies
the RAM into a memfd directly; hashing the file before each restore instead would cost
58 ms (sha256) per restore and still leave a window between the check and QEMU's
mapping. Three clones of one memfd: RSS 70 MB, PSS 35-38 MB each.

Its holes are allocated (zeroed pages, ``posix_fallocate``: allowed under the seals)
before the first QEMU maps it (:meth:`SealedMemoryCache.acquire`). A hole stays no hole
once a QEMU touches it: on this kernel (6.1-6.18) a copy-on-write fault on a hole of a
privately mapped memfd first allocates the memfd's page (then copies it), and a read
allocates it too, charged to the memory cgroup of the QEMU that touched it first. A
guest writing N MiB new to it cost its cgroup 2N (its copy and the memfd's page), and
a checkpoint reading all its RAM through QEMU the rest: a 512 MiB restore that had
touched 300 MiB was killed by its cgroup (RAM + 192 MiB) in its first checkpoint. Filled
by the supervisor, the pages are the supervisor's, once per snapshot (its RAM size, at
~2.4 GB/s here; a restore touches the pages anyway as it runs), and a QEMU's cgroup
holds only what its guest wrote. Budget the cache (:class:`SealedMemoryCache`)
accordingly.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from actors.cells.identities import Identity, JailError

MFD_NOEXEC_SEAL = 0x0008
ALIGN = 2 << 20  # where split_extents may cut
log = logging.getLogger("sandvisor.cells")
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class UnsafeDirectory(JailError):
    """A directory the supervisor must own alone is someone else's, or open to others."""


class MemoryFileError(JailError):
    """A RAM file or snapshot memory could not be made or opened."""


# -- the RAM directory and RAM files ---------------------------------------------------------


def private_dir(path: Path, mode: int = 0o700) -> Path:
    """The supervisor's own directory at ``path`` (0700; 0711 where an unjailed QEMU
    user must pass through): made here (the parent must exist), or checked when it
    exists: a real directory (lstat: no symlink), owned by us, ``mode`` exactly. A
    directory anyone else made -- or could have swapped in -- is refused
    (:class:`UnsafeDirectory`), never adopted."""
    try:
        os.mkdir(path, mode)
        os.chmod(path, mode)  # whatever the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafeDirectory(f"cannot make {path}: {exc.strerror}") from None
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} exists and is not a directory (a symlink or a file): refusing to use it")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(
            f"{path} exists and belongs to uid {st.st_uid}, not to the supervisor (uid {os.geteuid()}): "
            f"someone else made it; remove it or choose another directory"
        )
    if stat.S_IMODE(st.st_mode) != mode:
        raise UnsafeDirectory(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not {mode:o}: refusing it (others could reach guest memory)"
        )
    return path


def create_ram_file(directory: Path, name: str, size: int, identity: Identity | None) -> int:
    """A new RAM file ``directory/name`` (``directory`` from :func:`private_dir`): created
    with ``O_EXCL|O_NOFOLLOW`` (an existing file or symlink there is an error, never
    reused), 0600, ``size`` bytes (sparse), owned by ``identity``. Returns an ``O_RDWR``
    descriptor for QEMU (``mem-path=/proc/self/fd/N``, passed) and for checkpoints;
    the caller closes it and unlinks the file when the sandbox's life ends."""
    if "/" in name or name in ("", ".", ".."):
        raise MemoryFileError(f"bad RAM file name {name!r}")
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fd = os.open(
                name,
                os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dfd,
            )
        except OSError as exc:
            raise MemoryFileError(f"cannot create RAM file {directory / name}: {exc.strerror}") from None
        try:
            os.ftruncate(fd, size)
            if identity is not None:
                os.fchown(fd, identity.uid, identity.gid)
            os.fchmod(fd, 0o600)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dfd)
            raise MemoryFileError(f"cannot prepare RAM file {directory / name}: {exc.strerror}") from None
        return fd
    finally:
        os.close(dfd)


def own_memory(path: Path, identity: Identity) -> int:
    """A paused sandbox's saved memory for its resume's QEMU: the file itself,
    given to ``identity`` (QEMU 7.2 reopens it read-write) and opened ``O_RDWR`` for
    ``mem-path=/proc/self/fd/N``; QEMU maps it ``MAP_PRIVATE`` (it never writes it; a
    balloon's hole punches in it the discard shim skips: QemuSpec.environ names it). No
    sealed copy: nothing else restores from it, and it goes once the guest is back."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise MemoryFileError(f"cannot open saved memory {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MemoryFileError(f"saved memory {path} is not a regular file")
        os.fchown(fd, identity.uid, identity.gid)
        os.fchmod(fd, 0o600)
    except OSError as exc:
        os.close(fd)
        raise MemoryFileError(f"cannot prepare saved memory {path}: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_ram_file(directory: Path, name: str) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)


# -- snapshot memory: sealed memfds ---------------------------------------------------------------


def _extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the data in a sparse file (holes read as zeros)."""
    off = 0
    while off < size:
        try:
            data = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after off
                return
            raise
        hole = os.lseek(fd, data, os.SEEK_HOLE)
        yield data, hole - data
        off = hole


def copy_extents(src: int, dst: int, extents: list[tuple[int, int]]) -> None:
    """Copy the byte ranges ``extents`` of ``src`` to the same offsets of ``dst`` (in the
    kernel: no bytes through this process). Blocking: run in a worker thread; several
    may copy into one ``dst`` side by side (each writes through a file position of its own)."""
    out = os.open(f"/proc/self/fd/{dst}", os.O_WRONLY | os.O_CLOEXEC)
    try:
        for off, length in extents:
            os.lseek(out, off, os.SEEK_SET)
            pos, left = off, length
            while left:
                n = os.sendfile(out, src, pos, left)
                if n == 0:
                    raise MemoryFileError("the memory file shrank while being read")
                pos += n
                left -= n
    finally:
        os.close(out)


def split_extents(extents: list[tuple[int, int]], parts: int) -> list[list[tuple[int, int]]]:
    """``extents`` cut into ``parts`` lists of about equal bytes (a long extent is split),
    for copies side by side."""
    total = sum(n for _, n in extents)
    share = -(-total // max(parts, 1) // ALIGN) * ALIGN if total else 0  # (whole huge pages)
    out: list[list[tuple[int, int]]] = [[]]
    room = share
    for off, n in extents:
        while n:
            if room == 0 and len(out) < parts:
                out.append([])
                room = share
            take = n if len(out) == parts else min(n, room)
            out[-1].append((off, take))
            off, n, room = off + take, n - take, max(room - take, 0)
    return [p for p in out if p]


def data_extents(fd: int) -> list[tuple[int, int]]:
    """The data extents of the file ``fd`` (its holes left out)."""
    return list(_extents(fd, os.fstat(fd).st_size))


def preallocate(like: int, fd: int) -> None:
    """Allocate the pages of ``fd`` where ``like`` has data (its extents now): a copy into
    them later only writes (a new shmem page is zeroed first: that half of a copy's cost
    is paid here, ahead). Blocking: run in a worker thread."""
    for off, length in _extents(like, os.fstat(like).st_size):
        os.posix_fallocate(fd, off, length)


def new_memfd(size: int, name: str = "sandvisor-snapshot-memory") -> int:
    """An empty (sparse) memfd of ``size`` bytes that can be sealed, never executable."""
    try:  # not executable, ever (Linux 6.3+; also what vm.memfd_noexec=2 demands)
        mfd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        mfd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(mfd, size)
    except BaseException:
        os.close(mfd)
        raise
    return mfd


def seal(fd: int) -> None:
    """Nobody writes, grows or shrinks the memfd ``fd`` any more (nor unseals it)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)


def sealed_copy(source: Path | int, *, name: str = "sandvisor-snapshot-memory") -> int:
    """A sealed memfd with the contents of ``source`` (a path opened ``O_NOFOLLOW``, or a
    descriptor): only data extents are copied (holes stay holes: unallocated pages of
    the memfd read as zeros). Returns the descriptor (close-on-exec; pass it to QEMU)."""
    own = isinstance(source, Path)
    if isinstance(source, Path):
        try:
            src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise MemoryFileError(f"cannot open snapshot memory {source}: {exc.strerror}") from None
    else:
        src = source
    mfd = -1
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            raise MemoryFileError(f"snapshot memory {source} is not a regular file")
        mfd = new_memfd(st.st_size, name)
        copy_extents(src, mfd, list(_extents(src, st.st_size)))
        seal(mfd)
        out, mfd = mfd, -1
        return out
    except OSError as exc:
        raise MemoryFileError(f"cannot copy snapshot memory {source}: {exc.strerror}") from None
    finally:
        if mfd >= 0:
            os.close(mfd)
        if own:
            os.close(src)


def allocate_holes(fd: int) -> None:
    """Allocate every page of the memfd ``fd`` (its data stays; holes become zeroed
    pages, charged to the caller's memory cgroup). Blocking: run in a worker thread."""
    os.posix_fallocate(fd, 0, os.fstat(fd).st_size)


def is_sealed(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS


class SealedMemoryCache:
    """One sealed memfd per snapshot, shared by all its restores. ``acquire`` returns
    a descriptor the caller passes to QEMU and must :meth:`release` after QEMU has it
    open (QEMU's own reference keeps the pages); its holes are allocated by then (the
    module's docstring says why). Idle memfds (no holder) stay cached up to ``budget``
    bytes, least recently used dropped first: a hot snapshot is filled once per
    supervisor life. Thread-safe (fills run in worker threads)."""

    def __init__(self, budget: int = 1 << 30) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._filling: dict[str, threading.Lock] = {}  # one fill per key: the others wait for it
        self._fds: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (fd, data bytes)
        self._holders: dict[str, int] = {}
        self._whole: set[str] = set()  # keys whose memfd has no hole left

    def put(self, key: str, fd: int, *, pinned: bool = False) -> None:
        """Adopt an already sealed memfd (a checkpoint copied the RAM into it); ``pinned``:
        it is the snapshot's only memory (no file to fill it from again), kept until
        :meth:`drop`. The descriptor is the cache's from here, even if this raises."""
        if not is_sealed(fd):
            os.close(fd)
            raise MemoryFileError("refusing an unsealed memfd as snapshot memory")
        with self._lock:
            old = self._fds.pop(key, None)
            self._fds[key] = (fd, os.fstat(fd).st_blocks * 512)
            self._whole.discard(key)
            if old is not None and old[0] != fd:
                os.close(old[0])
            if pinned:
                self._holders[key] = self._holders.get(key, 0) + 1  # (a holder nobody releases)
            self._trim()

    def acquire(self, key: str, source: Path) -> int:
        """A descriptor of ``key``'s sealed memfd, filled from ``source`` on a miss, its
        holes allocated. Blocking (a fill copies the file: run it in a worker thread);
        restores of one snapshot side by side fill it once, the others wait for that."""
        with self._lock:
            fd = self._hit(key)
            if fd >= 0 and key in self._whole:
                return fd
            filling = self._filling.setdefault(key, threading.Lock())
        try:
            with filling:
                if fd < 0:
                    fd = self._fill(key, source)
                with self._lock:
                    whole = key in self._whole
                if not whole:
                    self._allocate(key, fd)
        except BaseException:
            if fd >= 0:
                self.release(key, fd)
            raise
        finally:
            with self._lock:
                self._filling.pop(key, None)
        return fd

    def _fill(self, key: str, source: Path) -> int:
        """Under ``key``'s filling lock: a held descriptor of its memfd (copied from
        ``source`` unless another acquire did it meanwhile)."""
        with self._lock:
            fd = self._hit(key)
            if fd >= 0:
                return fd
        fd = sealed_copy(source)  # outside the cache's lock: 30+ ms
        with self._lock:
            hit = self._fds.get(key)
            if hit is not None:  # (put meanwhile: a checkpoint of the same key)
                os.close(fd)
                fd = hit[0]
            else:
                self._fds[key] = (fd, os.fstat(fd).st_blocks * 512)
            self._holders[key] = self._holders.get(key, 0) + 1
            return os.dup(fd)

    def _allocate(self, key: str, fd: int) -> None:
        """Under ``key``'s filling lock: its holes allocated (the supervisor's pages, not
        the first QEMU's); if the host has no memory for it, the restore goes on with
        the holes (each QEMU's cgroup pays for what its guest touches)."""
        try:
            allocate_holes(fd)
        except OSError as exc:
            log.warning("snapshot memory %s: its holes not allocated (%s)", key, exc.strerror)
            return
        with self._lock:
            self._whole.add(key)
            if key in self._fds:
                self._fds[key] = (self._fds[key][0], os.fstat(fd).st_blocks * 512)
            self._trim()

    def _hit(self, key: str) -> int:
        """Under the lock: a new descriptor of ``key``'s cached memfd (held), or -1."""
        hit = self._fds.get(key)
        if hit is None:
            return -1
        self._fds.move_to_end(key)
        self._holders[key] = self._holders.get(key, 0) + 1
        return os.dup(hit[0])

    def release(self, key: str, fd: int) -> None:
        os.close(fd)
        with self._lock:
            n = self._holders.get(key, 0) - 1
            if n > 0:
                self._holders[key] = n
            else:
                self._holders.pop(key, None)
            self._trim()

    def drop(self, key: str) -> None:
        """The snapshot is deleted: forget its memfd (live QEMUs keep their own)."""
        with self._lock:
            hit = self._fds.pop(key, None)
            self._holders.pop(key, None)
            self._whole.discard(key)
        if hit is not None:
            os.close(hit[0])

    def _trim(self) -> None:
        total = sum(n for _, n in self._fds.values())
        for key in list(self._fds):
            if total <= self.budget:
                break
            if key in self._holders:
                continue
            fd, n = self._fds.pop(key)
            self._whole.discard(key)
            os.close(fd)
            total -= n

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._fds.values())

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._holders.clear()
            self._whole.clear()
