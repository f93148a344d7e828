"""Hostile input against the DNS codec (actors/net/dnsmsg.py) and the sandboxes' DNS proxy
(actors/net/dnsproxy.py): whatever a guest sends, and whatever an upstream answers, the
codec gives a result or a :class:`DnsError` and nothing else, and the proxy answers
with a well-formed reply (or silence) and serves on.

Found: one query whose label held ``\\xff`` (or a dot) made the proxy re-encode the
name for its REFUSED answer, raise UnicodeEncodeError, and take the supervisor down
with every sandbox. The property tests below draw such queries on purpose
(structured-but-malformed messages: raw label octets, dots inside labels, compression
loops, pointers past the end, truncation, huge counts), besides arbitrary bytes.

The proxy runs with a fake upstream and a fake nftables (no namespace, no root); the
serving loops run on loopback. The last tests (marker ``host``: root, namespaces,
nftables) prove the fail-closed side in a lab namespace: a dead proxy ends neither
tap networking nor the filter, and a teardown with sandbox links still open keeps the
table.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import subprocess
from collections.abc import Callable
from ipaddress import IPv4Address, IPv4Network
from typing import Any, cast

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.net import dnsmsg
from actors.net.dnsproxy import DnsProxy
from actors.net.egress import NEVER4, EgressPolicy
from actors.net.nft import Nft, NftError

GUEST = IPv4Address("10.88.0.2")
CLOSED = [*map(IPv4Network, NEVER4), IPv4Network("10.88.0.0/16")]  # as HostNetwork gives it
HDR = struct.Struct("!HHHHHH")

# -- strategies: messages a hostile guest (or upstream) sends ----------------------------
plain_label = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", min_size=1, max_size=12
)
hostile_label = st.one_of(
    st.sampled_from([b"\xff", b"a.b", b"\\", b"..", b"\x00", b"x y", b"\xc0", b"\\255", b"caf\xc3\xa9", b"EXAMPLE"]),
    st.binary(min_size=1, max_size=63),
)
label = st.one_of(plain_label.map(str.encode), hostile_label)
label_lists = st.lists(label, max_size=6)
SUFFIXES = [(), (b"example", b"com"), (b"allowed", b"example", b"com"), (b"bad", b"example", b"com"), (b"other",)]


def wire(labels: tuple[bytes, ...] | list[bytes]) -> bytes:
    """Labels on the wire without any check (overlong names included)."""
    return b"".join(bytes([len(x)]) + x for x in labels) + b"\0"


@st.composite
def names(draw: st.DrawFn) -> bytes:
    """A name's octets in a question: raw labels under a policy-relevant suffix, or a
    malformed one (compression loops and chains, pointers past the end or into the
    header, reserved label types, a label longer than what follows)."""
    labels = [*draw(label_lists), *draw(st.sampled_from(SUFFIXES))]
    kind = draw(st.sampled_from(["labels"] * 6 + ["loop", "chain", "past-end", "header", "reserved", "short", "long"]))
    if kind == "labels":
        return wire(labels)
    if kind == "loop":
        return b"\xc0\x0c"  # the question's name points at itself
    if kind == "chain":
        return wire(labels)[:-1] + b"\xc0\x0c"  # labels, then back to their start: forever
    if kind == "past-end":
        return wire(labels)[:-1] + bytes([0xC0 | draw(st.integers(0, 0x3F)), draw(st.integers(0, 255))])
    if kind == "header":
        return b"\xc0" + bytes([draw(st.integers(0, 11))])
    if kind == "reserved":
        return bytes([draw(st.sampled_from([0x40, 0x80, 0x41, 0xBF]))]) + b"abc\0"
    if kind == "short":
        return b"\x3f" + b"x" * draw(st.integers(0, 20))  # a 63-octet label with fewer octets behind
    return wire([b"a" * 63] * draw(st.integers(4, 6)))  # longer than 255 octets


@st.composite
def queries(draw: st.DrawFn) -> bytes:
    """A query as a guest could send it: a header (mostly sane, sometimes not), one
    question (sometimes more, or none), maybe trailing octets, maybe cut anywhere."""
    mid = draw(st.integers(0, 0xFFFF))
    flags = draw(st.one_of(st.just(dnsmsg.RD), st.just(0), st.integers(0, 0xFFFF)))
    qd = draw(st.one_of(st.just(1), st.integers(0, 0xFFFF)))
    counts = draw(st.one_of(st.just((0, 0, 0)), st.tuples(*[st.integers(0, 0xFFFF)] * 3)))
    qtail = struct.pack(
        "!HH", draw(st.sampled_from([dnsmsg.A, dnsmsg.AAAA, dnsmsg.ANY, dnsmsg.TXT, 0, 0xFFFF])), dnsmsg.IN
    )
    data = HDR.pack(mid, flags, qd, *counts) + draw(names()) + qtail + draw(st.binary(max_size=40))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return data


# -- the codec: a result or a DnsError, never another exception ---------------------------
def check_codec(data: bytes) -> None:
    for fn in (dnsmsg.parse, dnsmsg.parse_query):
        try:
            fn(data)
        except dnsmsg.DnsError:
            pass
    q: dnsmsg.Question | None
    try:
        _mid, _flags, q = dnsmsg.parse_query(data)
    except dnsmsg.DnsError:
        q = None
    if q is not None:
        raw = dnsmsg.read_labels(data, 12)[0]
        assert dnsmsg.name_labels(q.name) == tuple(x.lower() for x in raw)
        assert dnsmsg.encode_name(q.name) == wire([x.lower() for x in raw])
    if len(data) < 12:
        with pytest.raises(dnsmsg.DnsError):
            dnsmsg.error_response(data, dnsmsg.REFUSED)
        return
    for rcode in (dnsmsg.FORMERR, dnsmsg.REFUSED, dnsmsg.SERVFAIL):
        reply = dnsmsg.error_response(data, rcode)
        msg = dnsmsg.parse(reply)  # well-formed, always
        assert msg.id == HDR.unpack_from(data)[0] and msg.is_response and msg.rcode == rcode
        if q is None:
            assert msg.questions == ()
        else:  # the question's own octets, case and all (compression undone)
            labels, end = dnsmsg.read_labels(data, 12)
            assert msg.questions == (q,) and reply[12:] == wire(labels) + data[end : end + 4]


@given(st.binary(max_size=600))
@settings(max_examples=300)
def test_codec_arbitrary_bytes_typed_errors_only(data: bytes) -> None:
    check_codec(data)


@given(queries())
@settings(max_examples=500)
def test_codec_malformed_queries_typed_errors_only(data: bytes) -> None:
    check_codec(data)


@given(st.lists(st.binary(min_size=1, max_size=63), max_size=5))
def test_names_round_trip_through_text_losslessly(labels: list[bytes]) -> None:
    text = dnsmsg.name_text(tuple(labels))
    assert dnsmsg.name_labels(text) == tuple(x.lower() for x in labels)
    assert dnsmsg.is_plain(text) == all(all(0x21 <= b <= 0x7E and b not in b".\\" for b in x) for x in labels)
    if len(wire(labels)) <= 255:
        assert dnsmsg.read_name(dnsmsg.encode_name(text), 0) == (text, len(wire(labels)))


@given(st.text(max_size=80))
def test_text_names_encode_or_fail_typed(text: str) -> None:
    try:
        dnsmsg.encode_name(text)
        dnsmsg.query(text)
    except dnsmsg.DnsError:
        pass


def test_the_reported_queries() -> None:
    """The finding's exact queries: \\xff.example.com and a.b (a dot in a label)."""
    for raw in (b"\x01\xff\x07example\x03com\x00", b"\x03a.b\x00", b"\x03a.b\x07example\x03com\x00"):
        data = HDR.pack(7, dnsmsg.RD, 1, 0, 0, 0) + raw + struct.pack("!HH", dnsmsg.A, dnsmsg.IN)
        _, _, q = dnsmsg.parse_query(data)
        assert not dnsmsg.is_plain(q.name)
        reply = dnsmsg.error_response(data, dnsmsg.REFUSED)
        assert reply[12:] == data[12:] and dnsmsg.parse(reply).rcode == dnsmsg.REFUSED
    # a compressed question is echoed uncompressed (a pointer would point into nowhere)
    data = HDR.pack(8, 0, 1, 0, 0, 0) + b"\x01a\xc0\x14" + struct.pack("!HH", dnsmsg.A, dnsmsg.IN) + b"\x03com\x00"
    assert dnsmsg.parse(dnsmsg.error_response(data, dnsmsg.FORMERR)).questions == (dnsmsg.Question("a.com", dnsmsg.A),)


