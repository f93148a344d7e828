"""qcow2 layers: headers, backing chains, overlays.

A sandbox's disk is a chain of qcow2 layers over a read-only base::

    sandbox overlay (read-write) -> snapshot disk -> ... -> base rootfs (raw or qcow2)

QEMU never opens a layer by path (it runs unprivileged and gets descriptors, see
:class:`~actors.machines.qemuspec.MachineSpec`), so the supervisor reads the chain from the
headers itself: the backing file name is at offsets 8 (offset) and 16 (length).

Only a *trusted* base (the built image, an OCI image the store made, the store's own
layers) has its chain followed. A caller's own rootfs (``Create{rootfs}``, from an
``--allow-path`` directory) is a layer on its own (:func:`check_user_disk`): a qcow2
naming a backing file or an external data file is refused, since root would open
that name and hand it to the guest (``/etc/shadow``, the database, another
sandbox's overlay). Whoever needs layers flattens them first
(``qemu-img convert -O qcow2 top.qcow2 flat.qcow2``).

Every header is parsed defensively (:func:`parse_qcow2_header`): reads are bounded
(the header, its extensions and the backing name live in the first cluster, at most
2 MiB), and anything malformed is a :class:`DiskError`, never another exception.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
from pathlib import Path

import attrs
import trio

from actors.machines.qemuproc import LaunchError

QCOW2_MAGIC = b"QFI\xfb"
MAX_CHAIN = 64
MAX_BACKING_NAME = 1023  # QEMU's own limit
MAX_CLUSTER_BITS = 21  # 2 MiB clusters: the most QEMU accepts (and the most we read)
MIN_CLUSTER_BITS = 9
V2_HEADER = 72
V3_HEADER = 104
INCOMPAT_DATA_FILE = 1 << 2  # "external data file" (the guest's data in another file, named by an extension)
EXT_END = 0
EXT_DATA_FILE = 0x44415441
MAX_EXTENSIONS = 1024


class DiskError(LaunchError):
    """A layer is missing, unreadable, malformed or not what its parent's header says."""


@attrs.frozen
class Qcow2Header:
    version: int
    cluster_bits: int
    size: int  # virtual size in bytes
    backing: str | None  # the backing file's name as the header spells it
    data_file: str | None  # an external data file's name ("" when the bit is set without a name)
    incompatible: int  # the incompatible feature bits (v3; 0 for v2)

    @property
    def external_data(self) -> bool:
        return self.data_file is not None or bool(self.incompatible & INCOMPAT_DATA_FILE)


def _name(raw: bytes) -> str:
    return os.fsdecode(raw)  # bytes QEMU would open as a path; surrogateescape never raises


def parse_qcow2_header(buf: bytes, what: str = "image") -> Qcow2Header:
    """The header of a qcow2 image from its first bytes (the first cluster, or all of a
    smaller file). Anything malformed or truncated is a DiskError naming ``what``."""
    if len(buf) < V2_HEADER or buf[:4] != QCOW2_MAGIC:
        raise DiskError(f"{what} is not a qcow2 image (or its header is truncated)")
    version, backing_off, backing_len, cluster_bits, size = struct.unpack_from(">IQIIQ", buf, 4)
    if version not in (2, 3):
        raise DiskError(f"{what}: qcow2 version {version} is not supported")
    if not MIN_CLUSTER_BITS <= cluster_bits <= MAX_CLUSTER_BITS:
        raise DiskError(f"{what}: qcow2 cluster bits {cluster_bits} out of range")
    if size >= 1 << 63:
        raise DiskError(f"{what}: qcow2 virtual size {size} out of range")
    cluster = 1 << cluster_bits
    end = min(len(buf), cluster)  # the header, extensions and backing name live in the first cluster
    incompatible, header_len = 0, V2_HEADER
    if version == 3:
        if end < V3_HEADER:
            raise DiskError(f"{what}: qcow2 v3 header truncated")
        incompatible = struct.unpack_from(">Q", buf, 72)[0]
        header_len = struct.unpack_from(">I", buf, 100)[0]
        if not V3_HEADER <= header_len <= end:
            raise DiskError(f"{what}: qcow2 header length {header_len} out of range")
    backing = None
    if backing_off and backing_len:  # (QEMU, too, opens no backing for an empty name)
        if backing_len > MAX_BACKING_NAME:
            raise DiskError(f"{what}: backing file name of {backing_len} bytes")
        if backing_off < header_len or backing_off + backing_len > end:
            raise DiskError(f"{what}: backing file name outside the image's first cluster")
        backing = _name(buf[backing_off : backing_off + backing_len])
    data_file = None
    if version == 3:
        off = header_len  # where QEMU reads them: aligned or not
        for _ in range(MAX_EXTENSIONS):
            if off + 8 > end:
                break  # no end marker within what we read: QEMU would refuse the image too
            kind, length = struct.unpack_from(">II", buf, off)
            if kind == EXT_END:
                break
            if off + 8 + length > end:
                raise DiskError(f"{what}: qcow2 header extension {kind:#x} runs past the first cluster")
            if kind == EXT_DATA_FILE:
                data_file = _name(buf[off + 8 : off + 8 + length])
            off += 8 + ((length + 7) & ~7)
        else:
            raise DiskError(f"{what}: more than {MAX_EXTENSIONS} qcow2 header extensions")
        if incompatible & INCOMPAT_DATA_FILE and data_file is None:
            data_file = ""
    return Qcow2Header(version, cluster_bits, size, backing, data_file, incompatible)


