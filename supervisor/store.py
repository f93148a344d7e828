"""SQLite persistence of sandbox records (stdlib sqlite3, WAL, one connection).

A record is keyed by ``uid``, a UUID the supervisor generates: every on-disk path
(run dir, disk, log) is built from it, never from a caller-supplied id. Calls are
short, synchronous and made from the Trio thread (a few hundred microseconds each).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import attrs
import msgpack

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    uid TEXT PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    seq INTEGER NOT NULL,
    config BLOB NOT NULL,
    state TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    ready_at INTEGER NOT NULL DEFAULT 0,
    last_exited_at INTEGER NOT NULL DEFAULT 0,
    last_exit_code INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '',
    qemu_pid INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sandboxes_seq ON sandboxes(seq);
CREATE TABLE IF NOT EXISTS snapshots (
    uid TEXT PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    created_ns INTEGER NOT NULL,
    data BLOB NOT NULL
);
"""


@attrs.define
class Record:
    uid: str
    id: str
    seq: int
    config: dict[str, Any]
    state: str
    created_at: int
    ready_at: int = 0
    last_exited_at: int = 0
    last_exit_code: int = 0
    error: str = ""
    qemu_pid: int = 0


@attrs.define
class SnapshotRecord:
    """One snapshot. ``dir`` holds vmstate, memory (when mapped), disk.qcow2 (the origin's
    frozen overlay), kernel and initrd (links to the image parts it was saved with).
    ``machine``: the arguments a restore must start QEMU with; ``config``: the origin's
    sandbox configuration, which restores inherit."""

    uid: str
    id: str
    name: str
    labels: dict[str, str]
    sandbox_id: str  # the origin's id (it may be gone since)
    origin_uid: str
    created_ns: int
    dir: str
    memory: str  # "mapped" | "streamed"
    machine: dict[str, Any]
    config: dict[str, Any]
    sizes: dict[str, int] = attrs.field(factory=dict)
    memory_stat: list[int] = attrs.field(factory=list)  # size, mtime_ns: tamper check


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def next_seq(self) -> int:
        row = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM sandboxes").fetchone()
        return int(row[0])

    def insert(self, r: Record) -> None:
        self.db.execute(
            "INSERT INTO sandboxes (uid, id, seq, config, state, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (r.uid, r.id, r.seq, msgpack.packb(r.config, use_bin_type=True), r.state, r.created_at),
        )

    def update(self, r: Record) -> None:
        self.db.execute(
            "UPDATE sandboxes SET state=?, ready_at=?, last_exited_at=?, last_exit_code=?, error=?, qemu_pid=? "
            "WHERE uid=?",
            (r.state, r.ready_at, r.last_exited_at, r.last_exit_code, r.error, r.qemu_pid, r.uid),
        )

    def update_config(self, r: Record) -> None:
        self.db.execute(
            "UPDATE sandboxes SET config=? WHERE uid=?", (msgpack.packb(r.config, use_bin_type=True), r.uid)
        )

    def rekey(self, r: Record) -> None:
        """A warm pool member handed out: it takes the caller's id and becomes visible."""
        self.db.execute(
            "UPDATE sandboxes SET id=?, seq=?, config=?, created_at=? WHERE uid=?",
            (r.id, r.seq, msgpack.packb(r.config, use_bin_type=True), r.created_at, r.uid),
        )

    def delete(self, uid: str) -> None:
        self.db.execute("DELETE FROM sandboxes WHERE uid=?", (uid,))

    def all(self) -> list[Record]:
        rows = self.db.execute(
            "SELECT uid, id, seq, config, state, created_at, ready_at, last_exited_at, last_exit_code, error, "
            "qemu_pid FROM sandboxes ORDER BY seq"
        ).fetchall()
        return [
            Record(
                uid=r[0],
                id=r[1],
                seq=r[2],
                config=msgpack.unpackb(r[3], raw=False),
                state=r[4],
                created_at=r[5],
                ready_at=r[6],
                last_exited_at=r[7],
                last_exit_code=r[8],
                error=r[9],
                qemu_pid=r[10],
            )
            for r in rows
        ]

    # -- snapshots -------------------------------------------------------------
    def insert_snapshot(self, r: SnapshotRecord) -> None:
        self.db.execute(
            "INSERT INTO snapshots (uid, id, created_ns, data) VALUES (?, ?, ?, ?)",
            (r.uid, r.id, r.created_ns, msgpack.packb(attrs.asdict(r), use_bin_type=True)),
        )

    def delete_snapshot(self, uid: str) -> None:
        self.db.execute("DELETE FROM snapshots WHERE uid=?", (uid,))

    def snapshots(self) -> list[SnapshotRecord]:
        rows = self.db.execute("SELECT data FROM snapshots ORDER BY created_ns").fetchall()
        return [SnapshotRecord(**msgpack.unpackb(r[0], raw=False)) for r in rows]
