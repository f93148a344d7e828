"""sandbox.v1 over gRPC against real VMs: clients generated from sandbox.v1's proto drive a
throwaway supervisor over its gRPC Unix socket, and over TLS on loopback.

One supervisor and two boots for the file (TCG boots are the cost): ``a`` is the sandbox.v1
client's sandbox (network mode "", which is none) and goes through the whole lifecycle,
its snapshot restores into ``b``; ``u`` is created through sandvisor.v1 with user
networking, for ExposePort, TLS and the Prometheus endpoint. The clients are grpcio's
sync ones, run in threads so the supervisor's Trio loop (this test's) stays free."""

from __future__ import annotations

import io
import os
import queue
import socket
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import trio

from actors.model import State
from actors.net.ports import free_port
from actors.registry import Registry
from images.build import Image
from supervisor.main.throwaway import supervisor, workdir
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
from tests.support.grpc_clients import generate, make_pki

SC = grpc.StatusCode
MiB = 1 << 20


@pytest.fixture(scope="module")
def seed() -> tuple[ModuleType, ModuleType]:
    return generate()


async def in_thread(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kw))


async def status(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[grpc.StatusCode, str]:
    """The status code and details a call fails with (streams are drained)."""

    def call() -> tuple[grpc.StatusCode, str]:
        try:
            result = fn(*args, **kw)
            if hasattr(result, "__next__"):
                list(result)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        raise AssertionError("no error")

    return await trio.to_thread.run_sync(call)


async def until(cond: Callable[[], bool], timeout: float = 60) -> None:
    """Wait for a condition of the supervisor's state (it runs in this process)."""
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.01)


def gone_in_guest(stub: Any, spb: Any, id: str, pid: int) -> int:
    """Exit code of a check in the guest that ``pid`` has ended (0), within 20 s (124: it runs on)."""
    cmd = ["timeout", "20", "tail", "-s", "0.05", f"--pid={pid}", "-f", "/dev/null"]
    out = list(stub.Exec(iter([spb.ExecInput(init=spb.ExecRequest(id=id, cmd=cmd))]), timeout=60))
    return int(out[-1].exit_code)


class Interactive:
    """An Exec whose input is sent as the test goes (grpc reads the queue in its thread)."""

    def __init__(self, stub: Any, spb: Any, init: Any) -> None:
        self.q: queue.Queue[Any] = queue.Queue()
        self.q.put(spb.ExecInput(init=init))
        self.spb = spb
        self.call = stub.Exec(iter(self.q.get, None), timeout=120)

    def send(self, **payload: Any) -> None:
        self.q.put(self.spb.ExecInput(**payload))

    def half_close(self) -> None:
        self.q.put(None)

    def read_until(self, marker: bytes) -> bytes:
        got = b""
        while marker not in got:
            got += next(self.call).data
        return got


def get_metrics(port: int, token: bytes | None) -> tuple[bytes, bytes]:
    """GET /metrics with ``Authorization: Bearer TOKEN`` (none if None): the head and the body."""
    auth = b"Authorization: Bearer " + token + b"\r\n" if token is not None else b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def scrape(port: int, token: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    head, body = get_metrics(port, token)
    assert head.startswith(b"HTTP/1.1 200"), head
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }


async def test_seed_clients_drive_the_lifecycle_over_grpc(image: Image, seed: tuple[ModuleType, ModuleType]) -> None:
    spb, sgrpc = seed
    pki = make_pki()
    with workdir("sv-grpc-") as work:
        for name in ("ca", "server_cert", "server_key"):
            (work.root / name).write_bytes(pki[name])
        grpc_sock = work.root / "g.sock"
        tls_port = free_port("127.0.0.1", "tcp")
        metrics_port = free_port("127.0.0.1", "tcp")
        options: dict[str, Any] = {
            "grpc": (f"unix://{grpc_sock}", f"127.0.0.1:{tls_port}"),
            "grpc_cert": work.root / "server_cert",
            "grpc_key": work.root / "server_key",
            "grpc_client_ca": work.root / "ca",
            "metrics": f"127.0.0.1:{metrics_port}",
            "metrics_token_file": work.root / "metrics.token",  # (made 0600 by serve: it is not there)
            "templates": False,  # two boots of two configurations: a template of each would be waste
            "stop_timeout": 5,
        }
        with trio.fail_after(900):
            async with supervisor(work, **options) as (_cfg, reg):
                assert grpc_sock.stat().st_mode & 0o777 == 0o600  # as the msgpack socket
                with grpc.insecure_channel(f"unix:{grpc_sock}") as ch:
                    await _lifecycle(reg, ch, spb, sgrpc, tls_port, (metrics_port, work.root / "metrics.token"), pki)


