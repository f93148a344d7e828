"""The kernel runtime both edges share: the guest's kernel server of a sandbox
(images/kernel_server.py: Jupyter kernels run with jupyter_client in the sandbox,
speaking JSON lines on stdin/stdout) and the table of them, one per sandbox.

The kernel server is a service of the guest: a daemon listening on the guest's
127.0.0.1:49999, started by ``python3 -c SOURCE start`` -- before a boot template of
the code-interpreter image is saved (:func:`supervisor.serve.e2b_kernels.warmup_argv`,
run by the pools), so sandboxes restored from it (and its warm pool's members) hold a
started, warm kernel; or by the first call, when a sandbox booted without one. The
host reaches it through one relay Exec per sandbox life (:data:`RELAY`: bash's
``/dev/tcp``, with the server's root-only token first; the sandbox needs no network)
through the target's client, owned by :class:`Kernels` (a task in its nursery:
cancelled, the relay ends, the server and its kernels stay with the sandbox); found by
the sandbox's uid, so a later sandbox given the same id gets its own. What the guest
sends is parsed here, bounded (:data:`LINE_MAX`) and routed by id. Each edge checks the caller first
(it must be allowed to exec in the sandbox) and maps :class:`KernelError` to its
wire: the E2B endpoint (:mod:`supervisor.serve.e2b_kernels`) to HTTP statuses, the
method table (:mod:`supervisor.serve.api_code`) to sandbox.v1's codes.

A target is what :meth:`KernelHost.run` drives: ``target.client.acting()`` (a context
in which the Exec acts for the caller), ``target.handle().exec(argv, workdir=...)``
(an async context of the Exec: async iteration of outputs with ``stream`` and
``data``, ``send(bytes)`` to its stdin), ``target.sandbox`` (its id) and
``target.uid``.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

import attrs
import trio

from supervisor.wire import errors

log = logging.getLogger("sandvisor.kernels")

SOURCE = Path(__file__).resolve().parents[2] / "images" / "kernel_server.py"
START_TIMEOUT_S = 300.0  # the kernel server's first kernel, under TCG
# the relay: the server's port (or, if none listens, the server started first), the
# token line, the sandbox's environment (a template's kernels predate it), then the
# host's lines in and the server's out ($1: the server's source)
RELAY = (
    "{ exec 3<>/dev/tcp/127.0.0.1/49999; } 2>/dev/null || "
    '{ python3 -c "$1" start || exit 1; exec 3<>/dev/tcp/127.0.0.1/49999 || exit 1; }\n'
    "cat /run/sandvisor-kernels/token >&3 || exit 1\n"
    "printf 'ENV %s\\n' \"$(env -0 | base64 -w0)\" >&3\n"
    "cat <&3 & cat >&3\nwait\n"
)
LINE_MAX = 64 << 20  # a line from the guest (a chart's PNG in base64) longer than this ends the server


class KernelError(Exception):
    """A call the kernel runtime did not serve: ``status`` as the kernel server's answers
    carry it (HTTP's: 400 bad request, 404 no such context, 500 the kernel's failure,
    502 the kernel server is not there) and the reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@attrs.define(eq=False)
