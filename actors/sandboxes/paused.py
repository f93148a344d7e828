"""What a paused sandbox holds (the sequence is actors/hibernation.py's): the
listeners of its host ports, kept bound while it is paused and handed to its next
life's relays; a tap sandbox's TAP, whose queue keeps what comes for the guest; and
whether a pause is under way (a call needing the guest waits for it, then resumes)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from actors.model import PortSpec, Protocol
from actors.net.hostnet import SandboxLink


class PauseHold:
    """One per sandbox, across lives: what it holds while paused."""

    def __init__(self) -> None:
        self.ports: dict[tuple[int, Protocol], socket.socket] = {}
        self.link: SandboxLink | None = None  # a paused tap sandbox's TAP (its queue)
        self.under_way = False  # a pause is under way

    @contextmanager
    def pausing(self) -> Iterator[None]:
        """While the block runs a pause is under way: a call needing the guest waits for
        it, then resumes the sandbox (Sandbox.awake)."""
        self.under_way = True
        try:
            yield
        finally:
            self.under_way = False

    def hold_port(self, key: tuple[int, Protocol], sock: socket.socket) -> None:
        """Keep the listener of a paused sandbox's host port (its next life relays it)."""
        self.ports[key] = sock

    def let_go(self) -> tuple[dict[tuple[int, Protocol], socket.socket], SandboxLink | None]:
        """Everything held while paused (listeners, TAP), no longer held: the caller's to close."""
        ports, self.ports = self.ports, {}
        link, self.link = self.link, None
        return ports, link

    def take_port(self, pm: PortSpec) -> socket.socket | None:
        """The listener of ``pm``'s host port held while it was paused, handed to the
        resumed life's relay (None: the life binds its own)."""
        return self.ports.pop(pm.key, None)

    def hold_link(self, link: SandboxLink | None) -> None:
        """Keep a paused tap sandbox's TAP (its queue holds what comes for the guest)."""
        self.link = link

    def take_link(self) -> SandboxLink | None:
        """The TAP held while it was paused, for the resumed life (None: it opens one)."""
        link, self.link = self.link, None
        return link if link is not None and not link.closed else None
