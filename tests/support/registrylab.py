"""A registry lab: test images built here from directories with umoci, the refs policy the
tests' images and registries need, and checks on a converted image (debugfs). The
fixtures that start docker-registries on loopback and push the images are in
tests/host/conftest.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import attrs

from images.oci import ImageStore
from images.ocilocal import ImageSpec, Layer, LocalRegistry, build_image, busybox_tree, python_tree, run
from images.refs import RefPolicy

APP_SPEC = ImageSpec(
    user="4242:4243",  # no /etc/passwd entry: numeric ids must work without one
    workdir="/srv/app",  # not in the tree: the store creates it, owned by the user
    env=("PATH=/bin", "GREETING=hello"),
    cmd=("/bin/sh", "-c", 'echo "$GREETING from $(pwd) as $(id -u):$(id -g)"'),
)


@attrs.frozen
class Built:
    layout: Path  # one OCI layout, tags busybox, python, app
    archive: Path  # docker-archive of app
    oci_archive: Path  # oci-archive of busybox


@attrs.frozen
class Pushed:
    reg: LocalRegistry
    busybox: str  # docker://127.0.0.1:PORT/test/busybox:1
    python: str
    app: str
    digests: dict[str, str]  # name -> manifest digest as pushed


def build_images(w: Path) -> Built:
    """The test images in one OCI layout under ``w`` (busybox, python, app), and two archives."""
    layout = w / "layout"
    bb = busybox_tree(w / "bb")
    build_image(layout, "busybox", [Layer(bb)], ImageSpec(cmd=("/bin/sh",)))
    # python: lower layer with files that upper layers delete (whiteout) and hide (opaque)
    py = python_tree(w / "py")
    (py / "etc").mkdir()
    (py / "etc" / "doomed.txt").write_text("deleted by the next layer\n")
    (py / "etc" / "kept.txt").write_text("kept\n")
    (py / "opt/lower").mkdir(parents=True)
    for n in ("a", "b"):
        (py / "opt/lower" / n).write_text(n)
    upper = w / "upper"
    upper.mkdir()
    (upper / "c").write_text("c")
    build_image(
        layout,
        "python",
        [Layer(py), Layer(target="/etc/doomed.txt", whiteout=True), Layer(upper, "/opt/lower", opaque=True)],
        ImageSpec(cmd=("/usr/bin/python3", "-S")),
    )
    motd = w / "motd"
    (motd / "etc").mkdir(parents=True)
    (motd / "etc" / "motd").write_text("app image\n")
    build_image(layout, "app", [Layer(motd)], APP_SPEC, base="busybox")
    archive = w / "app-docker.tar"
    run(["skopeo", "copy", "--quiet", f"oci:{layout}:app", f"docker-archive:{archive}:test/app:1"])
    oci_archive = w / "busybox-oci.tar"
    run(["skopeo", "copy", "--quiet", f"oci:{layout}:busybox", f"oci-archive:{oci_archive}:busybox"])
    return Built(layout, archive, oci_archive)


# the tests' images and registries are all under /tmp and on 127.0.0.1: what serve's
# --allow-path and --registry-allow would say for them (the store's default refuses both)
REFS = RefPolicy(allowed_paths=(Path("/tmp"),), registry_allow=("127.0.0.1",))


def assert_clean(store: ImageStore, images: int = 0) -> None:
    """No partial image: nothing staged, only complete images, no stray files."""
    assert list(store.tmp.iterdir()) == []
    assert len(list(store.images.iterdir())) == images
    assert len(store.list_images()) == images


def debugfs(img: Path, cmd: str) -> str:
    return subprocess.run(["debugfs", "-R", cmd, str(img)], capture_output=True, text=True, check=True).stdout


def names(img: Path, path: str) -> set[str]:
    out = debugfs(img, f"ls -p {path}")
    return {ln.split("/")[5] for ln in out.splitlines() if ln.count("/") >= 6} - {".", ".."}


def owner(img: Path, path: str) -> tuple[int, int, int]:
    out = debugfs(img, f"stat {path}")
    m = re.search(r"Mode:\s+(\d+).*?User:\s+(\d+)\s+Group:\s+(\d+)", out, re.S)
    assert m, out
    return int(m.group(1), 8), int(m.group(2)), int(m.group(3))
