"""Host end of the guest channel: hello, request/stream multiplexing, flow control.

A thin Trio adapter over the I/O-free protocol core in :mod:`guestd.proto`. One
reader task parses frames and hands each message to the request it belongs to;
callers send under a lock. The guest is hostile: every byte it sends is bounded
(frames by ``MAX_FRAME``, stream data by the credit we granted), and any breach
closes the channel with a typed error instead of growing memory or crashing.

actors/channel/guestwire.py holds the error tree, the range checks of the guest's numbers and the
request values; actors/channel/gueststreams.py the streams of one request (exec, file and tree
reads, flow control). This module re-exports them: ``from actors.channel.guest import ...`` is
the channel's whole API.

Deadlines: every wait for the guest to answer something the host asked (a unary
reply, exec_started, file_info, file data, credit for a file's data, the final Ok of
a write) is bounded by ``answer_timeout``; waits on a process (its output, credit
for its stdin) are not: a process may be silent or slow to read for as long as it
likes, and its own timeout bounds it.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import trio

from actors._groups import collapse_single
from actors.channel.gueststreams import (
    KILL_GRACE,
    ExecHandle,
    FileReadStream,
    FsAnswerStream,
    TreeReadStream,
    _DataStream,
    _Request,
    _send_with_credit,
)
from actors.channel.guestwire import (
    PATCH_OPS,
    ChannelBroken,
    ChannelClosed,
    ChannelStatistics,
    ExecResult,
    FsEntry,
    GuestError,
    GuestOpError,
    GuestProtocolError,
    GuestTimeout,
    HelloTimeout,
    PatchEntry,
    check_ranges,
    parse_fs_entries,
)
from guestd import proto

__all__ = [
    "CLOCK_STALE_S",
    "CLOCK_TRIES",
    "FRAME_TIMEOUT",
    "KILL_GRACE",
    "PATCH_OPS",
    "ChannelBroken",
    "ChannelClosed",
    "ChannelStatistics",
    "ExecHandle",
    "ExecResult",
    "FileReadStream",
    "FsEntry",
    "GuestChannel",
    "GuestError",
    "GuestOpError",
    "GuestProtocolError",
    "GuestTimeout",
    "HelloTimeout",
    "PatchEntry",
    "TreeReadStream",
    "_DataStream",
    "_Request",
    "check_ranges",
    "open_channel",
]

log = logging.getLogger("sandvisor.guest")
CLOCK_STALE_S = 0.05  # a set_clock answered later than this set a stale time: it is sent again
CLOCK_TRIES = 8  # ... at most this often (each try's error is its own round trip)
FRAME_TIMEOUT = 30.0  # how long a guest may take to read one frame we send (as the daemon's guest_timeout)
_M = TypeVar("_M", bound=proto.Message)


class GuestChannel:
    """One connection to guestd. Use :func:`open_channel`; do not construct directly."""

    def __init__(
        self, stream: trio.abc.Stream, *, max_frame: int = proto.MAX_FRAME, answer_timeout: float | None = None
    ) -> None:
        self._stream = stream
        self.answer_timeout = answer_timeout
        self._decoder = proto.FrameDecoder(max_frame)
        self._send_lock = trio.Lock()
        self._reqs: dict[int, _Request] = {}
        self._next_rid = 1
        self._closed = False
        self._broken: ChannelBroken | None = None
        self._hello: proto.HelloOk | None = None
        self._hello_event = trio.Event()
        self._eof_expected = False  # set once guestd agreed to power off
        self._syncing = False  # after our HOST_SYNC: discard input up to GUEST_SYNC
        self._discarded = 0
        self.hello_info: proto.HelloOk | None = None
        # seconds from sending Hello to its answer: its host_time_ns set the guest's clock
        # this stale at most (clock_stale says whether a restore must set it again)
        self.hello_rtt = 0.0
        self._hello_sent = 0.0
        self.guest_logs: collections.deque[str] = collections.deque(maxlen=64)
        self._stats = {"frames_in": 0, "frames_out": 0, "bytes_in": 0, "bytes_out": 0, "dropped": 0}
        # the guest's OOM kill reports (checked: check_ranges), to whoever listens (a Life)
        self.on_oom_kill: Callable[[proto.OomKill], None] | None = None

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
                    data = await self._stream.receive_some(1 << 18)
                except (trio.BrokenResourceError, OSError) as exc:
                    raise ChannelBroken(f"guest channel broke: {exc}") from None
                except trio.ClosedResourceError:
                    return
                if not data:
                    raise ChannelBroken("guest closed the channel")
                self._stats["bytes_in"] += len(data)
                self._decoder.feed(data)
                if self._syncing:
                    if not self._decoder.resync(proto.GUEST_SYNC):
                        self._discarded += len(data)
                        if self._discarded > proto.MAX_RESYNC:
                            raise GuestProtocolError("no sync marker from the guest")
                        continue
                    self._syncing = False
                try:
                    for msg in self._decoder.messages():
                        self._stats["frames_in"] += 1
                        self._dispatch(msg)
                except proto.ProtocolError as exc:
                    raise GuestProtocolError(f"guest protocol error: {exc}") from None
        except ChannelBroken as exc:
            if not self._closed:
                if not self._eof_expected:
                    log.warning("guest channel: %s", exc)
                self._broken = exc
                self._fail_all(exc)
                with trio.CancelScope(shield=True):
                    await self._stream.aclose()

    def _dispatch(self, msg: proto.Message) -> None:
        check_ranges(msg)
        if isinstance(msg, proto.HelloOk):
            self._hello = msg
            self._hello_event.set()
            return
        if isinstance(msg, proto.Log):
            self.guest_logs.append(f"{msg.level}: {msg.text[:1000]}")
            return
        if isinstance(msg, proto.OomKill):
            if self.on_oom_kill is not None:
                self.on_oom_kill(msg)
            return
        rid = getattr(msg, "rid", None)
        if not isinstance(rid, int):
            raise proto.BadMessage(f"unexpected {msg.TAG} from the guest")
        req = self._reqs.get(rid)
        if req is None:
            self._stats["dropped"] += 1  # late traffic of a request we abandoned
            return
        req.deliver(msg)

    # -- sending -------------------------------------------------------------
    async def send_message(self, msg: proto.Message) -> None:
        """One frame to guestd, whole (its requests' streams send through this too)."""
        self._check()
        try:
            frame = proto.encode(msg)
        except proto.FrameTooLarge as exc:  # our own request: refuse it, the channel stays fine
            raise GuestOpError(proto.E_TOO_LARGE, f"request too large for the guest channel: {exc}") from None
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

    async def grant_credit(self, rid: int, ch: int, n: int) -> None:
        """``n`` more bytes of request ``rid``'s output channel ``ch`` consumed: credit them back."""
        req = self._reqs.get(rid)
        if req is not None and not req.done:
            req.outstanding[ch] = req.outstanding.get(ch, 0) + n
            try:
                await self.send_message(proto.Credit(rid=rid, ch=ch, n=n))
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
    async def hello(self, timeout: float) -> proto.HelloOk:
        """Send Hello and wait for the guest's answer (this spans the guest's boot)."""
        await self.send_hello()
        return await self.wait_hello(timeout)

    async def send_hello(self) -> None:
        """HOST_SYNC and Hello, sent: requests sent after it (:meth:`post`) are the new
        session's, answered after its HelloOk, in the same wakeup of the guest."""
        self._check()
        for req in list(self._reqs.values()):  # the guest drops the old session's requests: so do we
            req.fail(ChannelBroken("a new session with the guest began; this request was dropped"))
        self._hello_event = trio.Event()
        self._hello = None
        self._syncing = True
        self._discarded = 0
        async with self._send_lock:
            try:
                await self._stream.send_all(proto.HOST_SYNC)
            except (trio.BrokenResourceError, OSError) as exc:
                raise ChannelBroken(f"guest channel broke: {exc}") from None
        self._hello_sent = time.monotonic()
        await self.send_message(proto.Hello(version=proto.PROTOCOL_VERSION, host_time_ns=time.time_ns()))

    async def wait_hello(self, timeout: float) -> proto.HelloOk:
        """The answer to :meth:`send_hello`'s Hello (HelloTimeout after ``timeout``)."""
        t0 = self._hello_sent
        with trio.move_on_after(timeout):
            await self._hello_event.wait()
        self.hello_rtt = time.monotonic() - t0
        if self._hello is None:
            self._check()
            raise HelloTimeout(f"guestd did not answer hello within {timeout:g}s")
        if self._hello.version != proto.PROTOCOL_VERSION:
            raise GuestProtocolError(f"guest speaks protocol {self._hello.version}, we speak {proto.PROTOCOL_VERSION}")
        self.hello_info = self._hello
        return self._hello

    # -- unary requests --------------------------------------------------------
    async def _unary(self, build: Any, expect: type[_M]) -> _M:
        req = self._new_request()
        try:
            await self.send_message(build(req.rid))
            msg = await req.next(self.answer_timeout)
        finally:
            self._end_request(req)
        if isinstance(msg, proto.Error):
            raise GuestOpError(msg.code, msg.message)
        if not isinstance(msg, expect):
            await self.fail_protocol(f"expected {expect.TAG}, got {msg.TAG}")
        return msg  # type: ignore[return-value]

    async def post(self, builds: Sequence[Callable[[int], proto.Message]]) -> Callable[[], Awaitable[None]]:
        """Send these requests now, in order (each built from its request id), without
        waiting: what the guest does after them sees their effect. The returned function
        waits for every answer (Ok) and raises the first error (a restore's and a pool
        acquire's fix-ups: no round trip of their own on the way to ready)."""
        reqs: list[_Request] = []
        try:
            for build in builds:
                req = self._new_request()
                reqs.append(req)
                await self.send_message(build(req.rid))
        except BaseException:
            for req in reqs:
                self._end_request(req)
            raise

        async def answers() -> None:
            try:
                for req in reqs:
                    msg = await req.next(self.answer_timeout)
                    if isinstance(msg, proto.Error):
                        raise GuestOpError(msg.code, msg.message)
                    if not isinstance(msg, proto.Ok):
                        await self.fail_protocol(f"expected {proto.Ok.TAG}, got {msg.TAG}")
            finally:
                for req in reqs:
                    self._end_request(req)

        return answers

    async def fail_protocol(self, text: str) -> None:
        """guestd broke the protocol: the channel is poisoned and closed; raises."""
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

    async def ping(self) -> proto.Pong:
        return await self._unary(lambda rid: proto.Ping(rid=rid), proto.Pong)

    async def touch(self) -> int:
        return (await self._unary(lambda rid: proto.Touch(rid=rid), proto.Ok)).activity

    async def metrics(self) -> proto.MetricsOk:
        return await self._unary(lambda rid: proto.Metrics(rid=rid), proto.MetricsOk)

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
            await self._unary(lambda rid, ns=ns: proto.SetClock(rid=rid, realtime_ns=ns), proto.Ok)
            if realtime_ns is not None or time.monotonic() - t0 < CLOCK_STALE_S:
                return

    async def add_entropy(self, nbytes: int = 64) -> None:
        data = os.urandom(nbytes)
        await self._unary(lambda rid: proto.AddEntropy(rid=rid, data=data), proto.Ok)

    async def set_hostname(self, hostname: str) -> None:
        await self._unary(lambda rid: proto.SetHostname(rid=rid, hostname=hostname), proto.Ok)

    async def set_cpus(self, online: int) -> int:
        """vCPUs 0..online-1 online, the others offline; how many are online after."""
        r = await self._unary(lambda rid: proto.SetCpus(rid=rid, online=online), proto.Ok)
        return r.value

    async def grow_root(self) -> int:
        """The root filesystem grown to its device; its size in bytes after."""
        r = await self._unary(lambda rid: proto.GrowRoot(rid=rid), proto.Ok)
        return r.value

    async def hand_off(
        self, path: str, args: Sequence[str], env: Mapping[str, str], workload: Sequence[str]
    ) -> proto.HandOffOk:
        """PID 1 becomes the init (``path`` "" or "auto": Init.Auto; guestd/initsys.py),
        guestd its child; once, after the boot-time set-up."""
        return await self._unary(
            lambda rid: proto.HandOff(rid=rid, path=path, args=list(args), env=dict(env), workload=list(workload)),
            proto.HandOffOk,
        )

    async def freeze(self, timeout: float) -> int:
        """Sync and freeze the guest's writable file systems (guestd/freeze.py) until
        :meth:`thaw`, the next hello, or ``timeout`` seconds of guest time; how many froze."""
        r = await self._unary(lambda rid: proto.Freeze(rid=rid, timeout=timeout), proto.Ok)
        return r.value

    async def thaw(self) -> int:
        """Thaw what :meth:`freeze` froze; how many thawed."""
        r = await self._unary(lambda rid: proto.Thaw(rid=rid), proto.Ok)
        return r.value

    def has_feature(self, name: str) -> bool:
        """guestd said so at hello (an older guest runtime lacks newer requests)."""
        return self.hello_info is not None and name in self.hello_info.features

    async def net_config(
        self, address: str, prefix: int, gateway: str, dns: list[str], mac: str = "", iface: str = "eth0"
    ) -> None:
        """Give the guest's ``iface`` this address, MAC, default route and resolvers
        (guestd/netcfg.py; a restored tap clone, before it is reported ready)."""
        servers = list(dns)
        await self._unary(
            lambda rid: proto.NetConfig(
                rid=rid, address=address, prefix=prefix, gateway=gateway, dns=servers, mac=mac, iface=iface
            ),
            proto.Ok,
        )

    async def trust_ca(self, pem: bytes) -> None:
        """Install the sandbox's CA certificate in the guest's trust stores (guestd/trust.py)."""
        await self._unary(lambda rid: proto.TrustCa(rid=rid, pem=pem), proto.Ok)

    async def configure(
        self, *, path_extra: str = "", restricted: bool = False, thp: str = "", log_level: str = ""
    ) -> None:
        """The sandbox's workload shape (guestd/shape.py): once per boot, before its mounts."""
        await self._unary(
            lambda rid: proto.Configure(
                rid=rid, path_extra=path_extra, restricted=restricted, thp=thp, log_level=log_level
            ),
            proto.Ok,
        )

    async def shutdown(self, reboot: bool = False) -> None:
        """Ask guestd to stop every process, sync and power off. Returns once it agreed."""
        await self._unary(lambda rid: proto.Shutdown(rid=rid, reboot=reboot), proto.Ok)
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
        process exited kills its process group (nothing is left running unowned), also
        when it is left before the guest's answer came (a cancel while waiting for
        exec_started): guestd starts the process before it answers, so the kill goes
        out whenever the Exec went out and no refusal came back."""
        req = self._new_request()
        handle = ExecHandle(self, req, timeout=timeout, stdin=stdin)
        sent = answered = False
        try:
            msg = proto.Exec(
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
            await self.send_message(msg)  # (returns once the frame is out, even if cancelled meanwhile)
            sent = True
            first = await req.next(self.answer_timeout)
            answered = True
            if isinstance(first, proto.Error):
                raise GuestOpError(first.code, first.message)
            if not isinstance(first, proto.ExecStarted):
                await self.fail_protocol(f"expected exec_started, got {first.TAG}")
                raise AssertionError  # unreachable
            handle.pid = first.pid
            yield handle
        finally:
            # running, or perhaps running: guestd handles the Exec before any later frame and
            # ignores a Signal for a request it refused or ended, so the kill is safe unseen
            may_run = handle.pid != 0 or (sent and not answered)
            if may_run and handle.exit is None and not self._closed and self._broken is None:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await self.send_message(proto.Signal(rid=req.rid, signum=signal.SIGKILL))
                    except GuestError:
                        pass
            self._end_request(req)

    async def run(self, argv: list[str], *, max_output: int = 64 << 20, **kw: Any) -> ExecResult:
        """Run to completion and collect output (at most ``max_output`` bytes per stream)."""
        out: dict[int, bytearray] = {proto.STDOUT: bytearray(), proto.STDERR: bytearray()}
        async with self.exec(argv, **kw) as h:
            async for ch, data in h:
                if len(out[ch]) + len(data) > max_output:
                    raise GuestOpError(proto.E_TOO_LARGE, f"output exceeds {max_output} bytes")
                out[ch] += data
        assert h.exit is not None
        return ExecResult(
            h.exit.code,
            h.exit.signal,
            h.exit.timed_out,
            bytes(out[proto.STDOUT]),
            bytes(out[proto.STDERR]),
            oom_killed=h.exit.oom_killed,
        )

    # -- files -----------------------------------------------------------------
    @asynccontextmanager
    async def read_file(self, path: str) -> AsyncIterator[FileReadStream]:
        req = self._new_request()
        try:
            await self.send_message(proto.ReadFile(rid=req.rid, path=path))
            first = await req.next(self.answer_timeout)
            if isinstance(first, proto.Error):
                raise GuestOpError(first.code, first.message)
            if not isinstance(first, proto.FileInfo):
                await self.fail_protocol(f"expected file_info, got {first.TAG}")
                raise AssertionError  # unreachable
            if first.size > proto.MAX_FILE:
                await self.fail_protocol("guest announced a file beyond the limit")
            if first.size > proto.WINDOW:  # a deeper pipe for a file beyond one window
                await self.grant_credit(req.rid, proto.STDOUT, proto.FILE_WINDOW - proto.WINDOW)
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
        if size > proto.MAX_FILE:
            raise GuestOpError(proto.E_TOO_LARGE, f"{size} bytes exceeds the {proto.MAX_FILE} byte limit")
        msg = lambda rid: proto.WriteFile(
            rid=rid, path=path, mode=mode, size=size, owner=owner, window=proto.FILE_WINDOW
        )
        return await self._stream_in(
            msg, data, proto.MAX_FILE, "file", window=proto.FILE_WINDOW, chunk=proto.FILE_CHUNK
        )

    async def _stream_in(
        self,
        build: Any,
        data: bytes | AsyncIterable[bytes],
        limit: int,
        what: str,
        *,
        window: int = proto.WINDOW,
        chunk: int = proto.CHUNK,
    ) -> int:
        """A request that streams ``data`` to the guest on STDIN within credit, then Eof;
        the guest's Ok (its value) ends it. ``window``: the credit the request asked the
        guest for (what it may grant in all); ``chunk``: the largest data frame."""
        req = self._new_request()
        req.max_send_credit = window
        sent_eof = False
        try:
            await self.send_message(build(req.rid))
            total = 0

            async def chunks() -> AsyncGenerator[bytes, None]:
                if isinstance(data, (bytes, bytearray, memoryview)):
                    view = memoryview(data)
                    for i in range(0, len(view), chunk):
                        yield bytes(view[i : i + chunk])
                else:
                    async for c in data:
                        for i in range(0, len(c), chunk):
                            yield bytes(c[i : i + chunk])

            async with aclosing(chunks()) as pieces:
                async for piece in pieces:
                    total += len(piece)
                    if total > limit:
                        raise GuestOpError(proto.E_TOO_LARGE, f"{what} exceeds the {limit} byte limit")
                    await _send_with_credit(self, req, piece, self.answer_timeout, chunk)
            await self.send_message(proto.Eof(rid=req.rid, ch=proto.STDIN))
            sent_eof = True
            while True:
                msg = await req.next(self.answer_timeout)
                if isinstance(msg, proto.Error):
                    raise GuestOpError(msg.code, msg.message)
                if isinstance(msg, proto.Ok):
                    return msg.value
                await self.fail_protocol(f"expected ok, got {msg.TAG}")
        finally:
            if not sent_eof and not req.done and not self._closed and self._broken is None:
                # the data did not end (the caller's stream failed): the guest drops what it has
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await self.send_message(proto.Signal(rid=req.rid, signum=signal.SIGKILL))
                    except GuestError:
                        pass
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
            await self.send_message(proto.ReadTree(rid=req.rid, path=path))
            first = await req.next(self.answer_timeout)
            if isinstance(first, proto.Error):
                raise GuestOpError(first.code, first.message)
            if not isinstance(first, proto.Ok):
                await self.fail_protocol(f"expected ok, got {first.TAG}")
            yield stream
        finally:
            if not stream.eof and not req.broken and not self._closed and self._broken is None:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:  # the guest's worker would wait for credit until the session ends
                        await self.send_message(proto.Signal(rid=req.rid, signum=signal.SIGKILL))
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
        msg = lambda rid: proto.WriteTree(rid=rid, path=path, owner=owner)
        return await self._stream_in(msg, data, proto.MAX_TREE_STREAM, "tree")

    # -- patches and mounts ----------------------------------------------------------
    async def patch(self, entries: Sequence[PatchEntry]) -> int:
        """Apply patch entries in order (as few requests as the frame cap allows).
        Returns how many were applied; the first failure raises GuestOpError naming
        the entry (its index in ``entries``) and leaves the ones before it applied."""
        done = 0
        batch: list[dict[str, Any]] = []
        size = 0
        budget = proto.MAX_FRAME - 4096
        for i, entry in enumerate(entries):
            wire = entry.to_wire()
            n = len(entry.data) + len(entry.path) + len(entry.target) + 128
            if n > budget:
                raise GuestOpError(
                    proto.E_TOO_LARGE, f"patch entry {i} ({entry.path}) carries {n} bytes: use write_file for it"
                )
            if batch and (size + n > budget or len(batch) >= proto.MAX_PATCH_ENTRIES):
                done += await self._patch_batch(batch, done)
                batch, size = [], 0
            batch.append(wire)
            size += n
        if batch:
            done += await self._patch_batch(batch, done)
        return done

    async def _patch_batch(self, batch: list[dict[str, Any]], base: int) -> int:
        ok = await self._unary(lambda rid: proto.Patch(rid=rid, entries=batch, base=base), proto.Ok)
        return ok.value

    async def mount(
        self, device: str, path: str, *, read_only: bool = False, fstype: str = "ext4", size_mib: int = 0
    ) -> None:
        """Mount a disk at ``path`` in the guest (made if missing). ``device``: a /dev
        path or ``serial:NAME`` (see MachineSpec.volumes); fstype "tmpfs": a tmpfs of
        at most ``size_mib``. guestd unmounts it when it powers off."""
        msg = lambda rid: proto.Mount(
            rid=rid, device=device, path=path, fstype=fstype, read_only=read_only, size_mib=size_mib
        )
        await self._unary(msg, proto.Ok)

    async def umount(self, path: str) -> None:
        await self._unary(lambda rid: proto.Umount(rid=rid, path=path), proto.Ok)

    # -- file-system operations (feature "fs") -------------------------------------------
    def _require(self, feature: str) -> None:
        info = self.hello_info
        if info is not None and feature not in info.features:  # an older guestd (an old snapshot)
            raise GuestOpError(proto.E_UNSUPPORTED, f"this sandbox's guest agent has no {feature!r} requests")

    async def fs_entries(self, op: str, path: str) -> list[FsEntry]:
        """``list`` (a directory's entries) or ``stat`` (``path`` itself), checked: the
        answer is the guest's, bounded by MAX_FS_ANSWER bytes and MAX_FS_LIST entries."""
        self._require("fs")
        req = self._new_request()
        stream = FsAnswerStream(req, self.answer_timeout)
        try:
            await self.send_message(proto.Fs(rid=req.rid, op=op, path=path))
            first = await req.next(self.answer_timeout)
            if isinstance(first, proto.Error):
                raise GuestOpError(first.code, first.message)
            if not isinstance(first, proto.Ok):
                await self.fail_protocol(f"expected ok, got {first.TAG}")
            body = bytearray()
            async for chunk in stream:
                body += chunk
        finally:
            if not stream.eof and not req.broken and not self._closed and self._broken is None:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await self.send_message(proto.Signal(rid=req.rid, signum=signal.SIGKILL))
                    except GuestError:
                        pass
            self._end_request(req)
        try:
            return parse_fs_entries(bytes(body))
        except ValueError as exc:
            await self.fail_protocol(f"fs {op} answer: {exc}")
            raise AssertionError from None  # unreachable

    async def fs_change(self, op: str, path: str, *, dest: str = "", recursive: bool = False, mode: int = 0o755) -> int:
        """``mkdir`` (``recursive``: parents), ``remove`` (``recursive``: a tree), ``rename``
        (to ``dest``): see ``proto.Fs``. The guest's Ok value (mkdir: 0 if it was there)."""
        self._require("fs")
        msg = lambda rid: proto.Fs(rid=rid, op=op, path=path, dest=dest, recursive=recursive, mode=mode)
        return (await self._unary(msg, proto.Ok)).value


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
