"""Detach keys: the key sequence that leaves an attached session running (docker's
syntax: ``ctrl-p,ctrl-q``, ``ctrl-]``, ``q``), found in a terminal's input stream."""

from __future__ import annotations

from supervisor.wire import protocol
from supervisor.wire.errors import InvalidArgument

DEFAULT_DETACH_KEYS = "ctrl-p,ctrl-q"
_CTRL_PUNCT = {"@": 0, "[": 0x1B, "\\": 0x1C, "]": 0x1D, "^": 0x1E, "_": 0x1F}


class Detached(Exception):
    """The client detached from session ``session_id``: its process runs on
    (``sandvisor attach NAME SESSION``, ``sb.attach_session(session_id)``)."""

    def __init__(self, session_id: int) -> None:
        super().__init__(f"detached from session {session_id}")
        self.session_id = session_id


def parse_detach_keys(keys: str) -> bytes:
    """``ctrl-p,ctrl-q`` -> b"\\x10\\x11"; a single character stands for itself."""
    out = bytearray()
    for part in keys.split(","):
        p = part.strip()
        if p.lower().startswith("ctrl-") and len(p) == 6:
            c = p[5]
            if c.isalpha():
                out.append(ord(c.upper()) & 0x1F)
                continue
            if c in _CTRL_PUNCT:
                out.append(_CTRL_PUNCT[c])
                continue
        elif len(p) == 1 and p.isprintable():
            out += p.encode()
            continue
        usage = "ctrl-<letter or one of @[\\]^_>, or a character; comma-separated"
        raise InvalidArgument(protocol.INVALID_ARGUMENT, f"detach keys {keys!r}: {usage}")
    return bytes(out)


class DetachMatcher:
    """Scans input for the sequence: bytes that could start it are held back until it
    completes (a detach) or fails (they go on, in order)."""

    def __init__(self, seq: bytes) -> None:
        self.seq = seq
        self.held = b""

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        """(what to send on, whether the sequence completed: then the rest is dropped)."""
        if not self.seq:
            return data, False
        out = bytearray()
        for b in data:
            self.held += bytes([b])
            if self.held == self.seq:
                self.held = b""
                return bytes(out), True
            if not self.seq.startswith(self.held):
                while self.held and not self.seq.startswith(self.held):
                    out.append(self.held[0])
                    self.held = self.held[1:]
        return bytes(out), False
