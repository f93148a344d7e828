"""Which host addresses a sandbox's exposed ports may listen on.

An exposed port is a door into the sandbox: whoever reaches its host address reaches
the guest's service. Loopback (127.0.0.0/8) reaches only this host's own users; the
supervisor's ``--expose-address`` is the operator's default; any other address (a LAN
address, ``0.0.0.0``) opens the sandbox to every host of that network, so a Create or
ExposePort may name it only when the operator listed it with ``serve --port-address``.
Anything else is PERMISSION_DENIED (docs/security.md, "Exposed ports").
"""

from __future__ import annotations

from ipaddress import IPv4Address

from actors.errors import PermissionDenied
from actors.rules import check_bind_address


def allowed(address: str, expose_address: str, extra: tuple[str, ...]) -> bool:
    """Whether exposed ports may listen on ``address`` (a valid IPv4 address)."""
    return address == expose_address or IPv4Address(address).is_loopback or address in extra


def check(address: str, expose_address: str, extra: tuple[str, ...]) -> None:
    """INVALID_ARGUMENT for a malformed address, PERMISSION_DENIED for one the operator
    did not open ("" is the supervisor's default: always fine)."""
    if not address:
        return
    check_bind_address(address)
    if not allowed(address, expose_address, extra):
        opened = ", ".join(extra) or "none"
        raise PermissionDenied(
            f"exposed ports may not listen on {address}: this supervisor allows loopback, {expose_address} "
            f"and what serve --port-address names ({opened})"
        )
