"""``sandvisor exec --user/--workdir`` and ``logs --until`` (CLI, sync and async SDK)
against a real ``sandvisor serve`` and a real VM: one sandbox for the module."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import trio

from images.build import Image
from supervisor.client import AsyncSandbox, Sandbox
from tests.support.vms import serve_process


@pytest.fixture(scope="module")
def served(image: Image) -> Iterator[dict[str, str]]:
    with serve_process("sv-cligaps-") as (env, _):
        r = cli(env, "create", "gaps", "--json")
        assert r.returncode == 0, r.stderr
        yield env


def cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


def test_exec_user_and_workdir(served: dict[str, str]) -> None:
    r = cli(served, "exec", "--user", "nobody", "gaps", "--", "id", "-u")
    assert (r.returncode, r.stdout) == (0, b"65534\n"), r.stderr
    r = cli(served, "exec", "--workdir", "/tmp", "gaps", "--", "pwd")
    assert (r.returncode, r.stdout) == (0, b"/tmp\n"), r.stderr
    r = cli(served, "exec", "--user", "nobody", "--workdir", "/tmp", "gaps", "--", "sh", "-c", "id -un; pwd")
    assert (r.returncode, r.stdout) == (0, b"nobody\n/tmp\n"), r.stderr


def _stdout(lines: bytes) -> list[str]:
    return [e["data"] for e in map(json.loads, lines.splitlines()) if e["source"] == "stdout"]


def test_logs_until(served: dict[str, str]) -> None:
    assert cli(served, "run", "gaps", "--", "echo", "before-until").returncode == 0
    until = time.time_ns()
    assert cli(served, "run", "gaps", "--", "echo", "after-until").returncode == 0

    # CLI: unix ns and ISO 8601 (microseconds: the ISO form rounds down, still after "before")
    got = _stdout(cli(served, "logs", "gaps", "--until", str(until), "--json").stdout)
    assert "before-until\n" in got and "after-until\n" not in got
    iso = datetime.datetime.fromtimestamp(until / 1e9, datetime.UTC).isoformat()
    got = _stdout(cli(served, "logs", "gaps", "--until", iso, "--json").stdout)
    assert "before-until\n" in got and "after-until\n" not in got

    # a followed stream whose until has passed: what was written up to it, then its end
    r = cli(served, "logs", "gaps", "-f", "--until", str(until), "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    got = _stdout(r.stdout)
    assert "before-until\n" in got and "after-until\n" not in got

    sock = served["SANDVISOR_SOCKET"]
    sb = Sandbox("gaps", socket=sock)
    data = [e.data for e in sb.log_stream(follow=False, until=until)]
    assert b"before-until\n" in data and b"after-until\n" not in data

    # a follow with an until ahead ends by itself when the clock passes it, with what came
    # in the meantime (a run while it follows)
    async def main() -> list[bytes]:
        asb = AsyncSandbox("gaps", socket=sock)
        seen: list[bytes] = []
        with trio.fail_after(60):
            stream = asb.log_stream(since=until, until=time.time_ns() + 15 * 10**9)
            async with trio.open_nursery() as n:

                async def follow() -> None:
                    async for e in stream:
                        seen.append(e.data)

                n.start_soon(follow)
                await asb.run(["echo", "while-following"])
        return seen

    seen = trio.run(main)
    assert b"while-following\n" in seen and b"after-until\n" in seen and b"before-until\n" not in seen

    # the CLI's follow ends at its until too
    r = cli(served, "logs", "gaps", "-f", "--until", str(time.time_ns() + 3 * 10**9), "--tail", "1", timeout=60)
    assert r.returncode == 0, r.stderr
