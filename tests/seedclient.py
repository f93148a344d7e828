"""Clients generated at test time from the seed's proto, as any seed client makes them.

``generate()`` runs protoc (grpcio-tools) over ``shared/seeds/000_...txt`` (the vendored
copy when shared/ is not beside the clone) at its conventional path
``sandbox/v1/sandbox.proto`` in a temporary directory and imports ``sandbox_pb2`` and
``sandbox_pb2_grpc`` from there, once per process (the modules stay imported; their
directory is removed at exit)."""

from __future__ import annotations

import atexit
import functools
import importlib
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
SEED_NAME = "shared/seeds/000_b1e1dbfa8d7a5097.txt"  # beside the clone in CI, above the worktree here
SEED = next((p / SEED_NAME for p in REPO.parents if (p / SEED_NAME).exists()), REPO.parent / SEED_NAME)
VENDORED = REPO / "supervisor" / "proto" / "sandbox" / "v1" / "sandbox.proto"


@functools.cache
def generate() -> tuple[ModuleType, ModuleType]:
    protoc = pytest.importorskip("grpc_tools.protoc")
    work = Path(tempfile.mkdtemp(prefix="seed-client-"))
    atexit.register(shutil.rmtree, work, True)
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
    return pb2, pb2_grpc
