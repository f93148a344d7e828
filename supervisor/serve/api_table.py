"""What a method of the table is: its call's streams as a handler sees them
(:class:`CallIO`), its entry (:class:`Method`), and the tables the handler modules
declare theirs in (:class:`Table`: ``@table.method(name, request)``), which
:mod:`supervisor.serve.api` joins into the one table both edges serve; and what their handlers
share (:func:`stopped`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs
import trio

from actors.face import DeadlineExceeded, InvalidArgument

if TYPE_CHECKING:
    from actors.face import Principal, Registry, Sandbox
    from supervisor.wire import protocol


class CallIO(Protocol):
    """A call's streams as a handler sees them, whatever the wire, and who makes it."""

    @property
    def principal(self) -> Principal:
        """Who makes the call (the edge decided: peer credentials, certificate, token, act_as)."""

    async def send(self, message: Any) -> None:
        """One message of a server stream (an attrs value of the method's response class)."""

    async def receive(self) -> Any | None:
        """The client stream's next message (an attrs value), or None once the client half-closed."""


R = TypeVar("R")
Handler = Callable[["Registry", CallIO, Any], Awaitable[Any]]
Typed = Callable[["Registry", CallIO, R], Awaitable[Any]]  # a handler of requests of class R


@attrs.frozen
class Method:
    """One method of the table: its request class and shape, and its handler."""

    name: str
    request: type  # the request (of a client stream: its first message)
    handler: Handler
    streams: bool = False  # a server stream (items, then the end); else one response
    inputs: type | None = None  # a client stream: the class of every later message


class Table:
    """The methods one module declares, by name."""

    def __init__(self) -> None:
        self.methods: dict[str, Method] = {}

    def method(
        self, name: str, request: type[R], *, streams: bool = False, inputs: type | None = None
    ) -> Callable[[Callable[[Registry, CallIO, R], Awaitable[Any]]], Callable[[Registry, CallIO, R], Awaitable[Any]]]:
        def wrap(
            fn: Callable[[Registry, CallIO, R], Awaitable[Any]],
        ) -> Callable[[Registry, CallIO, R], Awaitable[Any]]:
            if name in self.methods:
                raise ValueError(f"method {name} defined twice")
            self.methods[name] = Method(name, request, fn, streams, inputs)
            return fn

        return wrap


async def stopped(sb: Sandbox, within: float) -> None:
    """Until ``sb`` stopped; a VM that did not in ``within`` seconds is DEADLINE_EXCEEDED
    (the stop goes on: it was asked, and it may still end)."""
    with trio.move_on_after(within):
        await sb.wait_stopped()
        return
    raise DeadlineExceeded(f"sandbox {sb.id} did not stop within {within:g}s (it is {sb.state.value})")


def joined(*tables: Table) -> dict[str, Method]:
    """The tables as one; a name declared in two is an error."""
    out: dict[str, Method] = {}
    for t in tables:
        if twice := out.keys() & t.methods.keys():
            raise ValueError(f"methods defined twice: {sorted(twice)}")
        out.update(t.methods)
    return out


class ExecInput(Protocol):
    """The process side of an exec that a client's ExecInput frames feed."""

    async def send_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    async def resize(self, rows: int, cols: int) -> None: ...


async def feed(h: ExecInput, msg: protocol.ExecInput, *, tty: bool) -> None:
    """One ExecInput frame (after the first) to its process: stdin, a resize (a terminal's
    only), the end of stdin. Exec and an attached detachable session read them alike."""
    if msg.init is not None:
        raise InvalidArgument("init is the first ExecInput's only")
    if msg.stdin is not None:
        await h.send_stdin(msg.stdin)
    if msg.resize is not None:
        if not tty:
            raise InvalidArgument("resize needs tty")
        await h.resize(msg.resize.height, msg.resize.width)
    if msg.close_stdin:
        await h.close_stdin()
