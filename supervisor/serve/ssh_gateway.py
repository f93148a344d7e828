"""The SSH endpoint (``sandvisor serve --ssh HOST:PORT``): a stock OpenSSH client's
``ssh``, ``scp`` and ``sftp`` reach a sandbox by key, with no sshd in the guest.

``ssh -p PORT SANDBOX@HOST`` (``SANDBOX+USER``: as that guest user) opens the sandbox
named by the username, when the client proves a key that the sandbox was given
(``create --ssh-key FILE``, ``sandvisor ssh-key add``, sandbox.v1's
``ssh_public_key``): a key opens exactly the sandboxes it was added to, anything else
(another key, a password, a sandbox that does not exist) is the same "Permission
denied". The endpoint is then an ordinary client of the supervisor acting as the
sandbox's owner (the ``act_as`` hello: docs/security.md): a command runs through
Exec (stdout, stderr, exit status), a session with a PTY through Exec with a terminal
(window changes resize it), and SFTP (so ``sftp`` and ``scp``) through the sandbox's
file calls. Port forwarding (-L, -R, -D), agent forwarding and X11 are refused.

Hosting: asyncssh is an asyncio library and the supervisor is Trio, so the endpoint
runs its own asyncio loop on a thread of ``serve`` (:class:`SSHGateway` is the Trio
task that owns it: started with the other listeners, stopped and joined with them).
Its calls to the supervisor use the blocking SDK on worker threads (a pool of its
own), each a connection to the supervisor's socket like any client's; no state is
shared with the Trio side. The host key is made once per supervisor (ed25519, 0600,
in the state directory) so that clients can pin it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import posixpath
import stat
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import asyncssh
import trio

from supervisor.client.sdk.acting import acting_as
from supervisor.client.sdk.ops import each
from supervisor.client.sdk.sync import Exec, Sandbox, drive_stream
from supervisor.wire import protocol
from supervisor.wire.errors import NotFound, SandboxError

log = logging.getLogger("sandvisor.ssh")

T = TypeVar("T")
HOST_KEY_NAME = "ssh_host_ed25519_key"
MAX_SESSIONS = 32  # session channels at once (commands, shells, SFTP, scp), over all connections
MAX_OPEN_FILE = 256 << 20  # an SFTP file is read whole / written whole (the sandbox's file calls)
SFTP_BUDGET = 512 << 20  # bytes of open SFTP files buffered at once, over all connections
LOGIN_TIMEOUT = 30  # s


def host_key(state_dir: Path) -> asyncssh.SSHKey:
    """The supervisor's host key (made on first use: ed25519, 0600, ours); a key file
    another user owns or can read is refused."""
    path = state_dir / HOST_KEY_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ValueError(f"{path}: the SSH host key must be a regular file of ours, mode 0600") from None
        return asyncssh.read_private_key(path)
    key = asyncssh.generate_private_key("ssh-ed25519", comment="sandvisor")
    with os.fdopen(fd, "wb") as f:
        f.write(key.export_private_key())
    log.info("made the SSH host key %s", path)
    return key


def split_user(username: str) -> tuple[str, str]:
    """``SANDBOX`` or ``SANDBOX+USER`` -> (sandbox, guest user; "": its default)."""
    sandbox, plus, user = username.rpartition("+")
    return (sandbox, user) if plus else (username, "")


def key_blobs(lines: list[str]) -> set[bytes]:
    """The public key blobs of OpenSSH key lines (lines that are not keys: skipped)."""
    blobs = set()
    for line in lines:
        try:
            blobs.add(asyncssh.import_public_key(line).public_data)
        except (asyncssh.KeyImportError, ValueError):
            continue
    return blobs


class Refused(Exception):
    """A new channel of a connection whose login no longer holds."""


class Target:
    """What a connection reached: the sandbox (its id and uid: a sandbox made again under
    the name is another), its owner (whom the endpoint acts as), the guest user, the key
    the client proved; and the endpoint's pool and socket for calls."""

    def __init__(self, gateway: _Loop, sandbox: str, owner: str, user: str, uid: str = "") -> None:
        self.gateway = gateway
        self.sandbox = sandbox
        self.owner = owner
        self.user = user
        self.uid = uid
        self.key = b""  # the blob of the key that logged in

    async def recheck(self) -> None:
        """Raise :class:`Refused` unless the sandbox is still the one logged into (same
        uid, seen as its owner) and still lists the key: each new channel asks again."""
        try:
            info: protocol.SandboxInfo = await self.call(lambda sb: sb.inspect())
        except SandboxError as exc:
            raise Refused(f"the sandbox is gone: {exc}") from None
        if info.uid != self.uid or not self.key or self.key not in key_blobs(info.ssh_keys):
            raise Refused("this connection's key or sandbox is no longer valid; log in again")

    def sb(self) -> Sandbox:
        return Sandbox(self.sandbox, socket=self.gateway.socket)

    async def call(self, fn: Callable[[Sandbox], T]) -> T:
        """``fn(sandbox)`` on a worker thread, acting as the owner."""

        def run() -> T:
            with acting_as(self.owner):
                return fn(self.sb())

        return await self.gateway.blocking(run)


