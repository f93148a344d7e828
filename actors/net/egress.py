"""The nftables rules that enforce a sandbox's egress policy (I/O-free).

The policy itself (its grammar, parsed and checked) is actors/egress_policy.py's
``EgressPolicy``, re-exported here with ``PolicyError``. Domains work through the supervisor's DNS proxy (the
sandbox's resolver, see actors/net/dnsproxy.py): an allowed name resolves and its
addresses are opened in the filter for the answer's TTL; a denied one is refused.

Precedence, whatever the entries say (the order of the sandbox's chain)::

    1. never: 0/8, 127/8, 169.254/16 (metadata), 224/4, 240/4, IPv6, the operator's
       extra ranges; and the host itself (every local address: the input hook)
    2. ports: deny entries with ports, then allow entries with ports -- each allow
       clipped first: it opens no part of a closed range (below) it is less specific than
    3. addresses: the most specific CIDR wins; on a tie deny beats allow. The closed
       ranges are implicit denies at their own prefix length: the sandbox pool (other
       sandboxes) and PRIVATE4 (RFC 1918, 100.64/10 shared/CGNAT space -- cloud
       metadata such as 100.100.100.200 lives there -- and 198.18/15), so only an allow
       entry at least as specific as the range opens (that part of) it: ``10.1.2.0/24``
       opens that /24, ``default: allow`` and ``allow: [0.0.0.0/0]`` or
       ``0.0.0.0/0:443`` open none of them
    4. domains: addresses answered for a denied name, then for allowed names; an
       answer in a never or closed range is never opened (:func:`may_open`)
    5. the default

Table layout (one per supervisor, replaced atomically at start; a sandbox adds its
chain and sets, keyed by its link name, in one transaction and removes them in one)::

    table inet sandvisor
     prerouting (raw)  iif svn*: drop IPv6; drop unless (iif . saddr) in @links4
     input             iif svn*: established | gateway:53 tcp+udp | ping gateway | reject
     forward           iif svn*: established | never -> reject | iif vmap @egress -> sb_<link>
                       oif svn*: established | drop   (nothing new from outside into a sandbox)
     postrouting (nat) saddr pool, daddr not pool, oif not svn*: masquerade
     sb_<link>         steps 2-5 above, sets <link>_allow, _deny (painted CIDRs),
                       _dns, _dnsdeny, _dns_<lo>_<hi> (timeouts: filled by the DNS proxy)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from ipaddress import IPv4Address, IPv4Network

from actors.egress_policy import NEVER4, PRIVATE4, EgressPolicy, PolicyError

__all__ = [  # and the policy these rules enforce, with its error and ranges (actors/egress_policy.py)
    "LINK_GLOB",
    "NEVER4",
    "PRIVATE4",
    "REJECT",
    "SECRET_MARK",
    "SECRET_MARK_MASK",
    "TABLE",
    "EgressPolicy",
    "PolicyError",
    "Range",
    "base_ruleset",
    "clip",
    "closed_ranges",
    "dns_deny_set",
    "dns_set_name",
    "dns_update",
    "may_open",
    "paint",
    "range_text",
    "sandbox_removal",
    "sandbox_rules",
    "secret_mark",
    "secret_removal",
    "secret_rules",
]

TABLE = "sandvisor"
LINK_GLOB = "svn*"  # actors.net.ippool.LINK_PREFIX + "*"
REJECT = "reject with icmpx type admin-prohibited"
# the secret proxy's upstream sockets (actors/secrets/secretproxy.py): SECRET_MARK | the
# sandbox's address's offset in the IP pool (24 bits: a /8, the largest pool, fits, so no
# two leased addresses share a mark); the output hook sends them through its egress chain
SECRET_MARK = 0x53000000
SECRET_MARK_MASK = 0xFF000000


# -- painting CIDRs -----------------------------------------------------------------
Range = tuple[IPv4Address, IPv4Address]


def range_text(r: Range) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


def closed_ranges(pool: IPv4Network | None) -> list[IPv4Network]:
    """The implicit denies of a sandbox's policy: PRIVATE4 and the sandbox pool."""
    return [IPv4Network(n) for n in PRIVATE4] + ([pool] if pool is not None else [])


