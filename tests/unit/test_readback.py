"""Read-back: a sandbox's configuration fed back to Create gives an equal one (fake VMs
behind the real socket and SDK), log entries' sessions, mounts keyed by guest path, and
the SSH endpoint's description."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest
import trio

from actors.model import (
    BootSource,
    Egress,
    HostMount,
    Limits,
    NetMode,
    Network,
    PortSpec,
    Protocol,
    SandboxConfig,
    Timers,
    TmpfsMount,
    VolumeMount,
    Workload,
)
from actors.registry import Registry
from actors.sandboxes.logs import _HDR, SandboxLog
from actors.secrets.model import SecretRef
from actors.store import Store
from guestd.patch import Patch
from supervisor.client import AsyncSandbox, InvalidArgument, SandboxSpec, Tmpfs, Unavailable, load_config_json
from supervisor.client import VolumeMount as SdkVolume
from supervisor.client.sdk.config_plans import settings_of
from supervisor.serve import api_readback, config_readback, grpc_service, mapping
from supervisor.serve.server import Server
from supervisor.wire import protocol
from tests.support.fakevm import FakeLab, fake_settings


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))  # Unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@asynccontextmanager
async def serving(root: Path, sock: Path) -> AsyncIterator[Registry]:
    fake = FakeLab()
    store = Store(root / "state" / "sandvisor.db")
    try:
        async with trio.open_nursery() as n:
            await n.start(fake.run)
            reg = await n.start(Registry(fake_settings(root, fake), store, templates=False).run)
            try:
                await n.start(Server(reg, sock).serve)
                yield reg
            finally:
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


RICH = SandboxConfig(
    labels={"team": "a"},
    limits=Limits(vcpus=2, memory_mib=256, max_vcpus=3, max_memory_mib=512, disk_mib=2048),
    network=Network(NetMode.USER, outbound=True, egress=Egress("deny", ("example.com",), ("10.0.0.0/8",))),
    workload=Workload(cmd=("sleep", "9"), env={"A": "1"}, working_dir="/srv", user="nobody"),
    ports=(PortSpec(8080, 0), PortSpec(5353, 0, Protocol.UDP)),
    timers=Timers(ttl_seconds=600, idle_timeout_seconds=60, on_idle="pause", paused_ttl_seconds=30, auto_resume=False),
    boot=BootSource(image="alpine:3", pull="never", tls_verify=False),
    hostname="box",
    patches=(Patch.file("/etc/x", "hello", mode=0o600), Patch.mkdir("/srv/d"), Patch.symlink("/l", "/etc/x")),
    volumes=(VolumeMount("v", "/data", True),),
    tmpfs=(TmpfsMount("/scratch", 64),),
    host_mounts=(HostMount("/srv/host", "/host", True),),
    scripts={"hi": "echo hi"},
    secrets=(
        SecretRef("TOKEN", ("api.example.com",), placeholder="gen-1", generated=True),
        SecretRef("KEY", ("*.example.com",), placeholder="mine", store="key", substitute="all"),
    ),
    ssh_keys=("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJc3ycR6yQbl8nK2Um9pCTH9zVZTl4GyWbDjQqD9E9h4 u@h",),
)


def test_the_read_back_request_is_the_inverse_of_create_s_mapping() -> None:
    """Every field of a configuration survives read-back -> Create's mapping, except what
    is never read back: a generated placeholder (a new sandbox makes its own)."""
    req = config_readback.create_request(RICH, RICH.limits, patch_data=True)
    again = mapping.config(req)
    expected = attrs.evolve(
        RICH, secrets=(attrs.evolve(RICH.secrets[0], placeholder="", generated=False), RICH.secrets[1])
    )
    assert again == expected
    assert not any(s.value for s in req.secrets)  # never a value
    described = config_readback.create_request(RICH, RICH.limits)
    assert described.patches[0].data == b"" and described.patches[0].path == "/etc/x"
    info = config_readback.patch_info(RICH)
    assert info[0] == protocol.PatchInfo("file", "/etc/x", 5, hashlib.sha256(b"hello").hexdigest())
    assert info[1].size == 0 and info[1].sha256 == ""


def test_settings_of_a_read_back_make_the_same_create(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's settings (JSON values) through SandboxSpec give the Create the read-back
    came from: tcp ports (the settings' ports are tcp), a secret of its own value by
    name, taken again from the creating process's environment."""
    monkeypatch.setenv("TOKEN", "v")
    cfg = attrs.evolve(RICH, ports=(PortSpec(8080, 0),))
    resp = protocol.SandboxConfigResponse(
        "x", config_readback.create_request(cfg, cfg.limits, patch_data=True), config_readback.patch_info(cfg)
    )
    settings = settings_of(resp)
    json.dumps(settings)  # plain JSON values
    req = SandboxSpec().with_(**load_config_json(json.dumps(settings))).request("y")
    assert req.secrets[0].value == b"v" and req.secrets[1].store == "key"
    again = mapping.config(req)
    expected = attrs.evolve(
        cfg, secrets=(attrs.evolve(cfg.secrets[0], placeholder="", generated=False), cfg.secrets[1])
    )
    assert again == expected
    # described patches: refused by name when fed back, not silently empty files
    described = settings_of(
        protocol.SandboxConfigResponse(
            "x", config_readback.create_request(cfg, cfg.limits), config_readback.patch_info(cfg)
        )
    )
    digest = hashlib.sha256(b"hello").hexdigest()
    assert described["patches"][0] == {"op": "file", "path": "/etc/x", "mode": 0o600, "size": 5, "sha256": digest}
    with pytest.raises(InvalidArgument, match="/etc/x"):
        SandboxSpec().with_(**described)
    for bad in ("[]", "{", json.dumps({"cpus": 1, "bogus": 2}), json.dumps({"registry": {}})):
        with pytest.raises(InvalidArgument):
            load_config_json(bad)


