"""Wire <-> domain for the method table: requests into domain values, results into replies.

The only module that knows both :mod:`supervisor.wire.protocol` (the request and reply
classes both edges structure into: msgpack bodies, and gRPC messages through
:mod:`supervisor.serve.grpc_convert`) and :mod:`actors` (the domain). Wire fields the domain
does not model (mounts, an SSH key) are refused here; everything else is checked by
the domain itself.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from actors.face import (
    ALIVE,
    HEADERS,
    BootSource,
    Cause,
    Change,
    Dns,
    DomainError,
    Egress,
    FailedPrecondition,
    HostMount,
    InitSpec,
    InvalidArgument,
    Limits,
    MemoryKind,
    Modification,
    NetMode,
    Network,
    Plan,
    Policy,
    PortSpec,
    Protocol,
    PullAuth,
    Sandbox,
    SandboxConfig,
    SandboxEvent,
    SandboxMetrics,
    SecretChange,
    SecretRef,
    SnapshotRecord,
    State,
    Timers,
    TmpfsMount,
    VolumeMount,
    Workload,
    rfc3339,
)
from images.build import Image
from images.oci import Image as OciImage
from images.oci import PullProgress
from supervisor.wire import protocol
from supervisor.wire.ssh_keys import parse_keys


def wire_error(exc: DomainError) -> protocol.ApiError:
    return protocol.ApiError(exc.code.value, exc.message)  # (the domain's codes are the wire's: guestd/codes.py)


# --- requests -> domain -----------------------------------------------------------------------
def state(text: str) -> State | None:
    if not text:
        return None
    try:
        return State(text)
    except ValueError:
        raise InvalidArgument(f"unknown state {text!r}; one of {', '.join(State)}") from None


def port_protocol(text: str) -> Protocol:
    try:
        return Protocol(text or Protocol.TCP)
    except ValueError:
        raise InvalidArgument(f"protocol {text!r}: tcp or udp") from None


def net_mode(text: str) -> NetMode:
    try:
        return NetMode(text or NetMode.NONE)
    except ValueError:
        raise InvalidArgument(f"network mode {text!r}: one of none, tap, user") from None


def network(spec: protocol.NetworkSpec, req: protocol.CreateSandboxRequest | None = None) -> Network:
    eg = spec.egress
    egress = None if eg is None else Egress(default=eg.default, allow=tuple(eg.allow), deny=tuple(eg.deny))
    net = Network(mode=net_mode(spec.mode), outbound=spec.outbound, egress=egress)
    if req is None:
        return net
    d = req.dns
    dns = Dns(tuple(d.nameservers), tuple(d.search)) if d is not None else Dns()
    return attrs.evolve(net, profile=req.network_profile, port_address=req.port_address, dns=dns)


def create_ports(req: protocol.CreateSandboxRequest) -> tuple[PortSpec, ...]:
    """A Create's ports, each on its own host address or the sandbox's."""
    return tuple(
        PortSpec(p.sandbox_port, p.host_port, port_protocol(p.protocol), p.host_address or req.port_address)
        for p in req.ports
    )


def config(req: protocol.CreateSandboxRequest) -> SandboxConfig:
    if req.mounts:
        raise FailedPrecondition("mounts are not supported in sandbox.v1: copy files in with WriteFile")
    # (one key, or several lines: serve --ssh's, docs/ssh.md)
    ssh_keys = _keys(req.ssh_public_key) if req.ssh_public_key is not None else ()
    return SandboxConfig(
        labels=dict(req.labels),
        limits=Limits(
            vcpus=req.limits.vcpus,
            memory_mib=req.limits.memory_mib,
            max_vcpus=req.max_vcpus,
            max_memory_mib=req.max_memory_mib,
            disk_mib=req.disk_size_mib,
        ),
        network=network(req.network, req),
        workload=Workload(cmd=tuple(req.cmd), env=dict(req.env), working_dir=req.working_dir, user=req.user),
        ports=create_ports(req),
        timers=Timers(
            ttl_seconds=req.ttl_seconds,
            idle_timeout_seconds=req.idle_timeout_seconds,
            ephemeral=req.ephemeral,
            on_idle=req.on_idle or "stop",
            paused_ttl_seconds=req.paused_ttl_seconds,
            auto_resume=not req.no_auto_resume,
            ttl_action=req.ttl_action or "remove",
            kill_timeout_seconds=req.kill_timeout_seconds,
        ),
        boot=BootSource(
            kernel=req.kernel,
            rootfs=req.rootfs,
            boot_args=req.boot_args,
            image=req.image,
            pull=req.image_pull or "if-missing",
            tls_verify=req.image_tls_verify is not False,
            rootfs_fstype=req.rootfs_fstype,
        ),
        hostname=req.hostname,
        patches=tuple(req.patches),  # (the wire's Patch is the domain's: guestd/patch.py)
        volumes=tuple(VolumeMount(v.volume, v.target, v.readonly) for v in req.volumes),
        scripts=dict(req.scripts),
        tmpfs=tuple(TmpfsMount(t.target, t.size_mib) for t in req.tmpfs),
        host_mounts=tuple(HostMount(h.source, h.target, h.writable) for h in req.host_mounts),
        secrets=tuple(
            SecretRef(
                s.name, tuple(s.hosts), placeholder=s.placeholder, store=s.store, substitute=s.substitute or HEADERS
            )
            for s in req.secrets
        ),
        ssh_keys=ssh_keys,
        entrypoint=tuple(req.entrypoint) if req.entrypoint or req.entrypoint_cleared else None,
        cmd_cleared=req.cmd_cleared,
        shell=req.shell,
        security_profile="" if req.security_profile == "default" else req.security_profile,
        log_level=req.log_level,
        quiet_logs=req.quiet_logs,
        thp=req.thp,
        init=None if req.init is None else InitSpec(req.init.path or "auto", tuple(req.init.args), dict(req.init.env)),
    )


def secret_values(req: protocol.CreateSandboxRequest) -> dict[str, bytes]:
    """A Create's secret values by name (to the vault, never into the configuration)."""
    return {s.name: bytes(s.value) for s in req.secrets if s.value}


