"""envd, E2B's in-sandbox daemon, as the ``e2b`` SDK reaches it, served by the E2B
endpoint on a sandvisor sandbox: the ``process.Process`` and ``filesystem.Filesystem``
Connect services and the ``/files`` upload and download (HTTP), routed by the
``E2b-Sandbox-Id`` header (:mod:`supervisor.serve.e2b_server`).

Every call acts for the key that asked (:class:`Target`: the key's client, the
sandbox's id and uid). A process is an Exec of the supervisor held by
:class:`Processes` (the endpoint's; one task each, in its nursery; found by the
sandbox's uid, so a later sandbox given the same id sees none of them): ``Start``
opens it and streams its events, ``Connect`` subscribes to a running one,
``SendInput``/``CloseStdin`` feed it, ``SendSignal`` ends it (leaving the Exec kills
the process), ``List`` lists them. pids are the endpoint's own numbers. A subscriber
that falls behind by :data:`BACKLOG` events is dropped (its stream ends with
``resource_exhausted``); the process runs on.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import logging
import re
import zlib
from collections.abc import AsyncIterator
from typing import Any

import attrs
import trio

from supervisor.client.sdk.aio import AsyncExec, AsyncSandbox
from supervisor.serve import e2b_pty
from supervisor.serve import guest_fs as fs
from supervisor.serve.e2b_http import (
    CONNECT_STREAM_JSON,
    Exchange,
    HttpError,
    RpcError,
    envelope,
    http_error,
    rpc_error,
    stream_end,
    stream_request,
    unary_error,
    unary_request,
)
from supervisor.serve.e2b_keys import Client
from supervisor.serve.e2b_meta import metadata_of, set_metadata
from supervisor.serve.e2b_user import DEFAULT_USER, chown, default_cwd, user_or_default
from supervisor.wire import errors, protocol

log = logging.getLogger("sandvisor.e2b")

BACKLOG = 1024  # events queued per subscriber
SMALL = 1 << 20  # an upload up to this size is held, to retry it once its directory is made
KEEPALIVE_S = 30.0
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}$")


def envd_user(ex: Exchange) -> str:
    """The user of an envd call: ``Authorization: Basic base64(user:)``, else E2B's
    default user (:mod:`supervisor.serve.e2b_user`)."""
    auth = ex.headers.get("authorization", "")
    if not auth.lower().startswith("basic "):
        return DEFAULT_USER
    try:
        user = base64.b64decode(auth[6:].strip(), validate=True).decode().split(":", 1)[0]
    except (binascii.Error, UnicodeDecodeError):
        raise HttpError(400, "malformed Authorization header") from None
    return user_or_default(_checked_user(user))


def _checked_user(user: str) -> str:
    if user and not _USER.match(user):
        raise HttpError(400, f"bad user name {user!r}")
    return user


def _path(p: Any) -> str:
    if not isinstance(p, str) or not p or "\0" in p:
        raise RpcError("invalid_argument", "a path is required")
    return "./" + p if p.startswith("-") else p


@attrs.frozen
class Target:
    """The sandbox of an envd call: ``client`` acts for the key that asked; ``uid``: the
    sandbox's per-create identity (the one its id names now)."""

    client: Client
    sandbox: str
    uid: str

    def handle(self) -> AsyncSandbox:
        return self.client.sandbox(self.sandbox)


@attrs.define(eq=False)
class Process:
    pid: int
    target: Target
    config: dict[str, Any]
    tag: str
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    execd: AsyncExec | None = None
    tty: bool = False
    subscribers: list[trio.MemorySendChannel[dict[str, Any]]] = attrs.Factory(list)

    def subscribe(self) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        send, recv = trio.open_memory_channel[dict[str, Any]](BACKLOG)
        self.subscribers.append(send)
        return recv

    def publish(self, event: dict[str, Any]) -> None:
        for ch in list(self.subscribers):
            try:
                ch.send_nowait(event)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                self.subscribers.remove(ch)
                ch.close()

    def close(self) -> None:
        for ch in self.subscribers:
            ch.close()
        self.subscribers.clear()


