"""Snapshot export and import: one streamed file (:mod:`actors.snapshots.archive`)
that carries a snapshot to another supervisor.

What an export carries: the snapshot's directory (``vmstate``, ``memory`` when mapped,
``disk.qcow2``, ``kernel``, ``initrd``; a disk-only snapshot has the disk alone) and
every layer of its disk chain that is not a built image's or an OCI image's root
filesystem (a boot template's disk, an origin snapshot's), as ``layer-N``. The
image layers at the bottom are *named* (which cache, the path inside it, the size):
images are content-keyed, so a supervisor with the same image build or pull has the
very file; one without it refuses the import with FAILED_PRECONDITION naming what is
missing. ``include_base`` carries them too (the default rootfs: ~250 MiB of data).
Files go as their data extents (SEEK_DATA): a 2 GiB sparse rootfs sends what it holds.

Export: the files are opened in one Trio step (a conversion may switch the record and
unlink the old stream meanwhile; a delete may remove the directory: what was opened
is read to the end), then read in worker threads, 1 MiB per frame.

Import: the bytes are a hostile peer's. Nothing is parsed as root beyond the framed
format's bounded reader and the qcow2 header parser (actors/machines/disk.py): QEMU,
jailed, reads the files as it reads any snapshot. Files are written into a fresh
directory under the snapshot store (``pending``: the collector leaves it alone), by
the names the reader allows, never past the sizes the manifest declared, which are
checked against the supervisor's limits before a byte is written; the disk's free
space is checked as data comes. Only after the trailer's digest matched (and every
file checked) is anything synced, recorded and announced; any failure removes the
directory: nothing is left behind. The snapshot gets a new id; its name must not be
another snapshot's (ALREADY_EXISTS; the caller may give another).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.durable import fsync_dir
from actors.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from actors.hostdirs import check_host_file
from actors.machines.disk import MAX_CHAIN, DiskError, inspect_disk, overlay_bound
from actors.model import ImageUse, MemoryKind, SandboxConfig, dump, load
from actors.rules import check_config, check_labels, check_name
from actors.sandboxes.savedstate import allocated, stat_key
from actors.settings import Settings
from actors.snapshots import archive
from actors.snapshots.snapshot import SnapshotStore
from actors.store import MachineRecord, SnapshotRecord

log = logging.getLogger("sandvisor.transfer")

CHUNK = 1 << 20  # bytes of file data per frame an export writes
PARTS = ("kernel", "initrd")  # named when they are this supervisor's image's files
FRAMES_PER_HOP = 4  # frames an export reads (and an import writes) per worker-thread hop
DISK_CHECK_EVERY = 64 << 20  # bytes written between two free-space checks of an import
MAX_MEMORY_MIB = 65536  # as a Create's memory_mib (actors/rules.py check_config)
BASE_NAME = "rootfs.ext4"  # what a named base layer is in either cache (never another file of theirs)
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


def base_roots(settings: Settings) -> dict[str, Path]:
    """The image caches whose files an export names instead of carrying (most
    specific first: the OCI store may live inside the image cache)."""
    roots: dict[str, Path] = {}
    if settings.images is not None:
        roots["oci"] = settings.images.root.resolve()
    roots["image"] = settings.image.rootfs.resolve().parent.parent
    return roots


@attrs.frozen
class _Source:
    name: str
    fd: int
    size: int


def _open(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FailedPrecondition(f"{path} is not a regular file")
    return fd


def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of the data in a file; holes are left out."""
    out: list[tuple[int, int]] = []
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after off
                break
            return [(0, size)]  # no SEEK_DATA here: all of it
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        out.append((start, end))
        off = end
    return out


