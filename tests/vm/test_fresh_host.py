"""The product as a fresh host starts it: ``sandvisor serve`` on an empty state dir,
with no image in its cache, builds its default image itself -- under serve's umask
(077) -- boots a sandbox on it, and a SIGTERM leaves no cgroup, run dir or socket.

What the build costs from nothing (measured here: 6 min 47 s, over the network: apt
downloads, mmdebstrap) is too much for CI and would reach past loopback. So the new
cache is given what a build downloads or debootstraps, never what it writes for QEMU:
the packages the kernel and runtime parts are made of (the shared cache keeps them in
``debs/``) and the rootfs part (mmdebstrap's output; the build makes it 0444 itself).
serve then runs the build's own steps that write every file a jailed QEMU opens --
vmlinux (extracted from the kernel package), the initramfs (assembled, packed), the
part directories and the manifest -- under its own umask, as on a new host."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from actors.cells.cgroups import detect
from images.build import DEBS, Builder, Image, deb_glob, default_cache, load_default
from supervisor.client import AsyncSandbox
from supervisor.main.throwaway import Workdir, supervisor_process, workdir

BUILD_TIMEOUT = 900.0  # s: serve builds the kernel and runtime parts before it serves


def place(src: Path, dest: Path) -> None:
    """``src`` at ``dest``: a hard link, or a (sparse) copy on another file system."""
    try:
        os.link(src, dest)
    except OSError:
        subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(src), str(dest)], check=True)


@pytest.fixture
def fresh(image: Image) -> Iterator[tuple[Workdir, Path]]:
    """A workdir whose state dir's image cache is a new, empty directory but for what
    the build would download (see the module's docstring), made under umask 077."""
    shared = default_cache()
    builder = Builder(shared)
    builder.build()  # (cached: finds the parts, and says which packages they are made of)
    wanted = builder.wanted_debs
    missing = [f"{p}={v}" for p, v in wanted if not any((shared / DEBS).glob(deb_glob(p, v)))]
    if missing:
        pytest.skip(f"the image cache {shared} keeps no downloaded {', '.join(missing)} (built before it kept them)")
    old = os.umask(0o077)
    try:
        cache = Path(tempfile.mkdtemp(prefix="sv-fresh-cache-", dir="/tmp"))
        with workdir("sv-fresh-", private_state=True, cache=cache) as work:
            try:
                (cache / DEBS).mkdir()
                for p, v in wanted:
                    for deb in (shared / DEBS).glob(deb_glob(p, v)):
                        place(deb, cache / DEBS / deb.name)
                rootfs = cache / image.rootfs.parent.name
                rootfs.mkdir()
                place(image.rootfs, rootfs / image.rootfs.name)
                assert load_default(cache) is None  # no image there: serve must build it
                yield work, cache
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        os.umask(old)


def cgroup_dirs(work: Workdir) -> list[str]:
    """This state dir's cgroup parent, in every hierarchy it is in."""
    found = detect(parent=f"sandvisor-{work.key}")
    return [str(d) for d in found.parent_dirs() if d.exists()] if found is not None else []


def test_serve_on_an_empty_state_dir_builds_its_image_boots_and_leaves_nothing(fresh: tuple[Workdir, Path]) -> None:
    work, cache = fresh
    t0 = time.monotonic()
    with supervisor_process(work, "--state-dir", str(work.state), start_timeout=BUILD_TIMEOUT) as (_env, proc):
        built = time.monotonic() - t0
        img = load_default(cache)
        assert img is not None, "serve served without an image in its cache"
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (img.kernel, img.kernel_bz, img.initrd, img.rootfs)}
        assert modes == {"vmlinux": 0o644, "vmlinuz": 0o644, "initrd.cpio": 0o644, "rootfs.ext4": 0o444}
        dirs = {p.parent.name: stat.S_IMODE(p.parent.stat().st_mode) for p in (img.kernel, img.initrd, img.rootfs)}
        assert set(dirs.values()) == {0o755}, dirs

        async def use() -> bytes:
            with trio.fail_after(300):
                sb = await AsyncSandbox.create("fresh", socket=str(work.socket))
                r = await sb.run(["sh", "-c", "echo booted on $(uname -r)"])
                assert r.exit_code == 0, r
                return r.stdout

        out = trio.run(use)
        assert out == f"booted on {img.kernel_version}\n".encode()
        assert cgroup_dirs(work)  # (its QEMU's cgroup is under it while it runs)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    assert cgroup_dirs(work) == []
    assert not work.run_root.exists()
    assert not work.socket.exists()
    assert not work.processes()
    print(f"serve built its image (kernel and runtime parts) and served in {built:.0f} s")
