"""Where the gRPC edge listens: Unix sockets and TCP addresses, parsed from the command line.

A :class:`UnixAddress` is a socket of mode 0600 (or 0660 with a group), with an optional
:class:`PeerPolicy` checked on every connection (:mod:`supervisor.serve.grpc_unix`); a
:class:`TcpAddress` is plaintext on loopback only, TLS (:class:`TlsConfig`) elsewhere, and
its callers authenticate (:mod:`supervisor.serve.grpc_auth`).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Protocol

import attrs

from actors.face import Principal

# isort: split
# grpc's fork support off before grpc is imported (see the module): first, always
import supervisor.wire.grpc_env  # noqa: F401

# isort: split
import grpc


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


class PeerPolicy(Protocol):
    """Who may use a Unix socket, by the peer credentials the kernel recorded at connect."""

    def check(self, sock: Any) -> str | None:
        """None to serve the connection on ``sock`` (a connected AF_UNIX socket), else why not."""

    def served(self) -> str:
        """Who is served, as a refused client is told."""

    def principal(self, sock: Any) -> Principal:
        """The principal of a served connection (its peer credentials: ``uid:N``)."""


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
        if self.tls is None and not is_loopback(self.host):
            raise ValueError(f"gRPC on {self.host}:{self.port} needs TLS (plaintext is for loopback only)")

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return self.target


Address = UnixAddress | TcpAddress


def is_loopback(host: str) -> bool:
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
