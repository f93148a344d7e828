"""E2B's code-interpreter SDK (``e2b-code-interpreter`` from PyPI, unchanged) against
``sandvisor serve --e2b`` on loopback: its default template (``code-interpreter-v1``)
boots the code-interpreter image (``sandvisor image build --profile code-interpreter``,
built once per session into the shared image cache), and its cells run in Jupyter
kernels in the guest. State persists between cells; a matplotlib chart comes back as a
PNG; stdout streams before the cell ends; errors have their name and traceback;
contexts are separate kernels, restart clears one; a cell past its timeout is
interrupted and the next one runs; a call without the sandbox's token is refused.
The module's first sandbox boots and saves the image's boot template with its kernel
server started and warm: later creates restore it, and their first cell runs in a
kernel started before they were asked for, each sandbox with its own state."""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest

ci = pytest.importorskip("e2b_code_interpreter")
httpx = pytest.importorskip("httpx")

from e2b import CommandExitException, NotFoundException, TimeoutException  # noqa: E402
from e2b_code_interpreter import Sandbox  # noqa: E402

from images.build import Builder, default_cache, hold_parts  # noqa: E402
from images.profiles import build_profile  # noqa: E402
from tests.support.e2bserve import e2b_endpoint  # noqa: E402

KEY = "e2b_code_interpreter_test_key"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """The profile built (once: a later build finds it cached) and held, then a
    throwaway supervisor with the E2B endpoint, whose state shares the image cache."""
    img = build_profile(Builder(default_cache()), "code-interpreter")
    with hold_parts(img), e2b_endpoint("sv-ci-", f"{KEY}\n") as (url, _):
        yield url


@pytest.fixture(scope="module")
def opts(endpoint: str) -> dict[str, Any]:
    return {"api_url": endpoint, "sandbox_url": endpoint, "api_key": KEY, "request_timeout": 300}


@pytest.fixture(scope="module")
def box(opts: dict[str, Any]) -> Iterator[Sandbox]:
    sb = Sandbox.create(timeout=1800, **opts)  # the SDK's default template: code-interpreter-v1
    try:
        yield sb
    finally:
        sb.kill()


def test_state_persists(box: Sandbox) -> None:
    first = box.run_code("x = 41", request_timeout=300)
    assert first.error is None and first.results == []
    r = box.run_code("x + 1")
    assert r.error is None
    assert [res.text for res in r.results if res.is_main_result] == ["42"]
    assert r.text == "42" and r.execution_count is not None and r.execution_count >= 2


def test_chart_is_a_png(box: Sandbox) -> None:
    r = box.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 9])\nplt.title('t')\nplt.show()",
        timeout=300,
    )
    assert r.error is None, r.error
    pngs = [res.png for res in r.results if res.png]
    assert len(pngs) == 1
    data = base64.b64decode(pngs[0])
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100


def test_stdout_streams_before_the_cell_ends(box: Sandbox) -> None:
    """The cell prints, then waits for a file that only the on_stdout callback writes:
    it ends only if its first line reached the client while it ran."""
    box.files.remove("/tmp/go") if box.files.exists("/tmp/go") else None
    seen: list[str] = []

    def on_stdout(msg: Any) -> None:
        seen.append(msg.line)
        if msg.line.startswith("waiting"):
            box.files.write("/tmp/go", "go")

    code = (
        "import os, time\nprint('waiting', flush=True)\n"
        "for _ in range(1200):\n    if os.path.exists('/tmp/go'): break\n    time.sleep(0.05)\n"
        "print('released' if os.path.exists('/tmp/go') else 'not released')"
    )
    r = box.run_code(code, on_stdout=on_stdout, timeout=120)
    assert r.error is None
    assert "".join(seen) == "waiting\nreleased\n"
    # Jupyter's stream messages are not lines: print() writes its text and its end
    # separately and ipykernel's IOPub thread flushes on a 0.2 s timer, so a slow guest
    # may send "released" and "\n" as two messages (E2B's server forwards them as is).
    assert "".join(r.logs.stdout) == "waiting\nreleased\n"
    assert r.logs.stdout[0] == "waiting\n"


def test_error_has_name_and_traceback(box: Sandbox) -> None:
    errors: list[Any] = []
    r = box.run_code("1/0", on_error=errors.append)
    assert r.error is not None and r.error.name == "ZeroDivisionError"
    assert "division by zero" in r.error.value
    assert "ZeroDivisionError" in r.error.traceback and r.error.traceback.count("\n") >= 1
    assert errors and errors[0].name == "ZeroDivisionError"
    assert box.run_code("'still here'").text == "'still here'"  # the kernel lives on


