"""guestd.tree, guestd.fsops and supervisor.client.treecopy on the host's own kernel (no VM): the
tar packer and the hostile-input unpacker guestd's workers run in the guest, and the
host runs on a guest's streams; patches. The real-VM runs are in tests/vm/test_guest.py."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from guestd import proto, tarformat, tree
from guestd.fsops import TreeError, apply_patch
from supervisor.client.treecopy import packed_tree, unpack_tree
from supervisor.wire.errors import SandboxError

ROOT = os.geteuid() == 0


def tar_of(*members: tuple[str, bytes, bytes | str], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for name, kind, payload in members:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.mtime = kind, 0o644, 1_700_000_000
            if kind == tarfile.REGTYPE:
                assert isinstance(payload, bytes)
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
            else:
                ti.linkname = payload if isinstance(payload, str) else ""
                tf.addfile(ti)
    return out.getvalue()


def unpack_bytes(data: bytes, dest: Path, **kw: object) -> int:
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return tree.unpack(io.BytesIO(data).read, fd, **kw)  # type: ignore[arg-type]
    finally:
        os.close(fd)


def pack_bytes(src: Path) -> bytes:
    buf = bytearray()
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    try:
        tree.pack(fd, buf.extend)
    finally:
        os.close(fd)
    return bytes(buf)


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            body: object = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
            mtime = int(st.st_mtime) if not stat.S_ISDIR(st.st_mode) else 0
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), mtime, body)
    return out


@pytest.fixture
def place(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A destination and, beside it, a directory nothing may ever be written into."""
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (outside / "victim").write_text("victim")
    yield dest, outside
    assert sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_text() == "victim"


def test_round_trip_keeps_everything(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "a" / "b").mkdir(parents=True)
    (src / "empty" / "deeper").mkdir(parents=True)
    (src / "a" / "f").write_bytes(os.urandom(200_000))
    (src / "a" / "f").chmod(0o751)
    (src / "a" / "b" / "g").write_text("g")
    os.utime(src / "a" / "b" / "g", (1_500_000_000, 1_500_000_000))
    os.link(src / "a" / "f", src / "hard")
    (src / "abs").symlink_to("/etc/passwd")
    (src / "rel").symlink_to("a/b")
    (src / ("x" * 200)).write_text("a long name")
    os.mkfifo(src / "fifo")  # not archived
    (src / "empty").chmod(0o500)
    dst.mkdir()
    data = pack_bytes(src)
    assert unpack_bytes(data, dst, keep_ids=ROOT) == 11
    want = snapshot(src)
    del want["fifo"]
    assert snapshot(dst) == want
    assert os.stat(dst / "hard").st_ino == os.stat(dst / "a" / "f").st_ino
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert tf.getmember("hard").islnk() and tf.getmember("abs").issym()


def test_setuid_bits_and_owners_only_when_asked(tmp_path: Path) -> None:
    src, dst, dst2 = tmp_path / "src", tmp_path / "dst", tmp_path / "dst2"
    for d in (src, dst, dst2):
        d.mkdir()
    (src / "suid").write_text("x")
    (src / "suid").chmod(0o4755)
    data = pack_bytes(src)
    unpack_bytes(data, dst)
    unpack_bytes(data, dst2, mode_mask=0o777)
    assert stat.S_IMODE(os.stat(dst / "suid").st_mode) == 0o4755
    assert stat.S_IMODE(os.stat(dst2 / "suid").st_mode) == 0o755
    if ROOT:
        unpack_bytes(data, dst, owner=(1234, 5678))
        st = os.stat(dst / "suid")
        assert (st.st_uid, st.st_gid) == (1234, 5678)


