"""``python -m images.oci``: the store from the operator's own command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import trio

from images.oci.errors import ImageError
from images.oci.pull import ImageStore, PullProgress
from images.oci.store import default_store_root


def main(argv: list[str] | None = None) -> int:
    """``python -m images.oci pull REF [--tls-verify=false] | ls | rm REF | prune``."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m images.oci")
    ap.add_argument("--root", type=Path, default=None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pull")
    p.add_argument("ref")
    p.add_argument("--policy", default="if-missing")
    p.add_argument("--tls-verify", default="true")
    p.add_argument("--creds")
    p.add_argument("--authfile", type=Path)
    sub.add_parser("ls")
    p = sub.add_parser("rm")
    p.add_argument("ref")
    sub.add_parser("prune")
    a = ap.parse_args(argv)
    from images.refs import RefPolicy

    store = ImageStore(a.root or default_store_root(), refs=RefPolicy(unrestricted=True))  # the operator's own

    def show(pr: PullProgress) -> None:
        extra = f" {pr.done >> 20}/{pr.total >> 20} MiB" if pr.total else ""
        print(f"[{pr.phase}] {pr.message}{extra}", file=sys.stderr, flush=True)

    async def go() -> Any:
        if a.cmd == "pull":
            img = await store.pull(
                a.ref,
                policy=a.policy,
                tls_verify=a.tls_verify.lower() not in ("false", "0", "no"),
                creds=a.creds,
                authfile=a.authfile,
                progress=show,
            )
            return {"digest": img.digest, "rootfs": str(img.rootfs), "config": attrs.asdict(img.config)}
        if a.cmd == "ls":
            return [
                {"id": i.id, "digest": i.digest, "refs": i.refs, "size": i.content_bytes} for i in store.list_images()
            ]
        if a.cmd == "rm":
            return attrs.asdict(await store.remove(a.ref))
        return attrs.asdict(await store.prune(()))

    try:
        print(json.dumps(trio.run(go), indent=2))
    except ImageError as exc:
        print(f"{exc.code}: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
