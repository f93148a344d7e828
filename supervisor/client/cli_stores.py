"""The client commands on what the supervisor stores: snapshots (checkpoint, restore,
snapshots, snapshot rm), named volumes, OCI images (image pull, ls, rm, prune).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from supervisor.client.cli_common import UsageError, connect, kv, tls_flag
from supervisor.client.cli_output import PullProgress, mib, print_json, print_table, ts

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms; mypy reads the name)
if TYPE_CHECKING:
    from typing import Any


def checkpoint(a: argparse.Namespace) -> int:
    with connect(a) as c:
        r = c.call("Checkpoint", {"sandbox_id": a.name, "name": a.snapshot_name or "", "labels": kv(a.label)})
    print_json(r) if a.json else print(r["snapshot_id"])
    return 0


def restore(a: argparse.Namespace) -> int:
    with connect(a) as c:
        r = c.call(
            "Restore",
            {
                "snapshot_id": a.snapshot,
                "id": a.new_name or "",
                "labels": kv(a.label),
                "ttl_seconds": a.ttl,
                "network_override": a.network_override,
            },
        )
    print_json(r) if a.json else print(r["id"])
    return 0


def snapshots(a: argparse.Namespace) -> int:
    with connect(a) as c:
        if getattr(a, "snapshot_id", None):
            c.call("DeleteSnapshot", {"snapshot_id": a.snapshot_id})
            return 0
        r = c.call("ListSnapshots", {"sandbox_id": a.sandbox or "", "labels": kv(a.label)})
    if a.json:
        print_json(r["snapshots"])
        return 0
    print_table(
        ("ID", "NAME", "SANDBOX", "MEMORY", "SIZE", "POOL", "CREATED"),
        [
            (
                x["id"],
                x["name"],
                x["sandbox_id"],
                x.get("memory", ""),
                f"{x.get('size_bytes', 0) / 2**20:.0f} MiB",
                str(x.get("pool_ready", 0)),
                x["created_at"],
            )
            for x in r["snapshots"]
        ],
    )
    return 0


def snapshot(a: argparse.Namespace) -> int:
    """snapshot rm ID | export ID FILE | import FILE: export and import stream one file
    through the SDK (the supervisor never opens a path of the caller's)."""
    if a.action == "rm":
        return snapshots(a)
    if a.action == "inspect":  # (memory "disk", disk_only: a stopped sandbox's disk alone)
        with connect(a) as c:
            found = [
                s
                for s in c.call("ListSnapshots", {"sandbox_id": "", "labels": {}})["snapshots"]
                if a.snapshot_id in (s["id"], s["name"])
            ]
        exact = [s for s in found if s["id"] == a.snapshot_id] or found
        if len(exact) != 1:
            raise UsageError(f"{a.snapshot_id}: {'no such snapshot' if not exact else 'several snapshots: use an id'}")
        print_json(exact[0])
        return 0
    from supervisor.client import Sandbox

    if a.action == "export":
        if not a.file:
            raise UsageError("snapshot export ID FILE: FILE is missing (- : stdout)")
        dest = sys.stdout.buffer if a.file == "-" else a.file
        if dest is sys.stdout.buffer and sys.stdout.isatty():
            raise UsageError("snapshot export ID -: stdout is a terminal; redirect it or give a FILE")
        n = Sandbox.export_snapshot(a.snapshot_id, dest, include_base=a.include_base, socket=a.socket)
        if a.json:
            print_json({"file": a.file, "size_bytes": n})
        return 0
    if a.file:
        raise UsageError("snapshot import FILE takes one file")
    src = sys.stdin.buffer if a.snapshot_id == "-" else a.snapshot_id
    if src is not sys.stdin.buffer and not Path(a.snapshot_id).is_file():
        raise UsageError(f"{a.snapshot_id}: no such file")
    r = Sandbox.import_snapshot(src, name=a.snapshot_name or "", labels=kv(a.label), socket=a.socket)
    if a.json:
        from supervisor.wire import protocol

        print_json(protocol.unstructure_body(r))
    else:
        print(r.id)
    return 0


def image_pull(a: argparse.Namespace) -> int:
    """Pull with progress on stderr (one line redrawn on a terminal, each phase once
    otherwise); the digest (or --json, the image) on stdout."""
    if a.creds is not None and a.authfile is not None:
        raise UsageError("give --creds or --authfile, not both")
    body: dict[str, Any] = {"ref": a.ref, "policy": a.policy or "", "creds": a.creds or ""}
    if not a.tls_verify:
        body["tls_verify"] = False
    if a.authfile is not None:
        try:
            body["auth_json"] = Path(a.authfile).read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read the auth file {a.authfile}: {exc.strerror}") from None
    if a.registry_ca is not None:
        try:
            body["ca_pem"] = Path(a.registry_ca).read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read {a.registry_ca}: {exc.strerror}") from None
    show = PullProgress(quiet=a.quiet)
    image = None
    with connect(a) as c:
        for item in c.stream("PullImage", body):
            if item.get("image"):
                image = item["image"]
            show(item.get("phase", ""), item.get("message", ""), item.get("done", 0), item.get("total", 0))
    if image is None:
        raise UsageError("the supervisor ended the pull without an image")
    print_json(image) if a.json else print(image["digest"])
    return 0


def image_ls(a: argparse.Namespace) -> int:
    with connect(a) as c:
        r = c.call("ListImages", {})
    oci = r.get("oci_images", [])
    if a.json:
        print_json(oci)
        return 0
    rows = []
    for i in oci:
        for ref in i["refs"] or ["<none>"]:
            rows.append(
                (
                    ref,
                    i["id"],
                    mib(i.get("size_bytes", 0)),
                    "yes" if i.get("in_use") else "",
                    ts(i.get("pulled_at", 0)),
                )
            )
    print_table(("REFERENCE", "ID", "SIZE", "IN USE", "PULLED"), rows)
    return 0


def image_rm(a: argparse.Namespace) -> int:
    with connect(a) as c:
        for ref in a.refs:
            r = c.call("RemoveImage", {"ref": ref})
            if a.json:
                print_json(r)
                continue
            for t in r.get("untagged", []):
                print(f"untagged: {t}")
            for d in r.get("deleted", []):
                print(f"deleted: {d}")
    return 0


def image_prune(a: argparse.Namespace) -> int:
    with connect(a) as c:
        r = c.call("PruneImages", {"dangling_only": a.dangling})
    if a.json:
        print_json(r)
        return 0
    for d in r.get("deleted", []):
        print(f"deleted: {d}")
    print(f"freed {mib(r.get('freed_bytes', 0))} ({r.get('blobs_deleted', 0)} blobs)")
    return 0


def add_image_commands(isub: Any) -> None:
    """``image pull|ls|rm|prune``: the supervisor's OCI store (``image build`` is the host's)."""

    def cmd(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = isub.add_parser(name, help=help)
        p.add_argument("--socket", default=os.environ.get("SANDVISOR_SOCKET"), help="supervisor socket")
        p.add_argument("--json", action="store_true")
        p.set_defaults(client=fn)
        return p

    p = cmd("pull", image_pull, "pull an OCI image into the supervisor's store (prints its digest)")
    p.add_argument(
        "ref", help="alpine, python:3.12, ghcr.io/o/x:1, docker://HOST/NAME:TAG, ...@sha256:..., oci:DIR, ..."
    )
    p.add_argument("--policy", choices=["always", "if-missing", "never"], help="default: if-missing")
    p.add_argument("--tls-verify", type=tls_flag, default=True, metavar="BOOL", help="false: a plain-HTTP registry")
    p.add_argument("--creds", metavar="USER:PASS", help="registry credentials (never logged)")
    p.add_argument("--authfile", metavar="PATH", help="a docker-style auth file (read here, sent as content)")
    p.add_argument("--registry-ca", metavar="PEM", help="CA certificates for the registry (read here, sent as content)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")

    cmd("ls", image_ls, "list the OCI images in the supervisor's store")

    p = cmd("rm", image_rm, "untag a reference, or delete an image (refused while in use)")
    p.add_argument("refs", nargs="+", metavar="REF")

    p = cmd("prune", image_prune, "delete every image nothing uses, and unused layers")
    p.add_argument("--dangling", action="store_true", help="only images no reference names")


def volume(a: argparse.Namespace) -> int:
    """volume create NAME --size 256M | ls | inspect NAME | rm NAME..."""
    with connect(a) as c:
        if a.action == "create":
            if len(a.names) != 1:
                raise UsageError("volume create takes one NAME")
            from supervisor.client import parse_size

            mib = -(-parse_size(a.size) // (1 << 20))
            r = c.call("CreateVolume", {"name": a.names[0], "size_mib": mib, "labels": kv(a.label)})
            if a.json:
                print_json(r)
            else:
                print(r["name"])
            return 0
        if a.action == "rm":
            if not a.names:
                raise UsageError("volume rm takes NAME...")
            for name in a.names:
                c.call("DeleteVolume", {"name": name, "force": a.force})
            return 0
        if a.action == "inspect":
            if len(a.names) != 1:
                raise UsageError("volume inspect takes one NAME")
            print_json(c.call("InspectVolume", {"name": a.names[0]}))
            return 0
        r = c.call("ListVolumes", {"labels": kv(a.label)})
    if a.json:
        print_json(r["volumes"])
        return 0
    print_table(
        ("NAME", "SIZE", "MOUNTED BY", "CREATED"),
        [
            (x["name"], f"{x['size_mib']} MiB", ", ".join(x.get("mounted_by") or ()) or "-", str(x["created_at"]))
            for x in r["volumes"]
        ],
    )
    return 0
