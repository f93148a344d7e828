"""The plans of secrets (docs/secrets.md; see :mod:`supervisor.client.sdk.ops`): the supervisor's
secret store, and a sandbox's own secrets (rotate, revoke, list); values go in, never out.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from supervisor.client.sdk.ops import (
    Plan,
    Target,
    Unary,
)
from supervisor.wire import protocol


# --- secrets (docs/secrets.md) ------------------------------------------------------------------
def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def secret_set(t: Target, name: str, value: str | bytes, hosts: Sequence[str] | str = ()) -> Plan[None]:
    """An entry of the supervisor's store (made or replaced): every sandbox whose secret
    names it (``store=NAME``) puts the new value in from its next request on. ``hosts``
    (``"api.example.com,*.example.org"`` or a list): where its value may go; a sandbox's
    secret may narrow them, never widen them. None given: the entry keeps its own (a new
    entry must be given them)."""
    listed = [h.strip() for h in hosts.split(",")] if isinstance(hosts, str) else builtins.list(hosts)
    yield Unary("SetSecret", protocol.SetSecretRequest(name, _bytes(value), listed), protocol.Empty)


def secret_list(t: Target) -> Plan[builtins.list[str]]:
    """The store's entry names (never a value)."""
    r: protocol.ListSecretsResponse = yield Unary("ListSecrets", protocol.Empty(), protocol.ListSecretsResponse)
    return r.names


def secret_remove(t: Target, name: str) -> Plan[None]:
    yield Unary("DeleteSecret", protocol.NameRequest(name=name), protocol.Empty)


def rotate_secret(t: Target, name: str, value: str | bytes) -> Plan[None]:
    """A new value for this sandbox's own secret ``name``: its next request carries it
    (the placeholder stays)."""
    yield Unary("RotateSecret", protocol.RotateSecretRequest(t.id, name, _bytes(value)), protocol.Empty)


def revoke_secret(t: Target, name: str) -> Plan[None]:
    """Take secret ``name`` away from this running sandbox: its placeholder is no longer replaced."""
    yield Unary("RevokeSecret", protocol.SandboxSecretRequest(t.id, name), protocol.Empty)


def secrets(t: Target) -> Plan[builtins.list[protocol.SandboxSecretInfo]]:
    """This sandbox's secrets: names, hosts, placeholders, sources (never a value)."""
    r: protocol.SandboxSecretsResponse = yield Unary(
        "ListSandboxSecrets", protocol.IdRequest(t.id), protocol.SandboxSecretsResponse
    )
    return r.secrets
