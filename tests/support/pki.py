"""Test TLS material in memory: one CA that issues leaf certificates (EC P-256, PEM,
PKCS#8 keys). Shared by the gRPC edge's tests (tests/support/grpc_clients.py) and the fleet
lab (tests/support/fleetlab.py)."""

from __future__ import annotations

import datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class Authority:
    """A self-signed CA named ``name``, valid from five minutes ago for ``hours``."""

    def __init__(self, name: str, *, hours: int = 1) -> None:
        self.now = datetime.datetime.now(datetime.UTC)
        self.hours = hours
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (
            self._builder(_name(name), _name(name), self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def _builder(self, subject: x509.Name, issuer: x509.Name, public_key: Any) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.now - datetime.timedelta(minutes=5))
            .not_valid_after(self.now + datetime.timedelta(hours=self.hours))
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def leaf(
        self, cn: str, usages: list[x509.ObjectIdentifier], sans: list[x509.GeneralName] | None = None
    ) -> tuple[bytes, bytes]:
        """A certificate for ``cn`` with these extended key usages and SANs: (cert PEM, key PEM)."""
        key = ec.generate_private_key(ec.SECP256R1())
        b = self._builder(_name(cn), self.cert.subject, key.public_key()).add_extension(
            x509.ExtendedKeyUsage(usages), critical=False
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), pem_key(key)
