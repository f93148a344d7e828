"""A snapshot's side of a diff, read on the host: the fork point (or a named checkpoint)
is its frozen disk, a qcow2 layer on a chain, and no guest runs on it to ask.

The supervisor never parses those bytes itself (the parent's guest wrote the file
system, its QEMU the qcow2; both are hostile). It holds the disk, then hands it to a
tool cell (actors/cells/toolcell.py) that does the reading::

    hold(layers)                         every layer opened read-only, in one step of the
      |                                  Trio thread (O_NOFOLLOW, a regular file): from
      |                                  here a retired snapshot's files going (retire_forks,
      |                                  the snapshot collector) cannot touch what is read
      v
    a staging dir <state>/treediff/.stage-PID-*: layers only root may read (a snapshot's
      |                                  disk.qcow2, 0600) copied there from the held
      |                                  descriptor (sparse; copying is all it does), the
      |                                  others (the image's 0444 rootfs) passed by fd
      v
    one tool cell, root of the tools' user namespace (CAP_DAC_READ_SEARCH there, nothing
      |  else; no network; /usr read-only, the staging dir):
      |    qemu-img convert  the chain, as the supervisor spells it (a json: spec naming each
      |                      layer: a backing name in a header opens nothing) -> disk.raw
      |    debugfs rdump     PATH out of the ext4 (no kernel mount: e2fsprogs' reader);
      |                      the mode bits it drops (set-ID, sticky) from its ``ls -p``
      |    tar               that copy as a pax archive (or, for one file, its first MiB)
      v
    treediff.listing      the archive parsed with guestd's hostile-stream tar reader, with
                          the bounds a guest's stream has: the same shape a guest's side has

A sandbox's own side comes from its guest, as ever: neither speaks for the other, and a
guest that lies about its tree cannot change what the snapshot holds. Without a jail
(a non-root supervisor) the same script runs as the supervisor's own uid; as root
without one, the read is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import trio

from actors.cells.toolcell import make_stage
from actors.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from actors.registry import Registry
from actors.sandboxes.sandbox import Sandbox
from actors.settings import Settings
from actors.store import SnapshotRecord
from actors.treediff import MAX_HASHED, Change, Entry, Limits, diff_sides, guest_side, listing
from images.tools import READ_CAPS, ToolError, bind

STAGE_DIR = "treediff"  # beside <state>/sandboxes
CONTENT_CAP = 1 << 20  # bytes of one file's content given back (``--content``)
_CHUNK = 1 << 20
_QCOW2_MAGIC = b"QFI\xfb"
# The cell's work, in the staging dir $W: $1 the chain (json:), $2 debugfs's request,
# $3 where the dump is (relative to $W), $4 :data:`_MODES`, $5 the path dumped; $MODE what
# to make of the dump ("tree": a pax archive, "file": its first $CAP bytes). Its word in
# ``result``: ok, missing, notdir, notfile.
_SCRIPT = r"""
set -eu
cd "$W"
qemu-img convert -q -O raw "$1" disk.raw
ulimit -f "$FSIZE"
mkdir out whole
debugfs -R "$2" disk.raw >/dev/null 2>debugfs.err || true
t="$3"
[ -e "$t" ] || [ -L "$t" ] || { echo missing > result; exit 0; }
[ "$MODE" = file ] || [ ! -d "$t" ] || python3 -I -S -c "$4" "$t" "$5" disk.raw
rm -f disk.raw
if [ "$MODE" = file ]; then
  [ -f "$t" ] && [ ! -L "$t" ] || { echo notfile > result; exit 0; }
  head -c "$CAP" "$t" > content
else
  [ -d "$t" ] && [ ! -L "$t" ] || { echo notdir > result; exit 0; }
  tar -C "$t" --format=pax --numeric-owner -cf tree.tar .
fi
echo ok > result
"""


# rdump keeps a file's permission bits only: the set-user-ID, set-group-ID and sticky
# bits are put back from debugfs's own listing (``ls -p``, every directory of the dump),
# run in the cell. argv: the dump, the path it is of, the raw disk.
_MODES = r"""
import os, subprocess, sys
dump, src, raw = sys.argv[1:4]
dirs = {}
for d, _, _ in os.walk(dump):
    rel = os.path.relpath(d, dump)
    if '"' not in rel and "\n" not in rel:
        dirs[src if rel == "." else src.rstrip("/") + "/" + rel] = rel
