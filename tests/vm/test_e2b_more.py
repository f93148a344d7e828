"""More of the ``e2b`` SDK, unchanged, against ``sandvisor serve --e2b`` on loopback (a
throwaway supervisor and one real VM for the module, as tests/vm/test_e2b.py): PTY
(an interactive shell, resize, send_stdin, kill), ``commands.stream_input``,
``files.watch_dir`` (sync polling and the async stream), gzip uploads and downloads,
``get_metrics``, and E2B's unknown-route answer for what the endpoint does not serve."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

e2b = pytest.importorskip("e2b")
httpx = pytest.importorskip("httpx")

from e2b import AsyncSandbox, PtySize, Sandbox, SandboxException  # noqa: E402
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType  # noqa: E402

from tests.support.e2bserve import e2b_endpoint  # noqa: E402

KEY = "e2b_sandvisor_more_key"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with e2b_endpoint("sv-e2b-more-", f"{KEY}\n") as (url, _):
        yield url


@pytest.fixture(scope="module")
def opts(endpoint: str) -> dict[str, Any]:
    return {"api_url": endpoint, "sandbox_url": endpoint, "api_key": KEY, "request_timeout": 300}


@pytest.fixture(scope="module")
def box(opts: dict[str, Any]) -> Iterator[Sandbox]:
    sb = Sandbox.create(timeout=1800, **opts)
    try:
        yield sb
    finally:
        sb.kill()


def test_pty_runs_an_interactive_shell(box: Sandbox) -> None:
    out = bytearray()
    term = box.pty.create(PtySize(rows=24, cols=80), envs={"MARK": "pty"})
    box.pty.resize(term.pid, PtySize(rows=33, cols=101))
    box.pty.send_stdin(term.pid, b"stty size; tty >/dev/null && echo is-a-$MARK-$((6*7))\n")
    box.pty.send_stdin(term.pid, b"exit 3\n")
    with pytest.raises(e2b.CommandExitException) as ended:
        term.wait(on_pty=out.extend)
    assert ended.value.exit_code == 3
    text = out.decode(errors="replace")
    assert "33 101" in text and "is-a-pty-42" in text, text

    # a second terminal, ended by kill; stream_input reaches a PTY too
    other = box.pty.create(PtySize(rows=24, cols=80))
    seen = bytearray()
    box.pty.stream_input(other.pid, ["echo strea", b"med-$((2+3))\n"])
    deadline = time.monotonic() + 120
    for _stdout, _stderr, pty in other:
        seen.extend(pty or b"")
        if b"streamed-5" in seen or time.monotonic() > deadline:
            break
    assert b"streamed-5" in seen
    assert box.pty.kill(other.pid) is True
    assert other.pid not in [p.pid for p in box.commands.list()]


def test_commands_stream_input(box: Sandbox) -> None:
    cat = box.commands.run("cat", background=True, stdin=True)
    box.commands.stream_input(cat.pid, ["one ", b"two\n", "three\n"])
    box.commands.stream_input(cat.pid, ["four\n"])
    box.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "one two\nthree\nfour\n"
    with pytest.raises(e2b.NotFoundException):
        box.commands.stream_input(999_999, ["nobody\n"])


def test_watch_dir_sees_files_appear_change_and_go(box: Sandbox) -> None:
    box.files.make_dir("/tmp/watched")
    box.files.write("/tmp/watched/old.txt", "old")
    h = box.files.watch_dir("/tmp/watched")
    assert h.get_new_events() == []
    box.files.write("/tmp/watched/new.txt", "new")
    box.commands.run("echo more >> /tmp/watched/old.txt")
    events = {(e.name, e.type) for e in h.get_new_events()}
    assert events == {("new.txt", FilesystemEventType.CREATE), ("old.txt", FilesystemEventType.WRITE)}
    box.files.remove("/tmp/watched/new.txt")
    assert [(e.name, e.type) for e in h.get_new_events()] == [("new.txt", FilesystemEventType.REMOVE)]
    h.stop()
    with pytest.raises(SandboxException):
        box.files.watch_dir("/tmp/watched/old.txt")  # not a directory


def test_watch_dir_async_stream(box: Sandbox, opts: dict[str, Any]) -> None:
    async def main() -> list[tuple[str, Any]]:
        sb = await AsyncSandbox.connect(box.sandbox_id, **opts)
        await sb.files.make_dir("/tmp/awatched")
        got: list[tuple[str, Any]] = []
        seen = asyncio.Event()

        def on_event(ev: Any) -> None:
            got.append((ev.name, ev.type))
            seen.set()

        h = await sb.files.watch_dir("/tmp/awatched", on_event=on_event, recursive=True)
        await sb.files.write("/tmp/awatched/sub/deep.txt", "x")
        await asyncio.wait_for(seen.wait(), 120)
        await h.stop()  # type: ignore[no-untyped-call]
        return got

    got = asyncio.run(main())
    assert ("sub", FilesystemEventType.CREATE) in got or ("sub/deep.txt", FilesystemEventType.CREATE) in got


def test_gzip_transfers(box: Sandbox) -> None:
    data = os.urandom(1 << 16) + b"a" * (1 << 20)
    box.files.write("/tmp/zipped.bin", data, gzip=True)
    assert box.files.read("/tmp/zipped.bin", format="bytes") == data
    assert box.files.read("/tmp/zipped.bin", format="bytes", gzip=True) == data
    assert box.commands.run("stat -c %s /tmp/zipped.bin").stdout.strip() == str(len(data))


def test_get_metrics(box: Sandbox) -> None:
    [m] = box.get_metrics()
    assert m.cpu_count >= 1 and m.cpu_used_pct >= 0
    assert 0 < m.mem_used < m.mem_total
    assert 0 < m.disk_used < m.disk_total
    assert abs(m.timestamp.timestamp() - time.time()) < 600


def test_unserved_calls_answer_as_e2b(box: Sandbox, endpoint: str) -> None:
    r = httpx.get(f"{endpoint}/volumes", headers={"X-API-KEY": KEY})
    assert r.status_code == 404 and r.json()["code"] == 404 and r.json()["message"]
    r = httpx.get(f"{endpoint}/sandboxes/{box.sandbox_id}/logs", headers={"X-API-KEY": KEY})
    assert r.status_code == 404 and set(r.json()) == {"code", "message"}


def test_default_user_is_user(box: Sandbox) -> None:
    r = box.commands.run("whoami; pwd; id -gn")
    assert r.stdout == "user\n/home/user\nuser\n"
    assert box.commands.run("whoami", user="root").stdout == "root\n"
    info = box.files.write("/tmp/owned/by-user.txt", "mine")
    assert box.files.get_info(info.path).owner == "user"
    assert box.files.get_info("/tmp/owned").owner == "user"  # parents made as the user too
    box.files.write("/tmp/by-root.txt", "root's", user="root")
    assert box.files.get_info("/tmp/by-root.txt").owner == "root"
    with pytest.raises(SandboxException):
        box.files.make_dir("/etc/not-for-user")  # as envd: the user's permissions
    term = box.pty.create(PtySize(rows=24, cols=80))
    out = bytearray()
    box.pty.send_stdin(term.pid, b"echo me=$(whoami)\nexit\n")
    term.wait(on_pty=out.extend)
    assert b"me=user" in out


def test_get_host_proxies_a_port_with_the_token(box: Sandbox, endpoint: str) -> None:
    box.commands.run("mkdir -p /tmp/site && echo served-from-the-sandbox > /tmp/site/index.txt")
    server = box.commands.run("cd /tmp/site && exec python3 -m http.server 8080 --bind 127.0.0.1", background=True)
    try:
        host = box.get_host(8080)
        assert host.startswith(f"8080-{box.sandbox_id}.")
        token = box.traffic_access_token
        assert token
        deadline = time.monotonic() + 120
        while True:  # (the server takes a moment to listen: 502 until then)
            r = httpx.get(f"{endpoint}/index.txt", headers={"Host": host, "e2b-traffic-access-token": token})
            if r.status_code != 502 or time.monotonic() > deadline:
                break
            assert r.json()["message"] == "The sandbox is running but port is not open"
            time.sleep(0.5)
        assert (r.status_code, r.text) == (200, "served-from-the-sandbox\n")
        missing = httpx.get(f"{endpoint}/nope", headers={"Host": host, "e2b-traffic-access-token": token})
        assert missing.status_code == 404
        # refused: no token, a wrong one, an API key, another sandbox's port with this token
        for headers in ({}, {"e2b-traffic-access-token": token + "x"}, {"X-API-KEY": KEY}):
            r = httpx.get(f"{endpoint}/index.txt", headers={"Host": host, **headers})
            assert r.status_code == 401, headers
        other = httpx.get(
            f"{endpoint}/index.txt", headers={"Host": "8080-someone-else.x", "e2b-traffic-access-token": token}
        )
        assert other.status_code == 401
        closed = httpx.get(f"{endpoint}/", headers={"Host": box.get_host(8081), "e2b-traffic-access-token": token})
        assert closed.status_code == 502
    finally:
        server.kill()


def test_network_requests_are_refused_not_ignored(opts: dict[str, Any]) -> None:
    for extra in ({"allow_internet_access": True}, {"network": {"deny_out": ["0.0.0.0/0"]}}):
        with pytest.raises(SandboxException, match="no network"):
            Sandbox.create(timeout=60, **opts, **extra)


def test_default_without_tap_networking_says_so(box: Sandbox) -> None:
    """This serve has no tap networking: E2B's default (internet access) is not given,
    and the sandbox's info says so rather than leaving it unsaid."""
    assert box.get_info().allow_internet_access is False


