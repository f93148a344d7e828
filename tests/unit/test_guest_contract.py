"""The guest protocol's contract, written once and run against both implementations.

``impl`` is "fake" (tests/support/fakeguest.py: in-process, on Trio's autojump clock, so the
guest's sleeps and the host's timeouts cost no wall time; part of the unit session)
and "real" (guestd in the session's shared VM, conftest.shared_vm; marked ``vm``). Every
test gets a fresh :class:`GuestChannel` (``chan``) and a fresh scratch directory in the
guest (``scratch``), and observes the guest only through the channel (runs, files,
trees), never through the fake's model: what passes here is what guestd does.

Where the two differed, the fake was fixed (so both pass the same test). What only one
of them can show stays in its own file: the fake's hostile modes and host-side
deadlines (test_fakeguest.py); boots, the vsock listener, flooding 50 MiB, volumes and
what guestd leaves behind in a real kernel (test_guest.py, test_vm.py).
"""

from __future__ import annotations

import io
import os
import signal
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
from trio.testing import MockClock

from actors.channel.guest import ChannelBroken, GuestChannel, GuestOpError, PatchEntry, open_channel
from guestd import proto
from tests.support.fakeguest import FakeGuest, fake_guest
from tests.support.vms import SharedVM

E = PatchEntry


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.vm)])
def impl(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock(impl: str) -> MockClock | None:
    """Every test takes this (pytest-trio runs a test on a Clock among its arguments):
    the fake runs on the autojump clock, the real VM on the real one."""
    return MockClock(autojump_threshold=0) if impl == "fake" else None


@pytest.fixture
def real_vm(impl: str, request: pytest.FixtureRequest) -> SharedVM | None:
    """The shared VM, booted (synchronously, before the test's trio.run) only for "real"."""
    return request.getfixturevalue("shared_vm") if impl == "real" else None


@attrs.define
class Guest:
    """What a test reaches the guest by: new host connections (sessions)."""

    impl: str
    fake: FakeGuest | None
    vm: SharedVM | None

    @property
    def hello_timeout(self) -> float:
        return 5 if self.fake is not None else 90

    @asynccontextmanager
    async def channel(self) -> AsyncIterator[GuestChannel]:
        if self.fake is not None:
            stream: trio.abc.Stream = self.fake.connect()
        else:
            assert self.vm is not None
            if self.vm.proc.poll() is not None:
                pytest.fail("the shared VM died")
            stream = await trio.open_unix_socket(str(self.vm.guest_socket))
        async with open_channel(stream, hello_timeout=self.hello_timeout) as c:
            yield c


@pytest.fixture
async def guest(impl: str, real_vm: SharedVM | None) -> AsyncIterator[Guest]:
    if impl == "fake":
        assert isinstance(trio.lowlevel.current_clock(), MockClock), "take `clock`: the fake's waits must cost no time"
        async with fake_guest(hostname="sandbox") as g:
            yield Guest(impl, g, None)
    else:
        yield Guest(impl, None, real_vm)


@pytest.fixture
async def chan(guest: Guest) -> AsyncIterator[GuestChannel]:
    async with guest.channel() as c:
        yield c


@pytest.fixture
async def scratch(chan: GuestChannel) -> str:
    """A new empty directory of this test's own (the real VM is shared by the session)."""
    d = f"/tmp/contract-{uuid.uuid4().hex[:12]}"
    with trio.fail_after(30):
        await chan.patch([E.mkdir(d)])
    return d


def _tar(*members: tuple[str, bytes, bytes | str], mode: int = 0o644) -> bytes:
    """A tar of (name, type, contents or link target) members."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, payload in members:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode = kind, 0o755 if kind == tarfile.DIRTYPE else mode
            if kind == tarfile.REGTYPE:
                assert isinstance(payload, bytes)
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
            else:
                ti.linkname = payload if isinstance(payload, str) else ""
                tf.addfile(ti)
    return out.getvalue()


@attrs.frozen
class Member:
    type: bytes
    mode: int
    uid: int
    gid: int
    data: bytes = b""
    link: str = ""


async def _read_tree(chan: GuestChannel, path: str) -> dict[str, Member]:
    """The tree at ``path`` as the guest streams it: name -> what the tar says of it."""
    buf = bytearray()
    async with chan.read_tree(path) as tar:
        async for chunk in tar:
            buf += chunk
    out = {}
    with tarfile.open(fileobj=io.BytesIO(bytes(buf))) as tf:
        for m in tf.getmembers():
            f = tf.extractfile(m) if m.isreg() else None
            data = f.read() if f is not None else b""
            out[m.name.removeprefix("./") or "."] = Member(m.type, m.mode & 0o7777, m.uid, m.gid, data, m.linkname)
    return out


async def _exit_code(chan: GuestChannel, argv: list[str]) -> int:
    return (await chan.run(argv)).exit_code


# --- session ------------------------------------------------------------------------


async def test_hello_reports_the_guest(clock: object, chan: GuestChannel) -> None:
    info = chan.hello_info
    assert info is not None and info.version == proto.PROTOCOL_VERSION
    assert info.pid == 1  # guestd is PID 1
    assert 0 < info.boot_ns <= info.ready_ns
    assert {"init", "modules", "rootfs", "python", "ready"} <= set(info.marks)
    assert {"exec", "pty", "files", "metrics", "trees", "patch", "mount"} <= set(info.features)
    assert chan.hello_rtt >= 0.0


async def test_ping_does_not_touch_but_touch_and_exec_do(clock: object, chan: GuestChannel) -> None:
    with trio.fail_after(30):
        a = (await chan.ping()).activity
        b = (await chan.ping()).activity
        c = await chan.touch()
        await chan.run(["true"])
        d = (await chan.ping()).activity
    assert a == b and c == b + 1 and d == c + 1


async def test_metrics(clock: object, chan: GuestChannel) -> None:
    with trio.fail_after(30):
        m = await chan.metrics()
    assert m.uptime > 0 and m.ncpu >= 1
    assert m.mem["total"] > 100 << 20 and 0 < m.mem["available"] <= m.mem["total"]
    assert set(m.cpu_seconds) >= {"user", "system", "idle"} and m.cpu_seconds["user"] + m.cpu_seconds["system"] > 0
    assert set(m.disk) >= {"read_bytes", "write_bytes"} and m.disk["read_bytes"] > 0


async def test_clock_entropy_hostname_and_their_bad_input(clock: object, chan: GuestChannel) -> None:
    with trio.fail_after(30):
        target = time.time_ns() + 3600 * 10**9
        await chan.set_clock(target)
        assert abs((await chan.ping()).guest_ns - target) < 5 * 10**9
        await chan.set_clock()  # the host's now
        assert abs((await chan.ping()).guest_ns - time.time_ns()) < 5 * 10**9
        await chan.add_entropy(64)
        before = (await chan.run(["hostname"])).stdout.decode().strip()
        await chan.set_hostname("renamed")
        assert (await chan.run(["hostname"])).stdout == b"renamed\n"
        assert (await chan.run(["env"])).stdout.count(b"HOSTNAME=renamed\n") == 1
        bad_calls: list[Callable[[], Awaitable[None]]] = [
            lambda: chan.add_entropy(5000),
            lambda: chan.set_hostname(""),
            lambda: chan.set_hostname("x" * 65),
        ]
        for bad in bad_calls:
            with pytest.raises(GuestOpError) as e:
                await bad()
            assert e.value.code == proto.E_INVALID
        await chan.set_hostname(before)


async def test_a_second_hello_fails_the_requests_of_the_session_it_ends(clock: object, guest: Guest) -> None:
    async with guest.channel() as chan:
        async with chan.exec(["sleep", "10"]) as h:
            await chan.hello(guest.hello_timeout)  # a new session: this exec's exit will never come
            with trio.fail_after(30), pytest.raises(ChannelBroken, match="new session"):
                await h.wait()
        with trio.fail_after(30):
            assert (await chan.ping()).activity >= 0


async def test_a_new_host_finds_the_processes_and_state_of_the_last(
    clock: object, guest: Guest, chan: GuestChannel, scratch: str
) -> None:
    """A host that goes away mid-exec (a supervisor restart) and new ones that connect:
    the process the first started runs on, and the guest's state is the same. (One
    host at a time: QEMU's chardev socket takes the next only once this one is gone.)"""
    survivor = f"{scratch}/survivor"
    with trio.fail_after(60):
        async with chan.exec(["sh", "-c", f"sleep 1; echo survived > {survivor}"]):
            await chan.aclose()  # the host vanishes: no SIGKILL from leaving the exec
        for _ in range(3):  # connect, drop, connect again
            async with guest.channel() as c2:
                assert (await c2.ping()).activity >= 0
        async with guest.channel() as c3:
            while True:  # a poll: the process finishes in its own time
                try:
                    if await c3.read_bytes(survivor) == b"survived\n":
                        break
                except GuestOpError as exc:
                    assert exc.code == proto.E_NOT_FOUND
                await trio.sleep(0.1)


# --- exec -----------------------------------------------------------------------------


async def test_exact_streams_and_exit_codes(clock: object, chan: GuestChannel) -> None:
    with trio.fail_after(30):
        r = await chan.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (r.stdout, r.stderr, r.exit_code, r.signal, r.timed_out) == (b"out\n", b"err\n", 3, 0, False)
        codes = [await _exit_code(chan, a) for a in (["true"], ["false"], ["/bin/true"], ["sh", "-c", "exit 300"])]
        assert codes == [0, 1, 0, 300 & 0xFF]
        r = await chan.run(["sh", "-c", "false || echo a && echo b; false && echo c; nope"])
        assert (r.stdout, r.stderr, r.exit_code) == (b"a\nb\n", b"sh: 1: nope: not found\n", 127)


async def test_exec_gets_env_cwd_and_user(clock: object, chan: GuestChannel) -> None:
    with trio.fail_after(30):
        r = await chan.run(["env"], env={"FOO": "bar"}, cwd="/tmp", user="nobody")
        assert b"FOO=bar\n" in r.stdout and b"USER=nobody\n" in r.stdout and b"HOME=/nonexistent\n" in r.stdout
        assert (await chan.run(["sh", "-c", "pwd; id -un; id -u"], cwd="/tmp")).stdout == b"/tmp\nroot\n0\n"
        assert (await chan.run(["id", "-un"], user="nobody")).stdout == b"nobody\n"
        assert (await chan.run(["pwd"])).stdout == b"/root\n"  # root's home
        r = await chan.run(["env"], tty=True)
        assert b"TERM=xterm-256color\r\n" in r.stdout


async def test_exec_errors_are_typed(clock: object, chan: GuestChannel) -> None:
    cases: list[tuple[list[str], dict[str, str], str, str]] = [
        (["no-such-cmd"], {}, proto.E_NOT_FOUND, "executable file not found in $PATH"),
        (["/no/such/binary"], {}, proto.E_NOT_FOUND, "No such file or directory"),
        (["true"], {"user": "no-such-user"}, proto.E_INVALID, "unknown user 'no-such-user'"),
        (["true"], {"cwd": "/no/such/dir"}, proto.E_NOT_FOUND, "chdir '/no/such/dir'"),
        ([], {}, proto.E_INVALID, "empty command"),
    ]
    with trio.fail_after(30):
        for argv, kw, code, text in cases:
            with pytest.raises(GuestOpError) as e:
                await chan.run(argv, user=kw.get("user", ""), cwd=kw.get("cwd", ""))
            assert e.value.code == code and text in e.value.message, (argv, kw, e.value)
        assert (await chan.ping()).activity >= 0  # the channel is fine after all of them


async def test_stdin_round_trips_through_cat(clock: object, chan: GuestChannel) -> None:
    payload = os.urandom(1 << 20)
    got = bytearray()
    with trio.fail_after(60):
        async with chan.exec(["cat"], stdin=True) as h, trio.open_nursery() as n:

            async def feed() -> None:
                await h.send_stdin(payload)
                await h.close_stdin()

            n.start_soon(feed)
            async for ch, data in h:
                assert ch == proto.STDOUT and len(data) <= proto.WINDOW
                got += data
    assert h.exit is not None and h.exit.code == 0
    assert got == payload


async def test_output_honours_credit_and_a_stalled_consumer_bounds_it(clock: object, chan: GuestChannel) -> None:
    with trio.fail_after(60):
        r = await chan.run(["head", "-c", str(8 << 20), "/dev/zero"])
        assert len(r.stdout) == 8 << 20 and r.exit_code == 0
        async with chan.exec(["head", "-c", str(20 << 20), "/dev/zero"]) as h:  # a consumer that never reads
            req = chan._reqs[h.rid]
            while req.buffered < proto.WINDOW:  # the guest fills the window it was granted...
                await trio.sleep(0.01)
            assert req.buffered == proto.WINDOW and not chan.broken  # ...and stops there (beyond: a protocol error)
        # leaving the block killed it; the channel is fine
        assert (await chan.run(["echo", "ok"])).stdout == b"ok\n"


async def test_signals_reach_the_process_group(clock: object, chan: GuestChannel) -> None:
    with trio.fail_after(60):
        for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGINT):
            async with chan.exec(["sleep", "60"]) as h:
                await h.signal(sig)
                ex = await h.wait()
            assert (ex.code, ex.signal, ex.timed_out) == (128 + sig, sig, False)
        async with chan.exec(["sh", "-c", "sleep 60 & sleep 60"]) as h:  # a background child in the group
            await h.signal(signal.SIGWINCH)  # default action: ignore
            await h.signal(signal.SIGTERM)
            assert (await h.wait()).signal == signal.SIGTERM


