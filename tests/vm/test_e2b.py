"""The ``e2b`` SDK from PyPI, unchanged, against ``sandvisor serve --e2b`` on loopback (a
throwaway supervisor, one real VM shared by the module): create, commands (foreground;
background with callbacks, sync and asyncio; envs, cwd, user; stdin; kill; list),
files (write/read/list/exists/remove/make_dir/rename, a 16 MiB round trip),
set_timeout, get_info, Sandbox.list, Sandbox.connect, kill; a wrong key is 401; an
unknown sandbox is E2B's not-found; HTTP/2 by prior knowledge. Keys are principals: a
key sees only what it made (another key's sandbox and snapshot are not found for it, in
every call), an admin key sees all, a sandbox made through the supervisor's socket is
invisible to a non-admin key, and an access token opens only the sandbox (uid) it was
handed out for."""

from __future__ import annotations

import asyncio
import datetime
import io
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

e2b = pytest.importorskip("e2b")
httpx = pytest.importorskip("httpx")

from e2b import (  # noqa: E402
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
)

from supervisor.client.sdk import sync  # noqa: E402
from supervisor.client.sdk.acting import acting_as  # noqa: E402
from tests.support.e2bserve import e2b_endpoint  # noqa: E402

KEY = "e2b_sandvisor_test_key"  # a bare key: its principal is e2b:key-<hash>
ALICE, BOB, OPS = "e2b_alice_key", "e2b_bob_key", "e2b_ops_key"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, str]]:
    """(the endpoint's URL, the supervisor's socket)."""
    keys = f"# test keys\nother-key\n{KEY}\nalice {ALICE}\nbob {BOB}\nops {OPS} admin\n"
    with e2b_endpoint("sv-e2b-", keys) as (url, work):
        yield url, str(work.socket)


@pytest.fixture(scope="module")
def endpoint(served: tuple[str, str]) -> str:
    return served[0]


@pytest.fixture(scope="module")
def opts(endpoint: str) -> dict[str, Any]:
    return {"api_url": endpoint, "sandbox_url": endpoint, "api_key": KEY, "request_timeout": 300}


@pytest.fixture(scope="module")
def box(endpoint: str) -> Iterator[Sandbox]:
    """Made the way users configure it: the environment variables."""
    env = {"E2B_API_URL": endpoint, "E2B_SANDBOX_URL": endpoint, "E2B_API_KEY": KEY}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        sb = Sandbox.create(timeout=1800, metadata={"suite": "e2b"}, envs={"GREETING": "hello"}, request_timeout=300)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield sb
    finally:
        sb.kill()


def test_commands(box: Sandbox) -> None:
    r = box.commands.run("echo $GREETING $EXTRA; pwd; echo oops >&2", envs={"EXTRA": "world"}, cwd="/tmp")
    assert (r.stdout, r.stderr, r.exit_code) == ("hello world\n/tmp\n", "oops\n", 0)
    assert box.commands.run("whoami", user="nobody").stdout == "nobody\n"
    with pytest.raises(CommandExitException) as failed:
        box.commands.run("echo partial; exit 7")
    assert failed.value.exit_code == 7 and failed.value.stdout == "partial\n"

    # stdin
    cat = box.commands.run("cat", background=True, stdin=True)
    box.commands.send_stdin(cat.pid, "abc\n")
    box.commands.send_stdin(cat.pid, b"def\n")
    box.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "abc\ndef\n"

    # background with callbacks (the sync SDK hands them to wait)
    lines: list[str] = []
    h = box.commands.run("for i in 1 2 3; do echo line$i; sleep 0.1; done; echo e >&2", background=True)
    errs: list[str] = []
    assert h.wait(on_stdout=lines.append, on_stderr=errs.append).exit_code == 0
    assert "".join(lines) == "line1\nline2\nline3\n" and errs == ["e\n"]

    # connect to a running command: its output from then on, and its end
    later = box.commands.run("sleep 1; echo done", background=True)
    assert box.commands.connect(later.pid).wait().stdout == "done\n"

    # list and kill
    sleeper = box.commands.run("sleep 600", background=True)
    assert sleeper.pid in [p.pid for p in box.commands.list()]
    assert [p.args for p in box.commands.list() if p.pid == sleeper.pid] == [["-l", "-c", "sleep 600"]]
    assert box.commands.kill(sleeper.pid)
    with pytest.raises(CommandExitException):
        sleeper.wait()
    assert sleeper.pid not in [p.pid for p in box.commands.list()]
    assert not box.commands.kill(sleeper.pid)


