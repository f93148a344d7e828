"""The E2B-compatible endpoint (``sandvisor serve --e2b HOST:PORT --e2b-key-file FILE``):
E2B's REST API as the ``e2b`` Python SDK calls it, and envd's services on each sandbox
(:mod:`supervisor.serve.e2b_envd`), so that the SDK runs unchanged with ``E2B_API_URL`` and
``E2B_SANDBOX_URL`` both pointing here. It is an ordinary client of the supervisor: every
operation goes through the SDK on the supervisor's Unix socket.

HTTP/1.1 and HTTP/2 (cleartext, by prior knowledge; and TLS with ALPN) come from
Hypercorn, an ASGI server that runs on Trio; the app here is plain ASGI.

Authentication, on every request: REST calls send ``X-API-KEY`` (one of the key file's
keys, compared in constant time); envd calls send the ``X-Access-Token`` this endpoint
handed out for that sandbox at create/connect (bound to the key and the sandbox's uid:
:mod:`supervisor.serve.e2b_keys`), or an API key. Anything else is 401. Each key is a
principal, ``e2b:<label>``: every call reaches the supervisor acting as it, so a key
sees and touches only the sandboxes and snapshots it made (admin keys: all), and what
it may not see is E2B's not-found.

Templates: ``base`` (the SDK's default), ``default`` or "" boot the supervisor's default
image; ``code-interpreter-v1`` (the code-interpreter SDK's default) and
``code-interpreter`` boot the code-interpreter profile's rootfs (``sandvisor image build
--profile code-interpreter``; :mod:`supervisor.serve.e2b_kernels` serves its port
49999); the id or name of a snapshot the key may see restores it (when its origin had
no network, secrets or host directories: the endpoint makes none of those); a snapshot
id it may not see is not found; anything else is an OCI image reference (the supervisor's
pull policy applies). A sandbox's ``timeout`` is its TTL (``set_timeout`` replaces it).
Networking, as E2B's (internet access by default) when serve has tap networking:
:mod:`supervisor.serve.e2b_net`.

Beside envd's core (:mod:`~supervisor.serve.e2b_envd`): PTYs and input streams
(:mod:`~supervisor.serve.e2b_pty`), directory watchers (:mod:`~supervisor.serve.e2b_watch`),
E2B's default user (:mod:`~supervisor.serve.e2b_user`), ``get_metrics``
(:mod:`~supervisor.serve.e2b_metrics`), ``get_host`` (:mod:`~supervisor.serve.e2b_proxy`), and
fork and snapshots (:mod:`~supervisor.serve.e2b_snapshots`), file metadata
(:mod:`~supervisor.serve.e2b_meta`), signed file URLs (:mod:`~supervisor.serve.e2b_signed`)
and ``update_network`` (the supervisor's Modify of the egress policy).
Routes it does not have answer 404 ``{"code": 404, "message": ...}``, as E2B's API does.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote

import attrs
import trio

from supervisor.serve import e2b_envd as envd
from supervisor.serve import e2b_kernels as kern
from supervisor.serve import e2b_proxy, e2b_signed, e2b_snapshots
from supervisor.serve.e2b_http import Exchange, HttpError, Receive, Scope, Send, http_error
from supervisor.serve.e2b_keys import Client, Key, Tokens, find_key, read_keys
from supervisor.serve.e2b_metrics import e2b_metrics
from supervisor.serve.e2b_net import network_of, network_update
from supervisor.serve.e2b_user import Users
from supervisor.serve.e2b_watch import WATCHER_METHODS, Watchers
from supervisor.serve.metrics import is_loopback
from supervisor.wire import errors

log = logging.getLogger("sandvisor.e2b")

ENVD_VERSION = "0.6.2"  # what the SDK is told: the envd features served are those of this version
DEFAULT_TIMEOUT = 300  # s: the SDK's own default sandbox timeout
MAX_TIMEOUT = 24 * 3600
DEFAULT_TEMPLATES = frozenset({"", "base", "default"})
CODE_TEMPLATES = frozenset({"code-interpreter-v1", "code-interpreter"})
# the first create of a code-interpreter configuration boots, then starts and warms its
# kernel before its boot template is saved (actors/snapshots/pools.py): minutes under TCG
CODE_CREATE_TIMEOUT_S = 900.0
CODE_MEMORY_MIB = 1024  # a kernel with numpy, pandas and matplotlib loaded is ~150 MiB; a few contexts fit
_ID = r"([A-Za-z0-9][A-Za-z0-9_.-]{0,127})"
_ROUTES = [
    ("POST", re.compile(r"^/(?:v2/)?sandboxes$"), "create"),
    ("GET", re.compile(r"^/(?:v2/)?sandboxes$"), "list"),
    ("GET", re.compile(rf"^/sandboxes/{_ID}$"), "get"),
    ("DELETE", re.compile(rf"^/sandboxes/{_ID}$"), "kill"),
    ("POST", re.compile(rf"^/sandboxes/{_ID}/timeout$"), "timeout"),
    ("POST", re.compile(rf"^/sandboxes/{_ID}/pause$"), "pause"),
    ("POST", re.compile(rf"^/sandboxes/{_ID}/resume$"), "resume"),
    ("POST", re.compile(rf"^/(?:v2/)?sandboxes/{_ID}/connect$"), "connect"),
    ("GET", re.compile(rf"^/sandboxes/{_ID}/metrics$"), "metrics"),
    ("PUT", re.compile(rf"^/sandboxes/{_ID}/network$"), "update_network"),
    ("GET", re.compile(rf"^/templates/aliases/{_ID}$"), "template_alias"),
]
_RPC = re.compile(r"^/(process\.Process|filesystem\.Filesystem)/([A-Za-z]+)$")
_SNAPSHOT_ID = re.compile(r"^snap-[0-9a-f]+$")


@attrs.define
class Known:
    """What E2B says of a sandbox and sandvisor does not keep: its template, its end
    (of the sandbox with this uid: a later one given the same id is another)."""

    template: str
    end_at: int  # unix seconds (0: never)
    uid: str = ""
    internet: bool | None = None  # E2B's allow_internet_access, as made (None: not known)
    rules: dict[str, list[str]] = attrs.field(factory=dict)  # E2B's network allowOut/denyOut, as asked


def _iso(ts: int) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat().replace("+00:00", "Z")


def _timeout(value: Any, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_TIMEOUT:
        raise HttpError(400, f"timeout: whole seconds between 1 and {MAX_TIMEOUT}")
    return value


def _labels(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise HttpError(400, "metadata: a map of strings")
    return {str(k): v for k, v in value.items()}


class E2BApp:
    """The ASGI app. ``socket``: the supervisor's; ``keys``: the API keys; ``tap``: the
    supervisor has tap networking (E2B's networking is served: :mod:`~supervisor.serve.e2b_net`)."""

    def __init__(
        self,
        socket: str,
        keys: list[Key],
        procs: envd.Processes,
        kernels: kern.Kernels | None = None,
        code_rootfs: str = "",
        *,
        tap: bool = False,
    ) -> None:
        self.socket = socket
        self.tap = tap
        self.keys = keys
        self.procs = procs
        self.watchers = Watchers()
        self.users = Users()
        self.kernels = kernels if kernels is not None else kern.Kernels(procs.nursery)
        self.code_rootfs = code_rootfs  # the code-interpreter profile's rootfs ("": not built)
        self.tokens = Tokens(keys)
        self.known: dict[str, Known] = {}

    def _known(self, sid: str, uid: str = "") -> Known | None:
        known = self.known.get(sid)
        if known is not None and uid and known.uid and known.uid != uid:
            del self.known[sid]  # another sandbox's, of the same id
            return None
        return known

    # -- ASGI --------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        ex = Exchange(scope, receive, send)
        try:
            await self._route(ex)
        except HttpError as err:
            if not ex.started:
                await ex.fail(err.status, err.message)
        except errors.SandboxError as exc:
            if not ex.started:
                answer = http_error(exc)
                await ex.fail(answer.status, answer.message)
            else:
                log.info("e2b: %s %s failed mid-answer: %s", ex.method, ex.path, exc)

    async def _route(self, ex: Exchange) -> None:
        if (to_port := e2b_proxy.target(ex)) is not None:
            await self._proxy(ex, *to_port)
            return
        if e2b_signed.is_signed(ex):  # download_url / upload_url: the signature is the credential
            await self._signed(ex)
            return
        sandbox = ex.headers.get("e2b-sandbox-id")
        if sandbox is not None:
            # (the code-interpreter SDK sends its calls but /execute with the traffic token alone)
            token = ex.headers.get("x-access-token") or ex.headers.get("e2b-traffic-access-token")
            opened = self.tokens.open(token, sandbox)
            if opened is not None:
                key, uid = opened
            else:  # an API key opens any sandbox its principal may see
                found = find_key(self.keys, ex.headers.get("x-api-key"))
                if found is None:
                    raise HttpError(401, "invalid or missing access token")
                key, uid = found, ""
            client = Client(self.socket, key)
            with client.acting():
                await self._envd(ex, client, sandbox, uid)
            return
        found = find_key(self.keys, ex.headers.get("x-api-key"))
        if found is None:
            raise HttpError(401, "Invalid API key")
        client = Client(self.socket, found)
        for method, pattern, name in _ROUTES:
            m = pattern.match(ex.path)
            if m and ex.method == method:
                with client.acting():
                    await getattr(self, name)(ex, client, *m.groups())
                return
        if (served := e2b_snapshots.route(ex)) is not None:  # fork and snapshots
            with client.acting():
                await served(self, ex, client)
            return
        raise HttpError(404, f"no route {ex.method} {ex.path}")

    async def _signed(self, ex: Exchange) -> None:
        sandbox, token = e2b_signed.opened(ex, self.tokens)
        found = self.tokens.open(token, sandbox)
        if found is None:
            raise HttpError(401, "invalid signature")
        client = Client(self.socket, found[0])
        with client.acting():
            await self._envd(ex, client, sandbox, found[1])

    async def _proxy(self, ex: Exchange, port: int, sandbox: str) -> None:
        """``get_host(port)``: only with the sandbox's access token (no API key)."""
        token = ex.headers.get("e2b-traffic-access-token") or ex.headers.get("x-access-token")
        opened = self.tokens.open(token, sandbox)
        if opened is None:
            raise HttpError(401, f"a valid access token for sandbox {sandbox} is required to reach its ports")
        client = Client(self.socket, opened[0])
        with client.acting():
            try:
                await e2b_proxy.proxy(ex, client, sandbox, opened[1], port)
            except errors.NotFound:
                if ex.started:
                    raise
                await ex.send_json(
                    {"code": 502, "message": f"The sandbox {sandbox} was not found", "sandboxId": sandbox}, 502
                )

    async def _envd(self, ex: Exchange, client: Client, sandbox: str, uid: str) -> None:
        """A call to a sandbox, for ``client``'s key; ``uid``: the sandbox its token was
        handed out for ("" for an API key: whichever sandbox of that id the key sees)."""
        try:  # as E2B's proxy answers for a sandbox that is not there (the SDK: SandboxNotRunning)
            info = await client.sandbox(sandbox).inspect()
        except errors.NotFound:
            info = None
        if info is None or (uid and info.uid != uid):  # the token's sandbox is gone
            if uid:
                self.tokens.forget(uid)  # (its tokens open nothing any more: signed URLs need not try them)
            await ex.send_json(
                {"code": 502, "message": f"The sandbox {sandbox} was not found", "sandboxId": sandbox}, 502
            )
            return
        if info.state not in ("ready", "running"):
            await ex.send_json(
                {"code": 502, "message": f"The sandbox {sandbox} is {info.state}", "sandboxId": sandbox}, 502
            )
            return
        if ex.path == "/health":
            await ex.respond(204)
            return
        target = envd.Target(client, sandbox, info.uid)
        if ex.headers.get("e2b-sandbox-port") == kern.PORT:
            await kern.serve(ex, self.kernels, target)
            return
        await self.users.ensure(target.handle(), info.uid)
        if ex.path == "/files":
            if ex.method == "GET":
                await envd.download(ex, target)
            elif ex.method == "POST":
                await envd.upload(ex, target)
            else:
                raise HttpError(405, "GET or POST")
            return
        m = _RPC.match(ex.path)
        if m is None or ex.method != "POST":
            raise HttpError(404, f"no envd route {ex.method} {ex.path}")
        if m.group(2) in WATCHER_METHODS and m.group(1) == "filesystem.Filesystem":
            await self.watchers.call(ex, target, m.group(2), envd.envd_user(ex))
        elif m.group(1) == "process.Process":
            await envd.process_call(ex, self.procs, target, m.group(2))
        else:
            await envd.filesystem_call(ex, target, m.group(2))

    # -- the REST API ------------------------------------------------------------------------
    def _created(self, ex: Exchange, client: Client, sandbox: str, uid: str, template: str) -> dict[str, Any]:
        token = self.tokens.mint(client.key, sandbox, uid)
        return {
            "templateID": template,
            "sandboxID": sandbox,
            "clientID": "sandvisor",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": token,
            # get_host(port) names PORT-ID.<this endpoint's host>, proxied with this token
            "trafficAccessToken": token,
            "domain": ex.headers.get("host", ""),
        }

    async def _template(self, client: Client, template: str) -> str | None:
        """The snapshot id ``template`` names among those the key may see (None: it names
        none, so it is an image reference); 404 for a snapshot id it may not see, 400 for
        a snapshot whose restores would have what endpoint sandboxes never have."""
        for s in await client.snapshots():
            if template in (s.id, s.name):
                kept = []
                if s.network not in ("", "none"):
                    kept.append(f"network {s.network!r}")
                if s.secrets:
                    kept.append(f"secrets {', '.join(sorted(s.secrets))}")
                if s.host_mounts:
                    kept.append("host directories")
                if kept:
                    raise HttpError(
                        400,
                        f"template {template}: a snapshot with {'; '.join(kept)}, which a restore keeps; "
                        "the E2B endpoint makes sandboxes without them (restore it with sandvisor's SDK or CLI)",
                    )
                return s.id
        if _SNAPSHOT_ID.match(template):  # a snapshot id that is not there for this key: never an image name
            raise HttpError(404, f"template {template} not found")
        return None

    async def create(self, ex: Exchange, client: Client) -> None:
        body = await ex.json()
        template = body.get("templateID", "")
        if not isinstance(template, str):
            raise HttpError(400, "templateID: a string")
        ttl = _timeout(body.get("timeout"), DEFAULT_TIMEOUT)
        labels = _labels(body.get("metadata"))
        env = _labels(body.get("envVars"))
        net = network_of(body, self.tap)
        code = template in CODE_TEMPLATES
        if code and not self.code_rootfs:
            raise HttpError(
                400,
                f"template {template}: the code-interpreter image is not built "
                "(sandvisor image build --profile code-interpreter, then restart serve)",
            )
        snapshot = None if template in DEFAULT_TEMPLATES or code else await self._template(client, template)
        if code:
            # (shielded: a client that gives up on the first create, which waits for the
            # warm-up, does not cancel it, so the template is saved; the sandbox then
            # ends by its TTL)
            with trio.CancelScope(shield=True):
                sb = await client.create(
                    rootfs=self.code_rootfs,
                    memory_mib=CODE_MEMORY_MIB,
                    timeout=CODE_CREATE_TIMEOUT_S,
                    labels=labels,
                    env=env,
                    ttl=ttl,
                    ttl_action="remove",
                    **net.kwargs,
                )
        elif snapshot is not None:
            if env:
                raise HttpError(400, "envVars: not supported for a snapshot template (it keeps its own)")
            if net.asked and (body.get("allow_internet_access") is not False or body.get("network")):
                raise HttpError(400, "allow_internet_access, network: a snapshot template keeps its own (none)")
            sb = await client.restore(snapshot, labels=labels, ttl=ttl)
        else:
            image = "" if template in DEFAULT_TEMPLATES else template
            sb = await client.create(image=image, labels=labels, env=env, ttl=ttl, ttl_action="remove", **net.kwargs)
            if not net.asked and not net.internet:
                log.info("E2B sandbox %s made without internet access: serve has no tap networking", sb.id)
        info = await sb.inspect()
        try:
            await self.users.ensure(sb, info.uid)
        except BaseException:
            with trio.CancelScope(shield=True):
                await sb.remove(force=True)
            raise
        internet = net.internet if snapshot is None else False
        self.known[sb.id] = Known(template or "base", info.created_at + ttl, info.uid, internet, net.rules)
        if code:  # its kernel starts now: the first cell does not wait for it
            self.kernels.host(envd.Target(client, sb.id, info.uid)).warm()
        await ex.send_json(self._created(ex, client, sb.id, info.uid, template or "base"), 201)

    def _listed(self, sid: str, state: str, labels: dict[str, str], created_at: int, uid: str = "") -> dict[str, Any]:
        known = self._known(sid, uid)
        return {
            "templateID": known.template if known else "base",
            "sandboxID": sid,
            "clientID": "sandvisor",
            "startedAt": _iso(created_at),
            "endAt": _iso(known.end_at if known and known.end_at else created_at),
            "cpuCount": 0,
            "memoryMB": 0,
            "diskSizeMB": 0,
            "state": "paused" if state == "paused" else "running",
            "envdVersion": ENVD_VERSION,
            "metadata": labels,
        }

    async def list(self, ex: Exchange, client: Client) -> None:
        q = ex.query
        states = set(filter(None, q.get("state", "").split(",")))
        # the SDK quotes each key and value, then url-encodes the pairs, then the query
        pairs = parse_qsl(q.get("metadata", ""), keep_blank_values=True)
        labels = {unquote(k): unquote(v) for k, v in pairs}
        try:
            limit = min(max(int(q.get("limit", "100")), 1), 100)
        except ValueError:
            raise HttpError(400, "limit: a number") from None
        wanted = {"ready", "running"} if not states or "running" in states else set()
        if not states or "paused" in states:
            wanted.add("paused")
        page = await client.list(labels=labels, limit=limit, cursor=q.get("nextToken", ""))
        out = [self._listed(s.id, s.state, s.labels, s.created_at) for s in page.sandboxes if s.state in wanted]
        await ex.send_json(out, headers=[("x-next-token", page.next_cursor)] if page.next_cursor else [])

    async def _info(self, client: Client, sid: str) -> Any:
        try:
            return await client.sandbox(sid).inspect()
        except errors.NotFound:
            if client.key.admin:  # (gone by its TTL, or removed by another client)
                self.known.pop(sid, None)
            raise HttpError(404, f"Sandbox {sid} not found") from None

    def _template_of(self, sid: str, uid: str) -> str:
        known = self._known(sid, uid)
        return known.template if known is not None else "base"

    async def get(self, ex: Exchange, client: Client, sid: str) -> None:
        info = await self._info(client, sid)
        detail = self._listed(sid, info.state, info.labels, info.created_at, info.uid)
        token = self.tokens.mint(client.key, sid, info.uid)
        detail.update(cpuCount=info.limits.vcpus, memoryMB=info.limits.memory_mib, envdAccessToken=token)
        known = self._known(sid, info.uid)
        if known is not None and known.internet is not None:
            detail["allowInternetAccess"] = known.internet
        if known is not None and known.rules:
            detail["network"] = known.rules
        await ex.send_json(detail)

    async def kill(self, ex: Exchange, client: Client, sid: str) -> None:
        info = await self._info(client, sid)
        try:
            await client.sandbox(sid).remove(force=True)
        except errors.NotFound:
            raise HttpError(404, f"Sandbox {sid} not found") from None
        self.procs.forget(info.uid)
        self.watchers.forget(info.uid)
        self.users.forget(info.uid)
        self.kernels.forget(info.uid)
        self.tokens.forget(info.uid)
        self.known.pop(sid, None)
        await ex.respond(204)

    async def _set_timeout(self, client: Client, sid: str, uid: str, seconds: int) -> None:
        try:
            end = await client.sandbox(sid).set_ttl(seconds)
        except errors.NotFound:
            raise HttpError(404, f"Sandbox {sid} not found") from None
        known = self._known(sid, uid)
        if known is None:
            known = self.known[sid] = Known("base", 0, uid)
        known.end_at = end

    async def timeout(self, ex: Exchange, client: Client, sid: str) -> None:
        body = await ex.json()
        info = await self._info(client, sid)
        await self._set_timeout(client, sid, info.uid, _timeout(body.get("timeout"), DEFAULT_TIMEOUT))
        await ex.respond(204)

    async def connect(self, ex: Exchange, client: Client, sid: str) -> None:
        body = await ex.json()
        info = await self._info(client, sid)
        if info.state == "paused":  # E2B's connect resumes a paused sandbox
            await self._call(sid, client.sandbox(sid).resume())
        elif info.state not in ("ready", "running"):
            raise HttpError(409, f"Sandbox {sid} is {info.state}")
        if body.get("timeout") is not None:  # E2B: connecting may extend the timeout, never shortens it
            seconds = _timeout(body.get("timeout"), DEFAULT_TIMEOUT)
            known = self._known(sid, info.uid)
            now = int(time.time())
            if known is None or (known.end_at and known.end_at < now + seconds):
                await self._set_timeout(client, sid, info.uid, seconds)
        await ex.send_json(self._created(ex, client, sid, info.uid, self._template_of(sid, info.uid)), 200)

    async def pause(self, ex: Exchange, client: Client, sid: str) -> None:
        """E2B's pause is sandvisor's hibernation (docs/hibernation.md): 204, or 409 when
        it already is paused."""
        info = await self._info(client, sid)
        if info.state == "paused":
            raise HttpError(409, f"Sandbox {sid} is already paused")
        await self._call(sid, client.sandbox(sid).pause())
        await ex.respond(204)

    async def resume(self, ex: Exchange, client: Client, sid: str) -> None:
        """(the older API's resume; the SDK's connect resumes too) 201 with the sandbox,
        409 when it is not paused."""
        body = await ex.json()
        info = await self._info(client, sid)
        if info.state != "paused":
            raise HttpError(409, f"Sandbox {sid} is not paused")
        await self._call(sid, client.sandbox(sid).resume())
        if body.get("timeout") is not None:
            await self._set_timeout(client, sid, info.uid, _timeout(body.get("timeout"), DEFAULT_TIMEOUT))
        await ex.send_json(self._created(ex, client, sid, info.uid, self._template_of(sid, info.uid)), 201)

    async def metrics(self, ex: Exchange, client: Client, sid: str) -> None:
        """E2B's metrics of a sandbox: one sample, now (the supervisor keeps no history)."""
        info = await self._info(client, sid)
        try:
            sample = await client.sandbox(sid).metrics()
        except errors.NotFound:
            raise HttpError(404, f"Sandbox {sid} not found") from None
        except errors.FailedPrecondition:  # paused: E2B has no sample either
            await ex.send_json([])
            return
        await ex.send_json([e2b_metrics(sample, info.limits.vcpus)])

    async def update_network(self, ex: Exchange, client: Client, sid: str) -> None:
        """E2B's ``update_network``: the sandbox's egress policy replaced by what the body
        says (:func:`~supervisor.serve.e2b_net.network_update`), through the supervisor's
        Modify: live on the running sandbox's filter and DNS answers (204)."""
        body = await ex.json()
        info = await self._info(client, sid)
        net = network_update(body, self.tap)
        if not net.kwargs:  # no tap networking: no sandbox has a network, and none is asked for
            await ex.respond(204)
            return
        try:
            plan = await client.sandbox(sid).modify(egress=net.kwargs["egress"])
        except errors.NotFound:
            raise HttpError(404, f"Sandbox {sid} not found") from None
        except errors.FailedPrecondition as exc:
            raise HttpError(409, str(exc)) from None
        if not plan.applied:
            raise HttpError(409, "; ".join(f"{c.field}: {c.message}" for c in plan.conflicts) or "not applied")
        known = self._known(sid, info.uid)
        if known is None:
            known = self.known[sid] = Known("base", 0, info.uid)
        known.internet, known.rules = net.internet, net.rules
        await ex.respond(204)

    async def template_alias(self, ex: Exchange, client: Client, alias: str) -> None:
        """``Template.exists(name)`` / ``alias_exists``: the templates a create takes by
        name here (the default image's, the code interpreter's once built, the snapshots
        the key may see); 404 for any other, as E2B answers an alias that is not there."""
        if alias in DEFAULT_TEMPLATES or (alias in CODE_TEMPLATES and self.code_rootfs):
            await ex.send_json({"templateID": alias, "public": True})
            return
        for s in await client.snapshots():
            if alias in (s.id, s.name):
                await ex.send_json({"templateID": s.id, "public": False})
                return
        raise HttpError(404, f"template alias {alias} not found")

    async def _call(self, sid: str, call: Awaitable[object]) -> None:
        try:
            await call
        except errors.NotFound:
            raise HttpError(404, f"Sandbox {sid} not found") from None
        except errors.FailedPrecondition as exc:
            raise HttpError(409, str(exc)) from None


@attrs.define
class E2BEndpoint:
    """The endpoint as an actor: ``await nursery.start(ep.run)`` returns once it
    listens (``ep.port``: the bound port, for port 0); cancelled, it stops and ends its
    processes."""

    socket: str
    host: str
    port: int
    key_file: Path
    code_rootfs: str = ""
    tap: bool = False  # the supervisor has tap networking: E2B's networking is served
    keys: list[Key] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        self.keys = read_keys(self.key_file)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        from hypercorn.config import Config
        from hypercorn.trio import serve

        config = Config()
        config.bind = [f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"]
        config.accesslog = None
        config.errorlog = log
        config.graceful_timeout = 1.0
        async with trio.open_nursery() as nursery:
            app = E2BApp(
                self.socket, self.keys, envd.Processes(nursery), kern.Kernels(nursery), self.code_rootfs, tap=self.tap
            )
            binds = await nursery.start(lambda task_status: serve(app, config, task_status=task_status))  # type: ignore[arg-type]
            self.port = int(str(binds[0]).rsplit(":", 1)[1])
            admins = sum(k.admin for k in self.keys)
            if not self.tap:
                log.warning(
                    "E2B endpoint: serve has no tap networking (--ip-pool, as root), so E2B sandboxes, "
                    "which have internet access by default, get no network; asking for it is refused"
                )
            log.info("E2B API on http://%s:%d (%d keys, %d admin)", self.host, self.port, len(self.keys), admins)
            if not is_loopback(self.host):
                log.warning(
                    "the E2B API on %s is plain HTTP: API keys and access tokens cross the network in clear", self.host
                )
            task_status.started()


def check_key_file(path: Path) -> None:
    """Refuse a key file others may read or write (it holds secrets)."""
    st = path.stat()
    if st.st_mode & 0o077:
        raise ValueError(f"{path}: mode {st.st_mode & 0o777:o}; the key file must be private (chmod 600)")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{path}: not owned by this user")
    read_keys(path)
