"""Who may call the gRPC edge over TCP: a verified client certificate or the bearer token.

TCP addresses authenticate every call (:class:`TcpAuth`): a client certificate the TLS
handshake verified (``client_ca``), or the bearer token (``authorization: Bearer TOKEN``
metadata, compared in constant time); else the call ends UNAUTHENTICATED before any
handler (health and reflection too) sees it (:class:`TcpGate`, the server's interceptor).
An edge with a TCP address and neither refuses to start (:func:`check_tcp_auth`);
``TcpAuth(insecure=True)`` (tests, loopback only) lets any caller in. Unix sockets are
not concerned: their file mode and peer credentials decide (:mod:`supervisor.serve.grpc_unix`).

Each call's principal (:func:`call_principal`, docs/security.md): ``cert:<CN>`` for a
verified client certificate (an admin when its CN is one of ``admin_cns``, or when no
``--grpc-admin-cert-cn`` is given: then every certificate of the operator's CA is the
operator's), ``token:<label>`` for a token (the token file's lines are ``TOKEN [LABEL
[admin]]``; a token without a label is the operator's own: ``token:operator``, an
admin), ``uid:N`` on a Unix socket (the relay's peer credentials).
"""

from __future__ import annotations

import hmac
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from actors.face import Principal, check_principal_name

# isort: split
import supervisor.wire.grpc_env  # noqa: F401  grpc's fork support off before grpc is imported: first, always

# isort: split
import grpc
import grpc.aio

from supervisor.serve.grpc_addresses import Address, TcpAddress, is_loopback
from supervisor.serve.tokens import check_token, read_private, read_token_file

__all__ = [
    "NO_TCP_AUTH",
    "UNAUTHENTICATED",
    "TcpAuth",
    "TcpGate",
    "Token",
    "check_tcp_auth",
    "read_grpc_tokens",
    "read_token_file",
]

log = logging.getLogger("sandvisor.grpc")

UNAUTHENTICATED = (
    "this address needs client authentication: a client certificate (serve --grpc-client-ca) "
    "or metadata 'authorization: Bearer TOKEN' (serve --grpc-token-file)"
)


OPERATOR = "operator"  # the label of a token given without one (the operator's own: an admin)


@attrs.frozen
class Token:
    """A bearer token and the principal it stands for (``token:<label>``)."""

    secret: bytes = attrs.field(repr=False)
    label: str = OPERATOR
    admin: bool = True

    def __attrs_post_init__(self) -> None:
        check_token(self.secret)
        bad = check_principal_name(f"token:{self.label}")
        if bad is not None:
            raise ValueError(f"token label {self.label[:40]!r}: {bad}")

    @property
    def principal(self) -> Principal:
        return Principal(f"token:{self.label}", self.admin)


@attrs.frozen
class TcpAuth:
    """How calls on TCP addresses authenticate besides a verified client certificate:
    ``token`` (``authorization: Bearer TOKEN`` metadata: the operator's, an admin),
    ``tokens`` (each with its principal), or ``insecure`` (nothing: tests on loopback
    only; such callers are admins). ``admin_cns``: the client certificates' common names
    that are admins (None: every verified certificate). Unix sockets are not concerned
    (file mode and peer credentials)."""

    token: bytes | None = attrs.field(default=None, repr=False)
    insecure: bool = False
    tokens: tuple[Token, ...] = ()
    admin_cns: frozenset[str] | None = None

    def __attrs_post_init__(self) -> None:
        if self.token is not None:
            check_token(self.token)
        if (self.token is not None or self.tokens) and self.insecure:
            raise ValueError("--grpc-insecure and --grpc-token-file contradict each other: give one")
        labels = [t.label for t in self.all_tokens]
        if len(set(labels)) != len(labels):
            raise ValueError("each token of --grpc-token-file has its own label")
        secrets = [t.secret for t in self.all_tokens]
        if len(set(secrets)) != len(secrets):
            raise ValueError("a token is given twice in --grpc-token-file")

    @property
    def all_tokens(self) -> tuple[Token, ...]:
        return (*((Token(self.token),) if self.token is not None else ()), *self.tokens)

    def bearer(self, value: bytes) -> Token | None:
        """The token an ``authorization`` value presents (each compared in constant time)."""
        found = None
        for t in self.all_tokens:  # every one compared: no early exit to time
            if hmac.compare_digest(value, b"Bearer " + t.secret):
                found = t
        return found

    def cert_principal(self, cn: str) -> Principal:
        return Principal(f"cert:{cn}", self.admin_cns is None or cn in self.admin_cns)


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
        if not (auth.all_tokens or auth.insecure or (a.tls is not None and a.tls.require_client_cert)):
            raise ValueError(f"gRPC on {a} would let any client in: {NO_TCP_AUTH}")


def read_grpc_tokens(path: Path | str) -> tuple[Token, ...]:
    """The bearer tokens in ``path``: a regular file of ours, not a symlink, mode 0600 or
    stricter. Each line is ``TOKEN [LABEL [admin]]`` (blank lines and ``#`` comments
    skipped): a token without a label is the operator's (``token:operator``, an admin),
    one with a label is ``token:LABEL``, an admin only when the line says ``admin``.
    Read once, at start."""
    text = read_private(path, "--grpc-token-file", 1 << 20)
    tokens: list[Token] = []
    try:
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith(b"#"):
                continue
            if len(fields) > 3 or (len(fields) == 3 and fields[2] != b"admin"):
                raise ValueError(f"line {n}: expected TOKEN [LABEL [admin]]")
            if len(fields) == 1:
                tokens.append(Token(fields[0]))
            else:
                tokens.append(Token(fields[0], fields[1].decode("ascii", "replace"), len(fields) == 3))
        if not tokens:
            raise ValueError("no token in it")
        TcpAuth(tokens=tuple(tokens))  # (labels and tokens each once)
    except ValueError as exc:
        raise ValueError(f"--grpc-token-file {path}: {exc}") from None
    return tuple(tokens)


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
        if context.peer().startswith(("unix:", "unix-abstract:")):
            return None
        auth = self.auth
        if auth.insecure:
            return None
        if self.mtls and context.auth_context().get("x509_pem_cert"):
            return None  # only a verifying address asks for a certificate: one present was verified
        if auth.all_tokens:
            for key, value in context.invocation_metadata() or ():
                if key == "authorization":
                    got = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
                    if auth.bearer(got) is not None:
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
