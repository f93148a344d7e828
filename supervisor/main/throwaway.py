"""A throwaway supervisor on a temporary state dir that shares the built image.

The demo, the benchmarks and the tests all need one; this is the one way to make it::

    with workdir("sv-bench-") as work:              # /tmp/sv-bench-XXXX, removed after
        async with supervisor(work) as (cfg, registry):   # in this process, this Trio run
            ...
        with supervisor_process(work) as (env, proc):  # or `sandvisor serve` as a child process
            subprocess.run([...], env=env)             # SANDVISOR_SOCKET / _STATE_DIR point at it

Layout: ``<root>`` (0711: QEMU's unprivileged user passes through to its run dir),
``<root>/state`` (``images`` links to the built image cache), ``<root>/run`` (the run
root), ``<root>/s.sock``. ``private_state``: the state dir is 0700, so QEMU's user
cannot reach snapshot files in place (restores then link them into the run dir).

Nothing of a workdir's supervisors may outlive them: at its exit, after they are gone,
:func:`workdir` looks for what is still there (:func:`left_behind`: a process in one of
its cgroups -- QEMU, virtiofsd, a secret proxy, a tool cell --, or naming its dir; a
jail network namespace of its state dir), kills and removes it, and records it in
:data:`LEFT_BEHIND` (tests/conftest.py fails the test it happened in). Empty cgroups
and RAM files a killed supervisor left go quietly (the machine's reboot, for a host
that died).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.cells.cgroups import CgroupError, detect
from actors.net.hostnet import NETNS_DIR
from actors.registry import Registry
from images.build import default_cache
from supervisor.main.daemon import serve
from supervisor.main.daemon_config import DaemonConfig
from supervisor.wire.config import default_memory_dir

log = logging.getLogger("sandvisor.throwaway")
LEFT_BEHIND: list[str] = []  # what workdirs found still running at their exit (tests/conftest.py)


@attrs.frozen
class Workdir:
    root: Path

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def run_root(self) -> Path:
        return self.root / "run"

    @property
    def socket(self) -> Path:
        return self.root / "s.sock"

    def env(self) -> dict[str, str]:
        """The environment the SDK and the CLI find this supervisor by."""
        return {**os.environ, "SANDVISOR_SOCKET": str(self.socket), "SANDVISOR_STATE_DIR": str(self.state)}

    @property
    def key(self) -> str:
        """The state dir's key, as the supervisor derives it: its cgroup parent
        ``sandvisor-KEY`` (actors/cells/cell.py), RAM dir ``/dev/shm/sandvisor-KEY``
        (supervisor/wire/config.py), jail namespaces ``svj-KEY[:6]-*`` (supervisor/main/daemon.py)."""
        return hashlib.sha256(str(self.state.resolve()).encode()).hexdigest()[:12]

    def processes(self) -> dict[int, str]:
        """pid -> what, of every live process of this workdir's supervisors: in one of
        its cgroups (jailed QEMUs and the cells of virtiofsd, secret proxies, tools), or
        naming its dir on its command line (an unjailed QEMU; a supervisor)."""
        tag = f"/sandvisor-{self.key}/".encode()
        root = str(self.root).encode() + b"/"
        found: dict[int, str] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                with open(f"{entry.path}/stat", "rb") as f:
                    if f.read().rpartition(b")")[2].split()[0] == b"Z":
                        continue  # (exited: nothing runs)
                with open(f"{entry.path}/cgroup", "rb") as f:
                    cgroup = f.read()
                with open(f"{entry.path}/cmdline", "rb") as f:
                    argv = f.read()
                owner = os.stat(entry.path).st_uid
            except (OSError, IndexError):
                continue
            if tag in cgroup or root in argv:
                name = argv.split(b"\0", 1)[0].decode(errors="replace")
                why = "in its cgroups" if tag in cgroup else "names its dir"
                found[int(entry.name)] = f"process {entry.name} ({name}, uid {owner}, {why})"
        return found

    def jail_namespaces(self) -> list[str]:
        """Network namespaces of its sandboxes' outbound links (``ip netns`` names)."""
        prefix = f"svj-{self.key[:6]}-"
        with contextlib.suppress(OSError):
            return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
        return []


