"""The gRPC edge without VMs: supervisor.serve.grpc_bridge with a fake sandbox.v1 servicer, driven by
clients generated at test time from sandbox.v1's proto, over a Unix socket and over TLS on
loopback; health, reflection, the generated code's currency, the metrics endpoint.

The clients are grpcio's sync ones, run in threads (trio.to_thread), so the server's
Trio loop stays free while a test waits on a call."""

from __future__ import annotations

import contextvars
import grp
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import trio

from actors.principals import Principal
from supervisor.serve import grpc_bridge, metrics
from supervisor.serve.grpc_addresses import Address, TcpAddress, TlsConfig, UnixAddress, parse_address
from supervisor.serve.grpc_auth import TcpAuth
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as pb
from supervisor.wire.protocol import ApiError
from tests.support.grpc_clients import REPO, SEED, bearer, generate, make_pki

VENDORED = REPO / "supervisor/wire/proto/sandbox/v1/sandbox.proto"


@pytest.fixture(scope="session")
def seed() -> tuple[ModuleType, ModuleType]:
    """sandbox_pb2 and sandbox_pb2_grpc made by protoc from sandbox.v1, as a sandbox.v1 client would."""
    return generate()


def test_vendored_proto_is_the_seed_byte_for_byte() -> None:
    if not SEED.exists():
        pytest.skip("shared/seeds is not beside the repo")
    assert VENDORED.read_bytes() == SEED.read_bytes()


def test_generated_code_is_current() -> None:
    pytest.importorskip("grpc_tools.protoc")
    from supervisor.wire.proto import generate

    assert generate.stale() == [], "run: python -m supervisor.wire.proto.generate"


def test_seed_clients_share_our_descriptors(seed: tuple[ModuleType, ModuleType]) -> None:
    """Same file name, same bytes: a seed client's classes are ours (one process holds both)."""
    spb, _ = seed
    assert spb.RunRequest is pb.RunRequest
    assert spb.DESCRIPTOR.services_by_name["SandboxService"].full_name == "sandbox.v1.SandboxService"


# ---------------------------------------------------------------------------------------
# a fake servicer, written as the real ones will be: Trio methods named after the RPCs
# ---------------------------------------------------------------------------------------
class FakeSandboxes:
    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.files: dict[str, bytes] = {}
        self.cancelled = trio.Event()
        self.hang_deadline: float | None = None
        self.hang_started = 0
        self.peers: list[grpc_bridge.Call[Any, Any]] = []

    async def Create(self, req: pb.CreateSandboxRequest, call: grpc_bridge.Call[Any, Any]) -> pb.CreateSandboxResponse:
        self.peers.append(call)
        if not req.id or "/" in req.id:
            raise ApiError("INVALID_ARGUMENT", f"bad id {req.id!r}")
        if req.id in self.ids:
            raise ApiError("ALREADY_EXISTS", f"sandbox {req.id} exists")
        if req.image:
            raise grpc_bridge.StatusError("FAILED_PRECONDITION", "image is not supported")
        self.ids.add(req.id)
        return pb.CreateSandboxResponse(id=req.id, state="starting")

    async def Inspect(self, req: pb.InspectSandboxRequest, call: grpc_bridge.Call[Any, Any]) -> pb.SandboxInfo:
        if req.id not in self.ids:
            raise ApiError("NOT_FOUND", f"no sandbox {req.id}")
        return pb.SandboxInfo(id=req.id, state="ready", labels={"a": "b"})

    async def Remove(self, req: pb.RemoveSandboxRequest, call: grpc_bridge.Call[Any, Any]) -> pb.Empty:
        raise ZeroDivisionError("a bug")  # INTERNAL

    async def Run(self, req: pb.RunRequest, call: grpc_bridge.Call[Any, pb.RunOutput]) -> None:
        cmd = list(req.cmd)
        if cmd and cmd[0] == "raise":
            raise ApiError(cmd[1], "as asked")
        if cmd == ["hang"]:
            self.hang_deadline = call.deadline
            self.hang_started += 1
            await call.send(pb.RunOutput(stream="stdout", data=b"started\n"))
            try:
                await trio.sleep_forever()
            finally:
                self.cancelled.set()
        for i in range(int(cmd[1]) if cmd[:1] == ["count"] else 1):
            await call.send(pb.RunOutput(stream="stdout", data=f"{i}\n".encode()))
        await call.send(pb.RunOutput(stream="stderr", data=b"warn\n"))
        await call.send(pb.RunOutput(stream="exit", exit_code=7, done=True))

    async def Exec(self, call: grpc_bridge.Call[pb.ExecInput, pb.ExecOutput]) -> None:
        first = await call.receive()
        if first is None or first.WhichOneof("payload") != "init":
            raise ApiError("INVALID_ARGUMENT", "the first ExecInput must carry init")
        tty = first.init.tty
        await call.send(pb.ExecOutput(stream="stdout", data=b"$ "))
        async for msg in call:
            kind = msg.WhichOneof("payload")
            if kind == "stdin":
                await call.send(pb.ExecOutput(stream="stdout", data=msg.stdin.upper()))
            elif kind == "resize":
                if not tty:
                    raise ApiError("INVALID_ARGUMENT", "resize needs tty")
                await call.send(pb.ExecOutput(stream="stdout", data=f"{msg.resize.width}x{msg.resize.height}".encode()))
        await call.send(pb.ExecOutput(stream="exit", exit_code=0, done=True))

    async def Events(self, req: pb.SandboxEventsRequest, call: grpc_bridge.Call[Any, pb.SandboxEvent]) -> None:
        for action in ("created", "ready"):
            if not req.action or req.action == action:
                await call.send(pb.SandboxEvent(sandbox_id=req.id, action=action, timestamp=time.time_ns()))

    async def WriteFile(self, call: grpc_bridge.Call[pb.WriteFileRequest, pb.Empty]) -> pb.Empty:
        first = await call.receive()
        if first is None or first.WhichOneof("payload") != "open":
            raise ApiError("INVALID_ARGUMENT", "the first WriteFileRequest must carry open")
        parts = []
        async for msg in call:
            parts.append(msg.chunk.data)
            if msg.chunk.done:
                break
        self.files[first.open.path] = b"".join(parts)
        return pb.Empty()

    async def ReadFile(self, req: pb.ReadFileRequest, call: grpc_bridge.Call[Any, pb.FileChunk]) -> None:
        data = self.files.get(req.path)
        if data is None:
            raise ApiError("NOT_FOUND", f"no file {req.path}")
        for i in range(0, len(data), 1 << 16):
            await call.send(pb.FileChunk(data=data[i : i + (1 << 16)]))
        await call.send(pb.FileChunk(done=True))


