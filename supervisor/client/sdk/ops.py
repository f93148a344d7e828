"""The SDK's effects: what an operation asks its driver for, and the method table's descriptors.

Every SDK operation is written once, in the ``*_plans`` modules, as a *plan*: a
plain generator that knows no I/O. It builds the wire's typed requests, yields one
effect at a time (a unary call, open a call, the next item of it, send on it, ...),
gets the typed answer back (or the error thrown in at the ``yield``), interprets
it, and returns the operation's result. Two small drivers run plans::

    plan --Unary/Open/Receive/Send/Finish/...--> driver --frames--> supervisor
         <--------- typed reply / item / raise ---'
    AsyncSandbox: supervisor.client.sdk.aio   (Trio, frames.FramedStream)
    Sandbox:      supervisor.client.sdk.sync  (a blocking socket, frames.BlockingConnection;
                                        no event loop, no thread)

A plan that *streams* to its caller yields :class:`Emit` values: the Trio driver
makes it an async generator, the blocking one an iterator. Each call of a public
method runs its plan on a connection of its own (its calls multiplexed on it), closed
when the plan ends.

The public classes are declared once, as tables of descriptors over plans
(:class:`op`, :class:`stream`, :class:`class_op`, :class:`maker`); a descriptor bound
to an :class:`AsyncDriven` gives a coroutine function, to a :class:`SyncDriven` a
plain one, and the type checker sees both signatures (ParamSpec).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Coroutine, Generator, Iterator
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

import attrs

from supervisor.wire import protocol
from supervisor.wire.errors import error_for

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


# --- the effects --------------------------------------------------------------------------
@attrs.frozen
class Unary:
    """One call answered by one reply: ``request`` (a protocol class) sent, the reply
    structured into ``reply``. ``cleanup``: the plan is failing (maybe cancelled, maybe
    its connection is gone): run on a fresh connection, shielded from cancellation."""

    method: str
    request: Any
    reply: type[Any]
    cleanup: bool = False


@attrs.frozen
class Open:
    """Open a streaming call: the driver's handle on it (opaque to the plan)."""

    method: str
    request: Any


@attrs.frozen
class Receive:
    """The call's next item structured into ``item``; None once it ended; :data:`TIMED_OUT`
    when ``deadline`` (the driver's clock, see :class:`Now`) passes first."""

    call: Any
    item: type[Any]
    deadline: float | None = None


@attrs.frozen
class Send:
    """One message (a protocol class) of a client-streaming call."""

    call: Any
    request: Any


@attrs.frozen
class Finish:
    """Half-close the call and wait for its reply, structured into ``reply``."""

    call: Any
    reply: type[Any]


@attrs.frozen
class Emit(Generic[T]):
    """A value for the caller of a streaming operation."""

    value: T


@attrs.frozen
class Blocking:
    """``fn(*args)``: host file work (the Trio driver runs it in a worker thread)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


@attrs.frozen
class Pull:
    """The next piece of a caller's iterable (sync or async), or None after the last."""

    source: Iterator[bytes] | AsyncIterable[bytes]


@attrs.frozen
class Now:
    """The driver's clock (seconds), for :class:`Receive` deadlines."""


@attrs.frozen
class Expired:
    """Raise the driver's timeout (trio.TooSlowError, as ``trio.fail_after``)."""


@attrs.frozen
class SendTree:
    """Pack the host directory ``fd`` (tar) onto the call, each chunk as ``wrap(chunk)``."""

    call: Any
    fd: int
    wrap: Callable[[bytes], Any]


@attrs.frozen
class ReceiveTree:
    """Unpack the call's FileChunk items (a tar stream) into the host directory ``fd``:
    the number of entries (see :func:`supervisor.client.treecopy.unpack_tree`)."""

    call: Any
    fd: int
    keep_ids: bool
    root_meta: bool


Op = Unary | Open | Receive | Send | Finish | Blocking | Pull | Now | Expired | SendTree | ReceiveTree
Plan = Generator[Op, Any, R]
StreamPlan = Generator[Op | Emit[T], Any, None]
TIMED_OUT: Any = object()  # what Receive gives at its deadline


def structure(body: dict[str, Any], cls: type[T], method: str) -> T:
    """A reply or item body as ``cls``; a body this SDK cannot read is INTERNAL."""
    try:
        return protocol.structure_body(body, cls)
    except protocol.ApiError as exc:  # the supervisor answered something this SDK does not read
        raise error_for(protocol.INTERNAL, f"unexpected answer to {method}: {exc.message}") from None


def tree_chunks_ended() -> protocol.ApiError:
    return protocol.ApiError(protocol.UNAVAILABLE, "the tree stream ended early")


@attrs.frozen
class Made:
    """What a constructor plan (create, get, restore) gives its driver: the handle to make."""

    id: str
    detached: bool


class Target(Protocol):
    """What a plan sees of its handle: the sandbox's id ("" for volumes and images)."""

    @property
    def id(self) -> str: ...


