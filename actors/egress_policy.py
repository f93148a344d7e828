"""A sandbox's egress policy as a value: its grammar, parsed and checked (no I/O, no nftables).

``network.egress = {"default": "allow"|"deny", "allow": [...], "deny": [...]}``;
an entry is a CIDR or address (``10.0.0.0/8``, ``1.2.3.4``), the same with ports
(``1.2.3.4:443``, ``10.0.0.0/8:8000-8100``: TCP and UDP), or a domain name
(``example.com`` is that name, ``*.example.com`` its subdomains, either with an
optional ``:port``). The precedence of entries and the nftables rules that enforce a
policy are actors/net/egress.py's; the model checks a Create's policy with this module
alone, so the values of the domain need nothing of the host's network.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from ipaddress import IPv4Network
from typing import Any

import attrs

NEVER4 = ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")
# closed unless an allow entry names them (at least as specific): the networks a host's
# neighbours live on -- RFC 1918, RFC 6598 shared space (CGNAT, cloud metadata and
# services such as 100.100.100.200, Tailscale), RFC 2544 benchmarking space (used as
# internal space by some networks and proxies' fake-IP modes; nothing public is there).
# The documentation ranges (192.0.2/24, 198.51.100/24, 203.0.113/24) stay open: nothing
# lives there either way, and the tests' stand-in internet does.
PRIVATE4 = ("10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16", "198.18.0.0/15")
MAX_ENTRIES = 256
_DOMAIN_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


class PolicyError(ValueError):
    """An egress policy that cannot be applied (INVALID_ARGUMENT)."""


@attrs.frozen
class Entry:
    """One allow or deny entry. Exactly one of ``net`` and ``domain`` is set."""

    text: str
    net: IPv4Network | None = None
    domain: str | None = None  # "example.com" or "*.example.com", lower case, no trailing dot
    ports: tuple[int, int] | None = None  # inclusive range; None: every port (and ICMP)

    @property
    def wildcard(self) -> bool:
        return self.domain is not None and self.domain.startswith("*.")

    def matches_name(self, name: str) -> bool:
        if self.domain is None:
            return False
        if self.wildcard:
            return name.endswith(self.domain[1:])
        return name == self.domain

    @property
    def specificity(self) -> tuple[int, int]:
        """Domain entries: an exact name beats any wildcard; a longer suffix beats a shorter."""
        assert self.domain is not None
        return (0 if self.wildcard else 1, len(self.domain))


def _ports(text: str, entry: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise PolicyError(f"egress entry {entry!r}: bad port {text!r}") from None
    if not (1 <= a <= b <= 65535):
        raise PolicyError(f"egress entry {entry!r}: ports must be 1-65535, low to high")
    return a, b


def parse_entry(raw: object) -> Entry:
    if not isinstance(raw, str) or not raw.strip():
        raise PolicyError(f"egress entry {raw!r}: expected a CIDR, an address, host:port or a domain name")
    text = raw.strip().lower()
    if len(text) > 300:
        raise PolicyError(f"egress entry {text[:40]!r}...: too long")
    if text.startswith("[") or text.count(":") > 1:
        raise PolicyError(f"egress entry {text!r}: IPv6 is not supported (sandboxes have no IPv6)")
    host, sep, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    ports = _ports(port_text, text) if sep else None
    try:
        net = ipaddress.ip_network(host, strict=False)
    except ValueError:
        net = None
    if net is not None:
        if not isinstance(net, IPv4Network):
            raise PolicyError(f"egress entry {text!r}: IPv6 is not supported (sandboxes have no IPv6)")
        if any(net.subnet_of(IPv4Network(n)) for n in NEVER4):
            raise PolicyError(
                f"egress entry {text!r}: loopback, link-local (metadata), multicast and reserved "
                "addresses are never reachable from a sandbox"
            )
        return Entry(text, net=net, ports=ports)
    if re.fullmatch(r"[0-9./]+", host):
        raise PolicyError(f"egress entry {text!r}: not a valid address or CIDR")
    name = host.rstrip(".")
    labels = name.split(".")
    wildcard = labels[0] == "*"
    if wildcard:
        labels = labels[1:]
    if len(name) > 253 or len(labels) < 1 or not all(_DOMAIN_LABEL.match(x) for x in labels):
        raise PolicyError(f"egress entry {text!r}: not a valid domain name (use *.example.com for subdomains)")
    if wildcard and len(labels) < 2:
        raise PolicyError(f"egress entry {text!r}: a wildcard needs a domain under it (*.example.com)")
    return Entry(text, domain=("*." if wildcard else "") + ".".join(labels), ports=ports)


@attrs.frozen
class EgressPolicy:
    default: str = "allow"  # "allow" | "deny"
    allow: tuple[Entry, ...] = ()
    deny: tuple[Entry, ...] = ()

    @classmethod
    def parse(cls, body: Mapping[str, Any] | None) -> EgressPolicy:
        """From the API's ``network.egress`` (None or {}: allow everything but the invariants)."""
        if body is None:
            return cls()
        if not isinstance(body, Mapping):
            raise PolicyError("network.egress must be a mapping {default, allow, deny}")
        unknown = set(body) - {"default", "allow", "deny"}
        if unknown:
            raise PolicyError(f"network.egress: unknown fields {sorted(unknown)}")
        default = body.get("default") or "allow"
        if default not in ("allow", "deny"):
            raise PolicyError(f"network.egress.default must be 'allow' or 'deny', not {default!r}")
        lists: dict[str, tuple[Entry, ...]] = {}
        for key in ("allow", "deny"):
            raw = body.get(key) or []
            if not isinstance(raw, list | tuple):
                raise PolicyError(f"network.egress.{key} must be a list")
            if len(raw) > MAX_ENTRIES:
                raise PolicyError(f"network.egress.{key}: at most {MAX_ENTRIES} entries")
            entries = tuple(parse_entry(x) for x in raw)
            lists[key] = tuple(dict.fromkeys(entries))  # duplicates: once
        for e in lists["deny"]:
            if e.domain is not None and e.ports is not None:
                raise PolicyError(f"egress deny entry {e.text!r}: a denied name is refused whole (no port)")
        return cls(default=default, allow=lists["allow"], deny=lists["deny"])

    def to_dict(self) -> dict[str, Any]:
        return {"default": self.default, "allow": [e.text for e in self.allow], "deny": [e.text for e in self.deny]}

    @property
    def domains(self) -> bool:
        return any(e.domain is not None for e in (*self.allow, *self.deny))

    def match_name(self, name: str) -> tuple[str, tuple[tuple[int, int] | None, ...]]:
        """The DNS proxy's decision for a queried name: ``("allow", port ranges)``,
        ``("deny", ())`` or ``("default", ())``. Port range None: every port. The most
        specific matching entry decides; on a tie deny wins."""
        name = name.lower().rstrip(".")
        allows = [e for e in self.allow if e.matches_name(name)]
        denies = [e for e in self.deny if e.matches_name(name)]
        if not allows and not denies:
            return ("default", ())
        best_allow = max((e.specificity for e in allows), default=None)
        best_deny = max((e.specificity for e in denies), default=None)
        if best_deny is not None and (best_allow is None or best_deny >= best_allow):
            return ("deny", ())
        ranges = tuple(dict.fromkeys(e.ports for e in allows if e.specificity == best_allow))
        return ("allow", (None,) if None in ranges else ranges)