class Processes:
    """The endpoint's processes: one task each in ``nursery`` (the endpoint's), keyed
    by the sandbox's uid and the pid."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.table: dict[tuple[str, int], Process] = {}
        self._pids = itertools.count(1000)

    async def start(self, target: Target, req: dict[str, Any], user: str) -> tuple[Process, Any]:
        cfg = req.get("process") or {}
        cmd = cfg.get("cmd")
        args = cfg.get("args") or []
        envs = cfg.get("envs") or {}
        if not isinstance(cmd, str) or not cmd or not isinstance(args, list) or not isinstance(envs, dict):
            raise RpcError("invalid_argument", "process.cmd is required; args a list, envs a map")
        proc = Process(next(self._pids), target, {"cmd": cmd, "args": [str(a) for a in args]}, str(req.get("tag", "")))
        if cfg.get("cwd"):
            proc.config["cwd"] = str(cfg["cwd"])
        if envs:
            proc.config["envs"] = {str(k): str(v) for k, v in envs.items()}
        size = e2b_pty.pty_size(req)
        proc.tty = size is not None
        events = proc.subscribe()
        workdir = default_cwd(user, proc.config.get("cwd", ""))
        how = {"env": proc.config.get("envs", {}), "workdir": workdir, "user": user}
        if size is not None:
            how.update(tty=True, size=size)
        await self.nursery.start(self._run, proc, [cmd, *proc.config["args"]], how, bool(req.get("stdin")) or proc.tty)
        return proc, events

    async def _run(
        self, proc: Process, argv: list[str], how: dict[str, Any], stdin: bool, task_status: trio.TaskStatus[None]
    ) -> None:
        key = (proc.target.uid, proc.pid)
        end: dict[str, Any] = {"exitCode": -1, "exited": False, "status": "killed"}
        sb = proc.target.handle()
        try:
            with proc.target.client.acting():  # (the key's, whichever task runs this)
                opened = sb.exec(
                    argv,
                    env=how["env"],
                    workdir=how["workdir"],
                    user=how["user"],
                    tty=bool(how.get("tty")),
                    size=how.get("size", (80, 24)),
                )
                async with opened as execd:
                    proc.execd = execd
                    self.table[key] = proc
                    proc.publish({"start": {"pid": proc.pid}})
                    task_status.started()
                    if not stdin:
                        await execd.close_stdin()
                    with proc.scope:
                        async for o in execd:
                            if o.stream == "exit":
                                code = o.exit_code if o.exit_code is not None else -1
                                end = {"exitCode": code, "exited": True, "status": f"exit status {code}"}
                            elif o.data:
                                stream = "pty" if proc.tty else o.stream
                                proc.publish({"data": {stream: base64.b64encode(o.data).decode()}})
        except errors.SandboxError as exc:
            if proc.execd is None:  # not started: the caller's error
                raise rpc_error(exc) from None
            end = {"exitCode": -1, "exited": False, "status": "error", "error": f"{exc.code}: {exc.message}"}
        except Exception as exc:  # one process's failure is its own: the endpoint serves on
            if proc.execd is None:
                raise RpcError("unavailable", f"cannot start the process: {exc}") from None
            log.warning("e2b: process %d of %s failed: %r", proc.pid, proc.target.sandbox, exc)
            end = {"exitCode": -1, "exited": False, "status": "error", "error": f"UNAVAILABLE: {exc}"}
        finally:
            self.table.pop(key, None)
            proc.publish({"end": end})
            proc.close()

    def get(self, uid: str, selector: Any) -> Process:
        sel = selector if isinstance(selector, dict) else {}
        if "pid" in sel:
            p = self.table.get((uid, int(sel["pid"])))
            if p is not None:
                return p
            raise RpcError("not_found", f"process with pid {sel['pid']} not found")
        if "tag" in sel:
            for (u, _), p in self.table.items():
                if u == uid and p.tag == sel["tag"]:
                    return p
            raise RpcError("not_found", f"process with tag {sel['tag']!r} not found")
        raise RpcError("invalid_argument", "process selector: pid or tag")

    def listing(self, uid: str) -> list[dict[str, Any]]:
        out = []
        for (u, pid), p in sorted(self.table.items()):
            if u == uid:
                info: dict[str, Any] = {"config": p.config, "pid": pid}
                if p.tag:
                    info["tag"] = p.tag
                out.append(info)
        return out

    def forget(self, uid: str) -> None:
        """The sandbox (this uid) is gone: end its processes."""
        for (u, _), p in list(self.table.items()):
            if u == uid:
                p.scope.cancel()


# --- process.Process ---------------------------------------------------------------------------
async def _stream_events(ex: Exchange, events: trio.MemoryReceiveChannel[dict[str, Any]]) -> None:
    if not ex.started:
        await ex.start(200, CONNECT_STREAM_JSON)
    ended = False
    with events:
        while True:
            with trio.move_on_after(KEEPALIVE_S) as idle:
                try:
                    ev = await events.receive()
                except trio.EndOfChannel:
                    break
            if idle.cancelled_caught:
                await ex.write(envelope({"event": {"keepalive": {}}}))
                continue
            await ex.write(envelope({"event": ev}))
            if "end" in ev:
                ended = True
                break
    await stream_end(
        ex, None if ended else RpcError("resource_exhausted", "the client fell behind the process's output")
    )


async def process_call(ex: Exchange, procs: Processes, target: Target, method: str) -> None:
    if method in ("Start", "Connect"):
        try:
            req = await stream_request(ex)
            if method == "Start":
                _, events = await procs.start(target, req, envd_user(ex))
            else:
                proc = procs.get(target.uid, (req.get("process") or {}))
                events = proc.subscribe()
                await ex.start(200, CONNECT_STREAM_JSON)
                await ex.write(envelope({"event": {"start": {"pid": proc.pid}}}))
        except RpcError as err:
            await stream_end(ex, err)
            return
        except HttpError as err:
            await stream_end(ex, RpcError("invalid_argument", err.message))
            return
        except (ValueError, TypeError):
            await stream_end(ex, RpcError("invalid_argument", "malformed request"))
            return
        await _stream_events(ex, events)
        return
    if method == "Update":
        await e2b_pty.update(ex, procs, target)
        return
    if method == "StreamInput":
        await e2b_pty.stream_input(ex, procs, target)
        return
    try:
        if method not in ("List", "SendInput", "CloseStdin", "SendSignal"):
            raise RpcError("unimplemented", f"process.Process/{method} is not served")
        req = await unary_request(ex)
        reply: dict[str, Any] = {}
        if method == "List":
            reply = {"processes": procs.listing(target.uid)}
        elif method == "SendInput":
            proc = procs.get(target.uid, req.get("process"))
            kind, data = e2b_pty.input_bytes(req.get("input"))
            if kind == "pty" and not proc.tty:
                raise RpcError("failed_precondition", "the process has no PTY")
            if proc.execd is not None:
                await proc.execd.send(data)
        elif method == "CloseStdin":
            proc = procs.get(target.uid, req.get("process"))
            if proc.execd is not None:
                await proc.execd.close_stdin()
        elif method == "SendSignal":
            proc = procs.get(target.uid, req.get("process"))
            if req.get("signal") not in ("SIGNAL_SIGKILL", "SIGNAL_SIGTERM", 9, 15):
                raise RpcError("invalid_argument", "signal: SIGNAL_SIGKILL or SIGNAL_SIGTERM")
            proc.scope.cancel()  # leaving the Exec kills the process
        else:
            raise RpcError("unimplemented", f"process.Process/{method} is not served")
    except RpcError as err:
        await unary_error(ex, err)
        return
    except (ValueError, TypeError):
        await unary_error(ex, RpcError("invalid_argument", "malformed request"))
        return
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        await unary_error(ex, RpcError("not_found", "the process has ended"))
        return
    except errors.SandboxError as exc:
        await unary_error(ex, rpc_error(exc))
        return
    await ex.send_json(reply)


# --- filesystem.Filesystem ---------------------------------------------------------------------
async def filesystem_call(ex: Exchange, target: Target, method: str) -> None:
    sb = target.handle()
    try:
        if method not in ("Stat", "ListDir", "MakeDir", "Move", "Remove"):
            raise RpcError("unimplemented", f"filesystem.Filesystem/{method} is not served (no watchers)")
        req = await unary_request(ex)
        user = envd_user(ex)
        if method == "Stat":
            reply: dict[str, Any] = {"entry": await fs.stat(sb, user, _path(req.get("path")))}
        elif method == "ListDir":
            depth = int(req.get("depth") or 1)
            reply = {"entries": await fs.list_dir(sb, user, _path(req.get("path")), depth)}
        elif method == "MakeDir":
            reply = {"entry": await fs.make_dir(sb, user, _path(req.get("path")))}
        elif method == "Move":
            reply = {"entry": await fs.move(sb, user, _path(req.get("source")), _path(req.get("destination")))}
        elif method == "Remove":
            await fs.remove(sb, user, _path(req.get("path")))
            reply = {}
        else:
            raise RpcError("unimplemented", f"filesystem.Filesystem/{method} is not served (no watchers)")
    except RpcError as err:
        await unary_error(ex, err)
        return
    except HttpError as err:
        await unary_error(ex, RpcError("invalid_argument", err.message))
        return
    except (ValueError, TypeError):
        await unary_error(ex, RpcError("invalid_argument", "malformed request"))
        return
    except errors.SandboxError as exc:
        await unary_error(ex, rpc_error(exc))
        return
    await ex.send_json(reply)


# --- /files ------------------------------------------------------------------------------------
def _file_path(ex: Exchange, path: str | None = None) -> str:
    p = path if path is not None else ex.query.get("path", "")
    if not p or "\0" in p:
        raise HttpError(400, "a path is required")
    if not p.startswith("/"):
        raise HttpError(400, f"path {p!r}: absolute paths only")
    return p


async def download(ex: Exchange, target: Target) -> None:
    """``GET /files?path=``: the file, streamed as the supervisor's ReadFile sends it."""
    path = _file_path(ex)
    _checked_user(ex.query.get("username", ""))
    zipped = accepts_gzip(ex)
    squeeze = zlib.compressobj(6, zlib.DEFLATED, 31) if zipped else None
    headers = [("content-encoding", "gzip")] if zipped else []
    try:
        async with (
            target.client.connect() as conn,
            conn.open_call(
                "ReadFile", protocol.unstructure_body(protocol.ReadFileRequest(target.sandbox, path))
            ) as call,
        ):
            async for item in call:
                chunk = protocol.structure_body(item, protocol.FileChunk)
                if not ex.started:
                    await ex.start(200, "application/octet-stream", headers)
                data = squeeze.compress(chunk.data) if squeeze is not None else chunk.data
                if data:
                    await ex.write(data)
                if chunk.done:
                    break
    except errors.SandboxError as exc:
        if ex.started:
            raise
        raise http_error(exc) from None
    if not ex.started:
        await ex.start(200, "application/octet-stream", headers)
    await ex.write(squeeze.flush() if squeeze is not None else b"", more=False)


