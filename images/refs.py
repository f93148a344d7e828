"""Which image references a client may make the supervisor pull (the confused deputy).

A pull runs skopeo as the supervisor (root): without these rules a client names any
host path (``docker-archive:/etc/shadow``) or any host-local service
(``docker://127.0.0.1:PORT``, ``docker://169.254.169.254/...``) and root reads or
fetches it for them. :class:`RefPolicy` is what ``serve --allow-path`` and
``serve --registry-allow`` say, checked by :meth:`images.oci.ImageStore.pull` before
the store's cache and before skopeo sees the reference::

    oci:DIR[:TAG]  oci-archive:FILE[:TAG]  docker-archive:FILE[:NAME:TAG]
        path realpath-checked: no symlink on the way, no '..', inside an --allow-path
        directory, a directory (oci:) or a regular file (the archives)
        else NOT_FOUND, one message for "missing" and "not allowed" (no probing)
    docker://HOST[:PORT]/NAME...  (and plain names: alpine is docker.io/library/alpine:latest)
        --registry-allow given: HOST or HOST:PORT must be listed (else FAILED_PRECONDITION)
        not listed: the host is resolved once; loopback, link-local or unspecified
        addresses are refused (FAILED_PRECONDITION), naming the flag that allows it
        a registry with a mirror (serve --registry-mirror REGISTRY=URL): fetched from
        the mirror, which the operator named (not checked again); the image keeps its
        name (docker.io/library/alpine:latest), whichever host served it

Remaining windows (docs/security.md): skopeo resolves the registry's name again (a name
that rebinds to 127.0.0.1 between the check and skopeo's connection gets through); a
registry may redirect blob downloads to another host, which skopeo follows; a local
path is checked by name, so whoever may write inside an allowed directory could swap a
symlink in between the check and skopeo's open (allow only directories that only
trusted users write). The other transports skopeo knows (``dir:``,
``docker-daemon:``, ``containers-storage:``, ...) are not references at all here
(INVALID_ARGUMENT, whatever the path).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import trio

from images.oci import FAILED_PRECONDITION, ImageError, ImageNotFound, Reference, RegistryUnavailable

log = logging.getLogger("sandvisor.images")

LOCAL_DIRS = frozenset({"oci"})  # transports whose path is a directory
LOCAL_FILES = frozenset({"oci-archive", "docker-archive"})  # ... a regular file
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


class RegistryRefused(ImageError):
    """The registry is not one this supervisor pulls from (serve --registry-allow)."""

    code = FAILED_PRECONDITION


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (once, in a thread: getaddrinfo blocks)."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def split_host(spec: str) -> tuple[str, int | None]:
    """``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT`` -> (host lowercased, port or None)."""
    s = spec.strip().lower()
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad registry {spec!r}: expected HOST[:PORT] or [V6][:PORT]")
        port_s = rest[1:] if rest else None
    else:
        host, sep, port_s = s.partition(":")
        port_s = port_s if sep else None
        if ":" in (port_s or ""):
            raise ValueError(f"bad registry {spec!r}: an IPv6 address goes in brackets, [::1]:5000")
    if not host or any(c.isspace() or c == "/" for c in host):
        raise ValueError(f"bad registry {spec!r}: expected HOST[:PORT]")
    if port_s is not None and (not port_s.isdigit() or not 0 < int(port_s) <= 65535):
        raise ValueError(f"bad registry {spec!r}: the port is 1-65535")
    return host, int(port_s) if port_s is not None else None


def internal_address(addr: str) -> bool:
    """Loopback, link-local or unspecified (0.0.0.0 and :: reach the host itself), also as
    an IPv4-mapped IPv6 address."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return True  # not an address we can judge: refused
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_link_local or ip.is_unspecified


@attrs.frozen
class Mirror:
    """``serve --registry-mirror REGISTRY=URL``: REGISTRY's images are fetched from ``host``."""

    registry: str  # HOST[:PORT] as references spell it (docker.io)
    host: str  # HOST[:PORT] of the mirror
    insecure: bool = False  # http://: plain HTTP (skopeo --tls-verify=false)


def parse_mirror(spec: str) -> Mirror:
    """``REGISTRY=URL``: URL is ``HOST[:PORT]`` or ``https://HOST[:PORT]`` (TLS, verified)
    or ``http://HOST[:PORT]`` (plain HTTP); no path. ValueError names what is wrong."""
    registry, sep, url = spec.partition("=")
    if not sep or not registry or not url:
        raise ValueError(f"--registry-mirror {spec!r}: expected REGISTRY=URL, e.g. docker.io=https://mirror.example")
    insecure = url.startswith("http://")
    url = url.removeprefix("http://").removeprefix("https://").rstrip("/")
    if "/" in url or "://" in url:
        raise ValueError(f"--registry-mirror {spec!r}: the mirror is HOST[:PORT], with no path")
    reg_host, reg_port = split_host(registry)
    host, port = split_host(url)
    return Mirror(_join_host(reg_host, reg_port), _join_host(host, port), insecure)


