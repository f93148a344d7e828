"""Names that survive a power cut: a rename (or a new file's link) is durable only
once its directory is fsynced; the file's data only once the file is. One helper for
every module of the supervisor that publishes a file by renaming it."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path, *, directory: bool = False) -> None:
    """fsync a file (its data and size) or, with ``directory``, a directory (its names)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the names in ``path`` durable (after a rename, link, create or unlink in it)."""
    fsync_path(path, directory=True)
