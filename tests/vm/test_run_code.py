"""sandvisor's own code interpreter (docs/code.md) against a real ``sandvisor serve`` and
one real VM from the code-interpreter image (``sandvisor image build --profile
code-interpreter``, built once into the shared cache; the first kernel start under TCG
is slow, so every test shares the one sandbox): the SDK's ``run_code`` and contexts,
the CLI's ``run-code`` writing a plot's PNG, the MCP ``run_code`` tool through the
``mcp`` package's client returning it as image content, sandvisor.v1's RunCode through
the generated gRPC client; a principal that may not exec in the sandbox is refused, and
an image without the kernel runtime is FAILED_PRECONDITION naming the profile. After
``run_code`` the sandbox is idle (the relay to the kernel server is open only while a
call is in flight): it checkpoints, forks, pauses and resumes with its variables, and
its idle timeout stops it (the module's last test: it ends the sandbox)."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio

from images.build import Builder, default_cache, hold_parts
from images.profiles import build_profile
from supervisor.client import AsyncSandbox, FailedPrecondition, NotFound, OutputMessage, Sandbox
from supervisor.client.sdk.acting import acting_as
from supervisor.main.throwaway import supervisor_process, workdir
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc

PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 9])\nplt.title('t')\nplt.show()"


@pytest.fixture(scope="module")
def served() -> Iterator[dict[str, Any]]:
    """A throwaway supervisor that may boot the profile's rootfs (``--allow-path``), with
    sandvisor.v1 on a Unix socket, and one sandbox of the code-interpreter image."""
    img = build_profile(Builder(default_cache()), "code-interpreter")
    with (
        hold_parts(img),
        workdir("sv-rc-", private_state=False) as work,
        supervisor_process(
            work, "--allow-path", str(img.rootfs.parent), "--grpc", f"unix://{work.root / 'g.sock'}"
        ) as (env, _),
    ):
        sock = str(work.socket)
        sb = Sandbox.create("rc", socket=sock, image_disk=str(img.rootfs), memory_mib=1024, detached=True)
        yield {"env": env, "sb": sb, "socket": sock, "grpc": f"unix:{work.root / 'g.sock'}", "root": work.root}


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def test_state_persists_between_cells(served: dict[str, Any]) -> None:
    sb: Sandbox = served["sb"]
    first = sb.run_code("x = 41")  # (the first cell waits for the kernel server to start)
    assert first.error is None and first.results == []
    r = sb.run_code("x + 1")
    assert r.error is None
    assert [res.text for res in r.results if res.is_main_result] == ["42"]
    assert r.text == "42" and r.execution_count is not None and r.execution_count >= 2


def test_print_streams_before_the_cell_ends(served: dict[str, Any]) -> None:
    """The cell prints, then waits for a file only the on_stdout callback writes: it ends
    only if its first line reached the client while it ran."""
    sb: Sandbox = served["sb"]
    seen: list[OutputMessage] = []

    def on_stdout(msg: OutputMessage) -> None:
        seen.append(msg)
        if msg.line.startswith("waiting"):
            sb.fs.write("/tmp/go", b"go")

    code = (
        "import os, time\nprint('waiting', flush=True)\n"
        "for _ in range(1200):\n    if os.path.exists('/tmp/go'): break\n    time.sleep(0.05)\n"
        "print('released' if os.path.exists('/tmp/go') else 'not released')"
    )
    r = sb.run_code(code, on_stdout=on_stdout, timeout=120)
    assert r.error is None
    assert "".join(m.line for m in seen) == "waiting\nreleased\n"
    # Stream messages are not lines (ipykernel flushes on a timer): compare the text.
    assert "".join(r.logs.stdout) == "waiting\nreleased\n" and r.logs.stdout[0] == "waiting\n"
    assert seen[0].timestamp > 0 and not seen[0].error


def test_an_error_has_its_name_value_and_traceback(served: dict[str, Any]) -> None:
    sb: Sandbox = served["sb"]
    errors: list[Any] = []
    r = sb.run_code("1/0", on_error=errors.append)
    assert r.error is not None and r.error.name == "ZeroDivisionError"
    assert "division by zero" in r.error.value
    assert "ZeroDivisionError" in r.error.traceback and r.error.traceback.count("\n") >= 1
    assert errors == [r.error]
    assert sb.run_code("'still here'").text == "'still here'"  # the kernel lives on


def test_a_plot_is_a_png(served: dict[str, Any]) -> None:
    sb: Sandbox = served["sb"]
    results: list[Any] = []
    r = sb.run_code(PLOT, on_result=results.append, timeout=300)
    assert r.error is None, r.error
    pngs = [res for res in r.results if res.png]
    assert len(pngs) == 1 and results == r.results and not pngs[0].is_main_result
    assert "png" in pngs[0].formats() and "text" in pngs[0].formats()
    width, height = png_size(pngs[0].data("png"))
    assert width > 100 and height > 100


def test_contexts_are_separate_and_restart_clears(served: dict[str, Any]) -> None:
    sb: Sandbox = served["sb"]
    a = sb.create_code_context(cwd="/tmp")
    b = sb.create_code_context()
    assert a.id != b.id and a.cwd == "/tmp" and b.cwd == "/home/user" and a.language == "python"
    sb.run_code("v = 'a'", context=a)
    sb.run_code("v = 'b'", context=b.id)
    assert sb.run_code("v", context=a).text == "'a'"
    assert sb.run_code("v", context=b).text == "'b'"
    assert sb.run_code("import os; os.getcwd()", context=a).text == "'/tmp'"
    assert {a.id, b.id} <= {c.id for c in sb.list_code_contexts()}

    sb.restart_code_context(a)
    gone = sb.run_code("v", context=a)
    assert gone.error is not None and gone.error.name == "NameError"
    assert sb.run_code("v", context=b).text == "'b'"

    sb.remove_code_context(b)
    assert b.id not in {c.id for c in sb.list_code_contexts()}
    with pytest.raises(NotFound):
        sb.run_code("v", context=b)


def test_a_cell_past_its_timeout_is_interrupted_and_the_next_runs(served: dict[str, Any]) -> None:
    sb: Sandbox = served["sb"]
    sb.run_code("n = 0")
    r = sb.run_code("import time\nwhile True:\n    n += 1\n    time.sleep(0.01)", timeout=5)
    assert r.error is not None and r.error.name == "TimeoutError"
    after = sb.run_code("n > 0", timeout=60)
    assert after.error is None and after.text == "True"


def test_the_cli_prints_streams_and_writes_the_png(served: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = "print('hello from the kernel')\n" + PLOT
    r = subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", "run-code", "rc", code, "--out-dir", str(out)],
        env=served["env"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r
    assert "hello from the kernel" in r.stdout
    written = sorted(out.glob("*.png"))
    assert len(written) == 1 and f"image: {written[0]}" in r.stderr, r.stderr
    assert png_size(written[0].read_bytes())[0] > 100
    cell = tmp_path / "cell.py"
    cell.write_text("1/0\n")
    failed = subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", "run-code", "rc", "-f", str(cell)],
        env=served["env"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert failed.returncode == 1 and "ZeroDivisionError" in failed.stderr, failed


async def test_the_mcp_tool_returns_the_plot_as_image_content(served: dict[str, Any]) -> None:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=sys.executable, args=["-m", "supervisor.main.cli", "mcp", "--socket", served["socket"]]
    )
    with trio.fail_after(600):
        async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            r = await s.call_tool("run_code", {"sandbox_id": "rc", "code": "print('p')\n" + PLOT})
            assert not r.is_error, r.content
            summary = json.loads(r.content[0].text)
            assert summary["stdout"] == "p\n" and summary["error"] is None
            images = [c for c in r.content if c.type == "image"]
            assert len(images) == 1 and images[0].mime_type == "image/png"
            assert png_size(base64.b64decode(images[0].data))[0] > 100
            err = await s.call_tool("run_code", {"sandbox_id": "rc", "code": "1/0"})
            assert json.loads(err.content[0].text)["error"]["name"] == "ZeroDivisionError"
            missing = await s.call_tool("run_code", {"sandbox_id": "no-such", "code": "1"})
            assert missing.is_error and "NOT_FOUND: " in missing.content[0].text


def test_sandvisor_v1_run_code_streams(served: dict[str, Any]) -> None:
    """The generated gRPC client: RunCode's stream, then the context RPCs."""
    with grpc.insecure_channel(served["grpc"]) as ch:
        stub = sv_grpc.SandvisorServiceStub(ch)
        outs = list(stub.RunCode(sv.RunCodeRequest(id="rc", code="print('hi')\n6 * 7"), timeout=300))
        kinds = [o.kind for o in outs]
        assert kinds == ["execution_count", "stdout", "result"], outs
        assert outs[1].text == "hi\n" and outs[2].result.is_main_result and outs[2].result.text == "42"
        ctx = stub.CreateCodeContext(sv.CreateCodeContextRequest(id="rc", cwd="/tmp"), timeout=300)
        assert ctx.id and ctx.cwd == "/tmp"
        listed = stub.ListCodeContexts(sv.ListCodeContextsRequest(id="rc"), timeout=60)
        assert ctx.id in {c.id for c in listed.contexts}
        stub.RemoveCodeContext(sv.CodeContextRequest(id="rc", context=ctx.id), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.RunCode(sv.RunCodeRequest(id="rc", code="1", context=ctx.id), timeout=60))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            list(stub.RunCode(sv.RunCodeRequest(id="nobody", code="1"), timeout=60))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_principal_that_may_not_exec_there_is_refused(served: dict[str, Any]) -> None:
    """Another principal (root acting for it) does not see the sandbox: NOT_FOUND, as Run."""
    with acting_as("uid:4242"):
        other = Sandbox("rc", socket=served["socket"])
        with pytest.raises(NotFound):
            other.run_code("1")
        with pytest.raises(NotFound):
            other.list_code_contexts()
        with pytest.raises(NotFound):
            other.run(["true"])