def _plan_export(rec: SnapshotRecord, settings: Settings, include_base: bool) -> tuple[list[_Source], dict[str, Any]]:
    """Open what the export carries (one Trio step: no await) and say it in a manifest."""
    if rec.config.volumes:
        raise FailedPrecondition(f"snapshot {rec.id} has volumes mounted: volumes do not travel with an export")
    if rec.config.secrets:  # (their values are in this supervisor's vault, never in a file)
        raise FailedPrecondition(f"snapshot {rec.id} has secrets: secrets do not travel with an export")
    names = ["disk.qcow2"]
    if rec.memory != MemoryKind.DISK:
        names = [
            rec.vmstate,
            *(["memory"] if rec.memory == MemoryKind.MAPPED else []),
            "disk.qcow2",
            "kernel",
            "initrd",
        ]
    roots = base_roots(settings)
    sources: list[_Source] = []
    chain: list[dict[str, Any]] = []
    named: dict[str, dict[str, Any]] = {}  # kernel, initrd: the image's own files, named
    oci_base = ""
    try:
        for name in names:
            part = _named_part(rec.path / name, settings, roots) if name in PARTS and not include_base else None
            if part is not None:
                named[name] = part
                continue
            try:
                fd = _open(rec.path / name)
            except OSError as exc:
                raise FailedPrecondition(f"snapshot {rec.id} is incomplete on disk: {name}: {exc.strerror}") from None
            sources.append(_Source(name, fd, os.fstat(fd).st_size))
        for i, layer in enumerate(rec.chain, 1):
            p = Path(layer).resolve()
            # an image cache's root filesystem (never a snapshot's layer, wherever the caches are)
            image_file = p.name == BASE_NAME and not p.is_relative_to(rec.path.parent.resolve())
            base = next(((k, r) for k, r in roots.items() if p.is_relative_to(r)), None) if image_file else None
            if base is not None and not include_base:
                kind, root = base
                chain.append({"base": kind, "path": str(p.relative_to(root)), "size": p.stat().st_size})
                if rec.oci is not None and p == Path(rec.oci.rootfs).resolve():
                    oci_base = f"base:{len(chain) - 1}"
                continue
            fd = _open(p)
            sources.append(_Source(f"layer-{i}", fd, os.fstat(fd).st_size))
            chain.append({"file": f"layer-{i}"})
            if rec.oci is not None and p == Path(rec.oci.rootfs).resolve():
                oci_base = f"layer-{i}"
    except BaseException:
        for s in sources:
            os.close(s.fd)
        raise
    body = {
        "snapshot": {
            "id": rec.id,
            "name": rec.name,
            "labels": dict(rec.labels),
            "sandbox_id": rec.sandbox_id,
            "created_ns": rec.created_ns,
            "memory": rec.memory.value,
            "vmstate": rec.vmstate if rec.memory != MemoryKind.DISK else "",
            "machine": dump(rec.machine),
            "config": dump(rec.config),
            "oci": dump(rec.oci) if rec.oci is not None else None,
            "oci_base": oci_base,
        },
        "chain": chain,
        "parts": named,
    }
    return sources, body


async def export_stream(
    rec: SnapshotRecord, settings: Settings, *, include_base: bool = False
) -> AsyncGenerator[bytes]:
    """The export of ``rec`` as pieces of bytes (each a frame or less than 1.1 MiB)."""
    sources, body = _plan_export(rec, settings, include_base)
    h = hashlib.sha256()
    try:
        first = archive.head() + archive.manifest_frame([archive.FileEntry(s.name, s.size) for s in sources], body)
        h.update(first)
        yield first
        for index, src in enumerate(sources):
            extents = await trio.to_thread.run_sync(_extents, src.fd, src.size)
            for start, end in extents:
                for off in range(start, end, CHUNK * FRAMES_PER_HOP):
                    stop = min(end, off + CHUNK * FRAMES_PER_HOP)
                    for piece in await trio.to_thread.run_sync(_read_frames, src.fd, index, off, stop, h):
                        yield piece
        yield archive.end_frame(h.digest())
    finally:
        for s in sources:
            os.close(s.fd)


def _read_frames(fd: int, index: int, start: int, stop: int, h: Any) -> list[bytes]:
    """Data frames of ``start``..``stop`` (a worker thread's hop: read and hashed)."""
    out = []
    for off in range(start, stop, CHUNK):
        n = min(CHUNK, stop - off)
        data = os.pread(fd, n, off)
        if len(data) != n:
            raise FailedPrecondition("a snapshot file shrank while it was exported")
        piece = archive.data_frame(index, off, data)
        h.update(piece)
        out.append(piece)
    return out


