"""The client protocol of ``sandvisor serve``: the ``sandbox.v1`` service over a Unix socket.

Framing is the guest channel's (``u32be length || msgpack``), with its own cap
(:data:`MAX_FRAME`), in :mod:`supervisor.frames` (its ``FramedStream`` carries these
envelopes for the server and the SDK); the error codes and ``ApiError`` are in
:mod:`supervisor.errors` (both re-exported here). Messages are frozen attrs classes
converted by one cattrs msgpack converter (:data:`converter`); envelopes are a tagged
union on ``"t"``.

Connection: the client sends :class:`ClientHello`, the server answers
:class:`ServerHello` (or :class:`Fail` with id 0 and closes). Then any number of
concurrent calls, each with a client-chosen ``id``:

* unary: ``Call`` -> ``Reply`` | ``Fail``
* server stream: ``Call`` -> ``Item``* -> ``End`` | ``Fail``
* client / bidirectional stream: ``Call`` (first message in ``body``), then
  ``Send``* and ``HalfClose`` from the client, ``Item``* and ``End``/``Reply``/``Fail``
  from the server.
* ``Cancel`` from the client ends a call (the server stops its work); a client that
  disconnects cancels all of its calls.

Bodies are method-specific request/response classes below, named after the seed's
messages, converted with :func:`structure_body` / :func:`unstructure_body`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.preconf.msgpack import make_converter
from cattrs.strategies import configure_tagged_union

from guestd import patch
from supervisor import frames as F
from supervisor.errors import (
    ALREADY_EXISTS,
    CANCELLED,
    CODES,
    DEADLINE_EXCEEDED,
    FAILED_PRECONDITION,
    INTERNAL,
    INVALID_ARGUMENT,
    NOT_FOUND,
    PERMISSION_DENIED,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    UNIMPLEMENTED,
    ApiError,
)
from supervisor.frames import MAX_FRAME, PROTOCOL_VERSION, FrameReader

__all__ = [
    "ALREADY_EXISTS",
    "CANCELLED",
    "CODES",
    "DEADLINE_EXCEEDED",
    "FAILED_PRECONDITION",
    "INTERNAL",
    "INVALID_ARGUMENT",
    "MAX_FRAME",
    "NOT_FOUND",
    "PERMISSION_DENIED",
    "PROTOCOL_VERSION",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "UNIMPLEMENTED",
    "ApiError",
    "FrameReader",
]
T = TypeVar("T")


# --- envelopes ----------------------------------------------------------------------
@attrs.frozen
class ClientHello:
    version: int
    client: str = ""
    # acting for another principal (docs/security.md): honoured from an admin peer only;
    # from anyone else the hello fails PERMISSION_DENIED
    act_as: str = ""
    act_as_admin: bool = False


@attrs.frozen
class ServerHello:
    version: int
    server: str


@attrs.frozen
class Call:
    id: int
    method: str
    body: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Send:
    id: int
    body: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class HalfClose:
    id: int


@attrs.frozen
class Cancel:
    id: int


@attrs.frozen
class Reply:
    id: int
    body: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Item:
    id: int
    body: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class End:
    id: int


@attrs.frozen
class Fail:
    id: int
    code: str
    message: str


Envelope = ClientHello | ServerHello | Call | Send | HalfClose | Cancel | Reply | Item | End | Fail
_ENVELOPES: dict[type, str] = {
    ClientHello: F.HELLO,
    ServerHello: F.HELLO_OK,
    Call: F.CALL,
    Send: F.SEND,
    HalfClose: F.HALF_CLOSE,
    Cancel: F.CANCEL,
    Reply: F.REPLY,
    Item: F.ITEM,
    End: F.END,
    Fail: F.FAIL,
}

# --- bodies (the seed's messages; snake_case fields as in the .proto) ---------------------------


@attrs.frozen
class Empty:
    pass


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
    # the seed's) | "user" (QEMU's slirp: exposed ports only, unless outbound)
    mode: str = ""
    outbound: bool = False  # sandvisor extension: user mode without restrict (the guest may reach out)
    egress: EgressSpec | None = None  # sandvisor extension (None: everything but the host and metadata)


@attrs.frozen
class PortMapping:
    """sandvisor extension: ports exposed at create (``--port HOST:GUEST``), and ListPorts' answer."""

    sandbox_port: int
    host_port: int = 0
    protocol: str = "tcp"
    host_address: str = ""  # set by the server (ListPorts); ignored in requests


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
    # hibernation (issue 25): what the idle timeout does ("stop" or "pause"; "": stop), how
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


@attrs.frozen
class ExecInput:
    """Exactly one of the three is set (the seed's oneof)."""

    init: ExecRequest | None = None
    stdin: bytes | None = None
    resize: TerminalSize | None = None
    close_stdin: bool = False  # sandvisor extension: end of input