def accepts_gzip(ex: Exchange) -> bool:
    """Whether the client asked for a gzip answer (``Accept-Encoding: gzip``, not q=0)."""
    for item in ex.headers.get("accept-encoding", "").lower().split(","):
        name, _, params = item.strip().partition(";")
        if name.strip() == "gzip":
            return params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


async def gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A gzip body (``Content-Encoding: gzip``) as its bytes, streamed; a corrupt one is 400."""
    d = zlib.decompressobj(31)
    try:
        async for piece in chunks:
            while piece:
                out = d.decompress(piece, 1 << 20)
                if out:
                    yield out
                piece = d.unconsumed_tail
        tail = d.flush()
    except zlib.error as exc:
        raise HttpError(400, f"the gzip body does not decode: {exc}") from None
    if tail:
        yield tail
    if not d.eof:
        raise HttpError(400, "the gzip body is truncated")


async def _write(sb: AsyncSandbox, path: str, data: AsyncIterator[bytes], user: str = "") -> None:
    """Write ``path``, making its parent directories as envd does: a small file (up to
    :data:`SMALL` bytes, held here) is written at once and again after ``mkdir -p`` if
    its directory is missing; a larger one after ``mkdir -p``."""
    head = bytearray()
    more = True
    while len(head) <= SMALL:
        piece = await anext(data, None)
        if piece is None:
            more = False
            break
        head += piece
    if not more:
        try:
            await sb.fs.write(path, bytes(head))
        except errors.NotFound:
            await fs.make_parents(sb, user, path)
            await sb.fs.write(path, bytes(head))
        return

    async def rest() -> AsyncIterator[bytes]:
        yield bytes(head)
        async for piece in data:
            yield piece

    await fs.make_parents(sb, user, path)
    await sb.fs.write(path, rest())


async def upload(ex: Exchange, target: Target) -> None:
    """``POST /files``: an ``application/octet-stream`` body (``?path=``) or
    ``multipart/form-data`` with a ``file`` part per file (its file name the path
    when there is no ``?path=``), each streamed into the sandbox as it arrives."""
    user = user_or_default(_checked_user(ex.query.get("username", "")))
    meta = metadata_of(ex)
    encoding = ex.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "", "gzip"):
        raise HttpError(415, f"content-encoding {encoding!r}: identity or gzip")
    body = gunzip(ex.chunks()) if encoding == "gzip" else ex.chunks()
    sb = target.handle()
    written: list[dict[str, Any]] = []
    ctype = ex.headers.get("content-type", "")
    try:
        if ctype.startswith("multipart/form-data"):
            from supervisor.serve.e2b_multipart import parts

            async for name, data in parts(ctype, body):
                path = _file_path(ex, ex.query.get("path") or name)
                await _write(sb, path, data, user)
                written.append({"name": path.rsplit("/", 1)[-1], "type": "file", "path": path})
        else:
            path = _file_path(ex)
            await _write(sb, path, body, user)
            written.append({"name": path.rsplit("/", 1)[-1], "type": "file", "path": path})
        await chown(sb, user, [w["path"] for w in written])
        if meta:  # (envd 0.6.2's file metadata: user.e2b.* xattrs)
            await set_metadata(sb, [w["path"] for w in written], meta)
            for w in written:
                w["metadata"] = dict(meta)
    except errors.SandboxError as exc:
        raise http_error(exc) from None
    await ex.send_json(written)
