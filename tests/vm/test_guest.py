"""guestd against a real VM (TCG): what only a real guest shows (the rootfs, a PTY's line
discipline, flooding, 20 MiB files, the vsock listener, exact trees of 1000 files, limits
the fake does not model, volumes). The protocol itself, for guestd and the fake alike:
test_guest_contract.py."""

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

from actors.channel.guest import GuestChannel, GuestOpError, PatchEntry
from actors.machines.qemuspec import TooManyDevices, Volume
from actors.machines.vm import booted_guest
from actors.volumes import check_volume_image, create_volume_image
from guestd import proto
from images.build import Image
from supervisor.client.treecopy import packed_tree, unpack_tree
from tests.support.clocks import fail_when_stalled
from tests.support.trees import listing, make_tree
from tests.support.vms import cold_spec

# (work that scales) the longest a piece of it may take: the product's own deadline for
# a guest's answer (actors/defaults.py GUEST_TIMEOUT); a MiB took at most 2 s at load 16
STALL = 30.0


async def test_user_processes_see_the_rootfs(chan: GuestChannel) -> None:
    with trio.fail_after(30):
        r = await chan.run(["sh", "-c", "cat /etc/os-release | head -1; ls -d /dev/pts /tmp"])
    assert b"Debian" in r.stdout  # the rootfs, not guestd's runtime


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
            await h.send_stdin(b"x" * (4 * proto.WINDOW))
            await h.signal(signal.SIGKILL)
            ex = await h.wait()
    assert ex.signal == signal.SIGKILL


# glibc's posix_spawn leaves its two internal signals (32, 33) ignored in every child
GLIBC_INTERNAL = (1 << 31) | (1 << 32)


async def test_processes_start_clean_as_root_and_as_a_user(chan: GuestChannel) -> None:
    """Each spawn path (root: posix_spawn; a user: C fork+exec; a TTY: fork) starts its
    process the same: a session and process group of its own, SCHED_OTHER, no signal
    ignored or blocked, none of guestd's descriptors, umask 022
    -- and a user's failures typed."""
    script = (
        "ls /proc/self/fd | sort -n | tr '\\n' ' '; echo; "
        "grep -E '^Sig(Blk|Ign)' /proc/self/status | tr -d '\\t'; "
        "ps -o pid=,pgid=,sid=,cls= -p $$ | awk '{print ($1==$2 && $2==$3) $4}'; umask; id -un"
    )
    with trio.fail_after(120):
        for kw in ({}, {"user": "nobody"}, {"user": "nobody", "cwd": "/tmp"}):
            r = await chan.run(["sh", "-c", script], **kw)  # type: ignore[arg-type]
            fds, blk, ign, leader, umask, who = r.stdout.decode().splitlines()
            assert fds.split() == ["0", "1", "2", "3"], (kw, fds)  # 3: ls's own directory
            assert blk == "SigBlk:0000000000000000" and int(ign.split(":")[1], 16) & ~GLIBC_INTERNAL == 0, (kw, ign)
            assert (leader, umask, who) == ("1TS", "0022", kw.get("user", "root")), kw  # TS: SCHED_OTHER
        r = await chan.run(
            ["sh", "-c", "grep -E '^Sig(Blk|Ign)' /proc/self/status | tr -d '\\t'; id -un; ps -o cls= -p $$"], tty=True
        )
        blk, ign, who, cls = r.stdout.decode().split()
        assert (blk, who, cls) == ("SigBlk:0000000000000000", "root", "TS") and int(
            ign.split(":")[1], 16
        ) & ~GLIBC_INTERNAL == 0
        cases: list[tuple[list[str], str, str, str]] = [
            (["true"], "/no/such/dir", proto.E_NOT_FOUND, "chdir '/no/such/dir'"),
            (["/no/such/binary"], "", proto.E_NOT_FOUND, "No such file or directory"),
            (["/root/secret"], "", proto.E_PERM, "Permission denied"),
        ]
        await chan.run(["sh", "-c", "printf '#!/bin/sh\\n' >/root/secret; chmod 700 /root/secret"])
        for argv, cwd, code, text in cases:
            with pytest.raises(GuestOpError) as e:
                await chan.run(argv, user="nobody", cwd=cwd)
            assert e.value.code == code and text in e.value.message, (argv, e.value)
        assert (await chan.run(["/root/secret"])).exit_code == 0  # root may


async def test_a_process_that_closes_its_outputs_runs_on_to_its_exit(chan: GuestChannel) -> None:
    """Both outputs at EOF while the process runs on: guestd does not take that for its
    exit (it reaps only what exited; guestd/exec.py reap_now), the Exit carries the real code."""
    with trio.fail_after(60):
        r = await chan.run(["sh", "-c", "echo bye; exec >&- 2>&-; sleep 1; exit 5"])
    assert (r.stdout, r.exit_code) == (b"bye\n", 5)


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


