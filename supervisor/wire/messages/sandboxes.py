"""The ``sandbox.v1`` SandboxService's bodies: a sandbox's life (Create, Inspect, Modify,
List, Events, Stop, ...), its work (Run, Exec), logs, metrics and ports.

Named after the ``.proto``'s messages, snake_case fields as there; the field order of
each class is the msgpack wire's (:mod:`supervisor.wire.protocol` converts them).
"""

from __future__ import annotations

import attrs

from guestd import patch


@attrs.frozen
class ResourceLimits:
    vcpus: int = 0
    memory_mib: int = 0


@attrs.frozen
class EgressSpec:
    """sandvisor extension: where a sandbox may connect to (tap; user with outbound).
    Entries: CIDRs, addresses, ``host:port`` (ranges ``lo-hi``), domain names
    (``example.com``, ``*.example.com``, optionally ``:port``)."""

    default: str = "allow"  # "allow" | "deny"
    allow: list[str] = attrs.field(factory=list)
    deny: list[str] = attrs.field(factory=list)


@attrs.frozen
class NetworkSpec:
    # "none" (default, see docs/network.md) | "tap" (a TAP and an address of the IP pool,
    # sandbox.v1's) | "user" (QEMU's slirp: exposed ports only, unless outbound)
    mode: str = ""
    outbound: bool = False  # sandvisor extension: user mode without restrict (the guest may reach out)
    egress: EgressSpec | None = None  # sandvisor extension (None: everything but the host and metadata)


@attrs.frozen
class PortMapping:
    """sandvisor extension: ports exposed at create (``--port [ADDR:]HOST:GUEST[/udp]``), and ListPorts' answer."""

    sandbox_port: int
    host_port: int = 0
    protocol: str = "tcp"
    host_address: str = ""  # where the host port listens ("": the sandbox's or the supervisor's)


@attrs.frozen
class DnsSpec:
    """sandvisor extension: the guest's resolv.conf: IPv4 ``nameservers`` (none: the
    supervisor's DNS proxy's address) and ``search`` domains. Every query goes to the
    supervisor's DNS proxy, whatever address the guest sends it to."""

    nameservers: list[str] = attrs.field(factory=list)
    search: list[str] = attrs.field(factory=list)


@attrs.frozen
class Mount:
    source: str = ""
    target: str = ""
    readonly: bool = False


PatchSpec = patch.Patch  # a Create's file system change (the one definition: guestd/patch.py)


@attrs.frozen
class VolumeMount:
    """A named volume mounted at ``target`` (sandvisor.v1.VolumeMount)."""

    volume: str
    target: str
    readonly: bool = False


@attrs.frozen
class TmpfsMount:
    """A tmpfs at ``target`` of at most ``size_mib`` (0: the guest kernel's default, half
    its RAM) (sandvisor.v1.TmpfsMount)."""

    target: str
    size_mib: int = 0


@attrs.frozen
class HostMount:
    """A host directory (under a ``serve --allow-path`` directory) at ``target``,
    read-only unless ``writable`` (sandvisor.v1.HostMount)."""

    source: str
    target: str
    writable: bool = False


@attrs.frozen
class SecretSpec:
    """A secret of a Create (docs/secrets.md): ``value`` (for ``value:`` and ``env:``
    sources, which the client reads from its own environment) or ``store`` (an entry of
    the supervisor's store), the hosts it may go to; ``placeholder`` "" = made fresh;
    ``substitute`` where the placeholder is replaced: "headers" ("" too) or "all"
    (the URL and the body as well)."""

    name: str
    hosts: list[str] = attrs.field(factory=list)
    value: bytes = b""
    store: str = ""
    placeholder: str = ""
    substitute: str = ""

    def __repr__(self) -> str:  # (never the value: a repr may end up in a log or an error)
        return f"SecretSpec(name={self.name!r}, hosts={self.hosts!r}, store={self.store!r})"


