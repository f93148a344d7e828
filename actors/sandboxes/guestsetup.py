"""A boot's requests to its guest, after it answered and before anything of the
caller's runs: the workload shape, volumes, host directories, tmpfs, patches, the
sandbox's CA and its resolv.conf, then its ports, tuning and init hand-off
(:func:`prepare`; a taken warm pool member's: :func:`prepare_member`). Each failure
is logged to the sandbox's system log and ends the boot as a MachineError naming
what failed."""

from __future__ import annotations

from typing import Protocol

from actors import hostcopy, hostdirs
from actors.channel.guest import GuestError, PatchEntry
from actors.errors import DomainError
from actors.machines.qemuproc import MachineError
from actors.machines.vm import Guest
from actors.rules import SCRIPTS_DIR, script_patches
from actors.sandboxes import handoff, secrets, tune
from actors.sandboxes.life import Life, LifeOwner, guest_error
from actors.sandboxes.plans import Boot, Resume
from actors.sandboxes.workload import Workloads


class SetupOwner(LifeOwner, tune.TuneOwner, Protocol):
    """What a boot's set-up uses of a sandbox (the Sandbox is one; it is not imported here)."""

    @property
    def work(self) -> Workloads: ...


async def prepare(sb: SetupOwner, life: Life, guest: Guest, plan: Boot | Resume, *, fresh: bool) -> bool:
    """A booted or restored guest made the caller's, in order, before it is ready:
    whether an init it was handed to runs the initial command (actors/sandboxes/handoff.py).
    ``fresh``: a fresh disk, which gets the Create's patches."""
    if isinstance(plan, Boot) and plan.template is not None:
        await plan.template()  # a fresh boot, nothing of the caller's in it yet
    if not isinstance(plan, Resume) or plan.fallback is not None:  # (a restored guest holds it)
        await apply_shape(sb, guest)
    if not isinstance(plan, Resume):  # (a restored guest has them mounted)
        await mount_volumes(sb, guest)
        await mount_host_dirs(sb, guest)
    if not isinstance(plan, Resume) or plan.fallback is not None:  # (a template has none)
        await mount_tmpfs(sb, guest)
    if fresh:
        await apply_patches(sb, guest)
    if sb.config.secrets:  # every boot and restore (a clone has a CA of its own)
        await install_ca(sb, guest)
    await configure_dns(sb, guest)  # (every boot and restore: /init writes its own)
    await life.apply_ports()  # ports given at create (or exposed before a stop) come first
    # vCPUs and memory below the machine's ceilings, a grown root filesystem
    await tune.at_boot(sb, guest, fresh=isinstance(plan, Boot))
    if not isinstance(plan, Resume) or plan.fallback is not None:  # (a restored one runs its init)
        return await handoff.hand_off(sb, guest, sb.work.initial_cmd)
    return False


async def prepare_member(sb: SetupOwner, life: Life, guest: Guest, *, apply_ports: bool) -> None:
    """A taken warm pool member's guest made the caller's (its identity is fresh
    already): ``apply_ports``: a Create's (a template's member has none; a
    snapshot's has its own)."""
    await apply_shape(sb, guest)  # (a member's guest has the template's: none)
    if apply_ports:
        await mount_tmpfs(sb, guest)
    await apply_patches(sb, guest)
    await configure_dns(sb, guest)
    life.update_policy()  # the caller's egress policy, not the template's
    if apply_ports:
        await life.apply_ports()


async def mount_volumes(sb: LifeOwner, guest: Guest) -> None:
    """Mount the life's volumes (virtio-blk serial vN, in order) where the config says."""
    for i, m in enumerate(sb.config.volumes):
        try:
            await guest.channel.mount(f"serial:v{i}", m.path, read_only=m.read_only)
        except GuestError as exc:
            err = guest_error(exc)
            sb.log.append("system", f"volume {m.name}: {err.message}".encode())
            raise MachineError(f"volume {m.name!r} at {m.path}: {err.message}") from None


async def mount_host_dirs(sb: LifeOwner, guest: Guest) -> None:
    """Mount the life's host directories (virtio-fs tags host0, ...), read-only
    unless writable."""
    for i, m in enumerate(sb.config.host_mounts):
        try:
            await guest.channel.mount(hostdirs.tag(i), m.path, fstype="virtiofs", read_only=not m.writable)
        except GuestError as exc:
            err = guest_error(exc)
            sb.log.append("system", f"host directory {m.source}: {err.message}".encode())
            raise MachineError(f"host directory {m.source!r} at {m.path}: {err.message}") from None


