"""The plans of the code interpreter (see :mod:`supervisor.client.sdk.ops`; docs/code.md):
``run_code`` (a cell in a Jupyter kernel in the sandbox, as E2B's Code Interpreter SDK
runs it) and the code contexts, with their result types.

Callbacks (``on_stdout``, ``on_stderr``, ``on_result``, ``on_error``) are plain
functions, called as each message arrives (in the Trio SDK too: called, not awaited).
"""

from __future__ import annotations

import base64
import builtins
import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from supervisor.client.sdk.ops import Open, Plan, Receive, Target, Unary
from supervisor.wire import protocol

FORMATS = ("text", "html", "markdown", "png", "jpeg", "svg", "pdf", "latex", "json", "javascript", "chart")
IMAGES = {"png": "png", "jpeg": "jpg", "svg": "svg", "pdf": "pdf"}  # format -> a file's suffix


@attrs.frozen
class OutputMessage:
    """A piece of stdout or stderr as it came (``timestamp``: ns since the epoch)."""

    line: str
    timestamp: int = 0
    error: bool = False  # stderr

    def __str__(self) -> str:
        return self.line


@attrs.frozen
class ExecutionError:
    """The cell's error: the exception's ``name`` and ``value``, and the traceback."""

    name: str
    value: str = ""
    traceback: str = ""


@attrs.frozen
class Result:
    """One result of a cell, with each representation the kernel gave: ``png``, ``jpeg``
    and ``pdf`` base64 (:meth:`data` decodes), ``json`` and ``chart`` parsed, other MIME
    types in ``extra`` (parsed). ``is_main_result``: the cell's value (its last
    expression), not a display (a plot, ``display(...)``)."""

    is_main_result: bool = False
    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    png: str | None = None
    jpeg: str | None = None
    svg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json: Any = None
    javascript: str | None = None
    chart: Any = None
    extra: dict[str, Any] = attrs.field(factory=dict)

    def formats(self) -> builtins.list[str]:
        """The representations this result has (``text`` , ``png``, ..., then ``extra``'s MIME types)."""
        return [f for f in FORMATS if getattr(self, f) is not None] + builtins.list(self.extra)

    def data(self, fmt: str) -> bytes:
        """Representation ``fmt`` as bytes: base64-decoded for png, jpeg and pdf."""
        value = getattr(self, fmt)
        if value is None:
            raise KeyError(f"this result has no {fmt}")
        if fmt in ("png", "jpeg", "pdf"):
            return base64.b64decode(value)
        return (value if isinstance(value, str) else json.dumps(value)).encode()


@attrs.define
class Logs:
    stdout: builtins.list[str] = attrs.field(factory=list)
    stderr: builtins.list[str] = attrs.field(factory=list)


