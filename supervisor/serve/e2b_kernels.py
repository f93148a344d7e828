"""E2B's code interpreter (``e2b-code-interpreter``) on the E2B endpoint: the SDK's calls
to port 49999 of a sandbox (``E2b-Sandbox-Port: 49999``), ``POST /execute`` and
``/contexts``, answered by the guest's kernel server (images/kernel_server.py: Jupyter
kernels run with jupyter_client in the sandbox, speaking JSON lines).

The kernel server is a service of the guest: a daemon listening on the guest's
127.0.0.1:49999, started by ``python3 -c SOURCE start`` -- before a boot template of
the code-interpreter image is saved (:func:`warmup_argv`, run by the pools), so
sandboxes restored from it (and its warm pool's members) hold a started, warm kernel;
or by the first call, when a sandbox booted without one. The host reaches it through
one relay Exec per sandbox life (:data:`RELAY`: bash's ``/dev/tcp``, with the
server's root-only token first; the sandbox needs no network), owned by
:class:`Kernels` (a task in the endpoint's nursery: cancelled, the relay ends, the
server and its kernels stay with the sandbox); found by the sandbox's uid, so a
later sandbox given the same id gets its own. It acts for the key that started it;
every call is checked first by the endpoint (the key must see the sandbox). What
the guest sends is parsed here, bounded (:data:`LINE_MAX`) and routed by id.

A cell whose client goes away (the SDK's ``timeout`` passed: it closes the
connection) is interrupted in the kernel, so the next cell runs.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from pathlib import Path
from typing import Any

import attrs
import trio

from supervisor.serve.e2b_http import Exchange, HttpError
from supervisor.serve.e2b_user import _ENSURE as ENSURE_USER  # (the script the endpoint runs at create)
from supervisor.wire import errors

log = logging.getLogger("sandvisor.e2b")

PORT = "49999"  # the code interpreter's port, as the SDK names it
SOURCE = Path(__file__).resolve().parents[2] / "images" / "kernel_server.py"
START_TIMEOUT_S = 300.0  # the kernel server's first kernel, under TCG
# the relay: the server's port (or, if none listens, the server started first), the
# token line, the sandbox's environment (a template's kernels predate it), then the
# host's lines in and the server's out ($1: the server's source)
RELAY = (
    "{ exec 3<>/dev/tcp/127.0.0.1/49999; } 2>/dev/null || "
    '{ python3 -c "$1" start || exit 1; exec 3<>/dev/tcp/127.0.0.1/49999 || exit 1; }\n'
    "cat /run/sandvisor-kernels/token >&3 || exit 1\n"
    "printf 'ENV %s\\n' \"$(env -0 | base64 -w0)\" >&3\n"
    "cat <&3 & cat >&3\nwait\n"
)
LINE_MAX = 64 << 20  # a line from the guest (a chart's PNG in base64) longer than this ends the server
_CONTEXT = re.compile(r"^/contexts/([A-Za-z0-9_.-]{1,128})(/restart)?$")


@attrs.define(eq=False)
class KernelHost:
    """The kernel server of one sandbox: requests go in as lines, answers are routed
    back to the request's channel by its id."""

    target: Any  # e2b_envd.Target
    ready: trio.Event = attrs.Factory(trio.Event)
    failed: str = ""
    execd: Any = None
    pending: dict[int, trio.MemorySendChannel[dict[str, Any]]] = attrs.Factory(dict)
    lock: trio.Lock = attrs.Factory(trio.Lock)
    ids: itertools.count[int] = attrs.Factory(lambda: itertools.count(1))

    async def run(self, source: str) -> None:
        sb = self.target.handle()
        try:
            with self.target.client.acting():
                async with sb.exec(["bash", "-c", RELAY, "kernel-relay", source], workdir="/") as execd:
                    self.execd = execd
                    await self._read(execd)
        except errors.SandboxError as exc:
            self.failed = f"{exc.code}: {exc.message}"
        except Exception as exc:  # one sandbox's failure is its own: the endpoint serves on
            log.warning("e2b: the kernel server of %s failed: %r", self.target.sandbox, exc)
            self.failed = f"UNAVAILABLE: {exc}"
        finally:
            self.failed = self.failed or "the kernel server ended"
            self.ready.set()
            for ch in self.pending.values():
                ch.close()
            self.pending.clear()

    async def _read(self, execd: Any) -> None:
        buf = bytearray()
        err = bytearray()
        async for o in execd:
            if o.stream == "exit":
                break
            if o.stream == "stderr":
                err = (err + o.data)[-4096:]
                continue
            if b"\n" not in o.data:  # (a long line comes in many chunks: split only at its end)
                buf += o.data
                if len(buf) > LINE_MAX:
                    raise RuntimeError("a line from the kernel server is too long")
                continue
            *lines, rest = bytes(buf + o.data).split(b"\n")
            if len(lines[0]) > LINE_MAX:
                raise RuntimeError("a line from the kernel server is too long")
            buf = bytearray(rest)
            for line in lines:
                self._dispatch(line)
        if not self.ready.is_set():
            self.failed = "the kernel server did not start: " + err.decode(errors="replace").strip()[-1000:]

    def _dispatch(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        if "ready" in msg:
            if not msg["ready"]:
                self.failed = f"the kernel server did not start: {msg.get('error', '')}"
            self.ready.set()
            return
        rid = msg.get("id")
        if not isinstance(rid, int):  # (the guest's word: any JSON)
            return
        ch = self.pending.get(rid)
        if ch is None:
            return
        try:
            ch.send_nowait(msg)
        except trio.WouldBlock:  # a reader that stopped reading: its call ends
            self.pending.pop(rid, None)
            ch.close()
        if msg.get("done"):
            self.pending.pop(rid, None)
            ch.close()

    async def send(self, request: dict[str, Any]) -> None:
        async with self.lock:
            await self.execd.send(json.dumps(request).encode() + b"\n")

    async def call(self, op: str, **fields: Any) -> tuple[int, trio.MemoryReceiveChannel[dict[str, Any]]]:
        """Send request ``op``; its id and the channel of its answers (closed after "done")."""
        with trio.move_on_after(START_TIMEOUT_S):
            await self.ready.wait()
        if not self.ready.is_set():
            raise HttpError(502, "code interpreter unavailable: its kernel is still starting")
        if self.failed:
            raise HttpError(502, f"code interpreter unavailable: {self.failed}")
        rid = next(self.ids)
        send, recv = trio.open_memory_channel[dict[str, Any]](4096)
        self.pending[rid] = send
        await self.send({"id": rid, "op": op, **fields})
        return rid, recv

    async def unary(self, op: str, **fields: Any) -> Any:
        _, recv = await self.call(op, **fields)
        async with recv:
            async for msg in recv:
                if msg.get("done"):
                    return _value(msg)
        raise HttpError(502, f"code interpreter unavailable: {self.failed or 'no answer'}")


def _value(msg: dict[str, Any]) -> Any:
    err = msg.get("error")
    if err:
        raise HttpError(int(err.get("status", 500)), str(err.get("message", "")))
    return msg.get("value")


def warmup_argv(source: str | None = None) -> tuple[str, ...]:
    """What starts the kernel server in a fresh boot of the code-interpreter image,
    before its boot template is saved (Settings.template_warmups): E2B's ``user``
    made first (as the endpoint makes it: its home is not the root-owned directory the
    server would make for its kernels' cwd, and restores need no useradd), then the
    server started and warm."""
    text = source if source is not None else SOURCE.read_text()
    script = f'( {ENSURE_USER} ) || exit 1\nexec python3 -c "$1" start\n'
    return ("/bin/sh", "-c", script, "kernel-warmup", text)


class Kernels:
    """The endpoint's kernel servers, one per sandbox uid, each a task in ``nursery``."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.hosts: dict[str, tuple[KernelHost, trio.CancelScope]] = {}
        self._source: str | None = None

    def source(self) -> str:
        if self._source is None:
            self._source = SOURCE.read_text()
        return self._source

    def host(self, target: Any) -> KernelHost:
        """``target``'s kernel server, started if it runs none (or its last one ended)."""
        found = self.hosts.get(target.uid)
        if found is not None and not (found[0].ready.is_set() and found[0].failed):
            return found[0]
        host, scope = KernelHost(target), trio.CancelScope()
        self.hosts[target.uid] = (host, scope)
        source = self.source()

        async def run() -> None:
            with scope:
                await host.run(source)
            if self.hosts.get(target.uid, (None,))[0] is host and host.failed:
                log.info("e2b: kernel server of %s: %s", target.sandbox, host.failed)

        self.nursery.start_soon(run)
        return host

    def forget(self, uid: str) -> None:
        found = self.hosts.pop(uid, None)
        if found is not None:
            found[1].cancel()


async def serve(ex: Exchange, kernels: Kernels, target: Any) -> None:
    """One call of the code-interpreter SDK to ``target``."""
    host = kernels.host(target)
    if ex.path == "/execute" and ex.method == "POST":
        await execute(ex, host)
        return
    if ex.path == "/contexts":
        if ex.method == "POST":
            body = await ex.json()
            language, cwd = body.get("language"), body.get("cwd")
            if not isinstance(language, str | None) or not isinstance(cwd, str | None):
                raise HttpError(400, "language and cwd: strings")
            await ex.send_json(await host.unary("create", language=language, cwd=cwd))
            return
        if ex.method == "GET":
            await ex.send_json(await host.unary("list"))
            return
        raise HttpError(405, "GET or POST")
    m = _CONTEXT.match(ex.path)
    if m is not None and m.group(2) and ex.method == "POST":
        await host.unary("restart", context=m.group(1))
        await ex.respond(204)
        return
    if m is not None and not m.group(2) and ex.method == "DELETE":
        await host.unary("remove", context=m.group(1))
        await ex.respond(204)
        return
    raise HttpError(404, f"no route {ex.method} {ex.path}")


async def execute(ex: Exchange, host: KernelHost) -> None:
    """``POST /execute``: the cell's messages as JSON lines, as they come; a client that
    goes away interrupts the cell."""
    body = await ex.json()
    code, context, language = body.get("code"), body.get("context_id"), body.get("language")
    envs = body.get("env_vars") or {}
    if not isinstance(code, str):
        raise HttpError(400, "code: a string")
    if not isinstance(context, str | None) or not isinstance(language, str | None):
        raise HttpError(400, "context_id and language: strings")
    if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
        raise HttpError(400, "env_vars: a map of strings")
    t0 = trio.current_time()
    rid, recv = await host.call("execute", code=code, context=context, language=language, envs=envs)
    refused: HttpError | None = None
    async with recv, trio.open_nursery() as nursery:

        async def watch() -> None:
            await ex.disconnected()
            await host.send({"id": 0, "op": "interrupt", "target": rid})

        nursery.start_soon(watch)
        gone = False
        async for msg in recv:
            if msg.get("done"):
                guest_ms = msg.get("guest_ms")
                if isinstance(guest_ms, float | int):  # (the guest's word: only logged)
                    log.debug(
                        "e2b: cell %d: %.1f ms here, %.1f in the guest",
                        rid,
                        (trio.current_time() - t0) * 1000,
                        guest_ms,
                    )
                if not ex.started:
                    try:
                        _value(msg)  # (an error before any line: its status)
                        await ex.respond(200, b"", "application/x-ndjson")
                    except HttpError as err:
                        refused = err
                else:
                    await _write(ex, b"", more=False)
                break
            if not ex.started:
                await ex.start(200, "application/x-ndjson")
            if not gone:
                gone = not await _write(ex, json.dumps(msg["msg"]).encode() + b"\n")
        else:  # the kernel server ended mid-cell
            if ex.started:
                await _write(ex, b"", more=False)
            else:
                refused = HttpError(502, f"code interpreter unavailable: {host.failed}")
        nursery.cancel_scope.cancel()
    if refused is not None:
        raise refused


async def _write(ex: Exchange, data: bytes, *, more: bool = True) -> bool:
    try:
        await ex.write(data, more=more)
        return True
    except Exception:  # (the client went away: the cell is interrupted by the watcher)
        return False
