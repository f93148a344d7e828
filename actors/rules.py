"""The rules a sandbox's configuration follows: the checks that need no I/O (ids, labels,
ports, network, limits, patches, mounts, scripts, the workload's shape), a sandbox's
default hostname, and where its named scripts live in the guest and how Run reaches them.

The values themselves are actors.model's; this module imports it, never the reverse.
"""

from __future__ import annotations

import ipaddress
import os
import re

from actors.egress_policy import EgressPolicy, PolicyError
from actors.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from actors.model import (
    HOST_DIR_OPTION_CHARS,
    MAX_HOST_MOUNTS,
    MAX_PATCH_BYTES,
    MAX_PATCHES,
    MAX_TMPFS_MIB,
    MAX_WORKLOAD_BYTES,
    ON_IDLE,
    PATCH_OPS,
    TTL_ACTIONS,
    Limits,
    NetMode,
    Network,
    Patch,
    Protocol,
    SandboxConfig,
    TmpfsMount,
    VolumeMount,
    check_init,
)
from actors.secrets.model import check_secrets
from guestd import patch


def default_hostname(id: str) -> str:
    """A sandbox's hostname when its config names none: its id as a hostname (runs of
    anything but ASCII letters, digits and '-' as one '-', at most 63 characters), or
    "sandbox" when nothing of the id is left."""
    name = re.sub(r"[^A-Za-z0-9-]+", "-", id).strip("-")[:63].strip("-")
    return name or "sandbox"


MAX_ID_BYTES = 128
RESERVED_LABEL_PREFIXES = ("sandbox.", "sandvisor.")


def check_id(id: str) -> None:
    if len(id.encode()) > MAX_ID_BYTES:
        raise InvalidArgument(f"id is {len(id.encode())} bytes; at most {MAX_ID_BYTES} UTF-8 bytes")
    if any(ord(c) < 32 or ord(c) == 127 for c in id):
        raise InvalidArgument("id must not contain control characters")
    if id.strip() != id:
        raise InvalidArgument("id must not start or end with whitespace")


def check_labels(labels: dict[str, str]) -> None:
    for k, v in labels.items():
        if not k:
            raise InvalidArgument("label keys must not be empty")
        if len(k.encode()) > 256 or len(v.encode()) > 4096:
            raise InvalidArgument(f"label {k[:40]!r} is too long")
        if k.startswith(RESERVED_LABEL_PREFIXES):
            raise InvalidArgument(f"label {k!r}: the prefixes sandbox. and sandvisor. are reserved")


def check_port(sandbox_port: int, host_port: int = 0) -> None:
    if not 0 < sandbox_port <= 65535 or not 0 <= host_port <= 65535:
        raise InvalidArgument("ports must be 1-65535 (host_port 0 allocates one)")


def check_name(name: str) -> None:
    if len(name.encode()) > 256 or any(ord(c) < 32 for c in name):
        raise InvalidArgument("name must be at most 256 bytes without control characters")


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
MAX_NAMESERVERS = 3  # what a resolver reads of resolv.conf (glibc's MAXNS)
MAX_SEARCH = 6


def check_bind_address(address: str) -> None:
    """A host address exposed ports may listen on: a dotted-quad IPv4 address (whether
    this supervisor lets a sandbox use it is actors/net/bindaddr.py's)."""
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        raise InvalidArgument(f"bind address {address!r}: an IPv4 address such as 127.0.0.1") from None


def check_dns(net: Network) -> None:
    """The guest's resolv.conf settings: IPv4 nameservers, domain names to search."""
    dns = net.dns
    if not dns:
        return
    if not net.reaches_out:
        raise FailedPrecondition(
            "DNS settings need network mode 'tap', or 'user' with outbound: this sandbox resolves nothing"
        )
    if len(dns.nameservers) > MAX_NAMESERVERS:
        raise InvalidArgument(f"at most {MAX_NAMESERVERS} nameservers (a resolver reads no more)")
    for ns in dns.nameservers:
        try:
            ipaddress.IPv4Address(ns)
        except ValueError:
            raise InvalidArgument(f"nameserver {ns!r}: an IPv4 address") from None
    if len(dns.search) > MAX_SEARCH:
        raise InvalidArgument(f"at most {MAX_SEARCH} search domains")
    for d in dns.search:
        name = d.removesuffix(".")
        if not name or len(name) > 253 or not all(_DNS_LABEL.fullmatch(x) for x in name.split(".")):
            raise InvalidArgument(f"search domain {d!r}: a domain name (letters, digits, '-', '_', dots)")


