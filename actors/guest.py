"""Host end of the guest channel: hello, request/stream multiplexing, flow control.

A thin Trio adapter over the I/O-free protocol core in :mod:`guestd.proto`. One
reader task parses frames and hands each message to the request it belongs to;
callers send under a lock. The guest is hostile: every byte it sends is bounded
(frames by ``MAX_FRAME``, stream data by the credit we granted), and any breach
closes the channel with a typed error instead of growing memory or crashing.

Error tree::

    GuestError
     +-- ChannelClosed (trio.ClosedResourceError)   we closed the channel, then used it
     +-- ChannelBroken (trio.BrokenResourceError)   the guest went away or broke the protocol
     |    +-- GuestProtocolError                     ... specifically, it sent something illegal
     +-- HelloTimeout (trio.TooSlowError)           no hello answer in time (boot hung)
     +-- GuestTimeout (trio.TooSlowError)           no answer to a request in time (a silent guest)
     +-- GuestOpError                               the guest refused one request (code, message)

Deadlines: every wait for the guest to answer something the host asked (a unary
reply, exec_started, file_info, file data, credit for a file's data, the final Ok of
a write) is bounded by ``answer_timeout``; waits on a process (its output, credit
for its stdin) are not: a process may be silent or slow to read for as long as it
likes, and its own timeout bounds it.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import attrs
import trio

from actors._groups import collapse_single
from guestd import patch
from guestd import proto as P

log = logging.getLogger("sandvisor.guest")
KILL_GRACE = 5.0  # how long a guest has to end a process it should have killed (timeout, SIGKILL)
CLOCK_STALE_S = 0.05  # a set_clock answered later than this set a stale time: it is sent again
CLOCK_TRIES = 8  # ... at most this often (each try's error is its own round trip)
FRAME_TIMEOUT = 30.0  # how long a guest may take to read one frame we send (as the daemon's guest_timeout)
_M = TypeVar("_M", bound=P.Message)

# What the host takes of a guest's numbers. The codec checks types only; these ranges are
# what the rest of the host can hold (SQLite and protobuf int64, int32 exit codes, uint64
# counters): a guest that sends more breaks the protocol, and only its own channel.
_U31, _U63 = (0, 2**31 - 1), (0, 2**63 - 1)
_I64 = (-(2**63), 2**63 - 1)
_RANGES: dict[str, dict[str, tuple[float, float]]] = {
    "hello_ok": {"pid": _U31, "boot_ns": _U63, "ready_ns": _U63, "activity": _U63, "version": _U31},
    "pong": {"activity": _U63, "guest_ns": _I64},
    "ok": {"activity": _U63, "value": _U63},
    "exec_started": {"pid": _U31},
    "exit": {"code": _U31, "signal": _U31},
    "file_info": {"size": _U63, "mode": (0, 0o177777)},
    "metrics_ok": {"uptime": (0, math.inf), "ncpu": _U31, "procs": _U31},
    "data": {"ch": _U31},
    "eof": {"ch": _U31},
    "credit": {"ch": _U31, "n": _U63},
}
_VALUE_RANGES: dict[str, dict[str, tuple[float, float]]] = {  # every value of a map field
    "hello_ok": {"marks": (0, math.inf)},
    "metrics_ok": {"cpu_seconds": (0, math.inf), "mem": _U63, "disk": _U63, "net": _U63},
}


def check_ranges(msg: P.Message) -> None:
    """BadMessage unless every number of ``msg`` is finite and in the host's range."""
    for name, (lo, hi) in _RANGES.get(msg.TAG, {}).items():
        v = getattr(msg, name)
        if not (lo <= v <= hi and math.isfinite(v)):
            raise P.BadMessage(f"{msg.TAG}.{name} out of range: {str(v)[:40]}")
    for name, (lo, hi) in _VALUE_RANGES.get(msg.TAG, {}).items():
        for key, v in getattr(msg, name).items():
            if not (lo <= v <= hi and math.isfinite(v)):
                raise P.BadMessage(f"{msg.TAG}.{name}[{key[:40]!r}] out of range: {str(v)[:40]}")


class GuestError(Exception):
    """Base of every error of the guest channel."""


class ChannelClosed(GuestError, trio.ClosedResourceError):
    """This end closed the channel and then tried to use it."""


class ChannelBroken(GuestError, trio.BrokenResourceError):
    """The guest went away (EOF, reset) or the channel was torn down under a request."""


