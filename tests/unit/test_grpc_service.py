"""The gRPC services on the registry and sandbox actors, on fake VMs (tests/support/fakevm.py).

Clients generated at test time from sandbox.v1's proto (and our own sandvisor.v1 code)
call the daemon's edge (supervisor.serve.grpc_service on supervisor.serve.grpc_bridge) over a Unix
socket: every RPC is bound, requests and responses convert with proto3's zero values,
errors arrive as the status of the same name, a client cancel or a deadline kills the
process in the guest, sandvisor.v1 reaches the same sandboxes, and both edges answer
from one method table. No QEMU: the real lifecycle is tests/vm/test_grpc.py's.

The clients are grpcio's sync ones, run in threads, so the Trio loop stays free; the
clock is real (grpc's threads do not tell a mock clock they are busy)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import trio

from actors.model import SandboxConfig, State
from actors.registry import Registry
from actors.store import Store
from supervisor.client import connect
from supervisor.main.daemon import serve
from supervisor.main.daemon_config import DaemonConfig
from supervisor.serve import grpc_bridge, grpc_service
from supervisor.serve.api import METHODS
from supervisor.serve.grpc_addresses import TcpAddress, UnixAddress
from supervisor.serve.grpc_convert import message_to_dict
from supervisor.serve.metrics import RegistrySource
from supervisor.wire import protocol
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as pb
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
from tests.support.fakevm import FakeLab, fake_settings
from tests.support.grpc_clients import bearer, generate, write_token
from tests.support.grpcstack import Stack, stack, status_of

SC = grpc.StatusCode


@pytest.fixture(scope="session")
def seed() -> tuple[ModuleType, ModuleType]:
    return generate()


async def in_thread(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kw))


async def until(cond: Callable[[], bool], timeout: float = 10) -> None:
    """Wait for a condition of the server's state (the test runs in its process)."""
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.005)


async def ready_via_events(st: Stack, sgrpc: Any, spb: Any, create: Callable[[], Any]) -> Any:
    """Subscribe to "ready", make sure the server has subscribed, then create: no race."""
    before = len(st.reg.events.subs)
    events = sgrpc.SandboxServiceStub(st.channel).Events(spb.SandboxEventsRequest(action="ready"))
    await until(lambda: len(st.reg.events.subs) > before)
    created = await in_thread(create)
    ev = await in_thread(next, events)
    events.cancel()
    assert ev.sandbox_id == created.id
    return created


# ---------------------------------------------------------------------------------------
# the bindings and the conversions
# ---------------------------------------------------------------------------------------
def test_every_rpc_of_every_service_is_bound_with_its_shape() -> None:
    edge = grpc_bridge.GrpcEdge([UnixAddress(Path("/nonexistent/g.sock"))])
    grpc_service.add_services(edge, registry=None)  # type: ignore[arg-type]
    expected = {f"/{name}/{rpc.name}" for name, desc in grpc_service.descriptors().items() for rpc in desc.methods}
    assert set(edge._methods) == expected
    seed_rpcs = {m.name for m in pb.DESCRIPTOR.services_by_name["SandboxService"].methods}
    assert seed_rpcs == {
        *("Create", "Run", "Exec", "Stop", "Remove", "Inspect", "List", "Events"),
        *("ReadFile", "WriteFile", "ExposePort", "UnexposePort"),
    }
    for name, bindings in grpc_service.BINDINGS.items():
        for b in bindings:
            if b.method is not None:
                assert b.method in METHODS, (name, b)


