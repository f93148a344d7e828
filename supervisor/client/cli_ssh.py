"""``sandvisor ssh NAME``: the system's ``ssh`` to a sandbox through ``serve --ssh``
(docs/ssh.md); ``sandvisor ssh-key add|rm|ls NAME [FILE...]``: the keys it accepts
(Modify and Inspect); and ``create --ssh-key FILE``'s reading of key files."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from supervisor.client.cli_common import UsageError, connect, trailing_command
from supervisor.wire.ssh_keys import parse_keys

DEFAULT_AT = "127.0.0.1:2222"


def read_key_files(paths: Sequence[str]) -> tuple[str, ...]:
    """The public keys in ``paths`` (.pub files or authorized_keys lines); a private key
    file given by mistake is refused before anything of it leaves this process."""
    keys: list[str] = []
    for path in paths:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--ssh-key {path}: {getattr(exc, 'strerror', None) or exc}") from None
        if "PRIVATE KEY" in text:
            raise UsageError(f"--ssh-key {path}: a private key; give the public one ({path}.pub)")
        try:
            keys += parse_keys(text)
        except ValueError as exc:
            raise UsageError(f"--ssh-key {path}: {exc}") from None
    return tuple(keys)


def ssh_command(a: argparse.Namespace) -> list[str]:
    import shlex  # (here: a one-shot command imports only what it uses)

    host, sep, port = a.at.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"--at {a.at!r}: HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    user = a.name + (f"+{a.user}" if a.user else "")
    argv = [
        "ssh",
        "-p",
        port,
        # one known_hosts entry per supervisor endpoint, whatever the sandbox
        "-o",
        f"HostKeyAlias=sandvisor-{host}-{port}",
    ]
    if a.identity:
        argv += ["-i", a.identity]
    if a.tty:
        argv.append("-t")
    argv.append(f"{user}@{host}")
    cmd = trailing_command(a)
    if cmd:
        argv += ["--", shlex.join(cmd)]
    return argv


def ssh(a: argparse.Namespace) -> int:
    import shlex
    import shutil

    if a.endpoint:
        return endpoint(a)
    argv = ssh_command(a)
    if a.print:
        print(shlex.join(argv))
        return 0
    exe = shutil.which("ssh")
    if exe is None:
        raise UsageError("no ssh on PATH; the command would be: " + shlex.join(argv))
    os.execv(exe, argv)
    return 255  # (not reached)


def endpoint(a: argparse.Namespace) -> int:
    """``--endpoint``: where the supervisor serves the sandbox's SSH (its own word, not
    ``--at``): host, port, user, the host key's fingerprint and a known_hosts line."""
    from supervisor.client.cli_output import print_json

    with connect(a) as c:
        ep = c.call("SshEndpoint", {"id": a.name})
    if a.json:
        print_json(ep)
    else:
        print(f"ssh -p {ep['port']} {ep['user']}@{ep['host']}")
        print(f"host key {ep['fingerprint']}")
        print(f"known_hosts: {ep['known_hosts']}")
    return 0


def add_ssh_command(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument(
        "--at",
        default=os.environ.get("SANDVISOR_SSH", DEFAULT_AT),
        metavar="HOST:PORT",
        help=f"serve --ssh's address (default: $SANDVISOR_SSH or {DEFAULT_AT})",
    )
    p.add_argument("--user", default="", help="the guest user (default: the sandbox's)")
    p.add_argument("-i", dest="identity", metavar="KEY", help="the private key (ssh -i)")
    p.add_argument("-t", dest="tty", action="store_true", help="a terminal even with a command (ssh -t)")
    p.add_argument("--print", action="store_true", help="print the ssh command instead of running it")
    p.add_argument(
        "--endpoint", action="store_true", help="print the supervisor's SSH endpoint for it (address, user, host key)"
    )
    p.add_argument("--json", action="store_true", help="with --endpoint: as JSON")


def ssh_key(a: argparse.Namespace) -> int:
    """``add``/``rm`` NAME FILE...: one Modify; ``ls`` NAME: the keys Inspect shows."""
    if a.action == "ls":
        if a.files:
            raise UsageError("ssh-key ls takes just the sandbox's name")
        with connect(a) as c:
            keys = c.call("Inspect", {"id": a.name}).get("ssh_keys") or []
        for key in keys:
            print(key)
        return 0
    if not a.files:
        raise UsageError(f"ssh-key {a.action} needs a public key FILE")
    field = "ssh_keys_add" if a.action == "add" else "ssh_keys_remove"
    with connect(a) as c:
        r = c.call("Modify", {"id": a.name, field: list(read_key_files(a.files))})
    change = next((ch for ch in r["changes"] if ch["kind"] == "ssh_keys"), None)
    if change is not None:
        print(f"{a.name}: {change['value']} ssh key(s) ({change['status']})")
    return 0


def add_ssh_key_command(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["add", "rm", "ls"])
    p.add_argument("name")
    p.add_argument("files", nargs="*", metavar="FILE", help="public key files (.pub, authorized_keys lines)")
