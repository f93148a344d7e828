"""Hibernation against a real `sandvisor serve` and real VMs: a paused
sandbox has no QEMU and comes back as itself -- its processes and memory, its ports
(auto-resume on a connection), its address; the idle policy pauses; auto-resume off
refuses; a paused sandbox survives a supervisor's kill -9. One supervisor for the
module; the restart test has its own."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.recovery import our_qemus
from images.build import Image
from supervisor.client import AsyncSandbox, FailedPrecondition, connect
from supervisor.main.throwaway import supervisor_process, workdir
from supervisor.wire.protocol import ApiError
from tests.support.client import COUNTER, run, wait_state
from tests.support.netlab import probe
from tests.support.vms import serve_process

pytestmark = pytest.mark.vm

# answers each connection with one line: "up <the counter>" (an HTTP-less echo of its state)
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
while True:
    c, _ = s.accept()
    c.sendall(("up " + open("/run/cnt").read().strip() + "\\n").encode()); c.close()
"""


@pytest.fixture(scope="module")
def served(image: Image) -> Iterator[dict[str, Any]]:
    with serve_process("sv-hib-", reachable=True) as (env, work):
        yield {"env": env, "sock": str(work / "s.sock"), "run_root": work / "run", "state": work / "state"}


async def counter(sb: AsyncSandbox) -> int:
    r = await sb.run(["sh", "-c", "cat /run/cnt 2>/dev/null || echo 0"])
    assert r.exit_code == 0, r
    return int(r.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


async def test_pause_frees_qemu_and_resume_continues_the_processes(served: dict[str, Any]) -> None:
    sock, run_root = served["sock"], served["run_root"]
    with trio.fail_after(300):
        async with await AsyncSandbox.create("count", socket=sock, labels={"k": "v"}) as sb:
            await sb.run(["sh", "-c", f"({COUNTER}) >/dev/null 2>&1 &"])
            with trio.fail_after(30):
                while await counter(sb) < 3:
                    await trio.sleep(0.1)
            before = await sb.inspect()
            [pid] = our_qemus(run_root)
            assert (await sb.metrics()).host_rss_bytes > 0
            events: list[str] = []
            async with connect(sock) as ec, ec.open_call("Events", {}) as stream:

                async def watch() -> None:
                    async for ev in stream:
                        if ev["sandbox_id"] == "count":
                            events.append(ev["action"])

                async with trio.open_nursery() as n:
                    n.start_soon(watch)
                    info = await sb.pause()
                    assert info.state == "paused"
                    at_pause = int((await sb.inspect()).created_at)
                    # no QEMU: the process is gone (and its RSS with it)
                    assert not alive(pid) and not our_qemus(run_root)
                    listed = await AsyncSandbox.list(labels={"k": "v"}, socket=sock)
                    assert [(s.id, s.state) for s in listed.sandboxes] == [("count", "paused")]
                    await trio.sleep(1.0)  # paused time: the counter must not move
                    info = await sb.resume()
                    assert info.state == "ready"
                    with trio.fail_after(10):
                        while events[-2:] != ["paused", "resumed"]:
                            await trio.sleep(0.05)
                    n.cancel_scope.cancel()
            assert "stopped" not in events and "ready" not in events[events.index("paused") :], events
            after = await sb.inspect()
            # the same sandbox: identity, labels, creation time (its TTL's clock), address
            assert (after.id, after.labels, after.created_at, after.ready_at) == (
                before.id,
                before.labels,
                at_pause,
                before.ready_at,
            )
            assert after.network.ip_address == before.network.ip_address
            [pid2] = our_qemus(run_root)
            assert pid2 != pid
            # the loop went on from where it was (not restarted) and keeps rising
            first = await counter(sb)
            await trio.sleep(0.5)
            second = await counter(sb)
            assert 3 <= first < second, (first, second)

            # a call that needs the guest resumes it (auto-resume). (This pause is streamed:
            # the resumed guest's RAM maps the first pause's file; a helper QEMU may be
            # converting it to mapped now, so only the sandbox's own QEMU is checked.)
            await sb.pause()
            assert not alive(pid2)
            third = await counter(sb)
            assert third >= second and await sb.state() == "ready"
            await sb.remove()


def own_chain(disk: Path, state: Path) -> tuple[int, int]:
    """(depth, allocated bytes) of a sandbox's disk chain as its headers say (the
    overlay and every layer under the state dir but the built image)."""
    out = subprocess.run(
        ["qemu-img", "info", "-U", "--backing-chain", "--output=json", str(disk)],
        capture_output=True,
        text=True,
        check=True,
    )
    files = [Path(x["filename"]) for x in json.loads(out.stdout)]
    mine = [f for f in files if f.resolve().is_relative_to(state.resolve()) and "images" not in f.parts]
    return len(files), sum(f.stat().st_blocks * 512 for f in mine)


CYCLES = 20


def write_mark(i: int) -> list[str]:
    """Rewrite a 2 MiB file in place (the same disk blocks each time) and keep its hash
    in a mark file of its own; both on the disk (fsync, sync)."""
    return [
        "sh",
        "-c",
        "dd if=/dev/urandom of=/root/data bs=1M count=2 conv=notrunc,fsync status=none && "
        f"sha256sum /root/data | cut -d' ' -f1 | tee /root/mark-{i} && sync",
    ]


async def pause_resume(
    sb: AsyncSandbox, disk: Path, state: Path, i: int, sums: list[str]
) -> tuple[int, int, float, float]:
    """One cycle: a write, a pause, the chain measured while paused, a resume."""
    r = await sb.run(write_mark(i))
    assert r.exit_code == 0, r
    sums.append(r.stdout.decode().strip())
    t0 = time.monotonic()
    await sb.pause()
    t1 = time.monotonic()
    depth, used = own_chain(disk, state)
    await sb.resume()
    return depth, used, t1 - t0, time.monotonic() - t1


async def check_marks(sb: AsyncSandbox, sums: list[str]) -> None:
    """Every mark and the last data, read back from the disk (not the page cache)."""
    check = "echo 3 > /proc/sys/vm/drop_caches; " + "; ".join(f"cat /root/mark-{i}" for i in range(len(sums)))
    r = await sb.run(["sh", "-c", check + "; sha256sum /root/data | cut -d' ' -f1"])
    assert r.exit_code == 0, r
    assert r.stdout.decode().split() == [*sums, sums[-1]]


async def test_pause_resume_cycles_keep_the_disk_chain_bounded(served: dict[str, Any]) -> None:
    """20 pauses and resumes with writes in between: each resume merges the layer its
    pause froze back into the overlay (block-stream), so the chain's depth and the
    sandbox's disk bytes stay where the first pause left them (a 2 MiB file rewritten
    in place each time would otherwise leave a 2 MiB layer per cycle), and what was
    written before every pause is read back from the disk after the last resume."""
    sock, state = served["sock"], served["state"]
    before = set(os.listdir(state / "sandboxes"))
    with trio.fail_after(1200):
        sb = await AsyncSandbox.create("cycles", socket=sock)
        try:
            [uid] = set(os.listdir(state / "sandboxes")) - before
            disk = state / "sandboxes" / uid / "disk.qcow2"
            sums: list[str] = []
            rows = [await pause_resume(sb, disk, state, i, sums) for i in range(CYCLES)]
            print("\ncycle depth bytes pause_s resume_s")
            for i, (depth, used, p, r_) in enumerate(rows, 1):
                print(f"{i:5} {depth:5} {used:9} {p:7.2f} {r_:8.2f}")
            await check_marks(sb, sums)
            merged = [e.data.decode() for e in await sb.logs(sources=["system"]) if b"merged into it" in e.data]
            print("\n".join(merged))
            assert len(merged) >= CYCLES - 1, merged  # (the last resume's may still run)
            assert {d for d, _, _, _ in rows} == {rows[0][0]}, rows  # one frozen layer while paused, every time
            assert rows[-1][1] <= rows[0][1] + (8 << 20), rows  # what the first pause left, and the marks
        finally:
            await sb.remove(force=True)


def test_a_resumed_sandbox_adopted_by_the_next_supervisor_merges_too(image: Image) -> None:
    """serve --keep-sandboxes stopped right after a resume (its merge done, under way or
    not begun): the next supervisor adopts the running QEMU, and its pauses merge what
    is left -- the chain as deep as at the first pause, every write intact."""
    sums: list[str] = []

    async def first(sock: Path, state: Path) -> tuple[Path, int]:
        with trio.fail_after(600):
            before = set(os.listdir(state / "sandboxes")) if (state / "sandboxes").exists() else set()
            sb = await AsyncSandbox.create("a", socket=sock)
            [uid] = set(os.listdir(state / "sandboxes")) - before
            disk = state / "sandboxes" / uid / "disk.qcow2"
            depth, _, _, _ = await pause_resume(sb, disk, state, 0, sums)
            r = await sb.run(write_mark(1))
            assert r.exit_code == 0, r
            sums.append(r.stdout.decode().strip())
            return disk, depth

    async def second(sock: Path, state: Path, disk: Path, depth: int) -> None:
        with trio.fail_after(600):
            sb = AsyncSandbox("a", socket=sock)
            assert await sb.state() == "ready"
            rows = [await pause_resume(sb, disk, state, i, sums) for i in range(2, 5)]
            assert [d for d, _, _, _ in rows] == [depth] * 3, rows
            await check_marks(sb, sums)
            await sb.remove(force=True)

    with workdir("sv-hib-adopt-", private_state=True) as work:
        with supervisor_process(work, "--keep-sandboxes") as (_, proc):
            disk, depth = trio.run(first, work.socket, work.state)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        with supervisor_process(work):
            trio.run(second, work.socket, work.state, disk, depth)


async def test_an_exposed_ports_first_connection_after_a_pause_is_served(served: dict[str, Any]) -> None:
    sock, port = served["sock"], free_port()
    with trio.fail_after(300):
        sb = await AsyncSandbox.create("web", socket=sock, network="user", ports={8000: port})
        try:
            await sb.fs.write("/tmp/srv.py", SERVER.encode())
            await sb.run(["sh", "-c", f"({COUNTER}) >/dev/null 2>&1 & python3 /tmp/srv.py 8000 >/dev/null 2>&1 &"])
            with trio.fail_after(60):
                while not (await fetch(port)).startswith("up "):
                    await trio.sleep(0.2)
            await sb.pause()
            assert await sb.state() == "paused"
            # the host port stays ours while paused: nobody else can bind it
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
            got = await fetch(port, timeout=60)  # held, then served once the guest is back
            assert got.startswith("up "), got
            assert await sb.state() == "ready"
        finally:
            await sb.remove(force=True)


async def fetch(port: int, timeout: float = 5.0) -> str:
    def get() -> str:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
                return c.recv(100).decode()
        except OSError as exc:
            return type(exc).__name__

    return await trio.to_thread.run_sync(get)


async def test_idle_pause_then_a_run_resumes(served: dict[str, Any]) -> None:
    sock = served["sock"]
    with trio.fail_after(300):
        sb = await AsyncSandbox.create("idle", socket=sock, idle_timeout=2, on_idle="pause")
        try:
            async with connect(sock) as c:
                await wait_state(c, "idle", "paused", timeout=120)
            r = await sb.run(["echo", "back"])
            assert r.stdout == b"back\n" and await sb.state() == "ready"
        finally:
            await sb.remove(force=True)


async def test_auto_resume_off_refuses_until_resumed(served: dict[str, Any]) -> None:
    sock = served["sock"]
    with trio.fail_after(300):
        sb = await AsyncSandbox.create("manual", socket=sock, auto_resume=False)
        try:
            await sb.pause()
            with pytest.raises(FailedPrecondition):
                await sb.run(["true"])
            assert await sb.state() == "paused"
            # the CLI's resume
            out = subprocess.run(
                [sys.executable, "-m", "supervisor.main.cli", "resume", "manual"],
                env=served["env"],
                capture_output=True,
                text=True,
                check=False,
            )
            assert out.returncode == 0 and "ready" in out.stdout, out
            assert (await sb.run(["true"])).exit_code == 0
        finally:
            await sb.remove(force=True)


def test_a_paused_sandbox_survives_a_supervisor_kill_9(image: Image) -> None:
    async def pause_it(sock: Path) -> int:
        with trio.fail_after(300):
            async with connect(sock) as c:
                await c.call("Create", {"id": "p"})
                await wait_state(c, "p", "ready")
                await run(c, "p", ["sh", "-c", f"({COUNTER}) >/dev/null 2>&1 &"])
                await trio.sleep(1.0)
                out, _ = await run(c, "p", ["cat", "/run/cnt"])
                info = await c.call("Pause", {"id": "p"})
                assert info["state"] == "paused"
                return int(out)

    async def resume_it(sock: Path, before: int) -> None:
        with trio.fail_after(300):
            async with connect(sock) as c:
                assert (await c.call("Inspect", {"id": "p"}))["state"] == "paused"
                info = await c.call("Resume", {"id": "p"})
                assert info["state"] == "ready"
                out, _ = await run(c, "p", ["cat", "/run/cnt"])
                assert int(out) >= before, (out, before)
                # --max-paused 1: a second paused sandbox is refused; it runs on
                await c.call("Pause", {"id": "p"})
                await c.call("Create", {"id": "q"})
                await wait_state(c, "q", "ready")
                with pytest.raises(ApiError) as refused:
                    await c.call("Pause", {"id": "q"})
                assert refused.value.code == "RESOURCE_EXHAUSTED" and "--max-paused" in refused.value.message
                assert (await c.call("Inspect", {"id": "q"}))["state"] == "ready"
                for id in ("p", "q"):
                    await c.call("Remove", {"id": id, "force": True})

    with workdir("sv-hib-kill-", private_state=True) as work:
        with supervisor_process(work) as (_, proc):
            before = trio.run(pause_it, work.socket)
            proc.kill()
            proc.wait(timeout=60)
        assert not our_qemus(work.run_root)
        with supervisor_process(work, "--max-paused", "1"):
            trio.run(resume_it, work.socket, before)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, TAP, jail)")
async def test_a_tap_sandbox_keeps_its_address_and_a_connection_to_it_resumes_it(image: Image) -> None:
    """In a network namespace of its own (tests/test_net_supervisor.py's lab): a tap
    sandbox paused keeps its address; a connection from the host to that address while
    it is paused waits in its TAP's queue and is answered once it is back."""
    from actors.model import State
    from tests.support.taplab import net_lab, reach, ready, serving, start_server, tap

    async with net_lab("sv-hib-tap-") as lab, serving(lab) as reg:
        with trio.fail_after(400):
            sb = await ready(await reg.create("t", tap()))
            address = sb.ip_address
            await start_server(sb)
            await reach(lab.host, address, 8000, f"vm {address} 10.88.0.1")
            await reg.pause("t")
            assert sb.state == State.PAUSED and sb.ip_address == address and sb.guest is None
            got = await probe(lab.host, address, 8000, timeout=90)  # held in the TAP, then served
            assert got == f"vm {address} 10.88.0.1", got
            with trio.fail_after(60):  # (the guest answers during the resume's last steps)
                while sb.state != State.READY:
                    await trio.sleep(0.05)
            assert sb.ip_address == address
            await reg.remove("t", force=True)
