"""The guest's kernel server: Jupyter kernels (ipykernel) run inside a sandbox.

This file's source is what runs in the guest (``python3 -c SOURCE start``, through an
Exec of the supervisor: :mod:`supervisor.serve.e2b_kernels`); it imports only the
guest image's packages (the code-interpreter profile: ipykernel, pyzmq). It launches
each kernel itself (a connection file of its own, ipykernel without its debugger)
and speaks Jupyter's wire protocol to it directly: no jupyter_client, whose imports,
kernel-spec and provisioner scans and per-call asyncio loops cost seconds to start a
kernel and tens of milliseconds a cell under TCG.

It is a service of the guest, not of one Exec: ``start`` forks a daemon (its own
session, stdio on /dev/null) that listens on ``127.0.0.1:49999`` (the port E2B's code
interpreter has), starts the default python kernel, warms it (the libraries cells
reach for imported, one cell run) and only then accepts connections; ``start``
returns once it does (exit 0), or at once if a server runs already. So a boot
template taken after ``start`` holds a started, warm kernel, and every sandbox
restored from it finds its server there: the host reaches it through a relay Exec
(bash's ``/dev/tcp``, :data:`supervisor.serve.kernels.RELAY`), open while requests
are in flight (a connection each time: the sandbox is idle between calls).

A connection is taken only with the server's token as its first line: a random
secret in a root-only file (:data:`TOKEN`) that the relay (root) sends, so the
sandbox's other users (E2B's ``user`` runs commands) cannot drive root's kernels
through the port. Then it speaks JSON lines: one request a line, answers tagged
with its request's ``id``, and a first line ``{"ready": true, ...}`` once taken;
the relay's own lines, ``LIFE <id>`` (the sandbox's life) and ``ENV <base64>`` (its
environment), come first::

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
time. ``interrupt`` (or an execute's own ``timeout``, or its connection closing)
interrupts the kernel: the cell ends with a TimeoutError and the next cell runs.

A ``LIFE`` other than the last one seen is a new life of the sandbox (a fork, a
sandbox restored from a template or a checkpoint; not the next relay of the same
sandbox, nor a pause and resume): each kernel's ``random`` (and numpy's global one)
is seeded again from the kernel's entropy before its next cell, so sandboxes
restored from one template do not share random streams (guestd reseeds the guest's
own generator at each restore), while a cell's ``random.seed(1)`` holds for the next
cell of the same sandbox. Each kernel's start time
(epoch seconds) is in its ``SANDVISOR_KERNEL_STARTED_AT``.
"""

import base64
import hmac
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

ADDRESS = ("127.0.0.1", 49999)
RUN_DIR = "/run/sandvisor-kernels"
TOKEN = RUN_DIR + "/token"
LOG = RUN_DIR + "/log"
LINE_MAX = 16 << 20  # a request line longer than this ends its connection
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
# imported in the default kernel before the server takes connections (into sys.modules,
# not the cell's namespace): a chart's first cell does not pay for them
WARM_IMPORTS = ("numpy", "pandas", "matplotlib.pyplot", "matplotlib_inline.backend_inline")
# the kernel: ipykernel as its kernel spec starts it, but without debugpy (the
# debugger: seconds of imports under TCG, and work in every cell) and without the
# SQLite history (a write per cell, on the sandbox's disk)
KERNEL_MAIN = (
    "import sys; sys.modules['debugpy'] = None\n"
    "from ipykernel.kernelapp import launch_new_instance\nlaunch_new_instance()\n"
)
KERNEL_ARGS = ["--HistoryManager.enabled=False"]
SHELL_VARS = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})  # the relay's own, not the sandbox's
RESEED = (
    "import random as _sv_r, sys as _sv_s\n_sv_r.seed()\n"
    "if 'numpy' in _sv_s.modules: _sv_s.modules['numpy'].random.seed()\ndel _sv_r, _sv_s\n"
)