class GuestProtocolError(ChannelBroken):
    """The guest sent something the protocol forbids; the channel is now closed."""


class HelloTimeout(GuestError, trio.TooSlowError):
    """The guest did not answer the hello in time."""


class GuestTimeout(GuestError, trio.TooSlowError):
    """The guest did not answer a request within the channel's answer timeout."""


class GuestOpError(GuestError):
    """The guest refused a request. ``code`` is one of the proto E_* codes."""

    MAX_TEXT = 4096  # a guest's code and message, as far as the host keeps them (records, logs, replies)

    def __init__(self, code: str, message: str) -> None:
        code, message = code[:200], message[: self.MAX_TEXT]
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@attrs.frozen
class ExecResult:
    exit_code: int
    signal: int
    timed_out: bool
    stdout: bytes
    stderr: bytes


@attrs.frozen
class ChannelStatistics:
    requests_in_flight: int
    frames_in: int
    frames_out: int
    bytes_in: int
    bytes_out: int
    dropped: int  # messages for requests that no longer exist


class _Request:
    """Receiving side of one request.

    Messages are delivered in arrival order. Stream data is merged into the trailing
    run of data entries (at most one entry per channel there), so a process writing
    a byte at a time to a slow consumer costs no more than the credit we granted;
    other messages queue, at most MAX_EVENTS of them.
    """

    MAX_EVENTS = 64

    def __init__(self, chan: GuestChannel, rid: int) -> None:
        self.chan = chan
        self.rid = rid
        self.queue: collections.deque[P.Message | tuple[int, bytearray]] = collections.deque()
        self.events = 0
        self.wakeup = trio.Event()
        self.outstanding = {P.STDOUT: P.WINDOW, P.STDERR: P.WINDOW}  # bytes the guest may still send
        self.send_credit = P.WINDOW  # bytes we may still send on STDIN
        self.credit_changed = trio.Event()
        self.broken: BaseException | None = None
        self.done = False

    @property
    def buffered(self) -> int:
        return sum(len(x[1]) for x in self.queue if isinstance(x, tuple))

    def deliver(self, msg: P.Message) -> None:
        if isinstance(msg, P.Credit):
            if msg.ch != P.STDIN or msg.n < 0:
                raise P.BadMessage(f"credit on channel {msg.ch}")
            self.send_credit += msg.n
            if self.send_credit > P.WINDOW:
                raise P.BadMessage("guest granted more stdin credit than the window")
            self.credit_changed.set()
            self.credit_changed = trio.Event()
            return
        if isinstance(msg, P.Data):
            left = self.outstanding.get(msg.ch)
            if left is None or len(msg.data) > left:
                raise P.BadMessage(f"data beyond granted credit on channel {msg.ch}")
            self.outstanding[msg.ch] = left - len(msg.data)
            trailing = self._trailing(msg.ch)
            if trailing is not None:
                trailing.extend(msg.data)
            else:  # (data was once lost here whenever a message, e.g. file_info, was queued)
                self.queue.append((msg.ch, bytearray(msg.data)))
        else:
            self.events += 1
            if self.events > self.MAX_EVENTS:
                raise P.BadMessage("too many messages for one request")
            self.queue.append(msg)
            if isinstance(msg, P.Error):  # a sender waiting for credit must see it now
                self.credit_changed.set()
                self.credit_changed = trio.Event()
        self.wakeup.set()

    def _trailing(self, ch: int) -> bytearray | None:
        """The buffer of ``ch`` in the run of data entries at the queue's end, if any:
        data merges only there, never past a queued message (order must hold)."""
        for item in reversed(self.queue):
            if not isinstance(item, tuple):
                return None
            if item[0] == ch:
                return item[1]
        return None

    def peek_error(self) -> P.Error | None:
        if self.queue and isinstance(self.queue[0], P.Error):
            err = self.queue.popleft()
            assert isinstance(err, P.Error)
            return err
        return None

    def fail(self, exc: BaseException) -> None:
        self.broken = exc
        self.wakeup.set()
        self.credit_changed.set()

    async def next(self, timeout: float | None = None) -> P.Message:
        """The next message; ``timeout``: GuestTimeout when none came for that long."""
        deadline = trio.current_time() + timeout if timeout is not None else math.inf
        while not self.queue:
            if self.broken is not None:
                raise self.broken
            with trio.move_on_at(deadline):
                await self.wakeup.wait()
            if not self.wakeup.is_set() and not self.queue:
                raise GuestTimeout(f"the guest did not answer within {timeout:g}s")
            self.wakeup = trio.Event()
        item = self.queue.popleft()
        if isinstance(item, tuple):
            ch, buf = item
            data = bytes(buf)
            await self.chan._grant(self.rid, ch, len(data))
            return P.Data(rid=self.rid, ch=ch, data=data)
        self.events -= 1
        return item