async def test_config_fed_back_to_create_gives_an_equal_config(tmp_path: Path, short_dir: Path) -> None:
    """Through the socket and the SDK (fake VMs): create -> config() -> create(**cfg) ->
    config() is equal; and config_json() -> load_config_json -> create the same."""
    sock = short_dir / "s.sock"
    async with serving(tmp_path, sock):
        with trio.fail_after(60):
            a = await AsyncSandbox.create(
                "a",
                socket=sock,
                cpus=2,
                memory_mib=256,
                env={"A": "1"},
                labels={"l": "1"},
                hostname="alpha",
                workdir="/tmp",
                ttl=600,
                idle_timeout=300,
                patches=[Patch.file("/etc/motd", "hi\n"), Patch.mkdir("/srv/x", mode=0o700)],
                scripts={"hello": "echo hello"},
                detached=True,
            )
            cfg = await a.config(patch_data=True)
            assert cfg["hostname"] == "alpha" and cfg["cpus"] == 2 and cfg["max_memory_mib"] == 256
            assert cfg["scripts"] == {"hello": "echo hello"}
            assert base64.b64decode(cfg["patches"][0]["data_base64"]) == b"hi\n"
            b = await AsyncSandbox.create("b", socket=sock, detached=True, **cfg)
            assert await b.config(patch_data=True) == cfg
            text = await a.config_json()
            assert "data_base64" not in text and json.loads(text)["patches"][0]["size"] == 3
            loaded = load_config_json(await a.config_json(patch_data=True))
            c = await AsyncSandbox.create("c", socket=sock, detached=True, **loaded)
            assert await c.config(patch_data=True) == cfg


