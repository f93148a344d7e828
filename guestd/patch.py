"""A patch of the guest's file system: the one definition of the concept.

The SDK builds them (``Patch.file(...)``), the wire carries them (a Create's
``patches``), the domain keeps them in the sandbox's record and checks them
(actors/model.py ``check_patches``: INVALID_ARGUMENT), and the guest channel sends each
as one entry of guestd's ``patch`` message (:meth:`Patch.to_wire`). Here, in guestd,
because both the SDK and the domain may import it (stdlib only: a dataclass, not
attrs; guestd's agent does not import it, it reads the entries as maps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPS = ("file", "append", "mkdir", "remove", "symlink")
# read on the supervisor's host (a path under serve --allow-path), sent to guestd as
# the file, mkdir and symlink entries they expand to (actors/hostcopy.py)
HOST_OPS = ("copy_file", "copy_dir")


@dataclass(frozen=True)
class Patch:
    """A change to the sandbox's file system, applied by guestd once, on the sandbox's
    fresh disk, before it is reported ready and before its initial command (not on a
    restart of its own disk, nor on a restore of its snapshots: they hold it already).
    Build with the class methods. ``owner``: user[:group] by the guest's names or ids
    ("" = root); ``mode`` None: 0644 for files, 0755 for directories. Checked where it
    enters the domain, not here (a bad one is INVALID_ARGUMENT there)."""

    op: str  # file | append | mkdir | remove | symlink
    path: str
    data: bytes = b""
    target: str = ""  # symlink: what the link points to
    mode: int | None = None
    owner: str = ""
    replace: bool = False  # file, symlink: replace what is there (else ALREADY_EXISTS)
    source: str = ""  # copy_file, copy_dir: the host path (absolute, under serve --allow-path)

    @classmethod
    def file(
        cls, path: str, data: bytes | str, *, mode: int | None = None, owner: str = "", replace: bool = False
    ) -> Patch:
        """A file with these contents (ALREADY_EXISTS if one is there, unless ``replace``)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        return cls("file", path, raw, mode=mode, owner=owner, replace=replace)

    @classmethod
    def append(cls, path: str, data: bytes | str, *, mode: int | None = None, owner: str = "") -> Patch:
        """Append to a file (made if missing)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        return cls("append", path, raw, mode=mode, owner=owner)

    @classmethod
    def mkdir(cls, path: str, *, mode: int | None = None, owner: str = "") -> Patch:
        """A directory, with its parents (idempotent; mode and owner apply to it)."""
        return cls("mkdir", path, mode=mode, owner=owner)

    @classmethod
    def remove(cls, path: str) -> Patch:
        """Remove a file or a directory tree (idempotent; symlinks removed, not followed)."""
        return cls("remove", path)

    @classmethod
    def symlink(cls, target: str, link: str, *, owner: str = "", replace: bool = False) -> Patch:
        """A symbolic link at ``link`` pointing to ``target``."""
        return cls("symlink", link, target=target, owner=owner, replace=replace)

    @classmethod
    def copy_file(cls, src: str, dst: str, *, mode: int | None = None, replace: bool = False) -> Patch:
        """The host file ``src`` (under the supervisor's ``--allow-path``, read by the
        supervisor at boot, never by the guest) as the guest file ``dst``; ``mode``
        None: the host file's permission bits."""
        return cls("copy_file", dst, mode=mode, replace=replace, source=str(src))

    @classmethod
    def copy_dir(cls, src: str, dst: str, *, replace: bool = False) -> Patch:
        """The host directory tree ``src`` (as copy_file; its symlinks copied as links,
        never followed) as the guest directory ``dst``."""
        return cls("copy_dir", dst, replace=replace, source=str(src))

    def to_wire(self) -> dict[str, Any]:
        """guestd's ``patch`` entry (fields at their defaults left out)."""
        d: dict[str, Any] = {"op": self.op, "path": self.path}
        if self.data:
            d["data"] = self.data
        if self.target:
            d["target"] = self.target
        if self.mode is not None:
            d["mode"] = self.mode
        if self.owner:
            d["owner"] = self.owner
        if self.replace:
            d["replace"] = True
        return d
