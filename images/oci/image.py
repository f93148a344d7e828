"""What a pulled image is: its record in the store (Image) and the mapping of its OCI
config (Env, WorkingDir, User, Entrypoint, Cmd, ...) onto ImageConfig."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from images.oci.errors import UnsupportedImage
from images.oci.reference import Reference


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


def _json(raw: bytes, what: str, r: Reference | str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        raise UnsupportedImage(f"{r}: the {what} is not JSON") from None
    if not isinstance(doc, dict):
        raise UnsupportedImage(f"{r}: the {what} is not a JSON object")
    return doc
