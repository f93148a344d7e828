"""The rules a Create is checked against before anything is made: its idempotency
(:func:`created`), the host files and directories it may name, its secrets' values
and the supervisor's means to keep them, and its disks' sizes. Each refusal is a
typed :class:`~actors.errors.DomainError`; none of them changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs

from actors import hostcopy, hostdirs, image_disks
from actors.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from actors.hostdirs import check_host_file
from actors.machines.disk import DiskError, virtual_size
from actors.model import ImageUse, SandboxConfig
from actors.modify import check_disk_size
from actors.net.netlink import needs_pool_address
from actors.quotas import check_sandbox_disk
from actors.sandboxes.sandbox import Sandbox
from actors.sandboxes.secrets import check_store_hosts
from actors.secrets.model import check_value, without_generated
from actors.settings import Settings
from actors.volumes import Volumes


def created(sandboxes: Mapping[str, Sandbox], id: str, requested: SandboxConfig, owner: str) -> Sandbox | None:
    """The idempotency of Create, decided in one place: the sandbox ``id`` names if
    it was made by the same request (the configuration as the caller asked for it:
    its secrets' generated placeholders aside) of the same owner; None if no sandbox
    has the id; any other request for a taken id is ALREADY_EXISTS."""
    existing = sandboxes.get(id) if id else None
    if existing is None:
        return None
    asked = attrs.evolve(existing.config, secrets=without_generated(existing.config.secrets))
    if asked == requested and existing.record.owner == owner:
        return existing  # idempotent: same id, same request, same caller
    raise AlreadyExists(f"sandbox {id!r} exists with a different configuration")


def check_host_paths(settings: Settings, config: SandboxConfig) -> None:
    """The caller's own kernel and rootfs, and the host directories it mounts: in
    directories the operator allows (and a host mount needs the virtiofs servers)."""
    for what, path in (("kernel", config.boot.kernel), ("rootfs", config.boot.rootfs)):
        if path:
            check_host_file(what, path, settings.allowed_paths)
    b = config.boot
    image_disks.check_fstype(b.rootfs_fstype, rootfs=b.rootfs, kernel=b.kernel)
    if config.host_mounts:
        hostdirs.servers(settings)
    for m in config.host_mounts:
        hostdirs.check_host_dir(m.source, settings.allowed_paths, writable=m.writable)
    if any(p.source for p in config.patches):  # copy patches: read now to be refused now (bounded)
        hostcopy.expand(config.patches, settings.allowed_paths)


def check_secrets_available(
    settings: Settings, config: SandboxConfig, values: dict[str, bytes], *, fresh: bool = True
) -> None:
    """Secrets need the vault and a sandbox link the proxy can sit on (tap, or jailed
    user mode with outbound); each secret its value (its own, or a store entry)."""
    if settings.vault is None or settings.upstream_tls is None:
        raise FailedPrecondition("this supervisor keeps no secrets")
    if not needs_pool_address(settings, config.network) or settings.hostnet is None:
        raise FailedPrecondition(
            "secrets need network mode 'tap', or 'user' with outbound in the jail (a root supervisor with --ip-pool)"
        )
    names = {r.name for r in config.secrets}
    extra = set(values) - names
    if extra:
        raise InvalidArgument(f"values for secrets that are not declared: {', '.join(sorted(extra))}")
    for r in config.secrets:
        if r.store:
            if r.name in values:
                raise InvalidArgument(f"secret {r.name}: a store entry and a value exclude each other")
            if fresh and r.store not in settings.vault.named:  # (a restore copies its snapshot's)
                raise NotFound(f"secret {r.name}: no entry {r.store!r} in the secret store (secret set)")
            if fresh:  # (a restore's hosts are narrowed by the entry's at each request)
                check_store_hosts(settings.vault, r)
        elif r.name in values:
            check_value(r.name, values[r.name])
        elif fresh:
            raise InvalidArgument(f"secret {r.name}: no value (give value:, env: or store:)")


def check_disks(settings: Settings, volumes: Volumes, config: SandboxConfig, image: ImageUse | None) -> None:
    """A caller's own rootfs stands alone (no backing or data file, actors/machines/disk.py), and
    the sandbox's disks fit --max-sandbox-disk (actors/quotas.py). The life checks again."""
    try:
        if config.boot.rootfs:
            size = image_disks.disk_size(settings, Path(config.boot.rootfs))  # (a vmdk: its conversion's)
        else:
            size = virtual_size(Path(image.rootfs) if image is not None else settings.image.rootfs)
    except DiskError as exc:
        raise FailedPrecondition(str(exc)) from None
    recs = volumes.records
    rw = [(m.name, recs[m.name].size_bytes) for m in config.volumes if not m.read_only and m.name in recs]
    check_disk_size(config.limits.disk_mib, size)
    check_sandbox_disk(settings.max_sandbox_disk_mib, max(size, config.limits.disk_mib << 20), rw)
