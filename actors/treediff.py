"""What a branch changed: two sandboxes' trees, compared on the host.

Each guest is asked only about its own tree: guestd packs the directory as a tar stream
(``read_tree``, the walk ``cp -r box:/dir`` uses), and the host parses that stream with
guestd's hostile-stream tar reader (``guestd.tarformat``: checksums, pax records, sizes
bounded), hashing each regular file's contents as they pass (SHA-256), keeping nothing
but one entry per path. Neither guest sees the other's listing or can speak for it: a
guest that lies can only lie about its own files. The two listings are compared here.

A guest's stream is hostile input: names are checked (relative, no ``..``, no empty
component, no NUL, at most :data:`MAX_DEPTH` deep), a name seen twice is refused, and
three bounds apply to each side: :data:`MAX_ENTRIES` entries, :data:`MAX_HASHED` bytes of
file contents hashed, and the tar stream's own cap. Past one, the diff fails with
RESOURCE_EXHAUSTED naming the bound; a malformed stream fails with INVALID_ARGUMENT.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager

import attrs
import trio

from actors.errors import DomainError, InvalidArgument, ResourceExhausted
from guestd import proto
from guestd.fsops import TreeError
from guestd.tarformat import Reader, SourceError, check_header, next_member

MAX_ENTRIES = 100_000  # entries of one side's tree
MAX_DEPTH = 64  # path components
MAX_HASHED = 1 << 30  # bytes of file contents hashed, per side
_HASH_PIECE = 1 << 20


@attrs.frozen
class Entry:
    """One path of a tree: ``kind`` file, dir, link (``digest``: its target) or hardlink
    (a file's second name: its first name's digest), ``size`` and ``mode`` (permission
    bits), ``digest`` the SHA-256 of a file's contents (hex)."""

    kind: str
    size: int
    mode: int
    digest: str = ""


@attrs.frozen
class Change:
    """``change`` added (only in b), removed (only in a) or modified (both, differing)."""

    path: str
    change: str
    a: Entry | None
    b: Entry | None


@attrs.frozen
class Limits:
    entries: int = MAX_ENTRIES
    depth: int = MAX_DEPTH
    hashed: int = MAX_HASHED


def _check_name(name: str, depth: int) -> str:
    """The path as the diff shows it ("." is the root); hostile names refused."""
    if name in ("", ".", "./"):
        return "."
    if name.startswith("./"):
        name = name[2:]
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in name:
        raise InvalidArgument(f"the guest's tree has a bad name: {name[:200]!r}")
    if len(parts) > depth:
        raise ResourceExhausted(f"the guest's tree is deeper than {depth} levels ({name[:200]!r})")
    return name


def listing(read: Callable[[int], bytes], limits: Limits = Limits()) -> dict[str, Entry]:
    """Parse one guest's tar stream (``read(n)``: up to n more bytes, b"" at the end)
    into path -> Entry, within ``limits``. Blocking: run it in a thread."""
    r = Reader(read)
    glob: dict[str, bytes] = {}
    out: dict[str, Entry] = {}
    hashed = 0
    try:
        while (m := next_member(r, glob)) is not None:
            check_header(m)
            name = _check_name(m.name, limits.depth)
            if name in out:
                raise InvalidArgument(f"the guest's tree names {name[:200]!r} twice")
            if len(out) >= limits.entries:
                raise ResourceExhausted(f"the tree has more than {limits.entries} entries")
            mode = m.mode & 0o7777
            if m.isreg():
                hashed += m.size
                if hashed > limits.hashed:
                    raise ResourceExhausted(f"the tree's files hold more than {limits.hashed} bytes to hash")
                h, left = hashlib.sha256(), m.size
                while left:
                    piece = r.take(min(left, _HASH_PIECE))
                    if not piece:
                        raise InvalidArgument(f"{name[:200]!r}: truncated tar stream")
                    h.update(piece)
                    left -= len(piece)
                r.skip(-m.size % 512)
                out[name] = Entry("file", m.size, mode, h.hexdigest())
            elif m.isdir():
                r.skip(m.size + (-m.size % 512))
                out[name] = Entry("dir", 0, mode)
            elif m.type == 0x32:  # "2": a symlink
                out[name] = Entry("link", len(m.linkname), mode, m.linkname[:4096])
            elif m.type == 0x31:  # "1": a hard link to an earlier file of this archive
                first = out.get(_check_name(m.linkname, limits.depth))
                if first is None or first.kind != "file":
                    raise InvalidArgument(f"{name[:200]!r}: a hard link to no file of the tree")
                out[name] = first
            else:
                raise InvalidArgument(f"{name[:200]!r}: an entry of type {chr(m.type)!r} in the guest's tree")
        r.drain()  # (the writer's padding: the stream is read to its end, within its cap)
    except TreeError as exc:
        cls = ResourceExhausted if exc.code == proto.E_TOO_LARGE else InvalidArgument
        raise cls(f"the guest's tree: {exc.message}") from None
    except SourceError as exc:
        raise exc.error from None
    return out


