"""File ``metadata=`` on E2B uploads (``sb.files.write(..., metadata={...})``,
``write_files``): as envd 0.6.2 does, each ``X-Metadata-KEY: VALUE`` header of a
``POST /files`` is kept on every uploaded file as the extended attribute
``user.e2b.<key>`` (the key lowercased), and the upload's answer carries the map
(the SDK's ``WriteInfo.metadata``). Set in the guest by ``python3`` (``os.setxattr``,
not following a symlink), as root once the files are written; the guest's file system
must keep user xattrs (ext4 does, tmpfs before Linux 6.6 does not: a 400 says so)."""

from __future__ import annotations

import json
import re
from typing import Any

from supervisor.serve.e2b_http import Exchange, HttpError
from supervisor.serve.guest_fs import exec_collect

PREFIX = "x-metadata-"
XATTR = "user.e2b."
MAX_KEYS = 64
MAX_VALUE = 4096
_KEY = re.compile(r"\A[A-Za-z0-9!#$%&'*+\-.^_`|~]+\Z")  # an HTTP token, as the SDK checks it
_VALUE = re.compile(r"\A[\x20-\x7e]*\Z")  # printable US-ASCII
_SET = """
import json, os, sys
meta = json.loads(sys.argv[1])
for path in sys.argv[2:]:
    for k, v in meta.items():
        try:
            os.setxattr(path, "user.e2b." + k, v.encode(), follow_symlinks=False)
        except OSError as e:
            sys.exit(f"{path}: {e.strerror}")
"""


def metadata_of(ex: Exchange) -> dict[str, str]:
    """The upload's metadata (keys lowercased); 400 for a key or value envd refuses."""
    meta: dict[str, str] = {}
    for name, value in ex.headers.items():  # (names are lowercased already)
        if not name.startswith(PREFIX):
            continue
        key = name[len(PREFIX) :]
        if not _KEY.match(key):
            raise HttpError(400, f"metadata key {key[:64]!r}: letters, digits and !#$%&'*+-.^_`|~")
        if not _VALUE.match(value) or len(value) > MAX_VALUE:
            raise HttpError(400, f"metadata value of {key!r}: printable US-ASCII, at most {MAX_VALUE} bytes")
        meta[key] = value
    if len(meta) > MAX_KEYS:
        raise HttpError(400, f"at most {MAX_KEYS} metadata keys")
    return meta


async def set_metadata(sb: Any, paths: list[str], meta: dict[str, str]) -> None:
    """``meta`` on each of ``paths`` as ``user.e2b.*`` xattrs."""
    if not meta or not paths:
        return
    r = await exec_collect(sb, ["python3", "-c", _SET, json.dumps(meta), *paths], "root")
    if r.exit_code != 0:
        msg = r.stderr.decode("utf-8", "replace").strip()[-300:]
        if r.exit_code == 127 or "not found" in msg:
            msg = "the image has no python3 to set extended attributes with"
        raise HttpError(400, f"file metadata: {msg}")
