"""The docker-like client commands of the ``sandvisor`` CLI (create, run, exec, ls, ...).

Every command takes ``--socket PATH`` (default: ``$SANDVISOR_SOCKET``, else the
serve default). Human output is tables; ``--json`` output is stable. Errors are one
line on stderr: exit 2 for usage errors (bad ``K=V``, bad port), 1 for failed
operations; ``run`` and ``exec`` exit with the command's own exit code.

One-shot commands are quick (issue 14): a command that is one call or one server
stream (run, ls, inspect, logs, events, stop, kill, rm, ping, touch, metrics, top,
checkpoint, restore, snapshots, port) speaks the protocol over a plain blocking
socket (:class:`supervisor.frames.BlockingConnection`, bodies as the wire's maps):
no event loop, no converter. Tables are printed as rich would print them, by
:func:`print_table`, which imports rich only for what it cannot match. The commands
that need concurrency (create and start wait for readiness, exec pumps a terminal,
cp streams files) use the Trio SDK, imported when they run. Measured on this machine
(``benchmarks/control.py``): ``import supervisor.cli`` went from ~270 ms to ~10 ms.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from supervisor.frames import BlockingConnection

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms; mypy reads the name)
if TYPE_CHECKING:
    from typing import Any, Literal

    from supervisor.client import AsyncSandbox


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
    import datetime

    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S") if unix else "-"


def _json(obj: Any) -> None:
    import json

    def default(o: Any) -> Any:
        if isinstance(o, bytes):
            return o.decode(errors="replace")
        raise TypeError(type(o).__name__)

    print(json.dumps(obj, default=default, sort_keys=True))


def _cmd(args: argparse.Namespace) -> list[str]:
    """The command after ``--`` (split off before argparse: see cli.main)."""
    return list(getattr(args, "cmd", None) or [])


@contextmanager
def _conn(a: argparse.Namespace) -> Iterator[BlockingConnection]:
    with BlockingConnection.open(a.socket) as c:
        yield c


def configure_logging(verbose: bool) -> None:
    import logging

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def _on_trio(fn: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]) -> Callable[[argparse.Namespace], int]:
    """A command written against the Trio SDK, run in its own event loop."""

    def run(a: argparse.Namespace) -> int:
        import trio

        configure_logging(getattr(a, "verbose", False))

        from supervisor.errors import collapse_single

        with collapse_single():  # one error leaves as itself, for a one-line message
            return int(trio.run(fn, a))

    run.__name__ = run.__qualname__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


# --- tables ------------------------------------------------------------------------
# print_table prints what rich's Console().print(Table(*headers, box=None)) prints, byte
# for byte, without importing rich (~25 ms): cells padded by one space each side, the
# header bold on a terminal. Where rich would do more (markup, emoji codes, wide or
# control characters, a table wider than the console, colour forced by the
# environment) it hands the table to rich. tests/test_frames.py holds it to rich.
_EMOJI = re.compile(r"(:(\S*?)(?:(?:\-)(emoji|text))?:)")  # rich's emoji-code pattern
_PLAIN = re.compile(r"[\x20-\x5a\x5c-\x7e]*")  # printable ASCII without "[" (rich's markup)
_BOLD, _RESET = "\x1b[1m", "\x1b[0m"


def _console() -> tuple[bool, int] | None:
    """(is a terminal, width) as rich's Console would find them; None where rich's
    environment switches (forced colour, TTY_COMPATIBLE, NO_COLOR, a dumb terminal)
    decide: rich then prints the table."""
    env = os.environ
    if any(k in env for k in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR")):
        return None
    try:
        terminal = sys.stdout.isatty()
    except ValueError:
        terminal = False
    if terminal and env.get("TERM", "").lower() in ("dumb", "unknown"):
        return None
    width = None
    for fd in (0, 1, 2):  # rich asks stdin, stdout, stderr in this order
        try:
            width, _ = os.get_terminal_size(fd)
        except (AttributeError, ValueError, OSError):
            continue
        break
    columns = env.get("COLUMNS")
    if columns is not None and columns.isdigit():
        width = int(columns)
    return terminal, width or 80


def _plain(cell: str) -> bool:
    if not _PLAIN.fullmatch(cell):
        return False
    return all(m.group(3) is None and re.fullmatch(r"\d{0,2}", m.group(2)) for m in _EMOJI.finditer(cell))


def plain_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, show_header: bool, terminal: bool, width: int
) -> str | None:
    """The text rich prints for ``Table(*headers, box=None, show_header=...)`` on a
    console of ``width`` columns, or None where rich would render more than padding."""
    cells = ([list(headers)] if show_header else []) + [list(r) for r in rows]
    if not cells or any(len(r) != len(headers) or not all(_plain(c) for c in r) for r in cells):
        return None
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if sum(widths) + 2 * len(widths) > width or 0 in widths:
        return None
    lines = []
    for n, row in enumerate(cells):
        if n == 0 and show_header and terminal:
            lines.append(
                "".join(
                    f"{_BOLD} {_RESET}{_BOLD}{c.ljust(w)}{_RESET}{_BOLD} {_RESET}"
                    for c, w in zip(row, widths, strict=True)
                )
            )
        else:
            lines.append("".join(f" {c.ljust(w)} " for c, w in zip(row, widths, strict=True)))
    return "".join(line + "\n" for line in lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, show_header: bool = True) -> None:
    console = _console()
    text = None
    if console is not None:
        text = plain_table(headers, rows, show_header=show_header, terminal=console[0], width=console[1])
    if text is None:
        from rich.console import Console

        Console().print(_rich_table(headers, rows, show_header=show_header))
        return
    sys.stdout.write(text)
    sys.stdout.flush()


def _rich_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, show_header: bool = True) -> Any:
    from rich.table import Table

    t = Table(*headers, box=None, show_header=show_header)
    for r in rows:
        t.add_row(*r)
    return t


# --- commands -------------------------------------------------------------------
@_on_trio
async def create(a: argparse.Namespace) -> int:
    status = None
    if not a.json and not a.no_wait and sys.stderr.isatty():
        from rich.console import Console

        status = Console(stderr=True).status(f"booting {a.name or 'a sandbox'} ...")
        status.start()
    try:
        sb = await _create(a)
    finally:
        if status is not None:
            status.stop()
    info = await sb.inspect()
    if a.json:
        _json({"id": sb.id, "state": info.state, "ip_address": info.network.ip_address})
    else:
        print(sb.id)
    return 0


async def _create(a: argparse.Namespace) -> AsyncSandbox:
    from supervisor.client import AsyncImages, AsyncSandbox

    pull: Literal["", "always", "if-missing", "never"] = a.pull or ""
    if a.image and not a.json and a.pull != "never":
        # pull first, with progress (a Create pulls silently before it answers); the
        # Create then finds the reference in the store
        show = PullProgress()
        await AsyncImages(a.socket).pull(
            a.image,
            policy=pull,
            tls_verify=a.tls_verify,
            progress=lambda p: show(p.phase, p.message, p.done, p.total),
        )
        pull = "if-missing"
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
        image=a.image or "",
        pull=pull,
        tls_verify=a.tls_verify,
        volumes=a.volume or (),
        scripts=_scripts(a.script),
        detached=True,
        wait=not a.no_wait,
    )


def _scripts(items: list[str] | None) -> dict[str, str]:
    """``--script NAME=FILE`` (repeatable): the file's text is the script."""
    out = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--script {item!r}: NAME=FILE")
        try:
            out[name] = Path(path).read_text()
        except OSError as exc:
            raise UsageError(f"--script {name}: {path}: {exc.strerror}") from None
    return out


