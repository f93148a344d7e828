"""The sandboxes' parent cgroup weighs what its children weigh (actors/cells/cgroups.py,
``CgroupManager.reweigh``): the sum of their CPU weights within the kernel's bounds,
kept when a cgroup is made, tuned (Modify's vCPUs) or removed. Units against fake
trees (v2 is not usable on this machine; v1's arithmetic too), and a real jailed
sandbox on this machine's hierarchy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from actors.cells.cgroups import Cgroup, CgroupLimits, CgroupV1Manager, CgroupV2Manager
from actors.model import Limits, SandboxConfig, State
from actors.modify import Modification, modify
from actors.registry import Registry
from actors.sandboxes.sandbox import Sandbox
from images.build import Image
from supervisor.main.throwaway import supervisor, workdir


def guest(vcpus: int) -> CgroupLimits:
    return CgroupLimits.for_guest(256, vcpus)


def remove(cg: Cgroup) -> None:
    for d in cg.dirs:  # (a fake tree's files: the kernel's go with rmdir)
        for f in d.iterdir():
            f.unlink()
    cg.remove()


def v2_tree(tmp_path: Path, controllers: str = "cpu io memory pids") -> Path:
    root = tmp_path / "cg"
    (root / "sandvisor-k").mkdir(parents=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "sandvisor-k" / "cgroup.subtree_control").write_text("")
    return root


def test_v2_the_parent_weighs_the_sum_of_its_children(tmp_path: Path) -> None:
    root = v2_tree(tmp_path)
    weight = root / "sandvisor-k" / "cpu.weight"
    m = CgroupV2Manager(root, parent="sandvisor-k")
    a = m.create("a", guest(1))
    assert weight.read_text() == "100"  # one 1-vCPU sandbox: one ordinary task's weight
    b = m.create("b", guest(2))
    assert weight.read_text() == "300"
    proxy = m.create("proxy", CgroupLimits(memory_bytes=64 << 20, pids=16))  # no weight of its own: the default
    assert weight.read_text() == "400"
    b.set_cpu(guest(4))  # Modify: 4 vCPUs
    assert (root / "sandvisor-k" / "b" / "cpu.weight").read_text() == "400"
    assert weight.read_text() == "600"
    many = [m.create(f"big{i}", guest(64)) for i in range(2)]  # 6400 each: bounded by the kernel's 10000
    assert weight.read_text() == "10000"
    for cg in [*many, b, proxy]:
        remove(cg)
    assert weight.read_text() == "100"
    remove(a)
    assert weight.read_text() == "100"  # none left: the default
    reopened = CgroupV2Manager(root, parent="sandvisor-k")  # after a restart: an opened one tunes too
    c = reopened.create("c", guest(1))
    reopened.open("c").set_cpu(guest(3))
    assert weight.read_text() == "300"
    remove(c)


def test_v2_without_the_cpu_controller_no_weight_is_written(tmp_path: Path) -> None:
    root = v2_tree(tmp_path, "io memory pids")
    m = CgroupV2Manager(root, parent="sandvisor-k")
    remove(m.create("a", guest(2)))
    assert not (root / "sandvisor-k" / "cpu.weight").exists()
    assert not (root / "cpu.weight").exists()  # the level above is never ours to weigh


def test_v1_the_parent_shares_are_the_sum_of_its_childrens(tmp_path: Path) -> None:
    mounts = {c: tmp_path / c for c in ("memory", "pids", "cpu")}
    for d in mounts.values():
        d.mkdir()
    m = CgroupV1Manager(mounts, parent="sandvisor-k")
    shares = mounts["cpu"] / "sandvisor-k" / "cpu.shares"
    a = m.create("a", guest(1))
    b = m.create("b", guest(2))
    assert shares.read_text() == str(1024 + 2048)
    many = [m.create(f"big{i}", guest(64)) for i in range(5)]  # 65536 each: bounded by 262144
    assert shares.read_text() == "262144"
    for cg in many:
        remove(cg)
    a.set_cpu(guest(2))
    assert shares.read_text() == str(2048 + 2048)
    remove(a)
    remove(b)
    assert shares.read_text() == "1024"


# -- a real jailed sandbox on this machine's hierarchy -------------------------------------------


async def ready(reg: Registry, id: str, limits: Limits) -> Sandbox:
    sb = await reg.create(id, SandboxConfig(limits=limits))
    with trio.fail_after(300):
        await sb.ready_event.wait()
    assert sb.state == State.READY, sb.record.error
    return sb


@pytest.mark.vm
@pytest.mark.skipif(os.geteuid() != 0, reason="jails and cgroups need a root supervisor")
async def test_a_jailed_sandboxes_parent_weighs_its_sandboxes(image: Image) -> None:
    with workdir("sv-weight-") as work:
        async with supervisor(work, templates=False) as (_, reg):
            cells = reg.settings.cells
            assert cells is not None
            if cells.cgroups is None or cells.cgroups.version != 1 or "cpu" not in getattr(cells.cgroups, "mounts", {}):
                pytest.skip("this checks cgroup v1's cpu controller (the v2 arithmetic: the units above)")
            parent = cells.cgroups.mounts["cpu"] / cells.cgroups.parent  # type: ignore[attr-defined]

            def shares() -> int:
                return int((parent / "cpu.shares").read_text())

            a = await ready(reg, "a", Limits(vcpus=1, max_vcpus=2))
            assert shares() == 1024  # one 1-vCPU sandbox (booted with 2, settled to 1: tuned)
            b = await ready(reg, "b", Limits(vcpus=1))
            assert shares() == 2048
            plan = await modify(reg, "a", Modification(vcpus=2))
            assert plan.applied
            assert shares() == 3072  # a at 2 vCPUs, b at 1
            for sb, left in ((b, 2048), (a, 1024)):
                await reg.remove(sb.id, force=True)
                assert shares() == left  # none left: the default
