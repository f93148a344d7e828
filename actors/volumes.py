"""Named volumes: persistent ext4 disks that outlive the sandboxes using them.

:class:`Volumes` (owned by the registry) is the only code that makes or removes a
volume's image (``<state>/volumes/<uid>.ext4``: the path holds the record's uid, never
the caller's name) and its record (the store's ``volumes`` table). It also knows who
uses each one: a sandbox's life *claims* its configuration's volumes before QEMU is
launched and releases them when the life ends (adopted lives claim again at a
supervisor's start). A volume is claimed read-write by one live sandbox at a time, or
read-only by many; anything else is FAILED_PRECONDITION, naming the user::

    Create{volumes: [{name, path, read_only}]}
      registry.create --check--> Volumes (NotFound / FailedPrecondition, nothing made)
      Life._launch   --claim---> Volumes --> machine.Volume(fd by path, serial vN)
         QEMU: virtio-blk per volume (the supervisor opens the image, QEMU gets the fd)
         guestd: mount serial:vN at path (ro: read-only device and mount)
      end of life    --release-> Volumes

Create order (crash-safe): mkfs into ``<uid>.ext4.part``, rename, record, flush;
removal: record first, flush, then the file. At start, files no record names are
removed (:meth:`Volumes.sweep`).

Volume images: raw ext4 files made and checked on the host, never mounted there.

A volume is a sparse file with an ext4 file system, made by ``mkfs.ext4`` (no loop
device, no mount: a file system the host never mounts cannot attack the host's
kernel), attached to a VM as virtio-blk (:class:`actors.machines.qemuspec.Volume`) and mounted
in the guest by guestd (``GuestChannel.mount``). Only the blocks the guest writes
take disk space: ``lazy_itable_init`` and ``lazy_journal_init`` leave the inode
tables and the journal unwritten at creation (the guest kernel zeroes the inode
tables in the background after the first mount).

A volume whose VM was killed (not powered off through guestd, which unmounts it)
has a journal that needs recovery: ext4 replays it on a read-write mount, but a
read-only device cannot be mounted at all then ("write access unavailable").
:func:`check_volume_image` (``e2fsck -p``) replays and checks it on the host; do it
before attaching a volume read-only, or after a crash.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import attrs
import trio

from actors.cells.toolcell import ToolCells, fsck_in_cell
from actors.durable import fsync_dir, fsync_path
from actors.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from actors.machines.qemuspec import Volume
from actors.model import VolumeMount, VolumeRecord
from actors.principals import LEGACY_OWNER, SYSTEM
from actors.store import Store
from images.tools import ToolError, ToolResult

MIN_VOLUME = 8 << 20  # ext4 with a journal needs a few MiB; below this mkfs refuses or wastes most of it
BLOCK = 4096


class VolumeError(Exception):
    """A volume image could not be made or is damaged; the message says why."""


async def _run(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    try:
        return await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    except FileNotFoundError:
        raise VolumeError(f"{argv[0]} is not installed (e2fsprogs)") from None


async def create_volume_image(path: Path, size: int, *, label: str = "", owner: tuple[int, int] = (0, 0)) -> int:
    """Make ``path`` (which must not exist) a sparse ``size``-byte ext4 image whose root
    directory belongs to ``owner`` (uid, gid in the guest). Returns the size used (a
    multiple of 4 KiB). Nothing is left behind on failure."""
    size = -(-size // BLOCK) * BLOCK
    if size < MIN_VOLUME:
        raise VolumeError(f"a volume needs at least {MIN_VOLUME >> 20} MiB")
    if len(label) > 16:
        raise VolumeError("an ext4 label has at most 16 bytes")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise VolumeError(f"cannot create {path}: {exc.strerror}") from None
    try:
        try:
            os.ftruncate(fd, size)  # sparse: no block is written
        finally:
            os.close(fd)
        argv = ["mkfs.ext4", "-q", "-F", "-b", str(BLOCK), "-m", "0"]
        if label:
            argv += ["-L", label]
        argv += ["-E", f"lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner={owner[0]}:{owner[1]}", str(path)]
        p = await _run(argv)
        if p.returncode != 0:
            raise VolumeError(f"mkfs.ext4 failed: {p.stderr.decode(errors='replace').strip()[-300:]}")
    except BaseException:
        with trio.CancelScope(shield=True):
            path.unlink(missing_ok=True)
        raise
    return size


async def check_volume_image(path: Path, tools: ToolCells | None = None) -> bool:
    """``e2fsck -p``: replay the journal and fix what is safe to fix. True when the file
    system was clean, False when it was repaired; VolumeError when it needs a human.
    ``tools``: in a cell of its own (the image is the guest's: hostile input), the
    image by descriptor (actors/cells/toolcell.py); None (no jail): as the supervisor."""
    if tools is None:
        p: subprocess.CompletedProcess[bytes] | ToolResult = await _run(["e2fsck", "-p", str(path)])
    else:
        try:
            p = await fsck_in_cell(tools, path)
        except ToolError as exc:
            raise VolumeError(f"e2fsck could not run in its cell: {exc}") from None
    if p.returncode == 0:
        return True
    if p.returncode in (1, 2):
        return False
    out = (p.stdout + p.stderr).decode(errors="replace").strip()
    raise VolumeError(f"e2fsck found damage it cannot fix safely ({p.returncode}): {out[-300:]}")


# --- named volumes -------------------------------------------------------------------
NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
MAX_VOLUME = 1 << 40  # 1 TiB: sparse, but a typo of a unit should not make a 1 PiB file
DEFAULT_SIZE = 256 << 20
CHECK_TIMEOUT = 120.0


def check_volume_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise InvalidArgument(f"volume name {name[:80]!r}: 1-63 of [a-z0-9_.-], starting with a letter or digit")


@attrs.frozen
class Claim:
    sandbox_id: str
    read_only: bool


class Volumes:
    """The named volumes of one supervisor: records, image files, claims."""

    def __init__(self, root: Path, store: Store, *, max_size: int = 0) -> None:
        self.root = root
        self.max_size = max_size  # the per-sandbox disk cap (--max-sandbox-disk; 0: none)
        self._store = store
        self.records: dict[str, VolumeRecord] = {}
        self.claims: dict[str, dict[str, Claim]] = {}  # name -> sandbox uid -> claim
        self._busy: set[str] = set()  # names being created or removed
        self.tools: ToolCells | None = None  # e2fsck runs in a cell (root, jail on: Registry sets it)

    def load(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)  # QEMU gets volumes by descriptor, never by path
        self.records = {r.name: r for r in self._store.volumes()}

    def sweep(self) -> list[Path]:
        """Remove image files no record names (a crash mid-create or mid-remove)."""
        keep = {f"{r.uid}.ext4" for r in self.records.values()}
        gone = []
        for p in self.root.iterdir():
            if p.name not in keep:
                p.unlink(missing_ok=True)
                gone.append(p)
        return gone

    def path(self, rec: VolumeRecord) -> Path:
        return self.root / f"{rec.uid}.ext4"

    def get(self, name: str) -> VolumeRecord:
        rec = self.records.get(name)
        if rec is None:
            raise NotFound(f"volume {name!r} does not exist")
        return rec

    def users(self, name: str) -> list[str]:
        return sorted(c.sandbox_id for c in self.claims.get(name, {}).values())

    async def create(
        self, name: str, size: int = DEFAULT_SIZE, labels: dict[str, str] | None = None, owner: str = LEGACY_OWNER
    ) -> VolumeRecord:
        check_volume_name(name)
        if not MIN_VOLUME <= size <= MAX_VOLUME:
            raise InvalidArgument(f"volume size must be {MIN_VOLUME >> 20} MiB to {MAX_VOLUME >> 30} GiB")
        if self.max_size and size > self.max_size:
            raise ResourceExhausted(
                f"a volume of {-(-size // (1 << 20))} MiB is over the {self.max_size >> 20} MiB one sandbox's "
                "disks may take (--max-sandbox-disk)"
            )
        if name in self.records or name in self._busy:
            raise AlreadyExists(f"volume {name!r} exists")
        self._busy.add(name)
        try:
            uid = str(uuid.uuid4())
            final = self.root / f"{uid}.ext4"
            part = final.with_name(final.name + ".part")
            try:
                used = await create_volume_image(part, size, label=name[:16])
            except VolumeError as exc:
                raise ResourceExhausted(str(exc)) if "No space" in str(exc) else FailedPrecondition(str(exc)) from None
            try:
                await trio.to_thread.run_sync(fsync_path, part)  # mkfs's blocks, then the name, then the record
                part.rename(final)
                fsync_dir(self.root)
                rec = VolumeRecord(name, uid, used, int(time.time()), dict(labels or {}), owner=owner)
                self._store.put_volume(rec)
                await self._store.flush()
            except BaseException:
                with trio.CancelScope(shield=True):
                    self._store.delete_volume(name)
                    part.unlink(missing_ok=True)
                    final.unlink(missing_ok=True)
                raise
            self.records[name] = rec
            return rec
        finally:
            self._busy.discard(name)

    async def remove(self, name: str) -> None:
        rec = self.get(name)
        if name in self._busy:
            raise FailedPrecondition(f"volume {name!r} is being created or removed")
        users = self.users(name)
        if users:
            raise FailedPrecondition(f"volume {name!r} is in use by {', '.join(users)}")
        self._busy.add(name)
        try:
            del self.records[name]
            self._store.delete_volume(name)
            await self._store.flush()  # the record goes first: a crash leaves a file (swept), not a record without one
            self.path(rec).unlink(missing_ok=True)
        finally:
            self._busy.discard(name)

    def check(self, mounts: Iterable[VolumeMount], sandbox_uid: str = "", what: str = "") -> None:
        """Raise what :meth:`claim` would raise, claiming nothing."""
        for m in mounts:
            if m.name in self._busy or m.name not in self.records:
                msg = f"{what}volume {m.name!r} does not exist"
                raise FailedPrecondition(msg) if what else NotFound(msg)
            for uid, c in self.claims.get(m.name, {}).items():
                if uid == sandbox_uid:
                    continue
                if not (m.read_only and c.read_only):
                    mode = "read-only" if c.read_only else "read-write"
                    raise FailedPrecondition(
                        f"{what}volume {m.name!r} is mounted {mode} by sandbox {c.sandbox_id}: "
                        "read-write in one live sandbox at a time, read-only in many"
                    )

    def check_owner(self, mounts: Iterable[VolumeMount], owner: str, what: str = "") -> None:
        """Refuse a Start or a restore that would mount a volume ``owner`` does not own.
        Mounts name volumes, and a stopped sandbox or a snapshot holds no claim: its
        volume can be deleted and its name taken by another principal's new one, which
        would then be mounted. The admin owners the supervisor knows by name (the
        legacy owner, the supervisor's own) are excepted; another admin's sandbox
        mounting another principal's volume is refused too (its Create was checked
        against the caller, who is not known here)."""
        if owner in (LEGACY_OWNER, SYSTEM.name):
            return
        for m in mounts:
            rec = self.records.get(m.name)
            if rec is not None and rec.owner != owner:
                raise FailedPrecondition(f"{what}volume {m.name!r} is no longer this sandbox's owner's ({owner})")

    def generations(self, mounts: Iterable[VolumeMount]) -> dict[str, int]:
        """The generation of each mounted volume (a checkpoint records them)."""
        return {m.name: self.records[m.name].generation for m in mounts if m.name in self.records}

    def check_unchanged(self, mounts: Iterable[VolumeMount], taken: dict[str, int], what: str) -> None:
        """Refuse a restore whose volumes another life mounted read-write since the
        snapshot was taken: the restored guest's page cache and ext4 state describe the
        volume as it was, and writing over newer contents would corrupt it. Every new
        read-write life (a Start, a restore, another sandbox) starts a generation, so a
        snapshot with a read-write volume restores until someone mounts it read-write
        again. Not counted: the origin's own writes after the checkpoint (its life
        began before). Snapshots older than generations record none: not checked."""
        for m in mounts:
            rec = self.records.get(m.name)
            if rec is None or m.name not in taken:
                continue
            if rec.generation != taken[m.name]:
                raise FailedPrecondition(
                    f"{what} cannot be restored: volume {m.name!r} was mounted read-write by another "
                    "sandbox since it was taken (volume contents are not part of a snapshot)"
                )

    def claim(
        self, sandbox_uid: str, sandbox_id: str, mounts: tuple[VolumeMount, ...], *, adopted: bool = False
    ) -> tuple[Volume, ...]:
        """Claim ``mounts`` for one life (all or none); the machine's volumes, in order.
        A new life's read-write claim starts a new generation of the volume (stored
        with the life's next flush, before it is ready); an adopted life goes on in its own."""
        self.check(mounts, sandbox_uid)
        out = []
        for i, m in enumerate(mounts):
            self.claims.setdefault(m.name, {})[sandbox_uid] = Claim(sandbox_id, m.read_only)
            if not m.read_only and not adopted:
                rec = attrs.evolve(self.records[m.name], generation=self.records[m.name].generation + 1)
                self.records[m.name] = rec
                self._store.put_volume(rec)
            out.append(Volume(self.path(self.records[m.name]), read_only=m.read_only, serial=f"v{i}"))
        return tuple(out)

    async def release_checked(self, sandbox_uid: str) -> list[str]:
        """End a life's claims (its QEMU reaped). A volume it held read-write is checked
        first, still claimed meanwhile: ``e2fsck -p`` replays the journal a killed VM left
        (a read-only device cannot be mounted until then: "Read-only file system") and
        returns at once on a clean one. What it did or found, as log lines."""
        notes = []
        for name, claims in list(self.claims.items()):
            c = claims.get(sandbox_uid)
            if c is None or c.read_only or name not in self.records:
                continue
            with trio.move_on_after(CHECK_TIMEOUT) as waited:
                try:
                    if not await check_volume_image(self.path(self.records[name]), self.tools):
                        notes.append(f"volume {name}: its journal was replayed (e2fsck)")
                except VolumeError as exc:
                    notes.append(f"volume {name}: {exc}")
            if waited.cancelled_caught:
                notes.append(f"volume {name}: e2fsck took over {CHECK_TIMEOUT:g}s; left as it is")
        self.release(sandbox_uid)
        return notes

    def release(self, sandbox_uid: str) -> None:
        for name in list(self.claims):
            self.claims[name].pop(sandbox_uid, None)
            if not self.claims[name]:
                del self.claims[name]