def paint(
    allow: Iterable[IPv4Network],
    deny: Iterable[IPv4Network],
    pool: IPv4Network | None,
    closed: Iterable[IPv4Network] = (),
) -> tuple[list[Range], list[Range]]:
    """Disjoint (allowed, denied) address ranges (first, last) where the most specific entry decides.
    ``pool`` and ``closed`` are implicit denies at their own prefix length. CIDR blocks
    nest or are disjoint, so painting from the least to the most specific (ties:
    implicit denies, then allow, then deny: the later paint wins) leaves each address
    with the verdict of its most specific entry."""
    items: list[tuple[int, int, IPv4Network, str]] = []
    for c in (*closed, *([pool] if pool is not None else [])):
        items.append((c.prefixlen, 0, c, "deny"))
    items += [(n.prefixlen, 1, n, "allow") for n in allow]
    items += [(n.prefixlen, 2, n, "deny") for n in deny]
    if not items:
        return [], []
    bounds = sorted(
        {0, 1 << 32, *(int(n.network_address) for _, _, n, _ in items)}
        | {int(n.broadcast_address) + 1 for _, _, n, _ in items}
    )
    verdict: list[str | None] = [None] * (len(bounds) - 1)
    for _, _, net, v in sorted(items, key=lambda x: (x[0], x[1])):
        i = bisect.bisect_left(bounds, int(net.network_address))
        j = bisect.bisect_left(bounds, int(net.broadcast_address) + 1)
        for k in range(i, j):
            verdict[k] = v
    out: dict[str, list[Range]] = {"allow": [], "deny": []}
    k = 0
    while k < len(verdict):
        here = verdict[k]
        m = k
        while m + 1 < len(verdict) and verdict[m + 1] == here:
            m += 1
        if here is not None:
            out[here].append((IPv4Address(bounds[k]), IPv4Address(bounds[m + 1] - 1)))
        k = m + 1
    return out["allow"], out["deny"]


def clip(net: IPv4Network, closed: Iterable[IPv4Network]) -> list[Range]:
    """``net`` less every closed range it is less specific than: what a port-qualified
    allow entry opens (``0.0.0.0/0:443`` is not a way into the pool or a private range;
    ``10.1.2.0/24:443`` opens that /24, being at least as specific as 10/8)."""
    holes = sorted(
        (int(c.network_address), int(c.broadcast_address))
        for c in closed
        if c != net and c.subnet_of(net)  # CIDRs nest or are disjoint
    )
    out: list[Range] = []
    at, last = int(net.network_address), int(net.broadcast_address)
    for lo, hi in holes:
        if lo > at:
            out.append((IPv4Address(at), IPv4Address(lo - 1)))
        at = max(at, hi + 1)
    if at <= last:
        out.append((IPv4Address(at), IPv4Address(last)))
    return out


def may_open(address: IPv4Address, closed: Iterable[IPv4Network] = ()) -> bool:
    """May the DNS proxy open ``address`` (an answer for an allowed name)? Never an
    invariant (NEVER4), private (PRIVATE4) or ``closed`` (the pool, the operator's never
    ranges) address: a name is no way around the CIDR rules (DNS rebinding). A private
    address a policy's CIDR allow names is open through that entry anyway."""
    nets = (*(IPv4Network(n) for n in (*NEVER4, *PRIVATE4)), *closed)
    return not any(address in n for n in nets)


# -- nftables text ------------------------------------------------------------------
def _elements(nets: Sequence[IPv4Network | IPv4Address | str]) -> str:
    return ", ".join(str(n) for n in nets)


