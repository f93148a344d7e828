"""The Python SDK of sandvisor, and the client side of its Unix-socket protocol.

``from supervisor.client import Sandbox, AsyncSandbox``: the same surface, sync and
Trio-async. Failures raise subclasses of :class:`SandboxError` named after the
seed's codes (:class:`NotFound`, :class:`InvalidArgument`, ...).

Below them, :func:`connect` gives an :class:`AsyncConnection`: unary calls, server
streams and bidirectional streams multiplexed on one socket.
"""

from __future__ import annotations

import builtins
import functools
import os
import queue
import signal
import termios
import threading
import tty as tty_mod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from actors._groups import collapse_single
from supervisor import protocol as W
from supervisor.config import default_socket
from supervisor.protocol import ApiError

T_ = TypeVar("T_")


class CallStream:
    """One call's incoming items; ``send``/``half_close`` for client-streaming calls."""

    def __init__(self, conn: AsyncConnection, id: int) -> None:
        self.conn = conn
        self.id = id
        self.send_ch, self.recv_ch = trio.open_memory_channel[W.Envelope](256)
        self.reply: dict[str, Any] | None = None
        self.done = False

    async def send(self, body: dict[str, Any]) -> None:
        await self.conn._send(W.Send(self.id, body))

    async def half_close(self) -> None:
        await self.conn._send(W.HalfClose(self.id))

    async def cancel(self) -> None:
        if not self.done:
            await self.conn._send(W.Cancel(self.id))

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.done:
            raise StopAsyncIteration
        try:
            msg = await self.recv_ch.receive()
        except trio.EndOfChannel:
            self.done = True
            raise error_for(W.UNAVAILABLE, "connection to the supervisor lost") from None
        if isinstance(msg, W.Item):
            return msg.body
        self.done = True
        if isinstance(msg, W.Fail):
            raise error_for(msg.code, msg.message)
        if isinstance(msg, W.Reply):
            self.reply = msg.body
        raise StopAsyncIteration

    async def result(self) -> dict[str, Any]:
        """For calls answered by one Reply (unary, client-streaming)."""
        async for _ in self:
            pass
        return self.reply or {}


class AsyncConnection:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.lock = trio.Lock()
        self.calls: dict[int, CallStream] = {}
        self.next_id = 1
        self.reader = W.FrameReader()
        self.closed = False

    async def _send(self, msg: W.Envelope) -> None:
        async with self.lock:
            await self.stream.send_all(W.encode(msg))

    async def _read_one(self) -> W.Envelope | None:
        while True:
            body = self.reader.next()
            if body is not None:
                return W.decode(body)
            data = await self.stream.receive_some(1 << 16)
            if not data:
                return None
            self.reader.feed(data)

    async def _hello(self) -> None:
        await self._send(W.ClientHello(W.PROTOCOL_VERSION, "sandvisor-client"))
        msg = await self._read_one()
        if isinstance(msg, W.Fail):
            raise error_for(msg.code, msg.message)
        if not isinstance(msg, W.ServerHello):
            raise ApiError(W.UNAVAILABLE, "the supervisor did not answer the hello")

    async def _reader(self) -> None:
        try:
            while True:
                msg = await self._read_one()
                if msg is None:
                    break
                if isinstance(msg, W.Fail) and msg.id == 0:
                    break
                call = self.calls.get(getattr(msg, "id", -1))
                if call is None:
                    continue
                await call.send_ch.send(msg)  # a slow consumer holds back this connection
                if not isinstance(msg, W.Item):
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
            raise ApiError(W.UNAVAILABLE, "connection to the supervisor lost")
        call = CallStream(self, self.next_id)
        self.next_id += 1
        self.calls[call.id] = call
        await self._send(W.Call(call.id, method, body or {}))
        try:
            yield call
        finally:
            if not call.done and not self.closed:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await call.cancel()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
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
async def connect(path: Path | str | None = None) -> AsyncIterator[AsyncConnection]:
    sock_path = str(path or default_socket())
    try:
        stream = await trio.open_unix_socket(sock_path)
    except OSError as exc:
        raise error_for(W.UNAVAILABLE, f"cannot reach the supervisor at {sock_path}: {exc.strerror}") from None
    conn = AsyncConnection(stream)
    with collapse_single():
        async with stream, trio.open_nursery() as nursery:
            await conn._hello()
            nursery.start_soon(conn._reader)
            try:
                yield conn
            finally:
                nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


