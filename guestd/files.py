"""Files (imported at the first read_file or write_file, never at boot): a file streamed
to the host under its credit, a file written from the host's stream to a temporary
name and renamed into place at eof."""

from __future__ import annotations

import errno
import os

from guestd import proto
from guestd.common import errcode
from guestd.session import Req, Session
from guestd.users import resolve_user

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~30 ms of boot

if TYPE_CHECKING:  # pragma: no cover
    from guestd.agent import Agent


def read_file(agent: Agent, session: Session, msg: proto.ReadFile) -> None:
    if not msg.path.startswith("/"):
        raise LookupError("path must be absolute")
    fd = os.open(msg.path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if (st.st_mode & 0o170000) == 0o040000:
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
        if (st.st_mode & 0o170000) != 0o100000:
            raise LookupError(f"{msg.path} is not a regular file")
        if st.st_size > proto.MAX_FILE:
            session.send(
                proto.Error(rid=msg.rid, code=proto.E_TOO_LARGE, message=f"{st.st_size} bytes > {proto.MAX_FILE}")
            )
            os.close(fd)
            return
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    session.send(proto.FileInfo(rid=msg.rid, size=st.st_size, mode=st.st_mode & 0o7777))
    reader = FileReader(agent, session, msg.rid, fd, st.st_size)
    session.reqs[msg.rid] = reader
    agent.runnable.add(reader)


def write_file(session: Session, msg: proto.WriteFile) -> None:
    if not msg.path.startswith("/") or msg.path.endswith("/"):
        raise LookupError("path must be absolute and name a file")
    if msg.size > proto.MAX_FILE:
        session.send(proto.Error(rid=msg.rid, code=proto.E_TOO_LARGE, message=f"{msg.size} bytes > {proto.MAX_FILE}"))
        return
    if os.path.isdir(msg.path):
        raise IsADirectoryError(errno.EISDIR, "Is a directory")
    parent = os.path.dirname(msg.path) or "/"
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, f"No such directory: {parent}")
    ids = resolve_user(msg.owner)[:2] if msg.owner else None
    tmp = f"{parent}/.{os.path.basename(msg.path)}.sandvisor-{msg.rid}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    session.reqs[msg.rid] = FileWriter(session, msg.rid, fd, msg.path, tmp, msg.mode & 0o7777, ids)
    extra = min(msg.window, proto.FILE_WINDOW) - proto.WINDOW
    if extra > 0:  # the host asked for a deeper pipe: it may run this much further ahead
        session.send(proto.Credit(rid=msg.rid, ch=proto.STDIN, n=extra))


class FileReader(Req):
    def __init__(self, agent: Agent, session: Session, rid: int, fd: int, size: int) -> None:
        super().__init__(session, rid)
        self.agent, self.fd, self.left, self.credit = agent, fd, size, proto.WINDOW

    def on_credit(self, ch: int, n: int) -> None:
        self.credit = min(self.credit + max(n, 0), 1 << 30)
        self.agent.runnable.add(self)

    def run(self) -> None:
        """Send what credit allows, one chunk per loop turn, so others get served."""
        if self.session is None:
            self.close()
            return
        if self.session.conn.congested:
            self.session.conn.stalled = True  # rescheduled once the connection drains
            return
        if self.credit <= 0:
            return  # rescheduled by the host's next credit
        data = os.read(self.fd, min(proto.FILE_CHUNK, self.credit, max(self.left, 0) or proto.CHUNK))
        if not data or self.left <= 0:
            self.send(proto.Eof(rid=self.rid, ch=proto.STDOUT))
            self.close()
            return
        self.left -= len(data)
        self.credit -= len(data)
        self.send(proto.Data(rid=self.rid, ch=proto.STDOUT, data=data))
        self.agent.runnable.add(self)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.finish()

    def orphan(self) -> None:
        super().orphan()
        self.close()

    def resume(self) -> None:
        self.agent.runnable.add(self)


class FileWriter(Req):
    def __init__(
        self, session: Session, rid: int, fd: int, path: str, tmp: str, mode: int, ids: tuple[int, int] | None = None
    ) -> None:
        super().__init__(session, rid)
        self.fd, self.path, self.tmp, self.mode, self.size = fd, path, tmp, mode, 0
        self.ids = ids

    def on_data(self, ch: int, data: bytes) -> None:
        self.size += len(data)
        if self.size > proto.MAX_FILE:
            self.fail(proto.E_TOO_LARGE, f"file exceeds {proto.MAX_FILE} bytes")
            return
        try:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as exc:
            self.fail(errcode(exc), f"write {self.path}: {exc.strerror}")
            return
        self.send(proto.Credit(rid=self.rid, ch=proto.STDIN, n=len(data)))

    def on_eof(self, ch: int) -> None:
        try:
            if self.ids is not None:
                os.fchown(self.fd, *self.ids)  # before the mode: chown clears setuid bits
            os.fchmod(self.fd, self.mode)
            os.close(self.fd)
            self.fd = -1
            os.rename(self.tmp, self.path)
        except OSError as exc:
            self.fail(errcode(exc), f"write {self.path}: {exc.strerror}")
            return
        self.send(proto.Ok(rid=self.rid, value=self.size))
        self.finish()

    def fail(self, code: str, text: str) -> None:
        self.send(proto.Error(rid=self.rid, code=code, message=text))
        self.discard()
        self.finish()

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.tmp)
            except OSError:
                pass

    def on_signal(self, signum: int) -> None:
        """The host gave up on the write (its data did not end): nothing is committed."""
        self.discard()
        self.finish()

    def orphan(self) -> None:
        super().orphan()
        self.discard()
