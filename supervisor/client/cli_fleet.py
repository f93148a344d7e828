"""``sandvisor --fleet ADDRESS COMMAND`` and ``sandvisor fleet nodes``: the fleet's CLI.

ADDRESS is any member's advertised gRPC address (``$SANDVISOR_FLEET``); the client's
certificate, key and the fleet's CA: ``--cert/--key/--ca`` (``$SANDVISOR_FLEET_CERT``,
``_KEY``, ``_CA``). Commands: create, run, inspect, ls, rm, checkpoint, restore, nodes.
Errors: one line, exit 1 (2: usage); ``run`` exits with the command's code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from supervisor.client.cli_common import UsageError

USAGE = "sandvisor --fleet ADDRESS [--ca PEM --cert PEM --key PEM] COMMAND ..."


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandvisor --fleet ADDRESS", description="the fleet's sandboxes, on any host")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--fleet", default=os.environ.get("SANDVISOR_FLEET"), metavar="ADDRESS", help="a member's HOST:PORT")
    for flag, env in (("--ca", "CA"), ("--cert", "CERT"), ("--key", "KEY")):
        p.add_argument(flag, default=os.environ.get(f"SANDVISOR_FLEET_{env}"), metavar="PEM")
    p.add_argument("--timeout", type=float, default=120.0, help="each call's deadline, seconds")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("create", help="a sandbox on a node Ray's scheduler chooses; prints NAME NODE")
    c.add_argument("name")
    c.add_argument("--memory", type=int, default=0, metavar="MIB")
    c.add_argument("--cpus", type=int, default=0)
    c.add_argument("--node", default="", help="only this node")
    c.add_argument("--prefer-snapshot", default="", metavar="ID", help="rather a node that caches this snapshot")
    c.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="for room (default 60)")
    r = sub.add_parser("run", help="run a command in the sandbox, on its node: NAME -- CMD...")
    r.add_argument("name")
    i = sub.add_parser("inspect", help="where the sandbox lives (JSON)")
    i.add_argument("name")
    ls = sub.add_parser("ls", help="every sandbox of the fleet, with its node")
    ls.add_argument("--json", action="store_true")
    rm = sub.add_parser("rm", help="remove sandboxes (their slots go back)")
    rm.add_argument("names", nargs="+")
    cp = sub.add_parser("checkpoint", help="checkpoint a sandbox on its node; prints the snapshot id")
    cp.add_argument("name")
    cp.add_argument("--name", dest="snapshot_name", default="")
    rs = sub.add_parser("restore", help="restore a snapshot on a node that caches it (or --node)")
    rs.add_argument("snapshot")
    rs.add_argument("--name", dest="sandbox", required=True)
    rs.add_argument("--node", default="")
    rs.add_argument("--wait", type=float, default=0, metavar="SECONDS")
    n = sub.add_parser("nodes", help="the fleet's nodes: capacity and use")
    n.add_argument("--json", action="store_true")
    return p


def _fleet(args: argparse.Namespace) -> Any:
    from supervisor.client.fleet import Fleet, FleetTls

    if not args.fleet:
        raise UsageError(f"no fleet address: {USAGE} (or $SANDVISOR_FLEET)")
    given = [args.ca, args.cert, args.key]
    if any(given) and not all(given):
        raise UsageError("--ca, --cert and --key go together")
    tls = FleetTls.from_files(args.ca, args.cert, args.key) if all(given) else None
    return Fleet(args.fleet, tls=tls, timeout=args.timeout)


def _record(p: Any) -> dict[str, Any]:
    return {
        "name": p.name,
        "node": p.node,
        "address": p.address,
        "state": p.state,
        "memory_mib": p.memory_mib,
        "created_at": p.created_at,
        "lost_at": p.lost_at,
    }


def main(argv: list[str]) -> int:
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1 :]
    if argv and argv[0] == "fleet":  # `sandvisor fleet nodes --fleet ADDRESS`
        argv = argv[1:]
    args = parser().parse_args(argv)
    with _fleet(args) as fleet:
        if args.command == "create":
            sb = fleet.create(
                args.name,
                memory_mib=args.memory,
                cpus=args.cpus,
                node=args.node,
                prefer_snapshot=args.prefer_snapshot,
                wait=args.wait,
            )
            print(f"{sb.name} {sb.node}")
        elif args.command == "run":
            if not cmd:
                raise UsageError("run NAME -- CMD...: no command")
            res = fleet.get(args.name).run(cmd)
            sys.stdout.buffer.write(res.stdout)
            sys.stderr.buffer.write(res.stderr)
            return int(res.exit_code)
        elif args.command == "inspect":
            print(json.dumps(_record(fleet.get(args.name).record)))
        elif args.command == "ls":
            rows = [_record(p) for p in fleet.ls()]
            if args.json:
                print(json.dumps(rows))
            else:
                print(f"{'NAME':<24} {'NODE':<16} {'STATE':<8} {'ADDRESS':<22} AGE")
                for r in rows:
                    age = f"{time.time() - r['created_at']:.0f}s"
                    print(f"{r['name']:<24} {r['node']:<16} {r['state']:<8} {r['address']:<22} {age}")
        elif args.command == "rm":
            for name in args.names:
                sb = fleet.get(name)
                if sb.state == "lost":
                    fleet.release(name)  # its node is gone: only the record is left
                else:
                    sb.remove()
        elif args.command == "checkpoint":
            print(fleet.get(args.name).checkpoint(args.snapshot_name))
        elif args.command == "restore":
            sb = fleet.restore(args.snapshot, args.sandbox, node=args.node, wait=args.wait)
            print(f"{sb.name} {sb.node}")
        elif args.command == "nodes":
            nodes = fleet.nodes()
            if args.json:
                print(json.dumps([_node(n) for n in nodes]))
            else:
                print(f"{'NODE':<16} {'ADDRESS':<22} {'ALIVE':<6} {'SLOTS':<8} {'MEMORY MiB':<14} SNAPSHOTS")
                for n in nodes:
                    print(
                        f"{n.name:<16} {n.address:<22} {'yes' if n.alive else 'no':<6} "
                        f"{n.slots_used}/{n.slots:<6} {n.memory_used_mib}/{n.memory_mib:<9} {len(n.snapshots)}"
                    )
    return 0


def _node(n: Any) -> dict[str, Any]:
    import attrs

    d = attrs.asdict(n)
    d["snapshots"] = list(d["snapshots"])
    return d
