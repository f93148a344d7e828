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
``code`` attribute that names a :class:`grpc.StatusCode` (the seed's codes, our
``ApiError``, the domain's errors) becomes that status with its ``message``; an
unexpected exception is ``INTERNAL`` (and logged).

Lifecycle: ``await nursery.start(edge.run)`` returns once every address listens;
cancelling ``run`` stops the server (``grace`` seconds for calls to finish, calls
still running get ``UNAVAILABLE``), cancels every call task, and returns only after
the loop thread has ended: no thread, loop or socket outlives it.

TCP addresses authenticate every call (:class:`TcpAuth`): a client certificate the TLS
handshake verified (``client_ca``), or the bearer token (``authorization: Bearer TOKEN``
metadata, compared in constant time); else the call ends UNAUTHENTICATED before any
handler (health and reflection too) sees it. An edge with a TCP address and neither
refuses to start; ``TcpAuth(insecure=True)`` (tests, loopback only) lets any caller in.

Unix sockets are born with their mode: 0600 (root, or whoever runs the daemon) or 0660
with the configured group, bound in a fresh 0700 directory, where they get their mode
and group before they are renamed to their path. grpcio does not expose a peer's
credentials (SO_PEERCRED), so an address with a :class:`PeerPolicy` is served through
a relay: the public socket is Trio's, each connection's credentials are checked when
it is accepted (as the msgpack socket does at hello), and its bytes are relayed to
grpc's own socket in that private directory, or, refused, to a second grpc server
there that answers every call PERMISSION_DENIED::

    client --unix--> public socket (Trio: SO_PEERCRED -> policy.check)
                        |-- served --> <private>/grpc.sock (the edge's server)
                        +-- refused -> <private>/refused.sock (PERMISSION_DENIED, policy.served())
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import enum
import grp
import hmac
import inspect
import ipaddress
import logging
import math
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

import attrs

# isort: split
# grpc's fork support off before grpc is imported (see the module): first, always
from supervisor.grpc_env import GRPC_FORK_ENV, GRPC_FORK_SAFE

# isort: split
import grpc
import grpc.aio
import trio
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory

log = logging.getLogger("sandvisor.grpc")

ReqT = TypeVar("ReqT")
RespT = TypeVar("RespT")

DEFAULT_WINDOW = 16  # messages in flight per direction per call
DEFAULT_MAX_MESSAGE = 4 << 20  # as the msgpack socket's MAX_FRAME; the seed streams files in chunks
MAX_CONCURRENT_RPCS = 1024  # in all: more are RESOURCE_EXHAUSTED (each is a Trio task and a window)
MAX_CONCURRENT_STREAMS = 256  # per connection, as the msgpack socket's MAX_CALLS
REFUSED_LINGER = 10.0  # seconds a refused connection is kept, to be told PERMISSION_DENIED
RELAY_CHUNK = 1 << 16
MIN_TOKEN, MAX_TOKEN = 32, 1024  # a bearer token's length (openssl rand -hex 32: 64)
UNAUTHENTICATED = (
    "this address needs client authentication: a client certificate (serve --grpc-client-ca) "
    "or metadata 'authorization: Bearer TOKEN' (serve --grpc-token-file)"
)
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
# addresses
# ---------------------------------------------------------------------------------------
@attrs.frozen
class TlsConfig:
    """Server certificate (PEM), and the CA that signs client certificates if they are checked."""

    cert_chain: bytes
    private_key: bytes = attrs.field(repr=False)
    client_ca: bytes | None = None
    require_client_cert: bool = False

    def __attrs_post_init__(self) -> None:
        if self.require_client_cert and not self.client_ca:
            raise ValueError("require_client_cert needs client_ca")

    @classmethod
    def from_files(
        cls,
        cert: Path | str,
        key: Path | str,
        client_ca: Path | str | None = None,
        *,
        require_client_cert: bool = False,
    ) -> TlsConfig:
        return cls(
            Path(cert).read_bytes(),
            Path(key).read_bytes(),
            Path(client_ca).read_bytes() if client_ca else None,
            require_client_cert=require_client_cert or client_ca is not None,
        )

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.require_client_cert,
        )


@attrs.frozen
class TcpAuth:
    """How calls on TCP addresses authenticate besides a verified client certificate:
    ``token`` (``authorization: Bearer TOKEN`` metadata), or ``insecure`` (nothing: tests
    on loopback only). Unix sockets are not concerned (file mode and peer credentials)."""

    token: bytes | None = attrs.field(default=None, repr=False)
    insecure: bool = False

    def __attrs_post_init__(self) -> None:
        if self.token is not None and not MIN_TOKEN <= len(self.token) <= MAX_TOKEN:
            raise ValueError(f"a bearer token is {MIN_TOKEN} to {MAX_TOKEN} characters")
        if self.token is not None and not all(0x21 <= b <= 0x7E for b in self.token):
            raise ValueError("a bearer token is printable ASCII without spaces")
        if self.token is not None and self.insecure:
            raise ValueError("--grpc-insecure and --grpc-token-file contradict each other: give one")


NO_TCP_AUTH = (
    "give --grpc-token-file FILE (bearer token) or --grpc-cert, --grpc-key and --grpc-client-ca (mTLS); "
    "--grpc-insecure only for tests on loopback"
)


def check_tcp_auth(addresses: Iterable[Address], auth: TcpAuth | None) -> None:
    """Every TCP address authenticates its clients (ValueError naming the flags otherwise)."""
    auth = auth or TcpAuth()
    for a in addresses:
        if not isinstance(a, TcpAddress):
            continue
        if auth.insecure and not _is_loopback(a.host):
            raise ValueError(f"gRPC on {a}: --grpc-insecure is for loopback addresses only")
        if not (auth.token or auth.insecure or (a.tls is not None and a.tls.require_client_cert)):
            raise ValueError(f"gRPC on {a} would let any client in: {NO_TCP_AUTH}")


def read_token_file(path: Path | str) -> bytes:
    """The bearer token in ``path``: a regular file of ours, not a symlink, mode 0600 or
    stricter; its one line (surrounding whitespace dropped). Read once, at start."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"--grpc-token-file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ValueError(
                f"--grpc-token-file {path}: must be a regular file owned by uid {os.geteuid()}, "
                f"mode 0600 or stricter (it is {stat.filemode(st.st_mode)}, uid {st.st_uid})"
            )
        token = f.read(MAX_TOKEN + 2).strip()
    try:
        return TcpAuth(token=token).token or b""
    except ValueError as exc:
        raise ValueError(f"--grpc-token-file {path}: {exc}") from None


class PeerPolicy(Protocol):
    """Who may use a Unix socket, by the peer credentials the kernel recorded at connect."""

    def check(self, sock: Any) -> str | None:
        """None to serve the connection on ``sock`` (a connected AF_UNIX socket), else why not."""

    def served(self) -> str:
        """Who is served, as a refused client is told."""


@attrs.frozen
class UnixAddress:
    """A Unix socket, 0600 (the daemon's user only) or 0660 with ``group``; with a
    ``policy``, every connection's peer credentials are checked too (a relay)."""

    path: Path
    group: str | None = None
    policy: PeerPolicy | None = attrs.field(default=None, eq=False, repr=False)

    def __str__(self) -> str:
        return f"unix://{self.path}"


@attrs.frozen
class TcpAddress:
    """HOST:PORT (port 0: any). Plaintext only on loopback; the edge's :class:`TcpAuth` or a
    client CA authenticates its callers (check_tcp_auth)."""

    host: str
    port: int
    tls: TlsConfig | None = None

    def __attrs_post_init__(self) -> None:
        if self.tls is None and not _is_loopback(self.host):
            raise ValueError(f"gRPC on {self.host}:{self.port} needs TLS (plaintext is for loopback only)")

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return self.target


Address = UnixAddress | TcpAddress


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_address(spec: str, *, tls: TlsConfig | None = None, group: str | None = None) -> Address:
    """``unix:///run/x.sock`` (or ``unix:/run/x.sock``) or ``HOST:PORT`` / ``[V6]:PORT``."""
    if spec.startswith("unix:"):
        rest = spec[len("unix:") :]
        if rest.startswith("//"):
            rest = rest[2:]
        if not rest.startswith("/"):
            raise ValueError(f"unix socket path must be absolute: {spec!r}")
        return UnixAddress(Path(rest), group=group)
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected unix:///PATH or HOST:PORT, got {spec!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return TcpAddress(host, int(port), tls)


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
        self.auth: Mapping[str, Sequence[bytes]] = (
            {} if self.peer.startswith("unix:") else {k: list(v) for k, v in context.auth_context().items()}
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
        self._gate = _TcpGate(self) if tcp else None  # Unix-only edges pay nothing
        self._mtls = any(a.tls is not None and a.tls.require_client_cert for a in tcp)
        self.unauthenticated = 0  # TCP calls refused UNAUTHENTICATED
        self._refusal_logged = -math.inf
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
        self.calls_started = 0
        self.refused = 0  # connections refused by a peer policy

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
                        listener, ino = await _listen_public(addr, private)
                        public.append((addr.path, ino))
                        nursery.start_soon(self._accept, listener, addr, private)
                    task_status.started(self)
                    await trio.sleep_forever()
            finally:
                self._request_stop()  # the thread task ends when the loop has; the nursery waits for it
                nursery.cancel_scope.cancel()
                for path, ino in public:
                    _unlink_if_ours(path, ino)
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
                    private = _private_dir(addr.path)
                    self._relays.append((addr, private))
                    if server.add_insecure_port(f"unix:{private / 'grpc.sock'}") == 0:
                        raise OSError(f"cannot listen on {private / 'grpc.sock'}")
                    refuser = grpc.aio.server(options=self.options, maximum_concurrent_rpcs=64)
                    refuser.add_generic_rpc_handlers((_Refuser(addr.policy.served()),))
                    if refuser.add_insecure_port(f"unix:{private / 'refused.sock'}") == 0:
                        raise OSError(f"cannot listen on {private / 'refused.sock'}")
                    refusers.append(refuser)
                    await refuser.start()
                    self.addresses.append(addr)
                elif isinstance(addr, UnixAddress):
                    bound.append((addr, _bind_unix(server, addr)))
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
                _unlink_if_ours(addr.path, ino)
            for _, private in self._relays:
                shutil.rmtree(private, ignore_errors=True)

    def _tcp_refusal(self, context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        """None if the call may go on: over a Unix socket (mode and peer credentials
        decided), ``insecure``, a client certificate the handshake verified, or the token."""
        if context.peer().startswith("unix:"):
            return None
        auth = self.tcp_auth
        if auth.insecure:
            return None
        if self._mtls and context.auth_context().get("x509_pem_cert"):
            return None  # only a verifying address asks for a certificate: one present was verified
        if auth.token is not None:
            for key, value in context.invocation_metadata() or ():
                if key == "authorization":
                    got = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
                    if hmac.compare_digest(got, b"Bearer " + auth.token):
                        return None
                    break
        return UNAUTHENTICATED

    async def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """The gate of every call (health and reflection too): UNAUTHENTICATED, or on."""
        why = self._tcp_refusal(context)
        if why is None:
            return
        self.unauthenticated += 1
        now = time.monotonic()
        if now - self._refusal_logged >= 1.0:  # one line a second at most: refusals are cheap to cause
            self._refusal_logged = now
            log.warning("gRPC: unauthenticated call from %s refused (%d so far)", context.peer(), self.unauthenticated)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

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

    # -- the relay of a Unix address with a peer policy (Trio) ---------------------------------
    async def _accept(self, listener: trio.SocketListener, addr: UnixAddress, private: Path) -> None:
        async with listener, trio.open_nursery() as nursery:
            while True:
                stream = await listener.accept()
                nursery.start_soon(self._relay, stream, addr, private)

    async def _relay(self, stream: trio.SocketStream, addr: UnixAddress, private: Path) -> None:
        assert addr.policy is not None
        try:
            why = addr.policy.check(stream.socket)
        except OSError as exc:
            why = f"peer credentials unavailable: {exc}"
        if why is not None:
            self.refused += 1
            log.warning("gRPC on %s: refused: %s", addr.path, why)
        async with stream:
            try:
                upstream = await trio.open_unix_socket(str(private / ("refused.sock" if why else "grpc.sock")))
            except OSError:
                return
            async with upstream:
                with trio.move_on_after(REFUSED_LINGER if why else math.inf):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_pipe, stream, upstream, nursery.cancel_scope)
                        nursery.start_soon(_pipe, upstream, stream, nursery.cancel_scope)

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


class _TcpGate(grpc.aio.ServerInterceptor):
    """Every method's behaviour behind the edge's :meth:`GrpcEdge._authenticate` (an aio
    interceptor cannot see the peer or the TLS session, the behaviour's context can)."""

    def __init__(self, edge: GrpcEdge) -> None:
        self.edge = edge

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # unknown method: grpc answers UNIMPLEMENTED
        return _gated(handler, self.edge._authenticate)


def _gated(
    handler: grpc.RpcMethodHandler[Any, Any], gate: Callable[[Any], Awaitable[None]]
) -> grpc.RpcMethodHandler[Any, Any]:
    def wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):  # a streaming response as an async generator

            async def agen(arg: Any, context: Any) -> AsyncIterator[Any]:
                await gate(context)
                async for item in behavior(arg, context):
                    yield item

            return agen

        async def call(arg: Any, context: Any) -> Any:
            await gate(context)
            result = behavior(arg, context)
            return await result if inspect.isawaitable(result) else result

        return call

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), des, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), des, ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), des, ser)
    assert handler.stream_stream is not None
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), des, ser)