def _join_host(host: str, port: int | None) -> str:
    return (f"[{host}]" if ":" in host else host) + (f":{port}" if port else "")


@attrs.frozen
class RefPolicy:
    """``allowed_paths``: directories local references may name (serve --allow-path; none:
    no local reference). ``registry_allow``: HOST or HOST:PORT the supervisor may pull from
    (serve --registry-allow; empty: any registry not on loopback or link-local).
    ``unrestricted``: the operator's own command line (``python -m images.oci``), no deputy."""

    allowed_paths: tuple[Path, ...] = ()
    registry_allow: tuple[str, ...] = ()
    unrestricted: bool = False
    resolver: Resolver = attrs.field(default=resolve, eq=False, repr=False)
    registry_mirrors: tuple[str, ...] = ()  # REGISTRY=URL (serve --registry-mirror)
    _allow: tuple[tuple[str, int | None], ...] = attrs.field(init=False, eq=False, repr=False)
    _mirrors: dict[str, Mirror] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_allow", tuple(split_host(s) for s in self.registry_allow))
        mirrors = [parse_mirror(s) for s in self.registry_mirrors]
        object.__setattr__(self, "_mirrors", {m.registry: m for m in mirrors})
        if len(self._mirrors) < len(mirrors):
            raise ValueError("--registry-mirror: one mirror per registry")

    def mirror(self, r: Reference) -> Mirror | None:
        """The mirror ``r``'s registry is fetched from, if the operator named one."""
        return self._mirrors.get(r.domain) if r.is_registry else None

    # -- local transports -------------------------------------------------------------
    def check_local(self, r: Reference) -> None:
        """The path of an ``oci:``/``oci-archive:``/``docker-archive:`` reference, or
        NOT_FOUND: the same message whether it is missing, not allowed, a symlink or of the
        wrong type (the reason is logged for the operator, not told to the client)."""
        if self.unrestricted:
            return
        why = self._local_refusal(r)
        if why is not None:
            log.info("image %s refused: %s", r, why)
            raise ImageNotFound(not_found_message(r))

    def _local_refusal(self, r: Reference) -> str | None:
        path = r.path
        if not os.path.isabs(path) or ".." in Path(path).parts:
            return "not an absolute path without '..'"
        dirs = [d.resolve() for d in self.allowed_paths]
        if not any(Path(path).is_relative_to(d) for d in dirs):
            return "not in an --allow-path directory"
        try:
            real = os.path.realpath(path, strict=True)
            st = os.lstat(path)
        except OSError as exc:
            return f"cannot be read: {exc.strerror}"
        if real != path:
            return f"reached through a symlink (it is {real})"
        want_dir = r.transport in LOCAL_DIRS
        if want_dir and not stat.S_ISDIR(st.st_mode):
            return "not a directory"
        if not want_dir and not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        return None

    # -- registries ---------------------------------------------------------------------
    def listed(self, domain: str) -> bool:
        """``domain`` (a reference's HOST[:PORT]) is named by --registry-allow."""
        host, port = split_host(domain)
        return any(h == host and (p is None or p == port) for h, p in self._allow)

    async def check_registry(self, r: Reference) -> None:
        """Before skopeo contacts ``r``'s registry: listed, or (no list) not internal."""
        if self.unrestricted or self.mirror(r) is not None:
            return  # (a mirror: the operator's own choice of host)
        domain = r.domain
        if self.listed(domain):
            return
        if self._allow:
            raise RegistryRefused(
                f"{r}: registry {domain} is not one this supervisor pulls from "
                f"(serve --registry-allow: {', '.join(self.registry_allow)})"
            )
        host, port = split_host(domain)
        if host == "localhost" or host.endswith(".localhost"):
            bad = host
        else:
            try:
                addresses = await self.resolver(host, port or 443)
            except OSError as exc:
                raise RegistryUnavailable(f"{r}: cannot reach the registry: {host} does not resolve ({exc})") from None
            bad = next((a for a in addresses if internal_address(a)), "")
        if bad:
            raise RegistryRefused(
                f"{r}: registry {domain} is on the supervisor's host or link ({bad}): "
                f"serve --registry-allow {domain} allows it"
            )


def not_found_message(r: Reference) -> str:
    """What a client is told for a local reference it may not have: the same for a path
    that does not exist and one it may not read."""
    return (
        f"{r.transport}:{r.path}: no such image on the supervisor's host "
        "(local references are read from serve --allow-path directories only)"
    )
