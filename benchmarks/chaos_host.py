"""The chaos harness's hands on the host: ``sandvisor serve`` as a child process it
kills and starts again, the state dir on a small filesystem of its own, and what
belongs to one serve on the host (/proc, its run root, RAM dir, cgroups, mounts,
network namespaces), gathered as :class:`chaos_checks.HostFacts`."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack

from actors.cells.cgroups import detect
from images.build import default_cache
from supervisor.main.throwaway import Workdir, kill_processes, supervisor_process
from supervisor.wire.config import default_memory_dir

if __package__:
    from benchmarks import chaos_checks as checks
else:  # (run as a script: benchmarks/ is on the path)
    import chaos_checks as checks  # type: ignore[no-redef]


class Serve:
    """``sandvisor serve`` as a child process the harness kills and starts again."""

    def __init__(self, work: Workdir, log: Path) -> None:
        self.work, self.log = work, log
        self.kills = 0  # bumped at every kill: an operation that saw it change was cut
        self._cm: Any = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, crash_at: str = "") -> None:
        env = {"SANDVISOR_CRASH_AT": crash_at} if crash_at else None
        self._cm = supervisor_process(self.work, extra_env=env, log=self.log, start_timeout=120)
        _, self.proc = self._cm.__enter__()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        self.kills += 1
        if self.proc is not None:
            self.proc.kill()  # SIGKILL: no cleanup at all
            self.proc.wait()
            self._cm.__exit__(None, None, None)
            self.proc = None

    def stop(self) -> int:
        """SIGTERM (stops every sandbox); its exit status."""
        if self.proc is None:
            return 0
        proc, self.proc = self.proc, None
        self._cm.__exit__(None, None, None)
        return proc.returncode


# --- what is on the host -------------------------------------------------------------------------
def host_facts(work: Workdir, serve_pid: int, state_mount: Path | None) -> checks.HostFacts:
    qemus: dict[int, str] = {}
    others: dict[int, str] = {}
    for pid, what in work.processes().items():
        if pid == serve_pid:
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"qemu-system" in argv[0]:  # (a jailed QEMU names its run dir nowhere but in its cgroup)
            cgroup = Path(f"/proc/{pid}/cgroup").read_text(errors="replace").replace("\n", " ")
            qemus[pid] = " ".join(a.decode(errors="replace") for a in argv) + " " + cgroup
        else:
            others[pid] = what
    mounts: set[str] = set()
    root = str(work.root) + "/"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4]
            if point.startswith(root) and Path(point) != state_mount:
                mounts.add(point)
    ram = default_memory_dir(work.state)
    cgroups = detect(parent=f"sandvisor-{work.key}") if os.geteuid() == 0 else None
    stray = [
        *_files_in_children(work.state / "sandboxes", lambda n: n == "disk.next.qcow2"),
        *_files_in_children(work.state / "snapshots", lambda n: n.endswith(".part")),
    ]
    return checks.HostFacts(
        qemus=qemus,
        others=others,
        run_entries=frozenset(os.listdir(work.run_root)) if work.run_root.is_dir() else frozenset(),
        ram_files=frozenset(os.listdir(ram)) if ram is not None and ram.is_dir() else frozenset(),
        cgroups=frozenset(cgroups.names()) if cgroups is not None else frozenset(),
        mounts=frozenset(mounts),
        netns=frozenset(work.jail_namespaces()),
        stray_files=frozenset(str(p.relative_to(work.root)) for p in stray),
    )


def _files_in_children(parent: Path, wanted: Callable[[str], bool]) -> list[Path]:
    """The wanted files one level below PARENT's subdirectories. The supervisor runs on
    while this looks: a directory listed and then removed (a snapshot deleted) has
    nothing in it, where Path.glob (Python 3.11, as here) raises."""
    found: list[Path] = []
    with contextlib.suppress(OSError), os.scandir(parent) as children:
        for child in children:
            with contextlib.suppress(OSError):
                found += [Path(child.path, n) for n in os.listdir(child.path) if wanted(n)]
    return found


def footprint(pid: int) -> tuple[int, int]:
    """The process's open fds and RSS (MiB)."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) // 1024
    return fds, rss


@contextlib.contextmanager
def state_filesystem(work: Workdir, size_mib: int) -> Iterator[Path | None]:
    """The state dir on its own small ext4 (a loop device), so it can be filled; None
    (the state dir stays on /tmp) when not root."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        yield None
        return
    image = work.root / "state.img"
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(work.state)], check=True, capture_output=True)
    try:
        work.state.chmod(0o700)
        (work.state / "images").symlink_to(default_cache())
        yield work.state
    finally:
        # nothing of the workdir may still hold it (an interrupted run: a serve stopping,
        # its QEMUs); the run reported them already, the workdir records them again
        kill_processes(work)
        if subprocess.run(["umount", str(work.state)], check=False, capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(work.state)], check=False, capture_output=True)
        image.unlink(missing_ok=True)


def qemu_pid(work: Workdir, id: str) -> int:
    """The pid serve records for a sandbox's QEMU (only to aim the fault at it)."""
    db = sqlite3.connect(f"file:{work.state / 'sandvisor.db'}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT qemu_pid FROM sandboxes WHERE id=?", (id,)).fetchone()
    finally:
        db.close()
    return int(row[0]) if row and row[0] else 0


def http_get(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET /{path} HTTP/1.0\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def saved_states(work: Workdir) -> checks.SavedStates:
    """The snapshot directories that hold a machine's saved memory (its memory file or
    a migration stream), and the store's snapshot records: their directories and how
    many are a fork's hidden snapshot or a paused sandbox's saved state."""
    memory: list[str] = []
    with contextlib.suppress(OSError):
        for d in sorted((work.state / "snapshots").iterdir()):
            with contextlib.suppress(OSError):
                if any(n == "memory" or n.startswith("vmstate") for n in os.listdir(d)):
                    memory.append(str(d))
    recorded: set[str] = set()
    forks = paused = 0
    with contextlib.suppress(sqlite3.Error):
        db = sqlite3.connect(f"file:{work.state / 'sandvisor.db'}?mode=ro", uri=True)
        try:
            for (blob,) in db.execute("SELECT data FROM snapshots").fetchall():
                rec = msgpack.unpackb(blob, raw=False)
                recorded.add(str(rec.get("dir", "")))
                forks += bool(rec.get("fork_only"))
                paused += bool(rec.get("paused_for"))
        finally:
            db.close()
    return checks.SavedStates(memory, frozenset(recorded), forks, paused)
