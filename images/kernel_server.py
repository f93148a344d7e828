"""The guest's kernel server: Jupyter kernels run with jupyter_client inside a sandbox.

This file's source is what runs in the guest (``python3 -c SOURCE``, through an Exec
of the supervisor: :mod:`supervisor.serve.e2b_kernels`); it imports only the guest
image's packages (the code-interpreter profile: ipykernel, jupyter_client). It speaks
JSON lines: one request a line on stdin, answers on stdout, each tagged with its
request's ``id``::

    {"id": 1, "op": "execute", "code": "1+1", "context": null, "language": null,
     "envs": {}, "timeout": 30}
    {"id": 2, "op": "create", "language": "python", "cwd": "/home/user"}
    {"id": 3, "op": "list"}   {"id": 4, "op": "restart", "context": "C"}
    {"id": 5, "op": "remove", "context": "C"}   {"id": 6, "op": "interrupt", "target": 1}

    {"id": 1, "msg": {"type": "stdout", "text": "..."}}     (an execute's stream)
    {"id": 1, "done": true, "value": ...}                   (its end; or "error": {...})

An execute's messages are E2B's code-interpreter lines (stdout, stderr, result with
its MIME bundle and ``is_main_result``, error with name/value/traceback,
number_of_executions). A context is a kernel; cells on one context run one at a
time. ``interrupt`` (or an execute's own ``timeout``) interrupts the kernel: the cell
ends with a TimeoutError and the next cell runs. The default context (python) is
started with the server, so the first cell does not wait for a kernel to start.
The server ends when stdin closes, shutting its kernels down.
"""

import json
import os
import queue
import sys
import threading
import time
import uuid
from typing import Any

from jupyter_client.manager import KernelManager

LANGUAGES = {"python": "python3", "python3": "python3"}
MIME = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "image/svg+xml": "svg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
DEFAULT_CWD = "/home/user"
_out = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    line = json.dumps(obj, default=str) + "\n"
    with _out:
        sys.stdout.write(line)
        sys.stdout.flush()


