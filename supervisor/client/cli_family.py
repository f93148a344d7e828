"""The client commands of a sandbox's family (docs/fork.md): ``fork`` (children of a running
sandbox) and ``tree`` (who came from whom, with state, age and memory).
"""

from __future__ import annotations

import argparse
import time

from supervisor.client.cli_common import connect, kv
from supervisor.client.cli_output import print_json

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms; mypy reads the name)
if TYPE_CHECKING:
    from typing import Any


def fork(a: argparse.Namespace) -> int:
    with connect(a) as c:
        r = c.call(
            "Fork",
            {"id": a.name, "count": a.n, "name_prefix": a.name_prefix or "", "labels": kv(a.label)},
        )
    if a.json:
        print_json(r)
    else:
        for child in r["sandboxes"]:
            print(child["id"])
    return 0


def _age(created_at: int, now: float) -> str:
    s = max(0, int(now - created_at))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def family_lines(rows: list[dict[str, Any]], root: str = "", now: float | None = None) -> list[str]:
    """The forest of ``rows`` (List's summaries) as drawn lines; ``root``: only the tree
    holding that sandbox (id), from its oldest ancestor still there."""
    now = time.time() if now is None else now
    by_uid = {r["uid"]: r for r in rows if r.get("uid")}
    kids: dict[str, list[dict[str, Any]]] = {}
    tops = []
    for r in sorted(rows, key=lambda r: (r["created_at"], r["id"])):
        parent = r.get("parent_uid", "")
        if parent and parent in by_uid:
            kids.setdefault(parent, []).append(r)
        else:
            tops.append(r)
    if root:
        start = next((r for r in rows if r["id"] == root), None)
        if start is None:
            return []
        seen = set()
        while start.get("parent_uid") in by_uid and start["uid"] not in seen:
            seen.add(start["uid"])
            start = by_uid[start["parent_uid"]]
        tops = [start]
    out: list[str] = []

    def draw(r: dict[str, Any], lead: str, branch: str) -> None:
        mem = f"{r['memory_mib']} MiB" if r.get("memory_mib") else "-"
        if r.get("memory_own_bytes"):  # (filled in by tree from Inspect: the host's count)
            mem += f" (own {r['memory_own_bytes'] >> 20} MiB, shared {r.get('memory_shared_bytes', 0) >> 20} MiB)"
        out.append(f"{lead}{branch}{r['id']}  {r['state']}  {_age(r['created_at'], now)}  {mem}")
        children = kids.get(r.get("uid", ""), [])
        below = lead + ("" if not branch else ("    " if branch.startswith("└") else "│   "))
        for i, c in enumerate(children):
            draw(c, below, "└── " if i == len(children) - 1 else "├── ")

    for t in tops:
        draw(t, "", "")
    return out


def tree(a: argparse.Namespace) -> int:
    from supervisor.wire.errors import ApiError

    rows: list[dict[str, Any]] = []
    with connect(a) as c:
        rows = c.call("ListAll", {})["sandboxes"]
        for r in rows:  # memory per branch: Inspect's (a sandbox gone meanwhile keeps its row)
            try:
                info = c.call("Inspect", {"id": r["id"]})
            except ApiError:
                continue
            r["memory_own_bytes"] = info.get("memory_own_bytes", 0)
            r["memory_shared_bytes"] = info.get("memory_shared_bytes", 0)
    if a.json:
        print_json(rows)
        return 0
    lines = family_lines(rows, a.name or "")
    if a.name and not lines:
        print(f"no sandbox {a.name!r}")
        return 1
    for line in lines:
        print(line)
    return 0


CONTENT_CAP = 1 << 20  # bytes of each side ``diff --content`` shows


def _side(c: Any, name: str, path: str) -> bytes | None:
    """The first CONTENT_CAP bytes of ``path`` in ``name`` (None: no such file there)."""
    from supervisor.wire.errors import ApiError

    out = bytearray()
    try:
        for chunk in c.stream("ReadFile", {"id": name, "path": path}):
            out += chunk.get("data") or b""
            if len(out) > CONTENT_CAP:
                break
    except ApiError as exc:
        if exc.code == "NOT_FOUND":
            return None
        raise
    return bytes(out)


def content_lines(a_name: str, a: bytes | None, b_name: str, b: bytes | None, path: str) -> list[str]:
    """Both sides of one file: a unified diff when both are text, else their sizes and hashes."""
    import difflib
    import hashlib

    def text(x: bytes | None) -> list[str] | None:
        try:
            return [] if x is None else x[:CONTENT_CAP].decode("utf-8").splitlines(keepends=True)
        except UnicodeDecodeError:
            return None

    ta, tb = text(a), text(b)
    if ta is not None and tb is not None:
        out = list(difflib.unified_diff(ta, tb, f"{a_name}:{path}", f"{b_name}:{path}"))
        return [line.rstrip("\n") for line in out]
    lines = []
    for name, x in ((a_name, a), (b_name, b)):
        desc = "absent" if x is None else f"{len(x)} bytes, sha256 {hashlib.sha256(x).hexdigest()}"
        lines.append(f"{name}:{path}: {desc} (binary)")
    return lines


def _mark(ch: dict[str, Any]) -> str:
    sym = {"added": "A", "removed": "D", "modified": "M"}.get(ch["change"], "?")
    what = []
    if ch["change"] == "modified":
        if ch.get("kind_a") != ch.get("kind_b"):
            what.append(f"{ch.get('kind_a')} -> {ch.get('kind_b')}")
        if ch.get("size_a") != ch.get("size_b"):
            what.append(f"size {ch.get('size_a', 0)} -> {ch.get('size_b', 0)}")
        if ch.get("mode_a") != ch.get("mode_b"):
            what.append(f"mode {ch.get('mode_a', 0):o} -> {ch.get('mode_b', 0):o}")
        if ch.get("hash_a") != ch.get("hash_b") and ch.get("size_a") == ch.get("size_b"):
            what.append("content")
    side = "b" if ch["change"] == "added" else "a"
    if not what:
        what.append(f"{ch.get('kind_' + side)}, {ch.get('size_' + side, 0)} bytes")
    return f"{sym} {ch['path']}  ({'; '.join(what)})"


def diff(a: argparse.Namespace) -> int:
    against = sum(map(bool, (a.other, a.fork_point, a.snapshot)))
    if against != 1:
        print("sandvisor diff NAME: give one of OTHER, --fork-point, --snapshot SNAP")
        return 2
    with connect(a) as c:
        if a.other and a.content:
            left, right = _side(c, a.name, a.content), _side(c, a.other, a.content)
            for line in content_lines(a.name, left, a.other, right, a.content):
                print(line)
            return 0
        req = {"id": a.name, "other": a.other or "", "path": a.path}
        req |= {"fork_point": bool(a.fork_point), "snapshot": a.snapshot or "", "content": a.content or ""}
        r = c.call("Diff", req)
    if a.content:  # (a snapshot's side: the server reads both)
        base = f"{a.name}@{r.get('base') or 'fork-point'}"
        left = r.get("content_a", b"") if r.get("found_a") else None
        right = r.get("content_b", b"") if r.get("found_b") else None
        for line in content_lines(base, left, a.name, right, a.content):
            print(line)
        return 0
    if a.json:
        print_json(r)
        return 0
    for ch in r.get("changes") or []:
        print(_mark(ch))
    return 1 if r.get("changes") else 0
