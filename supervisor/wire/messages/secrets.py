"""The secrets' bodies (docs/secrets.md): the supervisor's secret store and a sandbox's own
secrets (values go in, never out: no repr shows one).

The field order of each class is the msgpack wire's (:mod:`supervisor.wire.protocol`).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class SetSecretRequest:
    """An entry of the supervisor's secret store (made or replaced: a rotation of every
    sandbox whose secret names it), and the hosts its value may go to (none: the
    entry's own are kept; a new entry must be given them)."""

    name: str
    value: bytes
    hosts: list[str] = attrs.field(factory=list)

    def __repr__(self) -> str:
        return f"SetSecretRequest(name={self.name!r}, hosts={self.hosts!r})"


@attrs.frozen
class ListSecretsResponse:
    names: list[str]  # the store's entries (never a value)


@attrs.frozen
class RotateSecretRequest:
    """A sandbox's own secret gets a new value (the placeholder stays)."""

    id: str
    name: str
    value: bytes

    def __repr__(self) -> str:
        return f"RotateSecretRequest(id={self.id!r}, name={self.name!r})"


@attrs.frozen
class SandboxSecretRequest:
    id: str
    name: str


@attrs.frozen
class SandboxSecretInfo:
    name: str
    hosts: list[str]
    placeholder: str
    source: str  # "value" (the sandbox's own) | "store:NAME"
    removed: bool
    substitute: str = "headers"  # "headers" | "all"


@attrs.frozen
class SandboxSecretsResponse:
    secrets: list[SandboxSecretInfo]