cmds = "".join('ls -p "%s"\n' % p for p in dirs)
out = subprocess.run(["debugfs", "-f", "-", raw], input=cmds.encode(), capture_output=True).stdout
here = None
for line in out.decode("utf-8", "surrogateescape").split("\n"):
    if line.startswith('debugfs: ls -p "') and line.endswith('"'):
        here = dirs.get(line[len('debugfs: ls -p "'):-1])
        continue
    f = line.split("/")
    if here is None or len(f) != 8 or f[0] or f[5] in ("", ".", ".."):
        continue
    try:
        mode = int(f[2], 8)
    except ValueError:
        continue
    if mode & 0o7000 and mode & 0o170000 in (0o100000, 0o040000):
        p = os.path.join(dump, here, f[5])
        try:
            st = os.lstat(p)
            if st.st_mode & 0o170000 == mode & 0o170000:
                os.chmod(p, mode & 0o7777)
        except OSError:
            pass
"""


@attrs.frozen
class _Layer:
    fd: int
    fmt: str  # qcow2 or raw (from its magic: four bytes, not a parse)
    world_readable: bool
    size: int


class HeldDisk:
    """A snapshot's disk chain held open (top first): what the diff reads, whatever
    happens to the snapshot's files meanwhile. Close it (a context manager)."""

    def __init__(self, layers: Sequence[Path]) -> None:
        self.layers: list[_Layer] = []
        self.virtual_size = 0
        try:
            for p in layers:
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    os.close(fd)
                    raise FailedPrecondition(f"the snapshot's disk layer {p} is not a regular file")
                fmt = "qcow2" if os.pread(fd, 4, 0) == _QCOW2_MAGIC else "raw"
                self.layers.append(_Layer(fd, fmt, bool(st.st_mode & stat.S_IROTH), st.st_size))
        except FileNotFoundError as exc:
            self.close()
            raise FailedPrecondition(f"the snapshot's disk is gone ({exc.filename})") from None
        except BaseException:
            self.close()
            raise
        if not self.layers:
            raise FailedPrecondition("the snapshot has no disk")
        top = self.layers[0]
        head = os.pread(top.fd, 32, 0)
        # (a bound for the raw copy's size only: a header that lies makes that copy fail)
        self.virtual_size = (
            struct.unpack_from(">Q", head, 24)[0] if top.fmt == "qcow2" and len(head) == 32 else top.size
        )

    def close(self) -> None:
        for layer in self.layers:
            with contextlib.suppress(OSError):
                os.close(layer.fd)
        self.layers = []

    def __enter__(self) -> HeldDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hold(layers: Sequence[Path]) -> HeldDisk:
    """The chain ``layers`` (a snapshot's ``layers``: its disk, then those below) held
    open now, in this step of the Trio thread (no await between a record's lookup and
    this: the files cannot go in between)."""
    return HeldDisk(layers)


def chain_spec(files: Sequence[tuple[str, str]]) -> str:
    """qemu-img's ``json:`` spec of a chain, top first (``files``: (format, file name)):
    each layer's backing is the next one, the bottom has none. No name in any header is
    followed."""
    node: dict[str, object] | None = None
    for fmt, name in reversed(files):
        layer: dict[str, object] = {
            "driver": fmt,
            "file": {"driver": "file", "filename": name, "locking": "off"},
        }
        if fmt == "qcow2":
            layer["backing"] = node
        elif node is not None:
            raise FailedPrecondition("a raw layer with layers below it")
        node = layer
    return "json:" + json.dumps(node, separators=(",", ":"))


def check_path(path: str) -> str:
    """An absolute path debugfs can be told (no quote, newline or NUL), without a
    trailing slash ("/" stays)."""
    if not path.startswith("/"):
        raise InvalidArgument(f"path must be absolute: {path[:200]!r}")
    if any(c in path for c in '"\n\r\0\\'):
        raise InvalidArgument(
            f"a path with a quote, backslash or newline cannot be read from a snapshot: {path[:200]!r}"
        )
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        raise InvalidArgument(f"path must not hold '..': {path[:200]!r}")
    return "/" + "/".join(parts)


