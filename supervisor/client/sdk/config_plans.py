"""A sandbox's configuration read back (``Config``) as the settings a Create takes, and
its SSH endpoint (``SshEndpoint``): the plans of ``sb.config()``, ``sb.config_json()``
and ``sb.ssh()`` (see :mod:`supervisor.client.sdk.ops`). No I/O here.

The settings are plain JSON values that ``create``'s keyword arguments accept as they
are (``Sandbox.create(name, **sb.config())``, or ``sandvisor create NAME --from-config
FILE`` with ``config_json()``'s text): mounts as their ``NAME:/path[:ro]`` strings,
secrets as ``NAME=SOURCE@HOSTS`` (a secret of the sandbox's own value as
``env:NAME``: its value is never read back, so the new sandbox takes it from the
creating process's ``$NAME``), patches as dicts (their bytes as ``data_base64`` only
with ``patch_data=True``; else described by ``size`` and ``sha256``, and a Create
refuses a file patch without its bytes).
"""

from __future__ import annotations

import base64
import json
from typing import Any, cast

from supervisor.client.sdk.ops import Plan, Target, Unary
from supervisor.client.sdk.spec import Settings
from supervisor.wire import protocol
from supervisor.wire.errors import InvalidArgument

SETTINGS_KEYS = frozenset(Settings.__annotations__)


def _secret(s: protocol.SecretSpec) -> str:
    source = f"store:{s.store}" if s.store else f"env:{s.name}"
    text = f"{s.name}={source}@{','.join(s.hosts)}"
    if s.substitute and s.substitute != "headers":
        text += f";substitute={s.substitute}"
    if s.placeholder:
        text += f";placeholder={s.placeholder}"
    return text


def _patch(p: protocol.PatchSpec, info: protocol.PatchInfo | None) -> dict[str, Any]:
    d: dict[str, Any] = {"op": p.op, "path": p.path}
    if p.target:
        d["target"] = p.target
    if p.mode is not None:
        d["mode"] = p.mode
    if p.owner:
        d["owner"] = p.owner
    if p.replace:
        d["replace"] = True
    if p.source:  # a copy patch: the host path it is read from again
        d["source"] = p.source
    if p.data:
        d["data_base64"] = base64.b64encode(p.data).decode()
    if info is not None and info.size:
        d["size"], d["sha256"] = info.size, info.sha256
    return d


def _plain(p: protocol.PortMapping, port_address: str) -> bool:
    """A port the ``ports`` setting spells (TCP, on the sandbox's own address)."""
    return p.protocol in ("", "tcp") and p.host_address in ("", port_address)


def _binding(p: protocol.PortMapping) -> str:
    """A port as ``port_bindings`` spells it: ``[ADDRESS:]HOST:GUEST[/udp]``."""
    text = f"{p.host_address}:{p.host_port}:{p.sandbox_port}" if p.host_address else f"{p.host_port}:{p.sandbox_port}"
    return text + ("/udp" if p.protocol == "udp" else "")