# --- domain -> replies ------------------------------------------------------------------------
def stop_cause(cause: Cause | None) -> protocol.StopCause | None:
    if cause is None:
        return None
    return protocol.StopCause(
        ending=cause.ending.value,
        source=cause.source,
        by=cause.by,
        exit_code=cause.exit_code,
        signal=cause.signal,
        detail=cause.detail,
        sentence=cause.sentence(),
    )


def info(sb: Sandbox) -> protocol.SandboxInfo:
    r = sb.record
    shared, own = sb.life.memory.read(r.qemu_pid) if sb.life is not None else (0, 0)
    limits = sb.limits
    return protocol.SandboxInfo(
        id=r.id,
        state=r.state.value,
        labels=dict(r.config.labels),
        limits=protocol.ResourceLimits(vcpus=limits.vcpus, memory_mib=limits.memory_mib),
        network=protocol.SandboxNetwork(ip_address=sb.ip_address, gateway=sb.gateway, tap_name=sb.tap_name),
        created_at=r.created_at,
        ready_at=r.ready_at,
        last_exited_at=r.last_exited_at,
        last_exit_code=r.last_exit_code,
        error=(r.cause.sentence() if r.cause is not None else r.error)
        if r.state in (State.FAILED, State.CRASHED)
        else "",
        uid=r.uid,
        requested=requested(sb),
        applied=applied(sb),
        pending=pending(sb),
        updated_at=r.updated_at,
        owner=r.owner,
        ssh_keys=list(r.config.ssh_keys),
        shell=r.config.shell,
        init=None if (i := r.config.init) is None else protocol.InitSpec(i.path, list(i.args), dict(i.env)),
        cause=stop_cause(r.cause),
        parent=r.lineage.parent_id if r.lineage else "",
        parent_uid=r.lineage.parent_uid if r.lineage else "",
        fork_snapshot=r.lineage.snapshot_id if r.lineage else "",
        forked_at=r.lineage.forked_ns // 1_000_000_000 if r.lineage else 0,
        memory_shared_bytes=shared,
        memory_own_bytes=own,
        guest_oom_kills=sb.life.ooms.count if sb.life is not None else 0,
    )


def requested(sb: Sandbox) -> protocol.SandboxSettings:
    """The configuration as asked (Create and the Modifies since; defaults resolved)."""
    return _settings(sb.config, sb.limits)


def pending(sb: Sandbox) -> protocol.SandboxSettings | None:
    """The configuration a Modify saved for the next start (None: nothing pending)."""
    cfg = sb.record.pending
    if cfg is None:
        return None
    return _settings(cfg, cfg.limits.filled(sb.limits.vcpus, sb.limits.memory_mib))


def _settings(cfg: SandboxConfig, limits: Limits) -> protocol.SandboxSettings:
    return protocol.SandboxSettings(
        vcpus=limits.vcpus,
        memory_mib=limits.memory_mib,
        max_vcpus=limits.vcpu_ceiling,
        max_memory_mib=limits.memory_ceiling,
        disk_size_mib=limits.disk_mib,
        env=dict(cfg.workload.env),
        working_dir=cfg.workload.working_dir,
        ttl_seconds=cfg.timers.ttl_seconds,
        idle_timeout_seconds=cfg.timers.idle_timeout_seconds,
    )


