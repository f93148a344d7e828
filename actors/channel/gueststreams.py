"""The streams of one guest request, host side: its receiving mailbox with flow control
(_Request: credit granted and owed), sending within the guest's credit, a process's
output and input (ExecHandle), and file and tree reads (FileReadStream, TreeReadStream).

Every byte the guest sends is bounded by the credit granted; a breach is a protocol
error of the channel (actors/channel/guest.py), not memory grown here."""

from __future__ import annotations

import collections
import math
import signal
from typing import Protocol

import trio

from actors.channel.guestwire import ChannelClosed, GuestOpError, GuestTimeout
from guestd import proto


class RequestChannel(Protocol):
    """What a request's streams use of their channel (actors/channel/guest.py's
    ``GuestChannel``, which makes them): frames out, credit back, a protocol breach."""

    async def send_message(self, msg: proto.Message) -> None: ...

    async def grant_credit(self, rid: int, ch: int, n: int) -> None: ...

    async def fail_protocol(self, text: str) -> None: ...


KILL_GRACE = 5.0  # how long a guest has to end a process it should have killed (timeout, SIGKILL)


class _Request:
    """Receiving side of one request.

    Messages are delivered in arrival order. Stream data is merged into the trailing
    run of data entries (at most one entry per channel there), so a process writing
    a byte at a time to a slow consumer costs no more than the credit we granted;
    other messages queue, at most MAX_EVENTS of them.
    """

    MAX_EVENTS = 64

    def __init__(self, chan: RequestChannel, rid: int) -> None:
        self.chan = chan
        self.rid = rid
        self.queue: collections.deque[proto.Message | tuple[int, bytearray]] = collections.deque()
        self.events = 0
        self.wakeup = trio.Event()
        self.outstanding = {proto.STDOUT: proto.WINDOW, proto.STDERR: proto.WINDOW}  # bytes the guest may still send
        self.send_credit = proto.WINDOW  # bytes we may still send on STDIN
        self.max_send_credit = proto.WINDOW  # what the guest may grant in all (a WriteFile asks for more)
        self.credit_changed = trio.Event()
        self.broken: BaseException | None = None
        self.done = False

    @property
    def buffered(self) -> int:
        return sum(len(x[1]) for x in self.queue if isinstance(x, tuple))

    def deliver(self, msg: proto.Message) -> None:
        if isinstance(msg, proto.Credit):
            if msg.ch != proto.STDIN or msg.n < 0:
                raise proto.BadMessage(f"credit on channel {msg.ch}")
            self.send_credit += msg.n
            if self.send_credit > self.max_send_credit:
                raise proto.BadMessage("guest granted more stdin credit than the window")
            self.credit_changed.set()
            self.credit_changed = trio.Event()
            return
        if isinstance(msg, proto.Data):
            left = self.outstanding.get(msg.ch)
            if left is None or len(msg.data) > left:
                raise proto.BadMessage(f"data beyond granted credit on channel {msg.ch}")
            self.outstanding[msg.ch] = left - len(msg.data)
            trailing = self._trailing(msg.ch)
            if trailing is not None:
                trailing.extend(msg.data)
            else:  # (data was once lost here whenever a message, e.g. file_info, was queued)
                self.queue.append((msg.ch, bytearray(msg.data)))
        else:
            self.events += 1
            if self.events > self.MAX_EVENTS:
                raise proto.BadMessage("too many messages for one request")
            self.queue.append(msg)
            if isinstance(msg, proto.Error):  # a sender waiting for credit must see it now
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

    def peek_error(self) -> proto.Error | None:
        if self.queue and isinstance(self.queue[0], proto.Error):
            err = self.queue.popleft()
            assert isinstance(err, proto.Error)
            return err
        return None

    def fail(self, exc: BaseException) -> None:
        self.broken = exc
        self.wakeup.set()
        self.credit_changed.set()

    async def next(self, timeout: float | None = None) -> proto.Message:
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
            await self.chan.grant_credit(self.rid, ch, len(data))
            return proto.Data(rid=self.rid, ch=ch, data=data)
        self.events -= 1
        return item


async def _send_with_credit(
    chan: RequestChannel, req: _Request, data: bytes, timeout: float | None = None, chunk: int = proto.CHUNK
) -> None:
    """Send ``data`` on STDIN in frames of at most ``chunk`` bytes, waiting for credit
    (GuestTimeout when none came for ``timeout``); an early error from the guest wins."""
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
        n = min(len(view), req.send_credit, chunk)
        req.send_credit -= n
        await chan.send_message(proto.Data(rid=req.rid, ch=proto.STDIN, data=bytes(view[:n])))
        view = view[n:]


class ExecHandle:
    """A running process in the guest. Iterate it for ``(channel, bytes)`` output.

    With a ``timeout``, the guest kills the process then; the host gives up on it
    :data:`KILL_GRACE` later (GuestTimeout), and as long after a SIGKILL it sent: a
    guest that ignores either cannot hold a caller forever."""

    def __init__(self, chan: RequestChannel, req: _Request, *, timeout: float = 0.0, stdin: bool = False) -> None:
        self._chan = chan
        self._req = req
        self.pid = 0
        self.exit: proto.Exit | None = None
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
                if isinstance(msg, proto.Data):
                    return msg.ch, msg.data
                if isinstance(msg, proto.Exit):
                    self.exit = msg
                elif isinstance(msg, proto.Error):
                    raise GuestOpError(msg.code, msg.message)
                continue
            raise GuestTimeout(self._why)
        raise StopAsyncIteration

    async def wait(self) -> proto.Exit:
        """Discard remaining output and wait for the exit."""
        async for _ in self:
            pass
        assert self.exit is not None
        return self.exit

    async def send_stdin(self, data: bytes) -> None:
        if not self._stdin:
            raise GuestOpError(proto.E_INVALID, "this process was started without stdin")
        if self._stdin_closed:
            raise ChannelClosed("stdin already closed")
        if self.exit is not None:
            return
        await _send_with_credit(self._chan, self._req, data)

    async def close_stdin(self) -> None:
        if self._stdin and not self._stdin_closed and self.exit is None:
            self._stdin_closed = True
            await self._chan.send_message(proto.Eof(rid=self.rid, ch=proto.STDIN))

    async def resize(self, rows: int, cols: int) -> None:
        if self.exit is None:
            await self._chan.send_message(proto.Resize(rid=self.rid, rows=rows, cols=cols))

    async def signal(self, signum: int) -> None:
        if self.exit is None:
            await self._chan.send_message(proto.Signal(rid=self.rid, signum=signum))
            if signum == signal.SIGKILL:
                self._deadline = min(self._deadline, trio.current_time() + KILL_GRACE)
                self._why = f"the guest did not end the process within {KILL_GRACE:g}s of SIGKILL"


class _DataStream:
    """The guest's Data frames of one request as an async iterator of chunks, ended by its
    Eof, bounded by ``LIMIT`` bytes (a guest that sends more breaks the protocol)."""

    LIMIT = proto.MAX_FILE
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
            if isinstance(msg, proto.Data):
                self.received += len(msg.data)
                if self.received > self.LIMIT:
                    await self._req.chan.fail_protocol(f"guest sent more than {self.WHAT}")
                return msg.data
            if isinstance(msg, proto.Eof):
                self.eof = True
            elif isinstance(msg, proto.Error):
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

    LIMIT = proto.MAX_TREE_STREAM
    WHAT = "the tree limit"


class FsAnswerStream(_DataStream):
    """The msgpack answer of an Fs list or stat."""

    LIMIT = proto.MAX_FS_ANSWER
    WHAT = "the fs answer limit"
