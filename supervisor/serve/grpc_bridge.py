"""A gRPC edge for Trio: grpcio's asyncio server in its own thread, every call a Trio task.

grpcio's C core does the HTTP/2, TLS and flow control; its ``grpc.aio`` server runs
on a private asyncio loop in one thread the edge owns. Each RPC's shim on that loop
starts the handler as a task in the edge's Trio nursery and relays messages both
ways; handlers are plain Trio async functions with a :class:`Call` for the stream::

    client ──HTTP/2──► grpc core ──► aio thread: shim ──run_sync_soon──► Trio: call task
                                       │   ▲                               (cancel scope,
                                       │   └──── call_soon_threadsafe ◄──── deadline)
                                       └─ peer cancel / deadline / stop ──► scope.cancel()

Why this shape (measured, benchmarks/grpc_bridges.py and docs/results): of grpcio-aio
in a thread, grpcio-aio on trio-asyncio in Trio's thread, grpcio's sync server with
a thread pool calling into Trio, and purerpc (Trio-native HTTP/2 in Python), this is
the one that keeps grpcio's C core (TLS, HTTP/2 hardening, the ecosystem's
conformance), never ties a thread to an open stream (Events and Exec may stay open
for hours), and propagates cancellation and deadlines into Trio cancel scopes at
once.

Flow control: ``window`` messages may be in flight each way per call; a Trio
``send`` blocks when the aio side has not written them, and the aio side stops
reading the client's messages when the Trio side has not received them, so HTTP/2
flow control pushes back on the peer.

Cancellation: a client cancel, an expired deadline or the edge stopping cancel the
aio shim; the shim cancels the call's Trio scope. The deadline is also put on the
Trio scope itself when the call starts (so work stops on time even if the core's
notice is late). Errors raised in Trio map to status codes by name: anything with a
``code`` attribute that names a :class:`grpc.StatusCode` (sandbox.v1's codes, our
``ApiError``, the domain's errors) becomes that status with its ``message``; an
unexpected exception is ``INTERNAL`` (and logged).

Lifecycle: ``await nursery.start(edge.run)`` returns once every address listens;
cancelling ``run`` stops the server (``grace`` seconds for calls to finish, calls
still running get ``UNAVAILABLE``), cancels every call task, and returns only after
the loop thread has ended: no thread, loop or socket outlives it.

Addresses (:mod:`supervisor.serve.grpc_addresses`): TCP callers authenticate by a client
certificate or a bearer token, checked before any handler runs
(:mod:`supervisor.serve.grpc_auth`); Unix sockets are born with their mode, and an address
with a peer policy is served through a relay that checks each connection's credentials
(:mod:`supervisor.serve.grpc_unix`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import enum
import logging
import math
import shutil
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import attrs

# isort: split
# grpc's fork support off before grpc is imported (see the module): first, always
from supervisor.wire.grpc_env import GRPC_FORK_ENV, GRPC_FORK_SAFE

# isort: split
import grpc
import grpc.aio
import trio
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory

from actors.face import Principal
from supervisor.serve.grpc_addresses import Address, TcpAddress, UnixAddress
from supervisor.serve.grpc_auth import TcpAuth, TcpGate, check_tcp_auth
from supervisor.serve.grpc_unix import (
    bind_unix,
    listen_public,
    private_dir,
    relay_connections,
    serve_privately,
    unlink_if_ours,
)

log = logging.getLogger("sandvisor.grpc")

ReqT = TypeVar("ReqT")
RespT = TypeVar("RespT")

DEFAULT_WINDOW = 16  # messages in flight per direction per call
DEFAULT_MAX_MESSAGE = 4 << 20  # as the msgpack socket's MAX_FRAME; sandbox.v1 streams files in chunks
MAX_CONCURRENT_RPCS = 1024  # in all: more are RESOURCE_EXHAUSTED (each is a Trio task and a window)
MAX_CONCURRENT_STREAMS = 256  # per connection, as the msgpack socket's MAX_CALLS
STATUS_BY_NAME: dict[str, grpc.StatusCode] = {c.name: c for c in grpc.StatusCode}


class Kind(enum.Enum):
    UNARY_UNARY = "unary_unary"
    UNARY_STREAM = "unary_stream"
    STREAM_UNARY = "stream_unary"
    STREAM_STREAM = "stream_stream"

    @classmethod
    def of(cls, client_streaming: bool, server_streaming: bool) -> Kind:
        return {
            (False, False): cls.UNARY_UNARY,
            (False, True): cls.UNARY_STREAM,
            (True, False): cls.STREAM_UNARY,
            (True, True): cls.STREAM_STREAM,
        }[(client_streaming, server_streaming)]


class StatusError(Exception):
    """Raise in a handler to end the call with ``code`` (a :class:`grpc.StatusCode` name)."""

    def __init__(self, code: str | grpc.StatusCode, message: str = "") -> None:
        self.code = code.name if isinstance(code, grpc.StatusCode) else code
        if self.code not in STATUS_BY_NAME:
            raise ValueError(f"unknown status code {code!r}")
        self.message = message
        super().__init__(f"{self.code}: {message}")


ErrorMapper = Callable[[BaseException], "tuple[grpc.StatusCode, str] | None"]


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status an exception raised in a handler maps to, or None (unexpected: INTERNAL).

    Duck-typed, so the edge needs no import of the domain: an exception whose
    ``code`` is a status code's name (``"NOT_FOUND"``) or a :class:`grpc.StatusCode`
    maps to it, with its ``message`` (or ``str(exc)``) as the details."""
    code = getattr(exc, "code", None)
    status: grpc.StatusCode | None = None
    if isinstance(code, grpc.StatusCode):
        status = code
    elif isinstance(code, str):
        status = STATUS_BY_NAME.get(code)
    if status is not None and status is not grpc.StatusCode.OK:
        message = getattr(exc, "message", None)
        return status, message if isinstance(message, str) else str(exc)
    if isinstance(exc, trio.TooSlowError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "timed out"
    return None


def _leaf(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member groups (nurseries wrap them)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


# ---------------------------------------------------------------------------------------
# the Trio side of one call
# ---------------------------------------------------------------------------------------
class _Done:
    """The end of a call, queued behind its last message (so it cannot overtake one)."""

    __slots__ = ("code", "message", "response")

    def __init__(self, code: grpc.StatusCode, message: str = "", response: Any = None) -> None:
        self.code = code
        self.message = message
        self.response = response


class Call(Generic[ReqT, RespT]):
    """One RPC, as its Trio handler sees it.

    ``send`` (server streaming), ``receive`` / ``async for`` (client streaming; None or
    the end of iteration at the client's half-close). ``deadline`` is on Trio's clock
    (``inf`` without one) and already applied to the handler's cancel scope."""

    def __init__(
        self,
        method: Method,
        context: grpc.aio.ServicerContext[Any, Any],
        loop: asyncio.AbstractEventLoop,
        window: int,
    ) -> None:
        # built on the aio thread, per call: only what this kind of call needs (measured:
        # a Trio memory channel alone costs 12 us, a third of a unary call's bridge cost)
        self.method = method.path
        self.peer = context.peer()
        self.metadata = cast(Sequence[tuple[str, str | bytes]], context.invocation_metadata() or ())
        unix = self.peer.startswith(("unix:", "unix-abstract:"))
        self.auth: Mapping[str, Sequence[bytes]] = (
            {} if unix else {k: list(v) for k, v in context.auth_context().items()}
        )
        remaining = context.time_remaining()
        self._remaining = remaining if remaining is not None and remaining < 1e9 else None
        self._remaining_at = time.monotonic()
        self.deadline = math.inf
        self.peer_cancelled = False
        self._loop = loop
        self._scope = trio.CancelScope()
        self._finished = False
        # Trio -> aio: messages, then the final _Done; one wakeup only when the aio side waits
        self._lock = threading.Lock()
        self._outq: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._streams_out = method.kind in (Kind.UNARY_STREAM, Kind.STREAM_STREAM)
        self._streams_in = method.kind in (Kind.STREAM_UNARY, Kind.STREAM_STREAM)
        if self._streams_out:
            self._out_credit = trio.Semaphore(window)  # credits come back as the aio side writes
        if self._streams_in:
            # aio -> Trio: the client's messages; credits go back to the aio side
            self._in_send, self._in_recv = trio.open_memory_channel[Any](window)
            self._in_credit = asyncio.Semaphore(window)

    # -- for handlers (Trio thread) --------------------------------------------------
    @property
    def peer_identities(self) -> list[str]:
        """The TLS client certificate's names (common name, then SANs), if one was checked."""
        names = [*self.auth.get("x509_common_name", ()), *self.auth.get("x509_subject_alternative_name", ())]
        return [n.decode(errors="replace") for n in names]

    def metadata_value(self, key: str) -> str | bytes | None:
        for k, v in self.metadata:
            if k == key:
                return v
        return None

    async def send(self, message: RespT) -> None:
        """Queue one response message; waits while ``window`` are unwritten."""
        if not self._streams_out:
            raise RuntimeError(f"{self.method} does not stream responses: return the response")
        await self._out_credit.acquire()
        if self._finished or not self._push(message):
            raise trio.BrokenResourceError("the call has ended")

    async def receive(self) -> ReqT | None:
        """The client's next message, or None once it half-closed."""
        if not self._streams_in:
            raise RuntimeError(f"{self.method} takes one request: it is the handler's argument")
        try:
            msg = await self._in_recv.receive()
        except trio.EndOfChannel:
            return None
        self._to_aio(self._in_credit.release)
        return cast(ReqT, msg)

    def __aiter__(self) -> Call[ReqT, RespT]:
        return self  # not an async generator: a handler that breaks out leaves nothing to finalize

    async def __anext__(self) -> ReqT:
        msg = await self.receive()
        if msg is None:
            raise StopAsyncIteration
        return msg

    # -- plumbing ----------------------------------------------------------------------
    def _to_aio(self, fn: Callable[..., object], *args: Any) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the loop is closed: the edge has stopped
            return False

    def _push(self, item: Any) -> bool:  # Trio thread
        with self._lock:
            self._outq.append(item)
            waiter, self._waiter = self._waiter, None
        return waiter is None or self._to_aio(_wake, waiter)

    async def _pop(self) -> Any:  # aio thread
        while True:
            with self._lock:
                if self._outq:
                    return self._outq.popleft()
                waiter = self._waiter = self._loop.create_future()
            await waiter

    def _finish(self, done: _Done) -> None:  # Trio thread
        if not self._finished:
            self._finished = True
            self._push(done)

    def _release_out(self, n: int) -> None:  # Trio thread
        for _ in range(n):
            self._out_credit.release()

    def _peer_gone(self) -> None:  # Trio thread: the aio shim ended first
        if not self._finished:
            self.peer_cancelled = trio.current_time() < self.deadline
            self._scope.cancel()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


UnaryHandler = Callable[[Any, Call[Any, Any]], Awaitable[Any]]
StreamHandler = Callable[[Call[Any, Any]], Awaitable[Any]]
Handler = UnaryHandler | StreamHandler


@attrs.frozen
class Method:
    service: str  # "sandbox.v1.SandboxService"
    name: str  # "Create"
    kind: Kind
    handler: Handler
    request_deserializer: Callable[[bytes], Any] | None = None
    response_serializer: Callable[[Any], bytes] | None = None

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


def methods_of(service: _descriptor.ServiceDescriptor, servicer: object) -> list[Method]:
    """The servicer's Trio methods named after the service's RPCs (missing ones answer
    UNIMPLEMENTED). Unary requests: ``async def Name(self, request, call)``; streaming
    requests: ``async def Name(self, call)``; server streams ``await call.send(msg)``."""
    out = []
    for m in service.methods:
        fn = getattr(servicer, m.name, None)
        if fn is None:
            continue
        if not callable(fn):
            raise TypeError(f"{type(servicer).__name__}.{m.name} is not callable")
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        out.append(
            Method(
                service.full_name,
                m.name,
                Kind.of(m.client_streaming, m.server_streaming),
                fn,
                request_deserializer=req_cls.FromString,
                response_serializer=resp_cls.SerializeToString,
            )
        )
    return out


# ---------------------------------------------------------------------------------------
# the edge
# ---------------------------------------------------------------------------------------
class GrpcEdge:
    """gRPC server for Trio handlers. Add services, then ``await nursery.start(edge.run)``.

    ::

        edge = GrpcEdge([parse_address("unix:///run/sandvisor/grpc.sock", group="sandvisor")])
        edge.add_service(sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"], SandboxServicer(core))
        await nursery.start(edge.run)       # listening; edge.addresses has the bound ports
    """

    def __init__(
        self,
        addresses: Iterable[Address],
        *,
        health: bool = True,
        reflection: bool = True,
        window: int = DEFAULT_WINDOW,
        grace: float = 2.0,
        max_message: int = DEFAULT_MAX_MESSAGE,
        max_rpcs: int = MAX_CONCURRENT_RPCS,
        error_mapper: ErrorMapper | None = None,
        options: Sequence[tuple[str, Any]] = (),
        tcp_auth: TcpAuth | None = None,
    ) -> None:
        self.requested: list[Address] = list(addresses)
        if not self.requested:
            raise ValueError("no address to serve on")
        check_tcp_auth(self.requested, tcp_auth)
        self.tcp_auth = tcp_auth or TcpAuth()
        tcp = [a for a in self.requested if isinstance(a, TcpAddress)]
        mtls = any(a.tls is not None and a.tls.require_client_cert for a in tcp)
        self._gate = TcpGate(self.tcp_auth, mtls=mtls) if tcp else None  # Unix-only edges pay nothing
        self.addresses: list[Address] = []  # as bound (TCP port 0 resolved), once running
        self.health = health
        self.reflection = reflection
        self.window = window
        self.grace = grace
        self.error_mapper = error_mapper
        self.max_rpcs = max_rpcs
        self.options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
            ("grpc.so_reuseport", 0),  # a second daemon on the same port must fail, not share it
            *options,
        ]
        self._methods: dict[str, Method] = {}
        self._descriptor_services: list[str] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._context: contextvars.Context | None = None
        self._nursery: trio.Nursery | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False
        self._lock = threading.Lock()
        self._health_servicer: Any = None
        self._relays: list[tuple[UnixAddress, Path]] = []  # (public address, private dir)
        self.unix_peers: dict[str, Principal] = {}  # relayed connections' principals, by grpc's peer name
        self.calls_started = 0
        self.refused = 0  # connections refused by a peer policy

    @property
    def unauthenticated(self) -> int:
        """TCP calls refused UNAUTHENTICATED."""
        return self._gate.unauthenticated if self._gate is not None else 0

    # -- configuration (before run) ------------------------------------------------------
    def add_service(self, service: _descriptor.ServiceDescriptor, servicer: object) -> None:
        """Serve ``service`` (from a generated ``*_pb2.DESCRIPTOR``) with ``servicer``'s Trio methods."""
        self.add_methods(service.full_name, methods_of(service, servicer))

    def add_methods(self, service: str, methods: Iterable[Method]) -> None:
        """Serve ``methods`` as the service named ``service`` (listed in health and reflection)."""
        for m in methods:
            self.add_method(m)
        self._descriptor_services.append(service)

    def add_method(self, method: Method) -> None:
        if self._token is not None:
            raise RuntimeError("add methods before run()")
        if method.path in self._methods:
            raise ValueError(f"{method.path} added twice")
        self._methods[method.path] = method

    # -- health (Trio thread, while running) ---------------------------------------------
    def set_serving(self, service: str, serving: bool) -> None:
        """Set ``grpc.health.v1`` status of ``service`` ("" is the whole server)."""
        if self._health_servicer is None or self._loop is None:
            return
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        servicer = self._health_servicer
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(servicer.set(service, status)))

    # -- lifecycle (Trio) ------------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[GrpcEdge] = trio.TASK_STATUS_IGNORED) -> None:
        if self._token is not None:
            raise RuntimeError("a GrpcEdge runs once")
        self._token = trio.lowlevel.current_trio_token()
        # call tasks are started from run_sync_soon callbacks (Trio's system context): they
        # get run()'s context instead, as tasks its caller started would (the daemon's
        # context variables)
        self._context = contextvars.copy_context()
        if not GRPC_FORK_SAFE:
            log.warning(
                "grpc was imported before the supervisor and %s is not 0: its fork handlers may crash "
                "the QEMU processes this supervisor forks",
                GRPC_FORK_ENV,
            )
        ready = trio.Event()
        failure: list[BaseException] = []

        def on_ready(exc: BaseException | None) -> None:
            if exc is not None:
                failure.append(exc)
            ready.set()

        public: list[tuple[Path, int]] = []
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._thread, on_ready)
            try:
                await ready.wait()
                if not failure:
                    for addr, private in self._relays:
                        listener, ino = await listen_public(addr, private)
                        public.append((addr.path, ino))
                        nursery.start_soon(
                            relay_connections, listener, addr, private, self._refused_one, self.unix_peers
                        )
                    task_status.started(self)
                    await trio.sleep_forever()
            finally:
                self._request_stop()  # the thread task ends when the loop has; the nursery waits for it
                nursery.cancel_scope.cancel()
                for path, ino in public:
                    unlink_if_ours(path, ino)
        if failure:
            raise failure[0]  # out here, once the loop thread has ended, and not in a group

    async def _thread(self, on_ready: Callable[[BaseException | None], None]) -> None:
        # not abandoned on cancel: run() cannot return before the loop thread has ended
        await trio.to_thread.run_sync(
            self._loop_thread, on_ready, limiter=trio.CapacityLimiter(1), thread_name="grpc-edge"
        )

    def _loop_thread(self, on_ready: Callable[[BaseException | None], None]) -> None:
        asyncio.run(self._aio_main(on_ready))

    def _request_stop(self) -> None:
        with self._lock:
            self._stop_requested = True
            loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)

    def _to_trio(self, fn: Callable[..., object], *args: Any) -> bool:
        assert self._token is not None
        try:
            self._token.run_sync_soon(fn, *args)
            return True
        except trio.RunFinishedError:
            return False

    # -- the asyncio thread ------------------------------------------------------------------
    async def _aio_main(self, on_ready: Callable[[BaseException | None], None]) -> None:
        server: grpc.aio.Server | None = None
        bound: list[tuple[UnixAddress, int]] = []
        refusers: list[grpc.aio.Server] = []
        try:
            with self._lock:
                self._loop = asyncio.get_running_loop()
                self._stop = asyncio.Event()
                if self._stop_requested:
                    self._stop.set()
            server = grpc.aio.server(
                options=self.options,
                maximum_concurrent_rpcs=self.max_rpcs,
                interceptors=[self._gate] if self._gate is not None else None,
            )
            server.add_generic_rpc_handlers((_Dispatcher(self),))
            await self._add_health_and_reflection(server)
            for addr in self.requested:
                if isinstance(addr, UnixAddress) and addr.policy is not None:
                    private = private_dir(addr.path)
                    self._relays.append((addr, private))
                    refusers.append(await serve_privately(server, addr.policy, private, self.options))
                    self.addresses.append(addr)
                elif isinstance(addr, UnixAddress):
                    bound.append((addr, bind_unix(server, addr)))
                    self.addresses.append(addr)
                else:
                    target = addr.target
                    try:  # (grpcio raises RuntimeError where it used to return 0)
                        port = (
                            server.add_secure_port(target, addr.tls.credentials())
                            if addr.tls
                            else server.add_insecure_port(target)
                        )
                    except RuntimeError:
                        port = 0
                    if port == 0:
                        raise OSError(f"gRPC: cannot listen on {target} (in use, or not an address of this host)")
                    self.addresses.append(attrs.evolve(addr, port=port))
            await server.start()
            if self._gate is not None and self.tcp_auth.insecure:
                log.warning(
                    "gRPC on %s: --grpc-insecure: TCP callers are NOT authenticated, any local user who can "
                    "connect controls every sandbox (for tests only)",
                    ", ".join(str(a) for a in self.addresses if isinstance(a, TcpAddress)),
                )
        except BaseException as exc:
            on_ready_exc: BaseException | None = exc
        else:
            on_ready_exc = None
        self._to_trio(on_ready, on_ready_exc)
        try:
            if on_ready_exc is None:
                assert self._stop is not None
                await self._stop.wait()
        finally:
            if self._health_servicer is not None:
                with contextlib.suppress(Exception):
                    await self._health_servicer.enter_graceful_shutdown()
            for refuser in refusers:
                await refuser.stop(0)
            if server is not None:
                await server.stop(self.grace)
            for addr, ino in bound:
                unlink_if_ours(addr.path, ino)
            for _, private in self._relays:
                shutil.rmtree(private, ignore_errors=True)

    async def _add_health_and_reflection(self, server: grpc.aio.Server) -> None:
        names = list(self._descriptor_services)
        if self.health:
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            from grpc_health.v1._async import HealthServicer

            self._health_servicer = HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._health_servicer, server)
            for name in names:
                await self._health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            names.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        if self.reflection:
            from grpc_reflection.v1alpha import reflection

            names.append(reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, server)

    async def _serve(
        self,
        method: Method,
        request: Any,
        requests: AsyncIterator[Any] | None,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> Any:
        """The shim of one call on the aio loop."""
        loop = asyncio.get_running_loop()
        call: Call[Any, Any] = Call(method, context, loop, self.window)
        if not self._to_trio(self._start_call, method, call, request):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server shutting down")
        pump = asyncio.ensure_future(self._pump(call, requests)) if requests is not None else None
        unwritten = 0
        done: _Done | None = None
        try:
            while True:
                item = await call._pop()
                if isinstance(item, _Done):
                    done = item
                    break
                await context.write(item)
                unwritten += 1
                if not call._outq or unwritten >= max(1, self.window // 2):
                    self._to_trio(call._release_out, unwritten)
                    unwritten = 0
        finally:
            if pump is not None:
                pump.cancel()
            if done is None:  # cancelled (peer, deadline, server stop) or write failed
                self._to_trio(call._peer_gone)
        assert done is not None
        if done.code is not grpc.StatusCode.OK:
            await context.abort(done.code, done.message)
        return done.response

    async def _pump(self, call: Call[Any, Any], requests: AsyncIterator[Any]) -> None:
        """The client's messages into the call's Trio channel, ``window`` at a time."""
        try:
            async for msg in requests:
                await call._in_credit.acquire()
                if not self._to_trio(call._in_send.send_nowait, msg):
                    return
        finally:
            self._to_trio(call._in_send.close)
            aclose = getattr(requests, "aclose", None)  # grpc's is an async generator: close it here,
            if aclose is not None:  # on this loop, not in whatever thread collects it
                with contextlib.suppress(Exception):
                    await aclose()

    def _refused_one(self) -> None:  # Trio thread: a peer policy refused a connection
        self.refused += 1

    # -- the Trio side of a call ---------------------------------------------------------------
    def _start_call(self, method: Method, call: Call[Any, Any], request: Any) -> None:
        nursery, context = self._nursery, self._context
        assert nursery is not None and context is not None
        self.calls_started += 1
        try:
            context.run(lambda: nursery.start_soon(self._run_call, method, call, request, name=method.path))
        except RuntimeError:  # the nursery is closing
            call._finish(_Done(grpc.StatusCode.UNAVAILABLE, "server shutting down"))

    async def _run_call(self, method: Method, call: Call[Any, Any], request: Any) -> None:
        if call._remaining is not None:
            call.deadline = trio.current_time() + call._remaining - (time.monotonic() - call._remaining_at)
            call._scope.deadline = call.deadline
        done = _Done(grpc.StatusCode.OK)
        try:
            with call._scope:
                if method.kind in (Kind.UNARY_UNARY, Kind.UNARY_STREAM):
                    result = await cast(UnaryHandler, method.handler)(request, call)
                else:
                    result = await cast(StreamHandler, method.handler)(call)
                if method.kind in (Kind.UNARY_UNARY, Kind.STREAM_UNARY):
                    if result is None:
                        raise TypeError(f"{method.path} returned no response")
                    done.response = result
            if call._scope.cancelled_caught:
                if call.peer_cancelled:
                    done = _Done(grpc.StatusCode.CANCELLED, "cancelled by the client")
                else:
                    done = _Done(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        except trio.Cancelled:
            call._finish(_Done(grpc.StatusCode.UNAVAILABLE, "server shutting down"))
            raise
        except BaseException as exc:
            leaf = _leaf(exc)
            if isinstance(leaf, trio.Cancelled):  # a group around the edge's own cancellation
                call._finish(_Done(grpc.StatusCode.UNAVAILABLE, "server shutting down"))
                raise
            if not isinstance(leaf, Exception):
                raise
            mapped = (self.error_mapper(leaf) if self.error_mapper else None) or status_of(leaf)
            if mapped is None:
                log.error("%s failed", method.path, exc_info=leaf)
                mapped = (grpc.StatusCode.INTERNAL, f"{type(leaf).__name__}: {leaf}")
            done = _Done(*mapped)
        call._finish(done)


class _Dispatcher(grpc.GenericRpcHandler):
    """Routes a method path to its aio shim (grpc answers UNIMPLEMENTED for unknown paths)."""

    def __init__(self, edge: GrpcEdge) -> None:
        self.edge = edge

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        m = self.edge._methods.get(handler_call_details.method)
        if m is None:
            return None
        edge = self.edge
        des, ser = m.request_deserializer, m.response_serializer
        if m.kind is Kind.UNARY_UNARY:

            async def uu(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                return await edge._serve(m, request, None, context)

            return grpc.unary_unary_rpc_method_handler(uu, des, ser)
        if m.kind is Kind.UNARY_STREAM:

            async def us(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
                await edge._serve(m, request, None, context)

            return grpc.unary_stream_rpc_method_handler(us, des, ser)
        if m.kind is Kind.STREAM_UNARY:

            async def su(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                return await edge._serve(m, None, requests, context)

            return grpc.stream_unary_rpc_method_handler(su, des, ser)

        async def ss(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await edge._serve(m, None, requests, context)

        return grpc.stream_stream_rpc_method_handler(ss, des, ser)