class Failure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Conn:
    """One taken connection: its answers, written whole lines under a lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.running: dict[Any, threading.Event] = {}  # request id -> its cancel event
        self.closed = False

    def emit(self, obj: dict[str, Any]) -> None:
        data = (json.dumps(obj, default=str) + "\n").encode()
        with self.lock:
            if self.closed:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True


class Wire:
    """A kernel's shell and iopub sockets, spoken directly (Jupyter's wire protocol:
    HMAC-signed multipart JSON): jupyter_client's blocking client runs an asyncio
    loop per call and parses every date in every message, tens of ms per cell under
    TCG. One thread at a time (the context's lock)."""

    def __init__(self, info: dict[str, Any]) -> None:
        import zmq

        self.zmq = zmq
        self.key = info["key"].encode() if isinstance(info["key"], str) else info["key"]
        self.session = uuid.uuid4().hex
        url = f"{info['transport']}://{info['ip']}:"
        self.ctx = zmq.Context()
        self.shell = self.ctx.socket(zmq.DEALER)
        self.shell.linger = 0
        self.shell.connect(url + str(info["shell_port"]))
        self.iopub = self.ctx.socket(zmq.SUB)
        self.iopub.linger = 0
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(url + str(info["iopub_port"]))
        self.poller = zmq.Poller()
        self.poller.register(self.iopub, zmq.POLLIN)
        self.poller.register(self.shell, zmq.POLLIN)

    def send(self, msg_type: str, content: dict[str, Any]) -> str:
        msg_id = uuid.uuid4().hex
        header = {
            "msg_id": msg_id,
            "msg_type": msg_type,
            "username": "sandvisor",
            "session": self.session,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()),
            "version": "5.3",
        }
        parts = [json.dumps(header).encode(), b"{}", b"{}", json.dumps(content).encode()]
        sig = hmac.new(self.key, b"".join(parts), "sha256").hexdigest().encode()
        self.shell.send_multipart([b"<IDS|MSG>", sig, *parts])
        return msg_id

    def execute(self, code: str, *, silent: bool = False, store_history: bool = True) -> str:
        content = {
            "code": code,
            "silent": silent,
            "store_history": store_history,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": False,
        }
        return self.send("execute_request", content)

    def next(self, timeout: float) -> tuple[str, str, dict[str, Any]] | None:
        """The next iopub message, (parent msg_id, msg_type, content); None after
        ``timeout`` seconds without one (shell replies are read and dropped)."""
        while True:
            ready = dict(self.poller.poll(int(timeout * 1000)))
            if not ready:
                return None
            if self.shell in ready:
                self.shell.recv_multipart()
            if self.iopub in ready:
                frames = self.iopub.recv_multipart()
                i = frames.index(b"<IDS|MSG>")
                header, parent, content = (json.loads(f) for f in (frames[i + 2], frames[i + 3], frames[i + 5]))
                return parent.get("msg_id", ""), header.get("msg_type", ""), content

    def ready(self, timeout: float, proc: Any) -> None:
        """Until iopub hears the kernel (a SUB socket misses what is published before
        its subscription reaches the kernel)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the kernel exited ({proc.returncode})")
            self.send("kernel_info_request", {})
            if self.next(1.0) is not None:
                while self.next(0.2) is not None:  # (the rest of those answers)
                    pass
                return
        raise RuntimeError("the kernel's iopub is silent")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


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
        self.reseed = False
        self.pending_env: dict[str, str] = {}  # set in the kernel before its next cell
        self.pending_lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn_file = ""
        self.wire: Wire | None = None
        self.start()

    def start(self) -> None:
        """Launch the kernel (ipykernel, as its kernel spec does) on a connection file
        of our own and wait until it answers."""
        ports = []
        for _ in range(5):  # shell, iopub, stdin, control, heartbeat
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        info = dict(zip(("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port"), ports, strict=True))
        info.update(ip="127.0.0.1", transport="tcp", signature_scheme="hmac-sha256", kernel_name="python3")
        info["key"] = uuid.uuid4().hex
        path = os.path.join(RUN_DIR, f"kernel-{uuid.uuid4().hex}.json")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        env = dict(
            os.environ,
            MPLBACKEND="module://matplotlib_inline.backend_inline",
            PYTHONUNBUFFERED="1",
            SANDVISOR_KERNEL_STARTED_AT=repr(time.time()),
        )
        self.conn_file = path
        self.proc = subprocess.Popen(
            [sys.executable, "-c", KERNEL_MAIN, "-f", path, *KERNEL_ARGS],
            cwd=self.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.wire = Wire(info)
        try:
            self.wire.ready(300, self.proc)
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def interrupt(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # (as jupyter_client does: the cell's children too)

    def stop(self) -> None:
        if self.wire is not None:
            self.wire.close()
            self.wire = None
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # (the kernel and what its cells started)
            except OSError:
                pass
            self.proc.wait()
            self.proc = None
        try:
            os.unlink(self.conn_file)
        except OSError:
            pass

    def restart(self) -> None:
        with self.lock:
            self.stop()
            self.start()

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def warm(self, imports: tuple[str, ...]) -> None:
        """Import ``imports`` (into sys.modules only) and run a cell, silently: the
        first real cell finds them loaded and IPython's paths run once."""
        names = ", ".join(repr(m) for m in imports)
        code = f"import importlib as _sv_i\nfor _sv_m in ({names},):\n    _sv_i.import_module(_sv_m)\n"
        code += "del _sv_i, _sv_m\n"
        for cell in (code, "1+1"):
            self.execute(None, cell, {}, 300, threading.Event(), lambda _: None, silent=True)

    def _setup(self, wire: Wire, envs: dict[str, str]) -> None:
        """A new life's reseed and variables, and a cell's ``envs``: a silent request
        of their own, not waited for (the kernel runs it first). Under the lock."""
        setup = ""
        if self.reseed:
            setup, self.reseed = RESEED, False
        with self.pending_lock:
            envs, self.pending_env = {**self.pending_env, **envs}, {}
        if envs:
            setup += "import os as _o\n" + "".join(f"_o.environ[{k!r}] = {v!r}\n" for k, v in envs.items())
            setup += "del _o\n"
        if setup:
            wire.execute(setup, silent=True, store_history=False)

    def prime(self) -> None:
        """Send the set-up now, if no cell runs: the kernel does it before the first
        cell comes (a relay connects at create)."""
        if self.lock.acquire(blocking=False):
            try:
                if self.wire is not None:
                    self._setup(self.wire, {})
            finally:
                self.lock.release()

    def execute(
        self,
        rid: Any,
        code: str,
        envs: dict[str, str],
        timeout: float | None,
        cancel: threading.Event,
        emit: Any,
        *,
        silent: bool = False,
    ) -> None:
        with self.lock:
            wire = self.wire
            assert wire is not None
            self._setup(wire, envs)
            msg_id = wire.execute(code, silent=silent, store_history=not silent)
            deadline = time.monotonic() + timeout if timeout else None
            interrupted = False
            while True:
                if not interrupted and (cancel.is_set() or (deadline is not None and time.monotonic() > deadline)):
                    self.interrupt()
                    interrupted = True
                got = wire.next(0.1 if deadline is not None or not interrupted else 1.0)
                if got is None:
                    if not self.alive():
                        raise Failure(500, "the kernel died")
                    continue
                parent, kind, content = got
                if parent != msg_id:
                    continue
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
        self.guard = threading.Lock()
        self.started_at = time.time()
        self.connections = 0
        self.life = b""  # the last life a relay named (none in a template's saved server)

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

    def environ(self, encoded: bytes) -> None:
        """The relay's environment (the sandbox's, as its Execs get it; base64 of
        ``env -0``): what differs from the server's own goes into every kernel before
        its next cell, and into kernels started later (a template's kernel predates
        the sandbox's own variables)."""
        try:
            pairs = [p.split("=", 1) for p in base64.b64decode(encoded).decode().split("\0") if "=" in p]
        except ValueError:
            return
        new = {k: v for k, v in pairs if k not in SHELL_VARS and os.environ.get(k) != v}
        if not new:
            return
        os.environ.update(new)
        for ctx in self.every():
            with ctx.pending_lock:
                ctx.pending_env.update(new)

    def new_life(self, life: bytes) -> None:
        """The sandbox's life, as the relay says it: one not seen last is a new life
        (a fork, a sandbox restored from a template or a checkpoint), whose kernels
        each draw a fresh random stream before their next cell; the same again (the
        next relay, a pause and resume) changes nothing."""
        with self.guard:
            if life == self.life:
                return
            self.life = life
        for ctx in self.every():
            ctx.reseed = True

    def every(self) -> list[Context]:
        with self.guard:
            return [*self.default.values(), *self.contexts.values()]

    def handle(self, conn: Conn, req: dict[str, Any]) -> None:
        rid, op = req.get("id"), req.get("op")
        t0 = time.monotonic()
        value: Any = None
        try:
            if op == "execute":
                cancel = threading.Event()
                with conn.lock:
                    conn.running[rid] = cancel
                try:
                    ctx = self.context(req.get("context"), req.get("language"))
                    code, envs = str(req.get("code", "")), req.get("envs") or {}
                    ctx.execute(rid, code, envs, req.get("timeout"), cancel, conn.emit)
                finally:
                    with conn.lock:
                        conn.running.pop(rid, None)
            elif op == "create":
                ctx = Context(req.get("language"), req.get("cwd"))
                with self.guard:
                    self.contexts[ctx.id] = ctx
                value = ctx.describe()
            elif op == "list":
                value = [c.describe() for c in self.every()]
            elif op == "restart":
                self.context(req.get("context"), None).restart()
            elif op == "remove":
                with self.guard:
                    gone = self.contexts.pop(str(req.get("context")), None)
                if gone is None:
                    raise Failure(404, f"context {req.get('context')} not found")
                gone.stop()
            elif op == "interrupt":
                with conn.lock:
                    running = conn.running.get(req.get("target"))
                if running is not None:
                    running.set()
            else:
                raise Failure(400, f"unknown op {op!r}")
            conn.emit({"id": rid, "done": True, "value": value, "guest_ms": (time.monotonic() - t0) * 1000})
        except Failure as f:
            conn.emit({"id": rid, "done": True, "error": {"status": f.status, "message": f.message}})
        except Exception as exc:
            conn.emit({"id": rid, "done": True, "error": {"status": 500, "message": f"{type(exc).__name__}: {exc}"}})

    def serve_conn(self, sock: socket.socket, token: bytes) -> None:
        """One connection: the token first, then requests until it closes; a cell still
        running for it then is interrupted."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Conn(sock)
        reader = sock.makefile("rb")
        try:
            first = reader.readline(len(token) + 2).strip()
            if not hmac.compare_digest(first, token):
                return
            with self.guard:
                self.connections += 1
                n = self.connections
            conn.emit({"ready": True, "pid": os.getpid(), "started_at": self.started_at, "connection": n})
            while True:
                line = reader.readline(LINE_MAX + 1)
                if not line or len(line) > LINE_MAX:
                    return
                if line.startswith(b"LIFE "):
                    self.new_life(line[5:].strip())
                    continue
                if line.startswith(b"ENV "):
                    self.environ(line[4:])
                    for ctx in self.every():
                        ctx.prime()
                    continue
                try:
                    req = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(req, dict):
                    continue
                if req.get("op") == "interrupt":  # (at once: its target holds a context's lock)
                    self.handle(conn, req)
                else:
                    threading.Thread(target=self.handle, args=(conn, req), daemon=True).start()
        except OSError:
            return
        finally:
            with conn.lock:
                conn.closed = True
                every = list(conn.running.values())
            for cancel in every:
                cancel.set()
            reader.close()
            sock.close()

    def accept(self, lsock: socket.socket, token: bytes) -> None:
        while True:
            sock, _ = lsock.accept()
            threading.Thread(target=self.serve_conn, args=(sock, token), daemon=True).start()


def _token_line() -> bytes:
    with open(TOKEN, "rb") as f:
        return f.read().strip() + b"\n"


def daemon(ready: int) -> None:
    """The server (a forked child of ``start``): listen, warm the default kernel, tell
    ``start`` on ``ready``, serve until the machine stops."""
    os.makedirs(RUN_DIR, mode=0o700, exist_ok=True)
    os.chmod(RUN_DIR, 0o700)
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        lsock.bind(ADDRESS)
    except OSError as exc:
        os.write(ready, f"busy: {exc}\n".encode())
        return
    token = secrets.token_hex(32).encode()
    tmp = TOKEN + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, token + b"\n")
    os.close(fd)
    os.rename(tmp, TOKEN)
    lsock.listen(64)  # (a relay that connects now waits in the backlog until the kernel is warm)
    server = Server()
    t0 = time.monotonic()
    try:
        ctx = Context("python", DEFAULT_CWD, cid="default-python")
        server.default["python"] = ctx
        sys.stderr.write(f"kernel server: the default kernel answered after {time.monotonic() - t0:.1f} s\n")
        ctx.warm(WARM_IMPORTS)
        sys.stderr.write(f"kernel server: warm after {time.monotonic() - t0:.1f} s\n")
        sys.stderr.flush()
    except Exception as exc:
        os.write(ready, f"failed: {type(exc).__name__}: {exc}\n".encode())
        return
    os.write(ready, b"ready\n")
    os.close(ready)
    server.accept(lsock, token)


def start() -> int:
    """Start the server (or find it running); 0 once it takes connections."""
    try:
        with socket.create_connection(ADDRESS, timeout=300) as sock:
            sock.sendall(_token_line())
            hello = sock.makefile("rb").readline(4096)
        return 0 if b'"ready"' in hello else 1
    except OSError:
        pass
    r, w = os.pipe()
    if os.fork() == 0:  # (before anything starts a thread or a zmq context)
        os.close(r)
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        log = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if os.path.isdir(RUN_DIR) else null
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(log, 2)
        try:
            daemon(w)
        finally:
            os._exit(0)
    os.close(w)
    said = b""
    while chunk := os.read(r, 4096):
        said += chunk
    if said.startswith(b"ready"):
        return 0
    if said.startswith(b"busy"):  # another start won the port: wait for it
        return start_wait()
    sys.stderr.write(f"kernel server: {said.decode(errors='replace').strip() or 'exited'}\n")
    return 1


def start_wait() -> int:
    for _ in range(600):
        try:
            with socket.create_connection(ADDRESS, timeout=300) as sock:
                sock.sendall(_token_line())
                return 0 if b'"ready"' in sock.makefile("rb").readline(4096) else 1
        except OSError:
            time.sleep(0.5)
    return 1


if __name__ == "__main__":
    if sys.argv[1:] == ["start"]:
        os.makedirs(RUN_DIR, mode=0o700, exist_ok=True)
        sys.exit(start())
    sys.stderr.write("usage: kernel_server.py start\n")
    sys.exit(2)