# -- the proxy's answer(): a well-formed reply or None, never an exception ----------------
class FakeNft:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.commands: list[str] = []

    def run(self, commands: str | list[str]) -> str:
        if self.fail:
            raise NftError("no such set (the sandbox went away)")
        self.commands += [commands] if isinstance(commands, str) else commands
        return ""


Upstream = Callable[[bytes], "bytes | None"]


def good_answer(query: bytes, *, flags: int = 0, mid_delta: int = 0) -> bytes:
    mid, rflags, q = dnsmsg.parse_query(query)
    records = (
        dnsmsg.Record(q.name, dnsmsg.CNAME, dnsmsg.IN, 30, b"", target="cdn.example.net"),
        dnsmsg.address_record("cdn.example.net", IPv4Address("203.0.113.5"), 0),
        dnsmsg.address_record(q.name, IPv4Address("10.88.0.9"), 60),  # a sandbox: never opened
        dnsmsg.address_record(q.name, IPv4Address("169.254.169.254"), 60),  # metadata: never opened
    )
    msg = dnsmsg.Message(
        (mid + mid_delta) & 0xFFFF, dnsmsg.QR | dnsmsg.RA | (rflags & dnsmsg.RD) | flags, (q,), records
    )
    return dnsmsg.build(msg)


def mutate(data: bytes, at: int, value: int) -> bytes:
    b = bytearray(data)
    b[at % len(b)] = value
    return bytes(b)


