"""SQLite persistence of sandbox and snapshot records (stdlib sqlite3, WAL, one connection).

A record is keyed by ``uid``, a UUID the supervisor generates: every on-disk path
(run dir, disk, log) is built from it, never from a caller-supplied id. Records hold
domain values (:mod:`actors.model`), stored as msgpack through the one converter.

Reads happen once, at start (:meth:`Store.all`, :meth:`Store.snapshots`). Writes are
queued by the Trio thread (the values are packed at once, so a later change of the
record is not written early) and committed in order by the writer task
(:meth:`Store.run`) in a worker thread, a batch per transaction: a slow commit (a
WAL checkpoint's fsync under I/O load) never stalls the supervisor's one thread.
Whoever needs a write on disk before going on (a Create before it answers, a
checkpoint's journal before the disk swap) awaits :meth:`Store.flush`. A full disk
fails the flush with RESOURCE_EXHAUSTED and keeps the queue, retried until it fits::

    Trio thread                       writer task (run)            worker thread
    insert/update/... -> queue --+--> batch --to_thread------->  BEGIN; ...; COMMIT
    await flush() <-- committed -+                                 (SQLITE_FULL: retry later)

Schema versions (``PRAGMA user_version``): 0 is the first release, whose ``config``
column held the wire's CreateSandboxRequest as a dict; 2 holds a SandboxConfig, the
live port mappings in ``ports`` and the snapshot a sandbox came from in ``origin``;
3 adds the checkpoint journal (``swap``); 4 what Modify changed (``tuning``: the
machine as applied, ``updated_at``); 5 each sandbox's ``owner`` (a principal's name:
actors/principals.py; older rows are :data:`~actors.principals.LEGACY_OWNER`'s, as are
snapshots and volumes stored without one); 6 each sandbox's ``lineage`` (the sandbox it
was forked from and the fork's snapshot: actors/fork.py; older rows have none). Older
databases are migrated in place when opened (columns added; version 0's
configurations rewritten). ``tuning`` also holds the effective limits, resolved when
the sandbox was made (``Record.limits``); a row without them gets the defaults of the
supervisor that first loads it, written back once.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import msgpack
import trio

from actors.errors import ResourceExhausted
from actors.model import (
    Applied,
    BootSource,
    Cause,
    ImageUse,
    Limits,
    MemoryKind,
    NetMode,
    Network,
    PortSpec,
    Protocol,
    SandboxConfig,
    State,
    Timers,
    VolumeRecord,
    Workload,
    dump,
    load,
)
from actors.principals import LEGACY_OWNER

log = logging.getLogger("sandvisor.store")

VERSION = 6
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
CREATE TABLE IF NOT EXISTS volumes (
    name TEXT PRIMARY KEY,
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS ip_leases (
    owner TEXT PRIMARY KEY,
    address TEXT NOT NULL UNIQUE
);
"""
_COLUMNS = (
    "ALTER TABLE sandboxes ADD COLUMN ports BLOB",
    "ALTER TABLE sandboxes ADD COLUMN origin TEXT",
    "ALTER TABLE sandboxes ADD COLUMN image BLOB",
    "ALTER TABLE sandboxes ADD COLUMN chain BLOB",
    "ALTER TABLE sandboxes ADD COLUMN life BLOB",
    "ALTER TABLE sandboxes ADD COLUMN swap TEXT",
    "ALTER TABLE sandboxes ADD COLUMN tuning BLOB",
    "ALTER TABLE sandboxes ADD COLUMN owner TEXT",
    "ALTER TABLE sandboxes ADD COLUMN lineage BLOB",
    "ALTER TABLE sandboxes ADD COLUMN cause BLOB",
)


