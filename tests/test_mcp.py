"""``sandvisor mcp`` driven by the ``mcp`` package's own client over stdio, against a
throwaway supervisor and a real VM: the tools listed with their schemas; create, run
(with progress notifications), write, read, list, list_sandboxes, an error's code, remove."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip("mcp")

from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from actors.net.ports import free_port
from supervisor.throwaway import supervisor, workdir

TOOLS = {
    "create_sandbox",
    "run_command",
    "write_file",
    "read_file",
    "list_files",
    "checkpoint",
    "restore",
    "remove_sandbox",
    "list_sandboxes",
}


def _result(r: Any) -> dict[str, Any]:
    assert not r.is_error, r.content
    if isinstance(r.structured_content, dict):
        return r.structured_content
    return json.loads(r.content[0].text)  # type: ignore[no-any-return]


@pytest.mark.vm
async def test_mcp_over_stdio() -> None:
    with workdir("sv-mcp-") as work:
        async with supervisor(work) as _:
            params = StdioServerParameters(
                command=sys.executable, args=["-m", "supervisor.cli", "mcp", "--socket", str(work.socket)]
            )
            with trio.fail_after(600):
                async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
                    await s.initialize()
                    tools = {t.name: t for t in (await s.list_tools()).tools}
                    assert set(tools) == TOOLS
                    for t in tools.values():
                        assert t.description and t.input_schema["type"] == "object", t.name
                    assert "ttl_seconds" in tools["create_sandbox"].input_schema["properties"]
                    assert tools["run_command"].input_schema["required"] == ["sandbox_id", "command"]

                    created = _result(await s.call_tool("create_sandbox", {"ttl_seconds": 900}))
                    sid = created["id"]
                    try:
                        progress: list[float] = []

                        async def on_progress(p: float, total: float | None, message: str | None) -> None:
                            progress.append(p)

                        run = _result(
                            await s.call_tool(
                                "run_command",
                                {"sandbox_id": sid, "command": "echo hi; sleep 3; echo oops >&2; exit 3"},
                                progress_callback=on_progress,
                            )
                        )
                        assert run == {"exit_code": 3, "stdout": "hi\n", "stderr": "oops\n"}
                        assert len(progress) >= 2, "a run of seconds sends progress notifications, output or not"

                        content = "héllo\n" * 100
                        w = {"sandbox_id": sid, "path": "/tmp/mcp/a.txt", "content": content}
                        await s.call_tool("run_command", {"sandbox_id": sid, "command": "mkdir -p /tmp/mcp"})
                        assert _result(await s.call_tool("write_file", w))["bytes"] == len(content.encode())
                        r = _result(await s.call_tool("read_file", {"sandbox_id": sid, "path": "/tmp/mcp/a.txt"}))
                        assert r["content"] == content
                        listed = _result(await s.call_tool("list_files", {"sandbox_id": sid, "path": "/tmp/mcp"}))
                        assert listed["entries"] == [
                            {"path": "/tmp/mcp/a.txt", "type": "file", "size": 700, "permissions": "-rw-r--r--"}
                        ]
                        mine = _result(await s.call_tool("list_sandboxes", {"mine": True}))
                        assert [b["id"] for b in mine["sandboxes"]] == [sid]

                        snap = _result(await s.call_tool("checkpoint", {"sandbox_id": sid, "name": "mcp-snap"}))
                        assert snap["snapshot_id"] and snap["name"] == "mcp-snap"
                        clone = _result(await s.call_tool("restore", {"snapshot": "mcp-snap", "ttl_seconds": 600}))
                        cat = {"sandbox_id": clone["id"], "command": "cat /tmp/mcp/a.txt"}
                        assert _result(await s.call_tool("run_command", cat))["stdout"] == content
                        await s.call_tool("remove_sandbox", {"sandbox_id": clone["id"]})

                        missing = await s.call_tool("read_file", {"sandbox_id": sid, "path": "/nope"})
                        assert missing.is_error and "NOT_FOUND: " in missing.content[0].text
                        unknown = await s.call_tool("run_command", {"sandbox_id": "no-such", "command": "true"})
                        assert unknown.is_error and "NOT_FOUND: " in unknown.content[0].text
                    finally:
                        removed = _result(await s.call_tool("remove_sandbox", {"sandbox_id": sid}))
                    assert removed == {"removed": sid}
                    assert _result(await s.call_tool("list_sandboxes", {}))["sandboxes"] == []


def test_mcp_over_streamable_http(tmp_path: Path) -> None:
    """``--http``: the same tools over MCP's streamable HTTP (listing them needs no
    supervisor). The client runs on asyncio (its HTTP stack's generators are finalized
    by asyncio's hooks, where Trio's would warn)."""
    import asyncio
    import socket
    import subprocess
    import time

    from mcp.client.streamable_http import streamable_http_client

    port = free_port("127.0.0.1", "tcp")
    argv = [sys.executable, "-m", "supervisor.cli", "mcp", "--socket", str(tmp_path / "none.sock")]
    proc = subprocess.Popen([*argv, "--http", f"127.0.0.1:{port}"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:  # until it listens, bounded
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)

        async def client() -> tuple[set[str], Any]:
            url = f"http://127.0.0.1:{port}/mcp"
            async with streamable_http_client(url) as (read, write), ClientSession(read, write) as s:
                await s.initialize()
                names = {t.name for t in (await s.list_tools()).tools}
                return names, await s.call_tool("list_sandboxes", {})

        names, r = asyncio.run(asyncio.wait_for(client(), 120))
        assert names == TOOLS
        assert r.is_error and "UNAVAILABLE: " in r.content[0].text  # no supervisor there
    finally:
        proc.terminate()
        proc.wait(timeout=30)