@st.composite
def upstreams(draw: st.DrawFn) -> tuple[Upstream, Upstream]:
    """(UDP, TCP) behaviours of the upstream resolver: right, wrong, hostile or gone."""

    def pick() -> Upstream:
        kind = draw(st.sampled_from(["good", "garbage", "wrong-id", "mutated", "timeout", "oserror", "tc"]))
        junk = draw(st.binary(max_size=64))
        at, value = draw(st.integers(0, 500)), draw(st.integers(0, 255))

        def up(query: bytes) -> bytes | None:
            if kind == "good":
                return good_answer(query)
            if kind == "garbage":
                return junk
            if kind == "wrong-id":
                return good_answer(query, mid_delta=1)
            if kind == "mutated":
                return mutate(good_answer(query), at, value)
            if kind == "tc":
                return good_answer(query, flags=dnsmsg.TC)
            if kind == "oserror":
                raise OSError(111, "Connection refused")
            return None

        return up

    return pick(), pick()


class FakeUpstreamProxy(DnsProxy):
    def __init__(self, udp: Upstream, tcp: Upstream, nft: FakeNft) -> None:
        super().__init__(IPv4Address("10.88.0.1"), [("192.0.2.53", 53)], cast(Nft, nft), closed=CLOSED)
        self.udp, self.tcp = udp, tcp
        self.asked: list[bytes] = []

    async def _udp_upstream(self, data: bytes, host: str, port: int) -> bytes | None:
        self.asked.append(data)
        await trio.lowlevel.checkpoint()
        return self.udp(data)

    async def _tcp_upstream(self, data: bytes, host: str, port: int) -> bytes | None:
        await trio.lowlevel.checkpoint()
        return self.tcp(data)


POLICIES = [
    {"default": "deny", "allow": ["example.com", "*.allowed.example.com"]},
    {"default": "allow", "deny": ["bad.example.com", "other"]},
    {"default": "allow", "allow": ["*.example.com:443"], "deny": ["bad.example.com"]},
    None,
]


