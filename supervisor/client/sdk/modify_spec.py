"""What a Modify says of secrets (docs/modify.md): :class:`SecretUpdate`, one secret
added or changed by name, as the wire's ``SecretSpec``."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from supervisor.client.sdk.spec import Secret, secret_value
from supervisor.wire import protocol
from supervisor.wire.errors import InvalidArgument


def _hosts(v: Sequence[str] | str) -> tuple[str, ...]:
    return tuple(h.strip() for h in v.split(",") if h.strip()) if isinstance(v, str) else tuple(v)


@attrs.frozen(kw_only=True)
class SecretUpdate:
    """One secret of a Modify, by ``name``: a new one (a source and ``hosts``), or a
    change of one the sandbox has: at most one source (``value``; ``env``, a variable of
    *this* process's environment read when the request is made; ``store``, an entry of
    the supervisor's store whose hosts it may narrow, never widen), ``hosts`` (re-host:
    empty leaves them), ``placeholder`` (empty leaves it; a new one gets a fresh one),
    ``substitute`` (empty leaves it). No value ever comes back in a plan."""

    name: str
    hosts: tuple[str, ...] = attrs.field(default=(), converter=_hosts)
    value: str | bytes = attrs.field(default="", repr=False)
    env: str = ""
    store: str = ""
    placeholder: str = ""
    substitute: str = ""

    def spec(self) -> protocol.SecretSpec:
        if sum([bool(self.value), bool(self.env), bool(self.store)]) > 1:
            raise InvalidArgument(protocol.INVALID_ARGUMENT, f"secret {self.name}: at most one of value, env, store")
        raw = secret_value(self.name, self.value, self.env)
        return protocol.SecretSpec(self.name, list(self.hosts), raw, self.store, self.placeholder, self.substitute)


def secret_specs(v: Sequence[SecretUpdate | Secret | str] | None) -> list[protocol.SecretSpec]:
    """A Modify's secrets on the wire: updates, whole :class:`Secret`s (an addition),
    or their text form (``NAME=SOURCE@HOSTS``, as create's)."""
    out = []
    for s in v or ():
        if isinstance(s, str):
            s = Secret.parse(s)
        out.append(s.spec())
    return out
