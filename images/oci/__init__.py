"""OCI and Docker images as sandbox root filesystems: pull, convert, cache.

A reference as skopeo spells it is pulled with skopeo into a staging OCI layout whose
blobs live in one shared, content-addressed blob directory, unpacked with umoci (which
applies whiteouts and opaque directories), and converted into a read-only, sparse ext4
file with ``mkfs.ext4 -d`` (no loop mounts, no privileges beyond file ownership). The
result is cached by the image's manifest digest; tags map onto digests in refs.json::

    pull("docker://127.0.0.1:5000/app:1")
      |
      |  parse  ----------------------------------------> InvalidReference
      |  policy if-missing / never: refs.json hit? ------> Image (no registry contact)
      v
    skopeo inspect --raw            manifest or index -> the linux/amd64 manifest digest
      |  images/<digest> exists? ------------------------> Image (+ the new ref)
      |  another pull of this digest running? wait for it, then look again
      v
    skopeo copy SRC@digest  oci:tmp/pull-*/layout:img --dest-shared-blob-dir blobs
      |   (digests verified on the way in; layers already in blobs/ are not fetched)
      v
    umoci raw unpack  tmp/pull-*/layout:img  tmp/pull-*/tree
      |   + mount points (/proc /sys /dev /tmp /run) and a missing WORKDIR created
      v
    mkfs.ext4 -d tree  tmp/pull-*/out/rootfs.ext4   (content + max(1 GiB, 50%), sparse)
      |   + image.json (digest, parsed config, blobs)
      v
    rename tmp/pull-*/out -> images/<hex>;  refs.json[ref] = digest

Layout of the store (``<state>/images/oci``)::

    blobs/sha256/<hex>        manifests, configs and layers, shared by every image
    images/<hex>/rootfs.ext4  the root filesystem (0444; sandboxes write to qcow2 overlays)
    images/<hex>/image.json   what the image is (Image, below)
    refs.json                 canonical reference -> manifest digest
    tmp/                      staging directories and the trash; never read as images

Every failure leaves the store as it was: work happens in a staging directory removed
on the way out (error or cancellation); an image appears by one rename. Two pulls of one
image in this store run the download and conversion once (the second waits). Errors are
ImageError subclasses whose ``code`` is one of sandbox.v1's codes.

Measured (benchmarks/oci_images.py, docs/results/images.md; 2 cores shared with other
engineers' TCG VMs, load 12-25): a 99 MB, 4-layer image (35 MB compressed) costs 3.3 s
of CPU to pull and convert against 2.8 s for skopeo copy + tar -xzf + mkfs.ext4 -d by
hand (1.18x; wall time 1.12x paired, 6-23 s under that load). umoci's unpack is most of
it; the ext4 takes 104 MB on disk for 1.3 GB virtual. A cached pull: 0.2 ms.

The package, one role a module:

    errors.py     ImageError and its codes; classify_failure (a tool's stderr -> the typed error)
    reference.py  Reference, parse_reference, digests (which refs a client may name: images/refs.py)
    image.py      Image, ImageConfig, parse_config (the OCI config's Env, WorkingDir, User, Cmd...)
    store.py      Store: the layout on disk, refs.json, blobs, lookups, remove, prune, GC
    pull.py       ImageStore = Store + the pull pipeline (skopeo, umoci, the size cap watcher)
    convert.py    the unpacked tree's fix-ups, sizing and mkfs.ext4's arguments
    __main__.py   ``python -m images.oci pull REF | ls | rm REF | prune``
"""

from __future__ import annotations

from images.oci.errors import (
    FAILED_PRECONDITION,
    INTERNAL,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    ConversionError,
    DigestMismatch,
    DiskFull,
    ImageError,
    ImageInUse,
    ImageNotFound,
    InvalidReference,
    RegistryAuthError,
    RegistryUnavailable,
    ToolMissing,
    UnsupportedImage,
    classify_failure,
)
from images.oci.image import Image, ImageConfig, parse_config
from images.oci.pull import GIB, ImageStore, ProgressFn, PullPolicy, PullProgress, StoreStats
from images.oci.reference import DOCKER_HUB, TRANSPORTS, Reference, parse_reference
from images.oci.store import PruneResult, RemoveResult, Store, default_store_root

__all__ = [
    "DOCKER_HUB",
    "FAILED_PRECONDITION",
    "GIB",
    "INTERNAL",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "RESOURCE_EXHAUSTED",
    "TRANSPORTS",
    "UNAVAILABLE",
    "ConversionError",
    "DigestMismatch",
    "DiskFull",
    "Image",
    "ImageConfig",
    "ImageError",
    "ImageInUse",
    "ImageNotFound",
    "ImageStore",
    "InvalidReference",
    "ProgressFn",
    "PruneResult",
    "PullPolicy",
    "PullProgress",
    "Reference",
    "RegistryAuthError",
    "RegistryUnavailable",
    "RemoveResult",
    "Store",
    "StoreStats",
    "ToolMissing",
    "UnsupportedImage",
    "classify_failure",
    "default_store_root",
    "parse_config",
    "parse_reference",
]
