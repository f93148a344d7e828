"""Tap networking's I/O-free parts: the IP pool, egress policies and their painting,
the DNS codec (Hypothesis-fuzzed)."""

from __future__ import annotations

import fcntl
import os
import re
import stat
import struct
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.egress_policy import PRIVATE4, EgressPolicy, PolicyError, parse_entry
from actors.net import dnsmsg
from actors.net.egress import clip, may_open, paint, sandbox_rules
from actors.net.hostnet import lock_netns, unlock_netns
from actors.net.ippool import IpPool, MemoryLeases, PoolError, PoolExhausted, guest_mac, link_name
from actors.net.netns import NetError, NetNS
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


# -- the painted chain: what a sandbox reaches (an interpreter of sandbox_rules' text) --
POOL = IPv4Network("10.88.0.0/16")
CLOSED = [*(IPv4Network(n) for n in PRIVATE4), POOL]


def _ranges(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.strip("{} ").split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            out.append((int(IPv4Address(lo)), int(IPv4Address(hi))))
        else:
            n = IPv4Network(part)
            out.append((int(n.network_address), int(n.broadcast_address)))
    return out


def chain_verdict(policy: EgressPolicy, addr: str, port: int, pool: IPv4Network = POOL) -> str:
    """What the sandbox chain of ``policy`` does to a TCP packet to ``addr:port``
    (the DNS sets empty: nothing resolved)."""
    cmds = sandbox_rules("svnx", IPv4Address("10.88.0.2"), policy, pool)
    sets: dict[str, list[tuple[int, int]]] = {}
    for c in cmds:
        if m := re.fullmatch(r"add set inet sandvisor (\S+) .*", c):
            sets[m.group(1)] = []
        elif m := re.fullmatch(r"add element inet sandvisor (svnx_\S+) (\{.*\})", c):
            sets[m.group(1)] += _ranges(m.group(2))
    a = int(IPv4Address(addr))
    for c in cmds:
        if not c.startswith("add rule inet sandvisor sb_svnx "):
            continue
        body = c.removeprefix("add rule inet sandvisor sb_svnx ")
        if m := re.search(r"ip daddr (@\S+|\{[^}]*\}|\S+)", body):
            target = m.group(1)
            ranges = sets[target[1:]] if target.startswith("@") else _ranges(target)
            if not any(lo <= a <= hi for lo, hi in ranges):
                continue
        if m := re.search(r"th dport (\d+)(?:-(\d+))?", body):
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if not lo <= port <= hi:
                continue
        return "accept" if body.endswith("accept") else "reject"
    raise AssertionError("the chain ends without a verdict")


def test_port_allow_does_not_open_the_pool_or_private_ranges() -> None:
    p = EgressPolicy.parse({"default": "deny", "allow": ["0.0.0.0/0:8080"]})
    assert chain_verdict(p, "203.0.113.5", 8080) == "accept"
    assert chain_verdict(p, "203.0.113.5", 80) == "reject"
    for closed in ("10.88.0.5", "10.1.2.3", "172.16.0.1", "192.168.1.1", "100.100.100.200", "198.18.0.1"):
        assert chain_verdict(p, closed, 8080) == "reject", closed  # another sandbox's 8080, the LAN's
    p = EgressPolicy.parse({"default": "deny", "allow": ["10.88.0.7:8080", "10.1.2.0/24:443", "10.0.0.0/8:22"]})
    assert chain_verdict(p, "10.88.0.7", 8080) == "accept"  # as specific as the pool: that sandbox
    assert chain_verdict(p, "10.88.0.8", 8080) == "reject"
    assert chain_verdict(p, "10.1.2.9", 443) == "accept"  # names a part of 10/8: opens it
    assert chain_verdict(p, "10.1.3.9", 443) == "reject"
    assert chain_verdict(p, "10.200.0.1", 22) == "accept"  # 10/8 itself names 10/8 ...
    assert chain_verdict(p, "10.88.0.7", 22) == "reject"  # ... but not the pool inside it


def test_default_allow_closes_private_ranges_unless_named() -> None:
    p = EgressPolicy.parse(None)
    for addr in ("10.1.2.3", "172.31.255.255", "192.168.0.1", "100.64.0.1", "100.100.100.200", "198.19.0.1"):
        assert chain_verdict(p, addr, 443) == "reject", addr
    for addr in ("203.0.113.5", "198.51.100.1", "8.8.8.8", "100.128.0.1", "172.32.0.1", "198.20.0.1"):
        assert chain_verdict(p, addr, 443) == "accept", addr
    p = EgressPolicy.parse({"allow": ["0.0.0.0/0", "0.0.0.0/1", "128.0.0.0/1"]})
    assert chain_verdict(p, "10.1.2.3", 443) == chain_verdict(p, "192.168.0.1", 443) == "reject"
    p = EgressPolicy.parse({"allow": ["10.1.2.0/24", "192.168.0.0/16", "100.100.100.200"], "deny": ["192.168.7.0/24"]})
    assert chain_verdict(p, "10.1.2.3", 443) == "accept"
    assert chain_verdict(p, "10.1.3.3", 443) == "reject"
    assert chain_verdict(p, "192.168.1.1", 443) == "accept"
    assert chain_verdict(p, "192.168.7.1", 443) == "reject"
    assert chain_verdict(p, "100.100.100.200", 80) == "accept"
    assert chain_verdict(p, "10.88.0.3", 443) == "reject"  # the pool: still closed


entries = st.builds(
    lambda a, p, port: f"{IPv4Network((a, p), strict=False)}" + (f":{port}" if port else ""),
    st.sampled_from([0x0A000000, 0x0A580000, 0x0A580007, 0xAC100000, 0xC0A80000, 0x64646464, 0xCB007105]),
    st.integers(0, 32),
    st.one_of(st.none(), st.sampled_from([80, 443])),
)


@given(
    st.lists(entries, max_size=5),
    st.lists(entries, max_size=3),
    st.sampled_from(["allow", "deny"]),
    st.sampled_from(["10.1.2.3", "10.88.0.7", "10.88.1.1", "172.16.5.5", "192.168.0.9", "100.100.100.200"]),
    st.sampled_from([80, 443, 22]),
)
@settings(max_examples=400)
def test_a_closed_address_opens_only_to_an_allow_at_least_as_specific(
    allow: list[str], deny: list[str], default: str, addr: str, port: int
) -> None:
    try:
        p = EgressPolicy.parse({"default": default, "allow": allow, "deny": deny})
    except PolicyError:
        return  # 0.0.0.0/8 and the like: never entries
    a = IPv4Address(addr)
    innermost = max((c for c in CLOSED if a in c), key=lambda c: c.prefixlen)
    may = any(
        e.net is not None
        and a in e.net
        and e.net.subnet_of(innermost)
        and (e.ports is None or e.ports[0] <= port <= e.ports[1])
        for e in p.allow
    )
    if chain_verdict(p, addr, port) == "accept":
        assert may


def test_clip_and_may_open() -> None:
    ten = IPv4Network("10.0.0.0/8")
    assert clip(ten, CLOSED) == [
        (IPv4Address("10.0.0.0"), IPv4Address("10.87.255.255")),
        (IPv4Address("10.89.0.0"), IPv4Address("10.255.255.255")),
    ]
    assert clip(IPv4Network("10.1.0.0/16"), CLOSED) == [(IPv4Address("10.1.0.0"), IPv4Address("10.1.255.255"))]
    assert clip(IPv4Network("192.168.0.0/16"), CLOSED) == [(IPv4Address("192.168.0.0"), IPv4Address("192.168.255.255"))]
    assert IPv4Address("10.0.0.0") not in [r[0] for r in clip(IPv4Network("0.0.0.0/0"), CLOSED)]
    for addr in (
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.100.100.200",
        "198.18.0.1",
        "169.254.169.254",
        "127.0.0.1",
    ):
        assert not may_open(IPv4Address(addr)), addr  # DNS rebinding: a name opens no private address
    assert not may_open(IPv4Address("203.0.113.9"), [IPv4Network("203.0.113.0/24")])  # --egress-never
    assert may_open(IPv4Address("203.0.113.9")) and may_open(IPv4Address("8.8.8.8"))


# -- DNS codec ---------------------------------------------------------------------
def test_dns_roundtrip_and_cname_chain() -> None:
    q = dnsmsg.query("www.Example.com", dnsmsg.A, mid=77)
    mid, flags, question = dnsmsg.parse_query(q)
    assert (mid, question) == (77, dnsmsg.Question("www.example.com", dnsmsg.A)) and flags & dnsmsg.RD
    ans = dnsmsg.Message(
        77,
        dnsmsg.QR | dnsmsg.RD | dnsmsg.RA,
        (question,),
        (
            dnsmsg.Record("www.example.com", dnsmsg.CNAME, dnsmsg.IN, 300, b"", target="cdn.example.net"),
            dnsmsg.address_record("cdn.example.net", IPv4Address("203.0.113.5"), 60),
            dnsmsg.address_record("unrelated.org", IPv4Address("203.0.113.66"), 60),
        ),
    )
    parsed = dnsmsg.parse(dnsmsg.build(ans))
    assert parsed.answers[0].target == "cdn.example.net"
    assert dnsmsg.answered_addresses(parsed, "www.example.com") == [(IPv4Address("203.0.113.5"), 60)]
    err = dnsmsg.parse(dnsmsg.error_response(q, dnsmsg.REFUSED))
    assert err.id == 77 and err.rcode == dnsmsg.REFUSED and err.questions == (question,) and err.is_response


def test_dns_compression_pointers_are_bounded() -> None:
    loop = struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0) + b"\xc0\x0c" + b"\x00\x01\x00\x01"
    with pytest.raises(dnsmsg.DnsError):
        dnsmsg.parse(loop)
    # a pointer to a valid name earlier in the message
    msg = dnsmsg.build(dnsmsg.Message(1, 0, (dnsmsg.Question("a.b", dnsmsg.A),)))
    compressed = msg + b"\xc0\x0c" + struct.pack("!HHIH", dnsmsg.A, dnsmsg.IN, 5, 4) + b"\x01\x02\x03\x04"
    compressed = struct.pack("!HHHHHH", 1, dnsmsg.QR, 1, 1, 0, 0) + compressed[12:]
    parsed = dnsmsg.parse(compressed)
    assert parsed.answers[0].name == "a.b" and parsed.answers[0].address == IPv4Address("1.2.3.4")


