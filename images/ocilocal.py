"""Local OCI plumbing for tests, benchmarks and demos (never used by the supervisor):
Debian's ``docker-registry`` on a loopback port, and images built from directories
with umoci and pushed with skopeo -- no docker daemon, no network beyond 127.0.0.1.

    reg = LocalRegistry(work).start()            # docker-registry serve, 127.0.0.1:<free>
    build_image(layout, "v1", [Layer(tree)], config=ImageSpec(user="1000", cmd=["/bin/sh"]))
    push(layout, "v1", reg.ref("test/app:1"))    # -> docker://127.0.0.1:<port>/test/app:1
    reg.stop()
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

# bcrypt of TEST_PASSWORD (the registry's htpasswd accepts bcrypt only); made once with
# crypt.crypt(TEST_PASSWORD, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
TEST_USER = "alice"
TEST_PASSWORD = "s3cret-pass"
TEST_HTPASSWD = "alice:$2b$04$I/Zr46AuBwcxxOWipgc4Ru8mvxTgagMbVY5ox5VlsamPdPjjqLiIi\n"

_CONFIG = """\
version: 0.1
log:
  level: info
  formatter: text
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
  secret: sandvisor-test
{tls}{auth}"""
_TLS = """\
  tls:
    certificate: {cert}
    key: {key}
"""
_AUTH = """\
auth:
  htpasswd:
    realm: sandvisor-test
    path: {htpasswd}
