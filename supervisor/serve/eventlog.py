"""The durable event log: every lifecycle event, numbered, in the state dir; the webhooks' outbox.

``STATE_DIR/events.db`` (sqlite, WAL) holds the last :data:`MAX_EVENTS` events, each
numbered by a ``cursor`` (1, 2, ...: never reused, also after the oldest are dropped)
and by its sandbox's own ``sequence``. ``sandvisor events --since CURSOR`` replays the
events after a cursor from here and goes on with the live ones, so a client that
reconnects misses none (:meth:`EventLog.after`). Each configured webhook has a row per
event it has yet to receive (``pending``): the outbox (supervisor/serve/webhooks.py).

The event bus hands each event to :meth:`EventLog.append` in the publisher's step (the
bus's ``journal``), which commits it (with its outbox rows) before any subscriber or
webhook sees it: an event a client was told of is on disk. A commit in WAL mode with
``synchronous=NORMAL`` writes the WAL without an fsync: a supervisor that is killed
loses nothing it committed; a power cut may lose the last few (the rest of the state
dir's database is kept the same way). A commit that fails (a full disk) loses that
event from the log (logged and counted: ``lost``); the live stream still carries it.

Bound: past ``max_events`` the oldest events are dropped, and with them any webhook's
undelivered rows for them (a warning names how many; counted: ``dropped``). A
``--since`` older than the oldest kept event is refused (OUT of the log: FAILED_PRECONDITION),
never answered with a silent gap.
"""

from __future__ import annotations

import json
import logging
import secrets
import sqlite3
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from actors.face import Action, FailedPrecondition, SandboxEvent

log = logging.getLogger("sandvisor.events")

