"""A sandbox's secret as the domain keeps it: never its value (that is the vault's).

A secret has a name (the guest's environment variable that holds its placeholder),
one source (the sandbox's own value, given at Create: ``value:`` or ``env:``, which the
*client* reads from its own environment and sends as a value; or ``store:NAME``, an
entry of the supervisor's store, read at each use so ``secret set`` rotates it), a
placeholder and the hosts it may be sent to. I/O-free; checked here (INVALID_ARGUMENT).

Hosts: ``api.example.com`` (that name), ``*.example.com`` (its subdomains, not the
name itself), either with ``:port`` (else 443). Names only: the proxy decides by the
TLS server name (SNI), and an address is never one. A wildcard over a public suffix
(``*.com``, ``*.co.uk``, ``*.github.io``: the Public Suffix List, ICANN and private
sections, from the ``publicsuffixlist`` package) is refused: it names hosts of
unrelated owners.

Where a placeholder is replaced: in the request's headers (``substitute="headers"``,
the default), or in its target and body too (``"all"``): an allowed API that stores
what it is sent (a gist, an issue) would hand a value put in a body back to anyone.

A ``store:`` secret's hosts are at most its store entry's (``secret set --hosts``):
:func:`covers` says whether a Create's pattern is within a stored one.
"""

from __future__ import annotations

import functools
import re
import secrets as _random
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from actors.errors import InvalidArgument

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
PLACEHOLDER = re.compile(r"[A-Za-z0-9_.\-]{16,256}")  # safe in a URL, a header and a body, unencoded
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
MAX_SECRETS = 64
MAX_HOSTS = 64
MAX_VALUE_BYTES = 64 * 1024
HTTPS_PORT = 443
PLACEHOLDER_PREFIX = "SANDVISOR_SECRET_"
HEADERS = "headers"  # where placeholders are replaced: the request's headers only (the default)
ALL = "all"  # ... and its target (URL) and body
SUBSTITUTE = (HEADERS, ALL)


@attrs.frozen
class SecretRef:
    """One secret of a sandbox's configuration (what its record and snapshots hold)."""

    name: str
    hosts: tuple[str, ...]
    placeholder: str = ""  # "" until the registry makes one (then generated is True)
    store: str = ""  # the supervisor store's entry; "": the sandbox's own value (the vault's)
    generated: bool = False  # the supervisor made the placeholder: a clone gets a fresh one
    substitute: str = HEADERS  # HEADERS or ALL (where the proxy replaces the placeholder)


@attrs.frozen
class HostRule:
    name: str  # "api.example.com" or "*.example.com"
    port: int = HTTPS_PORT

    def matches(self, server_name: str, port: int) -> bool:
        if port != self.port:
            return False
        host = server_name.lower().rstrip(".")
        if self.name.startswith("*."):
            return host.endswith(self.name[1:]) and len(host) > len(self.name) - 1
        return host == self.name


def parse_host(text: str) -> HostRule:
    raw = text.strip().lower()
    host, sep, port_text = raw.rpartition(":") if ":" in raw else (raw, "", "")
    port = HTTPS_PORT
    if sep:
        if not port_text.isdigit() or not 0 < int(port_text) <= 65535:
            raise InvalidArgument(f"secret host {text!r}: bad port")
        port = int(port_text)
    name = host.rstrip(".")
    labels = name[2:].split(".") if name.startswith("*.") else name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise InvalidArgument(f"secret host {text!r}: a DNS name or *.suffix, with an optional :port")
    if all(label.isdigit() for label in labels):
        raise InvalidArgument(f"secret host {text!r}: addresses are not names (the proxy matches the TLS server name)")
    return HostRule(name, port)


@functools.cache
def _suffixes() -> Any:
    """The Public Suffix List (the package's copy; read at the first need, ~0.1 s)."""
    from publicsuffixlist import PublicSuffixList

    return PublicSuffixList()


def check_pattern(text: str) -> HostRule:
    """A host pattern as a caller gives it: :func:`parse_host`, and no wildcard over a
    public suffix (ICANN or private: ``*.com``, ``*.co.uk``, ``*.github.io``; an
    unknown top-level name counts as one, so ``*.test`` too). A single name is allowed
    even when it is a suffix (``s3.amazonaws.com`` is one host)."""
    rule = parse_host(text)
    if rule.name.startswith("*.") and _suffixes().is_public(rule.name[2:]):
        raise InvalidArgument(
            f"secret host {text!r}: {rule.name[2:]} is a public suffix (its subdomains belong to unrelated owners)"
        )
    return rule


def covers(outer: HostRule, inner: HostRule) -> bool:
    """Is every host:port ``inner`` matches matched by ``outer`` too?"""
    if outer.port != inner.port:
        return False
    if not outer.name.startswith("*."):
        return inner.name == outer.name
    tail = outer.name[1:]  # ".example.com"
    if inner.name.startswith("*."):
        return inner.name[1:] == tail or inner.name[1:].endswith(tail)
    return inner.name.endswith(tail) and len(inner.name) > len(tail)