@pytest.mark.parametrize(
    ("name", "kind", "link", "uid", "size", "mtime"),
    [
        ("a/file", tarfile.REGTYPE, "", 0, 12345, 1_700_000_000),
        ("dir", tarfile.DIRTYPE, "", 1000, 0, 0),
        ("dir/", tarfile.DIRTYPE, "", 65534, 0, 5),
        ("l", tarfile.SYMTYPE, "../" * 33, 7, 0, 1),
        ("h", tarfile.LNKTYPE, "a/file", 0, 0, 1),
        ("x" * 100, tarfile.REGTYPE, "", 0, 1, 1),
        ("x" * 101, tarfile.REGTYPE, "", 0, 1, 1),  # these take tarfile's path: pax records
        ("naïve", tarfile.REGTYPE, "", 0, 1, 1),
        ("big", tarfile.REGTYPE, "", 8**7, 8**11, 8**11),
        ("l2", tarfile.SYMTYPE, "t" * 101, 0, 0, 1),
    ],
)
def test_our_headers_are_tarfiles(name: str, kind: bytes, link: str, uid: int, size: int, mtime: int) -> None:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.uid, ti.gid, ti.size, ti.mtime, ti.mode = kind, link, uid, uid, size, mtime, 0o4755
    ti.uname = ti.gname = ""
    assert tarformat.header(ti) == ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


HOSTILE = {
    "absolute": tar_of(("/etc/evil", tarfile.REGTYPE, b"x")),
    "dotdot": tar_of(("a/../../outside/evil", tarfile.REGTYPE, b"x")),
    "dotdot dir": tar_of(("..", tarfile.DIRTYPE, b"")),
    "own symlink": tar_of(("l", tarfile.SYMTYPE, "../outside"), ("l/evil", tarfile.REGTYPE, b"x")),
    "symlink dir": tar_of(("l", tarfile.SYMTYPE, "../outside"), ("l/sub", tarfile.DIRTYPE, b"")),
    "hard link out": tar_of(("h", tarfile.LNKTYPE, "../outside/victim")),
    "hard link absolute": tar_of(("h", tarfile.LNKTYPE, "/etc/passwd")),
    "hard link to a name not in the archive": tar_of(("h", tarfile.LNKTYPE, "planted")),
    "char device": tar_of(("c", tarfile.CHRTYPE, b"")),
    "block device": tar_of(("b", tarfile.BLKTYPE, b"")),
    "fifo": tar_of(("p", tarfile.FIFOTYPE, b"")),
    "unknown type": tar_of(("u", b"Z", b"")),
    "garbage": os.urandom(3000),
    "empty stream": b"",
    "deep": tar_of(("/".join(["d"] * (tree.MAX_DEPTH + 1)), tarfile.DIRTYPE, b"")),
    "truncated": tar_of(("t", tarfile.REGTYPE, os.urandom(20_000)))[:4096],
    "no end marker": tar_of(("t", tarfile.REGTYPE, b"x"))[:1024],
}


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_hostile_archives_are_refused(what: str, place: tuple[Path, Path]) -> None:
    dest, outside = place
    (dest / "planted").symlink_to(outside)  # a link a process in the guest made
    with pytest.raises(TreeError) as e:
        unpack_bytes(HOSTILE[what], dest)
    assert e.value.code == proto.E_INVALID
    if what == "truncated":
        assert not (dest / "t").exists()  # no half file of a broken stream


def test_a_planted_symlink_is_neither_followed_nor_written_through(place: tuple[Path, Path]) -> None:
    dest, outside = place
    (dest / "planted").symlink_to(outside)
    (dest / "file").symlink_to(outside / "victim")
    with pytest.raises(TreeError):
        unpack_bytes(tar_of(("planted/evil", tarfile.REGTYPE, b"x")), dest)
    # a file member replaces the link (unlinked first); a directory member too
    assert unpack_bytes(tar_of(("file", tarfile.REGTYPE, b"new"), ("planted", tarfile.DIRTYPE, b"")), dest) == 2
    assert (dest / "file").read_bytes() == b"new" and not (dest / "file").is_symlink()
    assert (dest / "planted").is_dir() and not (dest / "planted").is_symlink()
    (dest / "dir").mkdir()
    with pytest.raises(TreeError) as e:
        unpack_bytes(tar_of(("dir", tarfile.REGTYPE, b"x")), dest)
    assert e.value.code == proto.E_IS_DIR