# --- authentication ------------------------------------------------------------------------
class _Server(asyncssh.SSHServer):
    """One connection: public keys only, checked against the sandbox named by the username."""

    def __init__(self, gateway: _Loop) -> None:
        self.gateway = gateway
        self.conn: asyncssh.SSHServerConnection | None = None
        self.keys: dict[str, set[bytes]] = {}  # username -> the public key blobs it accepts

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn

    def begin_auth(self, username: str) -> bool:
        return True  # every login authenticates

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def host_based_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    async def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        if username not in self.keys:
            self.keys[username] = await self._lookup(username)
        ok = key.public_data in self.keys[username]
        if ok and self.conn is not None:
            # the last key accepted is the one whose signature is checked next (no await
            # between), so the one that logged in: its removal ends new channels
            targets = self.conn.get_extra_info("sandvisor_targets") or {}
            targets[username].key = key.public_data
        return ok

    async def _lookup(self, username: str) -> set[bytes]:
        """The key blobs of the sandbox ``username`` names (none: not found, or no keys);
        its owner is kept for the sessions."""
        sandbox, user = split_user(username)
        if not sandbox:
            return set()
        try:
            sb = Sandbox(sandbox, socket=self.gateway.socket)
            info: protocol.SandboxInfo = await self.gateway.blocking(sb.inspect)
        except NotFound:
            return set()
        except SandboxError as exc:
            log.warning("ssh: looking up %r: %s", sandbox, exc)
            return set()
        blobs = key_blobs(info.ssh_keys)
        if blobs and self.conn is not None:
            targets = self.conn.get_extra_info("sandvisor_targets") or {}
            targets[username] = Target(self.gateway, info.id, info.owner, user, info.uid)
            self.conn.set_extra_info(sandvisor_targets=targets)
        return blobs

    # forwarding of any kind: refused (asyncssh's defaults refuse too; said here to stay so)
    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int) -> bool:
        return False

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        return False

    def unix_connection_requested(self, dest_path: str) -> bool:
        return False

    def unix_server_requested(self, listen_path: str) -> bool:
        return False


def target_of(chan: Any) -> Target:
    conn = chan.get_extra_info("connection")
    username = conn.get_extra_info("username")
    targets: dict[str, Target] = conn.get_extra_info("sandvisor_targets") or {}
    return targets[username]


# --- sessions: commands and shells ---------------------------------------------------------
SHELL = ["/bin/sh", "-l"]


async def run_session(process: asyncssh.SSHServerProcess[bytes]) -> None:
    """A session: ``ssh box CMD`` (sh -c CMD) or a shell, with a PTY when asked (at most
    MAX_SESSIONS session channels at once, over all connections); the login is checked
    again first (:meth:`Target.recheck`)."""
    t = target_of(process.channel)
    if not t.gateway.sessions.take(1):
        process.stderr.write(b"sandvisor: too many SSH sessions at once; try again later\r\n")
        process.exit(255)
        return
    try:
        try:
            await t.recheck()
        except Refused as exc:
            process.stderr.write(f"sandvisor: {exc}\r\n".encode())
            process.exit(255)
            return
        await _session(process, t)
    finally:
        t.gateway.sessions.give(1)


