"""The Unix-socket edge of ``sandvisor serve``: the msgpack transport of the method table.

Each connection is a task; each call on it is a task in the connection's nursery
with its own cancel scope, so a ``Cancel`` or a disconnect stops the call's work
(an exec is killed in the guest, a stream stops). Frames are capped; a frame that
does not decode closes the connection after a ``Fail`` (id 0) saying why; a call
that fails gets a ``Fail`` with sandbox.v1's code and the connection goes on.

A ``Call{method, body}`` is structured (cattrs) into the method's request class and
run by its handler from :data:`supervisor.serve.api.METHODS` (the table the gRPC edge
serves too); the response goes back as a ``Reply``, or ``Item*`` then ``End`` for a
server stream; ``Send`` bodies feed a client stream. Domain errors become a ``Fail``
with the wire's code of the same name.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.face import DomainError, InvalidArgument, Principal, Registry, check_principal_name, collapse_single
from supervisor.serve import mapping
from supervisor.serve.api import METHODS
from supervisor.serve.peers import ClientPolicy, Peer
from supervisor.wire import protocol
from supervisor.wire.frames import FramedStream
from supervisor.wire.protocol import ApiError

log = logging.getLogger("sandvisor.server")
HELLO_TIMEOUT = 10.0
MAX_CALLS = 256  # open calls per connection; more is RESOURCE_EXHAUSTED (a task each)


@attrs.define(eq=False)
class CallCtx:
    """One msgpack call: its :class:`~supervisor.serve.api.CallIO` (items out, ``Send`` bodies in) and cancel scope."""

    id: int
    method: str
    conn: Connection
    inbox_send: trio.MemorySendChannel[dict[str, Any]]
    inbox: trio.MemoryReceiveChannel[dict[str, Any]]
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    inputs: type | None = None  # the class ``Send`` bodies structure into

    @property
    def principal(self) -> Principal:
        """Who asks (the connection's, fixed at hello)."""
        assert self.conn.principal is not None
        return self.conn.principal

    async def send(self, message: Any) -> None:
        await self.conn.send(protocol.Item(self.id, protocol.unstructure_body(message)))

    async def receive(self) -> Any | None:
        try:
            raw = await self.inbox.receive()
        except trio.EndOfChannel:
            return None
        if self.inputs is None:
            raise InvalidArgument(f"{self.method} takes no stream")
        return protocol.structure_body(raw, self.inputs)


class Connection:
    def __init__(self, server: Server, stream: trio.SocketStream, name: str, peer: Peer | None = None) -> None:
        self.server = server
        self.frames = FramedStream(stream)  # (the SDK's framing too: one implementation)
        self.name = name
        self.peer = peer
        self.calls: dict[int, CallCtx] = {}
        self.principal: Principal | None = None  # set by a hello that was accepted

    async def send(self, msg: protocol.Envelope) -> None:
        await self.frames.send(msg)

    async def serve(self) -> None:
        try:
            with trio.move_on_after(HELLO_TIMEOUT) as hello_scope:
                hello = await self.frames.receive()
            if hello_scope.cancelled_caught or not isinstance(hello, protocol.ClientHello):
                await self._fail_and_close(0, protocol.INVALID_ARGUMENT, "expected hello first")
                return
            if hello.version != protocol.PROTOCOL_VERSION:
                await self._fail_and_close(
                    0,
                    protocol.FAILED_PRECONDITION,
                    f"protocol {hello.version} unsupported; server speaks {protocol.PROTOCOL_VERSION}",
                )
                return
            why = "peer credentials unavailable" if self.peer is None else self.server.policy.refusal(self.peer)
            if why is None:
                assert self.peer is not None
                self.principal, why = self._principal(self.server.policy.principal(self.peer), hello)
            if why is not None:
                log.warning("%s: refused: %s", self.name, why)
                await self._fail_and_close(0, protocol.PERMISSION_DENIED, why)
                return
            await self.send(protocol.ServerHello(protocol.PROTOCOL_VERSION, "sandvisor"))
            with collapse_single():
                async with trio.open_nursery() as nursery:
                    while True:
                        msg = await self.frames.receive()
                        if msg is None:
                            break
                        await self._route(nursery, msg)
                    nursery.cancel_scope.cancel()  # client gone: cancel every call
        except ApiError as exc:  # undecodable input: say why, then hang up
            await self._fail_and_close(0, exc.code, exc.message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await self.frames.aclose()

    def _principal(self, peer: Principal, hello: protocol.ClientHello) -> tuple[Principal | None, str | None]:
        """The connection's principal: the peer's, or the one an admin peer acts for
        (``act_as``); else (None, why not)."""
        if not hello.act_as:
            if hello.act_as_admin:
                return None, "act_as_admin needs act_as"
            return peer, None
        if not peer.admin:
            return None, f"{peer.name} may not act for another principal: only admins may"
        bad = check_principal_name(hello.act_as)
        if bad is not None:
            return None, f"act_as: {bad}"
        log.info("%s: %s acts as %s%s", self.name, peer.name, hello.act_as, " (admin)" if hello.act_as_admin else "")
        return Principal(hello.act_as, hello.act_as_admin), None

    async def _fail_and_close(self, id: int, code: str, message: str) -> None:
        try:
            with trio.move_on_after(2):
                await self.send(protocol.Fail(id, code, message))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ApiError):
            pass

    async def _route(self, nursery: trio.Nursery, msg: protocol.Envelope) -> None:
        if isinstance(msg, protocol.Call):
            if msg.id in self.calls or msg.id <= 0:
                await self.send(
                    protocol.Fail(msg.id, protocol.INVALID_ARGUMENT, f"call id {msg.id} is in use or invalid")
                )
                return
            if len(self.calls) >= MAX_CALLS:
                await self.send(
                    protocol.Fail(msg.id, protocol.RESOURCE_EXHAUSTED, f"at most {MAX_CALLS} open calls per connection")
                )
                return
            send, recv = trio.open_memory_channel[dict[str, Any]](16)
            ctx = CallCtx(msg.id, msg.method, self, send, recv)
            self.calls[msg.id] = ctx
            nursery.start_soon(self._run_call, ctx, msg.body)
        elif isinstance(msg, protocol.Send):
            target = self.calls.get(msg.id)
            if target is not None:
                try:
                    await target.inbox_send.send(msg.body)  # a full inbox holds back this connection only
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    pass
        elif isinstance(msg, protocol.HalfClose):
            target = self.calls.get(msg.id)
            if target is not None:
                target.inbox_send.close()
        elif isinstance(msg, protocol.Cancel):
            target = self.calls.get(msg.id)
            if target is not None:
                target.scope.cancel()
        else:
            raise ApiError(protocol.INVALID_ARGUMENT, f"unexpected {type(msg).__name__} from a client")

    async def _run_call(self, ctx: CallCtx, body: dict[str, Any]) -> None:
        entry = METHODS.get(ctx.method)
        try:
            with ctx.scope:
                if entry is None:
                    raise ApiError(protocol.UNIMPLEMENTED, f"unknown method {ctx.method!r}")
                request: Any = protocol.structure_body(body, entry.request)
                ctx.inputs = entry.inputs
                try:
                    with collapse_single():  # a handler's own nursery must not hide its error's code
                        result = await entry.handler(self.server.registry, ctx, request)
                except DomainError as exc:
                    raise mapping.wire_error(exc) from None
                if entry.streams:
                    await self.send(protocol.End(ctx.id))
                else:
                    await self.send(
                        protocol.Reply(
                            ctx.id, protocol.unstructure_body(result if result is not None else protocol.Empty())
                        )
                    )
            if ctx.scope.cancelled_caught:
                await self.send(protocol.Fail(ctx.id, protocol.CANCELLED, "cancelled by the client"))
        except ApiError as exc:
            await self._safe_send(protocol.Fail(ctx.id, exc.code, exc.message))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:
            log.exception("call %s %s failed", ctx.method, ctx.id)
            await self._safe_send(protocol.Fail(ctx.id, protocol.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            self.calls.pop(ctx.id, None)
            ctx.inbox_send.close()

    async def _safe_send(self, msg: protocol.Envelope) -> None:
        try:
            await self.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


class Server:
    def __init__(
        self, registry: Registry, socket_path: Path, *, group: str | None = None, admin_group: str | None = None
    ) -> None:
        self.registry = registry
        self.socket_path = socket_path
        self.group = group
        self.policy = ClientPolicy.for_serve(group, admin_group)
        self.connections = 0

    async def serve(self, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED) -> None:
        path = self.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            path.unlink()
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # bound and listening under a temporary name, then renamed into place: the path
        # never names a socket that refuses connections (a client that waited for the
        # file, as tests and scripts do, got ECONNREFUSED between bind and listen)
        for stale in path.parent.glob(f".{path.name}.*"):  # a supervisor killed between bind and rename
            stale.unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            await sock.bind(str(tmp))
        finally:
            os.umask(old)
        try:
            if self.group:
                os.chown(tmp, -1, grp.getgrnam(self.group).gr_gid)
                os.chmod(tmp, 0o660)
            sock.listen(128)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            sock.close()
            raise
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
        peer = None
        try:
            peer = Peer.of(stream.socket)  # type: ignore[arg-type]
            log.info("%s: client pid=%d uid=%d gid=%d", name, peer.pid, peer.uid, peer.gid)
        except OSError:
            pass
        await Connection(self, stream, name, peer).serve()
