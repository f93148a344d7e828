"""The Python SDK of sandvisor, and the client side of its Unix-socket protocol.

``from supervisor.client import Sandbox, AsyncSandbox``: the same surface, sync and
Trio-async. Requests are the protocol module's typed classes; results are typed
values with attributes (:class:`SandboxInfo`, :class:`Page` of :class:`SandboxSummary`,
:class:`MetricsResponse`, :class:`SnapshotSummary`, :class:`CheckpointResponse`,
:class:`LogEntry`, :class:`SandboxEvent`). Failures raise subclasses of
:class:`SandboxError` named after the seed's codes (:class:`NotFound`,
:class:`InvalidArgument`, ...).

A sandbox is described by a :class:`SandboxSpec` (grouped: :class:`Resources`,
:class:`Workload`, :class:`Network`, :class:`Lifetime`, :class:`Boot`), reusable
and frozen; the common settings are also keyword arguments of ``create``, applied
on top of the spec (maps merge, the rest replaces)::

    async with await AsyncSandbox.create("web", cpus=2, env={"A": "1"}) as sb:
        r = await sb.run("echo $A")
        info = await sb.inspect()          # info.state == "ready"

    spec = SandboxSpec(resources=Resources(cpus=2, memory_mib=1024), lifetime=Lifetime(ttl=600))
    workers = [await AsyncSandbox.create(f"w{i}", spec, labels={"n": str(i)}) for i in range(4)]

Below them, :func:`connect` gives an :class:`AsyncConnection`: unary calls, server
streams and bidirectional streams multiplexed on one socket, with the wire's maps as
bodies (the protocol-level API); frames travel on :class:`supervisor.frames.FramedStream`.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import queue
import signal
import termios
import threading
import tty as tty_mod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, Literal, TypedDict, TypeVar, Unpack

import attrs
import trio

from supervisor import protocol as W
from supervisor.config import UnsafeRuntimeDir, check_runtime_dir, default_socket
from supervisor.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SandboxError,
    Unavailable,
    Unimplemented,
    collapse_single,
    error_for,
)
from supervisor.frames import FramedStream
from supervisor.protocol import (
    ApiError,
    CheckpointResponse,
    LogEntry,
    MetricsResponse,
    OciImageInfo,
    PruneImagesResponse,
    PullImageProgress,
    RemoveImageResponse,
    SandboxEvent,
    SandboxInfo,
    SandboxSummary,
    SnapshotSummary,
    VolumeInfo,
)

__all__ = [
    "AlreadyExists",
    "AsyncConnection",
    "AsyncExec",
    "AsyncImages",
    "AsyncSandbox",
    "AsyncVolumes",
    "Boot",
    "CallStream",
    "Cancelled",
    "CheckpointResponse",
    "DeadlineExceeded",
    "Egress",
    "FailedPrecondition",
    "Images",
    "Internal",
    "InvalidArgument",
    "Lifetime",
    "LogEntry",
    "MetricsResponse",
    "Network",
    "NotFound",
    "OciImageInfo",
    "Output",
    "Page",
    "Patch",
    "PermissionDenied",
    "PruneImagesResponse",
    "PullImageProgress",
    "RemoveImageResponse",
    "ResourceExhausted",
    "Resources",
    "RunResult",
    "RunSettings",
    "Sandbox",
    "SandboxError",
    "SandboxEvent",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxSummary",
    "Settings",
    "SnapshotRef",
    "SnapshotSummary",
    "Unavailable",
    "Unimplemented",
    "VolumeInfo",
    "VolumeMount",
    "Volumes",
    "Workload",
    "connect",
    "error_for",
    "images",
    "parse_size",
]

T_ = TypeVar("T_")
B = TypeVar("B")


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
    """One connection to the supervisor: calls multiplexed by id, bodies as the wire's maps.

    A reader task (started by :func:`connect`) routes each incoming envelope to its
    call's channel; any task may open calls."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.frames = FramedStream(stream)
        self.calls: dict[int, CallStream] = {}
        self.next_id = 1
        self.closed = False

    async def _send(self, msg: W.Envelope) -> None:
        await self.frames.send(msg)

    async def _hello(self) -> None:
        await self._send(W.ClientHello(W.PROTOCOL_VERSION, "sandvisor-client"))
        msg = await self.frames.receive()
        if isinstance(msg, W.Fail):
            raise error_for(msg.code, msg.message)
        if not isinstance(msg, W.ServerHello):
            raise ApiError(W.UNAVAILABLE, "the supervisor did not answer the hello")

    async def _reader(self) -> None:
        try:
            while True:
                msg = await self.frames.receive()
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
    default = default_socket()
    path = default if path is None else Path(path)
    if path == default:
        try:
            check_runtime_dir(path)
        except UnsafeRuntimeDir as exc:
            raise error_for(W.FAILED_PRECONDITION, str(exc)) from None
    sock_path = str(path)
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


async def _unary(c: AsyncConnection, method: str, request: Any, result: type[B]) -> B:
    """A typed call: ``request`` unstructured by the protocol's converter, the reply
    structured into ``result``."""
    return _structure(await c.call(method, W.unstructure_body(request)), result, method)


def _structure(body: dict[str, Any], cls: type[B], method: str) -> B:
    try:
        return W.structure_body(body, cls)
    except ApiError as exc:  # the supervisor answered something this SDK does not read
        raise error_for(W.INTERNAL, f"unexpected answer to {method}: {exc.message}") from None


# ---------------------------------------------------------------------------
# what a sandbox is: the spec
# ---------------------------------------------------------------------------


def _kv(d: Mapping[str, str] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (d or {}).items()}


def _ports(d: Mapping[int, int] | None) -> dict[int, int]:
    return {int(k): int(v) for k, v in (d or {}).items()}


def _argv(cmd: Sequence[str] | None) -> tuple[str, ...]:
    if isinstance(cmd, str):
        raise TypeError("cmd is a sequence of arguments (a string would be split into characters)")
    return tuple(cmd or ())


@attrs.frozen(kw_only=True)
class Resources:
    """vCPUs and guest RAM; 0 takes the supervisor's default."""

    cpus: int = 0
    memory_mib: int = 0


@attrs.frozen(kw_only=True)
class Workload:
    """The sandbox's initial command (none: it waits for runs), and the environment,
    working directory and user that its runs and execs inherit."""

    cmd: tuple[str, ...] = attrs.field(default=(), converter=_argv)
    env: dict[str, str] = attrs.field(factory=dict, converter=_kv)
    workdir: str = ""
    user: str = ""