def check_network(net: Network) -> None:
    """The network's rules that need no supervisor: an egress policy that parses, and only
    where the guest reaches out at all."""
    if net.mode == NetMode.TAP and net.outbound:
        raise InvalidArgument("outbound is a user-mode option: tap sandboxes reach out as their egress policy says")
    check_dns(net)
    if net.port_address:
        check_bind_address(net.port_address)
    if net.egress is None:
        return
    if not net.reaches_out:
        raise FailedPrecondition(
            "an egress policy needs network mode 'tap', or 'user' with outbound: this sandbox reaches nothing"
        )
    try:
        EgressPolicy.parse(net.egress.to_dict())
    except PolicyError as exc:
        raise InvalidArgument(str(exc)) from None


def max_vcpus() -> int:
    return max(1, os.cpu_count() or 1) * 4


def check_config(cfg: SandboxConfig) -> None:
    """The rules of a configuration that need no I/O (files are checked by the registry)."""
    check_labels(cfg.labels)
    if cfg.boot.image and (cfg.boot.rootfs or cfg.boot.kernel):
        raise InvalidArgument("image and rootfs/kernel exclude each other: the image is the root filesystem")
    if cfg.boot.pull not in ("always", "if-missing", "never"):
        raise InvalidArgument(f"image pull policy {cfg.boot.pull!r}: always, if-missing or never")
    check_network(cfg.network)
    if cfg.ports and cfg.network.mode == NetMode.NONE:
        raise FailedPrecondition("ports need network mode 'tap' or 'user'")
    seen: set[tuple[int, Protocol]] = set()
    for pm in cfg.ports:
        check_port(pm.sandbox_port, pm.host_port)
        if pm.host_address:
            check_bind_address(pm.host_address)
        if pm.protocol == Protocol.UDP and cfg.network.mode == NetMode.USER and not cfg.network.outbound:
            raise FailedPrecondition(
                "QEMU's restricted user networking drops the guest's UDP replies: a UDP port needs network "
                "mode 'tap', or 'user' with outbound"
            )
        if pm.key in seen:
            raise AlreadyExists(f"port {pm.label()} is given twice")
        seen.add(pm.key)
    if not 0 <= cfg.limits.vcpus <= max_vcpus():
        raise InvalidArgument(f"vcpus must be 0 (default) to {max_vcpus()}")
    if cfg.limits.memory_mib and not 64 <= cfg.limits.memory_mib <= 65536:
        raise InvalidArgument("memory_mib must be 0 (default) or 64 to 65536")
    check_ceilings(cfg.limits)
    if cfg.timers.ttl_seconds < 0 or cfg.timers.idle_timeout_seconds < 0:
        raise InvalidArgument("ttl_seconds and idle_timeout_seconds must not be negative")
    if cfg.timers.on_idle not in ON_IDLE:
        raise InvalidArgument(f"on_idle must be one of {', '.join(sorted(ON_IDLE))}, not {cfg.timers.on_idle!r}")
    if cfg.timers.paused_ttl_seconds < 0:
        raise InvalidArgument("paused_ttl_seconds must not be negative")
    if cfg.timers.ttl_action not in TTL_ACTIONS:
        raise InvalidArgument(f"ttl_action {cfg.timers.ttl_action!r}: stop or remove")
    if cfg.timers.kill_timeout_seconds < 0:
        raise InvalidArgument("kill_timeout_seconds must not be negative")
    if cfg.hostname and (len(cfg.hostname) > 63 or not cfg.hostname.replace("-", "").isalnum()):
        raise InvalidArgument("hostname must be 1-63 letters, digits or '-'")
    w = cfg.workload
    if w.cmd and not w.cmd[0]:
        raise InvalidArgument("cmd[0] must not be empty")
    size = sum(len(x.encode()) for x in (*w.cmd, *w.env, *w.env.values(), w.working_dir, w.user))
    if size > MAX_WORKLOAD_BYTES:
        raise InvalidArgument(f"cmd, env, working_dir and user take {size} bytes; at most 256 KiB")
    if len(cfg.boot.boot_args) > 1024 or "\n" in cfg.boot.boot_args:
        raise InvalidArgument("boot_args must be one line of at most 1024 bytes")
    check_patches(cfg.patches)
    check_volume_mounts(cfg.volumes)
    check_tmpfs_mounts(cfg.tmpfs, cfg.volumes)
    check_host_mounts(cfg)
    check_scripts(cfg.scripts)
    check_secrets(cfg.secrets)
    check_shape(cfg)
    if cfg.secrets and not cfg.network.reaches_out:
        raise FailedPrecondition(
            "secrets need network mode 'tap', or 'user' with outbound: this sandbox reaches nothing"
        )
    size = sum(len(p.data) for p in cfg.patches) + sum(len(b.encode()) for b in cfg.scripts.values())
    if size > MAX_PATCH_BYTES:
        raise InvalidArgument(f"patches and scripts carry {size} bytes; at most {MAX_PATCH_BYTES}")
    if cfg.init is not None:
        check_init(cfg.init)


