"""The code interpreter's bodies (docs/code.md): a cell run in a sandbox's Jupyter
kernel (``RunCode``, a server stream of :class:`CodeOutput`) and its contexts.

The field order of each class is the msgpack wire's (:mod:`supervisor.wire.protocol`).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class RunCodeRequest:
    id: str
    code: str
    language: str = ""  # the default context of this language ("": python)
    context: str = ""  # a context's id (from CreateCodeContext); "" the language's default
    envs: dict[str, str] = attrs.field(factory=dict)  # set in the kernel's os.environ before the cell
    timeout_seconds: float = 0.0  # the cell is interrupted past it (0: no limit); the next cell runs


@attrs.frozen
class CodeResult:
    """One result of a cell with its MIME bundle (the representations the kernel gave):
    ``png``, ``jpeg`` and ``pdf`` are base64, ``json`` is JSON text; other MIME types are
    in ``extra`` (JSON text each). ``is_main_result``: the cell's value (its last
    expression), not a display."""

    is_main_result: bool = False
    text: str = ""
    html: str = ""
    markdown: str = ""
    png: str = ""
    jpeg: str = ""
    svg: str = ""
    pdf: str = ""
    latex: str = ""
    json: str = ""
    javascript: str = ""
    chart: str = ""  # a chart's structured data (JSON text) where the kernel gives it
    extra: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class CodeError:
    name: str
    value: str = ""
    traceback: str = ""


@attrs.frozen
class CodeOutput:
    """One message of a cell as it comes: ``kind`` stdout or stderr (``text``,
    ``timestamp`` in ns since the epoch), result, error, or execution_count."""

    kind: str
    text: str = ""
    timestamp: int = 0
    result: CodeResult | None = None
    error: CodeError | None = None
    execution_count: int = 0


@attrs.frozen
class CreateCodeContextRequest:
    id: str
    cwd: str = ""  # "" /home/user (made if missing)
    language: str = ""  # "" python


@attrs.frozen
class CodeContext:
    id: str
    language: str = ""
    cwd: str = ""


@attrs.frozen
class CodeContextRequest:
    id: str  # the sandbox
    context: str  # the context's id


@attrs.frozen
class ListCodeContextsResponse:
    contexts: list[CodeContext] = attrs.field(factory=list)