class GuestChannel:
    """One connection to guestd. Use :func:`open_channel`; do not construct directly."""

    def __init__(
        self, stream: trio.abc.Stream, *, max_frame: int = P.MAX_FRAME, answer_timeout: float | None = None
    ) -> None:
        self._stream = stream
        self.answer_timeout = answer_timeout
        self._decoder = P.FrameDecoder(max_frame)
        self._send_lock = trio.Lock()
        self._reqs: dict[int, _Request] = {}
        self._next_rid = 1
        self._closed = False
        self._broken: ChannelBroken | None = None
        self._hello: P.HelloOk | None = None
        self._hello_event = trio.Event()
        self._eof_expected = False  # set once guestd agreed to power off
        self._syncing = False  # after our HOST_SYNC: discard input up to GUEST_SYNC
        self._discarded = 0
        self.hello_info: P.HelloOk | None = None
        # seconds from sending Hello to its answer: its host_time_ns set the guest's clock
        # this stale at most (clock_stale says whether a restore must set it again)
        self.hello_rtt = 0.0
        self.guest_logs: collections.deque[str] = collections.deque(maxlen=64)
        self._stats = {"frames_in": 0, "frames_out": 0, "bytes_in": 0, "bytes_out": 0, "dropped": 0}

    # -- lifecycle -----------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def expect_eof(self) -> None:
        """The VM is being killed: its end of the channel going away is no news."""
        self._eof_expected = True

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(requests_in_flight=len(self._reqs), **self._stats)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_all(ChannelClosed("guest channel closed"))
        with trio.CancelScope(shield=True):
            await self._stream.aclose()

    def _check(self) -> None:
        if self._closed:
            raise ChannelClosed("guest channel closed")
        if self._broken is not None:
            raise self._broken

    def _fail_all(self, exc: BaseException) -> None:
        for req in self._reqs.values():
            req.fail(exc)
        self._hello_event.set()

    async def _reader(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                try:
                    data = await self._stream.receive_some(1 << 16)
                except (trio.BrokenResourceError, OSError) as exc:
                    raise ChannelBroken(f"guest channel broke: {exc}") from None
                except trio.ClosedResourceError:
                    return
                if not data:
                    raise ChannelBroken("guest closed the channel")
                self._stats["bytes_in"] += len(data)
                self._decoder.feed(data)
                if self._syncing:
                    if not self._decoder.resync(P.GUEST_SYNC):
                        self._discarded += len(data)
                        if self._discarded > P.MAX_RESYNC:
                            raise GuestProtocolError("no sync marker from the guest")
                        continue
                    self._syncing = False
                try:
                    for msg in self._decoder.messages():
                        self._stats["frames_in"] += 1
                        self._dispatch(msg)
                except P.ProtocolError as exc:
                    raise GuestProtocolError(f"guest protocol error: {exc}") from None
        except ChannelBroken as exc:
            if not self._closed:
                if not self._eof_expected:
                    log.warning("guest channel: %s", exc)
                self._broken = exc
                self._fail_all(exc)
                with trio.CancelScope(shield=True):
                    await self._stream.aclose()

    def _dispatch(self, msg: P.Message) -> None:
        check_ranges(msg)
        if isinstance(msg, P.HelloOk):
            self._hello = msg
            self._hello_event.set()
            return
        if isinstance(msg, P.Log):
            self.guest_logs.append(f"{msg.level}: {msg.text[:1000]}")
            return
        rid = getattr(msg, "rid", None)
        if not isinstance(rid, int):
            raise P.BadMessage(f"unexpected {msg.TAG} from the guest")
        req = self._reqs.get(rid)
        if req is None:
            self._stats["dropped"] += 1  # late traffic of a request we abandoned
            return
        req.deliver(msg)

    # -- sending -------------------------------------------------------------
    async def _send(self, msg: P.Message) -> None:
        self._check()
        try:
            frame = P.encode(msg)
        except P.FrameTooLarge as exc:  # our own request: refuse it, the channel stays fine
            raise GuestOpError(P.E_TOO_LARGE, f"request too large for the guest channel: {exc}") from None
        async with self._send_lock:
            self._check()
            # A frame goes out whole: cut by a cancel, what follows would be read as its
            # body. A caller cancelled before it starts sends nothing (the channel stays
            # fine); once started, a cancel waits for the frame (bounded: a guest that
            # does not read it in FRAME_TIMEOUT is broken, and so is the channel).
            await trio.lowlevel.checkpoint_if_cancelled()
            with trio.CancelScope(shield=True), trio.move_on_after(FRAME_TIMEOUT) as stalled:
                try:
                    await self._stream.send_all(frame)
                except trio.ClosedResourceError:
                    self._check()  # our reader closed it under us: the breakage it found
                    raise ChannelClosed("guest channel closed") from None
                except (trio.BrokenResourceError, OSError) as exc:
                    raise ChannelBroken(f"guest channel broke: {exc}") from None
            if stalled.cancelled_caught:
                broken = ChannelBroken(f"the guest took no frame for {FRAME_TIMEOUT:g}s: the channel is cut mid-frame")
                self._poison(broken)
                await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller sees its cancel
                raise broken
        self._stats["frames_out"] += 1
        self._stats["bytes_out"] += len(frame)

    async def _grant(self, rid: int, ch: int, n: int) -> None:
        req = self._reqs.get(rid)
        if req is not None and not req.done:
            req.outstanding[ch] = req.outstanding.get(ch, 0) + n
            try:
                await self._send(P.Credit(rid=rid, ch=ch, n=n))
            except GuestError:
                pass  # the request sees the breakage on its next receive

    def _new_request(self) -> _Request:
        self._check()
        rid = self._next_rid
        self._next_rid += 1
        req = _Request(self, rid)
        self._reqs[rid] = req
        return req

    def _end_request(self, req: _Request) -> None:
        req.done = True
        self._reqs.pop(req.rid, None)

    # -- hello ---------------------------------------------------------------
    async def hello(self, timeout: float) -> P.HelloOk:
        """Send Hello and wait for the guest's answer (this spans the guest's boot)."""
        self._check()
        for req in list(self._reqs.values()):  # the guest drops the old session's requests: so do we
            req.fail(ChannelBroken("a new session with the guest began; this request was dropped"))
        self._hello_event = trio.Event()
        self._hello = None
        self._syncing = True
        self._discarded = 0
        async with self._send_lock:
            try:
                await self._stream.send_all(P.HOST_SYNC)
            except (trio.BrokenResourceError, OSError) as exc:
                raise ChannelBroken(f"guest channel broke: {exc}") from None
        t0 = time.monotonic()
        await self._send(P.Hello(version=P.PROTOCOL_VERSION, host_time_ns=time.time_ns()))
        with trio.move_on_after(timeout):
            await self._hello_event.wait()
        self.hello_rtt = time.monotonic() - t0
        if self._hello is None:
            self._check()
            raise HelloTimeout(f"guestd did not answer hello within {timeout:g}s")
        if self._hello.version != P.PROTOCOL_VERSION:
            raise GuestProtocolError(f"guest speaks protocol {self._hello.version}, we speak {P.PROTOCOL_VERSION}")
        self.hello_info = self._hello
        return self._hello

    # -- unary requests --------------------------------------------------------
    async def _unary(self, build: Any, expect: type[_M]) -> _M:
        req = self._new_request()
        try:
            await self._send(build(req.rid))
            msg = await req.next(self.answer_timeout)
        finally:
            self._end_request(req)
        if isinstance(msg, P.Error):
            raise GuestOpError(msg.code, msg.message)
        if not isinstance(msg, expect):
            await self._protocol_violation(f"expected {expect.TAG}, got {msg.TAG}")
        return msg  # type: ignore[return-value]

    async def _protocol_violation(self, text: str) -> None:
        exc = GuestProtocolError(text)
        self._poison(exc)
        with trio.CancelScope(shield=True):
            await self._stream.aclose()
        raise exc

    def _poison(self, exc: ChannelBroken) -> None:
        """The channel cannot be used any more: every request sees ``exc``."""
        if self._broken is None:
            self._broken = exc
        self._fail_all(exc)

    async def ping(self) -> P.Pong:
        return await self._unary(lambda rid: P.Ping(rid=rid), P.Pong)

    async def touch(self) -> int:
        return (await self._unary(lambda rid: P.Touch(rid=rid), P.Ok)).activity

    async def metrics(self) -> P.MetricsOk:
        return await self._unary(lambda rid: P.Metrics(rid=rid), P.MetricsOk)

    @property
    def clock_stale(self) -> bool:
        """The last hello's answer came late: the clock it set is behind by that much."""
        return self.hello_rtt >= CLOCK_STALE_S

    async def set_clock(self, realtime_ns: int | None = None) -> None:
        """Set the guest's wall clock to ours. The time is taken when the request is
        sent: one that waited (a vCPU still busy after a restore, a loaded host) set a
        stale time -- measured 1.9 s behind at load 9 -- so a slow answer is followed
        by another request, until one is answered in time: the guest's error is at most
        the last round trip. Two tries were not enough at load 38 (a clone 4.4 s behind:
        the second answer took seconds too), so it tries up to CLOCK_TRIES times."""
        for _ in range(CLOCK_TRIES):
            t0 = time.monotonic()
            ns = time.time_ns() if realtime_ns is None else realtime_ns
            await self._unary(lambda rid, ns=ns: P.SetClock(rid=rid, realtime_ns=ns), P.Ok)
            if realtime_ns is not None or time.monotonic() - t0 < CLOCK_STALE_S:
                return

    async def add_entropy(self, nbytes: int = 64) -> None:
        data = os.urandom(nbytes)
        await self._unary(lambda rid: P.AddEntropy(rid=rid, data=data), P.Ok)

    async def set_hostname(self, hostname: str) -> None:
        await self._unary(lambda rid: P.SetHostname(rid=rid, hostname=hostname), P.Ok)

    async def net_config(
        self, address: str, prefix: int, gateway: str, dns: list[str], mac: str = "", iface: str = "eth0"
    ) -> None:
        """Give the guest's ``iface`` this address, MAC, default route and resolvers
        (guestd/netcfg.py; a restored tap clone, before it is reported ready)."""
        servers = list(dns)
        await self._unary(
            lambda rid: P.NetConfig(
                rid=rid, address=address, prefix=prefix, gateway=gateway, dns=servers, mac=mac, iface=iface
            ),
            P.Ok,
        )

    async def shutdown(self, reboot: bool = False) -> None:
        """Ask guestd to stop every process, sync and power off. Returns once it agreed."""
        await self._unary(lambda rid: P.Shutdown(rid=rid, reboot=reboot), P.Ok)
        self._eof_expected = True

    # -- exec ------------------------------------------------------------------
    @asynccontextmanager
    async def exec(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str = "",
        user: str = "",
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        timeout: float = 0.0,
        stdin: bool = False,
    ) -> AsyncIterator[ExecHandle]:
        """Start a process; the handle streams its output. Leaving the block before the
        process exited kills its process group (nothing is left running unowned)."""
        req = self._new_request()
        handle = ExecHandle(self, req, timeout=timeout, stdin=stdin)
        try:
            msg = P.Exec(
                rid=req.rid,
                argv=list(argv),
                env=dict(env or {}),
                cwd=cwd,
                user=user,
                tty=tty,
                rows=rows,
                cols=cols,
                timeout=float(timeout),
                stdin=stdin,
            )
            await self._send(msg)
            first = await req.next(self.answer_timeout)
            if isinstance(first, P.Error):
                raise GuestOpError(first.code, first.message)
            if not isinstance(first, P.ExecStarted):
                await self._protocol_violation(f"expected exec_started, got {first.TAG}")
                raise AssertionError  # unreachable
            handle.pid = first.pid
            yield handle
        finally:
            if handle.pid and handle.exit is None and not self._closed and self._broken is None:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await self._send(P.Signal(rid=req.rid, signum=signal.SIGKILL))
                    except GuestError:
                        pass
            self._end_request(req)

    async def run(self, argv: list[str], *, max_output: int = 64 << 20, **kw: Any) -> ExecResult:
        """Run to completion and collect output (at most ``max_output`` bytes per stream)."""
        out: dict[int, bytearray] = {P.STDOUT: bytearray(), P.STDERR: bytearray()}
        async with self.exec(argv, **kw) as h:
            async for ch, data in h:
                if len(out[ch]) + len(data) > max_output:
                    raise GuestOpError(P.E_TOO_LARGE, f"output exceeds {max_output} bytes")
                out[ch] += data
        assert h.exit is not None
        return ExecResult(h.exit.code, h.exit.signal, h.exit.timed_out, bytes(out[P.STDOUT]), bytes(out[P.STDERR]))

    # -- files -----------------------------------------------------------------
    @asynccontextmanager
    async def read_file(self, path: str) -> AsyncIterator[FileReadStream]:
        req = self._new_request()
        try:
            await self._send(P.ReadFile(rid=req.rid, path=path))
            first = await req.next(self.answer_timeout)
            if isinstance(first, P.Error):
                raise GuestOpError(first.code, first.message)
            if not isinstance(first, P.FileInfo):
                await self._protocol_violation(f"expected file_info, got {first.TAG}")
                raise AssertionError  # unreachable
            if first.size > P.MAX_FILE:
                await self._protocol_violation("guest announced a file beyond the limit")
            yield FileReadStream(req, first.size, first.mode, self.answer_timeout)
        finally:
            self._end_request(req)

    async def read_bytes(self, path: str) -> bytes:
        buf = bytearray()
        async with self.read_file(path) as f:
            async for chunk in f:
                buf += chunk
        return bytes(buf)

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes],
        *,
        mode: int = 0o644,
        size: int = -1,
        owner: str = "",
    ) -> int:
        """Write a file atomically (temp file + rename in the guest). Returns its size.
        ``owner``: user[:group] as the guest's /etc/passwd and /etc/group name them (or
        numeric ids); "" = root."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            size = len(data)
        if size > P.MAX_FILE:
            raise GuestOpError(P.E_TOO_LARGE, f"{size} bytes exceeds the {P.MAX_FILE} byte limit")
        msg = lambda rid: P.WriteFile(rid=rid, path=path, mode=mode, size=size, owner=owner)
        return await self._stream_in(msg, data, P.MAX_FILE, "file")

    async def _stream_in(self, build: Any, data: bytes | AsyncIterable[bytes], limit: int, what: str) -> int:
        """A request that streams ``data`` to the guest on STDIN within credit, then Eof;
        the guest's Ok (its value) ends it."""
        req = self._new_request()
        try:
            await self._send(build(req.rid))
            total = 0

            async def chunks() -> AsyncGenerator[bytes, None]:
                if isinstance(data, (bytes, bytearray, memoryview)):
                    view = memoryview(data)
                    for i in range(0, len(view), P.CHUNK):
                        yield bytes(view[i : i + P.CHUNK])
                else:
                    async for c in data:
                        for i in range(0, len(c), P.CHUNK):
                            yield bytes(c[i : i + P.CHUNK])

            async with aclosing(chunks()) as pieces:
                async for piece in pieces:
                    total += len(piece)
                    if total > limit:
                        raise GuestOpError(P.E_TOO_LARGE, f"{what} exceeds the {limit} byte limit")
                    await _send_with_credit(self, req, piece, self.answer_timeout)
            await self._send(P.Eof(rid=req.rid, ch=P.STDIN))
            while True:
                msg = await req.next(self.answer_timeout)
                if isinstance(msg, P.Error):
                    raise GuestOpError(msg.code, msg.message)
                if isinstance(msg, P.Ok):
                    return msg.value
                await self._protocol_violation(f"expected ok, got {msg.TAG}")
        finally:
            self._end_request(req)
            aclose = getattr(data, "aclose", None)
            if aclose is not None:  # the caller's generator: what we did not consume goes now
                with trio.CancelScope(shield=True):
                    await aclose()

    # -- trees -------------------------------------------------------------------
    @asynccontextmanager
    async def read_tree(self, path: str) -> AsyncIterator[TreeReadStream]:
        """The directory ``path`` of the guest as one tar stream (POSIX pax: modes,
        numeric owners, mtimes, symlinks as links, hard links, empty directories),
        an async iterator of byte chunks. The archive is whole only if the iteration
        ends without an error. Leaving the block early stops the guest's packer::

            async with chan.read_tree("/srv/app") as tar:
                async for chunk in tar:
                    out.write(chunk)
        """
        req = self._new_request()
        stream = TreeReadStream(req, self.answer_timeout)
        try:
            await self._send(P.ReadTree(rid=req.rid, path=path))
            first = await req.next(self.answer_timeout)
            if isinstance(first, P.Error):
                raise GuestOpError(first.code, first.message)
            if not isinstance(first, P.Ok):
                await self._protocol_violation(f"expected ok, got {first.TAG}")
            yield stream
        finally:
            if not stream.eof and not req.broken and not self._closed and self._broken is None:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:  # the guest's worker would wait for credit until the session ends
                        await self._send(P.Signal(rid=req.rid, signum=signal.SIGKILL))
                    except GuestError:
                        pass
            self._end_request(req)

    async def write_tree(self, path: str, data: bytes | AsyncIterable[bytes], *, owner: str = "") -> int:
        """Unpack a tar stream into the guest directory ``path`` (made if missing;
        existing directories are merged, files replaced). Returns the number of
        entries. ``owner`` "": each entry keeps the archive's numeric uid/gid; else
        user[:group] (the guest's names or ids) owns every entry. Hostile archives
        (absolute names, '..', names through symlinks, devices...) are refused
        (INVALID_ARGUMENT) without a byte written outside ``path``."""
        msg = lambda rid: P.WriteTree(rid=rid, path=path, owner=owner)
        return await self._stream_in(msg, data, P.MAX_TREE_STREAM, "tree")

    # -- patches and mounts ----------------------------------------------------------
    async def patch(self, entries: Sequence[PatchEntry]) -> int:
        """Apply patch entries in order (as few requests as the frame cap allows).
        Returns how many were applied; the first failure raises GuestOpError naming
        the entry (its index in ``entries``) and leaves the ones before it applied."""
        done = 0
        batch: list[dict[str, Any]] = []
        size = 0
        budget = P.MAX_FRAME - 4096
        for i, entry in enumerate(entries):
            wire = entry.to_wire()
            n = len(entry.data) + len(entry.path) + len(entry.target) + 128
            if n > budget:
                raise GuestOpError(
                    P.E_TOO_LARGE, f"patch entry {i} ({entry.path}) carries {n} bytes: use write_file for it"
                )
            if batch and (size + n > budget or len(batch) >= P.MAX_PATCH_ENTRIES):
                done += await self._patch_batch(batch, done)
                batch, size = [], 0
            batch.append(wire)
            size += n
        if batch:
            done += await self._patch_batch(batch, done)
        return done

    async def _patch_batch(self, batch: list[dict[str, Any]], base: int) -> int:
        ok = await self._unary(lambda rid: P.Patch(rid=rid, entries=batch, base=base), P.Ok)
        return ok.value

    async def mount(self, device: str, path: str, *, read_only: bool = False, fstype: str = "ext4") -> None:
        """Mount a disk at ``path`` in the guest (made if missing). ``device``: a /dev
        path or ``serial:NAME`` (see MachineSpec.volumes). guestd unmounts it when it
        powers off."""
        msg = lambda rid: P.Mount(rid=rid, device=device, path=path, fstype=fstype, read_only=read_only)
        await self._unary(msg, P.Ok)

    async def umount(self, path: str) -> None:
        await self._unary(lambda rid: P.Umount(rid=rid, path=path), P.Ok)


