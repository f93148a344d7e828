"""The real host channel (actors.channel.guest) against the in-process fake guestd (tests/support/fakeguest.py).

No QEMU, and nearly all on Trio's autojump clock (the guest's sleeps and the host's
timeouts cost no wall time): measured 0.6 s for the file on a quiet machine, 2-5 s
with the machine's two cores loaded 10-20 deep by VM boots. The protocol itself (exec,
streams, credit, files, trees, patches, reconnect) is pinned down once for the fake and
guestd alike in test_guest_contract.py; here is what only the fake can show: its own
model (commands, the mini shell, the clock) and what the host does with each hostile
guest behaviour: a guest silent after its hello, one that
ignores timeouts and kills, floods frames with unknown ids, overruns credit, answers
with the wrong message, hangs up mid-request, or stops reading. Each of these was a
hang or an untyped error once (strict xfails, written first); each is now bounded by
a host-side deadline or typed.
"""

from __future__ import annotations

import os
import signal
import socket
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from actors.channel.guest import (
    KILL_GRACE,
    ChannelBroken,
    GuestChannel,
    GuestError,
    GuestOpError,
    GuestProtocolError,
    GuestTimeout,
    HelloTimeout,
    open_channel,
)
from guestd import proto
from tests.support.fakeguest import Command, FakeGuest, fake_guest


@pytest.fixture
async def guest() -> AsyncIterator[FakeGuest]:
    assert isinstance(trio.lowlevel.current_clock(), MockClock), "take autojump_clock: hangs must cost no time"
    async with fake_guest(hostname="fake") as g:
        yield g


@pytest.fixture
async def chan(guest: FakeGuest) -> AsyncIterator[GuestChannel]:
    async with open_channel(guest.connect(), hello_timeout=5) as c:
        yield c


# --- session ------------------------------------------------------------------------


