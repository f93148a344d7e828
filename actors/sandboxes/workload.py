"""A sandbox's work in its guest: the Run (its workload), exec sessions, files and trees.

:class:`Workloads` (one per sandbox) streams them through the guest channel with the
sandbox's defaults, and counts what is in flight (the stop's drain, the idle timer
and the checkpoint's idleness read the counts). The state transitions a Run makes
(running, then ready with an idle event) are the sandbox's:
:meth:`~actors.sandboxes.sandbox.Sandbox.workload_started` and ``workload_ended``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Protocol, TypeVar

import trio

from actors.channel.guest import ExecHandle, FileReadStream, FsEntry, GuestError, GuestOpError, TreeReadStream
from actors.errors import DomainError, FailedPrecondition, InvalidArgument, NotFound
from actors.machines.vm import Guest
from actors.model import ImageUse, State
from actors.sandboxes import secrets
from actors.sandboxes.life import guest_error
from guestd import proto

T = TypeVar("T")


class WorkloadOwner(secrets.SecretsOwner, Protocol):
    """What the work in a sandbox's guest uses of the sandbox (the Sandbox is one; it is
    not imported here): its guest, when alive, and its workload state changes."""

    @property
    def state(self) -> State: ...

    async def awake(self) -> None: ...

    def require_alive(self) -> Guest: ...

    async def guest_call(self, fn: Callable[[Guest], Awaitable[T]]) -> T: ...

    def touch(self) -> None: ...

    def workload_started(self) -> None: ...

    def workload_ended(self, code: int, error: str, *, oom_killed: bool = False) -> None: ...


class RunExit(int):
    """A Run's exit status (the code of its "exit" item: an int, as before) and whether
    the guest kernel's OOM killer ended its process (guestd read the kernel's log)."""

    oom_killed: bool

    def __new__(cls, code: int, *, oom_killed: bool = False) -> RunExit:
        self = super().__new__(cls, code)
        self.oom_killed = oom_killed
        return self


class CommandNotRun(NotFound):
    """The command of a Run or an Exec is not there (``exit_code`` 127) or cannot be
    executed (126): its stream ends as a shell's would, with ``stderr`` saying why,
    not with an error (the sandbox was found)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.stderr = f"sandvisor: {message}\n".encode()


def shell_status(exc: GuestOpError) -> CommandNotRun | None:
    """guestd's refusal to start a command, as a shell's status (None: another failure,
    e.g. a working directory that is not there)."""
    if exc.code in (proto.E_NOT_FOUND, proto.E_PERM) and exc.message.startswith("exec "):
        return CommandNotRun(exc.message, 127 if exc.code == proto.E_NOT_FOUND else 126)
    return None


def initial_argv(
    img: ImageUse | None, cmd: tuple[str, ...], entrypoint: tuple[str, ...] | None, cmd_cleared: bool
) -> tuple[str, ...]:
    """The initial workload's argv (see :attr:`Workloads.initial_cmd`)."""
    if img is None:
        return (*(entrypoint or ()), *cmd)
    if entrypoint is not None:  # (the image's CMD was its ENTRYPOINT's arguments: dropped too)
        return (*entrypoint, *cmd)
    image_cmd = img.argv[len(img.entrypoint) :]
    return (*img.entrypoint, *(cmd or (() if cmd_cleared else image_cmd)))


