"""Secrets without VMs: host rules, placeholders, substitution, the vault's
encryption, the ClientHello peek, the proxy's verdicts, guestd's trust store install,
the SDK's Secret, and the store's RPCs on both edges (fake VMs)."""

from __future__ import annotations

import os
import shutil
import ssl
import tempfile
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import attrs
import grpc
import h11
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from actors.net import egress
from actors.net.ippool import MIN_PREFIX
from actors.registry import Registry
from actors.sandboxes.secrets import check_store_hosts, hosts_in_force, upstream_context
from actors.secrets import model as secrets_model
from actors.secrets.ca import Minter, new_ca
from actors.secrets.secretproxy import Blocked, ProxyView, Scrubber, SecretProxy, _Refused, client_hello_name
from actors.secrets.vault import Vault
from actors.store import Store
from guestd import trust
from supervisor.client import Secret
from supervisor.client.sdk.aio import connect
from supervisor.serve import grpc_service
from supervisor.serve.server import Server
from supervisor.wire.errors import InvalidArgument as ClientInvalidArgument
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as pb
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
from tests.support.fakevm import FakeLab, fake_settings

VALUE = b"sk-unit-THE-VALUE-0123456789"


# -- the model ---------------------------------------------------------------------------------
def test_host_rules_match_names_wildcards_and_ports() -> None:
    exact, wild, port = (
        secrets_model.parse_host("API.example.com"),
        secrets_model.parse_host("*.example.com"),
        secrets_model.parse_host("h.test:8443"),
    )
    assert exact.matches("api.example.com", 443) and exact.matches("API.EXAMPLE.COM.", 443)
    assert not exact.matches("api.example.com", 8443) and not exact.matches("xapi.example.com", 443)
    assert wild.matches("a.example.com", 443) and wild.matches("a.b.example.com", 443)
    assert not wild.matches("example.com", 443) and not wild.matches("badexample.com", 443)
    assert port.matches("h.test", 8443) and not port.matches("h.test", 443)
    for bad in ("", "*.", "a..b", "1.2.3.4", "h.test:0", "h.test:x", "-a.test", "a b.test", "*.*.test"):
        with pytest.raises(InvalidArgument):
            secrets_model.parse_host(bad)
    refs = [secrets_model.SecretRef("A", ("api.test",)), secrets_model.SecretRef("B", ("*.cdn.test:8443",))]
    assert secrets_model.intercepted_ports(refs) == (443, 8443)
    assert secrets_model.named_by_any(refs, "x.cdn.test", 8443) and not secrets_model.named_by_any(
        refs, "plain.test", 443
    )


def test_secrets_are_checked() -> None:
    ok = secrets_model.SecretRef("API_KEY", ("api.test",))
    secrets_model.check_secrets([ok])
    for refs in (
        [secrets_model.SecretRef("1BAD", ("api.test",))],
        [secrets_model.SecretRef("A-B", ("api.test",))],
        [ok, ok],
        [secrets_model.SecretRef("A", ())],
        [secrets_model.SecretRef("A", ("api.test",), placeholder="short")],
        [
            secrets_model.SecretRef("A", ("a.test",), placeholder="x" * 20),
            secrets_model.SecretRef("B", ("a.test",), placeholder="x" * 24),
        ],
    ):
        with pytest.raises(InvalidArgument):
            secrets_model.check_secrets(refs)
    for value in (b"", b"a\nb", b"a\rb", b"a\0b", b"x" * (secrets_model.MAX_VALUE_BYTES + 1)):
        with pytest.raises(InvalidArgument):
            secrets_model.check_value("A", value)


def test_public_suffix_wide_patterns_are_refused() -> None:
    for wide in ("*.com", "*.co.uk", "*.github.io", "*.test", "*.uk:8443", "*.compute.amazonaws.com"):
        with pytest.raises(InvalidArgument, match="public suffix"):
            secrets_model.check_pattern(wide)
        with pytest.raises(InvalidArgument):
            secrets_model.check_secrets([secrets_model.SecretRef("A", ("api.example.com", wide))])
    for fine in ("*.example.com", "*.api.test", "s3.amazonaws.com", "github.io", "api.test:8443", "*.octo.github.io"):
        secrets_model.check_pattern(fine)
    with pytest.raises(InvalidArgument, match="substitute"):
        secrets_model.check_secrets([secrets_model.SecretRef("A", ("api.test",), substitute="body")])


