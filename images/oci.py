"""OCI and Docker images as sandbox root filesystems: pull, convert, cache (issue 15).

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
ImageError subclasses whose ``code`` is one of the seed's codes.

Measured (benchmarks/oci_images.py, docs/results/images.md; 2 cores shared with other
engineers' TCG VMs, load 12-25): a 99 MB, 4-layer image (35 MB compressed) costs 3.3 s
of CPU to pull and convert against 2.8 s for skopeo copy + tar -xzf + mkfs.ext4 -d by
hand (1.18x; wall time 1.12x paired, 6-23 s under that load). umoci's unpack is most of
it; the ext4 takes 104 MB on disk for 1.3 GB virtual. A cached pull: 0.2 ms.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import trio

from images.tools import READ_CAPS, SHIFT_COUNT, UNPACK_CAPS, ToolBind, ToolError, ToolIdentity, ToolRunner, bind

if TYPE_CHECKING:
    from images.refs import RefPolicy

# -- errors ------------------------------------------------------------------------

INVALID_ARGUMENT = "INVALID_ARGUMENT"
NOT_FOUND = "NOT_FOUND"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
INTERNAL = "INTERNAL"
UNAVAILABLE = "UNAVAILABLE"


class ImageError(Exception):
    """An image could not be pulled, converted, found or removed; ``code`` is the seed's."""

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

    FAILED_PRECONDITION: the seed has no UNAUTHENTICATED, and retrying the same call
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


# -- references --------------------------------------------------------------------

TRANSPORTS = ("docker", "docker-archive", "oci-archive", "oci")
_DOMAIN_LABEL = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN_RE = re.compile(rf"(?:{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?")
_COMPONENT_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*")
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_LOCAL_NAME_RE = re.compile(r"[A-Za-z0-9._-]+(?:[:/@][A-Za-z0-9._-]+)*")
DOCKER_HUB = "docker.io"


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
    ``oci-archive:PATH[:TAG]``, ``oci:DIR[:TAG]``. A transport is required (a bare
    ``busybox`` might mean a registry on the internet); paths must be absolute (a daemon
    has no business guessing its client's working directory)."""
    if not isinstance(ref, str) or not ref:
        raise InvalidReference("empty image reference")
    if len(ref) > 4096 or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in ref):
        raise InvalidReference(f"malformed image reference {ref[:80]!r}: whitespace or control characters")
    transport, sep, rest = ref.partition(":")
    if not sep or transport not in TRANSPORTS:
        raise InvalidReference(
            f"malformed image reference {ref!r}: it needs a transport, one of "
            "docker://HOST/NAME:TAG, docker-archive:PATH, oci-archive:PATH, oci:DIR[:TAG]"
        )
    if transport == "docker":
        if not rest.startswith("//"):
            raise InvalidReference(f"malformed image reference {ref!r}: docker references start with docker://")
        return _parse_docker(ref, rest[2:])
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


# -- values ------------------------------------------------------------------------


class PullPolicy(enum.StrEnum):
    ALWAYS = "always"  # resolve the reference every time; fetch only what is new
    IF_MISSING = "if-missing"  # no registry contact when the reference is cached
    NEVER = "never"  # only what is in the store; a miss is NOT_FOUND


@attrs.frozen
class ImageConfig:
    """What an image says about how to run it (the OCI config's ``config`` object)."""

    env: tuple[str, ...] = ()  # "KEY=VALUE", in the image's order
    working_dir: str = ""
    user: str = ""  # name, uid, name:group or uid:gid, as the image spells it; "" = root
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    stop_signal: str = ""
    exposed_ports: tuple[str, ...] = ()
    volumes: tuple[str, ...] = ()
    architecture: str = "amd64"
    os: str = "linux"
    created: str = ""

    def env_dict(self) -> dict[str, str]:
        """Env as a mapping (a later duplicate wins, as in a container runtime)."""
        out: dict[str, str] = {}
        for item in self.env:
            key, _, value = item.partition("=")
            if key:
                out[key] = value
        return out

    def argv(self, cmd: Sequence[str] = ()) -> list[str]:
        """The initial workload: Entrypoint + (``cmd`` if given, else the image's Cmd)."""
        return [*self.entrypoint, *(cmd or self.cmd)]


@attrs.frozen
class Image:
    """A pulled and converted image, ready to boot."""

    digest: str  # "sha256:..." of the (linux/amd64) manifest: the cache key
    config_digest: str  # the image ID as docker shows it
    config: ImageConfig
    rootfs: Path  # images/<hex>/rootfs.ext4, read-only
    rootfs_uuid: str  # the ext4 UUID, new at every conversion
    refs: tuple[str, ...]  # canonical references that name this image here
    layers: tuple[str, ...]  # layer digests, lowest first
    blobs: tuple[str, ...]  # every blob in blobs/ this image keeps (manifest, config, layers)
    content_bytes: int  # bytes of the unpacked tree
    disk_bytes: int  # virtual size of rootfs.ext4 (sparse)
    download_bytes: int  # the layers' sizes as the source stores them
    source: str  # the reference it was first pulled from
    pulled_at: float

    @property
    def id(self) -> str:
        """Short id for tables: 12 hex digits of the digest."""
        return self.digest.removeprefix("sha256:")[:12]

    @property
    def template_key(self) -> str:
        """What a boot template of this image must match: the digest names the content,
        the UUID this very ext4 file (a re-pull after ``rm`` makes a different file whose
        block layout a memory snapshot must not be restored against)."""
        return f"{self.digest}/{self.rootfs_uuid}"


@attrs.frozen
class PullProgress:
    """One step of a pull, for a progress display. ``done``/``total`` are bytes while
    downloading (layers already in the store count as done)."""

    ref: str
    phase: str  # resolving | cached | waiting | downloading | unpacking | converting | done
    message: str = ""
    done: int = 0
    total: int = 0
    digest: str = ""


ProgressFn = Callable[[PullProgress], None]


@attrs.frozen
class RemoveResult:
    untagged: tuple[str, ...]  # references removed
    deleted: tuple[str, ...]  # digests of images deleted
    freed_bytes: int


@attrs.frozen
class PruneResult:
    deleted: tuple[str, ...]  # digests of images deleted
    blobs_deleted: int
    freed_bytes: int
    blobs_skipped: bool  # pulls were running: blob collection left for next time


def _quiet(_p: PullProgress) -> None:
    pass


@attrs.frozen
class _Tool:
    """How one tool runs in its cell (with a ToolRunner; ignored without)."""

    identity: ToolIdentity | None  # None: root of the tools' user namespace
    binds: tuple[ToolBind, ...]
    host_network: bool = False
    keep_caps: tuple[int, ...] = ()
    fsize: int | None = None