MAX_DISK_MIB = 1 << 20  # 1 TiB: a root disk's size (serve --max-sandbox-disk caps it lower)


def check_ceilings(limits: Limits) -> None:
    """The ceilings and the disk size: in range, and not below the values they bound."""
    if not 0 <= limits.max_vcpus <= max_vcpus():
        raise InvalidArgument(f"max_vcpus must be 0 (the vcpus) to {max_vcpus()}")
    if limits.max_vcpus and limits.vcpus > limits.max_vcpus:
        raise InvalidArgument(f"vcpus {limits.vcpus} is above max_vcpus {limits.max_vcpus}")
    if limits.max_memory_mib and not 64 <= limits.max_memory_mib <= 65536:
        raise InvalidArgument("max_memory_mib must be 0 (the memory) or 64 to 65536")
    if limits.max_memory_mib and limits.memory_mib > limits.max_memory_mib:
        raise InvalidArgument(f"memory_mib {limits.memory_mib} is above max_memory_mib {limits.max_memory_mib}")
    if not 0 <= limits.disk_mib <= MAX_DISK_MIB:
        raise InvalidArgument(f"disk size must be 0 (the image's) to {MAX_DISK_MIB} MiB")


SCRIPTS_DIR = "/.sandvisor/scripts"
SCRIPT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def check_scripts(scripts: dict[str, str]) -> None:
    if len(scripts) > 100:
        raise InvalidArgument(f"{len(scripts)} scripts; at most 100")
    for name, body in scripts.items():
        if not SCRIPT_NAME.fullmatch(name):
            raise InvalidArgument(f"script name {name[:80]!r}: 1-64 of [A-Za-z0-9_.-], not starting with . or -")
        if not body.strip():
            raise InvalidArgument(f"script {name!r} is empty")


def script_patches(scripts: dict[str, str]) -> tuple[Patch, ...]:
    """The named scripts as files (a body without ``#!`` runs with /bin/sh)."""
    if not scripts:
        return ()
    out = [Patch("mkdir", SCRIPTS_DIR, mode=0o755)]
    for name, body in sorted(scripts.items()):
        text = body if body.startswith("#!") else "#!/bin/sh\n" + body
        out.append(Patch("file", f"{SCRIPTS_DIR}/{name}", text.encode(), mode=0o755, replace=True))
    return tuple(out)


def script_argv(scripts: dict[str, str], name: str, args: list[str]) -> list[str]:
    """What Run{script: name, cmd: args} runs (NOT_FOUND for a name the config lacks)."""
    if name not in scripts:
        known = ", ".join(sorted(scripts)) or "none"
        raise NotFound(f"no script {name!r} (this sandbox's: {known})")
    return [f"{SCRIPTS_DIR}/{name}", *args]


def check_guest_path(path: str, what: str) -> None:
    if not path.startswith("/") or "\0" in path or len(path.encode()) > 4096:
        raise InvalidArgument(f"{what} {path[:80]!r}: an absolute path without NUL, at most 4096 bytes")


def check_patches(patches: tuple[Patch, ...]) -> None:
    if len(patches) > MAX_PATCHES:
        raise InvalidArgument(f"{len(patches)} patches; at most {MAX_PATCHES}")
    size = 0
    for i, p in enumerate(patches):
        if p.op not in PATCH_OPS and p.op not in patch.HOST_OPS:
            ops = ", ".join((*PATCH_OPS, *patch.HOST_OPS))
            raise InvalidArgument(f"patch {i}: op {p.op!r} is not one of {ops}")
        if (p.op in patch.HOST_OPS) != bool(p.source):
            raise InvalidArgument(f"patch {i}: a host source is for copy_file and copy_dir, and they need one")
        if p.source:
            src = p.source
            if not src.startswith("/") or "\0" in src or ".." in src.split("/") or len(src.encode()) > 4096:
                raise InvalidArgument(f"patch {i}: host source {src[:80]!r}: an absolute path without '..' or NUL")
        check_guest_path(p.path, f"patch {i}: path")
        if p.mode is not None and not 0 <= p.mode <= 0o7777:
            raise InvalidArgument(f"patch {i}: mode must be 0 to 0o7777")
        if p.op == "symlink" and not p.target:
            raise InvalidArgument(f"patch {i}: a symlink needs a target")
        size += len(p.data) + len(p.path) + len(p.target) + len(p.owner)
    if size > MAX_PATCH_BYTES:
        raise InvalidArgument(f"patches carry {size} bytes; at most {MAX_PATCH_BYTES} (copy bigger trees with cp -r)")


