"""docs/agents.md's "Every SDK call" table stays true: every public method and property
of the pinned ``e2b`` and ``e2b-code-interpreter`` SDKs' classes (sync and asyncio) has
a row there, with a status, and no row names a call the SDK does not have."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

e2b = pytest.importorskip("e2b")
ci = pytest.importorskip("e2b_code_interpreter")

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
STATUSES = {"served", "local", "not served"}
_ROW = re.compile(r"^\| `([A-Za-z]+)\.([A-Za-z_*]+)` \| ([a-z ]+) \| (.+) \|$")


def classes() -> dict[str, list[type]]:
    """The SDK's classes by the name the table uses (asyncio twins under the same name)."""
    from e2b.sandbox_async.commands.command import Commands as AsyncCommands
    from e2b.sandbox_async.commands.command_input_handle import AsyncCommandInputHandle
    from e2b.sandbox_async.commands.pty import Pty as AsyncPty
    from e2b.sandbox_async.filesystem.filesystem import Filesystem as AsyncFilesystem
    from e2b.sandbox_async.git import Git as AsyncGit
    from e2b.sandbox_sync.commands.command import Commands
    from e2b.sandbox_sync.commands.pty import Pty
    from e2b.sandbox_sync.filesystem.filesystem import Filesystem

    return {
        "Sandbox": [e2b.Sandbox, e2b.AsyncSandbox, ci.Sandbox, ci.AsyncSandbox],
        "Commands": [Commands, AsyncCommands],
        "CommandHandle": [e2b.CommandHandle, e2b.AsyncCommandHandle],
        "CommandInputHandle": [AsyncCommandInputHandle],
        "Filesystem": [Filesystem, AsyncFilesystem],
        "WatchHandle": [e2b.WatchHandle, e2b.AsyncWatchHandle],
        "Pty": [Pty, AsyncPty],
        "Git": [e2b.Git, AsyncGit],
        "SandboxPaginator": [e2b.SandboxPaginator, e2b.AsyncSandboxPaginator],
        "SnapshotPaginator": [e2b.SnapshotPaginator, e2b.AsyncSnapshotPaginator],
        "Template": [e2b.Template, e2b.AsyncTemplate],
        "Secret": [e2b.Secret, e2b.AsyncSecret],
        "SecretPaginator": [e2b.SecretPaginator, e2b.AsyncSecretPaginator],
        "Volume": [e2b.Volume, e2b.AsyncVolume],
    }


def sdk_calls() -> set[str]:
    return {
        f"{name}.{member}"
        for name, group in classes().items()
        for cls in group
        for member, _ in inspect.getmembers(cls)
        if not member.startswith("_")
    }


def table() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    section = text[text.index("### Every SDK call") :]
    section = section[: section.index("\n### ", 1)]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m:
            call = f"{m.group(1)}.{m.group(2)}"
            assert call not in rows, f"{call}: two rows"
            rows[call] = (m.group(3), m.group(4))
    return rows


def covered(call: str, rows: dict[str, tuple[str, str]]) -> bool:
    return call in rows or any(r.endswith("*") and call.startswith(r[:-1]) for r in rows)


def test_every_sdk_call_has_a_row() -> None:
    rows = table()
    missing = sorted(c for c in sdk_calls() if not covered(c, rows))
    assert not missing, f"not in docs/agents.md's table: {missing}"


def test_every_row_is_an_sdk_call_with_a_status_and_a_reason() -> None:
    rows, calls = table(), sdk_calls()
    for call, (status, why) in rows.items():
        assert status in STATUSES, call
        assert why.strip(), call
        if call.endswith("*"):
            assert any(c.startswith(call[:-1]) for c in calls), call
        else:
            assert call in calls, f"{call}: not a call of the pinned SDKs"


def test_the_table_is_of_the_pinned_versions() -> None:
    from importlib.metadata import version

    text = DOC.read_text()
    assert f"`e2b` {version('e2b')}" in text and f"`e2b-code-interpreter` {version('e2b-code-interpreter')}" in text
