"""Paths and defaults of the supervisor, from the environment and the invoking user."""

from __future__ import annotations

import os
from pathlib import Path


def default_socket() -> Path:
    """``SANDVISOR_SOCKET``, else /run/sandvisor/sandvisor.sock for root, else under $XDG_RUNTIME_DIR."""
    env = os.environ.get("SANDVISOR_SOCKET")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/run/sandvisor/sandvisor.sock")
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/sandvisor-{os.geteuid()}"
    return Path(runtime) / "sandvisor" / "sandvisor.sock"


def default_run_root() -> Path:
    """Short paths for per-VM sockets (AF_UNIX paths are limited to 107 bytes)."""
    if os.geteuid() == 0:
        return Path("/run/sandvisor/vms")
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/sandvisor-{os.geteuid()}"
    return Path(runtime) / "sandvisor" / "vms"


def default_memory_dir(state_dir: Path) -> Path | None:
    """Where guest RAM files live: tmpfs (/dev/shm), one directory per state dir (two
    supervisors never sweep each other's files). None where there is no /dev/shm:
    guest RAM is then anonymous and checkpoints stream it."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return None
    import hashlib  # (here: the quick CLI, given a socket, never needs it; 2.6 ms measured)

    key = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return shm / f"sandvisor-{key}"
