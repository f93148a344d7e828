"""E2B's fork and snapshot calls on the E2B endpoint (:mod:`supervisor.serve.e2b_server`),
as the ``e2b`` SDK sends them:

* ``POST /sandboxes/{id}/fork`` ``{"count", "timeout"}`` (``Sandbox.fork``): sandvisor's
  fork (docs/fork.md): the parent pauses once and runs on; 201 with one
  ``{"sandbox": ...}`` per child, each the key's, with its own access token and
  ``timeout`` (default 300 s). The fork is one operation: a child that fails takes its
  siblings with it and the whole call answers the error.
* ``POST /sandboxes/{id}/snapshots`` ``{"name", "memory"}`` (``create_snapshot``): a
  checkpoint (memory and disk; the sandbox runs on); 201 ``{"snapshotID", "names"}``.
  A filesystem-only snapshot (``memory: false``) is refused: a checkpoint here always
  keeps memory.
* ``GET /snapshots?sandboxID=&name=&limit=&nextToken=`` (``list_snapshots``): the
  snapshots the key may see, oldest first, paged by ``x-next-token``.
* ``DELETE /templates/{id}`` (``delete_snapshot``): 204, or 404 (the SDK: False); 409 while
  a sandbox's disk stands on it (its origin, running; a sandbox made from it).
* a snapshot as a template: ``Sandbox.create(snapshot_id)`` (the endpoint's create).

Each runs as the key's principal, so the domain's ownership rules hold: a key forks and
snapshots only sandboxes it sees, lists and deletes only snapshots it sees, and what it
may not see is E2B's not-found.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from supervisor.client.sdk.aio import AsyncSandbox
from supervisor.serve.e2b_http import Exchange, HttpError
from supervisor.serve.e2b_keys import Client
from supervisor.wire import errors

if TYPE_CHECKING:
    from supervisor.serve.e2b_server import E2BApp

MAX_FORKS = 100  # children of one call (the domain's bound; the SDK sends at most 20)
PAGE = 100
_ID = r"([A-Za-z0-9][A-Za-z0-9_.-]{0,127})"

Handler = Callable[["E2BApp", Exchange, Client], Awaitable[None]]


async def fork(app: E2BApp, ex: Exchange, client: Client, sid: str) -> None:
    from supervisor.serve.e2b_server import DEFAULT_TIMEOUT, _timeout

    body = await ex.json()
    count = body.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_FORKS:
        raise HttpError(400, f"count: a whole number between 1 and {MAX_FORKS}")
    ttl = _timeout(body.get("timeout"), DEFAULT_TIMEOUT)
    info = await app._info(client, sid)
    if info.state not in ("ready", "running"):
        raise HttpError(409, f"Sandbox {sid} is {info.state}: fork needs it running")
    try:
        kids = await client.sandbox(sid).fork(count)
    except errors.NotFound:
        raise HttpError(404, f"Sandbox {sid} not found") from None
    except errors.FailedPrecondition as exc:
        raise HttpError(409, str(exc)) from None
    template = app._template_of(sid, info.uid)
    out: list[dict[str, Any]] = []
    try:
        for kid in kids:
            kinfo = await kid.inspect()
            await app.users.ensure(kid, kinfo.uid)
            await app._set_timeout(client, kid.id, kinfo.uid, ttl)
            known = app._known(kid.id, kinfo.uid)
            if known is not None:
                known.template = template
            out.append({"sandbox": app._created(ex, client, kid.id, kinfo.uid, template)})
    except BaseException:
        with trio.CancelScope(shield=True):
            for kid in kids:
                try:
                    await kid.remove(force=True)
                except errors.NotFound:
                    pass
                app.known.pop(kid.id, None)
        raise
    await ex.send_json(out, 201)


async def create_snapshot(app: E2BApp, ex: Exchange, client: Client, sid: str) -> None:
    body = await ex.json()
    name = body.get("name") or ""
    if not isinstance(name, str):
        raise HttpError(400, "name: a string")
    if body.get("memory") is False:
        raise HttpError(
            400,
            "memory: false (a filesystem-only snapshot) is not served: a snapshot here keeps the "
            "sandbox's memory and disk (create from it restores its processes)",
        )
    await app._info(client, sid)
    try:
        made = await client.sandbox(sid).checkpoint(name)
    except errors.NotFound:
        raise HttpError(404, f"Sandbox {sid} not found") from None
    except errors.FailedPrecondition as exc:
        raise HttpError(409, str(exc)) from None
    await ex.send_json({"snapshotID": made.snapshot_id, "names": [name] if name else []}, 201)


async def list_snapshots(app: E2BApp, ex: Exchange, client: Client) -> None:
    q = ex.query
    try:
        limit = min(max(int(q.get("limit", str(PAGE))), 1), PAGE)
        start = int(q.get("nextToken") or "0")
    except ValueError:
        raise HttpError(400, "limit and nextToken: numbers") from None
    sid, name = q.get("sandboxID", ""), q.get("name", "")
    snaps = [
        s for s in await client.snapshots() if (not sid or s.sandbox_id == sid) and (not name or name in (s.name, s.id))
    ]
    page = snaps[max(start, 0) : max(start, 0) + limit]
    more = start + limit < len(snaps)
    out = [{"snapshotID": s.id, "names": [s.name] if s.name else []} for s in page]
    await ex.send_json(out, headers=[("x-next-token", str(start + limit))] if more else [])


async def delete_snapshot(app: E2BApp, ex: Exchange, client: Client, ref: str) -> None:
    """A snapshot the key sees, by id or name; anything else (a template of E2B's, another
    key's snapshot) is not found."""
    for s in await client.snapshots():
        if ref in (s.id, s.name):
            try:
                await AsyncSandbox.delete_snapshot(s.id, socket=client.socket)
            except errors.NotFound:
                break
            except errors.FailedPrecondition as exc:
                raise HttpError(409, str(exc)) from None
            await ex.respond(204)
            return
    raise HttpError(404, f"template {ref} not found")


_ROUTES: list[tuple[str, re.Pattern[str], Callable[..., Awaitable[None]]]] = [
    ("POST", re.compile(rf"^/sandboxes/{_ID}/fork$"), fork),
    ("POST", re.compile(rf"^/sandboxes/{_ID}/snapshots$"), create_snapshot),
    ("GET", re.compile(r"^/snapshots$"), list_snapshots),
    ("DELETE", re.compile(r"^/templates/([^/]{1,256})$"), delete_snapshot),
]


def route(ex: Exchange) -> Handler | None:
    """The handler of one of these calls (its path's ids bound), or None."""
    for method, pattern, handler in _ROUTES:
        m = pattern.match(ex.path)
        if m and ex.method == method:
            return _bind(handler, m.groups())
    return None


def _bind(handler: Callable[..., Awaitable[None]], ids: tuple[str | Any, ...]) -> Handler:
    async def call(app: E2BApp, ex: Exchange, client: Client) -> None:
        await handler(app, ex, client, *ids)

    return call
