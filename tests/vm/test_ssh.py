"""``sandvisor serve --ssh`` with the real OpenSSH client (``ssh``, ``scp``, ``sftp``)
against a real VM: a command, a PTY session through tmux, files both ways, and the
refusals (another key, a sandbox the key was not given to, port forwarding)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.client.sdk import sync
from supervisor.main.throwaway import supervisor_process, workdir

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("ssh", "scp", "sftp", "ssh-keygen")), reason="no OpenSSH"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Lab:
    def __init__(self, root: Path, port: int, socket: str) -> None:
        self.root, self.port, self.socket = root, port, socket
        self.key = root / "id_ed25519"
        self.other = root / "other_ed25519"
        self.known = root / "known_hosts"

    def opts(self, key: Path | None = None) -> list[str]:
        return [
            "-i",
            str(key or self.key),
            "-o",
            f"UserKnownHostsFile={self.known}",
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=30",
            "-o",
            "LogLevel=ERROR",
            "-F",
            "/dev/null",
        ]

    def ssh(self, *args: str, key: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        argv = ["ssh", "-p", str(self.port), *self.opts(key), *args]
        return subprocess.run(
            argv, check=False, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with workdir("sv-ssh-") as work:
        port = _free_port()
        with supervisor_process(work, "--ssh", f"127.0.0.1:{port}", log=work.root / "serve.log"):
            deadline = time.monotonic() + 60
            while True:  # the socket is there before the SSH port: wait for it, bounded
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            lab = Lab(work.root, port, str(work.socket))
            for k in (lab.key, lab.other):
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)], check=True)
            yield lab
            key = work.state / "ssh_host_ed25519_key"
            assert key.stat().st_mode & 0o777 == 0o600  # made once, private


@pytest.fixture(scope="module")
def box(lab: Lab) -> Iterator[str]:
    name = f"ssh-{uuid.uuid4().hex[:6]}"
    pub = (lab.root / "id_ed25519.pub").read_text()
    sb = sync.Sandbox.create(name, socket=lab.socket, ssh_keys=[pub])
    try:
        yield name
    finally:
        sb.kill()
        sb.remove(force=True)


def test_command(lab: Lab, box: str) -> None:
    r = lab.ssh(f"{box}@127.0.0.1", "echo hi; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, "hi\n", "err\n")
    r = lab.ssh(f"{box}@127.0.0.1", "--", "id", "-un")
    assert (r.returncode, r.stdout.strip()) == (0, "root")
    # stdin goes through
    p = subprocess.run(
        ["ssh", "-p", str(lab.port), *lab.opts(), f"{box}@127.0.0.1", "wc -c"],
        input="12345",
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (p.returncode, p.stdout.strip()) == (0, "5")
    # the host key was pinned on first use and is the same next time
    assert "[127.0.0.1]" in lab.known.read_text()


def test_client_gone_ends_the_process(lab: Lab, box: str) -> None:
    """A client that goes away mid-command takes the sandbox's process with it."""
    sb = sync.Sandbox(box, socket=lab.socket)
    count = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -o 'sleep 31[3]' | wc -l"
    argv = ["ssh", "-p", str(lab.port), *lab.opts(), f"{box}@127.0.0.1", "sleep 313"]
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while sb.run(count).stdout.strip() == b"0":
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.2)
    finally:
        p.kill()
        p.wait(timeout=30)
    deadline = time.monotonic() + 60
    while sb.run(count).stdout.strip() != b"0":
        assert time.monotonic() < deadline, "the command outlived its client"
        time.sleep(0.2)


