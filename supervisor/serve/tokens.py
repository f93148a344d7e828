"""Bearer tokens of the supervisor's TCP doors: one from a private file, compared in constant time.

The gRPC edge (``serve --grpc-token-file``), the metrics endpoint (``serve
--metrics-token-file``) and ``sandvisor mcp --http`` (``--token-file``) read their token
here, once, at start: a regular file of the reading uid, not a symlink, mode 0600 or
stricter (a group- or world-readable file is refused: the token would be everyone's),
one line of 32 to 1024 printable ASCII characters. :func:`bearer_ok` compares an HTTP
``Authorization`` value with ``Bearer TOKEN`` in constant time (:func:`hmac.compare_digest`).
No grpc import: the MCP server and the metrics endpoint use this too.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

MIN_TOKEN, MAX_TOKEN = 32, 1024  # a bearer token's length (openssl rand -hex 32: 64)


def check_token(token: bytes) -> bytes:
    """``token`` if it is one (ValueError saying why not)."""
    if not MIN_TOKEN <= len(token) <= MAX_TOKEN:
        raise ValueError(f"a bearer token is {MIN_TOKEN} to {MAX_TOKEN} characters")
    if not all(0x21 <= b <= 0x7E for b in token):
        raise ValueError("a bearer token is printable ASCII without spaces")
    return token


def read_private(path: Path | str, flag: str, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``path``: a regular file of ours, not a symlink, mode 0600
    or stricter (ValueError naming ``flag`` otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ValueError(
                f"{flag} {path}: must be a regular file owned by uid {os.geteuid()}, "
                f"mode 0600 or stricter (it is {stat.filemode(st.st_mode)}, uid {st.st_uid})"
            )
        return f.read(limit)


def read_token_file(path: Path | str, flag: str = "--grpc-token-file") -> bytes:
    """The bearer token in ``path``: a regular file of ours, not a symlink, mode 0600 or
    stricter; its one line (surrounding whitespace dropped). ``flag`` names the option in
    errors (ValueError)."""
    token = read_private(path, flag, MAX_TOKEN + 2).strip()
    try:
        return check_token(token)
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None


def make_token_file(path: Path | str, flag: str) -> bool:
    """A new random token (64 hex digits) in ``path``, mode 0600, if there is no file
    there; False if there was one (left as it is: :func:`read_token_file` judges it).
    Never follows a symlink nor replaces anything (O_EXCL)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return False
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_hex(32).encode() + b"\n")
    return True


def bearer_ok(authorization: bytes | None, token: bytes) -> bool:
    """``authorization`` (an HTTP header's value) is ``Bearer TOKEN``: constant time in the
    value (the scheme compared with it: no early return on a near miss)."""
    if authorization is None:
        return False
    return hmac.compare_digest(authorization.strip(), b"Bearer " + token)
