"""The kernel runtime both edges share: the guest's kernel server of a sandbox
(images/kernel_server.py: Jupyter kernels run with jupyter_client in the sandbox,
speaking JSON lines on stdin/stdout) and the table of them, one per sandbox.

The kernel server is a service of the guest: a daemon listening on the guest's
127.0.0.1:49999, started by ``python3 -c SOURCE start`` -- before a boot template of
the code-interpreter image is saved (:func:`supervisor.serve.e2b_kernels.warmup_argv`,
run by the pools), so sandboxes restored from it (and its warm pool's members) hold a
started, warm kernel; or by the first call, when a sandbox booted without one. The
host reaches it through a relay Exec (:data:`RELAY`: bash's ``/dev/tcp``, with the
server's root-only token first; the sandbox needs no network) through the target's
client, open only while requests are in flight: the first call opens it, and the
answer that leaves nothing in flight is delivered once it is closed (its stdin ended,
the Exec ended). So between calls the sandbox has no exec session of ours: it can be
checkpointed, forked and paused, and its idle timeout runs; a call that comes while
a relay closes opens the next. The kernel server and its kernels (their variables)
stay in the guest, across relays, pauses and forks. A relay is a task in the nursery
of :class:`Kernels`, which finds the host by the sandbox's uid (a later sandbox given
the same id gets its own); forgotten, its relays end. What the guest
sends is parsed here, bounded (:data:`LINE_MAX`) and routed by id. Each edge checks the caller first
(it must be allowed to exec in the sandbox) and maps :class:`KernelError` to its
wire: the E2B endpoint (:mod:`supervisor.serve.e2b_kernels`) to HTTP statuses, the
method table (:mod:`supervisor.serve.api_code`) to sandbox.v1's codes.

A target is what :meth:`KernelHost.run` drives: ``target.client.acting()`` (a context
in which the Exec acts for the caller), ``target.handle().exec(argv, workdir=...)``
(an async context of the Exec: async iteration of outputs with ``stream`` and
``data``, an output of stream "exit" at its end and the iteration's end once its
session is closed, ``send(bytes)`` to its stdin and ``close_stdin()``),
``target.sandbox`` (its id) and ``target.uid``.
"""

from __future__ import annotations

import contextlib
import hashlib
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
CLOSE_TIMEOUT_S = 30.0  # a relay told to close (its stdin ended) that has not: killed
# the relay: the server's port (or, if none listens, the server started first), the
# token line, then (the host's first relay: $2 not empty) the sandbox's life and its
# environment (a template's kernels predate it), then the host's lines in and the
# server's out until the host ends its stdin ($1: the server's source, $2: the life).
# Under TCG every process costs: the token is read by a builtin, and the environment
# (two more) is sent once.
RELAY = (
    "{ exec 3<>/dev/tcp/127.0.0.1/49999; } 2>/dev/null || "
    '{ python3 -c "$1" start || exit 1; exec 3<>/dev/tcp/127.0.0.1/49999 || exit 1; }\n'
    "read -r t < /run/sandvisor-kernels/token || exit 1\n"
    "printf '%s\\n' \"$t\" >&3\n"
    '[ -z "$2" ] || printf \'LIFE %s\\nENV %s\\n\' "$2" "$(env -0 | base64 -w0)" >&3\n'
    "cat <&3 & cat >&3\nkill $! 2>/dev/null\nexit 0\n"
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
class Relay:
    """One relay Exec to the kernel server: the requests in flight through it (their
    answers' channels by id), open until the last of them is answered."""

    ready: trio.Event = attrs.Factory(trio.Event)
    ended: trio.Event = attrs.Factory(trio.Event)
    closing: bool = False  # no new request goes through it (it closes, or failed)
    close: trio.Event = attrs.Factory(trio.Event)  # close it now: nothing is in flight
    failed: str = ""
    execd: Any = None
    introduces: bool = False  # it tells the server the sandbox's life and environment
    pending: dict[int, trio.MemorySendChannel[dict[str, Any]]] = attrs.Factory(dict)
    # the answers that emptied it: delivered once it is closed (the sandbox idle again)
    held: list[tuple[trio.MemorySendChannel[dict[str, Any]], dict[str, Any]]] = attrs.Factory(list)
    lock: trio.Lock = attrs.Factory(trio.Lock)  # whole lines on its stdin
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)