def _egress(a: argparse.Namespace) -> Any:
    """``--egress-default/--allow/--deny`` as the SDK's Egress (None: not given)."""
    if a.egress_default is None and not a.allow and not a.deny:
        return None
    from supervisor.client import Egress

    return Egress(default=a.egress_default or "allow", allow=a.allow or (), deny=a.deny or ())


def run(a: argparse.Namespace) -> int:
    cmd = _cmd(a)
    if not cmd and not a.script:
        raise UsageError("run needs a command after -- (or --script NAME)")
    body = {
        "id": a.name,
        "cmd": cmd,
        "script": a.script or "",
        "env": kv(a.env),
        "working_dir": a.workdir or "",
        "user": a.user or "",
        "tty": a.tty,
        "timeout_seconds": a.timeout,
    }
    code = 0
    with _conn(a) as c:
        for o in c.stream("Run", body):
            if o.get("done"):
                code = o.get("exit_code") or 0
            elif o["stream"] == "stdout":
                sys.stdout.buffer.write(o["data"])
                sys.stdout.buffer.flush()
            elif o["stream"] == "stderr":
                sys.stderr.buffer.write(o["data"])
                sys.stderr.buffer.flush()
    return int(code)


@_on_trio
async def exec_(a: argparse.Namespace) -> int:
    from supervisor.client import AsyncSandbox

    cmd = _cmd(a)
    if not cmd:
        raise UsageError("exec needs a command after --")
    sb = AsyncSandbox(a.name, socket=a.socket)
    if not a.interactive and not a.tty:
        # output only: stdin is not the process's
        with open(os.devnull, "rb") as devnull:
            return await sb.attach(cmd, tty=False, env=kv(a.env), stdin_fd=devnull.fileno())
    return await sb.attach(cmd, tty=a.tty, env=kv(a.env))