def compare(a: dict[str, Entry], b: dict[str, Entry]) -> list[Change]:
    """What differs from ``a`` to ``b``, by path (the root's own mode left out)."""
    out: list[Change] = []
    for path in sorted(a.keys() | b.keys()):
        x, y = a.get(path), b.get(path)
        if path == "." or x == y:
            continue
        kind = "added" if x is None else "removed" if y is None else "modified"
        out.append(Change(path, kind, x, y))
    return out


ReadTree = Callable[[str], AbstractAsyncContextManager[AsyncIterator[bytes]]]


async def tree_listing(read_tree: ReadTree, path: str, limits: Limits = Limits()) -> dict[str, Entry]:
    """One sandbox's tree at ``path`` (``read_tree``: the sandbox's, an async context of
    byte chunks), parsed in a worker thread as the chunks arrive."""
    async with read_tree(path) as tar:
        chunks = tar
        buf = bytearray()

        def read(n: int) -> bytes:
            nonlocal buf
            while not buf:
                try:
                    buf += trio.from_thread.run(chunks.__anext__)
                except StopAsyncIteration:
                    return b""
            out, buf = bytes(buf[:n]), buf[n:]
            return out

        return await trio.to_thread.run_sync(lambda: listing(read, limits), abandon_on_cancel=False)


Side = Callable[[str, Limits], Awaitable[dict[str, Entry]]]
"""One side of a diff: its listing of ``path`` within the limits (a guest's tree, or a
snapshot's disk read on the host: actors/forkpoint.py)."""


def guest_side(read_tree: ReadTree) -> Side:
    """A sandbox's side: its guest packs its own tree."""
    return lambda path, limits: tree_listing(read_tree, path, limits)


async def diff_sides(a: Side, b: Side, path: str, limits: Limits = Limits()) -> tuple[list[Change], int, int]:
    """Both sides fetched side by side, then compared: the changes, and the number of
    paths on each side."""
    got: dict[str, dict[str, Entry]] = {}
    failed: dict[str, DomainError] = {}

    async def one(key: str, side: Side) -> None:
        try:
            got[key] = await side(path, limits)
        except DomainError as exc:  # (one typed error for the caller, not a group of two)
            failed[key] = exc

    async with trio.open_nursery() as n:
        n.start_soon(one, "a", a)
        n.start_soon(one, "b", b)
    if failed:
        raise failed.get("a") or failed["b"]
    return compare(got["a"], got["b"]), len(got["a"]), len(got["b"])


async def diff(
    read_a: ReadTree, read_b: ReadTree, path: str, limits: Limits = Limits()
) -> tuple[list[Change], int, int]:
    """Two sandboxes' trees (each guest asked about its own), compared."""
    return await diff_sides(guest_side(read_a), guest_side(read_b), path, limits)


__all__ = [
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "MAX_HASHED",
    "Change",
    "Entry",
    "Limits",
    "ReadTree",
    "Side",
    "compare",
    "diff",
    "diff_sides",
    "guest_side",
    "listing",
]
