"""Every Go snippet of the microsandbox SDK reference has its equivalent in
tests/vm/test_reference_examples.py: a ``# ref N: [Section] first line`` marker inside a
test function, or at module level followed by a ``# no equivalent:`` reason. A snippet
cannot be dropped silently.

A snippet is a Go statement that starts in the first column and calls the SDK
(``m.X``, ``sb.X``), with or without ``a, err :=`` / ``_, err =`` or ``defer`` before it;
its section is the name in the nearest ``func`` signature above it. Lines inside a
snippet are indented in the reference, signatures start with ``func``, headings with a
space, so neither is counted. The reference sits beside the clone (``shared/seeds``);
without it the list below, checked against it whenever it is there, stands in."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SEED_NAME = "shared/seeds/002_ea5c2dbd8b9d50af.plain.txt"
SEED = next((p / SEED_NAME for p in REPO.parents if (p / SEED_NAME).exists()), REPO.parent / SEED_NAME)
MODULE = REPO / "tests/vm/test_reference_examples.py"

SNIPPET = re.compile(r"^(?:\w+(?:, ?\w+)*\s*:?=\s*)?(?:defer\s+)?(?:m|sb)\.[A-Z]\w*")
FUNC = re.compile(r"^func (?:\([^)]*\)\s*)?(\w+)")
MARKER = re.compile(r"^\s*# ref (\d+): \[(\w+)\] (.*)$")

# (section, first line) in order of appearance; the reference is checked against it
VENDORED: tuple[tuple[str, str], ...] = (
    ("CreateSandbox", 'sb, err := m.CreateSandbox(ctx, "api",'),
    ("GetSandbox", 'h, err := m.GetSandbox(ctx, "api")'),
    ("ListSandboxes", "page, err := m.ListSandboxes(ctx)"),
    ("ListSandboxesWith", "page, err := m.ListSandboxesWith("),
    ("StartSandbox", 'sb, err := m.StartSandbox(ctx, "api")'),
    ("RemoveSandbox", 'err := m.RemoveSandbox(ctx, "api")'),
    ("AllSandboxMetrics", "all, err := m.AllSandboxMetrics(ctx)"),
    ("FS", 'err := sb.FS().Write(ctx, "/tmp/hello.txt", []byte("hi"))'),
    ("SSH", "client, err := sb.SSH().OpenClient(ctx)"),
    ("Logs", "entries, err := sb.Logs(ctx, m.LogOptions{"),
    ("LogStream", "stream, err := sb.LogStream(ctx, m.LogStreamOptions{Follow: true})"),
    ("Ping", "health, err := sb.Ping(ctx)"),
    ("Touch", "keepalive, err := sb.Touch(ctx)"),
    ("Modify", "plan, err := sb.Modify(ctx, m.ModifyOptions{CPUs: 4, MemoryMiB: 4096})"),
    ("Modify", "preview, err := sb.Modify(ctx, m.ModifyOptions{MaxMemoryMiB: 16384, DryRun: true})"),
    ("Modify", "_, err = sb.Modify(ctx, m.ModifyOptions{"),
    ("Modify", "_, err = sb.Modify(ctx, m.ModifyOptions{"),
    ("Modify", "_, err = sb.Modify(ctx, m.ModifyOptions{"),
    ("Modify", "_, err = sb.Modify(ctx, m.ModifyOptions{"),
    ("Metrics", "metrics, err := sb.Metrics(ctx)"),
    ("MetricsStream", "stream, err := sb.MetricsStream(ctx, 500*time.Millisecond)"),
    ("AttachWith", 'exitCode, err := sb.AttachWith(ctx, "bash", []string{"-l"},'),
    ("Stop", "err := sb.Stop(ctx, m.WithStopTimeout(30*time.Second))"),
    ("Kill", "err := sb.Kill(ctx)"),
    ("WaitUntilStopped", "result, err := sb.WaitUntilStopped(ctx)"),
    ("Detach", "err := sb.Detach(ctx) // keeps running in the background"),
    ("Close", "defer sb.Close()"),
    ("WithCmd", 'sb, err := m.CreateSandbox(ctx, "worker",'),
    ("WithInit", 'sb, err := m.CreateSandbox(ctx, "worker",'),
    ("WithNetwork", 'sb, err := m.CreateSandbox(ctx, "api",'),
    ("WithPatches", 'sb, err := m.CreateSandbox(ctx, "api",'),
    ("WithMounts", 'sb, err := m.CreateSandbox(ctx, "api",'),
    ("Auto", "m.WithInit(m.Init.Auto())"),
    ("Cmd", "m.WithInit(m.Init.Cmd("),
)


def extract(text: str) -> list[tuple[str, str]]:
    """The reference's snippets, (section, first line), in order of appearance."""
    found: list[tuple[str, str]] = []
    section = ""
    for line in text.splitlines():
        f = FUNC.match(line)
        if f:
            section = f.group(1)
        elif SNIPPET.match(line):
            found.append((section, line.rstrip()))
    return found