@given(st.binary(max_size=600))
@settings(max_examples=2000)
def test_dns_parser_never_fails_but_typed(data: bytes) -> None:
    for fn in (dnsmsg.parse, dnsmsg.parse_query):
        try:
            fn(data)
        except dnsmsg.DnsError:
            pass
    try:
        dnsmsg.error_response(data, dnsmsg.REFUSED)
    except dnsmsg.DnsError:
        assert len(data) < 12


labels = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)
names = st.lists(labels, min_size=1, max_size=5).map(".".join)


@given(
    st.integers(0, 0xFFFF),
    names,
    st.lists(st.tuples(names, st.integers(0, 2**31 - 1), st.binary(min_size=4, max_size=4)), max_size=8),
)
def test_dns_build_parse_roundtrip(mid: int, qname: str, records: list[tuple[str, int, bytes]]) -> None:
    msg = dnsmsg.Message(
        mid,
        dnsmsg.QR,
        (dnsmsg.Question(qname, dnsmsg.A),),
        tuple(dnsmsg.Record(n, dnsmsg.A, dnsmsg.IN, ttl, raw) for n, ttl, raw in records),
    )
    assert dnsmsg.parse(dnsmsg.build(msg)) == msg


@given(st.binary(min_size=12, max_size=200), st.integers(0, 199), st.integers(0, 255))
def test_dns_mutated_answers_fail_typed(seed: bytes, at: int, value: int) -> None:
    base = bytearray(dnsmsg.build(dnsmsg.Message(1, dnsmsg.QR, (dnsmsg.Question("x.example", dnsmsg.A),))) + seed)
    base[at % len(base)] = value
    try:
        dnsmsg.parse(bytes(base))
    except dnsmsg.DnsError:
        pass