@attrs.define(eq=False)
class KernelHost:
    """The kernel server of one sandbox: requests go in as lines through a relay, opened
    by the first of them and closed when the last in flight is answered (then the
    sandbox has no exec session of ours: it can be checkpointed, forked, paused, and
    its idle timeout runs); answers are routed back to the request's channel by its id."""

    target: Any  # e2b_envd.Target, api_code._Target: the shape the module names
    nursery: trio.Nursery  # where the relays run
    source: str  # the kernel server's, for a relay that finds none running
    failed: str = ""  # the last relay's failure (what a call that lost its answer says)
    relay: Relay | None = None  # the relay new requests go through (None: none open)
    relays: set[Relay] = attrs.Factory(set)  # every relay not yet ended (one closing, one open)
    ids: itertools.count[int] = attrs.Factory(lambda: itertools.count(1))
    forgotten: bool = False
    introduced: bool = False  # a relay told the server the sandbox's life and environment

    @property
    def life(self) -> str:
        """What the host's first relay tells the server this sandbox is: a new value is
        a new life (a fork, a restore of a template or a checkpoint as a new sandbox),
        whose kernels draw fresh random streams; a pause and resume, or the next relay,
        is the same."""
        return hashlib.sha256(f"sandvisor-kernels:{self.target.uid}".encode()).hexdigest()[:32]

    def open(self) -> Relay:
        """The relay a new request goes through: the open one, else a new one."""
        r = self.relay
        if r is None or r.closing:
            r = self.relay = Relay(introduces=not self.introduced)
            self.relays.add(r)
            self.nursery.start_soon(self._run, r)
        return r

    def warm(self) -> None:
        """Start the kernel server now (a relay that closes once it is up), so the first
        call does not wait for it."""
        if not self.forgotten:
            self.open()

    def forget(self) -> None:
        """The sandbox is gone: its relays end (their calls with them)."""
        self.forgotten = True
        for r in self.relays:
            r.scope.cancel()

    @property
    def idle(self) -> bool:
        return not self.relays

    async def _run(self, r: Relay) -> None:
        sb = self.target.handle()
        try:
            with r.scope, self.target.client.acting():
                argv = ["bash", "-c", RELAY, "kernel-relay", self.source, self.life if r.introduces else ""]
                async with sb.exec(argv, workdir="/") as execd:
                    r.execd = execd
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._closer, r)
                        await self._read(r, execd)
                        nursery.cancel_scope.cancel()
        except errors.SandboxError as exc:
            r.failed = f"{exc.code}: {exc.message}"
        except Exception as exc:  # one sandbox's failure is its own: the endpoint serves on
            log.warning("the kernel server relay of %s failed: %r", self.target.sandbox, exc)
            r.failed = f"UNAVAILABLE: {exc}"
        finally:
            if r.scope.cancelled_caught and self.forgotten and not r.failed:
                r.failed = "the sandbox's kernel server was let go"
            if not r.closing or not r.ready.is_set():
                r.failed = r.failed or "the kernel server ended"
            if r.failed:
                self.failed = r.failed
            r.closing = True
            r.ready.set()
            r.ended.set()
            if self.relay is r:
                self.relay = None
            self.relays.discard(r)
            for ch in r.pending.values():
                ch.close()
            r.pending.clear()
            for ch, msg in r.held:  # (the relay's Exec has ended: now its callers hear)
                with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                    ch.send_nowait(msg)
                ch.close()
            r.held.clear()

    async def _closer(self, r: Relay) -> None:
        """Once nothing is in flight: end the relay's stdin (it ends, and with it the
        server's connection), then wait for it to end, at most :data:`CLOSE_TIMEOUT_S`."""
        await r.close.wait()
        try:
            async with r.lock:
                await r.execd.close_stdin()
        except Exception as exc:  # (its Exec is going anyway: leaving it kills it)
            log.info("the kernel server relay of %s: its stdin did not close: %r", self.target.sandbox, exc)
        else:
            await trio.sleep(CLOSE_TIMEOUT_S)
            log.warning("the kernel server relay of %s did not end when closed: killed", self.target.sandbox)
        r.scope.cancel()

    def _idle(self, r: Relay) -> None:
        """Close ``r`` if it is up and nothing is in flight through it."""
        if r.ready.is_set() and not r.pending and not r.closing:
            r.closing = True
            r.close.set()

    async def _read(self, r: Relay, execd: Any) -> None:
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
                self._dispatch(r, line)
        async for _ in execd:  # (the end of the Exec itself: its session is closed)
            pass
        if not r.ready.is_set():
            r.failed = "the kernel server did not start: " + err.decode(errors="replace").strip()[-1000:]

    def _dispatch(self, r: Relay, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        if "ready" in msg:
            if not msg["ready"]:
                r.failed = f"the kernel server did not start: {msg.get('error', '')}"
                r.closing = True
                r.close.set()
            elif r.introduces:
                self.introduced = True
            r.ready.set()
            self._idle(r)
            return
        rid = msg.get("id")
        if not isinstance(rid, int):  # (the guest's word: any JSON)
            return
        ch = r.pending.get(rid)
        if ch is None:
            return
        if msg.get("done"):
            del r.pending[rid]
            if not r.pending and not r.closing:  # the last answer: after the relay closed
                r.held.append((ch, msg))
                self._idle(r)
                return
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                ch.send_nowait(msg)
            ch.close()
            return
        try:
            ch.send_nowait(msg)
        except (trio.WouldBlock, trio.BrokenResourceError):  # a reader that stopped reading: its call ends
            del r.pending[rid]
            ch.close()
            self._idle(r)

    async def call(self, op: str, **fields: Any) -> tuple[int, trio.MemoryReceiveChannel[dict[str, Any]]]:
        """Send request ``op``; its id and the channel of its answers (closed after "done")."""
        if self.forgotten:
            raise KernelError(502, "code interpreter unavailable: the sandbox is gone")
        r = self.open()
        rid = next(self.ids)
        send, recv = trio.open_memory_channel[dict[str, Any]](4096)
        r.pending[rid] = send  # (before the relay is up: it stays open for this request)
        try:
            with trio.move_on_after(START_TIMEOUT_S):
                await r.ready.wait()
            if not r.ready.is_set():
                raise KernelError(502, "code interpreter unavailable: its kernel is still starting")
            if r.failed:
                raise KernelError(502, f"code interpreter unavailable: {r.failed}")
            try:
                async with r.lock:
                    await r.execd.send(json.dumps({"id": rid, "op": op, **fields}).encode() + b"\n")
            except (errors.SandboxError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise KernelError(502, f"code interpreter unavailable: {exc}") from None
        except BaseException:
            if r.pending.pop(rid, None) is not None:
                send.close()
                self._idle(r)
            recv.close()
            raise
        return rid, recv

    async def interrupt(self, rid: int) -> None:
        """Interrupt request ``rid``'s cell, if it is still in flight (else: nothing)."""
        for r in list(self.relays):
            if rid in r.pending and r.execd is not None:
                with contextlib.suppress(Exception):  # (the relay ended meanwhile: so did the cell)
                    async with r.lock:
                        await r.execd.send(json.dumps({"id": 0, "op": "interrupt", "target": rid}).encode() + b"\n")

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
    """The kernel servers of an edge, one host per sandbox uid; their relays are tasks
    in ``nursery``."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.hosts: dict[str, KernelHost] = {}
        self._source: str | None = None

    def source(self) -> str:
        if self._source is None:
            self._source = SOURCE.read_text()
        return self._source

    def host(self, target: Any) -> KernelHost:
        """``target``'s kernel server (its relay opens with the first call)."""
        found = self.hosts.get(target.uid)
        if found is None:
            found = self.hosts[target.uid] = KernelHost(target, self.nursery, self.source())
        return found

    def forget(self, uid: str) -> None:
        found = self.hosts.pop(uid, None)
        if found is not None:
            found.forget()
