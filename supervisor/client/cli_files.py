"""``sandvisor fs ls|stat|exists|mkdir|rm|mv NAME:/path``: files of a sandbox beyond cp.

One-shot commands over a blocking socket (:func:`supervisor.client.cli_common.connect`), one
call each (FsList, FsStat, FsExists, FsMkdir, FsRemove, FsRename). Names and link
targets are the guest's: printed with control characters escaped.
"""

from __future__ import annotations

import argparse
import stat as st

from supervisor.client.cli_common import UsageError, connect
from supervisor.client.cli_output import print_json, print_table

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms; mypy reads the name)
if TYPE_CHECKING:
    from typing import Any

ACTIONS = ("ls", "stat", "exists", "mkdir", "rm", "mv")
_TYPE = {"file": st.S_IFREG, "dir": st.S_IFDIR, "symlink": st.S_IFLNK}


def _remote(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition(":")
    if not sep or not name or not path.startswith("/"):
        raise UsageError(f"{spec!r}: expected NAME:/absolute/path")
    return name, path


def _text(s: str) -> str:
    """A guest-chosen name for a terminal: control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def _mtime(ns: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).strftime("%Y-%m-%d %H:%M")


def _row(e: dict[str, Any]) -> tuple[str, ...]:
    name = _text(e["name"]) + (f" -> {_text(e['target'])}" if e["kind"] == "symlink" else "")
    mode = st.filemode(_TYPE.get(e["kind"], 0) | e["mode"])  # (other: "?")
    return (mode, f"{e['uid']}:{e['gid']}", str(e["size"]), _mtime(e["mtime_ns"]), name)


def fs(a: argparse.Namespace) -> int:
    name, path = _remote(a.path)
    body: dict[str, Any] = {"id": name, "path": path}
    with connect(a) as c:
        if a.action == "ls":
            entries = [e for page in c.stream("FsList", body) for e in page["entries"]]
            if a.json:
                print_json(entries)
            else:
                print_table(("MODE", "OWNER", "SIZE", "MODIFIED", "NAME"), [_row(e) for e in entries])
        elif a.action == "stat":
            e = c.call("FsStat", body)
            if a.json:
                print_json(e)
            else:
                print_table(("MODE", "OWNER", "SIZE", "MODIFIED", "NAME"), [_row({**e, "name": e["path"]})])
        elif a.action == "exists":
            found = bool(c.call("FsExists", body)["exists"])
            if a.json:
                print_json({"exists": found})
            return 0 if found else 1
        elif a.action == "mkdir":
            c.call("FsMkdir", {**body, "parents": a.parents, "mode": int(a.mode, 8) if a.mode else 0})
        elif a.action == "rm":
            c.call("FsRemove", {**body, "recursive": a.recursive})
        else:
            if not a.dest:
                raise UsageError("fs mv NAME:/path /dest (or NAME:/dest)")
            dest_name, dest = _remote(a.dest) if ":" in a.dest else (name, a.dest)
            if dest_name != name or not dest.startswith("/"):
                raise UsageError("fs mv: DEST is an absolute path in the same sandbox")
            c.call("FsRename", {**body, "dest": dest})
    return 0


def add_fs_command(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("path", metavar="NAME:/path")
    p.add_argument("dest", nargs="?", help="mv: the new path (/path or NAME:/path)")
    p.add_argument("-p", "--parents", action="store_true", help="mkdir: parents too; an existing directory is fine")
    p.add_argument("-r", "--recursive", action="store_true", help="rm: a directory and everything in it")
    p.add_argument("--mode", help="mkdir: octal permission bits (default 755)")
    p.add_argument("--json", action="store_true")
