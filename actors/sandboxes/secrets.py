"""A sandbox's secrets at run time (docs/secrets.md): the environment its
processes get (placeholders, the CA's paths), its CA installed in the guest, its
substitution proxy (a confined process owned by a task of the life, with its
nftables elements: actors/net/secretcell.py), rotation and
removal. The values are the vault's (actors/secrets/vault.py); none of them passes here
on its way to the guest -- only to the proxy, which puts them in on the way out."""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import Iterable
from typing import Any, Protocol

import trio

from actors.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from actors.machines.vm import Guest
from actors.model import Action, SandboxConfig
from actors.net import egress
from actors.net.hostnet import SandboxLink
from actors.net.nft import NftError
from actors.net.secretcell import ProxyCell
from actors.principals import LEGACY_OWNER
from actors.sandboxes.logs import SandboxLog
from actors.secrets import model as secrets_model
from actors.secrets.ca import new_ca
from actors.secrets.vault import Vault
from actors.settings import Settings
from actors.store import Record
from guestd import trust

log = logging.getLogger("sandvisor.secrets")


class SecretsOwner(Protocol):
    """What this module uses of a sandbox (the Sandbox is one; it is not imported here)."""

    record: Record
    settings: Settings
    log: SandboxLog

    @property
    def id(self) -> str: ...

    @property
    def config(self) -> SandboxConfig: ...

    def emit(self, action: Action, **attributes: str) -> None: ...


CA_ENV = {
    "SSL_CERT_FILE": trust.BUNDLE,
    "REQUESTS_CA_BUNDLE": trust.BUNDLE,
    "CURL_CA_BUNDLE": trust.BUNDLE,
    "PIP_CERT": trust.BUNDLE,
    "NODE_EXTRA_CA_CERTS": trust.CA,
}


def vault_of(sb: SecretsOwner) -> Vault:
    return _vault(sb.settings)


def live_refs(sb: SecretsOwner) -> list[secrets_model.SecretRef]:
    """The sandbox's secrets not removed from it."""
    v = sb.settings.vault
    return [r for r in sb.config.secrets if v is None or not v.removed(sb.record.uid, r.name)]


def env(sb: SecretsOwner) -> dict[str, str]:
    """What every process of the sandbox gets: each secret's placeholder under its name,
    and the CA's paths (no value: the guest never holds one)."""
    refs = live_refs(sb)
    if not sb.config.secrets:
        return {}
    return {**CA_ENV, **{r.name: r.placeholder for r in refs}}


def hosts_in_force(vault: Vault, ref: secrets_model.SecretRef) -> tuple[str, ...]:
    """Where ``ref``'s value may go now: its own hosts, and for a ``store:`` secret only
    those its entry's hosts still cover (``secret set --hosts`` narrowed later applies
    to running sandboxes from their next request)."""
    if not ref.store:
        return ref.hosts
    stored = vault.named_hosts(ref.store)
    wide = set(secrets_model.within(ref.hosts, stored))
    return tuple(h for h in ref.hosts if h not in wide)


def check_store_hosts(vault: Vault, ref: secrets_model.SecretRef) -> None:
    """A Create's ``store:`` secret may narrow its entry's hosts, never widen them."""
    stored = vault.named_hosts(ref.store)
    if not stored:
        raise PermissionDenied(
            f"secret {ref.name}: the store entry {ref.store!r} has no hosts yet (secret set {ref.store} --hosts ...)"
        )
    wide = secrets_model.within(ref.hosts, stored)
    if wide:
        raise PermissionDenied(
            f"secret {ref.name}: {', '.join(wide)} is not within the hosts of the store entry {ref.store!r}"
            f" ({', '.join(stored)})"
        )


def new_owner(vault: Vault, uid: str, values: dict[str, bytes]) -> None:
    """A new sandbox's values and its own CA, on disk before it starts."""
    vault.put_owner(uid, values, new_ca(uid[:12]))


class SecretsOfLife:
    """One life's part: the proxy's cell (actors/net/secretcell.py: a confined process,
    the supervisor's listener) and the elements that steer the guest to it."""

    def __init__(self, sb: SecretsOwner, link: SandboxLink) -> None:
        self.sb = sb
        self.link = link
        self.port = 0
        self.ports: tuple[int, ...] = ()
        self.cell: ProxyCell | None = None
        self._upstream_ca = b""

    def config(self) -> dict[str, Any]:
        """What the proxy holds: this sandbox's secrets in force with their values, its
        CA, the CAs it verifies servers with (the supervisor's context's: the system
        store and ``serve --upstream-ca``; the proxy's cell sees no /etc)."""
        sb = self.sb
        vault = vault_of(sb)
        ca = vault.ca(sb.record.uid)
        if ca is None:
            raise FailedPrecondition(f"sandbox {sb.id}: its CA is missing from the vault")
        secrets = [
            [
                r.name,
                list(hosts_in_force(vault, r)),
                r.placeholder,
                vault.value(sb.record.uid, r.name, r.store),
                r.substitute,
            ]
            for r in live_refs(sb)
        ]
        return {"secrets": secrets, "ca": list(ca), "upstream_ca": self._upstream_ca}

    def _blocked(self, secret: str, host: str, port: int) -> None:
        sb = self.sb
        sb.log.append("system", f"secret {secret}: a request to {host}:{port} was refused (not allowed)".encode())
        log.warning("%s: secret %s: a request to %s:%d was refused", sb.id, secret, host, port)
        sb.emit(Action.SECRET_BLOCKED, secret=secret, host=f"{host}:{port}")

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sb, link = self.sb, self.link
        settings = sb.settings
        hn = settings.hostnet
        assert hn is not None and settings.upstream_tls is not None
        self._upstream_ca = "".join(
            ssl.DER_cert_to_PEM_cert(der) for der in settings.upstream_tls.get_ca_certs(binary_form=True)
        ).encode()
        self.config()  # (its CA is there: FAILED_PRECONDITION before anything starts)
        address = link.guest.address
        cell = ProxyCell(
            sb.id,
            listen=hn.gateway,
            guest=address,
            mark=egress.secret_mark(address, hn.pool.network),
            netns=hn.netns,
            config=self.config,
            names=lambda: {r.name for r in sb.config.secrets},
            blocked=self._blocked,
            cells=settings.cells,
            exclude=[
                settings.sandboxes_dir.parent,
                settings.run_root,
                *([settings.memory_dir] if settings.memory_dir else []),
            ],
        )
        self.cell = cell
        vault = vault_of(sb)
        self.ports = secrets_model.intercepted_ports(sb.config.secrets)
        async with trio.open_nursery() as nursery:
            self.port = await nursery.start(cell.run)
            vault.listeners.append(cell.push)
            hn.nft.run(egress.secret_rules(link.name, address, hn.gateway, self.port, self.ports, hn.pool.network))
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                vault.listeners.remove(cell.push)
                if not link.closed:
                    with contextlib.suppress(NftError):
                        hn.nft.run(egress.secret_removal(link.name, address, self.port, self.ports, hn.pool.network))
                nursery.cancel_scope.cancel()


