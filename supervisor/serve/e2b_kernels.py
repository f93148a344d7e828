"""E2B's code interpreter (``e2b-code-interpreter``) on the E2B endpoint: the SDK's calls
to port 49999 of a sandbox (``E2b-Sandbox-Port: 49999``), ``POST /execute`` and
``/contexts``, answered by the guest's kernel server (images/kernel_server.py: Jupyter
kernels run with jupyter_client in the sandbox, speaking JSON lines on stdin/stdout).

The kernel server is a service of the guest (:mod:`supervisor.serve.kernels`, the
runtime sandvisor's own edges share): started before the code-interpreter image's
boot template is saved (:func:`warmup_argv`), so its sandboxes hold a warm kernel, or
by the first call (the create starts it: :meth:`KernelHost.warm`); reached through a
relay Exec open while calls are in flight (so ``beta_pause``, a snapshot and the
idle timeout work between cells), which acts for the key whose call first reached
the sandbox; every call is checked first by the endpoint (the key must see the
sandbox).

A cell whose client goes away (the SDK's ``timeout`` passed: it closes the
connection) is interrupted in the kernel, so the next cell runs.
"""

from __future__ import annotations

import json
import re
from typing import Any

import trio

from supervisor.serve.e2b_http import Exchange, HttpError
from supervisor.serve.e2b_user import ENSURE as ENSURE_USER  # (the script the endpoint runs at create)
from supervisor.serve.kernels import SOURCE, KernelError, KernelHost, Kernels, value_of

__all__ = ["PORT", "SOURCE", "KernelHost", "Kernels", "execute", "serve", "warmup_argv"]

PORT = "49999"  # the code interpreter's port, as the SDK names it
_CONTEXT = re.compile(r"^/contexts/([A-Za-z0-9_.-]{1,128})(/restart)?$")


def _value(msg: dict[str, Any]) -> Any:
    try:
        return value_of(msg)
    except KernelError as err:
        raise HttpError(err.status, err.message) from None


def warmup_argv(source: str | None = None) -> tuple[str, ...]:
    """What starts the kernel server in a fresh boot of the code-interpreter image,
    before its boot template is saved (Settings.template_warmups): E2B's ``user``
    made first (as the endpoint makes it: its home is not the root-owned directory the
    server would make for its kernels' cwd, and restores need no useradd), then the
    server started and warm."""
    text = source if source is not None else SOURCE.read_text()
    script = f'( {ENSURE_USER} ) || exit 1\nexec python3 -c "$1" start\n'
    return ("/bin/sh", "-c", script, "kernel-warmup", text)


async def serve(ex: Exchange, kernels: Kernels, target: Any) -> None:
    """One call of the code-interpreter SDK to ``target`` (the kernel runtime's refusals
    as HTTP statuses)."""
    try:
        await _serve(ex, kernels.host(target))
    except KernelError as err:
        raise HttpError(err.status, err.message) from None


async def _serve(ex: Exchange, host: KernelHost) -> None:
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
    rid, recv = await host.call("execute", code=code, context=context, language=language, envs=envs)
    refused: HttpError | None = None
    async with recv, trio.open_nursery() as nursery:

        async def watch() -> None:
            await ex.disconnected()
            await host.interrupt(rid)

        nursery.start_soon(watch)
        gone = False
        async for msg in recv:
            if msg.get("done"):
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