ExecOutput = RunOutput


@attrs.frozen
class StopSandboxRequest:
    id: str
    timeout_seconds: int = 0


@attrs.frozen
class RemoveSandboxRequest:
    id: str
    force: bool = False


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
    # sandvisor extensions: read-back (None for the seed's Inspect: it has no field for them)
    requested: SandboxSettings | None = None
    applied: SandboxSettings | None = None  # None: no machine runs
    updated_at: int = 0  # unix seconds of the last Modify that changed something (0: none)
    owner: str = ""  # the principal that made it (docs/security.md)
    ssh_keys: list[str] = attrs.field(factory=list)  # the public keys its SSH endpoint accepts (docs/ssh.md)


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


@attrs.frozen
class SandboxSummary:
    id: str
    state: str
    labels: dict[str, str]
    ip_address: str
    created_at: int


@attrs.frozen
class ListSandboxesResponse:
    sandboxes: list[SandboxSummary]
    next_cursor: str = ""


@attrs.frozen
class SandboxEventsRequest:
    id: str = ""
    action: str = ""


@attrs.frozen
class SandboxEvent:
    sandbox_id: str
    action: str
    timestamp: int
    attributes: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class ReadFileRequest:
    id: str
    path: str


@attrs.frozen
class FileChunk:
    data: bytes = b""
    done: bool = False


@attrs.frozen
class WriteFileOpen:
    id: str
    path: str
    mode: int = 0


@attrs.frozen
class WriteFileRequest:
    open: WriteFileOpen | None = None
    chunk: FileChunk | None = None


@attrs.frozen
class ReadTreeRequest:
    """A guest directory as one tar stream (answered with FileChunk items, the last done)."""

    id: str
    path: str


@attrs.frozen
class WriteTreeOpen:
    id: str
    path: str
    owner: str = ""  # "": the archive's numeric owners; else user[:group] owns every entry


@attrs.frozen
class WriteTreeRequest:
    """A client stream: ``open`` first, then tar bytes in ``chunk``s (the last done)."""

    open: WriteTreeOpen | None = None
    chunk: FileChunk | None = None


@attrs.frozen
class WriteTreeResponse:
    entries: int


@attrs.frozen
class FsPathRequest:
    """FsList (a directory's entries), FsStat (the path itself), FsExists."""

    id: str
    path: str


@attrs.frozen
class FsEntry:
    """One file of FsList or FsStat (symlinks are reported as links, not followed)."""

    name: str  # the entry's name (FsStat: the path)
    path: str  # its absolute path
    kind: str  # file | dir | symlink | other
    size: int = 0
    mode: int = 0  # permission bits
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0  # unix ns
    target: str = ""  # a symlink's target


@attrs.frozen
class FsListResponse:
    entries: list[FsEntry] = attrs.field(factory=list)


@attrs.frozen
class FsExistsResponse:
    exists: bool = False


@attrs.frozen
class FsMkdirRequest:
    id: str
    path: str
    parents: bool = False  # mkdir -p: parents too, and an existing directory is fine
    mode: int = 0  # permission bits; 0 = 0755


@attrs.frozen
class FsRemoveRequest:
    id: str
    path: str
    recursive: bool = False  # a directory and everything in it (else: empty directories only)


@attrs.frozen
class FsRenameRequest:
    id: str
    path: str
    dest: str


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


# --- the server and its images (sandvisor extensions) ---------------------------------
@attrs.frozen
class CreateVolumeRequest:
    name: str
    size_mib: int = 0  # 0: 256 MiB
    labels: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class VolumeInfo:
    name: str
    size_mib: int
    created_at: int  # unix seconds
    labels: dict[str, str] = attrs.field(factory=dict)
    mounted_by: list[str] = attrs.field(factory=list)  # live sandboxes that mount it now


@attrs.frozen
class ListVolumesRequest:
    labels: dict[str, str] = attrs.field(factory=dict)  # every one of them must match


@attrs.frozen
class ListVolumesResponse:
    volumes: list[VolumeInfo] = attrs.field(factory=list)


@attrs.frozen
class DeleteVolumeRequest:
    name: str
    force: bool = False  # kill the live sandboxes that mount it first (else FAILED_PRECONDITION)


@attrs.frozen
class NameRequest:
    name: str = ""


@attrs.frozen
class ServerInfo:
    version: str
    accel: str
    max_sandboxes: int
    sandboxes_by_state: dict[str, int]
    default_image: str
    services: list[str]


@attrs.frozen
class ImageInfo:
    name: str
    kernel: str
    initrd: str
    rootfs: str
    kernel_version: str
    keys: dict[str, str]
    is_default: bool
    size_bytes: int  # on disk (the rootfs is sparse)
    built_at: int  # unix seconds


