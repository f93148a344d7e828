"""The blocking SDK: :class:`Sandbox` and friends, the same surface as the Trio one.

The methods are the plans of :mod:`supervisor.client.sdk.plans`, run by the driver here on
a plain blocking socket (:class:`supervisor.wire.frames.BlockingConnection`, its calls
multiplexed by id): no event loop, no thread, not even for streams (an iterator
reads its items off the socket as the caller asks for them) or tree copies (the tar
codec's callbacks send or read the socket directly). This module does not import
trio (only ``attach``/``shell``, which bridge a terminal, run the Trio SDK's).
"""

from __future__ import annotations

import builtins
import contextlib
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, Unpack

from supervisor.client.sdk import plans, sandbox_plans, snapshot_plans
from supervisor.client.sdk.acting import hello_fields
from supervisor.client.sdk.detach import DEFAULT_DETACH_KEYS, Detached
from supervisor.client.sdk.ops import (
    TIMED_OUT,
    Blocking,
    Emit,
    Expired,
    Finish,
    Made,
    Now,
    Op,
    Open,
    Plan,
    Pull,
    Receive,
    ReceiveTree,
    Send,
    SendTree,
    Stepper,
    StreamPlan,
    SyncDriven,
    Unary,
    structure,
    tree_chunks_ended,
)
from supervisor.client.sdk.spec import Output, RunSettings
from supervisor.wire import protocol
from supervisor.wire.config import UnsafeRuntimeDir, check_runtime_dir, default_socket
from supervisor.wire.errors import SandboxError, error_for
from supervisor.wire.frames import FAIL, ITEM, REPLY, BlockingConnection

T = TypeVar("T")
R = TypeVar("R")
H = TypeVar("H", bound="Sandbox")


def open_connection(socket: str | Path | None, *, act_as: str = "", act_as_admin: bool = False) -> BlockingConnection:
    """A connection to the supervisor at ``socket`` (None: the default one, whose
    runtime directory must be safe, as :func:`supervisor.client.sdk.aio.connect` checks).
    ``act_as``: an admin's connection acting for that principal; without it, the
    context's (:func:`supervisor.client.sdk.acting.acting_as`)."""
    act_as, act_as_admin = hello_fields(act_as, act_as_admin)
    default = default_socket()
    path = default if socket is None else Path(socket)
    if path == default:
        try:
            check_runtime_dir(path)
        except UnsafeRuntimeDir as exc:
            raise error_for(protocol.FAILED_PRECONDITION, str(exc)) from None
    return BlockingConnection.open(path, client="sandvisor-client", act_as=act_as, act_as_admin=act_as_admin)


class Call:
    """One call on a :class:`BlockingConnection`: its items, messages and reply."""

    def __init__(self, conn: BlockingConnection, method: str, body: dict[str, Any]) -> None:
        self.conn = conn
        self.method = method
        self.id = conn.start(method, body)
        self.done = False
        self.reply: dict[str, Any] = {}

    def next(self, deadline: float | None = None) -> dict[str, Any] | None:
        """The next item's body; None after the last (a reply is kept in ``reply``);
        TimeoutError at ``deadline`` (time.monotonic)."""
        if self.done:
            return None
        msg = self.conn.next(self.id, deadline)
        if msg["t"] == ITEM:
            return dict(msg.get("body") or {})
        self.done = True
        if msg["t"] == FAIL:
            raise error_for(str(msg.get("code")), str(msg.get("message")))
        if msg["t"] == REPLY:
            self.reply = dict(msg.get("body") or {})
        return None

    def send(self, body: dict[str, Any]) -> None:
        self.conn.send_body(self.id, body)

    def half_close(self) -> None:
        self.conn.half_close(self.id)

    def result(self) -> dict[str, Any]:
        while self.next() is not None:
            pass
        return self.reply

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while (body := self.next()) is not None:
            yield body

    def close(self) -> None:
        """Cancel the call unless it ended."""
        if not self.done:
            self.done = True
            self.conn.cancel(self.id)


