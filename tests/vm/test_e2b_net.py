"""E2B's networking through ``sandvisor serve --e2b`` with tap networking, driven by the
unchanged ``e2b`` SDK on real VMs: internet access by default (an HTTP server in the
test's stand-in internet answers), none with ``allow_internet_access=False``,
``network={deny_out, allow_out}`` as egress entries under the supervisor's own denials
(the metadata address stays out of reach), and ``update_network`` changing a running
sandbox's egress (the supervisor's Modify).

The supervisor runs as a child of the test in a "host" network namespace the test makes,
linked to a stand-in internet namespace (tests/support/netlab.py); no packet leaves the
namespaces the test made.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

e2b = pytest.importorskip("e2b")

from e2b import Sandbox, SandboxException  # noqa: E402

from supervisor.main.throwaway import supervisor_process, workdir  # noqa: E402
from tests.support.e2bserve import free_port, wait_port  # noqa: E402
from tests.support.netlab import (  # noqa: E402
    METADATA,
    POOL,
    SERVERS,
    UPLINK_INET,
    forwarded,
    link_internet,
    namespaces,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, TAP, jail)")

KEY = "e2b_sandvisor_net_key"
ALL_TRAFFIC = "0.0.0.0/0"
# in the guest: one HTTP GET per URL -> its status, or the error's name
GET = """
import sys, urllib.request
def get(url):
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return str(r.status) + ":" + r.read().decode().strip()
    except Exception as e:
        return type(getattr(e, "reason", e)).__name__
print(" ".join(get(u) for u in sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def opts() -> Iterator[dict[str, Any]]:
    """The endpoint's SDK options: serve runs in a host namespace of the test's, its
    E2B port reached through a relay from this one."""
    with namespaces("sve2h", "sve2i") as (host, inet), workdir("sv-e2b-net-", private_state=True) as work:
        link_internet(host, inet)
        site = work.root / "site"
        site.mkdir()
        (site / "index.html").write_text("hello\n")
        assert inet.path is not None
        server = subprocess.Popen(
            ["nsenter", f"--net={inet.path}", sys.executable, "-m", "http.server", "80", "--bind", "0.0.0.0"],
            cwd=site,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            keys = work.root / "keys"
            keys.write_text(f"{KEY}\n")
            keys.chmod(0o600)
            port = free_port()
            args = (
                *("--ip-pool", POOL, "--dns-upstream", UPLINK_INET),
                *("--e2b", f"127.0.0.1:{port}", "--e2b-key-file", str(keys), "--registry-allow", "127.0.0.1:9"),
            )
            with contextlib.ExitStack() as stack:
                with host.entered():  # serve in the host namespace (its tap pool and uplink are there)
                    stack.enter_context(supervisor_process(work, *args, log=work.root / "serve.log"))
                    wait_port(port)
                # the SDK's HTTP runtime has threads of its own (made by an earlier test, in
                # this namespace): the endpoint is reached through a relay, not by entering
                local = stack.enter_context(forwarded(host, port))
                url = f"http://127.0.0.1:{local}"
                yield {"api_url": url, "sandbox_url": url, "api_key": KEY, "request_timeout": 300}
        finally:
            server.kill()
            server.wait()


def fetch(sb: Sandbox, *addresses: str) -> list[str]:
    sb.files.write("/tmp/get.py", GET)
    res = sb.commands.run("python3 /tmp/get.py " + " ".join(f"http://{a}/" for a in addresses), timeout=120)
    return res.stdout.split()


def test_internet_by_default_and_none_without_it(opts: dict[str, Any]) -> None:
    sb = Sandbox.create(timeout=600, **opts)
    try:
        assert sb.get_info().allow_internet_access is True
        got = fetch(sb, SERVERS[0], SERVERS[1], METADATA)
        assert got[:2] == ["200:hello", "200:hello"], got
        assert got[2] != "200:hello", got  # the supervisor's own denials stay
        # update_network replaces the running sandbox's egress policy (no restart)
        sb.update_network({"deny_out": [SERVERS[0]]})
        got = fetch(sb, SERVERS[0], SERVERS[1])
        assert got[0] != "200:hello" and got[1] == "200:hello", got
        sb.update_network({"allow_internet_access": False, "allow_out": [SERVERS[0]]})
        info = sb.get_info()
        assert info.allow_internet_access is False
        got = fetch(sb, SERVERS[0], SERVERS[1], METADATA)
        assert got[0] == "200:hello" and got[1] != "200:hello" and got[2] != "200:hello", got
        sb.update_network({})  # every rule cleared: internet access again
        assert sb.get_info().allow_internet_access is True
        assert fetch(sb, SERVERS[0], SERVERS[1]) == ["200:hello", "200:hello"]
        with pytest.raises(SandboxException, match="dnsServers"):
            sb.update_network({"dns_servers": ["1.1.1.1"]})
    finally:
        sb.kill()

    sb = Sandbox.create(timeout=600, allow_internet_access=False, **opts)
    try:
        assert sb.get_info().allow_internet_access is False
        got = fetch(sb, SERVERS[0], SERVERS[1])
        assert "200:hello" not in got, got
    finally:
        sb.kill()


def test_deny_out_and_allow_out(opts: dict[str, Any]) -> None:
    sb = Sandbox.create(timeout=600, network={"deny_out": [SERVERS[0]]}, **opts)
    try:
        got = fetch(sb, SERVERS[0], SERVERS[1])
        assert got[0] != "200:hello" and got[1] == "200:hello", got
    finally:
        sb.kill()

    # E2B's allow-list: all traffic denied but what allow_out names
    sb = Sandbox.create(timeout=600, network={"deny_out": [ALL_TRAFFIC], "allow_out": [SERVERS[1]]}, **opts)
    try:
        assert sb.get_info().allow_internet_access is False
        got = fetch(sb, SERVERS[0], SERVERS[1])
        assert got[0] != "200:hello" and got[1] == "200:hello", got
    finally:
        sb.kill()


def test_unserved_network_options_are_refused(opts: dict[str, Any]) -> None:
    with pytest.raises(SandboxException, match="dnsServers"):
        Sandbox.create(timeout=60, network={"dns_servers": ["1.1.1.1"]}, **opts)
