"""A build that supersedes the default image's parts removes the old kernel and
runtime only when nobody holds them, and never an old rootfs (the disks of stopped
sandboxes and snapshots stand on it). No apt, no VM: the garbage collection alone."""

from __future__ import annotations

from pathlib import Path

from images.build import Builder, Image, hold_parts


def _part(cache: Path, kind: str, key: str, name: str) -> Path:
    d = cache / f"{kind}-{key}"
    d.mkdir(parents=True)
    (d / name).write_bytes(b"x")
    return d / name


def _image(cache: Path, key: str) -> Image:
    kernel = _part(cache, "kernel", key, "vmlinux")
    initrd = _part(cache, "runtime", key, "initrd.cpio")
    rootfs = _part(cache, "rootfs", key, "rootfs.ext4")
    return Image("default", kernel, kernel, initrd, rootfs, "6.1", {})


def test_superseded_parts_go_unless_held_and_a_rootfs_stays(tmp_path: Path) -> None:
    cache = tmp_path / "images"
    old, held, new = (_image(cache, k * 16) for k in "abc")
    current = {p.parent.name for p in (new.kernel, new.initrd, new.rootfs)}
    said: list[str] = []
    with hold_parts(held):  # a running supervisor boots from these
        Builder(cache, progress=lambda part, msg: said.append(msg))._gc(keep=current)
        assert held.kernel.exists() and held.initrd.exists()
        assert any("kept superseded runtime-" in m for m in said)
    assert not old.kernel.exists() and not old.initrd.exists()
    assert old.rootfs.exists() and held.rootfs.exists() and new.rootfs.exists()
    assert new.kernel.exists() and new.initrd.exists()
    Builder(cache)._gc(keep=current)  # released: now they go too
    assert not held.kernel.exists() and not held.initrd.exists()
