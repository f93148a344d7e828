"""The SDK (sync and async) and the CLI, end to end against a real `sandvisor serve`
process and real VMs. One supervisor for the module; a few sandboxes shared."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from images.build import Image
from supervisor.client import (
    AsyncSandbox,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Sandbox,
)
from tests.support.vms import serve_process


@pytest.fixture(scope="module")
def served(image: Image) -> Iterator[dict[str, str]]:
    with serve_process("sv-cli-") as (env, _):
        yield env


def cli(
    env: dict[str, str], *args: str, stdin: bytes = b"", timeout: float = 120
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=env,
        input=stdin,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


def test_sync_sdk(served: dict[str, str], tmp_path: Path) -> None:
    sock = served["SANDVISOR_SOCKET"]
    with Sandbox.create("sdk-sync", socket=sock, labels={"via": "sdk"}, env={"GREETING": "hi"}) as sb:
        assert sb.state() == "ready"
        r = sb.run("echo $GREETING from $(hostname); echo oops >&2; exit 2")
        assert (r.stdout, r.stderr, r.exit_code, r.ok) == (b"hi from sdk-sync\n", b"oops\n", 2, False)
        chunks = list(sb.run_stream(["sh", "-c", "echo a; echo b >&2"]))
        assert chunks[-1].stream == "exit" and chunks[-1].exit_code == 0
        assert {(c.stream, c.data) for c in chunks[:-1]} == {("stdout", b"a\n"), ("stderr", b"b\n")}
        blob = os.urandom(3 << 20)
        sb.fs.write("/root/blob", blob, mode=0o600)
        assert sb.fs.read("/root/blob") == blob
        local = tmp_path / "in.txt"
        local.write_text("copied in\n")
        sb.fs.copy_in(local, "/root/in.txt")
        sb.fs.copy_out("/root/in.txt", tmp_path / "out.txt")
        assert (tmp_path / "out.txt").read_text() == "copied in\n"
        assert sb.ping() > 0 and sb.touch() >= 1
        assert abs(sb.set_ttl(3600) - (time.time() + 3600)) < 120  # SetTtl: replaces the TTL
        assert cli(served, "ttl", "sdk-sync", "0").stdout == b"never\n"
        assert sb.metrics().memory_total_bytes > 0
        assert any(e.data == b"a\n" for e in sb.logs())
        first = next(iter(sb.log_stream(follow=True)))  # a sync generator over a live stream, closed early
        assert first.seq >= 1
        page = Sandbox.list(socket=sock, labels={"via": "sdk"})
        assert [s.id for s in page.sandboxes] == ["sdk-sync"]
        with pytest.raises(FailedPrecondition):
            sb.start()  # already running
    # leaving the block removed it
    with pytest.raises(NotFound):
        Sandbox.get("sdk-sync", socket=sock)
    with pytest.raises(InvalidArgument):
        Sandbox.create("x" * 129, socket=sock)


def test_async_sdk_exec_and_events(served: dict[str, str]) -> None:
    sock = served["SANDVISOR_SOCKET"]

    async def main() -> None:
        async with await AsyncSandbox.create("sdk-async", socket=sock, ephemeral=True) as sb:
            async with sb.exec(["sh", "-c", "read x; echo got $x"]) as proc:
                await proc.send(b"value\n")
                await proc.close_stdin()
                out = b"".join([o.data async for o in proc if o.stream == "stdout"])
            assert out == b"got value\n" and proc.exit_code == 0
            send, actions = trio.open_memory_channel[str](64)
            async with trio.open_nursery() as n:

                async def watch() -> None:
                    async for e in sb.events():
                        await send.send(e.action)

                n.start_soon(watch)
                with trio.fail_after(60):
                    while True:  # probe until the subscription is live: a run's events reach it
                        await sb.run(["true"])
                        with trio.move_on_after(1):
                            while await actions.receive() != "idle":
                                pass
                            break
                    await sb.run(["true"])
                    got = [await actions.receive(), await actions.receive()]
                n.cancel_scope.cancel()
            assert got == ["running", "idle"]
            await sb.stop()
            # ephemeral: removed once stopped
            with trio.fail_after(10):
                while True:
                    try:
                        await sb.inspect()
                    except NotFound:
                        break
                    await trio.sleep(0.1)

    trio.run(main)


def test_cli_surface(served: dict[str, str], tmp_path: Path) -> None:
    env = served
    r = cli(env, "create", "cli1", "--label", "team=x", "--env", "K=v", "--json")
    assert r.returncode == 0, r.stderr
    created = json.loads(r.stdout)
    assert created == {"id": "cli1", "state": "ready", "ip_address": ""}

    r = cli(env, "run", "cli1", "--env", "A=1", "--", "sh", "-c", "echo $A $K; echo e >&2; exit 9")
    assert (r.returncode, r.stdout, r.stderr) == (9, b"1 v\n", b"e\n")

    r = cli(env, "exec", "-i", "cli1", "--", "cat", stdin=b"through stdin\n")
    assert (r.returncode, r.stdout) == (0, b"through stdin\n")

    r = cli(env, "ls", "--label", "team=x", "--json")
    rows = json.loads(r.stdout)
    assert [(x["id"], x["state"], x["labels"]) for x in rows] == [("cli1", "ready", {"team": "x"})]
    assert set(rows[0]) == {"id", "state", "labels", "ip_address", "created_at"}

    info = json.loads(cli(env, "inspect", "cli1", "--json").stdout)
    assert set(info) == {
        "id",
        "state",
        "labels",
        "limits",
        "network",
        "created_at",
        "ready_at",
        "last_exited_at",
        "last_exit_code",
        "error",
        "uid",  # this life's identity (the id may be reused once it is gone): E2B tokens are bound to it
        "owner",  # the principal that made it (docs/security.md)
        "ssh_keys",  # the public keys serve --ssh lets in (docs/ssh.md)
        "requested",  # the read-back: configuration as requested, as applied
        "applied",
        "updated_at",
        "shell",  # the stored shell of shell() (docs/protocol.md)
        "init",  # the init PID 1 is handed to (docs/init.md)
        "pending",  # what a Modify saved for the next start (docs/modify.md)
        "cause",  # why its last life ended (docs/architecture.md)
        "parent",  # lineage and memory per branch (docs/fork.md)
        "parent_uid",
        "fork_snapshot",
        "forked_at",
        "memory_shared_bytes",
        "memory_own_bytes",
        "guest_oom_kills",  # the guest's OOM killer's kills in this life (docs/protocol.md)
    }
    assert info["last_exit_code"] == 9

    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(100_000))
    assert cli(env, "cp", str(src), "cli1:/root/f.bin").returncode == 0
    assert cli(env, "cp", "cli1:/root/f.bin", str(tmp_path / "back.bin")).returncode == 0
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()

    lines = [json.loads(x) for x in cli(env, "logs", "cli1", "--json").stdout.splitlines()]
    assert any(x["source"] == "stdout" and x["data"] == "1 v\n" for x in lines)

    assert cli(env, "ping", "cli1").stdout.endswith(b"ms\n")
    m = json.loads(cli(env, "metrics", "cli1", "--json").stdout)
    assert m["id"] == "cli1" and m["host_rss_bytes"] > 0

    ev = subprocess.Popen(
        [sys.executable, "-m", "supervisor.main.cli", "events", "--id", "cli1", "--json"],
        env=env,
        stdout=subprocess.PIPE,
    )
    try:
        assert ev.stdout is not None
        deadline = time.monotonic() + 60
        while True:  # probe until the subscription is live: a run's events reach it
            assert cli(env, "run", "cli1", "--", "true").returncode == 0
            if select.select([ev.stdout], [], [], 1.0)[0]:
                break
            assert time.monotonic() < deadline, "no event reached `sandvisor events`"
        assert cli(env, "stop", "cli1").returncode == 0
        seen = []
        while not seen or seen[-1]["action"] != "stopping":
            seen.append(json.loads(ev.stdout.readline()))
        assert {e["action"] for e in seen[:-1]} <= {"running", "idle"}  # the probes' events, then the stop's
        # cursor: where `events --since` resumes; sequence: the event's place in its sandbox's (docs/webhooks.md)
        assert set(seen[-1]) == {"sandbox_id", "action", "timestamp", "attributes", "cursor", "sequence"}
    finally:
        ev.kill()
        ev.wait()
        if ev.stdout is not None:
            ev.stdout.close()
    assert json.loads(cli(env, "inspect", "cli1", "--json").stdout)["state"] == "stopped"
    # refused operations on a sandbox that exists: one line, exit 1, the reason
    # a stopped sandbox's checkpoint is a disk-only snapshot
    r = cli(env, "checkpoint", "cli1")
    assert r.returncode == 0 and r.stdout.startswith(b"snap-"), r
    snap = r.stdout.decode().strip()  # (the sandbox's disk now stands on it: not removable)
    assert b"in use" in cli(env, "snapshot", "rm", snap).stderr
    r = cli(env, "run", "cli1", "--", "true")
    assert (r.returncode, r.stderr.count(b"\n")) == (1, 1) and b"FAILED_PRECONDITION" in r.stderr, r
    assert b"is stopped" in r.stderr, r
    assert cli(env, "start", "cli1").returncode == 0
    r = cli(env, "port", "add", "cli1", "80")
    assert (r.returncode, r.stderr.count(b"\n")) == (1, 1) and b"has no network" in r.stderr, r
    assert cli(env, "rm", "-f", "cli1").returncode == 0
    assert cli(env, "snapshot", "rm", snap).returncode == 0  # its sandbox is gone: it goes too

    assert json.loads(cli(env, "snapshots", "--json").stdout) == []
    # bad input: one line on stderr, exit 2 (usage) or 1 (operation)
    for args, code in (
        (["inspect", "nope"], 1),
        (["create", "bad", "--env", "NOEQUALS"], 2),
        (["create", "bad", "--port", "99x"], 2),
        (["create", "x" * 129], 1),
        (["run", "nope", "--", "true"], 1),
        (["cp", "a", "b"], 2),
        (["frobnicate"], 2),
        (["port", "add", "cli1", "eighty"], 2),
        (["port", "add", "cli1", "80"], 1),  # cli1 is gone now: NOT_FOUND
        (["checkpoint", "cli1"], 1),
        (["snapshot", "rm", "nope"], 1),
    ):
        r = cli(env, *args)
        assert r.returncode == code, (args, r)
        assert r.stderr.count(b"\n") == 1 and b"Traceback" not in r.stderr, (args, r.stderr)


def test_ports_listed_and_exposed_idempotently_through_the_sdk_and_cli(served: dict[str, str]) -> None:
    env = served
    sock = env["SANDVISOR_SOCKET"]
    with Sandbox.create("ports", socket=sock, network="user", ports={8000: 0}) as sb:
        (carried,) = sb.ports()
        assert carried.sandbox_port == 8000 and carried.protocol == "tcp" and carried.host_port > 0
        assert carried.host_address == "127.0.0.1"
        assert sb.expose(8000) == carried.host_port  # exposed already: its mapping, again
        r = cli(env, "port", "add", "ports", "8000")
        assert (r.returncode, r.stdout) == (0, f"{carried.host_port}\n".encode()), r.stderr
        extra = int(cli(env, "port", "add", "ports", "8001").stdout)
        listed = json.loads(cli(env, "port", "ls", "ports", "--json").stdout)
        assert [(m["sandbox_port"], m["host_port"]) for m in listed] == [(8000, carried.host_port), (8001, extra)]
        table = cli(env, "port", "ls", "ports").stdout.decode()
        assert f"127.0.0.1:{extra}" in table
        sb.unexpose(8001)
        assert [m.sandbox_port for m in sb.ports()] == [8000]
    for args, code in (
        (["port", "ls", "nope"], 1),
        (["port", "rm", "ports"], 2),  # which port?
        # no tap networking in this supervisor (the machine's own namespace): refused, typed
        (["create", "tapped", "--network", "tap"], 1),
        *([(["create", "out", "--network", "outbound"], 1)] if os.geteuid() == 0 else []),
        (["create", "bad", "--network", "user", "--outbound", "--egress-default", "deny", "--allow", "300.1.1.1"], 1),
    ):
        r = cli(env, *args)
        assert r.returncode == code, (args, r)
        assert r.stderr.count(b"\n") == 1 and b"Traceback" not in r.stderr, (args, r.stderr)
    r = cli(env, "create", "bad", "--network", "user", "--outbound", "--allow", "300.1.1.1")
    assert b"INVALID_ARGUMENT" in r.stderr or b"not a valid address" in r.stderr, r.stderr


def test_exec_it_in_tmux(served: dict[str, str]) -> None:
    if not shutil.which("tmux"):
        pytest.skip("tmux is installed by images/host-packages.sh")
    env = served
    assert cli(env, "create", "tty1").returncode == 0
    session = f"sv{os.getpid()}"
    cmd = f"{sys.executable} -m supervisor.main.cli exec -it tty1 -- sh; echo EXITED=$?; sleep 60"
    subprocess.run(
        [
            "tmux",
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            "100",
            "-y",
            "30",
            "env",
            *[f"{k}={v}" for k, v in env.items() if k.startswith("SANDVISOR")],
            "sh",
            "-c",
            cmd,
        ],
        check=True,
    )

    def screen() -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-t", session, "-p"], capture_output=True, text=True, check=False
        ).stdout

    def wait_for(text: str) -> str:
        deadline = time.monotonic() + 30
        while text not in (s := screen()):
            assert time.monotonic() < deadline, s
            time.sleep(0.2)
        return s

    try:
        wait_for("#")  # the shell's prompt
        subprocess.run(["tmux", "send-keys", "-t", session, "echo hello-tty; tty; stty size", "Enter"], check=True)
        s = wait_for("30 100")
        assert "hello-tty" in s and "/dev/pts/" in s
        subprocess.run(["tmux", "send-keys", "-t", session, "exit 7", "Enter"], check=True)
        wait_for("EXITED=7")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
        cli(env, "rm", "-f", "tty1")


def test_examples_run_against_a_real_daemon(served: dict[str, str]) -> None:
    root = Path(__file__).resolve().parents[2] / "examples"
    r = subprocess.run(
        [sys.executable, str(root / "quickstart.py")], env=served, capture_output=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr
    assert b"hello from quickstart" in r.stdout and b"written by the host" in r.stdout
    assert b"exit code of false: 1" in r.stdout
    r = subprocess.run(
        [sys.executable, str(root / "parallel_agents.py")], env=served, capture_output=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().splitlines() == [
        "squares: exit 0: [0, 1, 4, 9, 16, 25, 36, 49, 64, 81]",
        "fail: exit 3: ",
        "env: exit 0: env",
    ]


def test_demo_the_main_job(image: Image) -> None:
    """`sandvisor demo` (what `nox -s demo` runs): its own supervisor, a sandbox at
    work, a checkpoint, two clones, a Create from the boot template; nothing left."""
    p = subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", "demo", "--accel", "tcg"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    for want in ("hello from demo as root", "python 3", "clone-1: written by the host", "nothing left behind"):
        assert want in p.stdout, p.stdout
