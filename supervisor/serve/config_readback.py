"""A sandbox's configuration read back as the Create that makes an equal sandbox
(``Config``): the inverse of :func:`supervisor.serve.mapping.config`.

What is left out, and why: secret values (never read back: a secret of the sandbox's
own value comes back by name and hosts, its value the caller's to give again; a
``store`` entry by its name), placeholders the supervisor generated (a new sandbox
makes its own), file patches' bytes unless asked (each is described: size and
SHA-256), the live host ports (the ports as asked: 0 picks one again) and a pull's
credentials (never stored).
"""

from __future__ import annotations

import hashlib

from actors.face import HEADERS, Limits, SandboxConfig
from supervisor.wire import protocol


def create_request(cfg: SandboxConfig, limits: Limits, *, patch_data: bool = False) -> protocol.CreateSandboxRequest:
    """``cfg`` (with its effective ``limits``: defaults resolved) as a Create's request."""
    eg = cfg.network.egress
    w, t, b = cfg.workload, cfg.timers, cfg.boot
    return protocol.CreateSandboxRequest(
        labels=dict(cfg.labels),
        kernel=b.kernel,
        rootfs=b.rootfs,
        boot_args=b.boot_args,
        rootfs_fstype=b.rootfs_fstype,
        limits=protocol.ResourceLimits(vcpus=limits.vcpus, memory_mib=limits.memory_mib),
        image=b.image,
        cmd=list(w.cmd),
        env=dict(w.env),
        working_dir=w.working_dir,
        user=w.user,
        network=protocol.NetworkSpec(
            mode=cfg.network.mode.value,
            outbound=cfg.network.outbound,
            egress=None if eg is None else protocol.EgressSpec(eg.default, list(eg.allow), list(eg.deny)),
        ),
        # a profile's expansion is what the sandbox keeps (its name alone would take the
        # profile file's rules of today): the egress above, not the name
        port_address=cfg.network.port_address,
        dns=protocol.DnsSpec(list(cfg.network.dns.nameservers), list(cfg.network.dns.search))
        if cfg.network.dns.nameservers or cfg.network.dns.search
        else None,
        ttl_seconds=t.ttl_seconds,
        ssh_public_key="\n".join(cfg.ssh_keys) if cfg.ssh_keys else None,
        idle_timeout_seconds=t.idle_timeout_seconds,
        hostname=cfg.hostname,
        ephemeral=t.ephemeral,
        ports=[
            protocol.PortMapping(p.sandbox_port, p.host_port, p.protocol.value, host_address=p.host_address)
            for p in cfg.ports
        ],
        image_pull="" if b.pull == "if-missing" else b.pull,
        image_tls_verify=None if b.tls_verify else False,
        patches=[p if patch_data else _without_data(p) for p in cfg.patches],
        volumes=[protocol.VolumeMount(v.name, v.path, v.read_only) for v in cfg.volumes],
        scripts=dict(cfg.scripts),
        tmpfs=[protocol.TmpfsMount(m.path, m.size_mib) for m in cfg.tmpfs],
        host_mounts=[protocol.HostMount(m.source, m.path, m.writable) for m in cfg.host_mounts],
        on_idle="" if t.on_idle == "stop" else t.on_idle,
        paused_ttl_seconds=t.paused_ttl_seconds,
        ttl_action=t.ttl_action,
        kill_timeout_seconds=t.kill_timeout_seconds,
        no_auto_resume=not t.auto_resume,
        max_vcpus=limits.vcpu_ceiling,
        max_memory_mib=limits.memory_ceiling,
        disk_size_mib=limits.disk_mib,
        secrets=[
            protocol.SecretSpec(
                s.name,
                list(s.hosts),
                store=s.store,
                placeholder="" if s.generated else s.placeholder,
                substitute="" if s.substitute == HEADERS else s.substitute,
            )
            for s in cfg.secrets
        ],
        entrypoint=list(cfg.entrypoint or ()),
        entrypoint_cleared=cfg.entrypoint == (),
        cmd_cleared=cfg.cmd_cleared,
        shell=cfg.shell,
        security_profile=cfg.security_profile,
        log_level=cfg.log_level,
        quiet_logs=cfg.quiet_logs,
        thp=cfg.thp,
        init=None if cfg.init is None else protocol.InitSpec(cfg.init.path, list(cfg.init.args), dict(cfg.init.env)),
    )


def _without_data(p: protocol.PatchSpec) -> protocol.PatchSpec:
    return protocol.PatchSpec(
        p.op, p.path, b"", target=p.target, mode=p.mode, owner=p.owner, replace=p.replace, source=p.source
    )


def patch_info(cfg: SandboxConfig) -> list[protocol.PatchInfo]:
    """Each patch described: its bytes' size and SHA-256 (empty for a patch of none)."""
    return [
        protocol.PatchInfo(p.op, p.path, len(p.data), hashlib.sha256(p.data).hexdigest() if p.data else "")
        for p in cfg.patches
    ]
