"""Snapshot export and import without a VM (actors/snapshots/transfer.py): a round trip
between two snapshot stores, what is named instead of carried, and hostile exports
(well-framed, digest-correct, but lying in their manifest or files) refused with their
codes and nothing left behind."""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from actors.errors import AlreadyExists, DomainError, FailedPrecondition, InvalidArgument
from actors.model import MemoryKind, SandboxConfig, VolumeMount, dump
from actors.secrets.model import SecretRef
from actors.settings import Settings
from actors.snapshots import archive
from actors.snapshots.snapshot import SnapshotStore
from actors.snapshots.transfer import Importer, export_stream
from actors.store import MachineRecord, SnapshotRecord, Store
from images.build import Image

MIB = 1 << 20


def qcow2_head(size: int = 64 * MIB, data_file: bytes | None = None) -> bytes:
    buf = bytearray(64 * 1024)
    struct.pack_into(">4sIQIIQ", buf, 0, b"QFI\xfb", 3, 0, 0, 16, size)
    struct.pack_into(">QQQII", buf, 72, 0, 0, 0, 4, 104)
    off = 104
    if data_file is not None:
        struct.pack_into(">II", buf, off, 0x44415441, len(data_file))
        buf[off + 8 : off + 8 + len(data_file)] = data_file
        off += 8 + ((len(data_file) + 7) & ~7)
    struct.pack_into(">II", buf, off, 0, 0)
    return bytes(buf)


@attrs.frozen
class Env:
    settings: Settings
    src: SnapshotStore
    dst: SnapshotStore
    rec: SnapshotRecord


def _store(root: Path) -> SnapshotStore:
    s = SnapshotStore(root / "snapshots", Store(root / "db.sqlite"), set)
    s.load()
    return s


@pytest.fixture
def env(tmp_path: Path) -> Env:
    cache = tmp_path / "cache"
    for d in ("kernel-k", "runtime-r", "rootfs-f"):
        (cache / d).mkdir(parents=True)
    (cache / "kernel-k/vmlinux").write_bytes(b"K" * 5000)
    (cache / "runtime-r/initrd.cpio").write_bytes(b"I" * 3000)
    with open(cache / "rootfs-f/rootfs.ext4", "wb") as f:
        f.truncate(8 * MIB)
        f.seek(MIB)
        f.write(b"R" * 4096)
    img = Image(
        name="default",
        kernel=cache / "kernel-k/vmlinux",
        kernel_bz=cache / "kernel-k/vmlinux",
        initrd=cache / "runtime-r/initrd.cpio",
        rootfs=cache / "rootfs-f/rootfs.ext4",
        kernel_version="6",
        keys={},
    )
    settings = Settings(image=img, sandboxes_dir=tmp_path / "a/sandboxes", run_root=tmp_path / "run")
    src, dst = _store(tmp_path / "a"), _store(tmp_path / "b")
    d = src.root / "s1"
    d.mkdir()
    (d / "vmstate").write_bytes(os.urandom(10000))
    with open(d / "memory", "wb") as f:
        f.truncate(64 * MIB)
        f.seek(3 * MIB)
        f.write(b"M" * MIB)
    (d / "disk.qcow2").write_bytes(qcow2_head())
    os.link(img.kernel, d / "kernel")
    os.link(img.initrd, d / "initrd")
    rec = SnapshotRecord(
        uid="s1",
        id="snap-origin",
        name="warm",
        labels={"team": "a"},
        sandbox_id="box",
        origin_uid="u",
        created_ns=1,
        dir=str(d),
        memory=MemoryKind.MAPPED,
        machine=MachineRecord(append="console=hvc0", memory_mib=64, cpus=1, accel="tcg"),
        config=SandboxConfig(),
        chain=(str(img.rootfs),),
    )
    src.snapshots[rec.id] = rec
    return Env(settings, src, dst, rec)


async def export_bytes(env: Env, **kw: Any) -> bytes:
    return b"".join([p async for p in export_stream(env.rec, env.settings, **kw)])


async def import_bytes(env: Env, data: bytes, piece: int = 300_000, **kw: Any) -> SnapshotRecord:
    imp = Importer(env.dst, env.settings, **kw)
    imp.open()
    try:
        for i in range(0, len(data), piece):
            await imp.feed(data[i : i + piece])
        return await imp.commit()
    except BaseException:
        await imp.abort()
        raise


