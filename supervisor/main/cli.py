"""The ``sandvisor`` command line.

Errors a user can cause (bad arguments, a missing image) print one line on stderr
and exit 2 (usage) or 1 (operation failed); never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from supervisor.client.cli_client import CLIENT_COMMANDS, add_client_commands, run_client
from supervisor.client.cli_common import UsageError, configure_logging
from supervisor.client.cli_stores import add_image_commands
from supervisor.wire.errors import ApiError

# Imports are inside the functions that need them: a one-shot client command (ls,
# inspect, run, ...) loads neither Trio, rich nor the image builder (benchmarks/control.py).
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy reads the name)
if TYPE_CHECKING:
    from typing import Any, NoReturn


class UserError(Exception):
    """An error the user can fix: printed as one line, exit code 1."""


def fail(message: str, code: int = 1) -> NoReturn:
    from rich.console import Console

    from supervisor.client.cli_output import markup_escape

    Console(stderr=True, emoji=False).print(
        f"[bold red]error:[/] {markup_escape(message)}", highlight=False, soft_wrap=True
    )
    sys.exit(code)


def _host_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """The image builder's and the VM layer's errors as one line (exit 1), for the
    commands that use them; imported with them, not by every command."""

    def run(args: argparse.Namespace) -> int:
        from actors.channel.guest import GuestError
        from actors.machines.qemuproc import MachineError
        from images.build import BuildError

        try:
            return fn(args)
        except BuildError as exc:
            raise UserError(f"image build failed: {exc}") from None
        except (GuestError, MachineError) as exc:
            raise UserError(str(exc)) from None

    run.__name__ = run.__qualname__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


# --- image -------------------------------------------------------------------
def cmd_image_build(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from images.build import Builder, default_cache
    from supervisor.client.cli_output import markup_escape

    err, out = Console(stderr=True, emoji=False), Console(emoji=False)
    cache = Path(args.cache) if args.cache else default_cache()
    if args.json:
        b = Builder(cache)
        img = b.build()
        print(json.dumps({"built": b.built, "image": img.to_json()}))
        return 0
    with Progress(
        SpinnerColumn(), TextColumn("[bold]{task.fields[part]}[/] {task.description}"), TimeElapsedColumn(), console=err
    ) as progress:
        tasks: dict[str, object] = {}

        def report(part: str, msg: str) -> None:
            if part not in tasks:
                tasks[part] = progress.add_task(markup_escape(msg), part=markup_escape(part))
            progress.update(tasks[part], description=markup_escape(msg))  # type: ignore[arg-type]

        b = Builder(cache, progress=report)
        img = b.build()
    if b.built:
        out.print(f"built: {', '.join(b.built)}  ->  {cache / 'default.json'}", markup=False)
    else:
        out.print(f"image up to date, nothing to do ({cache / 'default.json'})", markup=False)
    return 0


# --- demo --------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: a supervisor (in this process, on a throwaway state dir sharing the
    built image) and, through the SDK, a sandbox at work: commands, files, metrics,
    then a checkpoint, two restored clones and a Create from the boot template."""
    import time
    from pathlib import Path

    import trio
    from rich.console import Console
    from rich.table import Table

    from actors.machines.qemuspec import resolve_accel
    from images.build import default_cache, load_default
    from supervisor.client.cli_output import markup_escape as esc

    out = Console(emoji=False)  # data (command output, ids, paths) prints as it is
    img = load_default(Path(args.cache) if args.cache else None)
    if img is None:
        raise UserError("the default image is not built: run 'sandvisor image build'")
    accel = resolve_accel(args.accel)
    cache = Path(args.cache) if args.cache else default_cache()

    async def main() -> None:
        from supervisor.client import AsyncSandbox
        from supervisor.main.throwaway import supervisor, workdir

        with workdir("sandvisor-demo-", cache=cache) as work:
            async with supervisor(work, accel=accel) as (cfg, _):
                sock = cfg.socket
                out.print(f"[bold]supervisor[/] up on {esc(sock)} (accel={accel}, kernel {esc(img.kernel_version)})")
                t0 = time.monotonic()
                sb = await AsyncSandbox.create("demo", hostname="demo", socket=sock, labels={"via": "demo"})
                out.print(f"sandbox [bold]demo[/] booted and ready in {time.monotonic() - t0:.2f}s")
                for argv in (
                    ["uname", "-sr"],
                    ["sh", "-c", "echo hello from $(hostname) as $(id -un); echo to stderr >&2; exit 3"],
                    ["python3", "-c", "import sys; print('python', sys.version.split()[0], 'in the sandbox')"],
                ):
                    t = time.monotonic()
                    r = await sb.run(argv)
                    out.print(f"[dim]$ {esc(' '.join(argv))}[/]  [dim]({(time.monotonic() - t) * 1000:.0f} ms)[/]")
                    if r.stdout:
                        out.print(r.stdout.decode(errors="replace").rstrip(), highlight=False, markup=False)
                    if r.stderr:
                        out.print(f"[yellow]{esc(r.stderr.decode(errors='replace').rstrip())}[/]", highlight=False)
                    out.print(f"[dim]exit code {r.exit_code}[/]")
                await sb.fs.write("/root/greeting", b"written by the host before the checkpoint\n")
                out.print(f"file round trip: {await sb.fs.read('/root/greeting')!r}", markup=False)
                m = await sb.metrics()
                table = Table("metric", "value", title="sandbox metrics")
                table.add_row("uptime", f"{m.uptime_seconds:.1f} s")
                table.add_row(
                    "guest memory available",
                    f"{m.memory_available_bytes >> 20} / {m.memory_total_bytes >> 20} MiB",
                )
                table.add_row("QEMU host RSS", f"{m.host_rss_bytes >> 20} MiB")
                out.print(table)

                t = time.monotonic()
                snap = (await sb.checkpoint("demo-snap")).snapshot_id
                out.print(
                    f"checkpoint [bold]{esc(snap)}[/] in {(time.monotonic() - t) * 1000:.0f} ms (the sandbox runs on)"
                )
                clones: list[AsyncSandbox] = []
                t = time.monotonic()

                async def restore(name: str) -> None:
                    clones.append(await AsyncSandbox.restore(snap, name=name, socket=sock))

                async with trio.open_nursery() as n:
                    for name in ("clone-1", "clone-2"):
                        n.start_soon(restore, name)
                out.print(f"two clones restored side by side, ready in {time.monotonic() - t:.2f}s")
                for c in sorted(clones, key=lambda c: c.id):
                    r = await c.run(["sh", "-c", "cat /root/greeting; head -c 6 /dev/urandom | od -An -tx1"])
                    out.print(
                        f"[dim]{esc(c.id)}:[/] " + esc(" | ".join(r.stdout.decode().split("\n")[:2])), highlight=False
                    )
                t = time.monotonic()
                quick = await AsyncSandbox.create("demo-2", socket=sock)
                out.print(
                    f"sandbox [bold]demo-2[/] ready in {time.monotonic() - t:.2f}s (restored from the boot template)"
                )
                for x in (quick, *clones, sb):
                    await x.remove(force=True)
                await AsyncSandbox.delete_snapshot(snap, socket=sock)
        out.print("sandboxes removed, snapshot deleted, supervisor stopped: nothing left behind")

    trio.run(main)
    return 0


