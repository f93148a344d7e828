"""``sandvisor mcp`` driven by the ``mcp`` package's own client over stdio, against a
throwaway supervisor and a real VM: the tools listed with their schemas; create, run
(with progress notifications), write, read, list, list_sandboxes, an error's code, remove.
Over ``--http``: the bearer token (401 without it, as another local user too), the
loopback-or-TLS rule, the Host check, the token file."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import secrets
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

pytest.importorskip("mcp")

from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from actors.net.ports import free_port
from supervisor.main.throwaway import supervisor, supervisor_process, workdir

R = TypeVar("R")

TOOLS = {
    "create_sandbox",
    "run_command",
    "write_file",
    "read_file",
    "list_files",
    "checkpoint",
    "restore",
    "fork_sandbox",
    "remove_sandbox",
    "list_sandboxes",
    "run_code",
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
                command=sys.executable, args=["-m", "supervisor.main.cli", "mcp", "--socket", str(work.socket)]
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
                        fork = {"sandbox_id": sid, "count": 2, "ttl_seconds": 600}
                        kids = _result(await s.call_tool("fork_sandbox", fork))
                        assert kids["parent"] == sid and len(set(kids["ids"])) == 2
                        for kid in kids["ids"]:
                            cat = {"sandbox_id": kid, "command": "cat /tmp/mcp/a.txt"}
                            assert _result(await s.call_tool("run_command", cat))["stdout"] == content
                            await s.call_tool("remove_sandbox", {"sandbox_id": kid})

                        missing = await s.call_tool("read_file", {"sandbox_id": sid, "path": "/nope"})
                        assert missing.is_error and "NOT_FOUND: " in missing.content[0].text
                        unknown = await s.call_tool("run_command", {"sandbox_id": "no-such", "command": "true"})
                        assert unknown.is_error and "NOT_FOUND: " in unknown.content[0].text
                    finally:
                        removed = _result(await s.call_tool("remove_sandbox", {"sandbox_id": sid}))
                    assert removed == {"removed": sid}
                    assert _result(await s.call_tool("list_sandboxes", {}))["sandboxes"] == []


# ---------------------------------------------------------------------------------------
# --http: a door that checks who is asking (a bearer token; loopback or TLS; Host checked)
# ---------------------------------------------------------------------------------------
NOBODY = 65534
# Debian's python as uid 65534 (the venv may not be readable to it): POST an MCP initialize,
# print the status and the WWW-Authenticate challenge
RAW_CLIENT = """
import json, sys, urllib.error, urllib.request
url, token, host = sys.argv[1:4]
body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}}).encode()
h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
if token:
    h["Authorization"] = "Bearer " + token
if host:
    h["Host"] = host
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    r = opener.open(urllib.request.Request(url, data=body, headers=h), timeout=30)
    print(r.status, r.headers.get("WWW-Authenticate"))
except urllib.error.HTTPError as e:
    print(e.code, e.headers.get("WWW-Authenticate"))