async def _lifecycle(
    reg: Registry,
    ch: grpc.Channel,
    spb: Any,
    sgrpc: Any,
    tls_port: int,
    metrics: tuple[int, Path],
    pki: dict[str, bytes],
) -> None:
    metrics_port, metrics_token = metrics
    s = sgrpc.SandboxServiceStub(ch)
    snaps = sgrpc.SandboxSnapshotServiceStub(ch)
    ours = sv_grpc.SandvisorServiceStub(ch)

    # --- Create returns "starting"; Events until "ready" (subscribed before the Create) ---
    events = s.Events(spb.SandboxEventsRequest(id="a"))
    await until(lambda: len(reg.events.subs) == 1)
    created = await in_thread(s.Create, spb.CreateSandboxRequest(id="a", labels={"team": "grpc"}))
    assert (created.id, created.state, created.ip_address) == ("a", "starting", "")
    # u (sandvisor.v1, user networking) boots beside a
    u = await in_thread(
        ours.Create,
        sv.CreateRequest(
            base=spb.CreateSandboxRequest(id="u", network=spb.NetworkSpec(mode="user")),
            hostname="web",
            patches=[sv.PatchSpec(op="file", path="/etc/sv-patched", data=b"patched\n", mode=0o640)],
            scripts={"hello": "echo hello $1 from $(hostname)"},
            tmpfs=[sv.TmpfsMount(target="/scratch", size_mib=8)],
        ),
    )
    assert (u.state, u.ip_address) == ("starting", "10.0.2.15")

    def first_events() -> list[str]:
        actions = []
        for ev in events:
            actions.append(ev.action)
            if ev.action in ("ready", "failed"):
                return actions
        return actions

    assert await in_thread(first_events) == ["created", "ready"]

    # --- Run streams output and ends with done and the exit code ---
    out = await in_thread(
        lambda: list(s.Run(spb.RunRequest(id="a", cmd=["sh", "-c", "echo out; echo err >&2; exit 3"])))
    )
    assert {(o.stream, o.data) for o in out[:-1]} == {("stdout", b"out\n"), ("stderr", b"err\n")}
    assert (out[-1].stream, out[-1].exit_code, out[-1].done, out[-1].data) == ("exit", 3, True, b"")

    # --- Exec: stdin, then a TTY sized at init and resized ---
    cat = [spb.ExecInput(init=spb.ExecRequest(id="a", cmd=["cat"])), spb.ExecInput(stdin=b"hello exec\n")]
    out = await in_thread(lambda: list(s.Exec(iter(cat))))  # the end of the iterator closes stdin
    assert b"".join(o.data for o in out) == b"hello exec\n" and (out[-1].done, out[-1].exit_code) == (True, 0)

    def tty() -> tuple[bytes, int]:
        init = spb.ExecRequest(id="a", cmd=["sh"], tty=True, tty_size=spb.TerminalSize(width=90, height=33))
        ex = Interactive(s, spb, init)
        ex.send(stdin=b"stty size\n")
        got = ex.read_until(b"33 90")
        ex.send(resize=spb.TerminalSize(width=120, height=40))
        ex.send(stdin=b"stty size; exit 5\n")
        ex.half_close()
        rest = list(ex.call)
        return got + b"".join(o.data for o in rest), rest[-1].exit_code

    got, code = await in_thread(tty)
    assert b"40 120" in got and code == 5

    # --- WriteFile, then ReadFile: 10 MiB intact ---
    big = os.urandom(10 * MiB)

    def files() -> bytes:
        def writes() -> Iterator[Any]:
            yield spb.WriteFileRequest(open=spb.WriteFileOpen(id="a", path="/root/big", mode=0o600))
            for i in range(0, len(big), MiB):
                yield spb.WriteFileRequest(chunk=spb.FileChunk(data=big[i : i + MiB], done=i + MiB >= len(big)))

        assert s.WriteFile(writes(), timeout=300) == spb.Empty()
        chunks = list(s.ReadFile(spb.ReadFileRequest(id="a", path="/root/big"), timeout=300))
        assert chunks[-1].done
        return b"".join(c.data for c in chunks)

    assert await in_thread(files) == big

    # --- a deadline shorter than a Run ends it, and its process is gone from the guest ---
    def run_past_deadline() -> tuple[int, grpc.StatusCode]:
        call = s.Run(spb.RunRequest(id="a", cmd=["sh", "-c", "echo $$; exec sleep 600"]), timeout=3)
        pid = int(next(call).data)
        try:
            list(call)
        except grpc.RpcError as exc:
            return pid, exc.code()
        raise AssertionError("the Run outlived its deadline")

    pid, code = await in_thread(run_past_deadline)
    assert code == SC.DEADLINE_EXCEEDED
    assert await in_thread(gone_in_guest, s, spb, "a", pid) == 0
    await until(lambda: reg.get("a").state == State.READY)  # idle again

    # --- a cancelled Exec: its process is gone too ---
    def exec_then_cancel() -> int:
        ex = Interactive(s, spb, spb.ExecRequest(id="a", cmd=["sh", "-c", "echo $$; exec sleep 600"]))
        pid = int(ex.read_until(b"\n"))
        ex.call.cancel()
        ex.half_close()  # grpc's thread reading our inputs ends too
        return pid

    pid = await in_thread(exec_then_cancel)
    assert await in_thread(gone_in_guest, s, spb, "a", pid) == 0

    # --- errors, with the status of the same name ---
    for code, fn in [
        (SC.NOT_FOUND, lambda: s.Inspect(spb.InspectSandboxRequest(id="nope"))),
        (SC.NOT_FOUND, lambda: s.ReadFile(spb.ReadFileRequest(id="a", path="/no/such/file"))),
        (SC.INVALID_ARGUMENT, lambda: s.ReadFile(spb.ReadFileRequest(id="a", path="relative"))),
        (SC.INVALID_ARGUMENT, lambda: s.List(spb.ListSandboxesRequest(state="dancing"))),
        (SC.ALREADY_EXISTS, lambda: s.Create(spb.CreateSandboxRequest(id="a", labels={"team": "other"}))),
        (SC.FAILED_PRECONDITION, lambda: s.Create(spb.CreateSandboxRequest(id="m", mounts=[spb.Mount(source="/")]))),
        # a seed client's sandbox has no network (mode "" is none): ExposePort says how to get one
        (SC.FAILED_PRECONDITION, lambda: s.ExposePort(spb.ExposePortRequest(id="a", sandbox_port=8000))),
    ]:
        got, why = await status(fn)
        assert got == code, (code, got, why)
    assert "network" in (await status(s.ExposePort, spb.ExposePortRequest(id="a", sandbox_port=8000)))[1]
    listed = await in_thread(s.List, spb.ListSandboxesRequest(labels={"team": "grpc"}))
    assert [x.id for x in listed.sandboxes] == ["a"]

    # --- Checkpoint; Restore (ready on return); ListSnapshots; DeleteSnapshot refused while in use ---
    ck = await in_thread(snaps.Checkpoint, spb.CheckpointRequest(sandbox_id="a", name="grpc-base"), timeout=300)
    assert ck.snapshot_id and ck.snapshot_dir and ck.created_at.endswith("Z")
    restored = await in_thread(snaps.Restore, spb.RestoreRequest(snapshot_id="grpc-base", id="b"), timeout=300)
    assert restored.id == "b"
    assert (await in_thread(s.Inspect, spb.InspectSandboxRequest(id="b"))).state == "ready"
    out = await in_thread(lambda: list(s.Run(spb.RunRequest(id="b", cmd=["sh", "-c", "wc -c < /root/big"]))))
    assert out[0].data == b"%d\n" % len(big)  # the snapshot's disk
    found = await in_thread(snaps.ListSnapshots, spb.ListSnapshotsRequest(sandbox_id="a"))
    assert [(x.id, x.name) for x in found.snapshots] == [(ck.snapshot_id, "grpc-base")]
    got, why = await status(snaps.DeleteSnapshot, spb.DeleteSnapshotRequest(snapshot_id=ck.snapshot_id))
    assert got == SC.FAILED_PRECONDITION and "in use" in why

    # --- u: sandvisor.v1's patches, a named script, a tree in and out as tar streams ---
    await until(lambda: reg.get("u").state == State.READY)
    df = await in_thread(lambda: b"".join(o.data for o in s.Run(spb.RunRequest(id="u", cmd=["df", "-k", "/scratch"]))))
    assert df.split(b"\n")[1].split()[:2] == [b"tmpfs", b"8192"]  # sandvisor.v1's tmpfs, with its size limit

    def patch_script_tree() -> tuple[bytes, bytes, int, dict[str, bytes]]:
        patched = b"".join(o.data for o in s.Run(spb.RunRequest(id="u", cmd=["stat", "-c", "%a", "/etc/sv-patched"])))
        said = b"".join(
            o.data for o in ours.Run(sv.RunRequest(base=spb.RunRequest(id="u", cmd=["world"]), script="hello"))
        )
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for name, data in (("a.txt", b"alpha\n"), ("sub/b.txt", b"beta\n")):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o640
                tar.addfile(info, io.BytesIO(data))
            empty = tarfile.TarInfo("empty")
            empty.type, empty.mode = tarfile.DIRTYPE, 0o750
            tar.addfile(empty)
        raw = buf.getvalue()

        def writes() -> Iterator[Any]:
            yield sv.WriteTreeRequest(open=sv.WriteTreeOpen(id="u", path="/srv/tree"))
            yield sv.WriteTreeRequest(chunk=spb.FileChunk(data=raw, done=True))

        entries = ours.WriteTree(writes(), timeout=120).entries
        chunks = list(ours.ReadTree(sv.ReadTreeRequest(id="u", path="/srv/tree"), timeout=120))
        assert chunks[-1].done
        back = {}
        with tarfile.open(fileobj=io.BytesIO(b"".join(c.data for c in chunks))) as tar:
            for m in tar:
                f = tar.extractfile(m) if m.isfile() else None
                back[m.name.removeprefix("./").rstrip("/")] = (f.read() if f else b"") + b"|%o" % (m.mode & 0o777)
        return patched, said, entries, back

    patched, said, entries, back = await in_thread(patch_script_tree)
    assert (patched, said) == (b"640\n", b"hello world from web\n")
    assert entries >= 3
    assert {k: v for k, v in back.items() if k not in ("", ".")} == {
        "a.txt": b"alpha\n|640",
        "sub": back["sub"],
        "sub/b.txt": b"beta\n|640",
        "empty": b"|750",
    }, back

    # --- u: Pause and Resume (sandvisor.v1); a seed client's Inspect and List say "paused" ---
    paused = await in_thread(ours.Pause, sv.PauseRequest(id="u"), timeout=300)
    assert paused.state == "paused" and reg.get("u").guest is None
    assert (await in_thread(s.Inspect, spb.InspectSandboxRequest(id="u"))).state == "paused"
    listed = await in_thread(s.List, spb.ListSandboxesRequest(state="paused"))
    assert [x.id for x in listed.sandboxes] == ["u"]
    resumed = await in_thread(ours.Resume, sv.ResumeRequest(id="u"), timeout=300)
    assert resumed.state == "ready" and resumed.id == "u"
    assert (
        b"".join(
            o.data for o in await in_thread(lambda: list(s.Run(spb.RunRequest(id="u", cmd=["cat", "/srv/tree/a.txt"]))))
        )
        == b"alpha\n"
    )

    # --- u: ExposePort (sandbox.v1's RPC on a sandvisor.v1 sandbox), reached from the host ---
    exposed = await in_thread(s.ExposePort, spb.ExposePortRequest(id="u", sandbox_port=8000))
    assert exposed.host_port and exposed.guest_port == 8000
    ports = await in_thread(ours.ListPorts, sv.ListPortsRequest(id="u"))
    ttl = await in_thread(ours.SetTtl, sv.SetTtlRequest(id="u", ttl_seconds=3600))  # (sandvisor.v1: E2B's timeout)
    assert ttl.expires_at >= int(time.time()) + 3500
    assert [(p.sandbox_port, p.host_port, p.host_address) for p in ports.ports] == [
        (8000, exposed.host_port, "127.0.0.1")
    ]
    server = (
        "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        "s.bind(('0.0.0.0', 8000)); s.listen(); print('listening', flush=True); "
        "c, _ = s.accept(); c.sendall(b'hello from the guest'); c.close()"
    )

    def reach_the_guest() -> tuple[bytes, int]:
        call = s.Run(spb.RunRequest(id="u", cmd=["python3", "-c", server]), timeout=120)
        assert next(call).data == b"listening\n"
        with socket.create_connection(("127.0.0.1", exposed.host_port), timeout=30) as c:
            got = b""
            while chunk := c.recv(100):
                got += chunk
        return got, list(call)[-1].exit_code

    assert await in_thread(reach_the_guest) == (b"hello from the guest", 0)

    # --- TLS on a loopback TCP port: with a client certificate, and refused without one ---
    def over_tls(with_cert: bool) -> str:
        creds = grpc.ssl_channel_credentials(
            root_certificates=pki["ca"],
            private_key=pki["client_key"] if with_cert else None,
            certificate_chain=pki["client_cert"] if with_cert else None,
        )
        with grpc.secure_channel(f"localhost:{tls_port}", creds) as tls:
            try:
                info = sgrpc.SandboxServiceStub(tls).Inspect(spb.InspectSandboxRequest(id="u"), timeout=30)
            except grpc.RpcError as exc:
                return str(exc.code())
            return str(info.state)

    assert await in_thread(over_tls, True) == "ready"
    assert await in_thread(over_tls, False) == str(SC.UNAVAILABLE)

    # --- the Prometheus endpoint lists each running sandbox's CPU and memory ---
    samples = await in_thread(scrape, metrics_port, metrics_token.read_bytes().strip())
    for id in ("a", "b", "u"):
        label = (("id", id),)
        assert samples[("sandvisor_sandbox_cpu_seconds_total", label)] > 0, id
        assert samples[("sandvisor_sandbox_memory_rss_bytes", label)] > 0, id
        assert samples[("sandvisor_sandbox_memory_limit_bytes", label)] == reg.get(id).limits.memory_mib * MiB
        assert (
            0
            < samples[("sandvisor_sandbox_guest_memory_available_bytes", label)]
            <= reg.get(id).limits.memory_mib * MiB
        )
    assert samples[("sandvisor_sandboxes", (("state", "ready"),))] == 3

    # --- Stop; Remove; the snapshot goes once nothing stands on it ---
    assert await in_thread(s.Stop, spb.StopSandboxRequest(id="a", timeout_seconds=5), timeout=120) == spb.Empty()
    assert (await in_thread(s.Inspect, spb.InspectSandboxRequest(id="a"))).state == "stopped"
    for id in ("a", "b", "u"):
        await in_thread(s.Remove, spb.RemoveSandboxRequest(id=id, force=True), timeout=120)
    got, _ = await status(s.Inspect, spb.InspectSandboxRequest(id="a"))
    assert got == SC.NOT_FOUND
    await in_thread(snaps.DeleteSnapshot, spb.DeleteSnapshotRequest(snapshot_id=ck.snapshot_id))
    rest: list[str] = []

    def remaining_events() -> None:
        for ev in events:
            rest.append(ev.action)
            if ev.action == "removed":
                return

    await in_thread(remaining_events)
    events.cancel()
    assert rest == ["running", "idle", "running", "idle", "stopping", "stopped", "removed"], rest


