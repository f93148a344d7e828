"""Hostile disk images and disk exhaustion.

A Create's own rootfs (from an ``--allow-path`` directory) is a file the caller chose:
its qcow2 header is hostile input. A backing name or an external data file would make
root open any host file for the guest; a malformed header must be a typed DiskError,
never a UnicodeDecodeError or struct.error out of the parser. And one guest must not
fill the state filesystem: a sandbox's overlay and read-write volumes are bounded by
``--max-sandbox-disk`` (the guest meets ENOSPC in its own file systems).

Unit tests first (the parser under Hypothesis, the checks, the registry on fake VMs,
the fsyncs), then real VMs through a throwaway supervisor."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors import create_checks
from actors import volumes as volumes_mod
from actors.errors import FailedPrecondition, ResourceExhausted
from actors.machines.disk import (
    INCOMPAT_DATA_FILE,
    DiskError,
    Qcow2Header,
    check_user_disk,
    inspect_disk,
    overlay_bound,
    parse_qcow2_header,
)
from actors.model import BootSource, SandboxConfig, VolumeMount
from actors.quotas import check_sandbox_disk
from actors.registry import Registry
from actors.sandboxes import files as files_mod
from actors.store import Store
from actors.volumes import Volumes
from images.build import Image
from images.ocilocal import busybox_tree
from supervisor.client import connect
from supervisor.main.throwaway import supervisor, workdir
from supervisor.wire.protocol import ApiError
from tests.support.client import run, wait_state
from tests.support.fakevm import FakeLab, fake_settings

MIB = 1 << 20


def qcow2(
    size: int = 64 * MIB,
    *,
    version: int = 3,
    backing: bytes = b"",
    data_file: bytes | None = None,
    incompat: int = 0,
    cluster_bits: int = 16,
    header_len: int = 104,
    total: int = 4096,
) -> bytes:
    """A qcow2 header (no tables: enough for every parser of ours), ``total`` bytes long."""
    buf = bytearray(total)
    backing_off = 2048 if backing else 0
    struct.pack_into(">4sIQIIQ", buf, 0, b"QFI\xfb", version, backing_off, len(backing), cluster_bits, size)
    if version == 3:
        struct.pack_into(">QQQII", buf, 72, incompat, 0, 0, 4, header_len)
        off = header_len
        if data_file is not None:
            struct.pack_into(">II", buf, off, 0x44415441, len(data_file))
            buf[off + 8 : off + 8 + len(data_file)] = data_file
            off += 8 + ((len(data_file) + 7) & ~7)
        struct.pack_into(">II", buf, off, 0, 0)
    if backing:
        buf[backing_off : backing_off + len(backing)] = backing
    return bytes(buf)


# --- the parser: anything in, DiskError or a header out --------------------------------
def _parses_or_disk_error(buf: bytes) -> Qcow2Header | None:
    try:
        h = parse_qcow2_header(buf, "x")
    except DiskError:
        return None
    assert h.version in (2, 3) and 9 <= h.cluster_bits <= 21 and 0 <= h.size < 1 << 63
    if h.backing is not None:
        assert 0 < len(os.fsencode(h.backing)) <= 1023
    return h


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=4096))
def test_garbage_is_a_disk_error(buf: bytes) -> None:
    _parses_or_disk_error(buf)
    _parses_or_disk_error(b"QFI\xfb" + buf)


fields = st.fixed_dictionaries(
    {
        "version": st.sampled_from([2, 3, 0, 4, 0xFFFFFFFF]),
        "backing_off": st.one_of(st.integers(0, 5000), st.integers(0, (1 << 64) - 1)),
        "backing_len": st.one_of(st.integers(0, 1100), st.integers(0, (1 << 32) - 1)),
        "cluster_bits": st.one_of(st.integers(8, 22), st.integers(0, (1 << 32) - 1)),
        "size": st.integers(0, (1 << 64) - 1),
        "incompat": st.integers(0, (1 << 64) - 1),
        "header_len": st.one_of(st.integers(0, 600), st.integers(0, (1 << 32) - 1)),
        "tail": st.binary(max_size=3000),
        "exts": st.lists(
            st.tuples(st.sampled_from([0x44415441, 0xE2792ACA, 0x6803F857, 1]), st.binary(max_size=64)), max_size=4
        ),
        "cut": st.integers(0, 4096),
    }
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields)
def test_structured_headers_parse_or_are_a_disk_error(f: dict[str, Any]) -> None:
    head = struct.pack(
        ">4sIQIIQ", b"QFI\xfb", f["version"], f["backing_off"], f["backing_len"], f["cluster_bits"], f["size"]
    )
    head += bytes(40) + struct.pack(">QQQII", f["incompat"], 0, 0, 4, f["header_len"])
    for kind, data in f["exts"]:
        head += struct.pack(">II", kind, len(data)) + data + bytes(-len(data) % 8)
    buf = (head + f["tail"])[: f["cut"]]
    _parses_or_disk_error(buf)
    # and the same bytes as a file, read with bounded reads
    with tempfile.NamedTemporaryFile() as tmp:
        tmp.write(buf)
        tmp.flush()
        try:
            info = inspect_disk(Path(tmp.name))
        except DiskError:
            return
        assert info.format in ("raw", "qcow2")


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 4096), st.integers(0, 4095), st.integers(0, 255))
def test_truncated_and_mutated_real_headers(cut: int, at: int, byte: int) -> None:
    for good in (qcow2(backing=b"/etc/shadow"), qcow2(data_file=b"/etc/shadow", incompat=INCOMPAT_DATA_FILE)):
        _parses_or_disk_error(good[:cut])
        mutated = bytearray(good)
        mutated[at] = byte
        _parses_or_disk_error(bytes(mutated))


def test_the_parser_reads_what_qemu_reads() -> None:
    h = parse_qcow2_header(qcow2(backing=b"../../etc/shadow"))
    assert h.backing == "../../etc/shadow" and not h.external_data
    h = parse_qcow2_header(qcow2(data_file=b"/etc/shadow", incompat=INCOMPAT_DATA_FILE))
    assert h.data_file == "/etc/shadow" and h.external_data
    assert parse_qcow2_header(qcow2(incompat=INCOMPAT_DATA_FILE)).external_data  # the bit alone
    assert parse_qcow2_header(qcow2(data_file=b"/x")).external_data  # the extension alone
    # extensions start at header_length exactly, aligned or not (a misaligned one is not missed)
    assert parse_qcow2_header(qcow2(data_file=b"/x", header_len=108)).data_file == "/x"
    assert parse_qcow2_header(qcow2(backing=b"\xff\xfe")).backing is not None  # not UTF-8: no UnicodeDecodeError
    h = parse_qcow2_header(qcow2(version=2, size=5 * MIB))
    assert (h.version, h.size, h.backing, h.external_data) == (2, 5 * MIB, None, False)
    for bad in (qcow2(backing=b"x" * 1024), qcow2(cluster_bits=30), qcow2(version=4), qcow2(header_len=50), b"QFI"):
        with pytest.raises(DiskError):
            parse_qcow2_header(bad)


# --- a caller's rootfs must stand alone --------------------------------------------------
def test_a_callers_disk_with_a_backing_or_data_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "outside" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(b"s3cret" * 1000)
    cases = {
        "backed.qcow2": qcow2(backing=str(secret).encode()),
        "relative.qcow2": qcow2(backing=b"../outside/secret"),
        "datafile.qcow2": qcow2(data_file=str(secret).encode(), incompat=INCOMPAT_DATA_FILE),
        "bit-only.qcow2": qcow2(incompat=INCOMPAT_DATA_FILE),
    }
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name, body in cases.items():
        (allowed / name).write_bytes(body)
        with pytest.raises(DiskError, match=rf"{name}.*(backed by|external data file).*stand alone"):
            check_user_disk(allowed / name)
    (allowed / "plain.qcow2").write_bytes(qcow2(size=64 * MIB))
    assert check_user_disk(allowed / "plain.qcow2").size == 64 * MIB
    with open(allowed / "raw.ext4", "wb") as f:
        f.truncate(32 * MIB)
    assert check_user_disk(allowed / "raw.ext4").format == "raw"
    with pytest.raises(DiskError, match="at most 16 MiB"):
        check_user_disk(allowed / "raw.ext4", 16 * MIB)
    (allowed / "link").symlink_to(allowed / "raw.ext4")
    with pytest.raises(DiskError, match="symlink"):
        check_user_disk(allowed / "link")
    os.mkfifo(allowed / "fifo")
    with pytest.raises(DiskError, match="not a regular file"):
        check_user_disk(allowed / "fifo")  # O_NONBLOCK: a FIFO does not hang us


@pytest.mark.host
def test_qemu_imgs_own_backed_and_data_file_images_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    with open(secret, "wb") as f:
        f.truncate(MIB)
    for name, opts in (
        ("backed.qcow2", ["-b", str(secret), "-F", "raw"]),
        ("df.qcow2", ["-o", f"data_file={secret},data_file_raw=on"]),
    ):
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", *opts, str(tmp_path / name), "1M"], check=True)
        with pytest.raises(DiskError, match="stand alone"):
            check_user_disk(tmp_path / name)


@pytest.mark.host
async def test_an_overlay_grows_to_its_bound_and_no_further(tmp_path: Path) -> None:
    """The measured bound behind --max-sandbox-disk: an overlay written in full, twice."""
    from actors.machines.disk import create_overlay

    base = tmp_path / "base.raw"
    with open(base, "wb") as f:
        f.truncate(64 * MIB)
    ov = tmp_path / "ov.qcow2"
    await create_overlay(base, ov)
    for pattern in ("0xab", "0xcd"):
        p = await trio.run_process(
            ["qemu-io", "-c", f"write -P {pattern} 0 64M", str(ov)], capture_stdout=True, check=True
        )
        assert b"wrote" in p.stdout
        used = ov.stat().st_blocks * 512
        assert 64 * MIB < used <= overlay_bound(64 * MIB), used  # 64 MiB + 320 KiB measured


# --- the cap -----------------------------------------------------------------------------
def test_the_sandbox_disk_cap_sums_the_disk_and_read_write_volumes() -> None:
    check_sandbox_disk(64, 32 * MIB, [("a", 16 * MIB), ("b", 16 * MIB)])
    check_sandbox_disk(0, 1 << 50, [("a", 1 << 40)])  # 0: no cap
    with pytest.raises(ResourceExhausted, match=r"at most 64 MiB \(--max-sandbox-disk\).*65 MiB.*volume b 17 MiB"):
        check_sandbox_disk(64, 32 * MIB, [("a", 16 * MIB), ("b", 17 * MIB)])


async def test_a_volume_over_the_cap_is_refused_and_one_made_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    monkeypatch.setattr(volumes_mod, "fsync_dir", synced.append)
    store = Store(tmp_path / "sandvisor.db")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            vols = Volumes(tmp_path / "volumes", store, max_size=32 * MIB)
            vols.load()
            with pytest.raises(ResourceExhausted, match=r"over the 32 MiB.*--max-sandbox-disk"):
                await vols.create("big", 33 * MIB)
            assert list(vols.root.iterdir()) == []  # nothing made
            rec = await vols.create("ok", 32 * MIB)
            assert synced == [vols.root] and vols.path(rec).exists()
            nursery.cancel_scope.cancel()
    store.close()


async def test_a_new_overlay_and_its_directory_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Path] = []
    monkeypatch.setattr(files_mod, "fsync_dir", synced.append)
    lab = FakeLab()
    s = fake_settings(tmp_path, lab)
    sf = files_mod.SandboxFiles("u" * 36, s)
    with trio.fail_after(30):
        await sf.overlay_on(s.image.rootfs)
    assert sf.disk.exists() and synced == [sf.dir, sf.dir.parent]


# --- the registry (fake VMs): refused at Create, nothing launched -----------------------------
@asynccontextmanager
async def fake_registry(root: Path, lab: FakeLab, **settings_kw: Any) -> AsyncIterator[Registry]:
    store = Store(root / "state" / "sandvisor.db")
    try:
        async with trio.open_nursery() as n:
            await n.start(lab.run)
            reg = await n.start(Registry(fake_settings(root, lab, allowed_paths=(root,), **settings_kw), store).run)
            try:
                yield reg
            finally:
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


async def test_create_refuses_layered_rootfs_and_disks_over_the_cap(tmp_path: Path) -> None:
    lab = FakeLab()
    secret = tmp_path / "outside" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(b"s3cret")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "evil.qcow2").write_bytes(qcow2(backing=str(secret).encode()))
    with open(allowed / "small.ext4", "wb") as f:
        f.truncate(16 * MIB)
    with trio.fail_after(60):
        async with fake_registry(tmp_path, lab, max_sandbox_disk_mib=40) as reg:
            with pytest.raises(FailedPrecondition, match=r"evil\.qcow2 is a qcow2 image backed by"):
                await reg.create("evil", SandboxConfig(boot=BootSource(rootfs=str(allowed / "evil.qcow2"))))
            await reg.volumes.create("data", 16 * MIB)
            await reg.volumes.create("more", 16 * MIB)
            own = BootSource(rootfs=str(allowed / "small.ext4"))
            two = (VolumeMount("data", "/data"), VolumeMount("more", "/more"))
            with pytest.raises(ResourceExhausted, match="48 MiB: disk 16 MiB, volume data 16 MiB, volume more 16"):
                await reg.create("big", SandboxConfig(boot=own, volumes=two))
            with pytest.raises(ResourceExhausted, match="--max-sandbox-disk"):
                await reg.volumes.create("huge", 41 * MIB)
            assert lab.guests == [] and reg.sandboxes == {}  # no QEMU got anything
            ro = (VolumeMount("data", "/data"), VolumeMount("more", "/more", read_only=True))
            # a read-only volume does not grow
            create_checks.check_disks(reg.settings, reg.volumes, SandboxConfig(boot=own, volumes=ro), None)
            ok = await reg.create("ok", SandboxConfig(boot=own))
            with trio.fail_after(60):
                await ok.ready_event.wait()
            assert list(ok.record.chain) == [str(allowed / "small.ext4")]  # its own layer, nothing below
            await reg.remove("ok", force=True)


async def test_a_rootfs_turned_layered_after_the_create_fails_its_life(tmp_path: Path) -> None:
    """The life checks again: the file is the caller's, and it may change after the Create."""
    lab = FakeLab()
    rootfs = tmp_path / "own.qcow2"
    rootfs.write_bytes(qcow2(size=16 * MIB))
    with trio.fail_after(60):
        async with fake_registry(tmp_path, lab) as reg:
            sb = await reg.create("turned", SandboxConfig(boot=BootSource(rootfs=str(rootfs))))
            await sb.ready_event.wait()
            reg.stop("turned", 5)
            await sb.wait_stopped()
            rootfs.write_bytes(qcow2(size=16 * MIB, data_file=b"/etc/shadow", incompat=INCOMPAT_DATA_FILE))
            guests = len(lab.guests)
            await reg.start("turned")
            await sb.wait_stopped()
            assert "external data file '/etc/shadow'" in sb.record.error
            assert len(lab.guests) == guests  # no QEMU for that life


