"""The code interpreter's edges without a VM: the kernel server's lines as the wire's
CodeOutput (the guest's word: anything, never a crash), the kernel runtime's refusals as
sandbox.v1's codes, and the SDK's plan folding a stream into an Execution with its
callbacks (the plan driven by hand, as a driver would)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from actors.face import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from supervisor.client.sdk import code_plans
from supervisor.client.sdk.ops import Open, Receive
from supervisor.serve.api_code import NO_RUNTIME, _domain, code_output
from supervisor.serve.kernels import KernelError
from supervisor.wire import protocol


def test_each_kind_of_line_becomes_its_output() -> None:
    assert code_output({"type": "stdout", "text": "hi\n", "timestamp": 5}) == protocol.CodeOutput(
        kind="stdout", text="hi\n", timestamp=5
    )
    assert code_output({"type": "stderr", "text": "e"}) == protocol.CodeOutput(kind="stderr", text="e")
    out = code_output(
        {
            "type": "result",
            "is_main_result": True,
            "text": "42",
            "png": "iVBO",
            "json": {"a": 1},
            "extra": {"application/x-thing": {"b": 2}},
        }
    )
    assert out is not None and out.kind == "result" and out.result is not None
    assert out.result.is_main_result and out.result.text == "42" and out.result.png == "iVBO"
    assert out.result.json == '{"a": 1}' and out.result.extra == {"application/x-thing": '{"b": 2}'}
    err = code_output({"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": "tb"})
    assert err == protocol.CodeOutput(
        kind="error", error=protocol.CodeError("ZeroDivisionError", "division by zero", "tb")
    )
    count = code_output({"type": "number_of_executions", "execution_count": 3})
    assert count == protocol.CodeOutput(kind="execution_count", execution_count=3)


@pytest.mark.parametrize(
    "line",
    [
        None,
        1,
        "x",
        [],
        {},
        {"type": "nope"},
        {"type": "result", "png": 7, "extra": "x"},
        {"type": "stdout", "timestamp": "x"},
    ],
)
def test_odd_lines_from_the_guest_do_not_break_the_stream(line: Any) -> None:
    out = code_output(line)
    assert out is None or isinstance(out, protocol.CodeOutput)


def test_the_runtime_s_refusals_are_typed() -> None:
    missing = _domain(
        KernelError(
            502, "code interpreter unavailable: the kernel server did not start: No module named 'jupyter_client'"
        )
    )
    assert (
        isinstance(missing, FailedPrecondition)
        and "sandvisor image build --profile code-interpreter" in missing.message
    )
    assert NO_RUNTIME in missing.message
    assert isinstance(
        _domain(KernelError(502, "the kernel server did not start: sandvisor: exec python3: not found")),
        FailedPrecondition,
    )
    assert isinstance(_domain(KernelError(400, "no kernel for language 'r'")), InvalidArgument)
    assert isinstance(_domain(KernelError(404, "context c not found")), NotFound)
    assert isinstance(_domain(KernelError(502, "code interpreter unavailable: the kernel server ended")), Unavailable)
    assert isinstance(_domain(KernelError(500, "the kernel died")), Unavailable)


def test_the_plan_folds_the_stream_into_an_execution_and_calls_back() -> None:
    class T:
        id = "sb"

    seen: dict[str, list[Any]] = {"out": [], "err": [], "res": [], "error": []}
    plan = code_plans.run_code(
        T(),
        "print(1); 2",
        context=code_plans.CodeContext("ctx-1"),
        on_stdout=seen["out"].append,
        on_stderr=seen["err"].append,
        on_result=seen["res"].append,
        on_error=seen["error"].append,
        envs={"A": "1"},
        timeout=5,
    )
    opened = plan.send(None)
    assert isinstance(opened, Open) and opened.method == "RunCode"
    assert opened.request == protocol.RunCodeRequest(
        id="sb", code="print(1); 2", context="ctx-1", envs={"A": "1"}, timeout_seconds=5.0
    )
    png = base64.b64encode(b"\x89PNG...").decode()
    items = [
        protocol.CodeOutput(kind="execution_count", execution_count=7),
        protocol.CodeOutput(kind="stdout", text="1\n", timestamp=9),
        protocol.CodeOutput(kind="stderr", text="w\n"),
        protocol.CodeOutput(kind="result", result=protocol.CodeResult(text="<Figure>", png=png)),
        protocol.CodeOutput(kind="result", result=protocol.CodeResult(is_main_result=True, text="2", json="[1]")),
        protocol.CodeOutput(kind="error", error=protocol.CodeError("E", "v", "tb")),
    ]
    step = plan.send("call")
    for item in items:
        assert isinstance(step, Receive) and step.item is protocol.CodeOutput
        step = plan.send(item)
    with pytest.raises(StopIteration) as done:
        plan.send(None)
    ex: code_plans.Execution = done.value.value
    assert ex.execution_count == 7 and ex.text == "2"
    assert ex.logs.stdout == ["1\n"] and ex.logs.stderr == ["w\n"]
    assert [m.line for m in seen["out"]] == ["1\n"] and seen["out"][0].timestamp == 9 and seen["err"][0].error
    assert ex.results == seen["res"] and ex.results[0].data("png") == b"\x89PNG..."
    assert ex.results[0].formats() == ["text", "png"] and ex.results[1].json == [1]
    assert ex.error == code_plans.ExecutionError("E", "v", "tb") and seen["error"] == [ex.error]


def test_language_and_context_together_are_refused() -> None:
    class T:
        id = "sb"

    with pytest.raises(ValueError, match="not both"):
        code_plans.run_code(T(), "1", language="python", context="c").send(None)


def test_outputs_too_big_for_a_frame_are_split_or_left_out() -> None:
    from supervisor.serve.api_code import MAX_RESULT, MAX_TEXT, OMITTED, fitted

    long = protocol.CodeOutput(kind="stdout", text="x" * (2 * MAX_TEXT + 5), timestamp=1)
    pieces = fitted(long)
    assert [len(p.text) for p in pieces] == [MAX_TEXT, MAX_TEXT, 5] and "".join(p.text for p in pieces) == long.text
    big = protocol.CodeResult(text="<Figure>", png="A" * MAX_RESULT, html="<b>" * 1000)
    (out,) = fitted(protocol.CodeOutput(kind="result", result=big))
    assert out.result is not None and out.result.png == "" and out.result.text == "<Figure>"
    assert out.result.html == big.html  # (what fits stays)
    assert json.loads(out.result.extra[OMITTED]) == {"png": MAX_RESULT}
    small = protocol.CodeOutput(kind="result", result=protocol.CodeResult(text="1"))
    assert fitted(small) == [small]
