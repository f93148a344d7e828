"""``sandvisor config NAME``: a sandbox's whole configuration as JSON, the file
``create NAME --from-config FILE`` makes an equal sandbox of (docs/cli.md)."""

from __future__ import annotations

import argparse


def config(a: argparse.Namespace) -> int:
    from supervisor.client import Sandbox

    print(Sandbox(a.name, socket=a.socket).config_json(patch_data=a.patch_data))
    return 0


def add_config_command(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument(
        "--patch-data",
        action="store_true",
        help="the file patches' bytes too (base64; else each is described by its size and SHA-256)",
    )