@attrs.frozen
class OciImageInfo:
    """An OCI image in the supervisor's store (issue 15): what ``image ls`` shows and
    the defaults a sandbox of it gets (env, working_dir, user, entrypoint + cmd)."""

    id: str  # 12 hex digits of the digest
    digest: str  # the manifest's "sha256:...": the cache key
    refs: list[str]  # canonical references that name it here ("": dangling)
    config_digest: str = ""
    size_bytes: int = 0  # the unpacked tree
    disk_bytes: int = 0  # the ext4 file's virtual size (sparse)
    download_bytes: int = 0  # the layers as the source stores them
    layers: int = 0
    source: str = ""  # the reference it was first pulled from
    pulled_at: int = 0  # unix seconds
    in_use: bool = False  # a sandbox, snapshot or template stands on it (rm refuses)
    env: list[str] = attrs.field(factory=list)  # "KEY=VALUE"
    working_dir: str = ""
    user: str = ""
    entrypoint: list[str] = attrs.field(factory=list)
    cmd: list[str] = attrs.field(factory=list)


@attrs.frozen
class ListImagesResponse:
    images: list[ImageInfo]
    oci_images: list[OciImageInfo] = attrs.field(factory=list)  # sandvisor: the OCI store


@attrs.frozen
class PullImageRequest:
    """PullImage: ``ref`` as skopeo spells it (docker://HOST/NAME:TAG, @sha256:...,
    docker-archive:PATH, oci-archive:PATH, oci:DIR[:TAG]). ``creds`` ("USER:PASSWORD")
    or ``auth_json`` (the content of a docker-style auth file: the client reads the
    file, the supervisor never opens a path its client names). Neither is logged."""

    ref: str
    policy: str = ""  # always | if-missing (""; the default) | never
    tls_verify: bool | None = None  # False: a plain-HTTP registry; None: verify
    creds: str = attrs.field(default="", repr=False)
    auth_json: bytes = attrs.field(default=b"", repr=False)
    ca_pem: bytes = attrs.field(default=b"", repr=False)  # the registry's CA certificates (PEM)


@attrs.frozen
class PullImageProgress:
    """One item of PullImage's stream. ``phase``: resolving | cached | waiting |
    downloading | unpacking | converting | done; ``done``/``total`` are bytes while
    downloading. The last item is ``done`` with ``image`` set."""

    phase: str
    message: str = ""
    done: int = 0
    total: int = 0
    digest: str = ""
    image: OciImageInfo | None = None


@attrs.frozen
class ImageRefRequest:
    ref: str  # a reference, a digest, or 12+ hex digits of one


@attrs.frozen
class RemoveImageResponse:
    untagged: list[str]  # references removed
    deleted: list[str]  # digests of images deleted
    freed_bytes: int = 0


@attrs.frozen
class PruneImagesRequest:
    dangling_only: bool = False  # only images no reference names


@attrs.frozen
class PruneImagesResponse:
    deleted: list[str]
    blobs_deleted: int = 0
    freed_bytes: int = 0


# --- SandboxSnapshotService -----------------------------------------------------------
@attrs.frozen
class CheckpointRequest:
    sandbox_id: str
    name: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class CheckpointResponse:
    snapshot_id: str
    snapshot_dir: str
    created_at: str  # RFC3339
    # extensions: what the checkpoint wrote and how long the guest was paused
    size_bytes: int = 0
    memory: str = ""  # "mapped" (RAM file, restores map it), "streamed" (RAM in vmstate), "disk" (none)
    paused_ms: float = 0.0
    disk_only: bool = False  # a stopped sandbox's disk: its restores boot


@attrs.frozen
class RestoreRequest:
    snapshot_id: str  # a snapshot id, or a snapshot name that is unique
    id: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)
    network_override: bool = False  # tap: a fresh address even when the snapshot's is free
    ttl_seconds: int = 0


@attrs.frozen
class RestoreResponse:
    id: str
    ip_address: str = ""


@attrs.frozen
class ListSnapshotsRequest:
    sandbox_id: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class SnapshotSummary:
    id: str
    sandbox_id: str
    name: str
    labels: dict[str, str]
    snapshot_dir: str
    created_at: str  # RFC3339
    # extensions: what a restore keeps of its origin (its network mode, secrets' names, host directories)
    network: str = ""
    secrets: list[str] = attrs.field(factory=list)
    host_mounts: int = 0
    size_bytes: int = 0
    memory: str = ""
    memory_mib: int = 0
    pool_ready: int = 0  # warm pool members ready for this snapshot
    disk_only: bool = False  # a stopped sandbox's disk (memory "disk"): its restores boot


