"""Files in before boot and whole trees through a real ``sandvisor
serve``: ``cp -r`` by the SDK (sync and async) and the CLI as one tar stream, and
patches given at Create."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from images.build import Image
from supervisor.client import AsyncSandbox, FailedPrecondition, InvalidArgument, NotFound, Patch, Sandbox, SandboxError
from tests.support.trees import listing, make_tree
from tests.support.vms import serve_process


@pytest.fixture(scope="module")
def served(image: Image) -> Iterator[dict[str, str]]:
    with serve_process("sv-cptree-") as (env, _):
        yield env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args], env=env, capture_output=True, timeout=300, check=False
    )


def test_cp_r_round_trips_a_1000_file_tree(served: dict[str, str], tmp_path: Path) -> None:
    """Modes, owners, mtimes, symlinks (dangling, absolute), hard links, empty
    directories: SDK in, SDK out, CLI in, CLI out, each the same tree."""
    sock = served["SANDVISOR_SOCKET"]
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    entries = 1 + sum(len(d) + len(f) for _, d, f in os.walk(src))
    assert entries > 1000
    with Sandbox.create("cp-tree", socket=sock) as sb:
        assert sb.fs.copy_tree_in(src, "/srv/tree") == entries
        r = sb.run("cd /srv/tree && stat -c '%a %u:%g %F' setuid d5 empty hard-link && readlink abs-link")
        assert r.stdout.decode().splitlines() == [
            "4755 0:0 regular file",
            "755 65534:65534 directory",
            "700 0:0 directory",
            "600 1000:100 regular empty file",
            "/etc/passwd",
        ]
        back = tmp_path / "back"  # made by the copy
        assert sb.fs.copy_tree_out("/srv/tree", back, keep_owners=True) == entries
        assert listing(back) == listing(src, mask=0o777)  # (setuid bits from a guest are dropped)
        assert os.stat(back / "hard-link").st_ino == os.stat(back / "d0/e0/f0.bin").st_ino

        r1 = cli(served, "cp", "-r", "-a", str(src), "cp-tree:/srv/cli")
        assert r1.returncode == 0, r1.stderr
        r2 = cli(served, "cp", "-r", "-a", "cp-tree:/srv/cli", str(tmp_path / "cli-back"))
        assert r2.returncode == 0, r2.stderr
        assert listing(tmp_path / "cli-back") == listing(src, mask=0o777)

        # without -a the CLI gives every entry to --owner (root by default) in the guest
        small = tmp_path / "small"
        (small / "a" / "b").mkdir(parents=True)
        (small / "a" / "f").write_text("x")
        os.chown(small / "a" / "f", 1000, 100)
        assert cli(served, "cp", "-r", str(small), "cp-tree:/srv/small").returncode == 0
        r = sb.run("stat -c '%u:%g' /srv/small/a/f /srv/small/a/b")
        assert r.stdout.decode().split() == ["0:0", "0:0"]

        # typed errors; the sandbox goes on serving
        with pytest.raises(NotFound):
            sb.fs.copy_tree_out("/srv/no-such-dir", tmp_path / "x")
        with pytest.raises(NotFound, match="Not a directory"):
            sb.fs.copy_tree_out("/srv/tree/hard-link", tmp_path / "y")
        bad = cli(served, "cp", "-r", str(tmp_path / "missing"), "cp-tree:/srv/m")
        assert bad.returncode != 0 and b"no such directory" in bad.stderr

        async def via_async() -> int:
            a = await AsyncSandbox.get("cp-tree", socket=sock)
            return await a.fs.copy_tree_in(small, "/srv/async", owner="nobody")

        assert trio.run(via_async) == 4
        assert sb.run("stat -c %U /srv/async/a/f").stdout == b"nobody\n"


def test_patches_at_create_are_there_before_the_command(served: dict[str, str]) -> None:
    sock = served["SANDVISOR_SOCKET"]
    patches = [
        Patch.mkdir("/srv/app", mode=0o750, owner="nobody"),
        Patch.file("/srv/app/run.sh", "#!/bin/sh\necho patched > /tmp/out\n", mode=0o755),
        Patch.symlink("/srv/app/run.sh", "/usr/local/bin/app"),
        Patch.file("/srv/app/secret", b"\x00s", mode=0o600, owner="nobody:nogroup"),
        Patch.append("/etc/motd", "from a patch\n"),
        Patch.remove("/etc/issue"),
    ]
    with Sandbox.create("patched", socket=sock, patches=patches, cmd=["app"]) as sb:
        end = time.monotonic() + 60
        while True:  # (a run is refused while the initial command runs)
            with contextlib.suppress(FailedPrecondition):
                if sb.run("test -e /tmp/out").exit_code == 0:
                    break
            assert time.monotonic() < end, "the initial command never ran"
            time.sleep(0.2)
        r = sb.run(
            "stat -c '%a %U:%G' /srv/app /srv/app/run.sh /srv/app/secret; readlink /usr/local/bin/app;"
            " cat /tmp/out; tail -n1 /etc/motd; test -e /etc/issue || echo gone"
        )
        assert r.stdout.decode().splitlines() == [
            "750 nobody:nogroup",  # (a user alone: with its primary group)
            "755 root:root",
            "600 nobody:nogroup",
            "/srv/app/run.sh",
            "patched",
            "from a patch",
            "gone",
        ]
        assert sb.fs.read("/srv/app/secret") == b"\x00s"
    with pytest.raises(InvalidArgument, match="absolute"):
        Sandbox.create("bad-patch", socket=sock, patches=[Patch.file("etc/x", "x")])
    # a patch the guest refuses (the file exists; no replace) fails the Create, saying which
    # (and the SDK removes the failed sandbox)
    with pytest.raises(SandboxError, match=r"patches: entry 0 .*/etc/passwd"):
        Sandbox.create("refused-patch", socket=sock, patches=[Patch.file("/etc/passwd", "x")])


def test_named_scripts_run_by_name(served: dict[str, str], tmp_path: Path) -> None:
    """Scripts kept with the sandbox's config, written with the
    patches, run by name through the SDK and the CLI."""
    sock = served["SANDVISOR_SOCKET"]
    scripts = {
        "setup": "echo setup $1 $# > /tmp/s; cat /tmp/s",
        "py": "#!/usr/bin/python3\nimport sys\nprint(sys.argv[1:])\n",
    }
    with Sandbox.create("scripted", socket=sock, scripts=scripts) as sb:
        r = sb.run_script("setup", "a", "b")
        assert (r.stdout, r.exit_code) == (b"setup a 2\n", 0)
        assert sb.run_script("py", "x y").stdout == b"['x y']\n"
        with pytest.raises(NotFound, match="py, setup"):
            sb.run_script("nope")
        r2 = cli(served, "run", "scripted", "--script", "setup", "--", "z")
        assert (r2.returncode, r2.stdout) == (0, b"setup z 1\n"), r2.stderr
    body = tmp_path / "hello.sh"
    body.write_text("echo from-file $1\n")
    assert cli(served, "create", "scripted-cli", "--script", f"hello={body}").returncode == 0
    try:
        r3 = cli(served, "run", "scripted-cli", "--script", "hello", "--", "w")
        assert r3.stdout == b"from-file w\n", r3.stderr
    finally:
        cli(served, "rm", "-f", "scripted-cli")
    with pytest.raises(InvalidArgument, match="script name"):
        Sandbox.create("bad-script", socket=sock, scripts={"../x": "true"})


def test_cp_out_keeps_existing_dirs_and_never_follows_a_planted_link(served: dict[str, str], tmp_path: Path) -> None:
    """A guest's 0777 directories and setuid file copied out: directories
    that were at DEST keep their mode and owner, new ones get the guest's mode without
    special bits (and, without -a, masked by the client's umask); a single-file copy
    replaces a symlink planted at its destination (and at the old predictable temp
    name) instead of writing through it."""
    with Sandbox.create("cp-hostile", socket=served["SANDVISOR_SOCKET"]) as sb:
        r = sb.run(
            "mkdir -p /srv/x/pre/new && echo s > /srv/x/pre/suid && chmod 4777 /srv/x/pre/suid"
            " && chmod 0777 /srv/x /srv/x/pre /srv/x/pre/new && chown -R 1000:1000 /srv/x"
        )
        assert r.exit_code == 0, r.stderr
        dest = tmp_path / "dest"
        (dest / "pre").mkdir(parents=True)
        for d in (dest, dest / "pre"):
            d.chmod(0o750)
            os.chown(d, 4321, 4321)
        r1 = cli(served, "cp", "-r", "-a", "cp-hostile:/srv/x", str(dest))
        assert r1.returncode == 0, r1.stderr

        def meta(p: Path) -> tuple[int, int, int]:
            st = p.lstat()
            return st.st_mode & 0o7777, st.st_uid, st.st_gid

        assert meta(dest) == (0o750, 4321, 4321)  # was there: kept
        assert meta(dest / "pre") == (0o750, 4321, 4321)
        assert meta(dest / "pre" / "new") == (0o777, 1000, 1000)  # made by the copy, -a as root
        assert meta(dest / "pre" / "suid") == (0o777, 1000, 1000)  # no setuid from a guest

        plain = tmp_path / "plain"  # without -a: the caller's files, its umask
        r2 = subprocess.run(
            [sys.executable, "-m", "supervisor.main.cli", "cp", "-r", "cp-hostile:/srv/x", str(plain)],
            env=served,
            capture_output=True,
            timeout=300,
            check=False,
            umask=0o027,
        )
        assert r2.returncode == 0, r2.stderr
        assert meta(plain / "pre" / "new") == (0o750, 0, 0)
        assert meta(plain / "pre" / "suid") == (0o750, 0, 0)

        out, outside = tmp_path / "out", tmp_path / "outside"
        out.mkdir()
        outside.mkdir()
        (outside / "victim").write_text("victim")
        (out / "f").symlink_to(outside / "victim")  # planted at the destination
        (out / ".f.sandvisor-part").symlink_to(outside / "victim")  # ... and at the old temp name
        r3 = cli(served, "cp", "cp-hostile:/srv/x/pre/suid", str(out / "f"))
        assert r3.returncode == 0, r3.stderr
        assert not (out / "f").is_symlink() and (out / "f").read_text() == "s\n"
        assert (outside / "victim").read_text() == "victim" and os.listdir(outside) == ["victim"]
        r4 = cli(served, "cp", "cp-hostile:/srv/x/pre/suid", str(out))  # a directory: its basename in it
        assert r4.returncode == 0, r4.stderr
        assert (out / "suid").read_text() == "s\n"
        assert sorted(os.listdir(out)) == [".f.sandvisor-part", "f", "suid"]  # no temp file left