async def _send_with_credit(chan: GuestChannel, req: _Request, data: bytes, timeout: float | None = None) -> None:
    """Send ``data`` on STDIN, waiting for credit (GuestTimeout when none came for
    ``timeout``); an early error from the guest wins."""
    view = memoryview(data)
    while view:
        while req.send_credit <= 0:
            err = req.peek_error()
            if err is not None:
                raise GuestOpError(err.code, err.message)
            if req.broken is not None:
                raise req.broken
            changed = req.credit_changed
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await changed.wait()
            if not changed.is_set():
                raise GuestTimeout(f"the guest granted no credit for {timeout:g}s")
        err = req.peek_error()
        if err is not None:
            raise GuestOpError(err.code, err.message)
        n = min(len(view), req.send_credit, P.CHUNK)
        req.send_credit -= n
        await chan._send(P.Data(rid=req.rid, ch=P.STDIN, data=bytes(view[:n])))
        view = view[n:]


class ExecHandle:
    """A running process in the guest. Iterate it for ``(channel, bytes)`` output.

    With a ``timeout``, the guest kills the process then; the host gives up on it
    :data:`KILL_GRACE` later (GuestTimeout), and as long after a SIGKILL it sent: a
    guest that ignores either cannot hold a caller forever."""

    def __init__(self, chan: GuestChannel, req: _Request, *, timeout: float = 0.0, stdin: bool = False) -> None:
        self._chan = chan
        self._req = req
        self.pid = 0
        self.exit: P.Exit | None = None
        self._stdin = stdin
        self._stdin_closed = False
        self._timeout = timeout
        self._deadline = trio.current_time() + timeout + KILL_GRACE if timeout > 0 else math.inf
        self._why = f"the process ran {KILL_GRACE:g}s past its {timeout:g}s timeout and the guest did not end it"

    @property
    def rid(self) -> int:
        return self._req.rid

    def __aiter__(self) -> ExecHandle:
        return self

    async def __anext__(self) -> tuple[int, bytes]:
        while self.exit is None:
            with trio.move_on_at(self._deadline):
                msg = await self._req.next()
                if isinstance(msg, P.Data):
                    return msg.ch, msg.data
                if isinstance(msg, P.Exit):
                    self.exit = msg
                elif isinstance(msg, P.Error):
                    raise GuestOpError(msg.code, msg.message)
                continue
            raise GuestTimeout(self._why)
        raise StopAsyncIteration

    async def wait(self) -> P.Exit:
        """Discard remaining output and wait for the exit."""
        async for _ in self:
            pass
        assert self.exit is not None
        return self.exit

    async def send_stdin(self, data: bytes) -> None:
        if not self._stdin:
            raise GuestOpError(P.E_INVALID, "this process was started without stdin")
        if self._stdin_closed:
            raise ChannelClosed("stdin already closed")
        if self.exit is not None:
            return
        await _send_with_credit(self._chan, self._req, data)

    async def close_stdin(self) -> None:
        if self._stdin and not self._stdin_closed and self.exit is None:
            self._stdin_closed = True
            await self._chan._send(P.Eof(rid=self.rid, ch=P.STDIN))

    async def resize(self, rows: int, cols: int) -> None:
        if self.exit is None:
            await self._chan._send(P.Resize(rid=self.rid, rows=rows, cols=cols))

    async def signal(self, signum: int) -> None:
        if self.exit is None:
            await self._chan._send(P.Signal(rid=self.rid, signum=signum))
            if signum == signal.SIGKILL:
                self._deadline = min(self._deadline, trio.current_time() + KILL_GRACE)
                self._why = f"the guest did not end the process within {KILL_GRACE:g}s of SIGKILL"


