"""SSH public keys as a sandbox stores them: OpenSSH's one-line form (``TYPE BASE64
[COMMENT]``, as in ``id_ed25519.pub`` or an ``authorized_keys`` line), checked here
without a crypto library (the gateway parses them for real when it compares).

A sandbox's keys are the only ones its SSH endpoint accepts (docs/ssh.md); they are
public, kept with its configuration and shown by Inspect.
"""

from __future__ import annotations

import base64
import binascii
import struct

KEY_TYPES = frozenset(
    {
        "ssh-ed25519",
        "ssh-rsa",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "sk-ssh-ed25519@openssh.com",
        "sk-ecdsa-sha2-nistp256@openssh.com",
    }
)
MAX_KEYS = 32
MAX_KEY_BYTES = 16 * 1024  # a 16384-bit RSA key's line is about 2.8 KiB


def parse_key(line: str) -> str:
    """``line`` as a stored key (``TYPE BASE64``, the comment kept), or ValueError."""
    parts = line.strip().split(None, 2)
    if len(parts) < 2 or parts[0] not in KEY_TYPES:
        raise ValueError(f"ssh key {line[:40]!r}: not an OpenSSH public key line (TYPE BASE64 [COMMENT])")
    if len(line.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"ssh key {line[:40]!r}: longer than {MAX_KEY_BYTES} bytes")
    try:
        blob = base64.b64decode(parts[1], validate=True)
        (n,) = struct.unpack(">I", blob[:4])
        name = blob[4 : 4 + n].decode("ascii")
    except (binascii.Error, struct.error, UnicodeDecodeError):
        raise ValueError(f"ssh key {line[:40]!r}: its key data is not valid base64 of a key") from None
    if name != parts[0]:
        raise ValueError(f"ssh key {line[:40]!r}: the key data is a {name[:40]!r} key, not {parts[0]!r}")
    comment = parts[2].strip() if len(parts) > 2 else ""
    if any(ord(c) < 32 or ord(c) == 127 for c in comment):
        raise ValueError("ssh key comments must not contain control characters")
    return f"{parts[0]} {parts[1]} {comment}".strip()


def parse_keys(text: str) -> tuple[str, ...]:
    """The keys of an authorized_keys-style text (one a line; blank lines and ``#``
    comments skipped; duplicates once), or ValueError (none, too many, a bad line)."""
    keys: list[str] = []
    seen: set[str] = set()
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key = parse_key(line)
        data = " ".join(key.split()[:2])
        if data not in seen:
            seen.add(data)
            keys.append(key)
    if not keys:
        raise ValueError("no ssh public key given (an OpenSSH .pub file's line)")
    if len(keys) > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS} ssh keys per sandbox")
    return tuple(keys)