class _Refuser(grpc.GenericRpcHandler):
    """Every method, for a peer the policy refused: PERMISSION_DENIED, saying who is served."""

    def __init__(self, served: str) -> None:
        self.served = served

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        served = self.served

        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, served)

        return grpc.unary_unary_rpc_method_handler(refuse)


async def _pipe(src: trio.SocketStream, dst: trio.SocketStream, done: trio.CancelScope) -> None:
    """Bytes from ``src`` to ``dst`` until either end goes; then the relay ends."""
    try:
        while data := await src.receive_some(RELAY_CHUNK):
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        done.cancel()


# ---------------------------------------------------------------------------------------
# Unix sockets born with their mode
# ---------------------------------------------------------------------------------------
def _private_dir(path: Path) -> Path:
    """A fresh 0700 directory beside ``path`` (the same file system: a rename into place works)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".grpc-", dir=path.parent))


async def _listen_public(addr: UnixAddress, private: Path) -> tuple[trio.SocketListener, int]:
    """The relay's public socket, bound with its mode and group in ``private`` and renamed
    into place; the listener and the socket's inode."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = private / "public.sock"
    old = os.umask(0o177)  # born 0600
    try:
        await sock.bind(str(tmp))
    finally:
        os.umask(old)
    if addr.group:
        os.chown(tmp, -1, grp.getgrnam(addr.group).gr_gid)
        os.chmod(tmp, 0o660)
    sock.listen(128)
    os.replace(tmp, addr.path)
    return trio.SocketListener(sock), addr.path.stat().st_ino


def _bind_unix(server: grpc.aio.Server, addr: UnixAddress) -> int:
    """Bind ``addr`` with its final mode and group before anyone can reach it: grpc binds in a
    fresh 0700 directory beside the path, then the socket is renamed into place (a Unix
    socket is reached through its inode; the rename keeps it). Returns the inode."""
    path = addr.path
    private = _private_dir(path)
    tmp = private / "s"
    try:
        if server.add_insecure_port(f"unix:{tmp}") == 0:
            raise OSError(f"cannot listen on {path}")
        if addr.group:
            os.chown(tmp, -1, grp.getgrnam(addr.group).gr_gid)
            os.chmod(tmp, 0o660)
        else:
            os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return path.stat().st_ino
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
        with contextlib.suppress(OSError):
            private.rmdir()


def _unlink_if_ours(path: Path, ino: int) -> None:
    """Remove the socket unless another server has put its own there since."""
    try:
        if path.lstat().st_ino == ino:
            path.unlink()
    except FileNotFoundError:
        pass
