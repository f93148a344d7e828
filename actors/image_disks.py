"""A caller's own disk image as a sandbox's root (``Create{rootfs}``, the CLI's
``--image-disk PATH[:FSTYPE]``): the formats qemu-img reads, and the file system
type the guest mounts it as.

raw and qcow2 are attached as they are (a qcow2 that stands alone:
:func:`~actors.machines.disk.check_user_disk`). vmdk (a monolithic sparse or stream
optimized file), vdi, vhdx and vpc (VHD) are converted once to a standalone qcow2:
the supervisor copies the caller's bytes into a staging directory (reading them is
all it does; it never parses them), and ``qemu-img convert`` runs in a tool cell
(actors/cells/toolcell.py) as an id of the job's own, seeing only that directory:
an extent or backing name inside the file opens nothing of the host's. The result is
checked like any caller's qcow2 (no backing file, no data file) and kept in the
supervisor's state directory by content (sha256 of the caller's file), so the next
Create of the same bytes attaches it at once. A vmdk descriptor (a text file that
names its extents) is refused: its data is in other files.

The guest kernel of the default image mounts ext4 (and ext2/ext3 through it) without
a module; other types need the caller's own kernel with them built in.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from pathlib import Path

import attrs
import trio

from actors.cells.toolcell import make_stage
from actors.errors import FailedPrecondition, InvalidArgument, NotFound
from actors.machines.disk import QCOW2_MAGIC, DiskError, check_user_disk
from actors.settings import Settings
from images.tools import ToolError, bind

# what the default kernel part mounts with no module (CONFIG_EXT4_FS=y, EXT4_USE_FOR_EXT2)
KERNEL_FSTYPES = ("ext4", "ext3", "ext2")
# what guestd's /init may be told to mount (a caller's kernel may have them built in)
ANY_FSTYPES = ("ext4", "ext3", "ext2", "xfs", "btrfs", "vfat", "squashfs", "erofs", "iso9660")
CONVERTED = ("vmdk", "vdi", "vhdx", "vpc")
CACHE_DIR = "image-disks"
_HEAD = 512
_CHUNK = 1 << 20


def check_fstype(fstype: str, *, rootfs: str, kernel: str) -> None:
    """The fstype hint of a caller's disk: one the guest kernel can mount."""
    if not fstype:
        return
    if not rootfs:
        raise InvalidArgument("a root file system type needs a disk image (rootfs / --image-disk)")
    if fstype not in ANY_FSTYPES:
        raise InvalidArgument(f"file system type {fstype[:40]!r}: one of {', '.join(ANY_FSTYPES)}")
    if not kernel and fstype not in KERNEL_FSTYPES:
        raise InvalidArgument(
            f"file system type {fstype!r}: the default guest kernel mounts {', '.join(KERNEL_FSTYPES)} "
            "(give a kernel of your own with it built in)"
        )


def split_image_disk(spec: str) -> tuple[str, str]:
    """``PATH[:FSTYPE]`` -> (path, fstype); a suffix that names no file system type is
    part of the path (a path may hold ':')."""
    path, sep, fstype = spec.rpartition(":")
    if sep and fstype in ANY_FSTYPES and path:
        return path, fstype
    return spec, ""


def detect_format(path: Path) -> str:
    """raw, qcow2, vmdk, vdi, vhdx or vpc, from the file's magic (opened with no
    symlink followed; a regular file). A vmdk descriptor is a DiskError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise NotFound(f"disk image {str(path)!r} is not a file on the supervisor's host") from None
        why = "a symlink" if exc.errno == errno.ELOOP else exc.strerror
        raise FailedPrecondition(f"cannot open the disk image {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FailedPrecondition(f"the disk image {path} is not a regular file")
        head = os.pread(fd, _HEAD, 0)
        tail = os.pread(fd, _HEAD, st.st_size - _HEAD) if st.st_size >= _HEAD else b""
    finally:
        os.close(fd)
    return format_of(head, tail)


def format_of(head: bytes, tail: bytes = b"") -> str:
    if head[:4] == QCOW2_MAGIC:
        return "qcow2"
    if head[:4] == b"KDMV":
        return "vmdk"
    if head.startswith(b"# Disk DescriptorFile"):
        raise FailedPrecondition(
            "the disk image is a vmdk descriptor, which names its data in other files: give a single-file "
            "vmdk (qemu-img convert -O vmdk -o subformat=monolithicSparse) or a qcow2"
        )
    if len(head) >= 0x44 and head[0x40:0x44] == b"\x7f\x10\xda\xbe":
        return "vdi"
    if head[:8] == b"vhdxfile":
        return "vhdx"
    if head[:8] == b"conectix" or tail[:8] == b"conectix":
        return "vpc"
    return "raw"


@attrs.frozen
class _Key:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


_digests: dict[_Key, str] = {}  # a file unchanged since it was hashed: its sha256 again


def _digest(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        key = _Key(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        known = _digests.get(key)
        if known is not None:
            return known
        h = hashlib.sha256()
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
    finally:
        os.close(fd)
    if len(_digests) > 256:
        _digests.clear()
    _digests[key] = h.hexdigest()
    return _digests[key]


def cache_dir(settings: Settings) -> Path:
    return settings.sandboxes_dir.parent / CACHE_DIR


def converted_path(settings: Settings, path: Path) -> Path | None:
    """Where a foreign-format disk's conversion is kept (None for raw and qcow2)."""
    fmt = detect_format(path)
    if fmt not in CONVERTED:
        return None
    return cache_dir(settings) / f"{_digest(path)}.{fmt}.qcow2"