async def _session(process: asyncssh.SSHServerProcess[bytes], t: Target) -> None:
    term = process.get_terminal_type()
    width, height, _, _ = process.get_terminal_size()
    cmd = ["/bin/sh", "-c", process.command] if process.command else SHELL
    env = {"TERM": term} if term else {}
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[Any] = asyncio.Queue(maxsize=8)  # (the worker waits for a slow client)
    opened: asyncio.Future[Any] = loop.create_future()
    sends = threading.Lock()
    stop = threading.Event()

    def pump() -> None:  # a worker thread: open the Exec, forward its output
        def put(item: Any) -> None:
            asyncio.run_coroutine_threadsafe(outputs.put(item), loop).result()

        try:
            with (
                acting_as(t.owner),
                t.sb().exec(cmd, size=(width or 80, height or 24), tty=term is not None, env=env, user=t.user) as ex,
            ):
                loop.call_soon_threadsafe(_settle, opened, ex)
                for o in ex:
                    if stop.is_set():
                        break
                    put(o)
        except BaseException as exc:  # (to the session: it reports and exits)
            loop.call_soon_threadsafe(_settle, opened, exc)
            put(exc)
        put(None)

    worker = loop.run_in_executor(t.gateway.pool, pump)
    code = 255
    stdin_task: asyncio.Task[None] | None = None
    watch: asyncio.Task[None] | None = None
    try:
        ex = await opened
        if isinstance(ex, BaseException):
            raise ex

        async def hang_up_when_closed() -> None:  # the client went: so does the process
            await process.channel.wait_closed()
            _hang_up(ex)

        watch = asyncio.create_task(hang_up_when_closed())

        def send(fn: Callable[[], None]) -> None:
            with sends:
                fn()

        async def feed() -> None:
            while True:
                try:
                    data = await process.stdin.read(65536)
                except asyncssh.TerminalSizeChanged as change:
                    size = (change.width, change.height)
                    await t.gateway.blocking(functools.partial(send, functools.partial(ex.resize, *size)))
                    continue
                except (asyncssh.BreakReceived, asyncssh.SignalReceived):
                    continue
                if not data:
                    await t.gateway.blocking(functools.partial(send, ex.close_stdin))
                    return
                await t.gateway.blocking(functools.partial(send, functools.partial(ex.send, data)))

        stdin_task = asyncio.create_task(feed())
        while (o := await outputs.get()) is not None:
            if isinstance(o, BaseException):
                raise o
            if o.stream == "exit":
                code = o.exit_code if o.exit_code is not None and 0 <= o.exit_code < 256 else 255
                break
            (process.stderr if o.stream == "stderr" else process.stdout).write(o.data)
            await process.stdout.drain()
    except SandboxError as exc:
        process.stderr.write(f"sandvisor: {exc}\r\n".encode())
    except (asyncssh.Error, OSError, ConnectionError) as exc:
        log.debug("ssh session of %s ended: %s", t.sandbox, exc)
    finally:
        stop.set()
        for task in (stdin_task, watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if opened.done() and not isinstance(opened.result(), BaseException):
            _hang_up(opened.result())  # a process still running: its connection goes, so does it
        drain = asyncio.create_task(_drain(outputs))  # (the worker's last puts)
        with contextlib.suppress(BaseException):
            await worker
        drain.cancel()
    process.exit(code)


async def _drain(q: asyncio.Queue[Any]) -> None:
    while True:
        await q.get()


def _settle(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _hang_up(ex: Exec) -> None:
    """Close an Exec's connection (unblocks the worker reading it; the supervisor ends the call)."""
    ex.hang_up()


# --- SFTP: the sandbox's file calls --------------------------------------------------------
def _sftp_error(exc: SandboxError) -> asyncssh.SFTPError:
    if isinstance(exc, NotFound):
        return asyncssh.SFTPNoSuchFile(str(exc))
    return asyncssh.SFTPFailure(str(exc))


def _attrs(e: protocol.FsEntry) -> asyncssh.SFTPAttrs:
    kind = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}.get(e.kind, 0)
    secs = e.mtime_ns // 10**9
    return asyncssh.SFTPAttrs(
        size=e.size, uid=e.uid, gid=e.gid, permissions=kind | (e.mode & 0o7777), mtime=secs, atime=secs
    )


class Budget:
    """A count shared by all connections (on the endpoint's loop: no lock): session
    channels, or bytes of open SFTP files held in memory."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.total:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0


class _File:
    """An open file: its content in memory (read whole at open, written whole at close);
    ``held``: the bytes of the gateway's SFTP budget it holds."""

    def __init__(self, path: str, data: bytes, mode: int, writable: bool, held: int = 0) -> None:
        self.path = path
        self.data = bytearray(data)
        self.mode = mode
        self.writable = writable
        self.dirty = False
        self.held = held


def read_capped(sb: Sandbox, path: str, cap: int) -> bytes:
    """The file ``path``, refused past ``cap`` bytes (a file that grew after its stat
    included: the read stops there)."""
    out = bytearray()
    chunks = drive_stream(
        sb.socket, each("ReadFile", protocol.ReadFileRequest(id=sb.id, path=path), protocol.FileChunk)
    )
    try:
        for ch in chunks:
            out += ch.data
            if len(out) > cap:
                raise asyncssh.SFTPFailure(f"{path}: larger than {cap >> 20} MiB")
    finally:
        chunks.close()  # type: ignore[attr-defined]
    return bytes(out)


async def open_sftp(chan: asyncssh.SSHServerChannel[bytes]) -> SandboxSFTP:
    """An SFTP or scp channel: counted in MAX_SESSIONS and the login checked again
    (:meth:`Target.recheck`); refused, the channel is closed with the reason."""
    server = SandboxSFTP(chan)
    if not server.t.gateway.sessions.take(1):
        reason = "too many SSH sessions at once; try again later"
    else:
        server.slot = True
        try:
            await server.t.recheck()
            return server
        except Refused as exc:
            reason = str(exc)
        server.release()
    with contextlib.suppress(OSError, asyncssh.Error):
        chan.write_stderr(f"sandvisor: {reason}\r\n".encode())
        chan.exit(255)
    return server


class SandboxSFTP(asyncssh.SFTPServer):
    """SFTP on the sandbox's file calls (Files API): paths are the guest's, relative ones
    from ``/``; every method of the base class that would touch the host is replaced."""

    def __init__(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:
        super().__init__(chan)
        self.t = target_of(chan)
        self.slot = False  # holds one of MAX_SESSIONS
        self.files: set[_File] = set()  # open, holding some of the SFTP budget

    def _hold(self, f: _File, size: int) -> None:
        """``f`` may hold ``size`` bytes (an SFTP failure past the gateway's budget)."""
        more = size - f.held
        if more > 0:
            if not self.t.gateway.budget.take(more):
                raise asyncssh.SFTPFailure("the SSH endpoint's buffer for open files is full; try again later")
            f.held = size
            self.files.add(f)

    def _let_go(self, f: _File) -> None:
        self.t.gateway.budget.give(f.held)
        f.held = 0
        self.files.discard(f)

    def release(self) -> None:
        """Give back what this channel holds (its files' bytes, its session slot): at its end."""
        for f in list(self.files):
            self._let_go(f)
        if self.slot:
            self.slot = False
            self.t.gateway.sessions.give(1)

    def _path(self, path: bytes) -> str:
        return posixpath.normpath(posixpath.join("/", path.decode("utf-8", "surrogateescape")))

    async def _call(self, fn: Callable[[Sandbox], T]) -> T:
        try:
            return await self.t.call(fn)
        except SandboxError as exc:
            raise _sftp_error(exc) from None

    async def _entry(self, path: str) -> protocol.FsEntry:
        return await self._call(lambda sb: sb.fs.stat(path))

    # paths and attributes
    async def realpath(self, path: bytes) -> bytes:
        return self._path(path).encode("utf-8", "surrogateescape")

    async def stat(self, path: bytes) -> asyncssh.SFTPAttrs:
        return _attrs(await self._entry(self._path(path)))

    async def lstat(self, path: bytes) -> asyncssh.SFTPAttrs:
        return _attrs(await self._entry(self._path(path)))

    async def scandir(self, path: bytes) -> AsyncIterator[asyncssh.SFTPName]:
        p = self._path(path)
        entries = await self._call(lambda sb: sb.fs.list(p))
        yield asyncssh.SFTPName(b".", attrs=_attrs(await self._entry(p)))
        for e in entries:
            yield asyncssh.SFTPName(e.name.encode("utf-8", "surrogateescape"), attrs=_attrs(e))

    async def setstat(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        await self._entry(self._path(path))  # (times and owners are not kept: a no-op on what exists)

    async def lsetstat(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        await self._entry(self._path(path))

    async def mkdir(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        p, mode = self._path(path), (attrs.permissions or 0o755) & 0o7777
        await self._call(lambda sb: sb.fs.mkdir(p, parents=False, mode=mode))

    async def rmdir(self, path: bytes) -> None:
        p = self._path(path)
        if (await self._entry(p)).kind != "dir":
            raise asyncssh.SFTPFailure("not a directory")
        await self._call(lambda sb: sb.fs.remove(p))

    async def remove(self, path: bytes) -> None:
        p = self._path(path)
        if (await self._entry(p)).kind == "dir":
            raise asyncssh.SFTPFailure("is a directory")
        await self._call(lambda sb: sb.fs.remove(p))

    async def rename(self, oldpath: bytes, newpath: bytes) -> None:
        old, new = self._path(oldpath), self._path(newpath)
        await self._call(lambda sb: sb.fs.rename(old, new))

    async def posix_rename(self, oldpath: bytes, newpath: bytes) -> None:
        await self.rename(oldpath, newpath)

    async def readlink(self, path: bytes) -> bytes:
        e = await self._entry(self._path(path))
        if e.kind != "symlink":
            raise asyncssh.SFTPFailure("not a symbolic link")
        return e.target.encode("utf-8", "surrogateescape")

    def symlink(self, oldpath: bytes, newpath: bytes) -> None:
        raise asyncssh.SFTPOpUnsupported("symbolic links are not made over SFTP here")

    def link(self, oldpath: bytes, newpath: bytes) -> None:
        raise asyncssh.SFTPOpUnsupported("hard links are not made over SFTP here")

    def statvfs(self, path: bytes) -> asyncssh.SFTPVFSAttrs:
        raise asyncssh.SFTPOpUnsupported("statvfs is not served")

    def fstatvfs(self, file_obj: object) -> asyncssh.SFTPVFSAttrs:
        raise asyncssh.SFTPOpUnsupported("statvfs is not served")

    def lock(self, file_obj: object, offset: int, length: int, flags: int) -> None:
        raise asyncssh.SFTPOpUnsupported("locks are not served")

    def unlock(self, file_obj: object, offset: int, length: int) -> None:
        raise asyncssh.SFTPOpUnsupported("locks are not served")

    # files
    async def open(self, path: bytes, pflags: int, attrs: asyncssh.SFTPAttrs) -> _File:
        p = self._path(path)
        write = bool(pflags & (asyncssh.FXF_WRITE | asyncssh.FXF_APPEND))
        entry: protocol.FsEntry | None = None
        try:
            entry = await self.t.call(lambda sb: sb.fs.stat(p))
        except NotFound:
            if not pflags & asyncssh.FXF_CREAT:
                raise asyncssh.SFTPNoSuchFile(f"{p}: no such file") from None
        except SandboxError as exc:
            raise _sftp_error(exc) from None
        if entry is not None:
            if entry.kind == "dir":
                raise asyncssh.SFTPFailure(f"{p}: is a directory")
            if pflags & asyncssh.FXF_EXCL and pflags & asyncssh.FXF_CREAT:
                raise asyncssh.SFTPFileAlreadyExists(f"{p}: exists")
        mode = entry.mode if entry is not None else (attrs.permissions or 0o644) & 0o7777
        f = _File(p, b"", mode, write)
        if entry is not None and not (write and pflags & asyncssh.FXF_TRUNC):
            if entry.size > MAX_OPEN_FILE:
                raise asyncssh.SFTPFailure(f"{p}: larger than {MAX_OPEN_FILE >> 20} MiB")
            self._hold(f, entry.size)
            try:
                cap = min(MAX_OPEN_FILE, f.held + self.t.gateway.budget.total - self.t.gateway.budget.used)
                data = await self._call(lambda sb: read_capped(sb, p, cap))
                self._hold(f, len(data))
            except BaseException:
                self._let_go(f)
                raise
            f.data[:] = data
        f.dirty = write and (entry is None or bool(pflags & asyncssh.FXF_TRUNC))
        return f

    def open56(self, path: bytes, desired_access: int, flags: int, attrs: asyncssh.SFTPAttrs) -> _File:
        raise asyncssh.SFTPOpUnsupported("SFTP versions 5 and 6 are not served")

    def read(self, file_obj: object, offset: int, size: int) -> bytes:
        assert isinstance(file_obj, _File)
        return bytes(file_obj.data[offset : offset + size])

    def write(self, file_obj: object, offset: int, data: bytes) -> int:
        assert isinstance(file_obj, _File)
        f = file_obj
        if not f.writable:
            raise asyncssh.SFTPPermissionDenied("opened for reading")
        end = offset + len(data)
        if end > MAX_OPEN_FILE:
            raise asyncssh.SFTPFailure(f"files over SFTP are at most {MAX_OPEN_FILE >> 20} MiB")
        self._hold(f, end)
        if end > len(f.data):
            f.data.extend(bytes(end - len(f.data)))
        f.data[offset:end] = data
        f.dirty = True
        return len(data)

    async def close(self, file_obj: object) -> None:
        assert isinstance(file_obj, _File)
        try:
            await self.fsync(file_obj)
        finally:
            self._let_go(file_obj)

    async def fsync(self, file_obj: object) -> None:
        assert isinstance(file_obj, _File)
        f = file_obj
        if f.dirty:
            data, mode = bytes(f.data), f.mode
            await self._call(lambda sb: sb.fs.write(f.path, data, mode=mode))
            f.dirty = False

    def fstat(self, file_obj: object) -> asyncssh.SFTPAttrs:
        assert isinstance(file_obj, _File)
        return asyncssh.SFTPAttrs(size=len(file_obj.data), permissions=stat.S_IFREG | file_obj.mode)

    def fsetstat(self, file_obj: object, attrs: asyncssh.SFTPAttrs) -> None:
        assert isinstance(file_obj, _File)
        if attrs.size is not None and file_obj.writable:
            del file_obj.data[attrs.size :]
            file_obj.dirty = True

    def exit(self) -> None:
        self.release()
        # an exit status, as sshd sends at a subsystem's end (scp's SFTP mode fails without one)
        with contextlib.suppress(OSError, asyncssh.Error):
            self.channel.exit(0)


# --- the loop and its owner ----------------------------------------------------------------
class _Loop:
    """The endpoint's asyncio side (its thread)."""

    def __init__(self, socket: str, host: str, port: int, key: asyncssh.SSHKey) -> None:
        self.socket = socket
        self.host, self.port = host, port
        self.key = key
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=MAX_SESSIONS + 16, thread_name_prefix="ssh")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: asyncio.Event | None = None
        self.sessions = Budget(MAX_SESSIONS)
        self.budget = Budget(SFTP_BUDGET)

    async def blocking(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a worker thread (the context, so ``acting_as``, goes with it)."""
        import contextvars

        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self.pool, ctx.run, fn)

    def _server(self) -> _Server:
        return _Server(self)

    async def serve(self, ready: Callable[[BaseException | None], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        try:
            server = await asyncssh.create_server(
                self._server,
                self.host,
                self.port,
                server_host_keys=[self.key],
                process_factory=run_session,
                sftp_factory=open_sftp,
                allow_scp=True,
                encoding=None,
                agent_forwarding=False,
                x11_forwarding=False,
                login_timeout=LOGIN_TIMEOUT,
                keepalive_interval=60,
                line_editor=False,
                max_pktsize=65536,
            )
        except OSError as exc:
            ready(exc)
            return
        self.port = server.sockets[0].getsockname()[1]
        ready(None)
        try:
            await self.stopping.wait()
        finally:
            server.close()
            await server.wait_closed()

    def stop(self) -> None:
        if self.loop is not None and self.stopping is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)


class SSHGateway:
    """``serve --ssh``: the Trio task that owns the endpoint's thread (started with
    ``nursery.start``; cancelled, it stops the server and joins the thread)."""

    def __init__(self, socket: str, host: str, port: int, *, state_dir: Path) -> None:
        self.inner = _Loop(socket, host, port, host_key(state_dir))

    @property
    def port(self) -> int:
        return self.inner.port

    @property
    def address(self) -> str:
        """HOST:PORT as bound (an IPv6 host in brackets)."""
        host = self.inner.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def host_key_line(self) -> str:
        """The host key's public half, an OpenSSH line (``ssh-ed25519 AAAA... sandvisor``)."""
        return bytes(self.inner.key.export_public_key("openssh")).decode().strip()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = threading.Event()
        failure: list[BaseException] = []

        def ready(exc: BaseException | None) -> None:
            if exc is not None:
                failure.append(exc)
            started.set()

        def main() -> None:
            try:
                asyncio.run(self.inner.serve(ready))
            except BaseException as exc:  # (a crash of the loop: the Trio side raises it)
                failure.append(exc)
                started.set()
            finally:
                self.inner.pool.shutdown(wait=True, cancel_futures=True)

        thread = threading.Thread(target=main, name="sandvisor-ssh", daemon=True)
        thread.start()
        try:
            await trio.to_thread.run_sync(started.wait)
            if failure:
                raise OSError(f"--ssh {self.inner.host}:{self.inner.port}: {failure[0]}")
            log.info("ssh on %s:%d", self.inner.host, self.inner.port)
            task_status.started()
            await trio.sleep_forever()
        finally:
            self.inner.stop()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join)