async def apply_shape(sb: LifeOwner, guest: Guest) -> None:
    """The configuration's workload shape in the guest (guestd/shape.py): the scripts
    directory on every exec's PATH, the restricted profile, the THP policy, guestd's
    log level. First of a boot's requests: the restricted profile's nosuid,nodev
    applies to the mounts after it."""
    c = sb.config
    path_extra = SCRIPTS_DIR if c.scripts else ""
    restricted = c.security_profile == "restricted"
    level = "off" if c.quiet_logs else c.log_level
    if not (path_extra or restricted or c.thp or level):
        return
    try:
        await guest.channel.configure(path_extra=path_extra, restricted=restricted, thp=c.thp, log_level=level)
    except GuestError as exc:
        err = guest_error(exc)
        sb.log.append("system", f"workload shape: {err.message}".encode())
        raise MachineError(f"workload shape: {err.message}") from None


async def mount_tmpfs(sb: LifeOwner, guest: Guest) -> None:
    """Mount the configuration's tmpfs file systems (each with its size limit)."""
    for m in sb.config.tmpfs:
        try:
            await guest.channel.mount("tmpfs", m.path, fstype="tmpfs", size_mib=m.size_mib)
        except GuestError as exc:
            err = guest_error(exc)
            sb.log.append("system", f"tmpfs {m.path}: {err.message}".encode())
            raise MachineError(f"tmpfs at {m.path}: {err.message}") from None


async def apply_patches(sb: LifeOwner, guest: Guest) -> None:
    """The Create's patches, in order, by guestd (batched by the frame cap), before
    anything of the caller's runs. Why not written into the overlay before boot: the
    host would have to parse the guest's file system (an ext4 in a qcow2) as root,
    and a Create served by a boot template restores a disk that is the template's,
    not a fresh one; guestd applies them the same way on both paths, as root in the
    guest, with the guest's own user names."""
    try:  # copy patches: the host files as they are now (actors/hostcopy.py)
        own = hostcopy.expand(sb.config.patches, sb.settings.allowed_paths)
    except DomainError as exc:
        sb.log.append("system", f"patches: {exc.message}".encode())
        raise MachineError(f"patches: {exc.message}") from None
    patches = (*script_patches(sb.config.scripts), *own)
    if not patches:
        return
    entries = [PatchEntry(p.op, p.path, p.data, p.target, p.mode, p.owner, p.replace) for p in patches]
    try:
        n = await guest.channel.patch(entries)
    except GuestError as exc:
        err = guest_error(exc)
        sb.log.append("system", f"patches: {err.message}".encode())
        raise MachineError(f"patches: {err.message}") from None
    sb.log.append("system", f"{n} patches applied".encode())


async def install_ca(sb: LifeOwner, guest: Guest) -> None:
    """The sandbox's CA into the guest's trust stores (it has secrets)."""
    try:
        await secrets.install_ca(sb, guest)
    except GuestError as exc:
        err = guest_error(exc)
        sb.log.append("system", f"secrets: {err.message}".encode())
        raise MachineError(f"secrets: installing the sandbox CA: {err.message}") from None


async def configure_dns(sb: LifeOwner, guest: Guest) -> None:
    """The guest's /etc/resolv.conf as its Create's DNS settings say (every boot and
    restore: /init and net_config write the proxy's address alone). The nameservers
    it names are answered by the DNS proxy all the same (the filter redirects port 53)."""
    dns, net = sb.config.network.dns, sb.network
    if not dns or net is None:
        return
    text = resolv_conf(dns.nameservers or (net.dns,), dns.search)
    try:
        await guest.channel.write_file("/etc/resolv.conf", text.encode())
    except GuestError as exc:
        err = guest_error(exc)
        sb.log.append("system", f"dns: {err.message}".encode())
        raise MachineError(f"dns: writing /etc/resolv.conf: {err.message}") from None


def resolv_conf(nameservers: tuple[str, ...], search: tuple[str, ...]) -> str:
    """A resolv.conf: its nameservers, then its search domains."""
    lines = [f"nameserver {ns}" for ns in nameservers]
    if search:
        lines.append("search " + " ".join(search))
    return "\n".join(lines) + "\n"
