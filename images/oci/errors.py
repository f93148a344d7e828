"""The image store's errors (each ``code`` one of sandbox.v1's) and how a tool's failure maps onto them."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from images.oci.reference import Reference

INVALID_ARGUMENT = "INVALID_ARGUMENT"
NOT_FOUND = "NOT_FOUND"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
INTERNAL = "INTERNAL"
UNAVAILABLE = "UNAVAILABLE"


class ImageError(Exception):
    """An image could not be pulled, converted, found or removed; ``code`` is sandbox.v1's."""

    code: ClassVar[str] = INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidReference(ImageError):
    """The reference is not one skopeo spells (or a bad pull option)."""

    code = INVALID_ARGUMENT


class ImageNotFound(ImageError):
    """No such repository, tag, digest, archive or directory (or not local under ``never``)."""

    code = NOT_FOUND


class RegistryUnavailable(ImageError):
    """The registry could not be reached (refused, no such host, TLS mismatch, timeout)."""

    code = UNAVAILABLE


class RegistryAuthError(ImageError):
    """The registry wants credentials, or refused the ones given.

    FAILED_PRECONDITION: sandbox.v1 has no UNAUTHENTICATED, and retrying the same call
    cannot succeed until the caller fixes its credentials."""

    code = FAILED_PRECONDITION


class DigestMismatch(ImageError):
    """A blob's content does not hash to its digest: the source is corrupt or tampered with."""

    code = FAILED_PRECONDITION


class UnsupportedImage(ImageError):
    """Not an image this host can run (another architecture or OS, schema 1, malformed config)."""

    code = FAILED_PRECONDITION


class ImageInUse(ImageError):
    """Removing the image would pull the root filesystem from under a sandbox or snapshot."""

    code = FAILED_PRECONDITION


class DiskFull(ImageError):
    """The store's file system filled up (or the image is over the store's size cap)."""

    code = RESOURCE_EXHAUSTED


class ToolMissing(ImageError):
    """skopeo, umoci or mkfs.ext4 is not installed (images/host-packages.sh installs them)."""

    code = FAILED_PRECONDITION


class ConversionError(ImageError):
    """A step of the conversion failed for a reason none of the above describes."""

    code = INTERNAL


_FATAL_RE = re.compile(r'level=fatal msg="((?:[^"\\]|\\.)*)"')


def _tool_message(stderr: str) -> str:
    """The error a tool printed, without logrus framing; the last lines otherwise."""
    m = _FATAL_RE.search(stderr)
    if m:
        return m.group(1).replace('\\"', '"').replace("\\\\", "\\")
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-3:]) or "no message"


def classify_failure(stderr: str, r: Reference, step: str, *, has_creds: bool) -> ImageError:
    """A skopeo/umoci/mkfs failure -> the typed error a caller can act on."""
    msg = _tool_message(stderr)
    s = stderr.lower()
    where = f"{r}: {step}"
    if "no space left on device" in s or "disk quota exceeded" in s:
        return DiskFull(f"{where}: the image store's disk is full ({msg})")
    if "digest did not match" in s or "digest mismatch" in s or ("digest" in s and "does not match" in s):
        return DigestMismatch(f"{where}: content does not match its digest, the source is corrupt ({msg})")
    if "unauthorized" in s or "authentication required" in s or "requested access to the resource is denied" in s:
        if has_creds:
            return RegistryAuthError(f"{where}: the registry refused the credentials ({msg})")
        return RegistryAuthError(f"{where}: the registry requires credentials; pass creds or an auth file ({msg})")
    if "server gave http response to https client" in s:
        return RegistryUnavailable(f"{where}: the registry speaks plain HTTP; pull with tls_verify=False ({msg})")
    if "manifest unknown" in s or "name unknown" in s or "no descriptor found" in s or "not found" in s:
        return ImageNotFound(f"{where}: no such image ({msg})")
    if "no such file or directory" in s and not r.is_registry:
        return ImageNotFound(f"{where}: {msg}")
    unreachable = (
        "connection refused",
        "no such host",
        "i/o timeout",
        "network is unreachable",
        "connection reset",
        "no route to host",
        "timeout",
        "x509:",
        "tls:",
        "pinging container registry",
    )
    if any(u in s for u in unreachable):
        return RegistryUnavailable(f"{where}: cannot reach the registry ({msg})")
    if "more than one image" in s:
        return InvalidReference(f"{where}: the source holds several images; name one after the path ({msg})")
    if "invalid reference format" in s:
        return InvalidReference(f"{where}: {msg}")
    if "could not allocate block" in s or "could not allocate inode" in s:
        return ConversionError(f"{where}: the ext4 file was sized too small ({msg})")
    if not r.is_registry and ("archive" in s or "tar" in s or "invalid" in s or "unexpected" in s):
        return UnsupportedImage(f"{where}: not a readable {r.transport} image ({msg})")
    return ConversionError(f"{where} failed: {msg}")