"""


class LocalRegistry:
    """A docker-registry process serving plain HTTP on 127.0.0.1 (``tls``: HTTPS with
    this certificate and key). ``auth``: htpasswd with TEST_USER/TEST_PASSWORD.
    Restartable on the same port and storage."""

    def __init__(self, work: Path, *, auth: bool = False, tls: tuple[Path, Path] | None = None) -> None:
        self.work = work
        self.tls = tls
        self.storage = work / "storage"
        self.log = work / "registry.log"
        self.auth = auth
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ref(self, name: str) -> str:
        return f"docker://{self.host}/{name}"

    def start(self, timeout: float = 20.0) -> LocalRegistry:
        self.work.mkdir(parents=True, exist_ok=True)
        auth = ""
        if self.auth:
            (self.work / "htpasswd").write_text(TEST_HTPASSWD)
            auth = _AUTH.format(htpasswd=self.work / "htpasswd")
        cfg = self.work / "config.yml"
        tls = _TLS.format(cert=self.tls[0], key=self.tls[1]) if self.tls is not None else ""
        cfg.write_text(_CONFIG.format(storage=self.storage, port=self.port, auth=auth, tls=tls))
        start = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["docker-registry", "serve", str(cfg)], stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log, "rb") as f:
                f.seek(start)
                m = re.search(rb"listening on 127\.0\.0\.1:(\d+)", f.read())
            if m:
                self.port = int(m.group(1))  # port 0 the first time: the kernel's choice, kept
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def blob_gets(self, digest: str) -> int:
        """How many times the registry served the blob ``digest`` (from its access log)."""
        return len(re.findall(rf'"GET /v2/[^ ]*/blobs/{re.escape(digest)} ', self.log.read_text()))

    def blob_file(self, digest: str) -> Path:
        algo, hexd = digest.split(":", 1)
        return self.storage / "docker/registry/v2/blobs" / algo / hexd[:2] / hexd / "data"


@attrs.frozen
class Layer:
    """One layer: the contents of ``source`` at ``target``; ``opaque`` hides what lower
    layers had under ``target``; ``whiteout`` (no source) deletes ``target``."""

    source: Path | None = None
    target: str = "/"
    opaque: bool = False
    whiteout: bool = False


@attrs.frozen
class ImageSpec:
    user: str = ""
    workdir: str = ""
    env: Sequence[str] = ()
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()


def run(argv: list[str]) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {p.stderr.strip()[-1000:]}")
    return p.stdout


def build_image(
    layout: Path, tag: str, layers: Sequence[Layer], spec: ImageSpec = ImageSpec(), *, base: str = ""
) -> None:
    """An image ``layout:tag`` in an OCI layout (made if missing), one umoci layer per
    Layer, on top of the image tagged ``base`` in the same layout (its layers shared)."""
    if not (layout / "oci-layout").exists():
        run(["umoci", "init", "--layout", str(layout)])
    image = f"{layout}:{tag}"
    if base:
        run(["umoci", "config", "--no-history", "--image", f"{layout}:{base}", "--tag", tag])
    else:
        run(["umoci", "new", "--image", image])
    for i, layer in enumerate(layers):
        tar = layout.parent / f".layer-{os.getpid()}-{i}.tar"
        try:
            layer_tar(layer, tar)
            run(["umoci", "raw", "add-layer", "--no-history", "--image", image, str(tar)])
        finally:
            tar.unlink(missing_ok=True)
    argv = ["umoci", "config", "--no-history", "--image", image]
    if spec.cmd:
        argv += ["--clear", "config.cmd"]
    if spec.env:
        argv += ["--clear", "config.env"]
    if spec.user:
        argv += ["--config.user", spec.user]
    if spec.workdir:
        argv += ["--config.workingdir", spec.workdir]
    for e in spec.env:
        argv += ["--config.env", e]
    for a in spec.entrypoint:
        argv += ["--config.entrypoint", a]
    for a in spec.cmd:
        argv += ["--config.cmd", a]
    run(argv)


def layer_tar(layer: Layer, out: Path) -> None:
    """The layer as docker writes one: a POSIX tar of paths relative to /, a whiteout as
    an empty ``.wh.NAME`` file, an opaque directory marked by ``.wh..wh..opq``. (Not
    ``umoci insert``: umoci 0.4.7 leaves that tar without its end-of-archive blocks.)"""
    base = layer.target.strip("/")
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        if layer.whiteout:
            parent, name = os.path.split(base)
            tf.addfile(tarfile.TarInfo(os.path.join(parent, ".wh." + name)))
            return
        assert layer.source is not None
        if base:
            tf.add(layer.source, arcname=base, recursive=False)
        if layer.opaque:
            tf.addfile(tarfile.TarInfo(os.path.join(base, ".wh..wh..opq")))
        for child in sorted(layer.source.iterdir()):
            tf.add(child, arcname=os.path.join(base, child.name))


def push(layout: Path, tag: str, dest: str, *, creds: str | None = None) -> str:
    """Copy ``layout:tag`` to ``dest`` (plain HTTP); the manifest digest pushed."""
    digest_file = layout.parent / f".digest-{os.getpid()}-{time.monotonic_ns()}"
    argv = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--digestfile", str(digest_file)]
    if creds:
        argv += ["--dest-creds", creds]
    run([*argv, f"oci:{layout}:{tag}", dest])
    try:
        return digest_file.read_text().strip()
    finally:
        digest_file.unlink()


def busybox_tree(dest: Path, passwd: str = "root:x:0:0:root:/root:/bin/sh\n") -> Path:
    """/bin/busybox (Debian's static one) with a few applet links and an /etc/passwd."""
    (dest / "bin").mkdir(parents=True)
    bb = shutil.which("busybox")
    if bb is None:
        raise RuntimeError("busybox-static is not installed")
    shutil.copy(bb, dest / "bin" / "busybox")
    for applet in ("sh", "echo", "cat", "ls", "id", "pwd", "env", "touch", "stat", "uname", "test"):
        (dest / "bin" / applet).symlink_to("busybox")
    (dest / "etc").mkdir()
    (dest / "etc" / "passwd").write_text(passwd)
    return dest


def python_tree(dest: Path) -> Path:
    """The host's python3.11 with its shared libraries and the encodings package: a
    ~12 MB interpreter that runs ``python3 -S -c ...``."""
    py = Path("/usr/bin/python3.11")
    (dest / "usr/bin").mkdir(parents=True)
    shutil.copy(py, dest / "usr/bin/python3.11")
    (dest / "usr/bin/python3").symlink_to("python3.11")
    for line in run(["ldd", str(py)]).splitlines():
        m = re.search(r"(/\S+)", line)
        if m:
            lib = Path(m.group(1))
            target = dest / lib.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(lib, target)
    stdlib = dest / "usr/lib/python3.11"
    stdlib.mkdir(parents=True)
    shutil.copytree("/usr/lib/python3.11/encodings", stdlib / "encodings", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy("/usr/lib/python3.11/os.py", stdlib / "os.py")  # the prefix landmark
    (stdlib / "lib-dynload").mkdir()
    return dest
