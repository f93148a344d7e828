"""The channel between the supervisor and a sandbox's confined secret proxy
(docs/secrets.md, "The proxy's cell"). Two socketpairs, both made by the supervisor:

``control`` (SOCK_STREAM): frames of a 4-byte big-endian length and a msgpack map.
    down: ``{"t": "config", "gen": N, "secrets": [[name, [hosts], placeholder, value|None,
           "headers"|"all"]],
           "ca": [cert PEM, key PEM], "upstream_ca": PEM}`` at start and after every
           change of the vault (a rotation, a removal, a store entry set)
    up:   ``{"t": "blocked", "secret": NAME, "host": SNI, "port": N}`` (frames of at most
           UP_MAX bytes; the supervisor believes none of it beyond a bounded event
           naming one of the sandbox's own secrets: :func:`blocked_event`)
``conns`` (SOCK_SEQPACKET): one message per accepted guest connection, the guest's
    socket and the upstream socket the supervisor opened (marked: judged by the sandbox's
    egress chain) as SCM_RIGHTS, with ``{"gen": N, "dst": [address, port], "err": why}``
    (no upstream socket: ``err`` says why; the proxy answers 502 or closes).

The proxy applies a connection only once it holds config ``gen``: a rotation made
before the guest's connection applies to it.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import msgpack

HEADER = struct.Struct("!I")
DOWN_MAX = 16 << 20  # a config: 64 secrets of at most 64 KiB, a CA, the upstream CAs
UP_MAX = 1024  # what the proxy may say in one frame
CONN_MAX = 512  # a connection's header
HOST = re.compile(r"[A-Za-z0-9*](?:[A-Za-z0-9_.*-]{0,252})")


class WireError(Exception):
    """A frame that breaks the protocol (its sender is broken or hostile)."""


def frame(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, max_bin_len=DOWN_MAX, max_str_len=DOWN_MAX)
    except Exception as exc:
        raise WireError(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(msg, dict):
        raise WireError("not a map")
    return msg


class Frames:
    """Incremental reader of frames (no frame longer than ``limit``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buf += data
        out = []
        while len(self.buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf)
            if n > self.limit:
                raise WireError(f"a frame of {n} bytes (at most {self.limit})")
            if len(self.buf) < HEADER.size + n:
                break
            body = bytes(self.buf[HEADER.size : HEADER.size + n])
            del self.buf[: HEADER.size + n]
            out.append(unpack(body))
        return out


def blocked_event(msg: dict[str, Any], names: set[str]) -> tuple[str, str, int] | None:
    """(secret, host, port) of a proxy's ``blocked`` report if it is one the supervisor
    may repeat: a secret of this sandbox, a host name's characters and length, a port.
    Else None (dropped)."""
    secret, host, port = msg.get("secret"), msg.get("host"), msg.get("port")
    if msg.get("t") != "blocked" or not isinstance(secret, str) or secret not in names:
        return None
    if not isinstance(host, str) or not HOST.fullmatch(host):
        return None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    return secret, host, port