@attrs.define
class Execution:
    """A cell's run: its results (displays and the main result), its stdout and stderr
    as they came, its error (None: it ran through) and its execution count."""

    results: builtins.list[Result] = attrs.field(factory=list)
    logs: Logs = attrs.field(factory=Logs)
    error: ExecutionError | None = None
    execution_count: int | None = None

    @property
    def text(self) -> str | None:
        """The main result's text (None: the cell had no value)."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None


@attrs.frozen
class CodeContext:
    """A kernel of the sandbox: cells run in one share its variables."""

    id: str
    language: str = ""
    cwd: str = ""


ContextRef = CodeContext | str


def _ctx_id(context: ContextRef | None) -> str:
    return context.id if isinstance(context, CodeContext) else (context or "")


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def result_of(r: protocol.CodeResult) -> Result:
    """A wire result as a :class:`Result` (empty representations are absent)."""
    fields: dict[str, Any] = {f: getattr(r, f) or None for f in FORMATS if f not in ("json", "chart")}
    return Result(
        is_main_result=r.is_main_result,
        json=_parsed(r.json) if r.json else None,
        chart=_parsed(r.chart) if r.chart else None,
        extra={k: _parsed(v) for k, v in r.extra.items()},
        **fields,
    )


Callback = Callable[[Any], object] | None


def apply(
    ex: Execution,
    out: protocol.CodeOutput,
    on_stdout: Callback = None,
    on_stderr: Callback = None,
    on_result: Callback = None,
    on_error: Callback = None,
) -> None:
    """One message of a cell into ``ex``, and to its callback."""
    if out.kind in ("stdout", "stderr"):
        err = out.kind == "stderr"
        (ex.logs.stderr if err else ex.logs.stdout).append(out.text)
        cb = on_stderr if err else on_stdout
        if cb is not None:
            cb(OutputMessage(out.text, out.timestamp, err))
    elif out.kind == "result" and out.result is not None:
        res = result_of(out.result)
        ex.results.append(res)
        if on_result is not None:
            on_result(res)
    elif out.kind == "error" and out.error is not None:
        ex.error = ExecutionError(out.error.name, out.error.value, out.error.traceback)
        if on_error is not None:
            on_error(ex.error)
    elif out.kind == "execution_count":
        ex.execution_count = out.execution_count


def run_code(
    t: Target,
    code: str,
    *,
    language: str | None = None,
    context: ContextRef | None = None,
    on_stdout: Callback = None,
    on_stderr: Callback = None,
    on_result: Callback = None,
    on_error: Callback = None,
    envs: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> Plan[Execution]:
    """Run ``code`` as a cell in a kernel of the sandbox (``context``, or the default
    context of ``language``, python unless named): variables persist between cells of
    one context. Messages are streamed as they come (the callbacks get each); the
    :class:`Execution` holds them all. Past ``timeout`` seconds the cell is
    interrupted (its error is ``TimeoutError``) and the next cell runs. ``envs`` are set
    in the kernel's ``os.environ`` first. The image needs the kernel runtime
    (``sandvisor image build --profile code-interpreter``; else FailedPrecondition)."""
    if context is not None and language is not None:
        raise ValueError("run_code: give language or context, not both")
    req = protocol.RunCodeRequest(
        id=t.id,
        code=code,
        language=language or "",
        context=_ctx_id(context),
        envs=dict(envs or {}),
        timeout_seconds=float(timeout or 0),
    )
    call = yield Open("RunCode", req)
    ex = Execution()
    while (item := (yield Receive(call, protocol.CodeOutput))) is not None:
        apply(ex, item, on_stdout, on_stderr, on_result, on_error)
    return ex


def _context(c: protocol.CodeContext) -> CodeContext:
    return CodeContext(c.id, c.language, c.cwd)


def create_code_context(t: Target, cwd: str | None = None, language: str | None = None) -> Plan[CodeContext]:
    """A new kernel (``language``: python; its working directory ``cwd``, /home/user
    unless named, made if missing)."""
    req = protocol.CreateCodeContextRequest(id=t.id, cwd=cwd or "", language=language or "")
    c: protocol.CodeContext = yield Unary("CreateCodeContext", req, protocol.CodeContext)
    return _context(c)


def list_code_contexts(t: Target) -> Plan[builtins.list[CodeContext]]:
    """The sandbox's contexts (the default python context among them, once started)."""
    r: protocol.ListCodeContextsResponse = yield Unary(
        "ListCodeContexts", protocol.IdRequest(id=t.id), protocol.ListCodeContextsResponse
    )
    return [_context(c) for c in r.contexts]


def restart_code_context(t: Target, context: ContextRef | None = None) -> Plan[None]:
    """Restart a context's kernel: its variables go (None: the default python context)."""
    yield Unary("RestartCodeContext", protocol.CodeContextRequest(id=t.id, context=_ctx_id(context)), protocol.Empty)


def remove_code_context(t: Target, context: ContextRef) -> Plan[None]:
    """Shut a context's kernel down (one made by :func:`create_code_context`)."""
    yield Unary("RemoveCodeContext", protocol.CodeContextRequest(id=t.id, context=_ctx_id(context)), protocol.Empty)
