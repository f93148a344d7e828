"""A caller's own disk image: its format from the magic, the fstype hint's rules, the
CLI's PATH[:FSTYPE] and the SDK's image_disk, the wire field."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from actors import from_snapshot, image_disks
from actors.errors import FailedPrecondition, InvalidArgument, NotFound
from actors.model import MemoryKind, SandboxConfig
from actors.store import MachineRecord, SnapshotRecord
from images.oci import rootdir
from images.oci.errors import DiskFull
from supervisor.client.sdk.spec import SandboxSpec
from supervisor.serve import mapping
from supervisor.wire import protocol


@pytest.mark.parametrize(
    ("head", "tail", "fmt"),
    [
        (b"QFI\xfb" + b"\0" * 100, b"", "qcow2"),
        (b"KDMV" + b"\0" * 100, b"", "vmdk"),
        (b"\0" * 0x40 + struct.pack("<I", 0xBEDA107F), b"", "vdi"),
        (b"vhdxfile" + b"\0" * 100, b"", "vhdx"),
        (b"conectix" + b"\0" * 100, b"", "vpc"),
        (b"\0" * 512, b"conectix" + b"\0" * 504, "vpc"),  # a fixed VHD: its footer
        (b"\x53\xef" * 256, b"", "raw"),
    ],
)
def test_format_of(head: bytes, tail: bytes, fmt: str) -> None:
    assert image_disks.format_of(head, tail) == fmt


def test_a_vmdk_descriptor_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "d.vmdk"
    p.write_text('# Disk DescriptorFile\nRW 8 FLAT "/etc/shadow" 0\n')
    with pytest.raises(FailedPrecondition, match="descriptor"):
        image_disks.detect_format(p)


def test_detect_opens_no_symlink_nor_directory(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"KDMV" + b"\0" * 600)
    (tmp_path / "link").symlink_to("real")
    assert image_disks.detect_format(tmp_path / "real") == "vmdk"
    with pytest.raises(FailedPrecondition, match="symlink"):
        image_disks.detect_format(tmp_path / "link")
    with pytest.raises(FailedPrecondition, match="regular file"):
        image_disks.detect_format(tmp_path)
    with pytest.raises(NotFound):
        image_disks.detect_format(tmp_path / "missing")


def test_fstype_rules() -> None:
    image_disks.check_fstype("", rootfs="", kernel="")
    image_disks.check_fstype("ext2", rootfs="/d/x.img", kernel="")
    image_disks.check_fstype("xfs", rootfs="/d/x.img", kernel="/d/vmlinux")  # a kernel of the caller's
    with pytest.raises(InvalidArgument, match="default guest kernel mounts"):
        image_disks.check_fstype("xfs", rootfs="/d/x.img", kernel="")
    with pytest.raises(InvalidArgument, match="one of"):
        image_disks.check_fstype("ntfs", rootfs="/d/x.img", kernel="/d/vmlinux")
    with pytest.raises(InvalidArgument, match="needs a disk image"):
        image_disks.check_fstype("ext4", rootfs="", kernel="")


def test_image_disk_spellings(tmp_path: Path) -> None:
    assert image_disks.split_image_disk("/a/b.vmdk:xfs") == ("/a/b.vmdk", "xfs")
    assert image_disks.split_image_disk("/a/b:c.img") == ("/a/b:c.img", "")
    req = SandboxSpec().with_(image_disk="/a/b.vmdk:ext2").request("x")
    assert (req.rootfs, req.rootfs_fstype) == ("/a/b.vmdk", "ext2")
    req = SandboxSpec().with_(image_disk=("rel.qcow2", "ext3")).request("x")
    assert req.rootfs == str(Path("rel.qcow2").absolute()) and req.rootfs_fstype == "ext3"
    cfg = mapping.config(req)
    assert cfg.boot.rootfs_fstype == "ext3" and cfg.boot.rootfs == req.rootfs


def test_the_wire_carries_the_fstype() -> None:
    from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as pb

    fields = pb.CreateRequest.DESCRIPTOR.fields_by_name
    assert fields["rootfs_fstype"].number == 200
    assert fields["from_snapshot"].number == 201


def _snap(memory: MemoryKind) -> SnapshotRecord:
    return SnapshotRecord(
        uid="u",
        id="snap-1",
        name="",
        labels={},
        sandbox_id="s",
        origin_uid="o",
        created_ns=0,
        dir="/nowhere",
        memory=memory,
        machine=MachineRecord(append="", memory_mib=256, cpus=1, accel="tcg"),
        config=_cfg(network="user"),
    )


def _cfg(**kw: object) -> SandboxConfig:
    return mapping.config(SandboxSpec().with_(**kw).request("x"))  # type: ignore[arg-type]


def test_from_snapshot_applies_what_a_restore_can() -> None:
    blank = mapping.config(protocol.CreateSandboxRequest())
    mem = _snap(MemoryKind.MAPPED)
    ok = _cfg(labels={"a": "b"}, ttl=60, idle_timeout=30, env={"K": "v"}, workdir="/w", ports={80: 0}, network="user")
    assert from_snapshot.check(mem, ok, blank) is None
    assert from_snapshot.check(mem, _cfg(memory_mib=256, cpus=1), blank) is None
    with pytest.raises(InvalidArgument, match="256 MiB machine"):
        from_snapshot.check(mem, _cfg(memory_mib=128), blank)
    with pytest.raises(InvalidArgument, match="1-vCPU"):
        from_snapshot.check(mem, _cfg(cpus=2), blank)
    with pytest.raises(InvalidArgument, match="networking"):
        from_snapshot.check(mem, _cfg(network="tap"), blank)
    with pytest.raises(InvalidArgument, match=r"workload\.cmd, boot\.image, hostname"):
        from_snapshot.check(mem, _cfg(image="alpine", cmd=["x"], hostname="h"), blank)
    # a disk-only snapshot boots: any resources
    disk = _snap(MemoryKind.DISK)
    assert from_snapshot.check(disk, _cfg(memory_mib=512, cpus=2), blank) == _cfg(memory_mib=512, cpus=2).limits
    assert from_snapshot.is_path("/d/x.svsnap") and not from_snapshot.is_path("warm")


def test_a_rootfs_directory_is_walked_without_following(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "f").write_bytes(b"x" * 10)
    (tree / "out").symlink_to("/etc")  # followed, it would carry the host's /etc
    (tree / "dirlink").symlink_to("d")
    os.mkfifo(tree / "fifo")
    first = rootdir.walk(str(tree), None, shift=0, budget=1 << 20, chown=False)
    assert first == rootdir.walk(str(tree), None, shift=0, budget=1 << 20, chown=False)
    copy = tmp_path / "copy"
    digest, size, _ = rootdir.walk(str(tree), copy, shift=0, budget=1 << 20, chown=False)
    assert digest == first[0] and size == 10
    assert os.readlink(copy / "out") == "/etc" and os.readlink(copy / "dirlink") == "d"
    assert (copy / "d" / "f").read_bytes() == b"x" * 10 and not (copy / "fifo").exists()
    (tree / "d" / "f").write_bytes(b"y" * 10)
    assert rootdir.walk(str(tree), None, shift=0, budget=1 << 20, chown=False)[0] != digest
    with pytest.raises(DiskFull):
        rootdir.walk(str(tree), None, shift=0, budget=5, chown=False)
    (tree / "link-root").symlink_to(tree)
    with pytest.raises(OSError):  # the directory itself through a symlink: refused
        rootdir.walk(str(tree / "link-root"), None, shift=0, budget=1 << 20, chown=False)


def test_image_spellings_of_a_directory() -> None:
    assert SandboxSpec().with_(image="./rootfs").boot.image == "dir:" + str(Path("rootfs").absolute())
    assert SandboxSpec().with_(image="dir:/srv/r").boot.image == "dir:/srv/r"
    assert SandboxSpec().with_(image="/srv/r").boot.image == "dir:/srv/r"
    assert SandboxSpec().with_(image="alpine:3").boot.image == "alpine:3"
    assert rootdir.is_dir_ref("dir:/srv/r") and rootdir.is_dir_ref("/srv/r") and not rootdir.is_dir_ref("oci:/x")


def test_a_rootfs_directory_takes_only_what_others_may_read(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "shadow").write_text("root:secret\n")
    os.chmod(tree, 0o755)
    os.chmod(tree / "etc", 0o755)
    os.chmod(tree / "etc" / "shadow", 0o640)
    with pytest.raises(rootdir.NotReadable, match="/etc/shadow"):
        rootdir.walk(str(tree), None, shift=0, budget=1 << 20, chown=False)
    os.chmod(tree / "etc" / "shadow", 0o644)
    os.chmod(tree / "etc", 0o750)
    with pytest.raises(rootdir.NotReadable, match="/etc "):
        rootdir.walk(str(tree), None, shift=0, budget=1 << 20, chown=False)


def test_the_grpc_request_reaches_the_domain() -> None:
    from supervisor.serve.grpc_convert import message_to_dict
    from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as pb
    from supervisor.wire.protocol import structure_body

    msg = pb.CreateRequest(rootfs_fstype="ext2", from_snapshot="warm")
    msg.base.rootfs = "/d/x.vmdk"
    req = structure_body(message_to_dict(msg), protocol.CreateSandboxRequest)
    assert (req.rootfs, req.rootfs_fstype, req.from_snapshot) == ("/d/x.vmdk", "ext2", "warm")
