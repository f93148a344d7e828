"""What tests of the gRPC edge share: clients generated from sandbox.v1's proto, TLS material.

``generate()`` runs protoc (grpcio-tools) over ``shared/seeds/000_...txt`` (the vendored
copy when shared/ is not beside the clone) at its conventional path
``sandbox/v1/sandbox.proto`` in a temporary directory and imports ``sandbox_pb2`` and
``sandbox_pb2_grpc`` from there, once per process (the directory goes once they are
imported). ``make_pki()`` makes a CA, a server certificate for
127.0.0.1/localhost and a client certificate (CN ci-client), in memory. ``write_token()``
makes a bearer token file as ``serve --grpc-token-file`` wants it; ``bearer()`` is the
metadata a client sends with it."""

from __future__ import annotations

import functools
import importlib
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SEED_NAME = "shared/seeds/000_b1e1dbfa8d7a5097.txt"  # beside the clone in CI, above the worktree here
SEED = next((p / SEED_NAME for p in REPO.parents if (p / SEED_NAME).exists()), REPO.parent / SEED_NAME)
VENDORED = REPO / "supervisor/wire/proto/sandbox/v1/sandbox.proto"


@functools.cache
def generate() -> tuple[ModuleType, ModuleType]:
    protoc = pytest.importorskip("grpc_tools.protoc")
    work = Path(tempfile.mkdtemp(prefix="seed-client-"))
    (work / "sandbox" / "v1").mkdir(parents=True)
    shutil.copyfile(SEED if SEED.exists() else VENDORED, work / "sandbox" / "v1" / "sandbox.proto")
    rc = protoc.main(
        ["protoc", f"-I{work}", f"--python_out={work}", f"--grpc_python_out={work}", "sandbox/v1/sandbox.proto"]
    )
    assert rc == 0
    sys.path.insert(0, str(work))
    try:
        pb2 = importlib.import_module("sandbox.v1.sandbox_pb2")
        pb2_grpc = importlib.import_module("sandbox.v1.sandbox_pb2_grpc")
    finally:
        sys.path.remove(str(work))
        shutil.rmtree(work)  # imported: the modules need their files no more
    return pb2, pb2_grpc


def make_pki() -> dict[str, bytes]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (CN ci-client)."""
    import ipaddress

    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from tests.support.pki import Authority

    ca = Authority("sandvisor test CA")
    server_cert, server_key = ca.leaf(
        "localhost",
        [ExtendedKeyUsageOID.SERVER_AUTH],
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_cert, client_key = ca.leaf("ci-client", [ExtendedKeyUsageOID.CLIENT_AUTH])
    return {
        "ca": ca.pem,
        "server_cert": server_cert,
        "server_key": server_key,
        "client_cert": client_cert,
        "client_key": client_key,
    }


def write_token(path: Path) -> str:
    """A fresh bearer token in ``path`` (0600, as --grpc-token-file requires); the token."""
    token = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def bearer(token: str) -> list[tuple[str, str]]:
    """The call metadata a TCP client authenticates with: ``authorization: Bearer TOKEN``."""
    return [("authorization", f"Bearer {token}")]