async def test_ssh_endpoint_unavailable_without_serve_ssh(tmp_path: Path, short_dir: Path) -> None:
    import asyncssh

    sock = short_dir / "s.sock"
    async with serving(tmp_path, sock) as reg:
        with trio.fail_after(60):
            sb = await AsyncSandbox.create("a+b", socket=sock, detached=True)
            with pytest.raises(Unavailable, match="serve --ssh"):
                await sb.ssh()
            key = asyncssh.generate_private_key("ssh-ed25519", comment="sandvisor")
            line = key.export_public_key("openssh").decode().strip()
            reg.endpoints.update(ssh="127.0.0.1:2222", ssh_host_key=line)
            ep = await sb.ssh()
    assert (ep.host, ep.port, ep.user, ep.host_key) == ("127.0.0.1", 2222, "a+b+", line)
    assert ep.fingerprint == key.get_fingerprint("sha256")
    assert ep.known_hosts == "[127.0.0.1]:2222 " + " ".join(line.split()[:2])
    wild = api_readback.endpoint("[::]:22", line, "box")
    assert (wild.host, wild.port, wild.user) == ("::1", 22, "box") and wild.known_hosts.startswith("::1 ssh-ed25519 ")


def test_mounts_are_keyed_by_guest_path_later_entries_override() -> None:
    spec = SandboxSpec(volumes=["v:/data", "w:/other"], tmpfs=["/scratch:8", "/scratch/:16"])
    assert spec.tmpfs == (Tmpfs("/scratch/", 16),)  # one path, the later entry
    later = spec.with_(tmpfs=["/data:32"], mounts=["/srv/h:/host"])
    assert later.volumes == (SdkVolume("w", "/other"),)  # the volume at /data replaced by the tmpfs
    assert later.tmpfs == (Tmpfs("/scratch/", 16), Tmpfs("/data", 32))
    req = later.request()
    assert [t.target for t in req.tmpfs] == ["/scratch/", "/data"] and [v.target for v in req.volumes] == ["/other"]
    # two kinds at one path in one breath: no order to decide by, the domain refuses it
    both = SandboxSpec().with_(volumes=["v:/x"], tmpfs=["/x"])
    with pytest.raises(Exception, match="one path"):
        from actors.rules import check_config

        check_config(mapping.config(both.request()))


def test_log_entries_carry_their_run_session(tmp_path: Path) -> None:
    log = SandboxLog(tmp_path / "log")
    # a record of an older supervisor: four elements, no session
    body = msgpack.packb([1, 5, "stdout", b"old"], use_bin_type=True)
    log.close()
    (tmp_path / "log").write_bytes(_HDR.pack(len(body)) + body)
    log = SandboxLog(tmp_path / "log")
    s1 = log.new_session()
    log.append("stdout", b"one", s1)
    log.append("system", b"note")
    s2 = log.new_session()
    log.append("stderr", b"two", s2)
    recs = log.read_sync()
    assert [(r.data, r.session) for r in recs] == [(b"old", 0), (b"one", s1), (b"note", 0), (b"two", s2)]
    assert 1 < s1 < s2
    log.close()
    again = SandboxLog(tmp_path / "log")
    assert again.new_session() > s2  # never an id an earlier life gave
    again.close()
    entry = protocol.LogEntry(1, 2, "stdout", b"h\xc3\xa9llo\xff", 7)
    assert entry.text() == "héllo\ufffd" and entry.session_id == 7


def test_every_configuration_field_is_read_back() -> None:
    """A field added to SandboxConfig must be read back too (supervisor/serve/config_readback.py
    and supervisor/client/sdk/config_plans.py), or Config stops being the whole configuration."""
    handled = {
        "labels", "limits", "network", "workload", "ports", "timers", "boot", "hostname", "patches",
        "volumes", "tmpfs", "host_mounts", "scripts", "secrets", "ssh_keys",
        "entrypoint", "cmd_cleared", "shell", "security_profile", "log_level", "quiet_logs", "thp",
        "init",
    }  # fmt: skip
    assert {f.name for f in attrs.fields(SandboxConfig)} == handled, "read the new field back in Config"