def leftovers(env: Env) -> set[str]:
    return {p.name for p in env.dst.root.iterdir()} - {r.uid for r in env.dst.snapshots.values()}


async def test_round_trip_names_the_image_files_and_keeps_holes(env: Env) -> None:
    data = await export_bytes(env)
    manifest = archive.Reader().feed(data[: 2 * MIB])[0]
    assert isinstance(manifest, archive.Manifest)
    assert [f.name for f in manifest.files] == ["vmstate", "memory", "disk.qcow2"]  # kernel, initrd named
    assert manifest.body["chain"] == [{"base": "image", "path": "rootfs-f/rootfs.ext4", "size": 8 * MIB}]
    assert len(data) < 2 * MIB  # the memory file's hole is not sent
    rec = await import_bytes(env, data)
    assert rec.id != env.rec.id and (rec.name, rec.labels, rec.memory) == ("warm", {"team": "a"}, MemoryKind.MAPPED)
    assert rec.chain == (str(env.settings.image.rootfs),)
    p = rec.path
    assert (p / "memory").read_bytes() == (env.rec.path / "memory").read_bytes()
    assert (p / "memory").stat().st_blocks * 512 < 4 * MIB  # sparse still
    assert (p / "vmstate").read_bytes() == (env.rec.path / "vmstate").read_bytes()
    assert os.path.samefile(p / "kernel", env.settings.image.kernel)  # linked, as a checkpoint does
    assert rec.memory_stat == [64 * MIB, (p / "memory").stat().st_mtime_ns]
    env.dst.check_restorable(rec, "tcg")
    # a second import of the same file: the name is taken; another name is a second snapshot
    with pytest.raises(AlreadyExists):
        await import_bytes(env, data)
    again = await import_bytes(env, data, name="warm-2", labels={"copy": "2"})
    assert (again.name, again.labels) == ("warm-2", {"team": "a", "copy": "2"})
    assert leftovers(env) == set()


async def test_include_base_carries_the_rootfs_and_image_files(env: Env) -> None:
    data = await export_bytes(env, include_base=True)
    rec = await import_bytes(env, data)
    assert rec.chain == (str(rec.path / "layer-1"),)
    assert (rec.path / "layer-1").read_bytes() == env.settings.image.rootfs.read_bytes()
    assert (rec.path / "kernel").read_bytes() == b"K" * 5000
    assert not os.path.samefile(rec.path / "kernel", env.settings.image.kernel)


def rebuild(data: bytes, change: Callable[[dict[str, Any], dict[str, bytes]], None]) -> bytes:
    """The export ``data`` with its manifest and files changed, framed and hashed anew:
    what a hostile peer can make."""
    events = archive.Reader().feed(data)
    m = events[0]
    assert isinstance(m, archive.Manifest)
    files = {f.name: bytearray(f.size) for f in m.files}
    for ev in events[1:]:
        if isinstance(ev, archive.Data):
            name = m.files[ev.index].name
            files[name][ev.offset : ev.offset + len(ev.data)] = ev.data
    body = {k: v for k, v in m.body.items() if k != "files"}
    out = {k: bytes(v) for k, v in files.items()}
    change(body, out)
    raw = archive.head() + archive.manifest_frame([archive.FileEntry(n, len(b)) for n, b in out.items()], body)
    for i, b in enumerate(out.values()):
        for off in range(0, len(b), MIB):
            piece = b[off : off + MIB]
            if piece.count(0) != len(piece):  # (holes stay holes)
                raw += archive.data_frame(i, off, piece)
    return raw + archive.end_frame(hashlib.sha256(raw).digest())


def _snap(f: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any], dict[str, bytes]], None]:
    return lambda body, files: f(body["snapshot"])


