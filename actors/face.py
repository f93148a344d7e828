"""What the edges (``supervisor/``: the serve side, the client, the wire) may use of the domain.

The one module of ``actors`` they import; everything else in ``actors/`` is the domain's
own and may move or change without them noticing (tests/unit/test_edge_face.py holds
``supervisor/`` to it, imports inside functions and under ``TYPE_CHECKING`` included).
Only the composition root (``supervisor/main/``: the daemon that builds the domain from
its parts, the ``sandvisor`` command that reports why building failed) reaches past it.

A module, not ``actors/__init__``: the package's ``__init__`` runs before each of its
modules is imported, so re-exporting the registry there would load the whole domain
(and its import cycles) for anyone importing ``actors.errors`` or ``actors.model``.

What is here, by kind:

* the errors the domain raises (the wire's codes) and the events stream's ``Lagged``;
* the values it takes and gives (model's records, configs and states) and rules' checks;
* the registry, a sandbox, a snapshot's record, Modify's plan and call, and fork's
  call, family walks and tree diff;
* a few helpers the edges share with it: ``defaults`` (its constants), ``rfc3339``,
  ``FsEntry``, ``CommandNotRun``, ``RunExit``, ``LOG_SOURCES``, ``collapse_single``, the principals'
  name check, the secret store's operations, and the host firewall the fleet's Ray
  node opens its ports in.
"""

from __future__ import annotations

from actors import defaults, from_snapshot
from actors._groups import collapse_single
from actors.channel.guest import FsEntry
from actors.errors import (
    AlreadyExists,
    DeadlineExceeded,
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from actors.events import Lagged
from actors.fork import Forked, descendants, fork, is_descendant, remove_with_descendants
from actors.forkpoint import contents_with_snapshot, diff_with_snapshot, fork_point_of, sandbox_head
from actors.model import (
    ALIVE,
    ENDED,
    V1_STATE,
    Action,
    BootSource,
    Cause,
    Dns,
    Egress,
    HostMount,
    InitSpec,
    Limits,
    MemoryKind,
    NetMode,
    Network,
    PortSpec,
    Protocol,
    PullAuth,
    SandboxConfig,
    SandboxEvent,
    SandboxMetrics,
    State,
    Timers,
    TmpfsMount,
    VolumeMount,
    VolumeRecord,
    Workload,
)
from actors.modify import Modification, Plan, Policy, SecretChange, modify
from actors.net import profiles
from actors.net.nft import Nft
from actors.principals import Principal
from actors.principals import check_name as check_principal_name
from actors.registry import DEFAULT_STOP_TIMEOUT, Registry
from actors.rules import check_labels, check_port, script_argv
from actors.sandboxes.logs import SOURCES as LOG_SOURCES
from actors.sandboxes.sandbox import Sandbox
from actors.sandboxes.secrets import describe as describe_sandbox_secrets
from actors.sandboxes.secrets import remove as remove_sandbox_secret
from actors.sandboxes.secrets import remove_named as remove_stored_secret
from actors.sandboxes.secrets import rotate as rotate_sandbox_secret
from actors.sandboxes.secrets import set_named as set_stored_secret
from actors.sandboxes.sessions import HeldSession
from actors.sandboxes.workload import CommandNotRun, RunExit
from actors.secrets.model import HEADERS, SecretRef
from actors.snapshots.snapshot import rfc3339
from actors.store import SnapshotRecord
from actors.treediff import Change
from actors.treediff import diff as diff_trees

__all__ = [
    "ALIVE",
    "DEFAULT_STOP_TIMEOUT",
    "ENDED",
    "HEADERS",
    "LOG_SOURCES",
    "V1_STATE",
    "Action",
    "AlreadyExists",
    "BootSource",
    "Cause",
    "Change",
    "CommandNotRun",
    "DeadlineExceeded",
    "Dns",
    "DomainError",
    "Egress",
    "FailedPrecondition",
    "Forked",
    "FsEntry",
    "HeldSession",
    "HostMount",
    "InitSpec",
    "InvalidArgument",
    "Lagged",
    "Limits",
    "MemoryKind",
    "Modification",
    "NetMode",
    "Network",
    "Nft",
    "NotFound",
    "PermissionDenied",
    "Plan",
    "Policy",
    "PortSpec",
    "Principal",
    "Protocol",
    "PullAuth",
    "Registry",
    "ResourceExhausted",
    "RunExit",
    "Sandbox",
    "SandboxConfig",
    "SandboxEvent",
    "SandboxMetrics",
    "SecretChange",
    "SecretRef",
    "SnapshotRecord",
    "State",
    "Timers",
    "TmpfsMount",
    "Unavailable",
    "Unimplemented",
    "VolumeMount",
    "VolumeRecord",
    "Workload",
    "check_labels",
    "check_port",
    "check_principal_name",
    "collapse_single",
    "contents_with_snapshot",
    "defaults",
    "descendants",
    "describe_sandbox_secrets",
    "diff_trees",
    "diff_with_snapshot",
    "fork",
    "fork_point_of",
    "from_snapshot",
    "is_descendant",
    "modify",
    "profiles",
    "remove_sandbox_secret",
    "remove_stored_secret",
    "remove_with_descendants",
    "rfc3339",
    "rotate_sandbox_secret",
    "sandbox_head",
    "script_argv",
    "set_stored_secret",
]