class _DataStream:
    """The guest's Data frames of one request as an async iterator of chunks, ended by its
    Eof, bounded by ``LIMIT`` bytes (a guest that sends more breaks the protocol)."""

    LIMIT = P.MAX_FILE
    WHAT = "the file limit"

    def __init__(self, req: _Request, timeout: float | None = None) -> None:
        self._req = req
        self._timeout = timeout
        self.received = 0
        self.eof = False

    def __aiter__(self) -> _DataStream:
        return self

    async def __anext__(self) -> bytes:
        while not self.eof:
            msg = await self._req.next(self._timeout)
            if isinstance(msg, P.Data):
                self.received += len(msg.data)
                if self.received > self.LIMIT:
                    await self._req.chan._protocol_violation(f"guest sent more than {self.WHAT}")
                return msg.data
            if isinstance(msg, P.Eof):
                self.eof = True
            elif isinstance(msg, P.Error):
                self.eof = True  # the guest ended its side
                raise GuestOpError(msg.code, msg.message)
        raise StopAsyncIteration


class FileReadStream(_DataStream):
    """A read_file's contents (its size and mode came first)."""

    def __init__(self, req: _Request, size: int, mode: int, timeout: float | None = None) -> None:
        super().__init__(req, timeout)
        self.size = size
        self.mode = mode


class TreeReadStream(_DataStream):
    """The tar stream of a read_tree, within the tree limits."""

    LIMIT = P.MAX_TREE_STREAM
    WHAT = "the tree limit"


PATCH_OPS = patch.OPS
PatchEntry = patch.Patch  # one patch of the guest's file system (the one definition: guestd/patch.py)


@asynccontextmanager
async def open_channel(
    stream: trio.abc.Stream, *, hello_timeout: float | None = 30.0, answer_timeout: float | None = None
) -> AsyncIterator[GuestChannel]:
    """Run a channel over ``stream`` (reader task in its own nursery); hello first unless
    ``hello_timeout`` is None. The stream is closed on exit."""
    chan = GuestChannel(stream, answer_timeout=answer_timeout)
    with collapse_single():
        async with trio.open_nursery() as nursery:
            await nursery.start(chan._reader)
            try:
                if hello_timeout is not None:
                    await chan.hello(hello_timeout)
                yield chan
            finally:
                await chan.aclose()
                nursery.cancel_scope.cancel()