@attrs.frozen(kw_only=True)
class Egress:
    """Where the sandbox may connect to (tap, and user mode with ``outbound``): entries
    are CIDRs, addresses, ``host:port`` (port ranges ``lo-hi``) and domain names
    (``example.com``, ``*.example.com``, optionally ``:port``); ``default`` is what no
    entry matches. The host, other sandboxes' exposed ports and 169.254.0.0/16 are
    never reachable, whatever the policy (docs/network.md)."""

    default: Literal["allow", "deny"] = "allow"
    allow: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    deny: tuple[str, ...] = attrs.field(default=(), converter=tuple)


def _to_egress(v: Egress | Mapping[str, Any] | None) -> Egress | None:
    """An Egress, or the same as a dict (``{"default": "deny", "allow": [...]}``)."""
    if v is None or isinstance(v, Egress):
        return v
    return Egress(default=v.get("default", "allow"), allow=v.get("allow", ()), deny=v.get("deny", ()))


@attrs.frozen(kw_only=True)
class Network:
    """``mode``: "none" (no network device), "tap" (an address of the supervisor's IP
    pool; root supervisors), "user" (QEMU user networking: exposed ports only, unless
    ``outbound``) or "outbound" (user mode that may reach out, as ``outbound=True``).
    ``egress``: where it may connect to (None: anywhere but the host). ``ports``:
    sandbox port -> host port on the supervisor's loopback (host port 0: any free port)."""

    mode: Literal["none", "tap", "user", "outbound"] = "none"
    outbound: bool = False
    egress: Egress | None = attrs.field(default=None, converter=_to_egress)
    ports: dict[int, int] = attrs.field(factory=dict, converter=_ports)

    def spec(self) -> W.NetworkSpec:
        mode, outbound = ("user", True) if self.mode == "outbound" else (self.mode, self.outbound)
        eg = self.egress
        egress = None if eg is None else W.EgressSpec(eg.default, list(eg.allow), list(eg.deny))
        return W.NetworkSpec(mode=mode, outbound=outbound, egress=egress)


@attrs.frozen(kw_only=True)
class Lifetime:
    """``ttl``: seconds until the sandbox is removed; ``idle_timeout``: seconds without
    activity until it stops; ``ephemeral``: removed once it stops. 0/False: never."""

    ttl: int = 0
    idle_timeout: int = 0
    ephemeral: bool = False


@attrs.frozen(kw_only=True)
class Boot:
    """What boots: empty fields take the supervisor's default image. ``image``: an OCI
    image reference as skopeo spells it (``docker://HOST/NAME:TAG``, ``oci:DIR``, ...),
    pulled by ``pull`` policy ("always", "if-missing" (""), "never"); ``tls_verify=False``
    for a plain-HTTP registry. Private registries: pull first with :class:`Images`."""

    image: str = ""
    pull: Literal["", "always", "if-missing", "never"] = ""
    tls_verify: bool | None = None
    kernel: str = ""
    rootfs: str = ""
    boot_args: str = ""


@attrs.frozen(kw_only=True)
class Patch:
    """A change to the sandbox's file system that guestd makes once, on its fresh disk,
    before it is ready and before its command runs. Build with the class methods;
    ``owner`` is user[:group] by the guest's names or ids ("" = root)."""

    op: str
    path: str
    data: bytes = b""
    target: str = ""
    mode: int | None = None
    owner: str = ""
    replace: bool = False

    @classmethod
    def file(
        cls, path: str, data: bytes | str, *, mode: int | None = None, owner: str = "", replace: bool = False
    ) -> Patch:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        return cls(op="file", path=path, data=raw, mode=mode, owner=owner, replace=replace)

    @classmethod
    def append(cls, path: str, data: bytes | str, *, mode: int | None = None, owner: str = "") -> Patch:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        return cls(op="append", path=path, data=raw, mode=mode, owner=owner)

    @classmethod
    def mkdir(cls, path: str, *, mode: int | None = None, owner: str = "") -> Patch:
        return cls(op="mkdir", path=path, mode=mode, owner=owner)

    @classmethod
    def remove(cls, path: str) -> Patch:
        return cls(op="remove", path=path)

    @classmethod
    def symlink(cls, target: str, link: str, *, owner: str = "", replace: bool = False) -> Patch:
        return cls(op="symlink", path=link, target=target, owner=owner, replace=replace)

    def spec(self) -> W.PatchSpec:
        return W.PatchSpec(self.op, self.path, self.data, self.target, self.mode, self.owner, self.replace)


@attrs.frozen
class VolumeMount:
    """Named volume ``name`` mounted at ``path``; ``VolumeMount.parse("NAME:/path[:ro]")``."""

    name: str
    path: str
    read_only: bool = False

    @classmethod
    def parse(cls, text: str) -> VolumeMount:
        name, sep, rest = text.partition(":")
        path, _, flag = rest.partition(":")
        if not sep or not name or not path.startswith("/") or flag not in ("", "ro", "rw"):
            raise InvalidArgument(W.INVALID_ARGUMENT, f"volume {text!r}: NAME:/path[:ro]")
        return cls(name, path, flag == "ro")


def _patches(v: Sequence[Patch] | None) -> tuple[Patch, ...]:
    return tuple(v or ())


def _mounts(v: Sequence[VolumeMount | str] | None) -> tuple[VolumeMount, ...]:
    return tuple(m if isinstance(m, VolumeMount) else VolumeMount.parse(m) for m in v or ())


class Settings(TypedDict, total=False):
    """The common settings, as keyword arguments of ``create`` and :meth:`SandboxSpec.with_`."""

    cpus: int
    memory_mib: int
    env: Mapping[str, str]
    labels: Mapping[str, str]
    cmd: Sequence[str]
    workdir: str
    user: str
    hostname: str
    network: Literal["none", "tap", "user", "outbound"]
    outbound: bool
    egress: Egress | Mapping[str, Any] | None
    ports: Mapping[int, int]
    ttl: int
    idle_timeout: int
    ephemeral: bool
    image: str
    pull: Literal["", "always", "if-missing", "never"]
    tls_verify: bool
    patches: Sequence[Patch]
    volumes: Sequence[VolumeMount | str]
    scripts: Mapping[str, str]