def applied(sb: Sandbox) -> protocol.SandboxSettings | None:
    """What the running machine has (None: none runs)."""
    a = sb.record.applied
    if a is None or sb.state not in ALIVE:
        return None
    cfg = sb.config
    return protocol.SandboxSettings(
        vcpus=a.vcpus,
        memory_mib=a.memory_mib,
        max_vcpus=a.max_vcpus,
        max_memory_mib=a.max_memory_mib,
        disk_size_mib=a.disk_mib,
        env=dict(cfg.workload.env),  # (env, workdir and timers apply at once)
        working_dir=cfg.workload.working_dir,
        ttl_seconds=cfg.timers.ttl_seconds,
        idle_timeout_seconds=cfg.timers.idle_timeout_seconds,
        settled=a.settled,
    )


def modification(req: protocol.ModifyRequest) -> Modification:
    return Modification(
        vcpus=req.vcpus,
        memory_mib=req.memory_mib,
        disk_mib=req.disk_size_mib,
        env=dict(req.env) or None,
        working_dir=req.working_dir,
        labels=dict(req.labels) or None,
        ttl_seconds=req.ttl_seconds,
        idle_timeout_seconds=req.idle_timeout_seconds,
        dry_run=req.dry_run,
        restart=req.restart,
        ssh_keys_add=_keys("\n".join(req.ssh_keys_add)) if req.ssh_keys_add else (),
        ssh_keys_remove=_keys("\n".join(req.ssh_keys_remove)) if req.ssh_keys_remove else (),
        env_remove=tuple(req.env_remove),
        max_vcpus=req.max_vcpus,
        max_memory_mib=req.max_memory_mib,
        policy=_policy(req.policy),
        secrets=tuple(
            SecretChange(
                s.name,
                value=bytes(s.value) if s.value else None,
                store=s.store,
                placeholder=s.placeholder,
                hosts=tuple(s.hosts),
                substitute=s.substitute,
            )
            for s in req.secrets
        ),
        egress=_egress(req.egress),
    )


def _egress(spec: protocol.EgressSpec | None) -> Egress | None:
    if spec is None:
        return None
    return Egress(default=spec.default, allow=tuple(spec.allow), deny=tuple(spec.deny))


def _policy(text: str) -> Policy | None:
    if not text:
        return None
    try:
        return Policy(text)
    except ValueError:
        raise InvalidArgument(f"policy {text[:40]!r}: no_restart, restart or next_start") from None


def _keys(text: str) -> tuple[str, ...]:
    try:
        return parse_keys(text)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def modify_response(p: Plan) -> protocol.ModifyResponse:
    return protocol.ModifyResponse(
        changes=[protocol.ModifyChange(c.kind.value, c.status.value, c.value, c.previous, c.why) for c in p.changes],
        applied=p.applied,
        dry_run=p.dry_run,
        restarted=p.restart and p.applied,
        note=p.note,
        settled=p.settled,
        settle_seconds=round(p.settle_seconds, 3),
        policy=p.policy.value,
        conflicts=[protocol.ModifyNote(n.field, n.message) for n in p.conflicts],
        warnings=[protocol.ModifyNote(n.field, n.message) for n in p.warnings],
        resize=[protocol.ResizeStatus(r.resource, r.requested, r.actual, r.enforced, r.state, r.why) for r in p.resize],
        pending=p.pending,
    )


def diff_change(c: Change) -> protocol.DiffChange:
    a, b = c.a, c.b
    return protocol.DiffChange(
        path=c.path,
        change=c.change,
        kind_a=a.kind if a else "",
        size_a=a.size if a else 0,
        mode_a=a.mode if a else 0,
        hash_a=a.digest if a else "",
        kind_b=b.kind if b else "",
        size_b=b.size if b else 0,
        mode_b=b.mode if b else 0,
        hash_b=b.digest if b else "",
    )


def summary(sb: Sandbox) -> protocol.SandboxSummary:
    r = sb.record
    return protocol.SandboxSummary(
        id=r.id,
        state=r.state.value,
        labels=dict(r.config.labels),
        ip_address=sb.ip_address,
        created_at=r.created_at,
        uid=r.uid,
        parent_uid=r.lineage.parent_uid if r.lineage else "",
        memory_mib=sb.limits.memory_mib,
    )


