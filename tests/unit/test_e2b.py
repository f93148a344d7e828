"""The E2B endpoint's parts without a VM: the key file (labels, admin marks, bare
keys), access tokens bound to a key, a sandbox id and its uid, authentication of every
request (ASGI, in process), Connect's envelopes, the streaming multipart parser."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.serve import e2b_envd, e2b_http
from supervisor.serve.e2b_keys import Client, Key, Tokens, derived_label, find_key, parse_keys, read_keys
from supervisor.serve.e2b_multipart import parts
from supervisor.serve.e2b_server import E2BApp, check_key_file


def test_key_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\n\nk1\n  k2  \nalice sk-alice\nops\tsk-ops   admin\n")
    f.chmod(0o600)
    check_key_file(f)
    keys = read_keys(f)
    assert [(k.label, k.secret, k.admin) for k in keys] == [
        (derived_label(b"k1"), b"k1", False),
        (derived_label(b"k2"), b"k2", False),
        ("alice", b"sk-alice", False),
        ("ops", b"sk-ops", True),
    ]
    assert [k.principal for k in keys[2:]] == ["e2b:alice", "e2b:ops"]
    f.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        check_key_file(f)
    f.chmod(0o600)
    f.write_text("# none\n")
    with pytest.raises(ValueError, match="no API keys"):
        check_key_file(f)


def test_bare_key_label_is_a_hash_never_the_key() -> None:
    (key,) = parse_keys("e2b_a-very-secret-key\n")
    assert key.label == derived_label(b"e2b_a-very-secret-key")
    assert key.label.startswith("key-") and len(key.label) == 20 and "secret" not in key.label
    assert key.principal == f"e2b:{key.label}" and not key.admin
    assert "secret" not in repr(key)
    assert derived_label(b"k1") != derived_label(b"k2")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("a k1\na k2\n", "label 'a' is given twice"),
        ("a k1\nb k1\n", "this key is given twice"),
        ("k1\nk1\n", "is given twice"),
        ("a.b k1\n", "a label is 1-64"),
        ("a k1 root\n", "expected KEY, LABEL KEY or LABEL KEY admin"),
        ("a k1 admin extra\n", "expected KEY"),
        ("", "no API keys"),
    ],
)
def test_key_file_refusals_name_the_line_never_the_key(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as err:
        parse_keys(text, "keys")
    assert "k1" not in str(err.value) and "k2" not in str(err.value)


def test_find_key_compares_every_key() -> None:
    keys = parse_keys("a k1\nb k2 admin\n")
    assert find_key(keys, "k2") == keys[1] and find_key(keys, "k1") == keys[0]
    for bad in (None, "", "k", "k1 ", "K1", "k3"):
        assert find_key(keys, bad) is None


def test_tokens_are_bound_to_key_sandbox_and_uid() -> None:
    a, b = parse_keys("a k1\nb k2\n")
    tokens = Tokens([a, b])
    t = tokens.mint(a, "box", "uid-1")
    assert tokens.open(t, "box") == (a, "uid-1")
    assert tokens.open(t, "box2") is None  # another sandbox id
    label, uid, mac = t.split(".")
    assert label == "a" and uid == "uid-1" and len(mac) == 64
    assert tokens.open(f"b.{uid}.{mac}", "box") is None  # handed to a, not b
    assert tokens.open(f"a.uid-2.{mac}", "box") is None  # another sandbox of that id (a later uid)
    flipped = mac[:-1] + ("1" if mac[-1] == "0" else "0")
    assert tokens.open(f"a.{uid}.{flipped}", "box") is None
    for bad in (None, "", t + ".x", "a..", "nobody.uid-1." + mac, f"a.{uid}"):
        assert tokens.open(bad, "box") is None
    assert Tokens([a, b]).open(t, "box") is None  # another endpoint's secret (a restart): nothing
    assert tokens.mint(a, "box", "uid-2") != t
    with pytest.raises(ValueError):
        tokens.mint(a, "box", "")  # no uid, no token


def test_client_acts_as_its_key() -> None:
    from supervisor.client.sdk.acting import hello_fields

    admin = Key("ops", b"k", admin=True)
    client = Client("/nonexistent.sock", admin)
    with client.acting():
        assert hello_fields() == ("e2b:ops", True)
    assert hello_fields() == ("", False)
    with Client("/x", Key("a", b"k1")).acting():
        assert hello_fields() == ("e2b:a", False)


def test_serve_e2b_needs_a_key_file(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", "serve", "--e2b", "127.0.0.1:0", "--socket", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "--e2b-key-file" in r.stderr


async def _ask(app: E2BApp, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, Any]:
    sent: list[dict[str, Any]] = []
    msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    await app(scope, receive, send)
    data = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], json.loads(data) if data else None


async def test_every_request_is_authenticated() -> None:
    async with trio.open_nursery() as n:
        keys = parse_keys("good\nother also-good\n")
        app = E2BApp("/nonexistent.sock", keys, e2b_envd.Processes(n))
        for headers in ({}, {"X-API-KEY": "bad"}, {"X-API-KEY": "goo"}, {"X-API-KEY": "good "}):
            for method, path in (("GET", "/v2/sandboxes"), ("POST", "/v2/sandboxes"), ("DELETE", "/sandboxes/x")):
                assert await _ask(app, method, path, headers) == (401, {"code": 401, "message": "Invalid API key"})
        token = app.tokens.mint(keys[0], "box1", "uid-1")
        envd = {"E2b-Sandbox-Id": "box1"}
        assert (await _ask(app, "GET", "/health", envd))[0] == 401
        other_box = app.tokens.mint(keys[0], "box2", "uid-1")
        assert (await _ask(app, "GET", "/health", {**envd, "X-Access-Token": other_box}))[0] == 401
        assert (await _ask(app, "GET", "/health", {**envd, "X-Access-Token": "box1"}))[0] == 401
        # past authentication: the supervisor is asked whether the sandbox is there (unreachable here: 503)
        for good in ({"X-Access-Token": token}, {"X-API-KEY": "also-good"}):
            status, body = await _ask(app, "GET", "/health", {**envd, **good})
            assert status == 503 and body["message"].startswith("UNAVAILABLE: ")
        # an authenticated call of a route that is not there: E2B's error shape
        assert await _ask(app, "GET", "/nope", {"X-API-KEY": "good"}) == (
            404,
            {"code": 404, "message": "no route GET /nope"},
        )
        # the supervisor unreachable: its UNAVAILABLE as 503
        status, body = await _ask(app, "GET", "/v2/sandboxes", {"X-API-KEY": "good"})
        assert status == 503 and body["message"].startswith("UNAVAILABLE: ")
        n.cancel_scope.cancel()


async def test_connect_envelopes() -> None:
    msg = e2b_http.envelope({"a": 1}, e2b_http.END_STREAM)
    flags, size = struct.unpack(">BI", msg[:5])
    assert (flags, json.loads(msg[5 : 5 + size])) == (2, {"a": 1})


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 20])
async def test_multipart_streams_parts_in_order(size: int) -> None:
    boundary = "XyZ-boundary"
    big = bytes(range(256)) * 300
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="/tmp/a"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    body += big + f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="/b c"\r\n\r\n'.encode()
    body += b"second" + f"\r\n--{boundary}--\r\n".encode()
    got = []
    async for name, data in parts(f"multipart/form-data; boundary={boundary}", _chunks(body, size)):
        got.append((name, b"".join([piece async for piece in data])))
    assert got == [("/tmp/a", big), ("/b c", b"second")]


async def test_multipart_refuses_garbage() -> None:
    with pytest.raises(e2b_http.HttpError):
        async for _ in parts("multipart/form-data", _chunks(b"x", 1)):
            pass
    with pytest.raises(e2b_http.HttpError):
        async for _, data in parts("multipart/form-data; boundary=b", _chunks(b"--b\r\nbroken", 3)):
            async for _ in data:
                pass


async def test_envd_requests_checked_before_the_supervisor() -> None:
    def exchange(headers: dict[str, str]) -> e2b_http.Exchange:
        scope = {
            "method": "POST",
            "path": "/",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }
        return e2b_http.Exchange(scope, None, None)  # type: ignore[arg-type]

    basic = "Basic " + base64.b64encode(b"nobody:").decode()
    assert e2b_envd.envd_user(exchange({"Authorization": basic})) == "nobody"
    assert e2b_envd.envd_user(exchange({})) == "user"  # E2B's default user
    for bad in (b"a b:", b"-x:", b"$(id):"):
        with pytest.raises(e2b_http.HttpError):
            e2b_envd.envd_user(exchange({"Authorization": "Basic " + base64.b64encode(bad).decode()}))
    with pytest.raises(e2b_http.RpcError):
        e2b_envd._path("")
    assert e2b_envd._path("-rf") == "./-rf"


async def _call(fn: Any, body: bytes) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"method": "POST", "path": "/", "headers": []}
    await fn(e2b_http.Exchange(scope, receive, send))
    return sent


async def test_malformed_process_calls_are_refused() -> None:
    async with trio.open_nursery() as n:
        procs = e2b_envd.Processes(n)
        target = e2b_envd.Target(Client("/nonexistent.sock", Key("a", b"k")), "sb", "uid-1")
        for method, body in (
            ("SendInput", b'{"process": {"pid": "abc"}, "input": {"stdin": "eA=="}}'),
            ("SendSignal", b'{"process": {"pid": [1]}, "signal": "SIGNAL_SIGKILL"}'),
            ("CloseStdin", b'{"process": {}}'),
            ("List", b"[1]"),
        ):
            sent = await _call(lambda ex, m=method: e2b_envd.process_call(ex, procs, target, m), body)
            assert sent[0]["status"] == 400, (method, sent)
        start = e2b_http.envelope({"process": {"cmd": 5}})
        sent = await _call(lambda ex: e2b_envd.process_call(ex, procs, target, "Start"), start)
        end = sent[-1]["body"]
        assert end[0] == e2b_http.END_STREAM and json.loads(end[5:])["error"]["code"] == "invalid_argument"
        sent = await _call(lambda ex: e2b_envd.process_call(ex, procs, target, "Connect"), b"\x00\x00")
        assert json.loads(sent[-1]["body"][5:])["error"]["code"] == "invalid_argument"
        n.cancel_scope.cancel()


class _Snapshots(Client):
    """A key's client whose ListSnapshots answers ``listed`` (what the supervisor lets the key see)."""

    listed: tuple[Any, ...] = ()

    async def snapshots(self) -> list[Any]:
        return list(self.listed)


