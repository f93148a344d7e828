"""A plain root filesystem directory as an image (``image="dir:/path"``, or a path:
``./rootfs``, ``/srv/rootfs``): made into a read-only ext4 the way a pulled image is,
and kept in the store by the tree's content.

The directory is the caller's, hostile: the supervisor walks it by descriptors
(``O_NOFOLLOW`` at every step, a symlink is read as data and recreated, never
followed), takes only what every local user may read (PERMISSION_DENIED otherwise:
it reads as root for a caller, as copy patches do), and hashes what it finds (names,
types, modes, owners, times, contents, link targets). When no image of that digest
is in the store, it copies the tree into a staging directory with its owners shifted
into the tools' user namespace (as umoci unpacks a pulled image). Device nodes,
fifos and sockets are left out (the guest has devtmpfs). The fix-ups
(:func:`~images.oci.convert.prepare_tree`) and ``mkfs.ext4 -d`` then run on that
copy, mkfs in a tool cell, as for a pull. The next Create of the same tree hashes it
again (no copy, no mkfs) and boots the kept ext4.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import trio

from images.oci.convert import _CODE_VERSION, _mkfs_argv, _own_output
from images.oci.errors import DiskFull, ImageError, ImageNotFound, UnsupportedImage
from images.oci.image import Image, ImageConfig
from images.oci.reference import Reference
from images.oci.store import _fsync_dir, _write_durably
from images.tools import READ_CAPS, SHIFT_COUNT, bind

if TYPE_CHECKING:
    from images.oci.pull import ImageStore

PREFIX = "dir:"


class NotReadable(ImageError):
    """A file or directory of the tree that not every local user may read."""

    code = "PERMISSION_DENIED"


_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def is_dir_ref(ref: str) -> bool:
    """``dir:/path``, or an absolute path (no OCI reference starts with '/'); the SDK
    and CLI make a relative path (``./rootfs``) absolute."""
    return ref.startswith((PREFIX, "/"))


def check_dir(store: ImageStore, path: str) -> None:
    """An absolute directory, reached through no symlink, in an ``--allow-path``
    directory; NOT_FOUND otherwise (the same words for each reason, as local images)."""
    refs = store.refs
    if refs.unrestricted:
        return
    p = Path(path)
    ok = os.path.isabs(path) and ".." not in p.parts and any(p.is_relative_to(d.resolve()) for d in refs.allowed_paths)
    try:
        ok = ok and os.path.realpath(path, strict=True) == path and stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        ok = False
    if not ok:
        raise ImageNotFound(
            f"{PREFIX}{path}: no such directory on the supervisor's host "
            "(a root filesystem directory is read from serve --allow-path directories only)"
        )


@attrs.define
class _Walk:
    dst: Path | None  # None: hash only
    shift: int
    budget: int
    chown: bool
    h: hashlib._Hash = attrs.field(factory=hashlib.sha256)
    bytes: int = 0
    inodes: int = 0

    def note(self, *parts: object) -> None:
        self.h.update(repr(parts).encode() + b"\n")

    def ids(self, st: os.stat_result, rel: str) -> tuple[int, int]:
        if not (0 <= st.st_uid < SHIFT_COUNT and 0 <= st.st_gid < SHIFT_COUNT):
            raise UnsupportedImage(f"{rel}: owner {st.st_uid}:{st.st_gid} is outside ids 0-{SHIFT_COUNT - 1}")
        return st.st_uid + self.shift, st.st_gid + self.shift

    def tree(self, dfd: int, rel: str, out: Path | None) -> None:
        for name in sorted(os.listdir(dfd)):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            r = f"{rel}/{name}"
            self.inodes += 1
            kind = stat.S_IFMT(st.st_mode)
            if kind not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK):
                continue  # a device node, fifo or socket: not carried
            _others_may(st.st_mode, r)
            self.note(r, kind, st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_mtime_ns)
            target = None if out is None else out / name
            if kind == stat.S_IFLNK:
                link = os.readlink(name, dir_fd=dfd)
                self.note(link)
                if target is not None:
                    os.symlink(link, target)
            elif kind == stat.S_IFREG:
                self.file(dfd, name, r, target)
            else:
                sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                try:
                    if target is not None:
                        target.mkdir(mode=0o700)
                    self.tree(sub, r, target)
                finally:
                    os.close(sub)
            if target is not None:
                self.own(target, st, r)

    def file(self, dfd: int, name: str, rel: str, target: Path | None) -> None:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsupportedImage(f"{rel} changed while it was read")
            out = (
                None if target is None else os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            )
            try:
                while chunk := os.read(fd, _CHUNK):
                    self.bytes += len(chunk)
                    if self.bytes > self.budget:
                        raise DiskFull(f"the directory holds over the image size cap of {self.budget} bytes")
                    self.h.update(chunk)
                    if out is not None:
                        os.write(out, chunk)
            finally:
                if out is not None:
                    os.close(out)
        finally:
            os.close(fd)

    def own(self, target: Path, st: os.stat_result, rel: str) -> None:
        uid, gid = self.ids(st, rel)
        if self.chown:
            os.chown(target, uid, gid, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(target, st.st_mode & 0o7777)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _others_may(mode: int, rel: str) -> None:
    """What the supervisor reads as root for a caller, every local user may read (as a
    copy patch or a host directory mount asks): a file others may read, a directory
    others may list and enter."""
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
    if (stat.S_ISREG(mode) or stat.S_ISDIR(mode)) and mode & need != need:
        raise NotReadable(
            f"{rel} (mode {stat.S_IMODE(mode):o}) is not readable by others: a root filesystem directory is "
            "read only where every local user may read (chmod -R o+rX, or give a disk image)"
        )


def walk(path: str, dst: Path | None, *, shift: int, budget: int, chown: bool) -> tuple[str, int, int]:
    """The tree's digest ("sha256:..."), its file bytes and its entries; copied into
    ``dst`` (made here) when given."""
    w = _Walk(dst, shift, budget, chown)
    fd = os.open(path, _DIR_FLAGS)
    try:
        st = os.fstat(fd)
        _others_may(st.st_mode, "/")
        w.note("/", st.st_mode & 0o7777, st.st_uid, st.st_gid)
        if dst is not None:
            dst.mkdir(mode=0o700)
        w.tree(fd, "", dst)
        if dst is not None:
            w.own(dst, st, "/")
    finally:
        os.close(fd)
    return "sha256:" + w.h.hexdigest(), w.bytes, w.inodes


async def from_directory(store: ImageStore, ref: str) -> Image:
    """The image of the directory ``ref`` names (``dir:/path``): the kept one when the
    tree is unchanged, else made now."""
    path = ref.removeprefix(PREFIX)
    ref = PREFIX + path
    check_dir(store, path)
    tools = store.tools
    shift = tools.shifted(0) if tools is not None else 0
    chown = tools is not None or os.geteuid() == 0
    budget = store.max_image_bytes if store.max_image_bytes is not None else 1 << 62
    try:
        digest, _, _ = await trio.to_thread.run_sync(lambda: walk(path, None, shift=shift, budget=budget, chown=chown))
    except OSError as exc:
        raise ImageNotFound(f"{ref}: cannot read the directory: {exc.strerror}") from None
    if store._load(digest.removeprefix("sha256:")) is None:
        # (the copy's own digest: the tree may have changed since it was hashed)
        digest = await _convert(store, ref, path, shift, budget, chown)
    store._add_ref(ref, digest)
    return store.get(digest)


async def _convert(store: ImageStore, ref: str, path: str, shift: int, budget: int, chown: bool) -> str:
    r = Reference(transport="dir", path=path)
    async with store._staging("dir") as stage:
        unpack = stage / "unpack"
        unpack.mkdir(mode=0o700)
        tree = unpack / "tree"
        if store.tools is not None:
            os.chmod(stage, 0o711)
            os.chown(unpack, shift, shift)
        try:
            digest, _, _ = await trio.to_thread.run_sync(
                lambda: walk(path, tree, shift=shift, budget=budget, chown=chown)
            )
        except OSError as exc:
            raise ImageNotFound(f"{ref}: cannot read the directory: {exc.strerror}") from None
        hexd = digest.removeprefix("sha256:")
        cfg = ImageConfig()
        content, disk = await trio.to_thread.run_sync(store._prepare_tree, tree, cfg, shift)
        out = stage / "out"
        out.mkdir()
        if store.tools is not None:
            os.chown(out, shift, shift)
        fs_uuid = str(uuid.uuid4())
        from images.oci.pull import _Tool

        await store._run(
            _mkfs_argv(tree, out / "rootfs.ext4", disk, content, fs_uuid),
            r,
            "making the ext4 file",
            tool=_Tool(None, (bind(unpack), bind(out, writable=True)), keep_caps=READ_CAPS, fsize=disk),
        )
        _own_output(out, "rootfs.ext4")
        meta = {
            "version": _CODE_VERSION,
            "digest": digest,
            "config_digest": digest,
            "config": attrs.asdict(cfg),
            "rootfs_uuid": fs_uuid,
            "layers": [],
            "blobs": [],
            "content_bytes": content[0],
            "disk_bytes": disk,
            "download_bytes": 0,
            "source": ref,
            "pulled_at": time.time(),
        }
        _write_durably(out / "image.json", json.dumps(meta, indent=2).encode())
        out.chmod(0o755)
        try:
            out.rename(store.images / hexd)
        except OSError:
            if store._load(hexd) is None:
                raise  # (else another Create made the same tree first: theirs is as good)
        _fsync_dir(store.images)
    return digest