def _read_head(fd: int) -> bytes:
    """The first cluster of an open image, at most 2 MiB (bounded, whatever the header says)."""
    head = os.pread(fd, V3_HEADER, 0)
    if len(head) < 24 or head[:4] != QCOW2_MAGIC:
        return head
    bits = struct.unpack_from(">I", head, 20)[0]
    want = 1 << min(max(bits, MIN_CLUSTER_BITS), MAX_CLUSTER_BITS)
    return os.pread(fd, want, 0)


def _open(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise DiskError(f"cannot open {path}: {'a symlink' if exc.errno == errno.ELOOP else exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DiskError(f"{path} is not a regular file")
    return fd


@attrs.frozen
class DiskInfo:
    format: str  # "raw" or "qcow2"
    size: int  # virtual size in bytes (a raw file's length)
    header: Qcow2Header | None


def inspect_disk(path: Path) -> DiskInfo:
    """What ``path`` is (regular file, no symlink, header parsed with bounded reads)."""
    fd = _open(path)
    try:
        head = _read_head(fd)
        if head[:4] != QCOW2_MAGIC:
            return DiskInfo("raw", os.fstat(fd).st_size, None)
        h = parse_qcow2_header(head, str(path))
        return DiskInfo("qcow2", h.size, h)
    except OSError as exc:
        raise DiskError(f"cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def check_user_disk(path: Path, max_size: int = 0) -> DiskInfo:
    """A caller's own rootfs: raw, or a qcow2 that stands alone -- no backing file and
    no external data file (root would open those names for the guest) -- and, with
    ``max_size``, no larger than that (its overlay grows up to its virtual size)."""
    info = inspect_disk(path)
    h = info.header
    if h is not None and h.backing is not None:
        raise DiskError(
            f"{path} is a qcow2 image backed by {h.backing!r}: a caller's rootfs must stand alone "
            "(flatten it: qemu-img convert -O qcow2 IMAGE FLAT)"
        )
    if h is not None and h.external_data:
        raise DiskError(
            f"{path} is a qcow2 image with an external data file {h.data_file!r}: a caller's rootfs must "
            "stand alone (flatten it: qemu-img convert -O qcow2 IMAGE FLAT)"
        )
    if max_size and info.size > max_size:
        raise DiskError(
            f"{path} has a virtual size of {-(-info.size // (1 << 20))} MiB; a sandbox's disk may be at most "
            f"{max_size >> 20} MiB (--max-sandbox-disk)"
        )
    return info


def is_qcow2(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == QCOW2_MAGIC


def qcow2_header(path: Path) -> tuple[int, Path | None]:
    """(virtual size in bytes, backing file or None) of a qcow2 image."""
    info = inspect_disk(path)
    if info.header is None:
        raise DiskError(f"{path} is not a qcow2 image")
    if info.header.backing is None:
        return info.size, None
    backing = Path(info.header.backing)
    if not backing.is_absolute():
        backing = path.parent / backing
    return info.size, backing


def backing_chain(path: Path) -> tuple[Path, ...]:
    """The layers below ``path``, nearest first, down to the base. Only for layers the
    supervisor made or trusts: a caller's file goes through :func:`check_user_disk`."""
    chain: list[Path] = []
    cur = path
    while is_qcow2(cur):
        _, backing = qcow2_header(cur)
        if backing is None:
            break
        if not backing.exists():
            raise DiskError(f"{cur} is backed by {backing}, which is missing")
        chain.append(backing)
        if len(chain) > MAX_CHAIN:
            raise DiskError(f"{path}: backing chain longer than {MAX_CHAIN}")
        cur = backing
    return tuple(chain)


def virtual_size(path: Path) -> int:
    return inspect_disk(path).size


def overlay_bound(size: int) -> int:
    """The most host bytes a qcow2 overlay of virtual size ``size`` (64 KiB clusters, as
    :func:`create_overlay` makes them) can take however the guest writes: every cluster
    once (a rewrite reuses it; QEMU ignores the guest's discards), plus its L2 tables
    (8 bytes per cluster), refcounts (2 bytes per cluster) and a few header clusters.
    Measured: a 64 MiB overlay written twice in full takes 64 MiB + 320 KiB;
    ``qemu-img measure`` says 16 GiB + 2.8 MiB for 16 GiB. Bound: size + size/4096 + 1 MiB."""
    return size + size // 4096 + (1 << 20)


# An empty overlay is a few clusters that depend only on qemu-img's arguments (backing
# name, its format, the virtual size; no time, no random): the first one qemu-img makes
# for a key is kept (its non-zero 4 KiB blocks) and the next ones are written from it --
# no qemu-img process on a Create's path (a fork and exec and its own start-up: ~10 ms
# of CPU each on a TCG host; docs/results/burst-fast.md).
OVERLAY_BLOCK = 4096
OVERLAY_KEEP_MAX = 1 << 20  # bytes: an overlay image larger than this is not kept (a huge L1 table)
OVERLAY_KEYS_MAX = 64  # kept images (a snapshot's disk is a key of its own; the oldest go first)


@attrs.frozen
class _Empty:
    length: int
    blocks: tuple[tuple[int, bytes], ...]  # (offset, data) of the non-zero blocks


_empty_overlays: dict[tuple[str, str, int], _Empty] = {}


def _keep_empty(key: tuple[str, str, int], path: Path) -> None:
    with open(path, "rb") as f:
        data = f.read(OVERLAY_KEEP_MAX + 1)
    if len(data) > OVERLAY_KEEP_MAX or data[:4] != QCOW2_MAGIC:
        return
    chunks = ((off, data[off : off + OVERLAY_BLOCK]) for off in range(0, len(data), OVERLAY_BLOCK))
    blocks = tuple((off, chunk) for off, chunk in chunks if chunk.strip(b"\0"))
    while len(_empty_overlays) >= OVERLAY_KEYS_MAX:
        del _empty_overlays[next(iter(_empty_overlays))]
    _empty_overlays[key] = _Empty(len(data), blocks)


def _write_empty(image: _Empty, path: Path) -> None:
    """The kept image at ``path`` (sparse, as qemu-img leaves it; mode 0644 less the umask, as qemu-img's)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        for off, data in image.blocks:
            os.pwrite(fd, data, off)
        os.ftruncate(fd, image.length)
    finally:
        os.close(fd)


async def create_overlay(base: Path, overlay: Path, *, backing_as: Path | None = None) -> None:
    """A qcow2 overlay on ``base`` (raw or qcow2). ``-u`` with the size read here:
    qemu-img then does not open the chain (it may hold layers QEMU has open).
    ``backing_as``: the name to record for the backing file when ``base`` is about to
    move there (a checkpoint freezes the overlay into the snapshot's directory). The
    same arguments again: the bytes qemu-img made the first time (``_empty_overlays``)."""
    base = base.resolve()
    info = inspect_disk(base)
    name = str(backing_as.resolve() if backing_as else base)
    key = (name, info.format, info.size)
    kept = _empty_overlays.get(key)
    if kept is not None:
        try:
            _write_empty(kept, overlay)
        except OSError as exc:
            raise DiskError(f"cannot write the overlay {overlay}: {exc.strerror}") from None
        return
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", name, "-F", info.format, str(overlay)]
    argv.append(str(info.size))
    p = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    if p.returncode != 0:
        raise DiskError(f"qemu-img create failed: {p.stderr.decode(errors='replace').strip()}")
    with contextlib.suppress(OSError):  # (only a cache: the overlay is made)
        _keep_empty(key, overlay)


async def grow_overlay(overlay: Path, size: int) -> bool:
    """Grow a qcow2 overlay (no QEMU has it open) to virtual size ``size``; never
    shrinks. True if it grew. The guest grows its filesystem at boot (guestd's
    grow_root); the layers below stay as they are (reads past them are zeros)."""
    if virtual_size(overlay) >= size:
        return False
    argv = ["qemu-img", "resize", "-q", "-f", "qcow2", str(overlay), str(size)]
    p = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    if p.returncode != 0:
        raise DiskError(f"qemu-img resize failed: {p.stderr.decode(errors='replace').strip()}")
    return True
