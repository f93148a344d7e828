from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as _sandbox_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DiffRequest(_message.Message):
    __slots__ = ("id", "other", "path", "fork_point", "snapshot", "content")
    ID_FIELD_NUMBER: _ClassVar[int]
    OTHER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FORK_POINT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    id: str
    other: str
    path: str
    fork_point: bool
    snapshot: str
    content: str
    def __init__(self, id: _Optional[str] = ..., other: _Optional[str] = ..., path: _Optional[str] = ..., fork_point: _Optional[bool] = ..., snapshot: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class DiffChange(_message.Message):
    __slots__ = ("path", "change", "kind_a", "size_a", "mode_a", "hash_a", "kind_b", "size_b", "mode_b", "hash_b")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    KIND_A_FIELD_NUMBER: _ClassVar[int]
    SIZE_A_FIELD_NUMBER: _ClassVar[int]
    MODE_A_FIELD_NUMBER: _ClassVar[int]
    HASH_A_FIELD_NUMBER: _ClassVar[int]
    KIND_B_FIELD_NUMBER: _ClassVar[int]
    SIZE_B_FIELD_NUMBER: _ClassVar[int]
    MODE_B_FIELD_NUMBER: _ClassVar[int]
    HASH_B_FIELD_NUMBER: _ClassVar[int]
    path: str
    change: str
    kind_a: str
    size_a: int
    mode_a: int
    hash_a: str
    kind_b: str
    size_b: int
    mode_b: int
    hash_b: str
    def __init__(self, path: _Optional[str] = ..., change: _Optional[str] = ..., kind_a: _Optional[str] = ..., size_a: _Optional[int] = ..., mode_a: _Optional[int] = ..., hash_a: _Optional[str] = ..., kind_b: _Optional[str] = ..., size_b: _Optional[int] = ..., mode_b: _Optional[int] = ..., hash_b: _Optional[str] = ...) -> None: ...

class DiffResponse(_message.Message):
    __slots__ = ("changes", "entries_a", "entries_b", "base", "content_a", "content_b", "found_a", "found_b")
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_A_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_B_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_A_FIELD_NUMBER: _ClassVar[int]
    CONTENT_B_FIELD_NUMBER: _ClassVar[int]
    FOUND_A_FIELD_NUMBER: _ClassVar[int]
    FOUND_B_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[DiffChange]
    entries_a: int
    entries_b: int
    base: str
    content_a: bytes
    content_b: bytes
    found_a: bool
    found_b: bool
    def __init__(self, changes: _Optional[_Iterable[_Union[DiffChange, _Mapping]]] = ..., entries_a: _Optional[int] = ..., entries_b: _Optional[int] = ..., base: _Optional[str] = ..., content_a: _Optional[bytes] = ..., content_b: _Optional[bytes] = ..., found_a: _Optional[bool] = ..., found_b: _Optional[bool] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("id", "count", "names", "name_prefix", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    NAME_PREFIX_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    id: str
    count: int
    names: _containers.RepeatedScalarFieldContainer[str]
    name_prefix: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., count: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., name_prefix: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ForkedSandbox(_message.Message):
    __slots__ = ("id", "ip_address", "uid")
    ID_FIELD_NUMBER: _ClassVar[int]
    IP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    id: str
    ip_address: str
    uid: str
    def __init__(self, id: _Optional[str] = ..., ip_address: _Optional[str] = ..., uid: _Optional[str] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("sandboxes", "snapshot_id", "paused_ms")
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    PAUSED_MS_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[ForkedSandbox]
    snapshot_id: str
    paused_ms: float
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[ForkedSandbox, _Mapping]]] = ..., snapshot_id: _Optional[str] = ..., paused_ms: _Optional[float] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ReadTreeRequest(_message.Message):
    __slots__ = ("id", "path")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class WriteTreeOpen(_message.Message):
    __slots__ = ("id", "path", "owner")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    owner: str
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class WriteTreeRequest(_message.Message):
    __slots__ = ("open", "chunk")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    open: WriteTreeOpen
    chunk: _sandbox_pb2.FileChunk
    def __init__(self, open: _Optional[_Union[WriteTreeOpen, _Mapping]] = ..., chunk: _Optional[_Union[_sandbox_pb2.FileChunk, _Mapping]] = ...) -> None: ...

class WriteTreeResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    def __init__(self, entries: _Optional[int] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("base", "script")
    BASE_FIELD_NUMBER: _ClassVar[int]
    SCRIPT_FIELD_NUMBER: _ClassVar[int]
    base: _sandbox_pb2.RunRequest
    script: str
    def __init__(self, base: _Optional[_Union[_sandbox_pb2.RunRequest, _Mapping]] = ..., script: _Optional[str] = ...) -> None: ...

class PatchSpec(_message.Message):
    __slots__ = ("op", "path", "data", "target", "mode", "owner", "replace", "source")
    OP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    op: str
    path: str
    data: bytes
    target: str
    mode: int
    owner: str
    replace: bool
    source: str
    def __init__(self, op: _Optional[str] = ..., path: _Optional[str] = ..., data: _Optional[bytes] = ..., target: _Optional[str] = ..., mode: _Optional[int] = ..., owner: _Optional[str] = ..., replace: _Optional[bool] = ..., source: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "accel", "max_sandboxes", "sandboxes_by_state", "default_image", "services")
    class SandboxesByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEL_FIELD_NUMBER: _ClassVar[int]
    MAX_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_IMAGE_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    version: str
    accel: str
    max_sandboxes: int
    sandboxes_by_state: _containers.ScalarMap[str, int]
    default_image: str
    services: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[str] = ..., accel: _Optional[str] = ..., max_sandboxes: _Optional[int] = ..., sandboxes_by_state: _Optional[_Mapping[str, int]] = ..., default_image: _Optional[str] = ..., services: _Optional[_Iterable[str]] = ...) -> None: ...

class PortMapping(_message.Message):
    __slots__ = ("sandbox_port", "host_port", "protocol", "host_address")
    SANDBOX_PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    HOST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    sandbox_port: int
    host_port: int
    protocol: str
    host_address: str
    def __init__(self, sandbox_port: _Optional[int] = ..., host_port: _Optional[int] = ..., protocol: _Optional[str] = ..., host_address: _Optional[str] = ...) -> None: ...

class VolumeMount(_message.Message):
    __slots__ = ("volume", "target", "readonly")
    VOLUME_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    READONLY_FIELD_NUMBER: _ClassVar[int]
    volume: str
    target: str
    readonly: bool
    def __init__(self, volume: _Optional[str] = ..., target: _Optional[str] = ..., readonly: _Optional[bool] = ...) -> None: ...

class TmpfsMount(_message.Message):
    __slots__ = ("target", "size_mib")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SIZE_MIB_FIELD_NUMBER: _ClassVar[int]
    target: str
    size_mib: int
    def __init__(self, target: _Optional[str] = ..., size_mib: _Optional[int] = ...) -> None: ...

class HostMount(_message.Message):
    __slots__ = ("source", "target", "writable")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    source: str
    target: str
    writable: bool
    def __init__(self, source: _Optional[str] = ..., target: _Optional[str] = ..., writable: _Optional[bool] = ...) -> None: ...

class CreateRequest(_message.Message):
    __slots__ = ("base", "idle_timeout_seconds", "hostname", "ephemeral", "ports", "outbound", "volumes", "image_pull", "image_tls_verify", "patches", "scripts", "tmpfs", "host_mounts", "on_idle", "paused_ttl_seconds", "no_auto_resume", "max_vcpus", "max_memory_mib", "disk_size_mib", "secrets", "egress", "image_creds", "image_auth_json", "image_ca_pem", "entrypoint", "entrypoint_cleared", "cmd_cleared", "shell", "security_profile", "log_level", "quiet_logs", "thp", "network_profile", "port_address", "dns", "init", "rootfs_fstype", "from_snapshot", "ttl_action", "kill_timeout_seconds")
    class ScriptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BASE_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_FIELD_NUMBER: _ClassVar[int]
    VOLUMES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PULL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TLS_VERIFY_FIELD_NUMBER: _ClassVar[int]
    PATCHES_FIELD_NUMBER: _ClassVar[int]
    SCRIPTS_FIELD_NUMBER: _ClassVar[int]
    TMPFS_FIELD_NUMBER: _ClassVar[int]
    HOST_MOUNTS_FIELD_NUMBER: _ClassVar[int]
    ON_IDLE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NO_AUTO_RESUME_FIELD_NUMBER: _ClassVar[int]
    MAX_VCPUS_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    DISK_SIZE_MIB_FIELD_NUMBER: _ClassVar[int]
    SECRETS_FIELD_NUMBER: _ClassVar[int]
    EGRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CREDS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_AUTH_JSON_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CA_PEM_FIELD_NUMBER: _ClassVar[int]
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    ENTRYPOINT_CLEARED_FIELD_NUMBER: _ClassVar[int]
    CMD_CLEARED_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    SECURITY_PROFILE_FIELD_NUMBER: _ClassVar[int]
    LOG_LEVEL_FIELD_NUMBER: _ClassVar[int]
    QUIET_LOGS_FIELD_NUMBER: _ClassVar[int]
    THP_FIELD_NUMBER: _ClassVar[int]
    NETWORK_PROFILE_FIELD_NUMBER: _ClassVar[int]
    PORT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DNS_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    ROOTFS_FSTYPE_FIELD_NUMBER: _ClassVar[int]
    FROM_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    TTL_ACTION_FIELD_NUMBER: _ClassVar[int]
    KILL_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    base: _sandbox_pb2.CreateSandboxRequest
    idle_timeout_seconds: int
    hostname: str
    ephemeral: bool
    ports: _containers.RepeatedCompositeFieldContainer[PortMapping]
    outbound: bool
    volumes: _containers.RepeatedCompositeFieldContainer[VolumeMount]
    image_pull: str
    image_tls_verify: bool
    patches: _containers.RepeatedCompositeFieldContainer[PatchSpec]
    scripts: _containers.ScalarMap[str, str]
    tmpfs: _containers.RepeatedCompositeFieldContainer[TmpfsMount]
    host_mounts: _containers.RepeatedCompositeFieldContainer[HostMount]
    on_idle: str
    paused_ttl_seconds: int
    no_auto_resume: bool
    max_vcpus: int
    max_memory_mib: int
    disk_size_mib: int
    secrets: _containers.RepeatedCompositeFieldContainer[SecretSpec]
    egress: EgressPolicy
    image_creds: str
    image_auth_json: bytes
    image_ca_pem: bytes
    entrypoint: _containers.RepeatedScalarFieldContainer[str]
    entrypoint_cleared: bool
    cmd_cleared: bool
    shell: str
    security_profile: str
    log_level: str
    quiet_logs: bool
    thp: str
    network_profile: str
    port_address: str
    dns: DnsSpec
    init: InitSpec
    rootfs_fstype: str
    from_snapshot: str
    ttl_action: str
    kill_timeout_seconds: int
    def __init__(self, base: _Optional[_Union[_sandbox_pb2.CreateSandboxRequest, _Mapping]] = ..., idle_timeout_seconds: _Optional[int] = ..., hostname: _Optional[str] = ..., ephemeral: _Optional[bool] = ..., ports: _Optional[_Iterable[_Union[PortMapping, _Mapping]]] = ..., outbound: _Optional[bool] = ..., volumes: _Optional[_Iterable[_Union[VolumeMount, _Mapping]]] = ..., image_pull: _Optional[str] = ..., image_tls_verify: _Optional[bool] = ..., patches: _Optional[_Iterable[_Union[PatchSpec, _Mapping]]] = ..., scripts: _Optional[_Mapping[str, str]] = ..., tmpfs: _Optional[_Iterable[_Union[TmpfsMount, _Mapping]]] = ..., host_mounts: _Optional[_Iterable[_Union[HostMount, _Mapping]]] = ..., on_idle: _Optional[str] = ..., paused_ttl_seconds: _Optional[int] = ..., no_auto_resume: _Optional[bool] = ..., max_vcpus: _Optional[int] = ..., max_memory_mib: _Optional[int] = ..., disk_size_mib: _Optional[int] = ..., secrets: _Optional[_Iterable[_Union[SecretSpec, _Mapping]]] = ..., egress: _Optional[_Union[EgressPolicy, _Mapping]] = ..., image_creds: _Optional[str] = ..., image_auth_json: _Optional[bytes] = ..., image_ca_pem: _Optional[bytes] = ..., entrypoint: _Optional[_Iterable[str]] = ..., entrypoint_cleared: _Optional[bool] = ..., cmd_cleared: _Optional[bool] = ..., shell: _Optional[str] = ..., security_profile: _Optional[str] = ..., log_level: _Optional[str] = ..., quiet_logs: _Optional[bool] = ..., thp: _Optional[str] = ..., network_profile: _Optional[str] = ..., port_address: _Optional[str] = ..., dns: _Optional[_Union[DnsSpec, _Mapping]] = ..., init: _Optional[_Union[InitSpec, _Mapping]] = ..., rootfs_fstype: _Optional[str] = ..., from_snapshot: _Optional[str] = ..., ttl_action: _Optional[str] = ..., kill_timeout_seconds: _Optional[int] = ...) -> None: ...

class DnsSpec(_message.Message):
    __slots__ = ("nameservers", "search")
    NAMESERVERS_FIELD_NUMBER: _ClassVar[int]
    SEARCH_FIELD_NUMBER: _ClassVar[int]
    nameservers: _containers.RepeatedScalarFieldContainer[str]
    search: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, nameservers: _Optional[_Iterable[str]] = ..., search: _Optional[_Iterable[str]] = ...) -> None: ...

class InitSpec(_message.Message):
    __slots__ = ("path", "args", "env")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PATH_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    path: str
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    def __init__(self, path: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EgressPolicy(_message.Message):
    __slots__ = ("default", "allow", "deny")
    DEFAULT_FIELD_NUMBER: _ClassVar[int]
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    DENY_FIELD_NUMBER: _ClassVar[int]
    default: str
    allow: _containers.RepeatedScalarFieldContainer[str]
    deny: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, default: _Optional[str] = ..., allow: _Optional[_Iterable[str]] = ..., deny: _Optional[_Iterable[str]] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class KillRequest(_message.Message):
    __slots__ = ("id", "timeout_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    timeout_seconds: int
    def __init__(self, id: _Optional[str] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("id", "grace_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    grace_seconds: int
    def __init__(self, id: _Optional[str] = ..., grace_seconds: _Optional[int] = ...) -> None: ...

class RequestStopRequest(_message.Message):
    __slots__ = ("id", "timeout_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    timeout_seconds: int
    def __init__(self, id: _Optional[str] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class StopCause(_message.Message):
    __slots__ = ("ending", "source", "by", "exit_code", "signal", "detail", "sentence")
    ENDING_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SENTENCE_FIELD_NUMBER: _ClassVar[int]
    ending: str
    source: str
    by: str
    exit_code: int
    signal: int
    detail: str
    sentence: str
    def __init__(self, ending: _Optional[str] = ..., source: _Optional[str] = ..., by: _Optional[str] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., detail: _Optional[str] = ..., sentence: _Optional[str] = ...) -> None: ...

class WaitUntilStoppedRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("base", "limit", "cursor")
    BASE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    base: _sandbox_pb2.ListSandboxesRequest
    limit: int
    cursor: str
    def __init__(self, base: _Optional[_Union[_sandbox_pb2.ListSandboxesRequest, _Mapping]] = ..., limit: _Optional[int] = ..., cursor: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("sandboxes", "next_cursor")
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[_sandbox_pb2.SandboxSummary]
    next_cursor: str
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[_sandbox_pb2.SandboxSummary, _Mapping]]] = ..., next_cursor: _Optional[str] = ...) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("id", "tail", "since", "until", "cursor", "follow", "sources")
    ID_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    id: str
    tail: int
    since: int
    until: int
    cursor: int
    follow: bool
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., tail: _Optional[int] = ..., since: _Optional[int] = ..., until: _Optional[int] = ..., cursor: _Optional[int] = ..., follow: _Optional[bool] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class LogEntry(_message.Message):
    __slots__ = ("seq", "timestamp", "source", "data", "session_id")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    seq: int
    timestamp: int
    source: str
    data: bytes
    session_id: int
    def __init__(self, seq: _Optional[int] = ..., timestamp: _Optional[int] = ..., source: _Optional[str] = ..., data: _Optional[bytes] = ..., session_id: _Optional[int] = ...) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class MetricsStreamRequest(_message.Message):
    __slots__ = ("id", "interval_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    interval_seconds: float
    def __init__(self, id: _Optional[str] = ..., interval_seconds: _Optional[float] = ...) -> None: ...

class SandboxMetrics(_message.Message):
    __slots__ = ("id", "timestamp", "cpu_percent", "memory_total_bytes", "memory_available_bytes", "host_rss_bytes", "disk_read_bytes", "disk_write_bytes", "net_rx_bytes", "net_tx_bytes", "uptime_seconds", "cpu_seconds_total", "root_used_bytes", "root_free_bytes", "root_host_allocated_bytes", "memory_shared_bytes", "memory_own_bytes", "cgroup_oom_kills", "guest_oom_kills")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NET_RX_BYTES_FIELD_NUMBER: _ClassVar[int]
    NET_TX_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROOT_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROOT_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROOT_HOST_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_OWN_BYTES_FIELD_NUMBER: _ClassVar[int]
    CGROUP_OOM_KILLS_FIELD_NUMBER: _ClassVar[int]
    GUEST_OOM_KILLS_FIELD_NUMBER: _ClassVar[int]
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
    cpu_seconds_total: float
    root_used_bytes: int
    root_free_bytes: int
    root_host_allocated_bytes: int
    memory_shared_bytes: int
    memory_own_bytes: int
    cgroup_oom_kills: int
    guest_oom_kills: int
    def __init__(self, id: _Optional[str] = ..., timestamp: _Optional[int] = ..., cpu_percent: _Optional[float] = ..., memory_total_bytes: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., host_rss_bytes: _Optional[int] = ..., disk_read_bytes: _Optional[int] = ..., disk_write_bytes: _Optional[int] = ..., net_rx_bytes: _Optional[int] = ..., net_tx_bytes: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., cpu_seconds_total: _Optional[float] = ..., root_used_bytes: _Optional[int] = ..., root_free_bytes: _Optional[int] = ..., root_host_allocated_bytes: _Optional[int] = ..., memory_shared_bytes: _Optional[int] = ..., memory_own_bytes: _Optional[int] = ..., cgroup_oom_kills: _Optional[int] = ..., guest_oom_kills: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("latency_ns", "activity")
    LATENCY_NS_FIELD_NUMBER: _ClassVar[int]
    ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    latency_ns: int
    activity: int
    def __init__(self, latency_ns: _Optional[int] = ..., activity: _Optional[int] = ...) -> None: ...

class TouchRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class TouchResponse(_message.Message):
    __slots__ = ("activity",)
    ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    activity: int
    def __init__(self, activity: _Optional[int] = ...) -> None: ...

class SetTtlRequest(_message.Message):
    __slots__ = ("id", "ttl_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    ttl_seconds: int
    def __init__(self, id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class SetTtlResponse(_message.Message):
    __slots__ = ("expires_at",)
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    expires_at: int
    def __init__(self, expires_at: _Optional[int] = ...) -> None: ...

class ListPortsRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListPortsResponse(_message.Message):
    __slots__ = ("ports",)
    PORTS_FIELD_NUMBER: _ClassVar[int]
    ports: _containers.RepeatedCompositeFieldContainer[PortMapping]
    def __init__(self, ports: _Optional[_Iterable[_Union[PortMapping, _Mapping]]] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("base", "size_bytes", "memory", "paused_ms", "disk_only")
    BASE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    PAUSED_MS_FIELD_NUMBER: _ClassVar[int]
    DISK_ONLY_FIELD_NUMBER: _ClassVar[int]
    base: _sandbox_pb2.CheckpointResponse
    size_bytes: int
    memory: str
    paused_ms: float
    disk_only: bool
    def __init__(self, base: _Optional[_Union[_sandbox_pb2.CheckpointResponse, _Mapping]] = ..., size_bytes: _Optional[int] = ..., memory: _Optional[str] = ..., paused_ms: _Optional[float] = ..., disk_only: _Optional[bool] = ...) -> None: ...

class SnapshotSummary(_message.Message):
    __slots__ = ("base", "size_bytes", "memory", "memory_mib", "pool_ready", "disk_only")
    BASE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    POOL_READY_FIELD_NUMBER: _ClassVar[int]
    DISK_ONLY_FIELD_NUMBER: _ClassVar[int]
    base: _sandbox_pb2.SnapshotSummary
    size_bytes: int
    memory: str
    memory_mib: int
    pool_ready: int
    disk_only: bool
    def __init__(self, base: _Optional[_Union[_sandbox_pb2.SnapshotSummary, _Mapping]] = ..., size_bytes: _Optional[int] = ..., memory: _Optional[str] = ..., memory_mib: _Optional[int] = ..., pool_ready: _Optional[int] = ..., disk_only: _Optional[bool] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotSummary]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotSummary, _Mapping]]] = ...) -> None: ...

class ListImagesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImageInfo(_message.Message):
    __slots__ = ("name", "kernel", "initrd", "rootfs", "kernel_version", "keys", "is_default", "size_bytes", "built_at")
    class KeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    INITRD_FIELD_NUMBER: _ClassVar[int]
    ROOTFS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUILT_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kernel: str
    initrd: str
    rootfs: str
    kernel_version: str
    keys: _containers.ScalarMap[str, str]
    is_default: bool
    size_bytes: int
    built_at: int
    def __init__(self, name: _Optional[str] = ..., kernel: _Optional[str] = ..., initrd: _Optional[str] = ..., rootfs: _Optional[str] = ..., kernel_version: _Optional[str] = ..., keys: _Optional[_Mapping[str, str]] = ..., is_default: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., built_at: _Optional[int] = ...) -> None: ...

class ListImagesResponse(_message.Message):
    __slots__ = ("images", "oci_images")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    OCI_IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageInfo]
    oci_images: _containers.RepeatedCompositeFieldContainer[OciImageInfo]
    def __init__(self, images: _Optional[_Iterable[_Union[ImageInfo, _Mapping]]] = ..., oci_images: _Optional[_Iterable[_Union[OciImageInfo, _Mapping]]] = ...) -> None: ...

class OciImageInfo(_message.Message):
    __slots__ = ("id", "digest", "refs", "config_digest", "size_bytes", "disk_bytes", "download_bytes", "layers", "source", "pulled_at", "in_use", "env", "working_dir", "user", "entrypoint", "cmd")
    ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PULLED_AT_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    id: str
    digest: str
    refs: _containers.RepeatedScalarFieldContainer[str]
    config_digest: str
    size_bytes: int
    disk_bytes: int
    download_bytes: int
    layers: int
    source: str
    pulled_at: int
    in_use: bool
    env: _containers.RepeatedScalarFieldContainer[str]
    working_dir: str
    user: str
    entrypoint: _containers.RepeatedScalarFieldContainer[str]
    cmd: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., digest: _Optional[str] = ..., refs: _Optional[_Iterable[str]] = ..., config_digest: _Optional[str] = ..., size_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., download_bytes: _Optional[int] = ..., layers: _Optional[int] = ..., source: _Optional[str] = ..., pulled_at: _Optional[int] = ..., in_use: _Optional[bool] = ..., env: _Optional[_Iterable[str]] = ..., working_dir: _Optional[str] = ..., user: _Optional[str] = ..., entrypoint: _Optional[_Iterable[str]] = ..., cmd: _Optional[_Iterable[str]] = ...) -> None: ...

class PullImageRequest(_message.Message):
    __slots__ = ("ref", "policy", "tls_verify", "creds", "auth_json", "ca_pem")
    REF_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TLS_VERIFY_FIELD_NUMBER: _ClassVar[int]
    CREDS_FIELD_NUMBER: _ClassVar[int]
    AUTH_JSON_FIELD_NUMBER: _ClassVar[int]
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    ref: str
    policy: str
    tls_verify: bool
    creds: str
    auth_json: bytes
    ca_pem: bytes
    def __init__(self, ref: _Optional[str] = ..., policy: _Optional[str] = ..., tls_verify: _Optional[bool] = ..., creds: _Optional[str] = ..., auth_json: _Optional[bytes] = ..., ca_pem: _Optional[bytes] = ...) -> None: ...

class PullImageProgress(_message.Message):
    __slots__ = ("phase", "message", "done", "total", "digest", "image")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    phase: str
    message: str
    done: int
    total: int
    digest: str
    image: OciImageInfo
    def __init__(self, phase: _Optional[str] = ..., message: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., digest: _Optional[str] = ..., image: _Optional[_Union[OciImageInfo, _Mapping]] = ...) -> None: ...

class RemoveImageRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: str
    def __init__(self, ref: _Optional[str] = ...) -> None: ...

class RemoveImageResponse(_message.Message):
    __slots__ = ("untagged", "deleted", "freed_bytes")
    UNTAGGED_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    untagged: _containers.RepeatedScalarFieldContainer[str]
    deleted: _containers.RepeatedScalarFieldContainer[str]
    freed_bytes: int
    def __init__(self, untagged: _Optional[_Iterable[str]] = ..., deleted: _Optional[_Iterable[str]] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class PruneImagesRequest(_message.Message):
    __slots__ = ("dangling_only",)
    DANGLING_ONLY_FIELD_NUMBER: _ClassVar[int]
    dangling_only: bool
    def __init__(self, dangling_only: _Optional[bool] = ...) -> None: ...

class PruneImagesResponse(_message.Message):
    __slots__ = ("deleted", "blobs_deleted", "freed_bytes")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    BLOBS_DELETED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    deleted: _containers.RepeatedScalarFieldContainer[str]
    blobs_deleted: int
    freed_bytes: int
    def __init__(self, deleted: _Optional[_Iterable[str]] = ..., blobs_deleted: _Optional[int] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class InspectImageRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class BuildImageRequest(_message.Message):
    __slots__ = ("name", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class BuildImageProgress(_message.Message):
    __slots__ = ("part", "message", "done", "image")
    PART_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    part: str
    message: str
    done: bool
    image: ImageInfo
    def __init__(self, part: _Optional[str] = ..., message: _Optional[str] = ..., done: _Optional[bool] = ..., image: _Optional[_Union[ImageInfo, _Mapping]] = ...) -> None: ...

class DeleteImageRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CreateVolumeRequest(_message.Message):
    __slots__ = ("name", "size_mib", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_MIB_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_mib: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., size_mib: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class VolumeInfo(_message.Message):
    __slots__ = ("name", "size_mib", "labels", "created_at", "mounted_by")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_MIB_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    MOUNTED_BY_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_mib: int
    labels: _containers.ScalarMap[str, str]
    created_at: int
    mounted_by: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., size_mib: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., created_at: _Optional[int] = ..., mounted_by: _Optional[_Iterable[str]] = ...) -> None: ...

class InspectVolumeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListVolumesRequest(_message.Message):
    __slots__ = ("labels",)
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListVolumesResponse(_message.Message):
    __slots__ = ("volumes",)
    VOLUMES_FIELD_NUMBER: _ClassVar[int]
    volumes: _containers.RepeatedCompositeFieldContainer[VolumeInfo]
    def __init__(self, volumes: _Optional[_Iterable[_Union[VolumeInfo, _Mapping]]] = ...) -> None: ...

class DeleteVolumeRequest(_message.Message):
    __slots__ = ("name", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class FsPathRequest(_message.Message):
    __slots__ = ("id", "path")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class FsEntry(_message.Message):
    __slots__ = ("name", "path", "kind", "size", "mode", "uid", "gid", "mtime_ns", "target")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    kind: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    target: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., kind: _Optional[str] = ..., size: _Optional[int] = ..., mode: _Optional[int] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., target: _Optional[str] = ...) -> None: ...

class FsListResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FsEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[FsEntry, _Mapping]]] = ...) -> None: ...

class FsExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    def __init__(self, exists: _Optional[bool] = ...) -> None: ...

class FsMkdirRequest(_message.Message):
    __slots__ = ("id", "path", "parents", "mode")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    parents: bool
    mode: int
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., parents: _Optional[bool] = ..., mode: _Optional[int] = ...) -> None: ...

class FsRemoveRequest(_message.Message):
    __slots__ = ("id", "path", "recursive")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    recursive: bool
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., recursive: _Optional[bool] = ...) -> None: ...

class FsRenameRequest(_message.Message):
    __slots__ = ("id", "path", "dest")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEST_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    dest: str
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., dest: _Optional[str] = ...) -> None: ...

class ExportSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id", "include_base")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_BASE_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    include_base: bool
    def __init__(self, snapshot_id: _Optional[str] = ..., include_base: _Optional[bool] = ...) -> None: ...

class ImportSnapshotOpen(_message.Message):
    __slots__ = ("name", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ImportSnapshotRequest(_message.Message):
    __slots__ = ("open", "chunk")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    open: ImportSnapshotOpen
    chunk: _sandbox_pb2.FileChunk
    def __init__(self, open: _Optional[_Union[ImportSnapshotOpen, _Mapping]] = ..., chunk: _Optional[_Union[_sandbox_pb2.FileChunk, _Mapping]] = ...) -> None: ...

class FleetFetchRequest(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    def __init__(self, snapshot_id: _Optional[str] = ...) -> None: ...

class FleetFetchResponse(_message.Message):
    __slots__ = ("snapshot_id", "source", "bytes", "seconds")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    source: str
    bytes: int
    seconds: float
    def __init__(self, snapshot_id: _Optional[str] = ..., source: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class FleetReserveRequest(_message.Message):
    __slots__ = ("name", "memory_mib", "node", "prefer_snapshot", "timeout_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PREFER_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    memory_mib: int
    node: str
    prefer_snapshot: str
    timeout_seconds: float
    def __init__(self, name: _Optional[str] = ..., memory_mib: _Optional[int] = ..., node: _Optional[str] = ..., prefer_snapshot: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class FleetNameRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class FleetListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FleetSandbox(_message.Message):
    __slots__ = ("name", "node", "address", "state", "memory_mib", "created_at", "lost_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LOST_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    node: str
    address: str
    state: str
    memory_mib: int
    created_at: float
    lost_at: float
    def __init__(self, name: _Optional[str] = ..., node: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., memory_mib: _Optional[int] = ..., created_at: _Optional[float] = ..., lost_at: _Optional[float] = ...) -> None: ...

class FleetSandboxes(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[FleetSandbox]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[FleetSandbox, _Mapping]]] = ...) -> None: ...

class FleetNode(_message.Message):
    __slots__ = ("name", "address", "alive", "slots", "slots_used", "memory_mib", "memory_used_mib", "snapshots")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    alive: bool
    slots: int
    slots_used: int
    memory_mib: int
    memory_used_mib: int
    snapshots: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., alive: _Optional[bool] = ..., slots: _Optional[int] = ..., slots_used: _Optional[int] = ..., memory_mib: _Optional[int] = ..., memory_used_mib: _Optional[int] = ..., snapshots: _Optional[_Iterable[str]] = ...) -> None: ...

class FleetNodes(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[FleetNode]
    def __init__(self, nodes: _Optional[_Iterable[_Union[FleetNode, _Mapping]]] = ...) -> None: ...

class ModifyRequest(_message.Message):
    __slots__ = ("id", "vcpus", "memory_mib", "disk_size_mib", "env", "working_dir", "labels", "ttl_seconds", "idle_timeout_seconds", "dry_run", "restart", "env_remove", "max_vcpus", "max_memory_mib", "policy", "secrets", "egress")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    VCPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    DISK_SIZE_MIB_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    ENV_REMOVE_FIELD_NUMBER: _ClassVar[int]
    MAX_VCPUS_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SECRETS_FIELD_NUMBER: _ClassVar[int]
    EGRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    vcpus: int
    memory_mib: int
    disk_size_mib: int
    env: _containers.ScalarMap[str, str]
    working_dir: str
    labels: _containers.ScalarMap[str, str]
    ttl_seconds: int
    idle_timeout_seconds: int
    dry_run: bool
    restart: bool
    env_remove: _containers.RepeatedScalarFieldContainer[str]
    max_vcpus: int
    max_memory_mib: int
    policy: str
    secrets: _containers.RepeatedCompositeFieldContainer[SecretSpec]
    egress: EgressPolicy
    def __init__(self, id: _Optional[str] = ..., vcpus: _Optional[int] = ..., memory_mib: _Optional[int] = ..., disk_size_mib: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ..., working_dir: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., ttl_seconds: _Optional[int] = ..., idle_timeout_seconds: _Optional[int] = ..., dry_run: _Optional[bool] = ..., restart: _Optional[bool] = ..., env_remove: _Optional[_Iterable[str]] = ..., max_vcpus: _Optional[int] = ..., max_memory_mib: _Optional[int] = ..., policy: _Optional[str] = ..., secrets: _Optional[_Iterable[_Union[SecretSpec, _Mapping]]] = ..., egress: _Optional[_Union[EgressPolicy, _Mapping]] = ...) -> None: ...

class ModifyChange(_message.Message):
    __slots__ = ("kind", "status", "value", "previous", "why")
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    kind: str
    status: str
    value: str
    previous: str
    why: str
    def __init__(self, kind: _Optional[str] = ..., status: _Optional[str] = ..., value: _Optional[str] = ..., previous: _Optional[str] = ..., why: _Optional[str] = ...) -> None: ...

class ModifyResponse(_message.Message):
    __slots__ = ("changes", "applied", "dry_run", "restarted", "note", "settled", "settle_seconds", "policy", "conflicts", "warnings", "resize", "pending")
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    SETTLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[ModifyChange]
    applied: bool
    dry_run: bool
    restarted: bool
    note: str
    settled: bool
    settle_seconds: float
    policy: str
    conflicts: _containers.RepeatedCompositeFieldContainer[ModifyNote]
    warnings: _containers.RepeatedCompositeFieldContainer[ModifyNote]
    resize: _containers.RepeatedCompositeFieldContainer[ResizeStatus]
    pending: bool
    def __init__(self, changes: _Optional[_Iterable[_Union[ModifyChange, _Mapping]]] = ..., applied: _Optional[bool] = ..., dry_run: _Optional[bool] = ..., restarted: _Optional[bool] = ..., note: _Optional[str] = ..., settled: _Optional[bool] = ..., settle_seconds: _Optional[float] = ..., policy: _Optional[str] = ..., conflicts: _Optional[_Iterable[_Union[ModifyNote, _Mapping]]] = ..., warnings: _Optional[_Iterable[_Union[ModifyNote, _Mapping]]] = ..., resize: _Optional[_Iterable[_Union[ResizeStatus, _Mapping]]] = ..., pending: _Optional[bool] = ...) -> None: ...

class ModifyNote(_message.Message):
    __slots__ = ("field", "message")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    field: str
    message: str
    def __init__(self, field: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ResizeStatus(_message.Message):
    __slots__ = ("resource", "requested", "actual", "enforced", "state", "why")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_FIELD_NUMBER: _ClassVar[int]
    ENFORCED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    resource: str
    requested: int
    actual: int
    enforced: int
    state: str
    why: str
    def __init__(self, resource: _Optional[str] = ..., requested: _Optional[int] = ..., actual: _Optional[int] = ..., enforced: _Optional[int] = ..., state: _Optional[str] = ..., why: _Optional[str] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class SandboxSettings(_message.Message):
    __slots__ = ("vcpus", "memory_mib", "max_vcpus", "max_memory_mib", "disk_size_mib", "env", "working_dir", "ttl_seconds", "idle_timeout_seconds", "settled")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VCPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    MAX_VCPUS_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    DISK_SIZE_MIB_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    vcpus: int
    memory_mib: int
    max_vcpus: int
    max_memory_mib: int
    disk_size_mib: int
    env: _containers.ScalarMap[str, str]
    working_dir: str
    ttl_seconds: int
    idle_timeout_seconds: int
    settled: bool
    def __init__(self, vcpus: _Optional[int] = ..., memory_mib: _Optional[int] = ..., max_vcpus: _Optional[int] = ..., max_memory_mib: _Optional[int] = ..., disk_size_mib: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ..., working_dir: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., idle_timeout_seconds: _Optional[int] = ..., settled: _Optional[bool] = ...) -> None: ...

class SandboxDetails(_message.Message):
    __slots__ = ("base", "requested", "applied", "updated_at", "shell", "init", "pending", "cause", "parent", "parent_uid", "fork_snapshot", "forked_at", "memory_shared_bytes", "memory_own_bytes", "guest_oom_kills")
    BASE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_UID_FIELD_NUMBER: _ClassVar[int]
    FORK_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    FORKED_AT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_OWN_BYTES_FIELD_NUMBER: _ClassVar[int]
    GUEST_OOM_KILLS_FIELD_NUMBER: _ClassVar[int]
    base: _sandbox_pb2.SandboxInfo
    requested: SandboxSettings
    applied: SandboxSettings
    updated_at: int
    shell: str
    init: InitSpec
    pending: SandboxSettings
    cause: StopCause
    parent: str
    parent_uid: str
    fork_snapshot: str
    forked_at: int
    memory_shared_bytes: int
    memory_own_bytes: int
    guest_oom_kills: int
    def __init__(self, base: _Optional[_Union[_sandbox_pb2.SandboxInfo, _Mapping]] = ..., requested: _Optional[_Union[SandboxSettings, _Mapping]] = ..., applied: _Optional[_Union[SandboxSettings, _Mapping]] = ..., updated_at: _Optional[int] = ..., shell: _Optional[str] = ..., init: _Optional[_Union[InitSpec, _Mapping]] = ..., pending: _Optional[_Union[SandboxSettings, _Mapping]] = ..., cause: _Optional[_Union[StopCause, _Mapping]] = ..., parent: _Optional[str] = ..., parent_uid: _Optional[str] = ..., fork_snapshot: _Optional[str] = ..., forked_at: _Optional[int] = ..., memory_shared_bytes: _Optional[int] = ..., memory_own_bytes: _Optional[int] = ..., guest_oom_kills: _Optional[int] = ...) -> None: ...

class SecretSpec(_message.Message):
    __slots__ = ("name", "hosts", "value", "store", "placeholder", "substitute")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_FIELD_NUMBER: _ClassVar[int]
    SUBSTITUTE_FIELD_NUMBER: _ClassVar[int]
    name: str
    hosts: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    store: str
    placeholder: str
    substitute: str
    def __init__(self, name: _Optional[str] = ..., hosts: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., store: _Optional[str] = ..., placeholder: _Optional[str] = ..., substitute: _Optional[str] = ...) -> None: ...

class SetSecretRequest(_message.Message):
    __slots__ = ("name", "value", "hosts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: bytes
    hosts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., value: _Optional[bytes] = ..., hosts: _Optional[_Iterable[str]] = ...) -> None: ...

class ListSecretsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSecretsResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteSecretRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RotateSecretRequest(_message.Message):
    __slots__ = ("id", "name", "value")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    value: bytes
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class RevokeSecretRequest(_message.Message):
    __slots__ = ("id", "name")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ListSandboxSecretsRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class SandboxSecretInfo(_message.Message):
    __slots__ = ("name", "hosts", "placeholder", "source", "removed", "substitute")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    SUBSTITUTE_FIELD_NUMBER: _ClassVar[int]
    name: str
    hosts: _containers.RepeatedScalarFieldContainer[str]
    placeholder: str
    source: str
    removed: bool
    substitute: str
    def __init__(self, name: _Optional[str] = ..., hosts: _Optional[_Iterable[str]] = ..., placeholder: _Optional[str] = ..., source: _Optional[str] = ..., removed: _Optional[bool] = ..., substitute: _Optional[str] = ...) -> None: ...

class ListSandboxSecretsResponse(_message.Message):
    __slots__ = ("secrets",)
    SECRETS_FIELD_NUMBER: _ClassVar[int]
    secrets: _containers.RepeatedCompositeFieldContainer[SandboxSecretInfo]
    def __init__(self, secrets: _Optional[_Iterable[_Union[SandboxSecretInfo, _Mapping]]] = ...) -> None: ...

class ConfigRequest(_message.Message):
    __slots__ = ("id", "patch_data")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATCH_DATA_FIELD_NUMBER: _ClassVar[int]
    id: str
    patch_data: bool
    def __init__(self, id: _Optional[str] = ..., patch_data: _Optional[bool] = ...) -> None: ...

class PatchInfo(_message.Message):
    __slots__ = ("op", "path", "size", "sha256")
    OP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    op: str
    path: str
    size: int
    sha256: str
    def __init__(self, op: _Optional[str] = ..., path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class SandboxConfig(_message.Message):
    __slots__ = ("id", "config", "patches", "image_digest")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PATCHES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    id: str
    config: CreateRequest
    patches: _containers.RepeatedCompositeFieldContainer[PatchInfo]
    image_digest: str
    def __init__(self, id: _Optional[str] = ..., config: _Optional[_Union[CreateRequest, _Mapping]] = ..., patches: _Optional[_Iterable[_Union[PatchInfo, _Mapping]]] = ..., image_digest: _Optional[str] = ...) -> None: ...

class SshEndpointRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class SshEndpointInfo(_message.Message):
    __slots__ = ("host", "port", "user", "host_key", "fingerprint", "known_hosts")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    HOST_KEY_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KNOWN_HOSTS_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    user: str
    host_key: str
    fingerprint: str
    known_hosts: str
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., user: _Optional[str] = ..., host_key: _Optional[str] = ..., fingerprint: _Optional[str] = ..., known_hosts: _Optional[str] = ...) -> None: ...

class SessionInput(_message.Message):
    __slots__ = ("init", "attach", "stdin", "resize", "close_stdin", "detach")
    INIT_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_STDIN_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    init: _sandbox_pb2.ExecRequest
    attach: AttachRequest
    stdin: bytes
    resize: _sandbox_pb2.TerminalSize
    close_stdin: bool
    detach: bool
    def __init__(self, init: _Optional[_Union[_sandbox_pb2.ExecRequest, _Mapping]] = ..., attach: _Optional[_Union[AttachRequest, _Mapping]] = ..., stdin: _Optional[bytes] = ..., resize: _Optional[_Union[_sandbox_pb2.TerminalSize, _Mapping]] = ..., close_stdin: _Optional[bool] = ..., detach: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("id", "session_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    session_id: int
    def __init__(self, id: _Optional[str] = ..., session_id: _Optional[int] = ...) -> None: ...

class SessionOutput(_message.Message):
    __slots__ = ("stream", "data", "exit_code", "done", "session_id", "oom_killed")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    stream: str
    data: bytes
    exit_code: int
    done: bool
    session_id: int
    oom_killed: bool
    def __init__(self, stream: _Optional[str] = ..., data: _Optional[bytes] = ..., exit_code: _Optional[int] = ..., done: _Optional[bool] = ..., session_id: _Optional[int] = ..., oom_killed: _Optional[bool] = ...) -> None: ...

class RunCodeRequest(_message.Message):
    __slots__ = ("id", "code", "language", "context", "envs", "timeout_seconds")
    class EnvsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ENVS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    code: str
    language: str
    context: str
    envs: _containers.ScalarMap[str, str]
    timeout_seconds: float
    def __init__(self, id: _Optional[str] = ..., code: _Optional[str] = ..., language: _Optional[str] = ..., context: _Optional[str] = ..., envs: _Optional[_Mapping[str, str]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class CodeResult(_message.Message):
    __slots__ = ("is_main_result", "text", "html", "markdown", "png", "jpeg", "svg", "pdf", "latex", "json", "javascript", "chart", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IS_MAIN_RESULT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    HTML_FIELD_NUMBER: _ClassVar[int]
    MARKDOWN_FIELD_NUMBER: _ClassVar[int]
    PNG_FIELD_NUMBER: _ClassVar[int]
    JPEG_FIELD_NUMBER: _ClassVar[int]
    SVG_FIELD_NUMBER: _ClassVar[int]
    PDF_FIELD_NUMBER: _ClassVar[int]
    LATEX_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    JAVASCRIPT_FIELD_NUMBER: _ClassVar[int]
    CHART_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    is_main_result: bool
    text: str
    html: str
    markdown: str
    png: str
    jpeg: str
    svg: str
    pdf: str
    latex: str
    json: str
    javascript: str
    chart: str
    extra: _containers.ScalarMap[str, str]
    def __init__(self, is_main_result: _Optional[bool] = ..., text: _Optional[str] = ..., html: _Optional[str] = ..., markdown: _Optional[str] = ..., png: _Optional[str] = ..., jpeg: _Optional[str] = ..., svg: _Optional[str] = ..., pdf: _Optional[str] = ..., latex: _Optional[str] = ..., json: _Optional[str] = ..., javascript: _Optional[str] = ..., chart: _Optional[str] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CodeError(_message.Message):
    __slots__ = ("name", "value", "traceback")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    traceback: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ..., traceback: _Optional[str] = ...) -> None: ...

class CodeOutput(_message.Message):
    __slots__ = ("kind", "text", "timestamp", "result", "error", "execution_count")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    timestamp: int
    result: CodeResult
    error: CodeError
    execution_count: int
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ..., timestamp: _Optional[int] = ..., result: _Optional[_Union[CodeResult, _Mapping]] = ..., error: _Optional[_Union[CodeError, _Mapping]] = ..., execution_count: _Optional[int] = ...) -> None: ...

class CreateCodeContextRequest(_message.Message):
    __slots__ = ("id", "cwd", "language")
    ID_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    cwd: str
    language: str
    def __init__(self, id: _Optional[str] = ..., cwd: _Optional[str] = ..., language: _Optional[str] = ...) -> None: ...

class CodeContext(_message.Message):
    __slots__ = ("id", "language", "cwd")
    ID_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    id: str
    language: str
    cwd: str
    def __init__(self, id: _Optional[str] = ..., language: _Optional[str] = ..., cwd: _Optional[str] = ...) -> None: ...

class ListCodeContextsRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListCodeContextsResponse(_message.Message):
    __slots__ = ("contexts",)
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    contexts: _containers.RepeatedCompositeFieldContainer[CodeContext]
    def __init__(self, contexts: _Optional[_Iterable[_Union[CodeContext, _Mapping]]] = ...) -> None: ...

class CodeContextRequest(_message.Message):
    __slots__ = ("id", "context")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    id: str
    context: str
    def __init__(self, id: _Optional[str] = ..., context: _Optional[str] = ...) -> None: ...
