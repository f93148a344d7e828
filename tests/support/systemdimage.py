"""A root filesystem with systemd for the init hand-off tests: Debian's minbase with
systemd and systemd-sysv (``/sbin/init``), made with mmdebstrap from the host's apt
sources as the default image's rootfs is, into a read-only ext4 file.

Cached in the image cache beside the default image's parts, keyed by the exact package
versions and this recipe (``test-systemd-<key>/rootfs.ext4``): the suite builds it once
(about two minutes), later runs find it. Built under a staging directory and renamed
into place, so an interrupted or concurrent build never leaves a half image."""

from __future__ import annotations

from pathlib import Path

from images.build import (
    build_umask,
    candidates,
    debian_tree,
    default_cache,
    digest,
    public_modes,
    publish,
    run,
    staging,
)

PACKAGES = ("systemd", "systemd-sysv")
SIZE_MIB = 1024  # sparse: room for the sandbox's writes, not disk use
RECIPE = 1  # bump when the tree below changes


def systemd_rootfs(cache: Path | None = None) -> Path:
    """The ext4 root filesystem with systemd (built, or found in the cache)."""
    cache = cache or default_cache()
    key = digest("test-systemd", RECIPE, candidates(PACKAGES), SIZE_MIB)
    final = cache / f"test-systemd-{key}"
    img = final / "rootfs.ext4"
    if img.exists():
        public_modes(final)
        return img
    with build_umask(), staging(cache, "test-systemd") as tmp:
        tree = tmp / "tree"
        debian_tree(tree, PACKAGES)
        (tree / "etc" / "machine-id").write_text("")  # each sandbox gets its own (guestd/initsys.py)
        out = tmp / "out"
        out.mkdir()
        built = out / "rootfs.ext4"
        run(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                "-b",
                "4096",
                "-m",
                "0",
                "-E",
                "root_owner=0:0",
                "-d",
                str(tree),
                str(built),
                f"{SIZE_MIB}M",
            ]
        )
        built.chmod(0o444)
        publish(out, final)
    return img
