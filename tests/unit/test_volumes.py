"""actors.volumes.Volumes without a VM: records in a real store, images made by
mkfs.ext4, claims (rw: one live sandbox; ro: many), removal order and the sweep; the
configuration rules of volume mounts, patches and scripts."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from actors.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from actors.model import VolumeMount
from actors.store import Store
from actors.volumes import Volumes


async def test_create_claim_release_remove_and_sweep(tmp_path: Path) -> None:
    store = Store(tmp_path / "sandvisor.db")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            vols = Volumes(tmp_path / "volumes", store)
            vols.load()
            rec = await vols.create("data", 16 << 20, {"k": "v"})
            assert vols.path(rec).stat().st_size == 16 << 20 and vols.path(rec).stat().st_blocks * 512 < 8 << 20
            with pytest.raises(AlreadyExists):
                await vols.create("data", 16 << 20)
            for bad in ("", "Data", "-x", "a" * 64, "a/b"):
                with pytest.raises(InvalidArgument):
                    await vols.create(bad, 16 << 20)
            with pytest.raises(InvalidArgument):
                await vols.create("tiny", 1 << 20)

            rw, ro = VolumeMount("data", "/data"), VolumeMount("data", "/data", read_only=True)
            (disk,) = vols.claim("uid-a", "a", (rw,))
            assert disk.path == vols.path(rec) and not disk.read_only and disk.serial == "v0"
            with pytest.raises(FailedPrecondition, match="read-write by sandbox a"):
                vols.claim("uid-b", "b", (rw,))
            with pytest.raises(FailedPrecondition):
                vols.check((ro,))
            vols.claim("uid-a", "a", (rw,))  # a life of the same sandbox again: its own claim
            with pytest.raises(FailedPrecondition, match="in use by a"):
                await vols.remove("data")
            assert await vols.release_checked("uid-a") == []  # a clean image: nothing to say
            vols.claim("uid-b", "b", (ro,))
            vols.claim("uid-c", "c", (ro,))
            assert vols.users("data") == ["b", "c"]
            with pytest.raises(FailedPrecondition, match="read-only by sandbox"):
                vols.claim("uid-d", "d", (rw,))
            with pytest.raises(NotFound):
                vols.claim("uid-d", "d", (VolumeMount("nope", "/x"),))
            with pytest.raises(FailedPrecondition, match="snapshot s needs volume 'nope'"):
                vols.check((VolumeMount("nope", "/x"),), what="snapshot s needs ")
            vols.release("uid-b")
            vols.release("uid-c")

            stray = vols.root / "stray.ext4.part"
            stray.write_bytes(b"x")
            other = await vols.create("other", 16 << 20)
            assert vols.sweep() == [stray]
            await vols.remove("data")
            assert not vols.path(rec).exists()
            with pytest.raises(NotFound):
                vols.get("data")
            nursery.cancel_scope.cancel()
    store.close()
    again = Volumes(tmp_path / "volumes", Store(tmp_path / "sandvisor.db"))
    again.load()
    assert list(again.records) == ["other"] and again.records["other"] == other


async def test_generations_refuse_a_restore_over_newer_contents(tmp_path: Path) -> None:
    """A snapshot records its volumes' generations; a read-write life of anyone after
    it (another sandbox, a restore, a Start) makes its restore refused; read-only lives
    and an adopted life change nothing; the generation survives a supervisor restart."""
    store = Store(tmp_path / "sandvisor.db")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            vols = Volumes(tmp_path / "volumes", store)
            vols.load()
            await vols.create("data", 16 << 20)
            rw, ro = VolumeMount("data", "/data"), VolumeMount("data", "/data", read_only=True)
            vols.claim("uid-a", "a", (rw,))  # the origin's life
            taken = vols.generations((rw,))  # its checkpoint
            assert taken == {"data": 1}
            vols.check_unchanged((rw,), taken, "snapshot s")  # the origin still writing: not counted
            vols.release("uid-a")
            vols.claim("uid-a", "a", (rw,), adopted=True)  # adopted after a restart: the same life
            vols.release("uid-a")
            for uid in ("uid-r1", "uid-r2"):  # read-only users
                vols.claim(uid, uid, (ro,))
            vols.release("uid-r1")
            vols.release("uid-r2")
            vols.check_unchanged((rw,), taken, "snapshot s")
            vols.check_unchanged((rw,), {}, "an old snapshot")  # recorded none: not checked
            vols.claim("uid-b", "b", (rw,))  # another sandbox writes
            vols.release("uid-b")
            with pytest.raises(FailedPrecondition, match="mounted read-write by another sandbox since"):
                vols.check_unchanged((rw,), taken, "snapshot s")
            await store.flush()
            again = Volumes(tmp_path / "volumes", store)
            again.load()
            assert again.generations((rw,)) == {"data": 2}
            nursery.cancel_scope.cancel()


def test_config_rules_of_patches_scripts_and_volume_mounts() -> None:
    from actors.model import Patch, SandboxConfig
    from actors.rules import check_config, script_argv, script_patches

    ok = SandboxConfig(
        patches=(Patch("file", "/etc/x", b"1", mode=0o600, owner="nobody"),),
        volumes=(VolumeMount("a", "/data"), VolumeMount("b", "/srv", read_only=True)),
        scripts={"setup": "echo hi", "py": "#!/usr/bin/python3\nprint(1)\n"},
    )
    check_config(ok)
    bad = [
        SandboxConfig(patches=(Patch("chmod", "/x"),)),
        SandboxConfig(patches=(Patch("file", "rel/x"),)),
        SandboxConfig(patches=(Patch("file", "/x", mode=0o10000),)),
        SandboxConfig(patches=(Patch("symlink", "/x"),)),
        SandboxConfig(patches=(Patch("file", "/x", b"x" * (5 << 20)),)),
        SandboxConfig(volumes=(VolumeMount("a", "/data"), VolumeMount("a", "/other"))),
        SandboxConfig(volumes=(VolumeMount("a", "/data"), VolumeMount("b", "/data/"))),
        SandboxConfig(volumes=(VolumeMount("a", "/proc"),)),
        SandboxConfig(scripts={"../x": "true"}),
        SandboxConfig(scripts={"empty": "  "}),
    ]
    for cfg in bad:
        with pytest.raises(InvalidArgument):
            check_config(cfg)
    files = script_patches(ok.scripts)
    assert [(p.op, p.path, p.mode) for p in files] == [
        ("mkdir", "/.sandvisor/scripts", 0o755),
        ("file", "/.sandvisor/scripts/py", 0o755),
        ("file", "/.sandvisor/scripts/setup", 0o755),
    ]
    assert files[2].data == b"#!/bin/sh\necho hi" and files[1].data.startswith(b"#!/usr/bin/python3")
    assert script_argv(ok.scripts, "setup", ["a"]) == ["/.sandvisor/scripts/setup", "a"]
    with pytest.raises(NotFound, match="py, setup"):
        script_argv(ok.scripts, "nope", [])
