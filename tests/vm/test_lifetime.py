"""Each cause of death produced for real, on real VMs (TCG): a guest's poweroff
(exited), a kernel panic (``echo c > /proc/sysrq-trigger``: guest_panic, crashed),
QEMU killed by SIGKILL (qemu_died, crashed), the TTL (drained, then stopped, its
source ttl), a drain that refuses new work, an out-of-memory kill inside the guest
(the sandbox lives on: a killed process is not its death), and a supervisor killed
with -9 whose sandbox's QEMU is gone at restart (host_restart). The boots run side by
side under one supervisor where they can."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from contextlib import aclosing

import pytest
import trio

from images.build import Image
from supervisor.client import AsyncSandbox, FailedPrecondition, Init, SandboxError, connect
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


async def _first_event(sb: AsyncSandbox, action: str) -> dict[str, str]:
    """The sandbox's first ``action`` event, from the event log (since its start): no race."""
    async with aclosing(sb.events(action=action, since=0)) as events:
        async for e in events:
            return dict(e.attributes)
    raise AssertionError(f"no {action} event")


async def test_an_oom_kill_in_the_guest_is_not_the_sandbox_s_death(image: Image) -> None:
    """The guest's OOM killer ends a process, not the sandbox: the Run says so (SIGKILL,
    oom_killed), an oom_kill event names the process, the guest's count says one more."""
    with workdir("lo") as work:
        async with supervisor(work):
            with trio.fail_after(240):
                sb = await AsyncSandbox.create("oom", socket=work.socket, detached=True, memory_mib=128)
                # tail keeps /dev/zero's one endless line: it grows until the OOM killer takes it
                r = await sb.run(["tail", "/dev/zero"])
                assert (r.exit_code, r.oom_killed) == (137, True), r
                event = await _first_event(sb, "oom_kill")
                assert (event["process"], event["by"], event["constraint"]) == ("tail", "guest", "CONSTRAINT_NONE")
                assert int(event["pid"]) > 1 and int(event["anon_rss_kb"]) > 32 << 10, event
                idle = await _first_event(sb, "idle")  # the Run's end (the sandbox's first)
                assert (idle["exit_code"], idle["oom_killed"]) == ("137", "true"), idle
                dmesg = await sb.run(["dmesg"])
                assert b"Out of memory" in dmesg.stdout or b"oom-kill" in dmesg.stdout
                assert (await sb.metrics()).guest_oom_kills == 1
                info = await sb.inspect()
                assert (info.state, info.guest_oom_kills) == ("ready", 1)  # it lives on
                # the CLI says so, and exits with the process's status
                env = {**os.environ, "SANDVISOR_SOCKET": str(work.socket)}
                for verb in ("run", "exec"):  # (an Exec session's exit says it too)
                    argv = [sys.executable, "-m", "supervisor.main.cli", verb, "oom", "--", "tail", "/dev/zero"]
                    run = functools.partial(subprocess.run, argv, env=env, capture_output=True, text=True, check=False)
                    out = await trio.to_thread.run_sync(run)
                    assert out.returncode == 137 and "killed: out of memory" in out.stderr, out
                assert (await sb.metrics()).guest_oom_kills == 3
                r = await sb.run(["sh", "-c", "kill -9 $$"])  # a SIGKILL of another's is not an OOM kill
                assert (r.exit_code, r.oom_killed) == (137, False), r
                assert (await sb.run(["echo", "alive"])).stdout == b"alive\n"
                await sb.stop()
                assert (await sb.wait_until_stopped()).source == "user"


# PID 1 (an init the sandbox handed off to) runs a hog and exits with its status: the
# kernel panics ("Attempted to kill init!") right after the OOM killer's line
OOM_INIT = "until [ -e /run/go ]; do sleep 0.1; done; tail /dev/zero; exit $?"


async def test_an_init_ended_by_the_guest_s_oom_killer_is_out_of_memory(image: Image) -> None:
    """The sandbox's own workload killed by the guest's OOM killer ends it: crashed, out
    of memory by the guest (Inspect, WaitUntilStopped, its failed event), the process
    named. A kernel that panics on OOM (vm.panic_on_oom) is a panic, its detail OOM's."""
    with workdir("li") as work:
        async with supervisor(work):
            with trio.fail_after(300):
                made: dict[str, AsyncSandbox] = {}

                async def make(name: str, **kw: object) -> None:
                    made[name] = await AsyncSandbox.create(name, socket=work.socket, memory_mib=128, **kw)  # type: ignore[arg-type]

                async with trio.open_nursery() as n:
                    n.start_soon(functools.partial(make, "initoom", init=Init.cmd("/bin/sh", args=["-c", OOM_INIT])))
                    n.start_soon(functools.partial(make, "panicoom", detached=True))
                init, panic = made["initoom"], made["panicoom"]

                await init.run(["touch", "/run/go"])  # (ready first: then the init's hog starts)
                got = await _stopped(init)
                assert (got["status"], got["source"]) == ("crashed", "oom"), got
                cause = got["info"].cause  # type: ignore[attr-defined]
                assert (cause.ending, cause.by) == ("out_of_memory", "guest"), cause
                assert "tail (pid" in cause.detail and "status 137" in cause.detail, cause
                assert got["info"].error.startswith("out of memory: the guest's OOM killer")  # type: ignore[attr-defined]
                failed = await _first_event(init, "failed")
                assert (failed["cause"], failed["by"]) == ("out_of_memory", "guest"), failed

                with pytest.raises(SandboxError):
                    await panic.run(["sh", "-c", "echo 1 > /proc/sys/vm/panic_on_oom && tail /dev/zero"])
                got = await _stopped(panic)
                assert (got["status"], got["source"]) == ("crashed", "guest-panic"), got
                assert "Out of memory" in got["info"].cause.detail  # type: ignore[attr-defined]


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