def settings_of(r: protocol.SandboxConfigResponse) -> Settings:
    """The read-back configuration as ``create``'s keyword arguments (JSON values)."""
    c = r.config
    net = c.network
    mode = "outbound" if net.mode == "user" and net.outbound else (net.mode or "none")
    out: dict[str, Any] = {
        "cpus": c.limits.vcpus,
        "memory_mib": c.limits.memory_mib,
        "max_cpus": c.max_vcpus,
        "max_memory_mib": c.max_memory_mib,
        "env": dict(c.env),
        "labels": dict(c.labels),
        "workdir": c.working_dir,
        "user": c.user,
        "hostname": c.hostname,
        "network": mode,
        "egress": None
        if net.egress is None
        else {
            "default": net.egress.default,
            "allow": list(net.egress.allow),
            "deny": list(net.egress.deny),
        },
        "ports": {str(p.sandbox_port): p.host_port for p in c.ports if _plain(p, c.port_address)},
        "port_bindings": [_binding(p) for p in c.ports if not _plain(p, c.port_address)],
        "port_address": c.port_address,
        "dns": None if c.dns is None else {"nameservers": list(c.dns.nameservers), "search": list(c.dns.search)},
        "ttl": c.ttl_seconds,
        "idle_timeout": c.idle_timeout_seconds,
        "ephemeral": c.ephemeral,
        "on_idle": c.on_idle or "stop",
        "paused_ttl": c.paused_ttl_seconds,
        "auto_resume": not c.no_auto_resume,
        "ttl_action": "stop" if c.ttl_action == "stop" else "remove",
        "kill_timeout": c.kill_timeout_seconds,
        "image": c.image,
        "pull": c.image_pull,
        "tls_verify": c.image_tls_verify is not False,
        "patches": [_patch(p, r.patches[i] if i < len(r.patches) else None) for i, p in enumerate(c.patches)],
        "volumes": [f"{v.volume}:{v.target}" + (":ro" if v.readonly else "") for v in c.volumes],
        "scripts": dict(c.scripts),
        "tmpfs": [f"{t.target}:{t.size_mib}" if t.size_mib else t.target for t in c.tmpfs],
        "mounts": [f"{m.source}:{m.target}:{'rw' if m.writable else 'ro'}" for m in c.host_mounts],
        "secrets": [_secret(s) for s in c.secrets],
        "ssh_keys": (c.ssh_public_key or "").splitlines(),
        "kernel": c.kernel,
        "rootfs": c.rootfs,
        "boot_args": c.boot_args,
    }
    if c.disk_size_mib:
        out["disk_size"] = f"{c.disk_size_mib}M"
    if c.cmd or c.cmd_cleared:  # (cmd=[] clears the image's CMD: given only when it was)
        out["cmd"] = list(c.cmd)
    if c.entrypoint or c.entrypoint_cleared:
        out["entrypoint"] = list(c.entrypoint)
    if c.rootfs_fstype:  # the caller's disk with its file system type
        out["image_disk"] = f"{c.rootfs}:{c.rootfs_fstype}"
    if c.init is not None:
        out["init"] = {"path": c.init.path or "auto", "args": list(c.init.args), "env": dict(c.init.env)}
    for key in ("shell", "security_profile", "log_level", "quiet_logs", "thp"):
        if getattr(c, key):
            out[key] = getattr(c, key)
    return cast(Settings, out)


def config(t: Target, *, patch_data: bool = False) -> Plan[Settings]:
    """The sandbox's whole effective configuration as ``create``'s keyword arguments:
    ``Sandbox.create(name, **sb.config())`` makes an equal sandbox. Secrets by name,
    never their values; file patches described (``size``, ``sha256``) unless
    ``patch_data`` (their bytes, base64)."""
    r: protocol.SandboxConfigResponse = yield Unary(
        "Config", protocol.ConfigRequest(id=t.id, patch_data=patch_data), protocol.SandboxConfigResponse
    )
    return settings_of(r)


def config_json(t: Target, *, patch_data: bool = False) -> Plan[str]:
    """:meth:`config` as JSON text (what ``sandvisor create --from-config FILE`` reads)."""
    settings = yield from config(t, patch_data=patch_data)
    return json.dumps(settings, indent=2, sort_keys=True)


def load_config_json(text: str) -> Settings:
    """``config_json()``'s text as ``create``'s keyword arguments (INVALID_ARGUMENT for
    what is not a configuration)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(protocol.INVALID_ARGUMENT, f"not a configuration (JSON): {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(protocol.INVALID_ARGUMENT, "a configuration is a JSON object")
    unknown = sorted(set(data) - SETTINGS_KEYS - {"registry"})
    if unknown or "registry" in data:
        raise InvalidArgument(
            protocol.INVALID_ARGUMENT, f"not settings of a Create: {', '.join(unknown or ['registry'])}"
        )
    return cast(Settings, data)


def ssh(t: Target) -> Plan[protocol.SshEndpoint]:
    """Where ``serve --ssh`` serves the sandbox: host, port, user, the host key, its
    fingerprint and a known_hosts line (Unavailable when the supervisor serves no SSH)."""
    ep: protocol.SshEndpoint = yield Unary("SshEndpoint", protocol.IdRequest(id=t.id), protocol.SshEndpoint)
    return ep