def base_ruleset(gateway: IPv4Address, pool: IPv4Network, *, never: Sequence[str] = (), dns_port: int = 53) -> str:
    """The supervisor's table, replaced whole (a crashed run's sandbox chains go too).
    ``never``: the operator's ranges no sandbox reaches under any policy (e.g. the LAN)."""
    never4 = _elements([*NEVER4, *never])
    return f"""
table inet {TABLE}
delete table inet {TABLE}
table inet {TABLE} {{
  set links4 {{ type ifname . ipv4_addr; }}
  map egress {{ type ifname : verdict; }}
  set never4 {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {never4} }}; }}
  map secret_dnat {{ type ifname . inet_service : ipv4_addr . inet_service; }}
  set secret_proxy {{ type ifname . inet_service; }}
  set secret_links {{ type ifname; }}
  map secret_marks {{ type mark : verdict; }}
  chain hook_prerouting {{
    type filter hook prerouting priority raw; policy accept;
    iifname "{LINK_GLOB}" jump sandbox_spoof
  }}
  chain sandbox_spoof {{
    meta nfproto ipv6 drop
    iifname . ip saddr @links4 return
    drop
  }}
  chain hook_input {{
    type filter hook input priority filter; policy accept;
    iifname "{LINK_GLOB}" jump sandbox_to_host
  }}
  chain sandbox_to_host {{
    ct state established,related accept
    ct state invalid drop
    ip daddr {gateway} meta l4proto {{ tcp, udp }} th dport {dns_port} accept
    ip daddr {gateway} icmp type echo-request limit rate 20/second accept
    ip daddr {gateway} iifname . tcp dport @secret_proxy accept
    {REJECT}
  }}
  chain hook_nat_prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{LINK_GLOB}" meta nfproto ipv4 meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {gateway}:{dns_port}
    iifname "{LINK_GLOB}" meta nfproto ipv4 dnat ip to iifname . tcp dport map @secret_dnat
  }}
  chain hook_output {{
    type filter hook output priority filter; policy accept;
    meta mark & {SECRET_MARK_MASK:#x} == {SECRET_MARK:#x} jump secret_egress
  }}
  chain secret_egress {{
    ct state established,related accept
    fib daddr type local {REJECT}
    ip daddr @never4 {REJECT}
    meta mark vmap @secret_marks
    {REJECT}
  }}
  chain hook_forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{LINK_GLOB}" jump sandbox_egress
    oifname "{LINK_GLOB}" jump sandbox_ingress
  }}
  chain sandbox_egress {{
    ct state established,related accept
    ct state invalid drop
    ip daddr @never4 {REJECT}
    iifname @secret_links udp dport 443 {REJECT}
    iifname vmap @egress
    {REJECT}
  }}
  chain sandbox_ingress {{
    ct state established,related accept
    drop
  }}
  chain hook_postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {pool} ip daddr != {pool} oifname != "{LINK_GLOB}" masquerade
  }}
}}
"""


def _dns_sets(link: str, policy: EgressPolicy) -> dict[tuple[int, int] | None, str]:
    """The DNS proxy's sets of a sandbox, by port range (None: every port)."""
    sets: dict[tuple[int, int] | None, str] = {}
    for e in policy.allow:
        if e.domain is not None and e.ports not in sets:
            sets[e.ports] = f"{link}_dns" if e.ports is None else f"{link}_dns_{e.ports[0]}_{e.ports[1]}"
    return sets


def dns_set_name(link: str, ports: tuple[int, int] | None) -> str:
    return f"{link}_dns" if ports is None else f"{link}_dns_{ports[0]}_{ports[1]}"


def dns_deny_set(link: str) -> str:
    return f"{link}_dnsdeny"


def _port_match(ports: tuple[int, int]) -> str:
    lo, hi = ports
    return f"meta l4proto {{ tcp, udp }} th dport {lo if lo == hi else f'{lo}-{hi}'}"


def sandbox_rules(link: str, address: IPv4Address, policy: EgressPolicy, pool: IPv4Network | None) -> list[str]:
    """nft commands that add a sandbox's chain, sets and map entries (one transaction)."""
    t = f"inet {TABLE}"
    chain = f"sb_{link}"
    closed = closed_ranges(pool)
    allow_nets, deny_nets = paint(
        [e.net for e in policy.allow if e.net is not None and e.ports is None],
        [e.net for e in policy.deny if e.net is not None and e.ports is None],
        None,
        closed,
    )
    cmds = [
        f"add chain {t} {chain}",
        f"add set {t} {link}_allow {{ type ipv4_addr; flags interval; }}",
        f"add set {t} {link}_deny {{ type ipv4_addr; flags interval; }}",
        f"add set {t} {dns_deny_set(link)} {{ type ipv4_addr; flags timeout; }}",
    ]
    dns = _dns_sets(link, policy)
    cmds += [f"add set {t} {name} {{ type ipv4_addr; flags timeout; }}" for name in dns.values()]
    if allow_nets:
        cmds.append(f"add element {t} {link}_allow {{ {', '.join(map(range_text, allow_nets))} }}")
    if deny_nets:
        cmds.append(f"add element {t} {link}_deny {{ {', '.join(map(range_text, deny_nets))} }}")
    rule = f"add rule {t} {chain}"
    for e in policy.deny:
        if e.net is not None and e.ports is not None:
            cmds.append(f"{rule} ip daddr {e.net} {_port_match(e.ports)} {REJECT}")
    for e in policy.allow:
        if e.net is not None and e.ports is not None:
            ranges = clip(e.net, closed)  # the implicit denies come before every allow
            if ranges == [(e.net.network_address, e.net.broadcast_address)]:
                cmds.append(f"{rule} ip daddr {e.net} {_port_match(e.ports)} accept")
            elif ranges:
                daddr = "{ " + ", ".join(map(range_text, ranges)) + " }"
                cmds.append(f"{rule} ip daddr {daddr} {_port_match(e.ports)} accept")
    cmds += [
        f"{rule} ip daddr @{link}_deny {REJECT}",
        f"{rule} ip daddr @{link}_allow accept",
        f"{rule} ip daddr @{dns_deny_set(link)} {REJECT}",
    ]
    for ports, name in dns.items():
        cmds.append(f"{rule} {_port_match(ports) + ' ' if ports else ''}ip daddr @{name} accept")
    cmds.append(f"{rule} {'accept' if policy.default == 'allow' else REJECT}")
    cmds += [
        f'add element {t} links4 {{ "{link}" . {address} }}',
        f'add element {t} egress {{ "{link}" : goto {chain} }}',
    ]
    return cmds