async def test_flood_does_not_stall_others(chan: GuestChannel) -> None:
    """One process floods 50 MiB; ten others run to completion and a ping round-trips meanwhile."""
    flood_bytes = 0
    results: list[bytes] = []
    pings: list[float] = []
    # 50 MiB through a TCG guest takes 20 s on a quiet host and minutes on a loaded one
    # (76 s at load 11): the bound is on each piece of output, job and ping
    with fail_when_stalled(STALL) as progress:
        async with trio.open_nursery() as n:
            flood_started = trio.Event()
            flood_done = trio.Event()

            async def flood() -> None:
                nonlocal flood_bytes
                async with chan.exec(["head", "-c", str(50 << 20), "/dev/zero"]) as h:
                    flood_started.set()
                    async for _ch, data in h:
                        flood_bytes += len(data)
                        progress()
                        await trio.sleep(0)  # a consumer, not a spin
                flood_done.set()

            async def small(i: int) -> None:
                await flood_started.wait()
                r = await chan.run(["sh", "-c", f"echo job{i}"])
                results.append(r.stdout)
                progress()

            async def pinger() -> None:
                await flood_started.wait()
                while not flood_done.is_set() and len(pings) < 5:
                    t = time.monotonic()
                    await chan.ping()
                    pings.append(time.monotonic() - t)
                    progress()
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


async def test_file_round_trip_20mib(chan: GuestChannel) -> None:
    data = os.urandom(20 << 20)
    # the bound is on each MiB (and on the checksum), not on the 20 MiB: see the flood's
    with fail_when_stalled(STALL) as progress:

        async def pieces() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 1 << 20):
                yield data[i : i + (1 << 20)]
                progress()

        n = await chan.write_file("/tmp/blob", pieces(), mode=0o600, size=len(data))
        assert n == len(data)
        back = bytearray()
        async with chan.read_file("/tmp/blob") as f:
            async for chunk in f:
                back += chunk
                progress()
        # the guest's checksum of what it has (dd reports its progress each second)
        out = bytearray()
        checksum = "dd if=/tmp/blob bs=1M status=progress | sha256sum; stat -c %a /tmp/blob"
        async with chan.exec(["sh", "-c", checksum]) as h:
            async for ch, got in h:
                if ch == proto.STDOUT:
                    out += got
                progress()
    assert h.exit is not None and h.exit.code == 0
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
    assert out.split()[0].decode() == hashlib.sha256(data).hexdigest()
    assert out.split()[-1] == b"600"


async def test_vsock_listener_with_loopback(chan: GuestChannel) -> None:
    """guestd listens on AF_VSOCK where the guest has a transport (vsock_loopback here):
    a client inside the guest speaks the same framing to it."""
    hello = (proto.HOST_SYNC + proto.encode(proto.Hello(version=proto.PROTOCOL_VERSION))).hex()
    sync = proto.GUEST_SYNC.hex()
    ping = proto.encode(proto.Ping(rid=7)).hex()
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
    first, second = (proto.decode(bytes.fromhex(x.decode())) for x in r.stdout.split())
    assert isinstance(first, proto.HelloOk) and "vsock" in first.features
    assert isinstance(second, proto.Pong) and second.rid == 7


# --- trees, patches, volumes (protocol 2) ------------------------------------------------


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


async def test_an_oversized_pax_header_is_refused(chan: GuestChannel) -> None:
    """guestd's MAX_TREE_META (the fake does not model it; the other hostile trees: the contract)."""
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type, pax.size = tarfile.XHDTYPE, 2 << 20  # 2 MiB of header payload
    data = pax.tobuf(tarfile.USTAR_FORMAT) + bytes(2 << 20) + _tar(("f", tarfile.REGTYPE, b"x"))
    with trio.fail_after(120):
        await chan.run(["rm", "-rf", "/tmp/pax"])
        with pytest.raises(GuestOpError) as e:
            await chan.write_tree("/tmp/pax", data)
        assert e.value.code == proto.E_INVALID
        r = await chan.run(["sh", "-c", "ls -A /tmp/pax 2>/dev/null | wc -l"])
        assert r.stdout == b"0\n"
        assert (await chan.ping()).activity >= 0


async def test_leaving_a_read_tree_early_kills_its_worker(chan: GuestChannel) -> None:
    """No process of guestd's is left behind (the errors of read_tree: the contract)."""
    with trio.fail_after(120):
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
            assert e.value.code == proto.E_PERM
            await g.channel.mount("serial:data", "/data", read_only=True)
            assert await g.channel.read_bytes("/data/hello") == b"written in life one"
            r = await g.channel.run(["sh", "-c", "stat -c '%U' /data/hello /data/dir; touch /data/x"])
            assert r.stdout == b"nobody\nnobody\n" and b"Read-only file system" in r.stderr
            with pytest.raises(GuestOpError) as e:
                await g.channel.mount("serial:nope", "/other")
            assert e.value.code == proto.E_NOT_FOUND
            await g.channel.umount("/data")
            assert (await g.channel.run(["grep", "-c", " /data ", "/proc/mounts"])).stdout == b"0\n"
