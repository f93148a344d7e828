"""Directory trees the tree-copy tests send and compare: one made with every kind of entry,
and a listing of a tree to compare two by."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def make_tree(root: Path, files: int = 1000) -> None:
    """``files`` files over nested directories, with modes, owners, symlinks (absolute,
    relative, dangling), empty directories, a hard link, a long and a non-ASCII name."""
    for i in range(files):
        d = root / f"d{i % 10}" / f"e{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"f{i}.bin"
        p.write_bytes(os.urandom(i * 37 % 9000) if i % 100 else b"")
        p.chmod(0o600 | (i % 0o200))
        if i % 3 == 0:
            os.chown(p, 1000 + i % 5, 100)
        os.utime(p, (1_600_000_000 + i, 1_600_000_000 + i))
    (root / "big.bin").write_bytes(os.urandom(3 << 20))
    (root / "empty" / "nested" / "deeper").mkdir(parents=True)
    (root / "empty").chmod(0o700)
    (root / "abs-link").symlink_to("/etc/passwd")
    (root / "d1" / "rel-link").symlink_to("../d2/e3")
    (root / "dangling").symlink_to("no/such/thing")
    os.link(root / "d0" / "e0" / "f0.bin", root / "hard-link")
    (root / ("long-" + "x" * 150)).write_text("long name")
    (root / "naïve ☃.txt").write_text("unicode")
    (root / "setuid").write_bytes(b"#!/bin/sh\n")
    (root / "setuid").chmod(0o4755)
    os.chown(root / "d5", 65534, 65534)


def listing(root: Path, *, mask: int = 0o7777) -> list[tuple[object, ...]]:
    """Every entry below ``root``: name, kind, mode, owner, size, whole-second mtime
    (directories: not the time, which their own contents' creation moved), link
    target, contents' hash."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            kind = "l" if p.is_symlink() else "d" if p.is_dir() else "f"
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if kind == "f" else ""
            out.append(
                (
                    str(p.relative_to(root)),
                    kind,
                    st.st_mode & mask if kind != "l" else 0,
                    st.st_uid,
                    st.st_gid,
                    st.st_size if kind == "f" else 0,
                    int(st.st_mtime) if kind == "f" else 0,
                    os.readlink(p) if kind == "l" else "",
                    digest,
                )
            )
    return sorted(out)