def test_a_pattern_covers_only_what_it_matches() -> None:
    stored = ["api.example.com", "*.example.org", "h.test:8443"]
    assert (
        secrets_model.within(
            ["api.example.com", "a.example.org", "*.b.example.org", "*.example.org", "h.test:8443"], stored
        )
        == []
    )
    assert secrets_model.within(
        ["example.org", "api.example.com:8443", "*.example.com", "h.test", "x.api.example.com"], stored
    ) == [
        "example.org",
        "api.example.com:8443",
        "*.example.com",
        "h.test",
        "x.api.example.com",
    ]
    assert secrets_model.within(["a.test"], []) == ["a.test"]


def test_a_store_secret_may_narrow_its_entry_s_hosts_never_widen_them(tmp_path: Path) -> None:
    vault = Vault(tmp_path, tmp_path / "key")
    vault.set_named("gh", VALUE, ["api.github.example", "*.uploads.example"])
    check_store_hosts(vault, secrets_model.SecretRef("T", ("api.github.example",), store="gh"))
    check_store_hosts(vault, secrets_model.SecretRef("T", ("x.uploads.example", "*.a.uploads.example"), store="gh"))
    for wide in (("attacker.example",), ("api.github.example", "uploads.example"), ("api.github.example:8443",)):
        with pytest.raises(PermissionDenied):
            check_store_hosts(vault, secrets_model.SecretRef("T", wide, store="gh"))
    vault.set_named("old", VALUE)  # (an entry kept before hosts were: it goes nowhere)
    with pytest.raises(PermissionDenied, match="no hosts"):
        check_store_hosts(vault, secrets_model.SecretRef("T", ("a.test",), store="old"))
    # what a running sandbox's proxy gets: only what the entry covers now
    ref = secrets_model.SecretRef("T", ("api.github.example", "x.uploads.example"), store="gh")
    assert hosts_in_force(vault, ref) == ref.hosts
    vault.set_named("gh", VALUE, ["x.uploads.example"])  # narrowed later
    assert hosts_in_force(vault, ref) == ("x.uploads.example",)
    assert Vault(tmp_path, tmp_path / "key").named_hosts("gh") == ["x.uploads.example"]  # (kept, encrypted)
    vault.remove_named("gh")
    assert hosts_in_force(vault, ref) == ()


def test_the_secret_mark_is_unique_in_the_largest_pool() -> None:
    pool = IPv4Network(f"10.0.0.0/{MIN_PREFIX}")
    a, b = IPv4Address("10.1.0.7"), IPv4Address("10.2.0.7")  # (the same low 16 bits)
    marks = {egress.secret_mark(x, pool) for x in (a, b, pool.network_address + 1, pool.broadcast_address - 1)}
    assert len(marks) == 4 and all(m & egress.SECRET_MARK_MASK == egress.SECRET_MARK for m in marks)
    with pytest.raises(ValueError):
        egress.secret_mark(IPv4Address("11.0.0.1"), pool)
    assert egress.secret_rules("svx", a, IPv4Address("10.0.0.1"), 1234, (443,), pool)[-1].endswith(
        f"{egress.secret_mark(a, pool):#x} : goto sb_svx }}"
    )


def test_placeholders_are_the_name_and_unguessable_and_fresh_for_clones() -> None:
    made = secrets_model.with_placeholders(
        [
            secrets_model.SecretRef("TOKEN", ("a.test",)),
            secrets_model.SecretRef("MINE", ("a.test",), "my-own-placeholder"),
        ]
    )
    token, mine = made
    assert token.generated and token.placeholder.startswith(secrets_model.PLACEHOLDER_PREFIX + "TOKEN_")
    assert len(token.placeholder) == len(secrets_model.PLACEHOLDER_PREFIX + "TOKEN_") + 32
    assert not mine.generated and mine.placeholder == "my-own-placeholder"
    again = secrets_model.with_placeholders(made)  # a clone's configuration
    assert again[0].placeholder != token.placeholder and again[1] == mine
    assert secrets_model.without_generated(made) == (secrets_model.SecretRef("TOKEN", ("a.test",)), mine)
    secrets_model.check_secrets(made)


def test_substitution_replaces_every_occurrence() -> None:
    pairs = [(b"PH_A", b"va"), (b"PH_B", b"vb")]
    assert secrets_model.substitute(b"PH_A x PH_A PH_B", pairs) == b"va x va vb"
    assert secrets_model.substitute(b"nothing", pairs) == b"nothing"


