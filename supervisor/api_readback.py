"""The read-back methods (sandvisor extensions): ``Config``, a sandbox's whole
configuration as the Create that makes an equal one (:mod:`supervisor.config_readback`),
and ``SshEndpoint``, where ``serve --ssh`` serves it (docs/ssh.md)."""

from __future__ import annotations

import base64
import hashlib

from actors.errors import Unavailable
from actors.registry import Registry
from supervisor import access, config_readback, protocol
from supervisor.api_table import CallIO, Table

TABLE = Table()
method = TABLE.method


@method("Config", protocol.ConfigRequest)
async def _config(reg: Registry, io: CallIO, req: protocol.ConfigRequest) -> protocol.SandboxConfigResponse:
    sb = access.sandbox(reg, io.principal, req.id)
    cfg = sb.config
    image = sb.record.image
    return protocol.SandboxConfigResponse(
        id=sb.id,
        config=config_readback.create_request(cfg, sb.limits, patch_data=req.patch_data),
        patches=config_readback.patch_info(cfg),
        image_digest=image.digest if image is not None else "",
    )


def fingerprint(key_line: str) -> str:
    """An OpenSSH public key line's fingerprint as ``ssh-keygen -l`` prints it (SHA256:...)."""
    blob = base64.b64decode(key_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def endpoint(address: str, host_key: str, sandbox_id: str) -> protocol.SshEndpoint:
    """The endpoint of ``serve --ssh`` bound at ``address`` (HOST:PORT) for one sandbox:
    a wildcard bind is reached on loopback; an id holding a ``+`` is logged in as ``ID+``."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    kind, blob = host_key.split()[:2]
    pinned = host if port == "22" else f"[{host}]:{port}"
    return protocol.SshEndpoint(
        host=host,
        port=int(port),
        user=sandbox_id + "+" if "+" in sandbox_id else sandbox_id,
        host_key=host_key,
        fingerprint=fingerprint(host_key),
        known_hosts=f"{pinned} {kind} {blob}",
    )


@method("SshEndpoint", protocol.IdRequest)
async def _ssh_endpoint(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.SshEndpoint:
    sb = access.sandbox(reg, io.principal, req.id)
    address, host_key = reg.endpoints.get("ssh"), reg.endpoints.get("ssh_host_key")
    if not address or not host_key:
        raise Unavailable("this supervisor serves no SSH endpoint (serve --ssh HOST:PORT; docs/ssh.md)")
    return endpoint(address, host_key, sb.id)
