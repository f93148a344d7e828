"""The docker-like client commands of the ``sandvisor`` CLI (create, run, exec, ls, ...).

Every command takes ``--socket PATH`` (default: ``$SANDVISOR_SOCKET``, else the
serve default). Human output is tables; ``--json`` output is stable. Errors are one
line on stderr: exit 2 for usage errors (bad ``K=V``, bad port), 1 for failed
operations; ``run`` and ``exec`` exit with the command's own exit code.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from contextlib import aclosing
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.live import Live
from rich.table import Table

from actors._groups import collapse_single
from supervisor.client import AsyncSandbox, connect

out = Console()


class UsageError(Exception):
    """A command-line mistake: one line, exit code 2."""


def kv(items: list[str] | None, what: str = "K=V") -> dict[str, str]:
    result = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"expected {what}, got {item!r}")
        result[k] = v
    return result


def ports(items: list[str] | None) -> dict[int, int]:
    result = {}
    for item in items or []:
        host, sep, guest = item.partition(":")
        if (
            not sep
            or not host.isdigit()
            or not guest.isdigit()
            or not 0 <= int(host) <= 65535
            or not 0 < int(guest) <= 65535
        ):
            raise UsageError(f"expected HOST:GUEST ports, got {item!r}")
        result[int(guest)] = int(host)
    return result


def _ts(unix: int) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S") if unix else "-"


def _json(obj: Any) -> None:
    def default(o: Any) -> Any:
        if isinstance(o, bytes):
            return o.decode(errors="replace")
        raise TypeError(type(o).__name__)

    print(json.dumps(obj, default=default, sort_keys=True))


def _cmd(args: argparse.Namespace) -> list[str]:
    """The command after ``--`` (split off before argparse: see cli.main)."""
    return list(getattr(args, "cmd", None) or [])


# --- commands -------------------------------------------------------------------
async def create(a: argparse.Namespace) -> int:
    status = None
    if not a.json and not a.no_wait and sys.stderr.isatty():
        status = Console(stderr=True).status(f"booting {a.name or 'a sandbox'} ...")
        status.start()
    try:
        sb = await _create(a)
    finally:
        if status is not None:
            status.stop()
    info = await sb.inspect()
    if a.json:
        _json({"id": sb.id, "state": info["state"], "ip_address": info["network"]["ip_address"]})
    else:
        print(sb.id)
    return 0


async def _create(a: argparse.Namespace) -> AsyncSandbox:
    return await AsyncSandbox.create(
        a.name,
        socket=a.socket,
        cpus=a.cpus,
        memory_mib=a.memory,
        env=kv(a.env),
        labels=kv(a.label),
        workdir=a.workdir or "",
        user=a.user or "",
        cmd=_cmd(a),
        ttl=a.ttl,
        idle_timeout=a.idle_timeout,
        network=a.network,
        outbound=a.outbound,
        egress=_egress(a),
        ports=ports(a.port),
        detached=True,
        wait=not a.no_wait,
    )


def _egress(a: argparse.Namespace) -> dict[str, Any] | None:
    if a.egress_default is None and not a.allow and not a.deny:
        return None
    return {"default": a.egress_default or "allow", "allow": a.allow or [], "deny": a.deny or []}


async def run(a: argparse.Namespace) -> int:
    cmd = _cmd(a)
    if not cmd:
        raise UsageError("run needs a command after --")
    sb = AsyncSandbox(a.name, socket=a.socket)
    code = 0
    stream = sb.run_stream(cmd, env=kv(a.env), workdir=a.workdir or "", user=a.user or "", tty=a.tty, timeout=a.timeout)
    async with aclosing(stream) as outputs:
        async for o in outputs:
            if o.stream == "stdout":
                sys.stdout.buffer.write(o.data)
                sys.stdout.buffer.flush()
            elif o.stream == "stderr":
                sys.stderr.buffer.write(o.data)
                sys.stderr.buffer.flush()
            else:
                code = o.exit_code or 0
    return code


async def exec_(a: argparse.Namespace) -> int:
    cmd = _cmd(a)
    if not cmd:
        raise UsageError("exec needs a command after --")
    sb = AsyncSandbox(a.name, socket=a.socket)
    if not a.interactive and not a.tty:
        # output only: stdin is not the process's
        with open(os.devnull, "rb") as devnull:
            return await sb.attach(cmd, tty=False, env=kv(a.env), stdin_fd=devnull.fileno())
    return await sb.attach(cmd, tty=a.tty, env=kv(a.env))


async def ls(a: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    cursor = ""
    while True:
        page = await AsyncSandbox.list(
            socket=a.socket, labels=kv(a.label), state=a.state or "", limit=100, cursor=cursor
        )
        rows += page.sandboxes
        cursor = page.next_cursor
        if not cursor:
            break
    if a.json:
        _json([{k: r[k] for k in ("id", "state", "labels", "ip_address", "created_at")} for r in rows])
        return 0
    t = Table("ID", "STATE", "LABELS", "IP", "CREATED", box=None)
    for r in rows:
        labels = ",".join(f"{k}={v}" for k, v in sorted(r["labels"].items()))
        t.add_row(r["id"], r["state"], labels, r["ip_address"] or "-", _ts(r["created_at"]))
    out.print(t)
    return 0


async def inspect(a: argparse.Namespace) -> int:
    info = await AsyncSandbox(a.name, socket=a.socket).inspect()
    if a.json:
        _json(info)
        return 0
    t = Table("FIELD", "VALUE", box=None, show_header=False)
    for k in ("id", "state", "labels", "limits", "network", "created_at", "ready_at", "last_exited_at"):
        v = info[k]
        if k.endswith("_at"):
            v = _ts(v)
        t.add_row(k, str(v))
    t.add_row("last_exit_code", str(info["last_exit_code"]))
    if info["error"]:
        t.add_row("error", info["error"])
    out.print(t)
    return 0


def _print_log(e: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _json(e)
        return
    target = sys.stderr.buffer if e["source"] == "stderr" else sys.stdout.buffer
    data = e["data"] if e["source"] != "system" else b"[system] " + e["data"] + b"\n"
    target.write(data)
    target.flush()


async def logs(a: argparse.Namespace) -> int:
    sb = AsyncSandbox(a.name, socket=a.socket)
    if a.follow:
        async with aclosing(sb.log_stream(follow=True, tail=a.tail)) as entries:
            async for e in entries:
                _print_log(e, a.json)
    else:
        for e in await sb.logs(tail=a.tail):
            _print_log(e, a.json)
    return 0


async def events(a: argparse.Namespace) -> int:
    async with connect(a.socket) as c, c.open_call("Events", {"id": a.id or "", "action": a.action or ""}) as call:
        async for e in call:
            if a.json:
                _json(e)
            else:
                attrs = " ".join(f"{k}={v}" for k, v in sorted(e["attributes"].items()))
                ts = datetime.datetime.fromtimestamp(e["timestamp"] / 1e9, datetime.UTC).isoformat()
                print(f"{ts} {e['sandbox_id']} {e['action']} {attrs}".rstrip(), flush=True)
    return 0


async def cp(a: argparse.Namespace) -> int:
    src_remote, dst_remote = ":" in a.src and not a.src.startswith("/"), ":" in a.dst and not a.dst.startswith("/")
    if src_remote == dst_remote:
        raise UsageError("exactly one of SRC and DST must be NAME:/path")
    if src_remote:
        name, _, path = a.src.partition(":")
        await AsyncSandbox(name, socket=a.socket).fs.copy_out(path, a.dst)
    else:
        name, _, path = a.dst.partition(":")
        if not Path(a.src).is_file():
            raise UsageError(f"{a.src}: no such file")
        await AsyncSandbox(name, socket=a.socket).fs.copy_in(a.src, path)
    return 0


async def simple(a: argparse.Namespace) -> int:
    sb = AsyncSandbox(a.name, socket=a.socket)
    if a.command == "stop":
        await sb.stop(a.timeout)
    elif a.command == "kill":
        await sb.kill()
    elif a.command == "rm":
        await sb.remove(force=a.force)
    elif a.command == "start":
        await sb.start()
    elif a.command == "ping":
        print(f"{await sb.ping() * 1000:.2f} ms")
    elif a.command == "touch":
        print(await sb.touch())
    return 0


def _metrics_row(t: Table, m: dict[str, Any]) -> None:
    t.add_row(
        m["id"],
        f"{m['cpu_percent']:.1f}%",
        f"{(m['memory_total_bytes'] - m['memory_available_bytes']) >> 20}/{m['memory_total_bytes'] >> 20} MiB",
        f"{m['host_rss_bytes'] >> 20} MiB",
        f"{m['disk_read_bytes'] >> 10}/{m['disk_write_bytes'] >> 10} KiB",
        f"{m['net_rx_bytes']}/{m['net_tx_bytes']}",
        f"{m['uptime_seconds']:.0f}s",
    )


def _metrics_table() -> Table:
    return Table("ID", "CPU", "MEM", "HOST RSS", "DISK R/W", "NET RX/TX", "UP", box=None)


async def metrics(a: argparse.Namespace) -> int:
    sb = AsyncSandbox(a.name, socket=a.socket)

    def show(m: dict[str, Any]) -> None:
        if a.json:
            _json(m)
        else:
            t = _metrics_table()
            _metrics_row(t, m)
            out.print(t)

    if not a.watch:
        show(await sb.metrics())
        return 0
    async with aclosing(sb.metrics_stream(1.0)) as samples:
        async for m in samples:
            show(m)
    return 0


async def top(a: argparse.Namespace) -> int:
    with Live(_metrics_table(), console=out, refresh_per_second=2) as live:
        while True:
            async with connect(a.socket) as c:
                every = await c.call("MetricsAll", {})
            t = _metrics_table()
            for m in every["sandboxes"]:
                _metrics_row(t, m)
            live.update(t)
            await trio.sleep(1.0)


async def port(a: argparse.Namespace) -> int:
    proto = "udp" if a.udp else "tcp"
    if a.action == "ls":
        async with connect(a.socket) as c:
            mappings = (await c.call("ListPorts", {"id": a.name}))["ports"]
        if a.json:
            _json(mappings)
            return 0
        t = Table("SANDBOX PORT", "HOST", "PROTOCOL", box=None)
        for m in mappings:
            t.add_row(str(m["sandbox_port"]), f"{m['host_address']}:{m['host_port']}", m["protocol"])
        out.print(t)
        return 0
    if a.sandbox_port is None:
        raise UsageError(f"port {a.action} needs SANDBOX_PORT")
    async with connect(a.socket) as c:
        if a.action == "add":
            r = await c.call(
                "ExposePort",
                {"id": a.name, "sandbox_port": a.sandbox_port, "host_port": a.host_port, "protocol": proto},
            )
            print(r["host_port"])
        else:
            await c.call("UnexposePort", {"id": a.name, "sandbox_port": a.sandbox_port, "protocol": proto})
    return 0


async def checkpoint(a: argparse.Namespace) -> int:
    async with connect(a.socket) as c:
        r = await c.call("Checkpoint", {"sandbox_id": a.name, "name": a.snapshot_name or "", "labels": kv(a.label)})
    _json(r) if a.json else print(r["snapshot_id"])
    return 0


async def restore(a: argparse.Namespace) -> int:
    async with connect(a.socket) as c:
        r = await c.call(
            "Restore",
            {
                "snapshot_id": a.snapshot,
                "id": a.new_name or "",
                "labels": kv(a.label),
                "ttl_seconds": a.ttl,
                "network_override": a.network_override,
            },
        )
    _json(r) if a.json else print(r["id"])
    return 0


async def snapshots(a: argparse.Namespace) -> int:
    async with connect(a.socket) as c:
        if getattr(a, "snapshot_id", None):
            await c.call("DeleteSnapshot", {"snapshot_id": a.snapshot_id})
            return 0
        r = await c.call("ListSnapshots", {"sandbox_id": a.sandbox or "", "labels": kv(a.label)})
    if a.json:
        _json(r["snapshots"])
        return 0
    t = Table("ID", "NAME", "SANDBOX", "MEMORY", "SIZE", "POOL", "CREATED", box=None)
    for x in r["snapshots"]:
        t.add_row(
            x["id"],
            x["name"],
            x["sandbox_id"],
            x.get("memory", ""),
            f"{x.get('size_bytes', 0) / 2**20:.0f} MiB",
            str(x.get("pool_ready", 0)),
            x["created_at"],
        )
    out.print(t)
    return 0


# --- parser ------------------------------------------------------------------------
def add_client_commands(sub: Any) -> None:
    def cmd(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help)
        p.add_argument("--socket", default=os.environ.get("SANDVISOR_SOCKET"), help="supervisor socket")
        p.set_defaults(client=fn)
        return p

    p = cmd("create", create, "create a sandbox (waits until ready unless --no-wait)")
    p.add_argument("name")
    p.add_argument("--cpus", type=int, default=0)
    p.add_argument("--memory", type=int, default=0, metavar="MIB")
    p.add_argument("--env", action="append", metavar="K=V")
    p.add_argument("--label", action="append", metavar="K=V")
    p.add_argument("--ttl", type=int, default=0, metavar="S")
    p.add_argument("--idle-timeout", type=int, default=0, metavar="S")
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
    p.add_argument("--port", action="append", metavar="HOST:GUEST")
    p.add_argument("--workdir")
    p.add_argument("--user")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--json", action="store_true")

    p = cmd("run", run, "run a command as the sandbox's workload, streaming its output")
    p.add_argument("name")
    p.add_argument("--env", action="append", metavar="K=V")
    p.add_argument("--workdir")
    p.add_argument("--user")
    p.add_argument("--timeout", type=int, default=0, metavar="S")
    p.add_argument("-t", "--tty", action="store_true")

    p = cmd("exec", exec_, "run an interactive command (-it for a terminal session)")
    p.add_argument("-i", "--interactive", action="store_true")
    p.add_argument("-t", "--tty", action="store_true")
    p.add_argument("--env", action="append", metavar="K=V")
    p.add_argument("name")

    p = cmd("ls", ls, "list sandboxes")
    p.add_argument("--state")
    p.add_argument("--label", action="append", metavar="K=V")
    p.add_argument("--json", action="store_true")

    p = cmd("inspect", inspect, "every field of a sandbox")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")

    p = cmd("logs", logs, "a sandbox's persisted output")
    p.add_argument("name")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--tail", type=int, default=0)
    p.add_argument("--json", action="store_true")

    p = cmd("events", events, "lifecycle events as they happen")
    p.add_argument("--id")
    p.add_argument("--action")
    p.add_argument("--json", action="store_true")

    p = cmd("cp", cp, "copy a file in or out: one side is NAME:/path")
    p.add_argument("src")
    p.add_argument("dst")

    for name, help in (
        ("stop", "stop gracefully"),
        ("kill", "stop at once"),
        ("rm", "remove"),
        ("start", "boot a stopped sandbox again"),
        ("ping", "round trip to the guest agent"),
        ("touch", "count as activity (idle timeout)"),
    ):
        p = cmd(name, simple, help)
        p.add_argument("name")
        if name == "stop":
            p.add_argument("--timeout", type=int, default=0, metavar="S")
        if name == "rm":
            p.add_argument("-f", "--force", action="store_true")

    p = cmd("metrics", metrics, "resource use of a sandbox")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true")

    cmd("top", top, "live table of every sandbox")

    p = cmd("checkpoint", checkpoint, "snapshot a ready sandbox (prints the snapshot id)")
    p.add_argument("name")
    p.add_argument("--name", dest="snapshot_name", metavar="N")
    p.add_argument("--label", action="append", metavar="K=V")
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

    p = cmd("snapshot", snapshots, "snapshot rm ID")
    p.add_argument("action", choices=["rm"])
    p.add_argument("snapshot_id")
    p.set_defaults(json=False, sandbox=None, label=None)

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
    p.add_argument("--json", action="store_true")


def run_client(args: argparse.Namespace) -> int:
    with collapse_single():  # one error leaves as itself, for a one-line message
        return int(trio.run(args.client, args))
