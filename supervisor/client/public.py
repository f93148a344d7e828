"""The Python SDK of sandvisor, and the client side of its Unix-socket protocol.

``from supervisor.client import Sandbox, AsyncSandbox``: the same surface, sync and
Trio-async. Requests are the protocol module's typed classes; results are typed
values with attributes (:class:`SandboxInfo`, :class:`Page` of :class:`SandboxSummary`,
:class:`MetricsResponse`, :class:`SnapshotSummary`, :class:`CheckpointResponse`,
:class:`LogEntry`, :class:`SandboxEvent`). Failures raise subclasses of
:class:`SandboxError` named after sandbox.v1's codes (:class:`NotFound`,
:class:`InvalidArgument`, ...).

A sandbox is described by a :class:`SandboxSpec` (grouped: :class:`Resources`,
:class:`Workload`, :class:`Network`, :class:`Lifetime`, :class:`Boot`, :class:`Shape`), reusable
and frozen; the common settings are also keyword arguments of ``create``, applied
on top of the spec (maps merge, the rest replaces)::

    async with await AsyncSandbox.create("web", cpus=2, env={"A": "1"}) as sb:
        r = await sb.run("echo $A")
        info = await sb.inspect()          # info.state == "ready"

    spec = SandboxSpec(resources=Resources(cpus=2, memory_mib=1024), lifetime=Lifetime(ttl=600))
    workers = [await AsyncSandbox.create(f"w{i}", spec, labels={"n": str(i)}) for i in range(4)]

Below them, :func:`connect` gives an :class:`AsyncConnection`: unary calls, server
streams and bidirectional streams multiplexed on one socket, with the wire's maps as
bodies (the protocol-level API); frames travel on :class:`supervisor.wire.frames.FramedStream`.

This module only gathers the SDK's names; the SDK lives in :mod:`supervisor.client.sdk`::

    sdk/spec.py     SandboxSpec and its groups, the result types      (no I/O)
    sdk/ops.py      the effects a plan yields; the method-table descriptors
    sdk/*_plans.py  every operation, written once, as a plan, by area
    sdk/plans.py    the method tables
    sdk/aio.py      the Trio driver (FramedStream): AsyncSandbox, ..., connect
    sdk/sync.py     the blocking driver (BlockingConnection, no thread): Sandbox, ...
"""

from __future__ import annotations

from guestd.patch import Patch
from supervisor.client.sdk.aio import (
    AsyncConnection,
    AsyncExec,
    AsyncImages,
    AsyncSandbox,
    AsyncSecrets,
    AsyncVolumes,
    CallStream,
    connect,
)
from supervisor.client.sdk.code_plans import CodeContext, Execution, ExecutionError, Logs, OutputMessage, Result
from supervisor.client.sdk.config_plans import load_config_json
from supervisor.client.sdk.detach import DEFAULT_DETACH_KEYS, Detached
from supervisor.client.sdk.modify_spec import SecretUpdate
from supervisor.client.sdk.network import Dns, Egress, Network, PortBinding
from supervisor.client.sdk.spec import (
    Boot,
    HostDir,
    Init,
    Lifetime,
    Output,
    Page,
    RegistryAuth,
    Resources,
    RunResult,
    RunSettings,
    SandboxSpec,
    Secret,
    Settings,
    Shape,
    SnapshotRef,
    Tmpfs,
    VolumeMount,
    Workload,
    parse_size,
)
from supervisor.client.sdk.sync import Images, Sandbox, Secrets, Volumes, images
from supervisor.wire.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SandboxError,
    Unavailable,
    Unimplemented,
    error_for,
)
from supervisor.wire.protocol import (
    CheckpointResponse,
    FsEntry,
    LogEntry,
    MetricsResponse,
    ModifyChange,
    ModifyNote,
    ModifyResponse,
    OciImageInfo,
    PruneImagesResponse,
    PullImageProgress,
    RemoveImageResponse,
    ResizeStatus,
    SandboxEvent,
    SandboxInfo,
    SandboxSettings,
    SandboxSummary,
    SnapshotSummary,
    SshEndpoint,
    VolumeInfo,
)

__all__ = [
    "DEFAULT_DETACH_KEYS",
    "AlreadyExists",
    "AsyncConnection",
    "AsyncExec",
    "AsyncImages",
    "AsyncSandbox",
    "AsyncSecrets",
    "AsyncVolumes",
    "Boot",
    "CallStream",
    "Cancelled",
    "CheckpointResponse",
    "CodeContext",
    "DeadlineExceeded",
    "Detached",
    "Dns",
    "Egress",
    "Execution",
    "ExecutionError",
    "FailedPrecondition",
    "FsEntry",
    "HostDir",
    "Images",
    "Init",
    "Internal",
    "InvalidArgument",
    "Lifetime",
    "LogEntry",
    "Logs",
    "MetricsResponse",
    "ModifyChange",
    "ModifyNote",
    "ModifyResponse",
    "Network",
    "NotFound",
    "OciImageInfo",
    "Output",
    "OutputMessage",
    "Page",
    "Patch",
    "PermissionDenied",
    "PortBinding",
    "PruneImagesResponse",
    "PullImageProgress",
    "RegistryAuth",
    "RemoveImageResponse",
    "ResizeStatus",
    "ResourceExhausted",
    "Resources",
    "Result",
    "RunResult",
    "RunSettings",
    "Sandbox",
    "SandboxError",
    "SandboxEvent",
    "SandboxInfo",
    "SandboxSettings",
    "SandboxSpec",
    "SandboxSummary",
    "Secret",
    "SecretUpdate",
    "Secrets",
    "Settings",
    "Shape",
    "SnapshotRef",
    "SnapshotSummary",
    "SshEndpoint",
    "Tmpfs",
    "Unavailable",
    "Unimplemented",
    "VolumeInfo",
    "VolumeMount",
    "Volumes",
    "Workload",
    "connect",
    "error_for",
    "images",
    "load_config_json",
    "parse_size",
]