def test_proto3_zero_values_take_our_defaults() -> None:
    ex = grpc_service.to_request(
        pb.ExecInput(init=pb.ExecRequest(id="a", tty=True, tty_size=pb.TerminalSize())), protocol.ExecInput
    )
    assert ex.init.tty_size == protocol.TerminalSize(80, 24)
    unset = grpc_service.to_request(pb.ExecInput(init=pb.ExecRequest(id="a")), protocol.ExecInput)
    assert unset.init.tty_size == protocol.TerminalSize(80, 24)
    assert grpc_service.to_request(
        pb.ExecInput(resize=pb.TerminalSize(width=100)), protocol.ExecInput
    ).resize == protocol.TerminalSize(100, 24)
    assert grpc_service.to_request(pb.ExecInput(stdin=b""), protocol.ExecInput).stdin == b""  # a oneof member set: kept
    assert (
        grpc_service.to_request(pb.ExposePortRequest(id="a", sandbox_port=80), protocol.ExposePortRequest).protocol
        == "tcp"
    )
    assert grpc_service.to_request(sv.MetricsStreamRequest(), protocol.MetricsStreamRequest).interval_seconds == 1.0
    create = grpc_service.to_request(pb.CreateSandboxRequest(), protocol.CreateSandboxRequest)
    assert create == protocol.CreateSandboxRequest()  # every zero is "the default"
    assert (
        grpc_service.to_request(
            pb.CreateSandboxRequest(ssh_public_key=""), protocol.CreateSandboxRequest
        ).ssh_public_key
        == ""
    )
    ours = grpc_service.to_request(
        sv.CreateRequest(
            base=pb.CreateSandboxRequest(id="x", network=pb.NetworkSpec(mode="user")),
            outbound=True,
            hostname="h",
            ports=[sv.PortMapping(sandbox_port=80, host_address="0.0.0.0")],
        ),
        protocol.CreateSandboxRequest,
        grpc_service._sandvisor_create,
    )
    assert ours.network == protocol.NetworkSpec(mode="user", outbound=True)
    # a port's host address is the caller's bind address (checked against serve --port-address)
    assert (ours.id, ours.hostname, ours.ports) == ("x", "h", [protocol.PortMapping(80, 0, "tcp", "0.0.0.0")])
    vols = grpc_service.to_request(
        sv.CreateRequest(volumes=[sv.VolumeMount(volume="v", target="/data", readonly=True)]),
        protocol.CreateSandboxRequest,
        grpc_service._sandvisor_create,
    )
    assert vols.volumes == [protocol.VolumeMount("v", "/data", True)]
    tmpfs = grpc_service.to_request(
        sv.CreateRequest(tmpfs=[sv.TmpfsMount(target="/scratch", size_mib=64), sv.TmpfsMount(target="/t")]),
        protocol.CreateSandboxRequest,
        grpc_service._sandvisor_create,
    )
    assert tmpfs.tmpfs == [protocol.TmpfsMount("/scratch", 64), protocol.TmpfsMount("/t", 0)]


def test_responses_fill_the_seed_messages_and_ours() -> None:
    info = protocol.ListSnapshotsResponse(
        [protocol.SnapshotSummary("s", "a", "n", {}, "/d", "t", size_bytes=7, pool_ready=2)]
    )
    seed_msg = grpc_service.to_message(info, pb.ListSnapshotsResponse)
    assert (seed_msg.snapshots[0].id, seed_msg.snapshots[0].snapshot_dir) == ("s", "/d")
    ours = grpc_service.to_message(info, sv.ListSnapshotsResponse)
    assert (ours.snapshots[0].base.id, ours.snapshots[0].size_bytes, ours.snapshots[0].pool_ready) == ("s", 7, 2)
    assert grpc_service.to_message(None, pb.Empty) == pb.Empty()


def test_grpc_addresses_from_the_daemon_flags(tmp_path: Path) -> None:
    [unix] = grpc_service.addresses(["unix:///run/x/g.sock"], group="root")
    assert unix == UnixAddress(Path("/run/x/g.sock"), "root")
    assert isinstance(unix, UnixAddress) and isinstance(unix.policy, grpc_service.ServePolicy)
    with pytest.raises(ValueError, match="no such group"):
        grpc_service.addresses(["unix:///run/x/g.sock"], group="no-such-group-here")
    # TCP: every client authenticates; plaintext loopback too
    with pytest.raises(ValueError, match=r"--grpc-token-file FILE .* --grpc-client-ca"):
        grpc_service.addresses(["127.0.0.1:0"])
    insecure = grpc_service.tcp_auth(insecure=True)
    assert grpc_service.addresses(["127.0.0.1:0"], auth=insecure) == [TcpAddress("127.0.0.1", 0)]
    write_token(tmp_path / "token")
    token = grpc_service.tcp_auth(tmp_path / "token")
    (tmp_path / "c").write_bytes(b"cert")
    (tmp_path / "k").write_bytes(b"key")
    assert grpc_service.addresses(["[::1]:0"], auth=token) == [TcpAddress("::1", 0)]
    with pytest.raises(ValueError, match="needs TLS"):
        grpc_service.addresses(["0.0.0.0:50051"], auth=token)  # a token over plaintext off loopback: never
    with pytest.raises(ValueError, match="loopback addresses only"):
        grpc_service.addresses(["0.0.0.0:1"], cert=tmp_path / "c", key=tmp_path / "k", auth=insecure)
    with pytest.raises(ValueError, match="go together"):
        grpc_service.addresses(["0.0.0.0:1"], cert=tmp_path / "c")
    with pytest.raises(ValueError, match="would let any client in"):  # TLS, but anyone may connect
        grpc_service.addresses(["0.0.0.0:1"], cert=tmp_path / "c", key=tmp_path / "k")
    [tcp] = grpc_service.addresses(["0.0.0.0:1"], cert=tmp_path / "c", key=tmp_path / "k", client_ca=tmp_path / "c")
    assert isinstance(tcp, TcpAddress) and tcp.tls is not None and tcp.tls.require_client_cert
    [tcp] = grpc_service.addresses(["0.0.0.0:1"], cert=tmp_path / "c", key=tmp_path / "k", auth=token)
    assert isinstance(tcp, TcpAddress) and tcp.tls is not None and not tcp.tls.require_client_cert