def ports(sb: Sandbox) -> protocol.ListPortsResponse:
    bind = sb.settings.bind_address
    return protocol.ListPortsResponse(
        [protocol.PortMapping(p.sandbox_port, p.host_port, p.protocol.value, host_address=bind(p)) for p in sb.ports()]
    )


def event(ev: SandboxEvent) -> protocol.SandboxEvent:
    return protocol.SandboxEvent(
        ev.sandbox_id, ev.action.value, ev.timestamp, dict(ev.attributes), cursor=ev.cursor, sequence=ev.sequence
    )


def metrics(m: SandboxMetrics, *, cpu_seconds_total: float = 0.0) -> protocol.MetricsResponse:
    return protocol.MetricsResponse(
        id=m.id,
        timestamp=m.timestamp,
        cpu_percent=m.cpu_percent,
        memory_total_bytes=m.memory_total_bytes,
        memory_available_bytes=m.memory_available_bytes,
        host_rss_bytes=m.host_rss_bytes,
        disk_read_bytes=m.disk_read_bytes,
        disk_write_bytes=m.disk_write_bytes,
        net_rx_bytes=m.net_rx_bytes,
        net_tx_bytes=m.net_tx_bytes,
        uptime_seconds=m.uptime_seconds,
        cgroup_memory_bytes=m.cgroup_memory_bytes,
        cgroup_memory_limit_bytes=m.cgroup_memory_limit_bytes,
        cgroup_oom_kills=m.cgroup_oom_kills,
        guest_oom_kills=m.guest_oom_kills,
        cpu_seconds_total=cpu_seconds_total,
        root_used_bytes=m.root_used_bytes,
        root_free_bytes=m.root_free_bytes,
        root_host_allocated_bytes=m.root_host_allocated_bytes,
        memory_shared_bytes=m.memory_shared_bytes,
        memory_own_bytes=m.memory_own_bytes,
    )


def image(img: Image, is_default: bool) -> protocol.ImageInfo:
    """An image's description (stats its files: call it in a worker thread)."""
    paths: list[Path] = [img.kernel, img.initrd, img.rootfs]
    stats = [p.stat() for p in paths if p.exists()]
    return protocol.ImageInfo(
        name=img.name,
        kernel=str(img.kernel),
        initrd=str(img.initrd),
        rootfs=str(img.rootfs),
        kernel_version=img.kernel_version,
        keys=dict(img.keys),
        is_default=is_default,
        size_bytes=sum(st.st_blocks * 512 for st in stats),
        built_at=int(max((st.st_mtime for st in stats), default=0)),
    )


def oci_image(img: OciImage, in_use: bool) -> protocol.OciImageInfo:
    c = img.config
    return protocol.OciImageInfo(
        id=img.id,
        digest=img.digest,
        refs=list(img.refs),
        config_digest=img.config_digest,
        size_bytes=img.content_bytes,
        disk_bytes=img.disk_bytes,
        download_bytes=img.download_bytes,
        layers=len(img.layers),
        source=img.source,
        pulled_at=int(img.pulled_at),
        in_use=in_use,
        env=list(c.env),
        working_dir=c.working_dir,
        user=c.user,
        entrypoint=list(c.entrypoint),
        cmd=list(c.cmd),
    )


def pull_progress(p: PullProgress) -> protocol.PullImageProgress:
    return protocol.PullImageProgress(phase=p.phase, message=p.message, done=p.done, total=p.total, digest=p.digest)


def snapshot(rec: SnapshotRecord, pool_ready: int) -> protocol.SnapshotSummary:
    return protocol.SnapshotSummary(
        id=rec.id,
        sandbox_id=rec.sandbox_id,
        name=rec.name,
        labels=dict(rec.labels),
        snapshot_dir=rec.dir,
        created_at=rfc3339(rec.created_ns),
        network=rec.config.network.mode.value,
        secrets=[s.name for s in rec.config.secrets],
        host_mounts=len(rec.config.host_mounts),
        size_bytes=sum(rec.sizes.values()),
        memory=rec.memory.value,
        memory_mib=rec.machine.memory_mib,
        pool_ready=pool_ready,
        disk_only=rec.memory == MemoryKind.DISK,
    )


def pull_auth(req: protocol.CreateSandboxRequest) -> PullAuth | None:
    """A Create's registry credentials and CA (kept out of the configuration)."""
    if not (req.image_creds or req.image_auth_json or req.image_ca_pem):
        return None
    if req.image_creds and req.image_auth_json:
        raise InvalidArgument("give image_creds or image_auth_json, not both")
    return PullAuth(req.image_creds, req.image_auth_json, req.image_ca_pem)
