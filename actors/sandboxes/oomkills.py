"""The guest's own OOM kills, as the host sees them: guestd's reports, their events,
and the cause of a death that followed one.

guestd reports each kill of the guest kernel's OOM killer (guestd/oom.py: the kernel's
log; ``proto.OomKill``, its numbers and lengths checked by the channel).
:class:`GuestOoms` (one per life) counts them, keeps the last few, and makes each an
``oom_kill`` event: at most :data:`OOM_EVENT_BURST` at once, then one per
:data:`OOM_EVENT_INTERVAL` (the guest is hostile: a flood of reports fills no event
log; the events left out are counted in the next one's ``suppressed``).

A kill is not the sandbox's death. It is when the guest's init (PID 1: an init the
sandbox handed off to) exits because the OOM killer took what it ran: the kernel then
panics ("Attempted to kill init!") and QEMU exits as on any panic. :func:`oom_death`
reads that from the console (the kernel's "Killed process" line is written before the
panic, which flushes the console; guestd's report may not have left in time).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

from actors.model import Action, Cause, Ending
from actors.sandboxes.eventrate import EventRate
from guestd import oom, proto

OOM_EVENT_BURST = 10  # oom_kill events one life may emit at once
OOM_EVENT_INTERVAL = 1.0  # s: one more allowed this often once the burst is spent
RECENT_KILLS = 8  # the last reports a life keeps (the cause of a death that follows)
CONSOLE_LINES = 400  # the console's last lines searched for the kernel's "Killed process" line
INIT_DIED = "Attempted to kill init! exitcode="


def printable(text: str) -> str:
    """A guest's text for events, logs and terminals: no control characters."""
    return "".join(c if c.isprintable() else "?" for c in text)


def attributes(kill: proto.OomKill) -> dict[str, str]:
    """An ``oom_kill`` event's attributes: the victim (``pid``, ``process``), which OOM
    killer (``by`` guest; ``constraint``, ``cgroup``), its memory at the kill (KiB)."""
    out = {"by": "guest", "pid": str(kill.pid), "process": printable(kill.comm)}
    if kill.constraint:
        out["constraint"] = printable(kill.constraint)
    if kill.cgroup:
        out["cgroup"] = printable(kill.cgroup)
    out["anon_rss_kb"] = str(kill.anon_rss_kb)
    out["total_vm_kb"] = str(kill.total_vm_kb)
    return out


class GuestOoms:
    """One life's OOM kill reports: ``count`` (every report), ``recent`` (the last few)."""

    def __init__(self, emit: Callable[..., None], clock: Callable[[], float] = time.monotonic) -> None:
        self._emit = emit
        self.count = 0
        self.recent: collections.deque[proto.OomKill] = collections.deque(maxlen=RECENT_KILLS)
        self._rate = EventRate(OOM_EVENT_BURST, OOM_EVENT_INTERVAL, clock)

    def report(self, kill: proto.OomKill) -> None:
        """A report from guestd (checked by the channel): counted, kept, and an event if the rate allows."""
        self.count += 1
        self.recent.append(kill)
        extra = self._rate.allow()
        if extra is None:
            return
        self._emit(Action.OOM_KILL, **attributes(kill), count=str(self.count), **extra)


def _init_status(panic: str) -> int | None:
    """The wait status of an init whose exit panicked the kernel (None: another panic)."""
    at = panic.find(INIT_DIED)
    if at < 0:
        return None
    rest = panic[at + len(INIT_DIED) :].split()
    word = rest[0] if rest else ""
    try:
        return int(word, 16) if word.startswith("0x") and len(word) <= 10 else None
    except ValueError:
        return None


def last_console_kill(console: str) -> proto.OomKill | None:
    """The last "Killed process" line of the kernel's OOM killer in the console's text."""
    for line in reversed(console.splitlines()[-CONSOLE_LINES:]):
        kill = oom.killed(line)
        if kill is not None:
            return kill
    return None


def oom_death(panic: str, console: str, recent: Sequence[proto.OomKill]) -> Cause | None:
    """Out of memory, by the guest: the init's exit panicked the kernel (``panic``), it
    ended as the OOM killer's victims end (SIGKILL, or status 137: what it ran was
    killed) and the OOM killer had killed (the console's line, or guestd's report).
    None otherwise (a panic of its own)."""
    status = _init_status(panic)
    if status is None:
        return None
    signal, code = status & 0x7F, (status >> 8) & 0xFF
    if signal != 9 and not (signal == 0 and code == 128 + 9):
        return None
    kill = last_console_kill(console) or (recent[-1] if recent else None)
    if kill is None:
        return None
    how = "was killed by SIGKILL" if signal else f"exited with status {code}"
    return Cause(
        Ending.OUT_OF_MEMORY,
        by="guest",
        detail=f"it killed {printable(kill.comm)[:64]} (pid {kill.pid}); the guest's init then {how}",
    )
