"""Tap networking's I/O-free parts: the IP pool, egress policies and their painting,
the DNS codec (Hypothesis-fuzzed)."""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors import dnsmsg as D
from actors.egress import EgressPolicy, PolicyError, paint, parse_entry
from actors.ippool import IpPool, MemoryLeases, PoolError, PoolExhausted, guest_mac, link_name
from actors.store import Store, StoreLeases


# -- pool --------------------------------------------------------------------------
def test_pool_allocates_next_fit_and_releases() -> None:
    pool = IpPool("10.9.0.0/29")  # .2 .. .6: five sandboxes
    assert pool.gateway == IPv4Address("10.9.0.1") and pool.size == 5
    got = [pool.allocate(f"o{i}") for i in range(5)]
    assert [str(a) for a in got] == [f"10.9.0.{i}" for i in range(2, 7)]
    assert pool.allocate("o3") == got[3]  # idempotent per owner
    with pytest.raises(PoolExhausted):
        pool.allocate("late")
    assert pool.release("o1") == IPv4Address("10.9.0.3")
    assert pool.release("o1") is None
    assert pool.allocate("new") == IPv4Address("10.9.0.3")  # the only free one
    pool.release("o0")
    pool.release("o2")
    assert pool.allocate("n2") == IPv4Address("10.9.0.4")  # next-fit: after the last handed out


def test_pool_persists_in_the_store_and_drops_leases_that_no_longer_fit(tmp_path: Path) -> None:
    def reopened() -> Store:  # a supervisor restart: what the last one queued is committed at its exit
        return Store(tmp_path / "sandvisor.db")

    store = reopened()
    pool = IpPool("10.9.0.0/24", StoreLeases(store))
    a = pool.allocate("a")
    b = pool.allocate("b")
    pool.release("a")
    store.close()
    store = reopened()
    again = IpPool("10.9.0.0/24", StoreLeases(store))
    assert again.leases() == {"b": b} and again.address_of("a") is None
    assert again.allocate("c") not in (a, b)  # the cursor starts after the highest lease
    assert again.allocate("d", want=a) == a  # a free address asked for (a restore keeping its own)
    assert again.allocate("e", want=b) not in (a, b)  # held: another one
    assert again.allocate("f", want=IPv4Address("10.9.0.1")) != IPv4Address("10.9.0.1")  # the gateway: never
    store.close()
    store = reopened()
    smaller = IpPool("10.7.0.0/29", StoreLeases(store))  # the operator changed the pool
    assert smaller.leases() == {} and {o for o, _ in smaller.dropped} == {"b", "c", "d", "e", "f"}
    store.close()
    store = reopened()
    assert store.ip_leases() == []
    store.close()


def test_pool_store_failure_changes_nothing() -> None:
    class Failing(MemoryLeases):
        def put(self, owner: str, address: str) -> None:
            raise OSError("disk full")

    pool = IpPool("10.9.0.0/24", Failing())
    with pytest.raises(OSError):
        pool.allocate("x")
    assert len(pool) == 0 and pool.address_of("x") is None


@pytest.mark.parametrize("bad", ["10.0.0.0/30", "10.0.0.1/24", "fd00::/64", "127.0.0.0/8", "nonsense", "1.0.0.0/7"])
def test_pool_refuses_bad_cidrs(bad: str) -> None:
    with pytest.raises(PoolError):
        IpPool(bad)


def test_names_and_macs() -> None:
    name = link_name("2f6a1c1e-8b1a-4a4e-9a51-5b0d3d1c2b11")
    assert name.startswith("svn") and len(name) == 15 and name != link_name("other")
    assert guest_mac(IPv4Address("10.88.1.2")) == "02:73:76:58:01:02"


# -- egress policy -----------------------------------------------------------------
def test_parse_entries() -> None:
    assert parse_entry("10.0.0.0/8").net == IPv4Network("10.0.0.0/8")
    e = parse_entry("1.2.3.4:8000-8100")
    assert e.net == IPv4Network("1.2.3.4/32") and e.ports == (8000, 8100)
    e = parse_entry("*.Example.COM.:443")
    assert e.domain == "*.example.com" and e.ports == (443, 443)
    for bad in ["169.254.169.254", "127.0.0.1:80", "::1", "[fe80::1]:80", "a..b", "*.com", "x:0", "x:9-3", "", 5]:
        with pytest.raises(PolicyError):
            parse_entry(bad)


def test_policy_parse_and_names() -> None:
    p = EgressPolicy.parse(
        {"default": "deny", "allow": ["*.example.com", "api.example.com:443"], "deny": ["evil.example.com"]}
    )
    assert p.match_name("evil.example.com.") == ("deny", ())
    assert p.match_name("API.example.com") == ("allow", ((443, 443),))  # exact beats wildcard
    assert p.match_name("www.example.com") == ("allow", (None,))
    assert p.match_name("example.com") == ("default", ())  # *.x is the subdomains only
    assert EgressPolicy.parse(p.to_dict()) == p
    for bad in [{"default": "maybe"}, {"allow": "x.com"}, {"other": 1}, {"deny": ["x.com:80"]}, []]:
        with pytest.raises(PolicyError):
            EgressPolicy.parse(bad)  # type: ignore[arg-type]