def _copy_sparse(fd: int, dst: Path, size: int) -> None:
    """The held layer's bytes into ``dst`` (holes stay holes)."""
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        pos = 0
        while pos < size:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # (ENXIO: only a hole is left)
                break
            try:
                hole = os.lseek(fd, data, os.SEEK_HOLE)
            except OSError:
                hole = size
            off = data
            while off < hole:
                piece = os.pread(fd, min(_CHUNK, hole - off), off)
                if not piece:
                    break
                os.pwrite(out, piece, off)
                off += len(piece)
            pos = hole
        os.ftruncate(out, size)
    finally:
        os.close(out)


def _argv(files: Sequence[tuple[str, str]], path: str, mode: str, work: Path) -> list[str]:
    """The cell's command: ``sh -c`` on :data:`_SCRIPT`, its inputs as arguments and
    environment (no caller's text is ever part of the script)."""
    src = check_path(path)
    # (rdump of "/" dumps the root's entries into the directory named: "whole"; any other
    # path's dump is its last component, under "out")
    request = f'rdump "{src}" out' if src != "/" else "rdump / whole"
    name = "out/" + src.rsplit("/", 1)[1] if src != "/" else "whole"
    env = [f"W={work}", f"MODE={mode}", f"CAP={CONTENT_CAP}", f"FSIZE={(MAX_HASHED >> 9) + 2048}"]
    return ["env", *env, "sh", "-c", _SCRIPT, "sh", chain_spec(files), request, name, _MODES, src]


async def _run_cell(settings: Settings, disk: HeldDisk, path: str, mode: str, work: Path) -> str:
    """The cell's run on ``disk`` into ``work``: its result word (ok, missing, notdir,
    notfile)."""
    tools = settings.cells.tools if settings.cells is not None else None
    root = os.geteuid() == 0
    if tools is None and root:
        raise FailedPrecondition("a snapshot's disk is read in a tool cell: this supervisor runs without its jail")
    owner = (tools.shifted(0), tools.shifted(0)) if tools is not None else (os.geteuid(), os.getegid())
    files: list[tuple[str, str]] = []
    fds: list[int] = []
    for i, layer in enumerate(disk.layers):
        if layer.world_readable or not root:
            files.append((layer.fmt, f"/proc/self/fd/{layer.fd}"))
            fds.append(layer.fd)
        else:  # (0600, root's: the cell's ids may not reopen it; a copy of its bytes is theirs)
            copy = work / f"layer{i}"
            await trio.to_thread.run_sync(_copy_sparse, layer.fd, copy, layer.size)
            os.chown(copy, *owner)
            files.append((layer.fmt, str(copy)))
    os.chown(work, *owner)
    argv = _argv(files, path, mode, work)
    # no file it writes grows past the disk's virtual size (the raw copy) or a bound
    fsize = max(disk.virtual_size, MAX_HASHED) + (1 << 20)
    if tools is None:
        p = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False, pass_fds=fds)
        rc, err = p.returncode, p.stderr
    else:
        try:
            res = await tools.run(
                argv, identity=None, keep_caps=READ_CAPS, binds=(bind(work, writable=True),), fds=fds, fsize=fsize
            )
        except ToolError as exc:
            raise FailedPrecondition(f"reading the snapshot's disk: {exc}") from None
        if res.oom_killed:
            raise ResourceExhausted("reading the snapshot's disk: its cell met its memory limit")
        rc, err = res.returncode, res.stderr
    if rc != 0:
        text = err.decode(errors="replace").strip()[-300:]
        raise FailedPrecondition(f"reading the snapshot's disk failed: {text}")
    try:
        fd = _open_result(work, "result")
        try:
            return os.read(fd, 16).decode(errors="replace").strip()
        finally:
            os.close(fd)
    except OSError:
        return ""


@contextlib.contextmanager
def _staging(settings: Settings) -> Iterator[Path]:
    base = settings.sandboxes_dir.parent / STAGE_DIR
    base.mkdir(mode=0o711, exist_ok=True)
    stage = make_stage(base)
    try:
        yield stage / "work"
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _open_result(work: Path, name: str) -> int:
    fd = os.open(work / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidArgument(f"the snapshot's {name} is not a file")
    return fd


async def tree(settings: Settings, disk: HeldDisk, path: str, limits: Limits | None = None) -> dict[str, Entry]:
    """The tree under ``path`` on the held disk, in treediff's shape (path -> Entry)."""
    with _staging(settings) as work:
        try:
            result = await _run_cell(settings, disk, path, "tree", work)
            if result == "missing":
                raise NotFound(f"{path}: no such directory at the snapshot")
            if result == "notdir":
                raise InvalidArgument(f"{path}: not a directory at the snapshot")
            if result != "ok":
                raise FailedPrecondition(f"reading the snapshot's disk: no result ({result[:40]!r})")
            fd = _open_result(work, "tree.tar")
            try:
                return await trio.to_thread.run_sync(lambda: listing(lambda n: os.read(fd, n), limits or Limits()))
            finally:
                os.close(fd)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, work, True)


