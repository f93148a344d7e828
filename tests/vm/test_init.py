"""The init hand-off end to end (microsandbox's WithInit): a real ``sandvisor serve``, the
SDK and the CLI, a real VM booting an ext4 root filesystem with Debian's systemd (made
from Debian's packages by tests/support/systemdimage.py, cached), PID 1 handed to it by
``Init.auto()``: systemd reaches running (or degraded), guestd serves execs as its child,
a stop goes through systemd's shutdown (a unit's ExecStop runs) within the grace."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from images.build import Image
from supervisor.client import Boot, Init, NotFound, Sandbox, SandboxSpec
from supervisor.main.throwaway import supervisor_process, workdir
from supervisor.wire import protocol
from tests.support.systemdimage import systemd_rootfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mmdebstrap builds the systemd root as root")

# a unit whose start and stop leave marks on the root disk: its ExecStop runs only when
# systemd stops it, i.e. in systemd's own shutdown
MARK_UNIT = """[Unit]
Description=sandvisor hand-off mark
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'echo started >> /var/lib/sv-mark'
ExecStop=/bin/sh -c 'echo stopped-by-systemd >> /var/lib/sv-mark; sync'
[Install]
WantedBy=multi-user.target
"""


@pytest.fixture(scope="module")
def rootfs() -> Path:
    return systemd_rootfs()


@pytest.fixture(scope="module")
def served(image: Image, rootfs: Path) -> Iterator[tuple[dict[str, str], Path]]:
    with workdir("sv-init-") as work:
        log = work.root / "serve.log"
        with supervisor_process(work, "--allow-path", str(rootfs.parent), log=log) as (env, _):
            yield env, log


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def system_running(sb: Sandbox) -> str:
    """systemd's own answer once it is up: its manager socket appears once it runs (the
    sandbox is ready before systemd has started), then ``--wait`` waits out its boot."""
    r = sb.run(
        ["sh", "-c", "until [ -S /run/systemd/private ]; do sleep 0.1; done; systemctl is-system-running --wait"],
        timeout=240,
    )
    return r.stdout.decode().strip()


def test_systemd_is_pid_1_and_stops_through_its_shutdown(served: tuple[dict[str, str], Path], rootfs: Path) -> None:
    env, log = served
    sock = env["SANDVISOR_SOCKET"]
    spec = SandboxSpec(boot=Boot(rootfs=str(rootfs)))
    with Sandbox.create("sd", spec, socket=sock, init=Init.auto(), memory_mib=512, timeout=300) as sb:
        assert system_running(sb) in ("running", "degraded")
        # PID 1 is systemd (Init.Auto found /sbin/init); guestd, this exec's parent, its child
        assert sb.run(["cat", "/proc/1/comm"]).stdout == b"systemd\n"
        parent = sb.run(["sh", "-c", "cut -d' ' -f4 /proc/$PPID/stat"]).stdout.strip()
        assert parent == b"1"
        # systemd moved it from the root cgroup into init.scope, its own perpetual scope,
        # which it never stops (only its shutdown's last SIGTERM ends guestd)
        assert sb.run(["sh", "-c", "cat /proc/$PPID/cgroup"]).stdout == b"0::/init.scope\n"
        assert any(b"init: PID 1 is /sbin/init (systemd)" in e.data for e in sb.logs())
        mid = sb.fs.read("/etc/machine-id").strip()
        assert len(mid) == 32  # its own, written before systemd started
        sb.fs.write("/etc/systemd/system/sv-mark.service", MARK_UNIT.encode())
        r = sb.run(["sh", "-c", "systemctl daemon-reload && systemctl enable --now sv-mark.service"])
        assert r.exit_code == 0, r.stderr
        assert sb.fs.read("/var/lib/sv-mark") == b"started\n"
        # stop: guestd asks systemd (SIGRTMIN+4), systemd stops its units and powers off
        sb.stop()
        assert sb.inspect().state == "stopped"
        # within the grace: the ladder did not need QMP quit
        assert "guest poweroff did not stop QEMU" not in log.read_text()
        # a second boot hands off again; the mark says the first stop ran the unit's ExecStop
        sb.start()
        assert system_running(sb) in ("running", "degraded")
        assert sb.fs.read("/var/lib/sv-mark") == b"started\nstopped-by-systemd\nstarted\n"
        assert sb.fs.read("/etc/machine-id").strip() == mid  # kept: it is on the disk


# an init of a few lines (the default image has none): it stops on SIGTERM, leaving a mark
SHELL_INIT = (
    "trap 'echo \"stopped $SV_INIT $*\" >> /var/tmp/init-mark; sync; exit 0' TERM; "
    'echo "started $SV_INIT $*" >> /var/tmp/init-mark; while :; do sleep 1 & wait $!; done'
)


def started(sb: Sandbox, n: int) -> None:
    """Until the shell init has written its n-th start line."""
    wait = f"until [ $(grep -c '^started' /var/tmp/init-mark 2>/dev/null || echo 0) -ge {n} ]; do sleep 0.1; done"
    assert sb.run(["sh", "-c", wait], timeout=60).exit_code == 0


def test_init_cmd_with_arguments_and_environment(served: tuple[dict[str, str], Path]) -> None:
    """Init.cmd(path, args=, env=) on the default image: a shell script as PID 1, asked to
    stop with SIGTERM (not systemd); guestd serves execs as its child meanwhile."""
    env, log = served
    sock = env["SANDVISOR_SOCKET"]
    init = Init.cmd("/bin/sh", args=["-c", SHELL_INIT, "sh", "one", "two"], env={"SV_INIT": "yes"})
    with Sandbox.create("sh-init", socket=sock, init=init, timeout=300) as sb:
        argv = sb.run(["cat", "/proc/1/cmdline"]).stdout.split(b"\0")
        assert argv[:2] == [b"/bin/sh", b"-c"] and argv[-3:-1] == [b"one", b"two"], argv
        assert b"SV_INIT=yes" in sb.run(["cat", "/proc/1/environ"]).stdout.split(b"\0")
        assert sb.run(["sh", "-c", "cut -d' ' -f4 /proc/$PPID/stat"]).stdout.strip() == b"1"
        assert sb.run(["echo", "hi"]).stdout == b"hi\n"
        started(sb, 1)  # (the init runs on after ready)
        assert sb.fs.read("/var/tmp/init-mark") == b"started yes one two\n"
        sb.stop()
        assert "guest poweroff did not stop QEMU" not in log.read_text()
        sb.start()
        started(sb, 2)
        mark = sb.fs.read("/var/tmp/init-mark")
        assert mark == b"started yes one two\nstopped yes one two\nstarted yes one two\n", mark
        assert sb.inspect().init == protocol.InitSpec(
            "/bin/sh", ["-c", SHELL_INIT, "sh", "one", "two"], {"SV_INIT": "yes"}
        )


def test_cli_init_auto_without_an_init_fails_the_boot(served: tuple[dict[str, str], Path]) -> None:
    """``create --init auto`` on an image without an init: the sandbox fails, saying so;
    a relative path is refused at create."""
    env, _ = served
    r = cli(env, "create", "no-init", "--init", "auto")
    assert r.returncode != 0
    assert "no init in the image" in r.stderr, r.stderr
    r = cli(env, "create", "bad-init", "--init", "sbin/init")
    assert r.returncode != 0
    assert "absolute path" in r.stderr, r.stderr
    with pytest.raises(NotFound):
        Sandbox.get("bad-init", socket=env["SANDVISOR_SOCKET"])