# -- file metadata, templates by name, and what is not served ----------------------------
XATTRS = "import os, sys; p = sys.argv[1]; print(sorted((k, os.getxattr(p, k).decode()) for k in os.listxattr(p)))"


def test_file_metadata_on_writes(box: Sandbox) -> None:
    info = box.files.write("/home/user/meta.txt", "tagged", metadata={"Owner": "agent-7", "stage": "draft"})
    assert info.metadata == {"owner": "agent-7", "stage": "draft"}  # keys lowercased, as envd does
    got = box.commands.run(f"python3 -c '{XATTRS}' /home/user/meta.txt").stdout.strip()
    assert got == "[('user.e2b.owner', 'agent-7'), ('user.e2b.stage', 'draft')]"
    assert box.files.get_info("/home/user/meta.txt").owner == "user"
    many = box.files.write_files(
        [{"path": "/home/user/m1.txt", "data": "1"}, {"path": "/home/user/m2.txt", "data": "2"}], metadata={"k": "v"}
    )
    assert [w.metadata for w in many] == [{"k": "v"}, {"k": "v"}]
    assert "user.e2b.k" in box.commands.run(f"python3 -c '{XATTRS}' /home/user/m2.txt").stdout
    with pytest.raises(e2b.InvalidArgumentException):  # (the SDK checks keys before sending)
        box.files.write("/home/user/bad.txt", "x", metadata={"no spaces": "v"})


