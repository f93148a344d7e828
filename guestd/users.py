"""Users and groups: ``name``, ``uid`` or ``user:group`` resolved from the rootfs' own
/etc/passwd and /etc/group (no NSS, no pwd module: the rootfs may have neither)."""

from __future__ import annotations

import os


def _read_db(path: str) -> list[list[str]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n").split(":") for line in f if line.strip() and not line.startswith("#")]
    except OSError:
        return []


_USER_CACHE: dict[str, tuple[tuple[int, ...], tuple[int, int, list[int], str, str]]] = {}


def _db_stamp() -> tuple[int, ...]:
    st = []
    for path in ("/etc/passwd", "/etc/group"):
        try:
            s = os.stat(path)
            st += [s.st_ino, s.st_size, s.st_mtime_ns]
        except OSError:
            st += [0, 0, 0]
    return tuple(st)


def resolve_user(spec: str) -> tuple[int, int, list[int], str, str]:
    """``name``, ``uid`` or ``uid:gid`` -> (uid, gid, groups, home, name), from the rootfs'
    files. Cached per spec while both files are unchanged (two stats instead of reading
    and parsing both files on every exec)."""
    if not spec:
        spec = "root"
    stamp = _db_stamp()
    hit = _USER_CACHE.get(spec)
    if hit is not None and hit[0] == stamp:
        uid, gid, groups, home, name = hit[1]
        return uid, gid, list(groups), home, name
    found = _resolve_user(spec)
    if len(_USER_CACHE) > 64:
        _USER_CACHE.clear()
    _USER_CACHE[spec] = (stamp, found)
    return found


def _resolve_user(spec: str) -> tuple[int, int, list[int], str, str]:
    user, _, group = spec.partition(":")
    passwd = _read_db("/etc/passwd")
    entry = None
    for row in passwd:
        if len(row) >= 7 and (row[0] == user or (user.isdigit() and row[2] == user)):
            entry = row
            break
    if entry is not None:
        name, uid, gid, home = entry[0], int(entry[2]), int(entry[3]), entry[5] or "/"
    elif user.isdigit():
        name, uid, gid, home = user, int(user), int(user), "/"
    elif user == "root":
        name, uid, gid, home = "root", 0, 0, "/root"
    else:
        raise LookupError(f"unknown user {user!r}")
    groups_db = _read_db("/etc/group")
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            for row in groups_db:
                if len(row) >= 3 and row[0] == group:
                    gid = int(row[2])
                    break
            else:
                raise LookupError(f"unknown group {group!r}")
    groups = {gid}
    for row in groups_db:
        if len(row) >= 4 and name in row[3].split(","):
            try:
                groups.add(int(row[2]))
            except ValueError:
                pass
    return uid, gid, sorted(groups), home, name