async def test_an_exec_left_before_its_answer_is_killed(
    clock: object, chan: GuestChannel, scratch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that leaves an exec while it waits for exec_started (a client's cancel or a
    deadline, as gRPC's Exec gets) kills its process all the same: the guest started it
    before answering. (Before, only an answered exec was killed: this one ran on,
    unowned, and its late exec_started was dropped as abandoned traffic.)"""
    marker = f"{scratch}/ran-on"
    send = chan.send_message
    with trio.CancelScope() as scope:

        async def send_then_cancel(msg: proto.Message) -> None:
            await send(msg)
            if isinstance(msg, proto.Exec):
                scope.cancel()  # the Exec is out; its answer is not in yet

        monkeypatch.setattr(chan, "send_message", send_then_cancel)
        with trio.fail_after(30):
            async with chan.exec(["sh", "-c", f"sleep 1; touch {marker}"]):
                pytest.fail("the exec was entered: the cancel came after its answer")
    monkeypatch.setattr(chan, "send_message", send)
    assert scope.cancelled_caught
    with trio.fail_after(60):
        await trio.sleep(5)  # well beyond its sleep: a process that ran on has made the file
        r = await chan.run(["cat", marker])
    assert r.exit_code != 0, "the cancelled exec's process ran on"


async def test_timeout_kills(clock: object, chan: GuestChannel) -> None:
    t = trio.current_time()
    with trio.fail_after(30):
        r = await chan.run(["sleep", "60"], timeout=1.0)
    assert r.timed_out and r.signal == signal.SIGKILL and r.exit_code == 128 + signal.SIGKILL
    assert 1 <= trio.current_time() - t < 20


async def test_a_background_child_does_not_hold_the_exec(clock: object, chan: GuestChannel) -> None:
    with trio.fail_after(30):
        r = await chan.run(["sh", "-c", "sleep 30 & echo started"])
    assert (r.stdout, r.exit_code) == (b"started\n", 0)


async def test_a_pty_merges_streams_and_follows_resize(clock: object, chan: GuestChannel) -> None:
    out = bytearray()
    with trio.fail_after(30):
        script = "stty size; echo err >&2; cat; stty size; exit 7"  # cat: until the host's end of input
        async with chan.exec(["sh", "-c", script], tty=True, stdin=True, rows=30, cols=100) as h:
            async for ch, data in h:
                assert ch == proto.STDOUT
                out += data
                if out.endswith(b"err\r\n"):
                    break
            await h.resize(40, 132)
            await h.close_stdin()  # guestd sends ^D to the line discipline
            async for ch, data in h:
                assert ch == proto.STDOUT
                out += data
    assert out == b"30 100\r\nerr\r\n40 132\r\n"  # ONLCR, one stream
    assert h.exit is not None and h.exit.code == 7


# --- files ------------------------------------------------------------------------------


async def test_file_round_trip_in_chunks(clock: object, chan: GuestChannel, scratch: str) -> None:
    data = os.urandom((1 << 20) + 1)
    chunks: list[int] = []
    with trio.fail_after(60):
        assert await chan.write_file(f"{scratch}/blob", data, mode=0o600) == len(data)
        async with chan.read_file(f"{scratch}/blob") as f:
            assert (f.size, f.mode) == (len(data), 0o600)
            back = bytearray()
            async for chunk in f:
                chunks.append(len(chunk))
                back += chunk
        await chan.write_file(f"{scratch}/empty", b"")
        assert await chan.read_bytes(f"{scratch}/empty") == b""
        r = await chan.run(["cat", f"{scratch}/blob"])  # what a process in the guest sees
    # a reader that falls behind gets what arrived meanwhile in one piece: at most the
    # credit the host granted the file (FILE_WINDOW beyond one window), not one frame
    assert back == data and max(chunks) <= proto.FILE_WINDOW and r.stdout == data


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


async def test_file_errors_are_typed(clock: object, chan: GuestChannel, scratch: str) -> None:
    cases: list[tuple[Callable[[], Awaitable[object]], str]] = [
        (lambda: chan.read_bytes("/no/such/file"), proto.E_NOT_FOUND),
        (lambda: chan.read_bytes("/etc"), proto.E_IS_DIR),
        (lambda: chan.read_bytes("relative"), proto.E_INVALID),
        (lambda: chan.write_file("/no/such/dir/file", b"x"), proto.E_NOT_FOUND),
        (lambda: chan.write_file("/tmp", b"x"), proto.E_IS_DIR),
        (lambda: chan.write_file(f"{scratch}/", b"x"), proto.E_INVALID),
        (lambda: chan.write_file("/proc/x", b"x"), proto.E_NOT_FOUND),  # procfs: no new files
        (lambda: chan.write_file(f"{scratch}/f", b"x", owner="no-such-user"), proto.E_INVALID),
        (
            lambda: chan.write_file(f"{scratch}/huge", _nothing(), size=proto.MAX_FILE + 1),
            proto.E_TOO_LARGE,
        ),  # host-side
    ]
    with trio.fail_after(30):
        for i, (call, code) in enumerate(cases):
            with pytest.raises(GuestOpError) as e:
                await call()
            assert e.value.code == code, (i, e.value)
        req = chan._new_request()  # the guest enforces the limit too, whatever a host announces
        await chan.send_message(proto.WriteFile(rid=req.rid, path=f"{scratch}/huge", size=proto.MAX_FILE + 1))
        err = await req.next()
        chan._end_request(req)
        assert isinstance(err, proto.Error) and err.code == proto.E_TOO_LARGE
        assert (await chan.ping()).activity >= 0
        assert set(await _read_tree(chan, scratch)) == {"."}  # nothing was written


async def test_write_file_with_an_owner_and_a_mode(clock: object, chan: GuestChannel, scratch: str) -> None:
    with trio.fail_after(30):
        await chan.write_file(f"{scratch}/f", b"data", mode=0o4755, owner="nobody")
        async with chan.read_file(f"{scratch}/f") as f:
            assert f.mode == 0o4755
        m = (await _read_tree(chan, scratch))["f"]
    assert m == Member(tarfile.REGTYPE, 0o4755, 65534, 65534, b"data")


# --- trees and patches (protocol 2) -------------------------------------------------------


async def test_tree_round_trip_with_modes_links_and_an_owner(clock: object, chan: GuestChannel, scratch: str) -> None:
    big = os.urandom(3 * proto.WINDOW)  # beyond one window: credit flows both ways
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, mode, data, link in (
            (".", tarfile.DIRTYPE, 0o755, b"", ""),
            ("sub", tarfile.DIRTYPE, 0o750, b"", ""),
            ("sub/empty", tarfile.DIRTYPE, 0o700, b"", ""),
            ("a.txt", tarfile.REGTYPE, 0o640, b"alpha", ""),
            ("sub/big", tarfile.REGTYPE, 0o755, big, ""),
            ("link", tarfile.SYMTYPE, 0o777, b"", "sub/big"),
        ):
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.size, ti.linkname = kind, mode, len(data), link
            tf.addfile(ti, io.BytesIO(data) if data else None)
    with trio.fail_after(60):
        assert await chan.write_tree(f"{scratch}/dst", tar.getvalue(), owner="nobody") == 6
        back = await _read_tree(chan, f"{scratch}/dst")
        assert await chan.read_bytes(f"{scratch}/dst/link") == big  # a real symlink in the guest
    assert set(back) == {".", "a.txt", "link", "sub", "sub/big", "sub/empty"}
    del back["."]
    nobody = (65534, 65534)
    assert back == {
        "sub": Member(tarfile.DIRTYPE, 0o750, *nobody),
        "sub/empty": Member(tarfile.DIRTYPE, 0o700, *nobody),
        "a.txt": Member(tarfile.REGTYPE, 0o640, *nobody, b"alpha"),
        "sub/big": Member(tarfile.REGTYPE, 0o755, *nobody, big),
        "link": Member(tarfile.SYMTYPE, 0o777, *nobody, link="sub/big"),
    }


async def test_hostile_trees_are_refused_and_write_nothing_outside(
    clock: object, chan: GuestChannel, scratch: str
) -> None:
    h, outside, victim = f"{scratch}/h", f"{scratch}/outside", f"{scratch}/victim"
    with trio.fail_after(60):
        await chan.patch(
            [
                E.mkdir(h),
                E.mkdir(outside),
                E.file(victim, "victim\n"),
                E.symlink(outside, f"{h}/planted"),
                E.symlink(victim, f"{h}/file-link"),
            ]
        )
        hostile = {
            "absolute name": _tar((f"{outside}/abs", tarfile.REGTYPE, b"x")),
            "dot-dot": _tar(("a/../../outside/dotdot", tarfile.REGTYPE, b"x")),
            "through its own symlink": _tar(("l", tarfile.SYMTYPE, outside), ("l/own", tarfile.REGTYPE, b"x")),
            "through a planted symlink": _tar(("planted/planted", tarfile.REGTYPE, b"x")),
            "a directory through a symlink": _tar(("planted/sub", tarfile.DIRTYPE, b"")),
            "device": _tar(("null", tarfile.CHRTYPE, b"")),
            "fifo": _tar(("pipe", tarfile.FIFOTYPE, b"")),
            "hard link out": _tar(("hl", tarfile.LNKTYPE, "../victim")),
            "hard link to a planted name": _tar(("hl", tarfile.LNKTYPE, "file-link")),
            "not a tar": b"\x01" * 4096,
            "truncated": _tar(("t", tarfile.REGTYPE, os.urandom(20000)))[:6000],
        }
        for what, data in hostile.items():
            with pytest.raises(GuestOpError) as e:
                await chan.write_tree(h, data)
            assert e.value.code == proto.E_INVALID, (what, e.value)
        for path, owner, code in (("relative", "", proto.E_INVALID), (f"{scratch}/t", "no-such-user", proto.E_INVALID)):
            with pytest.raises(GuestOpError) as e:
                await chan.write_tree(path, _tar(("f", tarfile.REGTYPE, b"x")), owner=owner)
            assert e.value.code == code
        with pytest.raises(GuestOpError) as e:
            await chan.write_tree(victim, _tar(("f", tarfile.REGTYPE, b"x")))  # onto a file
        assert e.value.code == proto.E_EXISTS
        # nothing outside, the victim intact (inside: guestd writes as it goes, the fake checks first)
        assert set(await _read_tree(chan, outside)) == {"."}
        assert await chan.read_bytes(victim) == b"victim\n"
        # a file member at a planted symlink's name replaces the link, never writes through it
        assert await chan.write_tree(h, _tar(("file-link", tarfile.REGTYPE, b"new"))) == 1
        assert await chan.read_bytes(victim) == b"victim\n"
        assert await chan.read_bytes(f"{h}/file-link") == b"new"
        assert (await chan.ping()).activity >= 0  # and the channel is fine


async def test_read_tree_errors_and_an_early_exit(clock: object, chan: GuestChannel, scratch: str) -> None:
    with trio.fail_after(60):
        await chan.write_file(f"{scratch}/file", b"hi")
        for path, code in (
            (f"{scratch}/nowhere", proto.E_NOT_FOUND),
            (f"{scratch}/file", proto.E_NOT_FOUND),
            ("rel", proto.E_INVALID),
        ):
            with pytest.raises(GuestOpError) as e:
                await _read_tree(chan, path)
            assert e.value.code == code
        await chan.patch([E.file(f"{scratch}/big/blob", os.urandom(proto.MAX_FRAME // 2))])
        async with chan.read_tree(f"{scratch}/big") as tar:
            async for _chunk in tar:
                break  # leaving early: the host cancels the guest's side
        while chan.statistics().requests_in_flight:
            await trio.sleep(0.01)
        assert (await chan.ping()).activity >= 0


async def test_patch_entries_in_order_with_owners_and_modes(clock: object, chan: GuestChannel, scratch: str) -> None:
    app = f"{scratch}/app"
    with trio.fail_after(60):
        n = await chan.patch(
            [
                E.mkdir(f"{app}/conf", mode=0o750, owner="nobody"),
                E.file(f"{app}/conf/a.txt", "ready\n", mode=0o600, owner="nobody:nogroup"),
                E.append(f"{app}/conf/a.txt", b"more\n"),
                E.symlink(f"{app}/conf/a.txt", f"{app}/current"),
                E.file(f"{app}/run.sh", "#!/bin/sh\necho ran\n", mode=0o755, owner="1234:5678"),
                E.file(f"{scratch}/deep/new/dir/f", b"x"),
                E.remove(f"{app}/never-there"),
            ]
        )
        assert n == 7
        tree = await _read_tree(chan, app)
        assert tree["conf"] == Member(tarfile.DIRTYPE, 0o750, 65534, 65534)
        assert tree["conf/a.txt"] == Member(tarfile.REGTYPE, 0o600, 65534, 65534, b"ready\nmore\n")
        assert (tree["current"].type, tree["current"].link) == (tarfile.SYMTYPE, f"{app}/conf/a.txt")
        assert tree["run.sh"] == Member(tarfile.REGTYPE, 0o755, 1234, 5678, b"#!/bin/sh\necho ran\n")
        assert await chan.read_bytes(f"{scratch}/deep/new/dir/f") == b"x"
        # replace=False refuses an existing path; the error names the entry; earlier entries stay
        with pytest.raises(GuestOpError) as e:
            await chan.patch([E.file(f"{app}/b", "b"), E.file(f"{app}/conf/a.txt", "again")])
        assert e.value.code == proto.E_EXISTS and f"entry 1 ({app}/conf/a.txt)" in e.value.message
        assert await chan.read_bytes(f"{app}/b") == b"b"
        await chan.patch([E.file(f"{app}/conf/a.txt", "again", replace=True), E.remove(f"{app}/conf")])
        assert "conf" not in await _read_tree(chan, app)
        # a patch bigger than a frame is split; the numbers in errors stay the patch's own
        half = bytes(proto.MAX_FRAME // 2)
        with pytest.raises(GuestOpError) as e:
            await chan.patch([E.file(f"{scratch}/p/{i}", half) for i in range(3)] + [E.mkdir(f"{scratch}/p/0")])
        assert f"entry 3 ({scratch}/p/0)" in e.value.message and e.value.code == proto.E_EXISTS
        for bad, code in (
            (E.file(f"{scratch}/x", "x", owner="no-such-user"), proto.E_INVALID),
            (E.file(f"{scratch}/x", "x", owner="nobody:no-such-group"), proto.E_INVALID),
            (E("file", "relative"), proto.E_INVALID),
            (E.mkdir("/"), proto.E_INVALID),
            (E.file(app, "x", replace=True), proto.E_IS_DIR),
        ):
            with pytest.raises(GuestOpError) as e:
                await chan.patch([bad])
            assert e.value.code == code, (bad, e.value)
        with pytest.raises(GuestOpError) as e:
            await chan.patch([E.file(f"{scratch}/huge", bytes(proto.MAX_FRAME))])  # refused on the host: use write_file
        assert e.value.code == proto.E_TOO_LARGE