async def test_config_and_detach_over_sandvisor_v1(tmp_path: Path, short_dir: Path) -> None:
    """sandvisor.v1: Config keeps what sandbox.v1's base cannot (outbound, egress), and a
    detachable exec is left running and attached again (fake VMs)."""
    import queue

    from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as pb
    from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
    from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
    from tests.support.grpcstack import stack, status_of

    async def in_thread(fn: Any) -> Any:
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)

    with trio.fail_after(60):
        async with stack(tmp_path, short_dir) as st:
            ours = sv_grpc.SandvisorServiceStub(st.channel)
            base = pb.CreateSandboxRequest(id="g", network=pb.NetworkSpec(mode="user"), env={"A": "1"})
            await in_thread(lambda: ours.Create(sv.CreateRequest(base=base, outbound=True)))
            with trio.fail_after(30):
                while st.reg.get("g").state.value != "ready":
                    await trio.sleep(0.05)
            got = await in_thread(lambda: ours.Config(sv.ConfigRequest(id="g")))
            c = got.config
            assert c.outbound and c.base.network.mode == "user" and dict(c.base.env) == {"A": "1"} and got.id == "g"
            # an egress policy (a fake VM cannot have one): its own field of CreateRequest
            rich = protocol.SandboxConfigResponse("x", config_readback.create_request(RICH, RICH.limits))
            msg = grpc_service.to_message(rich, sv.SandboxConfig, grpc_service._sandvisor_config)
            assert msg.config.outbound and msg.config.egress.default == "deny"
            assert list(msg.config.egress.deny) == ["10.0.0.0/8"] and msg.config.base.network.mode == "user"
            assert (await status_of(ours.SshEndpoint, sv.SshEndpointRequest(id="g")))[0].name == "UNAVAILABLE"

            inputs: queue.Queue[sv.SessionInput | None] = queue.Queue()
            inputs.put(sv.SessionInput(init=pb.ExecRequest(id="g", cmd=["cat"])))
            inputs.put(sv.SessionInput(stdin=b"one"))
            outputs = ours.ExecDetachable(iter(inputs.get, None))
            first = await in_thread(lambda: next(outputs))
            assert (first.stream, first.data) == ("stdout", b"one")
            inputs.put(sv.SessionInput(detach=True))
            rest = await in_thread(lambda: list(outputs))
            assert [(o.stream, o.done) for o in rest] == [("detached", True)] and rest[0].session_id > 0
            sid = rest[0].session_id
            inputs.put(None)

            again: queue.Queue[sv.SessionInput | None] = queue.Queue()
            again.put(sv.SessionInput(attach=sv.AttachRequest(id="g", session_id=sid)))
            again.put(sv.SessionInput(stdin=b"two"))
            again.put(sv.SessionInput(close_stdin=True))
            out = await in_thread(lambda: list(ours.Attach(iter(again.get, None))))
            assert [(o.stream, o.data) for o in out] == [("stdout", b"two"), ("exit", b"")] and out[-1].done
            again.put(None)
            gone = sv.SessionInput(attach=sv.AttachRequest(id="g", session_id=sid))
            assert (await status_of(lambda: list(ours.Attach(iter([gone])))))[0].name == "NOT_FOUND"


async def test_another_principal_reads_back_nothing(tmp_path: Path, short_dir: Path) -> None:
    """Config, SshEndpoint and Attach of a sandbox another principal owns: NOT_FOUND with
    a real miss's text (no existence oracle), as every call on it."""
    from supervisor.client import NotFound
    from supervisor.client.sdk.acting import acting_as

    sock = short_dir / "s.sock"
    async with serving(tmp_path, sock) as reg:
        with trio.fail_after(60):
            mine = await AsyncSandbox.create("mine", socket=sock, detached=True)
            reg.endpoints.update(ssh="127.0.0.1:2222", ssh_host_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA== x")
            with acting_as("uid:65534"):
                other = AsyncSandbox("mine", socket=sock)
                for call in (other.config, other.config_json, other.ssh):
                    with pytest.raises(NotFound, match="no sandbox 'mine'"):
                        await call()
                with pytest.raises(NotFound, match="no sandbox 'mine'"):
                    async with other.session(1) as s:
                        await s.wait()
            assert (await mine.config())["hostname"] == ""