@attrs.frozen
class InitSpec:
    """The init PID 1 is handed to (sandvisor.v1.InitSpec): path "auto" or absolute."""

    path: str = "auto"
    args: list[str] = attrs.field(factory=list)
    env: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class CreateSandboxRequest:
    id: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)
    kernel: str = ""
    rootfs: str = ""
    boot_args: str = ""
    limits: ResourceLimits = attrs.field(factory=ResourceLimits)
    image: str = ""
    cmd: list[str] = attrs.field(factory=list)
    env: dict[str, str] = attrs.field(factory=dict)
    working_dir: str = ""
    user: str = ""
    mounts: list[Mount] = attrs.field(factory=list)
    network: NetworkSpec = attrs.field(factory=NetworkSpec)
    ttl_seconds: int = 0
    ssh_public_key: str | None = None
    # sandvisor extensions (the mature SDK's surface)
    idle_timeout_seconds: int = 0
    hostname: str = ""
    ephemeral: bool = False  # removed once it stops
    ports: list[PortMapping] = attrs.field(factory=list)
    # how ``image`` is pulled: always | if-missing (""; the default) | never; False: a
    # plain-HTTP registry. Credentials: pull first with PullImage
    image_pull: str = ""
    image_tls_verify: bool | None = None  # None: verify (a proto3 optional on gRPC)
    patches: list[PatchSpec] = attrs.field(factory=list)  # applied by guestd before ready
    volumes: list[VolumeMount] = attrs.field(factory=list)  # sandvisor.v1.CreateRequest.volumes
    scripts: dict[str, str] = attrs.field(factory=dict)  # named scripts, run by Run{script}
    tmpfs: list[TmpfsMount] = attrs.field(factory=list)  # sandvisor.v1.CreateRequest.tmpfs
    host_mounts: list[HostMount] = attrs.field(factory=list)  # sandvisor.v1.CreateRequest.host_mounts
    # hibernation: what the idle timeout does ("stop" or "pause"; "": stop), how
    # long a paused sandbox is kept (0: until its TTL), whether calls and connections resume
    # it (a zero default: proto3 cannot tell false from unset)
    on_idle: str = ""
    paused_ttl_seconds: int = 0
    no_auto_resume: bool = False
    # ceilings Modify moves vcpus and memory below live (0: the values; docs/modify.md)
    max_vcpus: int = 0
    max_memory_mib: int = 0
    disk_size_mib: int = 0  # the root disk's size (0: the image's); grown, never shrunk
    secrets: list[SecretSpec] = attrs.field(factory=list)  # sandvisor.v1.CreateRequest.secrets (docs/secrets.md)
    # the image's registry: credentials ("USER:PASSWORD", or a docker-style auth file's
    # content) and CA certificates (PEM), for the Create's pull only: never stored,
    # never printed (repr), never in the sandbox's configuration
    image_creds: str = attrs.field(default="", repr=False)
    image_auth_json: bytes = attrs.field(default=b"", repr=False)
    image_ca_pem: bytes = attrs.field(default=b"", repr=False)
    # workload shape (sandvisor.v1 CreateRequest 120-127): the image ENTRYPOINT replaced
    # (empty: the image's, unless entrypoint_cleared: none), the image CMD cleared, the
    # shell of shell(), the in-guest security profile ("default" | "restricted"), the
    # log level of the sandbox's lines (trace..error, "off"), none of them, the THP policy
    entrypoint: list[str] = attrs.field(factory=list)
    entrypoint_cleared: bool = False
    cmd_cleared: bool = False
    shell: str = ""
    security_profile: str = ""
    log_level: str = ""
    quiet_logs: bool = False
    thp: str = ""
    # networking (docs/network.md): a named profile expanded to the egress policy at
    # Create (public, private, none, or the operator's); the host address exposed ports
    # listen on ("": the supervisor's; others as serve --port-address allows); the
    # guest's resolv.conf (queries still go through the supervisor's DNS proxy)
    network_profile: str = ""
    port_address: str = ""
    dns: DnsSpec | None = None
    init: InitSpec | None = None  # the init PID 1 is handed to (sandvisor.v1.CreateRequest.init)
    # images and disks: rootfs's file system type; a snapshot (id, name or exported file) to start from
    rootfs_fstype: str = ""
    from_snapshot: str = ""
    # lifetime: what the TTL does ("": "remove", sandbox.v1's; "stop": drain, then stop);
    # how long a Kill waits to see it stopped (0: the default)
    ttl_action: str = ""
    kill_timeout_seconds: int = 0


@attrs.frozen
class CreateSandboxResponse:
    id: str
    ip_address: str
    state: str


@attrs.frozen
class IdRequest:
    """Inspect, Kill, Drain, Start, WaitUntilStopped, Ping, Touch, Metrics take just an id."""

    id: str


