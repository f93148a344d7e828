"""Read-back against a real ``sandvisor serve --ssh`` and real VMs (one sandbox shared by
the tests that only read it): a configuration fed back to Create gives an equal sandbox
(CLI, sync and async SDK), log entries' Run sessions, root-disk metrics, and the SSH
endpoint ``sb.ssh()`` gives, used by the real OpenSSH client with its pinned host key."""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from guestd.patch import Patch
from images.build import Image
from supervisor.client import AsyncSandbox, FailedPrecondition, NotFound, Sandbox, Unavailable
from supervisor.main.throwaway import supervisor_process, workdir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Lab:
    def __init__(self, root: Path, env: dict[str, str], port: int) -> None:
        self.root, self.env, self.port = root, env, port
        self.socket = env["SANDVISOR_SOCKET"]
        self.key = root / "id_ed25519"

    def cli(self, *args: str, timeout: float = 180, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor.main.cli", *args],
            env=self.env,
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )


@pytest.fixture(scope="module")
def lab(image: Image) -> Iterator[Lab]:
    with workdir("sv-rb-") as work:
        port = _free_port()
        with supervisor_process(work, "--ssh", f"127.0.0.1:{port}", log=work.root / "serve.log") as (env, _):
            deadline = time.monotonic() + 60
            while True:  # the socket is there before the SSH port
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            lab = Lab(work.root, env, port)
            if shutil.which("ssh-keygen"):
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(lab.key)], check=True)
            yield lab


@pytest.fixture(scope="module")
def box(lab: Lab) -> Iterator[Sandbox]:
    keys = [(lab.root / "id_ed25519.pub").read_text()] if lab.key.exists() else []
    sb = Sandbox.create(
        "rb",
        socket=lab.socket,
        hostname="readback",
        env={"GREETING": "hi"},
        labels={"suite": "readback"},
        tmpfs=["/scratch:16", "/scratch:32"],  # one path: the later entry
        patches=[Patch.file("/etc/rb.txt", "patched\n", mode=0o640), Patch.mkdir("/srv/rb")],
        scripts={"hello": "echo hello from $GREETING"},
        ttl=3600,
        ssh_keys=keys,
        detached=True,
    )
    try:
        yield sb
    finally:
        sb.kill()
        sb.remove(force=True)


def test_config_fed_back_to_create_gives_an_equal_sandbox(lab: Lab, box: Sandbox) -> None:
    cfg = box.config(patch_data=True)
    assert cfg["hostname"] == "readback" and cfg["tmpfs"] == ["/scratch:32"] and cfg["ttl"] == 3600
    assert cfg["env"] == {"GREETING": "hi"} and cfg["labels"] == {"suite": "readback"}
    assert [p["path"] for p in cfg["patches"]] == ["/etc/rb.txt", "/srv/rb"]
    # the CLI's JSON is the SDK's; create --from-config makes the equal sandbox
    r = lab.cli("config", "rb", "--patch-data")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(json.dumps(cfg))
    path = lab.root / "rb.json"
    path.write_bytes(r.stdout)
    r = lab.cli("create", "rb2", "--from-config", str(path), "--label", "copy=1")
    assert r.returncode == 0, r.stderr
    copy = Sandbox("rb2", socket=lab.socket)
    try:
        again = copy.config(patch_data=True)
        assert again == {**cfg, "labels": {"suite": "readback", "copy": "1"}}  # the flag given on top
        # equal where it counts: the guest of the copy is made the same way
        out = copy.run("hostname; cat /etc/rb.txt; stat -c %a /etc/rb.txt; test -d /srv/rb && echo dir")
        assert out.stdout == b"readback\npatched\n640\ndir\n", out.stderr
        df = copy.run("grep ' /scratch ' /proc/mounts")
        assert b"tmpfs" in df.stdout and b"size=32768k" in df.stdout, df.stdout
        assert copy.run_script("hello").stdout == b"hello from hi\n"
        # described patches (the default): sizes and digests, not bytes; refused when fed back
        described = json.loads(lab.cli("config", "rb").stdout)
        assert described["patches"][0]["size"] == 8 and "data_base64" not in described["patches"][0]
        path.write_text(json.dumps(described))
        r = lab.cli("create", "rb3", "--from-config", str(path))
        assert r.returncode != 0 and b"/etc/rb.txt" in r.stderr
    finally:
        copy.remove(force=True)