# --- serve -------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import trio

    from images.refs import RefPolicy
    from supervisor.main.daemon import metrics_token, serve
    from supervisor.main.daemon_config import from_args
    from supervisor.serve.grpc_service import addresses as grpc_addresses
    from supervisor.serve.grpc_service import tcp_auth
    from supervisor.serve.metrics import check_listen as check_metrics_listen
    from supervisor.serve.metrics import parse_listen

    logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.INFO)
    cfg = from_args(args)
    # the flags' mistakes as usage errors, before anything starts
    try:
        auth = tcp_auth(cfg.grpc_token_file, cfg.grpc_insecure, cfg.grpc_admin_cert_cn)
    except (ValueError, OSError) as exc:
        fail(f"sandvisor serve: {exc}", 2)
    for addr in cfg.grpc:
        try:
            grpc_addresses((addr,), cert=cfg.grpc_cert, key=cfg.grpc_key, client_ca=cfg.grpc_client_ca, auth=auth)
        except (ValueError, OSError) as exc:
            fail(f"sandvisor serve: --grpc {addr!r}: {exc}", 2)
    from supervisor.serve.webhooks import webhooks

    try:
        webhooks(cfg.webhooks, cfg.webhook_secrets)
    except (ValueError, OSError) as exc:
        fail(f"sandvisor serve: {exc}", 2)
    try:
        if cfg.metrics:
            check_metrics_listen(cfg.metrics)
            metrics_token(cfg)
    except (ValueError, OSError) as exc:
        fail(f"sandvisor serve: --metrics {cfg.metrics!r}: {exc}", 2)
    if cfg.e2b:
        from supervisor.main.daemon import e2b_key_file

        try:
            parse_listen(cfg.e2b)
            e2b_key_file(cfg)
        except (ValueError, OSError) as exc:
            fail(f"sandvisor serve: --e2b: {exc}", 2)
    try:
        RefPolicy(registry_allow=cfg.registry_allow, registry_mirrors=cfg.registry_mirrors)
    except ValueError as exc:
        fail(f"sandvisor serve: {exc}", 2)
    try:
        trio.run(serve, cfg)
    except Exception as exc:
        reason = _refusal(exc)
        if reason is None:
            raise  # a bug, not a refusal: its traceback is the report
        if args.verbose:
            import traceback

            traceback.print_exception(exc)
        fail(f"sandvisor serve: {reason}", 1)
    return 0


