"""Each cause of death produced for real, on real VMs (TCG): a guest's poweroff
(exited), a kernel panic (``echo c > /proc/sysrq-trigger``: guest_panic, crashed),
QEMU killed by SIGKILL (qemu_died, crashed), the TTL (drained, then stopped, its
source ttl), a drain that refuses new work, an out-of-memory kill inside the guest
(the sandbox lives on: a killed process is not its death), and a supervisor killed
with -9 whose sandbox's QEMU is gone at restart (host_restart). The boots run side by
side under one supervisor where they can."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import trio

from images.build import Image
from supervisor.client import AsyncSandbox, FailedPrecondition, SandboxError, connect
from supervisor.main.throwaway import Workdir, supervisor, supervisor_process, workdir
from tests.support.client import wait_state


async def _stopped(sb: AsyncSandbox, timeout: float = 120) -> dict[str, object]:
    with trio.fail_after(timeout):
        result = await sb.wait_until_stopped()
    info = await sb.inspect()
    return {"status": result.status, "source": result.source, "signal": result.signal, "info": info}


async def test_each_death_has_its_cause(image: Image) -> None:
    with workdir("lt") as work:
        async with supervisor(work) as (_cfg, reg):
            sock = work.socket
            with trio.fail_after(300):
                names = ("off", "panic", "killed", "ttl", "drained")
                made: dict[str, AsyncSandbox] = {}

                async def make(name: str) -> None:
                    extra = {"ttl": 25, "ttl_action": "stop"} if name == "ttl" else {}
                    made[name] = await AsyncSandbox.create(name, socket=sock, detached=True, **extra)  # type: ignore[arg-type]

                async with trio.open_nursery() as n:
                    for name in names:
                        n.start_soon(make, name)
                off, panic, killed, ttl, drained = (made[n] for n in names)

                # the guest powers off on its own: stopped, exited
                with pytest.raises(SandboxError):
                    await off.run(["sh", "-c", "sync; echo o > /proc/sysrq-trigger; sleep 30"])
                got = await _stopped(off)
                assert (got["status"], got["source"]) == ("stopped", "guest-exit"), got

                # a kernel panic: crashed, detected on the console
                with pytest.raises(SandboxError):
                    await panic.run(["sh", "-c", "echo c > /proc/sysrq-trigger; sleep 30"])
                got = await _stopped(panic)
                assert (got["status"], got["source"]) == ("crashed", "guest-panic"), got
                assert "Kernel panic" in got["info"].cause.detail  # type: ignore[attr-defined]
                assert got["info"].error.startswith("crashed: the guest kernel panicked")  # type: ignore[attr-defined]

                # QEMU killed by a signal: crashed, its signal
                os.kill(reg.get("killed").record.qemu_pid, signal.SIGKILL)
                got = await _stopped(killed)
                assert (got["status"], got["source"], got["signal"]) == ("crashed", "qemu-died", 9), got

                # a drain: new work refused (naming draining), the work in flight ends, then it stops
                async with trio.open_nursery() as n:
                    outputs: list[object] = []

                    async def work_in_flight() -> None:
                        outputs.append(await drained.run(["sh", "-c", "sleep 3; echo done"]))

                    n.start_soon(work_in_flight)
                    await trio.sleep(1)
                    await drained.drain(grace=60)
                    assert (await drained.inspect()).state == "draining"
                    with pytest.raises(FailedPrecondition, match="draining"):
                        await drained.run(["true"])
                got = await _stopped(drained)
                assert outputs and outputs[0].stdout == b"done\n"  # type: ignore[attr-defined]
                assert (got["status"], got["source"]) == ("stopped", "drain"), got

                # its maximum duration: drained and stopped, kept
                got = await _stopped(ttl, timeout=120)
                assert (got["status"], got["source"]) == ("stopped", "ttl"), got
                assert reg.get("ttl").state == "stopped"


async def test_an_oom_kill_in_the_guest_is_not_the_sandbox_s_death(image: Image) -> None:
    with workdir("lo") as work:
        async with supervisor(work):
            with trio.fail_after(240):
                sb = await AsyncSandbox.create("oom", socket=work.socket, detached=True, memory_mib=128)
                # tail keeps /dev/zero's one endless line: it grows until the OOM killer takes it
                r = await sb.run(["sh", "-c", "tail /dev/zero; echo status=$?"])
                assert b"status=137" in r.stdout, r
                dmesg = await sb.run(["dmesg"])
                assert b"Out of memory" in dmesg.stdout or b"oom-kill" in dmesg.stdout
                assert (await sb.inspect()).state == "ready"  # it lives on
                assert (await sb.run(["echo", "alive"])).stdout == b"alive\n"
                await sb.stop()
                assert (await sb.wait_until_stopped()).source == "user"


def test_a_sandbox_whose_qemu_died_with_its_supervisor_is_lost_at_restart(image: Image) -> None:
    """kill -9 of the supervisor, then of the sandbox's QEMU: the next supervisor finds it
    gone (host_restart), says so in Inspect, sandbox.v1's error and the CLI."""
    with workdir("lh") as work:
        with supervisor_process(work) as (env, proc):
            pid = trio.run(_made, work)
            proc.kill()
            proc.wait()
            os.kill(pid, signal.SIGKILL)
        with supervisor_process(work) as (env, _proc):
            info = trio.run(_inspect, work)
            assert info["state"] == "failed", info
            assert info["cause"]["ending"] == "host_restart" and info["cause"]["source"] == "host-restart"
            assert info["error"].startswith("lost at a supervisor restart")
            out = subprocess.run(
                [sys.executable, "-m", "supervisor.main.cli", "wait", "lost"],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            assert out.returncode == 1 and "lost at a supervisor restart" in out.stdout, out


async def _made(work: Workdir) -> int:
    async with connect(work.socket) as c:
        await c.call("Create", {"id": "lost"})
        await wait_state(c, "lost", "ready")
        return _pid(work)


def _pid(work: Workdir) -> int:
    import sqlite3

    db = sqlite3.connect(str(work.state / "sandvisor.db"))
    (pid,) = db.execute("SELECT qemu_pid FROM sandboxes WHERE id='lost'").fetchone()
    db.close()
    return int(pid)


async def _inspect(work: Workdir) -> dict[str, object]:
    async with connect(work.socket) as c:
        return dict(await c.call("Inspect", {"id": "lost"}))
