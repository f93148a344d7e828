"""Principals and ownership (docs/security.md) on fake VMs: every edge names who asks,
and a principal sees and acts on what it owns; admins on everything.

The socket's principals are real peers: clients run as other uids (``setpriv``-like:
Trio's ``run_process(user=, group=)``) with Debian's python and :mod:`peerclient`.
The real-VM end of it is tests/vm/test_principals.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import grpc
import msgpack
import pytest
import trio

from actors.model import SandboxConfig, State, VolumeMount, VolumeRecord, dump
from actors.principals import LEGACY_OWNER, Principal, check_name
from actors.registry import Registry
from actors.secrets.model import SecretRef
from actors.secrets.vault import Vault
from actors.store import SCHEMA, VERSION, Store
from supervisor.client.sdk.acting import acting_as
from supervisor.client.sdk.aio import AsyncSandbox, connect
from supervisor.serve import grpc_service
from supervisor.serve.grpc_addresses import TcpAddress, TlsConfig
from supervisor.serve.grpc_auth import TcpAuth, Token, read_grpc_tokens
from supervisor.serve.peers import ClientPolicy, Peer
from supervisor.serve.server import Server
from supervisor.wire.errors import SandboxError
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as pb
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
from tests.support.fakevm import FakeLab, fake_settings
from tests.support.grpc_clients import bearer, make_pki
from tests.support.peerclient import install

ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists(), reason="clients of other uids need root"
)
NOGROUP = 65534  # Debian's "nogroup": the --group both test uids are in
ALICE, BOB = 65534, 65533


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="p", dir="/tmp"))  # Unix socket paths are short
    d.chmod(0o755)  # other uids reach the sockets in it
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Lab:
    def __init__(self, reg: Registry, sock: Path, client: Path) -> None:
        self.reg = reg
        self.sock = sock
        self.client = client

    async def as_uid(self, uid: int, calls: list[tuple[str, dict[str, Any]]], **hello: Any) -> Any:
        """``calls`` on one connection of uid ``uid`` (in the socket's group): its JSON answer."""
        p = await trio.run_process(
            ["/usr/bin/python3", str(self.client), str(self.sock), json.dumps(hello), json.dumps(calls)],
            user=uid,
            group=NOGROUP,
            extra_groups=[],
            capture_stdout=True,
        )
        out = json.loads(p.stdout)
        return out.get("results", out)


@asynccontextmanager
async def lab(root: Path, sock_dir: Path, *, admin_group: str | None = None, **kw: Any) -> AsyncIterator[Lab]:
    """A registry on fake VMs behind the msgpack socket, served to group nogroup."""
    fake = FakeLab()
    store = Store(root / "state" / "sandvisor.db")
    try:
        async with trio.open_nursery() as n:
            await n.start(fake.run)
            reg = await n.start(Registry(fake_settings(root, fake, **kw), store, templates=False).run)
            try:
                server = Server(reg, sock_dir / "m.sock", group="nogroup", admin_group=admin_group)
                await n.start(server.serve)
                yield Lab(reg, sock_dir / "m.sock", install(sock_dir / "client"))
            finally:
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


async def until(cond: Callable[[], bool], timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.005)


def ids(listed: dict[str, Any]) -> set[str]:
    return {s["id"] for s in listed["ok"]["sandboxes"]}


# ---------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------
def test_a_principal_sees_its_own_and_an_admin_everything() -> None:
    alice, root = Principal("uid:1000"), Principal("uid:0", admin=True)
    assert alice.may_see("uid:1000") and not alice.may_see("uid:1001") and not alice.may_see(LEGACY_OWNER)
    assert root.may_see("uid:1000") and root.may_see("e2b:k")
    assert check_name("e2b:key1") is None
    for bad in ("", "nokind", "uid:", ":x", "uid:1 2", "a:\x00", "x:" + "y" * 300):
        assert check_name(bad) is not None, bad


def test_admins_on_the_socket_are_root_the_supervisors_uid_and_the_admin_group() -> None:
    p = ClientPolicy(owner=1000, group=500, group_name="users", admin_group=600)
    assert p.principal(Peer(1, 0, 0)) == Principal("uid:0", admin=True)
    assert p.principal(Peer(1, 1000, 1000)) == Principal("uid:1000", admin=True)
    assert p.principal(Peer(1, 1001, 500)) == Principal("uid:1001")  # --group: served, not an admin
    assert p.principal(Peer(1, 1002, 500, frozenset({600}))) == Principal("uid:1002", admin=True)
    assert p.refusal(Peer(1, 1003, 600)) is None  # an admin is served
    assert p.refusal(Peer(1, 1004, 700)) is not None


def test_token_file_lines_name_their_principals(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    a, b, op = "a" * 40, "b" * 40, "c" * 40
    f.write_text(f"# ci and people\n{a} ci\n{b} ops admin\n\n{op}\n")
    f.chmod(0o600)
    tokens = read_grpc_tokens(f)
    assert [t.principal for t in tokens] == [
        Principal("token:ci"),
        Principal("token:ops", admin=True),
        Principal("token:operator", admin=True),  # unlabelled: the operator's own, as before
    ]
    auth = TcpAuth(tokens=tokens)
    assert auth.bearer(f"Bearer {a}".encode()) == tokens[0] and auth.bearer(b"Bearer " + b"d" * 40) is None
    for text in (f"{a} ci admin extra\n", f"{a} ci root\n", f"{a} ci\n{b} ci\n", f"{a} x\n{a} y\n", "# none\n"):
        f.write_text(text)
        with pytest.raises(ValueError):
            read_grpc_tokens(f)
    assert TcpAuth(admin_cns=frozenset({"ops"})).cert_principal("ci") == Principal("cert:ci")
    assert TcpAuth().cert_principal("ci") == Principal("cert:ci", admin=True)  # no list: the operator's CA


def test_records_stored_before_owners_belong_to_uid_0(tmp_path: Path) -> None:
    """A version-4 database (no owner column; snapshots and volumes without the field)
    opens migrated: every old record is uid:0's, an admin's only."""
    db_path = tmp_path / "sandvisor.db"
    db = sqlite3.connect(db_path)
    db.executescript(SCHEMA)
    for col in ("ports BLOB", "origin TEXT", "image BLOB", "chain BLOB", "life BLOB", "swap TEXT", "tuning BLOB"):
        db.execute(f"ALTER TABLE sandboxes ADD COLUMN {col}")
    cfg = msgpack.packb(dump(SandboxConfig()), use_bin_type=True)
    db.execute(
        "INSERT INTO sandboxes (uid, id, seq, config, state, created_at) VALUES (?, ?, ?, ?, ?, ?)",
        ("u1", "old", 1, cfg, "stopped", 1),
    )
    vol = dump(VolumeRecord("v", "vu", 1 << 20, 1))
    del vol["owner"]
    db.execute("INSERT INTO volumes (name, data) VALUES (?, ?)", ("v", msgpack.packb(vol, use_bin_type=True)))
    db.execute("PRAGMA user_version=4")
    db.commit()
    db.close()
    store = Store(db_path)
    try:
        [rec] = store.all()
        [v] = store.volumes()
        assert (rec.id, rec.owner, v.owner) == ("old", LEGACY_OWNER, LEGACY_OWNER)
        assert store.db.execute("PRAGMA user_version").fetchone()[0] == VERSION  # (migrated to the latest)
    finally:
        store.close()
    vault = Vault(tmp_path, tmp_path / "key")
    vault.named["old"] = b"v"  # as a vault written before owners: no named_owners
    assert vault.named_owner("old") == LEGACY_OWNER
    vault.set_named("new", b"v", owner="uid:1000")
    assert Vault(tmp_path, tmp_path / "key").named_owner("new") == "uid:1000"


# ---------------------------------------------------------------------------------------
# the socket: peer credentials, --group, act_as
# ---------------------------------------------------------------------------------------
@ROOT_ONLY
async def test_a_group_member_sees_only_its_own_sandboxes(tmp_path: Path, short_dir: Path) -> None:
    """Two uids of --group and root: each uid lists, inspects, runs in and removes its own
    sandbox only; the other's is NOT_FOUND with the text of a sandbox that does not
    exist; root (an admin) sees and acts on both."""
    with trio.fail_after(120):
        async with lab(tmp_path, short_dir) as lb:
            assert (await lb.as_uid(ALICE, [("Create", {"id": "a"})]))[0]["ok"]["id"] == "a"
            assert (await lb.as_uid(BOB, [("Create", {"id": "b"})]))[0]["ok"]["id"] == "b"
            await until(lambda: all(lb.reg.get(i).state == State.READY for i in "ab"))
            assert (lb.reg.get("a").record.owner, lb.reg.get("b").record.owner) == ("uid:65534", "uid:65533")
            got = await lb.as_uid(
                BOB,
                [
                    ("ListAll", {}),
                    ("Inspect", {"id": "a"}),
                    ("Inspect", {"id": "nothing"}),
                    ("Run", {"id": "a", "cmd": ["true"]}),
                    ("Remove", {"id": "a", "force": True}),
                    ("Stop", {"id": "a"}),
                    ("Checkpoint", {"sandbox_id": "a"}),
                    ("Create", {"id": "a"}),  # ids are one namespace: taken, not handed over
                    ("Run", {"id": "b", "cmd": ["echo", "mine"]}),
                    ("Info", {}),
                    ("Diff", {"id": "b", "other": "a"}),  # a diff reads both trees: both must be seen
                    ("Diff", {"id": "a", "other": "b"}),
                    ("Diff", {"id": "a", "fork_point": True}),  # another's fork point: as for no sandbox
                    ("Diff", {"id": "b", "fork_point": True}),  # one's own, not forked: the reason
                    ("Diff", {"id": "b", "other": "b", "fork_point": True}),
                    ("RunCode", {"id": "a", "code": "1"}),  # code runs where one may exec: the owner's
                    ("ListCodeContexts", {"id": "a"}),
                ],
            )
            assert ids(got[0]) == {"b"}
            assert got[10:13] == [{"fail": ["NOT_FOUND", "no sandbox 'a'"]}] * 3
            assert got[13]["fail"][0] == "FAILED_PRECONDITION" and "was not forked" in got[13]["fail"][1]
            assert got[14]["fail"][0] == "INVALID_ARGUMENT"
            assert got[15:17] == [{"fail": ["NOT_FOUND", "no sandbox 'a'"]}] * 2
            assert got[1] == {"fail": ["NOT_FOUND", "no sandbox 'a'"]}
            assert got[2] == {"fail": ["NOT_FOUND", "no sandbox 'nothing'"]}  # the same text: no oracle
            assert got[3:7] == [{"fail": ["NOT_FOUND", "no sandbox 'a'"]}] * 4
            assert got[7]["fail"][0] == "ALREADY_EXISTS"
            assert got[8]["items"][0]["data"] == "mine\n"
            assert got[9]["ok"]["sandboxes_by_state"] == {"ready": 1}
            assert lb.reg.get("a").state == State.READY  # untouched
            async with connect(lb.sock) as root:
                assert {s["id"] for s in (await root.call("ListAll", {}))["sandboxes"]} == {"a", "b"}
                await root.call("Inspect", {"id": "b"})
            assert (await lb.as_uid(ALICE, [("Remove", {"id": "a", "force": True})]))[0] == {"ok": {}}
            assert "a" not in lb.reg.sandboxes


@ROOT_ONLY
async def test_act_as_is_an_admins_and_refused_to_others(tmp_path: Path, short_dir: Path) -> None:
    """root acts for another principal (what it makes is that one's; it then sees only
    that one's); a --group uid that asks is refused at hello; --admin-group members may."""
    with trio.fail_after(120):
        async with lab(tmp_path, short_dir, admin_group="nogroup") as lb:
            async with connect(lb.sock, act_as="e2b:k1") as k1:
                await k1.call("Create", {"id": "k"})
            assert lb.reg.get("k").record.owner == "e2b:k1"
            async with connect(lb.sock, act_as="e2b:k2") as k2:
                assert (await k2.call("ListAll", {}))["sandboxes"] == []
                with pytest.raises(SandboxError, match="no sandbox 'k'"):
                    await k2.call("Inspect", {"id": "k"})
            with acting_as("e2b:k1"):  # the SDK's classes take it from the context
                assert [s.id for s in (await AsyncSandbox.list(socket=lb.sock)).sandboxes] == ["k"]
            async with connect(lb.sock, act_as="e2b:admin", act_as_admin=True) as adm:
                assert [s["id"] for s in (await adm.call("ListAll", {}))["sandboxes"]] == ["k"]
            # members of --admin-group are admins: they may act, and see everything
            assert ids((await lb.as_uid(ALICE, [("ListAll", {})]))[0]) == {"k"}
            got = await lb.as_uid(ALICE, [("ListAll", {})], act_as="e2b:k2")
            assert got[0]["ok"]["sandboxes"] == []
        async with lab(tmp_path / "2", short_dir) as lb:
            refused = await lb.as_uid(ALICE, [("ListAll", {})], act_as="uid:0", act_as_admin=True)
            assert refused["hello"][0] == "PERMISSION_DENIED" and "only admins" in refused["hello"][1]
            async with connect(lb.sock) as root:
                with pytest.raises(SandboxError, match="KIND:NAME"):
                    async with connect(lb.sock, act_as="nokind"):
                        pass
                await root.call("Info", {})


@ROOT_ONLY
async def test_snapshots_volumes_and_events_follow_their_owner(tmp_path: Path, short_dir: Path) -> None:
    """A snapshot is its taker's: another uid cannot list, restore, export or delete it
    (NOT_FOUND), nor mount another's volume; a restore is the restorer's; events of
    another's sandbox are not delivered."""
    with trio.fail_after(120):
        async with lab(tmp_path, short_dir) as lb:
            async with connect(lb.sock, act_as="uid:7") as seven:
                events = seven.open_call("Events", {})
                async with events as ev_stream:
                    await seven.call("CreateVolume", {"name": "vol7", "size_mib": 16})
                    await seven.call("Create", {"id": "s7"})
                    await until(lambda: lb.reg.get("s7").state == State.READY)
                    snap = (await seven.call("Checkpoint", {"sandbox_id": "s7", "name": "seven"}))["snapshot_id"]
                    async with connect(lb.sock, act_as="uid:8") as eight:
                        await eight.call("Create", {"id": "s8"})  # an event uid:7 must not see
                        missing = "no snapshot 'seven'"
                        for method, body in (
                            ("Restore", {"snapshot_id": "seven", "id": "c8"}),
                            ("DeleteSnapshot", {"snapshot_id": "seven"}),
                        ):
                            with pytest.raises(SandboxError, match=missing):
                                await eight.call(method, body)
                        with pytest.raises(SandboxError, match=f"no snapshot '{snap}'"):
                            await eight.collect("ExportSnapshot", {"snapshot_id": snap})
                        assert (await eight.call("ListSnapshots", {})).get("snapshots", []) == []
                        assert (await eight.call("ListVolumes", {})).get("volumes", []) == []
                        with pytest.raises(SandboxError, match="volume 'vol7' does not exist"):
                            await eight.call("InspectVolume", {"name": "vol7"})
                        with pytest.raises(SandboxError, match="volume 'vol7' does not exist"):
                            await eight.call("Create", {"id": "m8", "volumes": [{"volume": "vol7", "target": "/v"}]})
                        with pytest.raises(SandboxError, match="volume 'vol7' does not exist"):
                            await eight.call("DeleteVolume", {"name": "vol7"})
                        with pytest.raises(SandboxError, match="for admins"):
                            await eight.call("PruneImages", {})
                    await seven.call("Restore", {"snapshot_id": "seven", "id": "c7"})
                    assert lb.reg.get("c7").record.owner == "uid:7"
                    assert [s["name"] for s in (await seven.call("ListSnapshots", {}))["snapshots"]] == ["seven"]
                    assert [v["name"] for v in (await seven.call("ListVolumes", {}))["volumes"]] == ["vol7"]
                    seen: list[str] = []
                    async for item in ev_stream:
                        seen.append(item["sandbox_id"])
                        if item["sandbox_id"] == "c7" and item["action"] == "ready":
                            break
                    assert "s8" not in seen and {"s7", "c7"} <= set(seen)
            async with connect(lb.sock) as root:
                listed = await root.call("ListSnapshots", {})
                assert [s["id"] for s in listed["snapshots"]] == [snap]


async def test_a_stopped_sandbox_or_snapshot_never_mounts_a_volume_its_name_now_names_for_another(
    tmp_path: Path, short_dir: Path
) -> None:
    """A stopped sandbox and a snapshot hold no claim on their volumes: a volume deleted
    meanwhile and made again by another principal under the same name is not mounted
    by their Start or Restore (FAILED_PRECONDITION), and the new owner's still is."""
    with trio.fail_after(120):
        async with (
            lab(tmp_path, short_dir) as lb,
            connect(lb.sock, act_as="uid:7") as seven,
            connect(lb.sock, act_as="uid:8") as eight,
        ):
            await seven.call("CreateVolume", {"name": "data", "size_mib": 16})
            await seven.call("Create", {"id": "s7"})
            await until(lambda: lb.reg.get("s7").state == State.READY)
            # (fake VMs mount no disks: the mount is put in the record as a Create would)
            rec = lb.reg.get("s7").record
            rec.config = attrs.evolve(rec.config, volumes=(VolumeMount("data", "/v"),))
            await seven.call("Checkpoint", {"sandbox_id": "s7", "name": "seven"})
            await seven.call("Stop", {"id": "s7"})
            await until(lambda: lb.reg.get("s7").state == State.STOPPED)
            await seven.call("DeleteVolume", {"name": "data"})
            await eight.call("CreateVolume", {"name": "data", "size_mib": 16})
            with pytest.raises(SandboxError, match="volume 'data' is no longer this sandbox's owner's") as e:
                await seven.call("Start", {"id": "s7"})
            assert e.value.code == "FAILED_PRECONDITION"
            with pytest.raises(SandboxError, match="volume 'data' is no longer this sandbox's owner's") as e:
                await seven.call("Restore", {"snapshot_id": "seven", "id": "c7"})
            assert e.value.code == "FAILED_PRECONDITION"
            assert lb.reg.get("s7").state == State.STOPPED and "c7" not in lb.reg.sandboxes
            assert (await eight.call("InspectVolume", {"name": "data"}))["name"] == "data"


async def test_a_stored_secret_in_use_is_not_deleted_so_its_name_is_not_reused(tmp_path: Path, short_dir: Path) -> None:
    """A ``store:`` reference is by name, read at each use: the entry may not be deleted
    (FAILED_PRECONDITION) while a sandbox record in any state or a snapshot names it,
    else another principal could set the name again and be sent this one's guests'
    requests with its value in them. Once they are removed it goes."""
    (tmp_path / "vault").mkdir()
    vault = Vault(tmp_path / "vault", tmp_path / "vault.key")
    with trio.fail_after(120):
        async with (
            lab(tmp_path, short_dir, vault=vault) as lb,
            connect(lb.sock, act_as="uid:7") as seven,
            connect(lb.sock, act_as="uid:8") as eight,
        ):
            await seven.call("SetSecret", {"name": "gh", "value": b"seven's", "hosts": ["api.github.com"]})
            await seven.call("Create", {"id": "s7"})
            await until(lambda: lb.reg.get("s7").state == State.READY)
            # (fake VMs have no secrets proxy: the reference is put in the record as a Create would)
            ref = SecretRef("GH", ("api.github.com",), placeholder="p" * 20, store="gh")
            rec = lb.reg.get("s7").record
            rec.config = attrs.evolve(rec.config, secrets=(ref,))
            snap = (await seven.call("Checkpoint", {"sandbox_id": "s7", "name": "seven"}))["snapshot_id"]
            await seven.call("Stop", {"id": "s7"})
            await until(lambda: lb.reg.get("s7").state == State.STOPPED)
            with pytest.raises(SandboxError, match=r"used by 2 sandbox\(es\) or snapshot\(s\).*remove them first") as e:
                await seven.call("DeleteSecret", {"name": "gh"})
            assert e.value.code == "FAILED_PRECONDITION"
            with pytest.raises(SandboxError, match="another principal's"):
                await eight.call("SetSecret", {"name": "gh", "value": b"eight's", "hosts": ["api.github.com"]})
            assert vault.value("", "GH", "gh") == b"seven's"
            await seven.call("Remove", {"id": "s7"})
            with pytest.raises(SandboxError, match=r"used by 1 sandbox"):
                await seven.call("DeleteSecret", {"name": "gh"})
            await seven.call("DeleteSnapshot", {"snapshot_id": snap})
            await seven.call("DeleteSecret", {"name": "gh"})
            assert "gh" not in vault.named


async def test_the_principal_reaches_handlers_over_grpc(tmp_path: Path, short_dir: Path) -> None:
    """gRPC: a token's principal sees only its own; an admin token, and root on the Unix
    socket (its peer credentials, through the relay), see everything."""
    ci, ops = "c" * 40, "o" * 40
    auth = TcpAuth(tokens=(Token(ci.encode(), "ci", admin=False), Token(ops.encode(), "ops", admin=True)))
    fake = FakeLab()
    store = Store(tmp_path / "state" / "sandvisor.db")
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                await n.start(fake.run)
                reg = await n.start(Registry(fake_settings(tmp_path, fake), store, templates=False).run)
                addrs = grpc_service.addresses([f"unix://{short_dir / 'g.sock'}", "127.0.0.1:0"], auth=auth)
                edge = await n.start(grpc_service.build_edge(reg, addrs, tcp_auth=auth).run)
                tcp = edge.addresses[1]
                assert isinstance(tcp, TcpAddress)

                def listed(target: str, md: list[tuple[str, str]]) -> set[str]:
                    with grpc.insecure_channel(target) as ch:
                        r = sv_grpc.SandvisorServiceStub(ch).List(sv.ListRequest(), metadata=md)
                        return {s.id for s in r.sandboxes}

                def inspect(md: list[tuple[str, str]], id: str) -> str:
                    with grpc.insecure_channel(tcp.target) as ch:
                        try:
                            return str(
                                sv_grpc.SandvisorServiceStub(ch).Inspect(sv.InspectRequest(id=id), metadata=md).base.id
                            )
                        except grpc.RpcError as exc:
                            return f"{exc.code().name}: {exc.details()}"

                await reg.create("mine", SandboxConfig(), owner="token:ci")
                await reg.create("theirs", SandboxConfig(), owner="uid:1000")
                unix = f"unix:{short_dir / 'g.sock'}"
                assert await trio.to_thread.run_sync(listed, tcp.target, bearer(ci)) == {"mine"}
                assert await trio.to_thread.run_sync(inspect, bearer(ci), "theirs") == "NOT_FOUND: no sandbox 'theirs'"
                assert await trio.to_thread.run_sync(listed, tcp.target, bearer(ops)) == {"mine", "theirs"}
                assert await trio.to_thread.run_sync(listed, unix, []) == {"mine", "theirs"}  # root, relayed
                await until(lambda: not edge.unix_peers)  # each relayed connection's entry goes with it
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


async def test_a_client_certificate_is_its_cn_and_an_admin_only_when_listed(tmp_path: Path) -> None:
    """mTLS: ``cert:ci-client`` sees only its own when ``--grpc-admin-cert-cn`` names others."""
    pytest.importorskip("cryptography")
    pki = make_pki()
    tls = TlsConfig(pki["server_cert"], pki["server_key"], client_ca=pki["ca"], require_client_cert=True)
    auth = TcpAuth(admin_cns=frozenset({"ops"}))
    fake = FakeLab()
    store = Store(tmp_path / "state" / "sandvisor.db")
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                await n.start(fake.run)
                reg = await n.start(Registry(fake_settings(tmp_path, fake), store, templates=False).run)
                edge = await n.start(
                    grpc_service.build_edge(reg, [TcpAddress("127.0.0.1", 0, tls=tls)], tcp_auth=auth).run
                )
                tcp = edge.addresses[0]
                assert isinstance(tcp, TcpAddress)

                def create_and_list(id: str) -> set[str]:
                    creds = grpc.ssl_channel_credentials(pki["ca"], pki["client_key"], pki["client_cert"])
                    with grpc.secure_channel(tcp.target, creds) as ch:
                        stub = sv_grpc.SandvisorServiceStub(ch)
                        stub.Create(sv.CreateRequest(base=pb.CreateSandboxRequest(id=id)))
                        return {s.id for s in stub.List(sv.ListRequest()).sandboxes}

                await reg.create("other", SandboxConfig(), owner="cert:ops")
                assert await trio.to_thread.run_sync(create_and_list, "ci") == {"ci"}
                assert reg.get("ci").record.owner == "cert:ci-client"
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()
