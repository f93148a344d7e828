"""envd's directory watchers (``files.watch_dir``) on a sandvisor sandbox, by polling:
a watcher keeps the guest's listing of its directory (:func:`guest_fs.list_dir`, as the
caller's user, one level or, ``recursive``, up to its depth limit) and each poll lists
it again and reports the difference as envd's events: a new path is ``CREATE``, a gone
one ``REMOVE``, a changed size, mtime or type ``WRITE``, changed permissions ``CHMOD``.
So events are what the guest shows at each poll: a file made and removed between two
polls is not seen, and a rename is a ``REMOVE`` and a ``CREATE``.

The sync SDK's ``CreateWatcher``/``GetWatcherEvents``/``RemoveWatcher`` poll when it
asks for events; the async SDK's ``WatchDir`` stream polls every :data:`POLL_S` while
it is open. Watchers are kept per sandbox uid (a later sandbox given the same id sees
none) and dropped with the sandbox (:meth:`Watchers.forget`).
"""

from __future__ import annotations

import secrets
from typing import Any

import attrs
import trio

from supervisor.serve import guest_fs as fs
from supervisor.serve.e2b_http import (
    CONNECT_STREAM_JSON,
    Exchange,
    HttpError,
    RpcError,
    envelope,
    rpc_error,
    stream_end,
    stream_request,
    unary_error,
    unary_request,
)
from supervisor.wire import errors

POLL_S = 1.0  # a WatchDir stream's polling period
KEEPALIVE_S = 30.0
MAX_WATCHERS = 64  # per sandbox
MAX_EVENTS = 10_000
WATCHER_METHODS = frozenset(
    {"WatchDir", "CreateWatcher", "GetWatcherEvents", "RemoveWatcher"}
)  # kept per watcher between two GetWatcherEvents


Listing = dict[str, tuple[str, str, str, str]]  # relative name -> (type, size, mtime, permissions)


@attrs.define(eq=False)
class Watcher:
    path: str
    user: str
    recursive: bool
    include_entry: bool
    seen: Listing = attrs.Factory(dict)
    entries: dict[str, dict[str, Any]] = attrs.Factory(dict)


def _rel(base: str, path: str) -> str:
    prefix = base.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path.rsplit("/", 1)[-1]


async def _listing(sb: Any, w: Watcher) -> tuple[Listing, dict[str, dict[str, Any]]]:
    entries = await fs.list_dir(sb, w.user, w.path, 64 if w.recursive else 1)
    seen: Listing = {}
    by_name: dict[str, dict[str, Any]] = {}
    for e in entries:
        name = _rel(w.path, e["path"])
        seen[name] = (e["type"], e["size"], e["modifiedTime"], e["permissions"])
        by_name[name] = e
    return seen, by_name


def _diff(w: Watcher, now: Listing, entries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def event(name: str, kind: str, entry: dict[str, Any] | None) -> None:
        ev: dict[str, Any] = {"name": name, "type": kind}
        if w.include_entry and entry is not None:
            ev["entry"] = entry
        out.append(ev)

    for name in sorted(now):
        before = w.seen.get(name)
        if before is None:
            event(name, "EVENT_TYPE_CREATE", entries.get(name))
        elif before[:3] != now[name][:3]:
            event(name, "EVENT_TYPE_WRITE", entries.get(name))
        elif before[3] != now[name][3]:
            event(name, "EVENT_TYPE_CHMOD", entries.get(name))
    for name in sorted(set(w.seen) - set(now)):
        event(name, "EVENT_TYPE_REMOVE", w.entries.get(name))
    w.seen, w.entries = now, entries
    return out[:MAX_EVENTS]


async def _open(sb: Any, req: dict[str, Any], user: str) -> Watcher:
    path = req.get("path")
    if not isinstance(path, str) or not path or "\0" in path:
        raise RpcError("invalid_argument", "a path is required")
    w = Watcher(path, user, bool(req.get("recursive")), bool(req.get("includeEntry")))
    try:
        entry = await fs.stat(sb, user, path)
    except errors.NotFound:
        raise RpcError("not_found", f"path {path} not found") from None
    if entry["type"] != "FILE_TYPE_DIRECTORY":
        raise RpcError("invalid_argument", f"path {path} not a directory")
    w.seen, w.entries = await _listing(sb, w)
    return w


class Watchers:
    """The endpoint's watchers, keyed by the sandbox's uid and the watcher id."""

    def __init__(self) -> None:
        self.table: dict[str, dict[str, Watcher]] = {}

    def forget(self, uid: str) -> None:
        self.table.pop(uid, None)

    def _get(self, uid: str, req: dict[str, Any]) -> Watcher:
        w = self.table.get(uid, {}).get(str(req.get("watcherId", "")))
        if w is None:
            raise RpcError("not_found", f"watcher {req.get('watcherId')!r} not found")
        return w

    async def call(self, ex: Exchange, target: Any, method: str, user: str) -> None:
        """``CreateWatcher``, ``GetWatcherEvents``, ``RemoveWatcher`` (unary) and the
        ``WatchDir`` stream."""
        sb = target.handle()
        if method == "WatchDir":
            await self._stream(ex, sb, user)
            return
        try:
            req = await unary_request(ex)
            if method == "CreateWatcher":
                mine = self.table.setdefault(target.uid, {})
                if len(mine) >= MAX_WATCHERS:
                    raise RpcError("resource_exhausted", f"at most {MAX_WATCHERS} watchers per sandbox")
                w = await _open(sb, req, user)
                wid = secrets.token_hex(8)
                mine[wid] = w
                reply: dict[str, Any] = {"watcherId": wid}
            elif method == "GetWatcherEvents":
                w = self._get(target.uid, req)
                now, entries = await _listing(sb, w)
                reply = {"events": _diff(w, now, entries)}
            else:  # RemoveWatcher
                self._get(target.uid, req)
                self.table.get(target.uid, {}).pop(str(req.get("watcherId")), None)
                reply = {}
        except RpcError as err:
            await unary_error(ex, err)
            return
        except errors.SandboxError as exc:
            await unary_error(ex, rpc_error(exc))
            return
        await ex.send_json(reply)

    async def _stream(self, ex: Exchange, sb: Any, user: str) -> None:
        try:
            w = await _open(sb, await stream_request(ex), user)
        except RpcError as err:
            await stream_end(ex, err)
            return
        except errors.SandboxError as exc:
            await stream_end(ex, rpc_error(exc))
            return
        await ex.start(200, CONNECT_STREAM_JSON)
        await ex.write(envelope({"start": {}}))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_gone, ex, nursery.cancel_scope)
            await _poll(ex, sb, w)
            nursery.cancel_scope.cancel()


async def _until_gone(ex: Exchange, scope: trio.CancelScope) -> None:
    try:
        await ex.disconnected()
    except HttpError:
        pass
    scope.cancel()


async def _poll(ex: Exchange, sb: Any, w: Watcher) -> None:
    quiet = 0.0
    try:
        while True:
            await trio.sleep(POLL_S)
            now, entries = await _listing(sb, w)
            events = _diff(w, now, entries)
            for ev in events:
                await ex.write(envelope({"filesystem": ev}))
            quiet = 0.0 if events else quiet + POLL_S
            if quiet >= KEEPALIVE_S:
                await ex.write(envelope({"keepalive": {}}))
                quiet = 0.0
    except errors.SandboxError as exc:  # the directory went away, or the sandbox
        await stream_end(ex, rpc_error(exc))
    except HttpError:
        return