class KernelHost:
    """The kernel server of one sandbox: requests go in as lines, answers are routed
    back to the request's channel by its id."""

    target: Any  # e2b_envd.Target, api_code._Target: the shape the module names
    ready: trio.Event = attrs.Factory(trio.Event)
    failed: str = ""
    execd: Any = None
    pending: dict[int, trio.MemorySendChannel[dict[str, Any]]] = attrs.Factory(dict)
    lock: trio.Lock = attrs.Factory(trio.Lock)
    ids: itertools.count[int] = attrs.Factory(lambda: itertools.count(1))

    async def run(self, source: str) -> None:
        sb = self.target.handle()
        try:
            with self.target.client.acting():
                async with sb.exec(["bash", "-c", RELAY, "kernel-relay", source], workdir="/") as execd:
                    self.execd = execd
                    await self._read(execd)
        except errors.SandboxError as exc:
            self.failed = f"{exc.code}: {exc.message}"
        except Exception as exc:  # one sandbox's failure is its own: the endpoint serves on
            log.warning("the kernel server of %s failed: %r", self.target.sandbox, exc)
            self.failed = f"UNAVAILABLE: {exc}"
        finally:
            self.failed = self.failed or "the kernel server ended"
            self.ready.set()
            for ch in self.pending.values():
                ch.close()
            self.pending.clear()

    async def _read(self, execd: Any) -> None:
        buf = bytearray()
        err = bytearray()
        async for o in execd:
            if o.stream == "exit":
                break
            if o.stream == "stderr":
                err = (err + o.data)[-4096:]
                continue
            if b"\n" not in o.data:  # (a long line comes in many chunks: split only at its end)
                buf += o.data
                if len(buf) > LINE_MAX:
                    raise RuntimeError("a line from the kernel server is too long")
                continue
            *lines, rest = bytes(buf + o.data).split(b"\n")
            if len(lines[0]) > LINE_MAX:
                raise RuntimeError("a line from the kernel server is too long")
            buf = bytearray(rest)
            for line in lines:
                self._dispatch(line)
        if not self.ready.is_set():
            self.failed = "the kernel server did not start: " + err.decode(errors="replace").strip()[-1000:]

    def _dispatch(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        if "ready" in msg:
            if not msg["ready"]:
                self.failed = f"the kernel server did not start: {msg.get('error', '')}"
            self.ready.set()
            return
        rid = msg.get("id")
        if not isinstance(rid, int):  # (the guest's word: any JSON)
            return
        ch = self.pending.get(rid)
        if ch is None:
            return
        try:
            ch.send_nowait(msg)
        except trio.WouldBlock:  # a reader that stopped reading: its call ends
            self.pending.pop(rid, None)
            ch.close()
        if msg.get("done"):
            self.pending.pop(rid, None)
            ch.close()

    async def send(self, request: dict[str, Any]) -> None:
        async with self.lock:
            await self.execd.send(json.dumps(request).encode() + b"\n")

    async def call(self, op: str, **fields: Any) -> tuple[int, trio.MemoryReceiveChannel[dict[str, Any]]]:
        """Send request ``op``; its id and the channel of its answers (closed after "done")."""
        with trio.move_on_after(START_TIMEOUT_S):
            await self.ready.wait()
        if not self.ready.is_set():
            raise KernelError(502, "code interpreter unavailable: its kernel is still starting")
        if self.failed:
            raise KernelError(502, f"code interpreter unavailable: {self.failed}")
        rid = next(self.ids)
        send, recv = trio.open_memory_channel[dict[str, Any]](4096)
        self.pending[rid] = send
        await self.send({"id": rid, "op": op, **fields})
        return rid, recv

    async def unary(self, op: str, **fields: Any) -> Any:
        _, recv = await self.call(op, **fields)
        async with recv:
            async for msg in recv:
                if msg.get("done"):
                    return value_of(msg)
        raise KernelError(502, f"code interpreter unavailable: {self.failed or 'no answer'}")


def value_of(msg: dict[str, Any]) -> Any:
    """A request's "done" answer: its value, or its error raised."""
    err = msg.get("error")
    if err:
        raise KernelError(int(err.get("status", 500)), str(err.get("message", "")))
    return msg.get("value")


class Kernels:
    """The kernel servers of an edge, one per sandbox uid, each a task in ``nursery``."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.hosts: dict[str, tuple[KernelHost, trio.CancelScope]] = {}
        self._source: str | None = None

    def source(self) -> str:
        if self._source is None:
            self._source = SOURCE.read_text()
        return self._source

    def host(self, target: Any) -> KernelHost:
        """``target``'s kernel server, started if it runs none (or its last one ended)."""
        found = self.hosts.get(target.uid)
        if found is not None and not (found[0].ready.is_set() and found[0].failed):
            return found[0]
        host, scope = KernelHost(target), trio.CancelScope()
        self.hosts[target.uid] = (host, scope)
        source = self.source()

        async def run() -> None:
            with scope:
                await host.run(source)
            if self.hosts.get(target.uid, (None,))[0] is host and host.failed:
                log.info("kernel server of %s: %s", target.sandbox, host.failed)

        self.nursery.start_soon(run)
        return host

    def forget(self, uid: str) -> None:
        found = self.hosts.pop(uid, None)
        if found is not None:
            found[1].cancel()
