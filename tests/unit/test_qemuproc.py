"""QEMU's process (actors/machines/qemuproc.py): a socket reached by path must be QEMU's."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest


def test_a_socket_reached_by_path_must_be_qemus() -> None:
    """An escaped QEMU could swap its socket for a symlink to another service's: the
    listener's pid, as the kernel recorded it, must be QEMU's."""
    from actors.machines.qemuproc import LaunchError, check_peer

    a, b = socket.socketpair()
    with a, b:
        check_peer(a, os.getpid(), Path("qmp.sock"))  # (a socketpair's peer is this process)
        with pytest.raises(LaunchError, match="is not QEMU's"):
            check_peer(b, os.getpid() + 1, Path("qmp.sock"))
