"""The README's quick start, run as it stands, on the machine's real default paths.

The blocks of README.md marked ``<!-- quickstart -->`` are the commands: each line of a
``sh`` block runs in bash from the project's root, each ``python`` block runs whole.
Nothing is copied here, so the README and this test cannot drift apart. Three lines are
the shell's own business and get the shell's meaning: ``. .nox/demo/bin/activate`` (the
tests already run in a virtualenv with ``sandvisor`` on PATH), ``CMD &`` (started in the
background, as the shell's job 1) and ``kill %1`` (SIGTERM to that job). ``exec -it``
gets a real terminal and types ``exit``.

After the supervisor has stopped, nothing of it may be left: no QEMU, cgroup, mount,
network namespace or link, nft table, file under /run/sandvisor or /dev/shm, sandbox,
snapshot or volume that was not there before. Where systemd runs, the same again with
the unit file starting and stopping the supervisor.
"""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from actors.cells.cgroups import detect
from actors.store import Store
from supervisor.wire.config import default_memory_dir

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARK = "<!-- quickstart -->"
RUN_DIR = Path("/run/sandvisor")
SOCKET = RUN_DIR / "sandvisor.sock"
STATE = Path("/var/lib/sandvisor")
ACTIVATE = ". .nox/demo/bin/activate"

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(os.geteuid() != 0, reason="the quick start runs as root, on /run/sandvisor"),
]


def quickstart_blocks(text: str | None = None) -> list[tuple[str, str]]:
    """(language, body) of each marked fenced block, in the README's order."""
    lines = (README.read_text() if text is None else text).splitlines()
    blocks: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == MARK:
            fence = lines[i + 1].strip()
            assert fence.startswith("```") and len(fence) > 3, f"README line {i + 2}: a marked block must follow {MARK}"
            body: list[str] = []
            i += 2
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((fence[3:], "\n".join(body)))
        i += 1
    return blocks


def test_the_readme_has_quickstart_blocks() -> None:
    """The parser finds what the test runs: shell lines and the SDK's blocks."""
    blocks = quickstart_blocks()
    langs = [lang for lang, _ in blocks]
    assert "sh" in langs and "python" in langs
    commands = " ".join(body for lang, body in blocks if lang == "sh")
    for word in ("create", "run", "exec", "cp", "ls", "inspect", "logs", "checkpoint", "restore", "snapshots"):
        assert f"sandvisor {word}" in commands, word
    for word in ("port", "volume", "rm", "serve", "status"):
        assert f"sandvisor {word}" in commands, word
    assert commands.rstrip().endswith("kill %1"), "the quick start ends by stopping the supervisor"


# --- what a supervisor may leave behind -----------------------------------------------
def _our_qemus() -> set[int]:
    pids = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system" in cmd.split(b"\0")[0] and (b"/run/sandvisor/" in cmd or b"/var/lib/sandvisor/" in cmd):
            pids.add(int(d.name))
        else:
            try:
                if os.readlink(d / "cwd").startswith(str(RUN_DIR)) and b"qemu" in cmd:
                    pids.add(int(d.name))
            except OSError:
                pass
    return pids


def _entries(path: Path | None) -> set[str]:
    if path is None:
        return set()
    try:
        return {str(p) for p in path.rglob("*")}
    except OSError:
        return set()


def _cgroups() -> set[str]:
    cg = detect()
    if cg is None:
        return set()
    return {str(p) for d in cg.parent_dirs() if d.is_dir() for p in d.iterdir() if p.is_dir()}


def _out(argv: list[str]) -> str:
    if not shutil.which(argv[0]):
        return ""
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30).stdout


def leftovers() -> dict[str, set[str]]:
    """What a supervisor on the default paths owns, as it stands now."""
    shm = default_memory_dir(STATE)
    mounts = {line for line in Path("/proc/self/mountinfo").read_text().splitlines() if "sandvisor" in line}
    links = {m for m in re.findall(r"^\d+: ([^:@]+)", _out(["ip", "-o", "link"]), re.M) if m.startswith(("svn", "svj"))}
    return {
        "qemu": {str(p) for p in _our_qemus()},
        "cgroups": _cgroups(),
        "mounts": mounts,
        "netns": {n.split()[0] for n in _out(["ip", "netns", "list"]).splitlines() if n.startswith("svj")},
        "links": links,
        "nft": {t for t in _out(["nft", "list", "tables"]).splitlines() if "sandvisor" in t},
        "run": _entries(RUN_DIR) | _entries(Path("/run/sandvisor-net")) | _entries(Path("/run/sandvisor-cgroup")),
        "shm": _entries(shm) | ({str(shm)} if shm is not None and shm.exists() else set()),
        "sandboxes": _entries(STATE / "sandboxes"),
        "snapshots": _snapshots(),
        "volumes": _entries(STATE / "volumes"),
    }


def _snapshots() -> set[str]:
    """Snapshot dirs that are not boot templates (those are the state dir's cache, kept
    on purpose), and any dir no record names (an orphan)."""
    db = STATE / "sandvisor.db"
    if not db.exists():
        return _entries(STATE / "snapshots")
    store = Store(db)
    try:
        templates = {Path(r.dir).name for r in store.snapshots() if r.hidden}
    finally:
        store.close()
    d = STATE / "snapshots"
    return {str(p) for p in d.iterdir() if p.name not in templates} if d.is_dir() else set()