def test_background_callbacks_asyncio(box: Sandbox, opts: dict[str, Any]) -> None:
    """The asyncio SDK runs on_stdout/on_stderr as the output arrives, while the command runs."""

    async def main() -> tuple[list[str], list[str], int]:
        sb = await AsyncSandbox.connect(box.sandbox_id, **opts)
        out: list[str] = []
        err: list[str] = []
        h = await sb.commands.run(
            "echo first; sleep 1; echo second >&2",
            background=True,
            on_stdout=out.append,
            on_stderr=err.append,
        )
        for _ in range(600):  # the first line arrives before the command ends
            if out:
                break
            await asyncio.sleep(0.05)
        seen_early = list(out)
        result = await h.wait()
        assert seen_early == ["first\n"]
        return out, err, result.exit_code

    out, err, code = asyncio.run(main())
    assert (out, err, code) == (["first\n"], ["second\n"], 0)


def test_files(box: Sandbox) -> None:
    info = box.files.write("/tmp/e2b/hello.txt", "hi there")
    assert (info.path, info.name) == ("/tmp/e2b/hello.txt", "hello.txt")
    assert box.files.read("/tmp/e2b/hello.txt") == "hi there"
    assert box.files.exists("/tmp/e2b/hello.txt") and not box.files.exists("/tmp/e2b/nope")
    assert box.files.make_dir("/tmp/e2b/sub") and not box.files.make_dir("/tmp/e2b/sub")
    entries = {e.name: e for e in box.files.list("/tmp/e2b")}
    assert set(entries) == {"hello.txt", "sub"}
    assert entries["hello.txt"].size == 8 and entries["hello.txt"].type.value == "file"
    assert entries["sub"].type.value == "dir"
    moved = box.files.rename("/tmp/e2b/hello.txt", "/tmp/e2b/sub/moved.txt")
    assert moved.path == "/tmp/e2b/sub/moved.txt"
    assert [e.path for e in box.files.list("/tmp/e2b", depth=2)] == ["/tmp/e2b/sub", "/tmp/e2b/sub/moved.txt"]
    assert box.files.get_info("/tmp/e2b/sub/moved.txt").size == 8
    box.files.remove("/tmp/e2b/sub")
    assert not box.files.exists("/tmp/e2b/sub")
    with pytest.raises(NotFoundException):
        box.files.read("/tmp/e2b/sub/moved.txt")

    # several files in one multipart body; a file-like one streamed as octet-stream; a streamed read
    infos = box.files.write_files([{"path": "/tmp/w/a.txt", "data": "A"}, {"path": "/tmp/w/b.bin", "data": b"B"}])
    assert [i.path for i in infos] == ["/tmp/w/a.txt", "/tmp/w/b.bin"]
    box.files.write("/tmp/w/c.bin", io.BytesIO(b"streamed " * 1000))
    assert b"".join(box.files.read("/tmp/w/c.bin", format="stream")) == b"streamed " * 1000
    assert box.commands.run("cat /tmp/w/a.txt /tmp/w/b.bin").stdout == "AB"

    big = os.urandom(16 << 20)
    box.files.write("/tmp/big.bin", big)
    assert bytes(box.files.read("/tmp/big.bin", format="bytes")) == big
    assert box.commands.run("stat -c %s /tmp/big.bin").stdout.strip() == str(16 << 20)
    box.files.remove("/tmp/big.bin")


def test_lifecycle(box: Sandbox, opts: dict[str, Any]) -> None:
    info = box.get_info()
    assert info.sandbox_id == box.sandbox_id and info.metadata == {"suite": "e2b"}
    assert info.state.value == "running" and info.template_id == "base"
    box.set_timeout(7200)  # from now, whatever the sandbox's age
    left = (box.get_info().end_at - datetime.datetime.now(datetime.UTC)).total_seconds()
    assert 7200 - 120 < left <= 7200 + 2
    listed = Sandbox.list(**opts).next_items()
    assert box.sandbox_id in [s.sandbox_id for s in listed]
    mine = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b"}), **opts).next_items()
    assert [(s.sandbox_id, s.metadata) for s in mine] == [(box.sandbox_id, {"suite": "e2b"})]
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other"}), **opts).next_items() == []
    again = Sandbox.connect(box.sandbox_id, **opts)
    assert again.commands.run("echo $GREETING").stdout == "hello\n"
    # pause is sandvisor's hibernation; connect resumes it, processes and files intact
    box.commands.run("echo kept > /tmp/before-pause")
    assert box.pause() is True
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **opts).next_items()
    assert box.sandbox_id in [s.sandbox_id for s in paused]
    assert box.get_info().state.value == "paused"
    assert Sandbox.pause(box.sandbox_id, **opts) is False  # 409: already paused
    resumed = Sandbox.connect(box.sandbox_id, **opts)
    assert resumed.get_info().state.value == "running"
    assert resumed.commands.run("cat /tmp/before-pause").stdout == "kept\n"


