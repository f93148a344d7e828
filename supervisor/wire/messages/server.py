"""The server's own bodies (sandvisor extensions): its info, named volumes and the OCI
image store, and the empty message.

The field order of each class is the msgpack wire's (:mod:`supervisor.wire.protocol`).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Empty:
    pass


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
    """An OCI image in the supervisor's store: what ``image ls`` shows and
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
