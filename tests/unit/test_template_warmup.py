"""Boot templates of a served rootfs with a warm-up command (the code-interpreter
image's kernel server): keyed by the rootfs and the command; any other own rootfs, or
the same one with its own kernel or boot arguments, has no template."""

from __future__ import annotations

from pathlib import Path

from actors.model import BootSource, Limits, SandboxConfig
from actors.settings import Settings
from actors.snapshots.pools import Pools
from actors.snapshots.snapshot import SnapshotStore
from actors.store import Store
from images.build import Image

ROOTFS = "/cache/rootfs-c/rootfs.ext4"
LIMITS = Limits(memory_mib=1024, vcpus=1)


def _pools(tmp_path: Path, warmups: dict[str, tuple[str, ...]]) -> Pools:
    img = Image(
        name="default",
        kernel=tmp_path / "vmlinux",
        kernel_bz=tmp_path / "vmlinux",
        initrd=tmp_path / "initrd",
        rootfs=tmp_path / "rootfs.ext4",
        kernel_version="6",
        keys={"kernel": "k", "runtime": "r", "rootfs": "f"},
    )
    settings = Settings(image=img, sandboxes_dir=tmp_path / "sb", run_root=tmp_path / "run", template_warmups=warmups)
    return Pools(settings, SnapshotStore(tmp_path / "snapshots", Store(tmp_path / "db.sqlite"), set))


def _config(rootfs: str = "", kernel: str = "", boot_args: str = "", rootfs_fstype: str = "") -> SandboxConfig:
    boot = BootSource(kernel=kernel, rootfs=rootfs, boot_args=boot_args, rootfs_fstype=rootfs_fstype)
    return SandboxConfig(boot=boot, limits=LIMITS)


def test_a_served_rootfs_with_a_warmup_has_a_template_key(tmp_path: Path) -> None:
    pools = _pools(tmp_path, {ROOTFS: ("python3", "-c", "src", "start")})
    key = pools.template_key(_config(rootfs=ROOTFS), LIMITS, None)
    default = pools.template_key(_config(), LIMITS, None)
    assert key is not None and default is not None and key != default
    assert pools.warmup(_config(rootfs=ROOTFS)) == ("python3", "-c", "src", "start")
    assert pools.warmup(_config()) is None
    # another command (a new kernel server): another template
    other = _pools(tmp_path / "o", {ROOTFS: ("python3", "-c", "src2", "start")})
    assert other.template_key(_config(rootfs=ROOTFS), LIMITS, None) not in (None, key)


def test_other_own_files_boot(tmp_path: Path) -> None:
    pools = _pools(tmp_path, {ROOTFS: ("true",)})
    assert pools.template_key(_config(rootfs="/elsewhere/rootfs.ext4"), LIMITS, None) is None
    assert pools.template_key(_config(rootfs=ROOTFS, kernel="/k/vmlinux"), LIMITS, None) is None
    assert pools.template_key(_config(rootfs=ROOTFS, boot_args="quiet"), LIMITS, None) is None
    assert pools.warmup(_config(rootfs=ROOTFS, rootfs_fstype="xfs")) is None