def test_oversized_headers_and_limits(place: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    dest, _ = place
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type, pax.size = tarfile.XHDTYPE, proto.MAX_TREE_META + 512
    data = pax.tobuf(tarfile.USTAR_FORMAT) + bytes(proto.MAX_TREE_META + 512) + tar_of(("f", tarfile.REGTYPE, b"x"))
    with pytest.raises(TreeError) as e:
        unpack_bytes(data, dest)
    assert e.value.code == proto.E_INVALID and "header" in e.value.message
    longname = tar_of(("n" * (proto.MAX_TREE_META + 10), tarfile.REGTYPE, b"x"), fmt=tarfile.GNU_FORMAT)
    with pytest.raises(TreeError):
        unpack_bytes(longname, dest)
    monkeypatch.setattr(proto, "MAX_TREE", 1000)
    with pytest.raises(TreeError) as e:
        unpack_bytes(tar_of(("a", tarfile.REGTYPE, bytes(600)), ("b", tarfile.REGTYPE, bytes(600))), dest)
    assert e.value.code == proto.E_TOO_LARGE
    monkeypatch.setattr(proto, "MAX_TREE_ENTRIES", 3)
    with pytest.raises(TreeError) as e:
        unpack_bytes(tar_of(*[(f"f{i}", tarfile.REGTYPE, b"") for i in range(4)]), dest)
    assert e.value.code == proto.E_TOO_LARGE
    src = dest / "src"
    for i in range(4):
        (src / str(i)).mkdir(parents=True, exist_ok=True)
    with pytest.raises(TreeError) as e:
        pack_bytes(src)
    assert e.value.code == proto.E_TOO_LARGE


def test_the_archive_root_sets_the_target_only_when_asked(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    src.chmod(0o711)
    data = pack_bytes(src)
    for root_meta, mode in ((False, 0o755), (True, 0o711)):
        dst = tmp_path / f"dst{root_meta}"
        dst.mkdir(mode=0o755)
        unpack_bytes(data, dst, root_meta=root_meta)
        assert stat.S_IMODE(dst.stat().st_mode) == mode


# --- patches --------------------------------------------------------------------------


def ids(spec: str) -> tuple[int, int]:
    table = {"nobody": (65534, 65534), "app": (1000, 1000)}
    user = spec.partition(":")[0]
    if user.isdigit():
        return int(user), int(user)
    if user not in table:
        raise LookupError(f"unknown user {user!r}")
    return table[user]


def test_patch_entries(tmp_path: Path) -> None:
    base = str(tmp_path)
    n = apply_patch(
        [
            {"op": "mkdir", "path": f"{base}/app/conf", "mode": 0o750},
            {"op": "file", "path": f"{base}/app/conf/a", "data": b"one\n", "mode": 0o600},
            {"op": "append", "path": f"{base}/app/conf/a", "data": b"two\n"},
            {"op": "symlink", "path": f"{base}/app/cur", "target": "conf/a"},
            {"op": "file", "path": f"{base}/new/parents/f", "data": b""},
            {"op": "remove", "path": f"{base}/absent"},
        ],
        ids,
    )
    assert n == 6
    assert (tmp_path / "app/conf/a").read_bytes() == b"one\ntwo\n"
    assert stat.S_IMODE((tmp_path / "app/conf").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "app/conf/a").stat().st_mode) == 0o600
    assert os.readlink(tmp_path / "app/cur") == "conf/a"
    if ROOT:
        apply_patch([{"op": "file", "path": f"{base}/owned", "data": b"x", "owner": "app", "mode": 0o4750}], ids)
        st = os.stat(tmp_path / "owned")
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1000, 0o4750)