# -- the vault ---------------------------------------------------------------------------------
def test_the_vault_is_encrypted_with_a_key_outside_and_survives_a_restart(tmp_path: Path) -> None:
    state, key = tmp_path / "state", tmp_path / "etc" / "secrets.key"
    state.mkdir()
    v = Vault(state, key)
    assert not key.exists()  # made at the first need only
    v.set_named("store_entry", VALUE)
    v.put_owner("uid-1", {"TOKEN": VALUE + b"-own"}, new_ca("uid-1"))
    assert key.stat().st_mode & 0o777 == 0o600 and (key.parent.stat().st_mode & 0o777) == 0o700
    blob = (state / "secrets.vault").read_bytes()
    assert (state / "secrets.vault").stat().st_mode & 0o777 == 0o600
    assert VALUE not in blob and b"TOKEN" not in blob and b"PRIVATE KEY" not in blob
    again = Vault(state, key)  # the next supervisor
    assert again.value("uid-1", "TOKEN") == VALUE + b"-own" and again.value("uid-1", "X", "store_entry") == VALUE
    again.copy_owner("uid-1", "snap-1")
    again.remove_value("uid-1", "TOKEN")
    assert again.value("uid-1", "TOKEN") is None and again.removed("uid-1", "TOKEN")
    assert again.value("snap-1", "TOKEN") == VALUE + b"-own"
    again.keep_only({"snap-1"})
    assert Vault(state, key).owners.keys() == {"snap-1"}
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    with pytest.raises(FailedPrecondition, match="does not decrypt"):
        Vault(state, other)
    key.chmod(0o644)
    with pytest.raises(FailedPrecondition, match="0600"):
        Vault(state, key)


