"""guestd's ``trust_ca``: the sandbox's CA certificate (public: its key stays on the
host) into the guest's trust stores, so clients verify the secret proxy's leaves
without flags (docs/secrets.md).

Writes /etc/sandvisor/ca.pem (the CA alone: NODE_EXTRA_CA_CERTS) and, in every system
bundle the image has (Debian/Ubuntu and Alpine /etc/ssl/certs/ca-certificates.crt,
RHEL-style /etc/pki/tls/certs/ca-bundle.crt and its extracted bundle, SUSE
/etc/ssl/ca-bundle.pem, /etc/ssl/cert.pem), a marked block replacing the one before
(a restored clone's new CA replaces its origin's); /etc/sandvisor/ca-bundle.pem is the
first bundle found with the block (or the CA alone): what SSL_CERT_FILE,
REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE and PIP_CERT name for the processes guestd starts
(the host adds them to their environment). Each file is replaced atomically.
"""

from __future__ import annotations

import os

DIR = "/etc/sandvisor"
CA = DIR + "/ca.pem"
BUNDLE = DIR + "/ca-bundle.pem"
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
)
BEGIN = b"# sandvisor sandbox CA: begin\n"
END = b"# sandvisor sandbox CA: end\n"
MAX_PEM = 16 * 1024
MAX_BUNDLE = 8 << 20


def _write(path: str, data: bytes, mode: int = 0o644) -> None:
    tmp = path + ".sandvisor-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def without_block(data: bytes) -> bytes:
    start = data.find(BEGIN)
    if start < 0:
        return data
    end = data.find(END, start)
    return data[:start] + (data[end + len(END) :] if end >= 0 else b"")


def install(pem: bytes) -> int:
    """Install ``pem``; the number of system bundles it went into."""
    if not pem.startswith(b"-----BEGIN CERTIFICATE-----") or len(pem) > MAX_PEM or BEGIN in pem or END in pem:
        raise ValueError("not one PEM certificate")
    if not pem.endswith(b"\n"):
        pem += b"\n"
    os.makedirs(DIR, 0o755, exist_ok=True)
    _write(CA, pem)
    block = BEGIN + pem + END
    first = b""
    done: set[str] = set()
    for path in SYSTEM_BUNDLES:
        real = os.path.realpath(path)
        if real in done or not os.path.isfile(real):
            continue
        done.add(real)
        with open(real, "rb") as f:
            data = f.read(MAX_BUNDLE)
        data = without_block(data)
        if data and not data.endswith(b"\n"):
            data += b"\n"
        data += block
        _write(real, data, os.stat(real).st_mode & 0o777)
        first = first or data
    _write(BUNDLE, first or block)
    return len(done)
