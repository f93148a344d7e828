"""E2B's networking (``allow_internet_access``, ``network={allow_out, deny_out}``) as the
supervisor's: a tap network whose egress policy says what E2B's rules say, under the
supervisor's own denials that no sandbox ever gets past (the host, link-local and
metadata addresses, other sandboxes: docs/network.md).

E2B's semantics (its SDK, ``e2b.sandbox.sandbox_api``): internet access is on unless
``allow_internet_access=False``, which is the same as ``deny_out=["0.0.0.0/0"]``;
``allow_out`` entries are let through whatever ``deny_out`` says. Here: "all traffic"
(``0.0.0.0/0``, ``::/0``) in ``deny_out`` or ``allow_internet_access=False`` make the
policy's default ``deny``; every other entry is an allow or deny entry (CIDRs,
addresses, domain names, checked by the supervisor), and an entry in both lists is an
allow entry only (the supervisor denies on a tie, E2B allows).

Without tap networking in serve (no ``--ip-pool``, or not root), a request for a
network is refused (400) and the default (no request) gets a sandbox without one,
which :func:`network_of` says and the endpoint reports (``allow_internet_access:
false`` in the sandbox's info, and serve's log)."""

from __future__ import annotations

from typing import Any

import attrs

from supervisor.serve.e2b_http import HttpError

ALL_TRAFFIC = frozenset({"0.0.0.0/0", "::/0"})
SERVED_KEYS = frozenset({"allowOut", "denyOut"})  # (the SDK's allow_out, deny_out on the wire)


@attrs.frozen
class E2BNetwork:
    """What a create asked for, as the supervisor's create arguments."""

    kwargs: dict[str, Any]  # network=, egress= for the SDK's create ({}: no network)
    internet: bool  # what E2B's allow_internet_access reads back as
    asked: bool  # the request named networking (not the default)
    rules: dict[str, list[str]] = attrs.field(factory=dict)  # E2B's allowOut/denyOut, as asked


def _entries(net: dict[str, Any], key: str) -> list[str]:
    value = net.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise HttpError(400, f"network.{key}: a list of CIDRs, addresses or domain names")
    return [v.strip() for v in value]


def network_of(body: dict[str, Any], tap: bool) -> E2BNetwork:
    """The network a create body asks for; ``tap``: serve has tap networking."""
    internet = body.get("allow_internet_access")
    if internet is not None and not isinstance(internet, bool):
        raise HttpError(400, "allow_internet_access: true or false")
    net = body.get("network")
    if net is None:
        net = {}
    if not isinstance(net, dict):
        raise HttpError(400, "network: an object")
    # (allowPublicTraffic=false is what get_host does here: the token is always needed)
    unserved = sorted(k for k, v in net.items() if v and k not in SERVED_KEYS)
    if unserved:
        raise HttpError(400, f"network {unserved}: not served by this endpoint (allowOut and denyOut are)")
    allow, deny = _entries(net, "allowOut"), _entries(net, "denyOut")
    asked = internet is not None or bool(allow or deny)
    if not tap:
        if internet is True or allow or deny:
            what = "allow_internet_access" if internet is True else "network allowOut/denyOut"
            raise HttpError(
                400,
                f"{what}: this endpoint's supervisor has no tap networking (serve --ip-pool, as root: "
                "docs/network.md), so its sandboxes have no network",
            )
        return E2BNetwork({}, internet=False, asked=asked)
    closed = internet is False or any(d in ALL_TRAFFIC for d in deny)
    allowed = list(dict.fromkeys(allow))
    denied = [d for d in dict.fromkeys(deny) if d not in ALL_TRAFFIC and d not in allowed]
    egress = {"default": "deny" if closed else "allow", "allow": allowed, "deny": denied}  # (the SDK's Egress)
    rules = {k: v for k, v in (("allowOut", allow), ("denyOut", deny)) if v}
    return E2BNetwork({"network": "tap", "egress": egress}, internet=not closed, asked=asked, rules=rules)


# -- update_network: a running sandbox's egress, replaced --------------------------------
UPDATE_KEYS = frozenset({"allowOut", "denyOut", "dnsServers", "egressProxy", "rules"})


def network_update(body: dict[str, Any], tap: bool) -> E2BNetwork:
    """What ``update_network``'s body (E2B's ``SandboxNetworkUpdateConfig``) asks for, as
    at create: E2B replaces every egress rule, so a field left out is cleared (no
    ``allow_internet_access``: internet access, as a create without it). The
    supervisor's Modify applies the policy to the running sandbox."""
    internet = body.get("allow_internet_access", True)
    unknown = sorted(k for k in body if k not in UPDATE_KEYS and k != "allow_internet_access")
    if unknown:
        raise HttpError(400, f"network {unknown}: not fields of a network update")
    net = {k: v for k, v in body.items() if k in UPDATE_KEYS}
    return network_of({"allow_internet_access": internet, "network": net}, tap)