# --- import ----------------------------------------------------------------------------------
@attrs.define
class _Target:
    name: str
    size: int
    fd: int = -1


class Importer:
    """One import into ``store``: :meth:`feed` the stream, then :meth:`commit`; on any
    failure :meth:`abort` (the directory goes)."""

    def __init__(
        self,
        store: SnapshotStore,
        settings: Settings,
        *,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        check_disk: Callable[[], None] = lambda: None,
    ) -> None:
        if name is not None:
            check_name(name)
        if labels is not None:
            check_labels(labels)
        self.store, self.settings = store, settings
        self.name, self.labels, self.check_disk = name, labels, check_disk
        self.reader = archive.Reader()
        self.uid = os.urandom(8).hex()
        self.dir = store.root / self.uid
        self.targets: list[_Target] = []
        self.plan: _Plan | None = None
        self._written = 0
        self._since_check = 0

    def open(self) -> None:
        self.dir.mkdir(mode=0o711)
        self.store.pending.add(self.dir.resolve())

    async def feed(self, data: bytes) -> None:
        """Parse (and hash) in a worker thread, check a manifest here, write the data
        it completed in one more hop."""
        writes: list[archive.Data] = []
        for ev in await trio.to_thread.run_sync(self.reader.feed, data):
            if isinstance(ev, archive.Manifest):
                self.plan = _check_manifest(ev, self.settings, self.store, self.name, self.labels)
                await trio.to_thread.run_sync(self._create_files, ev.files)
            elif isinstance(ev, archive.Data):
                writes.append(ev)
        if writes:
            await trio.to_thread.run_sync(self._write, writes)
            self._since_check += sum(len(w.data) for w in writes)
            if self._since_check >= DISK_CHECK_EVERY:
                self._since_check = 0
                self.check_disk()

    def _write(self, writes: list[archive.Data]) -> None:
        for w in writes:
            _pwrite_all(self.targets[w.index].fd, w.data, w.offset)

    def _create_files(self, files: tuple[archive.FileEntry, ...]) -> None:
        for f in files:
            fd = os.open(self.dir / f.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self.targets.append(_Target(f.name, f.size, fd))
            os.ftruncate(fd, f.size)  # (a hole: what the stream does not fill stays one)
            if f.name in ("kernel", "initrd"):
                os.fchmod(fd, 0o644)  # as the image's: a jailed QEMU opens them itself

    async def commit(self) -> SnapshotRecord:
        """The stream ended: check the trailer was read (the digest matched), check the
        files, make them durable, record the snapshot."""
        self.reader.close()
        plan = self.plan
        assert plan is not None
        await trio.to_thread.run_sync(self._finish, plan)
        rec = plan.record(self)
        _check_name_free(self.store, rec.name)  # (again: one may have come meanwhile)
        self.store.store.insert_snapshot(rec)
        self.store.snapshots[rec.id] = rec
        self.store.pending.discard(self.dir.resolve())
        self.store.convert_soon(rec)
        log.info("snapshot %s imported (%d bytes of files)", rec.id, self._written)
        return rec

    def _finish(self, plan: _Plan) -> None:
        for t in self.targets:
            os.fsync(t.fd)
            os.close(t.fd)
            t.fd = -1
        for t in self.targets:
            _check_file(self.dir / t.name, t.name, plan, self.settings)
        for name, local in plan.parts.items():
            _link_part(local, self.dir / name)
        user = self.settings.qemu_user if self.settings.cells is None else None
        if user is not None and (self.dir / "memory").exists():
            os.chown(self.dir / "memory", user.uid, user.gid)  # (see snapshot._finish)
        fsync_dir(self.dir)
        fsync_dir(self.dir.parent)
        self._written = sum(allocated(self.dir / t.name) for t in self.targets)

    async def abort(self) -> None:
        for t in self.targets:
            if t.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(t.fd)
                t.fd = -1
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(shutil.rmtree, self.dir, True)
        self.store.pending.discard(self.dir.resolve())


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


@attrs.frozen
class _Plan:
    memory: MemoryKind
    vmstate: str
    machine: MachineRecord
    config: SandboxConfig
    chain: tuple[str, ...]  # resolved: carried layers in the new directory, local bases
    oci: ImageUse | None
    oci_base: str
    name: str
    labels: dict[str, str]
    sandbox_id: str
    created_ns: int
    parts: dict[str, Path] = attrs.Factory(dict)  # kernel, initrd: local image files to link

    def record(self, imp: Importer) -> SnapshotRecord:
        d = imp.dir
        chain = tuple(str(d / c) if c.startswith("layer-") else c for c in self.chain)
        oci = self.oci
        if oci is not None:
            if self.oci_base.startswith("layer-"):
                oci = attrs.evolve(oci, rootfs=str(d / self.oci_base))
            elif self.oci_base.startswith("base:"):
                oci = attrs.evolve(oci, rootfs=self.chain[int(self.oci_base[5:])])
        sizes = {t.name: allocated(d / t.name) for t in imp.targets}
        mapped = self.memory == MemoryKind.MAPPED
        return SnapshotRecord(
            uid=imp.uid,
            id=imp.store.new_id(),
            name=self.name,
            labels=self.labels,
            sandbox_id=self.sandbox_id,
            origin_uid="",
            created_ns=self.created_ns,
            dir=str(d),
            memory=self.memory,
            machine=self.machine,
            config=self.config,
            sizes=sizes,
            memory_stat=stat_key(d / "memory") if mapped else [],
            oci=oci,
            chain=chain,
            vmstate=self.vmstate or "vmstate",
        )


def _check_name_free(store: SnapshotStore, name: str) -> None:
    if name and any(r.name == name and not r.hidden for r in store.snapshots.values()):
        raise AlreadyExists(f"a snapshot named {name!r} exists; import it under another name")


def _field(d: dict[str, Any], key: str, t: type, default: Any) -> Any:
    v = d.get(key, default)
    if type(v) is not t:
        raise InvalidArgument(f"the export's manifest: {key} is not a {t.__name__}")
    return v


def _check_manifest(
    m: archive.Manifest, settings: Settings, store: SnapshotStore, name: str | None, labels: dict[str, str] | None
) -> _Plan:
    """Every field of the manifest checked against this supervisor's rules and limits,
    before a byte of a file is written."""
    snap = m.body.get("snapshot")
    if not isinstance(snap, dict):
        raise InvalidArgument("the export's manifest has no snapshot")
    try:
        memory = MemoryKind(_field(snap, "memory", str, ""))
    except ValueError:
        raise InvalidArgument("the export's manifest: unknown memory kind") from None
    files = {f.name: f.size for f in m.files}
    vmstate = _field(snap, "vmstate", str, "")
    need = ["disk.qcow2"]
    if memory != MemoryKind.DISK:
        if vmstate not in ("vmstate", "vmstate-mapped"):
            raise InvalidArgument("the export's manifest: vmstate must name vmstate or vmstate-mapped")
        need += [vmstate, "kernel", "initrd", *(["memory"] if memory == MemoryKind.MAPPED else [])]
    parts = _check_parts(m.body.get("parts", {}), files, settings, memory)
    for n in need:
        if n not in files and n not in parts:
            raise InvalidArgument(f"the export carries no {n}")
    try:
        machine = load(snap.get("machine"), MachineRecord)
        config = load(snap.get("config"), SandboxConfig)
        oci = load(snap["oci"], ImageUse) if snap.get("oci") is not None else None
    except Exception as exc:  # cattrs' errors for data that does not fit
        raise InvalidArgument(f"the export's manifest does not describe a snapshot: {type(exc).__name__}") from None
    # the converter coerces what it can ("5" for 5, a default for a string where a map
    # goes): what it read must be what the export says, field for field (fields this
    # supervisor does not know, a newer one's, are left out)
    for what, value, raw in (("machine", machine, snap.get("machine")), ("config", config, snap.get("config"))):
        if not _conforms(dump(value), raw):
            raise InvalidArgument(f"the export's manifest does not describe a snapshot: its {what} is malformed")
    if oci is not None and not _conforms(dump(oci), snap["oci"]):
        raise InvalidArgument("the export's manifest does not describe a snapshot: its OCI image is malformed")
    if machine.machine != "microvm" or not 1 <= machine.cpus <= 256 or not 1 <= machine.memory_mib <= MAX_MEMORY_MIB:
        raise InvalidArgument("the export's machine is not one this supervisor runs")
    if len(machine.append) > 4096 or not machine.append.isprintable():
        raise InvalidArgument("the export's kernel command line is malformed")
    if memory == MemoryKind.MAPPED and files["memory"] != machine.memory_mib << 20:
        raise InvalidArgument("the export's memory file does not match its machine's memory")
    if config.volumes:
        raise InvalidArgument("the export's sandbox mounts volumes: volumes do not travel")
    if config.secrets:
        raise InvalidArgument("the export's sandbox has secrets: secrets do not travel")
    check_config(config)
    if config.boot.kernel or config.boot.rootfs:
        for what, path in (("kernel", config.boot.kernel), ("rootfs", config.boot.rootfs)):
            if path:
                check_host_file(what, path, settings.allowed_paths)
    max_disk = settings.max_sandbox_disk_mib << 20
    for n, size in files.items():
        if n.startswith("layer-") or n == "disk.qcow2":
            if max_disk and size > overlay_bound(max_disk):
                raise InvalidArgument(f"the export's {n} is larger than a sandbox's disk may be")
        elif n in ("kernel", "initrd") and size > 1 << 30:
            raise InvalidArgument(f"the export's {n} is {size} bytes")
        elif n.startswith("vmstate") and size > (machine.memory_mib << 20) + (256 << 20):
            raise InvalidArgument(f"the export's {n} is larger than its machine's memory")
    chain = _check_chain(m.body.get("chain"), files, settings)
    new_name = name if name is not None else _field(snap, "name", str, "")
    check_name(new_name)
    _check_name_free(store, new_name)
    new_labels = _field(snap, "labels", dict, {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in new_labels.items()):
        raise InvalidArgument("the export's labels are not strings")
    new_labels = {**new_labels, **(labels or {})}
    check_labels(new_labels)
    sandbox_id = _field(snap, "sandbox_id", str, "")[:128]
    created = _field(snap, "created_ns", int, time.time_ns())
    oci_base = _field(snap, "oci_base", str, "")
    if oci is not None and not (
        (oci_base.startswith("layer-") and oci_base in files)
        or (oci_base.startswith("base:") and oci_base[5:].isdigit() and int(oci_base[5:]) < len(chain))
    ):
        raise InvalidArgument("the export's OCI image names no layer of its chain")
    return _Plan(
        memory, vmstate, machine, config, chain, oci, oci_base, new_name, dict(new_labels), sandbox_id, created, parts
    )


def _conforms(known: Any, raw: Any) -> bool:
    """``raw`` (a manifest's value) says exactly ``known`` (what the converter made of it,
    dumped again): maps may lack keys (defaults) or have more (a newer writer's)."""
    if isinstance(known, dict):
        return isinstance(raw, dict) and all(k not in raw or _conforms(v, raw[k]) for k, v in known.items())
    if isinstance(known, list | tuple):
        return isinstance(raw, list | tuple) and len(raw) == len(known) and all(map(_conforms, known, raw))
    if isinstance(known, str):  # (a StrEnum dumps as itself)
        return isinstance(raw, str) and known == raw
    return type(known) is type(raw) and known == raw


def _check_parts(raw: Any, files: dict[str, int], settings: Settings, memory: MemoryKind) -> dict[str, Path]:
    """The kernel and initrd an export names (this supervisor's image files, by path in
    its image cache: the same build's have the same content-keyed path)."""
    if not isinstance(raw, dict) or not set(raw) <= set(PARTS) or (raw and memory == MemoryKind.DISK):
        raise InvalidArgument("the export's named parts are malformed")
    roots = base_roots(settings)
    leaves = {settings.image.kernel.name, settings.image.initrd.name}
    out: dict[str, Path] = {}
    for name, entry in raw.items():
        if name in files or not isinstance(entry, dict):
            raise InvalidArgument(f"the export both names and carries its {name}")
        out[name] = _resolve_named(entry, {"image": roots["image"]}, leaves, name)
    return out


def _check_chain(raw: Any, files: dict[str, int], settings: Settings) -> tuple[str, ...]:
    """The chain below the disk: carried layers by file name (kept relative here),
    named image files resolved in this supervisor's caches (FAILED_PRECONDITION when
    one is missing)."""
    if not isinstance(raw, list) or len(raw) > MAX_CHAIN:
        raise InvalidArgument("the export's disk chain is malformed")
    roots = base_roots(settings)
    chain: list[str] = []
    for entry in raw:
        if not isinstance(entry, dict):
            raise InvalidArgument("the export's disk chain is malformed")
        if "file" in entry:
            f = entry["file"]
            if not isinstance(f, str) or not f.startswith("layer-") or f not in files or f in chain:
                raise InvalidArgument("the export's disk chain names a layer it does not carry")
            chain.append(f)
            continue
        chain.append(str(_resolve_named(entry, roots, {BASE_NAME}, "base layer")))
    carried = {n for n in files if n.startswith("layer-")}
    if carried - set(chain):
        raise InvalidArgument("the export carries layers its disk chain does not use")
    return tuple(chain)


def _resolve_named(entry: dict[str, Any], roots: dict[str, Path], leaves: set[str], what: str) -> Path:
    """A file an export names instead of carrying, in this supervisor's caches: a plain
    relative path whose last component is one of ``leaves``, a regular file reached
    through no symlink, of the size the exporter saw (FAILED_PRECONDITION when absent)."""
    kind, rel, size = entry.get("base"), entry.get("path"), entry.get("size")
    if kind not in roots or not isinstance(rel, str) or type(size) is not int:
        raise InvalidArgument(f"the export names a {what} it cannot say where to find")
    parts = rel.split("/")
    if not 2 <= len(parts) <= 8 or not all(_PART.match(p) for p in parts) or parts[-1] not in leaves:
        raise InvalidArgument(f"the export names a {what} by a malformed path")
    local = roots[kind] / rel
    try:
        st = local.lstat()
        ok = stat.S_ISREG(st.st_mode) and os.path.realpath(local) == str(local) and st.st_size == size
    except OSError:
        ok = False
    if not ok:
        raise FailedPrecondition(
            f"this supervisor lacks the {what} {kind}:{rel} ({size} bytes) the snapshot needs: "
            "build or pull that image here, or export with include_base"
        )
    return local


def _named_part(path: Path, settings: Settings, roots: dict[str, Path]) -> dict[str, Any] | None:
    """The kernel or initrd of a snapshot as the image file it is a link of (named, not
    carried), or None (the image was rebuilt since: carried)."""
    root = roots["image"]
    for candidate in (settings.image.kernel, settings.image.initrd):
        try:
            same = os.path.samefile(path, candidate)
        except OSError:
            continue
        real = candidate.resolve()
        if same and real.is_relative_to(root):
            return {"base": "image", "path": str(real.relative_to(root)), "size": real.stat().st_size}
    return None


def _link_part(local: Path, dest: Path) -> None:
    """A named kernel or initrd into the new snapshot dir: linked, as a checkpoint does."""
    try:
        os.link(local, dest)
    except OSError:
        shutil.copy2(local, dest)
        os.chmod(dest, 0o644)  # as the image's: a jailed QEMU opens it itself


def _check_file(path: Path, name: str, plan: _Plan, settings: Settings) -> None:
    """A written disk layer: a qcow2 (the disk, and a carried layer that is one) has no
    external data file and a virtual size within the sandbox disk limit."""
    if name != "disk.qcow2" and not name.startswith("layer-"):
        return
    try:
        info = inspect_disk(path)
    except DiskError as exc:
        raise InvalidArgument(f"the export's {name}: {exc}") from None
    if name == "disk.qcow2" and info.header is None:
        raise InvalidArgument("the export's disk.qcow2 is not a qcow2 image")
    if info.header is not None and info.header.external_data:
        raise InvalidArgument(f"the export's {name} names an external data file")
    limit = settings.max_sandbox_disk_mib << 20
    if limit and info.size > limit:
        raise InvalidArgument(f"the export's {name} has a virtual size above --max-sandbox-disk")
