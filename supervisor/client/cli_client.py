"""The docker-like client commands of the ``sandvisor`` CLI (create, run, exec, ls, ...).

Every command takes ``--socket PATH`` (default: ``$SANDVISOR_SOCKET``, else the
serve default). Human output is tables; ``--json`` output is stable. Errors are one
line on stderr: exit 2 for usage errors (bad ``K=V``, bad port), 1 for failed
operations; ``run`` and ``exec`` exit with the command's own exit code.

One-shot commands are quick (benchmarks/control.py): a command that is one call or one server
stream (run, ls, inspect, logs, events, stop, kill, rm, ping, touch, metrics, top,
checkpoint, restore, snapshots, port) speaks the protocol over a plain blocking
socket (:class:`supervisor.wire.frames.BlockingConnection`, bodies as the wire's maps):
no event loop, no converter. Tables are printed as rich would print them, by
:func:`print_table`, which imports rich only for what it cannot match. The commands
that need concurrency (create and start wait for readiness, exec pumps a terminal,
cp streams files) use the Trio SDK, imported when they run. Measured on this machine
(``benchmarks/control.py``): ``import supervisor.main.cli`` went from ~270 ms to ~10 ms.
"""

from __future__ import annotations

import argparse
import os

from supervisor.client.cli_code import add_run_code_command, run_code
from supervisor.client.cli_common import tls_flag, unix_ns
from supervisor.client.cli_family import diff, fork, tree
from supervisor.client.cli_files import add_fs_command, fs
from supervisor.client.cli_readback import add_config_command, config
from supervisor.client.cli_sandboxes import (
    attach,
    cp,
    create,
    events,
    exec_,
    inspect,
    logs,
    ls,
    metrics,
    modify,
    port,
    run,
    shell,
    simple,
    status,
    top,
    wait,
)
from supervisor.client.cli_secrets import secret
from supervisor.client.cli_ssh import add_ssh_command, add_ssh_key_command, ssh, ssh_key
from supervisor.client.cli_stores import checkpoint, restore, snapshot, snapshots, volume

DEFAULT_DETACH_KEYS = "ctrl-p,ctrl-q"  # the SDK's (supervisor.client.sdk.detach), not imported: a quick start
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms; mypy reads the name)
if TYPE_CHECKING:
    from typing import Any


CLIENT_COMMANDS = frozenset(
    {
        "create",
        "config",
        "ssh",
        "ssh-key",
        "run",
        "exec",
        "shell",
        "attach",
        "ls",
        "inspect",
        "modify",
        "logs",
        "events",
        "cp",
        "stop",
        "kill",
        "drain",
        "wait",
        "rm",
        "start",
        "pause",
        "resume",
        "ping",
        "touch",
        "ttl",
        "metrics",
        "top",
        "status",
        "checkpoint",
        "restore",
        "fork",
        "tree",
        "diff",
        "snapshots",
        "snapshot",
        "port",
        "volume",
        "fs",
        "secret",
        "run-code",
    }
)


class _Undefined:
    """Stands in for the parser of a command that is not being defined."""

    def add_argument(self, *args: Any, **kw: Any) -> None:
        pass

    def set_defaults(self, **kw: Any) -> None:
        pass