def check_answer(proxy: FakeUpstreamProxy, data: bytes, reply: bytes | None) -> None:
    if len(data) < 12:
        assert reply is None  # nothing to answer with (no id)
        return
    assert reply is not None
    msg = dnsmsg.parse(reply)  # well-formed, always
    assert msg.is_response and msg.id == HDR.unpack_from(data)[0]
    try:
        _, _, q = dnsmsg.parse_query(data)
    except dnsmsg.DnsError:
        assert msg.rcode == dnsmsg.FORMERR and msg.questions == ()
        return
    assert msg.questions[:1] == (q,)
    if not dnsmsg.is_plain(q.name):  # refused unjudged and never forwarded
        assert msg.rcode == dnsmsg.REFUSED and proxy.asked == []


@given(queries(), upstreams(), st.sampled_from(POLICIES), st.booleans())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_answer_is_well_formed_or_none_and_never_raises(
    data: bytes, ups: tuple[Upstream, Upstream], policy: dict[str, Any] | None, nft_fails: bool
) -> None:
    proxy = FakeUpstreamProxy(*ups, FakeNft(nft_fails))
    proxy.register(GUEST, "svn0000000000", EgressPolicy.parse(policy))

    async def main() -> bytes | None:
        with trio.fail_after(10):
            return await proxy.answer(GUEST, data)

    reply = trio.run(main)
    check_answer(proxy, data, reply)
    assert proxy.stats["errors"] == 0  # every path was foreseen: the catch-all never ran


@given(st.lists(label, min_size=1, max_size=4), st.sampled_from(POLICIES), upstreams())
@settings(max_examples=150, deadline=None)
def test_names_answered_by_policy_or_refused(
    labels: list[bytes], policy: dict[str, Any] | None, ups: tuple[Upstream, Upstream]
) -> None:
    """Well-formed queries for hostile names under policy-relevant suffixes: a name the
    policy could misjudge is refused; nothing opens but answers to plain allowed names."""
    nft = FakeNft()
    proxy = FakeUpstreamProxy(*ups, nft)
    proxy.register(GUEST, "svn0000000000", EgressPolicy.parse(policy))
    for suffix in SUFFIXES:
        full = [*labels, *suffix]
        if len(wire(full)) > 255:
            continue
        data = HDR.pack(99, dnsmsg.RD, 1, 0, 0, 0) + wire(full) + struct.pack("!HH", dnsmsg.A, dnsmsg.IN)
        proxy.asked.clear()
        reply = trio.run(proxy.answer, GUEST, data)
        check_answer(proxy, data, reply)
        _, _, q = dnsmsg.parse_query(data)
        if not dnsmsg.is_plain(q.name):
            assert reply is not None and reply[12:] == data[12:]  # the question echoed octet for octet
    assert proxy.stats["errors"] == 0
    for cmd in nft.commands:  # never a sandbox or the metadata service
        assert "10.88.0.9" not in cmd and "169.254.169.254" not in cmd


async def test_an_unexpected_error_in_answer_is_servfail_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    proxy = FakeUpstreamProxy(good_answer, good_answer, FakeNft())
    proxy.register(GUEST, "svn0000000000", EgressPolicy.parse(None))

    async def broken(client: object, data: bytes) -> bytes | None:
        raise RuntimeError("a bug")

    proxy._decide = broken  # type: ignore[method-assign]
    query = dnsmsg.query("example.com", mid=5)
    with caplog.at_level(logging.ERROR, logger="sandvisor.dns"):
        reply = await proxy.answer(GUEST, query)
    assert reply is not None and dnsmsg.parse(reply).rcode == dnsmsg.SERVFAIL and dnsmsg.parse(reply).id == 5
    assert proxy.stats["errors"] == 1 and "the proxy serves on" in caplog.text
    assert await proxy.answer(GUEST, b"\x00") is None  # too short to answer, still no exception


# -- the serving loops on loopback: one bad datagram or connection never ends the proxy ------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