# -- the proxy's pieces ------------------------------------------------------------------------
def client_hello(server_name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_the_client_hello_is_peeked_for_its_server_name() -> None:
    hello = client_hello("api.test")
    assert client_hello_name(hello) == (True, "api.test")
    assert client_hello_name(hello[:20]) == (False, None)  # more to read
    assert client_hello_name(client_hello(None)) == (True, None)
    assert client_hello_name(b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n")[1] is None  # not TLS: passed through


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_hostile_bytes_never_break_the_peek(data: bytes) -> None:
    _done, name = client_hello_name(data)
    assert name is None or isinstance(name, str)


def proxy(refs: list[secrets_model.SecretRef], values: dict[str, bytes], blocked: list[Blocked]) -> SecretProxy:
    minter = Minter(*new_ca("t"))
    view = ProxyView(
        refs=lambda: refs, value=lambda r: values.get(r.name), minter=lambda: minter, blocked=blocked.append
    )
    return SecretProxy(view, upstream=upstream_context())


def request(target: bytes, host: bytes, *more: tuple[bytes, bytes]) -> h11.Request:
    return h11.Request(method=b"POST", target=target, headers=[(b"host", host), *more])


def test_the_proxy_puts_values_in_for_allowed_hosts_only() -> None:
    token = secrets_model.SecretRef(
        "TOKEN", ("api.test",), placeholder="PH_TOKEN_0123456789abcdef", substitute=secrets_model.ALL
    )
    other = secrets_model.SecretRef(
        "OTHER", ("other.test",), placeholder="PH_OTHER_0123456789abcdef", substitute=secrets_model.ALL
    )
    blocked: list[Blocked] = []
    p = proxy([token, other], {"TOKEN": VALUE, "OTHER": b"other-value"}, blocked)
    req = request(
        b"/x?k=PH_TOKEN_0123456789abcdef",
        b"api.test",
        (b"authorization", b"Bearer PH_TOKEN_0123456789abcdef"),
        (b"accept-encoding", b"gzip"),
    )
    out, body = p._substitute(req, b"a=PH_TOKEN_0123456789abcdef", True, "api.test", 443)
    assert out.target == b"/x?k=" + VALUE and (b"authorization", b"Bearer " + VALUE) in out.headers
    assert (b"content-length", str(len(b"a=" + VALUE)).encode()) in out.headers and body == b"a=" + VALUE
    assert [v for k, v in out.headers if k == b"accept-encoding"] == [b"identity"]
    # a placeholder to a host its secret does not allow: 403, the secret named, not its value
    with pytest.raises(_Refused) as refused:
        p._substitute(request(b"/", b"api.test"), b"x=PH_OTHER_0123456789abcdef", True, "api.test", 443)
    assert (
        refused.value.status == 403
        and "OTHER" in refused.value.text
        and b"other-value" not in refused.value.text.encode()
    )
    assert blocked == [Blocked("OTHER", "api.test", 443)]
    # a removed secret's placeholder goes as it is
    gone = proxy([token], {}, [])
    out, body = gone._substitute(request(b"/PH_TOKEN_0123456789abcdef", b"api.test"), b"", True, "api.test", 443)
    assert out.target == b"/PH_TOKEN_0123456789abcdef"
    # substitute="headers" (the default): the target and the body keep the placeholder
    headers_only = proxy([attrs.evolve(token, substitute=secrets_model.HEADERS)], {"TOKEN": VALUE}, [])
    req = request(b"/?k=PH_TOKEN_0123456789abcdef", b"api.test", (b"x-key", b"PH_TOKEN_0123456789abcdef"))
    out, body = headers_only._substitute(req, b"PH_TOKEN_0123456789abcdef", True, "api.test", 443)
    assert out.target == b"/?k=PH_TOKEN_0123456789abcdef" and body == b"PH_TOKEN_0123456789abcdef"
    assert (b"x-key", VALUE) in out.headers


def test_responses_are_scrubbed_even_across_chunks() -> None:
    scrub = Scrubber([(b"VALUE-0123456789", b"PLACEHOLDER")])
    out = b"".join(scrub.feed(c) for c in (b"a VAL", b"UE-01234", b"56789 b VALUE-0123456789", b"c")) + scrub.flush()
    assert out == b"a PLACEHOLDER b PLACEHOLDERc"
    assert scrub.line(b"Bearer VALUE-0123456789") == b"Bearer PLACEHOLDER"
    none = Scrubber([])
    assert none.feed(b"x") == b"x" and none.flush() == b""


def test_leaves_are_minted_for_the_name_and_verify_with_the_ca(tmp_path: Path) -> None:
    cert, key = new_ca("t")
    ctx = Minter(cert, key).context("api.test")
    client = ssl.create_default_context(cadata=cert.decode())
    a_in, a_out, b_in, b_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(a_in, a_out, server_hostname="api.test")
    s = ctx.wrap_bio(b_in, b_out, server_side=True)
    for _ in range(10):
        for obj in (c, s):
            try:
                obj.do_handshake()
            except ssl.SSLWantReadError:
                pass
        b_in.write(a_out.read())
        a_in.write(b_out.read())
    c.do_handshake()
    assert c.selected_alpn_protocol() in (None, "http/1.1")
    assert b"PRIVATE" not in cert


# -- guestd's trust store install --------------------------------------------------------------
def test_guestd_installs_the_ca_and_a_clone_replaces_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    debian = tmp_path / "etc/ssl/certs/ca-certificates.crt"
    debian.parent.mkdir(parents=True)
    debian.write_bytes(b"-----BEGIN CERTIFICATE-----\nsystem\n-----END CERTIFICATE-----\n")
    link = tmp_path / "etc/ssl/cert.pem"  # Alpine: a link to the same bundle (installed once)
    link.symlink_to(debian)
    d = tmp_path / "etc/sandvisor"
    monkeypatch.setattr(trust, "DIR", str(d))
    monkeypatch.setattr(trust, "CA", str(d / "ca.pem"))
    monkeypatch.setattr(trust, "BUNDLE", str(d / "ca-bundle.pem"))
    monkeypatch.setattr(trust, "SYSTEM_BUNDLES", (str(debian), str(link), str(tmp_path / "etc/pki/none.crt")))
    first, _ = new_ca("a")
    assert trust.install(first) == 1
    second, _ = new_ca("b")
    trust.install(second)  # a restored clone's own CA
    data = debian.read_bytes()
    assert data.startswith(b"-----BEGIN CERTIFICATE-----\nsystem") and second in data and first not in data
    assert data.count(trust.BEGIN) == 1
    assert (d / "ca.pem").read_bytes() == second and (d / "ca-bundle.pem").read_bytes() == data
    with pytest.raises(ValueError):
        trust.install(b"not a certificate")


# -- the SDK ------------------------------------------------------------------------------------
def test_the_sdk_secret_reads_env_sources_here(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Secret.parse("API_KEY=env:MY_KEY@api.test, *.other.test:8443")
    assert s.hosts == ("api.test", "*.other.test:8443") and s.env == "MY_KEY"
    monkeypatch.setenv("MY_KEY", "v1")
    spec = s.spec()
    assert spec.value == b"v1" and spec.hosts == ["api.test", "*.other.test:8443"] and "v1" not in repr(spec)
    assert Secret.parse("A=store:entry@a.test").spec().store == "entry"
    assert spec.substitute == "headers"
    everywhere = Secret.parse("A=value:x;y@z@a.test,b.test;substitute=all")  # (a literal may hold ; and @)
    assert everywhere.hosts == ("a.test", "b.test") and everywhere.value == "x;y@z"
    assert everywhere.spec().substitute == "all"
    for bad_text in ("A=value:x@a.test;substitute=body", "A=value:x@a.test;other=all"):
        with pytest.raises(ClientInvalidArgument):
            Secret.parse(bad_text)
    assert "hidden" not in repr(Secret(name="A", value="hidden", hosts="a.test"))
    monkeypatch.delenv("MY_KEY")
    for bad in (s.spec, lambda: Secret.parse("A=api.test"), lambda: Secret(name="A", hosts="a").spec()):
        with pytest.raises(ClientInvalidArgument):
            bad()


# -- the edges (fake VMs) -----------------------------------------------------------------------
@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="g", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_the_store_on_both_edges_and_no_value_in_errors(tmp_path: Path, short_dir: Path) -> None:
    lab = FakeLab()
    state = tmp_path / "state"
    state.mkdir()
    vault = Vault(state, tmp_path / "key")
    store = Store(state / "sandvisor.db")
    settings = fake_settings(tmp_path, lab, vault=vault, upstream_tls=upstream_context())
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                await n.start(lab.run)
                reg: Registry = await n.start(Registry(settings, store, templates=False).run)
                await n.start(
                    grpc_service.build_edge(reg, grpc_service.addresses([f"unix://{short_dir / 'g.sock'}"])).run
                )
                await n.start(Server(reg, short_dir / "m.sock").serve)
                channel = grpc.insecure_channel(f"unix:{short_dir / 'g.sock'}")
                ours = sv_grpc.SandvisorServiceStub(channel)

                def over_grpc() -> Any:
                    for hosts, why in (([], "--hosts"), (["*.com"], "public suffix")):  # (a new entry needs hosts)
                        with pytest.raises(grpc.RpcError) as refused:
                            ours.SetSecret(sv.SetSecretRequest(name="k1", value=VALUE, hosts=hosts))
                        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                        assert why in str(refused.value.details())
                    ours.SetSecret(sv.SetSecretRequest(name="k1", value=VALUE, hosts=["api.test"]))
                    ours.SetSecret(sv.SetSecretRequest(name="k1", value=VALUE))  # (a rotation keeps the hosts)
                    names = ours.ListSecrets(sv.ListSecretsRequest()).names
                    try:
                        ours.Create(
                            sv.CreateRequest(
                                base=pb.CreateSandboxRequest(id="x", network=pb.NetworkSpec(mode="user")),
                                outbound=True,
                                secrets=[sv.SecretSpec(name="T", hosts=["a.test"], value=VALUE)],
                            )
                        )
                    except grpc.RpcError as exc:
                        err = (exc.code(), exc.details())
                    try:
                        ours.RotateSecret(sv.RotateSecretRequest(id="nope", name="T", value=VALUE))
                    except grpc.RpcError as exc:
                        err2 = (exc.code(), exc.details())
                    return list(names), err, err2

                names, err, err2 = await trio.to_thread.run_sync(over_grpc)
                assert names == ["k1"]
                assert err[0] == grpc.StatusCode.FAILED_PRECONDITION and VALUE.decode() not in err[1]
                assert err2[0] == grpc.StatusCode.NOT_FOUND
                async with connect(short_dir / "m.sock") as c:
                    assert (await c.call("ListSecrets", {}))["names"] == ["k1"]
                    await c.call("SetSecret", {"name": "k2", "value": b"v2", "hosts": ["*.k2.test"]})
                    assert vault.named_hosts("k1") == ["api.test"] and vault.named_hosts("k2") == ["*.k2.test"]
                    await c.call("DeleteSecret", {"name": "k1"})
                    assert (await c.call("ListSecrets", {}))["names"] == ["k2"]
                    with pytest.raises(Exception) as bad:
                        await c.call("SetSecret", {"name": "bad name", "value": VALUE})
                    assert "INVALID_ARGUMENT" in repr(bad.value) and VALUE.decode() not in repr(bad.value)
                assert VALUE not in (state / "secrets.vault").read_bytes()
                channel.close()
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()
