"""What the CLI prints through rich is printed verbatim: brackets in messages, names,
labels and paths are text, never markup (``pip install 'sandvisor[mcp]'`` keeps its
``[mcp]``; a ``[red]x`` label stays ``[red]x``). Also the ``logs --since/--until`` times."""

from __future__ import annotations

import argparse
import io
import sys

import pytest
from rich.console import Console

from supervisor.client.cli_common import unix_ns
from supervisor.client.cli_output import markup_escape, print_table, rich_table
from supervisor.main import cli


def test_an_error_message_keeps_its_brackets(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.fail("pip install 'sandvisor[mcp]', label [red]x, path /tmp/[b]/y\\[z] :smile:")
    assert exc.value.code == 1
    assert (
        capsys.readouterr().err == "error: pip install 'sandvisor[mcp]', label [red]x, path /tmp/[b]/y\\[z] :smile:\n"
    )


def test_mcp_without_its_extra_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "supervisor.serve.mcp_server", None)  # import -> ImportError
    with pytest.raises(SystemExit) as exc:
        cli.main(["mcp"])
    assert exc.value.code == 1
    assert "pip install 'sandvisor[mcp]'" in capsys.readouterr().err


def test_table_cells_are_data(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # a cell with "[" is one plain_table hands to rich: rich prints it as it is
    monkeypatch.setenv("COLUMNS", "120")
    print_table(("ID", "LABELS"), [("[bold]sb", "team=[red]x"), ("b:smile:", "k=[/]")])
    out = capsys.readouterr().out
    assert "[bold]sb" in out and "team=[red]x" in out and "k=[/]" in out and "b:smile:" in out

    buf = io.StringIO()
    Console(file=buf, width=80, force_terminal=True, color_system="standard", _environ={}).print(
        rich_table(("L",), [("[red]x",)], show_header=False)
    )
    assert "[red]x" in buf.getvalue() and "\x1b[31m" not in buf.getvalue()


def test_escaped_markup_prints_verbatim() -> None:
    buf = io.StringIO()
    data = "[red]x [mcp] a\\[b]"
    Console(file=buf, width=200, _environ={}).print(f"[bold]name:[/] {markup_escape(data)}")
    assert buf.getvalue() == "name: [red]x [mcp] a\\[b]\n"


def test_log_times() -> None:
    assert unix_ns("1700000000123456789") == 1700000000123456789
    assert unix_ns("2026-01-02T03:04:05Z") == 1767323045 * 10**9
    assert unix_ns("2026-01-02T03:04:05.5") == 1767323045 * 10**9 + 500_000_000  # no zone: UTC
    assert unix_ns("2026-01-02T04:04:05+01:00") == 1767323045 * 10**9
    with pytest.raises(argparse.ArgumentTypeError):
        unix_ns("yesterday")