HOSTILE = [
    HDR.pack(1, dnsmsg.RD, 1, 0, 0, 0) + b"\x01\xff\x07example\x03com\x00" + struct.pack("!HH", dnsmsg.A, dnsmsg.IN),
    HDR.pack(2, dnsmsg.RD, 1, 0, 0, 0) + b"\x03a.b\x07example\x03com\x00" + struct.pack("!HH", dnsmsg.A, dnsmsg.IN),
    HDR.pack(3, dnsmsg.RD, 1, 0, 0, 0) + b"\xc0\x0c" + struct.pack("!HH", dnsmsg.A, dnsmsg.IN),  # compression loop
    HDR.pack(4, dnsmsg.RD, 1, 0, 0, 0) + b"\x07exam",  # truncated
    HDR.pack(5, dnsmsg.RD, 0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF),  # huge counts
    b"\x00\x06",  # shorter than a header: silence
    bytes(range(256)) * 4,  # random-ish octets
]


async def test_serving_loops_survive_hostile_datagrams_connections_and_bugs() -> None:
    port = free_port()
    proxy = FakeUpstreamProxy(good_answer, good_answer, FakeNft())
    proxy.address, proxy.port = IPv4Address("127.0.0.1"), port
    proxy.register(IPv4Address("127.0.0.1"), "svn0000000000", EgressPolicy.parse({"default": "allow"}))
    real_decide = proxy._decide

    async def sometimes_broken(client: Any, data: bytes) -> bytes | None:
        if data[12:17] == b"\x04boom":
            raise RuntimeError("a bug in one query")
        return await real_decide(client, data)

    proxy._decide = sometimes_broken  # type: ignore[method-assign]
    boom = dnsmsg.query("boom.example.com", mid=77)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.run)
            udp = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            with udp:
                await udp.connect(("127.0.0.1", port))
                for data in [*HOSTILE, boom]:
                    await udp.send(data)
                    if len(data) >= 12:  # each gets its well-formed answer
                        msg = dnsmsg.parse(await udp.recv(4096))
                        assert msg.id == HDR.unpack_from(data)[0] and msg.is_response
                await udp.send(dnsmsg.query("fine.example.com", mid=4242))
                msg = dnsmsg.parse(await udp.recv(4096))
                assert msg.id == 4242 and msg.rcode == dnsmsg.NOERROR and msg.answers
            # TCP: one connection's hostile messages, then a bug; the next connection is served
            for messages in (HOSTILE[:5], [boom]):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    for data in messages:
                        await stream.send_all(len(data).to_bytes(2, "big") + data)
                        got = await _read_tcp(stream)
                        assert got is not None and dnsmsg.parse(got).id == HDR.unpack_from(data)[0]
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"\xff\xff" + b"\x00" * 100 + b"")  # a length it never sends
                await stream.send_eof()
                assert await _read_tcp(stream) is None  # closed, nothing else
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                q = dnsmsg.query("fine.example.com", mid=4343)
                await stream.send_all(len(q).to_bytes(2, "big") + q)
                got = await _read_tcp(stream)
                assert got is not None and dnsmsg.parse(got).id == 4343 and dnsmsg.parse(got).rcode == dnsmsg.NOERROR
            assert proxy.stats["errors"] == 2  # the two injected bugs, and nothing else
            nursery.cancel_scope.cancel()


async def _read_tcp(stream: trio.SocketStream) -> bytes | None:
    buf = b""
    while len(buf) < 2 or len(buf) < 2 + int.from_bytes(buf[:2], "big"):
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        buf += chunk
    return buf[2 : 2 + int.from_bytes(buf[:2], "big")]


# -- fail closed: the host side (root, namespaces, nftables) -------------------------------
needs_host = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("ip"), reason="needs root, nft and ip"
)


class Exploding(dict[IPv4Address, Any]):
    """The proxy's client table, made to fail inside the serving loop itself (outside
    any per-query boundary): how a proxy would die of a bug nobody foresaw."""

    def get(self, key: Any, default: Any = None) -> Any:
        if key == IPv4Address(trigger[0]):
            raise RuntimeError("the proxy's own bug")
        return super().get(key, default)


trigger = [""]