SERVICE = pb.DESCRIPTOR.services_by_name["SandboxService"]


@asynccontextmanager
async def serving(
    *addresses: Address, fake: FakeSandboxes | None = None, **kw: Any
) -> AsyncIterator[grpc_bridge.GrpcEdge]:
    edge = grpc_bridge.GrpcEdge(addresses, **kw)
    edge.add_service(SERVICE, fake or FakeSandboxes())
    async with trio.open_nursery() as nursery:
        await nursery.start(edge.run)
        yield edge
        nursery.cancel_scope.cancel()


def unix_target(edge: grpc_bridge.GrpcEdge) -> str:
    addr = edge.addresses[0]
    assert isinstance(addr, UnixAddress)
    return f"unix:{addr.path}"


async def in_thread(fn: Any, *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args)


# ---------------------------------------------------------------------------------------
# calls of every kind over the Unix socket
# ---------------------------------------------------------------------------------------
async def test_every_kind_of_call_over_a_unix_socket(tmp_path: Path, seed: tuple[ModuleType, ModuleType]) -> None:
    spb, sgrpc = seed
    fake = FakeSandboxes()
    big = os.urandom(10 << 20)

    def client(target: str) -> None:
        with grpc.insecure_channel(target) as ch:
            stub = sgrpc.SandboxServiceStub(ch)
            assert stub.Create(spb.CreateSandboxRequest(id="sb1")).state == "starting"
            info = stub.Inspect(spb.InspectSandboxRequest(id="sb1"))
            assert (info.id, info.state, dict(info.labels)) == ("sb1", "ready", {"a": "b"})
            out = list(stub.Run(spb.RunRequest(id="sb1", cmd=["count", "3"])))
            assert [(o.stream, o.data) for o in out[:-1]] == [
                ("stdout", b"0\n"),
                ("stdout", b"1\n"),
                ("stdout", b"2\n"),
                ("stderr", b"warn\n"),
            ]
            assert (out[-1].stream, out[-1].exit_code, out[-1].done) == ("exit", 7, True)
            events = list(stub.Events(spb.SandboxEventsRequest(id="sb1")))
            assert [e.action for e in events] == ["created", "ready"]

            def writes() -> Iterator[Any]:
                yield spb.WriteFileRequest(open=spb.WriteFileOpen(id="sb1", path="/tmp/big"))
                for i in range(0, len(big), 1 << 20):
                    last = i + (1 << 20) >= len(big)
                    yield spb.WriteFileRequest(chunk=spb.FileChunk(data=big[i : i + (1 << 20)], done=last))

            stub.WriteFile(writes())
            chunks = list(stub.ReadFile(spb.ReadFileRequest(id="sb1", path="/tmp/big")))
            assert chunks[-1].done
            assert b"".join(c.data for c in chunks) == big

            inputs = [
                spb.ExecInput(init=spb.ExecRequest(id="sb1", cmd=["sh"], tty=True)),
                spb.ExecInput(stdin=b"echo hi"),
                spb.ExecInput(resize=spb.TerminalSize(width=120, height=40)),
            ]
            out = list(stub.Exec(iter(inputs)))  # the iterator's end is the half-close: stdin closed
            assert [o.data for o in out[:-1]] == [b"$ ", b"ECHO HI", b"120x40"]
            assert (out[-1].stream, out[-1].done) == ("exit", True)

    with trio.fail_after(30):
        async with serving(UnixAddress(tmp_path / "grpc.sock"), fake=fake) as edge:
            await in_thread(client, unix_target(edge))
    assert fake.files["/tmp/big"] == big
    assert fake.peers[0].peer.startswith("unix:")
    assert fake.peers[0].deadline == float("inf")


@pytest.mark.parametrize(
    ("cmd", "code"),
    [
        (["raise", name], getattr(grpc.StatusCode, name))
        for name in (
            "INVALID_ARGUMENT",
            "NOT_FOUND",
            "ALREADY_EXISTS",
            "FAILED_PRECONDITION",
            "RESOURCE_EXHAUSTED",
            "DEADLINE_EXCEEDED",
            "INTERNAL",
            "UNAVAILABLE",
            "UNIMPLEMENTED",
            "CANCELLED",
        )
    ],
)
async def test_errors_raised_in_trio_arrive_as_the_status_of_the_same_name(
    tmp_path: Path, seed: tuple[ModuleType, ModuleType], cmd: list[str], code: grpc.StatusCode
) -> None:
    spb, sgrpc = seed

    def client(target: str) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(target) as ch:
            try:
                list(sgrpc.SandboxServiceStub(ch).Run(spb.RunRequest(id="x", cmd=cmd)))
            except grpc.RpcError as exc:
                return exc.code(), exc.details()
        raise AssertionError("no error")

    with trio.fail_after(20):
        async with serving(UnixAddress(tmp_path / "g.sock")) as edge:
            got, details = await in_thread(client, unix_target(edge))
    assert got == code
    assert details == "as asked"


