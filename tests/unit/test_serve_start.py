"""``sandvisor serve`` at start: the directories it makes, with the modes they need, and
refusals as one line that says what to change (exit 1, no traceback)."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.errors import DomainError
from actors.recovery import check_traversable
from supervisor.main import daemon
from supervisor.main.daemon import Refused
from supervisor.main.daemon_config import DaemonConfig
from supervisor.main.throwaway import workdir
from supervisor.wire import config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A scratch dir others may pass through (pytest's own base is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="sv-start-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_make_dirs_gives_every_made_dir_its_mode_whatever_the_umask(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir(mode=0o755)
    old = os.umask(0o077)
    try:
        made = config.make_dirs(tmp_path / "a" / "b" / "c", 0o711)
    finally:
        os.umask(old)
    assert made == [tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    assert mode(tmp_path / "a") == 0o755  # (what existed is left as it was)
    assert mode(tmp_path / "a" / "b") == mode(tmp_path / "a" / "b" / "c") == 0o711


def test_the_runtime_dir_an_earlier_supervisor_left_private_is_passable_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run" / "sandvisor"
    monkeypatch.setattr(config, "runtime_dir", lambda: run)
    config.passable_runtime_dir()  # a fresh /run: made 0711
    assert mode(run) == 0o711
    run.chmod(0o700)  # what serve's umask made of it before
    config.passable_runtime_dir()
    assert mode(run) == 0o711


@pytest.mark.skipif(os.geteuid() != 0, reason="checks the layout as root and as another uid")
def test_layout_as_root_and_as_a_user(open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path = open_tmp
    run = tmp_path / "run" / "sandvisor"
    monkeypatch.setattr(config, "runtime_dir", lambda: run)
    monkeypatch.setattr(daemon, "passable_runtime_dir", config.passable_runtime_dir)
    cfg = DaemonConfig(socket=run / "sandvisor.sock", state_dir=tmp_path / "state")
    old = os.umask(0o077)
    try:
        daemon._layout(cfg, run / "vms", "nobody")
        daemon._private_state_dir(cfg.state_dir)
    finally:
        os.umask(old)
    assert mode(run) == mode(run / "vms") == 0o711 and mode(tmp_path / "state") == 0o700

    # a user's supervisor: its runtime dir private, made by it
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.umask(0o077)
            os.environ["XDG_RUNTIME_DIR"] = str(home / "xdg")
            (home / "xdg").mkdir(mode=0o700)
            monkeypatch.undo()
            sock = config.default_socket()
            user_cfg = DaemonConfig(socket=sock, state_dir=home / "share" / "sandvisor")
            daemon._private_state_dir(user_cfg.state_dir)
            daemon._layout(user_cfg, config.default_run_root(), None)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for d in (home / "xdg" / "sandvisor", home / "xdg" / "sandvisor" / "vms", home / "share" / "sandvisor"):
        assert d.is_dir() and mode(d) == 0o700 and d.stat().st_uid == 65534, d


def test_a_run_root_qemu_cannot_reach_is_refused_naming_the_fix(open_tmp: Path) -> None:
    tmp_path = open_tmp
    if os.geteuid() != 0:
        pytest.skip("QEMU runs as another user only under a root supervisor")
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    cfg = DaemonConfig(socket=tmp_path / "s.sock", state_dir=tmp_path / "state", run_root=closed / "vms")
    with pytest.raises(Refused, match=rf"chmod o\+x {closed}"):
        daemon._layout(cfg, closed / "vms", "nobody")


def test_a_live_socket_is_not_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen()
        with pytest.raises(Refused, match="another supervisor serves on"):
            daemon._check_socket_free(path)
    daemon._check_socket_free(path)  # a dead one's file: replaced by the server


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", "serve", "--state-dir", str(tmp_path / "state"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def assert_one_line(r: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for f in fragments:
        assert f in errors[0], errors[0]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--egress-never", "bogus"], "--egress-never 'bogus'"),
        (["--jail-uids", "0:10"], "--jail-uids 0:10"),
        (["--ip-pool", "bogus"], "--ip-pool 'bogus'"),
        (["--dns-upstream", "x"], "--dns-upstream"),
        (["--boot-timeout", "0"], "--boot-timeout"),
        (["--allow-path", "/nonexistent-dir"], "--allow-path /nonexistent-dir"),
        (["--grpc", "tcp:nothing"], "--grpc 'tcp:nothing'"),
        (["--metrics", "127.0.0.1:9464"], "needs --metrics-token-file"),
        (["--metrics", "0.0.0.0:9464", "--metrics-token-file", "/nonexistent-dir/t"], "loopback addresses only"),
        (["--metrics", "127.0.0.2:9464", "--metrics-token-file", "/nonexistent-dir/t"], "--metrics-token-file"),
    ],
)
def test_bad_flag_values_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    """(In this process: the CLI's own main, as the command runs it; a process each costs
    most of a second, and test_verbose_adds_the_traceback runs the real command.)"""
    from supervisor.main import cli

    argv = ["serve", "--state-dir", str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock"), *args]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    code = exit_.value.code
    r = subprocess.CompletedProcess(argv, code if isinstance(code, int) else 1, "", capsys.readouterr().err)
    assert_one_line(r, fragment)


def test_a_busy_state_dir_is_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    fd = os.open(state / "serve.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242\n")
        r = serve(tmp_path, "--socket", str(tmp_path / "s.sock"))
    finally:
        os.close(fd)
    assert_one_line(r, "another sandvisor serve (pid 4242)", str(state))


@pytest.mark.vm  # (it gets as far as loading the default image)
def test_a_port_in_use_is_one_line() -> None:
    with workdir("sv-start-") as work, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for flag in ("--metrics", "--grpc"):  # (gRPC on TCP authenticates: --grpc-insecure, loopback, for a test)
            r = serve(
                work.root,
                "--socket",
                str(work.socket),
                "--run-root",
                str(work.run_root),
                flag,
                f"127.0.0.1:{port}",
                *(["--grpc-insecure"] if flag == "--grpc" else ["--metrics-token-file", str(work.root / "m.token")]),
            )
            assert_one_line(r, f"127.0.0.1:{port}", "in use")


def test_verbose_adds_the_traceback(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor.main.cli",
            "-v",
            "serve",
            "--state-dir",
            str(tmp_path),
            "--jail-uids",
            "0:10",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1 and "Traceback" in r.stderr and "--jail-uids 0:10" in r.stderr


def test_a_run_root_qemu_cannot_reach_is_refused_at_start() -> None:
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="sv-reach-", dir="/tmp"))  # /tmp is o+x: the check is ours alone
    try:
        private = top / "private"
        private.mkdir(mode=0o700)
        (private / "run").mkdir()
        with pytest.raises(DomainError) as e:
            check_traversable(private / "run", "nobody")
        assert e.value.code == "FAILED_PRECONDITION" and "not reachable" in e.value.message
        assert str(private) in e.value.message  # it names the directory that blocks
        private.chmod(0o711)
        top.chmod(0o711)
        check_traversable(private / "run", "nobody")  # now QEMU's user gets through
    finally:
        import shutil

        shutil.rmtree(top, ignore_errors=True)


def test_a_non_root_runtime_dir_someone_else_made_is_refused(tmp_path: Path) -> None:
    """serve as a non-root user claims /tmp/sandvisor-<uid> (0700, its own) or refuses
    one another user made first; a client refuses to talk to a socket in such a dir."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as two users")
    uid = 40000 + os.getpid() % 10000
    runtime = Path(f"/tmp/sandvisor-{uid}")
    code = f"""
import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from supervisor.wire.config import UnsafeRuntimeDir, check_runtime_dir, claim_runtime_dir, default_socket
try:
    print(claim_runtime_dir())
    check_runtime_dir(default_socket())
    print("client ok")
except UnsafeRuntimeDir as e:
    print("refused:", e)
"""

    def as_user() -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "SANDVISOR_SOCKET")}
        r = subprocess.run(
            ["/usr/bin/python3", "-S", "-c", code],
            user=uid,
            group=uid,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return r.stdout.strip()

    shutil.rmtree(runtime, ignore_errors=True)
    try:
        runtime.mkdir(mode=0o777)  # made first by someone else (root here)
        runtime.chmod(0o777)
        assert as_user().startswith(f"refused: {runtime} belongs to uid 0")
        runtime.rmdir()
        assert as_user().splitlines() == [f"{runtime}/sandvisor", "client ok"]
        info = runtime.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (uid, 0o700)
        os.chown(runtime / "sandvisor", 0, 0)  # swapped under the client
        assert "refused" in as_user()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
