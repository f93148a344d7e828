"""A snapshot's side of a diff, read on the host (actors/forkpoint.py): the chain spelled
for qemu-img, the paths debugfs is told, a disk held through its files' removal, and the
cell's script on a real (tiny) ext4 chain, parsed into treediff's shape. (The script's
run inside a tool cell, on a real fork's disk: tests/vm/test_fork_point_diff.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

from actors import forkpoint
from actors.errors import FailedPrecondition, InvalidArgument, NotFound
from actors.forkpoint import chain_spec, check_path, hold
from actors.treediff import Entry, compare, diff_sides, listing


def test_the_chain_is_spelled_layer_by_layer_with_no_header_followed() -> None:
    spec = json.loads(chain_spec([("qcow2", "/fd/5"), ("qcow2", "/w/layer1"), ("raw", "/fd/7")]).removeprefix("json:"))
    assert spec["driver"] == "qcow2" and spec["file"] == {"driver": "file", "filename": "/fd/5", "locking": "off"}
    assert spec["backing"]["file"]["filename"] == "/w/layer1"
    assert spec["backing"]["backing"] == {
        "driver": "raw",
        "file": {"driver": "file", "filename": "/fd/7", "locking": "off"},
    }
    alone = json.loads(chain_spec([("qcow2", "/a")]).removeprefix("json:"))
    assert alone["backing"] is None  # a bottom qcow2 opens no backing of its own
    with pytest.raises(FailedPrecondition):
        chain_spec([("raw", "/a"), ("raw", "/b")])


def test_paths_told_to_debugfs() -> None:
    assert check_path("/srv/w/") == "/srv/w"
    assert check_path("/./srv//w") == "/srv/w"
    assert check_path("/") == "/"
    for bad in ("srv", "/a/../b", '/a"b', "/a\nb", "/a\\b", "/a\0b"):
        with pytest.raises(InvalidArgument):
            check_path(bad)


def test_a_held_disk_outlives_its_files(tmp_path: Path) -> None:
    top, base = tmp_path / "top", tmp_path / "base"
    top.write_bytes(b"QFI\xfb" + bytes(20) + (5 << 30).to_bytes(8, "big") + b"rest")
    base.write_bytes(b"ext4 bytes")
    top.chmod(0o600)  # (a snapshot's disk.qcow2: copied for the cell, not reopened by it)
    base.chmod(0o444)
    with hold([top, base]) as disk:
        assert [(layer.fmt, layer.world_readable) for layer in disk.layers] == [("qcow2", False), ("raw", True)]
        assert disk.virtual_size == 5 << 30
        shutil.rmtree(tmp_path, ignore_errors=True)  # (what a retired snapshot's collection does)
        assert os.pread(disk.layers[1].fd, 10, 0) == b"ext4 bytes"
    assert disk.layers == []


def test_a_disk_that_is_gone_or_not_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="gone"):
        hold([tmp_path / "nothing"])
    with pytest.raises(FailedPrecondition, match="not a regular file"):
        hold([tmp_path])
    os.symlink("/etc/passwd", tmp_path / "link")
    with pytest.raises(OSError):  # (O_NOFOLLOW: ELOOP)
        hold([tmp_path / "link"])


TOOLS = ("mkfs.ext4", "qemu-img", "debugfs", "tar")


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Path, Path]:
    """A small ext4 (the base, raw) and a qcow2 over it, as a fork's chain is."""
    if not all(shutil.which(t) for t in TOOLS):
        pytest.skip(f"needs {', '.join(TOOLS)}")
    src = tmp_path / "src"
    (src / "srv/w/sub").mkdir(parents=True)
    (src / "srv/w/a").write_bytes(b"hi\n")
    (src / "srv/w/.hidden").write_bytes(b"dot\n")
    (src / "srv/w/sub/x").write_bytes(b"x" * 5000)
    (src / "srv/w/sub/x").chmod(0o600)
    os.symlink("/etc/passwd", src / "srv/w/l")
    os.mkfifo(src / "srv/w/fifo")
    (src / "srv/whole").mkdir()
    (src / "srv/w/sub/suid").write_bytes(b"s")
    (src / "srv/w/sub/suid").chmod(0o4755)
    (src / "srv/w/sub/tmp").mkdir()
    (src / "srv/w/sub/tmp").chmod(0o1777)
    (src / "srv/w/sub/tmp/sg").mkdir()
    (src / "srv/w/sub/tmp/sg").chmod(0o2775)
    base, top = tmp_path / "base.ext4", tmp_path / "top.qcow2"
    subprocess.run(["mkfs.ext4", "-q", "-d", str(src), str(base), "16M"], check=True, capture_output=True)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base), str(top)],
        check=True,
        capture_output=True,
    )
    return top, base