def _serving(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


# --- running the README ---------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's sandvisor
    env.pop("SANDVISOR_SOCKET", None)
    env.pop("SANDVISOR_STATE_DIR", None)
    env["PYTHONPATH"] = str(ROOT)
    return env


def _terminal(line: str, typed: bytes, timeout: float = 180) -> str:
    """``line`` with a pseudo-terminal as its stdio, ``typed`` written to it."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        ["bash", "-c", line], stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=_env(), start_new_session=True
    )
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    sent = False
    try:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"{line!r} did not end: {out.decode(errors='replace')[-2000:]}"
            ready, _, _ = select.select([master], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal's other end is gone
                    break
                if not chunk:
                    break
                out += chunk
                if not sent and b"#" in out:  # the guest shell's prompt (root's)
                    os.write(master, typed)
                    sent = True
            elif not sent and time.monotonic() > deadline - timeout + 20:
                os.write(master, typed)  # no prompt seen in 20 s: type anyway
                sent = True
        assert proc.wait(timeout=60) == 0, f"{line!r} failed: {out.decode(errors='replace')[-2000:]}"
        return out.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class QuickStart:
    """Runs the marked blocks; ``start``/``stop`` stand for ``CMD &`` and ``kill %1``."""

    def __init__(self, start: Callable[[str], None], stop: Callable[[], None]) -> None:
        self.start = start
        self.stop = stop
        self.outputs: list[tuple[str, str]] = []

    def run_all(self) -> None:
        for lang, body in quickstart_blocks():
            if lang == "python":
                self._run([sys.executable, "-c", body], body)
                continue
            assert lang == "sh", f"a quickstart block in {lang!r}: the test runs sh and python"
            for raw in body.splitlines():
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                if line.split("#")[0].strip() == ACTIVATE:
                    continue  # (this test's own virtualenv has the command)
                if line.split("#")[0].rstrip().endswith("&") and not line.split("#")[0].rstrip().endswith("&&"):
                    self.start(line.split("#")[0].rstrip()[:-1].strip())
                elif line == "kill %1":
                    self.stop()
                elif " exec -it " in f" {line} ":
                    out = _terminal(line, b"echo quickstart-$((6*7)); exit\r")
                    assert "quickstart-42" in out, out[-2000:]
                else:
                    self._run(["bash", "-c", f"set -eo pipefail; {line}"], line)

    def _run(self, argv: list[str], what: str) -> None:
        r = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False)
        assert r.returncode == 0, f"{what!r} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        self.outputs.append((what, r.stdout))

    def output_of(self, fragment: str) -> str:
        return "".join(out for what, out in self.outputs if fragment in what)


def _check(qs: QuickStart, before: dict[str, set[str]]) -> None:
    assert "hello from a microVM" in qs.output_of('print("hello from a microVM")')
    assert "prepared" in qs.output_of("cat /root/state")
    deadline = time.monotonic() + 30  # (a QEMU killed last is reaped by its parent's exit)
    while True:
        after = leftovers()
        left = {k: sorted(v - before[k]) for k, v in after.items() if v - before[k]}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"left behind by the supervisor: {left}"


@contextmanager
def _nothing_serving() -> Iterator[dict[str, set[str]]]:
    if _serving(SOCKET):
        pytest.skip(f"a supervisor already serves on {SOCKET}: the quick start needs the default paths")
    yield leftovers()


def test_quickstart_as_the_readme_says(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    procs: list[subprocess.Popen[bytes]] = []

    def start(cmd: str) -> None:
        assert not procs, "one background job: the supervisor"
        with open(log, "wb") as f:
            procs.append(
                subprocess.Popen(
                    ["bash", "-c", f"exec {cmd}"], cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT
                )
            )

    def stop() -> None:
        proc = procs[0]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        assert rc == 0, f"serve exited {rc}: {log.read_text()[-3000:]}"

    with _nothing_serving() as before:
        qs = QuickStart(start, stop)
        try:
            qs.run_all()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        _check(qs, before)


@pytest.mark.skipif(
    not Path("/run/systemd/system").is_dir() or not shutil.which("systemctl"), reason="systemd does not run here"
)
def test_quickstart_under_systemd() -> None:
    """The same commands with the unit file starting and stopping the supervisor."""
    unit = Path("/run/systemd/system/sandvisor.service")
    if unit.exists():
        pytest.skip(f"{unit} exists: not ours to replace")
    text = (ROOT / "supervisor/main/systemd/sandvisor.service").read_text()
    exe = Path(sys.executable).parent / "sandvisor"
    text = re.sub(r"^ExecStart=.*$", f"ExecStart={exe} serve", text, flags=re.M)
    text = text.replace("[Service]\n", f"[Service]\nEnvironment=PYTHONPATH={ROOT}\n", 1)

    def systemctl(*args: str) -> None:
        subprocess.run(["systemctl", *args], check=True, timeout=180)

    with _nothing_serving() as before:
        unit.write_text(text)
        try:
            systemctl("daemon-reload")
            qs = QuickStart(lambda cmd: systemctl("start", "sandvisor"), lambda: systemctl("stop", "sandvisor"))
            try:
                qs.run_all()
            finally:
                subprocess.run(["systemctl", "stop", "sandvisor"], check=False, timeout=180)
            _check(qs, before)
        finally:
            unit.unlink(missing_ok=True)
            subprocess.run(["systemctl", "daemon-reload"], check=False, timeout=60)