def test_log_entries_carry_the_run_session_that_wrote_them(box: Sandbox) -> None:
    box.run("echo first")
    box.run("echo second; echo err >&2")
    entries = [e for e in box.logs() if e.source in ("stdout", "stderr")]
    first = next(e for e in entries if e.text() == "first\n")
    second = [e for e in entries if e.text() in ("second\n", "err\n")]
    assert len(second) == 2 and second[0].session_id == second[1].session_id > first.session_id > 0
    assert all(e.session_id == 0 for e in box.logs(sources=["system"]))

    async def main() -> list[int]:
        asb = AsyncSandbox("rb", socket=box.socket)
        await asb.run("echo third")
        return [e.session_id for e in await asb.logs(tail=1)]

    (third,) = trio.run(main)
    assert third > second[0].session_id


def test_metrics_carry_root_disk_usage(lab: Lab, box: Sandbox) -> None:
    before = box.metrics()
    assert before.root_used_bytes > 0 and before.root_free_bytes > 0 and before.root_host_allocated_bytes > 0
    assert box.run("dd if=/dev/urandom of=/var/tmp/fill bs=1M count=24 2>/dev/null && sync").ok
    after = box.metrics()
    assert after.root_used_bytes - before.root_used_bytes >= 20 << 20
    assert after.root_free_bytes < before.root_free_bytes
    assert after.root_host_allocated_bytes - before.root_host_allocated_bytes >= 20 << 20
    r = lab.cli("metrics", "rb", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["root_used_bytes"] >= after.root_used_bytes - (4 << 20)
    box.run("rm -f /var/tmp/fill")


@pytest.mark.skipif(not shutil.which("ssh"), reason="no OpenSSH")
def test_ssh_endpoint_is_where_ssh_reaches_the_sandbox(lab: Lab, box: Sandbox) -> None:
    ep = box.ssh()
    assert (ep.host, ep.port, ep.user) == ("127.0.0.1", lab.port, "rb")
    known = lab.root / "known_hosts"
    known.write_text(ep.known_hosts + "\n")
    shown = subprocess.run(["ssh-keygen", "-lf", str(known)], capture_output=True, text=True, check=True).stdout
    assert ep.fingerprint in shown
    # the pinned key alone: StrictHostKeyChecking=yes fails on any other host key
    opts = ["-o", "StrictHostKeyChecking=yes", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-F", "/dev/null"]
    at = ["-p", str(ep.port), "-i", str(lab.key), "-o", f"UserKnownHostsFile={known}"]
    r = subprocess.run(
        ["ssh", *at, *opts, f"{ep.user}@{ep.host}", "cat /etc/rb.txt"],
        capture_output=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert (r.returncode, r.stdout) == (0, b"patched\n"), r.stderr
    r = lab.cli("ssh", "rb", "--endpoint", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["known_hosts"] == ep.known_hosts

    async def main() -> str:
        return (await AsyncSandbox("rb", socket=box.socket).ssh()).fingerprint

    assert trio.run(main) == ep.fingerprint


def test_ssh_endpoint_unavailable_without_serve_ssh(image: Image) -> None:
    with workdir("sv-rbn-") as work, supervisor_process(work) as (env, _):
        sb = Sandbox.create("plain", socket=env["SANDVISOR_SOCKET"], detached=True)
        try:
            with pytest.raises(Unavailable, match="serve --ssh"):
                sb.ssh()
        finally:
            sb.remove(force=True)


def _wait_logged(box: Sandbox, session_id: int, text: str, timeout: float = 60) -> None:
    """Until the sandbox's log holds ``text`` from session ``session_id`` (bounded)."""
    deadline = time.monotonic() + timeout
    while not any(e.session_id == session_id and text in e.text() for e in box.logs(tail=50)):
        assert time.monotonic() < deadline, f"{text!r} of session {session_id} never logged"
        time.sleep(0.2)


def test_a_detached_session_keeps_running_and_is_attached_again(box: Sandbox) -> None:
    """SDK: detach, output while away (logged with the session's id, buffered), attach
    again: the buffered output first, then stdin and the exit, as before."""
    script = "echo ready; sleep 1; echo while-away; while read l; do echo got:$l; done; exit 7"
    with box.exec(["sh", "-c", script], detachable=True) as p:
        first = next(iter(p))
        assert first.data == b"ready\n"
        sid = p.detach()
    _wait_logged(box, sid, "while-away")
    with box.session(sid) as again:
        out = iter(again)
        assert next(out).data == b"while-away\n"  # kept while no one was attached
        again.send(b"x\n")
        assert next(out).data == b"got:x\n"
        again.close_stdin()
        assert again.wait() == 7
    with pytest.raises(Exception, match=f"no session {sid}"), box.session(sid) as gone:
        gone.wait()

    # a client that leaves without detaching ends the process, as a plain exec's
    with box.exec(["sh", "-c", "echo up; exec sleep 313"], detachable=True) as p:
        assert next(iter(p)).data == b"up\n"
    deadline = time.monotonic() + 60
    while box.run("pgrep -f 'sleep [3]13'").ok:  # ([3]: not the shell that runs pgrep)
        assert time.monotonic() < deadline, "the left session's process runs on"
        time.sleep(0.2)

    async def main() -> int:  # the async SDK: detach, attach, detach again, attach, end
        asb = AsyncSandbox("rb", socket=box.socket)
        async with asb.exec(["sh", "-c", "cat"], detachable=True) as p:
            sid = await p.detach()
        async with asb.session(sid) as p:
            assert await p.detach() == sid
        async with asb.session(sid) as p:
            await p.send(b"async\n")
            await p.close_stdin()
            got = [o async for o in p]
            assert got[0].data == b"async\n" and got[-1].stream == "exit"
            return await p.wait()

    assert trio.run(main) == 0


@pytest.mark.skipif(not shutil.which("tmux"), reason="no tmux")
def test_cli_exec_it_detach_keys_and_attach(lab: Lab, box: Sandbox) -> None:
    """``sandvisor exec -it`` on a real terminal (tmux): ctrl-p ctrl-q leaves the shell
    running; ``sandvisor attach NAME SESSION`` goes back to it."""
    tag = f"rb{time.monotonic_ns() % 100000}"
    first, second = f"{tag}a", f"{tag}b"  # (two sessions: killing a server's last one ends it, racing the next)
    env = lab.env
    cli = [sys.executable, "-m", "supervisor.main.cli"]

    def screen(name: str) -> str:
        r = subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True, check=False)
        return r.stdout

    def wait_for(name: str, text: str) -> str:
        deadline = time.monotonic() + 90
        while text not in (s := screen(name)):
            assert time.monotonic() < deadline, f"{text!r} never showed; the screen:\n{s}"
            time.sleep(0.2)
        return s

    def keys(name: str, *k: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", name, *k], check=True)

    def start(name: str, *argv: str) -> None:  # the pane stays after the CLI ends: its last words readable
        # (env: a tmux server running already gives a new session its own environment, not ours)
        line = shlex.join(["env", *(f"{k}={v}" for k, v in env.items() if k.startswith("SANDVISOR")), *cli, *argv])
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", name, "-x", "100", "-y", "30", line + "; sleep 120"], check=True
        )

    try:
        start(first, "exec", "-it", "rb", "--", "sh")
        wait_for(first, "#")  # the shell's prompt: the terminal is raw by now (typed-ahead keys would be flushed)
        keys(first, "echo one-$((40+2))", "Enter")
        wait_for(first, "one-42")
        keys(first, "C-p", "C-q")
        s = wait_for(first, "detached: sandvisor attach rb ")
        sid = int(s.split("detached: sandvisor attach rb ")[1].split()[0])
        start(second, "attach", "rb", str(sid))
        deadline = time.monotonic() + 90
        while "two-43" not in screen(second):  # keys typed before the attach is raw are flushed: type until seen
            keys(second, "echo two-$((40+3))", "Enter")
            assert time.monotonic() < deadline, screen(second)
            time.sleep(1)
        keys(second, "exit 0", "Enter")
        deadline = time.monotonic() + 60
        while True:  # until the session is gone (the CLI holds it until the shell ends)
            try:
                with box.session(sid) as gone:
                    gone.detach()
            except NotFound:
                break
            except FailedPrecondition:
                pass
            assert time.monotonic() < deadline, "the session outlived its shell"
            time.sleep(0.2)
    finally:
        for name in (first, second):
            subprocess.run(["tmux", "kill-session", "-t", name], check=False, capture_output=True)
