"""What a caller may see: the method table's checks of ownership (docs/security.md).

A sandbox, snapshot, volume or stored secret its principal may not see is NOT_FOUND
with the text of a real miss (no existence oracle); lists keep what it may see;
PERMISSION_DENIED is for what it may see but not do.
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.face import (
    NotFound,
    PermissionDenied,
    Principal,
    Registry,
    Sandbox,
    SandboxConfig,
    SnapshotRecord,
    VolumeRecord,
)


def sandbox(reg: Registry, who: Principal, id: str) -> Sandbox:
    """The sandbox ``id`` if ``who`` may see it; else NOT_FOUND as for no sandbox."""
    sb = reg.get(id)
    if not who.may_see(sb.record.owner):
        raise NotFound(f"no sandbox {id!r}")
    return sb


def visible(who: Principal, sandboxes: Iterable[Sandbox]) -> list[Sandbox]:
    return [sb for sb in sandboxes if who.may_see(sb.record.owner)]


def sees_id(reg: Registry, who: Principal, id: str) -> bool:
    """May ``who`` see the registered sandbox ``id``?"""
    return who.may_see(reg.sandboxes[id].record.owner)


def snapshot(reg: Registry, who: Principal, ref: str) -> SnapshotRecord:
    """The snapshot ``ref`` (id, or a name) among those ``who`` may see."""
    return reg.snapshots.get(ref, who)


def volume(reg: Registry, who: Principal, name: str) -> VolumeRecord:
    rec = reg.volumes.get(name)
    if not who.may_see(rec.owner):
        raise NotFound(f"volume {name!r} does not exist")
    return rec


def stored_secret(reg: Registry, who: Principal, name: str) -> None:
    """NOT_FOUND (as for a missing entry) when ``who`` may not see the stored secret ``name``."""
    vault = reg.settings.vault
    if vault is not None and name in vault.named and not who.may_see(vault.named_owner(name)):
        raise NotFound(f"no secret {name!r} in the store")


def check_uses(reg: Registry, who: Principal, config: SandboxConfig) -> None:
    """A new sandbox mounts only volumes, and uses only stored secrets, ``who`` may see."""
    for m in config.volumes:
        if m.name in reg.volumes.records and not who.may_see(reg.volumes.records[m.name].owner):
            raise NotFound(f"volume {m.name!r} does not exist")
    vault = reg.settings.vault
    for r in config.secrets:
        if r.store and vault is not None and r.store in vault.named and not who.may_see(vault.named_owner(r.store)):
            raise NotFound(f"secret {r.name}: no entry {r.store!r} in the secret store (secret set)")


def admin_only(who: Principal, what: str) -> None:
    if not who.admin:
        raise PermissionDenied(f"{what} is for admins: {who.name} is not one")
