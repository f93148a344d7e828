"""The plans of a supervisor's stores of disks and images (see :mod:`supervisor.client.sdk.ops`):
named volumes, and the OCI image store (pull with progress, list, inspect, remove, prune).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from supervisor.client.sdk.ops import (
    Open,
    Plan,
    Receive,
    StreamPlan,
    Target,
    Unary,
    each,
)
from supervisor.client.sdk.spec import (
    parse_size,
)
from supervisor.wire import protocol
from supervisor.wire.errors import error_for
from supervisor.wire.protocol import (
    OciImageInfo,
    PruneImagesResponse,
    PullImageProgress,
    RemoveImageResponse,
    VolumeInfo,
)


# --- volumes and images ---------------------------------------------------------------------
def volume_create(
    t: Target, name: str, size: int | str = "256M", *, labels: Mapping[str, str] | None = None
) -> Plan[VolumeInfo]:
    mib = -(-parse_size(size) // (1 << 20))
    req = protocol.CreateVolumeRequest(name=name, size_mib=mib, labels=dict(labels or {}))
    info: VolumeInfo = yield Unary("CreateVolume", req, VolumeInfo)
    return info


def volume_get(t: Target, name: str) -> Plan[VolumeInfo]:
    info: VolumeInfo = yield Unary("InspectVolume", protocol.NameRequest(name=name), VolumeInfo)
    return info


def volume_list(t: Target, *, labels: Mapping[str, str] | None = None) -> Plan[builtins.list[VolumeInfo]]:
    r: protocol.ListVolumesResponse = yield Unary(
        "ListVolumes", protocol.ListVolumesRequest(labels=dict(labels or {})), protocol.ListVolumesResponse
    )
    return r.volumes


def volume_remove(t: Target, name: str, *, force: bool = False) -> Plan[None]:
    """FAILED_PRECONDITION while a live sandbox mounts it; ``force``: those sandboxes
    are killed first (they stay, stopped)."""
    yield Unary("DeleteVolume", protocol.DeleteVolumeRequest(name=name, force=force), protocol.Empty)


Pull_ = Literal["", "always", "if-missing", "never"]


def _pull_request(
    ref: str, policy: Pull_, tls_verify: bool, creds: str, authfile: str | Path | None, ca: str | Path | None = None
) -> protocol.PullImageRequest:
    auth = Path(authfile).read_bytes() if authfile is not None else b""
    ca_pem = Path(ca).read_bytes() if ca is not None else b""
    return protocol.PullImageRequest(
        ref=ref, policy=policy, tls_verify=None if tls_verify else False, creds=creds, auth_json=auth, ca_pem=ca_pem
    )


def image_pull_stream(
    t: Target,
    ref: str,
    *,
    policy: Pull_ = "",
    tls_verify: bool = True,
    creds: str = "",
    authfile: str | Path | None = None,
    ca: str | Path | None = None,
) -> StreamPlan[PullImageProgress]:
    """Progress items; the last is ``phase == "done"`` with ``.image`` set. ``ca``: a
    PEM file of CA certificates for the registry (read here, sent as content)."""
    return each("PullImage", _pull_request(ref, policy, tls_verify, creds, authfile, ca), PullImageProgress)


def image_pull(
    t: Target,
    ref: str,
    *,
    policy: Pull_ = "",
    tls_verify: bool = True,
    creds: str = "",
    authfile: str | Path | None = None,
    progress: Any = None,
    ca: str | Path | None = None,
) -> Plan[OciImageInfo]:
    """Pull ``ref`` (as ``policy`` says; default if-missing) and return the image;
    ``progress`` (a callable) sees every item on the way; ``ca``: a PEM file of CA
    certificates for the registry."""
    image = None
    call = yield Open("PullImage", _pull_request(ref, policy, tls_verify, creds, authfile, ca))
    while (item := (yield Receive(call, PullImageProgress))) is not None:
        if progress is not None:
            progress(item)
        if item.image is not None:
            image = item.image
    if image is None:
        raise error_for(protocol.INTERNAL, "PullImage ended without an image")
    got: OciImageInfo = image
    return got


def image_list(t: Target) -> Plan[builtins.list[OciImageInfo]]:
    r: protocol.ListImagesResponse = yield Unary("ListImages", protocol.Empty(), protocol.ListImagesResponse)
    return r.oci_images


def image_inspect(t: Target, ref: str) -> Plan[OciImageInfo]:
    info: OciImageInfo = yield Unary("InspectOciImage", protocol.ImageRefRequest(ref), OciImageInfo)
    return info


def image_remove(t: Target, ref: str) -> Plan[RemoveImageResponse]:
    """Untag ``ref``, or delete the image (a digest, or its last reference);
    FailedPrecondition while a sandbox, snapshot or template stands on it."""
    r: RemoveImageResponse = yield Unary("RemoveImage", protocol.ImageRefRequest(ref), RemoveImageResponse)
    return r


def image_prune(t: Target, *, dangling_only: bool = False) -> Plan[PruneImagesResponse]:
    r: PruneImagesResponse = yield Unary("PruneImages", protocol.PruneImagesRequest(dangling_only), PruneImagesResponse)
    return r
