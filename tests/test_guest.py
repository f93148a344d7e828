"""guestd against a real VM (TCG): exec, streams, PTY, timeouts, flow control, files."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
import trio

from actors.guest import GuestChannel, GuestOpError
from guestd import proto as P

pytestmark = pytest.mark.vm


async def test_hello_reports_boot(chan: GuestChannel) -> None:
    info = chan.hello_info
    assert info is not None
    assert info.version == P.PROTOCOL_VERSION
    assert info.pid == 1  # guestd is PID 1
    assert 0 < info.boot_ns <= info.ready_ns
    assert {"init", "modules", "rootfs", "python", "ready"} <= set(info.marks)


async def test_exact_streams_and_exit_code(chan: GuestChannel) -> None:
    with trio.fail_after(30):
        r = await chan.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.stdout, r.stderr, r.exit_code, r.signal, r.timed_out) == (b"out\n", b"err\n", 3, 0, False)


async def test_env_cwd_user_and_rootfs(chan: GuestChannel) -> None:
    with trio.fail_after(30):
        r = await chan.run(["sh", "-c", 'echo "$FOO $(pwd) $(id -u) $HOME"'], env={"FOO": "bar"}, cwd="/tmp")
        assert r.stdout == b"bar /tmp 0 /root\n"
        r = await chan.run(["id", "-un"], user="nobody")
        assert r.stdout == b"nobody\n"
        r = await chan.run(["sh", "-c", "cat /etc/os-release | head -1; ls -d /dev/pts /tmp"])
        assert b"Debian" in r.stdout  # user processes see the rootfs, not guestd's runtime


async def test_unknown_user_and_missing_binary_are_typed(chan: GuestChannel) -> None:
    with trio.fail_after(30):
        with pytest.raises(GuestOpError) as e:
            await chan.run(["true"], user="no-such-user")
        assert e.value.code == P.E_INVALID
        with pytest.raises(GuestOpError) as e:
            await chan.run(["/no/such/binary"])
        assert e.value.code == P.E_NOT_FOUND
        with pytest.raises(GuestOpError) as e:
            await chan.run(["true"], cwd="/no/such/dir")
        assert e.value.code == P.E_NOT_FOUND


async def test_stdin_round_trip_through_cat(chan: GuestChannel) -> None:
    payload = os.urandom(1 << 20)
    got = bytearray()
    with trio.fail_after(60):
        async with chan.exec(["cat"], stdin=True) as h, trio.open_nursery() as n:

            async def feed() -> None:
                await h.send_stdin(payload)
                await h.close_stdin()

            n.start_soon(feed)
            async for ch, data in h:
                assert ch == P.STDOUT
                got += data
    assert h.exit is not None and h.exit.code == 0
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()


async def test_pty_names_a_terminal_and_follows_resize(chan: GuestChannel) -> None:
    out = bytearray()
    with trio.fail_after(30):
        async with chan.exec(["sh"], tty=True, stdin=True, rows=30, cols=100) as h:
            await h.send_stdin(b"tty; stty size\n")
            async for _ch, data in h:
                out += data
                if b"30 100" in out:
                    break
            await h.resize(40, 132)
            await h.send_stdin(b"stty size; exit 7\n")
            async for _ch, data in h:
                out += data
    text = out.decode(errors="replace")
    assert "/dev/pts/" in text
    assert "30 100" in text and "40 132" in text
    assert h.exit is not None and h.exit.code == 7


async def test_timeout_kills(chan: GuestChannel) -> None:
    t = time.monotonic()
    with trio.fail_after(30):
        r = await chan.run(["sleep", "60"], timeout=1.0)
    assert r.timed_out and r.signal == signal.SIGKILL and r.exit_code == 128 + signal.SIGKILL
    assert time.monotonic() - t < 20


async def test_signal_reaches_process(chan: GuestChannel) -> None:
    with trio.fail_after(30):
        async with chan.exec(["sleep", "60"]) as h:
            await h.signal(signal.SIGTERM)
            ex = await h.wait()
    assert ex.signal == signal.SIGTERM


async def test_background_child_does_not_hang_exec(chan: GuestChannel) -> None:
    with trio.fail_after(30):
        r = await chan.run(["sh", "-c", "sleep 30 & echo started"])
    assert r.stdout == b"started\n" and r.exit_code == 0


async def test_flood_does_not_stall_others(chan: GuestChannel) -> None:
    """One process floods 50 MiB; ten others run to completion and a ping round-trips meanwhile."""
    flood_bytes = 0
    results: list[bytes] = []
    pings: list[float] = []
    with trio.fail_after(180):
        async with trio.open_nursery() as n:
            flood_started = trio.Event()
            flood_done = trio.Event()

            async def flood() -> None:
                nonlocal flood_bytes
                async with chan.exec(["head", "-c", str(50 << 20), "/dev/zero"]) as h:
                    flood_started.set()
                    async for _ch, data in h:
                        flood_bytes += len(data)
                        await trio.sleep(0)  # a consumer, not a spin
                flood_done.set()

            async def small(i: int) -> None:
                await flood_started.wait()
                r = await chan.run(["sh", "-c", f"echo job{i}"])
                results.append(r.stdout)

            async def pinger() -> None:
                await flood_started.wait()
                while not flood_done.is_set() and len(pings) < 5:
                    t = time.monotonic()
                    await chan.ping()
                    pings.append(time.monotonic() - t)
                    await trio.sleep(0.05)

            n.start_soon(flood)
            for i in range(10):
                n.start_soon(small, i)
            n.start_soon(pinger)
    assert flood_bytes == 50 << 20
    assert sorted(results) == sorted(f"job{i}\n".encode() for i in range(10))
    assert pings, "no ping completed during the flood"
    st = chan.statistics()
    assert st.requests_in_flight == 0


async def test_slow_consumer_bounds_buffering(chan: GuestChannel) -> None:
    """A consumer that does not read: the guest stops at the credit window."""
    with trio.fail_after(30):
        async with chan.exec(["head", "-c", str(20 << 20), "/dev/zero"]) as h:
            await trio.sleep(1.0)
            req = chan._reqs[h.rid]
            buffered = req.buffered
            assert buffered <= P.WINDOW
        # leaving the block killed the process; the channel still works
        assert (await chan.run(["echo", "ok"])).stdout == b"ok\n"


async def test_file_round_trip_20mib(chan: GuestChannel) -> None:
    data = os.urandom(20 << 20)
    with trio.fail_after(120):
        n = await chan.write_file("/tmp/blob", data, mode=0o600)
        assert n == len(data)
        back = await chan.read_bytes("/tmp/blob")
        r = await chan.run(["sh", "-c", "sha256sum /tmp/blob; stat -c %a /tmp/blob"])
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    assert r.stdout.split()[-1] == b"600"


async def test_file_errors_are_typed(chan: GuestChannel) -> None:
    with trio.fail_after(30):
        with pytest.raises(GuestOpError) as e:
            await chan.read_bytes("/no/such/file")
        assert e.value.code == P.E_NOT_FOUND
        with pytest.raises(GuestOpError) as e:
            await chan.read_bytes("/etc")
        assert e.value.code == P.E_IS_DIR
        with pytest.raises(GuestOpError) as e:
            await chan.write_file("/no/such/dir/file", b"x")
        assert e.value.code == P.E_NOT_FOUND
        with pytest.raises(GuestOpError) as e:
            await chan.write_file("/tmp", b"x")
        assert e.value.code == P.E_IS_DIR
        with pytest.raises(GuestOpError) as e:
            await chan.write_file("/proc/sys/x", b"x")
        assert e.value.code in (P.E_PERM, P.E_NOT_FOUND)
        with pytest.raises(GuestOpError) as e:
            await chan.write_file("/tmp/huge", _nothing(), size=P.MAX_FILE + 1)
        assert e.value.code == P.E_TOO_LARGE
        # the guest enforces the limit too, whatever a host announces
        req = chan._new_request()
        await chan._send(P.WriteFile(rid=req.rid, path="/tmp/huge", size=P.MAX_FILE + 1))
        err = await req.next()
        chan._end_request(req)
        assert isinstance(err, P.Error) and err.code == P.E_TOO_LARGE
        # the channel is still healthy after all of that
        assert (await chan.ping()).activity >= 0


async def _nothing() -> AsyncIterator[bytes]:
    if False:
        yield b""


async def test_ping_does_not_touch_but_touch_does(chan: GuestChannel) -> None:
    with trio.fail_after(30):
        a = (await chan.ping()).activity
        b = (await chan.ping()).activity
        c = await chan.touch()
    assert a == b and c == b + 1


async def test_metrics(chan: GuestChannel) -> None:
    with trio.fail_after(30):
        m = await chan.metrics()
    assert m.uptime > 0 and m.ncpu >= 1
    assert m.mem["total"] > 100 << 20 and 0 < m.mem["available"] <= m.mem["total"]
    assert m.cpu_seconds["user"] + m.cpu_seconds["system"] > 0
    assert m.disk["read_bytes"] > 0


async def test_set_clock_and_entropy(chan: GuestChannel) -> None:
    with trio.fail_after(30):
        await chan.set_clock(time.time_ns() + 3600 * 10**9)
        r = await chan.run(["date", "+%s"])
        assert abs(int(r.stdout) - (time.time() + 3600)) < 5
        await chan.set_clock()
        r = await chan.run(["date", "+%s"])
        assert abs(int(r.stdout) - time.time()) < 5
        await chan.add_entropy(64)
        await chan.set_hostname("renamed")
        assert (await chan.run(["hostname"])).stdout == b"renamed\n"


async def test_survives_host_disconnect(chan: GuestChannel, shared_vm: object) -> None:
    """A process started by a host that went away keeps running; a new host is served."""
    from actors.guest import open_channel

    with trio.fail_after(60):
        async with chan.exec(["sh", "-c", "sleep 1; echo survived > /tmp/survivor"]):
            pass  # leaving kills it: use a detached one instead
        await chan.run(
            ["sh", "-c", "rm -f /tmp/survivor; (sleep 1; echo survived > /tmp/survivor) </dev/null >/dev/null 2>&1 &"]
        )
        await chan.aclose()
        for _ in range(3):  # connect, drop, connect again
            stream = await trio.open_unix_socket(str(shared_vm.guest_socket))  # type: ignore[attr-defined]
            async with open_channel(stream, hello_timeout=30) as c2:
                assert (await c2.ping()).activity >= 0
        stream = await trio.open_unix_socket(str(shared_vm.guest_socket))  # type: ignore[attr-defined]
        async with open_channel(stream, hello_timeout=30) as c3:
            while True:  # the background writer may not have run yet under TCG
                try:
                    if await c3.read_bytes("/tmp/survivor") == b"survived\n":
                        break
                except GuestOpError:
                    pass
                await trio.sleep(0.2)


async def test_vsock_listener_with_loopback(chan: GuestChannel) -> None:
    """guestd listens on AF_VSOCK where the guest has a transport (vsock_loopback here):
    a client inside the guest speaks the same framing to it."""
    hello = (P.HOST_SYNC + P.encode(P.Hello(version=P.PROTOCOL_VERSION))).hex()
    sync = P.GUEST_SYNC.hex()
    ping = P.encode(P.Ping(rid=7)).hex()
    script = f"""
import socket, struct
s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
s.settimeout(10)
s.connect((1, 1024))  # VMADDR_CID_LOCAL
s.sendall(bytes.fromhex("{hello}") + bytes.fromhex("{ping}"))
buf = b""
while bytes.fromhex("{sync}") not in buf:
    buf += s.recv(65536)
buf = buf.split(bytes.fromhex("{sync}"), 1)[1]
frames = []
while True:
    while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
        n = struct.unpack(">I", buf[:4])[0]
        frames.append(buf[4:4 + n]); buf = buf[4 + n:]
    if len(frames) >= 2:
        break
    buf += s.recv(65536)
print(frames[0].hex()); print(frames[1].hex())
"""
    with trio.fail_after(60):
        r = await chan.run(["python3", "-c", script])
    assert r.exit_code == 0, r.stderr
    first, second = (P.decode(bytes.fromhex(x.decode())) for x in r.stdout.split())
    assert isinstance(first, P.HelloOk) and "vsock" in first.features
    assert isinstance(second, P.Pong) and second.rid == 7
