"""Named volumes through a real ``sandvisor serve`` and real VMs:
a volume outlives the sandbox that wrote it, is read-write in one live sandbox at a
time and read-only in many, a snapshot records it and Restore refuses clearly when it
is busy or gone; the SDK and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from images.build import Image
from supervisor.client import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Sandbox,
    Volumes,
)
from tests.support.vms import serve_process


@pytest.fixture(scope="module")
def served(image: Image) -> Iterator[dict[str, str]]:
    with serve_process("sv-vol-") as (env, _):
        yield env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args], env=env, capture_output=True, timeout=300, check=False
    )


def test_a_volume_outlives_its_writer_and_a_busy_one_is_refused(served: dict[str, str]) -> None:
    sock = served["SANDVISOR_SOCKET"]
    vols = Volumes(sock)
    info = vols.create("data", "64M", labels={"team": "a"})
    assert (info.name, info.size_mib, info.mounted_by) == ("data", 64, [])
    with pytest.raises(AlreadyExists):
        vols.create("data")
    with pytest.raises(InvalidArgument):
        vols.create("Not A Name")
    with pytest.raises(NotFound):
        Sandbox.create("vol-missing", socket=sock, volumes=["nope:/x"])

    writer = Sandbox.create("vol-writer", socket=sock, volumes=["data:/data"])
    try:
        r = writer.run("echo hello > /data/f && mkdir /data/d && chmod 700 /data/d && sync && stat -c %U /data")
        assert r.exit_code == 0, r.stderr
        assert vols.get("data").mounted_by == ["vol-writer"]
        # read-write in one live sandbox at a time: a second writer, a reader, rm are refused
        with pytest.raises(FailedPrecondition, match="vol-writer"):
            Sandbox.create("vol-second", socket=sock, volumes=["data:/data"])
        with pytest.raises(FailedPrecondition, match="read-write"):
            Sandbox.create("vol-reader", socket=sock, volumes=["data:/data:ro"])
        with pytest.raises(FailedPrecondition, match="in use by vol-writer"):
            vols.remove("data")
        # a snapshot records its volumes; restoring it while the writer lives is refused
        snap = writer.checkpoint("with-data").snapshot_id
        with pytest.raises(FailedPrecondition, match=f"snapshot {snap} needs volume 'data'"):
            Sandbox.restore(snap, socket=sock)
    finally:
        writer.remove()
    assert vols.get("data").mounted_by == []

    # free again: the snapshot restores with its volume attached as it was (same slot)
    restored = Sandbox.restore(snap, socket=sock)
    try:
        assert restored.run("cat /data/f").stdout == b"hello\n"
        assert vols.get("data").mounted_by == [restored.id]
    finally:
        restored.remove(force=True)
    # the clone wrote the volume after the snapshot was taken: a second restore would run
    # a guest whose page cache is older than the volume, so it is refused
    with pytest.raises(FailedPrecondition, match="mounted read-write by another sandbox since"):
        Sandbox.restore(snap, socket=sock)

    # read-only in many, after the writer is gone
    r1 = Sandbox.create("vol-r1", socket=sock, volumes=["data:/mnt/data:ro"])
    r2 = Sandbox.create("vol-r2", socket=sock, volumes=["data:/data:ro"])
    try:
        assert r1.run("cat /mnt/data/f; stat -c %a /mnt/data/d").stdout == b"hello\n700\n"
        refused = r2.run("touch /data/x")
        assert refused.exit_code != 0 and b"Read-only" in refused.stderr
        assert sorted(vols.get("data").mounted_by) == ["vol-r1", "vol-r2"]
        with pytest.raises(FailedPrecondition, match="read-only"):
            Sandbox.create("vol-rw", socket=sock, volumes=["data:/data"])
    finally:
        r1.remove()
        r2.remove()

    vols.remove("data")
    assert [v.name for v in vols.list()] == []
    with pytest.raises(FailedPrecondition, match=f"snapshot {snap} needs volume 'data' .*does not exist"):
        Sandbox.restore(snap, socket=sock)


def test_volumes_from_the_cli(served: dict[str, str]) -> None:
    r = cli(served, "volume", "create", "cli-vol", "--size", "32M", "--label", "k=v")
    assert r.returncode == 0 and r.stdout == b"cli-vol\n", r.stderr
    assert cli(served, "volume", "create", "cli-vol").returncode == 1
    r = cli(served, "create", "cli-box", "--volume", "cli-vol:/srv/v")
    assert r.returncode == 0, r.stderr
    try:
        r = cli(served, "run", "cli-box", "--", "sh", "-c", "echo from-cli > /srv/v/x && cat /srv/v/x")
        assert r.stdout == b"from-cli\n", r.stderr
        listed = json.loads(cli(served, "volume", "ls", "--json").stdout)
        assert [(v["name"], v["size_mib"], v["mounted_by"], v["labels"]) for v in listed] == [
            ("cli-vol", 32, ["cli-box"], {"k": "v"})
        ]
        busy = cli(served, "volume", "rm", "cli-vol")
        assert busy.returncode == 1 and b"in use" in busy.stderr
        bad = cli(served, "create", "cli-bad", "--volume", "cli-vol")
        assert bad.returncode != 0 and b"NAME:/path" in bad.stderr
    finally:
        cli(served, "rm", "-f", "cli-box")
    table = cli(served, "volume", "ls").stdout.decode()
    assert "cli-vol" in table and "32 MiB" in table
    assert cli(served, "volume", "rm", "cli-vol").returncode == 0
    assert json.loads(cli(served, "volume", "ls", "--json").stdout) == []