async def content(settings: Settings, disk: HeldDisk, path: str) -> bytes | None:
    """The first :data:`CONTENT_CAP` bytes of the file ``path`` on the held disk; None:
    no such file there."""
    with _staging(settings) as work:
        try:
            result = await _run_cell(settings, disk, path, "file", work)
            if result in ("missing", "notfile"):
                return None
            if result != "ok":
                raise FailedPrecondition(f"reading the snapshot's disk: no result ({result[:40]!r})")
            fd = _open_result(work, "content")
            try:
                return os.read(fd, CONTENT_CAP + 1)[:CONTENT_CAP]
            finally:
                os.close(fd)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, work, True)


# -- a sandbox against its fork point, or a snapshot ------------------------------------------


def fork_point_of(reg: Registry, sb: Sandbox) -> SnapshotRecord:
    """The snapshot ``sb`` was forked from (hidden; held while ``sb`` names it)."""
    lin = sb.record.lineage
    if lin is None:
        raise FailedPrecondition(
            f"sandbox {sb.id} was not forked, so it has no fork point: compare it with another sandbox "
            "or a snapshot of its own"
        )
    snap = reg.snapshots.snapshots.get(lin.snapshot_id)
    if snap is None:
        raise FailedPrecondition(f"sandbox {sb.id}'s fork point (snapshot {lin.snapshot_id}) is gone")
    return snap


async def diff_with_snapshot(
    reg: Registry, sb: Sandbox, snap: SnapshotRecord, path: str, limits: Limits | None = None
) -> tuple[list[Change], int, int]:
    """What differs from the snapshot's disk (a) to the sandbox's tree (b) under ``path``.
    The disk is held from this call's first step (call it in the step that looked the
    snapshot up), the sandbox's guest asked only about its own tree. Refused when the state
    dir is past its disk bounds (the reading stages copies there)."""
    check_path(path)
    reg.admission.check_disk()
    with hold(snap.layers) as disk:

        async def snapshot_side(p: str, lim: Limits) -> dict[str, Entry]:
            return await tree(reg.settings, disk, p, lim)

        return await diff_sides(snapshot_side, guest_side(sb.read_tree), path, limits or Limits())


async def contents_with_snapshot(
    reg: Registry, sb: Sandbox, snap: SnapshotRecord, path: str
) -> tuple[bytes | None, bytes | None]:
    """The first :data:`CONTENT_CAP` bytes of the file ``path`` at the snapshot (a) and in
    the sandbox (b); None where there is no such file."""
    check_path(path)
    reg.admission.check_disk()
    with hold(snap.layers) as disk:
        got: dict[str, bytes | None] = {}

        async def at_snapshot() -> None:
            got["a"] = await content(reg.settings, disk, path)

        async def in_sandbox() -> None:
            got["b"] = await sandbox_head(sb, path)

        async with trio.open_nursery() as n:
            n.start_soon(at_snapshot)
            n.start_soon(in_sandbox)
        return got["a"], got["b"]


async def sandbox_head(sb: Sandbox, path: str) -> bytes | None:
    """The first :data:`CONTENT_CAP` bytes of ``path`` in the sandbox (its guest's
    answer); None: no such file there."""
    out = bytearray()
    try:
        async with sb.read_file(path) as f:
            async for chunk in f:
                out += chunk
                if len(out) >= CONTENT_CAP:
                    break
    except NotFound:
        return None
    return bytes(out[:CONTENT_CAP])


__all__ = [
    "CONTENT_CAP",
    "HeldDisk",
    "chain_spec",
    "check_path",
    "content",
    "contents_with_snapshot",
    "diff_with_snapshot",
    "fork_point_of",
    "hold",
    "sandbox_head",
    "tree",
]