def _script(top: Path, base: Path, path: str, mode: str, work: Path) -> str:
    """The cell's script as the cell runs it, here unconfined on our own files."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    with hold([top, base]) as disk:
        files = [(layer.fmt, f"/proc/self/fd/{layer.fd}") for layer in disk.layers]
        argv = forkpoint._argv(files, path, mode, work)
        subprocess.run(argv, pass_fds=[layer.fd for layer in disk.layers], check=True, capture_output=True)
    return (work / "result").read_text().strip()


def _listing(work: Path) -> dict[str, Entry]:
    with open(work / "tree.tar", "rb") as f:
        return listing(f.read)


def test_the_script_lists_a_directory_of_the_disk_as_a_guest_would(chain: tuple[Path, Path], tmp_path: Path) -> None:
    top, base = chain
    work = tmp_path / "work"
    assert _script(top, base, "/srv/w", "tree", work) == "ok"
    got = _listing(work)
    sha = hashlib.sha256
    assert got == {
        ".": Entry("dir", 0, 0o755),
        ".hidden": Entry("file", 4, 0o644, sha(b"dot\n").hexdigest()),
        "a": Entry("file", 3, 0o644, sha(b"hi\n").hexdigest()),
        "l": Entry("link", 11, 0o777, "/etc/passwd"),
        "sub": Entry("dir", 0, 0o755),
        "sub/x": Entry("file", 5000, 0o600, sha(b"x" * 5000).hexdigest()),
        # set-user-ID, sticky and set-group-ID bits as the disk has them (rdump drops them)
        "sub/suid": Entry("file", 1, 0o4755, sha(b"s").hexdigest()),
        "sub/tmp": Entry("dir", 0, 0o1777),
        "sub/tmp/sg": Entry("dir", 0, 0o2775),
    }  # (a FIFO is not listed: neither does a guest's walk)
    assert _script(top, base, "/", "tree", work) == "ok"
    assert {"srv", "srv/w/a", "srv/whole", "lost+found"} <= set(_listing(work))
    assert _script(top, base, "/srv/whole", "tree", work) == "ok"  # (a name the script uses itself)
    assert _listing(work) == {".": Entry("dir", 0, 0o755)}
    assert _script(top, base, "/srv/w/.hidden", "file", work) == "ok"
    assert (work / "content").read_bytes() == b"dot\n"
    assert _script(top, base, "/srv/nowhere", "tree", work) == "missing"
    assert _script(top, base, "/srv/w/a", "tree", work) == "notdir"
    assert _script(top, base, "/srv/w", "file", work) == "notfile"


async def test_a_snapshot_side_and_a_guest_side_are_compared_and_fail_typed() -> None:
    async def snapshot_side(path: str, limits: object) -> dict[str, Entry]:
        return {".": Entry("dir", 0, 0o755), "a": Entry("file", 1, 0o644, "x"), "b": Entry("file", 1, 0o644, "y")}

    async def guest_side(path: str, limits: object) -> dict[str, Entry]:
        return {".": Entry("dir", 0, 0o700), "a": Entry("file", 1, 0o644, "z"), "c": Entry("dir", 0, 0o755)}

    async def missing(path: str, limits: object) -> dict[str, Entry]:
        raise NotFound(f"{path}: no such directory at the snapshot")

    with trio.fail_after(10):
        changes, n_a, n_b = await diff_sides(snapshot_side, guest_side, "/w")
        assert [(c.path, c.change) for c in changes] == [("a", "modified"), ("b", "removed"), ("c", "added")]
        assert (n_a, n_b) == (3, 3)
        assert [c.path for c in compare(await snapshot_side("", None), await snapshot_side("", None))] == []
        with pytest.raises(NotFound, match="at the snapshot"):
            await diff_sides(missing, guest_side, "/w")
