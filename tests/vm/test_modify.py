"""Modify against real VMs (docs/modify.md): one sandbox, created with ceilings and a
grown disk, changed live (gRPC), by a dry run (CLI), refused and then restarted above a
ceiling (SDK, CLI), and grown while stopped. One supervisor in this Trio run, with its
msgpack socket (SDK, CLI) and a gRPC unix socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import trio

from actors.defaults import JAIL_CPU_HEADROOM
from actors.registry import Registry
from images.build import Image
from images.ocilocal import Layer, build_image, busybox_tree
from supervisor.client import AsyncSandbox
from supervisor.main.throwaway import Workdir, supervisor, workdir
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc

MIB = 1 << 20


async def cli(work: Workdir, *args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=work.env(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def guest(sb: AsyncSandbox) -> dict[str, int]:
    """nproc, MemTotal (MiB) and the root filesystem's size (MiB), as the guest sees them."""
    r = await sb.run("nproc; grep MemTotal /proc/meminfo; df -m / | tail -1")
    nproc, mem, df = r.stdout.decode().splitlines()
    return {"nproc": int(nproc), "mem": int(mem.split()[1]) // 1024, "disk": int(df.split()[1])}


async def test_modify_live_dry_refused_restarted_and_offline(image: Image, tmp_path: Path) -> None:
    with workdir("sv-modify-") as work:
        grpc_sock = work.root / "g.sock"
        with trio.fail_after(1200):
            async with supervisor(
                work, grpc=(f"unix://{grpc_sock}",), templates=False, stop_timeout=10, allow_paths=(tmp_path,)
            ) as (_, reg):
                with grpc.insecure_channel(f"unix:{grpc_sock}") as ch:
                    await _modify(work, sv_grpc.SandvisorServiceStub(ch), reg)
                await _oci_root_grows(work, tmp_path)


def cpu_quota(reg: Registry) -> float | None:
    cell = reg.get("m").cell
    return cell.cgroup.stats().cpu_limit if cell is not None and cell.cgroup is not None else None


async def _modify(work: Workdir, ours: Any, reg: Registry) -> None:
    sock = str(work.socket)
    sb = await AsyncSandbox.create(
        "m", socket=sock, cpus=1, max_cpus=2, memory_mib=256, max_memory_mib=1024, disk_size="3G", detached=True
    )
    seen = await guest(sb)
    assert seen["nproc"] == 1 and seen["mem"] < 300, seen  # the balloon took the rest: MemTotal follows
    assert seen["disk"] > 2900, seen  # the image's 2 GiB root grown online to the 3 GiB disk
    info = await sb.inspect()
    assert info.requested is not None and info.applied is not None
    assert (info.requested.vcpus, info.requested.max_vcpus, info.requested.disk_size_mib) == (1, 2, 3072)
    assert (info.applied.vcpus, info.applied.memory_mib, info.applied.max_memory_mib) == (1, 256, 1024)
    assert info.applied.settled and info.updated_at == 0
    assert cpu_quota(reg) in (None, 1 + JAIL_CPU_HEADROOM)  # (None: no cgroup cpu controller)

    # a dry run (CLI) plans and changes nothing
    r = await cli(work, "modify", "m", "--cpus", "2", "--memory", "768", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["dry_run"] and not plan["applied"]
    assert [c["status"] for c in plan["changes"]] == ["applied_live", "applied_live"]
    assert (await guest(sb))["nproc"] == 1 and (await sb.inspect()).updated_at == 0

    # live, over gRPC: two vCPUs and 768 MiB, settled before the answer
    resp = await trio.to_thread.run_sync(lambda: ours.Modify(sv.ModifyRequest(id="m", vcpus=2, memory_mib=768)))
    assert resp.applied and resp.settled, resp
    assert [(c.kind, c.status) for c in resp.changes] == [("cpus", "applied_live"), ("memory", "applied_live")]
    seen = await guest(sb)
    assert seen["nproc"] == 2 and seen["mem"] > 700, seen
    assert cpu_quota(reg) in (None, 2 + JAIL_CPU_HEADROOM)  # enforced at once
    r = await sb.run(["python3", "-c", "b = bytearray(600 << 20); print(len(b) >> 20)"])
    assert r.stdout == b"600\n", r.stderr
    details = await trio.to_thread.run_sync(lambda: ours.Inspect(sv.InspectRequest(id="m")))
    assert (details.applied.vcpus, details.applied.memory_mib, details.base.state) == (2, 768, "ready")
    assert details.updated_at > 0

    # above the ceiling: refused without --restart (SDK), nothing changed
    p = await sb.modify(memory_mib=2048, env={"STAGE": "two"})
    assert not p.applied and p.changes[0].status == "needs_restart" and "--restart" in p.changes[0].why
    assert (await sb.inspect()).requested.memory_mib == 768  # type: ignore[union-attr]
    # with --restart (CLI): a new machine with the new ceiling, ready again
    r = await cli(work, "modify", "m", "--memory", "2048", "--env", "STAGE=two", "--restart")
    assert r.returncode == 0, r.stderr
    assert b"applied_by_restart" in r.stdout and b"processes end" in r.stdout
    info = await sb.inspect()
    assert info.state == "ready" and info.applied is not None
    assert (info.applied.memory_mib, info.applied.max_memory_mib, info.applied.vcpus) == (2048, 2048, 2)
    seen = await guest(sb)
    assert seen["mem"] > 1900 and seen["nproc"] == 2, seen
    assert (await sb.run("echo $STAGE")).stdout == b"two\n"  # env: future runs

    # stopped: saved for the next boot; the disk grows then (grow only)
    await sb.stop()
    p = await sb.modify(cpus=1, disk_size="4G")
    assert p.applied and {c.status for c in p.changes} == {"applied_at_next_boot"}
    assert (await sb.modify(disk_size="1G")).changes[0].status == "refused"
    await sb.start()
    seen = await guest(sb)
    assert seen["nproc"] == 1 and seen["disk"] > 3900, seen
    assert (await sb.inspect()).applied.disk_size_mib == 4096  # type: ignore[union-attr]
    r = await cli(work, "inspect", "m")
    assert b"requested" in r.stdout and b"disk 4096 MiB" in r.stdout
    await sb.remove(force=True)


async def _oci_root_grows(work: Workdir, tmp_path: Path) -> None:
    """An OCI image's root (mkfs.ext4 -d by the converter) grows online as the default image's does."""
    layout = tmp_path / "layout"
    old = os.umask(0o022)
    try:
        build_image(layout, "bb", [Layer(busybox_tree(tmp_path / "bb"))])
    finally:
        os.umask(old)
    sb = await AsyncSandbox.create(
        "o", socket=str(work.socket), image=f"oci:{layout}:bb", disk_size="3G", detached=True
    )
    r = await sb.run(["/bin/busybox", "df", "-m", "/"])
    size = int(r.stdout.decode().splitlines()[-1].split()[1])
    assert size > 2900, r.stdout
    await sb.remove(force=True)
