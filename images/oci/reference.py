"""Image references as skopeo spells them (``docker://``, ``docker-archive:``, ``oci-archive:``,
``oci:``): parsing, the canonical spelling refs.json keys on, and digests.

Which references a client may name is images/refs.py's (RefPolicy)."""

from __future__ import annotations

import hashlib
import os
import re

import attrs

from images.oci.errors import InvalidReference

TRANSPORTS = ("docker", "docker-archive", "oci-archive", "oci")
_DOMAIN_LABEL = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN_RE = re.compile(rf"(?:{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?")
_COMPONENT_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*")
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_LOCAL_NAME_RE = re.compile(r"[A-Za-z0-9._-]+(?:[:/@][A-Za-z0-9._-]+)*")
DOCKER_HUB = "docker.io"
LEGACY_HUBS = frozenset({"index.docker.io", "registry-1.docker.io"})


@attrs.frozen
class Reference:
    """A parsed image reference. ``docker``: ``domain``/``path`` with ``tag`` and/or
    ``digest``; the local transports: ``path`` (absolute) and ``name`` (the tag, or for
    docker-archive the image's name:tag / @index, as skopeo reads it)."""

    transport: str
    path: str
    domain: str = ""
    tag: str = ""
    digest: str = ""
    name: str = ""

    @property
    def is_registry(self) -> bool:
        return self.transport == "docker"

    def canonical(self) -> str:
        """The normalized spelling: the key in refs.json and what Image.refs lists."""
        if self.is_registry:
            if self.digest:
                return f"docker://{self.domain}/{self.path}@{self.digest}"
            return f"docker://{self.domain}/{self.path}:{self.tag}"
        return f"{self.transport}:{self.path}" + (f":{self.name}" if self.name else "")

    def skopeo(self, digest: str = "") -> str:
        """The argument skopeo takes; ``digest`` pins a registry reference to one manifest."""
        if self.is_registry and digest:
            return f"docker://{self.domain}/{self.path}@{digest}"
        return self.canonical()

    def __str__(self) -> str:
        return self.canonical()


def parse_reference(ref: str) -> Reference:
    """``docker://[HOST/]NAME[:TAG][@sha256:HEX]``, ``docker-archive:PATH[:NAME:TAG|:@N]``,
    ``oci-archive:PATH[:TAG]``, ``oci:DIR[:TAG]``, or a plain name as docker reads it
    (``alpine``, ``python:3.12``, ``ghcr.io/org/x:1``, ``localhost:5000/x``,
    ``x@sha256:...``): a registry reference, docker.io's when its first component is no
    host (no '.' or ':', not ``localhost``), ``library/`` for a one-component name
    there, ``latest`` without a tag or digest. A transport is recognised only with its
    own syntax (``docker://``; a local one followed by an absolute path): ``oci:latest``
    is docker.io/library/oci:latest, as docker reads it. Paths must be absolute (a
    daemon has no business guessing its client's working directory)."""
    if not isinstance(ref, str) or not ref:
        raise InvalidReference("empty image reference")
    if len(ref) > 4096 or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in ref):
        raise InvalidReference(f"malformed image reference {ref[:80]!r}: whitespace or control characters")
    transport, sep, rest = ref.partition(":")
    if sep and transport == "docker" and rest.startswith("//"):
        return _parse_docker(ref, rest[2:])
    if sep and transport in TRANSPORTS and transport != "docker" and rest.startswith("/"):
        pass  # a local transport, below
    elif sep and rest.startswith("/"):  # "dir:/x", "http://x": a transport we do not take
        raise InvalidReference(
            f"malformed image reference {ref!r}: transport {transport!r} is not one of "
            "docker://HOST/NAME:TAG, docker-archive:PATH, oci-archive:PATH, oci:DIR[:TAG] (or a plain name)"
        )
    else:
        return _parse_docker(ref, ref)
    path, _, name = rest.partition(":")
    if not path or not path.startswith("/"):
        raise InvalidReference(f"malformed image reference {ref!r}: {transport}: takes an absolute path")
    if name and (len(name) > 255 or not _LOCAL_NAME_RE.fullmatch(name)):
        raise InvalidReference(f"malformed image reference {ref!r}: bad image name {name!r} after the path")
    return Reference(transport=transport, path=os.path.normpath(path), name=name)


def _parse_docker(ref: str, s: str) -> Reference:
    def bad(why: str) -> InvalidReference:
        return InvalidReference(f"malformed image reference {ref!r}: {why}")

    if not s:
        raise bad("no repository name")
    name, at, digest = s.partition("@")
    if at and not _DIGEST_RE.fullmatch(digest):
        raise bad("a digest is sha256: and 64 lowercase hex digits")
    tag = ""
    colon = name.rfind(":")
    if colon > name.rfind("/"):
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG_RE.fullmatch(tag):
            raise bad(f"bad tag {tag!r}")
    first, slash, remainder = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        domain, path = first, remainder
        if not _DOMAIN_RE.fullmatch(domain):
            raise bad(f"bad registry host {domain!r}")
        if domain in LEGACY_HUBS:  # docker's own aliases of Docker Hub
            domain = DOCKER_HUB
    else:
        domain, path = DOCKER_HUB, name
    if not path:
        raise bad("no repository name")
    for comp in path.split("/"):
        if not _COMPONENT_RE.fullmatch(comp):
            raise bad(f"bad repository name component {comp!r} (lowercase letters, digits and . _ - only)")
    if domain == DOCKER_HUB and "/" not in path:
        path = "library/" + path
    if len(domain) + 1 + len(path) > 255:
        raise bad("repository name longer than 255 characters")
    if digest:
        tag = ""  # a digest pins the image; a tag beside it is only decoration (as docker reads it)
    elif not tag:
        tag = "latest"
    return Reference(transport="docker", path=path, domain=domain, tag=tag, digest=digest)


def _digest_of(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _digest_like(ref: str) -> str | None:
    """The hex of ``sha256:HEX`` or of a bare 12-64 digit hex id; None for a reference."""
    s = ref.removeprefix("sha256:")
    if re.fullmatch(r"[0-9a-f]{12,64}", s) and (ref.startswith("sha256:") or ":" not in ref):
        return s
    return None
