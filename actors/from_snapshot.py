"""A Create that starts from a snapshot (``Create{from_snapshot}``, the SDK's
``from_snapshot=``, the CLI's ``--from-snapshot``): a restore, with the Create's other
settings applied where a restore can take them, and refused where it cannot.

What applies: labels and TTL (the restore's own), the idle timeout, env and working
directory for later execs, SSH keys (a Modify right after the restore, before the
Create answers), ports (exposed on the restored sandbox), and the resources: any for
a disk-only snapshot (it boots), the snapshot's own for one with memory (its RAM and
vCPUs are the saved machine's: a Create asking other values is INVALID_ARGUMENT). The
network mode is the snapshot's (another mode is refused). Everything else is the
snapshot's (the image, disks, mounts, volumes, secrets, command, user, hostname...):
a Create naming any of it is INVALID_ARGUMENT naming the settings.

The snapshot is an id or name the caller may see, or the absolute path of an exported
snapshot file in an ``--allow-path`` directory: imported first (a snapshot of the
caller's named ``file-`` and the file's sha256, listed and removed as any other; the
same file again restores that snapshot), then restored.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING

import attrs
import trio

from actors.errors import InvalidArgument
from actors.hostdirs import check_host_file
from actors.model import Limits, MemoryKind, SandboxConfig, Timers, Workload
from actors.modify import Modification, modify

if TYPE_CHECKING:
    from actors.registry import Registry
    from actors.sandboxes.sandbox import Sandbox
    from actors.store import SnapshotRecord

CHUNK = 1 << 20


def leftovers(config: SandboxConfig, blank: SandboxConfig) -> list[str]:
    """The settings of ``config`` a restore cannot apply (``blank``: a Create's config
    with nothing set), by name."""
    applied = attrs.evolve(
        config,
        labels=blank.labels,
        limits=blank.limits,
        ports=blank.ports,
        network=blank.network,
        ssh_keys=blank.ssh_keys,
        workload=attrs.evolve(config.workload, env=blank.workload.env, working_dir=blank.workload.working_dir),
        timers=attrs.evolve(
            config.timers,
            ttl_seconds=blank.timers.ttl_seconds,
            idle_timeout_seconds=blank.timers.idle_timeout_seconds,
            ttl_action=blank.timers.ttl_action,
            kill_timeout_seconds=blank.timers.kill_timeout_seconds,
        ),
    )
    out: list[str] = []
    for f in attrs.fields(SandboxConfig):
        mine, base = getattr(applied, f.name), getattr(blank, f.name)
        if mine == base:
            continue
        if attrs.has(type(mine)):
            out += [
                f"{f.name}.{g.name}" for g in attrs.fields(type(mine)) if getattr(mine, g.name) != getattr(base, g.name)
            ]
        else:
            out.append(f.name)
    return out


def check(snap: SnapshotRecord, config: SandboxConfig, blank: SandboxConfig) -> Limits | None:
    """What of ``config`` the restore of ``snap`` cannot apply is INVALID_ARGUMENT; the
    limits a disk-only snapshot boots with (None: the snapshot's)."""
    rest = leftovers(config, blank)
    if rest:
        raise InvalidArgument(
            f"from_snapshot: {', '.join(rest)} cannot be set: the snapshot's are kept (it gives the image, "
            "disks, mounts, command...); a Create from a snapshot may set labels, ttl, idle timeout, env, "
            "workdir, ports, SSH keys and resources"
        )
    if config.network != blank.network and config.network.mode != snap.config.network.mode:
        raise InvalidArgument(
            f"from_snapshot: network {config.network.mode.value!r}: the snapshot's guest has "
            f"{snap.config.network.mode.value!r} networking"
        )
    lim = config.limits
    if snap.memory == MemoryKind.DISK:
        return lim if lim != blank.limits else None
    m = snap.machine
    if lim.memory_mib and lim.memory_mib != m.memory_mib:
        raise InvalidArgument(
            f"from_snapshot: memory {lim.memory_mib} MiB: snapshot {snap.id} holds the memory of a "
            f"{m.memory_mib} MiB machine (a memory snapshot resumes with its RAM; Modify lowers it afterwards)"
        )
    if lim.vcpus and lim.vcpus != m.cpus:
        raise InvalidArgument(f"from_snapshot: {lim.vcpus} vCPUs: snapshot {snap.id} is of a {m.cpus}-vCPU machine")
    if lim.max_vcpus or lim.max_memory_mib or lim.disk_mib:
        raise InvalidArgument("from_snapshot: a memory snapshot keeps its machine's ceilings and disk size")
    return None


async def create(
    reg: Registry,
    snap: SnapshotRecord,
    id: str,
    config: SandboxConfig,
    blank: SandboxConfig,
    *,
    owner: str,
) -> Sandbox:
    """Restore ``snap`` as sandbox ``id`` with ``config``'s applicable settings; ready
    when this returns (removed again if a setting fails to apply)."""
    limits = check(snap, config, blank)
    sb = await reg.restore(
        snap.id, id=id, labels=config.labels, ttl_seconds=config.timers.ttl_seconds, owner=owner, limits=limits
    )
    try:
        wl: Workload = config.workload
        t: Timers = config.timers
        sb.set_ttl(t.ttl_seconds, ttl_action=t.ttl_action, kill_timeout_seconds=t.kill_timeout_seconds)
        mod = Modification(
            env=dict(wl.env) or None,
            working_dir=wl.working_dir or None,
            idle_timeout_seconds=t.idle_timeout_seconds or None,
            ssh_keys_add=tuple(config.ssh_keys),
        )
        if mod != Modification():
            await modify(reg, sb.id, mod)
        for p in config.ports:
            await sb.expose(p.sandbox_port, p.host_port, p.protocol)
    except BaseException:
        with trio.CancelScope(shield=True):
            await reg.remove(sb.id, force=True)
        raise
    return sb


async def import_file(reg: Registry, path: str, *, owner: str) -> SnapshotRecord:
    """An exported snapshot file of the caller's (regular, no symlink, in an
    ``--allow-path`` directory) imported as a snapshot of ``owner``'s."""
    check_host_file("snapshot file", path, reg.settings.allowed_paths)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        name = f"file-{await trio.to_thread.run_sync(_digest, fd)}"
    except BaseException:
        os.close(fd)
        raise
    for rec in reg.snapshots.snapshots.values():  # the same file imported before: that snapshot
        if rec.name == name and rec.owner == owner and not rec.hidden:
            os.close(fd)
            return rec

    async def chunks() -> AsyncGenerator[bytes]:
        while data := await trio.to_thread.run_sync(os.read, fd, CHUNK):
            yield data

    try:
        async with aclosing(chunks()) as pieces:
            return await reg.import_snapshot(pieces, name=name, owner=owner)
    finally:
        os.close(fd)


def _digest(fd: int) -> str:
    """The file's sha256 (its first 24 hex digits: a snapshot's name), read from the start."""
    h = hashlib.sha256()
    while chunk := os.read(fd, CHUNK):
        h.update(chunk)
    os.lseek(fd, 0, os.SEEK_SET)
    return h.hexdigest()[:24]


def is_path(ref: str) -> bool:
    """A snapshot reference that is a file's path (ids and names have no '/')."""
    return "/" in ref
