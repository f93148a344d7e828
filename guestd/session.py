"""A host connection, the session a Hello starts on it, and the requests of that session
with their credited byte streams.

Every byte stream is flow-controlled by credit (see proto.py): output (a process's
stdout, a worker's tar) is read only while the host has granted credit and the
connection keeps up (:class:`OutStream`); input (stdin, a tar to unpack) is credited
back as the consumer takes it (:class:`InStream`). The rules are written here once,
for every kind of request.
"""

from __future__ import annotations

import os
import select

from guestd import proto
from guestd.common import log, now

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~30 ms of boot

if TYPE_CHECKING:  # pragma: no cover
    from typing import Protocol

    from guestd.agent import Agent

    class Profiled(Protocol):
        def on_flushed(self) -> None: ...


MAX_OUTBUF = 8 * 1024 * 1024  # a host that stops reading this long is dropped
# Reads and writes of the channel, sized for the virtio console, which hands out at most
# one of its receive buffers (a page) per read() and takes at most 32 KiB per write():
# a readv of page-sized pieces and a writev of 32 KiB pieces move many of them in one
# system call (the kernel loops over the pieces until one comes back short). Reading
# into a buffer allocated once also spares each read a fresh 1 MiB bytes object, which
# glibc maps and unmaps per read (mmap, a page fault, mremap, munmap: TLB flushes that
# TCG pays dearly for). Measured (docs/results/chan.md): a 64 MiB write_file cost the
# guest ~6x the QEMU CPU time with one 1 MiB os.read per page.
READ_PIECE = 4096
READ_PIECES = 64  # 256 KiB per readv: one window of the host's data
WRITE_PIECE = 32 * 1024
WRITE_PIECES = 32  # 1 MiB per writev
EPOLLOUT = select.EPOLLOUT

# ---------------------------------------------------------------------------
# connections (the host side of a session)
# ---------------------------------------------------------------------------