def check_volume_mounts(mounts: tuple[VolumeMount, ...]) -> None:
    seen: set[str] = set()
    for m in mounts:
        check_guest_path(m.path, f"volume {m.name!r}: path")
        if m.path.rstrip("/") in ("", "/proc", "/sys", "/dev"):
            raise InvalidArgument(f"volume {m.name!r}: cannot be mounted at {m.path}")
        if m.name in seen:
            raise InvalidArgument(f"volume {m.name!r} is given twice")
        seen.add(m.name)
    if len({m.path.rstrip("/") for m in mounts}) != len(mounts):
        raise InvalidArgument("two volumes at one path")


def check_tmpfs_mounts(mounts: tuple[TmpfsMount, ...], volumes: tuple[VolumeMount, ...] = ()) -> None:
    if len(mounts) > 16:
        raise InvalidArgument(f"{len(mounts)} tmpfs mounts; at most 16")
    for m in mounts:
        check_guest_path(m.path, "tmpfs: path")
        if m.path.rstrip("/") in ("", "/proc", "/sys", "/dev"):
            raise InvalidArgument(f"tmpfs: cannot be mounted at {m.path}")
        if not 0 <= m.size_mib <= MAX_TMPFS_MIB:
            raise InvalidArgument(f"tmpfs {m.path}: size_mib must be 0 (the kernel's default) to {MAX_TMPFS_MIB}")
    paths = [m.path.rstrip("/") for m in mounts] + [v.path.rstrip("/") for v in volumes]
    if len(set(paths)) != len(paths):
        raise InvalidArgument("two mounts (tmpfs or volumes) at one path")


def check_host_mounts(cfg: SandboxConfig) -> None:
    """The rules of host directory mounts that need no I/O (the directories themselves:
    actors.hostdirs.check_host_dir)."""
    mounts = cfg.host_mounts
    if len(mounts) > MAX_HOST_MOUNTS:
        raise InvalidArgument(f"{len(mounts)} host directories; at most {MAX_HOST_MOUNTS}")
    for m in mounts:
        src = m.source
        if not src.startswith("/") or "\0" in src or ".." in src.split("/") or len(src.encode()) > 4096:
            raise InvalidArgument(f"host directory {src[:80]!r}: an absolute path without '..' or NUL")
        if any(c in HOST_DIR_OPTION_CHARS for c in src):
            raise InvalidArgument(
                f"host directory {src[:80]!r}: its server takes the path in an option list, "
                "where ',' and '\\' are syntax: rename the directory (or mount a parent)"
            )
        check_guest_path(m.path, f"host directory {src[:80]!r}: path")
        if m.path.rstrip("/") in ("", "/proc", "/sys", "/dev"):
            raise InvalidArgument(f"host directory {src[:80]!r}: cannot be mounted at {m.path}")
    paths = [m.path.rstrip("/") for m in mounts] + [t.path.rstrip("/") for t in cfg.tmpfs]
    paths += [v.path.rstrip("/") for v in cfg.volumes]
    if len(set(paths)) != len(paths):
        raise InvalidArgument("two mounts (tmpfs, volumes or host directories) at one path")


SECURITY_PROFILES = ("", "default", "restricted")
LOG_LEVELS = ("", "trace", "debug", "info", "warn", "error", "off")
THP_POLICIES = ("", "always", "madvise", "never")


def check_shape(cfg: SandboxConfig) -> None:
    """The workload shape's values: an entrypoint whose program is named, a shell path,
    profiles, levels and policies by name, and the host sources of copy patches."""
    if cfg.entrypoint and not cfg.entrypoint[0]:
        raise InvalidArgument("entrypoint[0] must not be empty")
    if cfg.entrypoint and sum(len(a.encode()) for a in cfg.entrypoint) > MAX_WORKLOAD_BYTES:
        raise InvalidArgument("entrypoint: at most 256 KiB")
    if cfg.cmd_cleared and cfg.workload.cmd:
        raise InvalidArgument("cmd_cleared and a cmd exclude each other")
    if cfg.shell and ("\0" in cfg.shell or len(cfg.shell.encode()) > 4096 or not cfg.shell.strip()):
        raise InvalidArgument("shell: a program path (or name on PATH) without NUL, at most 4096 bytes")
    if cfg.security_profile not in SECURITY_PROFILES:
        raise InvalidArgument(f"security_profile {cfg.security_profile!r}: default or restricted")
    if cfg.log_level not in LOG_LEVELS:
        raise InvalidArgument(f"log_level {cfg.log_level!r}: one of {', '.join(LOG_LEVELS[1:])}")
    if cfg.thp not in THP_POLICIES:
        raise InvalidArgument(f"thp {cfg.thp!r}: always, madvise or never")
