"""Exec sessions that outlive their client: a detachable Exec's process, held by the
sandbox's life while no client is attached, and attached again by its session id.

One owner: each session is a task in the life's nursery (:attr:`Life.nursery`), so it
ends with the life (a stop, a pause, a crash) and nothing of it stays. While detached,
its output goes to a bounded buffer (the oldest dropped past :data:`MAX_BUFFER`, and
said so), and an idle limit applies: a session nobody attached to for
:data:`IDLE_SECONDS` is ended (its process killed), and an ended one nobody came back
for is forgotten. One client at a time; a client that goes away without detaching ends
the session, as a plain exec's would.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from actors.errors import FailedPrecondition, NotFound
from guestd import proto

MAX_BUFFER = 1 << 20  # bytes of output kept while detached
IDLE_SECONDS = 600.0  # a detached session nobody attached to for this long is ended
MAX_SESSIONS = 32  # held sessions of one sandbox at once

Output = tuple[str, bytes]  # (stream, data)
Opener = Callable[[], AbstractAsyncContextManager[Any]]  # the exec's context (yields its ExecHandle)


class HeldSession:
    """One detachable exec session (see the module's docstring)."""

    def __init__(self, id: int, tty: bool, log: Callable[[str, bytes], object], idle: float) -> None:
        self.id = id
        self.tty = tty
        self.handle: Any = None  # the guest exec (ExecHandle) while it runs
        self.exit_code: int | None = None
        self.oom_killed = False  # the guest kernel's OOM killer ended its process
        self.ended = trio.Event()
        self._log = log
        self._idle = idle
        self._client: trio.MemorySendChannel[Output] | None = None
        self._buffer: collections.deque[Output] = collections.deque()
        self._buffered = 0
        self._dropped = 0
        self._scope = trio.CancelScope()
        self._collected = trio.Event()

    @property
    def attached(self) -> bool:
        return self._client is not None

    async def run(self, open_exec: Opener, *, task_status: trio.TaskStatus[None]) -> None:
        with self._scope:
            try:
                async with open_exec() as h:
                    self.handle = h
                    task_status.started()
                    async for ch, data in h:
                        name = "stderr" if ch == proto.STDERR else "stdout"
                        self._log("output" if self.tty else name, data)
                        await self._out(name, data)
                    self.exit_code = h.exit.code if h.exit is not None else -1
                    self.oom_killed = h.exit is not None and h.exit.oom_killed
            finally:
                self.handle = None
                self.ended.set()
                if self._client is not None:
                    self._client.close()
            await self._collected.wait()  # (bounded by the idle deadline while detached)

    async def _out(self, name: str, data: bytes) -> None:
        client = self._client
        if client is not None:
            try:
                await client.send((name, data))
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # it detached while this waited: kept for the next one
        self._buffer.append((name, data))
        self._buffered += len(data)
        while self._buffered > MAX_BUFFER and len(self._buffer) > 1:
            _, old = self._buffer.popleft()
            self._buffered -= len(old)
            self._dropped += len(old)

    def attach(self, client: trio.MemorySendChannel[Output]) -> list[Output]:
        """``client`` gets the output from now on; what was buffered since the detach is
        returned (one step: nothing is lost or doubled between the two)."""
        if self._client is not None:
            raise FailedPrecondition(f"session {self.id} is attached already")
        held = list(self._buffer)
        if self._dropped:
            note = f"[{self._dropped} bytes of output dropped while detached]\r\n".encode()
            held.insert(0, ("stderr", note))
        self._buffer.clear()
        self._buffered = self._dropped = 0
        self._scope.deadline = math.inf
        if self.ended.is_set():
            client.close()
            self._collected.set()
        else:
            self._client = client
        return held

    def detach(self) -> None:
        """The client left it running: output is buffered, the idle limit starts."""
        if self._client is not None:
            self._client.close()
            self._client = None
        self._scope.deadline = trio.current_time() + self._idle

    def finish(self) -> None:
        """Its client saw it end: nothing more to keep."""
        self._collected.set()

    def end(self) -> None:
        """Its client went away without detaching: the process ends (as a plain exec's)."""
        self._client = None
        self._collected.set()
        self._scope.cancel()


class HeldSessions:
    """The detachable sessions of one life, by id (ids: the sandbox log's session ids)."""

    def __init__(self, nursery: trio.Nursery, *, idle: float = IDLE_SECONDS) -> None:
        self.nursery = nursery
        self.idle = idle
        self.sessions: dict[int, HeldSession] = {}

    async def open(self, id: int, tty: bool, open_exec: Opener, log: Callable[[str, bytes], object]) -> HeldSession:
        """A session running ``open_exec``'s process, its exec under way (the exec's
        errors, before it runs, are raised here)."""
        if len(self.sessions) >= MAX_SESSIONS:
            raise FailedPrecondition(f"{MAX_SESSIONS} detachable sessions at once; end one first")
        s = HeldSession(id, tty, log, self.idle)
        self.sessions[id] = s
        try:
            await self.nursery.start(self._run, s, open_exec)
        except BaseException:
            self.sessions.pop(id, None)
            raise
        return s

    async def _run(self, s: HeldSession, open_exec: Opener, *, task_status: trio.TaskStatus[None]) -> None:
        try:
            await s.run(open_exec, task_status=task_status)
        finally:
            self.sessions.pop(s.id, None)

    def get(self, id: int) -> HeldSession:
        s = self.sessions.get(id)
        if s is None:
            raise NotFound(f"no session {id} (it ended, or it was never detachable)")
        return s
