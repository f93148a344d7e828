"""The plans of secrets (docs/secrets.md; see :mod:`supervisor.sdk.ops`): the supervisor's
secret store, and a sandbox's own secrets (rotate, revoke, list); values go in, never out.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from supervisor import protocol as W
from supervisor.sdk.ops import (
    Plan,
    Target,
    Unary,
)


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
    yield Unary("SetSecret", W.SetSecretRequest(name, _bytes(value), listed), W.Empty)


def secret_list(t: Target) -> Plan[builtins.list[str]]:
    """The store's entry names (never a value)."""
    r: W.ListSecretsResponse = yield Unary("ListSecrets", W.Empty(), W.ListSecretsResponse)
    return r.names


def secret_remove(t: Target, name: str) -> Plan[None]:
    yield Unary("DeleteSecret", W.NameRequest(name=name), W.Empty)


def rotate_secret(t: Target, name: str, value: str | bytes) -> Plan[None]:
    """A new value for this sandbox's own secret ``name``: its next request carries it
    (the placeholder stays)."""
    yield Unary("RotateSecret", W.RotateSecretRequest(t.id, name, _bytes(value)), W.Empty)


def revoke_secret(t: Target, name: str) -> Plan[None]:
    """Take secret ``name`` away from this running sandbox: its placeholder is no longer replaced."""
    yield Unary("RevokeSecret", W.SandboxSecretRequest(t.id, name), W.Empty)


def secrets(t: Target) -> Plan[builtins.list[W.SandboxSecretInfo]]:
    """This sandbox's secrets: names, hosts, placeholders, sources (never a value)."""
    r: W.SandboxSecretsResponse = yield Unary("ListSandboxSecrets", W.IdRequest(t.id), W.SandboxSecretsResponse)
    return r.secrets