def test_templates_by_name(opts: dict[str, Any]) -> None:
    from e2b import Template

    assert Template.exists("base", **opts) and Template.alias_exists("default", **opts)
    assert not Template.exists("no-such-template", **opts)


def test_every_unserved_call_raises_the_sdks_own_exception(box: Sandbox, opts: dict[str, Any]) -> None:
    """Each call the endpoint does not serve gets E2B's unknown-route answer (404 with
    ``{"code", "message"}``): the SDK raises its usual exception for it, or its
    not-found answer (False for a delete), and the endpoint keeps serving."""
    from e2b import Secret, Template, Volume
    from e2b.exceptions import (
        BuildException,
        SecretException,
        SecretNotFoundException,
        TemplateException,
        VolumeException,
        VolumeNotFoundException,
    )

    with pytest.raises(SecretException, match="404"):
        Secret.create("name", "value", **opts)
    with pytest.raises(SecretException, match="404"):
        Secret.list(**opts).next_items()
    with pytest.raises(SecretNotFoundException):
        Secret.get_info("name", **opts)
    assert Secret.exists("name", **opts) is False and Secret.destroy("name", **opts) is False
    with pytest.raises(VolumeException, match="404"):
        Volume.create("vol", **opts)
    with pytest.raises(VolumeException, match="404"):
        Volume.list(**opts)
    with pytest.raises(VolumeNotFoundException):
        Volume.connect("vol", **opts)
    assert Volume.destroy("vol", **opts) is False
    with pytest.raises(BuildException, match="404"):
        Template.build(Template().from_image("debian:12"), "mine", **opts)
    with pytest.raises(TemplateException, match="404"):
        Template.get_tags("base", **opts)
    with pytest.raises(TemplateException, match="404"):
        Template.assign_tags("base:v1", ["v2"], **opts)
    with pytest.raises(e2b.NotFoundException):  # no MCP gateway in the sandbox
        box.get_mcp_token()
    assert box.commands.run("echo still-serving").stdout == "still-serving\n"


def test_signed_file_urls(box: Sandbox, opts: dict[str, Any]) -> None:
    """download_url / upload_url: the signature is the credential, for that path,
    operation and user, until it expires or the sandbox goes."""
    box.files.write("/home/user/signed.txt", "by signature")
    r = httpx.get(box.download_url("/home/user/signed.txt"))
    assert (r.status_code, r.text) == (200, "by signature")
    r = httpx.get(box.download_url("/home/user/signed.txt", use_signature_expiration=120))
    assert (r.status_code, r.text) == (200, "by signature")
    up = box.upload_url("/home/user/uploaded.txt")
    r = httpx.post(up, files={"file": ("uploaded.txt", b"posted")})
    assert r.status_code == 200, r.text
    assert box.files.read("/home/user/uploaded.txt") == "posted"
    assert box.files.get_info("/home/user/uploaded.txt").owner == "user"
    # refused: another path, another operation, another user, expired, no signature at all
    url = box.download_url("/home/user/signed.txt")
    refused = [
        url.replace("signed.txt", "uploaded.txt"),
        url + "&username=root",
        box.download_url("/home/user/signed.txt", use_signature_expiration=-5),
        url.split("&signature=")[0] + "&signature=v1_AAAA",
    ]
    for bad in refused:
        r = httpx.get(bad)
        assert r.status_code == 401 and set(r.json()) == {"code", "message"}, bad
    assert httpx.post(url, files={"file": ("x", b"x")}).status_code == 401  # a read's signature
    assert httpx.get(url.split("?")[0] + "?path=/home/user/signed.txt").status_code == 401  # nothing signed
    # a removed sandbox's URLs open nothing
    other = Sandbox.create(timeout=300, **opts)
    other.files.write("/tmp/gone.txt", "soon gone")
    gone = other.download_url("/tmp/gone.txt")
    assert httpx.get(gone).text == "soon gone"
    other.kill()
    assert httpx.get(gone).status_code == 401
