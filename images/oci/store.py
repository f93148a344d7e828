"""The image store on disk: its layout, refs.json, the shared blobs, lookups, removal and
garbage collection. Pulling into it is images/oci/pull.py's (ImageStore extends Store).

Layout of the store (``<state>/images/oci``)::

    blobs/sha256/<hex>        manifests, configs and layers, shared by every image
    images/<hex>/rootfs.ext4  the root filesystem (0444; sandboxes write to qcow2 overlays)
    images/<hex>/image.json   what the image is (Image)
    refs.json                 canonical reference -> manifest digest
    tmp/                      staging directories and the trash; never read as images

An image appears by one rename of a staging directory into images/; it goes by one
rename out of it (into tmp/, then removed)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path

import attrs
import trio

from images.oci.errors import DigestMismatch, DiskFull, ImageInUse, ImageNotFound, InvalidReference, UnsupportedImage
from images.oci.image import Image, _config_from_json
from images.oci.reference import _DIGEST_RE, Reference, _digest_like, _digest_of, parse_reference


@attrs.frozen
class RemoveResult:
    untagged: tuple[str, ...]  # references removed
    deleted: tuple[str, ...]  # digests of images deleted
    freed_bytes: int


@attrs.frozen
class PruneResult:
    deleted: tuple[str, ...]  # digests of images deleted
    blobs_deleted: int
    freed_bytes: int
    blobs_skipped: bool  # pulls were running: blob collection left for next time


class Store:
    """The store at ``root``: what is in it and how it changes, not how images get there."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.images = root / "images"
        self.tmp = root / "tmp"
        self._active_staging: set[Path] = set()
        self._pulls = 0  # pulls running: blobs are not collected meanwhile (one may be reusing them)
        for d in (root, self.blobs / "sha256", self.images, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        for d in (root, self.images):
            d.chmod(0o755)  # QEMU may run as another user: it opens images/<hex>/rootfs.ext4
        self._sweep_dead_staging()

    # -- lookups ------------------------------------------------------------------
    def list_images(self) -> list[Image]:
        """Every image in the store, newest pull first."""
        refs = self._read_refs()
        out = [img for d in self.images.iterdir() if (img := self._load(d.name, refs)) is not None]
        return sorted(out, key=lambda i: i.pulled_at, reverse=True)

    def get(self, ref: str) -> Image:
        """The local image a reference (or a digest, or 12+ hex digits of one) names."""
        img = self._lookup(ref)
        if img is None:
            raise ImageNotFound(f"image {ref} is not in the store (pull it first)")
        return img

    def _lookup(self, ref: str) -> Image | None:
        refs = self._read_refs()
        hexd = _digest_like(ref)
        if hexd is not None:
            matches = [d.name for d in self.images.iterdir() if d.name.startswith(hexd)]
            if len(matches) > 1:
                raise InvalidReference(f"{ref} is ambiguous: it matches {len(matches)} images")
            return self._load(matches[0], refs) if matches else None
        if ref.startswith("dir:"):  # a root filesystem directory's image (images/oci/rootdir.py): by its ref
            digest = refs.get(ref, "")
            return self._load(digest.removeprefix("sha256:"), refs) if digest else None
        r = parse_reference(ref)
        digest = refs.get(r.canonical()) or r.digest
        return self._load(digest.removeprefix("sha256:"), refs) if digest else None

    # -- blobs --------------------------------------------------------------------
    def _link_known(self, digests: list[str], into: Path) -> int:
        """Hard links of the store's blobs among ``digests`` in ``into``: bytes linked."""
        n = 0
        for d in dict.fromkeys(digests):
            src = self.blobs / d.replace(":", "/", 1)
            with contextlib.suppress(FileNotFoundError):
                os.link(src, into / src.name, follow_symlinks=False)
                n += os.lstat(src).st_size
        return n

    def _publish_blobs(self, blobs_in: Path, r: Reference) -> None:
        """skopeo's new blobs into the store: each a regular file of one link, its content
        hashed here to its name, then the supervisor's (0644), then linked in."""
        for e in os.scandir(blobs_in):
            dst = self.blobs / "sha256" / e.name
            if not re.fullmatch(r"[0-9a-f]{64}", e.name) or dst.exists():
                continue
            fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    raise UnsupportedImage(f"{r}: blob {e.name} is not a plain file")
                h = hashlib.sha256()
                while chunk := os.read(fd, 1 << 20):
                    h.update(chunk)
                if h.hexdigest() != e.name:
                    raise DigestMismatch(f"{r}: blob sha256:{e.name} does not match its digest")
                os.fchown(fd, 0, 0)
                os.fchmod(fd, 0o644)
                now = os.lstat(e.path)  # (skopeo has exited: the name cannot move under us)
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    raise UnsupportedImage(f"{r}: blob {e.name} changed while it was checked")
                with contextlib.suppress(FileExistsError):  # a concurrent pull published it
                    os.link(e.path, dst, follow_symlinks=False)
            finally:
                os.close(fd)

    def _blob(self, digest: str, limit: int, r: Reference) -> bytes:
        if not _DIGEST_RE.fullmatch(digest):
            raise UnsupportedImage(f"{r}: unsupported digest {digest[:80]!r}")
        p = self.blobs / digest.replace(":", "/", 1)
        if p.stat().st_size > limit:
            raise UnsupportedImage(f"{r}: blob {digest} is over {limit} bytes")
        data = p.read_bytes()
        if _digest_of(data) != digest:
            raise DigestMismatch(f"{r}: blob {digest} in the store does not match its digest")
        return data

    # -- remove and prune -----------------------------------------------------------
    async def remove(self, ref: str, *, in_use: Collection[str] = ()) -> RemoveResult:
        """Untag ``ref``; delete the image when that was its last reference, or when ``ref``
        is a digest (all its references go). ``in_use``: digests sandboxes, snapshots or
        templates still boot from; deleting one of those is ImageInUse (untagging is not)."""
        img = self.get(ref)
        refs = self._read_refs()
        mine = sorted(k for k, v in refs.items() if v == img.digest)
        local_dir = ref.startswith("dir:")  # (a root filesystem directory's ref: no OCI spelling)
        by_tag = _digest_like(ref) is None and (local_dir or not parse_reference(ref).digest)
        key = (ref if local_dir else parse_reference(ref).canonical()) if by_tag else ""
        if by_tag and key in mine and len(mine) > 1:
            self._drop_refs({key})
            return RemoveResult(untagged=(key,), deleted=(), freed_bytes=0)
        if img.digest in in_use:
            raise ImageInUse(f"image {img.id} ({', '.join(mine) or 'untagged'}) is in use by a sandbox or snapshot")
        freed = await self._delete(img)
        freed += await self._collect_blobs()
        return RemoveResult(untagged=tuple(mine), deleted=(img.digest,), freed_bytes=freed)

    async def prune(self, in_use: Collection[str], *, dangling_only: bool = False) -> PruneResult:
        """Delete every image not in ``in_use`` (only the untagged ones with
        ``dangling_only``), the blobs no image keeps, and stale staging directories."""
        deleted, freed = [], 0
        for img in self.list_images():
            if img.digest in in_use or (dangling_only and img.refs):
                continue
            freed += await self._delete(img)
            deleted.append(img.digest)
        present = {img.digest for img in self.list_images()}
        self._drop_refs({k for k, v in self._read_refs().items() if v not in present})  # left by a crash
        skipped = self._pulls > 0
        before = len(list(self._blob_files()))
        freed += await self._collect_blobs()
        freed += await self._sweep_tmp()
        return PruneResult(
            deleted=tuple(deleted),
            blobs_deleted=before - len(list(self._blob_files())),
            freed_bytes=freed,
            blobs_skipped=skipped,
        )

    async def _delete(self, img: Image) -> int:
        """Move the image out of images/ (one rename: it is gone at once), forget its refs,
        then remove the files in a thread."""
        src = self.images / img.digest.removeprefix("sha256:")
        trash = self.tmp / f"trash-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            src.rename(trash)
        except FileNotFoundError:
            return 0
        self._drop_refs({k for k, v in self._read_refs().items() if v == img.digest})
        size = _disk_usage(trash)
        await _rmtree(trash)
        return size

    async def _collect_blobs(self) -> int:
        """Remove blobs no image keeps, unless a pull is running (it may be reusing one)."""
        if self._pulls:
            return 0
        keep = {b for img in self.list_images() for b in img.blobs}
        freed = 0
        for p in self._blob_files():
            if f"sha256:{p.name}" not in keep:
                with contextlib.suppress(FileNotFoundError):
                    freed += p.stat().st_blocks * 512
                    p.unlink()
        return freed

    def _blob_files(self) -> Iterator[Path]:
        return (p for p in (self.blobs / "sha256").iterdir() if p.is_file())

    async def _sweep_tmp(self) -> int:
        freed = 0
        for p in list(self.tmp.iterdir()):
            if p in self._active_staging:
                continue
            pid = _owner_pid(p.name)
            if pid is None or pid == os.getpid() or not _alive(pid):
                freed += _disk_usage(p)
                await _rmtree(p)
        return freed

    def _sweep_dead_staging(self) -> None:
        """Staging left by a process that died mid-pull (a supervisor crash)."""
        for p in self.tmp.iterdir():
            pid = _owner_pid(p.name)
            if pid is not None and pid != os.getpid() and not _alive(pid):
                shutil.rmtree(p, ignore_errors=True)

    # -- staging, image.json and refs.json ---------------------------------------------
    @contextlib.asynccontextmanager
    async def _staging(self, kind: str) -> AsyncIterator[Path]:
        d = self.tmp / f"{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        d.mkdir(mode=0o700)
        self._active_staging.add(d)
        try:
            yield d
        finally:
            try:
                await _rmtree(d)  # shielded: an error or a cancel leaves nothing behind
            finally:
                self._active_staging.discard(d)

    def _load(self, hexd: str, refs: dict[str, str] | None = None) -> Image | None:
        d = self.images / hexd
        try:
            meta = json.loads((d / "image.json").read_bytes())
        except (OSError, ValueError):
            return None
        if not (d / "rootfs.ext4").exists():
            return None
        refs = self._read_refs() if refs is None else refs
        digest = str(meta["digest"])
        return Image(
            digest=digest,
            config_digest=str(meta["config_digest"]),
            config=_config_from_json(meta["config"]),
            rootfs=d / "rootfs.ext4",
            rootfs_uuid=str(meta["rootfs_uuid"]),
            refs=tuple(sorted(k for k, v in refs.items() if v == digest)),
            layers=tuple(meta["layers"]),
            blobs=tuple(meta["blobs"]),
            content_bytes=int(meta["content_bytes"]),
            disk_bytes=int(meta["disk_bytes"]),
            download_bytes=int(meta["download_bytes"]),
            source=str(meta["source"]),
            pulled_at=float(meta["pulled_at"]),
        )

    def _read_refs(self) -> dict[str, str]:
        try:
            data = json.loads((self.root / "refs.json").read_bytes())
        except FileNotFoundError:
            return {}
        except ValueError:
            return {}  # a torn write cannot happen (rename); a hand-edited file loses its tags
        return {str(k): str(v) for k, v in dict(data.get("refs", {})).items()}

    def _write_refs(self, refs: dict[str, str]) -> None:
        body = json.dumps({"version": 1, "refs": dict(sorted(refs.items()))}, indent=2).encode()
        tmp = self.root / f".refs.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            _write_durably(tmp, body)
            tmp.rename(self.root / "refs.json")
            _fsync_dir(self.root)  # the new refs survive a power cut (the old ones would name pruned images)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull("the image store's disk is full (writing refs.json)") from None
            raise

    def _add_ref(self, ref: str, digest: str) -> None:
        refs = self._read_refs()
        if refs.get(ref) != digest:
            refs[ref] = digest  # a moved tag: the old image keeps its other refs, or dangles
            self._write_refs(refs)

    def _drop_refs(self, keys: set[str]) -> None:
        refs = self._read_refs()
        if keys & refs.keys():
            self._write_refs({k: v for k, v in refs.items() if k not in keys})


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_usage(p: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(p):
        for name in files + dirs:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


async def _rmtree(p: Path) -> None:
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(shutil.rmtree, p, True)


def _owner_pid(name: str) -> int | None:
    m = re.match(r"^[a-z]+-(\d+)-", name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def default_store_root() -> Path:
    from images.build import default_cache

    return default_cache() / "oci"