async def test_hello_reports_boot_and_sets_the_clock(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    info = chan.hello_info
    assert info is not None and info.version == proto.PROTOCOL_VERSION and info.pid == 1
    assert 0 < info.boot_ns <= info.ready_ns
    assert {"init", "modules", "rootfs", "python", "ready"} <= set(info.marks)
    assert "exec" in info.features
    assert guest.hellos == 1 and len(guest.clock_sets) == 1  # Hello.host_time_ns set the clock
    assert chan.hello_rtt >= 0.0  # a restore sets the clock again when this is stale
    chan.hello_rtt = 1.0
    assert chan.clock_stale


async def test_shutdown_powers_off_and_the_stream_closes(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    with trio.fail_after(5):
        async with chan.exec(["sleep", "100"]):
            await chan.shutdown()  # answered Ok first, then the VM is gone
            while not chan.broken:
                await trio.sleep(0.01)
        with pytest.raises(ChannelBroken):
            await chan.ping()
    assert guest.shutdowns == [False] and guest.off
    assert guest.execs[0].exit is None  # killed with the VM: no Exit was ever sent
    with pytest.raises(ConnectionRefusedError):
        guest.connect()


# --- exec -----------------------------------------------------------------------------


async def test_sleep_runs_on_trio_time(autojump_clock: MockClock, chan: GuestChannel) -> None:
    t = trio.current_time()
    with trio.fail_after(7200):
        assert (await chan.run(["sleep", "3600"])).exit_code == 0
    assert trio.current_time() - t >= 3600


async def test_a_tests_own_command(autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel) -> None:
    @guest.command("greet")
    async def greet(cmd: Command) -> int:
        name = (await cmd.read_all()).decode().strip() or cmd.argv[1]
        await cmd.write(f"hello {name} from {cmd.proc.env['HOSTNAME']}\n")
        await cmd.error("done\n")
        return 42

    async def fails(cmd: Command) -> int:
        await trio.sleep(1)
        return 1

    guest.commands["fails"] = fails
    with trio.fail_after(5):
        r = await chan.run(["greet", "world"])
        assert (r.stdout, r.stderr, r.exit_code) == (b"hello world from fake\n", b"done\n", 42)
        async with chan.exec(["/usr/bin/greet", "x"], stdin=True) as h:
            await h.send_stdin(b"stdin\n")
            await h.close_stdin()
            assert [d async for _ch, d in h] == [b"hello stdin from fake\n", b"done\n"]
        r = await chan.run(["sh", "-c", "greet you > /tmp/g; fails || cat /tmp/g"])
        assert (r.stdout, r.stderr, r.exit_code) == (b"hello you from fake\n", b"done\n", 0)


async def test_background_processes_ps_and_kill(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    with trio.fail_after(5):
        r = await chan.run(["sh", "-c", "sleep 100 & echo started"])
        assert (r.stdout, r.exit_code) == (b"started\n", 0)  # the background child does not hold the exec
        ps = (await chan.run(["ps"])).stdout.decode()
        (pid,) = [line.split()[0] for line in ps.splitlines() if line.endswith(" sleep 100")]
        assert (await chan.run(["kill", "-KILL", pid])).exit_code == 0
        await trio.testing.wait_all_tasks_blocked()
        assert "sleep 100" not in (await chan.run(["ps"])).stdout.decode()
        assert (await chan.run(["kill", pid])).stderr == f"kill: ({pid}) - No such process\n".encode()


# --- files ------------------------------------------------------------------------------


async def test_a_write_under_a_read_only_tree_is_permission_denied(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    """The fake's stand-in for a read-only mount (the rest of the file errors: the contract)."""
    guest.mkdir("/ro")
    guest.readonly.add("/ro")
    with trio.fail_after(5), pytest.raises(GuestOpError) as e:
        await chan.write_file("/ro/x", b"x")
    assert e.value.code == proto.E_PERM and "/ro/x" not in guest.files


async def test_shell_redirections_and_file_commands(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    guest.files["/etc/motd"] = (0o644, b"welcome\n")
    with trio.fail_after(5):
        r = await chan.run(["sh", "-c", "mkdir -p /srv/a; echo a > /srv/a/x; cd /srv; echo b >> /srv/a/x"])
        assert (r.stderr, r.exit_code) == (b"sh: 1: cd: not found\n", 0)  # no cd in the mini shell
        r = await chan.run(["sh", "-c", "cat /srv/a/x /etc/motd; touch /srv/t; rm -r /srv/a; cat /srv/a/x"])
        assert (r.stdout, r.stderr, r.exit_code) == (
            b"a\nb\nwelcome\n",
            b"cat: /srv/a/x: No such file or directory\n",
            1,
        )
        assert await chan.read_bytes("/srv/t") == b""
        assert (await chan.run(["sh", "-c", "echo x > /no/dir/f"])).exit_code == 2
    assert "/srv/a" not in guest.dirs and "/srv" in guest.dirs


# --- reconnect --------------------------------------------------------------------------


async def test_stale_bytes_before_a_new_hello_are_skipped(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    with trio.fail_after(5):
        await chan._stream.send_all(b"\x00\x00\x00\x03\xc1\xc1\xc1")  # a stale frame: not msgpack
        await trio.testing.wait_all_tasks_blocked()
        assert guest.protocol_errors  # like guestd: logged, then input is discarded up to HOST_SYNC
        await chan.hello(5)
        assert (await chan.ping()).activity >= 0
    assert guest.hellos == 2


async def test_a_send_cancelled_mid_frame_breaks_the_channel(autojump_clock: MockClock, guest: FakeGuest) -> None:
    """A cancelled send may leave half a frame: the guest would read what follows as its
    body. The host poisons the channel instead of sending into it again."""
    guest.hostile.deaf = True  # the host's send blocks in send_all
    async with fake_guest() as g2, open_channel(g2.connect_socket(), hello_timeout=5) as chan:
        g2.hostile.deaf = True
        with trio.move_on_after(1):
            await chan.write_file("/tmp/f", bytes(8 << 20))  # cancelled while a frame is half out
        with trio.fail_after(5), pytest.raises(ChannelBroken, match="mid-frame"):
            await chan.ping()


async def test_a_cancel_waits_for_its_frame_and_the_channel_stays_usable(autojump_clock: MockClock) -> None:
    """A caller cancelled while its frame is going out (a client's Cancel or deadline
    during a Run's credit grants or an Exec's input) lets the frame finish: the channel
    and every other request on it go on."""
    async with fake_guest() as g, open_channel(g.connect_socket(), hello_timeout=5) as chan:
        g.hostile.deaf = True  # the host's send blocks in send_all, mid-frame

        async def hear_again() -> None:
            await trio.sleep(3)
            g.hostile.deaf = False

        async with trio.open_nursery() as n:
            n.start_soon(hear_again)
            with trio.move_on_after(1) as cancelled:
                await chan.write_file("/tmp/f", bytes(8 << 20))
        assert cancelled.cancelled_caught
        with trio.fail_after(5):
            assert (await chan.ping()).activity >= 0


async def test_over_a_socketpair_with_the_real_clock() -> None:
    payload = os.urandom(1 << 20)
    async with fake_guest() as guest, open_channel(guest.connect_socket(), hello_timeout=5) as chan:
        with trio.fail_after(10):
            async with chan.exec(["cat"], stdin=True) as h, trio.open_nursery() as n:

                async def feed() -> None:
                    await h.send_stdin(payload)
                    await h.close_stdin()

                n.start_soon(feed)
                got = b"".join([d async for _ch, d in h])
            assert got == payload
            assert (await chan.run(["sh", "-c", "sleep 0.01; echo ok"])).stdout == b"ok\n"


# --- hostile guests ---------------------------------------------------------------------


async def test_a_silent_guest_fails_hello_with_a_timeout(autojump_clock: MockClock, guest: FakeGuest) -> None:
    guest.hostile.silent = True
    with trio.fail_after(60), pytest.raises(HelloTimeout):
        async with open_channel(guest.connect(), hello_timeout=5):
            pass


_REQUESTS: dict[str, Callable[[GuestChannel], Awaitable[object]]] = {
    "ping": lambda c: c.ping(),
    "touch": lambda c: c.touch(),
    "metrics": lambda c: c.metrics(),
    "set_clock": lambda c: c.set_clock(),
    "add_entropy": lambda c: c.add_entropy(),
    "set_hostname": lambda c: c.set_hostname("x"),
    "shutdown": lambda c: c.shutdown(),
    "run": lambda c: c.run(["true"], timeout=1),
    "read_file": lambda c: c.read_bytes("/etc/hostname"),
    "write_file": lambda c: c.write_file("/tmp/f", b"x"),
}


@pytest.mark.parametrize("request_", list(_REQUESTS))
async def test_a_guest_silent_after_hello_fails_every_request_in_time(
    autojump_clock: MockClock, guest: FakeGuest, request_: str
) -> None:
    guest.hostile.silent_after_hello = True
    async with open_channel(guest.connect(), hello_timeout=5, answer_timeout=30) as chan:
        t0 = trio.current_time()
        with trio.fail_after(600), pytest.raises(GuestTimeout):
            await _REQUESTS[request_](chan)
        assert trio.current_time() - t0 == pytest.approx(30, abs=1)


async def test_leaving_an_exec_whose_process_ignores_kills_returns_but_leaks_it(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    guest.hostile.ignore_kills = True
    with trio.fail_after(5):
        async with chan.exec(["sleep", "3600"]) as h:
            pid = h.pid
        await trio.testing.wait_all_tasks_blocked()
    # the host sent SIGKILL and moved on: it never learns that the process is still there
    assert pid in guest.processes and guest.processes[pid].signals == [signal.SIGKILL]


async def test_a_timeout_the_guest_ignores_ends_the_run_on_the_host(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    guest.hostile.ignore_kills = True
    t0 = trio.current_time()
    with trio.fail_after(600), pytest.raises(GuestTimeout, match="past its 1s timeout"):
        await chan.run(["sleep", "3600"], timeout=1)
    assert trio.current_time() - t0 == pytest.approx(1 + KILL_GRACE, abs=0.5)


async def test_a_kill_the_guest_ignores_ends_the_wait_on_the_host(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    guest.hostile.ignore_kills = True
    async with chan.exec(["sleep", "3600"]) as h:
        await h.signal(signal.SIGKILL)
        with trio.fail_after(600), pytest.raises(GuestTimeout, match="SIGKILL"):
            await h.wait()


async def test_a_flood_of_unknown_request_ids_is_dropped(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    guest.hostile.flood_unknown_rids = 100
    with trio.fail_after(5):
        assert (await chan.ping()).activity >= 0
        assert (await chan.run(["echo", "hi"])).stdout == b"hi\n"
    assert chan.statistics().dropped == 200 and not chan.broken


async def test_exec_output_beyond_credit_breaks_the_channel(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    guest.hostile.overrun_credit = True
    with trio.fail_after(5):
        async with chan.exec(["head", "-c", str(1 << 20), "/dev/zero"]) as h:  # a consumer that never reads
            await trio.testing.wait_all_tasks_blocked()
            assert chan.broken
            with pytest.raises(GuestProtocolError, match="beyond granted credit"):
                await h.wait()
        with pytest.raises(ChannelBroken):
            await chan.ping()


async def test_file_contents_beyond_credit_break_the_channel(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    guest.files["/tmp/big"] = (0o644, bytes(2 * proto.FILE_WINDOW))  # beyond the whole file window
    guest.hostile.overrun_credit = True
    with trio.fail_after(5):
        async with chan.read_file("/tmp/big") as f:
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(GuestProtocolError, match="beyond granted credit"):
                async for _chunk in f:
                    pass
        with pytest.raises(ChannelBroken):
            await chan.ping()


@pytest.mark.parametrize("request_", ["ping", "touch", "metrics", "set_hostname", "run", "read_file"])
async def test_a_wrong_reply_type_is_a_protocol_error(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel, request_: str
) -> None:
    guest.files["/etc/hostname"] = (0o644, b"fake\n")
    guest.hostile.wrong_reply = True
    with trio.fail_after(5):
        with pytest.raises(GuestProtocolError, match="expected"):
            await _REQUESTS[request_](chan)
        assert chan.broken


async def test_a_wrong_reply_to_write_file_is_a_protocol_error(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    guest.hostile.wrong_reply = True
    with trio.fail_after(5), pytest.raises(GuestProtocolError, match="expected ok"):
        await chan.write_file("/tmp/f", b"x")


@pytest.mark.parametrize("request_", ["ping", "exec", "read_file"])
async def test_a_stream_closed_mid_request_breaks_the_call_and_the_guest_lives_on(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel, request_: str
) -> None:
    guest.files["/tmp/big"] = (0o644, bytes(1 << 20))
    guest.hostile.close_mid_request = True
    with trio.fail_after(30):
        with pytest.raises(ChannelBroken):
            if request_ == "exec":  # exec_started, then the guest hangs up
                async with chan.exec(["sh", "-c", "sleep 10; echo done > /tmp/done"]) as h:
                    await h.wait()
            elif request_ == "read_file":  # file_info, then the guest hangs up
                await chan.read_bytes("/tmp/big")
            else:
                await chan.ping()
        guest.hostile.close_mid_request = False
        async with open_channel(guest.connect()) as c2:
            assert (await c2.ping()).activity >= 0
            if request_ == "exec":  # the process started before the hang-up runs on
                await trio.sleep(11)
                assert await c2.read_bytes("/tmp/done") == b"done\n"


async def _capture(call: Callable[[], Awaitable[object]], into: list[Exception]) -> None:
    try:
        await call()
    except Exception as exc:
        into.append(exc.with_traceback(None))  # no cycle through the frames: they go now, not at some GC


async def test_a_write_file_broken_midway_closes_what_it_opened(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    guest.hostile.silent = True  # the write stops at the end of its credit window
    errors: list[Exception] = []
    with warnings.catch_warnings(record=True) as caught, trio.fail_after(5):
        warnings.simplefilter("always")
        async with trio.open_nursery() as n:
            n.start_soon(_capture, lambda: chan.write_file("/tmp/f", bytes(1 << 20)), errors)
            await trio.testing.wait_all_tasks_blocked()
            guest.power_off()  # the VM dies under the write
    assert [type(e) for e in errors] == [ChannelBroken]
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


async def test_a_send_blocked_when_the_channel_breaks_raises_a_guest_error() -> None:
    """Real clock, real socketpair: the guest stops reading, so the host's write blocks in
    send_all; then a process floods beyond credit and the reader closes the stream."""
    go = trio.Event()

    async def flood(cmd: Command) -> int:
        await go.wait()
        await cmd.write(bytes(2 * proto.WINDOW))
        return 0

    errors: list[Exception] = []
    async with fake_guest(commands={"flood": flood}) as guest:
        stream = guest.connect_socket()
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # well below one credit window
        async with open_channel(stream) as chan:
            with trio.fail_after(10):
                async with chan.exec(["flood"]), trio.open_nursery() as n:  # a consumer that never reads
                    guest.hostile.deaf = guest.hostile.overrun_credit = True
                    n.start_soon(_capture, lambda: chan.write_file("/tmp/f", bytes(4 << 20)), errors)
                    await trio.testing.wait_all_tasks_blocked()  # the write is stuck in send_all
                    go.set()
    (exc,) = errors
    assert isinstance(exc, GuestError), exc


async def test_stdin_to_an_exec_without_stdin_is_refused_on_the_host(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel
) -> None:
    """guestd would take it as a protocol error and ignore the host until its next
    hello: the host refuses to send it."""
    async with chan.exec(["sleep", "10"]) as h:
        with pytest.raises(GuestOpError, match="without stdin"):
            await h.send_stdin(b"x")
        assert (await h.wait()).code == 0
    assert guest.protocol_errors == []
    with trio.fail_after(5):
        assert (await chan.ping()).activity >= 0


# --- trees, patches, mounts (protocol 2) ----------------------------------------------


async def test_mounts_of_the_disks_there_are() -> None:
    async with (
        fake_guest(disks={"serial:vol0": False, "serial:ro": True}) as guest,
        open_channel(guest.connect(), hello_timeout=5) as chan,
    ):
        with trio.fail_after(10):
            await chan.mount("serial:vol0", "/data")
            await chan.mount("serial:ro", "/ro", read_only=True)
            assert guest.mounts == {"/data": ("serial:vol0", False), "/ro": ("serial:ro", True)}
            for args, kw, code in (
                (("serial:nope", "/x"), {}, proto.E_NOT_FOUND),
                (("serial:ro", "/rw"), {}, proto.E_PERM),
                (("serial:vol0", "/data"), {}, proto.E_EXISTS),
                (("serial:vol0", "/"), {}, proto.E_INVALID),
            ):
                with pytest.raises(GuestOpError) as e:
                    await chan.mount(*args, **kw)  # type: ignore[arg-type]
                assert e.value.code == code
            with pytest.raises(GuestOpError):
                await chan.write_file("/ro/f", b"x")  # read-only: EROFS
            await chan.umount("/ro")
            assert list(guest.mounts) == ["/data"]
            with pytest.raises(GuestOpError) as e:
                await chan.umount("/ro")
            assert e.value.code == proto.E_INVALID


@pytest.mark.parametrize(
    ("tampered", "request_"),
    [
        ({"metrics_ok": {"mem": {"total": -1}}}, "metrics"),
        ({"metrics_ok": {"uptime": float("nan")}}, "metrics"),
        ({"metrics_ok": {"net": {"rx_bytes": 2**64 - 1}}}, "metrics"),
        ({"metrics_ok": {"uptime": "soon"}}, "metrics"),  # a wrong type: the codec's own check
        ({"pong": {"activity": -1}}, "ping"),
        ({"exit": {"code": 2**64 - 1}}, "run"),
        ({"file_info": {"size": -1}}, "read_file"),
    ],
)
async def test_an_answer_out_of_the_hosts_range_is_a_protocol_error(
    autojump_clock: MockClock, guest: FakeGuest, chan: GuestChannel, tampered: dict[str, Any], request_: str
) -> None:
    """Numbers the host could not hold (SQLite's and protobuf's int64, uint64 counters,
    int32 exit codes) or not finite: the guest broke the protocol, its channel closes."""
    guest.files["/etc/hostname"] = (0o644, b"fake\n")
    guest.hostile.tampered = tampered
    with trio.fail_after(5):
        with pytest.raises(GuestProtocolError, match=r"out of range|wrong type"):
            await _REQUESTS[request_](chan)
        assert chan.broken
    guest.hostile.tampered = {}
    async with open_channel(guest.connect()) as c2:  # the guest itself is served again
        assert (await c2.metrics()).mem["total"] > 0


async def test_garbage_after_the_hello_breaks_the_channel_not_the_host(
    autojump_clock: MockClock, guest: FakeGuest
) -> None:
    guest.hostile.garbage_after_hello = b"\x00\x00\x00\x03\xc1\xc1\xc1"
    with trio.fail_after(5):
        async with open_channel(guest.connect()) as chan:
            with pytest.raises(GuestProtocolError, match="undecodable"):
                await chan.ping()
            assert chan.broken
        async with open_channel(guest.connect()) as c2:  # sent once: the next host is fine
            assert (await c2.ping()).activity >= 0