# --- real VMs ----------------------------------------------------------------------------
@pytest.mark.vm
async def test_a_backed_qcow2_under_an_allowed_dir_reaches_no_qemu(image: Image, tmp_path: Path) -> None:
    """The finding itself, through `serve --allow-path`: a qcow2 whose header names a host
    file (a secret outside the allowed directory) is FAILED_PRECONDITION at the Create,
    and no QEMU is started; flattened, the same disk boots."""
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.raw"
    with open(secret, "wb") as f:
        f.truncate(8 * MIB)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name, opts in (
        ("backed.qcow2", ["-b", str(secret), "-F", "raw"]),
        ("datafile.qcow2", ["-o", f"data_file={secret},data_file_raw=on"]),
    ):
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", *opts, str(allowed / name), "8M"], check=True)
    with workdir("sv-disk-") as work, trio.fail_after(120):
        async with supervisor(work, templates=False, allow_paths=(allowed,)) as (_, reg), connect(work.socket) as c:
            for name in ("backed.qcow2", "datafile.qcow2"):
                with pytest.raises(ApiError) as e:
                    await c.call("Create", {"id": "evil", "rootfs": str(allowed / name)})
                assert e.value.code == "FAILED_PRECONDITION", e.value
                assert name in e.value.message and str(secret) in e.value.message
            assert reg.sandboxes == {} and not any(work.run_root.iterdir())  # no life, no QEMU


