"""The Unix-socket edge of ``sandvisor serve``: connections, calls, method handlers.

Each connection is a task; each call on it is a task in the connection's nursery
with its own cancel scope, so a ``Cancel`` or a disconnect stops the call's work
(an exec is killed in the guest, a stream stops). Frames are capped; a frame that
does not decode closes the connection after a ``Fail`` (id 0) saying why; a call
that fails gets a ``Fail`` with the seed's code and the connection goes on.

Handlers check wire shapes (the first ExecInput carries init, paths are absolute),
map the wire to domain values and back (:mod:`supervisor.mapping`) and call the
registry or a sandbox; every lifecycle rule lives in the domain (:mod:`actors`).
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import attrs
import trio

from actors._groups import collapse_single
from actors.errors import DomainError, InvalidArgument
from actors.events import Lagged
from actors.model import ALIVE, State, check_port
from actors.registry import DEFAULT_STOP_TIMEOUT, Registry
from actors.sandbox import Sandbox
from actors.snapshot import rfc3339
from guestd import proto as P
from supervisor import mapping as M
from supervisor import protocol as W
from supervisor.protocol import ApiError

log = logging.getLogger("sandvisor.server")
HELLO_TIMEOUT = 10.0
MAX_CALLS = 256  # open calls per connection; more is RESOURCE_EXHAUSTED (a task each)


@attrs.define(eq=False)
class CallCtx:
    id: int
    method: str
    conn: Connection
    inbox_send: trio.MemorySendChannel[dict[str, Any]]
    inbox: trio.MemoryReceiveChannel[dict[str, Any]]
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    async def item(self, obj: Any) -> None:
        await self.conn.send(W.Item(self.id, W.unstructure_body(obj)))

    async def next_input(self) -> dict[str, Any] | None:
        try:
            return await self.inbox.receive()
        except trio.EndOfChannel:
            return None


Handler = Callable[["Server", CallCtx, dict[str, Any]], Awaitable[Any]]
UNARY, STREAM = "unary", "stream"


class Connection:
    def __init__(self, server: Server, stream: trio.SocketStream, name: str) -> None:
        self.server = server
        self.stream = stream
        self.name = name
        self.lock = trio.Lock()
        self.calls: dict[int, CallCtx] = {}
        self.closed = False

    async def send(self, msg: W.Envelope) -> None:
        frame = W.encode(msg)
        async with self.lock:
            if self.closed:
                raise trio.ClosedResourceError
            await self.stream.send_all(frame)

    async def serve(self) -> None:
        reader = W.FrameReader()
        try:
            with trio.move_on_after(HELLO_TIMEOUT) as hello_scope:
                hello = await self._next(reader)
            if hello_scope.cancelled_caught or not isinstance(hello, W.ClientHello):
                await self._fail_and_close(0, W.INVALID_ARGUMENT, "expected hello first")
                return
            if hello.version != W.PROTOCOL_VERSION:
                await self._fail_and_close(
                    0,
                    W.FAILED_PRECONDITION,
                    f"protocol {hello.version} unsupported; server speaks {W.PROTOCOL_VERSION}",
                )
                return
            await self.send(W.ServerHello(W.PROTOCOL_VERSION, "sandvisor"))
            with collapse_single():
                async with trio.open_nursery() as nursery:
                    while True:
                        msg = await self._next(reader)
                        if msg is None:
                            break
                        await self._route(nursery, msg)
                    nursery.cancel_scope.cancel()  # client gone: cancel every call
        except ApiError as exc:  # undecodable input: say why, then hang up
            await self._fail_and_close(0, exc.code, exc.message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.closed = True
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def _next(self, reader: W.FrameReader) -> W.Envelope | None:
        while True:
            body = reader.next()
            if body is not None:
                return W.decode(body)
            data = await self.stream.receive_some(1 << 16)
            if not data:
                return None
            reader.feed(data)

    async def _fail_and_close(self, id: int, code: str, message: str) -> None:
        try:
            with trio.move_on_after(2):
                await self.send(W.Fail(id, code, message))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ApiError):
            pass

    async def _route(self, nursery: trio.Nursery, msg: W.Envelope) -> None:
        if isinstance(msg, W.Call):
            if msg.id in self.calls or msg.id <= 0:
                await self.send(W.Fail(msg.id, W.INVALID_ARGUMENT, f"call id {msg.id} is in use or invalid"))
                return
            if len(self.calls) >= MAX_CALLS:
                await self.send(W.Fail(msg.id, W.RESOURCE_EXHAUSTED, f"at most {MAX_CALLS} open calls per connection"))
                return
            send, recv = trio.open_memory_channel[dict[str, Any]](16)
            ctx = CallCtx(msg.id, msg.method, self, send, recv)
            self.calls[msg.id] = ctx
            nursery.start_soon(self._run_call, ctx, msg.body)
        elif isinstance(msg, W.Send):
            target = self.calls.get(msg.id)
            if target is not None:
                try:
                    await target.inbox_send.send(msg.body)  # a full inbox holds back this connection only
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    pass
        elif isinstance(msg, W.HalfClose):
            target = self.calls.get(msg.id)
            if target is not None:
                target.inbox_send.close()
        elif isinstance(msg, W.Cancel):
            target = self.calls.get(msg.id)
            if target is not None:
                target.scope.cancel()
        else:
            raise ApiError(W.INVALID_ARGUMENT, f"unexpected {type(msg).__name__} from a client")

    async def _run_call(self, ctx: CallCtx, body: dict[str, Any]) -> None:
        entry = METHODS.get(ctx.method)
        try:
            with ctx.scope:
                if entry is None:
                    raise ApiError(W.UNIMPLEMENTED, f"unknown method {ctx.method!r}")
                kind, handler = entry
                try:
                    with collapse_single():  # a handler's own nursery must not hide its error's code
                        result = await handler(self.server, ctx, body)
                except DomainError as exc:
                    raise M.wire_error(exc) from None
                if kind == UNARY:
                    await self.send(W.Reply(ctx.id, W.unstructure_body(result if result is not None else W.Empty())))
                else:
                    await self.send(W.End(ctx.id))
            if ctx.scope.cancelled_caught:
                await self.send(W.Fail(ctx.id, W.CANCELLED, "cancelled by the client"))
        except ApiError as exc:
            await self._safe_send(W.Fail(ctx.id, exc.code, exc.message))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:
            log.exception("call %s %s failed", ctx.method, ctx.id)
            await self._safe_send(W.Fail(ctx.id, W.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            self.calls.pop(ctx.id, None)
            ctx.inbox_send.close()

    async def _safe_send(self, msg: W.Envelope) -> None:
        try:
            await self.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


class Server:
    def __init__(self, registry: Registry, socket_path: Path, *, group: str | None = None) -> None:
        self.registry = registry
        self.socket_path = socket_path
        self.group = group
        self.connections = 0

    async def serve(self, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED) -> None:
        path = self.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            path.unlink()
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            await sock.bind(str(path))
        finally:
            os.umask(old)
        if self.group:
            os.chown(path, -1, grp.getgrnam(self.group).gr_gid)
            os.chmod(path, 0o660)
        sock.listen(128)
        listener = trio.SocketListener(sock)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(self)
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(self._connection, stream)
        finally:
            with trio.CancelScope(shield=True):
                await listener.aclose()
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        name = f"conn{self.connections}"
        try:
            creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, gid = struct.unpack("3i", creds)
            log.info("%s: client pid=%d uid=%d gid=%d", name, pid, uid, gid)
        except OSError:
            pass
        await Connection(self, stream, name).serve()


# ---------------------------------------------------------------------------
# method handlers
# ---------------------------------------------------------------------------
METHODS: dict[str, tuple[str, Handler]] = {}


def method(name: str, kind: str = UNARY) -> Callable[[Handler], Handler]:
    def wrap(fn: Handler) -> Handler:
        METHODS[name] = (kind, fn)
        return fn

    return wrap


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise InvalidArgument("path must be absolute")
    return path


@method("Create")
async def _create(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.CreateSandboxRequest)
    sb = await srv.registry.create(req.id, M.config(req))
    # the seed: "State at time of response: always starting" (ready follows as an event,
    # at once when a warm pool member served it)
    return W.CreateSandboxResponse(id=sb.id, ip_address=sb.ip_address, state=State.STARTING.value)


@method("Start")
async def _start(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.IdRequest)
    sb = await srv.registry.start(req.id)
    return W.CreateSandboxResponse(id=sb.id, ip_address=sb.ip_address, state=sb.state.value)


@method("Inspect")
async def _inspect(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.IdRequest)
    return M.info(srv.registry.get(req.id))


@method("List")
async def _list(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.ListSandboxesRequest)
    page, cursor = srv.registry.list(
        state=M.state(req.state), labels=req.labels, limit=req.limit or 20, cursor=req.cursor
    )
    return W.ListSandboxesResponse([M.summary(sb) for sb in page], cursor)


@method("Stop")
async def _stop(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.StopSandboxRequest)
    if req.timeout_seconds < 0:
        raise InvalidArgument("timeout_seconds must not be negative")
    timeout = float(req.timeout_seconds or DEFAULT_STOP_TIMEOUT)
    sb = srv.registry.stop(req.id, timeout)
    with trio.move_on_after(timeout + 30):
        await sb.wait_stopped()
    return None


@method("Kill")
async def _kill(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.IdRequest)
    sb = srv.registry.kill(req.id)
    with trio.move_on_after(30):
        await sb.wait_stopped()
    return None


@method("Drain")
async def _drain(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.IdRequest)
    srv.registry.drain(req.id)
    return None


@method("WaitUntilStopped")
async def _wait(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.IdRequest)
    sb = srv.registry.get(req.id)
    await sb.wait_stopped()
    return M.info(sb)


@method("Remove")
async def _remove(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.RemoveSandboxRequest)
    await srv.registry.remove(req.id, req.force)
    return None


@method("Run", STREAM)
async def _run(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.RunRequest)
    sb = srv.registry.get(req.id)
    workload = sb.run_workload(
        req.cmd, env=req.env, cwd=req.working_dir, user=req.user, tty=req.tty, timeout=float(req.timeout_seconds)
    )
    # closed here, in this task: a cancelled Run kills its process and returns the
    # sandbox to ready at once, not when the garbage collector finds the generator
    async with aclosing(workload) as outputs:
        async for stream, data, code in outputs:
            if code is None:
                await ctx.item(W.RunOutput(stream=stream, data=data))
            else:
                await ctx.item(W.RunOutput(stream="exit", exit_code=code, done=True))


@method("Exec", STREAM)
async def _exec(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    first = W.structure_body(body, W.ExecInput)
    if first.init is None:
        raise InvalidArgument("the first ExecInput must carry init")
    req = first.init
    sb = srv.registry.get(req.id)
    async with (
        sb.exec_session(
            req.cmd,
            env=req.env,
            cwd=req.working_dir,
            user=req.user,
            tty=req.tty,
            rows=req.tty_size.height,
            cols=req.tty_size.width,
            timeout=float(req.timeout_seconds),
        ) as h,
        trio.open_nursery() as nursery,
    ):

        async def pump_input() -> None:
            while True:
                raw = await ctx.next_input()
                if raw is None:
                    await h.close_stdin()
                    return
                msg = W.structure_body(raw, W.ExecInput)
                if msg.stdin is not None:
                    await h.send_stdin(msg.stdin)
                if msg.resize is not None:
                    if not req.tty:
                        raise InvalidArgument("resize needs tty")
                    await h.resize(msg.resize.height, msg.resize.width)
                if msg.close_stdin:
                    await h.close_stdin()
                sb.touch()

        nursery.start_soon(pump_input)
        async for ch, data in h:
            name = "stderr" if ch == P.STDERR else "stdout"
            sb.log.append("output" if req.tty else name, data)
            await ctx.item(W.RunOutput(stream=name, data=data))
        nursery.cancel_scope.cancel()
    assert h.exit is not None
    await ctx.item(W.RunOutput(stream="exit", exit_code=h.exit.code, done=True))


@method("Events", STREAM)
async def _events(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.SandboxEventsRequest)
    sub = srv.registry.events.subscribe(req.id, req.action)
    try:
        async for ev in sub:
            await ctx.item(M.event(ev))
    except Lagged as exc:
        raise ApiError(W.RESOURCE_EXHAUSTED, str(exc)) from None
    finally:
        srv.registry.events.unsubscribe(sub)


@method("ReadFile", STREAM)
async def _read_file(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.ReadFileRequest)
    sb = srv.registry.get(req.id)
    async with sb.read_file(_absolute(req.path)) as f:
        async for chunk in f:
            await ctx.item(W.FileChunk(data=chunk))
    await ctx.item(W.FileChunk(done=True))


@method("WriteFile")
async def _write_file(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    first = W.structure_body(body, W.WriteFileRequest)
    if first.open is None:
        raise InvalidArgument("the first WriteFileRequest must carry open")
    op = first.open
    path = _absolute(op.path)
    sb = srv.registry.get(op.id)

    async def chunks() -> Any:
        total = 0
        while True:
            raw = await ctx.next_input()
            if raw is None:
                return
            msg = W.structure_body(raw, W.WriteFileRequest)
            if msg.chunk is None:
                raise InvalidArgument("after open, only chunks")
            total += len(msg.chunk.data)
            if total > P.MAX_FILE:
                raise ApiError(W.RESOURCE_EXHAUSTED, f"file exceeds {P.MAX_FILE} bytes")
            if msg.chunk.data:
                yield msg.chunk.data
            if msg.chunk.done:
                return

    await sb.write_file(path, chunks(), mode=op.mode or 0o644)
    return None


@method("Ping")
async def _ping(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.IdRequest)
    sb = srv.registry.get(req.id)
    t = time.monotonic_ns()
    pong = await sb.guest_call(lambda g: g.channel.ping())
    return W.PingResponse(latency_ns=time.monotonic_ns() - t, activity=pong.activity)


@method("Touch")
async def _touch(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.IdRequest)
    sb = srv.registry.get(req.id)
    activity = await sb.guest_call(lambda g: g.channel.touch())
    sb.touch()
    return W.TouchResponse(activity=activity)


@method("Logs", STREAM)
async def _logs(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.LogsRequest)
    if req.tail < 0:
        raise InvalidArgument("tail must not be negative")
    sb = srv.registry.get(req.id)
    if req.follow:
        async with aclosing(sb.log.follow(tail=req.tail, since=req.since, cursor=req.cursor)) as records:
            async for r in records:
                if req.until and r.timestamp > req.until:
                    return
                await ctx.item(W.LogEntry(r.seq, r.timestamp, r.source, r.data))
        return
    for r in await sb.log.read(tail=req.tail, since=req.since, until=req.until, cursor=req.cursor):
        await ctx.item(W.LogEntry(r.seq, r.timestamp, r.source, r.data))


@method("Metrics")
async def _metrics(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.IdRequest)
    return M.metrics(await srv.registry.get(req.id).metrics())


def _alive(sandboxes: list[Sandbox]) -> list[Sandbox]:
    return [sb for sb in sandboxes if sb.state in ALIVE]


async def _sample(sandboxes: list[Sandbox]) -> list[W.MetricsResponse]:
    """Live sandboxes' metrics, asked concurrently: a silent guest costs its own answer
    (bounded by the guest deadline), not everyone's."""
    alive = _alive(sandboxes)
    found: dict[str, W.MetricsResponse] = {}

    async def one(sb: Sandbox) -> None:
        try:
            found[sb.id] = M.metrics(await sb.metrics())
        except DomainError:
            pass

    async with trio.open_nursery() as nursery:
        for sb in alive:
            nursery.start_soon(one, sb)
    return [found[sb.id] for sb in alive if sb.id in found]