def _brute(addr: int, allow: list[IPv4Network], deny: list[IPv4Network], pool: IPv4Network | None) -> str | None:
    best: tuple[int, int, str] | None = None
    items = [(pool, 0, "deny")] if pool else []
    items += [(n, 1, "allow") for n in allow] + [(n, 2, "deny") for n in deny]
    for net, rank, verdict in items:
        if net is not None and int(net.network_address) <= addr <= int(net.broadcast_address):
            key = (net.prefixlen, rank, verdict)
            if best is None or key[:2] > best[:2]:
                best = key
    return None if best is None else best[2]


nets = st.builds(
    lambda a, p: IPv4Network((a, p), strict=False),
    st.integers(0, 255).map(lambda x: x << 24 | 0x0A0000),
    st.integers(8, 32),
)


@given(st.lists(nets, max_size=6), st.lists(nets, max_size=6), st.one_of(st.none(), nets), st.integers(0, 2**32 - 1))
@settings(max_examples=300)
def test_paint_matches_most_specific_entry(
    allow: list[IPv4Network], deny: list[IPv4Network], pool: IPv4Network | None, probe: int
) -> None:
    a, d = paint(allow, deny, pool)
    points = [probe] + [int(n.network_address) for n in (*allow, *deny)] + [int(n.broadcast_address) for n in deny]
    for addr in points:
        in_a = any(int(x) <= addr <= int(y) for x, y in a)
        in_d = any(int(x) <= addr <= int(y) for x, y in d)
        want = _brute(addr, allow, deny, pool)
        assert (in_a, in_d) == (want == "allow", want == "deny")


def test_pool_is_denied_unless_explicitly_allowed() -> None:
    pool = IPv4Network("10.88.0.0/16")
    a, d = paint([IPv4Network("0.0.0.0/0")], [], pool)
    assert (IPv4Address("10.88.0.0"), IPv4Address("10.88.255.255")) in d
    a, d = paint([IPv4Network("10.88.0.7/32")], [], pool)
    assert a == [(IPv4Address("10.88.0.7"), IPv4Address("10.88.0.7"))]
    a, d = paint([IPv4Network("10.88.0.0/16")], [], pool)  # the pool itself: every sandbox
    assert d == [] and a == [(IPv4Address("10.88.0.0"), IPv4Address("10.88.255.255"))]


# -- DNS codec ---------------------------------------------------------------------
def test_dns_roundtrip_and_cname_chain() -> None:
    q = D.query("www.Example.com", D.A, mid=77)
    mid, flags, question = D.parse_query(q)
    assert (mid, question) == (77, D.Question("www.example.com", D.A)) and flags & D.RD
    ans = D.Message(
        77,
        D.QR | D.RD | D.RA,
        (question,),
        (
            D.Record("www.example.com", D.CNAME, D.IN, 300, b"", target="cdn.example.net"),
            D.address_record("cdn.example.net", IPv4Address("203.0.113.5"), 60),
            D.address_record("unrelated.org", IPv4Address("203.0.113.66"), 60),
        ),
    )
    parsed = D.parse(D.build(ans))
    assert parsed.answers[0].target == "cdn.example.net"
    assert D.answered_addresses(parsed, "www.example.com") == [(IPv4Address("203.0.113.5"), 60)]
    err = D.parse(D.error_response(q, D.REFUSED))
    assert err.id == 77 and err.rcode == D.REFUSED and err.questions == (question,) and err.is_response


def test_dns_compression_pointers_are_bounded() -> None:
    loop = struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0) + b"\xc0\x0c" + b"\x00\x01\x00\x01"
    with pytest.raises(D.DnsError):
        D.parse(loop)
    # a pointer to a valid name earlier in the message
    msg = D.build(D.Message(1, 0, (D.Question("a.b", D.A),)))
    compressed = msg + b"\xc0\x0c" + struct.pack("!HHIH", D.A, D.IN, 5, 4) + b"\x01\x02\x03\x04"
    compressed = struct.pack("!HHHHHH", 1, D.QR, 1, 1, 0, 0) + compressed[12:]
    parsed = D.parse(compressed)
    assert parsed.answers[0].name == "a.b" and parsed.answers[0].address == IPv4Address("1.2.3.4")


@given(st.binary(max_size=600))
@settings(max_examples=2000)
def test_dns_parser_never_fails_but_typed(data: bytes) -> None:
    for fn in (D.parse, D.parse_query):
        try:
            fn(data)
        except D.DnsError:
            pass
    try:
        D.error_response(data, D.REFUSED)
    except D.DnsError:
        assert len(data) < 12


labels = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)
names = st.lists(labels, min_size=1, max_size=5).map(".".join)


@given(
    st.integers(0, 0xFFFF),
    names,
    st.lists(st.tuples(names, st.integers(0, 2**31 - 1), st.binary(min_size=4, max_size=4)), max_size=8),
)
def test_dns_build_parse_roundtrip(mid: int, qname: str, records: list[tuple[str, int, bytes]]) -> None:
    msg = D.Message(
        mid,
        D.QR,
        (D.Question(qname, D.A),),
        tuple(D.Record(n, D.A, D.IN, ttl, raw) for n, ttl, raw in records),
    )
    assert D.parse(D.build(msg)) == msg


@given(st.binary(min_size=12, max_size=200), st.integers(0, 199), st.integers(0, 255))
def test_dns_mutated_answers_fail_typed(seed: bytes, at: int, value: int) -> None:
    base = bytearray(D.build(D.Message(1, D.QR, (D.Question("x.example", D.A),))) + seed)
    base[at % len(base)] = value
    try:
        D.parse(bytes(base))
    except D.DnsError:
        pass
