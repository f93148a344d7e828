"""Principals end to end: a real ``sandvisor serve --group nogroup`` process, real VMs,
and clients of other uids (Debian's python, :mod:`peerclient`): a member of ``--group``
sees and acts on its own sandbox only; root, an admin, sees and acts on all.
(The ownership matrix on fake VMs: tests/unit/test_principals.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from images.build import Image
from supervisor.client import NotFound, Sandbox
from supervisor.main.throwaway import supervisor_process, workdir
from tests.support.peerclient import install

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or not Path("/usr/bin/python3").exists(), reason="clients of other uids need root"
    ),
]
NOBODY, NOGROUP = 65534, 65534


def as_nobody(client: Path, sock: Path, calls: list[tuple[str, dict[str, Any]]], **hello: Any) -> Any:
    p = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOGROUP}",
            "--clear-groups",
            "/usr/bin/python3",
            str(client),
            str(sock),
            json.dumps(hello),
            json.dumps(calls),
        ],
        capture_output=True,
        timeout=300,
        check=True,
    )
    out = json.loads(p.stdout)
    return out.get("results", out)


@pytest.fixture
def client() -> Iterator[Path]:
    """The client, where another uid reaches it (pytest's tmp_path is under a 0700 dir)."""
    d = Path(tempfile.mkdtemp(prefix="sv-prin-client-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield install(d / "client")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_group_member_sees_only_its_own_sandbox_on_real_vms(image: Image, client: Path) -> None:
    with workdir("sv-prin-") as work, supervisor_process(work, "--group", "nogroup"):
        sock = work.socket
        with Sandbox.create("roots", socket=sock) as roots:
            assert roots.state() == "ready"
            made = as_nobody(client, sock, [("Create", {"id": "nobodys"})])
            assert made[0]["ok"]["id"] == "nobodys"
            deadline = time.monotonic() + 240
            while (state := Sandbox("nobodys", socket=sock).state()) != "ready":  # (root sees it)
                assert state == "starting" and time.monotonic() < deadline, state
                time.sleep(0.2)
            got = as_nobody(
                client,
                sock,
                [
                    ("ListAll", {}),
                    ("Inspect", {"id": "roots"}),
                    ("Run", {"id": "roots", "cmd": ["id", "-u"]}),
                    ("Remove", {"id": "roots", "force": True}),
                    ("Inspect", {"id": "no-such-sandbox"}),
                    ("Run", {"id": "nobodys", "cmd": ["echo", "in my own"]}),
                ],
            )
            assert [s["id"] for s in got[0]["ok"]["sandboxes"]] == ["nobodys"]
            assert got[1:4] == [{"fail": ["NOT_FOUND", "no sandbox 'roots'"]}] * 3
            assert got[4] == {"fail": ["NOT_FOUND", "no sandbox 'no-such-sandbox'"]}  # the same: no oracle
            assert got[5]["items"][0]["data"] == "in my own\n" and got[5]["items"][-1]["exit_code"] == 0
            refused = as_nobody(client, sock, [("ListAll", {})], act_as="uid:0", act_as_admin=True)
            assert refused["hello"][0] == "PERMISSION_DENIED"
            assert roots.run("echo still here").stdout == b"still here\n"  # untouched
            listed = {s.id for s in Sandbox.list(socket=sock).sandboxes}
            assert listed == {"roots", "nobodys"}  # root: an admin, sees both
            assert Sandbox("nobodys", socket=sock).run("echo root too").stdout == b"root too\n"
            Sandbox("nobodys", socket=sock).remove(force=True)
        with pytest.raises(NotFound):
            Sandbox("roots", socket=sock).state()
