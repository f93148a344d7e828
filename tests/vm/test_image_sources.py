"""A caller's own disk image as a sandbox's root, against real VMs: an ext2 file
system (so the fstype hint is what the guest mounts) in a qcow2 (async SDK, the
(path, fstype) form) and in a vmdk (the CLI's ``--image-disk PATH:FSTYPE``, converted
in a tool cell and kept by content: a second Create finds it), and the refusals (a
qcow2 with a backing file, a path outside --allow-path, a type the kernel cannot
mount, a vmdk descriptor). One supervisor; sandboxes boot one after another."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from images.build import Image
from images.ocilocal import busybox_tree
from supervisor.client import AsyncSandbox, FailedPrecondition, InvalidArgument, NotFound
from supervisor.main.throwaway import Workdir, supervisor, workdir


async def cli(work: Workdir, *args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=work.env(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


def _disks(d: Path) -> dict[str, Path]:
    old = os.umask(0o022)
    try:
        tree = busybox_tree(d / "tree")
        (tree / "bin" / "grep").symlink_to("busybox")
        raw = d / "bb.raw"
        subprocess.run(["mkfs.ext2", "-q", "-F", "-d", str(tree), str(raw), "24M"], check=True)
        out = {"raw": raw}
        for fmt in ("qcow2", "vmdk"):
            out[fmt] = d / f"bb.{fmt}"
            subprocess.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", fmt, str(raw), str(out[fmt])], check=True)
        out["backed"] = d / "backed.qcow2"
        subprocess.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(raw), str(out["backed"])], check=True
        )
        out["descriptor"] = d / "desc.vmdk"
        out["descriptor"].write_text('# Disk DescriptorFile\nversion=1\nRW 49152 FLAT "/etc/shadow" 0\n')
    finally:
        os.umask(old)
    return out


async def _root_fstype(sb: AsyncSandbox) -> str:
    r = await sb.run("grep ' / ' /proc/mounts")
    assert r.ok, r
    return r.stdout.decode().split()[2]


async def test_image_disks(image: Image, tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    allowed = tmp_path / "allowed"
    allowed.mkdir(mode=0o755)
    disks = _disks(allowed)
    outside = tmp_path / "outside.qcow2"
    outside.write_bytes(disks["qcow2"].read_bytes())
    with workdir("sv-disks-") as work:
        with trio.fail_after(600):
            async with supervisor(work, templates=False, allow_paths=(allowed,)):
                sock = str(work.socket)
                sb = await AsyncSandbox.create(
                    "qcow2", socket=sock, image_disk=(str(disks["qcow2"]), "ext2"), detached=True
                )
                assert await _root_fstype(sb) == "ext2"
                assert (await sb.run("echo hi")).stdout == b"hi\n"
                await sb.remove(force=True)

                r = await cli(work, "create", "vmdk", "--image-disk", f"{disks['vmdk']}:ext2")
                assert r.returncode == 0, r.stderr
                sb = await AsyncSandbox.get("vmdk", socket=sock)
                assert await _root_fstype(sb) == "ext2"
                kept = list((work.state / "image-disks").glob("*.vmdk.qcow2"))
                assert len(kept) == 1 and kept[0].stat().st_mode & 0o777 == 0o444
                await sb.remove(force=True)
                # the same bytes again: the kept conversion (no second one)
                sb = await AsyncSandbox.create("vmdk2", socket=sock, image_disk=str(disks["vmdk"]), detached=True)
                assert await _root_fstype(sb) == "ext4"  # no hint: mounted as ext4 (the driver reads ext2)
                assert list((work.state / "image-disks").glob("*.vmdk.qcow2")) == kept
                await sb.remove(force=True)

                with pytest.raises(FailedPrecondition, match="backed by"):
                    await AsyncSandbox.create("backed", socket=sock, image_disk=str(disks["backed"]), wait=False)
                with pytest.raises(FailedPrecondition, match="not in a directory the supervisor allows"):
                    await AsyncSandbox.create("outside", socket=sock, image_disk=str(outside), wait=False)
                with pytest.raises(InvalidArgument, match="default guest kernel mounts"):
                    await AsyncSandbox.create("xfs", socket=sock, image_disk=f"{disks['raw']}:xfs", wait=False)
                with pytest.raises(FailedPrecondition, match="vmdk descriptor"):
                    await AsyncSandbox.create("desc", socket=sock, image_disk=str(disks["descriptor"]), wait=False)
                r = await cli(work, "ls", "--json")
                assert b"backed" not in r.stdout and b"desc" not in r.stdout


async def test_create_from_snapshot(image: Image, tmp_path: Path) -> None:
    """A Create from a memory snapshot with labels, TTL, env, workdir and a port; from
    the same snapshot's export file (imported first); the refusals."""
    tmp_path.chmod(0o755)
    allowed = tmp_path / "allowed"
    allowed.mkdir(mode=0o755)
    with workdir("sv-fromsnap-") as work:
        with trio.fail_after(600):
            async with supervisor(work, templates=False, allow_paths=(allowed,)):
                sock = str(work.socket)
                origin = await AsyncSandbox.create("origin", socket=sock, network="user", detached=True)
                assert (await origin.run("mkdir -p /srv && echo kept > /srv/mark")).ok
                snap = (await origin.checkpoint("warm")).snapshot_id
                mem = (await origin.inspect()).limits.memory_mib
                await origin.remove(force=True)

                sb = await AsyncSandbox.create(
                    "clone",
                    socket=sock,
                    from_snapshot="warm",
                    labels={"team": "a"},
                    ttl=3600,
                    env={"FOO": "bar"},
                    workdir="/srv",
                    ports={8080: 0},
                    memory_mib=mem,
                    detached=True,
                )
                info = await sb.inspect()
                assert info.labels == {"team": "a"}
                assert info.requested is not None and info.requested.ttl_seconds == 3600
                r = await sb.run("echo $FOO; pwd; cat mark")
                assert r.stdout == b"bar\n/srv\nkept\n", r
                assert 8080 in {p.sandbox_port for p in await sb.ports()}

                with pytest.raises(InvalidArgument, match="memory"):
                    await AsyncSandbox.create("small", socket=sock, from_snapshot=snap, memory_mib=mem - 64)
                with pytest.raises(InvalidArgument, match="image"):
                    await AsyncSandbox.create("img", socket=sock, from_snapshot=snap, image="alpine")
                await sb.remove(force=True)

                # an export file under --allow-path: imported, then restored (CLI)
                f = allowed / "warm.svsnap"
                await AsyncSandbox.export_snapshot(snap, f, socket=sock)
                r = await cli(work, "create", "from-file", "--from-snapshot", str(f), "--label", "src=file")
                assert r.returncode == 0, r.stderr
                sb = await AsyncSandbox.get("from-file", socket=sock)
                assert (await sb.run("cat /srv/mark")).stdout == b"kept\n"
                assert (await sb.inspect()).labels == {"src": "file"}
                names = [s.name for s in await AsyncSandbox.snapshots(socket=sock)]
                assert sum(n.startswith("file-") for n in names) == 1
                await sb.remove(force=True)
                # the same file again: the snapshot imported the first time
                sb = await AsyncSandbox.create("again", socket=sock, from_snapshot=str(f), detached=True)
                names = [s.name for s in await AsyncSandbox.snapshots(socket=sock)]
                assert sum(n.startswith("file-") for n in names) == 1
                await sb.remove(force=True)
                outside = tmp_path / "warm.svsnap"
                outside.write_bytes(f.read_bytes())
                with pytest.raises(FailedPrecondition, match="not in a directory the supervisor allows"):
                    await AsyncSandbox.create("outside", socket=sock, from_snapshot=str(outside))