def add_client_commands(sub: Any, only: str | None = None) -> None:
    """The client commands' parsers; ``only``: just that one (a one-shot command parses
    one command line, and argparse takes ~8 ms to define all of them: measured)."""

    def cmd(name: str, fn: Any, help: str) -> Any:
        if only is not None and name != only:
            return _Undefined()
        p: argparse.ArgumentParser = sub.add_parser(name, help=help)
        p.add_argument("--socket", default=os.environ.get("SANDVISOR_SOCKET"), help="supervisor socket")
        p.set_defaults(client=fn)
        return p

    p = cmd("create", create, "create a sandbox (waits until ready unless --no-wait)")
    p.add_argument("name")
    p.add_argument("--cpus", type=int, default=0)
    p.add_argument("--memory", type=int, default=0, metavar="MIB")
    p.add_argument("--max-cpus", type=int, default=0, metavar="N", help="ceiling: modify --cpus up to it, live")
    p.add_argument("--max-memory", type=int, default=0, metavar="MIB", help="ceiling: modify --memory up to it, live")
    p.add_argument("--disk-size", metavar="SIZE", help="the root disk's size (4G, 8192M; default: the image's)")
    p.add_argument("--env", action="append", metavar="K=V")
    p.add_argument("--label", action="append", metavar="K=V")
    p.add_argument("--ttl", type=int, default=0, metavar="S", help="its maximum duration (then --ttl-action)")
    p.add_argument(
        "--ttl-action",
        choices=["stop", "remove"],
        default="stop",
        help="what the TTL does: stop (drain, then stop; from each start) or remove (from creation)",
    )
    p.add_argument("--kill-timeout", type=int, default=0, metavar="S", help="how long kill waits to see it stopped")
    p.add_argument(
        "--replace", action="store_true", help="replace a sandbox of that name (stopped: 10 s grace, then killed)"
    )
    p.add_argument("--replace-timeout", type=float, metavar="S", help="--replace with this grace (0: killed at once)")
    p.add_argument("--idle-timeout", type=int, default=0, metavar="S")
    p.add_argument(
        "--on-idle", choices=["stop", "pause"], default="stop", help="what the idle timeout does (pause: hibernate)"
    )
    p.add_argument("--paused-ttl", type=int, default=0, metavar="S", help="remove it after S seconds paused")
    p.add_argument(
        "--no-auto-resume",
        dest="auto_resume",
        action="store_false",
        help="a paused sandbox refuses calls (FAILED_PRECONDITION) until resumed",
    )
    p.add_argument(
        "--network",
        choices=["none", "tap", "user", "outbound"],
        default="none",
        help="tap: an address of the IP pool; user: exposed ports only; outbound: user mode that may reach out",
    )
    p.add_argument("--outbound", action="store_true", help="user mode that may reach out (= --network outbound)")
    p.add_argument("--egress-default", choices=["allow", "deny"], help="what no --allow/--deny entry matches")
    p.add_argument("--allow", action="append", metavar="ENTRY", help="CIDR, host:port or domain (repeatable)")
    p.add_argument("--deny", action="append", metavar="ENTRY", help="CIDR, host:port or domain (repeatable)")
    p.add_argument(
        "--port",
        action="append",
        metavar="[ADDR:]HOST:GUEST[/udp]",
        help="expose a sandbox port (HOST 0: any free one; ADDR: loopback or what serve --port-address allows; "
        "repeatable)",
    )
    p.add_argument("--port-address", metavar="ADDR", help="the host address every --port listens on")
    p.add_argument(
        "--network-profile",
        metavar="NAME",
        help="public, private, none, or one of serve --network-profiles: its egress rules (no --allow/--deny)",
    )
    p.add_argument("--dns", action="append", metavar="IPV4", help="a nameserver the guest's resolv.conf names")
    p.add_argument("--dns-search", action="append", metavar="DOMAIN", help="a search domain of the guest")
    p.add_argument(
        "--volume", action="append", metavar="NAME:/path[:ro]", help="mount a named volume (sandvisor volume create)"
    )
    p.add_argument("--script", action="append", metavar="NAME=FILE", help="a named script (run it: run --script NAME)")
    p.add_argument("--tmpfs", action="append", metavar="/path[:SIZE]", help="a tmpfs, e.g. /scratch:64M (guest RAM)")
    p.add_argument(
        "--mount",
        action="append",
        metavar="HOST_DIR:/path[:ro|rw]",
        help="a host directory under serve --allow-path (read-only unless :rw)",
    )
    p.add_argument(
        "--secret",
        action="append",
        metavar="NAME=SRC@HOSTS[;substitute=all]",
        help="a secret the guest holds a placeholder of: SRC env:VAR, value:LITERAL or store:NAME; "
        "HOSTS a,b,*.c[:port]; ;substitute=all: in the URL and body too, not only the headers "
        "(repeatable; docs/secrets.md)",
    )
    p.add_argument(
        "--ssh-key",
        action="append",
        metavar="FILE",
        help="a public key file (.pub, or authorized_keys lines) that serve --ssh accepts for this sandbox "
        "(repeatable; docs/ssh.md)",
    )
    p.add_argument(
        "--init",
        metavar="auto|PATH",
        help="hand PID 1 to the image's init after the agent's set-up (auto: the ENTRYPOINT's init, "
        "else /sbin/init, /lib/systemd/systemd; or a path in the guest); stop goes through its shutdown",
    )
    p.add_argument("--workdir")
    p.add_argument("--user")
    p.add_argument(
        "--image",
        metavar="REF",
        help="an OCI image (alpine, python:3.12, ghcr.io/o/x:1, oci:DIR, ...), or a root filesystem directory "
        "(./rootfs, /abs/dir, dir:PATH; under serve --allow-path)",
    )
    p.add_argument(
        "--registry-creds-file", metavar="FILE", help="the image registry's USER:PASSWORD, from FILE (- : stdin)"
    )
    p.add_argument("--registry-authfile", metavar="FILE", help="the image registry's docker-style auth file")
    p.add_argument("--registry-ca", metavar="PEM", help="CA certificates for the image registry")
    p.add_argument("--pull", choices=["always", "if-missing", "never"], help="the image's pull policy")
    p.add_argument(
        "--image-disk",
        metavar="PATH[:FSTYPE]",
        help="a disk image of your own as the root (raw, qcow2, vmdk, vdi, vhdx, vpc; FSTYPE default ext4; "
        "under serve --allow-path; docs/images.md)",
    )
    p.add_argument(
        "--from-snapshot",
        metavar="SNAPSHOT",
        help="start from a snapshot (id, name, or an exported snapshot file: a path with a '/'), "
        "with the other options applied where a restore can (docs/snapshots.md)",
    )
    p.add_argument("--tls-verify", type=tls_flag, default=True, metavar="BOOL", help="false: a plain-HTTP registry")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--json", action="store_true")
    # workload shape and copy patches (supervisor/client/cli_sandboxes.py shape_settings)
    p.add_argument(
        "--entrypoint",
        metavar="ARGV",
        help="replace the image's ENTRYPOINT (split as a shell would; '' for none); drops its CMD",
    )
    p.add_argument("--no-cmd", action="store_true", help="clear the image's CMD (its ENTRYPOINT runs alone)")
    p.add_argument("--shell", metavar="PATH", help="what shell runs when the call names none (default /bin/sh)")
    p.add_argument(
        "--security-profile",
        choices=["default", "restricted"],
        help="restricted: every exec with no_new_privs (setuid bits give nothing), writable mounts nosuid,nodev",
    )
    p.add_argument(
        "--log-level",
        choices=["trace", "debug", "info", "warn", "error", "off"],
        help="the guest agent's diagnostics and the supervisor's lines about this sandbox",
    )
    p.add_argument("--quiet-logs", action="store_true", help="none of them (as --log-level off)")
    p.add_argument("--thp", choices=["always", "madvise", "never"], help="the guest's transparent huge page policy")
    p.add_argument(
        "--copy-file",
        action="append",
        metavar="HOST_FILE:/path",
        help="a host file under serve --allow-path, copied in before ready (read by the supervisor)",
    )
    p.add_argument(
        "--copy-dir",
        action="append",
        metavar="HOST_DIR:/path",
        help="a host directory tree under serve --allow-path, copied in before ready (symlinks as links)",
    )
    p.add_argument(
        "--from-config",
        metavar="FILE",
        help="the settings of `sandvisor config NAME` (- : stdin); flags given here go on top",
    )

    add_config_command(
        cmd("config", config, "a sandbox's whole configuration, as JSON that create --from-config takes")
    )

    p = cmd("run", run, "run a command as the sandbox's workload, streaming its output")
    p.add_argument("name")
    p.add_argument("--env", action="append", metavar="K=V")
    p.add_argument("--workdir")
    p.add_argument("--user")
    p.add_argument("--timeout", type=int, default=0, metavar="S")
    p.add_argument("-t", "--tty", action="store_true")
    p.add_argument("--script", metavar="NAME", help="run a named script of the sandbox (args after --)")

    p = cmd("exec", exec_, "run an interactive command (-it for a terminal session)")
    p.add_argument("-i", "--interactive", action="store_true")
    p.add_argument("-t", "--tty", action="store_true")
    p.add_argument("--env", action="append", metavar="K=V")
    p.add_argument("--workdir", help="the directory it runs in (default: the sandbox's)")
    p.add_argument("--user", help="the user it runs as, a name or uid (default: the sandbox's)")
    p.add_argument("name")
    detach_keys = (
        "with -t: keys that leave the session running (docker's syntax; '' : none); attach NAME SESSION goes back"
    )
    p.add_argument("--detach-keys", default=DEFAULT_DETACH_KEYS, metavar="KEYS", help=detach_keys)

    p = cmd("attach", attach, "back to a detached exec session (its output since the detach first)")
    p.add_argument("name")
    p.add_argument("session", type=int, metavar="SESSION", help="the session id exec printed at the detach")
    p.add_argument("--detach-keys", default=DEFAULT_DETACH_KEYS, metavar="KEYS", help=detach_keys)

    p = cmd("shell", shell, "an interactive shell in the sandbox (its create --shell, else /bin/sh)")
    p.add_argument("--shell", help="this shell instead (a path, or a name on the sandbox's PATH)")
    p.add_argument("name")

    p = cmd("ls", ls, "list sandboxes")
    p.add_argument("--state")
    p.add_argument("--ancestor", metavar="NAME", help="only the forks of NAME, and theirs")
    p.add_argument("--label", action="append", metavar="K=V")
    p.add_argument("--json", action="store_true")

    p = cmd("inspect", inspect, "every field of a sandbox")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")

    p = cmd("modify", modify, "change a sandbox (live below its ceilings); prints the plan (docs/modify.md)")
    p.add_argument("name")
    p.add_argument("--cpus", type=int, metavar="N")
    p.add_argument("--memory", type=int, metavar="MIB")
    p.add_argument("--disk-size", metavar="SIZE", help="grow the root disk (a stopped sandbox, or with --restart)")
    p.add_argument("--env", action="append", metavar="K=V", help="merged into its env (future runs and execs)")
    p.add_argument("--workdir")
    p.add_argument("--label", action="append", metavar="K=V", help="merged into its labels (K= removes K)")
    p.add_argument("--ttl", type=int, metavar="S")
    p.add_argument("--idle-timeout", type=int, metavar="S")
    p.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    p.add_argument("--restart", action="store_true", help="a change above a ceiling restarts the sandbox")
    p.add_argument("--env-remove", action="append", metavar="K", help="take K out of its env (repeatable)")
    p.add_argument("--max-cpus", type=int, metavar="N", help="the vCPU ceiling (a running sandbox: restart)")
    p.add_argument("--max-memory", type=int, metavar="MIB", help="the memory ceiling (a running sandbox: restart)")
    p.add_argument(
        "--policy",
        choices=["no_restart", "restart", "next_start"],
        help="next_start: save everything for the next start, the running sandbox unchanged",
    )
    p.add_argument(
        "--secret",
        action="append",
        metavar="NAME=SRC@HOSTS",
        help="add a secret (create's form), or give one another source and hosts",
    )
    p.add_argument("--secret-hosts", action="append", metavar="NAME=H[,H...]", help="re-host a secret")
    p.add_argument("--secret-placeholder", action="append", metavar="NAME=P", help="a secret's new placeholder")
    p.add_argument("--json", action="store_true")

    p = cmd("logs", logs, "a sandbox's persisted output")
    p.add_argument("name")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--tail", type=int, default=0)
    p.add_argument(
        "--source",
        action="append",
        choices=["stdout", "stderr", "output", "system"],
        help="only this source's entries (repeatable; default: all)",
    )
    p.add_argument(
        "--since",
        type=unix_ns,
        default=0,
        metavar="TIME",
        help="from this time (unix ns, or ISO 8601: 2026-01-02T03:04:05Z)",
    )
    p.add_argument(
        "--until",
        type=unix_ns,
        default=0,
        metavar="TIME",
        help="up to this time, as --since; with -f the stream ends there",
    )
    p.add_argument("--cursor", type=int, default=0, metavar="SEQ", help="after the entry of this seq (--json shows it)")
    p.add_argument("--json", action="store_true")

    p = cmd("events", events, "lifecycle events as they happen (each with its cursor)")
    p.add_argument("--id")
    p.add_argument("--action")
    p.add_argument(
        "--since",
        type=int,
        default=None,
        metavar="CURSOR",
        help="first the events after this cursor (from the supervisor's event log), then the live ones: "
        "resume after a disconnect with the last cursor seen (0: every event the log keeps)",
    )
    p.add_argument("-f", "--follow", action="store_true", help="go on with the live events (the default)")
    p.add_argument("--json", action="store_true")

    p = cmd("cp", cp, "copy a file (or with -r a directory tree) in or out: one side is NAME:/path")
    p.add_argument("-r", "--recursive", action="store_true", help="a directory tree, as one tar stream")
    p.add_argument(
        "-a",
        "--archive",
        action="store_true",
        help="keep numeric owners (in: the host's; out: the guest's, and modes unmasked by the umask, as root);"
        " out, directories already at DST keep their own",
    )
    p.add_argument("--owner", default="root", help="-r in: USER[:GROUP] in the guest that owns every entry")
    p.add_argument("src")
    p.add_argument("dst", help="out: a directory (or link to one) gets the file by name; a link at DST is replaced")

    for name, help in (
        ("stop", "stop gracefully"),
        ("kill", "stop at once"),
        ("drain", "refuse new execs and runs; those in flight get --grace, then it stops"),
        ("rm", "remove"),
        ("start", "boot a stopped sandbox again"),
        ("ping", "round trip to the guest agent"),
        ("touch", "count as activity (idle timeout)"),
        ("pause", "hibernate to disk (no QEMU, no RAM; resumes as itself)"),
        ("resume", "bring a paused sandbox back"),
    ):
        p = cmd(name, simple, help)
        p.add_argument("names", nargs="+", metavar="NAME")
        if name == "stop":
            p.add_argument("--timeout", type=int, default=0, metavar="S")
        if name == "kill":
            p.add_argument("--timeout", type=int, default=0, metavar="S", help="how long to wait to see it stopped")
        if name == "drain":
            p.add_argument("--grace", type=int, default=0, metavar="S", help="0: as long as they take")
        if name == "rm":
            p.add_argument("-f", "--force", action="store_true")
            p.add_argument("--with-descendants", action="store_true", help="its forks too, and theirs")

    p = cmd("wait", wait, "wait until a sandbox stops; print how it ended, exit with its code")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")

    p = cmd("ttl", simple, "end a sandbox's TTL SECONDS from now (0: never): removed, or drained and stopped")
    p.add_argument("names", nargs=1, metavar="NAME")
    p.add_argument("seconds", type=int, metavar="SECONDS")

    p = cmd("metrics", metrics, "resource use of a sandbox")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true")

    cmd("top", top, "live table of every sandbox")

    p = cmd("status", status, "whether the supervisor answers (--wait S: until it does)")
    p.add_argument("--wait", type=float, default=0, metavar="S", help="keep trying for up to S seconds")
    p.add_argument("--json", action="store_true")

    p = cmd("checkpoint", checkpoint, "snapshot a sandbox: ready, disk and memory; stopped, its disk (prints the id)")
    p.add_argument("name")
    p.add_argument("--name", dest="snapshot_name", metavar="N")
    p.add_argument("--label", action="append", metavar="K=V")
    p.add_argument("--json", action="store_true")

    p = cmd("fork", fork, "children of a running sandbox: it pauses once and runs on (prints their ids)")
    p.add_argument("name")
    p.add_argument("-n", type=int, default=1, metavar="N", help="how many (default 1, at most 100)")
    p.add_argument("--name-prefix", metavar="P", help="name them P1, P2, ...")
    p.add_argument("--label", action="append", metavar="K=V")
    p.add_argument("--json", action="store_true")

    p = cmd("tree", tree, "the family of forks: state, age, memory (NAME: its tree only)")
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true")

    p = cmd(
        "diff",
        diff,
        "paths added (A), removed (D), modified (M) from NAME to OTHER, or from NAME's fork point "
        "(--fork-point) or a snapshot (--snapshot) to NAME (exit 1: they differ)",
    )
    p.add_argument("name")
    p.add_argument("other", nargs="?", help="the other sandbox")
    p.add_argument("--fork-point", action="store_true", help="compare with the snapshot NAME was forked from")
    p.add_argument("--snapshot", metavar="SNAP", help="compare with this snapshot (id or name)")
    p.add_argument("--path", default="/", help="the directory compared (default /, its file system only)")
    p.add_argument("--content", metavar="PATH", help="both sides of one file instead")
    p.add_argument("--json", action="store_true")

    p = cmd("restore", restore, "a new sandbox from a snapshot (prints its id)")
    p.add_argument("snapshot")
    p.add_argument("--name", dest="new_name", metavar="NEW")
    p.add_argument("--ttl", type=int, default=0, metavar="S")
    p.add_argument("--label", action="append", metavar="K=V")
    p.add_argument(
        "--network-override", action="store_true", help="tap: a fresh address even if the snapshot's is free"
    )
    p.add_argument("--json", action="store_true")

    p = cmd("snapshots", snapshots, "list snapshots")
    p.add_argument("--sandbox", metavar="ID", help="only those taken of this sandbox")
    p.add_argument("--label", action="append", metavar="K=V")
    p.add_argument("--json", action="store_true")

    p = cmd("volume", volume, "named volumes: volume create NAME --size 256M | ls | inspect NAME | rm NAME...")
    p.add_argument("action", choices=["create", "ls", "inspect", "rm"])
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--size", default="256M", help="create: 256M, 1G, ...")
    p.add_argument("--label", action="append", metavar="K=V")
    p.add_argument("-f", "--force", action="store_true", help="rm: kill the sandboxes that mount it first")
    p.add_argument("--json", action="store_true")

    p = cmd(
        "snapshot", snapshot, "snapshot rm ID | inspect ID | export ID FILE | import FILE [--name N] (FILE -: a pipe)"
    )
    p.add_argument("action", choices=["rm", "inspect", "export", "import"])
    p.add_argument("snapshot_id", metavar="ID|FILE")
    p.add_argument("file", nargs="?", metavar="FILE")
    p.add_argument("--name", dest="snapshot_name", metavar="N", help="import: under this name (default: the export's)")
    p.add_argument("--label", action="append", metavar="K=V", help="import: added to the export's labels")
    p.add_argument("--include-base", action="store_true", help="export: carry the image's root filesystem too")
    p.add_argument("--json", action="store_true")
    p.set_defaults(sandbox=None)

    p = cmd(
        "port",
        port,
        "port add NAME SANDBOX_PORT [--host-port P] [--udp] | port rm NAME SANDBOX_PORT [--udp] | port ls NAME",
    )
    p.add_argument("action", choices=["add", "rm", "ls"])
    p.add_argument("name")
    p.add_argument("sandbox_port", type=int, nargs="?")
    p.add_argument("--host-port", type=int, default=0)
    p.add_argument("--udp", action="store_true")
    p.add_argument("--address", default="", metavar="ADDR", help="host address to listen on (add)")
    p.add_argument("--json", action="store_true")

    p = cmd("ssh", ssh, "ssh to a sandbox through serve --ssh (the system's ssh; docs/ssh.md)")
    add_ssh_command(p)
    p = cmd("ssh-key", ssh_key, "the SSH keys a sandbox accepts: ssh-key add|rm NAME FILE... | ls NAME")
    add_ssh_key_command(p)
    p = cmd("fs", fs, "files of a sandbox: fs ls|stat|exists|mkdir [-p]|rm [-r]|mv NAME:/path [DEST]")
    add_fs_command(p)
    p = cmd(
        "secret",
        secret,
        "secrets: secret set NAME [--hosts H,...] (value on stdin) | ls [--sandbox ID] | rm NAME... | "
        "rotate SANDBOX NAME (value on stdin) | revoke SANDBOX NAME",
    )
    p.add_argument("action", choices=["set", "ls", "rm", "rotate", "revoke"])
    p.add_argument("args", nargs="*", metavar="ARG")
    p.add_argument("--sandbox", metavar="ID", help="ls: that sandbox's secrets (names, hosts, placeholders)")
    p.add_argument(
        "--hosts",
        metavar="H,...",
        default="",
        help="set: the hosts the entry's value may go to (a,b,*.c[:port]; a sandbox's secret may narrow them, "
        "never widen them); required for a new entry, else the entry keeps its own",
    )
    p.add_argument("--json", action="store_true")

    p = cmd("run-code", run_code, "a cell in a Jupyter kernel of the sandbox; images written to --out-dir")
    add_run_code_command(p)


def run_client(args: argparse.Namespace) -> int:
    return int(args.client(args))