@pytest.mark.host
@needs_host
async def test_a_dead_proxy_ends_nothing_and_the_filter_stays(caplog: pytest.LogCaptureFixture) -> None:
    from tests.support.netlab import SERVERS, UPLINK_HOST, lab_env, probe, resolve

    async with lab_env() as lab:
        g = lab.guest("dns-dies", {"default": "deny", "allow": [SERVERS[0], "allowed.test"]})
        assert (await resolve(g.ns, str(lab.pool.gateway), "allowed.test"))[0] == dnsmsg.NOERROR
        trigger[0] = g.address
        lab.net.dns._clients = Exploding(lab.net.dns._clients)
        with caplog.at_level(logging.ERROR, logger="sandvisor.net"):
            assert (await resolve(g.ns, str(lab.pool.gateway), "allowed.test", timeout=1))[0] == -1
            while not lab.net.dns_down:
                await trio.sleep(0.01)
        assert "DNS for sandboxes is down" in caplog.text
        # tap networking runs on, the filter with it: the allowed CIDR, nothing else
        assert await probe(g.ns, SERVERS[0], 80) == f"server0 {UPLINK_HOST}"
        assert await probe(g.ns, SERVERS[2], 80, timeout=1) != "server2"
        argv = ["ip", "netns", "exec", str(lab.host.name), "nft", "list", "tables"]
        listing = subprocess.run(argv, check=True, capture_output=True, text=True)
        assert "sandvisor" in listing.stdout


@pytest.mark.host
@needs_host
async def test_teardown_with_links_still_open_keeps_the_table(caplog: pytest.LogCaptureFixture) -> None:
    """The supervisor going down on an error, its QEMUs not stopped yet: the table
    stays (the links' own rules go: whatever they send is dropped)."""
    from actors.net.hostnet import HostNetConfig, HostNetwork
    from actors.net.ippool import IpPool, link_name
    from tests.support.netlab import POOL, SERVERS, UPLINK_HOST, add_guest, link_internet, namespaces, probe, tcp_server

    with namespaces("svh", "svi", "svg") as (host, inet, guest):
        link_internet(host, inet)
        pool = IpPool(POOL)
        net = HostNetwork(HostNetConfig(netns=host, upstreams=(("192.0.2.1", 53),)), pool)
        async with trio.open_nursery() as outer:
            await outer.start(tcp_server, inet, SERVERS[0], 80, "server0")
            address = pool.allocate("open")
            add_guest(host, guest, link_name("open"), address, pool.prefix, pool.gateway)
            with caplog.at_level(logging.ERROR, logger="sandvisor.net"):
                async with trio.open_nursery() as running:
                    await running.start(net.run)
                    net.attach(link_name("open"), address, EgressPolicy.parse(None))
                    assert await probe(guest, SERVERS[0], 80) == f"server0 {UPLINK_HOST}"
                    running.cancel_scope.cancel()
            assert "still open" in caplog.text
            argv = ["ip", "netns", "exec", str(host.name), "nft", "list", "ruleset"]
            listing = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
            assert "table inet sandvisor" in listing and link_name("open") not in listing
            assert await probe(guest, SERVERS[0], 80, timeout=1) != f"server0 {UPLINK_HOST}"  # dropped
            outer.cancel_scope.cancel()


# -- port relays: a connection's failure is the connection's, never the relay's -----------
async def test_relays_survive_a_vanished_target_namespace() -> None:
    """The target's namespace is gone (a jail's, as its QEMU exits): each connection
    closes, each UDP datagram is dropped, and the relays serve on (this used to raise
    UnboundLocalError out of the relay's nursery, into the sandbox's life)."""
    from actors.net.netns import NetNS
    from actors.net.portfwd import Target, bind_listener, relay_tcp, relay_udp

    gone = Target("127.0.0.1", 9, NetNS(file="/nonexistent/ns/net"))
    tcp = bind_listener("127.0.0.1", 0, socket.SOCK_STREAM)
    udp = bind_listener("127.0.0.1", 0, socket.SOCK_DGRAM)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            tcp_port = await nursery.start(relay_tcp, tcp, gone)
            udp_port = await nursery.start(relay_udp, udp, gone)
            for _ in range(3):
                stream = await trio.open_tcp_stream("127.0.0.1", tcp_port)
                async with stream:
                    assert await stream.receive_some(100) == b""  # closed, nothing else
                client = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                with client:
                    await client.connect(("127.0.0.1", udp_port))
                    await client.send(b"ping")
            nursery.cancel_scope.cancel()