"""


def raw_initialize(url: str, token: str = "", *, uid: int | None = None, host: str = "") -> tuple[int, str]:
    """An MCP initialize over plain HTTP: (status, WWW-Authenticate), as ``uid`` (setpriv,
    no groups) or as we are."""
    prefix = ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups"] if uid is not None else []
    r = subprocess.run(
        [*prefix, "/usr/bin/python3", "-S", "-c", RAW_CLIENT, url, token, host],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
        check=False,
    )
    assert r.returncode == 0, r.stderr
    status, challenge = r.stdout.split(" ", 1)
    return int(status), challenge.strip()


def private_token(path: Path) -> str:
    token = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


@contextmanager
def mcp_http(
    tmp: Path, socket_path: Path, host: str, *args: str, reach: str = "", scheme: str = "http"
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``sandvisor mcp --http HOST:PORT ARGS`` as a child, yielded with its URL (at
    ``reach``, default ``host``) once it listens."""
    reach = reach or host
    port = free_port(reach, "tcp")
    argv = [sys.executable, "-m", "supervisor.main.cli", "mcp", "--socket", str(socket_path)]
    proc = subprocess.Popen([*argv, "--http", f"{host}:{port}", *args], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:  # until it listens, bounded
            try:
                socket.create_connection((reach, port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        yield f"{scheme}://{reach}:{port}/mcp", proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def mcp_client(
    url: str, token: str, work: Callable[[ClientSession], Awaitable[R]], *, verify: ssl.SSLContext | bool = True
) -> R:
    """The mcp package's own streamable HTTP client with the token in its headers (on
    asyncio: its HTTP stack's generators are finalized by asyncio's hooks, where Trio's
    would warn)."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, verify=verify, timeout=60) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as s,
    ):
        await s.initialize()
        return await work(s)


def test_mcp_over_streamable_http_needs_the_token(tmp_path: Path) -> None:
    """``--http``: no token or a wrong one, 401 with a Bearer challenge (127.0.0.2 too: a
    loopback address by its class); the mcp client with the token lists the tools (no
    supervisor needed for that); a Host header naming another host is refused (the SDK's
    DNS-rebinding check, on for every loopback bind)."""
    token = private_token(tmp_path / "token")
    none = tmp_path / "none.sock"
    for host in ("127.0.0.1", "127.0.0.2"):
        with mcp_http(tmp_path, none, host, "--token-file", str(tmp_path / "token")) as (url, _):
            assert raw_initialize(url) == (401, 'Bearer realm="sandvisor mcp"')
            assert raw_initialize(url, "x" * 64)[0] == 401
            assert raw_initialize(url, token)[0] == 200
            assert raw_initialize(url, token, host=f"evil.example:{url.split(':')[2].split('/')[0]}")[0] == 421

            async def tools(s: ClientSession) -> tuple[set[str], Any]:
                return {t.name for t in (await s.list_tools()).tools}, await s.call_tool("list_sandboxes", {})

            names, r = asyncio.run(asyncio.wait_for(mcp_client(url, token, tools), 120))
            assert names == TOOLS
            assert r.is_error and "UNAVAILABLE: " in r.content[0].text  # no supervisor there


def test_mcp_http_off_loopback_is_served_over_tls_with_the_token(tmp_path: Path) -> None:
    """``--http 0.0.0.0:PORT`` with ``--tls-cert/--tls-key`` starts (reached here through
    127.0.0.1: no traffic leaves the host); HTTPS, the token still required."""
    import httpx2
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from tests.support.pki import Authority

    ca = Authority("mcp-test-ca")
    cert, key = ca.leaf(
        "127.0.0.1", [ExtendedKeyUsageOID.SERVER_AUTH], [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    token = private_token(tmp_path / "token")
    tls = ("--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem"))
    trust = ssl.create_default_context(cadata=ca.pem.decode())
    args = ("--token-file", str(tmp_path / "token"), *tls)
    with mcp_http(tmp_path, tmp_path / "none.sock", "0.0.0.0", *args, reach="127.0.0.1", scheme="https") as (url, _):
        with httpx2.Client(verify=trust) as http:
            r = http.post(url, json={}, headers={"Accept": "application/json, text/event-stream"})
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")

        async def tools(s: ClientSession) -> set[str]:
            return {t.name for t in (await s.list_tools()).tools}

        assert asyncio.run(asyncio.wait_for(mcp_client(url, token, tools, verify=trust), 120)) == TOOLS


def test_mcp_http_refuses_to_start_without_a_private_token_or_off_loopback_without_tls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(In this process: the CLI's own main, as the command runs it; a process each costs
    seconds of imports.)"""
    from supervisor.main import cli

    def mcp_start(*args: str) -> subprocess.CompletedProcess[str]:
        with pytest.raises(SystemExit) as exit_:
            cli.main(["mcp", *args])
        code = exit_.value.code
        return subprocess.CompletedProcess(args, code if isinstance(code, int) else 1, "", capsys.readouterr().err)

    token_file = tmp_path / "token"
    private_token(token_file)
    port = str(free_port("127.0.0.1", "tcp"))
    r = mcp_start("--http", f"127.0.0.1:{port}")
    assert r.returncode == 2 and "--token-file" in r.stderr, r.stderr
    for host in ("0.0.0.0", "[::]", "192.0.2.1"):  # not loopback: refused before it listens, token or not
        r = mcp_start("--http", f"{host}:{port}", "--token-file", str(token_file))
        assert r.returncode == 2 and "not a loopback address" in r.stderr and "--tls-cert" in r.stderr, r.stderr
    os.chmod(token_file, 0o640)  # a token others can read is no one's
    r = mcp_start("--http", f"127.0.0.1:{port}", "--token-file", str(token_file))
    assert r.returncode == 2 and "mode 0600 or stricter" in r.stderr, r.stderr
    (tmp_path / "short").write_text("abc\n")
    os.chmod(tmp_path / "short", 0o600)
    r = mcp_start("--http", f"127.0.0.1:{port}", "--token-file", str(tmp_path / "short"))
    assert r.returncode == 2 and "32 to 1024" in r.stderr, r.stderr


def test_mcp_http_makes_a_private_token_file_when_there_is_none(tmp_path: Path) -> None:
    from supervisor.serve import mcp_server

    made = tmp_path / "new-token"
    door, fresh = mcp_server.http_door("127.0.0.2:1", str(made))
    assert fresh and made.stat().st_mode & 0o777 == 0o600
    assert door.token == made.read_bytes().strip() and len(door.token) == 64
    again, fresh = mcp_server.http_door("localhost:1", str(made))  # a name: resolved, then judged by its class
    assert not fresh and again.token == door.token
    assert door.allowed_hosts == ("127.0.0.2", "localhost")
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(ValueError, match="--token-file"):
        mcp_server.http_door("127.0.0.1:1", str(tmp_path / "link"))  # never through a symlink


@pytest.mark.vm
def test_mcp_http_as_another_local_user_is_refused_and_the_token_holder_served() -> None:
    """A root supervisor with a VM; ``mcp --http`` started by root. uid 65534, which the
    Unix socket refuses, is refused here too: no token or a wrong one, 401. The mcp
    client with the token creates a sandbox and lists it."""
    if os.geteuid() != 0:
        pytest.skip("another local user's client: setpriv needs root")
    with workdir("sv-mcp-http-") as work, supervisor_process(work):
        token = private_token(work.root / "mcp.token")
        with mcp_http(work.root, work.socket, "127.0.0.1", "--token-file", str(work.root / "mcp.token")) as (url, _):
            assert raw_initialize(url, uid=NOBODY) == (401, 'Bearer realm="sandvisor mcp"')
            assert raw_initialize(url, "0" * 64, uid=NOBODY)[0] == 401

            async def create_and_list(s: ClientSession) -> tuple[str, list[str]]:
                created = _result(await s.call_tool("create_sandbox", {"ttl_seconds": 600}))
                listed = _result(await s.call_tool("list_sandboxes", {"mine": True}))
                run = _result(await s.call_tool("run_command", {"sandbox_id": created["id"], "command": "id -u"}))
                assert run["exit_code"] == 0
                await s.call_tool("remove_sandbox", {"sandbox_id": created["id"]})
                return created["id"], [b["id"] for b in listed["sandboxes"]]

            sid, ids = asyncio.run(asyncio.wait_for(mcp_client(url, token, create_and_list), 600))
            assert ids == [sid]