@method("MetricsStream", STREAM)
async def _metrics_stream(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.MetricsStreamRequest)
    if not 0.1 <= req.interval_seconds <= 3600:
        raise InvalidArgument("interval_seconds must be 0.1 to 3600")
    while True:
        if req.id:
            sb = srv.registry.get(req.id)
            if sb.state in ALIVE:
                await ctx.item(M.metrics(await sb.metrics()))
        else:
            for m in await _sample(list(srv.registry.sandboxes.values())):
                await ctx.item(m)
        await trio.sleep(req.interval_seconds)


@method("MetricsAll")
async def _metrics_all(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    return _Raw([W.unstructure_body(m) for m in await _sample(list(srv.registry.sandboxes.values()))])


@attrs.frozen
class _Raw:
    sandboxes: list[dict[str, Any]]


@method("ExposePort")
async def _expose(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.ExposePortRequest)
    check_port(req.sandbox_port, req.host_port)
    pm = await srv.registry.get(req.id).expose(req.sandbox_port, req.host_port, M.protocol(req.protocol))
    # idempotent: a port exposed already answers with its mapping. The guest needs no
    # relay port: slirp forwards, and on tap the relay connects, to the sandbox port
    return W.ExposePortResponse(host_port=pm.host_port, guest_port=pm.sandbox_port)


@method("UnexposePort")
async def _unexpose(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.UnexposePortRequest)
    check_port(req.sandbox_port)
    await srv.registry.get(req.id).unexpose(req.sandbox_port, M.protocol(req.protocol))
    return None


@method("ListPorts")
async def _list_ports(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.IdRequest)
    return M.ports(srv.registry.get(req.id))


@method("Checkpoint")
async def _checkpoint(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.CheckpointRequest)
    rec, ck = await srv.registry.checkpoint(req.sandbox_id, name=req.name, labels=req.labels)
    return W.CheckpointResponse(
        snapshot_id=rec.id,
        snapshot_dir=rec.dir,
        created_at=rfc3339(rec.created_ns),
        size_bytes=sum(rec.sizes.values()),
        memory=rec.memory.value,
        paused_ms=round(ck.paused_s * 1000, 3),
    )


@method("Restore")
async def _restore(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.RestoreRequest)
    sb = await srv.registry.restore(
        req.snapshot_id,
        id=req.id,
        labels=req.labels,
        ttl_seconds=req.ttl_seconds,
        network_override=req.network_override,
    )
    return W.RestoreResponse(id=sb.id, ip_address=sb.ip_address)


@method("ListSnapshots")
async def _list_snapshots(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.ListSnapshotsRequest)
    reg = srv.registry
    return W.ListSnapshotsResponse(
        [M.snapshot(r, reg.pool_ready(r)) for r in reg.list_snapshots(req.sandbox_id, req.labels)]
    )


@method("DeleteSnapshot")
async def _delete_snapshot(srv: Server, ctx: CallCtx, body: dict[str, Any]) -> Any:
    req = W.structure_body(body, W.DeleteSnapshotRequest)
    await srv.registry.delete_snapshot(req.snapshot_id)
    return None