def test_the_token_file_is_ours_0600_and_a_real_token(tmp_path: Path) -> None:
    good = tmp_path / "good"
    token = write_token(good)
    auth = grpc_service.tcp_auth(good)
    assert auth is not None and auth.all_tokens[0].secret == token.encode() and token not in repr(auth)
    assert grpc_service.tcp_auth() is None
    loose = tmp_path / "loose"
    loose.write_text(token)
    loose.chmod(0o640)
    link = tmp_path / "link"
    link.symlink_to(good)
    short = tmp_path / "short"
    fd = os.open(short, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"hunter2\n")
    os.close(fd)
    for path, words in (
        (loose, "mode 0600 or stricter"),
        (link, "symbolic links"),
        (short, "32 to 1024 characters"),
        (tmp_path / "missing", "No such file"),
    ):
        with pytest.raises(ValueError, match=words):
            grpc_service.tcp_auth(path)
    with pytest.raises(ValueError, match="contradict"):
        grpc_service.tcp_auth(good, insecure=True)


def test_serve_refuses_tcp_grpc_without_client_authentication(tmp_path: Path) -> None:
    """``sandvisor serve --grpc 127.0.0.1:PORT`` alone: one line naming the flags, exit 2,
    nothing started (no socket, no state dir); serve() itself refuses the same config."""
    env = {**os.environ, "SANDVISOR_SOCKET": str(tmp_path / "s.sock"), "SANDVISOR_STATE_DIR": str(tmp_path / "st")}
    argv = [sys.executable, "-m", "supervisor.main.cli", "serve", "--grpc", "127.0.0.1:1", "--ip-pool", "none"]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "127.0.0.1:1" in line and "--grpc-token-file" in line and "--grpc-client-ca" in line, line
    assert not (tmp_path / "st").exists() and not (tmp_path / "s.sock").exists()
    cfg = DaemonConfig(socket=tmp_path / "s.sock", state_dir=tmp_path / "st", grpc=("127.0.0.1:1",))
    with pytest.raises(ValueError, match="would let any client in"):
        trio.run(serve, cfg)
    assert not (tmp_path / "s.sock").exists()