def _refusal(exc: BaseException) -> str | None:
    """The one line of a refusal to start (or to go on): a wrong setting, a directory, a
    port or a lock someone else holds, a missing tool or image. None when any part of
    ``exc`` is something else (a bug: shown whole)."""
    from actors.cells.cgroups import CgroupError
    from actors.cells.identities import JailError
    from actors.errors import DomainError
    from actors.machines.qemuproc import MachineError
    from actors.net.netns import NetError
    from actors.net.nft import NftError
    from images.build import BuildError
    from supervisor.main.daemon import Refused
    from supervisor.wire.config import UnsafeRuntimeDir

    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(exc)
    known = (
        Refused,
        DomainError,
        JailError,
        MachineError,
        BuildError,
        UnsafeRuntimeDir,
        NetError,
        NftError,
        CgroupError,
        OSError,
        ValueError,
    )
    if not leaves or not all(isinstance(e, known) for e in leaves):
        return None
    first = leaves[0]
    if isinstance(first, BuildError):
        return f"the default image cannot be built: {first} (build it with `sandvisor image build`)"
    if isinstance(first, DomainError):
        return first.message
    if isinstance(first, OSError) and first.strerror:  # not "[Errno 98] ..."
        return f"{first.filename}: {first.strerror}" if first.filename else first.strerror
    return str(first)


# --- completion ------------------------------------------------------------------
_IDS_FILTER = """python3 -c 'import json,sys; print(" ".join(r["id"] for r in json.load(sys.stdin)))'"""


def cmd_mcp(args: argparse.Namespace) -> int:
    """``sandvisor mcp``: the MCP server (supervisor/serve/mcp_server.py), an ordinary client."""
    try:
        from supervisor.serve import mcp_server
    except ImportError as exc:
        fail(f"sandvisor mcp needs the mcp package (pip install 'sandvisor[mcp]'): {exc}", 1)
    door = None
    if args.http:
        try:
            door, made = mcp_server.http_door(args.http, args.token_file, tls_cert=args.tls_cert, tls_key=args.tls_key)
        except ValueError as exc:
            fail(f"sandvisor mcp: {exc}", 2)
        if made:
            print(f"sandvisor mcp: a new token in {args.token_file} (mode 0600)", file=sys.stderr)
        print(f"sandvisor mcp: {door.url} (Authorization: Bearer <the token>)", file=sys.stderr)
    mcp_server.run(args.socket, door)
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    """Print a bash completion script: ``source <(sandvisor completion bash)``."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    words: dict[str, list[str]] = {}
    for name, p in sub.choices.items():
        p.fill()
        words[name] = sorted(o for act in p._actions for o in act.option_strings if o.startswith("--"))
    cases = "\n".join(f'    {name}) opts="{" ".join(opts)}" ;;' for name, opts in sorted(words.items()))
    image_parser = sub.choices["image"]
    image_sub = next(a for a in image_parser._actions if isinstance(a, argparse._SubParsersAction))
    image_words = " ".join(sorted(image_sub.choices))
    print(
        f"""_sandvisor() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" cmd="${{COMP_WORDS[1]}}" opts=""
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=($(compgen -W "{" ".join(sorted(words))}" -- "$cur")); return
  fi
  if [ "$cmd" = image ] && [ "$COMP_CWORD" -eq 2 ]; then
    COMPREPLY=($(compgen -W "{image_words}" -- "$cur")); return
  fi
  case "$cmd" in
{cases}
  esac
  if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W "$opts" -- "$cur")); return; fi
  case "$cmd" in
    run|exec|inspect|logs|stop|kill|rm|start|ping|touch|metrics)
      COMPREPLY=($(compgen -W "$(sandvisor ls --json 2>/dev/null | {_IDS_FILTER})" -- "$cur")) ;;
  esac
}}
complete -F _sandvisor sandvisor"""
    )
    return 0


# --- parser ------------------------------------------------------------------
def _columns() -> int:
    """``shutil.get_terminal_size().columns``, without importing shutil."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 80
        columns = columns or 80
    return columns


