"""Volume images: raw ext4 files made and checked on the host, never mounted there.

A volume is a sparse file with an ext4 file system, made by ``mkfs.ext4`` (no loop
device, no mount: a file system the host never mounts cannot attack the host's
kernel), attached to a VM as virtio-blk (:class:`actors.machine.Volume`) and mounted
in the guest by guestd (``GuestChannel.mount``). Only the blocks the guest writes
take disk space: ``lazy_itable_init`` and ``lazy_journal_init`` leave the inode
tables and the journal unwritten at creation (the guest kernel zeroes the inode
tables in the background after the first mount).

A volume whose VM was killed (not powered off through guestd, which unmounts it)
has a journal that needs recovery: ext4 replays it on a read-write mount, but a
read-only device cannot be mounted at all then ("write access unavailable").
:func:`check_volume_image` (``e2fsck -p``) replays and checks it on the host; do it
before attaching a volume read-only, or after a crash.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import trio

MIN_VOLUME = 8 << 20  # ext4 with a journal needs a few MiB; below this mkfs refuses or wastes most of it
BLOCK = 4096


class VolumeError(Exception):
    """A volume image could not be made or is damaged; the message says why."""


async def _run(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    try:
        return await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    except FileNotFoundError:
        raise VolumeError(f"{argv[0]} is not installed (e2fsprogs)") from None


async def create_volume_image(path: Path, size: int, *, label: str = "", owner: tuple[int, int] = (0, 0)) -> int:
    """Make ``path`` (which must not exist) a sparse ``size``-byte ext4 image whose root
    directory belongs to ``owner`` (uid, gid in the guest). Returns the size used (a
    multiple of 4 KiB). Nothing is left behind on failure."""
    size = -(-size // BLOCK) * BLOCK
    if size < MIN_VOLUME:
        raise VolumeError(f"a volume needs at least {MIN_VOLUME >> 20} MiB")
    if len(label) > 16:
        raise VolumeError("an ext4 label has at most 16 bytes")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise VolumeError(f"cannot create {path}: {exc.strerror}") from None
    try:
        try:
            os.ftruncate(fd, size)  # sparse: no block is written
        finally:
            os.close(fd)
        argv = ["mkfs.ext4", "-q", "-F", "-b", str(BLOCK), "-m", "0"]
        if label:
            argv += ["-L", label]
        argv += ["-E", f"lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner={owner[0]}:{owner[1]}", str(path)]
        p = await _run(argv)
        if p.returncode != 0:
            raise VolumeError(f"mkfs.ext4 failed: {p.stderr.decode(errors='replace').strip()[-300:]}")
    except BaseException:
        with trio.CancelScope(shield=True):
            path.unlink(missing_ok=True)
        raise
    return size


async def check_volume_image(path: Path) -> bool:
    """``e2fsck -p``: replay the journal and fix what is safe to fix. True when the file
    system was clean, False when it was repaired; VolumeError when it needs a human."""
    p = await _run(["e2fsck", "-p", str(path)])
    if p.returncode == 0:
        return True
    if p.returncode in (1, 2):
        return False
    out = (p.stdout + p.stderr).decode(errors="replace").strip()
    raise VolumeError(f"e2fsck found damage it cannot fix safely ({p.returncode}): {out[-300:]}")