class Failure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Context:
    def __init__(self, language: str | None, cwd: str | None, cid: str | None = None) -> None:
        kernel = LANGUAGES.get(language or "python")
        if kernel is None:
            raise Failure(400, f"no kernel for language {language!r} (there is: python)")
        self.id = cid or str(uuid.uuid4())
        self.language = "python" if kernel == "python3" else language
        self.cwd = cwd or DEFAULT_CWD
        os.makedirs(self.cwd, exist_ok=True)
        self.lock = threading.Lock()  # one cell at a time
        self.km: Any = None
        self.kc: Any = None
        self.start()

    def start(self) -> None:
        env = dict(os.environ, MPLBACKEND="module://matplotlib_inline.backend_inline", PYTHONUNBUFFERED="1")
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=self.cwd, env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def stop(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
        except Exception:  # (a kernel already gone)
            pass

    def restart(self) -> None:
        with self.lock:
            self.stop()
            self.start()

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def execute(
        self, rid: Any, code: str, envs: dict[str, str], timeout: float | None, cancel: threading.Event
    ) -> None:
        with self.lock:
            if envs:
                setup = "import os as _o\n" + "".join(f"_o.environ[{k!r}] = {v!r}\n" for k, v in envs.items())
                self.kc.execute(setup + "del _o", silent=True, store_history=False)
            msg_id = self.kc.execute(code, store_history=True)
            deadline = time.monotonic() + timeout if timeout else None
            interrupted = False
            while True:
                if not interrupted and (cancel.is_set() or (deadline is not None and time.monotonic() > deadline)):
                    self.km.interrupt_kernel()
                    interrupted = True
                try:
                    msg = self.kc.get_iopub_msg(timeout=0.1)
                except queue.Empty:
                    if not self.km.is_alive():
                        raise Failure(500, "the kernel died") from None
                    continue
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    stream, text = content["name"], content["text"]  # (timestamp: ns since the epoch)
                    emit({"id": rid, "msg": {"type": stream, "text": text, "timestamp": time.time_ns()}})
                elif kind in ("execute_result", "display_data"):
                    emit({"id": rid, "msg": result(content, kind == "execute_result")})
                elif kind == "error":
                    name = content.get("ename", "")
                    if interrupted and name == "KeyboardInterrupt":
                        name = "TimeoutError"
                    tb = "\n".join(content.get("traceback", []))
                    value = content.get("evalue", "")
                    emit({"id": rid, "msg": {"type": "error", "name": name, "value": value, "traceback": tb}})
                elif kind == "execute_input":
                    count = content.get("execution_count")
                    emit({"id": rid, "msg": {"type": "number_of_executions", "execution_count": count}})
                elif kind == "status" and content.get("execution_state") == "idle":
                    return


def result(content: dict[str, Any], main: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in content.get("data", {}).items():
        if mime in MIME:
            out[MIME[mime]] = value
        else:
            extra[mime] = value
    if extra:
        out["extra"] = extra
    return out


class Server:
    def __init__(self) -> None:
        self.contexts: dict[str, Context] = {}
        self.default: dict[str, Context] = {}  # language -> its default context
        self.running: dict[Any, threading.Event] = {}  # request id -> its cancel event
        self.guard = threading.Lock()

    def context(self, cid: str | None, language: str | None) -> Context:
        with self.guard:
            if cid:
                ctx = self.contexts.get(cid)
                if ctx is None:
                    raise Failure(404, f"context {cid} not found")
                return ctx
            lang = language or "python"
            ctx = self.default.get(lang)
        if ctx is None:
            ctx = Context(lang, DEFAULT_CWD)
            with self.guard:
                ctx = self.default.setdefault(lang, ctx)
        return ctx

    def handle(self, req: dict[str, Any]) -> None:
        rid, op = req.get("id"), req.get("op")
        value: Any = None
        try:
            if op == "execute":
                cancel = threading.Event()
                with self.guard:
                    self.running[rid] = cancel
                try:
                    ctx = self.context(req.get("context"), req.get("language"))
                    code, envs = str(req.get("code", "")), req.get("envs") or {}
                    ctx.execute(rid, code, envs, req.get("timeout"), cancel)
                    value = None
                finally:
                    with self.guard:
                        self.running.pop(rid, None)
            elif op == "create":
                ctx = Context(req.get("language"), req.get("cwd"))
                with self.guard:
                    self.contexts[ctx.id] = ctx
                value = ctx.describe()
            elif op == "list":
                with self.guard:
                    value = [c.describe() for c in [*self.default.values(), *self.contexts.values()]]
            elif op == "restart":
                self.context(req.get("context"), None).restart()
                value = None
            elif op == "remove":
                with self.guard:
                    gone = self.contexts.pop(str(req.get("context")), None)
                if gone is None:
                    raise Failure(404, f"context {req.get('context')} not found")
                gone.stop()
                value = None
            elif op == "interrupt":
                with self.guard:
                    running = self.running.get(req.get("target"))
                if running is not None:
                    running.set()
                value = None
            else:
                raise Failure(400, f"unknown op {op!r}")
            emit({"id": rid, "done": True, "value": value})
        except Failure as f:
            emit({"id": rid, "done": True, "error": {"status": f.status, "message": f.message}})
        except Exception as exc:
            emit({"id": rid, "done": True, "error": {"status": 500, "message": f"{type(exc).__name__}: {exc}"}})

    def serve(self) -> None:
        try:
            ctx = Context("python", DEFAULT_CWD, cid="default-python")
            self.default["python"] = ctx
        except Exception as exc:
            emit({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
            return
        emit({"ready": True})
        for line in sys.stdin:
            try:
                req = json.loads(line)
            except ValueError:
                continue
            if isinstance(req, dict):
                threading.Thread(target=self.handle, args=(req,), daemon=True).start()
        with self.guard:
            every = [*self.default.values(), *self.contexts.values()]
        for ctx in every:
            ctx.stop()


if __name__ == "__main__":
    Server().serve()