@attrs.define
class Record:
    """One sandbox. ``config`` is what was requested; ``ports`` are the live mappings
    (host ports filled in, runtime exposures added)."""

    uid: str
    id: str
    seq: int
    config: SandboxConfig
    state: State
    created_at: int
    ready_at: int = 0
    last_exited_at: int = 0
    last_exit_code: int = 0
    error: str = ""
    qemu_pid: int = 0
    ports: list[PortSpec] = attrs.Factory(list)
    origin: str = ""  # the snapshot it was restored from
    image: ImageUse | None = None  # the OCI image it boots, resolved at creation
    chain: list[str] = attrs.Factory(list)  # the layers below its overlay, top first, as we made them
    life: LifeState | None = None  # the QEMU running now (None when none runs)
    swap: str = ""  # journal: the frozen disk of a checkpoint whose disk swap may be under way
    applied: Applied | None = None  # the running machine's vCPUs, memory, disk (None: none runs)
    # the effective resources (the requested limits with the supervisor's defaults, as
    # resolved when the sandbox was made; Modify changes them): every boot, restore,
    # pool and Modify uses these. None: stored before they were kept (resolved on load)
    limits: Limits | None = None
    updated_at: int = 0  # unix seconds: the last Modify that changed something (0: none)
    owner: str = LEGACY_OWNER  # the principal it is the sandbox of (actors/principals.py)
    # a Modify's configuration saved for the next start (policy next_start on a running
    # sandbox): the next boot from stopped takes it (None: nothing pending)
    pending: SandboxConfig | None = None
    cause: Cause | None = None  # why its last life ended (None: none has, or not known)
    lineage: Lineage | None = None  # where a fork's child came from (None: not forked)


@attrs.frozen
class Lineage:
    """A forked sandbox's parent and fork point (actors/fork.py): the parent by uid (ids
    are reused) and by the id it had, the snapshot the fork took (hidden; its files go
    once no child names it) and when."""

    parent_uid: str
    parent_id: str
    snapshot_id: str
    forked_ns: int


@attrs.frozen
class LifeState:
    """A running QEMU as the next supervisor needs it (recorded when QEMU is spawned,
    updated when a checkpoint moves its disk): who it is (pid and start time: a
    recycled pid is not it), where it listens, what it runs in, and its per-life QEMU
    state (the block node the disk device writes, the overlays staged so far)."""

    pid: int
    start_time: int  # /proc/<pid>/stat field 22, clock ticks after boot
    run_dir: str  # the life's run dir on the host (QEMU's log, the jail)
    sock_dir: str  # QEMU's sockets (qmp.sock, console.sock, guest.sock), host path
    uid: int = 0  # the jail's identity (0: not jailed)
    cgroup: str = ""
    jail_root: str = ""
    ram: str = ""  # the RAM file (host path), "" for none or a sealed memfd
    disk_top: str = "disk0"
    staged: int = 0
    spec: Any = None  # the VmSpec it was started from (unstructured)


@attrs.frozen
class MachineRecord:
    """What a restore must start QEMU with: the saved state fits only this machine."""

    append: str
    memory_mib: int
    cpus: int
    accel: str
    machine: str = "microvm"
    balloon: bool = False  # a virtio-balloon (free page reporting); older records: none