def snippets() -> list[tuple[str, str]]:
    return extract(SEED.read_text()) if SEED.exists() else list(VENDORED)


def markers() -> dict[int, list[tuple[str, str, int, str]]]:
    """ref N -> [(section, quoted line, line number, enclosing test function or "")]."""
    source = MODULE.read_text()
    lines = source.splitlines()
    spans = [
        (node.name, node.lineno, node.end_lineno or node.lineno)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    ]
    out: dict[int, list[tuple[str, str, int, str]]] = {}
    for i, line in enumerate(lines, start=1):
        m = MARKER.match(line)
        if m:
            inside = next((name for name, a, b in spans if a <= i <= b), "")
            out.setdefault(int(m.group(1)), []).append((m.group(2), m.group(3), i, inside))
    return out


def test_the_vendored_list_is_the_references() -> None:
    if not SEED.exists():
        pytest.skip("shared/seeds is not beside the repo")
    assert extract(SEED.read_text()) == list(VENDORED)


def test_the_rule_counts_statements_not_signatures_headings_or_inner_lines() -> None:
    text = "\n".join(
        [
            "func CreateSandbox(ctx context.Context) (*Sandbox, error)",
            'sb, err := m.CreateSandbox(ctx, "api",',
            ' m.WithImage("python:3.12"),',
            " m. CreateSandbox() ",
            "func (s *Sandbox) Close() error",
            "defer sb.Close()",
            "if err != nil {",
            " nextPage, err := m.ListSandboxesWith(",
            "_, err = sb.Modify(ctx, m.ModifyOptions{",
        ]
    )
    assert extract(text) == [
        ("CreateSandbox", 'sb, err := m.CreateSandbox(ctx, "api",'),
        ("Close", "defer sb.Close()"),
        ("Close", "_, err = sb.Modify(ctx, m.ModifyOptions{"),
    ]


def test_every_snippet_has_its_equivalent_or_a_written_reason() -> None:
    want = snippets()
    have = markers()
    lines = MODULE.read_text().splitlines()
    missing = [n for n in range(1, len(want) + 1) if n not in have]
    assert not missing, f"snippets with no '# ref N:' in {MODULE.name}: {missing}"
    assert set(have) <= set(range(1, len(want) + 1)), f"markers past the last snippet: {sorted(have)}"
    for n, (section, first) in enumerate(want, start=1):
        for got_section, quoted, lineno, inside in have[n]:
            assert (got_section, quoted) == (section, first), f"ref {n} quotes {quoted!r} of [{got_section}]"
            if not inside:  # outside a test: the reason must follow
                after = lines[lineno].strip() if lineno < len(lines) else ""
                assert after.startswith("# no equivalent:"), f"ref {n} at line {lineno}: no test and no reason"


def test_pending_tests_are_marked_skip_and_kept_apart() -> None:
    """The tests of features still being built are skipped by one reason, below one
    heading, so they are found and un-skipped together."""
    source = MODULE.read_text()
    head, sep, rest = source.partition("# ===== pending:")
    pending = rest.partition("\n")[2]
    assert sep, "the pending section's heading is missing"

    def tests(text: str) -> dict[str, bool]:
        """test name -> skipped as pending"""
        return {
            node.name: any(
                ast.unparse(d) == "PENDING" or ast.unparse(d).startswith("pytest.mark.skip(")
                for d in node.decorator_list
            )
            for node in ast.parse(text).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
        }

    assert not any(tests(head).values()), "a pending test above the pending heading"
    assert all(tests(pending).values()), "an unskipped test in the pending section"
