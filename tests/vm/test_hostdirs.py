"""Host directories mounted into a sandbox (virtio-fs, virtiofsd in a cell), end to end:
a real ``sandvisor serve --allow-path`` (root, jailed), the CLI and the SDK, one real VM
with a read-only and a read-write mount."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from images.build import Image
from supervisor.client import FailedPrecondition, NotFound, PermissionDenied, Sandbox
from supervisor.main.throwaway import supervisor_process, workdir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="host directories are served in a cell")

SECRET = b"host-only secret\n"
ACL_UNDEFINED_ID = 0xFFFFFFFF


def _dir(prefix: str, mode: int) -> Path:
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))  # (/var/tmp: parents others may pass)
    d.chmod(mode)
    return d


@pytest.fixture(scope="module")
def dirs() -> Iterator[dict[str, Path]]:
    """allowed/ro (0755, a file, links out), allowed/rw (0777: the cell's ids are others
    here), outside/ (a secret, not under --allow-path)."""
    allowed, outside = _dir("sv-allowed-", 0o755), _dir("sv-outside-", 0o755)
    ro, rw = allowed / "ro", allowed / "rw"
    ro.mkdir(mode=0o755)
    rw.mkdir()
    rw.chmod(0o777)
    (ro / "hello.txt").write_text("hello from the host\n")
    (ro / "hello.txt").chmod(0o644)
    (outside / "secret.txt").write_bytes(SECRET)
    (ro / "abs-link").symlink_to(outside / "secret.txt")
    (ro / "rel-link").symlink_to(Path("..") / ".." / outside.name / "secret.txt")
    (ro / "etc-link").symlink_to("/etc")
    try:
        yield {"allowed": allowed, "ro": ro, "rw": rw, "outside": outside}
    finally:
        shutil.rmtree(allowed, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)


@pytest.fixture(scope="module")
def served(image: Image, dirs: dict[str, Path]) -> Iterator[dict[str, str]]:
    with workdir("sv-hdir-") as work, supervisor_process(work, "--allow-path", str(dirs["allowed"])) as (env, _):
        yield env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def sb(served: dict[str, str], dirs: dict[str, Path]) -> Iterator[Sandbox]:
    r = cli(served, "create", "hd", "--mount", f"{dirs['ro']}:/mnt/ro", "--mount", f"{dirs['rw']}:/mnt/rw:rw")
    assert r.returncode == 0, r.stderr
    box = Sandbox.get("hd", socket=served["SANDVISOR_SOCKET"])
    try:
        yield box
    finally:
        box.remove(force=True)


def test_read_only_host_dir(sb: Sandbox) -> None:
    assert sb.run("cat /mnt/ro/hello.txt").stdout == b"hello from the host\n"
    mounts = sb.run("grep ' /mnt/ro ' /proc/mounts").stdout.split()
    assert mounts[2] == b"virtiofs" and b"ro" in mounts[3].split(b",")
    w = sb.run("echo x > /mnt/ro/new.txt")
    assert w.exit_code != 0 and b"Read-only file system" in w.stderr


def test_symlinks_are_not_followed_out_of_the_host_dir(sb: Sandbox) -> None:
    """Links are the guest's to resolve, in its own file system: none reaches the host's."""
    for link in ("abs-link", "rel-link"):
        r = sb.run(f"cat /mnt/ro/{link}")
        assert r.exit_code != 0 and SECRET not in r.stdout and b"No such file" in r.stderr, link
    assert sb.run("readlink /mnt/ro/etc-link").stdout == b"/etc\n"
    # /etc through the link is the guest's own (its hostname, not the host's)
    assert sb.run("cat /mnt/ro/etc-link/hostname").stdout == sb.run("cat /etc/hostname").stdout


def test_read_write_host_dir(sb: Sandbox, dirs: dict[str, Path]) -> None:
    assert sb.run("echo from the guest > /mnt/rw/out.txt && mkdir /mnt/rw/sub").exit_code == 0
    out = dirs["rw"] / "out.txt"
    assert out.read_text() == "from the guest\n"
    assert out.stat().st_uid != 0  # guest root is not host root: an id of the tools' user namespace
    (dirs["rw"] / "from-host.txt").write_text("seen\n")
    assert sb.run("cat /mnt/rw/from-host.txt").stdout == b"seen\n"
    # no device node, and a set-uid file is set-uid to an id of the tools' namespace only
    assert sb.run("mknod /mnt/rw/mem c 1 1").exit_code != 0 and not (dirs["rw"] / "mem").exists()
    assert sb.run("cp /bin/true /mnt/rw/suid && chmod 4755 /mnt/rw/suid").exit_code == 0
    assert (dirs["rw"] / "suid").stat().st_uid == out.stat().st_uid != 0


def test_checkpoint_refused(sb: Sandbox) -> None:
    with pytest.raises(FailedPrecondition, match="host directories"):
        sb.checkpoint("hd-snap")
    assert sb.run("cat /mnt/ro/hello.txt").exit_code == 0  # it serves on


def test_served_again_after_a_restart(sb: Sandbox, dirs: dict[str, Path]) -> None:
    """Stop and Start: a new life, new servers, mounted again (and still read-only)."""
    sb.stop()
    sb.start()
    assert sb.run("cat /mnt/ro/hello.txt /mnt/rw/out.txt").stdout == b"hello from the host\nfrom the guest\n"
    assert sb.run("touch /mnt/ro/x").exit_code != 0


def test_host_dirs_outside_allow_path_refused(served: dict[str, str], dirs: dict[str, Path]) -> None:
    sock = served["SANDVISOR_SOCKET"]
    with pytest.raises(PermissionDenied, match="allow"):
        Sandbox.create("bad", socket=sock, mounts=[f"{dirs['outside']}:/mnt/x"])
    with pytest.raises(PermissionDenied):
        Sandbox.create("bad", socket=sock, mounts=["/etc:/mnt/x"])
    with pytest.raises(NotFound):
        Sandbox.create("bad", socket=sock, mounts=[f"{dirs['allowed']}/missing:/mnt/x"])
    r = cli(served, "create", "bad", "--mount", f"{dirs['outside']}:/mnt/x")
    assert r.returncode != 0 and "PERMISSION_DENIED" in r.stderr


def test_a_directory_its_server_cannot_read(served: dict[str, str], dirs: dict[str, Path]) -> None:
    """Refused at Create when its mode says so (FAILED_PRECONDITION, naming what to do);
    with an ACL (that grants someone else) the server fails, and the Create says why."""
    sock = served["SANDVISOR_SOCKET"]
    private = dirs["allowed"] / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(FailedPrecondition, match="by others"):
        Sandbox.create("priv", socket=sock, mounts=[f"{private}:/mnt/p"])
    with pytest.raises(FailedPrecondition, match="writable"):
        Sandbox.create("priv", socket=sock, mounts=[f"{dirs['ro']}:/mnt/p:rw"])  # 0755: others cannot write
    # user::rwx user:12345:r-x group::--- mask::r-x other::--- (system.posix_acl_access, version 2)
    entries = [(0x01, 7, ACL_UNDEFINED_ID), (0x02, 5, 12345), (0x04, 0, ACL_UNDEFINED_ID)]
    entries += [(0x10, 5, ACL_UNDEFINED_ID), (0x20, 0, ACL_UNDEFINED_ID)]
    os.setxattr(
        private, "system.posix_acl_access", struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    )
    with pytest.raises(FailedPrecondition, match=r"virtiofsd exited .*Permission denied"):
        Sandbox.create("priv", socket=sock, mounts=[f"{private}:/mnt/p"])
    with pytest.raises(NotFound):
        Sandbox.get("priv", socket=sock)  # (the SDK removed the failed one)
