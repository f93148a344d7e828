"""Modify's additions against a real VM and real clients (docs/modify.md): one tap
sandbox with a secret (so its proxy runs) in namespaces the test makes
(tests/support/netlab.py), a stand-in HTTPS internet recording what arrives
(tests/support/httpslab.py). In order: an env key removed (SDK); a secret added live
and used by curl in the guest, then re-hosted and given a new placeholder (CLI); a
ceiling and env saved with policy next_start while it runs (CLI), nothing changed
until it is stopped and started, then the new ceiling is the machine's and a live
resize up to it reports its resources (SDK); the plan's conflicts over gRPC
(sandvisor.v1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import grpc
import pytest
import trio

from images.build import Image
from supervisor.client import AsyncSandbox, FailedPrecondition, SecretUpdate
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
from tests.support.httpslab import HttpsServer
from tests.vm.test_secrets import lab, serving

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, TAP, jail)")

TOKEN = b"sk-token-0123456789abcdef-first"
ADDED = b"sk-added-fedcba9876543210-second"
NEW_PLACEHOLDER = "PLACEHOLDER_FOR_KEY2_0123456789abcdef"


async def cli(work: Any, *args: str) -> subprocess.CompletedProcess[bytes]:
    def call() -> subprocess.CompletedProcess[bytes]:
        argv = [sys.executable, "-m", "supervisor.main.cli", *args]
        return subprocess.run(argv, check=False, env=work.env(), capture_output=True, timeout=600)

    return await trio.to_thread.run_sync(call)


async def sh(box: AsyncSandbox, script: str) -> str:
    r = await box.run(["sh", "-c", script])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return r.stdout.decode().strip()


def curl(url: str, var: str) -> str:
    return f'curl -sS --max-time 30 -w " %{{http_code}}" -H "Authorization: Bearer ${var}" {url}'


def auth_seen(server: HttpsServer, host: str, target: str) -> list[str]:
    return [s.headers["authorization"] for s in server.to(host) if s.target == target]


async def test_modify_env_remove_secrets_next_start_and_ceilings(image: Image) -> None:
    async with lab() as (work, server):
        grpc_sock = work.root / "g.sock"
        with trio.fail_after(1500):
            async with serving(work, grpc=(f"unix://{grpc_sock}",), templates=False) as reg:
                box = await AsyncSandbox.create(
                    "mm",
                    socket=work.socket,
                    network="tap",
                    cpus=1,
                    memory_mib=256,
                    env={"A": "1", "B": "2"},
                    secrets=[f"TOKEN=value:{TOKEN.decode()}@api.test"],
                )
                await env_removed(box)
                await secret_added_rehosted_and_used(work, box, server)
                await next_start_and_ceiling(work, box)
                with grpc.insecure_channel(f"unix:{grpc_sock}") as ch:
                    await conflicts_over_grpc(sv_grpc.SandvisorServiceStub(ch))
                await box.remove()
                vault = reg.settings.vault
                assert vault is not None and not any(ADDED in o["values"].values() for o in vault.owners.values())


async def env_removed(box: AsyncSandbox) -> None:
    assert await sh(box, 'echo "${A:-none} ${B:-none}"') == "1 2"
    r = await box.modify(env_remove=["A"])
    assert r.applied and [(c.kind, c.status) for c in r.changes] == [("env_remove", "applied_live")]
    assert [w.field for w in r.warnings] == ["env"] and not r.conflicts
    assert await sh(box, 'echo "${A:-none} ${B:-none}"') == "none 2"


async def secret_added_rehosted_and_used(work: Any, box: AsyncSandbox, server: HttpsServer) -> None:
    # added while it runs: its proxy intercepts 443 already, so the next request has it
    r = await box.modify(secrets=[SecretUpdate(name="KEY2", value=ADDED, hosts="other.test")])
    assert r.applied and [(c.value, c.status) for c in r.changes] == [("KEY2: added", "applied_live")]
    assert ADDED.decode() not in repr(r)
    placeholder = await sh(box, "echo $KEY2")
    assert placeholder.startswith("SANDVISOR_SECRET_KEY2_") and ADDED.decode() not in placeholder
    assert (await sh(box, curl("https://other.test/added", "KEY2"))).endswith(" 200")
    assert auth_seen(server, "other.test", "/added") == ["Bearer " + ADDED.decode()]

    # re-hosted to api.test with a placeholder of the caller's (the CLI)
    argv = ["--secret-hosts", "KEY2=api.test", "--secret-placeholder", f"KEY2={NEW_PLACEHOLDER}"]
    p = await cli(work, "modify", "mm", *argv, "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert [(c["value"], c["status"]) for c in r["changes"]] == [
        ("KEY2: hosts updated, placeholder updated", "applied_live")
    ]
    assert "old placeholder" in r["warnings"][0]["message"]  # running processes hold the old one
    assert await sh(box, "echo $KEY2") == NEW_PLACEHOLDER
    assert (await sh(box, curl("https://api.test/rehosted", "KEY2"))).endswith(" 200")
    assert auth_seen(server, "api.test", "/rehosted") == ["Bearer " + ADDED.decode()]
    # other.test is no longer its host: no secret's, so the proxy passes the connection
    # through (-k: the guest does not trust the stand-in's CA) with the placeholder in it
    out = await sh(box, curl("-k https://other.test/no-longer", "KEY2") + " || true")
    assert auth_seen(server, "other.test", "/no-longer") == ["Bearer " + NEW_PLACEHOLDER], out
    listed = json.loads((await cli(work, "secret", "ls", "--sandbox", "mm", "--json")).stdout)
    assert [(x["name"], x["hosts"], x["placeholder"]) for x in listed][1] == ("KEY2", ["api.test"], NEW_PLACEHOLDER)


async def next_start_and_ceiling(work: Any, box: AsyncSandbox) -> None:
    # saved for the next start while it runs (the CLI): nothing changes now
    p = await cli(work, "modify", "mm", "--max-cpus", "2", "--env", "LATER=1", "--policy", "next_start", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["applied"] and r["pending"] and r["policy"] == "next_start" and not r["restarted"]
    assert {c["kind"]: c["status"] for c in r["changes"]} == {
        "max_cpus": "applied_at_next_boot",
        "env": "applied_at_next_boot",
    }
    assert await sh(box, 'echo "${LATER:-none} $(nproc)"') == "none 1"
    info = await box.inspect()
    assert info.applied is not None and info.requested is not None
    assert info.applied.max_vcpus == 1 and info.requested.max_vcpus == 1
    assert info.pending is not None and info.pending.max_vcpus == 2 and info.pending.env["LATER"] == "1"
    # a plain Modify now would be lost at the start: refused (next_start adds up, restart applies)
    with pytest.raises(FailedPrecondition, match="next start"):
        await box.modify(cpus=2)

    await box.stop()
    await box.start()
    info = await box.inspect()
    assert info.applied is not None and (info.applied.vcpus, info.applied.max_vcpus) == (1, 2)
    assert info.pending is None
    assert await sh(box, 'echo "${LATER:-none} ${A:-none} $KEY2"') == f"1 none {NEW_PLACEHOLDER}"
    # the new ceiling is the machine's: a live resize up to it, reported per resource
    r3 = await box.modify(cpus=2)
    assert r3.applied and r3.settled
    by = {x.resource: x for x in r3.resize}
    assert (by["cpus"].requested, by["cpus"].actual, by["cpus"].state) == (2, 2, "settled")
    assert by["memory"].requested == 256 and by["memory"].state in ("settled", "converging")
    assert await sh(box, "nproc") == "2"


async def conflicts_over_grpc(stub: Any) -> None:
    def call() -> Any:
        return stub.Modify(
            sv.ModifyRequest(id="mm", max_vcpus=4, env_remove=["B"], dry_run=True, policy="no_restart"), timeout=60
        )

    r = await trio.to_thread.run_sync(call)
    assert not r.applied and r.policy == "no_restart"
    assert [c.field for c in r.conflicts] == ["max_cpus"] and "restart" in r.conflicts[0].message
    assert {c.kind: c.status for c in r.changes} == {"max_cpus": "needs_restart", "env_remove": "applied_live"}
    assert [w.field for w in r.warnings] == ["env"]