@attrs.frozen
class KillRequest:
    """Kill (and RequestKill): ``timeout_seconds`` is how long Kill waits to see it
    stopped (0: the sandbox's ``kill_timeout_seconds``, else the default)."""

    id: str
    timeout_seconds: int = 0


@attrs.frozen
class DrainRequest:
    """Drain: work in flight gets ``grace_seconds`` (0: as long as it takes), then it stops."""

    id: str
    grace_seconds: int = 0


@attrs.frozen
class StopCause:
    """Why a sandbox's last life ended (actors.model.Cause on the wire): ``ending``
    (exited, stopped, out_of_memory, guest_panic, qemu_died, host_restart, gave_up,
    boot_failed, error), ``source`` in one word, ``by`` (who stopped it; which OOM
    killer), QEMU's signal or exit code when known, and a sentence for people."""

    ending: str
    source: str
    by: str = ""
    exit_code: int | None = None
    signal: int | None = None
    detail: str = ""
    sentence: str = ""


@attrs.frozen
class RunRequest:
    id: str
    cmd: list[str] = attrs.field(factory=list)
    env: dict[str, str] = attrs.field(factory=dict)
    working_dir: str = ""
    user: str = ""
    tty: bool = False
    timeout_seconds: int = 0
    script: str = ""  # a named script of the sandbox's config, run with ``cmd`` as its arguments


@attrs.frozen
class RunOutput:
    stream: str
    data: bytes = b""
    exit_code: int = 0
    done: bool = False
    # sandvisor extension: stream "detached" (done) ends a detachable Exec (or an
    # Attach) the client left with ExecInput.detach: its process runs on as this session
    session_id: int = 0
    # sandvisor extension, on "exit": the guest kernel's OOM killer killed the process
    # (exit_code 137: SIGKILL)
    oom_killed: bool = False


@attrs.frozen
class TerminalSize:
    width: int = 80
    height: int = 24


@attrs.frozen
class ExecRequest:
    id: str
    cmd: list[str] = attrs.field(factory=list)
    env: dict[str, str] = attrs.field(factory=dict)
    working_dir: str = ""
    user: str = ""
    tty: bool = False
    tty_size: TerminalSize = attrs.field(factory=TerminalSize)
    timeout_seconds: int = 0
    # sandvisor extension: the session may be left running (ExecInput.detach) and
    # attached again (Attach); a client that goes away without detaching still ends it
    detachable: bool = False


@attrs.frozen
class ExecInput:
    """Exactly one of the three is set (sandbox.v1's oneof)."""

    init: ExecRequest | None = None
    stdin: bytes | None = None
    resize: TerminalSize | None = None
    close_stdin: bool = False  # sandvisor extension: end of input
    detach: bool = False  # sandvisor extension: leave a detachable session running (the call ends)


ExecOutput = RunOutput


@attrs.frozen
class StopSandboxRequest:
    id: str
    timeout_seconds: int = 0


@attrs.frozen
class RemoveSandboxRequest:
    id: str
    force: bool = False
    with_descendants: bool = False  # its forks too, and theirs (those the caller sees)


@attrs.frozen
class SandboxNetwork:
    ip_address: str = ""
    gateway: str = ""
    tap_name: str = ""


@attrs.frozen
class SandboxSettings:
    """sandvisor extension: a sandbox's configuration as requested (Create and every
    Modify since), or as its running machine applies it (``settled``: the guest has
    reached it: balloon at its target, vCPUs online)."""

    vcpus: int = 0
    memory_mib: int = 0
    max_vcpus: int = 0
    max_memory_mib: int = 0
    disk_size_mib: int = 0
    env: dict[str, str] = attrs.field(factory=dict)
    working_dir: str = ""
    ttl_seconds: int = 0
    idle_timeout_seconds: int = 0
    settled: bool = False