def test_patch_never_writes_through_a_symlink_and_names_the_failing_entry(place: tuple[Path, Path]) -> None:
    dest, outside = place
    (dest / "link").symlink_to(outside / "victim")
    (dest / "dirlink").symlink_to(outside)
    with pytest.raises(TreeError) as e:
        apply_patch([{"op": "file", "path": f"{dest}/ok", "data": b"1"}, {"op": "file", "path": f"{dest}/link"}], ids)
    assert e.value.code == proto.E_EXISTS and e.value.message.startswith(f"entry 1 ({dest}/link)")
    apply_patch([{"op": "file", "path": f"{dest}/link", "data": b"mine", "replace": True}], ids)
    assert (dest / "link").read_bytes() == b"mine" and not (dest / "link").is_symlink()
    with pytest.raises(TreeError) as e:
        apply_patch([{"op": "append", "path": f"{dest}/dirlink", "data": b"x"}], ids)
    apply_patch([{"op": "remove", "path": f"{dest}/dirlink"}], ids)  # the link goes, not its target's contents
    assert not (dest / "dirlink").exists()
    (dest / "tree" / "sub").mkdir(parents=True)
    (dest / "tree" / "sub" / "out").symlink_to(outside)
    apply_patch([{"op": "remove", "path": f"{dest}/tree"}], ids)
    assert not (dest / "tree").exists()
    for bad, code in (
        ({"op": "chmod", "path": f"{dest}/x"}, proto.E_INVALID),
        ({"op": "file", "path": "relative"}, proto.E_INVALID),
        ({"op": "file", "path": "/"}, proto.E_INVALID),
        ({"op": "file", "path": f"{dest}/x", "mode": "0644"}, proto.E_INVALID),
        ({"op": "file", "path": f"{dest}/x", "mode": 0o10000}, proto.E_INVALID),
        ({"op": "file", "path": f"{dest}/x", "owner": "ghost"}, proto.E_INVALID),
        ({"op": "symlink", "path": f"{dest}/x"}, proto.E_INVALID),
        ({"op": "mkdir", "path": f"{dest}/ok"}, proto.E_EXISTS),
        ({"op": "file", "path": f"{dest}", "replace": True}, proto.E_IS_DIR),
    ):
        with pytest.raises(TreeError) as e:
            apply_patch([bad], ids, base=7)
        assert e.value.code == code and e.value.message.startswith("entry 7 "), bad


# --- supervisor.client.treecopy: the client's ends --------------------------------------------------


async def test_host_pack_and_unpack_through_threads(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "d").mkdir(parents=True)
    for i in range(300):
        (src / "d" / f"f{i}").write_bytes(os.urandom(i * 100))
    dst.mkdir()
    with trio.fail_after(60):
        async with packed_tree(src) as chunks:
            assert await unpack_tree(chunks, dst) == 302
    assert snapshot(dst) == snapshot(src)


async def test_host_unpack_refuses_a_hostile_guest(place: tuple[Path, Path]) -> None:
    dest, _ = place

    async def stream() -> AsyncIterator[bytes]:
        data = HOSTILE["own symlink"] + os.urandom(1 << 20)  # and more after it: never read
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]

    with trio.fail_after(30), pytest.raises(SandboxError) as e:
        await unpack_tree(stream(), dest)
    assert e.value.code == proto.E_INVALID and "the guest's tree" in e.value.message
    with trio.fail_after(30), pytest.raises(SandboxError) as e:
        async with packed_tree(dest / "missing"):
            pass
    assert e.value.code == proto.E_NOT_FOUND


async def test_host_unpack_reports_the_sources_error_not_truncation(tmp_path: Path) -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"\0" * 100
        raise SandboxError("NOT_FOUND", "no such directory")

    with trio.fail_after(30), pytest.raises(SandboxError) as e:
        await unpack_tree(failing(), tmp_path)
    assert e.value.code == "NOT_FOUND"


# --- copy-out hardening: malformed headers, pre-existing directories, single files ----------


def pax_member(records: dict[str, str], kind: bytes = tarfile.REGTYPE, name: str = "f") -> bytes:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.mtime = kind, 0o644, 1_700_000_000
    ti.size = 1 if kind == tarfile.REGTYPE else 0
    ti.pax_headers = records
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(ti, io.BytesIO(b"x") if kind == tarfile.REGTYPE else None)
    return out.getvalue()


def raw_pax(payload: bytes) -> bytes:
    """A pax header with exactly ``payload`` as its records, then a one-byte file."""
    h = tarfile.TarInfo("././@PaxHeader")
    h.type, h.size = tarfile.XHDTYPE, len(payload)
    f = tarfile.TarInfo("f")
    f.size = 1
    head = h.tobuf(tarfile.USTAR_FORMAT) + payload + bytes(-len(payload) % 512)
    return head + f.tobuf(tarfile.USTAR_FORMAT) + b"x" + bytes(511) + bytes(1024)