def disk_size(settings: Settings, path: Path) -> int:
    """The virtual size of a caller's disk, as the guest will see it (after conversion)."""
    out = converted_path(settings, path)
    try:
        return check_user_disk(out if out is not None and out.exists() else path).size
    except DiskError as exc:
        raise FailedPrecondition(str(exc)) from None


async def attach(settings: Settings, path: Path) -> Path:
    """The file a sandbox's overlay stands on for the caller's disk ``path``: itself
    (raw, a standalone qcow2), or its conversion (made now when not kept)."""
    out = await trio.to_thread.run_sync(converted_path, settings, path)
    try:
        if out is None:
            check_user_disk(path)
            return path
        if not out.exists():
            await _convert(settings, path, out)
        check_user_disk(out)
    except DiskError as exc:
        raise FailedPrecondition(str(exc)) from None
    return out


async def _convert(settings: Settings, src: Path, out: Path) -> None:
    fmt = out.name.split(".")[-2]
    tools = settings.cells.tools if settings.cells is not None else None
    if tools is None and os.geteuid() == 0:
        raise FailedPrecondition(f"a {fmt} disk is converted in a tool cell: this supervisor runs without its jail")
    cache = out.parent
    cache.mkdir(mode=0o755, exist_ok=True)
    stage = make_stage(cache)
    try:
        work = stage / "work"
        copy = work / f"in.{fmt}"
        await trio.to_thread.run_sync(_copy, src, copy)
        argv = ["qemu-img", "convert", "-q", "-f", fmt, "-O", "qcow2", str(copy), str(work / "out.qcow2")]
        cap = settings.max_sandbox_disk_mib << 20 or None
        if tools is None:
            p = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
            rc, err = p.returncode, p.stderr
        else:
            with tools.identity("qemu-img convert") as ident:
                os.chown(work, ident.uid, ident.gid)
                os.chown(copy, ident.uid, ident.gid)
                try:
                    res = await tools.run(argv, identity=ident, binds=(bind(work, writable=True),), fsize=cap)
                except ToolError as exc:
                    raise FailedPrecondition(f"converting the {fmt} disk {src}: {exc}") from None
                rc, err = res.returncode, res.stderr
        if rc != 0:
            text = err.decode(errors="replace").strip()[-300:]
            raise FailedPrecondition(f"qemu-img could not convert the {fmt} disk {src}: {text}")
        result = work / "out.qcow2"
        check_user_disk(result)  # standalone by construction; checked as any caller's qcow2
        os.chown(result, os.geteuid(), os.getegid())
        os.chmod(result, 0o444)
        os.replace(result, out)
    finally:
        await trio.to_thread.run_sync(shutil.rmtree, stage, True)


def _copy(src: Path, dst: Path) -> None:
    """The caller's bytes, read with no symlink followed (sparse holes stay holes)."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FailedPrecondition(f"the disk image {src} is not a regular file")
        with open(dst, "xb") as f:
            while chunk := os.read(fd, _CHUNK):
                if chunk.count(0) == len(chunk):
                    f.seek(len(chunk), os.SEEK_CUR)
                else:
                    f.write(chunk)
            f.truncate()
            os.fchmod(f.fileno(), 0o600)
    finally:
        os.close(fd)