class Workloads:
    """Runs, exec sessions and file transfers of ``sb``; how many Runs and execs are in flight."""

    def __init__(self, sb: WorkloadOwner) -> None:
        self.sb = sb
        self.runs = 0
        self.execs = 0
        self._finished = trio.Event()

    def _finish(self) -> None:
        self._finished.set()
        self._finished = trio.Event()

    async def drain(self) -> None:
        """Until no Run or exec session is in flight."""
        while self.runs or self.execs:
            await self._finished.wait()

    @property
    def initial_cmd(self) -> tuple[str, ...]:
        """What runs at the first ready: the entrypoint (the Create's, else its OCI
        image's ENTRYPOINT) followed by the cmd (the Create's, else, unless the Create
        cleared it or gave its own entrypoint, the image's CMD). As a container runtime
        (docker run --entrypoint, a pod's command) and the SDK reference's
        WithEntrypoint and WithCmd: a Create's cmd replaces the image's CMD; its
        entrypoint replaces the image's ENTRYPOINT and drops its CMD (the old
        entrypoint's arguments); an empty one given clears it."""
        c = self.sb.config
        return initial_argv(self.sb.record.image, c.workload.cmd, c.entrypoint, c.cmd_cleared)

    async def run_initial(self) -> None:
        workload = self.run(list(self.initial_cmd), env={})
        try:
            async with aclosing(workload) as outputs:
                async for _ in outputs:
                    pass
        except DomainError as exc:  # its idle event (with the error) was emitted already
            self.sb.log.append("system", f"initial cmd failed: {exc}".encode())

    def defaults(self, env: dict[str, str], cwd: str, user: str) -> tuple[dict[str, str], str, str]:
        """The sandbox's create-time env, working dir and user are every command's
        defaults, over its OCI image's; a call's own values win."""
        w, img = self.sb.config.workload, self.sb.record.image
        held = secrets.env(self.sb)  # placeholders and the CA's paths (actors/sandboxes/secrets.py)
        if img is None:
            return {**w.env, **held, **env}, cwd or w.working_dir, user or w.user
        return {**img.env, **w.env, **held, **env}, cwd or w.working_dir or img.working_dir, user or w.user or img.user

    async def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str = "",
        user: str = "",
        tty: bool = False,
        timeout: float = 0.0,
    ) -> AsyncGenerator[tuple[str, bytes, int | None], None]:
        """A Run: the sandbox goes running, output streams as (stream, data, None), the
        last item is ("exit", b"", code); then back to ready with an idle event."""
        sb = self.sb
        await sb.awake()  # a paused sandbox resumes first
        guest = sb.require_alive()
        if sb.state == State.RUNNING:
            raise FailedPrecondition(f"sandbox {sb.id} is running a workload already")
        if not argv:
            raise InvalidArgument("cmd must not be empty")
        env, cwd, user = self.defaults(env, cwd, user)
        self.runs += 1
        sb.workload_started()
        session = sb.log.new_session()  # its log records carry it (LogEntry.session_id)
        code = -1
        start_error = ""
        oom_killed = False
        try:
            async with guest.channel.exec(argv, env=env, cwd=cwd, user=user, tty=tty, timeout=timeout) as h:
                src_names = {proto.STDOUT: "output" if tty else "stdout", proto.STDERR: "stderr"}
                async for ch, data in h:
                    name = src_names[ch]
                    sb.log.append(name, data, session)
                    yield ("stdout" if tty else name), data, None
                assert h.exit is not None
                code, oom_killed = h.exit.code, h.exit.oom_killed
            yield "exit", b"", RunExit(code, oom_killed=oom_killed)
        except GuestOpError as exc:
            code = 127 if exc.code == proto.E_NOT_FOUND else 126
            start_error = exc.message
            status = shell_status(exc)
            if status is not None:  # ends the Run as a shell would, saying why on stderr
                text = status.stderr
                sb.log.append("stderr", text, session)
                yield "stderr", text, None
                yield "exit", b"", status.exit_code
                return
            raise guest_error(exc) from None
        except GuestError as exc:  # the guest broke, went silent, or would not end it
            raise guest_error(exc) from None
        finally:
            self.runs -= 1
            sb.workload_ended(code, start_error, oom_killed=oom_killed)
            self._finish()

    @asynccontextmanager
    async def exec(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str = "",
        user: str = "",
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        timeout: float = 0.0,
    ) -> AsyncIterator[ExecHandle]:
        """An exec session: interactive access beside the workload (no state change)."""
        sb = self.sb
        await sb.awake()
        guest = sb.require_alive()
        if not argv:
            raise InvalidArgument("cmd must not be empty")
        env, cwd, user = self.defaults(env, cwd, user)
        self.execs += 1
        sb.touch()
        try:
            try:
                async with guest.channel.exec(
                    argv, env=env, cwd=cwd, user=user, tty=tty, rows=rows, cols=cols, timeout=timeout, stdin=True
                ) as h:
                    yield h
            except GuestOpError as exc:
                status = shell_status(exc)
                if status is not None:
                    raise status from None
                raise guest_error(exc) from None
            except GuestError as exc:
                raise guest_error(exc) from None
        finally:
            self.execs -= 1
            sb.touch()
            self._finish()

    @asynccontextmanager
    async def read_file(self, path: str) -> AsyncIterator[FileReadStream]:
        """A file of the guest, as a stream of chunks."""
        await self.sb.awake()
        guest = self.sb.require_alive()
        try:
            async with guest.channel.read_file(path) as f:
                yield f
        except GuestError as exc:
            raise guest_error(exc) from None

    async def write_file(self, path: str, chunks: AsyncIterator[bytes], *, mode: int) -> None:
        await self.sb.guest_call(lambda g: g.channel.write_file(path, chunks, mode=mode))
        self.sb.touch()

    @asynccontextmanager
    async def read_tree(self, path: str) -> AsyncIterator[TreeReadStream]:
        """The guest directory ``path`` as one tar stream (see GuestChannel.read_tree)."""
        await self.sb.awake()
        guest = self.sb.require_alive()
        try:
            async with guest.channel.read_tree(path) as tar:
                yield tar
        except GuestError as exc:
            raise guest_error(exc) from None
        self.sb.touch()

    async def write_tree(self, path: str, chunks: AsyncIterator[bytes], *, owner: str = "") -> int:
        """Unpack a tar stream into the guest directory ``path``; the number of entries."""
        n = await self.sb.guest_call(lambda g: g.channel.write_tree(path, chunks, owner=owner))
        self.sb.touch()
        return n

    # -- file-system operations (guestd's fs requests) -----------------------------------
    async def fs_list(self, path: str) -> list[FsEntry]:
        """The entries of the guest directory ``path``, by name."""
        return await self._fs(lambda g: g.channel.fs_entries("list", path))

    async def fs_stat(self, path: str) -> FsEntry:
        """``path`` itself (a symlink not followed)."""
        return (await self._fs(lambda g: g.channel.fs_entries("stat", path)))[0]

    async def fs_change(self, op: str, path: str, *, dest: str = "", recursive: bool = False, mode: int = 0o755) -> int:
        """mkdir, remove or rename (see GuestChannel.fs_change)."""
        return await self._fs(lambda g: g.channel.fs_change(op, path, dest=dest, recursive=recursive, mode=mode))

    async def _fs(self, fn: Callable[[Guest], Awaitable[T]]) -> T:
        result = await self.sb.guest_call(fn)
        self.sb.touch()
        return result