async def test_unary_errors_unexpected_exceptions_and_unknown_methods(
    tmp_path: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    spb, sgrpc = seed

    def client(target: str) -> list[tuple[grpc.StatusCode, str]]:
        out = []
        with grpc.insecure_channel(target) as ch:
            stub = sgrpc.SandboxServiceStub(ch)
            stub.Create(spb.CreateSandboxRequest(id="dup"))
            for fn in (
                lambda: stub.Create(spb.CreateSandboxRequest(id="dup")),
                lambda: stub.Create(spb.CreateSandboxRequest(id="a/b")),
                lambda: stub.Create(spb.CreateSandboxRequest(id="img", image="alpine")),
                lambda: stub.Inspect(spb.InspectSandboxRequest(id="nope")),
                lambda: stub.Remove(spb.RemoveSandboxRequest(id="dup")),
                lambda: stub.Stop(spb.StopSandboxRequest(id="dup")),  # not in the fake: UNIMPLEMENTED
                lambda: list(stub.Exec(iter([spb.ExecInput(stdin=b"x")]))),
            ):
                try:
                    fn()
                    out.append((grpc.StatusCode.OK, ""))
                except grpc.RpcError as exc:
                    out.append((exc.code(), exc.details()))
        return out

    with trio.fail_after(20):
        async with serving(UnixAddress(tmp_path / "g.sock")) as edge:
            got = await in_thread(client, unix_target(edge))
    codes = [c for c, _ in got]
    assert codes == [
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]
    assert got[4][1] == "ZeroDivisionError: a bug"


def test_status_mapping_is_by_name() -> None:
    assert grpc_bridge.status_of(ApiError("NOT_FOUND", "gone")) == (grpc.StatusCode.NOT_FOUND, "gone")
    assert grpc_bridge.status_of(grpc_bridge.StatusError(grpc.StatusCode.ABORTED, "x")) == (
        grpc.StatusCode.ABORTED,
        "x",
    )
    assert grpc_bridge.status_of(trio.TooSlowError()) == (grpc.StatusCode.DEADLINE_EXCEEDED, "timed out")
    assert grpc_bridge.status_of(ApiError("NO_SUCH_CODE", "x")) is None
    assert grpc_bridge.status_of(ValueError("x")) is None
    with pytest.raises(ValueError, match="unknown status code"):
        grpc_bridge.StatusError("WHATEVER")


# ---------------------------------------------------------------------------------------
# cancellation and deadlines reach the Trio task
# ---------------------------------------------------------------------------------------
async def test_a_client_cancel_cancels_the_trio_task(tmp_path: Path, seed: tuple[ModuleType, ModuleType]) -> None:
    spb, sgrpc = seed
    fake = FakeSandboxes()
    cancelled_at: list[float] = []

    def client(target: str) -> grpc.StatusCode:
        with grpc.insecure_channel(target) as ch:
            it = sgrpc.SandboxServiceStub(ch).Run(spb.RunRequest(id="x", cmd=["hang"]))
            assert next(it).data == b"started\n"
            cancelled_at.append(time.monotonic())
            it.cancel()
            try:
                next(it)
            except grpc.RpcError as exc:
                return exc.code()
        raise AssertionError("stream went on")

    with trio.fail_after(20):
        async with serving(UnixAddress(tmp_path / "g.sock"), fake=fake) as edge:
            assert await in_thread(client, unix_target(edge)) == grpc.StatusCode.CANCELLED
            with trio.fail_after(5):
                await fake.cancelled.wait()
            lag = time.monotonic() - cancelled_at[0]
    assert fake.hang_deadline == float("inf")
    assert lag < 5  # measured: ~0.5 ms (benchmarks/grpc_bridges.py); the bound only catches "never"


async def test_a_deadline_is_the_trio_scope_deadline_and_cancels_the_task(
    tmp_path: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    spb, sgrpc = seed
    fake = FakeSandboxes()

    def client(target: str) -> grpc.StatusCode:
        with grpc.insecure_channel(target) as ch:
            try:
                list(sgrpc.SandboxServiceStub(ch).Run(spb.RunRequest(id="x", cmd=["hang"]), timeout=0.5))
            except grpc.RpcError as exc:
                return exc.code()
        raise AssertionError("no deadline")

    with trio.fail_after(20):
        async with serving(UnixAddress(tmp_path / "g.sock"), fake=fake) as edge:
            t0 = trio.current_time()
            assert await in_thread(client, unix_target(edge)) == grpc.StatusCode.DEADLINE_EXCEEDED
            with trio.fail_after(5):
                await fake.cancelled.wait()
    assert fake.hang_deadline is not None
    assert t0 < fake.hang_deadline <= t0 + 0.6


async def test_stopping_the_edge_cancels_calls_and_leaves_nothing(
    tmp_path: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    spb, sgrpc = seed
    fake = FakeSandboxes()
    path = tmp_path / "g.sock"
    result: list[grpc.StatusCode] = []

    def client(target: str) -> None:
        with grpc.insecure_channel(target) as ch:
            it = sgrpc.SandboxServiceStub(ch).Run(spb.RunRequest(id="x", cmd=["hang"]))
            try:
                for _ in it:
                    pass
            except grpc.RpcError as exc:
                result.append(exc.code())

    with trio.fail_after(20):
        async with trio.open_nursery() as outer:
            edge = grpc_bridge.GrpcEdge([UnixAddress(path)])
            edge.add_service(SERVICE, fake)
            scope = trio.CancelScope()

            async def run_edge(task_status: trio.TaskStatus[None]) -> None:
                with scope:
                    await edge.run(task_status=task_status)

            await outer.start(run_edge)
            outer.start_soon(in_thread, client, f"unix:{path}")
            while fake.hang_started == 0:
                await trio.sleep(0.01)
            scope.cancel()
    assert fake.cancelled.is_set()
    assert result in ([grpc.StatusCode.UNAVAILABLE], [grpc.StatusCode.CANCELLED])
    assert not path.exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".grpc-")] == []
    assert edge._loop is not None
    assert edge._loop.is_closed()
    assert not [t for t in threading.enumerate() if t.name == "grpc-edge"]


# ---------------------------------------------------------------------------------------
# who may connect: the Unix socket's mode and group
# ---------------------------------------------------------------------------------------
def _can_connect(path: Path, user: str, extra_groups: list[int] | None = None) -> bool:
    probe = "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])"
    r = subprocess.run(
        ["/usr/bin/python3", "-c", probe, str(path)],
        user=user,
        group="nogroup",
        extra_groups=extra_groups or [],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return r.returncode == 0


class Policy:
    """A PeerPolicy for tests: serves or refuses everyone, and counts what it saw."""

    def __init__(self, serve: bool) -> None:
        self.serve = serve
        self.uids: list[int] = []

    def check(self, sock: Any) -> str | None:
        from supervisor.serve.peers import Peer

        self.uids.append(Peer.of(sock).uid)
        return None if self.serve else "not you"

    def served(self) -> str:
        return "only the test's friends"

    def principal(self, sock: Any) -> Principal:
        from supervisor.serve.peers import Peer

        return Principal.uid(Peer.of(sock).uid)


async def test_a_peer_policy_relays_served_clients_and_refuses_the_others(
    tmp_path: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    """With a policy, the public socket is a relay: a served peer's calls go through
    (streams both ways included), a refused one gets PERMISSION_DENIED on every call."""
    spb, sgrpc = seed

    def calls(target: str) -> list[str]:
        out = []
        with grpc.insecure_channel(target) as ch:
            stub = sgrpc.SandboxServiceStub(ch)
            for fn in (
                lambda: stub.Create(spb.CreateSandboxRequest(id="p1")).state,
                lambda: len(list(stub.Run(spb.RunRequest(id="p1", cmd=["count", "200"])))),
            ):
                try:
                    out.append(str(fn()))
                except grpc.RpcError as exc:
                    out.append(f"{exc.code().name}: {exc.details()}")
        return out

    with trio.fail_after(30):
        friends, strangers = Policy(serve=True), Policy(serve=False)
        addrs = [
            UnixAddress(tmp_path / "in.sock", policy=friends),
            UnixAddress(tmp_path / "out.sock", policy=strangers),
        ]
        async with serving(*addrs) as edge:
            assert (tmp_path / "in.sock").stat().st_mode & 0o777 == 0o600
            assert await in_thread(calls, f"unix:{tmp_path / 'in.sock'}") == ["starting", "202"]
            refused = await in_thread(calls, f"unix:{tmp_path / 'out.sock'}")
            assert refused == ["PERMISSION_DENIED: only the test's friends"] * 2
            assert edge.refused >= 1
    assert friends.uids and set(friends.uids) == {os.geteuid()}
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # sockets and private dirs gone


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runs probes as nobody)")
async def test_unix_socket_admits_root_and_the_group_only() -> None:
    group = "daemon"  # any group nobody is not in
    gid = grp.getgrnam(group).gr_gid
    work = Path(tempfile.mkdtemp(prefix="grpc-perm-"))
    try:
        work.chmod(0o755)  # traversable: the socket's own mode must be what keeps others out
        with trio.fail_after(30):
            async with serving(UnixAddress(work / "owner.sock"), UnixAddress(work / "group.sock", group=group)):
                owner, grouped = work / "owner.sock", work / "group.sock"
                assert owner.stat().st_mode & 0o777 == 0o600
                assert (grouped.stat().st_mode & 0o777, grouped.stat().st_gid) == (0o660, gid)
                assert not await in_thread(_can_connect, owner, "nobody")
                assert not await in_thread(_can_connect, grouped, "nobody")
                assert await in_thread(_can_connect, grouped, "nobody", [gid])
                assert not await in_thread(_can_connect, owner, "nobody", [gid])
    finally:
        shutil.rmtree(work)


# ---------------------------------------------------------------------------------------
# TLS on loopback, with a client certificate
# ---------------------------------------------------------------------------------------
async def test_tls_on_loopback_with_a_client_certificate(seed: tuple[ModuleType, ModuleType]) -> None:
    pytest.importorskip("cryptography")
    spb, sgrpc = seed
    pki = make_pki()
    tls = TlsConfig(pki["server_cert"], pki["server_key"], client_ca=pki["ca"], require_client_cert=True)
    fake = FakeSandboxes()

    def client(target: str, with_cert: bool) -> str:
        creds = grpc.ssl_channel_credentials(
            root_certificates=pki["ca"],
            private_key=pki["client_key"] if with_cert else None,
            certificate_chain=pki["client_cert"] if with_cert else None,
        )
        with grpc.secure_channel(target, creds) as ch:
            try:
                return str(sgrpc.SandboxServiceStub(ch).Create(spb.CreateSandboxRequest(id="t1"), timeout=10).id)
            except grpc.RpcError as exc:
                return str(exc.code())

    with trio.fail_after(30):
        async with serving(parse_address("127.0.0.1:0", tls=tls), fake=fake) as edge:
            addr = edge.addresses[0]
            assert isinstance(addr, TcpAddress)
            assert addr.port != 0
            target = f"localhost:{addr.port}"
            assert await in_thread(client, target, True) == "t1"
            assert await in_thread(client, target, False) == str(grpc.StatusCode.UNAVAILABLE)
    call = fake.peers[0]
    assert call.peer.startswith("ipv4:127.0.0.1:")
    assert call.peer_identities == ["ci-client"]
    assert call.auth["transport_security_type"] == [b"ssl"]


# ---------------------------------------------------------------------------------------
# client authentication on TCP: a bearer token, a client certificate, or nothing
# ---------------------------------------------------------------------------------------
TOKEN = "t0k3n-" + "x" * 40


async def test_a_bearer_token_authenticates_tcp_calls(tmp_path: Path, seed: tuple[ModuleType, ModuleType]) -> None:
    """Plaintext loopback with a token: the token's calls are served; no token, a wrong
    one, a prefix of it or another scheme are UNAUTHENTICATED before any handler runs
    (health and reflection too); the Unix socket of the same edge needs none."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    spb, sgrpc = seed
    fake = FakeSandboxes()

    def create(target: str, metadata: list[tuple[str, str]], id: str) -> str:
        with grpc.insecure_channel(target) as ch:
            try:
                return str(sgrpc.SandboxServiceStub(ch).Create(spb.CreateSandboxRequest(id=id), metadata=metadata).id)
            except grpc.RpcError as exc:
                return f"{exc.code().name}: {exc.details()}"

    def run_stream(target: str, metadata: list[tuple[str, str]]) -> str:
        with grpc.insecure_channel(target) as ch:
            try:
                out = list(
                    sgrpc.SandboxServiceStub(ch).Run(spb.RunRequest(id="x", cmd=["count", "1"]), metadata=metadata)
                )
                return str(out[-1].exit_code)
            except grpc.RpcError as exc:
                return exc.code().name

    def health(target: str, metadata: list[tuple[str, str]]) -> str:
        with grpc.insecure_channel(target) as ch:
            try:
                return str(
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), metadata=metadata).status
                )
            except grpc.RpcError as exc:
                return exc.code().name

    auth = TcpAuth(token=TOKEN.encode())
    with trio.fail_after(30):
        async with serving(
            UnixAddress(tmp_path / "g.sock"), TcpAddress("127.0.0.1", 0), fake=fake, tcp_auth=auth
        ) as edge:
            tcp = edge.addresses[1]
            assert isinstance(tcp, TcpAddress)
            target = tcp.target
            assert await in_thread(create, target, bearer(TOKEN), "ok1") == "ok1"
            assert await in_thread(run_stream, target, bearer(TOKEN)) == "7"
            assert await in_thread(health, target, bearer(TOKEN)) == str(health_pb2.HealthCheckResponse.SERVING)
            for i, md in enumerate(
                ([], bearer("x" + TOKEN[1:]), bearer(TOKEN[:-1]), bearer(TOKEN + "x"), [("authorization", TOKEN)])
            ):
                answer = await in_thread(create, target, md, f"bad{i}")
                assert answer.startswith("UNAUTHENTICATED: ") and "--grpc-token-file" in answer, answer
                assert await in_thread(run_stream, target, md) == "UNAUTHENTICATED"
                assert await in_thread(health, target, md) == "UNAUTHENTICATED"
            assert await in_thread(create, unix_target(edge), [], "unix1") == "unix1"  # peer credentials' business
            assert edge.unauthenticated == 15
    assert fake.ids == {"ok1", "unix1"}  # no refused call reached a handler


async def test_tls_without_a_client_ca_still_needs_the_token(seed: tuple[ModuleType, ModuleType]) -> None:
    """TLS that does not verify clients is no authentication: a client certificate sent
    anyway counts for nothing, the token does."""
    pytest.importorskip("cryptography")
    spb, sgrpc = seed
    pki = make_pki()
    tls = TlsConfig(pki["server_cert"], pki["server_key"])

    def create(target: str, metadata: list[tuple[str, str]], id: str) -> str:
        creds = grpc.ssl_channel_credentials(pki["ca"], pki["client_key"], pki["client_cert"])
        with grpc.secure_channel(target, creds) as ch:
            try:
                return str(sgrpc.SandboxServiceStub(ch).Create(spb.CreateSandboxRequest(id=id), metadata=metadata).id)
            except grpc.RpcError as exc:
                return str(exc.code().name)

    with trio.fail_after(30):
        async with serving(TcpAddress("127.0.0.1", 0, tls=tls), tcp_auth=TcpAuth(token=TOKEN.encode())) as edge:
            addr = edge.addresses[0]
            assert isinstance(addr, TcpAddress)
            target = f"localhost:{addr.port}"
            assert await in_thread(create, target, [], "a") == "UNAUTHENTICATED"
            assert await in_thread(create, target, bearer(TOKEN), "b") == "b"


async def test_tcp_without_client_authentication_does_not_start() -> None:
    for addr, auth, words in (
        (TcpAddress("127.0.0.1", 0), None, "would let any client in"),
        (TcpAddress("::1", 0), TcpAuth(), "--grpc-token-file FILE"),
        (TcpAddress("0.0.0.0", 0, tls=TlsConfig(b"c", b"k")), None, "--grpc-client-ca"),  # TLS: not who
        (TcpAddress("0.0.0.0", 0, tls=TlsConfig(b"c", b"k")), TcpAuth(insecure=True), "loopback"),
    ):
        with pytest.raises(ValueError, match=words):
            grpc_bridge.GrpcEdge([addr], tcp_auth=auth)
    with pytest.raises(ValueError, match="contradict"):
        TcpAuth(token=TOKEN.encode(), insecure=True)
    for bad in (b"short", b"with space" + b"x" * 40, b"\xff" * 40):
        with pytest.raises(ValueError, match="bearer token"):
            TcpAuth(token=bad)
    grpc_bridge.GrpcEdge([UnixAddress(Path("/run/x.sock"))])  # Unix sockets: mode and peer credentials


async def test_insecure_tcp_is_loud(caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(20):
        async with serving(TcpAddress("127.0.0.1", 0), tcp_auth=TcpAuth(insecure=True)):
            pass
    assert any(r.levelname == "WARNING" and "--grpc-insecure" in r.getMessage() for r in caplog.records)


def test_plaintext_tcp_is_for_loopback_only() -> None:
    assert parse_address("127.0.0.1:50051") == TcpAddress("127.0.0.1", 50051)
    assert parse_address("[::1]:7") == TcpAddress("::1", 7)
    assert parse_address("unix:///run/s.sock") == UnixAddress(Path("/run/s.sock"))
    assert parse_address("unix:/run/s.sock", group="g") == UnixAddress(Path("/run/s.sock"), "g")
    with pytest.raises(ValueError, match="needs TLS"):
        parse_address("0.0.0.0:50051")
    for bad in ("unix:relative.sock", "host", "host:99999", ":80"):
        with pytest.raises(ValueError):
            parse_address(bad)


# ---------------------------------------------------------------------------------------
# health and reflection
# ---------------------------------------------------------------------------------------
async def test_health_and_reflection(tmp_path: Path) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def check(target: str, service: str) -> int:
        with grpc.insecure_channel(target) as ch:
            return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service)).status)

    def reflect(target: str) -> tuple[list[str], str]:
        with grpc.insecure_channel(target) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            reqs = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="sandbox.v1.SandboxService"),
            ]
            listed, file = list(stub.ServerReflectionInfo(iter(reqs)))
            from google.protobuf import descriptor_pb2

            fd = descriptor_pb2.FileDescriptorProto.FromString(file.file_descriptor_response.file_descriptor_proto[0])
            return [s.name for s in listed.list_services_response.service], fd.name

    serving_ = health_pb2.HealthCheckResponse.SERVING
    with trio.fail_after(20):
        async with serving(UnixAddress(tmp_path / "g.sock")) as edge:
            target = unix_target(edge)
            assert await in_thread(check, target, "") == serving_
            assert await in_thread(check, target, "sandbox.v1.SandboxService") == serving_
            edge.set_serving("sandbox.v1.SandboxService", False)
            with trio.fail_after(5):
                while await in_thread(check, target, "sandbox.v1.SandboxService") == serving_:
                    await trio.sleep(0.01)
            services, file = await in_thread(reflect, target)
    assert set(services) >= {
        "sandbox.v1.SandboxService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert file == "sandbox/v1/sandbox.proto"


# ---------------------------------------------------------------------------------------
# the Prometheus endpoint, fed fake samples
# ---------------------------------------------------------------------------------------
class FakeSource:
    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.asked = 0

    async def collect_metrics(self) -> metrics.MetricsSample:
        self.asked += 1
        await trio.sleep(self.delay)
        return metrics.MetricsSample(
            sandboxes=[
                metrics.SandboxSample("sb-a", "ready", 1.5, 300 << 20, 512 << 20, 400 << 20, image="default"),
                metrics.SandboxSample("sb-b", "running", 12.25, 700 << 20, 1024 << 20, None, image="default"),
            ],
            by_state={"ready": 1, "running": 1, "stopped": 3},
        )


METRICS_TOKEN = b"m" * 40


async def _get(port: int, path: str, token: bytes | None = METRICS_TOKEN) -> tuple[str, bytes]:
    return (await _get_head(port, path, token))[::2]


async def _get_head(port: int, path: str, token: bytes | None = METRICS_TOKEN) -> tuple[str, list[bytes], bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    auth = b"Authorization: Bearer " + token + b"\r\n" if token is not None else b""
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + auth + b"\r\n")
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    return lines[0].decode(), lines[1:], body


def _endpoint(source: metrics.MetricsSource, **kw: Any) -> metrics.MetricsEndpoint:
    return metrics.MetricsEndpoint(source, "127.0.0.1", 0, token=METRICS_TOKEN, **kw)


async def test_metrics_endpoint_lists_each_sandbox_cpu_and_memory() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            ep = await nursery.start(_endpoint(FakeSource()).run)
            status, body = await _get(ep.port, "/metrics")
            assert status == "HTTP/1.1 200 OK"
            assert (await _get(ep.port, "/"))[0] == "HTTP/1.1 404 Not Found"
            nursery.cancel_scope.cancel()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }
    assert samples[("sandvisor_sandbox_cpu_seconds_total", (("id", "sb-b"),))] == 12.25
    assert samples[("sandvisor_sandbox_memory_rss_bytes", (("id", "sb-a"),))] == 300 << 20
    assert samples[("sandvisor_sandbox_memory_limit_bytes", (("id", "sb-b"),))] == 1024 << 20
    assert samples[("sandvisor_sandbox_guest_memory_available_bytes", (("id", "sb-a"),))] == 400 << 20
    assert ("sandvisor_sandbox_guest_memory_available_bytes", (("id", "sb-b"),)) not in samples
    assert samples[("sandvisor_sandboxes", (("state", "stopped"),))] == 3
    assert samples[("sandvisor_sandbox_info", (("id", "sb-a"), ("image", "default"), ("state", "ready")))] == 1
    assert any(name == "process_resident_memory_bytes" for name, _ in samples)  # the supervisor itself


async def test_metrics_endpoint_answers_401_without_the_token_and_asks_no_one() -> None:
    source = FakeSource()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            ep = await nursery.start(_endpoint(source).run)
            for token in (None, b"m" * 39, b"m" * 41, b"x" * 40):
                status, head, body = await _get_head(ep.port, "/metrics", token)
                assert status == "HTTP/1.1 401 Unauthorized", token
                assert b'WWW-Authenticate: Bearer realm="sandvisor metrics"' in head
                assert b"sb-a" not in body
            assert (await _get(ep.port, "/nope", None))[0] == "HTTP/1.1 401 Unauthorized"  # no map of paths either
            assert source.asked == 0 and ep.unauthorized == 5
            assert (await _get(ep.port, "/metrics"))[0] == "HTTP/1.1 200 OK"
            nursery.cancel_scope.cancel()


async def test_metrics_scrapes_share_one_collection_while_it_is_fresh() -> None:
    """However often a token holder scrapes, the guests are asked once per ``cache_for``
    seconds, and concurrent scrapes wait for the one collection under way."""
    source = FakeSource(delay=0.2)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            ep = await nursery.start(_endpoint(source, cache_for=3600).run)
            statuses: list[str] = []

            async def scrape() -> None:
                statuses.append((await _get(ep.port, "/metrics"))[0])

            async with trio.open_nursery() as scrapes:
                for _ in range(8):
                    scrapes.start_soon(scrape)
            assert statuses == ["HTTP/1.1 200 OK"] * 8
            assert (source.asked, ep.collections, ep.scrapes) == (1, 1, 8)
            ep.cache_for = 0  # stale at once: each scrape collects again
            await _get(ep.port, "/metrics")
            assert source.asked == 2
            nursery.cancel_scope.cancel()


async def test_metrics_endpoint_answers_503_when_the_source_is_late() -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            ep = await nursery.start(_endpoint(FakeSource(delay=10), scrape_timeout=0.1).run)
            assert (await _get(ep.port, "/metrics"))[0] == "HTTP/1.1 503 Service Unavailable"
            nursery.cancel_scope.cancel()


async def test_metrics_endpoint_is_loopback_only() -> None:
    assert metrics.check_listen("localhost:9100") == ("localhost", 9100)  # a name: resolved, judged by its class
    assert metrics.check_listen("127.0.0.2:9100") == ("127.0.0.2", 9100)
    for spec in ("0.0.0.0:9100", "[::]:9100", "192.0.2.1:9100"):
        with pytest.raises(ValueError, match="loopback addresses only"):
            metrics.check_listen(spec)
    with pytest.raises(ValueError, match="loopback addresses only"):
        await metrics.MetricsEndpoint(FakeSource(), "0.0.0.0", 0, token=METRICS_TOKEN).run()
    with pytest.raises(ValueError, match="32 to 1024"):
        metrics.MetricsEndpoint(FakeSource(), token=b"short")


def test_metrics_listen_defaults_to_loopback() -> None:
    assert metrics.parse_listen("9100") == ("127.0.0.1", 9100)
    assert metrics.parse_listen(":9100") == ("127.0.0.1", 9100)
    assert metrics.parse_listen("[::1]:9100") == ("::1", 9100)
    assert metrics.parse_listen("0.0.0.0:9100") == ("0.0.0.0", 9100)
    with pytest.raises(ValueError):
        metrics.parse_listen("x:y")


# ---------------------------------------------------------------------------------------
# protobuf <-> the attrs classes both edges share
# ---------------------------------------------------------------------------------------
def test_seed_and_extended_requests_structure_into_one_class() -> None:
    from supervisor.serve.grpc_convert import message_to_dict
    from supervisor.wire import protocol
    from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv

    seed_req = pb.CreateSandboxRequest(id="a", labels={"k": "v"}, cmd=["sh"], limits=pb.ResourceLimits(vcpus=2))
    plain = protocol.structure_body(message_to_dict(seed_req), protocol.CreateSandboxRequest)
    assert (plain.id, plain.labels, plain.cmd, plain.limits.vcpus) == ("a", {"k": "v"}, ["sh"], 2)
    assert plain.ssh_public_key is None  # proto3 optional, unset: the attrs default
    assert plain.network == protocol.NetworkSpec()  # unset message: the attrs default
    ext = protocol.structure_body(
        message_to_dict(sv.CreateRequest(base=seed_req, hostname="h", ephemeral=True)), protocol.CreateSandboxRequest
    )
    assert ext == attrs_evolve(plain, hostname="h", ephemeral=True)
    from supervisor.serve.grpc_service import _sandvisor_create, to_request

    # sandvisor.v1 Create carries an egress policy, a field of the network on both edges
    policy = sv.EgressPolicy(allow=["10.1.0.0/16"], deny=["example.com:443"])
    eg = to_request(sv.CreateRequest(base=seed_req, egress=policy), protocol.CreateSandboxRequest, _sandvisor_create)
    assert eg.network.egress == protocol.EgressSpec(default="allow", allow=["10.1.0.0/16"], deny=["example.com:443"])
    deny_all = sv.CreateRequest(egress=sv.EgressPolicy(default="deny"))
    deny = to_request(deny_all, protocol.CreateSandboxRequest, _sandvisor_create)
    assert deny.network.egress == protocol.EgressSpec(default="deny")
    assert message_to_dict(pb.ExecInput(stdin=b"x")) == {"stdin": b"x"}  # a oneof: only its member


def attrs_evolve(obj: Any, **kw: Any) -> Any:
    import attrs

    return attrs.evolve(obj, **kw)


def test_responses_fill_seed_and_extended_messages() -> None:
    from supervisor.serve.grpc_convert import dict_to_message, message_to_dict
    from supervisor.wire import protocol
    from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv

    info = protocol.SandboxInfo(
        "a", "ready", {"k": "v"}, protocol.ResourceLimits(1, 512), protocol.SandboxNetwork(), 1, 2, 0, 0, ""
    )
    msg = dict_to_message(protocol.unstructure_body(info), pb.SandboxInfo)
    assert msg.HasField("network")
    assert protocol.structure_body(message_to_dict(msg), protocol.SandboxInfo) == info
    ck = protocol.CheckpointResponse("s1", "/d", "2026-11-30T00:00:00Z", size_bytes=5, memory="mapped", paused_ms=1.5)
    seed_msg = dict_to_message(protocol.unstructure_body(ck), pb.CheckpointResponse)  # extensions left out
    assert (seed_msg.snapshot_id, seed_msg.created_at) == ("s1", "2026-11-30T00:00:00Z")
    ours = dict_to_message(protocol.unstructure_body(ck), sv.CheckpointResponse)  # seed part in base
    assert (ours.base.snapshot_id, ours.size_bytes, ours.memory, ours.paused_ms) == ("s1", 5, "mapped", 1.5)
    out = dict_to_message(
        protocol.unstructure_body(protocol.RunOutput(stream="exit", exit_code=3, done=True)), pb.RunOutput
    )
    assert (out.stream, out.exit_code, out.done, out.data) == ("exit", 3, True, b"")


# ---------------------------------------------------------------------------------------
# in the daemon's context; start-up failures
# ---------------------------------------------------------------------------------------
async def test_calls_run_in_the_edges_context(tmp_path: Path) -> None:
    """A call runs in the context of the edge's ``run`` (the daemon's context variables),
    as the msgpack socket's calls do, not in Trio's system context."""

    class SeesContext:
        async def Inspect(self, req: pb.InspectSandboxRequest, call: grpc_bridge.Call[Any, Any]) -> pb.SandboxInfo:
            return pb.SandboxInfo(id=req.id, state=WHO.get())

    def client(target: str) -> str:
        with grpc.insecure_channel(target) as ch:
            return str(G_STUB(ch).Inspect(pb.InspectSandboxRequest(id="q")).state)

    with trio.fail_after(20):
        WHO.set("the edge's runner")
        edge = grpc_bridge.GrpcEdge([UnixAddress(tmp_path / "g.sock")], health=False, reflection=False)
        edge.add_service(SERVICE, SeesContext())
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.run)
            assert await in_thread(client, unix_target(edge)) == "the edge's runner"
            nursery.cancel_scope.cancel()


WHO: contextvars.ContextVar[str] = contextvars.ContextVar("WHO", default="nobody")


def G_STUB(ch: grpc.Channel) -> Any:
    from supervisor.wire.proto.sandbox.v1 import sandbox_pb2_grpc

    return sandbox_pb2_grpc.SandboxServiceStub(ch)


@pytest.mark.skipif(os.geteuid() != 0, reason="setuid children need root")
def test_forking_beside_grpc_threads_does_not_crash_children() -> None:
    """grpcio's fork handlers crash forked children while gRPC threads are busy (4 of 40
    measured); supervisor.serve.grpc_bridge and its modules, the supervisor's only importers of grpc,
    turn them off before they import grpc (not `import supervisor`: no import-time side effects). In a fresh
    interpreter: serve and call gRPC in threads, fork 40 setuid children (QEMU's launch)."""
    script = r"""
import supervisor.serve.grpc_bridge  # grpc first imported by the supervisor, as in `sandvisor serve`
import asyncio, os, subprocess, sys, tempfile, threading, time
import grpc, grpc.aio
sock = os.path.join(tempfile.mkdtemp(), "s.sock")
def serve():
    async def main():
        s = grpc.aio.server(); s.add_insecure_port("unix:" + sock); await s.start(); await asyncio.sleep(60)
    asyncio.run(main())
def call():
    ch = grpc.insecure_channel("unix:" + sock)
    while True:
        try: grpc.channel_ready_future(ch).result(timeout=1); ch.unary_unary("/x/y")(b"", timeout=0.5)
        except Exception: pass
threading.Thread(target=serve, daemon=True).start(); time.sleep(0.5)
threading.Thread(target=call, daemon=True).start(); time.sleep(0.2)
codes = [subprocess.run(["/bin/true"], user=65534, group=65534, extra_groups=[]).returncode for _ in range(40)]
print(os.environ.get("GRPC_ENABLE_FORK_SUPPORT"), sum(c != 0 for c in codes))
os._exit(0)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO, check=True
    ).stdout.split()
    assert out == ["0", "0"], out


async def test_a_port_in_use_fails_the_start_and_leaves_no_thread() -> None:
    with trio.fail_after(20):
        async with serving(TcpAddress("127.0.0.1", 0), tcp_auth=TcpAuth(insecure=True)) as first:
            taken = first.addresses[0]
            assert isinstance(taken, TcpAddress)
            second = grpc_bridge.GrpcEdge([taken], health=False, reflection=False, tcp_auth=TcpAuth(insecure=True))
            async with trio.open_nursery() as nursery:
                with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1"):
                    await nursery.start(second.run)
            assert second._loop is not None
            assert second._loop.is_closed()
    assert not [t for t in threading.enumerate() if t.name == "grpc-edge"]
