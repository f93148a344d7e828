"""The SDK's network settings of a sandbox (part of its spec): its mode, egress
policy, exposed ports (by sandbox port, or bound to a host address) and the guest's
DNS settings, with their parsers and what they are on the wire. No I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from supervisor.wire import protocol
from supervisor.wire.protocol import PortMapping


def _strs(v: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(v or ())


PortKey = int | str  # a sandbox port: 8080 (TCP), or "53/udp", "8080/tcp"


def _port_key(k: PortKey) -> PortKey:
    """TCP ports as ints, UDP ones as "N/udp" (so one map holds both)."""
    if isinstance(k, int):
        return k
    number, _, proto = str(k).partition("/")
    if proto not in ("", "tcp", "udp") or not number.strip().isdigit():
        raise ValueError(f"port {k!r}: a number, or NUMBER/tcp or NUMBER/udp")
    return f"{int(number)}/udp" if proto == "udp" else int(number)


def _ports(d: Mapping[PortKey, int] | None) -> dict[PortKey, int]:
    return {_port_key(k): int(v) for k, v in (d or {}).items()}


def _split_key(k: PortKey) -> tuple[int, str]:
    return (k, "tcp") if isinstance(k, int) else (int(k.partition("/")[0]), "udp")


@attrs.frozen(kw_only=True)
class Egress:
    """Where the sandbox may connect to (tap, and user mode with ``outbound``): entries
    are CIDRs, addresses, ``host:port`` (port ranges ``lo-hi``) and domain names
    (``example.com``, ``*.example.com``, optionally ``:port``); ``default`` is what no
    entry matches. The host, other sandboxes' exposed ports and 169.254.0.0/16 are
    never reachable, whatever the policy (docs/network.md)."""

    default: Literal["allow", "deny"] = "allow"
    allow: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    deny: tuple[str, ...] = attrs.field(default=(), converter=tuple)


def _to_egress(v: Egress | Mapping[str, Any] | None) -> Egress | None:
    """An Egress, or the same as a dict (``{"default": "deny", "allow": [...]}``)."""
    if v is None or isinstance(v, Egress):
        return v
    return Egress(default=v.get("default", "allow"), allow=v.get("allow", ()), deny=v.get("deny", ()))


@attrs.frozen(kw_only=True)
class PortBinding:
    """A port exposed at create on an explicit host address (``WithPortBindings``):
    ``address`` "" is the sandbox's ``port_address`` or the supervisor's default;
    others must be loopback or listed by ``serve --port-address`` (PermissionDenied)."""

    guest: int
    host: int = 0
    protocol: Literal["tcp", "udp"] = "tcp"
    address: str = ""

    @classmethod
    def parse(cls, text: str) -> PortBinding:
        """``[ADDRESS:]HOST:GUEST[/udp]`` or ``GUEST[/udp]``, as the CLI's ``--port``."""
        body, _, proto = text.partition("/")
        if proto not in ("", "tcp", "udp"):
            raise ValueError(f"port {text!r}: the protocol is tcp or udp")
        parts = body.rsplit(":", 2)
        if not all(p.isdigit() for p in parts[-2:]) or (len(parts) == 3 and not parts[0]):
            raise ValueError(f"port {text!r}: [ADDRESS:]HOST:GUEST[/udp] or GUEST[/udp]")
        guest, host = int(parts[-1]), int(parts[-2]) if len(parts) > 1 else 0
        return cls(
            guest=guest,
            host=host,
            protocol="udp" if proto == "udp" else "tcp",
            address=parts[0] if len(parts) == 3 else "",
        )

    def mapping(self) -> PortMapping:
        return PortMapping(self.guest, self.host, self.protocol, self.address)


def _bindings(v: Sequence[PortBinding | str] | None) -> tuple[PortBinding, ...]:
    return tuple(b if isinstance(b, PortBinding) else PortBinding.parse(b) for b in v or ())


@attrs.frozen(kw_only=True)
class Dns:
    """The guest's resolv.conf: ``nameservers`` (IPv4; none: the supervisor's DNS
    proxy's address) and ``search`` domains. Every DNS query the guest sends, to any
    address, is answered by the supervisor's DNS proxy under the sandbox's egress
    policy: a nameserver here is a name for the proxy, not a way around it."""

    nameservers: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    search: tuple[str, ...] = attrs.field(default=(), converter=_strs)


def _to_dns(v: Dns | Mapping[str, Any] | None) -> Dns | None:
    if v is None or isinstance(v, Dns):
        return v
    return Dns(nameservers=v.get("nameservers", ()), search=v.get("search", ()))


@attrs.frozen(kw_only=True)
class Network:
    """``mode``: "none" (no network device), "tap" (an address of the supervisor's IP
    pool; root supervisors), "user" (QEMU user networking: exposed ports only, unless
    ``outbound``) or "outbound" (user mode that may reach out, as ``outbound=True``).
    ``egress``: where it may connect to (None: anywhere but the host). ``ports``:
    sandbox port -> host port (host port 0: any free port); keys are TCP port numbers or
    "N/udp" for UDP. ``port_bindings``: ports on explicit host addresses;
    ``port_address``: the host address every port listens on ("": the supervisor's,
    loopback by default). ``profile``: a named network profile ("public", "private",
    "none", or the operator's), expanded to the egress policy at create (no egress then).
    ``dns``: the guest's resolv.conf."""

    mode: Literal["none", "tap", "user", "outbound"] = "none"
    outbound: bool = False
    egress: Egress | None = attrs.field(default=None, converter=_to_egress)
    ports: dict[PortKey, int] = attrs.field(factory=dict, converter=_ports)
    port_bindings: tuple[PortBinding, ...] = attrs.field(default=(), converter=_bindings)
    port_address: str = ""
    profile: str = ""
    dns: Dns | None = attrs.field(default=None, converter=_to_dns)

    def port_mappings(self) -> list[protocol.PortMapping]:
        out = [protocol.PortMapping(g, h, p) for g, p, h in ((*_split_key(k), h) for k, h in self.ports.items())]
        return out + [b.mapping() for b in self.port_bindings]

    def spec(self) -> protocol.NetworkSpec:
        mode, outbound = ("user", True) if self.mode == "outbound" else (self.mode, self.outbound)
        eg = self.egress
        egress = None if eg is None else protocol.EgressSpec(eg.default, list(eg.allow), list(eg.deny))
        return protocol.NetworkSpec(mode=mode, outbound=outbound, egress=egress)


def _dns_spec(d: Dns | None) -> protocol.DnsSpec | None:
    return None if d is None else protocol.DnsSpec(list(d.nameservers), list(d.search))


def egress_spec(v: Egress | Mapping[str, Any] | None) -> protocol.EgressSpec | None:
    """A Modify's egress policy on the wire (None: unchanged)."""
    eg = _to_egress(v)
    return None if eg is None else protocol.EgressSpec(eg.default, list(eg.allow), list(eg.deny))