@attrs.frozen(kw_only=True)
class SandboxSpec:
    """Everything a sandbox is made of, grouped; frozen and reusable (a template for
    many sandboxes). ``spec.with_(cpus=2, env={...})`` is a copy with settings applied:
    maps (env, labels, ports) merge, everything else replaces."""

    labels: dict[str, str] = attrs.field(factory=dict, converter=_kv)
    hostname: str = ""
    resources: Resources = Resources()
    workload: Workload = Workload()
    network: Network = Network()
    lifetime: Lifetime = Lifetime()
    boot: Boot = Boot()
    patches: tuple[Patch, ...] = attrs.field(default=(), converter=_patches)
    volumes: tuple[VolumeMount, ...] = attrs.field(default=(), converter=_mounts)
    # named scripts (name -> body; no "#!": /bin/sh), run by name: run_script(name, *args)
    scripts: dict[str, str] = attrs.field(factory=dict, converter=_kv)

    def with_(self, **settings: Unpack[Settings]) -> SandboxSpec:
        if not settings:
            return self
        s = settings
        wl, net, life, res, boot = self.workload, self.network, self.lifetime, self.resources, self.boot
        return attrs.evolve(
            self,
            boot=attrs.evolve(
                boot,
                image=s.get("image", boot.image),
                pull=s.get("pull", boot.pull),
                tls_verify=s.get("tls_verify", boot.tls_verify),
            ),
            labels={**self.labels, **_kv(s.get("labels"))},
            hostname=s.get("hostname", self.hostname),
            resources=Resources(cpus=s.get("cpus", res.cpus), memory_mib=s.get("memory_mib", res.memory_mib)),
            workload=Workload(
                cmd=s.get("cmd", wl.cmd),
                env={**wl.env, **_kv(s.get("env"))},
                workdir=s.get("workdir", wl.workdir),
                user=s.get("user", wl.user),
            ),
            network=Network(
                mode=s.get("network", net.mode),
                outbound=s.get("outbound", net.outbound),
                egress=s.get("egress", net.egress),
                ports={**net.ports, **_ports(s.get("ports"))},
            ),
            lifetime=Lifetime(
                ttl=s.get("ttl", life.ttl),
                idle_timeout=s.get("idle_timeout", life.idle_timeout),
                ephemeral=s.get("ephemeral", life.ephemeral),
            ),
            patches=s.get("patches", self.patches),
            volumes=_mounts(s.get("volumes", self.volumes)),
            scripts={**self.scripts, **_kv(s.get("scripts"))},
        )

    def request(self, name: str = "") -> W.CreateSandboxRequest:
        """The wire's Create request for a sandbox called ``name`` ("": the supervisor names it)."""
        return W.CreateSandboxRequest(
            id=name,
            labels=dict(self.labels),
            image=self.boot.image,
            image_pull=self.boot.pull,
            image_tls_verify=self.boot.tls_verify,
            kernel=self.boot.kernel,
            rootfs=self.boot.rootfs,
            boot_args=self.boot.boot_args,
            limits=W.ResourceLimits(vcpus=self.resources.cpus, memory_mib=self.resources.memory_mib),
            cmd=list(self.workload.cmd),
            env=dict(self.workload.env),
            working_dir=self.workload.workdir,
            user=self.workload.user,
            network=self.network.spec(),
            ports=[W.PortMapping(sandbox_port=g, host_port=h, protocol="tcp") for g, h in self.network.ports.items()],
            ttl_seconds=self.lifetime.ttl,
            idle_timeout_seconds=self.lifetime.idle_timeout,
            hostname=self.hostname,
            ephemeral=self.lifetime.ephemeral,
            patches=[p.spec() for p in self.patches],
            volumes=[W.VolumeMount(m.name, m.path, m.read_only) for m in self.volumes],
            scripts=dict(self.scripts),
        )


# ---------------------------------------------------------------------------
# results
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
    """One page of List, newest first; ``next_cursor`` ("" on the last page) asks for the next."""

    sandboxes: list[SandboxSummary]
    next_cursor: str


SnapshotRef = str | CheckpointResponse | SnapshotSummary
"""A snapshot: its id, a unique snapshot name, or what Checkpoint or ListSnapshots gave."""


def _snapshot_id(ref: SnapshotRef) -> str:
    if isinstance(ref, CheckpointResponse):
        return ref.snapshot_id
    if isinstance(ref, SnapshotSummary):
        return ref.id
    return ref


class RunSettings(TypedDict, total=False):
    """How a run or exec runs: env (on top of the sandbox's), workdir, user, tty, timeout (s)."""

    env: Mapping[str, str]
    workdir: str
    user: str
    tty: bool
    timeout: int


def _output(item: W.RunOutput) -> Output:
    return Output("exit", b"", item.exit_code) if item.done else Output(item.stream, item.data)


# ---------------------------------------------------------------------------
# the SDK
# ---------------------------------------------------------------------------


class AsyncExec:
    """An interactive process: ``send``/``close_stdin``/``resize``, iterate its Output."""

    def __init__(self, call: CallStream) -> None:
        self._call = call
        self.exit_code: int | None = None

    async def _input(self, msg: W.ExecInput) -> None:
        await self._call.send(W.unstructure_body(msg))

    async def send(self, data: bytes) -> None:
        await self._input(W.ExecInput(stdin=bytes(data)))

    async def close_stdin(self) -> None:
        await self._input(W.ExecInput(close_stdin=True))

    async def resize(self, width: int, height: int) -> None:
        await self._input(W.ExecInput(resize=W.TerminalSize(width=width, height=height)))

    def __aiter__(self) -> AsyncIterator[Output]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[Output]:
        async for item in self._call:
            o = _output(_structure(item, W.ExecOutput, "Exec"))
            if o.exit_code is not None:
                self.exit_code = o.exit_code
                yield o
                return
            yield o

    async def wait(self) -> int:
        async for _ in self:
            pass
        assert self.exit_code is not None
        return self.exit_code


