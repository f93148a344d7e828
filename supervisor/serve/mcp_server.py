"""``sandvisor mcp``: sandboxes as Model Context Protocol tools, for desktop and IDE
agents. Built on the ``mcp`` package's :class:`MCPServer`; an ordinary client of the
supervisor (the Trio SDK on its Unix socket), acting as the user who started it.
stdio by default; ``--http HOST:PORT`` serves MCP's streamable HTTP transport with
Hypercorn on Trio. That is a door to that user's powers, so it checks who is asking:
every request carries ``Authorization: Bearer TOKEN`` (the token in ``--token-file``,
a 0600 file of that user's; constant-time compare) or gets 401; a host that is not
loopback by its address class is refused unless served with TLS; plain-HTTP binds keep
the SDK's DNS-rebinding check (Host and Origin headers).

Every sandbox it creates gets a TTL (default :data:`DEFAULT_TTL`), so an agent's
sandboxes do not outlive its session by much, and the label ``created-by=sandvisor-mcp``.
Errors are tool errors whose text starts with sandbox.v1's code (``NOT_FOUND: ...``).
"""

from __future__ import annotations

import base64
import functools
import json
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

import attrs
import trio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ImageContent, TextContent
from pydantic import Field
from starlette.types import ASGIApp, Receive, Scope, Send

from supervisor.client.sdk.aio import AsyncSandbox
from supervisor.client.sdk.code_plans import Execution
from supervisor.serve import guest_fs
from supervisor.serve.tokens import bearer_ok, make_token_file, read_token_file
from supervisor.wire import errors

DEFAULT_TTL = 3600  # s: an agent's sandbox goes an hour after creation unless asked otherwise
MAX_TTL = 7 * 24 * 3600
MAX_OUTPUT = 64 << 10  # bytes of each of stdout and stderr a run_command returns (the tail)
MAX_READ = 1 << 20
PROGRESS_EVERY = 1.0  # s between progress notifications of a long run
LABEL = {"created-by": "sandvisor-mcp"}

Id = Annotated[str, Field(description="the sandbox's id (from create_sandbox or list_sandboxes)")]
Path_ = Annotated[str, Field(description="an absolute path inside the sandbox")]


class _Tail:
    """The last ``limit`` bytes of a stream, and how many came."""

    def __init__(self, limit: int = MAX_OUTPUT) -> None:
        self.buf = bytearray()
        self.total = 0
        self.limit = limit

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self.buf += data
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]

    def text(self) -> str:
        s = self.buf.decode("utf-8", "replace")
        cut = self.total - len(self.buf)
        return f"[... {cut} bytes cut ...]\n{s}" if cut else s


P = ParamSpec("P")
R = TypeVar("R")


