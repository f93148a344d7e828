"""The code interpreter on the method table (docs/code.md): ``RunCode`` runs a cell in a
Jupyter kernel inside the sandbox and streams its messages as they come (stdout,
stderr, results with their MIME bundles, the error, the execution count), and the
context calls make, list, restart and remove kernels.

The kernel runtime is the E2B endpoint's (:mod:`supervisor.serve.kernels`): one kernel
server per sandbox (images/kernel_server.py, a daemon of the guest started by the
first call), reached through a relay Exec open only while calls are in flight (a
task in the registry's nursery), found by the sandbox's uid. The Exec is the domain's
own (``Sandbox.exec_session``), driven through :class:`_Target`, the shape
:class:`~supervisor.serve.kernels.KernelHost` drives.

Who may: a principal that may exec in the sandbox (Run's and Exec's rule: it sees the
sandbox); anyone else gets NOT_FOUND as for no sandbox. An image without the kernel
runtime (python3 with ipykernel and jupyter_client) is FAILED_PRECONDITION naming the
profile to build. A cell past its ``timeout_seconds`` is interrupted in the kernel
(its error is ``TimeoutError``) and the next cell runs; a cancelled call (the client's
cancel, a deadline, a disconnect) interrupts its cell too.
"""

from __future__ import annotations

import contextlib
import json
import re
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import attrs
import trio

from actors.face import (
    CommandNotRun,
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Registry,
    Sandbox,
    Unavailable,
)
from guestd import proto
from supervisor.serve import access
from supervisor.serve.api_table import CallIO, Table
from supervisor.serve.kernels import KernelError, KernelHost, Kernels, value_of
from supervisor.wire import errors, protocol

TABLE = Table()
method = TABLE.method
NO_RUNTIME = (
    "this sandbox's image has no kernel runtime (python3 with ipykernel and jupyter_client): "
    "build it with `sandvisor image build --profile code-interpreter` and create the sandbox "
    "with the code-interpreter image"
)
_MISSING = re.compile(r"No module named|NoSuchKernel|No such kernel|exec python3")
_KERNELS: weakref.WeakKeyDictionary[Registry, Kernels] = weakref.WeakKeyDictionary()
_TEXT = ("text", "html", "markdown", "png", "jpeg", "svg", "pdf", "latex", "javascript")
MAX_TEXT = 1 << 20  # chars of stdout or stderr in one message (a longer piece is split)
MAX_RESULT = 3 << 20  # bytes of a result's representations together (the wire's frame is 4 MiB)
OMITTED = "application/vnd.sandvisor.omitted+json"  # extra: the representations left out, with their sizes


# --- the kernel server of a sandbox, through the domain's Exec ----------------------------------
@attrs.frozen
class _Out:
    stream: str
    data: bytes


class _Execd:
    """An exec session as :class:`KernelHost` reads it: outputs, then ("exit", b"")."""

    def __init__(self, h: Any) -> None:
        self.h = h
        self.it = h.__aiter__()
        self.ended = False

    async def send(self, data: bytes) -> None:
        await self.h.send_stdin(data)

    async def close_stdin(self) -> None:
        await self.h.close_stdin()

    def __aiter__(self) -> _Execd:
        return self

    async def __anext__(self) -> _Out:
        if self.ended:
            raise StopAsyncIteration
        try:
            ch, data = await self.it.__anext__()
        except StopAsyncIteration:
            self.ended = True
            return _Out("exit", b"")
        except DomainError as exc:
            raise errors.error_for(exc.code.value, exc.message) from None
        return _Out("stderr" if ch == proto.STDERR else "stdout", data)


class _NotRun(_Execd):
    """A command the guest could not start: its reason on stderr, then its end."""

    def __init__(self, exc: CommandNotRun) -> None:
        self.outs = [_Out("stderr", exc.stderr), _Out("exit", b"")]

    async def send(self, data: bytes) -> None:
        raise errors.error_for(errors.UNAVAILABLE, "the kernel server did not start")

    async def close_stdin(self) -> None:
        pass

    async def __anext__(self) -> _Out:
        if not self.outs:
            raise StopAsyncIteration
        return self.outs.pop(0)


