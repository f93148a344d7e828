"""guestd against a real VM (TCG): exec, streams, PTY, timeouts, flow control, files,
trees, patches and volumes."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from conftest import cold_spec

from actors.guest import GuestChannel, GuestOpError, PatchEntry
from actors.qemuspec import TooManyDevices, Volume
from actors.vm import booted_guest
from actors.volumes import check_volume_image, create_volume_image
from guestd import proto as P
from images.build import Image
from supervisor.treecopy import packed_tree, unpack_tree

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


async def test_stdin_a_process_closed_is_credited_back(chan: GuestChannel) -> None:
    """Stdin that arrives after the process closed its input is dropped and credited
    back (guestd/session.py InStream): four windows go through while the process runs
    on. (Before, a process's EPIPE dropped the bytes uncredited: the host stalled
    after one window until the process exited.)"""
    with trio.fail_after(30):
        async with chan.exec(["sh", "-c", "exec 0<&-; echo closed; exec sleep 300"], stdin=True) as h:
            async for _ch, data in h:
                if b"closed" in data:
                    break
            await h.send_stdin(b"x" * (4 * P.WINDOW))
            await h.signal(signal.SIGKILL)
            ex = await h.wait()
    assert ex.signal == signal.SIGKILL


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


# --- trees, patches, volumes (protocol 2) ------------------------------------------------


def make_tree(root: Path, files: int = 1000) -> None:
    """``files`` files over nested directories, with modes, owners, symlinks (absolute,
    relative, dangling), empty directories, a hard link, a long and a non-ASCII name."""
    for i in range(files):
        d = root / f"d{i % 10}" / f"e{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"f{i}.bin"
        p.write_bytes(os.urandom(i * 37 % 9000) if i % 100 else b"")
        p.chmod(0o600 | (i % 0o200))
        if i % 3 == 0:
            os.chown(p, 1000 + i % 5, 100)
        os.utime(p, (1_600_000_000 + i, 1_600_000_000 + i))
    (root / "big.bin").write_bytes(os.urandom(3 << 20))
    (root / "empty" / "nested" / "deeper").mkdir(parents=True)
    (root / "empty").chmod(0o700)
    (root / "abs-link").symlink_to("/etc/passwd")
    (root / "d1" / "rel-link").symlink_to("../d2/e3")
    (root / "dangling").symlink_to("no/such/thing")
    os.link(root / "d0" / "e0" / "f0.bin", root / "hard-link")
    (root / ("long-" + "x" * 150)).write_text("long name")
    (root / "naïve ☃.txt").write_text("unicode")
    (root / "setuid").write_bytes(b"#!/bin/sh\n")
    (root / "setuid").chmod(0o4755)
    os.chown(root / "d5", 65534, 65534)


def listing(root: Path, *, mask: int = 0o7777) -> list[tuple[object, ...]]:
    """Every entry below ``root``: name, kind, mode, owner, size, whole-second mtime
    (directories: not the time, which their own contents' creation moved), link
    target, contents' hash."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            kind = "l" if p.is_symlink() else "d" if p.is_dir() else "f"
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if kind == "f" else ""
            out.append(
                (
                    str(p.relative_to(root)),
                    kind,
                    st.st_mode & mask if kind != "l" else 0,
                    st.st_uid,
                    st.st_gid,
                    st.st_size if kind == "f" else 0,
                    int(st.st_mtime) if kind == "f" else 0,
                    os.readlink(p) if kind == "l" else "",
                    digest,
                )
            )
    return sorted(out)


async def test_tree_round_trip_1000_files_exact(chan: GuestChannel, tmp_path: Path) -> None:
    """host dir -> write_tree -> guest dir -> read_tree -> host dir: the same tree."""
    src, back = tmp_path / "src", tmp_path / "back"
    src.mkdir()
    back.mkdir()
    make_tree(src)
    with trio.fail_after(300):
        async with packed_tree(src) as chunks:
            n = await chan.write_tree("/tmp/rt", chunks)
        assert n == 1 + sum(len(d) + len(f) for _, d, f in os.walk(src))  # every entry, the root "." too
        r = await chan.run(
            ["sh", "-c", "cd /tmp/rt && stat -c '%a %u:%g %F' setuid d5 empty hard-link abs-link && readlink abs-link"]
        )
        assert r.stdout.decode().splitlines() == [
            "4755 0:0 regular file",
            "755 65534:65534 directory",
            "700 0:0 directory",
            "600 1000:100 regular empty file",
            "777 0:0 symbolic link",
            "/etc/passwd",
        ]
        async with chan.read_tree("/tmp/rt") as tar:
            assert await unpack_tree(tar, back, keep_ids=True) == n
    assert listing(back) == listing(src, mask=0o777)  # (the host drops setuid bits the guest chose)
    assert os.stat(back / "hard-link").st_ino == os.stat(back / "d0/e0/f0.bin").st_ino


def _tar(*members: tuple[str, bytes, bytes | str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, payload in members:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode = kind, 0o644
            if kind == tarfile.REGTYPE:
                assert isinstance(payload, bytes)
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
            else:
                ti.linkname = payload if isinstance(payload, str) else ""
                tf.addfile(ti)
    return out.getvalue()


async def test_hostile_trees_are_refused_and_write_nothing_outside(chan: GuestChannel) -> None:
    with trio.fail_after(120):
        r = await chan.run(
            [
                "sh",
                "-c",
                "rm -rf /tmp/h /tmp/outside && mkdir -p /tmp/h /tmp/outside && echo victim > /tmp/victim"
                " && ln -s /tmp/outside /tmp/h/planted && ln -s /tmp/victim /tmp/h/file-link",
            ]
        )
        assert r.exit_code == 0, r.stderr
        huge_pax = bytearray(_tar(("f", tarfile.REGTYPE, b"x")))
        hostile = {
            "absolute name": _tar(("/tmp/outside/abs", tarfile.REGTYPE, b"x")),
            "dot-dot": _tar(("a/../../outside/dotdot", tarfile.REGTYPE, b"x")),
            "through its own symlink": _tar(("l", tarfile.SYMTYPE, "/tmp/outside"), ("l/own", tarfile.REGTYPE, b"x")),
            "through a planted symlink": _tar(("planted/planted", tarfile.REGTYPE, b"x")),
            "a directory through a symlink": _tar(("planted/sub", tarfile.DIRTYPE, b"")),
            "device": _tar(("null", tarfile.CHRTYPE, b"")),
            "fifo": _tar(("pipe", tarfile.FIFOTYPE, b"")),
            "hard link out": _tar(("h", tarfile.LNKTYPE, "../victim")),
            "hard link to a planted name": _tar(("h", tarfile.LNKTYPE, "file-link")),
            "not a tar": os.urandom(4096),
            "truncated": _tar(("t", tarfile.REGTYPE, os.urandom(20000)))[:6000],
        }
        # a pax header that announces 2 MiB of header payload (over MAX_TREE_META)
        pax = tarfile.TarInfo("././@PaxHeader")
        pax.type, pax.size = tarfile.XHDTYPE, 2 << 20
        hostile["oversized pax header"] = pax.tobuf(tarfile.USTAR_FORMAT) + bytes(2 << 20) + bytes(huge_pax)
        for what, data in hostile.items():
            with pytest.raises(GuestOpError) as e:
                await chan.write_tree("/tmp/h", data)
            assert e.value.code == P.E_INVALID, (what, e.value)
        r = await chan.run(["sh", "-c", "ls -A /tmp/outside; cat /tmp/victim; ls -A /tmp/h | sort | tr '\\n' ' '"])
        # nothing outside; the victim intact; inside only what came before the refused member
        assert r.stdout == b"victim\nfile-link l planted ", r.stdout
        # a file member at a planted symlink's name replaces the link, never writes through it
        assert await chan.write_tree("/tmp/h", _tar(("file-link", tarfile.REGTYPE, b"new"))) == 1
        assert await chan.read_bytes("/tmp/victim") == b"victim\n"
        assert await chan.read_bytes("/tmp/h/file-link") == b"new"
        assert (await chan.ping()).activity >= 0  # and the channel is fine


async def test_tree_errors_limits_and_an_early_exit(chan: GuestChannel) -> None:
    with trio.fail_after(120):
        for path, code in (("/no/such/dir", P.E_NOT_FOUND), ("/etc/passwd", P.E_NOT_FOUND), ("tmp", P.E_INVALID)):
            with pytest.raises(GuestOpError) as e:
                async with chan.read_tree(path) as tar:
                    async for _ in tar:
                        pass
            assert e.value.code == code
        with pytest.raises(GuestOpError) as e:
            await chan.write_tree("/etc/passwd", _tar(("f", tarfile.REGTYPE, b"x")))
        assert e.value.code == P.E_EXISTS
        with pytest.raises(GuestOpError) as e:
            await chan.write_tree("/tmp/o", b"", owner="no-such-user")
        assert e.value.code == P.E_INVALID
        # leaving a read_tree early kills its worker: no process of guestd's is left behind
        await chan.run(["sh", "-c", "mkdir -p /tmp/bigtree && head -c 8000000 /dev/urandom > /tmp/bigtree/blob"])
        async with chan.read_tree("/tmp/bigtree") as tar:
            async for _ in tar:
                break
        script = (
            'n=0; for p in /proc/[0-9]*; do [ "$(cat $p/cmdline)" = "$(cat /proc/1/cmdline)" ] && n=$((n+1)); done;'
            " echo $n"
        )
        while (await chan.run(["sh", "-c", script])).stdout != b"1\n":  # PID 1 alone
            await trio.sleep(0.1)
        assert chan.statistics().requests_in_flight == 0


async def test_patches_with_owners_and_modes(chan: GuestChannel) -> None:
    E = PatchEntry
    with trio.fail_after(60):
        await chan.run(["rm", "-rf", "/srv/app", "/srv/data"])
        n = await chan.patch(
            [
                E.mkdir("/srv/app/conf", mode=0o750, owner="nobody"),
                E.file("/srv/app/conf/app.ini", "[app]\nready=1\n", mode=0o640, owner="nobody:nogroup"),
                E.append("/srv/app/conf/app.ini", "more=2\n"),
                E.file("/srv/app/run.sh", "#!/bin/sh\necho ran $(id -un)\n", mode=0o755, owner="1234:5678"),
                E.symlink("conf/app.ini", "/srv/app/current", owner="nobody"),
                E.mkdir("/srv/data"),
                E.remove("/srv/data"),
            ]
        )
        assert n == 7
        r = await chan.run(
            ["sh", "-c", "cd /srv/app && stat -c '%n %a %u:%g %F' conf conf/app.ini run.sh current; cat current"]
        )
        assert r.stdout.decode().splitlines() == [  # nobody: 65534, nogroup: 65534 in Debian
            "conf 750 65534:65534 directory",
            "conf/app.ini 640 65534:65534 regular file",
            "run.sh 755 1234:5678 regular file",
            "current 777 65534:65534 symbolic link",
            "[app]",
            "ready=1",
            "more=2",
        ]
        assert (await chan.run(["/srv/app/run.sh"], user="nobody")).stdout == b"ran nobody\n"
        assert (await chan.run(["test", "-e", "/srv/data"])).exit_code == 1
        with pytest.raises(GuestOpError) as e:
            await chan.patch([E.file("/srv/app/new", "x"), E.file("/srv/app/run.sh", "clobber")])
        assert e.value.code == P.E_EXISTS and "entry 1 (/srv/app/run.sh)" in e.value.message
        assert await chan.read_bytes("/srv/app/new") == b"x"  # the entry before the failure stays
        with pytest.raises(GuestOpError) as e:
            await chan.patch([E.file("/srv/x", "x", owner="no-such-user")])
        assert e.value.code == P.E_INVALID
        # write_file takes an owner too (for contents beyond a patch frame)
        await chan.write_file("/srv/app/blob", os.urandom(2 << 20), mode=0o600, owner="nobody")
        r = await chan.run(["stat", "-c", "%a %U %s", "/srv/app/blob"])
        assert r.stdout == f"600 nobody {2 << 20}\n".encode()


async def test_a_volume_written_then_seen_read_only(image: Image, tmp_run: Path) -> None:
    vol = tmp_run / "vol.ext4"
    await create_volume_image(vol, 64 << 20, label="data")
    base = await cold_spec(image, tmp_run, hostname="vol")
    # the slot budget: the channel and the root disk take two of the 24
    spec24 = base.with_volumes((Volume(vol, read_only=True),) * 23).machine
    assert spec24.max_volumes() == 22
    with pytest.raises(TooManyDevices, match="at most 22 volumes"):
        spec24.argv(tmp_run)
    with trio.fail_after(240):
        async with booted_guest(base.with_volumes((Volume(vol),)), tmp_run) as g:
            await g.channel.mount("serial:vol0", "/data")
            await g.channel.write_file("/data/hello", b"written in life one", owner="nobody")
            await g.channel.patch([PatchEntry.mkdir("/data/dir", owner="nobody")])
            r = await g.channel.run(["sh", "-c", "grep ' /data ' /proc/mounts"])
            assert r.stdout.startswith(b"/dev/vdb /data ext4 rw"), r.stdout
        assert g.machine.returncode == 0
        # guestd unmounted it at power-off: the journal is clean, no recovery needed
        assert await check_volume_image(vol) is True
        run2 = tmp_run / "two"
        run2.mkdir()
        base2 = await cold_spec(image, run2, hostname="vol2")
        spec2 = base2.with_volumes((Volume(vol, read_only=True, serial="data"),))
        async with booted_guest(spec2, run2) as g:
            with pytest.raises(GuestOpError) as e:
                await g.channel.mount("serial:data", "/data")  # read-write on a read-only disk
            assert e.value.code == P.E_PERM
            await g.channel.mount("serial:data", "/data", read_only=True)
            assert await g.channel.read_bytes("/data/hello") == b"written in life one"
            r = await g.channel.run(["sh", "-c", "stat -c '%U' /data/hello /data/dir; touch /data/x"])
            assert r.stdout == b"nobody\nnobody\n" and b"Read-only file system" in r.stderr
            with pytest.raises(GuestOpError) as e:
                await g.channel.mount("serial:nope", "/other")
            assert e.value.code == P.E_NOT_FOUND
            await g.channel.umount("/data")
            assert (await g.channel.run(["grep", "-c", " /data ", "/proc/mounts"])).stdout == b"0\n"
