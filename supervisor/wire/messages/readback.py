"""Read-back bodies (sandvisor extensions): a sandbox's whole configuration as a Create
would take it (Config), its SSH endpoint (SshEndpoint), and a detached exec session
attached again (Attach).

The field order of each class is the msgpack wire's (:mod:`supervisor.wire.protocol`).
"""

from __future__ import annotations

import attrs

from supervisor.wire.messages.sandboxes import CreateSandboxRequest


@attrs.frozen
class ConfigRequest:
    id: str
    patch_data: bool = False  # the file patches' bytes too (else described: size and digest)


@attrs.frozen
class PatchInfo:
    """One patch of a configuration, described: its bytes' size and SHA-256 (hex)."""

    op: str
    path: str
    size: int = 0
    sha256: str = ""


@attrs.frozen
class SandboxConfigResponse:
    """The effective configuration of sandbox ``id``, in the shape of the Create that
    makes an equal sandbox: secrets by name (never values: a secret of the sandbox's
    own value names no source; its ``store`` entry otherwise), generated placeholders
    left out (a new sandbox makes its own), file patches without their bytes unless
    asked (``patches`` describes each)."""

    id: str
    config: CreateSandboxRequest
    patches: list[PatchInfo] = attrs.field(factory=list)
    image_digest: str = ""  # the OCI image as resolved when the sandbox was made ("": none)


@attrs.frozen
class SshEndpoint:
    """Where ``serve --ssh`` serves a sandbox (docs/ssh.md): ``ssh -p PORT USER@HOST``;
    ``host_key``: the endpoint's public key (OpenSSH line), ``fingerprint`` its SHA256
    form as ssh prints it, ``known_hosts`` a line pinning it for HOST:PORT."""

    host: str
    port: int
    user: str
    host_key: str
    fingerprint: str
    known_hosts: str


@attrs.frozen
class AttachRequest:
    """Attach's first message: the detached session ``session_id`` of sandbox ``id``
    (its output since the detach comes first, then the live stream; later messages
    are ExecInput: stdin, resize, close_stdin, detach)."""

    id: str
    session_id: int
