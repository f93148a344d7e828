"""Files beyond read and write, without a VM: guestd's fs operations on a scratch
directory (their typed errors), the host's check of a guest's answer (hostile
shapes are a protocol error), and a guest agent without the "fs" feature."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

from actors.channel.guest import GuestOpError, open_channel
from actors.channel.guestwire import FsEntry, parse_fs_entries
from guestd import fsops, proto
from guestd.fsops import TreeError
from tests.support.fakeguest import fake_guest


def _code(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except TreeError as exc:
        return exc.code
    except OSError as exc:
        return proto.errcode(exc)
    raise AssertionError("no error")


def test_fs_operations_and_their_codes(tmp_path: Path) -> None:
    d = str(tmp_path)
    assert fsops.fs_mkdir(f"{d}/a/b", True, 0o700) == 1 and fsops.fs_mkdir(f"{d}/a/b", True, 0o700) == 0
    assert os.stat(f"{d}/a/b").st_mode & 0o7777 == 0o700  # the mode asked for, not the umask's
    Path(d, "a", "f").write_bytes(b"12345")
    os.symlink("/nowhere", f"{d}/a/dangling")
    listed = fsops.fs_list(f"{d}/a")
    want = [("b", "dir", ""), ("dangling", "symlink", "/nowhere"), ("f", "file", "")]
    assert [(e[0], e[1], e[7]) for e in listed] == want
    assert fsops.fs_stat(f"{d}/a/f")[1:3] == ["file", 5]
    assert _code(fsops.fs_mkdir, f"{d}/a/f", True, 0o755) == proto.E_FAILED  # over a file
    assert _code(fsops.fs_mkdir, f"{d}/a/f/x", True, 0o755) == proto.E_FAILED  # under a file
    assert _code(fsops.fs_mkdir, f"{d}/a", False, 0o755) == proto.E_EXISTS
    assert _code(fsops.fs_mkdir, f"{d}/q/r", False, 0o755) == proto.E_NOT_FOUND
    assert _code(fsops.fs_list, f"{d}/a/f") == proto.E_FAILED
    assert _code(fsops.fs_list, f"{d}/nope") == proto.E_NOT_FOUND
    assert _code(fsops.fs_remove, f"{d}/a", False) == proto.E_FAILED  # not empty
    assert _code(fsops.fs_remove, "/", True) == proto.E_INVALID
    assert _code(fsops.fs_rename, f"{d}/a", f"{d}/a/b/c") == proto.E_INVALID  # into itself
    assert _code(fsops.fs_rename, f"{d}/a/f", f"{d}/a/b") == proto.E_FAILED  # a file over a directory
    assert _code(fsops.fs_stat, "relative") == proto.E_INVALID
    assert _code(fsops.fs_remove, "//", True) == proto.E_INVALID
    os.mkfifo(f"{d}/a/fifo")
    assert _code(fsops.fs_list, f"{d}/a/fifo") == proto.E_FAILED  # refused, not opened (it would block)
    assert _code(fsops.fs_list, f"{d}/a/f/x") == proto.E_NOT_FOUND
    os.unlink(f"{d}/a/fifo")
    fsops.fs_rename(f"{d}/a/f", f"{d}/a/g")
    fsops.fs_remove(f"{d}/a/dangling", False)  # the link, never its target
    fsops.fs_remove(f"{d}/a", True)
    assert os.listdir(d) == []


def test_a_hostile_fs_answer_breaks_the_protocol() -> None:
    good = ["f", "file", 1, 0o644, 0, 0, 10, ""]
    assert parse_fs_entries(msgpack.packb([good])) == [FsEntry("f", "file", 1, 0o644, 0, 0, 10, "")]
    for bad in (
        {"a": 1},
        [good[:7]],
        [["", *good[1:]]],
        [["x" * 4097, *good[1:]]],
        [[*good[:1], "device", *good[2:]]],
        [[*good[:2], -1, *good[3:]]],
        [[*good[:3], 0o170000, *good[4:]]],
        [[*good[:4], 2**32, *good[5:]]],
        [[*good[:6], 2**64 - 1, ""]],
        [[*good[:7], b"bytes"]],
        [[*good[:2], True, *good[3:]]],
    ):
        with pytest.raises(ValueError):
            parse_fs_entries(msgpack.packb(bad))
    with pytest.raises(ValueError):
        parse_fs_entries(b"\xc1garbage")


async def test_a_guest_without_fs_requests_is_unimplemented() -> None:
    with trio.fail_after(30):
        async with fake_guest() as g, open_channel(g.connect(), hello_timeout=5) as chan:
            with pytest.raises(GuestOpError) as exc:
                await chan.fs_entries("list", "/")
            assert exc.value.code == proto.E_UNSUPPORTED
            with pytest.raises(GuestOpError):
                await chan.fs_change("mkdir", "/x")
            assert (await chan.ping()).activity >= 0  # the channel is fine: nothing was sent
