"""Regenerate the checked-in Python code of our protos (needs grpcio-tools, the ``proto`` extra).

    python -m supervisor.wire.proto.generate          # rewrite the generated files in place
    python -m supervisor.wire.proto.generate --check  # exit 1 if any is stale (tests run this)

The protos sit at their conventional paths under ``supervisor/wire/proto`` (the package
path, ``sandbox/v1/sandbox.proto``), so the descriptors carry the same file names as
any client's code generated from sandbox.v1, and both load in one process. protoc
writes ``from sandbox.v1 import ...`` for those paths; the imports are rewritten to
``supervisor.wire.proto.sandbox.v1``. The code is checked in (not generated at install)
so that an install needs no protoc; grpcio-tools is pinned in the ``proto`` extra so
that ``--check`` regenerates byte for byte.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROTOS = ("sandbox/v1/sandbox.proto", "sandvisor/v1/sandvisor.proto")
_IMPORT = re.compile(r"^(from|import) (sandbox|sandvisor)\.v1\b", re.MULTILINE)


def outputs(proto: str) -> list[str]:
    stem = proto.removesuffix(".proto")
    return [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]


def generate(out: Path) -> list[Path]:
    """Run protoc over :data:`PROTOS` into ``out``; the generated files, imports rewritten."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    files = []
    for proto in PROTOS:
        for name in outputs(proto):
            path = out / name
            path.write_text(_IMPORT.sub(r"\1 supervisor.wire.proto.\2.v1", path.read_text()))
            files.append(path)
    return files


def stale() -> list[str]:
    """Generated files that differ from what protoc makes of the protos now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        return [
            str(f.relative_to(tmp))
            for f in fresh
            if not (ROOT / f.relative_to(tmp)).exists() or (ROOT / f.relative_to(tmp)).read_bytes() != f.read_bytes()
        ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the checked-in code is stale")
    args = ap.parse_args()
    if args.check:
        bad = stale()
        for f in bad:
            print(f"stale: supervisor/wire/proto/{f}")
        sys.exit(1 if bad else 0)
    for path in generate(ROOT):
        print(f"wrote {path.relative_to(ROOT.parents[2])}")


if __name__ == "__main__":
    main()