def kill_processes(work: Workdir, timeout: float = 120.0) -> dict[int, str]:
    """SIGKILL every process :meth:`Workdir.processes` finds, until none is left (each
    dies in its own time: a QEMU killed mid-I/O on a loaded host took over 30 s); what
    was found."""
    found: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while (now := work.processes()) and time.monotonic() < deadline:
        found.update(now)
        for pid in now:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return found


def left_behind(work: Workdir) -> list[str]:
    """After every supervisor of ``work`` has exited: what still runs of them (killed
    now), and their jail network namespaces (deleted); cgroups and RAM files left
    empty by a killed supervisor are removed too. What was found, for the record."""
    found = list(kill_processes(work).values())
    for ns in work.jail_namespaces():
        found.append(f"network namespace {ns}")
        subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True)
    cgroups = detect(parent=f"sandvisor-{work.key}") if os.geteuid() == 0 else None
    if cgroups is not None:
        try:
            busy = cgroups.collect(keep=set())  # (the killed ones' zombies, if any: not reaped yet)
            if not busy:
                cgroups.remove_parent()
        except (CgroupError, OSError) as exc:
            log.warning("cgroups of %s: %s", work.root, exc)
    ram = default_memory_dir(work.state)
    if ram is not None and ram.is_dir():
        shutil.rmtree(ram, ignore_errors=True)
    return found


@contextmanager
def workdir(prefix: str, *, private_state: bool = False, cache: Path | None = None) -> Iterator[Workdir]:
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        root.chmod(0o711)
        state = root / "state"
        state.mkdir(mode=0o700 if private_state else 0o755)
        (state / "images").symlink_to(cache or default_cache())
        yield Workdir(root)
    finally:
        found = left_behind(Workdir(root))
        if found:
            log.error("left behind by the supervisors of %s (killed, removed): %s", root, "; ".join(found))
            LEFT_BEHIND.extend(f"{root}: {what}" for what in found)
        shutil.rmtree(root, ignore_errors=True)


@asynccontextmanager
async def supervisor(work: Workdir, **options: Any) -> AsyncIterator[tuple[DaemonConfig, Registry]]:
    """``serve`` in this Trio run (TCG unless ``accel`` says otherwise); stopped after."""
    cfg = DaemonConfig(
        **{
            "socket": work.socket,
            "state_dir": work.state,
            "run_root": work.run_root,
            "accel": "tcg",
            "secrets_key": work.root / "secrets.key",  # (never the machine's /etc/sandvisor)
            **options,
        }
    )
    async with trio.open_nursery() as nursery:
        registry, _server = await nursery.start(serve, cfg)
        yield cfg, registry
        nursery.cancel_scope.cancel()


@contextmanager
def supervisor_process(
    work: Workdir,
    *args: str,
    start_timeout: float = 30.0,
    extra_env: dict[str, str] | None = None,
    log: Path | None = None,
    python_args: tuple[str, ...] = (),
) -> Iterator[tuple[dict[str, str], subprocess.Popen[bytes]]]:
    """``sandvisor serve`` as a child process, yielded once its socket is there with the
    environment that finds it; SIGTERM (a graceful stop) after, if it still runs.
    ``extra_env`` goes to the supervisor only (SANDVISOR_CRASH_AT: tests); its log
    (stderr) is appended to ``log``, if given. ``python_args`` go to the interpreter
    before ``-m supervisor.main.cli`` (benchmarks: ``-m cProfile -o FILE``)."""
    env = work.env()
    argv = [
        sys.executable,
        *python_args,
        "-m",
        "supervisor.main.cli",
        "serve",
        "--accel",
        "tcg",
        "--run-root",
        str(work.run_root),
        *args,
    ]
    if "--secrets-key" not in args:  # (never the machine's /etc/sandvisor)
        argv += ["--secrets-key", str(work.root / "secrets.key")]
    if "--ip-pool" not in args:  # the machine's own namespace: tap networking only where a test makes its own
        argv += ["--ip-pool", "none"]
    work.socket.unlink(missing_ok=True)
    with open(log, "ab") if log is not None else open(os.devnull, "wb") as err:  # (the child has its own copy)
        p = subprocess.Popen(argv, env={**env, **(extra_env or {})}, stderr=err)
    try:
        deadline = time.monotonic() + start_timeout
        while not work.socket.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sandvisor serve did not start (exit status {p.poll()})")
            time.sleep(0.05)
        yield env, p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