@attrs.frozen
class SandboxInfo:
    id: str
    state: str
    labels: dict[str, str]
    limits: ResourceLimits
    network: SandboxNetwork
    created_at: int
    ready_at: int
    last_exited_at: int
    last_exit_code: int
    error: str
    # sandvisor extension: the per-create identity (a later sandbox given the same id has another)
    uid: str = ""
    # sandvisor extensions: read-back (None for sandbox.v1's Inspect: it has no field for them)
    requested: SandboxSettings | None = None
    applied: SandboxSettings | None = None  # None: no machine runs
    updated_at: int = 0  # unix seconds of the last Modify that changed something (0: none)
    owner: str = ""  # the principal that made it (docs/security.md)
    ssh_keys: list[str] = attrs.field(factory=list)  # the public keys its SSH endpoint accepts (docs/ssh.md)
    shell: str = ""  # what the clients' shell runs when the call names none ("": /bin/sh)
    init: InitSpec | None = None  # the init PID 1 is handed to (None: guestd stays PID 1)
    pending: SandboxSettings | None = None  # saved for the next start (a Modify's policy next_start)
    cause: StopCause | None = None  # why its last life ended (None: none has)
    # lineage (docs/fork.md): the sandbox it was forked from ("": none), its fork point
    parent: str = ""
    parent_uid: str = ""
    fork_snapshot: str = ""
    forked_at: int = 0  # unix seconds
    # memory per branch, as the host counts QEMU's pages: shared with others (the family's
    # one memory file) and its own (0: no machine runs)
    memory_shared_bytes: int = 0
    memory_own_bytes: int = 0
    # the guest kernel's OOM kills guestd reported in its current life (each an oom_kill event)
    guest_oom_kills: int = 0


@attrs.frozen
class ModifyRequest:
    """sandvisor extension (Modify): what to change; an absent field stays. ``env`` and
    ``labels`` are merged (a label set to "" is removed)."""

    id: str
    vcpus: int | None = None
    memory_mib: int | None = None
    disk_size_mib: int | None = None
    env: dict[str, str] = attrs.field(factory=dict)
    working_dir: str | None = None
    labels: dict[str, str] = attrs.field(factory=dict)
    ttl_seconds: int | None = None
    idle_timeout_seconds: int | None = None
    dry_run: bool = False
    restart: bool = False  # a change above a ceiling (or of the disk) restarts the sandbox
    ssh_keys_add: list[str] = attrs.field(factory=list)  # OpenSSH public key lines (docs/ssh.md)
    ssh_keys_remove: list[str] = attrs.field(factory=list)
    # env keys removed; ceilings by themselves (a running machine's: restart or next start);
    # policy: "" (restart says), no_restart, restart, next_start (saved for the next
    # start, the running sandbox untouched); secrets added or changed (docs/modify.md)
    env_remove: list[str] = attrs.field(factory=list)
    max_vcpus: int | None = None
    max_memory_mib: int | None = None
    policy: str = ""
    secrets: list[SecretSpec] = attrs.field(factory=list)
    # the egress policy, replaced whole (tap; user with outbound); live on a running sandbox
    egress: EgressSpec | None = None


@attrs.frozen
class ModifyNote:
    field: str
    message: str


@attrs.frozen
class ResizeStatus:
    """A live resize of one resource once Modify answers (docs/modify.md)."""

    resource: str  # cpus, memory
    requested: int = 0
    actual: int = 0  # the guest's (vCPUs online; the memory the balloon leaves it)
    enforced: int = 0  # the host's (the cgroup CPU ceiling in vCPUs; the balloon target)
    state: str = ""  # settled, converging, guest-refused
    why: str = ""


@attrs.frozen
class ModifyChange:
    kind: str  # cpus, memory, disk_size, env, workdir, labels, ttl, idle_timeout
    # applied_live, applied_at_next_boot, applied_by_restart, needs_restart, refused, unchanged
    status: str
    value: str = ""
    previous: str = ""
    why: str = ""


@attrs.frozen
class ModifyResponse:
    changes: list[ModifyChange] = attrs.field(factory=list)
    applied: bool = False  # False: a dry run, or a change refused (then nothing changed)
    dry_run: bool = False
    restarted: bool = False
    note: str = ""  # what the restart meant
    settled: bool = False  # the guest reached the new vCPUs and memory
    settle_seconds: float = 0.0
    policy: str = ""
    conflicts: list[ModifyNote] = attrs.field(factory=list)  # what blocks the plan
    warnings: list[ModifyNote] = attrs.field(factory=list)  # true, not blocking
    resize: list[ResizeStatus] = attrs.field(factory=list)  # a live resize's outcome
    pending: bool = False  # saved for the next start (policy next_start on a running sandbox)


@attrs.frozen
class SetTtlRequest:
    """sandvisor extension: remove the sandbox ``ttl_seconds`` from now (0: never)."""

    id: str
    ttl_seconds: int = 0