async def test_templates_a_key_may_restore() -> None:
    from supervisor.wire import protocol

    def snap(id: str, name: str, **kw: Any) -> protocol.SnapshotSummary:
        return protocol.SnapshotSummary(id, "origin", name, {}, "/d", "t", **kw)

    listed = (
        snap("snap-0a", "plain", network="none"),
        snap("snap-0b", "netted", network="user"),
        snap("snap-0c", "secret", network="tap", secrets=["gh"]),
        snap("snap-0d", "mounted", network="none", host_mounts=1),
    )
    async with trio.open_nursery() as n:
        app = E2BApp("/nonexistent.sock", [Key("a", b"k")], e2b_envd.Processes(n))
        client = _Snapshots("/nonexistent.sock", Key("a", b"k"))
        object.__setattr__(client, "listed", listed)
        assert await app._template(client, "snap-0a") == "snap-0a"
        assert await app._template(client, "plain") == "snap-0a"
        for name, why in (("netted", "network 'user'"), ("snap-0c", "secrets gh"), ("mounted", "host directories")):
            with pytest.raises(e2b_http.HttpError, match=why) as err:
                await app._template(client, name)
            assert err.value.status == 400
        # a snapshot id the key does not see: not found, never taken for an image reference
        with pytest.raises(e2b_http.HttpError, match="template snap-0e not found") as err:
            await app._template(client, "snap-0e")
        assert err.value.status == 404
        assert await app._template(client, "docker.io/library/python:3.12") is None
        assert await app._template(client, "someone-elses-name") is None  # (an image reference, like any miss)
        n.cancel_scope.cancel()
