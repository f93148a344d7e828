"""Containment against real VMs: every QEMU jailed as its own user, in its
own namespaces and cgroup, without privileges, reaching only its own files."""

from __future__ import annotations

import grp
import os
import stat
import subprocess
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.errors import DomainError
from actors.registry import Registry
from actors.sandboxes.sandbox import Sandbox
from images.build import Image
from supervisor.main.throwaway import supervisor, workdir
from supervisor.wire import protocol
from supervisor.wire.config import default_memory_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="jails need a root supervisor")


def status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


async def ready(reg: Registry, id: str, **cfg: Any) -> Sandbox:
    from actors.model import SandboxConfig

    sb = await reg.create(id, SandboxConfig(**cfg))
    with trio.fail_after(120):
        await sb.ready_event.wait()
    assert sb.state == "ready", sb.record.error
    return sb


@pytest.fixture
async def jailed(image: Image) -> AsyncIterator[tuple[Registry, Path]]:
    with workdir("sv-jail-") as work:
        async with supervisor(work) as (_, reg):
            assert reg.settings.cells is not None, "a root supervisor jails every QEMU"
            yield reg, work.root


def run_as(uid: int, code: str) -> str:
    """Python as another user (a sandbox's uid: what an escaped QEMU could do)."""
    r = subprocess.run(
        ["/usr/bin/python3", "-S", "-c", code],  # (the system's: /work is not the sandbox user's)
        user=uid,
        group=uid,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    return (r.stdout + r.stderr).strip()


async def test_each_qemu_is_jailed_as_its_own_user(jailed: tuple[Registry, Path]) -> None:
    reg, _ = jailed
    a = await ready(reg, "a")
    b = await ready(reg, "b")
    uids = []
    for sb in (a, b):
        pid = sb.record.qemu_pid
        st = status(pid)
        ids = set(st["Uid"].split()) | set(st["Gid"].split())
        assert len(ids) == 1, st["Uid"]  # real, effective, saved, fs: one id, for uid and gid
        uid = int(ids.pop())
        assert uid not in (0, 65534) and uid >= 1_000_000
        uids.append(uid)
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
        assert int(st["CapEff"], 16) == int(st["CapPrm"], 16) == int(st["CapBnd"], 16) == 0
        assert st["Groups"] == ""
        for ns in ("mnt", "pid", "net", "ipc", "uts"):
            assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
        cell = sb.cell
        assert cell is not None
        root, jail_dir = os.stat(f"/proc/{pid}/root"), os.stat(cell.spec.root)  # its "/" is the jail dir
        assert (root.st_dev, root.st_ino) == (jail_dir.st_dev, jail_dir.st_ino)
        # every descriptor QEMU holds is its own: no file of the supervisor or another sandbox
        img = reg.settings.image
        chain = [Path(p).parent for p in sb.record.chain]  # its disk's layers (a template's disk, the base)
        own = (sb.files.dir, sb.files.run_dir, img.kernel.parent, img.initrd.parent, img.rootfs.parent, *chain)
        allowed_dirs = (*(str(d) for d in own), "/dev/")
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:  # closed since the listing (a restore's stream, a copy's memfd)
                continue
            if target.startswith(("socket:", "anon_inode:", "pipe:", "/memfd:")):
                continue
            # the discard shim (a clone's balloon on privately mapped RAM): a root-owned,
            # read-only library the helper hands over
            shim = reg.settings.cells.discard_shim if reg.settings.cells is not None else None
            assert target.startswith(allowed_dirs) or target in (str(cell.ram), str(shim)), target
        assert cell.cgroup is not None
        stats = cell.cgroup.stats()
        assert stats.memory_limit == (256 + 192) << 20
        m = await sb.metrics()  # the cgroup's use and limit, in the sandbox's metrics
        assert m.cgroup_memory_limit_bytes == (256 + 192) << 20
        assert 0 < m.cgroup_memory_bytes < m.cgroup_memory_limit_bytes and m.cgroup_oom_kills == 0
    assert uids[0] != uids[1]


async def test_a_sandbox_user_cannot_touch_another_sandbox_or_snapshot(jailed: tuple[Registry, Path]) -> None:
    reg, root = jailed
    a = await ready(reg, "a")
    b = await ready(reg, "b")
    snap, _ = await reg.checkpoint("b", name="s")
    # a booted (a RAM file of its own); b was restored from the boot template (a sealed memfd)
    assert a.cell is not None and b.cell is not None and a.cell.ram is not None
    uid_b = b.cell.identity.uid
    for path in (
        a.cell.ram,
        snap.path / "memory",
        snap.path / "vmstate",
        a.files.disk,
        root / "state" / "sandvisor.db",
    ):
        code = (
            f"import os\ntry: os.open({str(path)!r}, os.O_RDWR); print('opened')\nexcept OSError as e: print(e.errno)"
        )
        got = run_as(uid_b, code)
        assert got in ("13", "2"), (path, got)  # EACCES (or ENOENT: not even reachable)
    got = run_as(uid_b, f"open('/proc/{a.record.qemu_pid}/mem','rb')")
    assert "Permission" in got or "denied" in got, got


async def test_a_memory_dir_someone_else_made_is_refused(image: Image) -> None:
    with workdir("sv-jail-mem-") as work:
        mem = default_memory_dir(work.state)
        assert mem is not None
        os.mkdir(mem, 0o700)
        try:
            os.chown(mem, 65534, 65534)  # made by another user first
            with pytest.raises(BaseException) as e:
                async with supervisor(work):
                    pass
            assert "someone else made it" in str(e.value) or "belongs to uid 65534" in repr(e.value)
        finally:
            os.rmdir(mem)


async def test_a_guest_over_its_memory_limit_fails_alone(image: Image) -> None:
    with workdir("sv-jail-oom-") as work, trio.fail_after(300):
        async with supervisor(work, jail_overhead_mib=0, templates=False) as (_, reg):
            from actors.model import Limits

            victim = await ready(reg, "victim", limits=Limits(memory_mib=512))
            bystander = await ready(reg, "bystander")
            sub = reg.events.subscribe("victim", "failed")
            with pytest.raises(DomainError):
                # guest RAM + QEMU's own memory cannot fit in a limit of guest RAM alone
                out = victim.run_workload(
                    ["python3", "-c", "b = bytearray(440 << 20); import time; time.sleep(30)"], env={}
                )
                async with aclosing(out):
                    async for _ in out:
                        pass
            with trio.fail_after(60):
                ev = await sub.__anext__()
            assert "memory limit" in ev.attributes["error"], ev
            assert victim.state == "crashed"  # (it died on its own: the cgroup's kill; its event is "failed")
            m = await bystander.metrics()
            assert m.uptime_seconds > 0 and bystander.state == "ready"


def hello_as(uid: int, gid: int, groups: list[int], sock: Path) -> protocol.Envelope:
    """The supervisor's first answer to a hello from a process of ``uid``/``gid``."""
    code = f"""
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(20)
try:
    s.connect({str(sock)!r})
except OSError as e:
    print("connect:", e.strerror); sys.exit()
s.sendall(bytes.fromhex({protocol.encode(protocol.ClientHello(protocol.PROTOCOL_VERSION, "test")).hex()!r}))
data = b""
while (len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big")) and (chunk := s.recv(65536)):
    data += chunk  # one frame: the answer to the hello
print(data.hex())
"""
    r = subprocess.run(
        ["/usr/bin/python3", "-S", "-c", code],
        user=uid,
        group=gid,
        extra_groups=groups,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    out = r.stdout.strip()
    if out.startswith("connect:"):
        raise PermissionError(out)
    reader = protocol.FrameReader()
    reader.feed(bytes.fromhex(out))
    body = reader.next()
    assert body is not None, out
    return protocol.decode(body)


async def test_only_root_and_the_group_are_served(image: Image) -> None:
    users = grp.getgrnam("users").gr_gid
    with workdir("sv-peers-") as work, trio.fail_after(60):
        async with supervisor(work, group="users"):
            sock = work.socket
            assert stat.S_IMODE(sock.stat().st_mode) == 0o660 and sock.stat().st_gid == users
            member = await trio.to_thread.run_sync(hello_as, 4242, 4242, [users], sock)
            assert isinstance(member, protocol.ServerHello)
            with pytest.raises(PermissionError):  # the first gate: the socket's mode
                await trio.to_thread.run_sync(hello_as, 4243, 4243, [], sock)
            sock.chmod(0o666)  # loosened by someone: peer credentials still decide
            refused = await trio.to_thread.run_sync(hello_as, 4243, 4243, [], sock)
            assert isinstance(refused, protocol.Fail) and refused.code == "PERMISSION_DENIED", refused
            assert "uid 4243 may not use this supervisor" in refused.message
            assert "group 'users'" in refused.message