class Conn:
    """One host connection: a framed, non-blocking byte pipe with a bounded out-buffer."""

    def __init__(self, agent: Agent, fd: int, kind: str) -> None:
        self.agent = agent
        self.fd = fd
        self.kind = kind  # "port" (persistent fd, host comes and goes) or "vsock"
        self.decoder = proto.FrameDecoder()
        self.out = bytearray()
        self.session: Session | None = None
        self.away = False
        self.stalled = False  # some stream declined to read because we were congested
        self.syncing = True  # discarding input up to HOST_SYNC (at start, after an error)
        self.discarded = 0
        self.rview = memoryview(bytearray(READ_PIECE * READ_PIECES))
        self.iov = [self.rview[i : i + READ_PIECE] for i in range(0, len(self.rview), READ_PIECE)]
        self.t_read = 0.0  # when the last read began (exec profile marks, exec.py)
        self.prof: list[Profiled] = []  # requests that want a mark at the next flush

    def send(self, msg: proto.Message) -> None:
        if self.away:
            return
        self.out += proto.encode(msg)
        if len(self.out) > MAX_OUTBUF:
            log(f"{self.kind}: host is not reading; dropping the session")
            self.drop()
            return
        # written once per turn of the event loop, not once per message: an exec's
        # eof, eof and exit (or exec_started and its first output) leave in one write,
        # one virtio transfer and one wakeup of the host's reader
        self.agent.dirty.add(self)

    def flush(self) -> None:
        while self.out and not self.away:
            mv = memoryview(self.out)
            iov = [mv[i : i + WRITE_PIECE] for i in range(0, min(len(mv), WRITE_PIECE * WRITE_PIECES), WRITE_PIECE)]
            try:
                n = os.writev(self.fd, iov)
            except BlockingIOError:
                n = -1
            except OSError:
                n = -2
            del iov  # the views go before the buffer changes size (drop clears it)
            mv.release()
            if n == -1:
                break
            if n == -2:
                self.drop()
                return
            del self.out[:n]
        if self.prof:
            prof, self.prof = self.prof, []
            for p in prof:
                p.on_flushed()
        self.agent.update_conn(self)

    @property
    def congested(self) -> bool:
        return len(self.out) > proto.WINDOW

    def on_readable(self) -> None:
        self.t_read = now()
        try:
            got = os.readv(self.fd, self.iov)
        except BlockingIOError:
            return
        except OSError:
            got = 0
        if not got:
            self.drop()
            return
        self.decoder.feed(self.rview[:got])
        while True:
            if self.syncing:
                if not self.decoder.resync(proto.HOST_SYNC):
                    self.discarded += got
                    if self.discarded > proto.MAX_RESYNC and self.kind != "port":
                        self.drop()
                    return
                self.syncing = False
                self.discarded = 0
                self.reset_session()
            try:
                for msg in self.decoder.messages():
                    self.agent.dispatch(self, msg)
                    if self.away:
                        return
                return
            except proto.ProtocolError as exc:
                # lost the frame boundary (a host that reconnected mid-frame, or garbage):
                # wait for the next host's sync marker; the buffered bytes are searched too.
                # A marker at a frame boundary is no error: a new host on a session that
                # was live (every restore of a snapshot), nothing to tell the console
                if not self.decoder.at(proto.HOST_SYNC):
                    log(f"{self.kind}: protocol error from host: {exc}; resynchronising")
                self.syncing = True
                got = 0

    def reset_session(self) -> None:
        """A new host (after HOST_SYNC): stale output of the old one must not reach it."""
        if self.session is not None:
            self.session.close()
            self.session = None
        self.out.clear()

    def drop(self) -> None:
        """The host went away (or misbehaved): end the session, keep the processes."""
        self.agent.dirty.discard(self)
        if self.session is not None:
            self.session.close()
            self.session = None
        self.out.clear()
        self.prof.clear()  # (the old session's marks are not the next host's)
        self.decoder.reset()
        self.syncing = True
        if self.kind == "port":
            self.away = True  # the port fd stays open; poll for the host's return
            self.agent.update_conn(self)
        else:
            self.agent.remove_conn(self)


class Session:
    """What one Hello started: the requests of one host connection."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.reqs: dict[int, Req] = {}

    def send(self, msg: proto.Message) -> None:
        self.conn.send(msg)

    def close(self) -> None:
        for req in list(self.reqs.values()):
            req.orphan()
        self.reqs.clear()


class Req:
    """A request with a life beyond its first answer (exec, file streams)."""

    def __init__(self, session: Session, rid: int) -> None:
        self.session: Session | None = session
        self.rid = rid

    def send(self, msg: proto.Message) -> None:
        if self.session is not None:
            self.session.send(msg)

    def finish(self) -> None:
        if self.session is not None:
            self.session.reqs.pop(self.rid, None)
            self.session = None

    def orphan(self) -> None:
        self.session = None

    def update(self) -> None:
        """Re-arm the request's epoll interest (streams, timers)."""

    def on_data(self, ch: int, data: bytes) -> None:
        raise proto.BadMessage("this request takes no data")

    def on_eof(self, ch: int) -> None:
        raise proto.BadMessage("this request takes no eof")

    def on_credit(self, ch: int, n: int) -> None:
        raise proto.BadMessage("this request takes no credit")

    def on_resize(self, rows: int, cols: int) -> None:
        """A terminal's new size (only a process with a TTY has one)."""

    def on_signal(self, signum: int) -> None:
        """The host signals the request (a process) or gives up on it (a worker)."""

    def resume(self) -> None:
        """The connection drained below its window: read again what stalled on it."""


# ---------------------------------------------------------------------------
# credited streams
# ---------------------------------------------------------------------------


