from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NetworkSpec(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class Mount(_message.Message):
    __slots__ = ("source", "target", "readonly")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    READONLY_FIELD_NUMBER: _ClassVar[int]
    source: str
    target: str
    readonly: bool
    def __init__(self, source: _Optional[str] = ..., target: _Optional[str] = ..., readonly: _Optional[bool] = ...) -> None: ...

class ResourceLimits(_message.Message):
    __slots__ = ("vcpus", "memory_mib")
    VCPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    vcpus: int
    memory_mib: int
    def __init__(self, vcpus: _Optional[int] = ..., memory_mib: _Optional[int] = ...) -> None: ...

class TerminalSize(_message.Message):
    __slots__ = ("width", "height")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class CreateSandboxRequest(_message.Message):
    __slots__ = ("id", "labels", "kernel", "rootfs", "boot_args", "limits", "image", "cmd", "env", "working_dir", "user", "mounts", "network", "ttl_seconds", "ssh_public_key")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    ROOTFS_FIELD_NUMBER: _ClassVar[int]
    BOOT_ARGS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SSH_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    id: str
    labels: _containers.ScalarMap[str, str]
    kernel: str
    rootfs: str
    boot_args: str
    limits: ResourceLimits
    image: str
    cmd: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    working_dir: str
    user: str
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    network: NetworkSpec
    ttl_seconds: int
    ssh_public_key: str
    def __init__(self, id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., kernel: _Optional[str] = ..., rootfs: _Optional[str] = ..., boot_args: _Optional[str] = ..., limits: _Optional[_Union[ResourceLimits, _Mapping]] = ..., image: _Optional[str] = ..., cmd: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., working_dir: _Optional[str] = ..., user: _Optional[str] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., network: _Optional[_Union[NetworkSpec, _Mapping]] = ..., ttl_seconds: _Optional[int] = ..., ssh_public_key: _Optional[str] = ...) -> None: ...

class CreateSandboxResponse(_message.Message):
    __slots__ = ("id", "ip_address", "state")
    ID_FIELD_NUMBER: _ClassVar[int]
    IP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    id: str
    ip_address: str
    state: str
    def __init__(self, id: _Optional[str] = ..., ip_address: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("id", "cmd", "env", "working_dir", "user", "tty", "timeout_seconds")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    TTY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    cmd: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    working_dir: str
    user: str
    tty: bool
    timeout_seconds: int
    def __init__(self, id: _Optional[str] = ..., cmd: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., working_dir: _Optional[str] = ..., user: _Optional[str] = ..., tty: _Optional[bool] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class RunOutput(_message.Message):
    __slots__ = ("stream", "data", "exit_code", "done")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    stream: str
    data: bytes
    exit_code: int
    done: bool
    def __init__(self, stream: _Optional[str] = ..., data: _Optional[bytes] = ..., exit_code: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...

class ExecInput(_message.Message):
    __slots__ = ("init", "stdin", "resize")
    INIT_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    init: ExecRequest
    stdin: bytes
    resize: TerminalSize
    def __init__(self, init: _Optional[_Union[ExecRequest, _Mapping]] = ..., stdin: _Optional[bytes] = ..., resize: _Optional[_Union[TerminalSize, _Mapping]] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("id", "cmd", "env", "working_dir", "user", "tty", "tty_size", "timeout_seconds")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    TTY_FIELD_NUMBER: _ClassVar[int]
    TTY_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    cmd: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    working_dir: str
    user: str
    tty: bool
    tty_size: TerminalSize
    timeout_seconds: int
    def __init__(self, id: _Optional[str] = ..., cmd: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., working_dir: _Optional[str] = ..., user: _Optional[str] = ..., tty: _Optional[bool] = ..., tty_size: _Optional[_Union[TerminalSize, _Mapping]] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class ExecOutput(_message.Message):
    __slots__ = ("stream", "data", "exit_code", "done")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    stream: str
    data: bytes
    exit_code: int
    done: bool
    def __init__(self, stream: _Optional[str] = ..., data: _Optional[bytes] = ..., exit_code: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("id", "path")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("data", "done")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    done: bool
    def __init__(self, data: _Optional[bytes] = ..., done: _Optional[bool] = ...) -> None: ...

class WriteFileOpen(_message.Message):
    __slots__ = ("id", "path", "mode")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    mode: int
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., mode: _Optional[int] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("open", "chunk")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    open: WriteFileOpen
    chunk: FileChunk
    def __init__(self, open: _Optional[_Union[WriteFileOpen, _Mapping]] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ...) -> None: ...

class ExposePortRequest(_message.Message):
    __slots__ = ("id", "sandbox_port", "host_port", "protocol")
    ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    id: str
    sandbox_port: int
    host_port: int
    protocol: str
    def __init__(self, id: _Optional[str] = ..., sandbox_port: _Optional[int] = ..., host_port: _Optional[int] = ..., protocol: _Optional[str] = ...) -> None: ...

class ExposePortResponse(_message.Message):
    __slots__ = ("host_port", "guest_port")
    HOST_PORT_FIELD_NUMBER: _ClassVar[int]
    GUEST_PORT_FIELD_NUMBER: _ClassVar[int]
    host_port: int
    guest_port: int
    def __init__(self, host_port: _Optional[int] = ..., guest_port: _Optional[int] = ...) -> None: ...

class UnexposePortRequest(_message.Message):
    __slots__ = ("id", "sandbox_port", "protocol")
    ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    id: str
    sandbox_port: int
    protocol: str
    def __init__(self, id: _Optional[str] = ..., sandbox_port: _Optional[int] = ..., protocol: _Optional[str] = ...) -> None: ...

class SandboxPortForwardRequest(_message.Message):
    __slots__ = ("id", "sandbox_port", "protocol")
    ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    id: str
    sandbox_port: int
    protocol: str
    def __init__(self, id: _Optional[str] = ..., sandbox_port: _Optional[int] = ..., protocol: _Optional[str] = ...) -> None: ...

class SandboxPortForwardResponse(_message.Message):
    __slots__ = ("guest_port",)
    GUEST_PORT_FIELD_NUMBER: _ClassVar[int]
    guest_port: int
    def __init__(self, guest_port: _Optional[int] = ...) -> None: ...

class SandboxPortForwardRemoveRequest(_message.Message):
    __slots__ = ("id", "sandbox_port", "protocol")
    ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    id: str
    sandbox_port: int
    protocol: str
    def __init__(self, id: _Optional[str] = ..., sandbox_port: _Optional[int] = ..., protocol: _Optional[str] = ...) -> None: ...

class StopSandboxRequest(_message.Message):
    __slots__ = ("id", "timeout_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    timeout_seconds: int
    def __init__(self, id: _Optional[str] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class RemoveSandboxRequest(_message.Message):
    __slots__ = ("id", "force")
    ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    force: bool
    def __init__(self, id: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class InspectSandboxRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class SandboxInfo(_message.Message):
    __slots__ = ("id", "state", "labels", "limits", "network", "created_at", "ready_at", "last_exited_at", "last_exit_code", "error")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    READY_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_EXITED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: str
    labels: _containers.ScalarMap[str, str]
    limits: ResourceLimits
    network: SandboxNetwork
    created_at: int
    ready_at: int
    last_exited_at: int
    last_exit_code: int
    error: str
    def __init__(self, id: _Optional[str] = ..., state: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., limits: _Optional[_Union[ResourceLimits, _Mapping]] = ..., network: _Optional[_Union[SandboxNetwork, _Mapping]] = ..., created_at: _Optional[int] = ..., ready_at: _Optional[int] = ..., last_exited_at: _Optional[int] = ..., last_exit_code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class SandboxNetwork(_message.Message):
    __slots__ = ("ip_address", "gateway", "tap_name")
    IP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    TAP_NAME_FIELD_NUMBER: _ClassVar[int]
    ip_address: str
    gateway: str
    tap_name: str
    def __init__(self, ip_address: _Optional[str] = ..., gateway: _Optional[str] = ..., tap_name: _Optional[str] = ...) -> None: ...

class ListSandboxesRequest(_message.Message):
    __slots__ = ("state", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    state: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, state: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[SandboxSummary]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[SandboxSummary, _Mapping]]] = ...) -> None: ...

class SandboxSummary(_message.Message):
    __slots__ = ("id", "state", "labels", "ip_address", "created_at")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    IP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: str
    labels: _containers.ScalarMap[str, str]
    ip_address: str
    created_at: int
    def __init__(self, id: _Optional[str] = ..., state: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., ip_address: _Optional[str] = ..., created_at: _Optional[int] = ...) -> None: ...

class SandboxEventsRequest(_message.Message):
    __slots__ = ("id", "action")
    ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    id: str
    action: str
    def __init__(self, id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class SandboxEvent(_message.Message):
    __slots__ = ("sandbox_id", "action", "timestamp", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    action: str
    timestamp: int
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, sandbox_id: _Optional[str] = ..., action: _Optional[str] = ..., timestamp: _Optional[int] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("sandbox_id", "name", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    name: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, sandbox_id: _Optional[str] = ..., name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("snapshot_id", "snapshot_dir", "created_at")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DIR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    snapshot_dir: str
    created_at: str
    def __init__(self, snapshot_id: _Optional[str] = ..., snapshot_dir: _Optional[str] = ..., created_at: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("id", "snapshot_id", "labels", "network_override", "ttl_seconds")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    snapshot_id: str
    labels: _containers.ScalarMap[str, str]
    network_override: bool
    ttl_seconds: int
    def __init__(self, id: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., network_override: _Optional[bool] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("id", "ip_address")
    ID_FIELD_NUMBER: _ClassVar[int]
    IP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    ip_address: str
    def __init__(self, id: _Optional[str] = ..., ip_address: _Optional[str] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("sandbox_id", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, sandbox_id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotSummary]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotSummary, _Mapping]]] = ...) -> None: ...

class SnapshotSummary(_message.Message):
    __slots__ = ("id", "sandbox_id", "name", "labels", "snapshot_dir", "created_at")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DIR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    sandbox_id: str
    name: str
    labels: _containers.ScalarMap[str, str]
    snapshot_dir: str
    created_at: str
    def __init__(self, id: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., snapshot_dir: _Optional[str] = ..., created_at: _Optional[str] = ...) -> None: ...

class DeleteSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    def __init__(self, snapshot_id: _Optional[str] = ...) -> None: ...