@attrs.define
class SnapshotRecord:
    """One snapshot. ``dir`` holds the migration stream (``vmstate``: its file name),
    memory (when mapped), disk.qcow2 (the origin's frozen overlay), kernel and initrd
    (links to the image parts it was saved with). ``config``: the origin's
    configuration, which restores inherit. A boot template (``template_key`` set) is
    the supervisor's own: hidden from callers.

    A streamed snapshot's conversion switches the record in place, in one step of the
    Trio thread (:meth:`~actors.snapshots.snapshot.SnapshotStore.convert_one`): ``memory``,
    ``vmstate``, ``sizes`` and ``memory_stat`` change together. A restore reads them
    once, in one step, and opens the stream there (the files it names then stay
    readable to it whatever happens to the record)."""

    uid: str
    id: str
    name: str
    labels: dict[str, str]
    sandbox_id: str  # the origin's id (it may be gone since)
    origin_uid: str
    created_ns: int
    dir: str
    memory: MemoryKind
    machine: MachineRecord
    config: SandboxConfig
    sizes: dict[str, int] = attrs.Factory(dict)
    memory_stat: list[int] = attrs.Factory(list)  # size, mtime_ns: tamper check
    template_key: str = ""
    image: tuple[str, ...] = ()  # the image parts a template was booted from
    oci: ImageUse | None = None  # the OCI image the origin booted (a template's, its key's)
    chain: tuple[str, ...] = ()  # the layers below disk.qcow2, top first, as we made them
    address: str = ""  # tap: the origin's address, which a restore keeps when it is free
    vmstate: str = "vmstate"  # the stream's file name in ``dir`` (a converted snapshot has another)
    volume_generations: dict[str, int] = attrs.Factory(dict)  # its volumes' generations when taken
    paused_for: str = ""  # a paused sandbox's hibernated state (its uid): hidden, gone at resume
    owner: str = LEGACY_OWNER  # the principal that made it (hidden ones: no caller sees them anyway)
    fork_only: bool = False  # taken only to fork (hidden): retired once no sandbox's lineage names it

    @property
    def layers(self) -> tuple[Path, ...]:
        """Its disk and every layer below: what restores stand on."""
        return (self.disk, *map(Path, self.chain))

    @property
    def path(self) -> Path:
        return Path(self.dir)

    @property
    def disk(self) -> Path:
        return self.path / "disk.qcow2"

    @property
    def hidden(self) -> bool:
        return bool(self.template_key or self.paused_for or self.fork_only)


def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(dump(obj), use_bin_type=True))


def _unpack(blob: bytes) -> Any:
    return msgpack.unpackb(blob, raw=False)