class Stepper:
    """Runs a plan one effect at a time: the drivers' shared loop. ``next()`` gives the
    next effect, or raises StopIteration with the plan's result; ``ok``/``fail`` answer."""

    def __init__(self, plan: Generator[Any, Any, Any]) -> None:
        self.plan = plan
        self._value: Any = None
        self._error: BaseException | None = None

    def next(self) -> Op | Emit[Any]:
        error, self._error = self._error, None
        value, self._value = self._value, None
        step: Op | Emit[Any] = self.plan.send(value) if error is None else self.plan.throw(error)
        return step

    def ok(self, value: Any) -> None:
        self._value = value

    def fail(self, error: BaseException) -> None:
        self._error = error


# --- the drivers' faces, and the descriptors of the method tables ----------------------------
class AsyncDriven:
    """A handle run by the Trio driver (:mod:`supervisor.client.sdk.aio`)."""

    socket: str | None

    @classmethod
    def _drive(cls, socket: str | None, plan: Plan[R]) -> Coroutine[Any, Any, R]:
        raise NotImplementedError

    @classmethod
    def _drive_stream(cls, socket: str | None, plan: StreamPlan[T]) -> AsyncGenerator[T, None]:
        raise NotImplementedError


class SyncDriven:
    """A handle run by the blocking driver (:mod:`supervisor.client.sdk.sync`)."""

    socket: str | None

    @classmethod
    def _drive(cls, socket: str | None, plan: Plan[R]) -> R:
        raise NotImplementedError

    @classmethod
    def _drive_stream(cls, socket: str | None, plan: StreamPlan[T]) -> Iterator[T]:
        raise NotImplementedError


A = TypeVar("A", bound=AsyncDriven)
S = TypeVar("S", bound=SyncDriven)


def _named(fn: Callable[..., Any], plan: Callable[..., Any]) -> Any:
    return functools.wraps(plan, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())(fn)


class op(Generic[P, R]):
    """A method of a handle: ``plan(handle, *args)`` on the handle's socket."""

    def __init__(self, plan: Callable[Concatenate[Any, P], Plan[R]]) -> None:
        self.plan = plan
        self.__doc__ = plan.__doc__

    @overload
    def __get__(self, obj: None, owner: Any) -> op[P, R]: ...
    @overload
    def __get__(self, obj: AsyncDriven, owner: Any) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __get__(self, obj: SyncDriven, owner: Any) -> Callable[P, R]: ...
    def __get__(self, obj: Any, owner: Any) -> Any:
        if obj is None:
            return self
        plan = self.plan
        return _named(lambda *a, **k: obj._drive(obj.socket, plan(obj, *a, **k)), plan)


class stream(Generic[P, T]):
    """A streaming method of a handle: an async generator (Trio) or an iterator (blocking)."""

    def __init__(self, plan: Callable[Concatenate[Any, P], StreamPlan[T]]) -> None:
        self.plan = plan
        self.__doc__ = plan.__doc__

    @overload
    def __get__(self, obj: None, owner: Any) -> stream[P, T]: ...
    @overload
    def __get__(self, obj: AsyncDriven, owner: Any) -> Callable[P, AsyncGenerator[T, None]]: ...
    @overload
    def __get__(self, obj: SyncDriven, owner: Any) -> Callable[P, Iterator[T]]: ...
    def __get__(self, obj: Any, owner: Any) -> Any:
        if obj is None:
            return self
        plan = self.plan
        return _named(lambda *a, **k: obj._drive_stream(obj.socket, plan(obj, *a, **k)), plan)


class class_op(Generic[P, R]):
    """A class method: ``plan(*args, socket=...)`` on that socket (default: the default one)."""

    def __init__(self, plan: Callable[P, Plan[R]]) -> None:
        self.plan = plan
        self.__doc__ = plan.__doc__

    @overload
    def __get__(self, obj: Any, owner: type[AsyncDriven]) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __get__(self, obj: Any, owner: type[SyncDriven]) -> Callable[P, R]: ...
    def __get__(self, obj: Any, owner: Any) -> Any:
        plan = self.plan
        return _named(lambda *a, **k: owner._drive(k.get("socket"), plan(*a, **k)), plan)


class maker(Generic[P]):
    """A class method that makes a handle of the class (create, get, restore)."""

    def __init__(self, plan: Callable[P, Plan[Made]]) -> None:
        self.plan = plan
        self.__doc__ = plan.__doc__

    @overload
    def __get__(self, obj: Any, owner: type[A]) -> Callable[P, Coroutine[Any, Any, A]]: ...
    @overload
    def __get__(self, obj: Any, owner: type[S]) -> Callable[P, S]: ...
    def __get__(self, obj: Any, owner: Any) -> Any:
        plan = self.plan
        return _named(lambda *a, **k: owner._make(k.get("socket"), plan(*a, **k)), plan)


# --- helpers of the plans ------------------------------------------------------------------
CHUNK = 1 << 20  # bytes of one file chunk a plan sends


def each(method: str, request: Any, item: type[Any]) -> StreamPlan[Any]:
    """A server stream's items, typed, to the caller."""
    call = yield Open(method, request)
    while (x := (yield Receive(call, item))) is not None:
        yield Emit(x)


def collect(method: str, request: Any, item: type[Any]) -> Plan[list[Any]]:
    """A (short) server stream's items, typed, as a list."""
    call = yield Open(method, request)
    out = []
    while (x := (yield Receive(call, item))) is not None:
        out.append(x)
    return out


def id_request(t: Target) -> protocol.IdRequest:
    return protocol.IdRequest(id=t.id)