def within(hosts: Sequence[str], stored: Sequence[str]) -> list[str]:
    """The patterns of ``hosts`` no pattern of ``stored`` covers (empty: a narrowing)."""
    outer = [parse_host(h) for h in stored]
    return [h for h in hosts if not any(covers(o, parse_host(h)) for o in outer)]


def check_hosts(hosts: Sequence[str], what: str) -> tuple[str, ...]:
    """A list of host patterns as given (a secret's, a store entry's), normalised."""
    if not hosts or len(hosts) > MAX_HOSTS:
        raise InvalidArgument(f"{what}: 1 to {MAX_HOSTS} allowed hosts")
    out = []
    for h in hosts:
        r = check_pattern(h)
        out.append(r.name if r.port == HTTPS_PORT else f"{r.name}:{r.port}")
    return tuple(out)


def rules(ref: SecretRef) -> tuple[HostRule, ...]:
    return tuple(parse_host(h) for h in ref.hosts)


def allowed(ref: SecretRef, server_name: str, port: int) -> bool:
    """May ``ref``'s value go to ``server_name`` (the TLS server name) on ``port``?"""
    return any(r.matches(server_name, port) for r in rules(ref))


def named_by_any(refs: Iterable[SecretRef], server_name: str, port: int) -> bool:
    """Does any secret name this host: the proxy terminates TLS for it (else it passes through)."""
    return any(allowed(ref, server_name, port) for ref in refs)


def intercepted_ports(refs: Iterable[SecretRef]) -> tuple[int, ...]:
    """The guest's TCP ports the proxy receives (443 and every port a host entry names)."""
    return tuple(sorted({HTTPS_PORT, *(r.port for ref in refs for r in rules(ref))}))


def new_placeholder(name: str) -> str:
    """Derived from the name (readable in the guest) plus 128 random bits (unguessable)."""
    return f"{PLACEHOLDER_PREFIX}{name}_{_random.token_hex(16)}"


def with_placeholders(refs: Sequence[SecretRef]) -> tuple[SecretRef, ...]:
    """Every secret with a placeholder (the generated ones fresh)."""
    return tuple(
        attrs.evolve(r, placeholder=new_placeholder(r.name), generated=True) if r.generated or not r.placeholder else r
        for r in refs
    )


def without_generated(refs: Sequence[SecretRef]) -> tuple[SecretRef, ...]:
    """As the caller asked for them (an idempotent Create compares these)."""
    return tuple(attrs.evolve(r, placeholder="", generated=False) if r.generated else r for r in refs)


def check_secrets(refs: Sequence[SecretRef]) -> None:
    if len(refs) > MAX_SECRETS:
        raise InvalidArgument(f"at most {MAX_SECRETS} secrets")
    names: set[str] = set()
    placeholders: list[str] = []
    for r in refs:
        if not NAME.fullmatch(r.name):
            raise InvalidArgument(f"secret name {r.name[:40]!r}: an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        if r.name in names:
            raise InvalidArgument(f"secret {r.name} is given twice")
        names.add(r.name)
        check_hosts(r.hosts, f"secret {r.name}")
        if r.substitute not in SUBSTITUTE:
            raise InvalidArgument(
                f"secret {r.name}: substitute is {' or '.join(SUBSTITUTE)}, not {r.substitute[:20]!r}"
            )
        if r.store and not NAME.fullmatch(r.store):
            raise InvalidArgument(f"secret {r.name}: store entry {r.store[:40]!r} is not a valid name")
        if r.placeholder:
            if not PLACEHOLDER.fullmatch(r.placeholder):
                raise InvalidArgument(f"secret {r.name}: a placeholder is 16-256 of A-Z a-z 0-9 _ . -")
            placeholders.append(r.placeholder)
    for i, a in enumerate(placeholders):
        if any(a in b or b in a for b in placeholders[i + 1 :]):
            raise InvalidArgument("a secret's placeholder must not contain another's")


def check_value(name: str, value: bytes) -> None:
    if not value:
        raise InvalidArgument(f"secret {name}: the value is empty")
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidArgument(f"secret {name}: at most {MAX_VALUE_BYTES} bytes")
    if any(b in value for b in (b"\r", b"\n", b"\x00")):
        raise InvalidArgument(f"secret {name}: the value must not hold CR, LF or NUL (it goes into HTTP headers)")


def substitute(data: bytes, pairs: Iterable[tuple[bytes, bytes]]) -> bytes:
    """Every occurrence of each placeholder replaced by its value."""
    for placeholder, value in pairs:
        if placeholder in data:
            data = data.replace(placeholder, value)
    return data