def test_serve_flags_start_the_grpc_edge_and_the_metrics_endpoint(
    image: Image, seed: tuple[ModuleType, ModuleType]
) -> None:
    """``sandvisor serve --grpc unix://... --metrics HOST:PORT --metrics-token-file F`` as a
    process (no VM booted): health, a seed call, the metrics endpoint (401 without the
    token, made 0600 by serve since the file was not there; 200 with it); SIGTERM removes
    the gRPC socket."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from supervisor.main.throwaway import supervisor_process

    spb, sgrpc = seed
    with workdir("sv-grpc-cli-") as work:
        grpc_sock = work.root / "g.sock"
        port = free_port("127.0.0.1", "tcp")
        token_file = work.root / "metrics.token"
        metrics = ("--metrics", f"127.0.0.1:{port}", "--metrics-token-file", str(token_file))
        with supervisor_process(work, "--grpc", f"unix://{grpc_sock}", *metrics) as (_, proc):
            with grpc.insecure_channel(f"unix:{grpc_sock}") as ch:
                grpc.channel_ready_future(ch).result(timeout=30)  # the edge starts just after the socket
                health = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="sandbox.v1.SandboxService"), timeout=30
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                s = sgrpc.SandboxServiceStub(ch)
                assert list(s.List(spb.ListSandboxesRequest(), timeout=30).sandboxes) == []
                with pytest.raises(grpc.RpcError) as e:
                    s.Inspect(spb.InspectSandboxRequest(id="nope"), timeout=30)
                assert e.value.code() == SC.NOT_FOUND
            assert token_file.stat().st_mode & 0o777 == 0o600
            head, body = get_metrics(port, None)
            assert head.startswith(b"HTTP/1.1 401") and b"WWW-Authenticate: Bearer" in head and b"process_" not in body
            assert get_metrics(port, b"0" * 64)[0].startswith(b"HTTP/1.1 401")
            token = token_file.read_bytes().strip()
            assert any(name == "process_resident_memory_bytes" for name, _ in scrape(port, token))
            proc.terminate()
            assert proc.wait(timeout=60) == 0
        assert not grpc_sock.exists()
