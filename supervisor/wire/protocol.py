"""The client protocol of ``sandvisor serve``: the ``sandbox.v1`` service over a Unix socket.

Framing is the guest channel's (``u32be length || msgpack``), with its own cap
(:data:`MAX_FRAME`), in :mod:`supervisor.wire.frames` (its ``FramedStream`` carries these
envelopes for the server and the SDK); the error codes and ``ApiError`` are in
:mod:`supervisor.wire.errors` (both re-exported here). Messages are frozen attrs classes
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

Bodies are method-specific request/response classes, named after the ``.proto``'s
messages and kept by service area in :mod:`supervisor.wire.messages` (sandboxes, files,
snapshots, secrets, the server and its images); this module is their one face (every
body is re-exported here: ``protocol.SandboxInfo``), converted with
:func:`structure_body` / :func:`unstructure_body`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.preconf.msgpack import make_converter
from cattrs.strategies import configure_tagged_union

from supervisor.wire import frames
from supervisor.wire.errors import (
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
from supervisor.wire.frames import MAX_FRAME, PROTOCOL_VERSION, FrameReader
from supervisor.wire.messages.code import (
    CodeContext,
    CodeContextRequest,
    CodeError,
    CodeOutput,
    CodeResult,
    CreateCodeContextRequest,
    ListCodeContextsResponse,
    RunCodeRequest,
)
from supervisor.wire.messages.files import (
    FileChunk,
    FsEntry,
    FsExistsResponse,
    FsListResponse,
    FsMkdirRequest,
    FsPathRequest,
    FsRemoveRequest,
    FsRenameRequest,
    ReadFileRequest,
    ReadTreeRequest,
    WriteFileOpen,
    WriteFileRequest,
    WriteTreeOpen,
    WriteTreeRequest,
    WriteTreeResponse,
)
from supervisor.wire.messages.readback import (
    AttachRequest,
    ConfigRequest,
    PatchInfo,
    SandboxConfigResponse,
    SshEndpoint,
)
from supervisor.wire.messages.sandboxes import (
    CreateSandboxRequest,
    CreateSandboxResponse,
    DnsSpec,
    DrainRequest,
    EgressSpec,
    ExecInput,
    ExecOutput,
    ExecRequest,
    ExposePortRequest,
    ExposePortResponse,
    HostMount,
    IdRequest,
    InitSpec,
    KillRequest,
    ListPortsResponse,
    ListSandboxesRequest,
    ListSandboxesResponse,
    LogEntry,
    LogsRequest,
    MetricsAllResponse,
    MetricsResponse,
    MetricsStreamRequest,
    ModifyChange,
    ModifyNote,
    ModifyRequest,
    ModifyResponse,
    Mount,
    NetworkSpec,
    PatchSpec,
    PingResponse,
    PortMapping,
    RemoveSandboxRequest,
    ResizeStatus,
    ResourceLimits,
    RunOutput,
    RunRequest,
    SandboxEvent,
    SandboxEventsRequest,
    SandboxInfo,
    SandboxNetwork,
    SandboxSettings,
    SandboxSummary,
    SecretSpec,
    SetTtlRequest,
    SetTtlResponse,
    StopCause,
    StopSandboxRequest,
    TerminalSize,
    TmpfsMount,
    TouchResponse,
    UnexposePortRequest,
    VolumeMount,
)
from supervisor.wire.messages.secrets import (
    ListSecretsResponse,
    RotateSecretRequest,
    SandboxSecretInfo,
    SandboxSecretRequest,
    SandboxSecretsResponse,
    SetSecretRequest,
)
from supervisor.wire.messages.server import (
    CreateVolumeRequest,
    DeleteVolumeRequest,
    Empty,
    ImageInfo,
    ImageRefRequest,
    ListImagesResponse,
    ListVolumesRequest,
    ListVolumesResponse,
    NameRequest,
    OciImageInfo,
    PruneImagesRequest,
    PruneImagesResponse,
    PullImageProgress,
    PullImageRequest,
    RemoveImageResponse,
    ServerInfo,
    VolumeInfo,
)
from supervisor.wire.messages.snapshots import (
    CheckpointRequest,
    CheckpointResponse,
    DeleteSnapshotRequest,
    DiffChange,
    DiffRequest,
    DiffResponse,
    ExportSnapshotRequest,
    ForkedSandbox,
    ForkRequest,
    ForkResponse,
    ImportSnapshotOpen,
    ImportSnapshotRequest,
    ListSnapshotsRequest,
    ListSnapshotsResponse,
    RestoreRequest,
    RestoreResponse,
    SnapshotSummary,
)

__all__ = [  # the errors, the frame constants and every body (supervisor.wire.messages)
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
    "AttachRequest",
    "CheckpointRequest",
    "CheckpointResponse",
    "CodeContext",
    "CodeContextRequest",
    "CodeError",
    "CodeOutput",
    "CodeResult",
    "ConfigRequest",
    "CreateCodeContextRequest",
    "CreateSandboxRequest",
    "CreateSandboxResponse",
    "CreateVolumeRequest",
    "DeleteSnapshotRequest",
    "DeleteVolumeRequest",
    "DiffChange",
    "DiffRequest",
    "DiffResponse",
    "DnsSpec",
    "DrainRequest",
    "EgressSpec",
    "Empty",
    "ExecInput",
    "ExecOutput",
    "ExecRequest",
    "ExportSnapshotRequest",
    "ExposePortRequest",
    "ExposePortResponse",
    "FileChunk",
    "ForkRequest",
    "ForkResponse",
    "ForkedSandbox",
    "FrameReader",
    "FsEntry",
    "FsExistsResponse",
    "FsListResponse",
    "FsMkdirRequest",
    "FsPathRequest",
    "FsRemoveRequest",
    "FsRenameRequest",
    "HostMount",
    "IdRequest",
    "ImageInfo",
    "ImageRefRequest",
    "ImportSnapshotOpen",
    "ImportSnapshotRequest",
    "InitSpec",
    "KillRequest",
    "ListCodeContextsResponse",
    "ListImagesResponse",
    "ListPortsResponse",
    "ListSandboxesRequest",
    "ListSandboxesResponse",
    "ListSecretsResponse",
    "ListSnapshotsRequest",
    "ListSnapshotsResponse",
    "ListVolumesRequest",
    "ListVolumesResponse",
    "LogEntry",
    "LogsRequest",
    "MetricsAllResponse",
    "MetricsResponse",
    "MetricsStreamRequest",
    "ModifyChange",
    "ModifyNote",
    "ModifyRequest",
    "ModifyResponse",
    "Mount",
    "NameRequest",
    "NetworkSpec",
    "OciImageInfo",
    "PatchInfo",
    "PatchSpec",
    "PingResponse",
    "PortMapping",
    "PruneImagesRequest",
    "PruneImagesResponse",
    "PullImageProgress",
    "PullImageRequest",
    "ReadFileRequest",
    "ReadTreeRequest",
    "RemoveImageResponse",
    "RemoveSandboxRequest",
    "ResizeStatus",
    "ResourceLimits",
    "RestoreRequest",
    "RestoreResponse",
    "RotateSecretRequest",
    "RunCodeRequest",
    "RunOutput",
    "RunRequest",
    "SandboxConfigResponse",
    "SandboxEvent",
    "SandboxEventsRequest",
    "SandboxInfo",
    "SandboxNetwork",
    "SandboxSecretInfo",
    "SandboxSecretRequest",
    "SandboxSecretsResponse",
    "SandboxSettings",
    "SandboxSummary",
    "SecretSpec",
    "ServerInfo",
    "SetSecretRequest",
    "SetTtlRequest",
    "SetTtlResponse",
    "SnapshotSummary",
    "SshEndpoint",
    "StopCause",
    "StopSandboxRequest",
    "TerminalSize",
    "TmpfsMount",
    "TouchResponse",
    "UnexposePortRequest",
    "VolumeInfo",
    "VolumeMount",
    "WriteFileOpen",
    "WriteFileRequest",
    "WriteTreeOpen",
    "WriteTreeRequest",
    "WriteTreeResponse",
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
    ClientHello: frames.HELLO,
    ServerHello: frames.HELLO_OK,
    Call: frames.CALL,
    Send: frames.SEND,
    HalfClose: frames.HALF_CLOSE,
    Cancel: frames.CANCEL,
    Reply: frames.REPLY,
    Item: frames.ITEM,
    End: frames.END,
    Fail: frames.FAIL,
}


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
    return frames.frame(converter.dumps(msg, Envelope))


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