HOSTILE: dict[str, tuple[Callable[[dict[str, Any], dict[str, bytes]], None], type[DomainError], str]] = {
    "memory size lies": (
        _snap(lambda s: s["machine"].update(memory_mib=128)),
        InvalidArgument,
        "memory file does not match",
    ),
    "machine pc": (_snap(lambda s: s["machine"].update(machine="pc,accel=kvm")), InvalidArgument, "machine"),
    "command line": (_snap(lambda s: s["machine"].update(append="a\nb")), InvalidArgument, "command line"),
    "unknown kind": (_snap(lambda s: s.update(memory="swapped")), InvalidArgument, "memory kind"),
    "vmstate elsewhere": (_snap(lambda s: s.update(vmstate="memory")), InvalidArgument, "vmstate"),
    "config not a config": (_snap(lambda s: s.update(config={"limits": "lots"})), InvalidArgument, "describe"),
    "volumes": (
        _snap(lambda s: s.update(config=dump(SandboxConfig(volumes=(VolumeMount("v", "/v"),))))),
        InvalidArgument,
        "volumes",
    ),
    "secrets": (
        _snap(lambda s: s["config"].update(secrets=[{"name": "TOKEN", "hosts": ["api.example.com"]}])),
        InvalidArgument,
        "secrets",
    ),
    "host rootfs": (
        _snap(lambda s: s["config"]["boot"].update(rootfs="/etc/shadow")),
        FailedPrecondition,
        "not in a directory the supervisor allows",
    ),
    "bad label": (_snap(lambda s: s.update(labels={"sandvisor.x": "1"})), InvalidArgument, "reserved"),
    "base escapes": (
        lambda b, f: b["chain"][0].update(path="../../../etc/passwd"),
        InvalidArgument,
        "malformed path",
    ),
    "base not a rootfs": (
        lambda b, f: b["chain"][0].update(path="kernel-k/vmlinux"),
        InvalidArgument,
        "malformed path",
    ),
    "base missing": (
        lambda b, f: b["chain"][0].update(path="rootfs-other/rootfs.ext4"),
        FailedPrecondition,
        "lacks the base layer",
    ),
    "base size": (lambda b, f: b["chain"][0].update(size=1), FailedPrecondition, "lacks"),
    "kernel elsewhere": (
        lambda b, f: b["parts"]["kernel"].update(path="rootfs-f/rootfs.ext4"),
        InvalidArgument,
        "path",
    ),
    "layer unused": (lambda b, f: f.update({"layer-7": b"x"}), InvalidArgument, "does not use"),
    "no disk": (lambda b, f: f.pop("disk.qcow2"), InvalidArgument, "no disk.qcow2"),
    "disk not qcow2": (lambda b, f: f.update({"disk.qcow2": b"raw" * 100}), InvalidArgument, "not a qcow2"),
    "disk with a data file": (
        lambda b, f: f.update({"disk.qcow2": qcow2_head(data_file=b"/etc/shadow")}),
        InvalidArgument,
        "external data file",
    ),
    "disk too large": (
        lambda b, f: f.update({"disk.qcow2": qcow2_head(size=1 << 50)}),
        InvalidArgument,
        "max-sandbox-disk",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_exports_are_refused_and_leave_nothing(env: Env, case: str) -> None:
    change, cls, words = HOSTILE[case]
    data = rebuild(await export_bytes(env), change)
    with pytest.raises(cls, match=words):
        await import_bytes(env, data)
    assert leftovers(env) == set() and env.dst.snapshots == {} and env.dst.pending == set()


async def test_truncated_and_corrupt_exports_leave_nothing(env: Env) -> None:
    data = await export_bytes(env)
    bad = bytearray(data)
    bad[len(data) // 2] ^= 1
    for broken in (data[: len(data) // 2], bytes(bad), data[:-1]):
        with pytest.raises(InvalidArgument):
            await import_bytes(env, broken)
        assert leftovers(env) == set() and env.dst.snapshots == {}


async def test_snapshots_with_secrets_or_volumes_do_not_travel(env: Env) -> None:
    for cfg, words in (
        (SandboxConfig(secrets=(SecretRef("TOKEN", ("api.example.com",)),)), "secrets"),
        (SandboxConfig(volumes=(VolumeMount("v", "/v"),)), "volumes"),
    ):
        rec = attrs.evolve(env.rec, config=cfg)
        with pytest.raises(FailedPrecondition, match=words):
            await export_bytes(attrs.evolve(env, rec=rec))


async def test_a_disk_only_snapshot_travels_alone(env: Env) -> None:
    rec = attrs.evolve(env.rec, memory=MemoryKind.DISK, vmstate="vmstate")
    env = attrs.evolve(env, rec=rec)
    data = await export_bytes(env)
    m = archive.Reader().feed(data)[0]
    assert isinstance(m, archive.Manifest) and [f.name for f in m.files] == ["disk.qcow2"]
    got = await import_bytes(env, data)
    assert got.memory == MemoryKind.DISK and sorted(os.listdir(got.path)) == ["disk.qcow2"]
    env.dst.check_restorable(got, "kvm")  # a boot: any accelerator
