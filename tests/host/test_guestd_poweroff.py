"""guestd's poweroff signals every process (``kill(-1)``): it must refuse anywhere but
as a guest's PID 1. Checked inside a PID namespace of its own, so a regression can only
kill the namespace's processes, never the host's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# PID 1 of the namespace forks; the child (PID 2) asks for a poweroff and must be refused
_SCRIPT = """
import os, sys
sys.path.insert(0, sys.argv[1])
from guestd import boot
pid = os.fork()
if pid == 0:
    try:
        boot.poweroff(-1, False, [])
    except RuntimeError as exc:
        print("refused:", exc, flush=True)
        os._exit(0)
    os._exit(3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_poweroff_refuses_unless_pid_1() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a PID namespace")
    p = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", _SCRIPT, str(REPO)],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert b"refused: poweroff: not PID 1" in p.stdout