class OutStream:
    """Guest -> host bytes of a request on channel ``ch``, read from ``fd`` only while
    the host has granted credit and its connection keeps up. An orphaned request (its
    host went away) reads on and discards, so the writer never blocks on a dead host."""

    def __init__(self, req: Req, ch: int, fd: int) -> None:
        self.req, self.ch, self.fd = req, ch, fd
        self.credit = proto.WINDOW
        self.open = True

    def readable(self) -> bool:
        session = self.req.session
        if session is None:
            return True
        if session.conn.congested:
            session.conn.stalled = True  # resumed once the connection drains
            return False
        return self.credit > 0

    def add_credit(self, n: int) -> None:
        self.credit = min(self.credit + max(n, 0), 1 << 30)

    def pump(self) -> int:
        """One read: the bytes sent on (0: none to read or no credit; -1: end of stream)."""
        want = proto.CHUNK if self.req.session is None else min(proto.CHUNK, self.credit)
        if want <= 0:
            return 0
        try:
            data = os.read(self.fd, want)
        except BlockingIOError:
            return 0
        except OSError:  # EIO on a PTY master once every slave is closed
            data = b""
        if not data:
            return -1
        if self.req.session is not None:
            self.credit -= len(data)
            self.req.send(proto.Data(rid=self.req.rid, ch=self.ch, data=data))
        return len(data)


class InStream:
    """Host -> guest bytes of a request (channel STDIN), written to ``fd``: at most one
    window is buffered (more breaks the protocol), and what the consumer took is
    credited back. Bytes it will never take (it closed its end, or ``fd`` is -1) are
    dropped and credited too, so the host never stalls on a reader that is gone. At
    the host's eof ``fd`` is closed -- or, for a TTY (``fd`` is the PTY master, owned
    by the output stream), ^D is written."""

    def __init__(
        self, req: Req, agent: Agent, fd: int, *, eof: bool, tty: bool = False, chunk: int = proto.CHUNK
    ) -> None:
        self.req, self.agent, self.fd = req, agent, fd
        self.eof = eof
        self.tty = tty
        self.chunk = chunk
        self.buf = bytearray()

    def watch(self) -> None:
        """Own a pipe's write end in the event loop (a TTY's master is its output's)."""
        if self.fd >= 0 and not self.tty:
            self.agent.watch(self.fd, 0, lambda _ev: self.write())

    def on_data(self, ch: int, data: bytes) -> None:
        if ch != proto.STDIN or self.eof:
            raise proto.BadMessage("data after eof or on a wrong channel")
        if len(self.buf) + len(data) > proto.WINDOW:
            raise proto.BadMessage("data beyond granted credit")
        self.buf += data
        self.write()

    def on_eof(self) -> None:
        self.eof = True
        self.write()

    def write(self) -> None:
        written = 0
        while self.buf and self.fd >= 0:
            try:
                n = os.write(self.fd, self.buf[: self.chunk])
            except BlockingIOError:
                break
            except OSError:  # EPIPE: the reader is gone
                self.close()
                break
            del self.buf[:n]
            written += n
        if self.fd < 0:  # nobody will read these: drop them, but keep crediting
            written += len(self.buf)
            self.buf.clear()
        if written:
            self.req.send(proto.Credit(rid=self.req.rid, ch=proto.STDIN, n=written))
        if not self.buf and self.eof:
            self.close(eot=True)
        self.req.update()

    def close(self, *, eot: bool = False) -> None:
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        if not self.tty:
            self.agent.unwatch(fd)
            os.close(fd)
        elif eot:
            try:
                os.write(fd, b"\x04")  # ^D: end of input for the line discipline
            except OSError:
                pass

    def abandon(self) -> None:
        """The host went away: nothing more comes; a pipe is closed (the reader sees EOF)."""
        self.buf.clear()
        self.eof = True
        if not self.tty:
            self.close()

    def update(self) -> None:
        if self.fd >= 0 and not self.tty:
            self.agent.modify(self.fd, EPOLLOUT if self.buf else 0)