def test_an_image_without_the_kernel_runtime_names_the_profile(served: dict[str, Any]) -> None:
    plain = Sandbox.create("plain", socket=served["socket"], detached=True)
    try:
        with pytest.raises(FailedPrecondition) as err:
            plain.run_code("1")
        assert "sandvisor image build --profile code-interpreter" in err.value.message
    finally:
        plain.remove(force=True)


async def test_after_run_code_it_checkpoints_forks_pauses_and_resumes_with_its_variables(
    served: dict[str, Any],
) -> None:
    """A code interpreter's user runs code, then pauses (or forks after preparing data):
    the kernel server's relay closed with the cell's answer, so the sandbox has no exec
    session; the kernels live in the guest, so their variables come back, and a seed
    set in one cell holds for the next (the same life: no reseed by a new relay)."""
    sb = AsyncSandbox("rc", socket=served["socket"])
    with trio.fail_after(900):
        prep = "kept = 'prepared'\nimport random\nrandom.seed(7)\nfirst = random.random()\nrandom.seed(7)"
        assert (await sb.run_code(prep, timeout=300)).error is None
        assert (await sb.run_code("random.random() == first")).text == "True"
        done = await sb.checkpoint("after-run-code")
        assert done.snapshot_id
        [child] = await sb.fork()
        try:
            assert (await child.run_code("kept")).text == "'prepared'"
        finally:
            await child.remove(force=True)
        assert (await sb.run_code("kept")).text == "'prepared'"
        await sb.pause()
        assert await sb.state() == "paused"
        await sb.resume()
        assert (await sb.run_code("kept")).text == "'prepared'"


async def test_the_idle_timeout_stops_a_sandbox_that_ran_code(served: dict[str, Any]) -> None:
    """(Last: it stops the module's sandbox.)"""
    sb = AsyncSandbox("rc", socket=served["socket"])
    with trio.fail_after(180):
        assert (await sb.run_code("1 + 1", timeout=120)).text == "2"
        await sb.modify(idle_timeout=2)
        stopped = await sb.wait_until_stopped()
        assert stopped.source == "idle", stopped.describe()