def test_pty_session(lab: Lab, box: str) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("no tmux")
    session = f"sshtest{uuid.uuid4().hex[:6]}"
    argv = ["ssh", "-t", "-p", str(lab.port), *lab.opts(), f"{box}@127.0.0.1"]
    env = {**os.environ, "TERM": "xterm"}
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", "100", "-y", "30", *argv], check=True, env=env, timeout=30
    )
    try:

        def screen() -> str:
            return subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True, check=True
            ).stdout

        def wait_for(text: str) -> str:
            deadline = time.monotonic() + 60
            while text not in (s := screen()):
                assert time.monotonic() < deadline, f"{text!r} never showed; the screen:\n{s}"
                time.sleep(0.2)
            return s

        subprocess.run(["tmux", "send-keys", "-t", session, "tty; echo TERM=$TERM; stty size", "Enter"], check=True)
        s = wait_for("30 100")  # the client's terminal size, a PTY, its TERM (tmux's)
        assert "/dev/pts/" in s and "TERM=tmux" in s
        subprocess.run(["tmux", "resize-window", "-t", session, "-x", "90", "-y", "25"], check=True)
        deadline = time.monotonic() + 60
        while "25 90" not in screen():  # a resize reaches the guest's terminal
            subprocess.run(["tmux", "send-keys", "-t", session, "stty size", "Enter"], check=True)
            assert time.monotonic() < deadline, screen()
            time.sleep(0.5)
        subprocess.run(["tmux", "send-keys", "-t", session, "exit 0", "Enter"], check=True)
        deadline = time.monotonic() + 60
        while subprocess.run(["tmux", "has-session", "-t", session], check=False, capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "ssh did not end with the shell"
            time.sleep(0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False, capture_output=True)


def test_scp_and_sftp(lab: Lab, box: str) -> None:
    src = lab.root / "up.bin"
    data = os.urandom(300_000)
    src.write_bytes(data)
    base = ["-P", str(lab.port), *lab.opts()]
    r = subprocess.run(
        ["scp", *base, str(src), f"{box}@127.0.0.1:/tmp/up.bin"], check=False, capture_output=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert sync.Sandbox(box, socket=lab.socket).fs.read("/tmp/up.bin") == data
    back = lab.root / "back.bin"
    r = subprocess.run(
        ["scp", *base, f"{box}@127.0.0.1:/tmp/up.bin", str(back)], check=False, capture_output=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert back.read_bytes() == data

    (lab.root / "s.txt").write_text("via sftp\n")
    script = (
        "mkdir /tmp/sf\n"
        f"put {lab.root / 's.txt'} /tmp/sf/a.txt\n"
        "rename /tmp/sf/a.txt /tmp/sf/b.txt\n"
        "ls -l /tmp/sf\n"
        f"get /tmp/sf/b.txt {lab.root / 'got.txt'}\n"
        "rm /tmp/sf/b.txt\n"
        "rmdir /tmp/sf\n"
    )
    r2 = subprocess.run(
        ["sftp", "-b", "-", *base, f"{box}@127.0.0.1"],
        input=script,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r2.returncode == 0, r2.stderr
    assert "b.txt" in r2.stdout
    assert (lab.root / "got.txt").read_text() == "via sftp\n"
    assert not sync.Sandbox(box, socket=lab.socket).fs.exists("/tmp/sf")
    # a missing file is the client's "No such file"
    r3 = subprocess.run(
        ["sftp", "-b", "-", *base, f"{box}@127.0.0.1"],
        input=f"get /nonexistent {lab.root / 'x'}\n",
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r3.returncode != 0 and "not found" in r3.stderr, (r3.returncode, r3.stderr)


def test_refused_keys(lab: Lab, box: str) -> None:
    r = lab.ssh(f"{box}@127.0.0.1", "echo hi", key=lab.other)  # a key the sandbox was not given
    assert r.returncode == 255 and "Permission denied" in r.stderr and "hi" not in r.stdout
    r = lab.ssh("no-such-box@127.0.0.1", "echo hi")  # no sandbox: the same refusal
    assert r.returncode == 255 and "Permission denied" in r.stderr
    # another sandbox, not given this key: the key opens only the sandboxes it was added to
    other = sync.Sandbox.create(
        f"ssh-o-{uuid.uuid4().hex[:6]}", socket=lab.socket, ssh_keys=[(lab.root / "other_ed25519.pub").read_text()]
    )
    try:
        r = lab.ssh(f"{other.id}@127.0.0.1", "echo hi")
        assert r.returncode == 255 and "Permission denied" in r.stderr
        r = lab.ssh(f"{other.id}@127.0.0.1", "echo hi", key=lab.other)
        assert (r.returncode, r.stdout) == (0, "hi\n")
    finally:
        other.kill()
        other.remove(force=True)


def test_keys_added_and_removed(lab: Lab, box: str) -> None:
    """``sandvisor ssh-key add|ls|rm``: a key added later opens the sandbox for new
    connections; removed, it is refused again."""

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SANDVISOR_SOCKET": lab.socket}
        argv = [sys.executable, "-m", "supervisor.main.cli", "ssh-key", *args]
        return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, env=env)

    other_pub = str(lab.root / "other_ed25519.pub")
    assert lab.ssh(f"{box}@127.0.0.1", "true", key=lab.other).returncode == 255
    r = cli("add", box, other_pub)
    assert r.returncode == 0, r.stderr
    assert len(cli("ls", box).stdout.splitlines()) == 2
    assert lab.ssh(f"{box}@127.0.0.1", "echo in", key=lab.other).stdout == "in\n"
    # a connection kept open (a ControlMaster) loses it too: its next channel is refused
    ctl = lab.root / "ctl"
    master = subprocess.Popen(
        ["ssh", "-p", str(lab.port), *lab.opts(lab.other), "-M", "-S", str(ctl), "-N", f"{box}@127.0.0.1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        via = ("-S", str(ctl), "-o", "ControlMaster=no")
        deadline = time.monotonic() + 60
        while lab.ssh("-S", str(ctl), "-O", "check", f"{box}@127.0.0.1").returncode != 0:  # the master is up
            assert time.monotonic() < deadline and master.poll() is None
            time.sleep(0.2)
        assert lab.ssh(*via, f"{box}@127.0.0.1", "echo in", key=lab.other).stdout == "in\n"
        assert cli("rm", box, other_pub).returncode == 0
        r = lab.ssh(*via, f"{box}@127.0.0.1", "echo in", key=lab.other)
        assert r.returncode == 255 and "no longer valid" in r.stderr and "in" not in r.stdout, r
    finally:
        master.kill()
        master.wait(timeout=30)
    assert lab.ssh(f"{box}@127.0.0.1", "true", key=lab.other).returncode == 255
    assert lab.ssh(f"{box}@127.0.0.1", "echo still").stdout == "still\n"  # the first key stays
    # a private key given by mistake never leaves the client
    r = cli("add", box, str(lab.other))
    assert r.returncode != 0 and "private key" in r.stderr


def test_forwarding_refused(lab: Lab, box: str) -> None:
    free = _free_port()
    r = lab.ssh("-o", "ExitOnForwardFailure=yes", "-R", f"{free}:127.0.0.1:22", f"{box}@127.0.0.1", "echo up")
    assert r.returncode == 255 and "forwarding failed" in r.stderr and "up" not in r.stdout
    # -L: the listener is the client's; a connection through it is refused by the endpoint
    local = _free_port()
    p = subprocess.Popen(
        [
            "ssh",
            "-p",
            str(lab.port),
            "-o",
            "LogLevel=INFO",
            *lab.opts(),
            "-N",
            "-L",
            f"{local}:127.0.0.1:{lab.port}",
            f"{box}@127.0.0.1",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                c = socket.create_connection(("127.0.0.1", local), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None
                time.sleep(0.1)
        c.settimeout(30)
        assert c.recv(100) == b""  # closed: the channel was refused
        c.close()
    finally:
        p.kill()
        _, err = p.communicate(timeout=30)
    assert "open failed" in err
