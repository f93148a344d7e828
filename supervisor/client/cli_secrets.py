"""``sandvisor secret``: the supervisor's secret store, and a sandbox's secrets
(docs/secrets.md). Values are read from stdin (never from an argument: argv is
visible to every local user in /proc) and never printed."""

from __future__ import annotations

import argparse
import sys

from supervisor.client.cli_common import UsageError, connect
from supervisor.client.cli_output import print_json, print_table

MAX_VALUE = 64 * 1024


def read_value() -> bytes:
    """The value on stdin (one trailing newline dropped: ``echo KEY | sandvisor secret set``)."""
    data = sys.stdin.buffer.read(MAX_VALUE + 2)
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise UsageError("the secret's value is read from stdin, and it was empty")
    return data


def secret(a: argparse.Namespace) -> int:
    """secret set NAME [--hosts H,...] | ls [--sandbox ID] | rm NAME... | rotate SANDBOX NAME | revoke SANDBOX NAME"""
    args = a.args
    want = {"set": 1, "rotate": 2, "revoke": 2}
    if a.action in want and len(args) != want[a.action]:
        raise UsageError(f"secret {a.action} takes {'SANDBOX NAME' if want[a.action] == 2 else 'NAME'}")
    if a.action == "rm" and not args:
        raise UsageError("secret rm takes NAME...")
    if a.action == "ls" and args:
        raise UsageError("secret ls takes no names (--sandbox ID: that sandbox's secrets)")
    if a.hosts and a.action != "set":
        raise UsageError("--hosts is for secret set")
    hosts = [h.strip() for h in a.hosts.split(",") if h.strip()]
    value = read_value() if a.action in ("set", "rotate") else b""
    with connect(a) as c:
        if a.action == "set":
            c.call("SetSecret", {"name": args[0], "value": value, "hosts": hosts})
        elif a.action == "rm":
            for name in args:
                c.call("DeleteSecret", {"name": name})
        elif a.action == "rotate":
            c.call("RotateSecret", {"id": args[0], "name": args[1], "value": value})
        elif a.action == "revoke":
            c.call("RevokeSecret", {"id": args[0], "name": args[1]})
        elif a.sandbox:
            r = c.call("ListSandboxSecrets", {"id": a.sandbox})
            if a.json:
                print_json(r["secrets"])
            else:
                rows = [
                    (
                        s["name"],
                        s["source"],
                        ",".join(s["hosts"]),
                        s.get("substitute", "headers"),
                        s["placeholder"],
                        "yes" if s["removed"] else "",
                    )
                    for s in r["secrets"]
                ]
                print_table(("NAME", "SOURCE", "HOSTS", "SUBSTITUTE", "PLACEHOLDER", "REVOKED"), rows)
        else:
            names = c.call("ListSecrets", {})["names"]
            if a.json:
                print_json(names)
            else:
                for name in names:
                    print(name)
    return 0
