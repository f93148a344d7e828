"""How the client commands print: JSON, timestamps and sizes, tables as rich prints them,
a pull's progress.

print_table prints what rich's Console().print(Table(*headers, box=None)) prints, byte
for byte, without importing rich (~25 ms): cells padded by one space each side, the
header bold on a terminal. Where rich would do more (markup, emoji codes, wide or
control characters, a table wider than the console, colour forced by the
environment) it hands the table to rich. tests/unit/test_frames.py holds it to rich.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms; mypy reads the name)
if TYPE_CHECKING:
    from typing import Any


def ts(unix: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S") if unix else "-"


def print_json(obj: Any) -> None:
    import json

    def default(o: Any) -> Any:
        if isinstance(o, bytes):
            return o.decode(errors="replace")
        raise TypeError(type(o).__name__)

    print(json.dumps(obj, default=default, sort_keys=True))


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

        Console().print(rich_table(headers, rows, show_header=show_header))
        return
    sys.stdout.write(text)
    sys.stdout.flush()


def rich_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, show_header: bool = True) -> Any:
    """The table rich prints; cells are data (names, labels, errors), printed verbatim
    (a ``[red]`` in a label is text, not markup)."""
    from rich.table import Table
    from rich.text import Text

    t = Table(*headers, box=None, show_header=show_header)
    for r in rows:
        t.add_row(*(Text(c) for c in r))
    return t


def markup_escape(text: object) -> str:
    """``text`` for a rich markup string: brackets in data (``pip install 'x[mcp]'``, a
    ``[red]`` label, a path) print as they are."""
    from rich.markup import escape

    return escape(str(text))


def mib(n: int) -> str:
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
        size = f" {mib(done)}/{mib(total)}" if total else ""
        line = f"{phase}: {message}{size}".rstrip(": ")
        if self.tty:
            sys.stderr.write(f"\r\x1b[K{line}" + ("\n" if phase == "done" else ""))
            sys.stderr.flush()
        elif phase != self.last:
            print(line, file=sys.stderr, flush=True)
        self.last = phase