class AsyncFS:
    """Files in the sandbox (absolute paths); ``write`` streams in 1 MiB chunks."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    async def read(self, path: str) -> bytes:
        async with connect(self._sb.socket) as c:
            chunks = await c.collect("ReadFile", W.unstructure_body(W.ReadFileRequest(id=self._sb.id, path=path)))
        return b"".join(_structure(ch, W.FileChunk, "ReadFile").data for ch in chunks)

    async def write(self, path: str, data: bytes | AsyncIterator[bytes], *, mode: int = 0o644) -> None:
        opening = W.WriteFileRequest(open=W.WriteFileOpen(id=self._sb.id, path=path, mode=mode))
        async with connect(self._sb.socket) as c, c.open_call("WriteFile", W.unstructure_body(opening)) as call:

            async def chunk(piece: bytes = b"", done: bool = False) -> None:
                await call.send(W.unstructure_body(W.WriteFileRequest(chunk=W.FileChunk(data=piece, done=done))))

            if isinstance(data, (bytes, bytearray, memoryview)):
                view = memoryview(data)
                for i in range(0, len(view), 1 << 20):
                    await chunk(bytes(view[i : i + (1 << 20)]))
            else:
                async for piece in data:
                    await chunk(bytes(piece))
            await chunk(done=True)
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
        """``cp box:/path DEST``: the sandbox's file ``path`` into the host file ``local``.
        ``local`` naming a directory (a symlink to one too, as ``cp`` follows it; the
        kernel's protected_symlinks rule applies) means ``local/<basename of path>``.
        The file is written to a new, unpredictable name in the target directory
        (O_CREAT|O_EXCL|O_NOFOLLOW, mode 0666 & ~umask) and renamed into place when whole:
        whatever is at the final name (a file, a symlink a guest's tree or another
        user planted) is replaced, never written through or followed; nothing is left
        behind on a failure."""
        from supervisor.treecopy import commit_temp, create_temp, open_target

        dfd, name = await trio.to_thread.run_sync(open_target, os.fspath(local), path)
        try:
            tmp, fd = await trio.to_thread.run_sync(create_temp, dfd, name)
            done = False
            try:
                req = W.unstructure_body(W.ReadFileRequest(id=self._sb.id, path=path))
                with open(fd, "wb", closefd=True) as f:
                    async with connect(self._sb.socket) as c, c.open_call("ReadFile", req) as call:
                        async for ch in call:
                            await trio.to_thread.run_sync(f.write, _structure(ch, W.FileChunk, "ReadFile").data)
                await trio.to_thread.run_sync(commit_temp, dfd, tmp, name)
                done = True
            finally:
                if not done:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=dfd)
        finally:
            os.close(dfd)

    async def copy_tree_in(self, local: str | Path, path: str, *, owner: str = "") -> int:
        """``cp -r DIR box:/path``: the host directory ``local`` into the sandbox's
        directory ``path`` (made if missing; existing directories merged, files
        replaced) as one tar stream packed here, with the caller's rights: modes,
        mtimes, symlinks, hard links, empty directories. ``owner`` "": every entry
        keeps its numeric uid/gid; else user[:group] (the guest's names) owns all.
        Returns the number of entries written."""
        from supervisor.treecopy import packed_tree  # (tarfile: imported when used)

        opening = W.WriteTreeRequest(open=W.WriteTreeOpen(id=self._sb.id, path=path, owner=owner))
        async with (
            packed_tree(Path(local)) as chunks,
            connect(self._sb.socket) as c,
            c.open_call("WriteTree", W.unstructure_body(opening)) as call,
        ):
            async for piece in chunks:
                await call.send(W.unstructure_body(W.WriteTreeRequest(chunk=W.FileChunk(data=piece))))
            await call.send(W.unstructure_body(W.WriteTreeRequest(chunk=W.FileChunk(done=True))))
            await call.half_close()
            return _structure(await call.result(), W.WriteTreeResponse, "WriteTree").entries

    async def copy_tree_out(self, path: str, local: str | Path, *, keep_owners: bool = False) -> int:
        """``cp -r box:/path DIR``: the sandbox's directory ``path`` into the host
        directory ``local`` (made if missing; the guest directory's mode and mtime
        become its own) as one tar stream, unpacked here by guestd's hostile-stream
        unpacker (no absolute names, '..', writes through symlinks, devices,
        setuid bits). ``keep_owners``: the guest's numeric owners (root only); else
        the files are the caller's. Returns the number of entries."""
        from supervisor.treecopy import unpack_tree

        dest = Path(local)
        await trio.to_thread.run_sync(functools.partial(dest.parent.mkdir, parents=True, exist_ok=True))
        try:  # a DEST that was there keeps its mode, owner and times (as every directory in it)
            await trio.to_thread.run_sync(dest.mkdir)
            made = True
        except FileExistsError:
            made = False
        req = W.unstructure_body(W.ReadTreeRequest(id=self._sb.id, path=path))
        async with connect(self._sb.socket) as c, c.open_call("ReadTree", req) as call:

            async def chunks() -> AsyncIterator[bytes]:
                async for item in call:
                    ch = _structure(item, W.FileChunk, "ReadTree")
                    if ch.data:
                        yield ch.data
                    if ch.done:
                        return
                raise ApiError(W.UNAVAILABLE, "the tree stream ended early")

            return await unpack_tree(chunks(), dest, keep_ids=keep_owners, root_meta=made)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(size: int | str) -> int:
    """Bytes: an int, or "256M", "1G", "512MiB", "1024" (bytes)."""
    if isinstance(size, int):
        return size
    text = size.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    number = text[: len(text) - len(unit)] if unit else text
    try:
        value = float(number)
    except ValueError:
        raise InvalidArgument(W.INVALID_ARGUMENT, f"size {size!r}: a number with K, M, G or T") from None
    return int(value * _UNITS[unit])


async def _outputs(items: AsyncGenerator[W.RunOutput, None]) -> AsyncGenerator[Output, None]:
    async with aclosing(items):
        async for item in items:
            yield _output(item)


class AsyncVolumes:
    """The named volumes of a supervisor (Trio): persistent ext4 disks a Create mounts
    (``volumes=["NAME:/path", "NAME:/path:ro"]``), read-write in one live sandbox at a
    time, read-only in many; they outlive the sandboxes."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self.socket = str(socket or default_socket())

    async def _unary(self, method: str, request: Any, result: type[B]) -> B:
        async with connect(self.socket) as c:
            return await _unary(c, method, request, result)

    async def create(
        self, name: str, size: int | str = "256M", *, labels: Mapping[str, str] | None = None
    ) -> VolumeInfo:
        mib = -(-parse_size(size) // (1 << 20))
        req = W.CreateVolumeRequest(name=name, size_mib=mib, labels=dict(labels or {}))
        return await self._unary("CreateVolume", req, VolumeInfo)

    async def get(self, name: str) -> VolumeInfo:
        return await self._unary("InspectVolume", W.NameRequest(name=name), VolumeInfo)

    async def list(self, *, labels: Mapping[str, str] | None = None) -> builtins.list[VolumeInfo]:
        req = W.ListVolumesRequest(labels=dict(labels or {}))
        return (await self._unary("ListVolumes", req, W.ListVolumesResponse)).volumes

    async def remove(self, name: str) -> None:
        """FAILED_PRECONDITION while a live sandbox mounts it."""
        await self._unary("DeleteVolume", W.DeleteVolumeRequest(name=name), W.Empty)


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

    async def _unary(self, method: str, request: Any, result: type[B]) -> B:
        async with connect(self.socket) as c:
            return await _unary(c, method, request, result)

    async def _stream(self, method: str, request: Any, item: type[B]) -> AsyncGenerator[B, None]:
        async with connect(self.socket) as c, c.open_call(method, W.unstructure_body(request)) as call:
            async for body in call:
                yield _structure(body, item, method)

    # -- creation and lookup -------------------------------------------------------
    @classmethod
    async def create(
        cls,
        name: str = "",
        spec: SandboxSpec | None = None,
        *,
        socket: str | Path | None = None,
        replace: bool = False,
        detached: bool = False,
        wait: bool = True,
        timeout: float = 120.0,
        **settings: Unpack[Settings],
    ) -> AsyncSandbox:
        """Create a sandbox from ``spec`` with ``settings`` applied on top, and by default
        wait until it is ready (``timeout`` seconds; a sandbox that fails to become ready
        is removed unless ``detached``). ``replace`` removes an existing sandbox of that
        name first. Leaving ``async with`` removes it unless ``detached``."""
        req = (spec or SandboxSpec()).with_(**settings).request(name)
        async with connect(socket) as c:
            if replace and name:
                try:
                    await _unary(c, "Remove", W.RemoveSandboxRequest(id=name, force=True), W.Empty)
                except NotFound:
                    pass
            resp = await _unary(c, "Create", req, W.CreateSandboxResponse)
        sb = cls(resp.id, socket=socket, detached=detached)
        if wait:
            try:
                await sb.wait_ready(timeout)
            except BaseException:
                await sb.__aexit__(None, None, None)
                raise
        return sb

    @classmethod
    async def get(cls, name: str, *, socket: str | Path | None = None) -> AsyncSandbox:
        """A handle on an existing sandbox (NotFound if there is none); detached."""
        sb = cls(name, socket=socket, detached=True)
        await sb.inspect()
        return sb

    @classmethod
    async def list(
        cls,
        *,
        socket: str | Path | None = None,
        labels: Mapping[str, str] | None = None,
        state: str = "",
        limit: int = 20,
        cursor: str = "",
    ) -> Page:
        """One page of sandboxes, newest first, filtered by state and labels (all must match)."""
        req = W.ListSandboxesRequest(state=state, labels=_kv(labels), limit=limit, cursor=cursor)
        async with connect(socket) as c:
            r = await _unary(c, "List", req, W.ListSandboxesResponse)
        return Page(r.sandboxes, r.next_cursor)

    @classmethod
    async def metrics_all(cls, *, socket: str | Path | None = None) -> builtins.list[MetricsResponse]:
        """One sample of every ready or running sandbox."""
        async with connect(socket) as c:
            r = _structure(await c.call("MetricsAll", {}), W.MetricsAllResponse, "MetricsAll")
        return r.sandboxes

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
    async def inspect(self) -> SandboxInfo:
        return await self._unary("Inspect", W.IdRequest(id=self.id), SandboxInfo)

    async def state(self) -> str:
        return (await self.inspect()).state

    async def wait_ready(self, timeout: float = 120.0) -> SandboxInfo:
        """Until the sandbox is ready (or running its initial command): FailedPrecondition
        if it failed or stopped instead, trio.TooSlowError after ``timeout`` seconds."""
        async with (
            connect(self.socket) as c,
            c.open_call("Events", W.unstructure_body(W.SandboxEventsRequest(id=self.id))) as ev,
        ):
            info = await _unary(c, "Inspect", W.IdRequest(id=self.id), SandboxInfo)
            with trio.fail_after(timeout):
                while info.state == "starting":
                    # the event ends the wait at once; the timeout covers an event that came
                    # before the server had subscribed this call (the calls run concurrently)
                    with trio.move_on_after(1.0):
                        while _structure(await ev.__anext__(), SandboxEvent, "Events").action not in (
                            "ready",
                            "failed",
                            "stopped",
                        ):
                            pass
                    info = await _unary(c, "Inspect", W.IdRequest(id=self.id), SandboxInfo)
            if info.state not in ("ready", "running"):
                raise error_for(W.FAILED_PRECONDITION, f"sandbox {self.id} is {info.state}: {info.error}")
            return info

    async def stop(self, timeout: int = 0) -> None:
        """Stop gracefully (``timeout`` seconds before it is killed; 0: the default)."""
        await self._unary("Stop", W.StopSandboxRequest(id=self.id, timeout_seconds=timeout), W.Empty)

    async def kill(self) -> None:
        await self._unary("Kill", W.IdRequest(id=self.id), W.Empty)

    async def drain(self) -> None:
        """Refuse new work, let the running workload finish, then stop."""
        await self._unary("Drain", W.IdRequest(id=self.id), W.Empty)

    async def wait_until_stopped(self) -> SandboxInfo:
        return await self._unary("WaitUntilStopped", W.IdRequest(id=self.id), SandboxInfo)

    async def start(self, *, wait: bool = True, timeout: float = 120.0) -> None:
        """Boot a stopped sandbox again (from its disk)."""
        await self._unary("Start", W.IdRequest(id=self.id), W.CreateSandboxResponse)
        if wait:
            await self.wait_ready(timeout)

    async def remove(self, *, force: bool = False) -> None:
        """Remove (``force``: stop it first if it runs)."""
        await self._unary("Remove", W.RemoveSandboxRequest(id=self.id, force=force), W.Empty)

    async def ping(self) -> float:
        """Round trip to the guest agent, in seconds (does not count as activity)."""
        return (await self._unary("Ping", W.IdRequest(id=self.id), W.PingResponse)).latency_ns / 1e9

    async def touch(self) -> int:
        """Count as activity (the idle timeout starts again); the guest's activity counter."""
        return (await self._unary("Touch", W.IdRequest(id=self.id), W.TouchResponse)).activity

    async def metrics(self) -> MetricsResponse:
        return await self._unary("Metrics", W.IdRequest(id=self.id), MetricsResponse)

    def metrics_stream(self, interval: float = 1.0) -> AsyncGenerator[MetricsResponse, None]:
        """A sample every ``interval`` seconds while the sandbox is ready or running."""
        req = W.MetricsStreamRequest(id=self.id, interval_seconds=interval)
        return self._stream("MetricsStream", req, MetricsResponse)

    async def logs(self, *, tail: int = 0, since: int = 0, until: int = 0) -> builtins.list[LogEntry]:
        """Persisted output (also of a stopped sandbox): the last ``tail`` entries (0:
        all), between ``since`` and ``until`` (unix ns; 0: open)."""
        req = W.LogsRequest(id=self.id, tail=tail, since=since, until=until)
        async with connect(self.socket) as c:
            return [_structure(e, LogEntry, "Logs") for e in await c.collect("Logs", W.unstructure_body(req))]

    def log_stream(self, *, follow: bool = True, tail: int = 0) -> AsyncGenerator[LogEntry, None]:
        """Log entries as they are written (``follow``), after the last ``tail`` ones."""
        return self._stream("Logs", W.LogsRequest(id=self.id, follow=follow, tail=tail), LogEntry)

    def events(self, action: str = "") -> AsyncGenerator[SandboxEvent, None]:
        """This sandbox's lifecycle events from now on (``action``: only those)."""
        return self._stream("Events", W.SandboxEventsRequest(id=self.id, action=action), SandboxEvent)

    # -- work --------------------------------------------------------------------
    def _run_request(self, cmd: builtins.list[str] | str, how: RunSettings) -> W.RunRequest:
        return W.RunRequest(
            id=self.id,
            cmd=["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd),
            env=_kv(how.get("env")),
            working_dir=how.get("workdir", ""),
            user=how.get("user", ""),
            tty=how.get("tty", False),
            timeout_seconds=how.get("timeout", 0),
        )

    async def run_stream(
        self, cmd: builtins.list[str] | str, **how: Unpack[RunSettings]
    ) -> AsyncGenerator[Output, None]:
        """Run a workload, streaming its output; the last Output is ("exit", b"", code).
        A string is run with ``sh -c``."""
        async with aclosing(self._stream("Run", self._run_request(cmd, how), W.RunOutput)) as items:
            async for item in items:
                yield _output(item)

    async def run(self, cmd: builtins.list[str] | str, **how: Unpack[RunSettings]) -> RunResult:
        """Run a workload to its end: its stdout, stderr and exit code."""
        return await self._collect(self.run_stream(cmd, **how))

    async def run_script(self, name: str, *args: str, **how: Unpack[RunSettings]) -> RunResult:
        """Run the named script of the sandbox's config (``scripts=`` at create) with
        ``args``, as a workload; NOT_FOUND for a name it does not have."""
        req = attrs.evolve(self._run_request(list(args), how), script=name)
        return await self._collect(_outputs(self._stream("Run", req, W.RunOutput)))

    async def _collect(self, stream: AsyncGenerator[Output, None]) -> RunResult:
        out, err, code = bytearray(), bytearray(), -1
        async with aclosing(stream) as outputs:
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
        size: tuple[int, int] = (80, 24),
        **how: Unpack[RunSettings],
    ) -> AsyncIterator[AsyncExec]:
        """An interactive process (stdin, optional PTY of ``size`` columns x rows, and
        resize). Leaving the block before it exited kills it."""
        r = self._run_request(cmd, how)
        init = W.ExecRequest(
            id=r.id,
            cmd=r.cmd,
            env=r.env,
            working_dir=r.working_dir,
            user=r.user,
            tty=r.tty,
            tty_size=W.TerminalSize(width=size[0], height=size[1]),
            timeout_seconds=r.timeout_seconds,
        )
        async with (
            connect(self.socket) as c,
            c.open_call("Exec", W.unstructure_body(W.ExecInput(init=init))) as call,
        ):
            yield AsyncExec(call)

    # -- ports -----------------------------------------------------------------
    async def expose(self, sandbox_port: int, host_port: int = 0, *, udp: bool = False) -> int:
        """Forward a host port (on the supervisor's loopback) to ``sandbox_port``; returns it."""
        req = W.ExposePortRequest(
            id=self.id, sandbox_port=sandbox_port, host_port=host_port, protocol="udp" if udp else "tcp"
        )
        return (await self._unary("ExposePort", req, W.ExposePortResponse)).host_port

    async def unexpose(self, sandbox_port: int, *, udp: bool = False) -> None:
        req = W.UnexposePortRequest(id=self.id, sandbox_port=sandbox_port, protocol="udp" if udp else "tcp")
        await self._unary("UnexposePort", req, W.Empty)

    async def ports(self) -> builtins.list[W.PortMapping]:
        """The port mappings (``sandbox_port``, ``host_port``, ``protocol``,
        ``host_address``): a restored sandbox's carried ones with the host ports it got."""
        return (await self._unary("ListPorts", W.IdRequest(id=self.id), W.ListPortsResponse)).ports

    # -- snapshots (SandboxSnapshotService) ------------------------------------
    async def checkpoint(self, name: str = "", *, labels: Mapping[str, str] | None = None) -> CheckpointResponse:
        """Snapshot this (ready) sandbox, which runs on; ``.snapshot_id`` names the snapshot."""
        req = W.CheckpointRequest(sandbox_id=self.id, name=name, labels=_kv(labels))
        return await self._unary("Checkpoint", req, CheckpointResponse)

    @classmethod
    async def restore(
        cls,
        snapshot: SnapshotRef,
        *,
        name: str = "",
        labels: Mapping[str, str] | None = None,
        ttl: int = 0,
        network_override: bool = False,
        detached: bool = False,
        socket: str | Path | None = None,
    ) -> AsyncSandbox:
        """A new sandbox from a snapshot (id, unique snapshot name, or a checkpoint's
        result), ready when this returns. As a context manager it is removed on exit
        unless ``detached``. A tap clone keeps the snapshot's address when it is free,
        unless ``network_override``."""
        req = W.RestoreRequest(
            snapshot_id=_snapshot_id(snapshot),
            id=name,
            labels=_kv(labels),
            ttl_seconds=ttl,
            network_override=network_override,
        )
        async with connect(socket) as c:
            r = await _unary(c, "Restore", req, W.RestoreResponse)
        return cls(r.id, socket=socket, detached=detached)

    @classmethod
    async def snapshots(
        cls, *, sandbox: str = "", labels: Mapping[str, str] | None = None, socket: str | Path | None = None
    ) -> builtins.list[SnapshotSummary]:
        """Snapshots, oldest first; filtered by origin sandbox id and labels (all must match)."""
        req = W.ListSnapshotsRequest(sandbox_id=sandbox, labels=_kv(labels))
        async with connect(socket) as c:
            return (await _unary(c, "ListSnapshots", req, W.ListSnapshotsResponse)).snapshots

    @classmethod
    async def delete_snapshot(cls, snapshot: SnapshotRef, *, socket: str | Path | None = None) -> None:
        async with connect(socket) as c:
            await _unary(c, "DeleteSnapshot", W.DeleteSnapshotRequest(snapshot_id=_snapshot_id(snapshot)), W.Empty)

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
                        cmd, tty=use_tty, size=(size.columns, size.lines), env=env or {}, workdir=workdir, user=user
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


# --- images ---------------------------------------------------------------------


class AsyncImages:
    """The supervisor's OCI image store (issue 15): pull (with progress), list, inspect,
    remove, prune. ``AsyncImages(socket=...)``; the module's ``images`` is the sync one
    on the default socket::

        img = await AsyncImages().pull("docker://127.0.0.1:5000/app:1", tls_verify=False)
        async with await AsyncSandbox.create("box", image=img.refs[0]) as sb: ...

    Credentials: ``creds="USER:PASSWORD"`` or ``authfile=PATH`` (a docker-style auth
    file, read here and sent as its content: the supervisor opens no path of yours)."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self.socket = socket

    def pull_stream(
        self,
        ref: str,
        *,
        policy: Literal["", "always", "if-missing", "never"] = "",
        tls_verify: bool = True,
        creds: str = "",
        authfile: str | Path | None = None,
    ) -> AsyncGenerator[PullImageProgress, None]:
        """Progress items; the last is ``phase == "done"`` with ``.image`` set."""
        auth = Path(authfile).read_bytes() if authfile is not None else b""
        req = W.PullImageRequest(
            ref=ref, policy=policy, tls_verify=None if tls_verify else False, creds=creds, auth_json=auth
        )
        return self._stream("PullImage", req)

    async def _stream(self, method: str, req: Any) -> AsyncGenerator[PullImageProgress, None]:
        async with connect(self.socket) as c, c.open_call(method, W.unstructure_body(req)) as call:
            async for body in call:
                yield _structure(body, PullImageProgress, method)

    async def pull(
        self,
        ref: str,
        *,
        policy: Literal["", "always", "if-missing", "never"] = "",
        tls_verify: bool = True,
        creds: str = "",
        authfile: str | Path | None = None,
        progress: Callable[[PullImageProgress], None] | None = None,
    ) -> OciImageInfo:
        """Pull ``ref`` (as ``policy`` says; default if-missing) and return the image;
        ``progress`` sees every item on the way."""
        image = None
        items = self.pull_stream(ref, policy=policy, tls_verify=tls_verify, creds=creds, authfile=authfile)
        async with aclosing(items) as stream:
            async for item in stream:
                if progress is not None:
                    progress(item)
                if item.image is not None:
                    image = item.image
        if image is None:
            raise error_for(W.INTERNAL, "PullImage ended without an image")
        return image

    async def list(self) -> builtins.list[OciImageInfo]:
        async with connect(self.socket) as c:
            return (await _unary(c, "ListImages", W.Empty(), W.ListImagesResponse)).oci_images

    async def inspect(self, ref: str) -> OciImageInfo:
        async with connect(self.socket) as c:
            return await _unary(c, "InspectOciImage", W.ImageRefRequest(ref), OciImageInfo)

    async def remove(self, ref: str) -> RemoveImageResponse:
        """Untag ``ref``, or delete the image (a digest, or its last reference);
        FailedPrecondition while a sandbox, snapshot or template stands on it."""
        async with connect(self.socket) as c:
            return await _unary(c, "RemoveImage", W.ImageRefRequest(ref), RemoveImageResponse)

    async def prune(self, *, dangling_only: bool = False) -> PruneImagesResponse:
        async with connect(self.socket) as c:
            return await _unary(c, "PruneImages", W.PruneImagesRequest(dangling_only), PruneImagesResponse)


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
    """:class:`AsyncFS`, blocking."""

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

    def copy_tree_in(self, local: str | Path, path: str, *, owner: str = "") -> int:
        return trio.run(functools.partial(self._a.fs.copy_tree_in, local, path, owner=owner))

    def copy_tree_out(self, path: str, local: str | Path, *, keep_owners: bool = False) -> int:
        return trio.run(functools.partial(self._a.fs.copy_tree_out, path, local, keep_owners=keep_owners))


class Volumes:
    """:class:`AsyncVolumes`, blocking."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self._a = AsyncVolumes(socket)

    def create(self, name: str, size: int | str = "256M", *, labels: Mapping[str, str] | None = None) -> VolumeInfo:
        return trio.run(functools.partial(self._a.create, name, size, labels=labels))

    def get(self, name: str) -> VolumeInfo:
        return trio.run(self._a.get, name)

    def list(self, *, labels: Mapping[str, str] | None = None) -> builtins.list[VolumeInfo]:
        return trio.run(functools.partial(self._a.list, labels=labels))

    def remove(self, name: str) -> None:
        trio.run(self._a.remove, name)


class Sandbox:
    """The synchronous SDK: the surface of :class:`AsyncSandbox`, blocking (each call
    runs its own Trio loop; streams are driven in a Trio thread)."""

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
    def create(
        cls,
        name: str = "",
        spec: SandboxSpec | None = None,
        *,
        socket: str | Path | None = None,
        replace: bool = False,
        detached: bool = False,
        wait: bool = True,
        timeout: float = 120.0,
        **settings: Unpack[Settings],
    ) -> Sandbox:
        fn = functools.partial(
            AsyncSandbox.create,
            name,
            spec,
            socket=socket,
            replace=replace,
            detached=detached,
            wait=wait,
            timeout=timeout,
            **settings,
        )
        return cls(trio.run(fn))

    @classmethod
    def get(cls, name: str, *, socket: str | Path | None = None) -> Sandbox:
        return cls(trio.run(functools.partial(AsyncSandbox.get, name, socket=socket)))

    @classmethod
    def list(
        cls,
        *,
        socket: str | Path | None = None,
        labels: Mapping[str, str] | None = None,
        state: str = "",
        limit: int = 20,
        cursor: str = "",
    ) -> Page:
        fn = functools.partial(AsyncSandbox.list, socket=socket, labels=labels, state=state, limit=limit, cursor=cursor)
        return trio.run(fn)

    @classmethod
    def metrics_all(cls, *, socket: str | Path | None = None) -> builtins.list[MetricsResponse]:
        return trio.run(functools.partial(AsyncSandbox.metrics_all, socket=socket))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        trio.run(self._a.__aexit__, None, None, None)

    def _do(self, fn: Callable[..., Awaitable[T_]], *args: Any, **kw: Any) -> T_:
        return trio.run(functools.partial(fn, *args, **kw))

    def inspect(self) -> SandboxInfo:
        return self._do(self._a.inspect)

    def state(self) -> str:
        return self._do(self._a.state)

    def wait_ready(self, timeout: float = 120.0) -> SandboxInfo:
        return self._do(self._a.wait_ready, timeout)

    def stop(self, timeout: int = 0) -> None:
        self._do(self._a.stop, timeout)

    def kill(self) -> None:
        self._do(self._a.kill)

    def drain(self) -> None:
        self._do(self._a.drain)

    def wait_until_stopped(self) -> SandboxInfo:
        return self._do(self._a.wait_until_stopped)

    def start(self, *, wait: bool = True, timeout: float = 120.0) -> None:
        self._do(self._a.start, wait=wait, timeout=timeout)

    def remove(self, *, force: bool = False) -> None:
        self._do(self._a.remove, force=force)

    def ping(self) -> float:
        return self._do(self._a.ping)

    def touch(self) -> int:
        return self._do(self._a.touch)

    def metrics(self) -> MetricsResponse:
        return self._do(self._a.metrics)

    def metrics_stream(self, interval: float = 1.0) -> Iterator[MetricsResponse]:
        return _sync_iter(lambda: self._a.metrics_stream(interval))

    def logs(self, *, tail: int = 0, since: int = 0, until: int = 0) -> builtins.list[LogEntry]:
        return self._do(self._a.logs, tail=tail, since=since, until=until)

    def log_stream(self, *, follow: bool = True, tail: int = 0) -> Iterator[LogEntry]:
        return _sync_iter(lambda: self._a.log_stream(follow=follow, tail=tail))

    def events(self, action: str = "") -> Iterator[SandboxEvent]:
        return _sync_iter(lambda: self._a.events(action))

    def run(self, cmd: builtins.list[str] | str, **how: Unpack[RunSettings]) -> RunResult:
        return self._do(self._a.run, cmd, **how)

    def run_script(self, name: str, *args: str, **how: Unpack[RunSettings]) -> RunResult:
        return self._do(self._a.run_script, name, *args, **how)

    def run_stream(self, cmd: builtins.list[str] | str, **how: Unpack[RunSettings]) -> Iterator[Output]:
        return _sync_iter(lambda: self._a.run_stream(cmd, **how))

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
    ) -> int:
        return self._do(
            self._a.attach,
            cmd,
            tty=tty,
            env=env,
            workdir=workdir,
            user=user,
            stdin_fd=stdin_fd,
            stdout_fd=stdout_fd,
            stderr_fd=stderr_fd,
        )

    def shell(self, shell: str = "/bin/sh") -> int:
        return self._do(self._a.shell, shell)

    def expose(self, sandbox_port: int, host_port: int = 0, *, udp: bool = False) -> int:
        return self._do(self._a.expose, sandbox_port, host_port, udp=udp)

    def unexpose(self, sandbox_port: int, *, udp: bool = False) -> None:
        self._do(self._a.unexpose, sandbox_port, udp=udp)

    def ports(self) -> builtins.list[W.PortMapping]:
        return self._do(self._a.ports)

    def checkpoint(self, name: str = "", *, labels: Mapping[str, str] | None = None) -> CheckpointResponse:
        return self._do(self._a.checkpoint, name, labels=labels)

    @classmethod
    def restore(
        cls,
        snapshot: SnapshotRef,
        *,
        name: str = "",
        labels: Mapping[str, str] | None = None,
        ttl: int = 0,
        network_override: bool = False,
        detached: bool = False,
        socket: str | Path | None = None,
    ) -> Sandbox:
        fn = functools.partial(
            AsyncSandbox.restore,
            snapshot,
            name=name,
            labels=labels,
            ttl=ttl,
            network_override=network_override,
            detached=detached,
            socket=socket,
        )
        return cls(trio.run(fn))

    @classmethod
    def snapshots(
        cls, *, sandbox: str = "", labels: Mapping[str, str] | None = None, socket: str | Path | None = None
    ) -> builtins.list[SnapshotSummary]:
        return trio.run(functools.partial(AsyncSandbox.snapshots, sandbox=sandbox, labels=labels, socket=socket))

    @classmethod
    def delete_snapshot(cls, snapshot: SnapshotRef, *, socket: str | Path | None = None) -> None:
        trio.run(functools.partial(AsyncSandbox.delete_snapshot, snapshot, socket=socket))


class Images:
    """:class:`AsyncImages`, blocking."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self._a = AsyncImages(socket)

    def pull(
        self,
        ref: str,
        *,
        policy: Literal["", "always", "if-missing", "never"] = "",
        tls_verify: bool = True,
        creds: str = "",
        authfile: str | Path | None = None,
        progress: Callable[[PullImageProgress], None] | None = None,
    ) -> OciImageInfo:
        fn = functools.partial(
            self._a.pull, ref, policy=policy, tls_verify=tls_verify, creds=creds, authfile=authfile, progress=progress
        )
        return trio.run(fn)

    def pull_stream(
        self,
        ref: str,
        *,
        policy: Literal["", "always", "if-missing", "never"] = "",
        tls_verify: bool = True,
        creds: str = "",
        authfile: str | Path | None = None,
    ) -> Iterator[PullImageProgress]:
        return _sync_iter(
            lambda: self._a.pull_stream(ref, policy=policy, tls_verify=tls_verify, creds=creds, authfile=authfile)
        )

    def list(self) -> builtins.list[OciImageInfo]:
        return trio.run(self._a.list)

    def inspect(self, ref: str) -> OciImageInfo:
        return trio.run(self._a.inspect, ref)

    def remove(self, ref: str) -> RemoveImageResponse:
        return trio.run(self._a.remove, ref)

    def prune(self, *, dangling_only: bool = False) -> PruneImagesResponse:
        return trio.run(functools.partial(self._a.prune, dangling_only=dangling_only))


images = Images()  # on the default socket (SANDVISOR_SOCKET): client.images.pull(...)