_ONE = tar_of(("f", tarfile.REGTYPE, b"x"))
MALFORMED = {
    "NUL in a pax path": pax_member({"path": "a\0b"}),
    "NUL in a pax link": pax_member({"linkpath": "t\0u"}, kind=tarfile.SYMTYPE),
    "NUL in a raw record": raw_pax(b"12 path=a\0b\n"),
    "mtime inf": pax_member({"mtime": "inf"}),
    "mtime nan": pax_member({"mtime": "nan"}),
    "mtime 1e300": pax_member({"mtime": "1e300"}),
    "directory mtime inf": pax_member({"mtime": "inf"}, kind=tarfile.DIRTYPE, name="d"),
    "uid 2**70": pax_member({"uid": str(2**70)}),
    "gid -5": pax_member({"gid": "-5"}),
    "record length past the header": raw_pax(b"99999 path=x\n"),
    "record length of 0": raw_pax(b"0 path=x\n"),
    "record length beyond ssize_t": raw_pax(b"9999999999999999999999 path=x\n"),
    "sparse map junk": raw_pax(b"22 GNU.sparse.map=1,x\n"),
    "sparse 1.0 without a name": pax_member({"GNU.sparse.major": "1", "GNU.sparse.minor": "0"}),
    "name beyond NAME_MAX": pax_member({"path": "x" * 300}),
    "bad checksum": _ONE[:148] + b"0000000\0" + _ONE[156:],
    "bad size digits": _ONE[:124] + b"9x9x9x9x9x9\0" + _ONE[136:],
    "truncated header": _ONE[:300],
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_every_malformed_header_is_a_tree_error(what: str, place: tuple[Path, Path]) -> None:
    dest, _ = place
    with pytest.raises(TreeError) as e:
        unpack_bytes(MALFORMED[what], dest, keep_ids=ROOT, mode_mask=0o777)
    assert e.value.code == proto.E_INVALID, e.value.message


def test_the_read_callbacks_own_error_passes_through(tmp_path: Path) -> None:
    data = io.BytesIO(tar_of(("f", tarfile.REGTYPE, b"x" * 5000)))

    def read(n: int) -> bytes:
        if data.tell() > 1000:
            raise ConnectionResetError("the source broke")
        return data.read(min(n, 600))

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(ConnectionResetError):
            tree.unpack(read, fd)
    finally:
        os.close(fd)


def test_pre_existing_directories_keep_their_mode_and_owner(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "old" / "new").mkdir(parents=True)
    (src / "old" / "f").write_text("f")
    for d in (src, src / "old", src / "old" / "new"):
        d.chmod(0o777)
    data = pack_bytes(src)
    (dst / "old").mkdir(parents=True)
    (dst / "old").chmod(0o750)
    if ROOT:
        os.chown(dst / "old", 4321, 4321)
    unpack_bytes(data, dst, keep_ids=ROOT, mode_mask=0o777, keep_existing=True, root_meta=True)
    assert stat.S_IMODE((dst / "old").stat().st_mode) == 0o750  # was there: kept
    assert stat.S_IMODE(dst.stat().st_mode) == 0o777  # the root entry, asked for (the caller made it)
    assert stat.S_IMODE((dst / "old" / "new").stat().st_mode) == 0o777  # made by the copy
    if ROOT:
        assert ((dst / "old").stat().st_uid, (dst / "old").stat().st_gid) == (4321, 4321)
    # without keep_existing (guestd's write_tree, as tar): the archive's mode
    unpack_bytes(data, dst, mode_mask=0o777)
    assert stat.S_IMODE((dst / "old").stat().st_mode) == 0o777


async def test_host_unpack_keeps_existing_dirs_and_applies_the_umask(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "keep").mkdir(parents=True)
    (src / "made").mkdir()
    (src / "made" / "suid").write_text("x")
    (src / "made" / "suid").chmod(0o4777)
    for d in (src / "keep", src / "made"):
        d.chmod(0o777)
    (dst / "keep").mkdir(parents=True)
    (dst / "keep").chmod(0o700)
    data = pack_bytes(src)

    async def one() -> AsyncIterator[bytes]:
        yield data

    old = os.umask(0o027)
    try:
        with trio.fail_after(30):
            await unpack_tree(one(), dst)
    finally:
        os.umask(old)
    assert stat.S_IMODE((dst / "keep").stat().st_mode) == 0o700
    assert stat.S_IMODE((dst / "made").stat().st_mode) == 0o750
    assert stat.S_IMODE((dst / "made" / "suid").stat().st_mode) == 0o750


def test_single_file_target_never_follows_the_final_component(place: tuple[Path, Path]) -> None:
    from supervisor.client.treecopy import commit_temp, create_temp, open_target

    dest, outside = place

    def copy(local: Path | str, guest: str, body: bytes) -> None:
        dfd, name = open_target(local, guest)
        try:
            tmp, fd = create_temp(dfd, name)
            assert tmp != create_temp.__name__ and not tmp.startswith(f".{name}.sandvisor-part")
            os.write(fd, body)
            os.close(fd)
            commit_temp(dfd, tmp, name)
        finally:
            os.close(dfd)

    (dest / "link").symlink_to(outside / "victim")  # planted: a guest's tree, another user
    copy(dest / "link", "/etc/hosts", b"new")
    assert not (dest / "link").is_symlink() and (dest / "link").read_bytes() == b"new"
    (dest / "dangling").symlink_to(outside / "nothing")
    copy(dest / "dangling", "/etc/hosts", b"d")
    assert not (dest / "dangling").is_symlink() and not (outside / "nothing").exists()
    copy(dest, "/etc/hosts", b"in the dir")  # a directory: the guest file's name in it
    assert (dest / "hosts").read_bytes() == b"in the dir"
    (dest / "sub").mkdir()
    (dest / "to-sub").symlink_to("sub")  # a symlink to a directory is followed, as cp does
    copy(dest / "to-sub", "/etc/hosts", b"via link")
    assert (dest / "sub" / "hosts").read_bytes() == b"via link"
    (dest / "sub" / "hosts").unlink()
    (dest / "sub" / "hosts").symlink_to(outside / "victim")  # ... but not its final name
    copy(dest / "to-sub", "/etc/hosts", b"again")
    assert not (dest / "sub" / "hosts").is_symlink()
    with pytest.raises(SandboxError) as e:
        copy(f"{dest}/no-such-dir/", "/etc/hosts", b"x")
    assert e.value.code == "NOT_FOUND"
    with pytest.raises(SandboxError) as e:
        copy(dest, "/", b"x")
    assert e.value.code == "INVALID_ARGUMENT"
    assert not [n for n in os.listdir(dest) if "sandvisor-part" in n]


# --- the hand-rolled reader: the header forms other tars write ----------------------


def test_reader_takes_the_forms_other_tars_write(tmp_path: Path) -> None:
    """GNU long names and base-256 numbers, ustar prefixes, a global pax header, an
    old-style directory, in one stream read a few bytes at a time; all as tarfile reads them."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tf:
        big = tarfile.TarInfo("g" * 150)  # GNU long name
        big.size, big.uid, big.mtime = 3, 8**8, 1_700_000_000  # a uid beyond 7 octal digits: base-256
        tf.addfile(big, io.BytesIO(b"big"))
    gnu = out.getvalue().rstrip(b"\0")  # (without its end-of-archive marker: the data ends in "big")
    gnu += bytes(-len(gnu) % 512)
    ustar = tarfile.TarInfo("p" * 120 + "/q")  # ustar's prefix field
    ustar.size = 1
    old_dir = tarfile.TarInfo("od/")
    old_dir.type, old_dir.mode = tarfile.AREGTYPE, 0o755
    glob = tarfile.TarInfo("././@PaxHeader")
    payload = b"17 mtime=1234567\n"
    glob.type, glob.size = tarfile.XGLTYPE, len(payload)
    data = (
        gnu
        + ustar.tobuf(tarfile.USTAR_FORMAT)
        + b"x"
        + bytes(511)
        + glob.tobuf(tarfile.USTAR_FORMAT)
        + payload
        + bytes(-len(payload) % 512)
        + old_dir.tobuf(tarfile.USTAR_FORMAT)
        + bytes(1024)
    )
    src = io.BytesIO(data)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert tree.unpack(lambda n: src.read(min(n, 7)), fd, keep_ids=False) == 3
    finally:
        os.close(fd)
    assert (tmp_path / ("g" * 150)).read_bytes() == b"big"
    assert (tmp_path / ("p" * 120) / "q").read_bytes() == b"x"
    assert (tmp_path / "od").is_dir() and (tmp_path / "od").stat().st_mtime == 1234567  # the global mtime
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        names = {ti.name for ti in tf}
    assert names == {"g" * 150, "p" * 120 + "/q", "od"}


@pytest.mark.parametrize("field", [b"0o00644\0", b"0_644\0\0\0", b"+644\0\0\0\0", b"\x80" + bytes(6) + b"\x01"])
def test_reader_octal_fields_are_strict(field: bytes, place: tuple[Path, Path]) -> None:
    """What int() would take but is no octal field: refused (base-256 only where tar writes it)."""
    dest, _ = place
    one = bytearray(tar_of(("f", tarfile.REGTYPE, b"x")))
    one[100:108] = field  # the mode
    one[148:156] = b"        "
    one[148:155] = b"%06o\0" % sum(one[:512])
    if field[0] == 0x80:  # base-256 mode: read as the number (1), not refused
        assert unpack_bytes(bytes(one), dest) >= 1
        return
    with pytest.raises(TreeError) as e:
        unpack_bytes(bytes(one), dest)
    assert e.value.code == proto.E_INVALID


def test_every_file_gets_its_exact_mode_and_owner(tmp_path: Path) -> None:
    """Files made with their final mode when that is safe (no fchmod), else 0600 and
    fchmod once whole: either way the archive's exact mode; the archive's owner even
    when it is the unpacker's own and a setgid parent would give its group instead."""
    modes = (0o644, 0o600, 0o000, 0o755, 0o664, 0o666, 0o4755, 0o2750, 0o1777, 0o444, 0o700, 0o640)
    out = io.BytesIO()
    me = (os.geteuid(), os.getegid())
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for sub in ("", "sg/"):
            for m in modes:
                ti = tarfile.TarInfo(f"{sub}f{m:o}")
                ti.mode, ti.size, ti.mtime, (ti.uid, ti.gid) = m, 1, 1_600_000_000, me
                tf.addfile(ti, io.BytesIO(b"x"))
    dst = tmp_path / "dst"
    (dst / "sg").mkdir(parents=True)
    os.chmod(dst / "sg", 0o2775)
    if ROOT:
        os.chown(dst / "sg", 0, 4321)
    old = os.umask(0o027)
    try:
        unpack_bytes(out.getvalue(), dst, keep_ids=ROOT)
    finally:
        os.umask(old)
    for sub in ("", "sg/"):
        for m in modes:
            st = os.lstat(dst / f"{sub}f{m:o}")
            assert (stat.S_IMODE(st.st_mode), int(st.st_mtime)) == (m, 1_600_000_000), (sub, oct(m))
            if ROOT:
                assert (st.st_uid, st.st_gid) == me, (sub, oct(m))


def test_many_pax_headers_before_one_member_are_bounded_together(place: tuple[Path, Path]) -> None:
    """MAX_TREE_META bounds a member's metadata headers in all, not each one (a run of
    small pax headers, or global ones piling up, would otherwise grow without end)."""
    dest, _ = place

    def record(n: int) -> bytes:
        body = b" comment=" + b"c" * n + b"\n"
        length = len(body) + len(str(len(body)))
        length = len(body) + len(str(length))
        return str(length).encode() + body

    def pax_header(kind: bytes, payload: bytes) -> bytes:
        ti = tarfile.TarInfo("././@PaxHeader")
        ti.type, ti.size = kind, len(payload)
        return ti.tobuf(tarfile.USTAR_FORMAT) + payload + bytes(-len(payload) % 512)

    piece = record(proto.MAX_TREE_META // 8)
    for kind in (tarfile.XHDTYPE, tarfile.XGLTYPE):
        data = b"".join(pax_header(kind, piece) for _ in range(12)) + tar_of(("f", tarfile.REGTYPE, b"x"))
        with pytest.raises(TreeError) as e:
            unpack_bytes(data, dest)
        assert e.value.code == proto.E_INVALID, kind
    ok = b"".join(pax_header(tarfile.XHDTYPE, record(10)) for _ in range(3)) + tar_of(("f", tarfile.REGTYPE, b"x"))
    unpack_bytes(ok, dest)
    assert (dest / "f").read_bytes() == b"x"
