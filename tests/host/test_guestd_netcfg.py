"""guestd/netcfg.py (guestd's ``net_config``) against a real kernel: an interface in a
namespace the test makes, configured, then reconfigured as after a restore. The
real-VM runs are in tests/vm/test_net.py and tests/vm/test_net_supervisor.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from guestd import netcfg
from tests.support.netlab import namespaces, sh

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces)")


def ip_json(ns: str, *args: str) -> Any:
    out = subprocess.run(["ip", "-j", "-n", ns, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def test_configure_then_reconfigure(tmp_path: Path) -> None:
    with namespaces("svc") as (ns,):
        assert ns.name
        sh("ip", "-n", ns.name, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0")
        sh("ip", "-n", ns.name, "link", "set", "peer0", "up")
        with ns.entered():
            netcfg.configure("eth0", "10.88.0.2", 16, "10.88.0.1", "02:73:76:58:00:02")
        with ns.entered():  # a restore: new address, MAC; same gateway
            netcfg.configure("eth0", "10.88.3.9", 16, "10.88.0.1", "02:73:76:58:03:09")
        (link,) = ip_json(ns.name, "addr", "show", "dev", "eth0")
        v4 = [(a["local"], a["prefixlen"]) for a in link["addr_info"] if a["family"] == "inet"]
        assert v4 == [("10.88.3.9", 16)]
        assert link["address"] == "02:73:76:58:03:09" and "UP" in link["flags"]
        routes = ip_json(ns.name, "route", "show", "default")
        assert [(r["gateway"], r["dev"]) for r in routes] == [("10.88.0.1", "eth0")]
        with ns.entered():  # idempotent
            netcfg.configure("eth0", "10.88.3.9", 16, "10.88.0.1")
        for bad in [("eth0", "10.88.3.9", 33, "10.88.0.1"), ("eth0", "x", 16, "10.88.0.1"), ("eth0", "1", 16, "")]:
            with pytest.raises(ValueError):
                netcfg.configure(*bad)
        with pytest.raises(ValueError):
            netcfg.configure("eth0", "10.88.3.9", 16, "10.88.0.1", "03:00:00:00:00:01")  # multicast
    resolv = tmp_path / "resolv.conf"
    resolv.symlink_to("/etc/hostname")
    netcfg.write_resolv_conf(["10.88.0.1"], str(resolv))
    assert not resolv.is_symlink() and resolv.read_text() == "nameserver 10.88.0.1\n"