# --- the driver -----------------------------------------------------------------------------
def _put(call: Call, wrap: Any) -> Any:
    def put(piece: bytes) -> None:
        try:
            call.send(protocol.unstructure_body(wrap(piece)))
        except OSError:  # (the codec would take it for its own: say what it is)
            raise error_for(protocol.UNAVAILABLE, "connection to the supervisor lost") from None

    return put


def _reader(call: Call) -> Any:
    pending = bytearray()
    ended = False

    def read(n: int) -> bytes:
        nonlocal ended
        while not pending and not ended:
            body = call.next()
            if body is None:
                raise tree_chunks_ended()
            ch = structure(body, protocol.FileChunk, "ReadTree")
            pending.extend(ch.data)
            ended = ch.done
        data = bytes(pending[:n])
        del pending[:n]
        return data

    return read


def _perform(c: BlockingConnection, op: Op, socket: str | Path | None) -> Any:
    """One effect of a plan, on the plan's connection ``c``."""
    if isinstance(op, Unary):
        if op.cleanup:
            with open_connection(socket) as fresh:
                return structure(fresh.call(op.method, protocol.unstructure_body(op.request)), op.reply, op.method)
        return structure(c.call(op.method, protocol.unstructure_body(op.request)), op.reply, op.method)
    if isinstance(op, Open):
        return Call(c, op.method, protocol.unstructure_body(op.request))
    if isinstance(op, Receive):
        try:
            body = op.call.next(op.deadline)
        except TimeoutError:
            return TIMED_OUT
        return None if body is None else structure(body, op.item, op.call.method)
    if isinstance(op, Send):
        return op.call.send(protocol.unstructure_body(op.request))
    if isinstance(op, Finish):
        op.call.half_close()
        return structure(op.call.result(), op.reply, op.call.method)
    if isinstance(op, Blocking):
        return op.fn(*op.args)
    if isinstance(op, Pull):
        if not isinstance(op.source, Iterator):
            raise TypeError("the blocking SDK writes bytes or an iterable of bytes")
        return next(op.source, None)
    if isinstance(op, Now):
        return time.monotonic()
    if isinstance(op, Expired):
        import trio  # its TooSlowError, as the Trio SDK raises (and fail_after does)

        raise trio.TooSlowError
    if isinstance(op, SendTree):
        from supervisor.client.treecopy import pack

        return pack(op.fd, _put(op.call, op.wrap))
    if isinstance(op, ReceiveTree):
        from supervisor.client.treecopy import unpack

        return unpack(_reader(op.call), op.fd, keep_ids=op.keep_ids, root_meta=op.root_meta)
    raise AssertionError(f"not an effect: {op!r}")


def drive(socket: str | Path | None, plan: Plan[R]) -> R:
    """Run ``plan`` on a connection of its own; its result."""
    step = Stepper(plan)
    with open_connection(socket) as c:
        while True:
            try:
                op = step.next()
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if isinstance(op, Emit):
                raise AssertionError("a plan of a unary method emitted")
            try:
                step.ok(_perform(c, op, socket))
            except BaseException as exc:  # thrown into the plan, which may clean up (create)
                step.fail(exc)


def drive_stream(socket: str | Path | None, plan: StreamPlan[T]) -> Iterator[T]:
    """Run ``plan`` on a connection of its own; what it emits, as the caller iterates.
    Closing the iterator early closes the connection (the supervisor cancels its calls)."""
    step = Stepper(plan)
    try:
        with open_connection(socket) as c:
            while True:
                try:
                    op = step.next()
                except StopIteration:
                    return
                if isinstance(op, Emit):
                    yield op.value
                    continue
                try:
                    step.ok(_perform(c, op, socket))
                except BaseException as exc:
                    step.fail(exc)
    finally:
        plan.close()


class _Driven(SyncDriven):
    @classmethod
    def _drive(cls, socket: str | None, plan: Plan[R]) -> R:
        return drive(socket, plan)

    @classmethod
    def _drive_stream(cls, socket: str | None, plan: StreamPlan[T]) -> Iterator[T]:
        return drive_stream(socket, plan)