@attrs.define
class _Job:
    """One pull's work dirs and ids (see ImageStore._job)."""

    stage: Path
    fetch: Path  # skopeo's: --tmpdir, auth file, layout, blob dir
    owner: tuple[int, int] | None  # the pull's id (uid, gid) with cells; None: the supervisor's
    shift: int  # the host id of the tools' user namespace root (0: no cells)
    identity: ToolIdentity | None = None
    src: Path | None = None  # a local source, copied into fetch (with cells)

    def source(self, r: Reference, digest: str = "") -> str:
        """What skopeo reads: the reference, or the copy of a local one."""
        if self.src is None:
            return r.skopeo(digest)
        return f"{r.transport}:{self.src}" + (f":{r.name}" if r.name else "")


# -- the store -----------------------------------------------------------------------

_CODE_VERSION = 1  # bump when the conversion changes what a rootfs holds
_MANIFEST_MAX = 4 << 20
_CONFIG_MAX = 32 << 20
_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_MOUNT_POINTS = (("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("tmp", 0o1777), ("run", 0o755))
_ANON_POLICY = {"default": [{"type": "insecureAcceptAnything"}]}
GIB = 1 << 30


@attrs.define
class StoreStats:
    """Counters for tests and benchmarks: what the store actually did."""

    resolves: int = 0
    copies: int = 0
    conversions: int = 0


class ImageStore:
    """The image store at ``root`` (``<state>/images/oci``); one per supervisor.

    ``max_image_bytes``: refuse (DiskFull) an image whose download or unpacked tree is
    larger, as the bytes arrive (``serve --max-image-size``).
    ``free_min``/``free_ratio``: room left in each ext4 for the sandbox's own writes.
    ``tools``: skopeo, umoci and mkfs.ext4 run in cells (images/tools.py's ToolRunner,
    actors/toolcell.py's ToolCells); None (``--no-jail``): as the supervisor, as before.
    ``refs``: the references a client may name (images/refs.py; default: no local path,
    no registry on loopback or link-local)."""

    def __init__(
        self,
        root: Path,
        *,
        max_image_bytes: int | None = None,
        free_min: int = GIB,
        free_ratio: float = 0.5,
        tools: ToolRunner | None = None,
        refs: RefPolicy | None = None,
    ) -> None:
        from images.refs import RefPolicy  # (images.refs imports this module)

        self.refs = refs if refs is not None else RefPolicy()
        self.root = root
        self.blobs = root / "blobs"
        self.images = root / "images"
        self.tmp = root / "tmp"
        self.max_image_bytes = max_image_bytes
        self.tools = tools
        self.free_min = free_min
        self.free_ratio = free_ratio
        self.stats = StoreStats()
        self._inflight: dict[str, trio.Event] = {}
        self._active_staging: set[Path] = set()
        self._pulls = 0
        for d in (root, self.blobs / "sha256", self.images, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        for d in (root, self.images):
            d.chmod(0o755)  # QEMU may run as another user: it opens images/<hex>/rootfs.ext4
        self._sweep_dead_staging()

    # -- lookups ------------------------------------------------------------------
    def list_images(self) -> list[Image]:
        """Every image in the store, newest pull first."""
        refs = self._read_refs()
        out = [img for d in self.images.iterdir() if (img := self._load(d.name, refs)) is not None]
        return sorted(out, key=lambda i: i.pulled_at, reverse=True)

    def get(self, ref: str) -> Image:
        """The local image a reference (or a digest, or 12+ hex digits of one) names."""
        img = self._lookup(ref)
        if img is None:
            raise ImageNotFound(f"image {ref} is not in the store (pull it first)")
        return img

    def _lookup(self, ref: str) -> Image | None:
        refs = self._read_refs()
        hexd = _digest_like(ref)
        if hexd is not None:
            matches = [d.name for d in self.images.iterdir() if d.name.startswith(hexd)]
            if len(matches) > 1:
                raise InvalidReference(f"{ref} is ambiguous: it matches {len(matches)} images")
            return self._load(matches[0], refs) if matches else None
        r = parse_reference(ref)
        digest = refs.get(r.canonical()) or r.digest
        return self._load(digest.removeprefix("sha256:"), refs) if digest else None

    # -- pull -----------------------------------------------------------------------
    async def pull(
        self,
        ref: str,
        *,
        policy: PullPolicy | str = PullPolicy.IF_MISSING,
        tls_verify: bool = True,
        creds: str | None = None,
        authfile: Path | None = None,
        auth_json: bytes | None = None,
        progress: ProgressFn | None = None,
    ) -> Image:
        """The image ``ref`` names, pulled and converted if needed (see the module doc).

        ``tls_verify=False``: plain HTTP (or unverified HTTPS) to the registry.
        ``creds``: "USER:PASSWORD"; ``authfile``: a docker-style auth file;
        ``auth_json``: the content of one (what a remote client sends: the supervisor
        never opens a path its client names). None of them: the registry is accessed
        anonymously (never with the supervisor's own credentials).
        ``progress``: called (synchronously; must not block) at every step."""
        emit = progress or _quiet
        try:
            policy = PullPolicy(policy)
        except ValueError:
            raise InvalidReference(f"pull policy {policy!r} is not one of always, if-missing, never") from None
        if creds is not None and (":" not in creds or not creds.partition(":")[0]):
            raise InvalidReference("creds must be USER:PASSWORD")
        if authfile is not None and not authfile.is_file():
            raise InvalidReference(f"auth file {authfile} does not exist")
        if auth_json is not None:
            _check_auth_json(auth_json)
        if sum(x is not None for x in (creds, authfile, auth_json)) > 1:
            raise InvalidReference("give one of creds, an auth file")
        if _digest_like(ref) is not None:
            if policy is PullPolicy.ALWAYS:
                raise InvalidReference(f"{ref} names a local image: pull a reference with a transport")
            return self.get(ref)
        r = parse_reference(ref)
        if not r.is_registry:  # before the cache: a path the client may not name is never an answer
            self.refs.check_local(r)
        if policy is not PullPolicy.ALWAYS:
            cached = self._lookup(ref)
            if cached is not None:
                if r.canonical() not in cached.refs:  # NAME@digest of an image pulled by tag: now a name too
                    self._add_ref(r.canonical(), cached.digest)
                    cached = self.get(cached.digest)
                emit(PullProgress(ref, "cached", "in the store", digest=cached.digest))
                return cached
            if policy is PullPolicy.NEVER:
                raise ImageNotFound(f"image {r} is not in the store and the pull policy is never")
        if r.is_registry:
            await self.refs.check_registry(r)
        self._pulls += 1
        try:
            return await self._pull(r, emit, tls_verify=tls_verify, creds=creds, authfile=authfile, auth_json=auth_json)
        finally:
            self._pulls -= 1

    async def _pull(
        self,
        r: Reference,
        emit: ProgressFn,
        *,
        tls_verify: bool,
        creds: str | None,
        authfile: Path | None,
        auth_json: bytes | None = None,
    ) -> Image:
        ref = r.canonical()
        async with self._staging("pull") as stage, self._job(r, stage) as job:
            auth = self._auth_args(r, job.fetch, creds, authfile, auth_json, job.owner)
            if not r.is_registry and self.tools is not None:
                emit(PullProgress(ref, "resolving", "copying the local image into the staging dir"))
                job.src = await trio.to_thread.run_sync(self._copy_local, r, job)
            emit(PullProgress(ref, "resolving", "reading the manifest"))
            digest, layers = await self._resolve(r, job, auth, tls_verify, auth != ["--no-creds"] and bool(auth))
            hexd = digest.removeprefix("sha256:")
            while True:
                if self._load(hexd) is not None:
                    self._add_ref(ref, digest)
                    emit(PullProgress(ref, "done", "already in the store", digest=digest))
                    return self.get(digest)
                ev = self._inflight.get(hexd)
                if ev is None:
                    break
                emit(PullProgress(ref, "waiting", "another pull of this image is running", digest=digest))
                await ev.wait()  # then look again: it may have failed (bad creds of its caller)
            ev = trio.Event()
            self._inflight[hexd] = ev
            try:
                await self._fetch_and_convert(r, digest, layers, job, auth, tls_verify, emit)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFull(f"{r}: the image store's disk is full ({exc})") from None
                if exc.errno == errno.EFBIG:
                    raise DiskFull(f"{r}: a file is over {self._cap_text()}") from None
                raise ConversionError(f"{r}: {exc}") from None
            finally:
                del self._inflight[hexd]
                ev.set()
        self._add_ref(ref, digest)
        img = self.get(digest)
        emit(PullProgress(ref, "done", f"{img.content_bytes} bytes in {len(img.layers)} layers", digest=digest))
        return img

    @contextlib.asynccontextmanager
    async def _job(self, r: Reference, stage: Path) -> AsyncIterator[_Job]:
        """A pull's work dirs in its staging dir. With cells: ``fetch`` (skopeo's) is an
        id of the pull's own; ``unpack`` and ``out`` are the tools' user namespace root's
        (umoci, mkfs); the stage itself stays the supervisor's."""
        fetch = stage / "fetch"
        fetch.mkdir(mode=0o700)
        if self.tools is None:
            yield _Job(stage, fetch, None, 0)
            return
        os.chmod(stage, 0o711)
        with self.tools.identity(f"pull {r}"[:80]) as ident:
            os.chown(fetch, ident.uid, ident.gid)
            yield _Job(stage, fetch, (ident.uid, ident.gid), self.tools.shifted(0), ident)

    def _cap_text(self) -> str:
        return f"the image size cap of {self.max_image_bytes} bytes (serve --max-image-size)"

    async def _resolve(
        self, r: Reference, job: _Job, auth: list[str], tls_verify: bool, has_creds: bool
    ) -> tuple[str, list[tuple[str, int]]]:
        """The manifest digest to pull (the linux/amd64 one of an index) and its layers."""
        self.stats.resolves += 1
        argv = ["skopeo", "--tmpdir", str(job.fetch), "inspect", "--raw", *auth]
        if r.is_registry and not tls_verify:
            argv.append("--tls-verify=false")
        run = functools.partial(
            self._run, r=r, step="reading the manifest", has_creds=has_creds, tool=self._skopeo(r, job)
        )
        raw = await run([*argv, job.source(r)])
        if r.digest and _digest_of(raw) != r.digest:
            raise DigestMismatch(f"{r}: the registry served a manifest that does not match {r.digest}")
        digest, manifest = _digest_of(raw), _json(raw, "manifest", r)
        if manifest.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:
            digest = _pick_platform(manifest, r)
            raw = await run([*argv, job.source(r, digest)])
            if _digest_of(raw) != digest:
                raise DigestMismatch(f"{r}: the manifest of its linux/amd64 image does not match {digest}")
            manifest = _json(raw, "manifest", r)
        if manifest.get("schemaVersion") != 2:
            raise UnsupportedImage(f"{r}: schema {manifest.get('schemaVersion')} manifests are not supported")
        layers = []
        for layer in manifest.get("layers") or []:
            if not isinstance(layer, dict) or not isinstance(layer.get("digest"), str):
                raise UnsupportedImage(f"{r}: the manifest lists a malformed layer")
            if not _DIGEST_RE.fullmatch(layer["digest"]):
                raise UnsupportedImage(f"{r}: unsupported digest {str(layer['digest'])[:80]!r}")
            layers.append((str(layer["digest"]), int(layer.get("size") or 0)))
        cap = self.max_image_bytes
        if cap is not None and sum(s for _, s in layers) > cap:
            raise DiskFull(f"{r}: its layers are {sum(s for _, s in layers)} bytes, over {self._cap_text()}")
        return digest, layers

    async def _fetch_and_convert(
        self,
        r: Reference,
        digest: str,
        layers: list[tuple[str, int]],
        job: _Job,
        auth: list[str],
        tls_verify: bool,
        emit: ProgressFn,
    ) -> None:
        ref = r.canonical()
        stage, fetch = job.stage, job.fetch
        layout = fetch / "layout"
        total = sum(s for _, s in layers)
        # skopeo writes into a blob dir of the pull's own: what the store has is linked in
        # (not fetched again, not writable by skopeo); what it adds is verified, then published
        blobs_in = fetch / "blobs" / "sha256"
        blobs_in.mkdir(parents=True)
        reused = await trio.to_thread.run_sync(self._link_known, [d for d, _ in layers], blobs_in)
        if job.owner is not None:
            for d in (fetch / "blobs", blobs_in):
                os.chown(d, *job.owner)
        argv = [
            "skopeo",
            "--tmpdir",
            str(fetch),
            "--override-os",
            "linux",
            "--override-arch",
            "amd64",
            *self._policy_args(job),
            "copy",
            "--quiet",
            "--remove-signatures",
            *[a.replace("--", "--src-", 1) for a in auth],
            "--dest-shared-blob-dir",
            str(fetch / "blobs"),
        ]
        if r.is_registry and not tls_verify:
            argv.append("--src-tls-verify=false")
        argv += [job.source(r, digest), f"oci:{layout}:img"]
        emit(PullProgress(ref, "downloading", f"{len(layers)} layers", 0, total, digest))
        self.stats.copies += 1
        await self._bounded(
            self._run(
                argv,
                r,
                "copying the image",
                has_creds=bool(auth) and "--no-creds" not in auth,
                tool=self._skopeo(r, job),
            ),
            fetch,
            r,
            "copying the image",
            progress=lambda used: emit(PullProgress(ref, "downloading", "", min(used + reused, total), total, digest)),
            skip=reused,
        )
        emit(PullProgress(ref, "downloading", "done", total, total, digest))
        try:
            await trio.to_thread.run_sync(self._publish_blobs, blobs_in, r)
            blobs, config_digest, cfg = self._read_layout(layout, r)
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedImage(f"{r}: malformed image metadata ({exc!r})") from None
        # umoci reads a layout of the supervisor's: the index skopeo wrote (checked), the
        # image's blobs linked from the store
        ulayout = stage / "layout"
        await trio.to_thread.run_sync(self._umoci_layout, ulayout, layout, blobs, r)
        emit(PullProgress(ref, "unpacking", "applying layers (umoci)", digest=digest))
        unpack = stage / "unpack"
        unpack.mkdir(mode=0o700)
        tree = unpack / "tree"
        if self.tools is not None:
            os.chown(unpack, job.shift, job.shift)
        await self._bounded(
            self._run(
                ["umoci", "--log", "error", "raw", "unpack", "--image", f"{ulayout}:img", str(tree)],
                r,
                "unpacking",
                tool=_Tool(
                    None,
                    (bind(ulayout), bind(unpack, writable=True)),
                    keep_caps=UNPACK_CAPS,
                    fsize=self.max_image_bytes,
                ),
            ),
            unpack,
            r,
            "unpacking",
        )
        emit(PullProgress(ref, "converting", "making the ext4 root filesystem", digest=digest))
        out = stage / "out"
        out.mkdir()
        fs_uuid = str(uuid.uuid4())
        content, disk = await trio.to_thread.run_sync(self._prepare_tree, tree, cfg, job.shift)
        if self.tools is not None:
            os.chown(out, job.shift, job.shift)
        await self._run(
            _mkfs_argv(tree, out / "rootfs.ext4", disk, content, fs_uuid),
            r,
            "making the ext4 file",
            tool=_Tool(None, (bind(unpack), bind(out, writable=True)), keep_caps=READ_CAPS, fsize=disk),
        )
        self.stats.conversions += 1
        _own_output(out, "rootfs.ext4")
        meta = {
            "version": _CODE_VERSION,
            "digest": digest,
            "config_digest": config_digest,
            "config": attrs.asdict(cfg),
            "rootfs_uuid": fs_uuid,
            "layers": [d for d, _ in layers],
            "blobs": blobs,
            "content_bytes": content[0],
            "disk_bytes": disk,
            "download_bytes": sum(s for _, s in layers),
            "source": ref,
            "pulled_at": time.time(),
        }
        _write_durably(out / "image.json", json.dumps(meta, indent=2).encode())
        out.chmod(0o755)
        final = self.images / digest.removeprefix("sha256:")
        try:
            out.rename(final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # another process published the same digest first: theirs is as good
        _fsync_dir(self.images)

    async def _bounded(
        self,
        work: Awaitable[bytes],
        directory: Path,
        r: Reference,
        step: str,
        *,
        progress: Callable[[int], None] | None = None,
        skip: int = 0,
    ) -> bytes:
        """Run ``work`` (a tool) while watching what ``directory`` holds: over the cap,
        the tool is killed (cancelled) at once and the pull fails with DiskFull. ``skip``:
        bytes of the store's own blobs linked in (not counted)."""
        cap = self.max_image_bytes
        over: list[int] = []
        result: list[bytes] = []

        async def watch(cancel: trio.CancelScope) -> None:
            last = -1
            while True:
                t0 = time.monotonic()
                used = max(0, await trio.to_thread.run_sync(_tree_usage, directory) - skip)
                if cap is not None and used > cap:
                    over.append(used)
                    cancel.cancel()
                    return
                if progress is not None and used != last:
                    progress(used)
                    last = used
                await trio.sleep(max(0.2, 10 * (time.monotonic() - t0)))  # a poll: walks cost

        failed: list[ImageError] = []  # raised past the nursery: not inside an ExceptionGroup
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            try:
                result.append(await work)
            except ImageError as exc:
                failed.append(exc)
            finally:
                nursery.cancel_scope.cancel()
        if over:
            raise DiskFull(f"{r}: {step}: {over[0]} bytes so far, over {self._cap_text()}; stopped")
        if failed:
            raise failed[0]
        return result[0]

    def _link_known(self, digests: list[str], into: Path) -> int:
        """Hard links of the store's blobs among ``digests`` in ``into``: bytes linked."""
        n = 0
        for d in dict.fromkeys(digests):
            src = self.blobs / d.replace(":", "/", 1)
            with contextlib.suppress(FileNotFoundError):
                os.link(src, into / src.name, follow_symlinks=False)
                n += os.lstat(src).st_size
        return n

    def _publish_blobs(self, blobs_in: Path, r: Reference) -> None:
        """skopeo's new blobs into the store: each a regular file of one link, its content
        hashed here to its name, then the supervisor's (0644), then linked in."""
        for e in os.scandir(blobs_in):
            dst = self.blobs / "sha256" / e.name
            if not re.fullmatch(r"[0-9a-f]{64}", e.name) or dst.exists():
                continue
            fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    raise UnsupportedImage(f"{r}: blob {e.name} is not a plain file")
                h = hashlib.sha256()
                while chunk := os.read(fd, 1 << 20):
                    h.update(chunk)
                if h.hexdigest() != e.name:
                    raise DigestMismatch(f"{r}: blob sha256:{e.name} does not match its digest")
                os.fchown(fd, 0, 0)
                os.fchmod(fd, 0o644)
                now = os.lstat(e.path)  # (skopeo has exited: the name cannot move under us)
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    raise UnsupportedImage(f"{r}: blob {e.name} changed while it was checked")
                with contextlib.suppress(FileExistsError):  # a concurrent pull published it
                    os.link(e.path, dst, follow_symlinks=False)
            finally:
                os.close(fd)

    def _umoci_layout(self, ulayout: Path, layout: Path, blobs: list[str], r: Reference) -> None:
        (ulayout / "blobs" / "sha256").mkdir(parents=True)
        for sub in (ulayout, ulayout / "blobs", ulayout / "blobs" / "sha256"):
            os.chmod(sub, 0o755)
        index = _read_small(layout / "index.json", _MANIFEST_MAX, r)
        for name, data in (("index.json", index), ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')):
            (ulayout / name).write_bytes(data)
            os.chmod(ulayout / name, 0o644)
        for d in blobs:
            src = self.blobs / d.replace(":", "/", 1)
            if stat.S_IMODE(os.lstat(src).st_mode) & 0o004 == 0:
                os.chmod(src, 0o644)  # an older store's: the tools' user reads it
            os.link(src, ulayout / "blobs" / "sha256" / src.name, follow_symlinks=False)

    def _copy_local(self, r: Reference, job: _Job) -> Path:
        """A local source (an archive, an OCI layout dir), copied into the pull's ``fetch``
        dir as the pull's id: skopeo in its cell reads only that. No symlink is followed;
        at most the cap is copied."""
        budget = [self.max_image_bytes if self.max_image_bytes is not None else 1 << 62]
        dst = job.fetch / "source"

        def copy_file(src: Path, to: Path) -> None:
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ImageNotFound(f"{r}: {src} is not a regular file")
                budget[0] -= st.st_size
                if budget[0] < 0:
                    raise DiskFull(f"{r}: the local image is over {self._cap_text()}")
                out = os.open(to, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    while os.copy_file_range(fd, out, 1 << 30):
                        pass
                    if job.owner is not None:
                        os.fchown(out, *job.owner)
                finally:
                    os.close(out)
            finally:
                os.close(fd)

        src = Path(r.path)
        try:
            if src.is_symlink() or not src.is_dir():
                copy_file(src, dst)
                return dst
            for root, dirs, files in os.walk(src):
                rel = Path(root).relative_to(src)
                (dst / rel).mkdir(mode=0o700)
                if job.owner is not None:
                    os.chown(dst / rel, *job.owner)
                for name in files:
                    copy_file(Path(root) / name, dst / rel / name)
                dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        except FileNotFoundError as exc:
            raise ImageNotFound(f"{r}: {exc.filename}: no such file") from None
        return dst

    def _read_layout(self, layout: Path, r: Reference) -> tuple[list[str], str, ImageConfig]:
        index = _json(_read_small(layout / "index.json", _MANIFEST_MAX, r), "index", r)
        (entry,) = index["manifests"]
        mdigest = str(entry["digest"])
        mraw = self._blob(mdigest, _MANIFEST_MAX, r)
        manifest = _json(mraw, "manifest", r)
        config_digest = str(manifest["config"]["digest"])
        cfg = parse_config(self._blob(config_digest, _CONFIG_MAX, r), r)
        if cfg.os != "linux" or cfg.architecture != "amd64":
            raise UnsupportedImage(f"{r} is a {cfg.os}/{cfg.architecture} image; sandboxes run linux/amd64")
        blobs = [mdigest, config_digest, *(str(layer["digest"]) for layer in manifest.get("layers") or [])]
        return blobs, config_digest, cfg

    def _blob(self, digest: str, limit: int, r: Reference) -> bytes:
        if not _DIGEST_RE.fullmatch(digest):
            raise UnsupportedImage(f"{r}: unsupported digest {digest[:80]!r}")
        p = self.blobs / digest.replace(":", "/", 1)
        if p.stat().st_size > limit:
            raise UnsupportedImage(f"{r}: blob {digest} is over {limit} bytes")
        data = p.read_bytes()
        if _digest_of(data) != digest:
            raise DigestMismatch(f"{r}: blob {digest} in the store does not match its digest")
        return data

    def _prepare_tree(self, tree: Path, cfg: ImageConfig, shift: int = 0) -> tuple[tuple[int, int], int]:
        """Make the unpacked tree bootable and size its ext4: ((content bytes, inodes), fs bytes).

        The tree is the image's: its symlinks may point anywhere on the host, so nothing
        here follows one (mount points are replaced, a WORKDIR behind a symlink is left).
        ``shift``: the host id of image id 0 (the tools' user namespace; 0 without cells)."""
        for name, mode in _MOUNT_POINTS:
            p = tree / name
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                st = None
            if st is not None and not stat.S_ISDIR(st.st_mode):
                p.unlink()  # a file or symlink where /init mounts a file system
                st = None
            if st is None:
                p.mkdir()
                os.chmod(p, mode)
                if shift:
                    os.lchown(p, shift, shift)
        if cfg.working_dir:
            _make_workdir(tree, cfg, shift)
        content, inodes = _tree_size(tree)
        if self.max_image_bytes is not None and content > self.max_image_bytes:
            raise DiskFull(f"the image unpacks to {content} bytes, over this store's cap of {self.max_image_bytes}")
        free = max(self.free_min, int(content * self.free_ratio))
        meta = inodes * 2 * 256 + (128 << 20)  # inode tables (twice the inodes: room) + journal + slack
        fs = (int(content * 1.05) + meta + free + (1 << 20) - 1) & ~((1 << 20) - 1)
        return (content, inodes), fs

    # -- remove and prune -----------------------------------------------------------
    async def remove(self, ref: str, *, in_use: Collection[str] = ()) -> RemoveResult:
        """Untag ``ref``; delete the image when that was its last reference, or when ``ref``
        is a digest (all its references go). ``in_use``: digests sandboxes, snapshots or
        templates still boot from; deleting one of those is ImageInUse (untagging is not)."""
        img = self.get(ref)
        refs = self._read_refs()
        mine = sorted(k for k, v in refs.items() if v == img.digest)
        by_tag = _digest_like(ref) is None and not parse_reference(ref).digest
        key = parse_reference(ref).canonical() if by_tag else ""
        if by_tag and key in mine and len(mine) > 1:
            self._drop_refs({key})
            return RemoveResult(untagged=(key,), deleted=(), freed_bytes=0)
        if img.digest in in_use:
            raise ImageInUse(f"image {img.id} ({', '.join(mine) or 'untagged'}) is in use by a sandbox or snapshot")
        freed = await self._delete(img)
        freed += await self._collect_blobs()
        return RemoveResult(untagged=tuple(mine), deleted=(img.digest,), freed_bytes=freed)

    async def prune(self, in_use: Collection[str], *, dangling_only: bool = False) -> PruneResult:
        """Delete every image not in ``in_use`` (only the untagged ones with
        ``dangling_only``), the blobs no image keeps, and stale staging directories."""
        deleted, freed = [], 0
        for img in self.list_images():
            if img.digest in in_use or (dangling_only and img.refs):
                continue
            freed += await self._delete(img)
            deleted.append(img.digest)
        present = {img.digest for img in self.list_images()}
        self._drop_refs({k for k, v in self._read_refs().items() if v not in present})  # left by a crash
        skipped = self._pulls > 0
        before = len(list(self._blob_files()))
        freed += await self._collect_blobs()
        freed += await self._sweep_tmp()
        return PruneResult(
            deleted=tuple(deleted),
            blobs_deleted=before - len(list(self._blob_files())),
            freed_bytes=freed,
            blobs_skipped=skipped,
        )

    async def _delete(self, img: Image) -> int:
        """Move the image out of images/ (one rename: it is gone at once), forget its refs,
        then remove the files in a thread."""
        src = self.images / img.digest.removeprefix("sha256:")
        trash = self.tmp / f"trash-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            src.rename(trash)
        except FileNotFoundError:
            return 0
        self._drop_refs({k for k, v in self._read_refs().items() if v == img.digest})
        size = _disk_usage(trash)
        await _rmtree(trash)
        return size

    async def _collect_blobs(self) -> int:
        """Remove blobs no image keeps, unless a pull is running (it may be reusing one)."""
        if self._pulls:
            return 0
        keep = {b for img in self.list_images() for b in img.blobs}
        freed = 0
        for p in self._blob_files():
            if f"sha256:{p.name}" not in keep:
                with contextlib.suppress(FileNotFoundError):
                    freed += p.stat().st_blocks * 512
                    p.unlink()
        return freed

    def _blob_files(self) -> Iterator[Path]:
        return (p for p in (self.blobs / "sha256").iterdir() if p.is_file())

    async def _sweep_tmp(self) -> int:
        freed = 0
        for p in list(self.tmp.iterdir()):
            if p in self._active_staging:
                continue
            pid = _owner_pid(p.name)
            if pid is None or pid == os.getpid() or not _alive(pid):
                freed += _disk_usage(p)
                await _rmtree(p)
        return freed

    def _sweep_dead_staging(self) -> None:
        """Staging left by a process that died mid-pull (a supervisor crash)."""
        for p in self.tmp.iterdir():
            pid = _owner_pid(p.name)
            if pid is not None and pid != os.getpid() and not _alive(pid):
                shutil.rmtree(p, ignore_errors=True)

    # -- plumbing -------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _staging(self, kind: str) -> AsyncIterator[Path]:
        d = self.tmp / f"{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        d.mkdir(mode=0o700)
        self._active_staging.add(d)
        try:
            yield d
        finally:
            try:
                await _rmtree(d)  # shielded: an error or a cancel leaves nothing behind
            finally:
                self._active_staging.discard(d)

    def _auth_args(
        self,
        r: Reference,
        stage: Path,
        creds: str | None,
        authfile: Path | None,
        auth_json: bytes | None = None,
        owner: tuple[int, int] | None = None,
    ) -> list[str]:
        if not r.is_registry:
            return []
        if authfile is not None and owner is not None:  # skopeo in its cell reads a copy of its own
            with open(authfile, "rb") as fh:
                auth_json = fh.read(1 << 20)
        if auth_json is not None:
            f = stage / "auth.json"
            fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            if owner is not None:
                os.fchown(fd, *owner)
            with os.fdopen(fd, "wb") as fh:
                fh.write(auth_json)
            return ["--authfile", str(f)]
        if creds is not None:
            user, _, password = creds.partition(":")
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            f = stage / "auth.json"
            fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            if owner is not None:
                os.fchown(fd, *owner)
            with os.fdopen(fd, "w") as fh:  # a file, not argv: other users can read argv
                json.dump({"auths": {r.domain: {"auth": token}}}, fh)
            return ["--authfile", str(f)]
        if authfile is not None:
            return ["--authfile", str(authfile)]
        return ["--no-creds"]

    def _policy_args(self, job: _Job | None = None) -> list[str]:
        """The host's signature policy when it has one; otherwise accept (skopeo needs one)."""
        if Path("/etc/containers/policy.json").exists():
            return []
        p = self.root / "policy.json" if job is None or job.owner is None else job.fetch / "policy.json"
        if not p.exists():
            _write_durably(p, json.dumps(_ANON_POLICY).encode())
            if job is not None and job.owner is not None:
                os.chown(p, *job.owner)
        return ["--policy", str(p)]

    def _skopeo(self, r: Reference, job: _Job) -> _Tool:
        """skopeo's cell: the pull's id; its fetch dir; the host's network for a registry
        (none for a local source, copied into the fetch dir); no file over the cap."""
        binds = [bind(job.fetch, writable=True)]
        if not r.is_registry and Path("/etc/containers").is_dir():
            binds.append(bind("/etc/containers"))  # (a registry pull binds it with the network's /etc)
        return _Tool(job.identity, tuple(binds), host_network=r.is_registry, fsize=self.max_image_bytes)

    async def _run(
        self, argv: list[str], r: Reference, step: str, *, has_creds: bool = False, tool: _Tool | None = None
    ) -> bytes:
        if shutil.which(argv[0]) is None:
            raise ToolMissing(f"{argv[0]} is not installed (images/host-packages.sh installs it)")
        if self.tools is not None and tool is not None:
            try:
                res = await self.tools.run(
                    argv,
                    identity=tool.identity,
                    binds=tool.binds,
                    host_network=tool.host_network,
                    keep_caps=tool.keep_caps,
                    fsize=tool.fsize,
                )
            except ToolError as exc:
                raise ConversionError(f"{r}: {step}: {exc}") from None
            if res.oom_killed:
                raise DiskFull(f"{r}: {step}: {argv[0]} was killed by its cell's memory limit")
            rc, out, err = res.returncode, res.stdout, res.stderr
        else:
            try:
                # umask 022: the supervisor runs under 077 (its files are its own), but the
                # directories umoci makes for paths a layer implies are the image's, and a
                # non-root USER must traverse them
                p = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False, umask=0o022)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFull(f"{r}: {step}: the image store's disk is full") from None
                raise ConversionError(f"{r}: {step}: cannot run {argv[0]}: {exc}") from None
            rc, out, err = p.returncode, p.stdout, p.stderr
        if rc != 0:
            text = err.decode(errors="replace")
            if rc == -signal.SIGXFSZ or "file too large" in text.lower():
                raise DiskFull(f"{r}: {step}: a file grew over its bound ({self._cap_text()})")
            raise classify_failure(text, r, step, has_creds=has_creds)
        return out

    def _load(self, hexd: str, refs: dict[str, str] | None = None) -> Image | None:
        d = self.images / hexd
        try:
            meta = json.loads((d / "image.json").read_bytes())
        except (OSError, ValueError):
            return None
        if not (d / "rootfs.ext4").exists():
            return None
        refs = self._read_refs() if refs is None else refs
        digest = str(meta["digest"])
        return Image(
            digest=digest,
            config_digest=str(meta["config_digest"]),
            config=_config_from_json(meta["config"]),
            rootfs=d / "rootfs.ext4",
            rootfs_uuid=str(meta["rootfs_uuid"]),
            refs=tuple(sorted(k for k, v in refs.items() if v == digest)),
            layers=tuple(meta["layers"]),
            blobs=tuple(meta["blobs"]),
            content_bytes=int(meta["content_bytes"]),
            disk_bytes=int(meta["disk_bytes"]),
            download_bytes=int(meta["download_bytes"]),
            source=str(meta["source"]),
            pulled_at=float(meta["pulled_at"]),
        )

    def _read_refs(self) -> dict[str, str]:
        try:
            data = json.loads((self.root / "refs.json").read_bytes())
        except FileNotFoundError:
            return {}
        except ValueError:
            return {}  # a torn write cannot happen (rename); a hand-edited file loses its tags
        return {str(k): str(v) for k, v in dict(data.get("refs", {})).items()}

    def _write_refs(self, refs: dict[str, str]) -> None:
        body = json.dumps({"version": 1, "refs": dict(sorted(refs.items()))}, indent=2).encode()
        tmp = self.root / f".refs.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            _write_durably(tmp, body)
            tmp.rename(self.root / "refs.json")
            _fsync_dir(self.root)  # the new refs survive a power cut (the old ones would name pruned images)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull("the image store's disk is full (writing refs.json)") from None
            raise

    def _add_ref(self, ref: str, digest: str) -> None:
        refs = self._read_refs()
        if refs.get(ref) != digest:
            refs[ref] = digest  # a moved tag: the old image keeps its other refs, or dangles
            self._write_refs(refs)

    def _drop_refs(self, keys: set[str]) -> None:
        refs = self._read_refs()
        if keys & refs.keys():
            self._write_refs({k: v for k, v in refs.items() if k not in keys})


# -- helpers -----------------------------------------------------------------------


def parse_config(raw: bytes, r: Reference | str = "") -> ImageConfig:
    """The OCI (or Docker v2) image config JSON -> ImageConfig; malformed is UnsupportedImage."""
    doc = _json(raw, "config", r)
    c = doc.get("config")
    c = {} if c is None else c
    if not isinstance(c, dict):
        raise UnsupportedImage(f"{r}: the image config's config is not an object")

    def strs(key: str) -> tuple[str, ...]:
        v = c.get(key)
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)  # docker accepts a string Cmd (shell form stored verbatim)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise UnsupportedImage(f"{r}: the image config's {key} is not a list of strings")
        return tuple(v)

    def one(key: str, src: dict[str, Any] = c) -> str:
        v = src.get(key)
        if v is None:
            return ""
        if not isinstance(v, str):
            raise UnsupportedImage(f"{r}: the image config's {key} is not a string")
        return v

    labels = c.get("Labels") or {}
    if not isinstance(labels, dict):
        raise UnsupportedImage(f"{r}: the image config's Labels is not an object")
    ports = c.get("ExposedPorts") or {}
    vols = c.get("Volumes") or {}
    return ImageConfig(
        env=strs("Env"),
        working_dir=one("WorkingDir"),
        user=one("User"),
        entrypoint=strs("Entrypoint"),
        cmd=strs("Cmd"),
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        stop_signal=one("StopSignal"),
        exposed_ports=tuple(sorted(str(p) for p in ports)) if isinstance(ports, dict) else (),
        volumes=tuple(sorted(str(v) for v in vols)) if isinstance(vols, dict) else (),
        architecture=one("architecture", doc) or "amd64",
        os=one("os", doc) or "linux",
        created=one("created", doc),
    )


def _check_auth_json(raw: bytes) -> None:
    """A docker-style auth file's content: a JSON object (its secrets never in a message)."""
    if len(raw) > 1 << 20:
        raise InvalidReference("the auth file is over 1 MiB")
    try:
        doc = json.loads(raw)
    except ValueError:
        raise InvalidReference("the auth file is not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("auths", {}), dict):
        raise InvalidReference('the auth file is not a docker-style {"auths": {...}} object')


def _config_from_json(d: dict[str, Any]) -> ImageConfig:
    return ImageConfig(
        env=tuple(d["env"]),
        working_dir=d["working_dir"],
        user=d["user"],
        entrypoint=tuple(d["entrypoint"]),
        cmd=tuple(d["cmd"]),
        labels=tuple((str(k), str(v)) for k, v in d["labels"]),
        stop_signal=d["stop_signal"],
        exposed_ports=tuple(d["exposed_ports"]),
        volumes=tuple(d["volumes"]),
        architecture=d["architecture"],
        os=d["os"],
        created=d["created"],
    )


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


def _pick_platform(index: dict[str, Any], r: Reference) -> str:
    seen = []
    for m in index.get("manifests") or []:
        plat = m.get("platform") or {}
        seen.append(f"{plat.get('os')}/{plat.get('architecture')}")
        if plat.get("os") == "linux" and plat.get("architecture") == "amd64" and isinstance(m.get("digest"), str):
            if not _DIGEST_RE.fullmatch(m["digest"]):
                raise UnsupportedImage(f"{r}: unsupported digest {m['digest'][:80]!r}")
            return str(m["digest"])
    raise UnsupportedImage(f"{r} has no linux/amd64 image (it has {', '.join(seen) or 'none'})")


def _json(raw: bytes, what: str, r: Reference | str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        raise UnsupportedImage(f"{r}: the {what} is not JSON") from None
    if not isinstance(doc, dict):
        raise UnsupportedImage(f"{r}: the {what} is not a JSON object")
    return doc


def _digest_of(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _digest_like(ref: str) -> str | None:
    """The hex of ``sha256:HEX`` or of a bare 12-64 digit hex id; None for a reference."""
    s = ref.removeprefix("sha256:")
    if re.fullmatch(r"[0-9a-f]{12,64}", s) and (ref.startswith("sha256:") or ":" not in ref):
        return s
    return None


def _make_workdir(tree: Path, cfg: ImageConfig, shift: int = 0) -> None:
    """Create a missing WORKDIR owned by the image's user (a runtime would; guestd needs
    the directory to exist). Never through a symlink: the tree is untrusted."""
    parts = [p for p in os.path.normpath("/" + cfg.working_dir).split("/") if p]
    cur = tree
    created = []
    for part in parts:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            os.mkdir(cur)
            os.chmod(cur, 0o755)  # whatever the supervisor's umask
            created.append(cur)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return  # a symlink or a file on the way: leave the image as it is
    if created:
        uid, gid = _resolve_user(tree, cfg.user)
        if shift and not (0 <= uid < SHIFT_COUNT and 0 <= gid < SHIFT_COUNT):
            raise UnsupportedImage(f"the image's user {cfg.user!r} is outside ids 0-{SHIFT_COUNT - 1}")
        for d in created[:-1]:
            os.chown(d, shift, shift, follow_symlinks=False)
        os.chown(created[-1], uid + shift, gid + shift, follow_symlinks=False)


def _resolve_user(tree: Path, user: str) -> tuple[int, int]:
    """USER -> (uid, gid) from the image's /etc/passwd and /etc/group, as guestd resolves
    it (a numeric uid without an entry gets gid = uid). Unknown names: root."""
    name, _, group = (user or "root").partition(":")
    uid = gid = 0
    passwd = _read_image_file(tree, "etc/passwd")
    rows = [ln.split(":") for ln in passwd.splitlines() if ln and not ln.startswith("#")]
    for row in rows:
        if len(row) >= 4 and (row[0] == name or (name.isdigit() and row[2] == name)):
            with contextlib.suppress(ValueError):
                uid, gid = int(row[2]), int(row[3])
            break
    else:
        if name.isdigit():
            uid = gid = int(name)
    if group.isdigit():
        gid = int(group)
    elif group:
        for row in (ln.split(":") for ln in _read_image_file(tree, "etc/group").splitlines()):
            if len(row) >= 3 and row[0] == group and row[2].isdigit():
                gid = int(row[2])
    return uid, gid


def _read_image_file(tree: Path, rel: str) -> str:
    """A small file of the image, refusing symlinks on the way (they could name host files)."""
    cur = tree
    for part in rel.split("/"):
        cur = cur / part
        try:
            if stat.S_ISLNK(os.lstat(cur).st_mode):
                return ""
        except OSError:
            return ""
    try:
        fd = os.open(cur, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return ""
        return f.read(1 << 20).decode(errors="replace")


def _tree_size(tree: Path) -> tuple[int, int]:
    """(bytes the tree takes in 4 KiB blocks, inodes), hard links counted once."""
    total, inodes, seen = 0, 0, set()
    stack = [str(tree)]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            entries = 0
            for e in it:
                entries += 1
                st = e.stat(follow_symlinks=False)
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                inodes += 1
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                elif stat.S_ISREG(st.st_mode) or (stat.S_ISLNK(st.st_mode) and st.st_size > 59):
                    total += (st.st_size + 4095) & ~4095
        total += max(4096, ((entries * 64) + 4095) & ~4095)  # the directory's own blocks
    return total, inodes + 1


def _mkfs_argv(tree: Path, out: Path, size: int, content: tuple[int, int], fs_uuid: str) -> list[str]:
    inodes = content[1] + max(65536, content[1])
    return [
        "mkfs.ext4",
        "-q",
        "-F",
        "-L",
        "sandvisor-oci",
        "-U",
        fs_uuid,
        "-b",
        "4096",
        "-m",
        "0",
        "-N",
        str(inodes),
        "-E",
        "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0",
        "-d",
        str(tree),
        str(out),
        f"{size // 1024}k",
    ]


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_usage(p: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(p):
        for name in files + dirs:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


async def _rmtree(p: Path) -> None:
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(shutil.rmtree, p, True)


def _owner_pid(name: str) -> int | None:
    m = re.match(r"^[a-z]+-(\d+)-", name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def default_store_root() -> Path:
    from images.build import default_cache

    return default_cache() / "oci"


def main(argv: list[str] | None = None) -> int:
    """``python -m images.oci pull REF [--tls-verify=false] | ls | rm REF | prune``."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m images.oci")
    ap.add_argument("--root", type=Path, default=None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pull")
    p.add_argument("ref")
    p.add_argument("--policy", default="if-missing")
    p.add_argument("--tls-verify", default="true")
    p.add_argument("--creds")
    p.add_argument("--authfile", type=Path)
    sub.add_parser("ls")
    p = sub.add_parser("rm")
    p.add_argument("ref")
    sub.add_parser("prune")
    a = ap.parse_args(argv)
    from images.refs import RefPolicy

    store = ImageStore(a.root or default_store_root(), refs=RefPolicy(unrestricted=True))  # the operator's own

    def show(pr: PullProgress) -> None:
        extra = f" {pr.done >> 20}/{pr.total >> 20} MiB" if pr.total else ""
        print(f"[{pr.phase}] {pr.message}{extra}", file=sys.stderr, flush=True)

    async def go() -> Any:
        if a.cmd == "pull":
            img = await store.pull(
                a.ref,
                policy=a.policy,
                tls_verify=a.tls_verify.lower() not in ("false", "0", "no"),
                creds=a.creds,
                authfile=a.authfile,
                progress=show,
            )
            return {"digest": img.digest, "rootfs": str(img.rootfs), "config": attrs.asdict(img.config)}
        if a.cmd == "ls":
            return [
                {"id": i.id, "digest": i.digest, "refs": i.refs, "size": i.content_bytes} for i in store.list_images()
            ]
        if a.cmd == "rm":
            return attrs.asdict(await store.remove(a.ref))
        return attrs.asdict(await store.prune(()))

    try:
        print(json.dumps(trio.run(go), indent=2))
    except ImageError as exc:
        print(f"{exc.code}: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _read_small(path: Path, limit: int, r: Reference) -> bytes:
    """A small file a tool wrote: a regular file (no symlink, FIFO or device), at most ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise UnsupportedImage(f"{r}: {path.name}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise UnsupportedImage(f"{r}: {path.name} is not a regular file of at most {limit} bytes")
        return f.read(limit + 1)[:limit]


def _tree_usage(d: Path) -> int:
    """Bytes the files under ``d`` take (each inode once), while a tool writes them."""
    total, seen, stack = 0, set(), [str(d)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_ino in seen:
                    continue
                seen.add(st.st_ino)
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
    return total


def _own_output(out: Path, name: str) -> None:
    """mkfs's output made the supervisor's: ``out`` holds one regular file of one link
    (a tool in a cell wrote it), now root's and 0444."""
    if os.listdir(out) != [name]:
        raise ConversionError(f"mkfs.ext4 left {sorted(os.listdir(out))[:5]} in its output dir")
    fd = os.open(out / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ConversionError("mkfs.ext4's output is not a plain file")
        if os.geteuid() == 0:
            os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o444)
    finally:
        os.close(fd)
    if os.geteuid() == 0:
        os.lchown(out, 0, 0)