class _Formatter(argparse.HelpFormatter):
    """argparse's own; it imports shutil (and with it bz2, lzma, zlib: ~2.4 ms of every
    command, measured) for the terminal's width, found here the same way without it."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None):
        super().__init__(prog, indent_increment, max_help_position, _columns() - 2 if width is None else width)


class _Parser(argparse.ArgumentParser):
    later: Callable[[argparse.ArgumentParser], None] | None = None  # arguments added on first use

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kw)

    def fill(self) -> None:
        """Add the arguments left for later (a parse, a help, the completion need them)."""
        if self.later is not None:
            add, self.later = self.later, None
            add(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.fill()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.fill()
        return super().format_help()

    def format_usage(self) -> str:
        self.fill()
        return super().format_usage()

    def error(self, message: str) -> NoReturn:
        """Usage errors are one line and exit code 2 (argparse's own print the usage too)."""
        fail(f"{self.prog}: {message}", 2)


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags, made from DaemonConfig's declaration (supervisor/main/daemon_config.py)."""
    from supervisor.main.daemon_config import add_flags

    add_flags(parser)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``only`` (a client command): a parser of that command
    alone, which parses its command lines as the whole one does."""
    p = _Parser(prog="sandvisor", description="QEMU microVM sandboxes")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    if only is not None:
        add_client_commands(sub, only)
        return p

    image = sub.add_parser("image", help="the guest image (build) and OCI images (pull, ls, rm, prune)")
    isub = image.add_subparsers(dest="image_command", required=True, metavar="SUBCOMMAND")
    ib = isub.add_parser("build", help="build the default guest image (cached, content-keyed)")
    ib.add_argument("--cache", help="image cache directory (default: STATE_DIR/images)")
    ib.add_argument("--json", action="store_true", help="print the result as JSON")
    ib.set_defaults(func=_host_errors(cmd_image_build))
    add_image_commands(isub)

    sv = sub.add_parser("serve", help="run the supervisor (the sandbox.v1 service on a Unix socket)")
    sv.later = _serve_flags  # (imports attrs: only when serve is parsed, or its help shown)
    sv.set_defaults(func=_host_errors(cmd_serve))

    mcp = sub.add_parser("mcp", help="serve sandboxes as MCP tools for agents (stdio, or --http HOST:PORT)")
    mcp.add_argument("--socket", default=os.environ.get("SANDVISOR_SOCKET"), help="supervisor socket")
    mcp.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="MCP's streamable HTTP at http://HOST:PORT/mcp (loopback; other hosts need --tls-cert/--tls-key); "
        "needs --token-file",
    )
    mcp.add_argument(
        "--token-file",
        metavar="FILE",
        help="with --http: clients send 'Authorization: Bearer TOKEN' with the token in FILE "
        "(yours, mode 0600; made with a new random token if absent)",
    )
    mcp.add_argument("--tls-cert", metavar="PEM", help="with --http: serve HTTPS with this certificate chain")
    mcp.add_argument("--tls-key", metavar="PEM", help="with --http: the certificate's private key")
    mcp.set_defaults(func=cmd_mcp)

    demo = sub.add_parser("demo", help="boot a sandbox from the default image and show it working")
    demo.add_argument("--cache", help="image cache directory")
    demo.add_argument("--accel", default="auto", choices=["auto", "kvm", "tcg"])
    demo.set_defaults(func=_host_errors(cmd_demo))
    add_client_commands(sub)
    comp = sub.add_parser("completion", help="print a shell completion script (bash)")
    comp.add_argument("shell", choices=["bash"])
    comp.set_defaults(func=cmd_completion)
    return p


def _client_command(argv: list[str]) -> str | None:
    """The client command this command line runs, if it plainly is one."""
    for word in argv:
        if word in ("-v", "--verbose"):
            continue
        return word if word in CLIENT_COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if is_fleet_command(argv):  # `sandvisor --fleet ADDRESS ...`, `sandvisor fleet nodes`
        return _fleet_main(argv)
    # everything after the first "--" is the sandbox command, never our options
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1 :]
    args = build_parser(_client_command(argv)).parse_args(argv)
    args.cmd = cmd
    if args.verbose or not hasattr(args, "client"):  # the quick client commands log nothing
        configure_logging(args.verbose)
    try:
        if hasattr(args, "client"):
            return run_client(args)
        return int(args.func(args))
    except UsageError as exc:
        fail(str(exc), 2)
    except ApiError as exc:
        fail(exc.message if exc.code in ("NOT_FOUND", "UNAVAILABLE") else f"{exc.code}: {exc.message}", 1)
    except UserError as exc:
        fail(str(exc), 1)
    except KeyboardInterrupt:
        fail("interrupted", 130)


def is_fleet_command(argv: list[str]) -> bool:
    """``--fleet ADDRESS`` before the command, or the ``fleet`` command (supervisor/client/cli_fleet.py)."""
    for word in argv:
        if word in ("-v", "--verbose"):
            continue
        return word in {"fleet", "--fleet"} or word.startswith("--fleet=")
    return False


def _fleet_main(argv: list[str]) -> int:
    from supervisor.client.cli_fleet import main as fleet_main

    try:
        return fleet_main(argv)
    except UsageError as exc:
        fail(str(exc), 2)
    except ApiError as exc:
        fail(f"{exc.code}: {exc.message}", 1)
    except OSError as exc:
        fail(str(exc), 1)
    except KeyboardInterrupt:
        fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
