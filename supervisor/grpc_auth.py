"""Who may call the gRPC edge over TCP: a verified client certificate or the bearer token.

TCP addresses authenticate every call (:class:`TcpAuth`): a client certificate the TLS
handshake verified (``client_ca``), or the bearer token (``authorization: Bearer TOKEN``
metadata, compared in constant time); else the call ends UNAUTHENTICATED before any
handler (health and reflection too) sees it (:class:`TcpGate`, the server's interceptor).
An edge with a TCP address and neither refuses to start (:func:`check_tcp_auth`);
``TcpAuth(insecure=True)`` (tests, loopback only) lets any caller in. Unix sockets are
not concerned: their file mode and peer credentials decide (:mod:`supervisor.grpc_unix`).
"""

from __future__ import annotations

import hmac
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import attrs

# isort: split
import supervisor.grpc_env  # noqa: F401  grpc's fork support off before grpc is imported: first, always

# isort: split
import grpc
import grpc.aio

from supervisor.grpc_addresses import Address, TcpAddress, is_loopback
from supervisor.tokens import check_token, read_token_file

__all__ = ["NO_TCP_AUTH", "UNAUTHENTICATED", "TcpAuth", "TcpGate", "check_tcp_auth", "read_token_file"]

log = logging.getLogger("sandvisor.grpc")

UNAUTHENTICATED = (
    "this address needs client authentication: a client certificate (serve --grpc-client-ca) "
    "or metadata 'authorization: Bearer TOKEN' (serve --grpc-token-file)"
)


@attrs.frozen
class TcpAuth:
    """How calls on TCP addresses authenticate besides a verified client certificate:
    ``token`` (``authorization: Bearer TOKEN`` metadata), or ``insecure`` (nothing: tests
    on loopback only). Unix sockets are not concerned (file mode and peer credentials)."""

    token: bytes | None = attrs.field(default=None, repr=False)
    insecure: bool = False

    def __attrs_post_init__(self) -> None:
        if self.token is not None:
            check_token(self.token)
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
        if auth.insecure and not is_loopback(a.host):
            raise ValueError(f"gRPC on {a}: --grpc-insecure is for loopback addresses only")
        if not (auth.token or auth.insecure or (a.tls is not None and a.tls.require_client_cert)):
            raise ValueError(f"gRPC on {a} would let any client in: {NO_TCP_AUTH}")


class TcpGate(grpc.aio.ServerInterceptor):
    """Every method's behaviour behind :meth:`authenticate` (an aio interceptor cannot see
    the peer or the TLS session, the behaviour's context can). ``mtls``: some address
    verifies client certificates."""

    def __init__(self, auth: TcpAuth, *, mtls: bool) -> None:
        self.auth = auth
        self.mtls = mtls
        self.unauthenticated = 0  # TCP calls refused UNAUTHENTICATED
        self._refusal_logged = -math.inf

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # unknown method: grpc answers UNIMPLEMENTED
        return _gated(handler, self.authenticate)

    def refusal(self, context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        """None if the call may go on: over a Unix socket (mode and peer credentials
        decided), ``insecure``, a client certificate the handshake verified, or the token."""
        if context.peer().startswith("unix:"):
            return None
        auth = self.auth
        if auth.insecure:
            return None
        if self.mtls and context.auth_context().get("x509_pem_cert"):
            return None  # only a verifying address asks for a certificate: one present was verified
        if auth.token is not None:
            for key, value in context.invocation_metadata() or ():
                if key == "authorization":
                    got = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
                    if hmac.compare_digest(got, b"Bearer " + auth.token):
                        return None
                    break
        return UNAUTHENTICATED

    async def authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """The gate of every call (health and reflection too): UNAUTHENTICATED, or on."""
        why = self.refusal(context)
        if why is None:
            return
        self.unauthenticated += 1
        now = time.monotonic()
        if now - self._refusal_logged >= 1.0:  # one line a second at most: refusals are cheap to cause
            self._refusal_logged = now
            log.warning("gRPC: unauthenticated call from %s refused (%d so far)", context.peer(), self.unauthenticated)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)


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
