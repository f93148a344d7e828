"""Named network profiles: a name a Create gives instead of an egress policy.

Built in: ``public`` (the internet; private ranges, the host and other sandboxes stay
closed as under any policy), ``private`` (only the RFC 1918 ranges: the LAN; not
100.64/10, where cloud metadata services live; nothing public, no names outside them)
and ``none`` (no network device).
An operator adds profiles in a TOML file (``serve --network-profiles FILE``)::

    [profile.corp]
    default = "deny"                       # what no entry matches ("allow" | "deny")
    allow = ["10.20.0.0/16", "pypi.org:443", "*.corp.example.com"]
    deny = ["10.20.9.9"]

A profile is resolved once, at Create (:func:`expand`): the sandbox keeps the expanded
rules and the profile's name, so a later change of the file leaves existing sandboxes,
their snapshots and restores as they were made. An unknown name is INVALID_ARGUMENT.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

import attrs

from actors.errors import InvalidArgument
from actors.model import Egress, NetMode, Network
from actors.net.egress import EgressPolicy, PolicyError

PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")  # RFC 1918
NONE = "none"
BUILTIN: dict[str, Egress | None] = {
    "public": Egress(default="allow"),
    "private": Egress(default="deny", allow=PRIVATE_RANGES),
    NONE: None,  # no network device at all
}
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


class ProfileFileError(ValueError):
    """A profiles file serve cannot use (it refuses to start)."""


def load(path: Path) -> dict[str, Egress]:
    """The operator's profiles from a TOML file: ``[profile.NAME]`` tables with
    ``default``, ``allow`` and ``deny``; each checked as a Create's policy would be."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ProfileFileError(f"network profiles {path}: {exc}") from None
    extra = set(doc) - {"profile"}
    if extra:
        raise ProfileFileError(f"network profiles {path}: unknown top-level keys {sorted(extra)} (use [profile.NAME])")
    out: dict[str, Egress] = {}
    tables = doc.get("profile", {})
    if not isinstance(tables, dict):
        raise ProfileFileError(f"network profiles {path}: 'profile' must be a table of [profile.NAME] tables")
    for name, body in tables.items():
        where = f"network profiles {path}: profile {name!r}"
        if not _NAME.fullmatch(name):
            raise ProfileFileError(f"{where}: a name is 1-63 of a-z, 0-9, '-', '_'")
        if name in BUILTIN:
            raise ProfileFileError(f"{where}: a built-in profile's name")
        if not isinstance(body, dict) or set(body) - {"default", "allow", "deny"}:
            raise ProfileFileError(f"{where}: a table of default, allow, deny")
        allow, deny = body.get("allow", []), body.get("deny", [])
        if not isinstance(allow, list) or not isinstance(deny, list):
            raise ProfileFileError(f"{where}: allow and deny are lists of entries")
        egress = Egress(default=str(body.get("default", "allow")), allow=tuple(allow), deny=tuple(deny))
        try:
            EgressPolicy.parse(egress.to_dict())
        except PolicyError as exc:
            raise ProfileFileError(f"{where}: {exc}") from None
        out[name] = egress
    return out


def names(operator: Mapping[str, Egress]) -> list[str]:
    return [*BUILTIN, *sorted(operator)]


def expand(network: Network, operator: Mapping[str, Egress]) -> Network:
    """The network a Create asked for with its profile resolved into egress rules
    (kept as they are now). A profile that reaches out and no network mode gives a
    tap network; ``none`` gives none."""
    name = network.profile
    if not name:
        return network
    if name in BUILTIN:
        egress = BUILTIN[name]
    elif name in operator:
        egress = operator[name]
    else:
        raise InvalidArgument(f"unknown network profile {name!r}; this supervisor has: {', '.join(names(operator))}")
    if network.egress is not None:
        raise InvalidArgument("a network profile and an egress policy exclude each other: the profile is the policy")
    if egress is None:
        if network.mode != NetMode.NONE:
            raise InvalidArgument(f"network profile 'none' and network mode {network.mode!r} contradict each other")
        return network
    mode = NetMode.TAP if network.mode == NetMode.NONE else network.mode
    return attrs.evolve(network, mode=mode, egress=egress)