@attrs.frozen
class SetTtlResponse:
    expires_at: int = 0  # unix seconds of its removal (0: never)


@attrs.frozen
class ListSandboxesRequest:
    state: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)
    limit: int = 0
    cursor: str = ""
    ancestor: str = ""  # only the forks of this sandbox, and theirs (docs/fork.md)


@attrs.frozen
class SandboxSummary:
    id: str
    state: str
    labels: dict[str, str]
    ip_address: str
    created_at: int
    # sandvisor extensions: the family (docs/fork.md) and the guest's memory
    uid: str = ""
    parent_uid: str = ""
    memory_mib: int = 0


@attrs.frozen
class ListSandboxesResponse:
    sandboxes: list[SandboxSummary]
    next_cursor: str = ""


@attrs.frozen
class SandboxEventsRequest:
    id: str = ""
    action: str = ""
    since: int | None = None  # resume: the events after this cursor first, then the live ones (None: live only)


@attrs.frozen
class SandboxEvent:
    sandbox_id: str
    action: str
    timestamp: int
    attributes: dict[str, str] = attrs.field(factory=dict)
    cursor: int = 0  # its place in the event log (0: not logged): resume with since=cursor
    sequence: int = 0  # its sandbox's count of events (1, 2, ...)


@attrs.frozen
class PingResponse:
    latency_ns: int
    activity: int


@attrs.frozen
class TouchResponse:
    activity: int


@attrs.frozen
class LogsRequest:
    id: str
    tail: int = 0  # 0 = all
    since: int = 0  # unix ns, 0 = start
    until: int = 0  # unix ns, 0 = no end
    cursor: int = 0  # resume after this sequence number
    follow: bool = False
    sources: list[str] = attrs.field(factory=list)  # stdout | stderr | output | system; [] = all


@attrs.frozen
class LogEntry:
    seq: int
    timestamp: int  # unix ns
    source: str  # stdout | stderr | output | system
    data: bytes
    session_id: int = 0  # the Run session that wrote it (increasing per sandbox); 0: none (system)

    def text(self) -> str:
        """The bytes as text (UTF-8; what does not decode is replaced)."""
        return self.data.decode(errors="replace")


@attrs.frozen
class MetricsResponse:
    id: str
    timestamp: int
    cpu_percent: float
    memory_total_bytes: int
    memory_available_bytes: int
    host_rss_bytes: int
    disk_read_bytes: int
    disk_write_bytes: int
    net_rx_bytes: int
    net_tx_bytes: int
    uptime_seconds: float
    cpu_seconds_total: float = 0.0  # host CPU of the VM since it started (a counter)
    # extensions of sandbox.v1: the QEMU cell's cgroup (0 when unjailed)
    cgroup_memory_bytes: int = 0
    cgroup_memory_limit_bytes: int = 0
    cgroup_oom_kills: int = 0
    # the root disk: used and free as the guest's statfs of / says (the guest's word),
    # and what its writable layer (the qcow2 overlay) takes on the host's disk
    root_used_bytes: int = 0
    root_free_bytes: int = 0
    root_host_allocated_bytes: int = 0
    # memory per branch (docs/fork.md): QEMU's resident pages shared with other processes
    # (the family's one memory file) and its own, as the host counts them
    memory_shared_bytes: int = 0
    memory_own_bytes: int = 0
    # the guest kernel's own OOM kills since it booted (the guest's word), beside the cgroup's
    guest_oom_kills: int = 0


@attrs.frozen
class MetricsAllResponse:
    """sandvisor extension: MetricsAll, one sample of every ready or running sandbox."""

    sandboxes: list[MetricsResponse]


@attrs.frozen
class MetricsStreamRequest:
    id: str = ""  # empty: every sandbox
    interval_seconds: float = 1.0


@attrs.frozen
class ExposePortRequest:
    id: str
    sandbox_port: int
    host_port: int = 0
    protocol: str = "tcp"
    host_address: str = ""  # sandvisor extension ("": the sandbox's bind address)


@attrs.frozen
class ExposePortResponse:
    host_port: int
    guest_port: int


@attrs.frozen
class UnexposePortRequest:
    id: str
    sandbox_port: int
    protocol: str = "tcp"


@attrs.frozen
class ListPortsResponse:
    ports: list[PortMapping]
