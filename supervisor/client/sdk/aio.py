"""The Trio SDK: :class:`AsyncSandbox` and friends, and the protocol-level
:class:`AsyncConnection` (unary calls, server streams and bidirectional streams
multiplexed on one socket, the wire's maps as bodies) on
:class:`supervisor.wire.frames.FramedStream`.

The methods are the plans of :mod:`supervisor.client.sdk.plans`, run by the driver here
(:func:`drive`, :func:`drive_stream`): each effect a plan yields is one await on the
connection. Only what is Trio's own is written here: the context managers, the
interactive :meth:`AsyncSandbox.exec` and the terminal bridge :meth:`AsyncSandbox.attach`.
"""

from __future__ import annotations

import builtins
import math
import os
import signal
import termios
import tty as tty_mod
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar, Unpack

import trio

from supervisor.client.sdk import plans, sandbox_plans, snapshot_plans
from supervisor.client.sdk.acting import hello_fields
from supervisor.client.sdk.detach import DEFAULT_DETACH_KEYS, Detached, DetachMatcher, parse_detach_keys
from supervisor.client.sdk.ops import (
    TIMED_OUT,
    AsyncDriven,
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
    Unary,
    structure,
    tree_chunks_ended,
)
from supervisor.client.sdk.spec import Output, RunSettings
from supervisor.wire import protocol
from supervisor.wire.config import UnsafeRuntimeDir, check_runtime_dir, default_socket
from supervisor.wire.errors import SandboxError, collapse_single, error_for
from supervisor.wire.frames import FramedStream
from supervisor.wire.protocol import ApiError

T = TypeVar("T")
R = TypeVar("R")
H = TypeVar("H", bound="AsyncSandbox")


class CallStream:
    """One call's incoming items; ``send``/``half_close`` for client-streaming calls."""

    def __init__(self, conn: AsyncConnection, id: int, method: str = "") -> None:
        self.conn = conn
        self.id = id
        self.method = method
        self.send_ch, self.recv_ch = trio.open_memory_channel[protocol.Envelope](256)
        self.reply: dict[str, Any] | None = None
        self.done = False

    async def send(self, body: dict[str, Any]) -> None:
        await self.conn._send(protocol.Send(self.id, body))

    async def half_close(self) -> None:
        await self.conn._send(protocol.HalfClose(self.id))

    async def cancel(self) -> None:
        if not self.done:
            await self.conn._send(protocol.Cancel(self.id))

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.done:
            raise StopAsyncIteration
        try:
            msg = await self.recv_ch.receive()
        except trio.EndOfChannel:
            self.done = True
            raise error_for(protocol.UNAVAILABLE, "connection to the supervisor lost") from None
        if isinstance(msg, protocol.Item):
            return msg.body
        self.done = True
        if isinstance(msg, protocol.Fail):
            raise error_for(msg.code, msg.message)
        if isinstance(msg, protocol.Reply):
            self.reply = msg.body
        raise StopAsyncIteration

    async def result(self) -> dict[str, Any]:
        """For calls answered by one Reply (unary, client-streaming)."""
        async for _ in self:
            pass
        return self.reply or {}