# --- the SDK --------------------------------------------------------------------------------
class Exec:
    """An interactive process: ``send``/``close_stdin``/``resize``, iterate its Output."""

    def __init__(self, call: Call) -> None:
        self._call = call
        self.exit_code: int | None = None
        self.oom_killed = False  # the guest kernel's OOM killer killed the process (once it exited)
        self.session_id = 0  # set when it was detached from (its process runs on)

    def send(self, data: bytes) -> None:
        self._call.send(sandbox_plans.exec_stdin(data))

    def detach(self) -> int:
        """Leave a detachable session running (``exec(..., detachable=True)``, or
        :meth:`Sandbox.session`): output until then is read and dropped; its session id."""
        self._call.send(sandbox_plans.exec_detach())
        for _ in self:
            pass
        if not self.session_id:
            raise error_for(protocol.FAILED_PRECONDITION, "the session ended before it was detached")
        return self.session_id

    def close_stdin(self) -> None:
        self._call.send(sandbox_plans.exec_close_stdin())

    def resize(self, width: int, height: int) -> None:
        self._call.send(sandbox_plans.exec_resize(width, height))

    def __iter__(self) -> Iterator[Output]:
        for item in self._call:
            o = sandbox_plans.exec_output(item)
            if o.stream == "detached":
                self.session_id = o.session_id
                return
            if o.exit_code is not None:
                self.exit_code, self.oom_killed = o.exit_code, o.oom_killed
                yield o
                return
            yield o

    def wait(self) -> int:
        for _ in self:
            pass
        if self.exit_code is None:
            raise Detached(self.session_id)
        return self.exit_code

    def hang_up(self) -> None:
        """End the call from any thread: its connection is shut down, so a reader blocked
        in the iteration returns and the supervisor ends the process (a client gone)."""
        with contextlib.suppress(OSError):
            self._call.conn.sock.shutdown(socket.SHUT_RDWR)


class FS(plans.FSMethods, _Driven):
    """Files in the sandbox (absolute paths); ``write`` streams in 1 MiB chunks."""

    def __init__(self, sb: Sandbox) -> None:
        self.id = sb.id
        self.socket = sb.socket


class Volumes(plans.VolumeMethods, _Driven):
    """The named volumes of a supervisor, blocking; see :class:`~supervisor.client.sdk.plans.VolumeMethods`."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self.socket = str(socket or default_socket())


class Secrets(plans.SecretMethods, _Driven):
    """The supervisor's secret store, blocking; see :class:`~supervisor.client.sdk.plans.SecretMethods`."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self.socket = str(socket or default_socket())


