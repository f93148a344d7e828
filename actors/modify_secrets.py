"""Modify's words (a change's kind and status, the policy, a plan's notes) and its
secrets part: a sandbox's secrets added, re-hosted, given another placeholder, source
or value through Modify (docs/modify.md, docs/secrets.md), within the stored-secret
rules (a store entry's hosts narrowed, never widened). I/O-free: actors/modify.py
plans with it and carries the plan out."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from actors.errors import InvalidArgument, NotFound, PermissionDenied
from actors.secrets import model as secrets_model

__all__ = ["BLOCKING", "Change", "Kind", "Note", "Policy", "SecretChange", "SecretPlan", "Status"]


class Kind(enum.StrEnum):
    CPUS = "cpus"
    MEMORY = "memory"
    DISK = "disk_size"
    ENV = "env"
    WORKDIR = "workdir"
    LABELS = "labels"
    TTL = "ttl"
    IDLE_TIMEOUT = "idle_timeout"
    SSH_KEYS = "ssh_keys"
    MAX_CPUS = "max_cpus"
    MAX_MEMORY = "max_memory"
    ENV_REMOVE = "env_remove"
    SECRET = "secret"
    EGRESS = "egress"


class Policy(enum.StrEnum):
    """What a Modify of a running sandbox may do: apply only what needs no restart
    (the default), restart when a change needs it, or save everything for the next
    start and leave the running machine (and the record's configuration) as it is."""

    NO_RESTART = "no_restart"
    RESTART = "restart"
    NEXT_START = "next_start"


class Status(enum.StrEnum):
    APPLIED = "applied_live"  # in effect now
    NEXT_BOOT = "applied_at_next_boot"  # saved; the sandbox's next boot has it
    RESTART = "applied_by_restart"  # in effect after the restart the caller asked for
    NEEDS_RESTART = "needs_restart"  # only a restart applies it: nothing done (no --restart)
    REFUSED = "refused"  # cannot be done (why says)
    UNCHANGED = "unchanged"


BLOCKING = frozenset({Status.NEEDS_RESTART, Status.REFUSED})


@attrs.frozen
class Change:
    kind: Kind
    status: Status
    value: str  # as requested
    previous: str = ""
    why: str = ""


@attrs.frozen
class Note:
    """A plan's conflict (what blocks it) or warning (true, not blocking)."""

    field: str
    message: str


@attrs.frozen(repr=False)
class SecretChange:
    """One secret of a Modify, by name: added (a source and hosts needed), or changed:
    a new ``value`` of its own, another ``store`` entry, ``hosts`` (re-hosted),
    ``placeholder``, ``substitute``; what is left empty stays. Never in a plan or a log."""

    name: str
    value: bytes | None = None
    store: str = ""
    placeholder: str = ""
    hosts: tuple[str, ...] = ()
    substitute: str = ""

    def __repr__(self) -> str:  # (never the value)
        return f"SecretChange(name={self.name!r}, store={self.store!r}, hosts={self.hosts!r})"


class SecretPlan:
    """The secrets part of a plan: each :class:`SecretChange` checked (the stored-secret
    rules: a store entry's hosts narrowed, never widened) and given its status. Live
    only where the running life's proxy already intercepts the ports: the proxy, the
    guest's trust of the sandbox CA and the interception start at boot."""

    def __init__(
        self,
        refs: tuple[secrets_model.SecretRef, ...],
        store_hosts: Mapping[str, Sequence[str]],
        proxy_ports: tuple[int, ...] | None,
        removed: frozenset[str],
        policy: Policy,
        running: bool,
        later: bool,
    ) -> None:
        self.refs = list(refs)
        self.store_hosts = store_hosts
        self.proxy_ports = proxy_ports
        self.removed = removed
        self.policy = policy
        self.running = running
        self.later = later
        self.changes: list[Change] = []
        self.warnings: list[Note] = []
        self.restart = False

    def run(self, wanted: tuple[SecretChange, ...]) -> tuple[tuple[secrets_model.SecretRef, ...], dict[str, bytes]]:
        values: dict[str, bytes] = {}
        if len({w.name for w in wanted}) != len(wanted):
            raise InvalidArgument("a secret is given twice")
        for w in wanted:
            if w.value is not None:
                secrets_model.check_value(w.name, w.value)
                values[w.name] = w.value
            self._one(w)
        refs = secrets_model.with_placeholders(self.refs)
        secrets_model.check_secrets(refs)
        return refs, values

    def _one(self, w: SecretChange) -> None:
        if not secrets_model.NAME.fullmatch(w.name):
            raise InvalidArgument(f"secret name {w.name[:40]!r}: an environment variable name")
        if w.value is not None and w.store:
            raise InvalidArgument(f"secret {w.name}: a store entry and a value exclude each other")
        if w.placeholder and not secrets_model.PLACEHOLDER.fullmatch(w.placeholder):
            raise InvalidArgument(f"secret {w.name}: a placeholder is 16 to 256 of [A-Za-z0-9_.-]")
        if w.substitute and w.substitute not in secrets_model.SUBSTITUTE:
            raise InvalidArgument(f"secret {w.name}: substitute is headers or all")
        hosts = secrets_model.check_hosts(w.hosts, f"secret {w.name}") if w.hosts else ()
        i = next((n for n, r in enumerate(self.refs) if r.name == w.name), None)
        old = self.refs[i] if i is not None else None
        what: list[str] = []
        if old is None:
            if w.value is None and not w.store:
                raise InvalidArgument(f"secret {w.name}: a new secret needs a source (value, env or store)")
            if not hosts:
                raise InvalidArgument(f"secret {w.name}: a new secret needs the hosts its value may go to")
            new = secrets_model.SecretRef(
                w.name, hosts, placeholder=w.placeholder, store=w.store, substitute=w.substitute or "headers"
            )
            what.append("added")
        else:
            new = old
            if w.value is not None:
                new = attrs.evolve(new, store="")
                what.append("rotated" if not old.store else "source: its own value")
            if w.store:
                new = attrs.evolve(new, store=w.store)
                what.append(f"source: store:{w.store}")
            if hosts and hosts != old.hosts:
                new = attrs.evolve(new, hosts=hosts)
                what.append("hosts updated")
            if w.placeholder and w.placeholder != old.placeholder:
                new = attrs.evolve(new, placeholder=w.placeholder, generated=False)
                what.append("placeholder updated")
            if w.substitute and w.substitute != old.substitute:
                new = attrs.evolve(new, substitute=w.substitute)
                what.append(f"substitute {w.substitute}")
        if new.store:
            stored = self.store_hosts.get(new.store)
            if stored is None:
                raise NotFound(f"secret {w.name}: no entry {new.store!r} in the secret store (secret set)")
            if not stored:
                raise PermissionDenied(f"secret {w.name}: the store entry {new.store!r} has no hosts yet")
            wide = secrets_model.within(new.hosts, stored)
            if wide:
                raise PermissionDenied(
                    f"secret {w.name}: {', '.join(wide)} is not within the hosts of the store entry {new.store!r}"
                )
        if i is None:
            self.refs.append(new)
        else:
            self.refs[i] = new
        value = f"{w.name}: {', '.join(what)}" if what else w.name
        previous = "" if old is None else f"hosts {','.join(old.hosts)}"
        if not what:
            self.changes.append(Change(Kind.SECRET, Status.UNCHANGED, value, previous))
            return
        st, why = self._status(w, old, new)
        self.changes.append(Change(Kind.SECRET, st, value, previous, why))
        if st == Status.APPLIED and old is not None and "placeholder updated" in what:
            self.warnings.append(
                Note(
                    f"secret {w.name}",
                    "processes running now hold the old placeholder in their env: it is no longer replaced",
                )
            )

    def _status(
        self, w: SecretChange, old: secrets_model.SecretRef | None, new: secrets_model.SecretRef
    ) -> tuple[Status, str]:
        if self.later and old is not None and w.value is not None:
            return Status.REFUSED, (
                "a secret's value is one, in the vault, used from the next request: a new value cannot wait for the "
                "next start (use policy no_restart)"
            )
        if not self.running:
            why = (
                "saved for the next start (policy next_start): the running sandbox is not changed"
                if self.later
                else "the sandbox is stopped: its next boot has it"
            )
            return Status.NEXT_BOOT, why
        ports = set(secrets_model.intercepted_ports([new]))
        if self.proxy_ports is None:
            why = (
                "the sandbox booted without secrets: its secret proxy, the guest's trust of its CA and the "
                "interception start at boot"
            )
        elif not ports <= set(self.proxy_ports):
            why = f"the proxy intercepts the ports fixed at boot ({', '.join(map(str, self.proxy_ports))})"
        else:
            if old is not None and w.name in self.removed and w.value is None:
                return Status.REFUSED, "the secret was revoked: give it a value to add it again"
            return Status.APPLIED, "the proxy substitutes it from the next request (placeholders: new Execs)"
        if self.policy == Policy.RESTART:
            self.restart = True
            return Status.RESTART, why + ": the sandbox restarts"
        return Status.NEEDS_RESTART, why + " (policy restart, or next_start)"