def guarded(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """The supervisor's errors as tool errors: ``CODE: message``."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kw: P.kwargs) -> R:
        try:
            return await fn(*args, **kw)
        except errors.SandboxError as exc:
            raise ToolError(f"{exc.code}: {exc.message}") from None

    return call


def build(socket: str | None) -> MCPServer:
    """The MCPServer with sandvisor's tools, on the supervisor at ``socket``."""
    server = MCPServer(
        "sandvisor",
        instructions="Run untrusted code in disposable QEMU microVM sandboxes: create_sandbox, then run_command, "
        "write_file/read_file/list_files; checkpoint/restore to fork state; remove_sandbox when done.",
    )

    def box(id: str) -> AsyncSandbox:
        return AsyncSandbox(id, socket=socket)

    @server.tool()
    @guarded
    async def create_sandbox(
        image: Annotated[str, Field(description="an OCI image reference; empty: the supervisor's default image")] = "",
        cpus: Annotated[int, Field(ge=0, le=64, description="vCPUs (0: the supervisor's default)")] = 0,
        memory_mib: Annotated[int, Field(ge=0, description="memory in MiB (0: the supervisor's default)")] = 0,
        network: Annotated[
            Literal["none", "user", "outbound"],
            Field(description="none: no network; user: QEMU user networking; outbound: internet access"),
        ] = "none",
        ttl_seconds: Annotated[
            int, Field(ge=1, le=MAX_TTL, description="seconds until the sandbox is removed (default: one hour)")
        ] = DEFAULT_TTL,
        env: Annotated[dict[str, str] | None, Field(description="environment variables of its commands")] = None,
    ) -> dict[str, Any]:
        """Create and boot a new sandbox (a QEMU microVM); returns its id once it is ready."""
        sb = await AsyncSandbox.create(
            socket=socket,
            image=image,
            cpus=cpus,
            memory_mib=memory_mib,
            network=network,
            ttl=ttl_seconds,
            ttl_action="remove",  # (the tool says: removed after it)
            env=env or {},
            labels=LABEL,
            detached=True,
        )
        return {"id": sb.id, "ttl_seconds": ttl_seconds}

    @server.tool()
    @guarded
    async def run_command(
        sandbox_id: Id,
        command: Annotated[str, Field(description="a shell command line, run by /bin/sh -c")],
        ctx: Context,
        workdir: Annotated[str, Field(description="working directory (default: the image's)")] = "",
        env: Annotated[dict[str, str] | None, Field(description="extra environment variables")] = None,
        timeout_seconds: Annotated[int, Field(ge=0, le=86400, description="kill it after this long (0: never)")] = 600,
    ) -> dict[str, Any]:
        """Run a shell command in the sandbox and wait for it: its exit code, stdout and stderr (the last 64 KiB of
        each). Long runs send progress notifications."""
        out, err = _Tail(), _Tail()
        code = -1
        started = time.monotonic()

        async def tick() -> None:  # progress every PROGRESS_EVERY s, output or not
            while True:
                await trio.sleep(PROGRESS_EVERY)
                t = time.monotonic() - started
                await ctx.report_progress(t, None, f"running {t:.0f}s, {out.total + err.total} bytes of output")

        with errors.collapse_single():
            async with trio.open_nursery() as ticker:
                ticker.start_soon(tick)
                async with aclosing(
                    box(sandbox_id).run_stream(
                        ["/bin/sh", "-c", command], env=env or {}, workdir=workdir, timeout=timeout_seconds
                    )
                ) as outputs:
                    async for o in outputs:
                        if o.stream == "stdout":
                            out.add(o.data)
                        elif o.stream == "stderr":
                            err.add(o.data)
                        elif o.exit_code is not None:
                            code = o.exit_code
                ticker.cancel_scope.cancel()
        return {"exit_code": code, "stdout": out.text(), "stderr": err.text()}

    @server.tool()
    @guarded
    async def write_file(
        sandbox_id: Id,
        path: Path_,
        content: Annotated[str, Field(description="the file's content (text, or base64 with encoding=base64)")],
        encoding: Literal["utf-8", "base64"] = "utf-8",
    ) -> dict[str, Any]:
        """Create or replace a file in the sandbox."""
        data = base64.b64decode(content) if encoding == "base64" else content.encode()
        await box(sandbox_id).fs.write(path, data)
        return {"path": path, "bytes": len(data)}

    @server.tool()
    @guarded
    async def read_file(
        sandbox_id: Id,
        path: Path_,
        encoding: Annotated[
            Literal["utf-8", "base64"], Field(description="utf-8 (text; invalid bytes replaced) or base64")
        ] = "utf-8",
    ) -> dict[str, Any]:
        """Read a file of the sandbox (up to 1 MiB)."""
        data = await box(sandbox_id).fs.read(path)
        if len(data) > MAX_READ:
            raise ToolError(
                f"{errors.RESOURCE_EXHAUSTED}: {path} has {len(data)} bytes; read_file returns up to {MAX_READ}"
            )
        text = base64.b64encode(data).decode() if encoding == "base64" else data.decode("utf-8", "replace")
        return {"path": path, "bytes": len(data), "content": text}

    @server.tool()
    @guarded
    async def list_files(
        sandbox_id: Id,
        path: Path_ = "/",
        depth: Annotated[int, Field(ge=1, le=8, description="how deep to descend (1: the directory's entries)")] = 1,
    ) -> dict[str, Any]:
        """List a directory of the sandbox: each entry's path, type, size and mode."""
        entries = await guest_fs.list_dir(box(sandbox_id), "", path, depth)
        return {
            "entries": [
                {
                    "path": e["path"],
                    "type": e["type"].removeprefix("FILE_TYPE_").lower(),
                    "size": int(e["size"]),
                    "permissions": e["permissions"],
                }
                for e in entries
            ]
        }

    @server.tool()
    @guarded
    async def checkpoint(
        sandbox_id: Id,
        name: Annotated[str, Field(description="a unique name for the snapshot (optional)")] = "",
    ) -> dict[str, Any]:
        """Snapshot a running sandbox (memory and disk); it runs on. restore makes new sandboxes from it."""
        r = await box(sandbox_id).checkpoint(name)
        return {"snapshot_id": r.snapshot_id, "name": name}

    @server.tool()
    @guarded
    async def restore(
        snapshot: Annotated[str, Field(description="a snapshot's id or name (from checkpoint)")],
        ttl_seconds: Annotated[int, Field(ge=1, le=MAX_TTL, description="seconds until it is removed")] = DEFAULT_TTL,
    ) -> dict[str, Any]:
        """Start a new sandbox from a snapshot, in the state it was checkpointed in."""
        sb = await AsyncSandbox.restore(snapshot, ttl=ttl_seconds, labels=LABEL, detached=True, socket=socket)
        return {"id": sb.id, "ttl_seconds": ttl_seconds}

    @server.tool()
    @guarded
    async def fork_sandbox(
        sandbox_id: Id,
        count: Annotated[int, Field(ge=1, le=16, description="how many copies")] = 1,
        ttl_seconds: Annotated[int, Field(ge=1, le=MAX_TTL, description="seconds until each is removed")] = DEFAULT_TTL,
    ) -> dict[str, Any]:
        """Copy a running sandbox: each copy has its processes, memory and files as they are
        now, its own id, hostname and address; the original runs on. For trying several
        things from one state."""
        kids = await box(sandbox_id).fork(count, labels=LABEL)
        for kid in kids:
            await kid.set_ttl(ttl_seconds)
        return {"ids": [k.id for k in kids], "parent": sandbox_id, "ttl_seconds": ttl_seconds}

    @server.tool()
    @guarded
    async def remove_sandbox(sandbox_id: Id) -> dict[str, Any]:
        """Stop and delete a sandbox and its disk."""
        await box(sandbox_id).remove(force=True)
        return {"removed": sandbox_id}

    @server.tool()
    @guarded
    async def list_sandboxes(
        mine: Annotated[bool, Field(description="only the sandboxes this MCP server created")] = False,
    ) -> dict[str, Any]:
        """The supervisor's sandboxes: id, state, labels."""
        page = await AsyncSandbox.list(socket=socket, labels=LABEL if mine else None, limit=100)
        return {"sandboxes": [{"id": s.id, "state": s.state, "labels": s.labels} for s in page.sandboxes]}

    # --- the code interpreter (docs/code.md) ---
    @server.tool()
    @guarded
    async def run_code(
        sandbox_id: Id,
        code: Annotated[str, Field(description="a Python cell (variables persist between cells of a context)")],
        context: Annotated[str, Field(description="a code context's id (empty: the default python context)")] = "",
        timeout_seconds: Annotated[
            int, Field(ge=0, le=86400, description="interrupt the cell after this long (0: never)")
        ] = 300,
    ) -> list[TextContent | ImageContent]:
        """Run a cell in a Jupyter kernel in the sandbox (its image needs the kernel runtime: the
        code-interpreter image). Returns its stdout, stderr, results' text, error and execution count
        as JSON text, then each image result (a matplotlib plot, ...) as image content."""
        ex = await box(sandbox_id).run_code(code, context=context or None, timeout=timeout_seconds or None)
        return code_content(ex)

    return server


def code_content(ex: Execution) -> list[TextContent | ImageContent]:
    """A cell's run as MCP content: a JSON summary (stdout and stderr cut to their last
    64 KiB), then its png, jpeg and svg results as images."""
    out, err = _Tail(), _Tail()
    for s in ex.logs.stdout:
        out.add(s.encode())
    for s in ex.logs.stderr:
        err.add(s.encode())
    summary = {
        "stdout": out.text(),
        "stderr": err.text(),
        "results": [{"is_main_result": r.is_main_result, "text": r.text, "formats": r.formats()} for r in ex.results],
        "error": attrs.asdict(ex.error) if ex.error is not None else None,
        "execution_count": ex.execution_count,
    }
    blocks: list[TextContent | ImageContent] = [TextContent(type="text", text=json.dumps(summary))]
    for r in ex.results:
        for fmt, mime in (("png", "image/png"), ("jpeg", "image/jpeg")):
            value = getattr(r, fmt)
            if value:
                blocks.append(ImageContent(type="image", data=value, mime_type=mime))
        if r.svg:
            svg = base64.b64encode(r.svg.encode()).decode()
            blocks.append(ImageContent(type="image", data=svg, mime_type="image/svg+xml"))
    return blocks


@attrs.frozen
class HttpDoor:
    """How ``--http`` serves: where, the bearer token every request carries, TLS, and the
    Host headers the SDK's DNS-rebinding check lets through (None: no check, over TLS)."""

    host: str
    port: int
    token: bytes = attrs.field(repr=False)
    tls: tuple[str, str] | None = None  # (certificate chain PEM, key PEM)
    allowed_hosts: tuple[str, ...] | None = ()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/mcp"


NOT_LOOPBACK = "is not a loopback address: serve it with TLS (--tls-cert and --tls-key), or on loopback"


def http_door(
    spec: str, token_file: str | None, *, tls_cert: str | None = None, tls_key: str | None = None
) -> tuple[HttpDoor, bool]:
    """``--http HOST:PORT``'s door, checked before anything listens (ValueError saying what
    to change), and whether its token file was made now. A token file is required (made,
    0600, with a new random token if there is no file at that path; refused if it is not
    a private file of ours); a host that is not loopback by its class (names resolved) is
    refused without TLS."""
    from supervisor.serve.metrics import is_loopback, parse_listen

    host, port = parse_listen(spec)
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
    loopback = is_loopback(host)
    if not loopback and tls is None:
        raise ValueError(f"--http {spec}: {host} {NOT_LOOPBACK}")
    if not token_file:
        raise ValueError("--http needs --token-file FILE: every request carries 'Authorization: Bearer TOKEN'")
    made = make_token_file(token_file, "--token-file")
    token = read_token_file(token_file, "--token-file")
    allowed: tuple[str, ...] | None = None  # over TLS a rebound name fails the certificate check
    if tls is None:
        named = f"[{host}]" if ":" in host else host
        allowed = tuple(dict.fromkeys((named, "localhost")))
    return HttpDoor(host, port, token, tls, allowed), made


class BearerGate:
    """Every HTTP request (and WebSocket) carries ``Authorization: Bearer TOKEN`` or gets
    401 with ``WWW-Authenticate: Bearer`` before the MCP app sees it."""

    def __init__(self, app: ASGIApp, token: bytes) -> None:
        self.app = app
        self.token = token
        self.refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(given) != 1 or not bearer_ok(given[0], self.token):
                self.refused += 1
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = b"Authorization: Bearer TOKEN (the token in sandvisor mcp's --token-file)\n"
                headers = [
                    (b"www-authenticate", b'Bearer realm="sandvisor mcp"'),
                    (b"content-type", b"text/plain"),
                    (b"content-length", str(len(body)).encode()),
                ]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def http_app(server: MCPServer, door: HttpDoor) -> BearerGate:
    """The streamable HTTP app behind the token, with the SDK's DNS-rebinding check on the
    Host and Origin headers (every plain-HTTP bind: loopback ones included)."""
    from mcp.server.transport_security import TransportSecuritySettings

    if door.allowed_hosts is None:
        security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    else:
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=[f"{h}:*" for h in door.allowed_hosts],
            allowed_origins=[f"http://{h}:*" for h in door.allowed_hosts],
        )
    app = server.streamable_http_app(host=door.host, transport_security=security)
    return BearerGate(app, door.token)


def run(socket: str | None, door: HttpDoor | None) -> None:
    """Serve on stdio, or streamable HTTP through ``door`` (see :func:`http_door`)."""
    import anyio

    server = build(socket)
    if door is None:
        anyio.run(server.run_stdio_async, backend="trio")
        return
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"[{door.host}]:{door.port}" if ":" in door.host else f"{door.host}:{door.port}"]
    config.accesslog = None
    if door.tls is not None:
        config.certfile, config.keyfile = door.tls
    trio.run(serve, http_app(server, door), config)  # type: ignore[arg-type]