async def test_rootfs_directory(image: Image, tmp_path: Path) -> None:
    """A plain directory as the image: made into an ext4 (owners kept, a symlink to a host
    file carried as a link, never followed), booted; the same tree again is the kept
    image; the CLI's ./PATH spelling; a directory outside --allow-path is refused."""
    tmp_path.chmod(0o755)
    allowed = tmp_path / "allowed"
    allowed.mkdir(mode=0o755)
    old = os.umask(0o022)
    try:
        tree = busybox_tree(allowed / "rootfs")
        for applet in ("grep", "readlink"):
            (tree / "bin" / applet).symlink_to("busybox")
        (tree / "home" / "u").mkdir(parents=True)
        (tree / "home" / "u" / "f").write_text("mine\n")
        os.chown(tree / "home" / "u" / "f", 1000, 1000)
        (tree / "shadow").symlink_to("/etc/shadow")  # data: the guest's /etc/shadow, of which it has none
    finally:
        os.umask(old)
    outside = tmp_path / "rootfs"
    outside.mkdir()
    with workdir("sv-rootdir-") as work:
        with trio.fail_after(600):
            async with supervisor(work, templates=False, allow_paths=(allowed,)):
                sock = str(work.socket)
                sb = await AsyncSandbox.create("dir", socket=sock, image=f"dir:{tree}", detached=True)
                r = await sb.run("cat /home/u/f; stat -c %u:%g /home/u/f; readlink /shadow; cat /shadow")
                assert r.stdout == b"mine\n1000:1000\n/etc/shadow\n", r
                assert r.exit_code != 0  # the link leads nowhere in the guest
                assert await _root_fstype(sb) == "ext4"
                await sb.remove(force=True)
                images = sorted((work.state / "oci" / "images").iterdir())

                r = await trio.run_process(
                    [sys.executable, "-m", "supervisor.main.cli", "create", "dir2", "--image", "./rootfs"],
                    cwd=allowed,
                    env=work.env(),
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
                assert r.returncode == 0, r.stderr
                sb = await AsyncSandbox.get("dir2", socket=sock)
                assert (await sb.run("cat /home/u/f")).stdout == b"mine\n"
                assert sorted((work.state / "oci" / "images").iterdir()) == images  # the kept one
                await sb.remove(force=True)

                with pytest.raises(NotFound, match="allow-path"):
                    await AsyncSandbox.create("outside", socket=sock, image=str(outside), wait=False)
                # the image by its ref: listed, removed
                r = await cli(work, "image", "ls")
                assert b" dir:/" in r.stdout, r  # (the table cuts a long reference)
                r = await cli(work, "image", "rm", f"dir:{tree}")
                assert r.returncode == 0, r.stderr
                assert not list((work.state / "oci" / "images").iterdir())