def sandbox_removal(link: str, address: IPv4Address, policy: EgressPolicy) -> list[str]:
    """nft commands that remove what :func:`sandbox_rules` added (one transaction)."""
    t = f"inet {TABLE}"
    cmds = [
        f'delete element {t} egress {{ "{link}" }}',
        f'delete element {t} links4 {{ "{link}" . {address} }}',
        f"flush chain {t} sb_{link}",
        f"delete chain {t} sb_{link}",
        f"delete set {t} {link}_allow",
        f"delete set {t} {link}_deny",
        f"delete set {t} {dns_deny_set(link)}",
    ]
    cmds += [f"delete set {t} {name}" for name in _dns_sets(link, policy).values()]
    return cmds


def dns_update(link: str, set_names: Iterable[str], addresses: Iterable[IPv4Address], timeout_s: int) -> list[str]:
    """Open (or refresh) answered addresses in a sandbox's DNS sets for ``timeout_s``.
    add; delete; add in one transaction: the element ends with the new timeout on every
    kernel (re-adding alone refreshes it only from Linux 6.10 on), and no packet sees
    it missing."""
    t = f"inet {TABLE}"
    cmds = []
    addrs = list(dict.fromkeys(addresses))
    if not addrs:
        return []
    for name in set_names:
        elems = ", ".join(f"{a} timeout {timeout_s}s" for a in addrs)
        cmds += [
            f"add element {t} {name} {{ {elems} }}",
            f"delete element {t} {name} {{ {_elements(addrs)} }}",
            f"add element {t} {name} {{ {elems} }}",
        ]
    return cmds


# -- the secret proxy (actors/secrets/secretproxy.py) -------------------------------------------
def secret_mark(address: IPv4Address, pool: IPv4Network) -> int:
    """The mark of a sandbox's proxied upstream connections: unique among the pool's
    addresses (its offset in the pool; pools are /8 or smaller: actors/net/ippool.py)."""
    offset = int(address) - int(pool.network_address)
    if address not in pool or offset & SECRET_MARK_MASK:
        raise ValueError(f"{address} has no secret mark in {pool}")
    return SECRET_MARK | offset


def secret_rules(
    link: str, address: IPv4Address, gateway: IPv4Address, proxy_port: int, ports: Iterable[int], pool: IPv4Network
) -> list[str]:
    """A sandbox's TCP to ``ports`` DNAT'ed to its proxy (on the gateway), the proxy's
    port open to it, its QUIC (UDP 443) refused, the proxy's upstream connections
    judged by its own egress chain (one transaction; the chain must exist)."""
    t = f"inet {TABLE}"
    dnat = ", ".join(f'"{link}" . {p} : {gateway} . {proxy_port}' for p in ports)
    return [
        f"add element {t} secret_dnat {{ {dnat} }}",
        f'add element {t} secret_proxy {{ "{link}" . {proxy_port} }}',
        f'add element {t} secret_links {{ "{link}" }}',
        f"add element {t} secret_marks {{ {secret_mark(address, pool):#x} : goto sb_{link} }}",
    ]


def secret_removal(
    link: str, address: IPv4Address, proxy_port: int, ports: Iterable[int], pool: IPv4Network
) -> list[str]:
    t = f"inet {TABLE}"
    keys = ", ".join(f'"{link}" . {p}' for p in ports)
    return [
        f"delete element {t} secret_dnat {{ {keys} }}",
        f'delete element {t} secret_proxy {{ "{link}" . {proxy_port} }}',
        f'delete element {t} secret_links {{ "{link}" }}',
        f"delete element {t} secret_marks {{ {secret_mark(address, pool):#x} }}",
    ]
