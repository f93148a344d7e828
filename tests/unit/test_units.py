"""Unit tests of actor logic and protocol cores without VMs."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
from contextlib import aclosing
from pathlib import Path

import msgpack
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from actors.channel.guest import _Request
from actors.errors import DomainError
from actors.events import EventBus, Lagged
from actors.model import Action, SandboxEvent, check_id, check_labels
from actors.registry import check_traversable, decode_cursor, encode_cursor
from actors.sandboxes.logs import SandboxLog
from guestd import proto as P
from supervisor import protocol as W
from supervisor.protocol import ApiError


async def test_slow_event_subscriber_is_told_it_lagged_and_others_are_not_blocked() -> None:
    bus = EventBus(buffer=4)
    slow = bus.subscribe()
    fast = bus.subscribe(action="ready")
    got: list[str] = []
    async with trio.open_nursery() as n:

        async def drain_fast() -> None:
            async for ev in fast:
                got.append(ev.sandbox_id)

        n.start_soon(drain_fast)
        for i in range(10):
            bus.publish(SandboxEvent(f"s{i}", Action.READY, i))
            await trio.sleep(0)  # publishing never blocks; the fast reader keeps up
        with pytest.raises(Lagged):
            async for _ in slow:
                pass
        assert slow not in bus.subs
        bus.unsubscribe(fast)
    assert got == [f"s{i}" for i in range(10)]


async def test_log_rotates_and_follow_sees_new_records(tmp_path: Path) -> None:
    log = SandboxLog(tmp_path / "log", max_bytes=1000)
    for i in range(200):
        log.append("stdout", f"line {i}\n".encode())
    recs = log.read_sync()
    assert recs[-1].data == b"line 199\n" and (tmp_path / "log.1").exists()
    assert len(recs) < 100  # the oldest rotated away: disk use stays bounded
    assert [r.seq for r in recs] == sorted(r.seq for r in recs)
    seen: list[bytes] = []
    async with trio.open_nursery() as n:

        async def follow() -> None:
            async with aclosing(log.follow(cursor=log.seq)) as records:
                async for r in records:
                    seen.append(r.data)
                    if r.data == b"last":
                        return

        n.start_soon(follow)
        await trio.sleep(0.01)
        log.append("stderr", b"new")
        log.append("system", b"last")
    assert seen == [b"new", b"last"]
    log.close()
    reopened = SandboxLog(tmp_path / "log")
    assert reopened.seq == 202  # numbering survives a reopen
    reopened.close()


def test_log_survives_a_full_disk_and_torn_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    log = SandboxLog(tmp_path / "log")
    log.append("stdout", b"before")
    real = os.pwrite
    calls = {"n": 0}

    def full(fd: int, data: bytes, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 1:  # a torn write: half a record lands, then the disk is full
            real(fd, bytes(data)[: len(data) // 2], offset)
            return len(data) // 2
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    for i in range(3):
        log.append("stdout", f"lost {i}".encode())  # never raises
    monkeypatch.setattr(os, "pwrite", real)
    assert log.dropped == 3
    log.append("stdout", b"after")
    recs = log.read_sync()
    assert [(r.source, r.data) for r in recs] == [
        ("stdout", b"before"),
        ("system", b"3 log records dropped"),
        ("stdout", b"after"),
    ]
    assert [r.seq for r in recs] == [1, 2, 3]
    log.close()
    with open(tmp_path / "log", "ab") as f:  # a crash mid-record leaves a torn tail
        f.write(b"\x00\x00\x01\x00partial")
    again = SandboxLog(tmp_path / "log")
    assert again.seq == 3
    again.append("stdout", b"next")
    assert [r.data for r in again.read_sync()][-1] == b"next"
    again.close()


async def test_log_follow_reads_only_what_is_new_across_rotations(tmp_path: Path) -> None:
    log = SandboxLog(tmp_path / "log", max_bytes=4096)
    log.append("stdout", b"old")
    seen: list[bytes] = []
    async with trio.open_nursery() as n:

        async def follow() -> None:
            async with aclosing(log.follow(tail=1)) as records:
                async for r in records:
                    seen.append(r.data)
                    if r.data == b"999":
                        return

        n.start_soon(follow)
        await trio.sleep(0.01)
        for i in range(1000):  # many rotations of a 4 KiB log while the follower keeps up
            log.append("stdout", str(i).encode())
            if i % 7 == 0:
                await trio.sleep(0)
    assert seen[0] == b"old"
    got = [int(x) for x in seen[1:]]
    assert got == sorted(got) and got[-1] == 999 and len(set(got)) == len(got)
    assert got == list(range(1000)) and log.generation > 3
    log.close()


@pytest.mark.parametrize("bad", ["x" * 129, "é" * 65, "a\x00b", " padded", "tab\t"])
def test_bad_ids(bad: str) -> None:
    with pytest.raises(DomainError) as e:
        check_id(bad)
    assert e.value.code == "INVALID_ARGUMENT"


def test_good_ids_and_labels() -> None:
    check_id("x" * 128)
    check_id("é" * 64)
    check_labels({"team": "a", "sandboxing": "ok"})
    for bad in ({"sandbox.x": "1"}, {"sandvisor.y": ""}, {"": "v"}):
        with pytest.raises(DomainError):
            check_labels(bad)


@given(st.integers(min_value=0, max_value=2**62))
def test_cursor_round_trip(seq: int) -> None:
    assert decode_cursor(encode_cursor(seq)) == seq


@given(st.text(max_size=30))
def test_garbage_cursors_are_invalid_argument(text: str) -> None:
    """Anything but a cursor the registry made is refused, typed."""
    import base64

    try:
        n = decode_cursor(text)
    except DomainError as e:
        assert e.code == "INVALID_ARGUMENT"
    else:  # accepted: then it must really be the encoding of "seq:N"
        assert base64.urlsafe_b64decode(text.encode()) == f"seq:{n}".encode(), text


def test_cursor_edge_cases_are_refused() -> None:
    import base64

    for raw in (b"seq:", b"seq:-1", b"seq:1x", b"other:5", b"seq", b"\xff\xfe"):
        with pytest.raises(DomainError):
            decode_cursor(base64.urlsafe_b64encode(raw).decode())


@given(st.builds(W.Call, id=st.integers(1, 2**31), method=st.text(max_size=20), body=st.just({"id": "x"})))
def test_envelopes_round_trip(msg: W.Call) -> None:
    frame = W.encode(msg)
    assert W.decode(frame[4:]) == msg


def test_wrong_types_never_coerce() -> None:
    for body in ({"id": 1}, {"id": "a", "ttl_seconds": "3"}, {"id": "a", "labels": {"k": 1}}, {"id": "a", "cmd": "sh"}):
        with pytest.raises(ApiError) as e:
            W.structure_body(body, W.CreateSandboxRequest)
        assert e.value.code == "INVALID_ARGUMENT"


def test_a_run_root_qemu_cannot_reach_is_refused_at_start() -> None:
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="sv-reach-", dir="/tmp"))  # /tmp is o+x: the check is ours alone
    try:
        private = top / "private"
        private.mkdir(mode=0o700)
        (private / "run").mkdir()
        with pytest.raises(DomainError) as e:
            check_traversable(private / "run", "nobody")
        assert e.value.code == "FAILED_PRECONDITION" and "not reachable" in e.value.message
        assert str(private) in e.value.message  # it names the directory that blocks
        private.chmod(0o711)
        top.chmod(0o711)
        check_traversable(private / "run", "nobody")  # now QEMU's user gets through
    finally:
        import shutil

        shutil.rmtree(top, ignore_errors=True)


class _NoGrant:
    async def _grant(self, rid: int, ch: int, n: int) -> None:
        pass


async def test_guest_request_keeps_data_queued_behind_a_message() -> None:
    """Data arriving while a message (file_info) is still queued is kept, in order, and
    data merges only into the trailing run of data entries."""
    req = _Request(_NoGrant(), 1)  # type: ignore[arg-type]
    req.deliver(P.FileInfo(rid=1, size=6, mode=0o644))
    req.deliver(P.Data(rid=1, ch=P.STDOUT, data=b"abc"))
    req.deliver(P.Data(rid=1, ch=P.STDERR, data=b"!"))
    req.deliver(P.Data(rid=1, ch=P.STDOUT, data=b"def"))
    req.deliver(P.Eof(rid=1, ch=P.STDOUT))
    req.deliver(P.Data(rid=1, ch=P.STDERR, data=b"?"))
    got = []
    for _ in range(5):
        m = await req.next()
        got.append((m.TAG, getattr(m, "ch", None), getattr(m, "data", None)))
    assert got == [
        ("file_info", None, None),
        ("data", P.STDOUT, b"abcdef"),
        ("data", P.STDERR, b"!"),
        ("eof", P.STDOUT, None),
        ("data", P.STDERR, b"?"),
    ]


def test_serve_pool_argument() -> None:
    from supervisor.daemon_config import _pool_arg

    assert _pool_arg("base=2") == ("base", 2)
    assert _pool_arg("a=b=3") == ("a=b", 3)
    for bad in ("base", "=2", "base=x", "base=-1"):
        with pytest.raises(Exception, match="SNAPSHOT=N"):
            _pool_arg(bad)


_text = st.text(max_size=30)
_labels = st.dictionaries(_text, _text, max_size=3)


@given(
    st.one_of(
        st.builds(W.CheckpointRequest, sandbox_id=_text, name=_text, labels=_labels),
        st.builds(
            W.RestoreRequest,
            snapshot_id=_text,
            id=_text,
            labels=_labels,
            network_override=st.booleans(),
            ttl_seconds=st.integers(0, 2**31),
        ),
        st.builds(W.ListSnapshotsRequest, sandbox_id=_text, labels=_labels),
        st.builds(
            W.SnapshotSummary,
            id=_text,
            sandbox_id=_text,
            name=_text,
            labels=_labels,
            snapshot_dir=_text,
            created_at=_text,
            size_bytes=st.integers(0, 2**40),
            memory=st.sampled_from(["mapped", "streamed"]),
        ),
        st.builds(W.DeleteSnapshotRequest, snapshot_id=_text),
    )
)
def test_snapshot_bodies_round_trip(body: object) -> None:
    raw = msgpack.unpackb(msgpack.packb(W.unstructure_body(body)), raw=False)
    assert W.structure_body(raw, type(body)) == body


def test_snapshot_requests_never_coerce() -> None:
    for body in ({"snapshot_id": 5}, {"snapshot_id": "s", "ttl_seconds": "9"}, {"snapshot_id": "s", "labels": []}):
        with pytest.raises(ApiError) as e:
            W.structure_body(body, W.RestoreRequest)
        assert e.value.code == "INVALID_ARGUMENT"


async def test_store_writes_behind_in_order_and_survives_a_full_disk(tmp_path: Path) -> None:
    from actors.errors import ResourceExhausted
    from actors.model import SandboxConfig, State, Workload
    from actors.store import Record, Store

    store = Store(tmp_path / "db")
    store.retry_after = 0.05
    big = Workload(env={"X": "y" * 20_000})  # a page or more per record
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(store.run)
            rec = Record("u0", "first", store.next_seq(), SandboxConfig(), State.STARTING, 1)
            store.insert(rec)
            await store.flush()
            pages = store.db.execute("PRAGMA page_count").fetchone()[0]
            store.db.execute(f"PRAGMA max_page_count={pages + 2}")  # the disk is full from here
            for i in range(1, 6):
                store.insert(Record(f"u{i}", f"sb{i}", store.next_seq(), SandboxConfig(workload=big), State.READY, i))
            rec.state = State.FAILED
            store.update(rec)
            with pytest.raises(ResourceExhausted, match="full"):
                await store.flush()
            with pytest.raises(ResourceExhausted):
                store.check_writable()
            store.db.execute("PRAGMA max_page_count=1073741823")  # room again: the queue goes through, in order
            await store.flush()
            store.check_writable()
            n.cancel_scope.cancel()
    store.close()
    again = Store(tmp_path / "db")
    recs = again.all()
    assert [r.id for r in recs] == ["first", "sb1", "sb2", "sb3", "sb4", "sb5"]
    assert recs[0].state == State.FAILED and recs[1].config.workload == big
    assert again.next_seq() == 7
    again.close()


async def test_sd_notify_ready_stopping_and_the_watchdog(tmp_path: Path) -> None:
    import socket as socket_mod

    from supervisor.notify import Notifier

    path = tmp_path / "notify"
    with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_DGRAM) as sink:
        sink.bind(str(path))
        sink.settimeout(5)
        n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
        assert n.enabled and n.watchdog == 0.2
        n.ready("serving")
        assert sink.recv(100) == b"READY=1\nSTATUS=serving"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(n.keep_alive)
            await trio.sleep(0.25)
            nursery.cancel_scope.cancel()
        n.stopping()
        got = [sink.recv(100)]
        while got[-1] != b"STOPPING=1":
            got.append(sink.recv(100))
        assert got[:-1] and set(got[:-1]) == {b"WATCHDOG=1"}  # every 0.1 s: half the interval asked for
    quiet = Notifier({})
    assert not quiet.enabled
    quiet.ready()  # without systemd: nothing, no error


def test_a_create_may_name_only_regular_files_in_allowed_dirs(tmp_path: Path) -> None:
    from actors.registry import check_host_file

    allowed = tmp_path / "images"
    allowed.mkdir()
    good = allowed / "root.ext4"
    good.write_bytes(b"x")
    (allowed / "link.ext4").symlink_to("/etc/shadow")
    (allowed / "dirlink").symlink_to(tmp_path)
    check_host_file("rootfs", str(good), (allowed,))
    cases = {
        "/etc/shadow": "FAILED_PRECONDITION",  # not in an allowed dir
        str(allowed / "link.ext4"): "FAILED_PRECONDITION",  # a symlink
        str(allowed / "dirlink" / "images" / "root.ext4"): "FAILED_PRECONDITION",  # a symlink on the way
        str(allowed / "missing.ext4"): "NOT_FOUND",
        str(allowed / ".." / "images" / "root.ext4"): "INVALID_ARGUMENT",
        "root.ext4": "INVALID_ARGUMENT",
    }
    for path, code in cases.items():
        with pytest.raises(DomainError) as e:
            check_host_file("rootfs", path, (allowed,))
        assert e.value.code == code, (path, e.value)
    with pytest.raises(DomainError, match="regular file"):
        check_host_file("rootfs", "/dev/null", (Path("/dev"),))  # a device
    with pytest.raises(DomainError, match="allowed: none"):
        check_host_file("kernel", str(good), ())


def test_a_non_root_runtime_dir_someone_else_made_is_refused(tmp_path: Path) -> None:
    """serve as a non-root user claims /tmp/sandvisor-<uid> (0700, its own) or refuses
    one another user made first; a client refuses to talk to a socket in such a dir."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as two users")
    uid = 40000 + os.getpid() % 10000
    runtime = Path(f"/tmp/sandvisor-{uid}")
    code = f"""
import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from supervisor.config import UnsafeRuntimeDir, check_runtime_dir, claim_runtime_dir, default_socket
try:
    print(claim_runtime_dir())
    check_runtime_dir(default_socket())
    print("client ok")
except UnsafeRuntimeDir as e:
    print("refused:", e)
"""

    def as_user() -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "SANDVISOR_SOCKET")}
        r = subprocess.run(
            ["/usr/bin/python3", "-S", "-c", code],
            user=uid,
            group=uid,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return r.stdout.strip()

    shutil.rmtree(runtime, ignore_errors=True)
    try:
        runtime.mkdir(mode=0o777)  # made first by someone else (root here)
        runtime.chmod(0o777)
        assert as_user().startswith(f"refused: {runtime} belongs to uid 0")
        runtime.rmdir()
        assert as_user().splitlines() == [f"{runtime}/sandvisor", "client ok"]
        info = runtime.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (uid, 0o700)
        os.chown(runtime / "sandvisor", 0, 0)  # swapped under the client
        assert "refused" in as_user()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_socket_reached_by_path_must_be_qemus() -> None:
    """An escaped QEMU could swap its socket for a symlink to another service's: the
    listener's pid, as the kernel recorded it, must be QEMU's."""
    from actors.machines.qemuproc import LaunchError, check_peer

    a, b = socket.socketpair()
    with a, b:
        check_peer(a, os.getpid(), Path("qmp.sock"))  # (a socketpair's peer is this process)
        with pytest.raises(LaunchError, match="is not QEMU's"):
            check_peer(b, os.getpid() + 1, Path("qmp.sock"))


# a life record's spec as the supervisor before VmSpec held its MachineSpec wrote it
# (dumped by that code): a running QEMU it left (serve --keep-sandboxes) is adopted by
# the next supervisor from this
FLAT_SPEC = {
    "kernel": "/k",
    "initrd": "/i",
    "append": "console=ttyS0",
    "disk": "/d/disk.qcow2",
    "cpus": 2,
    "memory_mib": 512,
    "accel": "tcg",
    "user": {"name": "nobody", "uid": 65534, "gid": 65534, "groups": [65534]},
    "network": {
        "restrict": True,
        "net": "10.0.2.0/24",
        "address": "10.0.2.15",
        "gateway": "10.0.2.2",
        "dns": "10.0.2.3",
        "prefix": 24,
        "tap": False,
        "mac": "",
        "tap_name": "",
        "detached": False,
    },
    "ram": "/dev/shm/x",
    "ram_shared": False,
    "restore": "/s/vmstate",
    "chain": ["/s/disk.qcow2", "/base.img"],
    "boot_timeout": 30.0,
    "answer_timeout": 5.0,
    "name": "sb",
    "machine": "microvm",
    "sandbox": True,
    "extra_ports": [],
    "balloon": True,
    "preload": "/p.so",
    "tb_size_mib": 64,
    "volumes": [{"path": "/v.ext4", "read_only": True, "serial": "data"}],
}


def test_a_vm_spec_holds_its_machine_spec_and_reads_old_records() -> None:
    """VmSpec derives its MachineSpec's network devices, disk chain, RAM file and
    -incoming once; the record round-trips, and a record in the earlier flat form
    gives the machine that supervisor derived (the MachineSpec below is what its
    ``machine_spec()`` printed for FLAT_SPEC)."""
    from actors.machines.qemuproc import QemuUser
    from actors.machines.qemuspec import MachineSpec, Volume
    from actors.machines.vm import NetConfig, VmSpec, load_spec
    from actors.model import dump

    spec = VmSpec.of(
        kernel=Path("/k"),
        initrd=Path("/i"),
        append="console=ttyS0",
        disk=Path("/d/disk.qcow2"),
        chain=(Path("/s/disk.qcow2"), Path("/base.img")),
        cpus=2,
        memory_mib=512,
        user=QemuUser("nobody", 65534, 65534, (65534,)),
        network=NetConfig(restrict=True),
        ram=Path("/dev/shm/x"),
        ram_shared=False,
        restore=Path("/s/vmstate"),
        boot_timeout=30.0,
        answer_timeout=5.0,
        name="sb",
        balloon=True,
        preload=Path("/p.so"),
        volumes=(Volume(Path("/v.ext4"), read_only=True, serial="data"),),
    )
    assert spec.machine == MachineSpec(
        kernel=Path("/k"),
        initrd=Path("/i"),
        disk=Path("/d/disk.qcow2"),
        cpus=2,
        memory_mib=512,
        append="console=ttyS0",
        balloon=True,
        preload=Path("/p.so"),
        netdev=(
            "-netdev",
            "user,id=n0,net=10.0.2.0/24,host=10.0.2.2,dns=10.0.2.3,restrict=on",
            "-device",
            "{net},netdev=n0",
        ),
        user=QemuUser("nobody", 65534, 65534, (65534,)),
        disk_chain=(Path("/s/disk.qcow2"), Path("/base.img")),
        memory_file=Path("/dev/shm/x"),
        memory_shared=False,
        incoming=True,
        volumes=(Volume(Path("/v.ext4"), read_only=True, serial="data"),),
    )
    assert spec.mapped_restore
    assert load_spec(dump(spec)) == spec
    assert load_spec(FLAT_SPEC) == spec
    with pytest.raises(ValueError, match="-incoming"):
        VmSpec(spec.machine)  # a machine waiting for a state nobody loads
