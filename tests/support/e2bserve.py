"""A throwaway supervisor serving the E2B endpoint, for the tests that drive the real
e2b SDKs against it (tests/vm/test_e2b*.py, test_code_interpreter.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from supervisor.main.throwaway import Workdir, supervisor_process, workdir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 60) -> None:
    """Until 127.0.0.1:``port`` takes a connection (serve's socket is there before its
    E2B port), bounded."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextmanager
def e2b_endpoint(prefix: str, keys: str) -> Iterator[tuple[str, Workdir]]:
    """(the endpoint's URL, the supervisor's work dir): ``keys`` the key file's lines.
    Pulls only from a registry nobody runs: a template taken for an image reference
    never leaves the host."""
    with workdir(prefix) as work:
        key_file = work.root / "keys"
        key_file.write_text(keys)
        key_file.chmod(0o600)
        port = free_port()
        args = ("--e2b", f"127.0.0.1:{port}", "--e2b-key-file", str(key_file), "--registry-allow", "127.0.0.1:9")
        with supervisor_process(work, *args, log=work.root / "serve.log"):
            wait_port(port)
            yield f"http://127.0.0.1:{port}", work
