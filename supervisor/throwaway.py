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
"""

from __future__ import annotations

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

from actors.registry import Registry
from images.build import default_cache
from supervisor.daemon import serve
from supervisor.daemon_config import DaemonConfig


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
    before ``-m supervisor.cli`` (benchmarks: ``-m cProfile -o FILE``)."""
    env = work.env()
    argv = [
        sys.executable,
        *python_args,
        "-m",
        "supervisor.cli",
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