BUSYBOX_APPLETS = ("dd", "df", "sync", "mkdir", "rm")


def small_rootfs(dest: Path, size: int) -> Path:
    tree = busybox_tree(dest.parent / "tree")
    for applet in BUSYBOX_APPLETS:
        (tree / "bin" / applet).symlink_to("busybox")
    for d in ("proc", "sys", "dev", "tmp", "run", "root", "data"):
        (tree / d).mkdir()
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-b", "4096", "-m", "0", "-d", str(tree), str(dest), f"{size >> 10}k"],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(tree)
    return dest


FILL = "dd if=/dev/zero of={path} bs=1M 2>&1; sync; echo rc=$?"


@pytest.mark.vm
async def test_a_guest_filling_its_disks_meets_enospc_and_the_host_stays_bounded(image: Image, tmp_path: Path) -> None:
    """A guest writes until its root file system and its volume are full: ENOSPC inside,
    the host's overlay under overlay_bound(its virtual size), the volume under its size;
    and with --max-sandbox-disk a bigger volume or disk is refused before anything runs."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    rootfs = small_rootfs(allowed / "small.ext4", 48 * MIB)
    with workdir("sv-disk-") as work, trio.fail_after(400):
        async with (
            supervisor(work, templates=False, allow_paths=(allowed,), max_sandbox_disk_mib=64) as (_, reg),
            connect(work.socket) as c,
        ):
            with pytest.raises(ApiError) as e:
                await c.call("CreateVolume", {"name": "huge", "size_mib": 65})
            assert e.value.code == "RESOURCE_EXHAUSTED" and "--max-sandbox-disk" in e.value.message
            await c.call("CreateVolume", {"name": "small", "size_mib": 16})
            await c.call("CreateVolume", {"name": "other", "size_mib": 16})
            two = [{"volume": "small", "target": "/data"}, {"volume": "other", "target": "/other"}]
            with pytest.raises(ApiError) as e:
                await c.call("Create", {"id": "over", "rootfs": str(rootfs), "volumes": two})
            assert e.value.code == "RESOURCE_EXHAUSTED" and "--max-sandbox-disk" in e.value.message
            await c.call("Create", {"id": "filler", "rootfs": str(rootfs), "volumes": two[:1]})
            await wait_state(c, "filler", "ready", timeout=240)
            for path in ("/big", "/data/big"):
                out, code = await run(c, "filler", ["sh", "-c", FILL.format(path=path)])
                assert b"No space left on device" in out, out
            out, code = await run(c, "filler", ["sh", "-c", "echo still here; df -k / /data"])
            assert code == 0 and out.startswith(b"still here"), out
            sb = reg.get("filler")
            overlay = sb.files.disk.stat().st_blocks * 512
            vol = reg.volumes.path(reg.volumes.get("small")).stat().st_blocks * 512
            print(f"overlay {overlay} bytes (bound {overlay_bound(48 * MIB)}), volume {vol} bytes of {16 * MIB}")
            assert (
                30 * MIB < overlay <= overlay_bound(48 * MIB)
            )  # (the guest filled it; ext4 metadata is not rewritten)
            assert vol <= 16 * MIB
            await c.call("Remove", {"id": "filler", "force": True})