class Images(plans.ImageMethods, _Driven):
    """The supervisor's OCI image store, blocking; see :class:`~supervisor.client.sdk.plans.ImageMethods`."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self.socket = None if socket is None else str(socket)


class Sandbox(plans.SandboxMethods, _Driven):
    """A sandbox of a ``sandvisor serve``, blocking. Leaving ``with`` stops and removes
    it, unless it was created ``detached``. The streaming methods are iterators that
    hold a connection open until they end or are closed."""

    def __init__(self, id: str, *, socket: str | Path | None = None, detached: bool = True) -> None:
        self.id = id
        self.socket = str(socket or default_socket())
        self.detached = detached
        self.fs = FS(self)

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    @classmethod
    def _make(cls: type[H], socket: str | Path | None, plan: Plan[Made]) -> H:
        made = drive(socket, plan)
        return cls(made.id, socket=socket, detached=made.detached)

    def fork(
        self,
        n: int = 1,
        *,
        names: builtins.list[str] | None = None,
        name_prefix: str = "",
        labels: Mapping[str, str] | None = None,
    ) -> builtins.list[Sandbox]:
        """``n`` children of this running sandbox, each ready (see
        :meth:`supervisor.client.sdk.aio.AsyncSandbox.fork`)."""
        r = drive(self.socket, snapshot_plans.fork(self, n, names=names, name_prefix=name_prefix, labels=labels))
        return [type(self)(c.id, socket=self.socket, detached=True) for c in r.sandboxes]

    def diff(
        self, other: str | Sandbox | None = None, path: str = "/", *, snapshot: str = ""
    ) -> builtins.list[protocol.DiffChange]:
        """The paths added, removed and modified under ``path`` (size, mode, SHA-256 of
        each side; docs/fork.md): from this sandbox to ``other``; without ``other``, from
        the ``snapshot`` (id or name), else from this sandbox's fork point, to this
        sandbox. Each guest is asked only about its own tree, a snapshot's disk is read
        on the host; the server compares."""
        o = "" if other is None else other if isinstance(other, str) else other.id
        return (drive(self.socket, snapshot_plans.diff(self, o, path, snapshot=snapshot))).changes

    def diff_content(
        self, path: str, other: str | Sandbox | None = None, *, snapshot: str = ""
    ) -> tuple[bytes | None, bytes | None]:
        """Both sides of the file ``path`` as :meth:`diff` pairs them (the first MiB of
        each; None where there is no such file)."""
        o = "" if other is None else other if isinstance(other, str) else other.id
        return drive(self.socket, snapshot_plans.diff_content(self, path, o, snapshot=snapshot))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.detached:
            try:
                self.remove(force=True)
            except SandboxError:
                pass

    @contextmanager
    def exec(
        self,
        cmd: builtins.list[str] | str,
        *,
        size: tuple[int, int] = (80, 24),
        detachable: bool = False,
        **how: Unpack[RunSettings],
    ) -> Iterator[Exec]:
        """An interactive process (stdin, optional PTY of ``size`` columns x rows, and
        resize). Leaving the block before it exited kills it, unless it was
        ``detachable`` and :meth:`Exec.detach` left it running."""
        with open_connection(self.socket) as c:
            call = Call(c, "Exec", sandbox_plans.exec_request(self, cmd, size, how, detachable=detachable))
            try:
                yield Exec(call)
            finally:
                call.close()

    @contextmanager
    def session(self, session_id: int) -> Iterator[Exec]:
        """A detached session again: its output since the detach, then live (see
        :meth:`supervisor.client.sdk.aio.AsyncSandbox.session`)."""
        with open_connection(self.socket) as c:
            call = Call(c, "Attach", sandbox_plans.attach_request(self, session_id))
            try:
                yield Exec(call)
            finally:
                call.close()

    def attach(
        self,
        cmd: builtins.list[str] | str,
        *,
        tty: bool | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str = "",
        user: str = "",
        stdin_fd: int = 0,
        stdout_fd: int = 1,
        stderr_fd: int = 2,
        detach_keys: str = "",
    ) -> int:
        """:meth:`supervisor.client.sdk.aio.AsyncSandbox.attach` (a terminal bridge: stdin, output
        and SIGWINCH at once), run on a Trio loop in this thread."""
        import functools

        import trio

        from supervisor.client.sdk.aio import AsyncSandbox

        a = AsyncSandbox(self.id, socket=self.socket)
        fn = functools.partial(
            a.attach,
            cmd,
            tty=tty,
            env=env,
            workdir=workdir,
            user=user,
            stdin_fd=stdin_fd,
            stdout_fd=stdout_fd,
            stderr_fd=stderr_fd,
            detach_keys=detach_keys,
        )
        return trio.run(fn)

    def attach_session(
        self,
        session_id: int,
        *,
        stdin_fd: int = 0,
        stdout_fd: int = 1,
        stderr_fd: int = 2,
        detach_keys: str = DEFAULT_DETACH_KEYS,
    ) -> int:
        """:meth:`supervisor.client.sdk.aio.AsyncSandbox.attach_session`, on a Trio loop in this thread."""
        import functools

        import trio

        from supervisor.client.sdk.aio import AsyncSandbox

        a = AsyncSandbox(self.id, socket=self.socket)
        fn = functools.partial(
            a.attach_session,
            session_id,
            stdin_fd=stdin_fd,
            stdout_fd=stdout_fd,
            stderr_fd=stderr_fd,
            detach_keys=detach_keys,
        )
        return trio.run(fn)

    def shell(self, shell: str | None = None) -> int:
        """An interactive shell on the caller's terminal: ``shell``, else the sandbox's
        (its Create's ``shell``), else /bin/sh."""
        return self.attach(self.shell_argv(shell), tty=True)


images = Images()  # on the default socket (SANDVISOR_SOCKET): client.images.pull(...)
