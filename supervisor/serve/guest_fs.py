"""envd's file-system RPCs (Stat, ListDir, MakeDir, Move, Remove) on a sandvisor
sandbox, as commands run in the guest (GNU ``find``/``mkdir``/``mv``/``rm``) as the
caller's user: the one place that maps them, to switch to native file-system calls of
the supervisor when it has them.

Paths and names come back NUL-separated (a file name may hold anything but NUL and
``/``) and are parsed here as data; a hostile guest can lie about its own files only.
"""

from __future__ import annotations

import datetime
from typing import Any

from supervisor.client.sdk.aio import AsyncSandbox
from supervisor.client.sdk.spec import RunResult
from supervisor.wire import errors

# one record per entry: 10 NUL-terminated fields
_FIELDS = ("type", "target_type", "size", "mode", "permissions", "owner", "group", "mtime", "link", "path")
_FORMAT = r"%y\0%Y\0%s\0%m\0%M\0%u\0%g\0%T@\0%l\0%p\0"
_TYPES = {"f": "FILE_TYPE_FILE", "d": "FILE_TYPE_DIRECTORY", "l": "FILE_TYPE_SYMLINK"}
_MISSING, _EXISTS, _NOT_DIR = 44, 45, 46
_MAX_DEPTH = 64


async def exec_collect(sb: AsyncSandbox, argv: list[str], user: str) -> RunResult:
    """``argv`` as an Exec (which runs beside others, where a Run is one at a time),
    its stdin closed; its output and exit code."""
    out, err = bytearray(), bytearray()
    code = -1
    async with sb.exec(argv, user=user) as execd:
        await execd.close_stdin()
        async for o in execd:
            if o.stream == "exit":
                code = o.exit_code if o.exit_code is not None else -1
            elif o.stream == "stderr":
                err += o.data
            else:
                out += o.data
    return RunResult(bytes(out), bytes(err), code)


async def _sh(sb: AsyncSandbox, user: str, script: str, *args: str) -> bytes:
    """``script`` under ``sh -c`` with ``args`` as $1...; its stdout, or the error its
    exit code stands for."""
    r = await exec_collect(sb, ["/bin/sh", "-c", script, "sh", *args], user)
    if r.exit_code == _MISSING:
        raise errors.NotFound(errors.NOT_FOUND, f"path {args[0]!r} does not exist")
    if r.exit_code == _EXISTS:
        raise errors.AlreadyExists(errors.ALREADY_EXISTS, f"path {args[0]!r} already exists")
    if r.exit_code == _NOT_DIR:
        raise errors.InvalidArgument(errors.INVALID_ARGUMENT, f"path {args[0]!r} is not a directory")
    if r.exit_code != 0:
        msg = r.stderr.decode("utf-8", "replace").strip()[-500:]
        if "Permission denied" in msg:
            raise errors.PermissionDenied(errors.PERMISSION_DENIED, msg)
        raise errors.Internal(errors.INTERNAL, msg or f"exit code {r.exit_code}")
    return r.stdout


def _entries(out: bytes) -> list[dict[str, Any]]:
    fields = out.split(b"\0")[:-1]
    n = len(_FIELDS)
    entries = []
    for i in range(0, len(fields) - n + 1, n):
        f = dict(zip(_FIELDS, (x.decode("utf-8", "surrogateescape") for x in fields[i : i + n]), strict=True))
        path = f["path"]
        is_link = f["type"] == "l"
        kind = f["target_type"] if is_link else f["type"]
        try:
            mtime = datetime.datetime.fromtimestamp(float(f["mtime"]), datetime.UTC)
            size, mode = int(f["size"]), int(f["mode"], 8)
        except ValueError:
            continue
        entry: dict[str, Any] = {
            "name": path.rstrip("/").rsplit("/", 1)[-1] or "/",
            "type": _TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
            "path": path,
            "size": str(size),
            "mode": mode,
            "permissions": f["permissions"],
            "owner": f["owner"],
            "group": f["group"],
            "modifiedTime": mtime.isoformat().replace("+00:00", "Z"),
        }
        if is_link:
            entry["isSymlink"] = True
            entry["symlinkTarget"] = f["link"]
        entries.append(entry)
    return entries


_EXIST = f'[ -e "$1" ] || [ -L "$1" ] || exit {_MISSING}; '


async def stat(sb: AsyncSandbox, user: str, path: str) -> dict[str, Any]:
    out = await _sh(sb, user, _EXIST + f"exec find \"$1\" -maxdepth 0 -printf '{_FORMAT}'", path)
    entries = _entries(out)
    if not entries:
        raise errors.NotFound(errors.NOT_FOUND, f"path {path!r} does not exist")
    return entries[0]


async def list_dir(sb: AsyncSandbox, user: str, path: str, depth: int) -> list[dict[str, Any]]:
    depth = min(max(depth, 1), _MAX_DEPTH)
    script = (
        _EXIST + f'[ -d "$1" ] || exit {_NOT_DIR}; exec find "$1" -mindepth 1 -maxdepth {depth} -printf \'{_FORMAT}\''
    )
    base = path.rstrip("/") or "/"
    entries = _entries(await _sh(sb, user, script, base))
    return entries


async def make_dir(sb: AsyncSandbox, user: str, path: str) -> dict[str, Any]:
    await _sh(sb, user, f'[ -e "$1" ] && exit {_EXISTS}; exec mkdir -p -- "$1"', path)
    return await stat(sb, user, path)


async def move(sb: AsyncSandbox, user: str, source: str, destination: str) -> dict[str, Any]:
    await _sh(sb, user, _EXIST + 'exec mv -f -- "$1" "$2"', source, destination)
    return await stat(sb, user, destination)


async def remove(sb: AsyncSandbox, user: str, path: str) -> None:
    await _sh(sb, user, _EXIST + 'exec rm -rf -- "$1"', path)


async def make_parents(sb: AsyncSandbox, user: str, path: str) -> None:
    """The directories above ``path`` (envd's upload makes them)."""
    parent = path.rstrip("/").rsplit("/", 1)[0]
    if parent:
        await _sh(sb, user, 'exec mkdir -p -- "$1"', parent)