Op = Callable[[sqlite3.Connection], object]


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        version = int(self.db.execute("PRAGMA user_version").fetchone()[0])
        if version < VERSION:
            _migrate(self.db, version)
        self._seq = int(self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM sandboxes").fetchone()[0])
        self._queue: list[Op] = []
        self._queued = 0  # ops ever queued
        self._done = 0  # ops committed
        self._changed = trio.Event()  # the queue grew or a batch ended
        self.error: str = ""  # why the last commit failed ("" when it did not)
        self._running = False  # the writer task runs
        self._attempts = 0  # commits tried
        self.retry_after = 1.0

    def close(self) -> None:
        """Commit what is queued (at exit; synchronously) and close."""
        if self._queue:
            try:
                self._commit(self._queue)
            except sqlite3.Error as exc:
                log.error("store: %d writes lost at exit: %s", len(self._queue), exc)
            self._queue = []
        self.db.close()

    # -- the writer --------------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[Store] = trio.TASK_STATUS_IGNORED) -> None:
        self._running = True
        try:
            task_status.started(self)
            await self._write_forever()
        finally:
            self._running = False
            self._wake()  # a flush waiting on us commits by itself now

    async def _write_forever(self) -> None:
        while True:
            if not self._queue:
                await self._changed.wait()  # (_wake sets it and puts a fresh one in its place)
                continue
            batch = self._queue
            self._queue = []
            try:
                await trio.to_thread.run_sync(self._commit, batch)
            except sqlite3.Error as exc:
                self._attempts += 1
                self._queue[:0] = batch  # keep the order; try again later
                self.error = _why(exc)
                log.warning("store: commit of %d writes failed: %s (retrying)", len(batch), self.error)
                self._wake()
                await trio.sleep(self.retry_after)
                continue
            self._attempts += 1
            self.error = ""
            self._done += len(batch)
            self._wake()

    def _commit(self, batch: list[Op]) -> None:
        self.db.execute("BEGIN")
        try:
            for op in batch:
                op(self.db)
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _put(self, op: Op) -> None:
        self._queue.append(op)
        self._queued += 1
        self._wake()

    def check_writable(self) -> None:
        """RESOURCE_EXHAUSTED while commits fail (a full disk): take no new work that must be stored."""
        if self.error:
            raise ResourceExhausted(f"the supervisor's database cannot be written: {self.error}")

    async def flush(self) -> None:
        """Return once every write queued so far is on disk; RESOURCE_EXHAUSTED when a
        commit tried since the call fails (the writes stay queued, retried later)."""
        target, attempts = self._queued, self._attempts
        while self._done < target:
            if not self._running:  # no writer (start-up, shutdown): commit here
                self._commit_now()
                return
            if self.error and self._attempts > attempts:
                self.check_writable()
            changed = self._changed
            await changed.wait()

    def _commit_now(self) -> None:
        batch, self._queue = self._queue, []
        try:
            self._commit(batch)
        except sqlite3.Error as exc:
            self._queue[:0] = batch
            self.error = _why(exc)
            self.check_writable()
        self._done += len(batch)

    # -- sandboxes ---------------------------------------------------------------------
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def insert(self, r: Record) -> None:
        row = (
            r.uid,
            r.id,
            r.seq,
            _pack(r.config),
            r.state.value,
            r.created_at,
            _pack(r.ports),
            r.origin,
            _pack(r.image),
            _pack(r.chain),
            r.owner,
            _pack_tuning(r),
            _pack(r.lineage) if r.lineage is not None else None,
        )
        self._put(
            lambda db: db.execute(
                "INSERT INTO sandboxes (uid, id, seq, config, state, created_at, ports, origin, image, chain, owner, "
                "tuning, lineage) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                row,
            )
        )

    def update(self, r: Record) -> None:
        """The record's state and life fields (not its identity or configuration)."""
        cause = _pack(r.cause) if r.cause is not None else None
        row = (r.state.value, r.ready_at, r.last_exited_at, r.last_exit_code, r.error, r.qemu_pid, cause, r.uid)
        self._put(
            lambda db: db.execute(
                "UPDATE sandboxes SET state=?, ready_at=?, last_exited_at=?, last_exit_code=?, error=?, qemu_pid=?, "
                "cause=? WHERE uid=?",
                row,
            )
        )

    def update_life(self, r: Record) -> None:
        """The running QEMU (or none), the disk chain, which a checkpoint moves, and the
        checkpoint's journal (``swap``)."""
        row = (_pack(r.life), _pack(r.chain), r.qemu_pid, r.swap, r.uid)
        self._put(lambda db: db.execute("UPDATE sandboxes SET life=?, chain=?, qemu_pid=?, swap=? WHERE uid=?", row))

    def update_tuning(self, r: Record) -> None:
        """The configuration and effective limits (a Modify changes them), the machine as
        applied, ``updated_at``."""
        row = (_pack(r.config), _pack_tuning(r), r.uid)
        self._put(lambda db: db.execute("UPDATE sandboxes SET config=?, tuning=? WHERE uid=?", row))

    def update_ports(self, r: Record) -> None:
        row = (_pack(r.ports), r.uid)
        self._put(lambda db: db.execute("UPDATE sandboxes SET ports=? WHERE uid=?", row))

    def update_config(self, r: Record) -> None:
        """Its configuration (SetTtl changes its timers)."""
        row = (_pack(r.config), r.uid)
        self._put(lambda db: db.execute("UPDATE sandboxes SET config=? WHERE uid=?", row))

    def rekey(self, r: Record) -> None:
        """A warm pool member handed out: it takes the caller's id, configuration, limits and owner."""
        row = (
            r.id,
            r.seq,
            _pack(r.config),
            r.created_at,
            _pack(r.ports),
            r.origin,
            _pack(r.image),
            r.owner,
            _pack_tuning(r),
            r.uid,
        )
        self._put(
            lambda db: db.execute(
                "UPDATE sandboxes SET id=?, seq=?, config=?, created_at=?, ports=?, origin=?, image=?, owner=?, "
                "tuning=? WHERE uid=?",
                row,
            )
        )

    def delete(self, uid: str) -> None:
        self._put(lambda db: db.execute("DELETE FROM sandboxes WHERE uid=?", (uid,)))

    def all(self) -> list[Record]:
        rows = self.db.execute(
            "SELECT uid, id, seq, config, state, created_at, ready_at, last_exited_at, last_exit_code, error, "
            "qemu_pid, ports, origin, image, chain, life, swap, tuning, owner, lineage, cause "
            "FROM sandboxes ORDER BY seq"
        ).fetchall()
        return [
            Record(
                uid=r[0],
                id=r[1],
                seq=r[2],
                config=load(_unpack(r[3]), SandboxConfig),
                state=State(r[4]),
                created_at=r[5],
                ready_at=r[6],
                last_exited_at=r[7],
                last_exit_code=r[8],
                error=r[9],
                qemu_pid=r[10],
                ports=load(_unpack(r[11]), list[PortSpec]) if r[11] else [],
                origin=r[12] or "",
                image=_image(r[13]),
                chain=load(_unpack(r[14]), list[str]) if r[14] else [],
                life=_life(r[15]),
                swap=r[16] or "",
                **_tuning(r[17]),
                owner=r[18] or LEGACY_OWNER,
                lineage=load(_unpack(r[19]), Lineage) if r[19] else None,
                cause=_cause(r[20]),
            )
            for r in rows
        ]

    # -- snapshots ---------------------------------------------------------------------
    def insert_snapshot(self, r: SnapshotRecord) -> None:
        row = (r.uid, r.id, r.created_ns, _pack(r))
        self._put(lambda db: db.execute("INSERT INTO snapshots (uid, id, created_ns, data) VALUES (?, ?, ?, ?)", row))

    def update_snapshot(self, r: SnapshotRecord) -> None:
        """A snapshot's record as it is now (a conversion switched its memory)."""
        row = (_pack(r), r.uid)
        self._put(lambda db: db.execute("UPDATE snapshots SET data=? WHERE uid=?", row))

    def delete_snapshot(self, uid: str) -> None:
        self._put(lambda db: db.execute("DELETE FROM snapshots WHERE uid=?", (uid,)))

    def snapshots(self) -> list[SnapshotRecord]:
        rows = self.db.execute("SELECT data FROM snapshots ORDER BY created_ns").fetchall()
        return [load(_unpack(r[0]), SnapshotRecord) for r in rows]

    # -- named volumes -------------------------------------------------------------------
    def put_volume(self, r: VolumeRecord) -> None:
        row = (r.name, _pack(r))
        self._put(lambda db: db.execute("INSERT OR REPLACE INTO volumes (name, data) VALUES (?, ?)", row))

    def delete_volume(self, name: str) -> None:
        self._put(lambda db: db.execute("DELETE FROM volumes WHERE name=?", (name,)))

    def volumes(self) -> list[VolumeRecord]:
        return [load(_unpack(r[0]), VolumeRecord) for r in self.db.execute("SELECT data FROM volumes ORDER BY name")]

    # -- the IP pool's leases (tap networking) -------------------------------------------
    def ip_leases(self) -> list[tuple[str, str]]:
        """(owner: a sandbox uid, address) of every lease, oldest first."""
        return [(str(o), str(a)) for o, a in self.db.execute("SELECT owner, address FROM ip_leases ORDER BY rowid")]

    def put_lease(self, owner: str, address: str) -> None:
        row = (owner, address)
        self._put(lambda db: db.execute("INSERT OR REPLACE INTO ip_leases (owner, address) VALUES (?, ?)", row))

    def delete_lease(self, owner: str) -> None:
        self._put(lambda db: db.execute("DELETE FROM ip_leases WHERE owner=?", (owner,)))


class StoreLeases:
    """The IP pool's leases in the supervisor's database (actors/net/ippool.py's
    ``LeaseStore``): written through the store's writer, in order with the sandbox
    records, so a lease is on disk whenever the Create that made it has answered
    (Create flushes before it answers)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def load(self) -> list[tuple[str, str]]:
        return self.store.ip_leases()

    def put(self, owner: str, address: str) -> None:
        self.store.put_lease(owner, address)

    def delete(self, owner: str) -> None:
        self.store.delete_lease(owner)


def _life(blob: bytes | None) -> LifeState | None:
    data = _unpack(blob) if blob else None
    return load(data, LifeState) if data else None


def _cause(blob: bytes | None) -> Cause | None:
    """A stored cause (None: none, or one this version cannot read)."""
    try:
        return load(_unpack(blob), Cause) if blob else None
    except Exception:  # a newer supervisor's ending: unknown here, not fatal
        return None


def _pack_tuning(r: Record) -> bytes:
    return _pack({"applied": r.applied, "updated_at": r.updated_at, "limits": r.limits, "pending": r.pending})


def _tuning(blob: bytes | None) -> dict[str, Any]:
    data = _unpack(blob) if blob else None
    if not isinstance(data, dict):
        return {}
    applied, limits, pending = data.get("applied"), data.get("limits"), data.get("pending")
    return {
        "pending": load(pending, SandboxConfig) if pending else None,
        "applied": load(applied, Applied) if applied else None,
        "updated_at": int(data.get("updated_at") or 0),
        "limits": load(limits, Limits) if limits else None,
    }


def _image(blob: bytes | None) -> ImageUse | None:
    data = _unpack(blob) if blob else None
    return load(data, ImageUse) if data else None


def _why(exc: sqlite3.Error) -> str:
    if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return "the disk is full"
    return f"{type(exc).__name__}: {exc}"


# --- migration from version 0 ---------------------------------------------------------------------
def _v0_config(d: dict[str, Any]) -> tuple[SandboxConfig, list[PortSpec], str]:
    """A version-0 config (the wire's CreateSandboxRequest as a dict, plus the live
    ports and ``restored_from``) as (requested config, live ports, origin)."""
    limits = d.get("limits") or {}
    net = d.get("network") or {}
    ports = [
        PortSpec(int(p["sandbox_port"]), int(p.get("host_port") or 0), Protocol(p.get("protocol") or "tcp"))
        for p in d.get("ports") or []
    ]
    cfg = SandboxConfig(
        labels=dict(d.get("labels") or {}),
        limits=Limits(int(limits.get("vcpus") or 0), int(limits.get("memory_mib") or 0)),
        network=Network(NetMode(net.get("mode") or "none"), bool(net.get("outbound"))),
        workload=Workload(
            tuple(d.get("cmd") or ()), dict(d.get("env") or {}), d.get("working_dir") or "", d.get("user") or ""
        ),
        ports=tuple(attrs.evolve(p, host_port=0) if d.get("restored_from") else p for p in ports),
        timers=Timers(
            int(d.get("ttl_seconds") or 0), int(d.get("idle_timeout_seconds") or 0), bool(d.get("ephemeral"))
        ),
        boot=BootSource(
            d.get("kernel") or "",
            d.get("rootfs") or "",
            d.get("boot_args") or "",
            d["image"] if isinstance(d.get("image"), str) else "",
        ),
        hostname=d.get("hostname") or "",
    )
    return cfg, ports, str(d.get("restored_from") or "")


def _migrate(db: sqlite3.Connection, version: int) -> None:
    db.execute("BEGIN IMMEDIATE")
    try:
        cols = {row[1] for row in db.execute("PRAGMA table_info(sandboxes)")}
        for stmt in _COLUMNS:
            if stmt.split()[-2] not in cols:
                db.execute(stmt)
        if version == 0:
            for uid, blob in db.execute("SELECT uid, config FROM sandboxes").fetchall():
                cfg, ports, origin = _v0_config(_unpack(blob))
                db.execute(
                    "UPDATE sandboxes SET config=?, ports=?, origin=? WHERE uid=?",
                    (_pack(cfg), _pack(ports), origin, uid),
                )
            for uid, blob in db.execute("SELECT uid, data FROM snapshots").fetchall():
                d = _unpack(blob)
                labels = dict(d.get("labels") or {})
                key = labels.pop("sandvisor.template", "")
                cfg, _, _ = _v0_config(d.get("config") or {})
                d.update(
                    labels=labels,
                    template_key=key,
                    image=tuple((d.get("config") or {}).get("image") or ()) if key else (),
                    config=dump(cfg),
                )
                db.execute("UPDATE snapshots SET data=? WHERE uid=?", (_pack(load(d, SnapshotRecord)), uid))
        db.execute(f"PRAGMA user_version={VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