class SandboxError(ApiError):
    """Base of the SDK's errors; ``code`` is the seed's error code."""


class InvalidArgument(SandboxError):
    pass


class NotFound(SandboxError):
    pass


class AlreadyExists(SandboxError):
    pass


class FailedPrecondition(SandboxError):
    pass


class ResourceExhausted(SandboxError):
    pass


class DeadlineExceeded(SandboxError):
    pass


class Internal(SandboxError):
    pass


class Unavailable(SandboxError):
    pass


class Unimplemented(SandboxError):
    pass


class Cancelled(SandboxError):
    pass


_ERRORS: dict[str, type[SandboxError]] = {
    W.INVALID_ARGUMENT: InvalidArgument,
    W.NOT_FOUND: NotFound,
    W.ALREADY_EXISTS: AlreadyExists,
    W.FAILED_PRECONDITION: FailedPrecondition,
    W.RESOURCE_EXHAUSTED: ResourceExhausted,
    W.DEADLINE_EXCEEDED: DeadlineExceeded,
    W.INTERNAL: Internal,
    W.UNAVAILABLE: Unavailable,
    W.UNIMPLEMENTED: Unimplemented,
    W.CANCELLED: Cancelled,
}


def error_for(code: str, message: str) -> SandboxError:
    return _ERRORS.get(code, SandboxError)(code, message)


# ---------------------------------------------------------------------------
# the SDK
# ---------------------------------------------------------------------------


@attrs.frozen
class RunResult:
    stdout: bytes
    stderr: bytes
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def text(self) -> str:
        return self.stdout.decode(errors="replace")


@attrs.frozen
class Output:
    """One chunk of a streaming run: ``stream`` is stdout, stderr or exit."""

    stream: str
    data: bytes
    exit_code: int | None = None


@attrs.frozen
class Page:
    sandboxes: list[dict[str, Any]]
    next_cursor: str


def _kv(d: dict[str, str] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (d or {}).items()}


class AsyncExec:
    """An interactive process: ``send``/``close_stdin``/``resize``, iterate its Output."""

    def __init__(self, call: CallStream) -> None:
        self._call = call
        self.exit_code: int | None = None

    async def send(self, data: bytes) -> None:
        await self._call.send({"stdin": data})

    async def close_stdin(self) -> None:
        await self._call.send({"close_stdin": True})

    async def resize(self, width: int, height: int) -> None:
        await self._call.send({"resize": {"width": width, "height": height}})

    def __aiter__(self) -> AsyncIterator[Output]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[Output]:
        async for item in self._call:
            if item.get("done"):
                self.exit_code = int(item["exit_code"])
                yield Output("exit", b"", self.exit_code)
                return
            yield Output(item["stream"], item["data"])

    async def wait(self) -> int:
        async for _ in self:
            pass
        assert self.exit_code is not None
        return self.exit_code


class AsyncFS:
    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    async def read(self, path: str) -> bytes:
        async with connect(self._sb.socket) as c:
            chunks = await c.collect("ReadFile", {"id": self._sb.id, "path": path})
        return b"".join(ch["data"] for ch in chunks)

    async def write(self, path: str, data: bytes | AsyncIterator[bytes], *, mode: int = 0o644) -> None:
        async with (
            connect(self._sb.socket) as c,
            c.open_call("WriteFile", {"open": {"id": self._sb.id, "path": path, "mode": mode}}) as call,
        ):
            if isinstance(data, (bytes, bytearray, memoryview)):
                view = memoryview(data)
                for i in range(0, len(view), 1 << 20):
                    await call.send({"chunk": {"data": bytes(view[i : i + (1 << 20)])}})
            else:
                async for piece in data:
                    await call.send({"chunk": {"data": bytes(piece)}})
            await call.send({"chunk": {"done": True}})
            await call.half_close()
            await call.result()

    async def copy_in(self, local: str | Path, path: str) -> None:
        src = Path(local)
        mode = src.stat().st_mode & 0o7777

        async def pieces() -> AsyncIterator[bytes]:
            with open(src, "rb") as f:
                while chunk := await trio.to_thread.run_sync(f.read, 1 << 20):
                    yield chunk

        await self.write(path, pieces(), mode=mode)

    async def copy_out(self, path: str, local: str | Path) -> None:
        dest = Path(local)
        tmp = dest.with_name(f".{dest.name}.sandvisor-part")
        async with connect(self._sb.socket) as c, c.open_call("ReadFile", {"id": self._sb.id, "path": path}) as call:
            with open(tmp, "wb") as f:
                async for ch in call:
                    await trio.to_thread.run_sync(f.write, ch["data"])
        tmp.replace(dest)