def ls(a: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    cursor = ""
    with _conn(a) as c:
        while True:
            page = c.call("List", {"labels": kv(a.label), "state": a.state or "", "limit": 100, "cursor": cursor})
            rows += page["sandboxes"]
            cursor = page.get("next_cursor", "")
            if not cursor:
                break
    if a.json:
        _json([{k: r[k] for k in ("id", "state", "labels", "ip_address", "created_at")} for r in rows])
        return 0
    print_table(
        ("ID", "STATE", "LABELS", "IP", "CREATED"),
        [
            (
                r["id"],
                r["state"],
                ",".join(f"{k}={v}" for k, v in sorted(r["labels"].items())),
                r["ip_address"] or "-",
                _ts(r["created_at"]),
            )
            for r in rows
        ],
    )
    return 0


def inspect(a: argparse.Namespace) -> int:
    with _conn(a) as c:
        info = c.call("Inspect", {"id": a.name})
    if a.json:
        _json(info)
        return 0
    rows = []
    for k in ("id", "state", "labels", "limits", "network", "created_at", "ready_at", "last_exited_at"):
        v = info[k]
        if k.endswith("_at"):
            v = _ts(v)
        rows.append((k, str(v)))
    rows.append(("last_exit_code", str(info["last_exit_code"])))
    if info["error"]:
        rows.append(("error", info["error"]))
    print_table(("FIELD", "VALUE"), rows, show_header=False)
    return 0


def _print_log(e: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _json(e)
        return
    target = sys.stderr.buffer if e["source"] == "stderr" else sys.stdout.buffer
    data = e["data"] if e["source"] != "system" else b"[system] " + e["data"] + b"\n"
    target.write(data)
    target.flush()


def logs(a: argparse.Namespace) -> int:
    with _conn(a) as c:
        for e in c.stream("Logs", {"id": a.name, "follow": a.follow, "tail": a.tail}):
            _print_log(e, a.json)
    return 0


def events(a: argparse.Namespace) -> int:
    import datetime

    with _conn(a) as c:
        for e in c.stream("Events", {"id": a.id or "", "action": a.action or ""}):
            if a.json:
                _json(e)
            else:
                attrs = " ".join(f"{k}={v}" for k, v in sorted(e["attributes"].items()))
                ts = datetime.datetime.fromtimestamp(e["timestamp"] / 1e9, datetime.UTC).isoformat()
                print(f"{ts} {e['sandbox_id']} {e['action']} {attrs}".rstrip(), flush=True)
    return 0


@_on_trio
async def cp(a: argparse.Namespace) -> int:
    from supervisor.client import AsyncSandbox

    src_remote, dst_remote = ":" in a.src and not a.src.startswith("/"), ":" in a.dst and not a.dst.startswith("/")
    if src_remote == dst_remote:
        raise UsageError("exactly one of SRC and DST must be NAME:/path")
    if src_remote:
        name, _, path = a.src.partition(":")
        fs = AsyncSandbox(name, socket=a.socket).fs
        if a.recursive:  # one tar stream; DST is the directory the tree becomes
            await fs.copy_tree_out(path, a.dst, keep_owners=a.archive)
        else:
            await fs.copy_out(path, a.dst)
    else:
        name, _, path = a.dst.partition(":")
        fs = AsyncSandbox(name, socket=a.socket).fs
        if a.recursive:
            if not Path(a.src).is_dir():
                raise UsageError(f"{a.src}: no such directory")
            await fs.copy_tree_in(a.src, path, owner="" if a.archive else a.owner)
        elif not Path(a.src).is_file():
            raise UsageError(f"{a.src}: no such file" + (" (a directory needs -r)" if Path(a.src).is_dir() else ""))
        else:
            await fs.copy_in(a.src, path)
    return 0


@_on_trio
async def _start(a: argparse.Namespace) -> int:
    from supervisor.client import AsyncSandbox

    for name in a.names:
        await AsyncSandbox(name, socket=a.socket).start()  # boots, then waits until ready
    return 0


def status(a: argparse.Namespace) -> int:
    """Whether the supervisor answers; with --wait, poll until it does (scripts start
    ``sandvisor serve &`` and go on once this returns)."""
    import time

    from supervisor.errors import ApiError

    deadline = time.monotonic() + max(a.wait, 0)
    while True:
        try:
            with _conn(a) as c:
                n = len(c.call("List", {"labels": {}, "state": "", "limit": 100, "cursor": ""})["sandboxes"])
            break
        except ApiError as exc:
            if exc.code != "UNAVAILABLE" or time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
    if a.json:
        _json({"serving": True, "sandboxes": n})
    else:
        print(f"serving: {n if n < 100 else '100+'} sandboxes")
    return 0


def simple(a: argparse.Namespace) -> int:
    if a.command == "start":
        return _start(a)
    from supervisor.errors import ApiError

    failed: list[str] = []
    with _conn(a) as c:
        for name in a.names:  # several names: each is tried, as docker's rm/stop/kill do
            try:
                if a.command == "stop":
                    c.call("Stop", {"id": name, "timeout_seconds": a.timeout})
                elif a.command == "kill":
                    c.call("Kill", {"id": name})
                elif a.command == "rm":
                    c.call("Remove", {"id": name, "force": a.force})
                elif a.command == "ping":
                    print(f"{int(c.call('Ping', {'id': name})['latency_ns']) / 1e9 * 1000:.2f} ms")
                elif a.command == "touch":
                    print(int(c.call("Touch", {"id": name})["activity"]))
            except ApiError as exc:
                if len(a.names) == 1:
                    raise
                print(f"{name}: {exc.message}", file=sys.stderr)
                failed.append(name)
    return 1 if failed else 0


_METRICS = ("ID", "CPU", "MEM", "HOST RSS", "DISK R/W", "NET RX/TX", "UP")


def _metrics_row(m: dict[str, Any]) -> tuple[str, ...]:
    return (
        m["id"],
        f"{m['cpu_percent']:.1f}%",
        f"{(m['memory_total_bytes'] - m['memory_available_bytes']) >> 20}/{m['memory_total_bytes'] >> 20} MiB",
        f"{m['host_rss_bytes'] >> 20} MiB",
        f"{m['disk_read_bytes'] >> 10}/{m['disk_write_bytes'] >> 10} KiB",
        f"{m['net_rx_bytes']}/{m['net_tx_bytes']}",
        f"{m['uptime_seconds']:.0f}s",
    )


def metrics(a: argparse.Namespace) -> int:
    def show(m: dict[str, Any]) -> None:
        if a.json:
            _json(m)
        else:
            print_table(_METRICS, [_metrics_row(m)])

    with _conn(a) as c:
        if not a.watch:
            show(c.call("Metrics", {"id": a.name}))
            return 0
        for m in c.stream("MetricsStream", {"id": a.name, "interval_seconds": 1.0}):
            show(m)
    return 0


def top(a: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.live import Live

    with Live(_rich_table(_METRICS, []), console=Console(), refresh_per_second=2) as live:
        while True:
            with _conn(a) as c:
                every = c.call("MetricsAll", {})
            live.update(_rich_table(_METRICS, [_metrics_row(m) for m in every["sandboxes"]]))
            time.sleep(1.0)


def port(a: argparse.Namespace) -> int:
    proto = "udp" if a.udp else "tcp"
    if a.action == "ls":
        with _conn(a) as c:
            mappings = c.call("ListPorts", {"id": a.name})["ports"]
        if a.json:
            _json(mappings)
            return 0
        print_table(
            ("SANDBOX PORT", "HOST", "PROTOCOL"),
            [(str(m["sandbox_port"]), f"{m['host_address']}:{m['host_port']}", m["protocol"]) for m in mappings],
        )
        return 0
    if a.sandbox_port is None:
        raise UsageError(f"port {a.action} needs SANDBOX_PORT")
    with _conn(a) as c:
        if a.action == "add":
            r = c.call(
                "ExposePort",
                {"id": a.name, "sandbox_port": a.sandbox_port, "host_port": a.host_port, "protocol": proto},
            )
            print(r["host_port"])
        else:
            c.call("UnexposePort", {"id": a.name, "sandbox_port": a.sandbox_port, "protocol": proto})
    return 0


def checkpoint(a: argparse.Namespace) -> int:
    with _conn(a) as c:
        r = c.call("Checkpoint", {"sandbox_id": a.name, "name": a.snapshot_name or "", "labels": kv(a.label)})
    _json(r) if a.json else print(r["snapshot_id"])
    return 0


def restore(a: argparse.Namespace) -> int:
    with _conn(a) as c:
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
    _json(r) if a.json else print(r["id"])
    return 0


def snapshots(a: argparse.Namespace) -> int:
    with _conn(a) as c:
        if getattr(a, "snapshot_id", None):
            c.call("DeleteSnapshot", {"snapshot_id": a.snapshot_id})
            return 0
        r = c.call("ListSnapshots", {"sandbox_id": a.sandbox or "", "labels": kv(a.label)})
    if a.json:
        _json(r["snapshots"])
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


# --- OCI images -----------------------------------------------------------------------
def tls_flag(text: str) -> bool:
    """``--tls-verify=false`` as podman and skopeo spell it."""
    v = text.lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class PullProgress:
    """A pull's progress on stderr: one line redrawn on a terminal, each phase once
    otherwise (logs stay short), nothing when quiet."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.last = ""

    def __call__(self, phase: str, message: str, done: int, total: int) -> None:
        if self.quiet:
            return
        size = f" {_mib(done)}/{_mib(total)}" if total else ""
        line = f"{phase}: {message}{size}".rstrip(": ")
        if self.tty:
            sys.stderr.write(f"\r\x1b[K{line}" + ("\n" if phase == "done" else ""))
            sys.stderr.flush()
        elif phase != self.last:
            print(line, file=sys.stderr, flush=True)
        self.last = phase


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
    show = PullProgress(quiet=a.quiet)
    image = None
    with _conn(a) as c:
        for item in c.stream("PullImage", body):
            if item.get("image"):
                image = item["image"]
            show(item.get("phase", ""), item.get("message", ""), item.get("done", 0), item.get("total", 0))
    if image is None:
        raise UsageError("the supervisor ended the pull without an image")
    _json(image) if a.json else print(image["digest"])
    return 0


def image_ls(a: argparse.Namespace) -> int:
    with _conn(a) as c:
        r = c.call("ListImages", {})
    oci = r.get("oci_images", [])
    if a.json:
        _json(oci)
        return 0
    rows = []
    for i in oci:
        for ref in i["refs"] or ["<none>"]:
            rows.append(
                (
                    ref,
                    i["id"],
                    _mib(i.get("size_bytes", 0)),
                    "yes" if i.get("in_use") else "",
                    _ts(i.get("pulled_at", 0)),
                )
            )
    print_table(("REFERENCE", "ID", "SIZE", "IN USE", "PULLED"), rows)
    return 0


def image_rm(a: argparse.Namespace) -> int:
    with _conn(a) as c:
        for ref in a.refs:
            r = c.call("RemoveImage", {"ref": ref})
            if a.json:
                _json(r)
                continue
            for t in r.get("untagged", []):
                print(f"untagged: {t}")
            for d in r.get("deleted", []):
                print(f"deleted: {d}")
    return 0


def image_prune(a: argparse.Namespace) -> int:
    with _conn(a) as c:
        r = c.call("PruneImages", {"dangling_only": a.dangling})
    if a.json:
        _json(r)
        return 0
    for d in r.get("deleted", []):
        print(f"deleted: {d}")
    print(f"freed {_mib(r.get('freed_bytes', 0))} ({r.get('blobs_deleted', 0)} blobs)")
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
    p.add_argument("ref", help="docker://HOST/NAME:TAG, ...@sha256:..., docker-archive:PATH, oci-archive:PATH, oci:DIR")
    p.add_argument("--policy", choices=["always", "if-missing", "never"], help="default: if-missing")
    p.add_argument("--tls-verify", type=tls_flag, default=True, metavar="BOOL", help="false: a plain-HTTP registry")
    p.add_argument("--creds", metavar="USER:PASS", help="registry credentials (never logged)")
    p.add_argument("--authfile", metavar="PATH", help="a docker-style auth file (read here, sent as content)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")

    cmd("ls", image_ls, "list the OCI images in the supervisor's store")

    p = cmd("rm", image_rm, "untag a reference, or delete an image (refused while in use)")
    p.add_argument("refs", nargs="+", metavar="REF")

    p = cmd("prune", image_prune, "delete every image nothing uses, and unused layers")
    p.add_argument("--dangling", action="store_true", help="only images no reference names")


def volume(a: argparse.Namespace) -> int:
    """volume create NAME --size 256M | ls | inspect NAME | rm NAME..."""
    with _conn(a) as c:
        if a.action == "create":
            if len(a.names) != 1:
                raise UsageError("volume create takes one NAME")
            from supervisor.client import parse_size

            mib = -(-parse_size(a.size) // (1 << 20))
            r = c.call("CreateVolume", {"name": a.names[0], "size_mib": mib, "labels": kv(a.label)})
            if a.json:
                _json(r)
            else:
                print(r["name"])
            return 0
        if a.action == "rm":
            if not a.names:
                raise UsageError("volume rm takes NAME...")
            for name in a.names:
                c.call("DeleteVolume", {"name": name})
            return 0
        if a.action == "inspect":
            if len(a.names) != 1:
                raise UsageError("volume inspect takes one NAME")
            _json(c.call("InspectVolume", {"name": a.names[0]}))
            return 0
        r = c.call("ListVolumes", {"labels": kv(a.label)})
    if a.json:
        _json(r["volumes"])
        return 0
    print_table(
        ("NAME", "SIZE", "MOUNTED BY", "CREATED"),
        [
            (x["name"], f"{x['size_mib']} MiB", ", ".join(x.get("mounted_by") or ()) or "-", str(x["created_at"]))
            for x in r["volumes"]
        ],
    )
    return 0


# --- parser ------------------------------------------------------------------------
CLIENT_COMMANDS = frozenset(
    {
        "create",
        "run",
        "exec",
        "ls",
        "inspect",
        "logs",
        "events",
        "cp",
        "stop",
        "kill",
        "rm",
        "start",
        "ping",
        "touch",
        "metrics",
        "top",
        "status",
        "checkpoint",
        "restore",
        "snapshots",
        "snapshot",
        "port",
        "volume",
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
    p.add_argument(
        "--volume", action="append", metavar="NAME:/path[:ro]", help="mount a named volume (sandvisor volume create)"
    )
    p.add_argument("--script", action="append", metavar="NAME=FILE", help="a named script (run it: run --script NAME)")
    p.add_argument("--workdir")
    p.add_argument("--user")
    p.add_argument("--image", metavar="REF", help="an OCI image (docker://HOST/NAME:TAG, oci:DIR, ...)")
    p.add_argument("--pull", choices=["always", "if-missing", "never"], help="the image's pull policy")
    p.add_argument("--tls-verify", type=tls_flag, default=True, metavar="BOOL", help="false: a plain-HTTP registry")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--json", action="store_true")

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
        ("rm", "remove"),
        ("start", "boot a stopped sandbox again"),
        ("ping", "round trip to the guest agent"),
        ("touch", "count as activity (idle timeout)"),
    ):
        p = cmd(name, simple, help)
        p.add_argument("names", nargs="+", metavar="NAME")
        if name == "stop":
            p.add_argument("--timeout", type=int, default=0, metavar="S")
        if name == "rm":
            p.add_argument("-f", "--force", action="store_true")

    p = cmd("metrics", metrics, "resource use of a sandbox")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true")

    cmd("top", top, "live table of every sandbox")

    p = cmd("status", status, "whether the supervisor answers (--wait S: until it does)")
    p.add_argument("--wait", type=float, default=0, metavar="S", help="keep trying for up to S seconds")
    p.add_argument("--json", action="store_true")

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

    p = cmd("volume", volume, "named volumes: volume create NAME --size 256M | ls | inspect NAME | rm NAME...")
    p.add_argument("action", choices=["create", "ls", "inspect", "rm"])
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--size", default="256M", help="create: 256M, 1G, ...")
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
    return int(args.client(args))