class AsyncConnection:
    """One connection to the supervisor: calls multiplexed by id, bodies as the wire's maps.

    A reader task (started by :func:`connect`) routes each incoming envelope to its
    call's channel; any task may open calls."""

    def __init__(self, stream: trio.SocketStream, *, act_as: str = "", act_as_admin: bool = False) -> None:
        self.frames = FramedStream(stream)
        self.calls: dict[int, CallStream] = {}
        self.next_id = 1
        self.closed = False
        self.act_as = act_as
        self.act_as_admin = act_as_admin

    async def _send(self, msg: protocol.Envelope) -> None:
        """One envelope out; a supervisor gone (killed, restarting) is UNAVAILABLE, as
        every error a caller sees has one of sandbox.v1's codes (the stream's own errors
        -- BrokenResourceError, a reset -- are not the caller's to know)."""
        try:
            await self.frames.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise error_for(protocol.UNAVAILABLE, "connection to the supervisor lost") from None

    async def _hello(self) -> None:
        await self._send(
            protocol.ClientHello(protocol.PROTOCOL_VERSION, "sandvisor-client", self.act_as, self.act_as_admin)
        )
        try:
            msg = await self.frames.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            msg = None
        if isinstance(msg, protocol.Fail):
            raise error_for(msg.code, msg.message)
        if not isinstance(msg, protocol.ServerHello):
            raise ApiError(protocol.UNAVAILABLE, "the supervisor did not answer the hello")

    async def _reader(self) -> None:
        try:
            while True:
                msg = await self.frames.receive()
                if msg is None:
                    break
                if isinstance(msg, protocol.Fail) and msg.id == 0:
                    break
                call = self.calls.get(getattr(msg, "id", -1))
                if call is None:
                    continue
                await call.send_ch.send(msg)  # a slow consumer holds back this connection
                if not isinstance(msg, protocol.Item):
                    self.calls.pop(call.id, None)
                    call.send_ch.close()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.closed = True
            for call in list(self.calls.values()):
                call.send_ch.close()
            self.calls.clear()

    @asynccontextmanager
    async def open_call(self, method: str, body: dict[str, Any] | None = None) -> AsyncIterator[CallStream]:
        if self.closed:
            raise error_for(protocol.UNAVAILABLE, "connection to the supervisor lost")
        call = CallStream(self, self.next_id, method)
        self.next_id += 1
        self.calls[call.id] = call
        await self._send(protocol.Call(call.id, method, body or {}))
        try:
            yield call
        finally:
            if not call.done and not self.closed:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await call.cancel()
                    except (ApiError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            self.calls.pop(call.id, None)

    async def call(self, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        async with self.open_call(method, body) as c:
            return await c.result()

    async def collect(self, method: str, body: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """A server stream collected to the end (for short streams)."""
        async with self.open_call(method, body) as c:
            return [item async for item in c]


@asynccontextmanager
async def connect(
    path: Path | str | None = None, *, act_as: str = "", act_as_admin: bool = False
) -> AsyncIterator[AsyncConnection]:
    """A connection to the supervisor at ``path`` (None: the default socket). ``act_as``:
    an admin's connection acting for that principal (docs/security.md); without it, the
    context's (:func:`supervisor.client.sdk.acting.acting_as`), else the caller's own uid."""
    act_as, act_as_admin = hello_fields(act_as, act_as_admin)
    default = default_socket()
    path = default if path is None else Path(path)
    if path == default:
        try:
            check_runtime_dir(path)
        except UnsafeRuntimeDir as exc:
            raise error_for(protocol.FAILED_PRECONDITION, str(exc)) from None
    sock_path = str(path)
    try:
        stream = await trio.open_unix_socket(sock_path)
    except OSError as exc:
        raise error_for(protocol.UNAVAILABLE, f"cannot reach the supervisor at {sock_path}: {exc.strerror}") from None
    conn = AsyncConnection(stream, act_as=act_as, act_as_admin=act_as_admin)
    with collapse_single():
        async with stream, trio.open_nursery() as nursery:
            await conn._hello()
            nursery.start_soon(conn._reader)
            try:
                yield conn
            finally:
                nursery.cancel_scope.cancel()


# --- the driver -----------------------------------------------------------------------------
async def _perform(c: AsyncConnection, calls: AsyncExitStack, op: Op, socket: str | Path | None) -> Any:
    """One effect of a plan, on the plan's connection ``c`` (its calls closed by ``calls``)."""
    if isinstance(op, Unary):
        if op.cleanup:
            with trio.CancelScope(shield=True):
                async with connect(socket) as fresh:
                    return structure(
                        await fresh.call(op.method, protocol.unstructure_body(op.request)), op.reply, op.method
                    )
        return structure(await c.call(op.method, protocol.unstructure_body(op.request)), op.reply, op.method)
    if isinstance(op, Open):
        return await calls.enter_async_context(c.open_call(op.method, protocol.unstructure_body(op.request)))
    if isinstance(op, Receive):
        with trio.move_on_at(math.inf if op.deadline is None else op.deadline):
            try:
                return structure(await op.call.__anext__(), op.item, op.call.method)
            except StopAsyncIteration:
                return None
        return TIMED_OUT
    if isinstance(op, Send):
        return await op.call.send(protocol.unstructure_body(op.request))
    if isinstance(op, Finish):
        await op.call.half_close()
        return structure(await op.call.result(), op.reply, op.call.method)
    if isinstance(op, Blocking):
        return await trio.to_thread.run_sync(op.fn, *op.args)
    if isinstance(op, Pull):
        if isinstance(op.source, AsyncIterator):
            return await anext(op.source, None)
        assert isinstance(op.source, Iterator)
        return next(op.source, None)
    if isinstance(op, Now):
        return trio.current_time()
    if isinstance(op, Expired):
        raise trio.TooSlowError
    if isinstance(op, SendTree):
        from supervisor.client.treecopy import packed_fd

        async with packed_fd(op.fd) as pieces:
            async for piece in pieces:
                await op.call.send(protocol.unstructure_body(op.wrap(piece)))
        return None
    if isinstance(op, ReceiveTree):
        from supervisor.client.treecopy import unpack_fd

        async def chunks() -> AsyncIterator[bytes]:
            async for item in op.call:
                ch = structure(item, protocol.FileChunk, "ReadTree")
                if ch.data:
                    yield ch.data
                if ch.done:
                    return
            raise tree_chunks_ended()

        return await unpack_fd(chunks(), op.fd, keep_ids=op.keep_ids, root_meta=op.root_meta)
    raise AssertionError(f"not an effect: {op!r}")


async def drive(socket: str | Path | None, plan: Plan[R]) -> R:
    """Run ``plan`` on a connection of its own; its result."""
    step = Stepper(plan)
    async with connect(socket) as c, AsyncExitStack() as calls:
        while True:
            try:
                op = step.next()
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if isinstance(op, Emit):
                raise AssertionError("a plan of a unary method emitted")
            try:
                step.ok(await _perform(c, calls, op, socket))
            except BaseException as exc:  # thrown into the plan, which may clean up (create)
                step.fail(exc)


async def drive_stream(socket: str | Path | None, plan: StreamPlan[T]) -> AsyncGenerator[T, None]:
    """Run ``plan`` on a connection of its own; what it emits. Close the generator in
    the task that iterates it (``contextlib.aclosing``): it holds the connection."""
    step = Stepper(plan)
    try:
        async with connect(socket) as c, AsyncExitStack() as calls:
            while True:
                try:
                    op = step.next()
                except StopIteration:
                    return
                if isinstance(op, Emit):
                    yield op.value
                    continue
                try:
                    step.ok(await _perform(c, calls, op, socket))
                except BaseException as exc:
                    step.fail(exc)
    finally:
        plan.close()


class _Driven(AsyncDriven):
    @classmethod
    def _drive(cls, socket: str | None, plan: Plan[R]) -> Any:
        return drive(socket, plan)

    @classmethod
    def _drive_stream(cls, socket: str | None, plan: StreamPlan[T]) -> AsyncGenerator[T, None]:
        return drive_stream(socket, plan)


# --- the SDK --------------------------------------------------------------------------------
class AsyncExec:
    """An interactive process: ``send``/``close_stdin``/``resize``, iterate its Output."""

    def __init__(self, call: CallStream) -> None:
        self._call = call
        self.exit_code: int | None = None
        self.oom_killed = False  # the guest kernel's OOM killer killed the process (once it exited)
        self.session_id = 0  # set when it was detached from (its process runs on)

    async def send(self, data: bytes) -> None:
        await self._call.send(sandbox_plans.exec_stdin(data))

    async def request_detach(self) -> None:
        """Ask to leave a detachable session running: the output iteration ends at the
        supervisor's answer (then ``session_id`` is set)."""
        await self._call.send(sandbox_plans.exec_detach())

    async def detach(self) -> int:
        """Leave a detachable session running (``exec(..., detachable=True)``, or one
        attached again with :meth:`AsyncSandbox.session`): its output until then is
        read and dropped; returns its session id."""
        await self.request_detach()
        async for _ in self:
            pass
        if not self.session_id:
            raise error_for(protocol.FAILED_PRECONDITION, "the session ended before it was detached")
        return self.session_id

    async def close_stdin(self) -> None:
        await self._call.send(sandbox_plans.exec_close_stdin())

    async def resize(self, width: int, height: int) -> None:
        await self._call.send(sandbox_plans.exec_resize(width, height))

    def __aiter__(self) -> AsyncIterator[Output]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[Output]:
        async for item in self._call:
            o = sandbox_plans.exec_output(item)
            if o.stream == "detached":
                self.session_id = o.session_id
                return
            if o.exit_code is not None:
                self.exit_code, self.oom_killed = o.exit_code, o.oom_killed
                yield o
                return
            yield o

    async def wait(self) -> int:
        async for _ in self:
            pass
        if self.exit_code is None:
            raise Detached(self.session_id)
        return self.exit_code


class AsyncFS(plans.FSMethods, _Driven):
    """Files in the sandbox (absolute paths); ``write`` streams in 1 MiB chunks."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self.id = sb.id
        self.socket = sb.socket


class AsyncVolumes(plans.VolumeMethods, _Driven):
    """The named volumes of a supervisor (Trio); see :class:`~supervisor.client.sdk.plans.VolumeMethods`."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self.socket = str(socket or default_socket())


class AsyncSecrets(plans.SecretMethods, _Driven):
    """The supervisor's secret store (Trio); see :class:`~supervisor.client.sdk.plans.SecretMethods`."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self.socket = str(socket or default_socket())


class AsyncImages(plans.ImageMethods, _Driven):
    """The supervisor's OCI image store (Trio). ``AsyncImages(socket=...)``; the
    module's ``images`` is the sync one on the default socket::

        img = await AsyncImages().pull("docker://127.0.0.1:5000/app:1", tls_verify=False)
        async with await AsyncSandbox.create("box", image=img.refs[0]) as sb: ..."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self.socket = None if socket is None else str(socket)


class AsyncSandbox(plans.SandboxMethods, _Driven):
    """A sandbox of a ``sandvisor serve`` (Trio). Leaving ``async with`` stops and
    removes it, unless it was created ``detached``.

    The streaming methods (run_stream, log_stream, metrics_stream, events) are async
    generators that hold a connection open: to leave one early, close it in the same
    task with ``async with contextlib.aclosing(sb.events()) as events:``."""

    def __init__(self, id: str, *, socket: str | Path | None = None, detached: bool = True) -> None:
        self.id = id
        self.socket = str(socket or default_socket())
        self.detached = detached
        self.fs = AsyncFS(self)

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r})"

    @classmethod
    async def _make(cls: type[H], socket: str | Path | None, plan: Plan[Made]) -> H:
        made = await drive(socket, plan)
        return cls(made.id, socket=socket, detached=made.detached)

    async def fork(
        self,
        n: int = 1,
        *,
        names: builtins.list[str] | None = None,
        name_prefix: str = "",
        labels: Mapping[str, str] | None = None,
    ) -> builtins.list[AsyncSandbox]:
        """``n`` children of this running sandbox, each ready, in the order asked (docs/fork.md):
        it pauses once and runs on; each child has its own id, hostname, address and secret
        placeholders, and this sandbox's processes, memory and files at the fork point.
        Their labels: this one's, then ``labels``. They are yours, detached (remove them,
        or remove this one ``with_descendants``)."""
        r = await drive(self.socket, snapshot_plans.fork(self, n, names=names, name_prefix=name_prefix, labels=labels))
        return [type(self)(c.id, socket=self.socket, detached=True) for c in r.sandboxes]

    async def diff(
        self, other: str | AsyncSandbox | None = None, path: str = "/", *, snapshot: str = ""
    ) -> builtins.list[protocol.DiffChange]:
        """The paths added, removed and modified under ``path`` (size, mode, SHA-256 of
        each side; docs/fork.md): from this sandbox to ``other``; without ``other``, from
        the ``snapshot`` (id or name), else from this sandbox's fork point, to this
        sandbox. Each guest is asked only about its own tree, a snapshot's disk is read
        on the host; the server compares."""
        o = "" if other is None else other if isinstance(other, str) else other.id
        return (await drive(self.socket, snapshot_plans.diff(self, o, path, snapshot=snapshot))).changes

    async def diff_content(
        self, path: str, other: str | AsyncSandbox | None = None, *, snapshot: str = ""
    ) -> tuple[bytes | None, bytes | None]:
        """Both sides of the file ``path`` as :meth:`diff` pairs them (the first MiB of
        each; None where there is no such file)."""
        o = "" if other is None else other if isinstance(other, str) else other.id
        return await drive(self.socket, snapshot_plans.diff_content(self, path, o, snapshot=snapshot))

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.detached:
            with trio.CancelScope(shield=True):
                try:
                    await self.remove(force=True)
                except SandboxError:
                    pass

    @asynccontextmanager
    async def exec(
        self,
        cmd: builtins.list[str] | str,
        *,
        size: tuple[int, int] = (80, 24),
        detachable: bool = False,
        **how: Unpack[RunSettings],
    ) -> AsyncIterator[AsyncExec]:
        """An interactive process (stdin, optional PTY of ``size`` columns x rows, and
        resize). Leaving the block before it exited kills it, unless it was
        ``detachable`` and :meth:`AsyncExec.detach` left it running."""
        request = sandbox_plans.exec_request(self, cmd, size, how, detachable=detachable)
        async with connect(self.socket) as c, c.open_call("Exec", request) as call:
            yield AsyncExec(call)

    @asynccontextmanager
    async def session(self, session_id: int) -> AsyncIterator[AsyncExec]:
        """A detached session again: its output since the detach (at most 1 MiB kept),
        then live; leave it running again with :meth:`AsyncExec.detach` (leaving the
        block otherwise ends it, as an exec's)."""
        request = sandbox_plans.attach_request(self, session_id)
        async with connect(self.socket) as c, c.open_call("Attach", request) as call:
            yield AsyncExec(call)

    async def attach(
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
        """Bridge the caller's terminal (or fds) to a process in the sandbox: raw mode
        and window-size changes when stdin is a terminal. Returns the exit code.
        ``detach_keys`` (``"ctrl-p,ctrl-q"``, docker's syntax; "": none): typed, they
        leave the process running and raise :class:`Detached` with its session id
        (:meth:`attach_session` goes back to it)."""
        use_tty = os.isatty(stdin_fd) if tty is None else tty
        size = os.get_terminal_size(stdout_fd) if os.isatty(stdout_fd) else os.terminal_size((80, 24))
        opened = self.exec(
            cmd,
            tty=use_tty,
            size=(size.columns, size.lines),
            env=env or {},
            workdir=workdir,
            user=user,
            detachable=bool(detach_keys),
        )
        return await _bridge(opened, use_tty, detach_keys, stdin_fd, stdout_fd, stderr_fd)

    async def attach_session(
        self,
        session_id: int,
        *,
        stdin_fd: int = 0,
        stdout_fd: int = 1,
        stderr_fd: int = 2,
        detach_keys: str = DEFAULT_DETACH_KEYS,
    ) -> int:
        """:meth:`attach` to a detached session again (``sandvisor attach NAME SESSION``)."""
        use_tty = os.isatty(stdin_fd)
        return await _bridge(self.session(session_id), use_tty, detach_keys, stdin_fd, stdout_fd, stderr_fd)

    async def shell(self, shell: str | None = None) -> int:
        """An interactive shell on the caller's terminal: ``shell``, else the sandbox's
        (its Create's ``shell``), else /bin/sh."""
        return await self.attach(await self.shell_argv(shell), tty=True)


async def _bridge(
    opened: AbstractAsyncContextManager[AsyncExec],
    use_tty: bool,
    detach_keys: str,
    stdin_fd: int,
    stdout_fd: int,
    stderr_fd: int,
) -> int:
    """The terminal (or fds) bridged to the process ``opened`` gives; its exit code, or
    :class:`Detached` when the detach keys were typed."""
    matcher = DetachMatcher(parse_detach_keys(detach_keys) if detach_keys else b"")
    raw = use_tty and os.isatty(stdin_fd)
    old = termios.tcgetattr(stdin_fd) if raw else None
    try:
        if raw:
            tty_mod.setraw(stdin_fd)
        with collapse_single():
            async with opened as proc, trio.open_nursery() as n:

                async def pump_stdin() -> None:
                    async with trio.lowlevel.FdStream(os.dup(stdin_fd)) as stdin:
                        while data := await stdin.receive_some(65536):
                            data, detach = matcher.feed(data)
                            if data:
                                await proc.send(data)
                            if detach:
                                await proc.request_detach()
                                return
                    await proc.close_stdin()

                async def on_winch() -> None:
                    with trio.open_signal_receiver(signal.SIGWINCH) as sigs:
                        async for _ in sigs:
                            sz = os.get_terminal_size(stdout_fd)
                            await proc.resize(sz.columns, sz.lines)

                n.start_soon(pump_stdin)
                if raw:
                    n.start_soon(on_winch)
                async for o in proc:
                    if o.stream != "exit":
                        fd = stderr_fd if o.stream == "stderr" else stdout_fd
                        view = memoryview(o.data)
                        while view:
                            view = view[await trio.to_thread.run_sync(os.write, fd, view) :]
                n.cancel_scope.cancel()
    finally:
        if old is not None:
            termios.tcsetattr(stdin_fd, termios.TCSADRAIN, old)
    if proc.exit_code is None:
        raise Detached(proc.session_id)
    if proc.oom_killed:  # (a shell would say "Killed"; this says why)
        os.write(stderr_fd, b"killed: out of memory\n")
    return proc.exit_code