async def install_ca(sb: SecretsOwner, guest: Guest) -> None:
    """The sandbox's CA certificate into the guest's trust stores (boot, restore)."""
    ca = vault_of(sb).ca(sb.record.uid)
    if ca is None:
        raise FailedPrecondition(f"sandbox {sb.id}: its CA is missing from the vault")
    await guest.channel.trust_ca(ca[0])
    sb.log.append("system", f"{len(sb.config.secrets)} secret(s): the sandbox CA is trusted in the guest".encode())


def rotate(sb: SecretsOwner, name: str, value: bytes) -> None:
    """A new value for ``name`` (the sandbox's own; a store-sourced secret is rotated by
    ``secret set`` of its entry): the next request substitutes it. Placeholder unchanged."""
    ref = _ref(sb, name)
    secrets_model.check_value(name, value)
    if ref.store:
        raise FailedPrecondition(f"secret {name} comes from the store entry {ref.store}: set that entry instead")
    vault_of(sb).set_value(sb.record.uid, name, value)
    sb.log.append("system", f"secret {name}: rotated".encode())


def remove(sb: SecretsOwner, name: str) -> None:
    """Take ``name`` away: its placeholder is no longer replaced (new connections and
    the next request of open ones), its hosts no longer intercepted for it."""
    _ref(sb, name)
    vault_of(sb).remove_value(sb.record.uid, name)
    sb.log.append("system", f"secret {name}: removed".encode())


def _ref(sb: SecretsOwner, name: str) -> secrets_model.SecretRef:
    for r in sb.config.secrets:
        if r.name == name:
            return r
    raise NotFound(f"sandbox {sb.id} has no secret {name!r}")


def upstream_context(extra_ca: str = "") -> ssl.SSLContext:
    """The proxy's TLS to real servers: the system store, plus ``serve --upstream-ca``."""
    ctx = ssl.create_default_context()
    if extra_ca:
        ctx.load_verify_locations(cafile=extra_ca)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def set_named(
    settings: Settings, name: str, value: bytes, hosts: list[str] | None = None, owner: str = LEGACY_OWNER
) -> None:
    """An entry of the supervisor's store (``secret set``) of ``owner``: every sandbox
    whose secret names it substitutes the new value from its next request on. ``hosts``
    (the hosts it may go to) replace the entry's; none given: it keeps its own (a new
    entry, or one that has none, must be given them)."""
    vault = _vault(settings)
    if not secrets_model.NAME.fullmatch(name):
        raise InvalidArgument(f"secret name {name[:40]!r}: [A-Za-z_][A-Za-z0-9_]*")
    secrets_model.check_value(name, value)
    checked = list(secrets_model.check_hosts(hosts, f"store entry {name}")) if hosts else None
    if checked is None and not vault.named_hosts(name):
        raise InvalidArgument(f"store entry {name}: give the hosts its value may go to (secret set --hosts)")
    vault.set_named(name, value, checked, owner=owner)


def remove_named(settings: Settings, name: str, users: Iterable[SandboxConfig]) -> None:
    """Delete the store entry ``name``, refused while ``users`` (the configurations of
    every sandbox record, in any state, and every snapshot) name it: a reference is by
    name and read at each use, so a freed name set again by another principal would
    hand that one's value to these sandboxes."""
    n = sum(1 for c in users if any(r.store == name for r in c.secrets))
    if n:
        raise FailedPrecondition(
            f"secret {name!r} is used by {n} sandbox(es) or snapshot(s) (store:{name}): remove them first"
        )
    _vault(settings).remove_named(name)


def describe(sb: SecretsOwner) -> list[tuple[str, list[str], str, str, bool, str]]:
    """A sandbox's secrets read back: (name, hosts, placeholder, source, removed,
    substitute); never a value."""
    v = sb.settings.vault
    return [
        (
            r.name,
            list(r.hosts),
            r.placeholder,
            f"store:{r.store}" if r.store else "value",
            v is not None and v.removed(sb.record.uid, r.name),
            r.substitute,
        )
        for r in sb.config.secrets
    ]


def _vault(settings: Settings) -> Vault:
    if settings.vault is None:
        raise FailedPrecondition("this supervisor keeps no secrets (its vault is off)")
    return settings.vault
