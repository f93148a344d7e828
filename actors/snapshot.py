"""Snapshots: checkpoint a running guest to a directory, and the snapshot store.

A snapshot directory holds::

    vmstate     QEMU's migration stream (device state; RAM too when "streamed")
    memory      guest RAM, when "mapped": restores map it privately (copy-on-write)
    disk.qcow2  the origin's overlay as it was, frozen; restores put overlays on it
    kernel, initrd   links to the image parts the guest was booted with

Checkpoint (the guest is paused only between ``stop`` and ``cont``)::

    new overlay made, opened, handed to QEMU (add-fd), blockdev-add   <- guest runs
    stop
    blockdev-snapshot: the disk device now writes the new overlay; the old one is
                       read-only from here and moves into the snapshot dir
    migrate to fd:     device state (+ RAM unless x-ignore-shared skips the shared
                       RAM file); wait "completed" and then for the run state to leave
                       finish-migrate (cont fails before that, measured)
    copy the RAM file  (mapped only: cp --sparse, ~100 MB touched of 256)
    cont                                                              <- guest runs
    fsync, sizes

A guest whose RAM is a shared file (every cold boot, and every restore of a streamed
snapshot) checkpoints "mapped". A guest restored from a mapped snapshot has its RAM
mapped privately from that snapshot's file, which QEMU cannot copy as a file: its
checkpoints are "streamed" (RAM in vmstate). Restoring a streamed snapshot gives the
guest a shared RAM file again, so the next checkpoint is mapped again.

Migration capabilities must match on both sides: ``x-ignore-shared`` is on for mapped
snapshots (checkpoint and restore) and off for streamed ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.disk import backing_chain, create_overlay
from actors.machine import MachineError, QemuUser, unsearchable_parent
from actors.vm import Guest
from supervisor.protocol import FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND, ApiError
from supervisor.store import SnapshotRecord, Store

log = logging.getLogger("sandvisor.snapshot")

MAPPED, STREAMED = "mapped", "streamed"


class CheckpointError(MachineError):
    """QEMU refused a step of the checkpoint; the guest runs on."""


@attrs.frozen
class Checkpoint:
    memory: str
    paused_s: float
    sizes: dict[str, int]
    memory_stat: list[int]
    machine: dict[str, Any]  # what a restore must start QEMU with


def allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def _stat_key(path: Path) -> list[int]:
    """Size and mtime: a write changes them. (Not ctime: the hard link a restore may
    make changes it.)"""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


async def checkpoint_guest(guest: Guest, *, disk: Path, snap_dir: Path, user: QemuUser | None) -> Checkpoint:
    """Save a running guest into ``snap_dir`` (which exists and is empty) and let it run
    on. ``disk``: the guest's overlay; afterwards a new overlay at the same path, on
    top of the frozen one (now ``snap_dir/disk.qcow2``).

    Until the freeze, a failure undoes everything here (the new overlay, its fd set and
    block node); after it, the guest runs on the new overlay and ``snap_dir`` holds the
    disk it stands on (the caller's collector keeps it while used)."""
    m = guest.machine
    spec = m.spec
    mapped = spec.memory_file is not None and spec.memory_shared
    frozen = snap_dir / "disk.qcow2"
    nxt = disk.with_name("disk.next.qcow2")
    m.checkpoints += 1
    fdset, node = 100 + m.checkpoints, f"ov{m.checkpoints}"
    fdset_added = node_added = frozen_done = False
    vm_fd = -1
    try:
        nxt.unlink(missing_ok=True)
        await create_overlay(disk, nxt, backing_as=frozen)
        fds = [os.open(nxt, os.O_RDWR | os.O_CLOEXEC), os.open(nxt, os.O_RDONLY | os.O_CLOEXEC)]
        try:
            for fd, opaque in zip(fds, ("rw", "ro"), strict=True):
                await m.add_fd(fd, fdset, f"{node}-{opaque}")
                fdset_added = True
        finally:
            for fd in fds:
                os.close(fd)
        await m.qmp_execute(
            "blockdev-add",
            {
                "driver": "qcow2",
                "node-name": node,
                "file": {"driver": "file", "filename": f"/dev/fdset/{fdset}", "locking": "off"},
                "backing": None,
            },
        )
        node_added = True
        vm_fd = os.open(snap_dir / "vmstate", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        t0 = time.monotonic()
        await m.qmp_execute("stop")
        try:
            await m.qmp_execute("blockdev-snapshot", {"node": m.disk_top, "overlay": node})
            m.disk_top = node
            # the guest is paused: nobody sees the two names change
            os.rename(disk, frozen)
            os.rename(nxt, disk)
            frozen_done = True
            await m.migrate_to_fd(vm_fd, ignore_shared=mapped)
            if mapped:
                assert spec.memory_file is not None
                p = await trio.run_process(
                    ["cp", "--sparse=always", str(spec.memory_file), str(snap_dir / "memory")],
                    capture_stderr=True,
                    check=False,
                )
                if p.returncode != 0:
                    raise CheckpointError(f"copying guest memory failed: {p.stderr.decode(errors='replace')[:200]}")
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await m.qmp_execute("cont")
                except MachineError as exc:
                    log.warning("%s: cont after checkpoint failed: %s", m.name, exc)
                    raise
        paused = time.monotonic() - t0
    except BaseException:
        if not frozen_done:
            with trio.CancelScope(shield=True), contextlib.suppress(MachineError):
                if node_added:
                    await m.qmp_execute("blockdev-del", {"node-name": node})
                if fdset_added:
                    await m.qmp_execute("remove-fd", {"fdset-id": fdset})
            nxt.unlink(missing_ok=True)
        raise
    finally:
        if vm_fd >= 0:
            os.close(vm_fd)
    files = ["vmstate", "disk.qcow2", *(["memory"] if mapped else [])]
    await trio.to_thread.run_sync(_finish, snap_dir, files, user, spec.kernel, spec.initrd)
    sizes = {f: allocated(snap_dir / f) for f in files}
    mem_stat = _stat_key(snap_dir / "memory") if mapped else []
    machine = {
        "append": spec.append,
        "memory_mib": spec.memory_mib,
        "cpus": spec.cpus,
        "accel": spec.accel,
        "machine": spec.machine,
    }
    return Checkpoint(MAPPED if mapped else STREAMED, paused, sizes, mem_stat, machine)


async def still_running(guest: Guest) -> bool:
    """After a failed checkpoint: is the guest running again (not left paused)?"""
    if guest.machine.exited:
        return False
    try:
        if await guest.machine.status() == "running":
            return True
        await guest.machine.qmp_execute("cont")
        return await guest.machine.status() == "running"
    except MachineError:
        return False


def _finish(snap_dir: Path, files: list[str], user: QemuUser | None, kernel: Path, initrd: Path) -> None:
    for name in files:
        fd = os.open(snap_dir / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if user is not None and (snap_dir / "memory").exists():
        # QEMU 7.2 maps a read-only file read-only (guest RAM must be writable), so
        # the restores' QEMU user opens it read-write; it maps it MAP_PRIVATE and never
        # writes it, and the recorded (size, mtime) catches a file written since
        os.chown(snap_dir / "memory", user.uid, user.gid)
    for src, name in ((kernel, "kernel"), (initrd, "initrd")):
        try:
            os.link(src, snap_dir / name)
        except OSError:
            shutil.copy2(src, snap_dir / name)


def memory_for_restore(snap_dir: Path, run_dir: Path, user: QemuUser | None) -> Path:
    """The snapshot's RAM file as a path QEMU's user can open: the file itself when
    its directory is reachable, else a hard link in the run dir (removed with it)."""
    mem = snap_dir / "memory"
    if user is None or unsearchable_parent(mem) is None:
        return mem
    link = run_dir / "memory"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        os.link(mem, link)
    except OSError as exc:
        raise ApiError(
            FAILED_PRECONDITION,
            f"QEMU's user {user.name if user else ''!r} cannot reach {mem} (a parent is not o+x) and it cannot be "
            f"linked into {run_dir}: {exc.strerror}; make the state directory's parents searchable",
        ) from None
    return link


def rfc3339(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class SnapshotStore:
    """The snapshots of one supervisor: records (SQLite) and directories
    (``<state>/snapshots/<uid>``). Owned by the registry, which checks who depends
    on a snapshot before :meth:`delete`."""

    def __init__(self, root: Path, store: Store, user: QemuUser | None) -> None:
        self.root = root
        self.store = store
        self.user = user
        self.snapshots: dict[str, SnapshotRecord] = {}
        self.pending: set[Path] = set()  # directories of checkpoints in progress: not garbage

    def load(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)  # restores' QEMU reaches <uid>/memory; lists nothing
        for rec in self.store.snapshots():
            self.snapshots[rec.id] = rec

    def new_dir(self) -> tuple[str, Path]:
        uid = os.urandom(8).hex()
        d = self.root / uid
        d.mkdir(mode=0o711)
        self.pending.add(d.resolve())
        return uid, d

    def settle(self, d: Path) -> None:
        """The checkpoint writing ``d`` is over (recorded or failed)."""
        self.pending.discard(d.resolve())

    def new_id(self) -> str:
        while True:
            sid = "snap-" + os.urandom(6).hex()
            if sid not in self.snapshots:
                return sid

    def add(self, rec: SnapshotRecord) -> None:
        self.store.insert_snapshot(rec)
        self.snapshots[rec.id] = rec

    def get(self, ref: str) -> SnapshotRecord:
        """By id, else by name when exactly one snapshot has it."""
        if not ref:
            raise ApiError(INVALID_ARGUMENT, "snapshot_id is required")
        rec = self.snapshots.get(ref)
        if rec is not None and not _hidden(rec):
            return rec
        named = [r for r in self.snapshots.values() if r.name == ref and not _hidden(r)]
        if len(named) == 1:
            return named[0]
        if len(named) > 1:
            raise ApiError(INVALID_ARGUMENT, f"{len(named)} snapshots are named {ref!r}: use an id")
        raise ApiError(NOT_FOUND, f"no snapshot {ref!r}")

    def select(self, sandbox_id: str = "", labels: dict[str, str] | None = None) -> list[SnapshotRecord]:
        labels = labels or {}
        return [
            r
            for r in sorted(self.snapshots.values(), key=lambda r: r.created_ns)
            if (not sandbox_id or r.sandbox_id == sandbox_id) and all(r.labels.get(k) == v for k, v in labels.items())
        ]

    def disk(self, rec: SnapshotRecord) -> Path:
        return Path(rec.dir) / "disk.qcow2"

    def check_memory(self, rec: SnapshotRecord) -> None:
        if rec.memory != MAPPED:
            return
        mem = Path(rec.dir) / "memory"
        try:
            key = _stat_key(mem)
        except OSError as exc:
            raise ApiError(FAILED_PRECONDITION, f"snapshot {rec.id}: memory file unreadable: {exc.strerror}") from None
        if key != rec.memory_stat:
            raise ApiError(
                FAILED_PRECONDITION, f"snapshot {rec.id}: its memory file was changed after the checkpoint; delete it"
            )

    def dependents(self, rec: SnapshotRecord, disks: Iterable[tuple[str, Path]]) -> list[str]:
        """Who needs this snapshot's disk: ``disks`` are (what, overlay) of the live
        sandboxes; other snapshots' disks are checked here."""
        mine = self.disk(rec).resolve()
        out: list[str] = []
        others = [(f"snapshot {r.id}", self.disk(r)) for r in self.snapshots.values() if r.id != rec.id]
        for what, top in [*disks, *others]:
            try:
                if mine in (p.resolve() for p in backing_chain(top)):
                    out.append(what)
            except (OSError, ValueError, MachineError):
                continue
        return out

    def delete(self, rec: SnapshotRecord) -> None:
        self.store.delete_snapshot(rec.uid)
        self.snapshots.pop(rec.id, None)
        shutil.rmtree(rec.dir, ignore_errors=True)

    def collect(self, in_use: Callable[[], set[Path]]) -> int:
        """Remove snapshot directories without a record that no disk chain uses (what
        a failed checkpoint or a crash left behind)."""
        known = {Path(r.dir).resolve() for r in self.snapshots.values()} | self.pending
        used = {p.resolve().parent for p in in_use()}
        n = 0
        for d in self.root.iterdir():
            if d.is_dir() and d.resolve() not in known and d.resolve() not in used:
                shutil.rmtree(d, ignore_errors=True)
                n += 1
        return n


def _hidden(rec: SnapshotRecord) -> bool:
    """Boot templates are the supervisor's own (labels under the reserved prefix)."""
    return any(k.startswith("sandvisor.") for k in rec.labels)


def summary_fields(rec: SnapshotRecord) -> dict[str, Any]:
    return {
        "id": rec.id,
        "sandbox_id": rec.sandbox_id,
        "name": rec.name,
        "labels": dict(rec.labels),
        "snapshot_dir": rec.dir,
        "created_at": rfc3339(rec.created_ns),
        "size_bytes": sum(rec.sizes.values()),
        "memory": rec.memory,
        "memory_mib": int(rec.machine.get("memory_mib", 0)),
    }