MAX_EVENTS = 100_000
VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    cursor INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    action TEXT NOT NULL,
    timestamp INTEGER NOT NULL,
    attributes TEXT NOT NULL,
    owner TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pending (
    hook TEXT NOT NULL,
    cursor INTEGER NOT NULL,
    PRIMARY KEY (hook, cursor)
);
"""


@attrs.define
class Counters:
    dropped: int = 0  # undelivered webhook events dropped by the bound
    lost: int = 0  # events whose commit failed


class EventLog:
    """The log of ``path``; ``hooks`` are the keys of the webhooks to keep an outbox for
    (rows of hooks no longer configured are dropped at open, with a warning)."""

    def __init__(self, path: Path, hooks: Sequence[str] = (), *, max_events: int = MAX_EVENTS) -> None:
        self.path = path
        self.max_events = max_events
        self.hooks = tuple(hooks)
        self.counters = Counters()
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.db.execute(f"PRAGMA user_version={VERSION}")
        row = self.db.execute("SELECT value FROM meta WHERE key='log_id'").fetchone()
        if row is None:
            self.log_id = secrets.token_hex(6)
            self.db.execute("INSERT INTO meta (key, value) VALUES ('log_id', ?)", (self.log_id,))
        else:
            self.log_id = str(row[0])
        gone = [h for (h,) in self.db.execute("SELECT DISTINCT hook FROM pending") if h not in self.hooks]
        for h in gone:
            n = self.db.execute("DELETE FROM pending WHERE hook=?", (h,)).rowcount
            log.warning("webhooks: %d undelivered events of a webhook no longer configured dropped", n)
        self.sequences: dict[str, int] = {
            str(s): int(n)
            for s, n in self.db.execute("SELECT sandbox_id, MAX(sequence) FROM events GROUP BY sandbox_id")
        }
        self.count = int(self.db.execute("SELECT COUNT(*) FROM events").fetchone()[0])
        # the outbox in memory: hook -> sandbox id -> its undelivered events, oldest first
        self.queues: dict[str, dict[str, deque[SandboxEvent]]] = {h: {} for h in self.hooks}
        for h in self.hooks:
            rows = self.db.execute(
                f"SELECT {_COLS} FROM events JOIN pending USING (cursor) WHERE hook=? ORDER BY cursor", (h,)
            )
            for r in rows:
                ev = _event(r)
                self.queues[h].setdefault(ev.sandbox_id, deque()).append(ev)
        self.listeners: list[Callable[[], None]] = []  # told after each append (the senders wake)

    def close(self) -> None:
        self.db.close()

    def event_id(self, ev: SandboxEvent) -> str:
        """The event's id, unique across logs (a de-duplication key for a listener)."""
        return f"evt_{self.log_id}_{ev.cursor}"

    # -- writing ---------------------------------------------------------------------------
    def append(self, ev: SandboxEvent) -> SandboxEvent:
        """``ev`` numbered and committed (with a pending row per webhook); ``ev`` as it
        came if the commit failed."""
        seq = self.sequences.get(ev.sandbox_id, 0) + 1
        try:
            self.db.execute("BEGIN")
            cur = self.db.execute(
                "INSERT INTO events (sandbox_id, sequence, action, timestamp, attributes, owner) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (ev.sandbox_id, seq, ev.action.value, ev.timestamp, json.dumps(ev.attributes), ev.owner),
            )
            cursor = int(cur.lastrowid or 0)
            self.db.executemany("INSERT INTO pending (hook, cursor) VALUES (?, ?)", [(h, cursor) for h in self.hooks])
            self.db.execute("COMMIT")
        except sqlite3.Error as exc:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            self.counters.lost += 1
            log.error("event log: %s %s not logged: %s", ev.sandbox_id, ev.action.value, exc)
            return ev
        self.sequences[ev.sandbox_id] = seq
        self.count += 1
        ev = attrs.evolve(ev, cursor=cursor, sequence=seq)
        for h in self.hooks:
            self.queues[h].setdefault(ev.sandbox_id, deque()).append(ev)
        if self.count > self.max_events:
            self._prune()
        for tell in list(self.listeners):
            tell()
        return ev

    def _prune(self) -> None:
        excess = self.count - self.max_events
        try:
            self.db.execute("BEGIN")
            cut = int(
                self.db.execute("SELECT cursor FROM events ORDER BY cursor LIMIT 1 OFFSET ?", (excess - 1,)).fetchone()[
                    0
                ]
            )
            dropped = self.db.execute("DELETE FROM pending WHERE cursor<=?", (cut,)).rowcount
            self.db.execute("DELETE FROM events WHERE cursor<=?", (cut,))
            self.db.execute("COMMIT")
        except sqlite3.Error as exc:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            log.error("event log: the oldest events could not be dropped: %s", exc)
            return
        self.count -= excess
        for queues in self.queues.values():
            for sid in list(queues):
                q = queues[sid]
                while q and q[0].cursor <= cut:
                    q.popleft()
                if not q:
                    del queues[sid]
        if dropped:
            self.counters.dropped += dropped
            log.warning(
                "webhooks: the outbox is full (%d events): %d undelivered events dropped, the oldest first",
                self.max_events,
                dropped,
            )

    def delivered(self, hook: str, ev: SandboxEvent) -> None:
        """``hook`` has ``ev`` (its sandbox's oldest undelivered): out of the outbox."""
        queues = self.queues[hook]
        q = queues.get(ev.sandbox_id)
        if q and q[0].cursor == ev.cursor:
            q.popleft()
            if not q:
                del queues[ev.sandbox_id]
        try:
            self.db.execute("DELETE FROM pending WHERE hook=? AND cursor=?", (hook, ev.cursor))
        except sqlite3.Error as exc:  # delivered again after a restart: at least once
            log.warning("webhooks: a delivery of %s not recorded: %s", self.event_id(ev), exc)

    # -- reading ---------------------------------------------------------------------------
    def first_cursor(self) -> int:
        """The oldest cursor kept (the next one to come when the log is empty)."""
        row = self.db.execute("SELECT MIN(cursor) FROM events").fetchone()
        if row[0] is not None:
            return int(row[0])
        seq = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name='events'").fetchone()
        return int(seq[0]) + 1 if seq else 1

    def after(self, cursor: int, limit: int = 1000) -> list[SandboxEvent]:
        """Up to ``limit`` events after ``cursor``, oldest first; FAILED_PRECONDITION when
        events after it were dropped already (the caller would miss them)."""
        if cursor + 1 < self.first_cursor():
            raise FailedPrecondition(
                f"events after cursor {cursor} are no longer in the log (it keeps the last {self.max_events}; "
                f"the oldest now is {self.first_cursor()})"
            )
        rows = self.db.execute(f"SELECT {_COLS} FROM events WHERE cursor>? ORDER BY cursor LIMIT ?", (cursor, limit))
        return [_event(r) for r in rows]

    def depth(self) -> int:
        return sum(len(q) for queues in self.queues.values() for q in queues.values())

    def oldest_ns(self) -> int:
        """The timestamp of the oldest undelivered event (0: none)."""
        heads = [q[0].timestamp for queues in self.queues.values() for q in queues.values() if q]
        return min(heads, default=0)


_COLS = "cursor, sandbox_id, sequence, action, timestamp, attributes, owner"


def _event(r: tuple[object, ...]) -> SandboxEvent:
    cursor, sid, seq, action, ts, attributes, owner = r
    return SandboxEvent(
        str(sid),
        Action(str(action)),
        int(str(ts)),
        dict(json.loads(str(attributes))),
        str(owner),
        cursor=int(str(cursor)),
        sequence=int(str(seq)),
    )