def test_contexts_are_separate_and_restart_clears(box: Sandbox) -> None:
    a = box.create_code_context(cwd="/tmp")
    b = box.create_code_context()
    assert a.id != b.id and a.cwd == "/tmp" and b.cwd == "/home/user" and a.language == "python"
    box.run_code("v = 'a'", context=a)
    box.run_code("v = 'b'", context=b)
    assert box.run_code("v", context=a).text == "'a'"
    assert box.run_code("v", context=b).text == "'b'"
    assert box.run_code("import os; os.getcwd()", context=a).text == "'/tmp'"
    listed = {c.id for c in box.list_code_contexts()}
    assert {a.id, b.id} <= listed

    box.restart_code_context(a)
    gone = box.run_code("v", context=a)
    assert gone.error is not None and gone.error.name == "NameError"
    assert box.run_code("v", context=b).text == "'b'"

    box.remove_code_context(b)
    assert b.id not in {c.id for c in box.list_code_contexts()}
    with pytest.raises(NotFoundException):
        box.run_code("v", context=b)


def test_timeout_interrupts_and_the_next_cell_runs(box: Sandbox) -> None:
    box.run_code("n = 0")
    with pytest.raises(TimeoutException):
        box.run_code("import time\nwhile True:\n    n += 1\n    time.sleep(0.01)", timeout=5)
    r = box.run_code("n > 0", timeout=60)  # waits for no 600 s: the loop was interrupted
    assert r.error is None and r.text == "True"


def test_a_call_without_the_token_is_refused(box: Sandbox, endpoint: str) -> None:
    hdrs = {"E2b-Sandbox-Id": box.sandbox_id, "E2b-Sandbox-Port": "49999"}
    for path, method in (("/contexts", "GET"), ("/execute", "POST")):
        r = httpx.request(method, endpoint + path, headers=hdrs, json={"code": "1"}, timeout=60)
        assert r.status_code == 401
        r = httpx.request(
            method,
            endpoint + path,
            headers={**hdrs, "E2B-Traffic-Access-Token": "nope"},
            json={"code": "1"},
            timeout=60,
        )
        assert r.status_code == 401


def test_a_create_from_the_template_finds_its_kernel_started(box: Sandbox, opts: dict[str, Any]) -> None:
    """``box`` booted and saved the template (its kernel started and warm before the
    checkpoint); two creates after it restore that template: the kernel their first
    cell runs in started before they were asked for (the same process, restored
    twice), sees the create's variables, and each has its own variables and random
    stream."""
    before = time.time()
    a = Sandbox.create(timeout=600, envs={"SV_CREATE_VAR": "from-create"}, **opts)
    try:
        b = Sandbox.create(timeout=600, **opts)
        try:
            probe = "import os; (float(os.environ['SANDVISOR_KERNEL_STARTED_AT']), os.getpid())"
            (started_a, pid_a), (started_b, pid_b) = (eval(sb.run_code(probe, timeout=120).text) for sb in (a, b))
            assert started_a < before and started_b < before
            assert pid_a == pid_b
            a.run_code("v = 'a'")
            b.run_code("v = 'b'")
            assert (a.run_code("v").text, b.run_code("v").text) == ("'a'", "'b'")
            # the create's variables reach the kernel that predates them
            assert a.run_code("import os; os.environ.get('SV_CREATE_VAR')").text == "'from-create'"
            draw = "import random; random.getrandbits(64)"
            assert a.run_code(draw).text != b.run_code(draw).text
        finally:
            b.kill()
    finally:
        a.kill()


def test_other_users_cannot_drive_the_kernel_server(box: Sandbox) -> None:
    """The server's port takes a connection only with its root-only token first: E2B's
    ``user`` (who runs commands) can neither read the token nor be served without it."""
    box.files.write(
        "/tmp/knock.py",
        "import socket\n"
        "s = socket.create_connection(('127.0.0.1', 49999))\n"
        "s.sendall(b'0' * 64 + b'\\n' + b'{\"id\": 1, \"op\": \"list\"}\\n')\n"
        "s.settimeout(60)\n"
        "print(repr(s.recv(4096)))\n",
    )
    r = box.commands.run("python3 /tmp/knock.py", user="user", timeout=120)
    assert r.stdout.strip() == "b''"  # closed, unanswered
    with pytest.raises(CommandExitException):
        box.commands.run("cat /run/sandvisor-kernels/token", user="user", timeout=60)


def test_the_default_user_owns_its_home(box: Sandbox) -> None:
    """The template's warm-up makes E2B's ``user`` before the kernel server (which would
    make the kernels' cwd, /home/user, as root): commands as ``user`` write there."""
    r = box.commands.run("touch /home/user/mine && stat -c %U /home/user /home/user/mine", user="user", timeout=60)
    assert r.stdout.split() == ["user", "user"]


def test_pause_after_run_code_and_the_kernel_s_variables_after_the_resume(box: Sandbox, opts: dict[str, Any]) -> None:
    """Run code, pause (E2B's ``beta_pause``: sandvisor's hibernation), connect (which
    resumes), run more: between cells the sandbox holds no relay to its kernel server,
    so the pause is not refused, and the kernel, a process of the guest, kept its
    variables."""
    assert box.run_code("kept = 'before the pause'", request_timeout=300).error is None
    assert box.pause() is True
    assert box.get_info().state.value == "paused"
    resumed = Sandbox.connect(box.sandbox_id, **opts)
    assert resumed.run_code("kept", request_timeout=300).text == "'before the pause'"