def test_errors(endpoint: str, opts: dict[str, Any]) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.list(**{**opts, "api_key": "wrong"}).next_items()
    r = httpx.get(f"{endpoint}/v2/sandboxes", headers={"X-API-KEY": "wrong"})
    assert r.status_code == 401 and r.json()["code"] == 401
    assert httpx.get(f"{endpoint}/v2/sandboxes").status_code == 401
    envd = {"E2b-Sandbox-Id": "anything", "X-Access-Token": "forged"}
    assert httpx.get(f"{endpoint}/health", headers=envd).status_code == 401

    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("no-such-sandbox", **opts)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("no-such-sandbox", **opts)
    assert Sandbox.kill("no-such-sandbox", **opts) is False
    r = httpx.get(f"{endpoint}/sandboxes/no-such-sandbox", headers={"X-API-KEY": KEY})
    assert r.status_code == 404 and r.json() == {"code": 404, "message": "Sandbox no-such-sandbox not found"}


def test_http2(endpoint: str) -> None:
    with httpx.Client(http1=False, http2=True) as c:  # cleartext HTTP/2 by prior knowledge
        r = c.get(f"{endpoint}/v2/sandboxes", headers={"X-API-KEY": KEY})
    assert r.http_version == "HTTP/2" and r.status_code == 200


def _as(opts: dict[str, Any], key: str) -> dict[str, Any]:
    return {**opts, "api_key": key}


def _ids(opts: dict[str, Any]) -> list[str]:
    return [s.sandbox_id for s in Sandbox.list(**opts).next_items()]


def _envd(endpoint: str, sid: str, method: str, path: str, headers: dict[str, str], **kw: Any) -> Any:
    return httpx.request(method, f"{endpoint}{path}", headers={"E2b-Sandbox-Id": sid, **headers}, timeout=60, **kw)


def test_keys_are_principals(served: tuple[str, str], box: Sandbox, opts: dict[str, Any]) -> None:
    """Bob cannot list, inspect, connect to, run in, read from, time, pause, kill or
    restore (by id) Alice's sandbox and snapshot: each is E2B's not-found; Alice's
    token does not open another sandbox; the admin key sees and acts on both keys'."""
    endpoint, sock = served
    alice, bob, ops = _as(opts, ALICE), _as(opts, BOB), _as(opts, OPS)
    mine = Sandbox.create(timeout=1200, metadata={"who": "alice"}, **alice)
    try:
        sid = mine.sandbox_id
        mine.files.write("/tmp/alice.txt", "alice's")
        with acting_as("e2b:alice"):  # (the endpoint takes no snapshots: made for Alice on the socket)
            snap = sync.Sandbox(sid, socket=sock).checkpoint("alice-snap").snapshot_id

        assert sid in _ids(alice) and box.sandbox_id not in _ids(alice)
        assert sid not in _ids(bob) and box.sandbox_id not in _ids(bob)
        assert Sandbox.list(query=SandboxQuery(metadata={"who": "alice"}), **bob).next_items() == []
        for call in (
            lambda: Sandbox.get_info(sid, **bob),
            lambda: Sandbox.connect(sid, **bob),
            lambda: Sandbox.set_timeout(sid, 60, **bob),
            lambda: Sandbox.pause(sid, **bob),
        ):
            with pytest.raises(SandboxNotFoundException):
                call()
        assert Sandbox.kill(sid, **bob) is False
        # restoring Alice's snapshot as a template: not found (never an image pull)
        with pytest.raises(SandboxException, match="404"):
            Sandbox.create(snap, timeout=60, **bob)

        # envd calls: Bob's key does not reach Alice's sandbox (the SDK: not running), nor does her token another
        stat = ("POST", "/filesystem.Filesystem/Stat")
        for method, path, kw in (("GET", "/files?path=/tmp/alice.txt", {}), (*stat, {"json": {"path": "/tmp"}})):
            r = _envd(endpoint, sid, method, path, {"X-API-KEY": BOB}, **kw)
            assert r.status_code == 502 and r.json()["message"] == f"The sandbox {sid} was not found", r.text
            token = {"X-Access-Token": mine._envd_access_token or ""}
            assert _envd(endpoint, box.sandbox_id, method, path, token, **kw).status_code == 401
            assert _envd(endpoint, sid, method, path, token, **kw).status_code == 200
        assert mine.files.read("/tmp/alice.txt") == "alice's"  # still hers, unharmed

        # the admin key: both keys' sandboxes, and it acts on them
        assert {sid, box.sandbox_id} <= set(_ids(ops))
        assert Sandbox.get_info(sid, **ops).metadata == {"who": "alice"}
        assert Sandbox.connect(sid, **ops).files.read("/tmp/alice.txt") == "alice's"
        assert Sandbox.connect(box.sandbox_id, **ops).commands.run("echo $GREETING").stdout == "hello\n"
        # Alice's own snapshot is hers to restore
        clone = Sandbox.create(snap, timeout=600, **alice)
        try:
            assert clone.files.read("/tmp/alice.txt") == "alice's"
            assert clone.sandbox_id not in _ids(bob)
        finally:
            clone.kill()
    finally:
        mine.kill()
    assert sid not in _ids(ops)


