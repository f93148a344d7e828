"""Image profiles: the default image with a richer root filesystem.

``sandvisor image build --profile code-interpreter`` builds (or finds) the default
image, then one more content-keyed rootfs part: the default's packages plus Debian's
Jupyter kernel and the libraries code cells reach for (ipykernel, jupyter_client,
matplotlib, numpy, pandas). The kernel and the guest runtime are the default's; the
profile's manifest, ``<cache>/<profile>.json``, names them with its own rootfs. The
part is cached like the default's (its key: the exact package versions and the size),
and kept by the default build's clean-up (which removes superseded kernels and
runtimes only).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from images.build import (
    PART_FILE_MODE,
    ROOTFS_INCLUDE,
    Builder,
    BuildError,
    Image,
    build_umask,
    default_cache,
)

PROFILES: dict[str, tuple[str, ...]] = {
    "code-interpreter": (
        "python3-ipykernel",
        "python3-jupyter-client",
        "python3-matplotlib",
        "python3-numpy",
        "python3-pandas",
    ),
}
PROFILE_SIZE_MIB = 3072  # sparse: room for the sandbox's own writes beside ~0.5 GiB of packages


def build_profile(builder: Builder, profile: str) -> Image:
    """The default image (built if needed), then ``profile``'s rootfs and manifest."""
    extra = PROFILES.get(profile)
    if extra is None:
        raise BuildError(f"no image profile {profile!r} (there are: {', '.join(sorted(PROFILES))})")
    base = builder.build()
    with build_umask():
        fdir, fkey = builder.rootfs((*ROOTFS_INCLUDE, *extra), PROFILE_SIZE_MIB)
        img = attrs.evolve(base, name=profile, rootfs=fdir / "rootfs.ext4", keys={**base.keys, "rootfs": fkey})
        manifest = builder.cache / f"{profile}.json"
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps(img.to_json(), indent=2))
        tmp.chmod(PART_FILE_MODE)
        tmp.rename(manifest)
    return img


def load_profile(profile: str, cache: Path | None = None) -> Image | None:
    """``profile``'s image, if built (without touching apt)."""
    try:
        img = Image.from_json(json.loads(((cache or default_cache()) / f"{profile}.json").read_text()))
    except (OSError, ValueError, KeyError):
        return None
    return img if img.exists() else None