# -- the one-supervisor-per-namespace lock --------------------------------------------
def test_tap_lock_is_a_file_lock_in_a_private_directory(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    fd, path = lock_netns(NetNS(), locks)
    assert stat.S_IMODE(locks.stat().st_mode) == 0o700 and path.parent == locks
    with pytest.raises(NetError, match="another supervisor runs tap networking"):
        lock_netns(NetNS(), locks)  # a second supervisor (flock: per open file, so here too)
    unlock_netns(fd, path)
    assert not path.exists()
    fd, path = lock_netns(NetNS(), locks)  # free again
    unlock_netns(fd, path)
    locks.chmod(0o755)
    unlock_netns(*lock_netns(NetNS(), locks))
    assert stat.S_IMODE(locks.stat().st_mode) == 0o700  # ours: closed again
    link = tmp_path / "link"
    link.symlink_to(locks)
    with pytest.raises(NetError, match="not a directory"):
        lock_netns(NetNS(), link)
    if os.geteuid() == 0:
        os.chown(locks, 65534, 65534)  # made first by someone else
        with pytest.raises(NetError, match="someone else made it"):
            lock_netns(NetNS(), locks)


def test_tap_lock_holds_the_file_that_is_there(tmp_path: Path) -> None:
    """A taker that opened the file just before its holder unlinked it does not keep a
    lock on the unlinked file (two holders): it locks the path's file."""
    locks = tmp_path / "locks"
    fd, path = lock_netns(NetNS(), locks)
    stale = os.open(path, os.O_RDWR)  # a taker's open, before the holder lets go
    unlock_netns(fd, path)
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it got the unlinked file's lock ...
    try:
        fd, path = lock_netns(NetNS(), locks)  # ... which is no lock: the path's file is free
        unlock_netns(fd, path)
    finally:
        os.close(stale)