# ---------------------------------------------------------------------------------------
# sandbox.v1 on fake VMs
# ---------------------------------------------------------------------------------------
async def test_the_daemons_tcp_edge_serves_the_token_only(
    tmp_path: Path, short_dir: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    """The daemon's edge (both protos) on loopback TCP with --grpc-token-file: a seed
    client with the token creates a sandbox; without it, or with another, every RPC is
    UNAUTHENTICATED and nothing happens; the Unix socket beside it needs no token."""
    spb, sgrpc = seed
    token = write_token(tmp_path / "token")
    auth = grpc_service.tcp_auth(tmp_path / "token")
    lab = FakeLab()
    store = Store(tmp_path / "state" / "sandvisor.db")
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                await n.start(lab.run)
                reg = await n.start(Registry(fake_settings(tmp_path, lab), store, templates=False).run)
                addrs = grpc_service.addresses([f"unix://{short_dir / 'g.sock'}", "127.0.0.1:0"], auth=auth)
                edge = await n.start(grpc_service.build_edge(reg, addrs, tcp_auth=auth).run)
                tcp = edge.addresses[1]
                assert isinstance(tcp, TcpAddress)

                def create(target: str, md: list[tuple[str, str]], id: str) -> str:
                    with grpc.insecure_channel(target) as ch:
                        try:
                            return str(
                                sgrpc.SandboxServiceStub(ch).Create(spb.CreateSandboxRequest(id=id), metadata=md).id
                            )
                        except grpc.RpcError as exc:
                            return exc.code().name

                def info(md: list[tuple[str, str]]) -> str:
                    with grpc.insecure_channel(tcp.target) as ch:
                        try:
                            return str(sv_grpc.SandvisorServiceStub(ch).Info(sv.InfoRequest(), metadata=md).version)
                        except grpc.RpcError as exc:
                            return exc.code().name

                assert await in_thread(create, tcp.target, bearer(token), "tok") == "tok"
                assert await in_thread(create, tcp.target, [], "none") == "UNAUTHENTICATED"
                assert await in_thread(create, tcp.target, bearer(token[::-1]), "other") == "UNAUTHENTICATED"
                assert await in_thread(info, []) == "UNAUTHENTICATED"
                assert await in_thread(info, bearer(token)) not in ("", "UNAUTHENTICATED")
                assert await in_thread(create, f"unix:{short_dir / 'g.sock'}", [], "unix") == "unix"
                assert {sb.id for sb in reg.sandboxes.values()} == {"tok", "unix"}
                assert edge.unauthenticated == 3
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


async def test_the_seed_lifecycle_on_fake_vms(
    tmp_path: Path, short_dir: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    spb, sgrpc = seed
    big = bytes(range(256)) * 4096 * 3  # 3 MiB: chunked both ways
    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            s = sgrpc.SandboxServiceStub(st.channel)
            snaps = sgrpc.SandboxSnapshotServiceStub(st.channel)

            def create() -> Any:
                resp = s.Create(spb.CreateSandboxRequest(id="a", labels={"k": "v"}, env={"E": "1"}))
                assert (resp.id, resp.state, resp.ip_address) == ("a", "starting", "")
                return resp

            await ready_via_events(st, sgrpc, spb, create)
            out = await in_thread(lambda: list(s.Run(spb.RunRequest(id="a", cmd=["sh", "-c", "echo o; exit 3"]))))
            assert [(o.stream, o.data) for o in out[:-1]] == [("stdout", b"o\n")]
            assert (out[-1].stream, out[-1].exit_code, out[-1].done) == ("exit", 3, True)

            inputs = [spb.ExecInput(init=spb.ExecRequest(id="a", cmd=["cat"])), spb.ExecInput(stdin=b"in")]
            out = await in_thread(lambda: list(s.Exec(iter(inputs))))  # the end of the iterator: end of stdin
            assert b"".join(o.data for o in out) == b"in" and out[-1].done
            tty = [
                spb.ExecInput(init=spb.ExecRequest(id="a", cmd=["stty", "size"], tty=True)),  # no size: 80x24
                spb.ExecInput(resize=spb.TerminalSize(width=120, height=40)),
            ]
            out = await in_thread(lambda: list(s.Exec(iter(tty))))
            assert b"24 80" in b"".join(o.data for o in out)

            def files() -> bytes:
                def writes() -> Iterator[Any]:
                    yield spb.WriteFileRequest(open=spb.WriteFileOpen(id="a", path="/root/f"))
                    for i in range(0, len(big), 1 << 20):
                        yield spb.WriteFileRequest(chunk=spb.FileChunk(data=big[i : i + (1 << 20)]))
                    yield spb.WriteFileRequest(chunk=spb.FileChunk(done=True))

                assert s.WriteFile(writes()) == spb.Empty()
                chunks = list(s.ReadFile(spb.ReadFileRequest(id="a", path="/root/f")))
                assert chunks[-1].done
                return b"".join(c.data for c in chunks)

            assert await in_thread(files) == big
            assert st.lab.guests[0].files["/root/f"][0] == 0o644  # mode 0: the default

            info = await in_thread(s.Inspect, spb.InspectSandboxRequest(id="a"))
            assert (info.state, dict(info.labels), info.limits.memory_mib, info.last_exit_code) == (
                "ready",
                {"k": "v"},
                256,
                3,
            )
            for i in range(21):  # sandbox.v1's List has no paging: all of them, not a page of 20
                await st.reg.create(f"many{i}", st.reg.get("a").config)
            listed = await in_thread(s.List, spb.ListSandboxesRequest())
            assert len(listed.sandboxes) == 22
            only = await in_thread(s.List, spb.ListSandboxesRequest(labels={"k": "v"}, state="ready"))
            assert {x.id for x in only.sandboxes} <= {x.id for x in listed.sandboxes}

            code, why = await status_of(s.ExposePort, spb.ExposePortRequest(id="a", sandbox_port=80))
            assert code == SC.FAILED_PRECONDITION and "network" in why

            ck = await in_thread(snaps.Checkpoint, spb.CheckpointRequest(sandbox_id="a", name="base"))
            assert ck.snapshot_id and ck.created_at.endswith("Z")
            restored = await in_thread(snaps.Restore, spb.RestoreRequest(snapshot_id="base", id="b"))
            assert restored.id == "b" and st.reg.get("b").state == State.READY  # ready on return
            listed_snaps = await in_thread(snaps.ListSnapshots, spb.ListSnapshotsRequest(sandbox_id="a"))
            assert [x.id for x in listed_snaps.snapshots] == [ck.snapshot_id]
            code, why = await status_of(snaps.DeleteSnapshot, spb.DeleteSnapshotRequest(snapshot_id=ck.snapshot_id))
            assert code == SC.FAILED_PRECONDITION and "in use" in why

            assert await in_thread(s.Stop, spb.StopSandboxRequest(id="a", timeout_seconds=5)) == spb.Empty()
            assert st.reg.get("a").state == State.STOPPED
            await in_thread(s.Remove, spb.RemoveSandboxRequest(id="a"))
            code, _ = await status_of(s.Inspect, spb.InspectSandboxRequest(id="a"))
            assert code == SC.NOT_FOUND


async def test_errors_arrive_with_the_status_of_the_same_name(
    tmp_path: Path, short_dir: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    spb, sgrpc = seed
    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            s = sgrpc.SandboxServiceStub(st.channel)
            await in_thread(s.Create, spb.CreateSandboxRequest(id="e"))
            await until(lambda: st.reg.get("e").state == State.READY)
            cases: list[tuple[grpc.StatusCode, Callable[[], Any]]] = [
                (SC.NOT_FOUND, lambda: s.Inspect(spb.InspectSandboxRequest(id="nope"))),
                (SC.NOT_FOUND, lambda: s.Run(spb.RunRequest(id="nope", cmd=["true"]))),
                (SC.NOT_FOUND, lambda: s.ReadFile(spb.ReadFileRequest(id="e", path="/no/such"))),
                (SC.INVALID_ARGUMENT, lambda: s.ReadFile(spb.ReadFileRequest(id="e", path="relative"))),
                (SC.INVALID_ARGUMENT, lambda: s.List(spb.ListSandboxesRequest(state="bogus"))),
                (SC.INVALID_ARGUMENT, lambda: s.Create(spb.CreateSandboxRequest(id="bad\x01id"))),
                (SC.INVALID_ARGUMENT, lambda: s.Run(spb.RunRequest(id="e"))),  # no cmd
                (SC.INVALID_ARGUMENT, lambda: s.Exec(iter([spb.ExecInput(stdin=b"x")]))),  # no init first
                (SC.INVALID_ARGUMENT, lambda: s.Exec(iter([]))),  # no message at all
                (SC.ALREADY_EXISTS, lambda: s.Create(spb.CreateSandboxRequest(id="e", labels={"other": "1"}))),
                (SC.FAILED_PRECONDITION, lambda: s.Create(spb.CreateSandboxRequest(id="i", image="alpine"))),
                (
                    SC.FAILED_PRECONDITION,
                    lambda: s.Create(spb.CreateSandboxRequest(id="m", mounts=[spb.Mount(source="/", target="/h")])),
                ),
                (SC.INVALID_ARGUMENT, lambda: s.Create(spb.CreateSandboxRequest(id="k", ssh_public_key=""))),  # no key
                (
                    SC.FAILED_PRECONDITION,
                    lambda: s.Create(spb.CreateSandboxRequest(id="t", network=spb.NetworkSpec(mode="tap"))),
                ),
            ]
            for code, fn in cases:
                got, why = await status_of(fn)
                assert got == code, (code, why)
                assert why
            sv_stub = sv_grpc.SandvisorServiceStub(st.channel)
            listed = await trio.to_thread.run_sync(sv_stub.ListVolumes, sv.ListVolumesRequest())
            assert list(listed.volumes) == []
            got, why = await status_of(sv_stub.InspectVolume, sv.InspectVolumeRequest(name="nope"))
            assert got == SC.NOT_FOUND and "nope" in why
            missing = sv.CreateRequest(
                base=spb.CreateSandboxRequest(id="v"), volumes=[sv.VolumeMount(volume="nope", target="/data")]
            )
            got, why = await status_of(sv_stub.Create, missing)
            assert got == SC.NOT_FOUND and "nope" in why
            # one running workload at a time, as sandbox.v1 says
            hang = s.Run(spb.RunRequest(id="e", cmd=["sleep", "100"]))
            await until(lambda: st.reg.get("e").state == State.RUNNING)
            got, _ = await status_of(s.Run, spb.RunRequest(id="e", cmd=["true"]))
            assert got == SC.FAILED_PRECONDITION
            hang.cancel()


async def test_cancels_and_deadlines_kill_the_process_in_the_guest(
    tmp_path: Path, short_dir: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    spb, sgrpc = seed
    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            s = sgrpc.SandboxServiceStub(st.channel)
            await in_thread(s.Create, spb.CreateSandboxRequest(id="c"))
            await until(lambda: st.reg.get("c").state == State.READY)
            guest = st.lab.guests[0]

            code, _ = await status_of(s.Run, spb.RunRequest(id="c", cmd=["sleep", "100"]), timeout=0.5)
            assert code == SC.DEADLINE_EXCEEDED
            run_proc = guest.execs[-1]
            await until(lambda: not run_proc.running)
            assert run_proc.argv == ["sleep", "100"] and run_proc.signals == [9]
            await until(lambda: st.reg.get("c").state == State.READY)

            call = s.Exec(iter([spb.ExecInput(init=spb.ExecRequest(id="c", cmd=["sleep", "100"]))]))
            await until(lambda: len(guest.execs) == 2)
            call.cancel()
            exec_proc = guest.execs[-1]
            await until(lambda: not exec_proc.running)
            assert exec_proc.signals == [9]
            assert st.reg.get("c").execs == 0


async def test_a_cancel_before_the_guests_answer_kills_the_process_too(
    tmp_path: Path, short_dir: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    """The window the test above could fall into under load: the client's cancel reaches
    the Exec's handler while the guest's exec_started is still on its way (the guest has
    started the process). The process is killed all the same. (Before, the handler left
    without a kill: the process ran on in the guest, its late exec_started dropped.)"""
    spb, sgrpc = seed
    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            s = sgrpc.SandboxServiceStub(st.channel)
            await in_thread(s.Create, spb.CreateSandboxRequest(id="c"))
            await until(lambda: st.reg.get("c").state == State.READY)
            guest = st.lab.guests[0]
            guest.hold_exec_started = trio.Event()
            started = len(guest.execs)

            call = s.Exec(iter([spb.ExecInput(init=spb.ExecRequest(id="c", cmd=["sleep", "100"]))]))
            await until(lambda: len(guest.execs) == started + 1)  # the process is there; its answer held
            proc = guest.execs[-1]
            assert st.reg.get("c").execs == 1
            call.cancel()
            await until(lambda: st.reg.get("c").execs == 0)  # the handler left the exec, unanswered
            guest.hold_exec_started.set()
            await until(lambda: not proc.running)
            assert proc.signals == [9]
            code, _ = await status_of(lambda: list(call))
            assert code == SC.CANCELLED


# ---------------------------------------------------------------------------------------
# sandvisor.v1 on the same sandboxes; both edges on one table; the metrics source
# ---------------------------------------------------------------------------------------
async def test_sandvisor_v1_reaches_the_same_sandboxes(
    tmp_path: Path, short_dir: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    spb, sgrpc = seed
    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            ours = sv_grpc.SandvisorServiceStub(st.channel)
            s = sgrpc.SandboxServiceStub(st.channel)

            def create() -> Any:
                return ours.Create(
                    sv.CreateRequest(
                        base=pb.CreateSandboxRequest(id="u", network=pb.NetworkSpec(mode="user")),
                        hostname="web",
                        outbound=True,
                        ports=[sv.PortMapping(sandbox_port=8080)],
                    )
                )

            await ready_via_events(st, sgrpc, spb, create)
            sb = st.reg.get("u")
            assert sb.config.network.outbound and sb.config.hostname == "web"
            ports = await in_thread(ours.ListPorts, sv.ListPortsRequest(id="u"))
            [p] = ports.ports
            assert (p.sandbox_port, p.protocol, p.host_address) == (8080, "tcp", "127.0.0.1") and p.host_port
            exposed = await in_thread(s.ExposePort, spb.ExposePortRequest(id="u", sandbox_port=9000))  # sandbox.v1 RPC
            assert exposed.host_port and exposed.guest_port == 9000
            assert len((await in_thread(ours.ListPorts, sv.ListPortsRequest(id="u"))).ports) == 2
            await in_thread(s.UnexposePort, spb.UnexposePortRequest(id="u", sandbox_port=9000))

            await in_thread(lambda: list(s.Run(spb.RunRequest(id="u", cmd=["echo", "logged"]))))
            logs = await in_thread(lambda: list(ours.Logs(sv.LogsRequest(id="u"))))
            assert ("stdout", b"logged\n") in {(e.source, e.data) for e in logs}
            only = await in_thread(lambda: list(ours.Logs(sv.LogsRequest(id="u", sources=["stdout"]))))
            assert only and {e.source for e in only} == {"stdout"}
            code, _ = await status_of(lambda: ours.Logs(sv.LogsRequest(id="u", sources=["nope"])))
            assert code == SC.INVALID_ARGUMENT
            m = await in_thread(ours.Metrics, sv.MetricsRequest(id="u"))
            assert m.id == "u" and m.memory_total_bytes > 0
            stream = ours.MetricsStream(sv.MetricsStreamRequest(id="u"))  # interval 0: the default 1 s
            assert (await in_thread(next, stream)).id == "u"
            stream.cancel()
            assert (await in_thread(ours.Ping, sv.PingRequest(id="u"))).latency_ns > 0
            assert (await in_thread(ours.Touch, sv.TouchRequest(id="u"))).activity > 0
            info = await in_thread(ours.Info, sv.InfoRequest())
            assert (
                info.accel == "tcg" and info.default_image == "fake" and dict(info.sandboxes_by_state) == {"ready": 1}
            )
            assert "sandbox.v1.SandboxService" in info.services
            images = await in_thread(ours.ListImages, sv.ListImagesRequest())
            assert [(i.name, i.is_default) for i in images.images] == [("fake", True)]
            got, _ = await status_of(ours.InspectImage, sv.InspectImageRequest(name="other"))
            assert got == SC.NOT_FOUND

            await in_thread(ours.Create, sv.CreateRequest(base=pb.CreateSandboxRequest(id="v")))
            page = await in_thread(ours.List, sv.ListRequest(limit=1))
            assert [x.id for x in page.sandboxes] == ["v"] and page.next_cursor
            rest = await in_thread(ours.List, sv.ListRequest(limit=1, cursor=page.next_cursor))
            assert [x.id for x in rest.sandboxes] == ["u"] and not rest.next_cursor

            await in_thread(ours.Kill, sv.KillRequest(id="u"))
            final = await in_thread(ours.WaitUntilStopped, sv.WaitUntilStoppedRequest(id="u"))
            assert final.state == "stopped"
            started = await in_thread(ours.Start, sv.StartRequest(id="u"))
            assert started.state in ("starting", "ready")  # a fake VM may boot before Start answers
            await until(lambda: st.reg.get("u").state == State.READY)
            await in_thread(ours.Drain, sv.DrainRequest(id="u"))
            await until(lambda: st.reg.get("u").state == State.STOPPED)


async def test_both_edges_answer_from_one_table(
    tmp_path: Path, short_dir: Path, seed: tuple[ModuleType, ModuleType]
) -> None:
    spb, sgrpc = seed
    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            async with connect(st.msgpack) as c:
                await c.call("Create", {"id": "one", "labels": {"a": "b"}})
                await until(lambda: st.reg.get("one").state == State.READY)
                over_msgpack = await c.call("Inspect", {"id": "one"})
                listed = await c.call("ListAll", {})
                assert [x["id"] for x in listed["sandboxes"]] == ["one"]
                assert (await c.call("Info", {}))["sandboxes_by_state"] == {"ready": 1}
            stub = sgrpc.SandboxServiceStub(st.channel)
            over_grpc = await in_thread(stub.Inspect, spb.InspectSandboxRequest(id="one"))
            # the read-back (docs/modify.md) is sandvisor.v1's: sandbox.v1's SandboxInfo has no field for it
            ext = {k: over_msgpack.pop(k) for k in ("requested", "applied", "updated_at", "shell")}
            assert over_msgpack.pop("uid") == st.reg.get("one").record.uid  # (the socket's alone: the E2B endpoint's)
            assert over_msgpack.pop("ssh_keys") == [] and over_msgpack.pop("owner")  # (the socket's: serve --ssh's)
            assert over_msgpack.pop("init") is None  # (sandvisor.v1's SandboxDetails.init: unset when none)
            assert over_msgpack.pop("pending") is None  # (nothing saved for the next start: unset on gRPC)
            assert over_msgpack.pop("cause", None) is None  # (none ended yet: sandvisor.v1's SandboxDetails.cause)
            # lineage and memory per branch (docs/fork.md): sandvisor.v1's SandboxDetails alone
            lineage = ("parent", "parent_uid", "fork_snapshot", "forked_at", "memory_shared_bytes", "memory_own_bytes")
            ext |= {k: over_msgpack.pop(k) for k in lineage}
            ext["guest_oom_kills"] = over_msgpack.pop("guest_oom_kills")  # (sandvisor.v1's SandboxDetails alone)
            assert message_to_dict(over_grpc) == over_msgpack
            ours = sv_grpc.SandvisorServiceStub(st.channel)
            details = await in_thread(ours.Inspect, sv.InspectRequest(id="one"))
            assert message_to_dict(details) == {**over_msgpack, **ext}


async def test_the_registry_feeds_the_prometheus_collector(tmp_path: Path, short_dir: Path) -> None:
    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            await st.reg.create("p", SandboxConfig())
            await until(lambda: st.reg.get("p").state == State.READY)
            await st.reg.create("q", SandboxConfig())
            await until(lambda: st.reg.get("q").state == State.READY)
            st.reg.kill("q")
            await st.reg.get("q").wait_stopped()
            sample = await RegistrySource(st.reg).collect_metrics()
    [p] = sample.sandboxes  # the stopped one has no series
    mem_total = st.lab.guests[0].mem_total
    assert (p.id, p.state, p.memory_limit_bytes, p.image) == ("p", "ready", 256 << 20, "fake")
    assert p.guest_memory_available_bytes == mem_total * 3 // 4
    assert sample.by_state == {"ready": 1, "stopped": 1}


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists(), reason="a client of another uid needs root"
)
async def test_peer_credentials_authorise_as_on_the_msgpack_socket(tmp_path: Path, short_dir: Path) -> None:
    """Served: root and the supervisor's uid (and --group). Another uid that reaches the socket
    anyway (its mode loosened) is refused by its peer credentials, as the msgpack socket
    refuses it at hello (what it is told: tests/unit/test_grpc_edge.py); the socket is 0600."""
    probe = (
        "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
        "s.sendall(b'PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n'); print(len(s.recv(9)))"
    )
    sock = short_dir / "g.sock"
    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            assert sock.stat().st_mode & 0o777 == 0o600
            assert await in_thread(st.channel.unary_unary("/sandbox.v1.SandboxService/List"), b"") == b""
            assert st.edge.refused == 0
            short_dir.chmod(0o755)
            sock.chmod(0o666)  # someone loosened it: the second gate holds
            # the system's python: the venv's may sit where another uid cannot reach it
            nobody = await trio.run_process(
                ["/usr/bin/python3", "-c", probe, str(sock)], user=65534, group=65534, capture_stdout=True
            )
            assert nobody.stdout.strip() == b"9"  # a grpc server answered: the refuser
            await until(lambda: st.edge.refused == 1)
    assert not [p.name for p in short_dir.iterdir() if p.name.startswith((".grpc-", "g.sock"))]


async def test_modify_and_the_read_back_over_grpc(tmp_path: Path, short_dir: Path) -> None:
    """sandvisor.v1 Create's ceilings and disk size, Modify (a dry run, live, refused),
    and Inspect's read-back: the table's, on fake VMs (the guest side: test_modify.py)."""
    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            ours = sv_grpc.SandvisorServiceStub(st.channel)
            base = pb.CreateSandboxRequest(id="r", limits=pb.ResourceLimits(vcpus=1))
            await in_thread(ours.Create, sv.CreateRequest(base=base, max_vcpus=2, disk_size_mib=128))
            await until(lambda: st.reg.get("r").state == State.READY)
            d = await in_thread(ours.Inspect, sv.InspectRequest(id="r"))
            assert (d.requested.vcpus, d.requested.max_vcpus, d.requested.disk_size_mib) == (1, 2, 128)
            assert (d.applied.max_vcpus, d.applied.disk_size_mib, d.updated_at) == (2, 128, 0)
            dry = await in_thread(ours.Modify, sv.ModifyRequest(id="r", vcpus=2, dry_run=True))
            assert dry.dry_run and not dry.applied and dry.changes[0].status == "applied_live"
            r = await in_thread(ours.Modify, sv.ModifyRequest(id="r", vcpus=2, labels={"k": "v"}, working_dir="/w"))
            assert r.applied and [c.status for c in r.changes] == ["applied_live"] * 3
            no = await in_thread(ours.Modify, sv.ModifyRequest(id="r", vcpus=4, disk_size_mib=64))
            assert not no.applied and [c.status for c in no.changes] == ["needs_restart", "refused"]
            d = await in_thread(ours.Inspect, sv.InspectRequest(id="r"))
            assert (d.requested.vcpus, d.applied.vcpus, d.requested.working_dir) == (2, 2, "/w")
            assert dict(d.base.labels) == {"k": "v"} and d.updated_at > 0
            assert await status_of(ours.Modify, sv.ModifyRequest(id="r", memory_mib=1)) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "memory must be 64 to 65536 MiB",
            )
            assert (await status_of(ours.Modify, sv.ModifyRequest(id="nope", vcpus=1)))[0] == grpc.StatusCode.NOT_FOUND
