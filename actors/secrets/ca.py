"""A sandbox's certificate authority: the guest trusts its certificate (public only:
guestd installs it), the supervisor keeps its key and mints a leaf per intercepted
server name (ECDSA P-256: a leaf is ~1 ms to make; cached per name)."""

from __future__ import annotations

import datetime
import ssl
import tempfile
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LEAF_CACHE = 64
_DAY = datetime.timedelta(days=1)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def new_ca(label: str) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) of a fresh CA, valid ten years, path length 0."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"sandvisor sandbox CA {label}"[:64])])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - _DAY)
        .not_valid_after(_now() + 3650 * _DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


class Minter:
    """Server-side TLS contexts for intercepted names, from one CA (HTTP/1.1 only in ALPN)."""

    def __init__(self, cert_pem: bytes, key_pem: bytes) -> None:
        self.cert_pem = cert_pem
        self._cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self._key = key
        self._contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()

    def leaf(self, server_name: str) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name[:64])]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - _DAY)
            .not_valid_after(_now() + 30 * _DAY)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(server_name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        chain = cert.public_bytes(serialization.Encoding.PEM) + self.cert_pem
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return chain, key_pem

    def context(self, server_name: str) -> ssl.SSLContext:
        """The server context presenting a leaf for ``server_name`` (cached)."""
        ctx = self._contexts.get(server_name)
        if ctx is not None:
            self._contexts.move_to_end(server_name)
            return ctx
        chain, key_pem = self.leaf(server_name)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        # load_cert_chain reads files only: a private temporary file, gone at once
        with tempfile.TemporaryDirectory(prefix="sandvisor-leaf-") as d:
            path = Path(d) / "leaf.pem"
            path.write_bytes(key_pem + chain)
            path.chmod(0o600)
            ctx.load_cert_chain(path)
        self._contexts[server_name] = ctx
        while len(self._contexts) > LEAF_CACHE:
            self._contexts.popitem(last=False)
        return ctx
