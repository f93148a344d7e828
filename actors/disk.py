"""qcow2 layers: headers, backing chains, overlays.

A sandbox's disk is a chain of qcow2 layers over a read-only base::

    sandbox overlay (read-write) -> snapshot disk -> ... -> base rootfs (raw or qcow2)

QEMU never opens a layer by path (it runs unprivileged and gets descriptors, see
:class:`~actors.machine.MachineSpec`), so the supervisor reads the chain from the
headers itself: the backing file name is at offsets 8 (offset) and 16 (length).
"""

from __future__ import annotations

import struct
from pathlib import Path

import trio

from actors.machine import LaunchError

QCOW2_MAGIC = b"QFI\xfb"
MAX_CHAIN = 64


class DiskError(LaunchError):
    """A layer is missing, unreadable or not what its parent's header says."""


def is_qcow2(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == QCOW2_MAGIC


def qcow2_header(path: Path) -> tuple[int, Path | None]:
    """(virtual size in bytes, backing file or None) of a qcow2 image."""
    with open(path, "rb") as f:
        head = f.read(32)
        if len(head) < 32 or head[:4] != QCOW2_MAGIC:
            raise DiskError(f"{path} is not a qcow2 image")
        off, length = struct.unpack(">QI", head[8:20])
        size = struct.unpack(">Q", head[24:32])[0]
        if not off or not length:
            return size, None
        if length > 1023:
            raise DiskError(f"{path}: backing file name of {length} bytes")
        f.seek(off)
        name = f.read(length).decode()
    backing = Path(name)
    if not backing.is_absolute():
        backing = path.parent / backing
    return size, backing


def backing_chain(path: Path) -> tuple[Path, ...]:
    """The layers below ``path``, nearest first, down to the base."""
    chain: list[Path] = []
    cur = path
    while is_qcow2(cur):
        _, backing = qcow2_header(cur)
        if backing is None:
            break
        if not backing.exists():
            raise DiskError(f"{cur} is backed by {backing}, which is missing")
        chain.append(backing)
        if len(chain) > MAX_CHAIN:
            raise DiskError(f"{path}: backing chain longer than {MAX_CHAIN}")
        cur = backing
    return tuple(chain)


def virtual_size(path: Path) -> int:
    return qcow2_header(path)[0] if is_qcow2(path) else path.stat().st_size


async def create_overlay(base: Path, overlay: Path, *, backing_as: Path | None = None) -> None:
    """A qcow2 overlay on ``base`` (raw or qcow2). ``-u`` with the size read here:
    qemu-img then does not open the chain (it may hold layers QEMU has open).
    ``backing_as``: the name to record for the backing file when ``base`` is about to
    move there (a checkpoint freezes the overlay into the snapshot's directory)."""
    base = base.resolve()
    fmt = "qcow2" if is_qcow2(base) else "raw"
    name = str(backing_as.resolve() if backing_as else base)
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", name, "-F", fmt, str(overlay)]
    argv.append(str(virtual_size(base)))
    p = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    if p.returncode != 0:
        raise DiskError(f"qemu-img create failed: {p.stderr.decode(errors='replace').strip()}")