@attrs.frozen
class _Target:
    """A sandbox as :class:`KernelHost` drives it (the E2B endpoint's targets are its
    SDK's): ``client.acting()``, ``handle().exec(argv, workdir=)``, ``sandbox``, ``uid``."""

    sb: Sandbox

    @property
    def sandbox(self) -> str:
        return self.sb.id

    @property
    def uid(self) -> str:
        return self.sb.record.uid

    @property
    def client(self) -> _Target:
        return self

    def acting(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # (the call was checked: the host acts as the supervisor)

    def handle(self) -> _Target:
        return self

    @contextlib.asynccontextmanager
    async def exec(self, argv: list[str], *, workdir: str = "") -> AsyncIterator[_Execd]:
        async with contextlib.AsyncExitStack() as stack:
            try:
                h = await stack.enter_async_context(self.sb.exec_session(argv, env={}, cwd=workdir))
            except CommandNotRun as exc:
                h = None
                yield _NotRun(exc)
            except DomainError as exc:
                raise errors.error_for(exc.code.value, exc.message) from None
            if h is not None:
                yield _Execd(h)


def _kernels(reg: Registry) -> Kernels:
    """The registry's kernel servers (their relays in its nursery); those of sandboxes
    that are gone are dropped."""
    nursery = reg.lives
    if nursery is None:
        raise Unavailable("the supervisor is not running")
    found = _KERNELS.get(reg)
    if found is None or found.nursery is not nursery:
        found = _KERNELS[reg] = Kernels(nursery)
    live = {sb.record.uid for sb in reg.sandboxes.values()}
    for uid, host in list(found.hosts.items()):
        if uid not in live and host.idle:  # (its sandbox is gone, and no relay runs)
            found.forget(uid)
    return found


def _host(reg: Registry, io: CallIO, id: str) -> KernelHost:
    """``id``'s kernel server (started if it runs none), for a caller that may exec there."""
    sb = access.sandbox(reg, io.principal, id)
    return _kernels(reg).host(_Target(sb))


def _domain(err: KernelError) -> DomainError:
    """The kernel runtime's refusal as sandbox.v1's code."""
    if err.status == 502 and _MISSING.search(err.message):
        return FailedPrecondition(f"{NO_RUNTIME} ({err.message[-300:]})")
    if err.status == 400:
        return InvalidArgument(err.message)
    if err.status == 404:
        return NotFound(err.message)
    return Unavailable(err.message)


@contextlib.contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except KernelError as err:
        raise _domain(err) from None


async def _unary(host: KernelHost, op: str, **fields: Any) -> Any:
    with _mapped():
        return await host.unary(op, **fields)


# --- the kernel server's lines as the wire's ---------------------------------------------------
def _json_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def code_output(msg: Any) -> protocol.CodeOutput | None:
    """One line of a cell (E2B's code-interpreter shape) as a :class:`protocol.CodeOutput`;
    None for a line of another kind (the guest's word: anything)."""
    if not isinstance(msg, dict):
        return None
    kind = msg.get("type")
    if kind in ("stdout", "stderr"):
        ts = msg.get("timestamp")
        return protocol.CodeOutput(kind=kind, text=str(msg.get("text", "")), timestamp=ts if isinstance(ts, int) else 0)
    if kind == "result":
        fields = {k: str(msg[k]) for k in _TEXT if isinstance(msg.get(k), str)}
        if msg.get("json") is not None:
            fields["json"] = _json_text(msg["json"])
        if msg.get("chart") is not None:
            fields["chart"] = _json_text(msg["chart"])
        extra = msg.get("extra")
        result = protocol.CodeResult(
            is_main_result=bool(msg.get("is_main_result")),
            extra={str(k): json.dumps(v) for k, v in extra.items()} if isinstance(extra, dict) else {},
            **fields,
        )
        return protocol.CodeOutput(kind="result", result=result)
    if kind == "error":
        error = protocol.CodeError(
            name=str(msg.get("name", "")), value=str(msg.get("value", "")), traceback=str(msg.get("traceback", ""))
        )
        return protocol.CodeOutput(kind="error", error=error)
    if kind == "number_of_executions":
        count = msg.get("execution_count")
        return protocol.CodeOutput(kind="execution_count", execution_count=count if isinstance(count, int) else 0)
    return None


def fitted(out: protocol.CodeOutput) -> list[protocol.CodeOutput]:
    """``out`` as messages that fit the wire's frame: a long stdout or stderr piece split,
    a result's largest representations left out (named in ``extra``) past
    :data:`MAX_RESULT`."""
    if out.kind in ("stdout", "stderr") and len(out.text) > MAX_TEXT:
        return [attrs.evolve(out, text=out.text[i : i + MAX_TEXT]) for i in range(0, len(out.text), MAX_TEXT)]
    r = out.result
    if r is None:
        return [out]
    sizes = {f: len(getattr(r, f).encode()) for f in (*_TEXT, "json", "chart")}
    sizes.update({f"extra:{k}": len(k.encode()) + len(v.encode()) for k, v in r.extra.items()})
    total, omitted = sum(sizes.values()), {}
    for name, size in sorted(sizes.items(), key=lambda kv: -kv[1]):
        if total <= MAX_RESULT:
            break
        omitted[name.removeprefix("extra:")] = size
        total -= size
    if not omitted:
        return [out]
    extra = {k: v for k, v in r.extra.items() if k not in omitted} | {OMITTED: json.dumps(omitted)}
    fields: dict[str, Any] = attrs.asdict(r) | {f: "" for f in (*_TEXT, "json", "chart") if f in omitted}
    return [attrs.evolve(out, result=protocol.CodeResult(**(fields | {"extra": extra})))]


# --- the methods ---------------------------------------------------------------------------------
@method("RunCode", protocol.RunCodeRequest, streams=True)
async def _run_code(reg: Registry, io: CallIO, req: protocol.RunCodeRequest) -> None:
    if req.timeout_seconds < 0:
        raise InvalidArgument("timeout_seconds must not be negative")
    host = _host(reg, io, req.id)
    with _mapped():
        rid, recv = await host.call(
            "execute",
            code=req.code,
            context=req.context or None,
            language=req.language or None,
            envs=dict(req.envs),
            timeout=req.timeout_seconds or None,
        )
    ended = False
    try:
        async with recv:
            async for msg in recv:
                if msg.get("done"):
                    ended = True
                    with _mapped():
                        value_of(msg)
                    return
                out = code_output(msg.get("msg"))
                for piece in fitted(out) if out is not None else ():
                    await io.send(piece)
        ended = True
        raise Unavailable(f"code interpreter unavailable: {host.failed or 'the kernel server ended'}")
    finally:
        if not ended:  # cancelled mid-cell (or its client went away): the kernel is interrupted
            with trio.CancelScope(shield=True), trio.move_on_after(5), contextlib.suppress(Exception):
                await host.interrupt(rid)


def _context(value: Any) -> protocol.CodeContext:
    v = value if isinstance(value, dict) else {}
    return protocol.CodeContext(id=str(v.get("id", "")), language=str(v.get("language", "")), cwd=str(v.get("cwd", "")))


@method("CreateCodeContext", protocol.CreateCodeContextRequest)
async def _create_context(reg: Registry, io: CallIO, req: protocol.CreateCodeContextRequest) -> protocol.CodeContext:
    if req.cwd and not req.cwd.startswith("/"):
        raise InvalidArgument("cwd must be absolute")
    host = _host(reg, io, req.id)
    return _context(await _unary(host, "create", language=req.language or None, cwd=req.cwd or None))


@method("ListCodeContexts", protocol.IdRequest)
async def _list_contexts(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.ListCodeContextsResponse:
    value = await _unary(_host(reg, io, req.id), "list")
    return protocol.ListCodeContextsResponse(contexts=[_context(v) for v in (value if isinstance(value, list) else [])])


@method("RestartCodeContext", protocol.CodeContextRequest)
async def _restart_context(reg: Registry, io: CallIO, req: protocol.CodeContextRequest) -> None:
    await _unary(_host(reg, io, req.id), "restart", context=req.context)


@method("RemoveCodeContext", protocol.CodeContextRequest)
async def _remove_context(reg: Registry, io: CallIO, req: protocol.CodeContextRequest) -> None:
    await _unary(_host(reg, io, req.id), "remove", context=req.context)