def test_socket_sandboxes_and_stale_tokens(served: tuple[str, str], opts: dict[str, Any]) -> None:
    """A sandbox made on the supervisor's socket is invisible to a non-admin key; a token
    of a removed sandbox opens nothing, a later sandbox given the same id included."""
    endpoint, sock = served
    alice, ops = _as(opts, ALICE), _as(opts, OPS)
    first = Sandbox.create(timeout=600, **alice)
    sid = first.sandbox_id
    stale = first._envd_access_token
    assert first.commands.run("echo one").stdout == "one\n"
    assert first.kill() is True
    with sync.Sandbox.create(sid, socket=sock, ttl=600):  # the same id, made on the socket (root's)
        assert sid not in _ids(alice)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(sid, **alice)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(sid, **alice)
        assert Sandbox.kill(sid, **alice) is False
        # the old handle's token is the removed sandbox's: not this one's (the SDK: not running)
        with pytest.raises(SandboxNotRunningException):
            first.commands.run("echo two")
        with pytest.raises(SandboxNotRunningException):
            first.files.read("/etc/hostname")
        r = _envd(endpoint, sid, "GET", "/health", {"X-Access-Token": stale or ""})
        assert r.status_code == 502
        # the admin key sees it, and a token it gets opens it
        assert sid in _ids(ops)
        assert Sandbox.connect(sid, **ops).commands.run("echo three").stdout == "three\n"


def test_snapshot_templates_without_network(served: tuple[str, str], opts: dict[str, Any]) -> None:
    """A snapshot whose origin had a network is refused as a template, for an admin key
    too (a restore would keep it; endpoint sandboxes have none); a key that may not see
    it does not find it."""
    _, sock = served
    ops, alice = _as(opts, OPS), _as(opts, ALICE)
    with sync.Sandbox.create("netted", socket=sock, ttl=600, network="user") as origin:
        snap = origin.checkpoint("netted-snap").snapshot_id
    before = set(_ids(ops))
    for template in (snap, "netted-snap"):
        with pytest.raises(SandboxException, match=r"400: template .*network 'user'"):
            Sandbox.create(template, timeout=60, **ops)
    with pytest.raises(SandboxException, match="404"):
        Sandbox.create(snap, timeout=60, **alice)
    assert set(_ids(ops)) == before  # nothing was made


def test_kill_last(endpoint: str, opts: dict[str, Any]) -> None:
    """(runs after the shared sandbox's tests) a sandbox killed through the API is gone."""
    sb = Sandbox.create(timeout=300, **opts)
    assert sb.kill() is True
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list(**opts).next_items()]
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sb.sandbox_id, **opts)


def test_timeout_expires(box: Sandbox, opts: dict[str, Any]) -> None:
    """(last: it ends the shared sandbox) set_timeout replaces the TTL the supervisor enforces."""
    box.set_timeout(2)
    deadline = time.monotonic() + 120
    while True:  # until it is removed (it leaves the listing as it starts stopping: before Inspect misses it)
        try:
            Sandbox.get_info(box.sandbox_id, **opts)
        except SandboxNotFoundException:
            break
        assert time.monotonic() < deadline, "the sandbox outlived its timeout"
        time.sleep(0.5)
    assert box.sandbox_id not in [s.sandbox_id for s in Sandbox.list(**opts).next_items()]
    assert not box.is_running()
    with pytest.raises(SandboxNotRunningException):
        box.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        box.files.read("/etc/hostname")
