"""Pulling into the store: resolve a reference to its linux/amd64 manifest, copy it with
skopeo, unpack it with umoci, convert it with mkfs.ext4 (images/oci/convert.py), each tool
in a cell of its own when a ToolRunner is given, under the size cap's watch.

ImageStore is the Store (images/oci/store.py) plus this pipeline: what other modules use."""

from __future__ import annotations

import base64
import contextlib
import enum
import errno
import functools
import json
import os
import shutil
import signal
import stat
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from images.oci.convert import _CODE_VERSION, _mkfs_argv, _own_output, prepare_tree
from images.oci.errors import (
    ConversionError,
    DigestMismatch,
    DiskFull,
    ImageError,
    ImageNotFound,
    InvalidReference,
    ToolMissing,
    UnsupportedImage,
    classify_failure,
)
from images.oci.image import Image, ImageConfig, _json, parse_config
from images.oci.reference import _DIGEST_RE, Reference, _digest_like, _digest_of, parse_reference
from images.oci.store import Store, _fsync_dir, _write_durably
from images.tools import READ_CAPS, UNPACK_CAPS, ToolBind, ToolError, ToolIdentity, ToolRunner, bind

if TYPE_CHECKING:
    from images.refs import RefPolicy


class PullPolicy(enum.StrEnum):
    ALWAYS = "always"  # resolve the reference every time; fetch only what is new
    IF_MISSING = "if-missing"  # no registry contact when the reference is cached
    NEVER = "never"  # only what is in the store; a miss is NOT_FOUND


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
    mirror: str = ""  # HOST[:PORT] a registry reference is fetched from (serve --registry-mirror)
    cert_dir: str = ""  # CA certificates the caller gave for its registry (skopeo --cert-dir)

    def source(self, r: Reference, digest: str = "") -> str:
        """What skopeo reads: the reference (at its registry's mirror, if any), or the
        copy of a local one."""
        if self.mirror:
            return attrs.evolve(r, domain=self.mirror).skopeo(digest)
        if self.src is None:
            return r.skopeo(digest)
        return f"{r.transport}:{self.src}" + (f":{r.name}" if r.name else "")


_MANIFEST_MAX = 4 << 20
_CONFIG_MAX = 32 << 20
_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_ANON_POLICY = {"default": [{"type": "insecureAcceptAnything"}]}
GIB = 1 << 30


@attrs.define
class StoreStats:
    """Counters for tests and benchmarks: what the store actually did."""

    resolves: int = 0
    copies: int = 0
    conversions: int = 0


class ImageStore(Store):
    """The image store at ``root`` (``<state>/images/oci``); one per supervisor.

    ``max_image_bytes``: refuse (DiskFull) an image whose download or unpacked tree is
    larger, as the bytes arrive (``serve --max-image-size``).
    ``free_min``/``free_ratio``: room left in each ext4 for the sandbox's own writes.
    ``tools``: skopeo, umoci and mkfs.ext4 run in cells (images/tools.py's ToolRunner,
    actors/cells/toolcell.py's ToolCells); None (``--no-jail``): as the supervisor, as before.
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
        from images.refs import RefPolicy  # (images.refs imports this package)

        self.refs = refs if refs is not None else RefPolicy()
        self.max_image_bytes = max_image_bytes
        self.tools = tools
        self.free_min = free_min
        self.free_ratio = free_ratio
        self.stats = StoreStats()
        self._inflight: dict[str, trio.Event] = {}
        super().__init__(root)

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
        ca_pem: bytes | None = None,
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
        if ca_pem is not None:
            _check_ca_pem(ca_pem)
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
            return await self._pull(
                r, emit, tls_verify=tls_verify, creds=creds, authfile=authfile, auth_json=auth_json, ca_pem=ca_pem
            )
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
        ca_pem: bytes | None = None,
    ) -> Image:
        ref = r.canonical()
        async with self._staging("pull") as stage, self._job(r, stage) as job:
            mirror = self.refs.mirror(r)
            if mirror is not None:
                job.mirror = mirror.host
                tls_verify = tls_verify and not mirror.insecure
                emit(PullProgress(ref, "resolving", f"from {r.domain}'s mirror {mirror.host}"))
            auth = self._auth_args(r, job.fetch, creds, authfile, auth_json, job.owner, host=job.mirror)
            if ca_pem is not None and r.is_registry:
                job.cert_dir = str(_write_cert_dir(job.fetch, ca_pem, job.owner))
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
        if job.cert_dir:
            argv += ["--cert-dir", job.cert_dir]
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
        if job.cert_dir:
            argv += ["--src-cert-dir", job.cert_dir]
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

    def _prepare_tree(self, tree: Path, cfg: ImageConfig, shift: int = 0) -> tuple[tuple[int, int], int]:
        return prepare_tree(
            tree,
            cfg,
            shift,
            max_image_bytes=self.max_image_bytes,
            free_min=self.free_min,
            free_ratio=self.free_ratio,
        )

    # -- the tools ------------------------------------------------------------------
    def _auth_args(
        self,
        r: Reference,
        stage: Path,
        creds: str | None,
        authfile: Path | None,
        auth_json: bytes | None = None,
        owner: tuple[int, int] | None = None,
        host: str = "",
    ) -> list[str]:
        """skopeo's credentials argument: always a file (argv is readable by every user).
        ``host``: the registry host skopeo contacts when not ``r``'s own (a mirror)."""
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
                json.dump({"auths": {host or r.domain: {"auth": token}}}, fh)
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


MAX_CA_PEM = 1 << 20


def _check_ca_pem(pem: bytes) -> None:
    """CA certificates a caller gives for its registry: PEM, bounded (never echoed)."""
    if not pem or len(pem) > MAX_CA_PEM:
        raise InvalidReference(f"the registry CA certificates must be 1 byte to {MAX_CA_PEM >> 20} MiB of PEM")
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise InvalidReference("the registry CA certificates are not PEM (no BEGIN CERTIFICATE)")


def _write_cert_dir(fetch: Path, pem: bytes, owner: tuple[int, int] | None) -> Path:
    """skopeo's --cert-dir: the caller's CA certificates as ca.crt in the pull's own dir."""
    d = fetch / "certs"
    d.mkdir(mode=0o700)
    fd = os.open(d / "ca.crt", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    if owner is not None:
        os.chown(d / "ca.crt", *owner)
        os.chown(d, *owner)
    return d


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