class AsyncSandbox:
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

    async def _call(self, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        async with connect(self.socket) as c:
            return await c.call(method, {"id": self.id, **(body or {})})

    # -- creation and lookup -------------------------------------------------------
    @classmethod
    async def create(
        cls,
        name: str = "",
        *,
        socket: str | Path | None = None,
        cpus: int = 0,
        memory_mib: int = 0,
        env: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        workdir: str = "",
        user: str = "",
        hostname: str = "",
        cmd: builtins.list[str] | None = None,
        ttl: int = 0,
        idle_timeout: int = 0,
        network: str = "none",
        outbound: bool = False,
        egress: dict[str, Any] | None = None,
        ports: dict[int, int] | None = None,
        kernel: str = "",
        rootfs: str = "",
        boot_args: str = "",
        replace: bool = False,
        ephemeral: bool = False,
        detached: bool = False,
        wait: bool = True,
        timeout: float = 120.0,
    ) -> AsyncSandbox:
        """Create (and by default wait until ready). ``replace`` removes an existing
        sandbox of that name first; ``ephemeral`` sandboxes are removed when they stop.
        ``network``: "none", "tap" (an address of the supervisor's IP pool), "user"
        (exposed ports only), or "outbound" (user mode that may reach out: the same as
        "user" with ``outbound``). ``egress``: where it may connect to, e.g.
        ``{"default": "deny", "allow": ["10.0.0.0/8", "pypi.org:443"], "deny": [...]}``."""
        if network == "outbound":
            network, outbound = "user", True
        body: dict[str, Any] = {
            "id": name,
            "labels": _kv(labels),
            "kernel": kernel,
            "rootfs": rootfs,
            "boot_args": boot_args,
            "limits": {"vcpus": cpus, "memory_mib": memory_mib},
            "cmd": list(cmd or []),
            "env": _kv(env),
            "working_dir": workdir,
            "user": user,
            "network": {"mode": network, "outbound": outbound, "egress": egress},
            "ports": [{"sandbox_port": g, "host_port": h, "protocol": "tcp"} for g, h in (ports or {}).items()],
            "ttl_seconds": ttl,
            "idle_timeout_seconds": idle_timeout,
            "hostname": hostname,
            "ephemeral": ephemeral,
        }
        async with connect(socket) as c:
            if replace and name:
                try:
                    await c.call("Remove", {"id": name, "force": True})
                except NotFound:
                    pass
            resp = await c.call("Create", body)
        sb = cls(resp["id"], socket=socket, detached=detached)
        if wait:
            await sb.wait_ready(timeout)
        return sb

    @classmethod
    async def get(cls, name: str, *, socket: str | Path | None = None) -> AsyncSandbox:
        sb = cls(name, socket=socket, detached=True)
        await sb.inspect()
        return sb

    @classmethod
    async def list(
        cls,
        *,
        socket: str | Path | None = None,
        labels: dict[str, str] | None = None,
        state: str = "",
        limit: int = 20,
        cursor: str = "",
    ) -> Page:
        async with connect(socket) as c:
            r = await c.call("List", {"labels": _kv(labels), "state": state, "limit": limit, "cursor": cursor})
        return Page(r["sandboxes"], r.get("next_cursor", ""))

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.detached:
            with trio.CancelScope(shield=True):
                try:
                    await self.remove(force=True)
                except SandboxError:
                    pass

    # -- state ------------------------------------------------------------------
    async def inspect(self) -> dict[str, Any]:
        return await self._call("Inspect")

    async def state(self) -> str:
        return str((await self.inspect())["state"])

    async def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        async with connect(self.socket) as c, c.open_call("Events", {"id": self.id}) as ev:
            info = await c.call("Inspect", {"id": self.id})
            with trio.fail_after(timeout):
                while info["state"] == "starting":
                    e = await ev.__anext__()
                    if e["action"] in ("ready", "failed", "stopped"):
                        info = await c.call("Inspect", {"id": self.id})
            if info["state"] not in ("ready", "running"):
                raise error_for(W.FAILED_PRECONDITION, f"sandbox {self.id} is {info['state']}: {info['error']}")
            return info

    async def stop(self, timeout: int = 0) -> None:
        await self._call("Stop", {"timeout_seconds": timeout})

    async def kill(self) -> None:
        await self._call("Kill")

    async def drain(self) -> None:
        await self._call("Drain")

    async def wait_until_stopped(self) -> dict[str, Any]:
        return await self._call("WaitUntilStopped")

    async def start(self, *, wait: bool = True, timeout: float = 120.0) -> None:
        await self._call("Start")
        if wait:
            await self.wait_ready(timeout)

    async def remove(self, *, force: bool = False) -> None:
        async with connect(self.socket) as c:
            await c.call("Remove", {"id": self.id, "force": force})

    async def ping(self) -> float:
        """Round trip to the guest agent, in seconds (does not count as activity)."""
        return int((await self._call("Ping"))["latency_ns"]) / 1e9

    async def touch(self) -> int:
        return int((await self._call("Touch"))["activity"])

    async def metrics(self) -> dict[str, Any]:
        return await self._call("Metrics")

    async def metrics_stream(self, interval: float = 1.0) -> AsyncGenerator[dict[str, Any], None]:
        async with (
            connect(self.socket) as c,
            c.open_call("MetricsStream", {"id": self.id, "interval_seconds": interval}) as call,
        ):
            async for m in call:
                yield m

    async def logs(self, *, tail: int = 0, since: int = 0, until: int = 0) -> builtins.list[dict[str, Any]]:
        async with connect(self.socket) as c:
            return await c.collect("Logs", {"id": self.id, "tail": tail, "since": since, "until": until})

    async def log_stream(self, *, follow: bool = True, tail: int = 0) -> AsyncGenerator[dict[str, Any], None]:
        async with (
            connect(self.socket) as c,
            c.open_call("Logs", {"id": self.id, "follow": follow, "tail": tail}) as call,
        ):
            async for entry in call:
                yield entry

    async def events(self, action: str = "") -> AsyncGenerator[dict[str, Any], None]:
        async with connect(self.socket) as c, c.open_call("Events", {"id": self.id, "action": action}) as call:
            async for e in call:
                yield e

    # -- work --------------------------------------------------------------------
    def _run_body(
        self,
        cmd: builtins.list[str] | str,
        env: dict[str, str] | None,
        workdir: str,
        user: str,
        tty: bool,
        timeout: int,
    ) -> dict[str, Any]:
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return {
            "id": self.id,
            "cmd": argv,
            "env": _kv(env),
            "working_dir": workdir,
            "user": user,
            "tty": tty,
            "timeout_seconds": timeout,
        }

    async def run_stream(
        self,
        cmd: builtins.list[str] | str,
        *,
        env: dict[str, str] | None = None,
        workdir: str = "",
        user: str = "",
        tty: bool = False,
        timeout: int = 0,
    ) -> AsyncGenerator[Output, None]:
        """Run a workload, streaming its output; the last Output is ("exit", b"", code).
        A string is run with ``sh -c``."""
        async with (
            connect(self.socket) as c,
            c.open_call("Run", self._run_body(cmd, env, workdir, user, tty, timeout)) as call,
        ):
            async for item in call:
                if item.get("done"):
                    yield Output("exit", b"", int(item["exit_code"]))
                else:
                    yield Output(item["stream"], item["data"])

    async def run(self, cmd: builtins.list[str] | str, **kw: Any) -> RunResult:
        out, err, code = bytearray(), bytearray(), -1
        async with aclosing(self.run_stream(cmd, **kw)) as outputs:
            async for o in outputs:
                if o.stream == "stdout":
                    out += o.data
                elif o.stream == "stderr":
                    err += o.data
                else:
                    code = o.exit_code if o.exit_code is not None else -1
        return RunResult(bytes(out), bytes(err), code)

    @asynccontextmanager
    async def exec(
        self,
        cmd: builtins.list[str] | str,
        *,
        env: dict[str, str] | None = None,
        workdir: str = "",
        user: str = "",
        tty: bool = False,
        size: tuple[int, int] = (80, 24),
        timeout: int = 0,
    ) -> AsyncIterator[AsyncExec]:
        """An interactive process (stdin, optional PTY and resize). Leaving the block
        before it exited kills it."""
        init = self._run_body(cmd, env, workdir, user, tty, timeout)
        init["tty_size"] = {"width": size[0], "height": size[1]}
        async with connect(self.socket) as c, c.open_call("Exec", {"init": init}) as call:
            yield AsyncExec(call)

    # -- ports -----------------------------------------------------------------
    async def expose(self, sandbox_port: int, host_port: int = 0, *, udp: bool = False) -> int:
        """Forward a host port (on the supervisor's loopback) to ``sandbox_port``; returns it."""
        r = await self._call(
            "ExposePort", {"sandbox_port": sandbox_port, "host_port": host_port, "protocol": "udp" if udp else "tcp"}
        )
        return int(r["host_port"])

    async def unexpose(self, sandbox_port: int, *, udp: bool = False) -> None:
        await self._call("UnexposePort", {"sandbox_port": sandbox_port, "protocol": "udp" if udp else "tcp"})

    async def ports(self) -> builtins.list[dict[str, Any]]:
        """The port mappings: ``{sandbox_port, host_port, protocol, host_address}`` each
        (a restored sandbox's carried ones with the host ports it got)."""
        return list((await self._call("ListPorts"))["ports"])

    # -- snapshots (SandboxSnapshotService) ------------------------------------
    async def checkpoint(self, name: str = "", *, labels: dict[str, str] | None = None) -> str:
        """Snapshot this (ready) sandbox; returns the snapshot id."""
        async with connect(self.socket) as c:
            r = await c.call("Checkpoint", {"sandbox_id": self.id, "name": name, "labels": _kv(labels)})
        return str(r["snapshot_id"])

    @classmethod
    async def restore(
        cls,
        snapshot_id: str,
        *,
        name: str = "",
        labels: dict[str, str] | None = None,
        ttl: int = 0,
        network_override: bool = False,
        detached: bool = False,
        socket: str | Path | None = None,
    ) -> AsyncSandbox:
        """A new sandbox from a snapshot (id, or a unique snapshot name), ready when this
        returns. As a context manager it is removed on exit unless ``detached``. A tap
        clone keeps the snapshot's address when it is free, unless ``network_override``."""
        async with connect(socket) as c:
            body = {"snapshot_id": snapshot_id, "id": name, "labels": _kv(labels), "ttl_seconds": ttl}
            r = await c.call("Restore", {**body, "network_override": network_override})
        return cls(r["id"], socket=socket, detached=detached)

    @classmethod
    async def snapshots(
        cls, *, sandbox: str = "", labels: dict[str, str] | None = None, socket: str | Path | None = None
    ) -> builtins.list[dict[str, Any]]:
        """Snapshots, oldest first; filtered by origin sandbox id and labels (all must match)."""
        async with connect(socket) as c:
            return list((await c.call("ListSnapshots", {"sandbox_id": sandbox, "labels": _kv(labels)}))["snapshots"])

    @classmethod
    async def delete_snapshot(cls, snapshot_id: str, *, socket: str | Path | None = None) -> None:
        async with connect(socket) as c:
            await c.call("DeleteSnapshot", {"snapshot_id": snapshot_id})

    async def attach(
        self,
        cmd: builtins.list[str] | str,
        *,
        tty: bool | None = None,
        env: dict[str, str] | None = None,
        workdir: str = "",
        user: str = "",
        stdin_fd: int = 0,
        stdout_fd: int = 1,
        stderr_fd: int = 2,
    ) -> int:
        """Bridge the caller's terminal (or fds) to a process in the sandbox: raw mode
        and window-size changes when stdin is a terminal. Returns the exit code."""
        use_tty = os.isatty(stdin_fd) if tty is None else tty
        size = os.get_terminal_size(stdout_fd) if os.isatty(stdout_fd) else os.terminal_size((80, 24))
        raw = use_tty and os.isatty(stdin_fd)
        old = termios.tcgetattr(stdin_fd) if raw else None
        try:
            if raw:
                tty_mod.setraw(stdin_fd)
            with collapse_single():
                async with (
                    self.exec(
                        cmd, tty=use_tty, size=(size.columns, size.lines), env=env, workdir=workdir, user=user
                    ) as proc,
                    trio.open_nursery() as n,
                ):

                    async def pump_stdin() -> None:
                        async with trio.lowlevel.FdStream(os.dup(stdin_fd)) as stdin:
                            while data := await stdin.receive_some(65536):
                                await proc.send(data)
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
        assert proc.exit_code is not None
        return proc.exit_code

    async def shell(self, shell: str = "/bin/sh") -> int:
        """An interactive shell on the caller's terminal."""
        return await self.attach([shell], tty=True)


# --- sync ---------------------------------------------------------------------


def _sync_iter(agen_factory: Callable[[], AsyncGenerator[T_, None]], buffer: int = 64) -> Iterator[T_]:
    """Drive an async iterator in a Trio thread; yield its items here. Closing the
    generator (break, exception) cancels the Trio side."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue(buffer)
    token_box: builtins.list[trio.lowlevel.TrioToken] = []
    scope_box: builtins.list[trio.CancelScope] = []
    started = threading.Event()

    async def pump() -> None:
        token_box.append(trio.lowlevel.current_trio_token())
        with trio.CancelScope() as scope:
            scope_box.append(scope)
            started.set()
            try:
                # aclosing: the generator holds a connection's nursery across its yields; it
                # must be closed here, in this task, before this cancel scope exits
                async with aclosing(agen_factory()) as agen:
                    async for item in agen:
                        await trio.to_thread.run_sync(q.put, ("item", item), abandon_on_cancel=True)
                q.put(("end", None))
            except BaseException as exc:
                q.put(("error", exc))
                if not isinstance(exc, Exception):
                    raise

    t = threading.Thread(target=trio.run, args=(pump,), daemon=True)
    t.start()
    started.wait()
    try:
        while True:
            kind, value = q.get()
            if kind == "item":
                yield value
            elif kind == "end":
                return
            else:
                raise value
    finally:
        if t.is_alive():
            try:
                trio.from_thread.run_sync(scope_box[0].cancel, trio_token=token_box[0])
            except trio.RunFinishedError:
                pass
            while t.is_alive():
                try:
                    q.get(timeout=0.05)
                except queue.Empty:
                    pass
            t.join()


class FS:
    def __init__(self, sb: Sandbox) -> None:
        self._a = sb._a

    def read(self, path: str) -> bytes:
        return trio.run(self._a.fs.read, path)

    def write(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        trio.run(functools.partial(self._a.fs.write, path, data, mode=mode))

    def copy_in(self, local: str | Path, path: str) -> None:
        trio.run(self._a.fs.copy_in, local, path)

    def copy_out(self, path: str, local: str | Path) -> None:
        trio.run(self._a.fs.copy_out, path, local)


class Sandbox:
    """The synchronous SDK: the surface of :class:`AsyncSandbox`, blocking."""

    def __init__(self, a: AsyncSandbox) -> None:
        self._a = a
        self.fs = FS(self)

    @property
    def id(self) -> str:
        return self._a.id

    @property
    def detached(self) -> bool:
        return self._a.detached

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    @classmethod
    def create(cls, name: str = "", **kw: Any) -> Sandbox:
        return cls(trio.run(functools.partial(AsyncSandbox.create, name, **kw)))

    @classmethod
    def get(cls, name: str, *, socket: str | Path | None = None) -> Sandbox:
        return cls(trio.run(functools.partial(AsyncSandbox.get, name, socket=socket)))

    @classmethod
    def list(cls, **kw: Any) -> Page:
        return trio.run(functools.partial(AsyncSandbox.list, **kw))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        trio.run(self._a.__aexit__, None, None, None)

    def _do(self, fn: Callable[..., Awaitable[T_]], *args: Any, **kw: Any) -> T_:
        return trio.run(functools.partial(fn, *args, **kw))

    def inspect(self) -> dict[str, Any]:
        return self._do(self._a.inspect)

    def state(self) -> str:
        return self._do(self._a.state)

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        return self._do(self._a.wait_ready, timeout)

    def stop(self, timeout: int = 0) -> None:
        self._do(self._a.stop, timeout)

    def kill(self) -> None:
        self._do(self._a.kill)

    def drain(self) -> None:
        self._do(self._a.drain)

    def wait_until_stopped(self) -> dict[str, Any]:
        return self._do(self._a.wait_until_stopped)

    def start(self, *, wait: bool = True, timeout: float = 120.0) -> None:
        self._do(self._a.start, wait=wait, timeout=timeout)

    def remove(self, *, force: bool = False) -> None:
        self._do(self._a.remove, force=force)

    def ping(self) -> float:
        return self._do(self._a.ping)

    def touch(self) -> int:
        return self._do(self._a.touch)

    def metrics(self) -> dict[str, Any]:
        return self._do(self._a.metrics)

    def metrics_stream(self, interval: float = 1.0) -> Iterator[dict[str, Any]]:
        return _sync_iter(lambda: self._a.metrics_stream(interval))

    def logs(self, **kw: Any) -> builtins.list[dict[str, Any]]:
        return self._do(self._a.logs, **kw)

    def log_stream(self, *, follow: bool = True, tail: int = 0) -> Iterator[dict[str, Any]]:
        return _sync_iter(lambda: self._a.log_stream(follow=follow, tail=tail))

    def events(self, action: str = "") -> Iterator[dict[str, Any]]:
        return _sync_iter(lambda: self._a.events(action))

    def run(self, cmd: builtins.list[str] | str, **kw: Any) -> RunResult:
        return self._do(self._a.run, cmd, **kw)

    def run_stream(self, cmd: builtins.list[str] | str, **kw: Any) -> Iterator[Output]:
        return _sync_iter(lambda: self._a.run_stream(cmd, **kw))

    def attach(self, cmd: builtins.list[str] | str, **kw: Any) -> int:
        return self._do(self._a.attach, cmd, **kw)

    def expose(self, sandbox_port: int, host_port: int = 0, *, udp: bool = False) -> int:
        return self._do(self._a.expose, sandbox_port, host_port, udp=udp)

    def unexpose(self, sandbox_port: int, *, udp: bool = False) -> None:
        self._do(self._a.unexpose, sandbox_port, udp=udp)

    def ports(self) -> builtins.list[dict[str, Any]]:
        return self._do(self._a.ports)

    def checkpoint(self, name: str = "", **kw: Any) -> str:
        return self._do(self._a.checkpoint, name, **kw)

    @classmethod
    def restore(cls, snapshot_id: str, **kw: Any) -> Sandbox:
        return cls(trio.run(functools.partial(AsyncSandbox.restore, snapshot_id, **kw)))

    @classmethod
    def snapshots(cls, **kw: Any) -> builtins.list[dict[str, Any]]:
        return trio.run(functools.partial(AsyncSandbox.snapshots, **kw))

    @classmethod
    def delete_snapshot(cls, snapshot_id: str, **kw: Any) -> None:
        trio.run(functools.partial(AsyncSandbox.delete_snapshot, snapshot_id, **kw))

    def shell(self, shell: str = "/bin/sh") -> int:
        return self._do(self._a.shell, shell)
