"""From an unpacked image tree to a bootable ext4 file: the fix-ups (mount points, a
missing WORKDIR owned by the image's USER), sizing, ``mkfs.ext4 -d``'s arguments, and
taking its output over. The tree is the image's, hostile: nothing here follows a symlink."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from images.oci.errors import ConversionError, DiskFull, UnsupportedImage
from images.oci.image import ImageConfig
from images.tools import SHIFT_COUNT

_CODE_VERSION = 1  # bump when the conversion changes what a rootfs holds
_MOUNT_POINTS = (("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("tmp", 0o1777), ("run", 0o755))


def prepare_tree(
    tree: Path, cfg: ImageConfig, shift: int, *, max_image_bytes: int | None, free_min: int, free_ratio: float
) -> tuple[tuple[int, int], int]:
    """Make the unpacked tree bootable and size its ext4: ((content bytes, inodes), fs bytes).

    The tree is the image's: its symlinks may point anywhere on the host, so nothing
    here follows one (mount points are replaced, a WORKDIR behind a symlink is left).
    ``shift``: the host id of image id 0 (the tools' user namespace; 0 without cells)."""
    for name, mode in _MOUNT_POINTS:
        p = tree / name
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            p.unlink()  # a file or symlink where /init mounts a file system
            st = None
        if st is None:
            p.mkdir()
            os.chmod(p, mode)
            if shift:
                os.lchown(p, shift, shift)
    if cfg.working_dir:
        _make_workdir(tree, cfg, shift)
    content, inodes = _tree_size(tree)
    if max_image_bytes is not None and content > max_image_bytes:
        raise DiskFull(f"the image unpacks to {content} bytes, over this store's cap of {max_image_bytes}")
    free = max(free_min, int(content * free_ratio))
    meta = inodes * 2 * 256 + (128 << 20)  # inode tables (twice the inodes: room) + journal + slack
    fs = (int(content * 1.05) + meta + free + (1 << 20) - 1) & ~((1 << 20) - 1)
    return (content, inodes), fs


def _make_workdir(tree: Path, cfg: ImageConfig, shift: int = 0) -> None:
    """Create a missing WORKDIR owned by the image's user (a runtime would; guestd needs
    the directory to exist). Never through a symlink: the tree is untrusted."""
    parts = [p for p in os.path.normpath("/" + cfg.working_dir).split("/") if p]
    cur = tree
    created = []
    for part in parts:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            os.mkdir(cur)
            os.chmod(cur, 0o755)  # whatever the supervisor's umask
            created.append(cur)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return  # a symlink or a file on the way: leave the image as it is
    if created:
        uid, gid = _resolve_user(tree, cfg.user)
        if shift and not (0 <= uid < SHIFT_COUNT and 0 <= gid < SHIFT_COUNT):
            raise UnsupportedImage(f"the image's user {cfg.user!r} is outside ids 0-{SHIFT_COUNT - 1}")
        for d in created[:-1]:
            os.chown(d, shift, shift, follow_symlinks=False)
        os.chown(created[-1], uid + shift, gid + shift, follow_symlinks=False)


def _resolve_user(tree: Path, user: str) -> tuple[int, int]:
    """USER -> (uid, gid) from the image's /etc/passwd and /etc/group, as guestd resolves
    it (a numeric uid without an entry gets gid = uid). Unknown names: root."""
    name, _, group = (user or "root").partition(":")
    uid = gid = 0
    passwd = _read_image_file(tree, "etc/passwd")
    rows = [ln.split(":") for ln in passwd.splitlines() if ln and not ln.startswith("#")]
    for row in rows:
        if len(row) >= 4 and (row[0] == name or (name.isdigit() and row[2] == name)):
            with contextlib.suppress(ValueError):
                uid, gid = int(row[2]), int(row[3])
            break
    else:
        if name.isdigit():
            uid = gid = int(name)
    if group.isdigit():
        gid = int(group)
    elif group:
        for row in (ln.split(":") for ln in _read_image_file(tree, "etc/group").splitlines()):
            if len(row) >= 3 and row[0] == group and row[2].isdigit():
                gid = int(row[2])
    return uid, gid


def _read_image_file(tree: Path, rel: str) -> str:
    """A small file of the image, refusing symlinks on the way (they could name host files)."""
    cur = tree
    for part in rel.split("/"):
        cur = cur / part
        try:
            if stat.S_ISLNK(os.lstat(cur).st_mode):
                return ""
        except OSError:
            return ""
    try:
        fd = os.open(cur, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return ""
        return f.read(1 << 20).decode(errors="replace")


def _tree_size(tree: Path) -> tuple[int, int]:
    """(bytes the tree takes in 4 KiB blocks, inodes), hard links counted once."""
    total, inodes, seen = 0, 0, set()
    stack = [str(tree)]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            entries = 0
            for e in it:
                entries += 1
                st = e.stat(follow_symlinks=False)
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                inodes += 1
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                elif stat.S_ISREG(st.st_mode) or (stat.S_ISLNK(st.st_mode) and st.st_size > 59):
                    total += (st.st_size + 4095) & ~4095
        total += max(4096, ((entries * 64) + 4095) & ~4095)  # the directory's own blocks
    return total, inodes + 1


def _mkfs_argv(tree: Path, out: Path, size: int, content: tuple[int, int], fs_uuid: str) -> list[str]:
    inodes = content[1] + max(65536, content[1])
    return [
        "mkfs.ext4",
        "-q",
        "-F",
        "-L",
        "sandvisor-oci",
        "-U",
        fs_uuid,
        "-b",
        "4096",
        "-m",
        "0",
        "-N",
        str(inodes),
        "-E",
        "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0",
        "-d",
        str(tree),
        str(out),
        f"{size // 1024}k",
    ]


def _own_output(out: Path, name: str) -> None:
    """mkfs's output made the supervisor's: ``out`` holds one regular file of one link
    (a tool in a cell wrote it), now root's and 0444."""
    if os.listdir(out) != [name]:
        raise ConversionError(f"mkfs.ext4 left {sorted(os.listdir(out))[:5]} in its output dir")
    fd = os.open(out / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ConversionError("mkfs.ext4's output is not a plain file")
        if os.geteuid() == 0:
            os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o444)
    finally:
        os.close(fd)
    if os.geteuid() == 0:
        os.lchown(out, 0, 0)