@attrs.frozen
class ListSnapshotsResponse:
    snapshots: list[SnapshotSummary]


@attrs.frozen
class DeleteSnapshotRequest:
    snapshot_id: str


@attrs.frozen
class ExportSnapshotRequest:
    """A server stream of FileChunks: the snapshot as one export file (the last chunk done)."""

    snapshot_id: str  # an id, or a unique name
    include_base: bool = False  # carry the image layers too (else named: the importer must have them)


@attrs.frozen
class ImportSnapshotOpen:
    name: str = ""  # "": the export's own name
    labels: dict[str, str] = attrs.field(factory=dict)  # added to (and overriding) the export's own


@attrs.frozen
class ImportSnapshotRequest:
    """A client stream: ``open`` first, then the export's bytes in ``chunk``s (the last done)."""

    open: ImportSnapshotOpen | None = None
    chunk: FileChunk | None = None


# --- the converter -------------------------------------------------------------------
converter = make_converter(forbid_extra_keys=False)


def _strict(t: type) -> Any:
    """Wrong field types are errors, not silently coerced (cattrs would str(5) a name)."""

    def hook(value: Any, _: Any) -> Any:
        if type(value) is t or (t is float and type(value) is int):
            return value
        raise TypeError(f"expected {t.__name__}, got {type(value).__name__}")

    return hook


for _t in (str, int, bool, bytes, float):
    converter.register_structure_hook(_t, _strict(_t))


def _is_list(t: Any) -> bool:
    return getattr(t, "__origin__", None) is list


def _strict_list(value: Any, t: Any) -> list[Any]:
    """A list field takes a list: a string must not be split into its characters."""
    if type(value) is not list:
        raise TypeError(f"expected a list, got {type(value).__name__}")
    (item,) = t.__args__
    return [converter.structure(v, item) for v in value]


converter.register_structure_hook_func(_is_list, _strict_list)
configure_tagged_union(Envelope, converter, tag_name="t", tag_generator=lambda cl: _ENVELOPES[cl])


def encode(msg: Envelope) -> bytes:
    """An envelope as a whole frame (header included); over the cap: RESOURCE_EXHAUSTED."""
    return F.frame(converter.dumps(msg, Envelope))


def decode(body: bytes) -> Envelope:
    """A frame body as an envelope; anything else is INVALID_ARGUMENT."""
    try:
        return converter.loads(body, Envelope)  # type: ignore[arg-type]
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
        raise ApiError(INVALID_ARGUMENT, f"malformed message: {_why(exc)}") from None
    except Exception as exc:  # msgpack's own zoo
        raise ApiError(INVALID_ARGUMENT, f"malformed message: {type(exc).__name__}") from None


def structure_body(body: dict[str, Any], cls: type[T]) -> T:
    """A request body into its class; wrong shapes are INVALID_ARGUMENT, with the field."""
    try:
        return converter.structure(body, cls)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ApiError(INVALID_ARGUMENT, f"invalid {cls.__name__}: {_why(exc)}") from None


def unstructure_body(obj: Any) -> dict[str, Any]:
    out = converter.unstructure(obj)
    assert isinstance(out, dict)
    return out


def _why(exc: BaseException) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        notes = cattrs.transform_error(exc)
        return "; ".join(notes)[:500]
    return f"{type(exc).__name__}: {exc}"[:500]


# --- secrets (docs/secrets.md) ----------------------------------------------------------------
@attrs.frozen
class SetSecretRequest:
    """An entry of the supervisor's secret store (made or replaced: a rotation of every
    sandbox whose secret names it), and the hosts its value may go to (none: the
    entry's own are kept; a new entry must be given them)."""

    name: str
    value: bytes
    hosts: list[str] = attrs.field(factory=list)

    def __repr__(self) -> str:
        return f"SetSecretRequest(name={self.name!r}, hosts={self.hosts!r})"


@attrs.frozen
class ListSecretsResponse:
    names: list[str]  # the store's entries (never a value)


@attrs.frozen
class RotateSecretRequest:
    """A sandbox's own secret gets a new value (the placeholder stays)."""

    id: str
    name: str
    value: bytes

    def __repr__(self) -> str:
        return f"RotateSecretRequest(id={self.id!r}, name={self.name!r})"


@attrs.frozen
class SandboxSecretRequest:
    id: str
    name: str


@attrs.frozen
class SandboxSecretInfo:
    name: str
    hosts: list[str]
    placeholder: str
    source: str  # "value" (the sandbox's own) | "store:NAME"
    removed: bool
    substitute: str = "headers"  # "headers" | "all"


@attrs.frozen
class SandboxSecretsResponse:
    secrets: list[SandboxSecretInfo]
