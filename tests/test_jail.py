"""The jail (actors/jail.py), cgroups (actors/cgroups.py) and guest memory
(actors/guestmem.py): units against fakes where the host cannot show a case (cgroup v2
here), real processes and real jailed QEMUs for the rest."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from jailed import JailOptions, OverlayFiles, jailed_guest, proc_status, run_as

from actors import cgroups, guestmem, jail
from actors.cgroups import CgroupError, CgroupLimits, CgroupV1Manager, CgroupV2Manager
from actors.guest import ChannelBroken, GuestError
from actors.guestmem import MemoryFileError, UnsafeDirectory
from actors.machine import MachineError
from actors.snapshot import checkpoint_guest
from actors.vm import NetConfig
from images.build import Image, load_default

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the jail needs root")
MIB = 1 << 20


@pytest.fixture
def img(request: pytest.FixtureRequest) -> Image:
    """The built default image, read-only (the session's ``image`` builds it when absent)."""
    found = load_default()
    return found if found is not None else request.getfixturevalue("image")


@pytest.fixture(scope="session")
def built_helper() -> Iterator[Path | None]:
    """sandvisor-jail-exec built once for the session (None where there is no compiler)."""
    if os.geteuid() != 0:
        yield None
        return
    d = Path(tempfile.mkdtemp(prefix="jail-helper-", dir="/tmp"))
    d.chmod(0o755)
    try:
        try:
            yield jail.build_helper(d / "bin")
        except jail.JailError:
            yield None
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["helper", "python"])
def helper(request: pytest.FixtureRequest, built_helper: Path | None) -> Path | None:
    """Both ways into the jail: the static helper (vforked) and the Python stage."""
    if request.param == "python":
        return None
    if built_helper is None:
        pytest.skip("no C compiler: the jail helper cannot be built")
    return built_helper


@pytest.fixture
def base() -> Iterator[Path]:
    """A root-owned 0755 dir (reachable by any uid: the checks below test our own modes,
    not a 0700 tmp parent) for jails and disks, and a private RAM dir on tmpfs."""
    d = Path(tempfile.mkdtemp(prefix="jail-test-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="jail-test-", dir="/dev/shm"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def test_cgroups() -> Iterator[cgroups.CgroupManager | None]:
    """The host's cgroups under a parent of the tests' own, removed after."""
    mgr = cgroups.detect(parent="sandvisor-test")
    yield mgr
    if mgr is not None:
        mgr.remove_parent()
        assert not any(d.exists() for d in mgr.parent_dirs())


def allocator() -> jail.IdentityAllocator:
    """Sandbox ids, none of which a process on this host has (other test runs, benchmarks)."""
    alloc = jail.IdentityAllocator()
    alloc.adopt_running()
    return alloc


def uids_with_processes(uids: set[int]) -> set[int]:
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(entry.path, "status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("Uid:"):
                    found |= {int(x) for x in line.split()[1:]} & uids
    return found


def ns_holders(inode: int, kind: str) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(f"/proc/{entry.name}/ns/{kind}").st_ino == inode:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


# -- identities --------------------------------------------------------------------------------------


def test_identity_range_refuses_real_ids(tmp_path: Path) -> None:
    (tmp_path / "passwd").write_text("root:x:0:0::/root:/bin/sh\nbob:x:5000:5000::/home/bob:/bin/sh\n")
    (tmp_path / "group").write_text("root:x:0:\nbob:x:5000:\n")
    (tmp_path / "subuid").write_text("bob:100000:65536\n")
    with pytest.raises(jail.JailError, match="passwd has 'bob'"):
        jail.IdentityAllocator(4000, 2000, etc=tmp_path)
    with pytest.raises(jail.JailError, match="subuid gives 'bob'"):
        jail.IdentityAllocator(150000, 10, etc=tmp_path)
    with pytest.raises(jail.JailError, match="65534"):
        jail.IdentityAllocator(60000, 10000, etc=tmp_path)
    with pytest.raises(jail.JailError, match="not a valid range"):
        jail.IdentityAllocator(0, 10, etc=tmp_path)
    jail.IdentityAllocator(200000, 1000, etc=tmp_path)  # clear of everything


def test_identities_are_never_shared_and_reused_late(tmp_path: Path) -> None:
    alloc = jail.IdentityAllocator(1_900_100_000, 3, etc=tmp_path)
    a, b, c = (alloc.allocate(x) for x in "abc")
    assert len({a.uid, b.uid, c.uid}) == 3 and all(i.uid == i.gid for i in (a, b, c))
    with pytest.raises(jail.JailError, match="no free sandbox uid"):
        alloc.allocate("d")
    alloc.release(b)
    assert alloc.allocate("d") == b  # the only free one
    alloc.release(a)
    alloc.release(c)
    # round-robin: the next after the last handed out, not the lowest free
    assert alloc.allocate("e") == c
    with pytest.raises(jail.JailError, match="live for e"):
        alloc.adopt(c, "f")
    alloc.adopt(a, "a-again")
    assert alloc.live == {a.uid: "a-again", b.uid: "d", c.uid: "e"}


@root_only
def test_running_processes_keep_their_uid(tmp_path: Path) -> None:
    alloc = jail.IdentityAllocator(1_900_200_000, 2, etc=tmp_path)
    p = subprocess.Popen(["sleep", "30"], user=1_900_200_000, group=1_900_200_000, extra_groups=[])
    try:
        assert alloc.adopt_running() == {1_900_200_000: p.pid}
        assert alloc.allocate("x").uid == 1_900_200_001
    finally:
        p.kill()
        p.wait()


# -- cgroups ------------------------------------------------------------------------------------------


def test_detect_prefers_v2_with_controllers_else_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    info = (
        f"30 25 0:26 / {v2} rw,nosuid - cgroup2 cgroup2 rw\n"
        "31 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "32 25 0:28 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "33 25 0:29 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
    )
    m = cgroups.detect(mountinfo=info)
    assert isinstance(m, CgroupV2Manager) and m.root == v2
    (v2 / "cgroup.controllers").write_text("\n")  # v2 mounted without controllers (this machine)
    m = cgroups.detect(mountinfo=info)
    assert isinstance(m, CgroupV1Manager)
    assert m.mounts == {
        "memory": Path("/sys/fs/cgroup/memory"),
        "cpu": Path("/sys/fs/cgroup/cpu,cpuacct"),
        "cpuacct": Path("/sys/fs/cgroup/cpu,cpuacct"),
        "pids": Path("/sys/fs/cgroup/pids"),
    }
    assert cgroups.detect(mountinfo=info.splitlines()[0]) is None


def test_v2_against_a_fake_tree(tmp_path: Path) -> None:
    """cgroup v2 is not usable on this machine: its code runs against files."""
    root = tmp_path / "cg"
    (root / "sandvisor" / "sbx").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "sandvisor" / "cgroup.subtree_control").write_text("")
    sbx = root / "sandvisor" / "sbx"
    for f in ("cgroup.procs", "memory.swap.max", "memory.oom.group"):
        (sbx / f).write_text("")
    m = CgroupV2Manager(root)
    assert m.controllers == ["memory", "pids", "cpu"]
    cg = m.create("sbx", CgroupLimits.for_guest(256, 2, overhead_mib=128, pids=100))  # a stale empty one: reused
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (root / "sandvisor" / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (sbx / "memory.max").read_text() == str(384 * MIB)
    assert (sbx / "memory.swap.max").read_text() == "0"
    assert (sbx / "memory.oom.group").read_text() == "1"
    assert (sbx / "pids.max").read_text() == "100"
    assert (sbx / "cpu.max").read_text() == "200000 100000"
    assert cg.procs_files() == (sbx / "cgroup.procs",)
    (sbx / "memory.current").write_text("1234\n")
    (sbx / "memory.peak").write_text("5678\n")
    (sbx / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 1\n")
    (sbx / "pids.current").write_text("7\n")
    (sbx / "cpu.stat").write_text("usage_usec 42\nuser_usec 40\n")
    st = cg.stats()
    assert (st.memory_bytes, st.memory_limit, st.memory_peak, st.oom_kills) == (1234, 384 * MIB, 5678, 1)
    assert (st.pids, st.pids_limit, st.cpu_usage_ns, st.cpu_limit) == (7, 100, 42000, 2.0)
    assert m.names() == {"sbx"}
    (sbx / "cgroup.procs").write_text("4242\n")
    with pytest.raises(CgroupError, match="holds processes"):
        m.create("sbx", CgroupLimits())
    assert m.collect(keep=set()) == {"sbx": {4242}}
    with pytest.raises(CgroupError, match="bad cgroup name"):
        m.create("../escape", CgroupLimits())
    for f in list(sbx.iterdir()):
        f.unlink()
    cg.remove()
    assert not sbx.exists()


@root_only
async def test_v1_memory_limit_kills_only_its_process(
    base: Path, test_cgroups: cgroups.CgroupManager | None, built_helper: Path | None
) -> None:
    m = test_cgroups
    if m is None:
        pytest.skip("no cgroup controllers")
    alloc = allocator()
    greedy = m.create(f"greedy-{os.getpid()}", CgroupLimits(memory_bytes=64 * MIB, pids=16, cpus=0.5))
    calm = m.create(f"calm-{os.getpid()}", CgroupLimits(memory_bytes=64 * MIB, pids=16))
    specs = [jail.JailSpec(identity=alloc.allocate(n), root=base / n) for n in ("greedy", "calm")]
    procs: list[jail.JailedProcess] = []
    try:
        for s in specs:
            jail.build_jail(s)
        hog = "b = bytearray(200 << 20)"
        p1 = await jail.spawn(["/usr/bin/python3", "-c", hog], specs[0], cgroup_procs=greedy.procs_files())
        procs.append(p1)
        p2 = await jail.spawn(["/usr/bin/sleep", "30"], specs[1], cgroup_procs=calm.procs_files(), helper=built_helper)
        procs.append(p2)
        with trio.fail_after(30):
            assert await p1.wait() == -signal.SIGKILL
        assert greedy.oom_kills() == 1
        assert calm.oom_kills() == 0 and p2.returncode is None
        st = greedy.stats()
        assert st.memory_limit == 64 * MIB and st.memory_peak is not None and st.memory_peak >= 60 * MIB
        assert (st.pids_limit, st.cpu_limit) == (16, 0.5)
    finally:
        with trio.CancelScope(shield=True):
            for p in procs:
                p.kill()
                await p.wait()
        for cg in (greedy, calm):
            cg.remove()
        for s in specs:
            jail.remove_jail(s.root)
    assert not m.names()


# -- the jail ------------------------------------------------------------------------------------------


@root_only
async def test_spawn_runs_contained_with_only_passed_fds(base: Path, helper: Path | None) -> None:
    spec = jail.JailSpec(identity=allocator().allocate("t"), root=base / "j")
    jail.build_jail(spec)
    extra = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    leak = os.open("/etc/hostname", os.O_RDONLY)  # inheritable, not passed: must not reach it
    r, w = os.pipe()
    code = (
        "import os; print(sorted(int(x) for x in os.listdir('/proc/self/fd')));"
        "print(sorted(os.listdir('/'))); print(os.path.exists('/etc/hostname'))"
    )
    try:
        p = await jail.spawn(
            ["/usr/bin/python3", "-I", "-S", "-c", code], spec, pass_fds=(extra,), stdout=w, helper=helper
        )
        os.close(w)
        st = proc_status(p.pid)
        me = {k: os.readlink(f"/proc/self/ns/{k}") for k in ("mnt", "pid", "net", "ipc", "uts", "cgroup")}
        for kind, mine in me.items():
            assert os.readlink(f"/proc/{p.pid}/ns/{kind}") != mine, kind
        root_st, jail_st = os.stat(f"/proc/{p.pid}/root"), os.stat(spec.root)
        assert (root_st.st_dev, root_st.st_ino) == (jail_st.st_dev, jail_st.st_ino)
        assert st["Uid"].split() == [str(spec.identity.uid)] * 4
        assert st["NoNewPrivs"] == "1" and st["NSpid"].split()[-1] == "1"
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(st[cap], 16) == 0, cap
        with trio.fail_after(30):
            assert await p.wait() == 0
        out = b""
        while chunk := os.read(r, 4096):
            out += chunk
        fds, entries, leaked = out.decode().splitlines()
        assert fds == str(sorted([0, 1, 2, 3, extra]))  # 3: listdir's own
        assert entries == str(sorted(["bin", "dev", "lib", "lib64", "proc", "run", "sbin", "usr"]))
        assert leaked == "False"
    finally:
        for fd in (extra, leak, r):
            os.close(fd)
        jail.remove_jail(spec.root)
    assert not spec.root.exists()


@root_only
async def test_spawn_failures_name_the_step(base: Path, helper: Path | None) -> None:
    ident = allocator().allocate("t")
    spec = jail.JailSpec(identity=ident, root=base / "j", netns=Path("/etc/hostname"))
    jail.build_jail(spec)
    try:
        with pytest.raises(jail.JailError, match="enter the network namespace"):
            await jail.spawn(["/usr/bin/true"], spec, helper=helper)
        with pytest.raises(jail.JailError, match="outside every bind"):
            await jail.spawn(
                [shutil.which("python3") or "/nonexistent"], jail.JailSpec(identity=ident, root=base / "j", binds=())
            )
        with pytest.raises(jail.JailError, match="No such file"):
            await jail.spawn(
                ["/usr/bin/true"], jail.JailSpec(identity=ident, root=base / "j", netns=Path("/nope")), helper=helper
            )
        missing = jail.JailSpec(
            identity=ident, root=base / "j", binds=(*jail.default_binds(), jail.Bind(base / "gone", "/x"))
        )
        with pytest.raises(jail.JailError, match=r"(mount .*/x|bind .*gone): No such file"):
            await jail.spawn(["/usr/bin/true"], missing, helper=helper)
    finally:
        jail.remove_jail(spec.root)
    spec.root.mkdir()
    with pytest.raises(jail.JailError, match="exists already"):
        jail.build_jail(spec)
    spec.root.rmdir()
    with pytest.raises(jail.JailError, match="only /dev/null"):
        jail.build_jail(jail.JailSpec(identity=ident, root=base / "dev", devices=("/dev/sda",)))
    assert not (base / "dev").exists()
    (base / "open").mkdir(mode=0o777)
    (base / "open").chmod(0o777)
    with pytest.raises(jail.JailError, match="writable by group or others"):
        jail.build_jail(jail.JailSpec(identity=ident, root=base / "open" / "j"))


# -- guest memory ----------------------------------------------------------------------------------------


@root_only
def test_private_dir_is_made_checked_and_foreign_ones_refused(shm: Path) -> None:
    d = guestmem.private_dir(shm / "ram")
    st = d.lstat()
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    assert guestmem.private_dir(shm / "ram") == d  # ours: accepted again
    other = shm / "theirs"
    other.mkdir(mode=0o700)
    os.chown(other, 1_900_300_000, 1_900_300_000)
    with pytest.raises(UnsafeDirectory, match="belongs to uid 1900300000"):
        guestmem.private_dir(other)
    loose = shm / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    with pytest.raises(UnsafeDirectory, match="mode 755"):
        guestmem.private_dir(loose)
    (shm / "link").symlink_to(d)
    with pytest.raises(UnsafeDirectory, match="symlink"):
        guestmem.private_dir(shm / "link")


@root_only
def test_ram_files_are_exclusive_and_the_sandboxs_own(shm: Path) -> None:
    d = guestmem.private_dir(shm / "ram")
    ident = jail.Identity(1_900_300_001, 1_900_300_001)
    fd = guestmem.create_ram_file(d, "a.ram", 4 * MIB, ident)
    try:
        st = os.fstat(fd)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_size) == (ident.uid, ident.gid, 0o600, 4 * MIB)
        with pytest.raises(MemoryFileError, match="File exists"):
            guestmem.create_ram_file(d, "a.ram", MIB, ident)
        (d / "b.ram").symlink_to("/etc/passwd")
        with pytest.raises(MemoryFileError, match="File exists"):
            guestmem.create_ram_file(d, "b.ram", MIB, ident)
        assert Path("/etc/passwd").stat().st_size != MIB
    finally:
        os.close(fd)
        guestmem.remove_ram_file(d, "a.ram")
    assert not (d / "a.ram").exists()


def test_sealed_copy_keeps_contents_and_holes_and_refuses_every_write(tmp_path: Path) -> None:
    src = tmp_path / "memory"
    with open(src, "wb") as f:
        f.truncate(8 * MIB)
        f.seek(MIB)
        f.write(b"A" * 4096)
        f.seek(6 * MIB)
        f.write(b"B" * 8192)
    fd = guestmem.sealed_copy(src)
    try:
        assert guestmem.is_sealed(fd)
        st = os.fstat(fd)
        assert st.st_size == 8 * MIB and st.st_blocks * 512 <= 64 * 1024  # holes stay holes
        with open(src, "rb") as f:
            assert os.pread(fd, 8 * MIB, 0) == f.read()
        import mmap

        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, MIB)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # what QEMU does: allowed ...
        try:
            with pytest.raises(PermissionError):
                os.pwrite(again, b"x", 0)  # ... but it cannot write through it
            m = mmap.mmap(again, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            m[0:1] = b"y"  # a private (copy-on-write) map is writable
            assert os.pread(fd, 1, 0) == b"\0"
            m.close()
        finally:
            os.close(again)
    finally:
        os.close(fd)


def test_sealed_memory_cache_fills_once_and_trims_idle(tmp_path: Path) -> None:
    for name in ("a", "b"):
        with open(tmp_path / name, "wb") as f:
            f.write(name.encode() * MIB)
    cache = guestmem.SealedMemoryCache(budget=MIB + 1)
    try:
        fa = cache.acquire("a", tmp_path / "a")
        fa2 = cache.acquire("a", tmp_path / "a")
        assert os.fstat(fa).st_ino == os.fstat(fa2).st_ino  # one memfd, shared
        fb = cache.acquire("b", tmp_path / "b")  # over budget, but a is held: both kept
        assert cache.cached_bytes == 2 * MIB
        cache.release("a", fa)
        cache.release("a", fa2)  # a idle now and the oldest: dropped
        assert cache.cached_bytes == MIB
        cache.release("b", fb)
        with pytest.raises(MemoryFileError, match="unsealed"):
            cache.put("c", os.memfd_create("x"))
    finally:
        cache.close()


# -- jailed QEMU ------------------------------------------------------------------------------------------


@root_only
@pytest.mark.vm
async def test_jailed_qemu_is_contained_checkpoints_and_restores_sealed(
    img: Image,
    base: Path,
    shm: Path,
    qmp: None,
    test_cgroups: cgroups.CgroupManager | None,
    built_helper: Path | None,
) -> None:
    """Boot in a jail to guestd's hello with QMP on a listening socket in the jail;
    check the jail from /proc; checkpoint over that QMP (add-fd); restore from a sealed
    memfd in a second jail; no other sandbox's uid can write either's memory; nothing
    is left behind."""
    alloc = allocator()
    mgr = test_cgroups
    a_id, b_id, c_id = alloc.allocate("a"), alloc.allocate("b"), alloc.allocate("c")
    ram_dir = shm / "ram"
    opts = JailOptions(identity=a_id, base=base, ram_dir=ram_dir, cgroups=mgr, qmp_socket=True, helper=built_helper)
    (base / "a").mkdir()
    snap = base / "snap"
    snap.mkdir()
    seen: dict[str, int] = {}
    with trio.fail_after(240):
        async with jailed_guest(img, "a", opts, disk_dir=base / "a") as a:
            vm, pid = a.guest.machine, a.guest.machine.pid
            assert pid is not None
            seen["mnt"] = os.stat(f"/proc/{pid}/ns/mnt").st_ino
            st = proc_status(pid)
            assert st["Uid"].split() == [str(a_id.uid)] * 4 and a_id.uid not in (0, 65534)
            assert st["Groups"] == ""
            assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
            for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(st[cap], 16) == 0, cap
            for kind in ("mnt", "pid", "net", "ipc", "uts", "cgroup"):
                assert os.readlink(f"/proc/{pid}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}"), kind
            assert st["NSpid"].split() == [str(pid), "1"]  # QEMU itself is pid 1 of its namespace
            root_st, jail_st = os.stat(f"/proc/{pid}/root"), os.stat(a.spec.root)
            assert (root_st.st_dev, root_st.st_ino) == (jail_st.st_dev, jail_st.st_ino)
            # open descriptors: only what we passed (and QEMU's reopens of it) by path
            targets = [os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")]
            paths = {t for t in targets if t.startswith("/")}
            chain = vm.spec.disk_chain
            assert paths == {"/dev/null", str(img.kernel), str(img.initrd), str(ram_dir / "a.ram")} | {
                str(vm.spec.disk),
                *map(str, chain),
            }
            kinds = {t.split(":")[0] for t in targets if not t.startswith("/")}
            assert kinds <= {"socket", "pipe", "anon_inode"}, kinds
            # QMP: a listening socket in the jail, fd passing works over it
            assert (a.spec.socket_host_dir / "qmp.sock").is_socket()
            nul = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
            try:
                await vm.add_fd(nul, 77, "probe")
            finally:
                os.close(nul)
            sets = await vm.qmp_execute("query-fdsets")
            assert any(s["fdset-id"] == 77 for s in sets)
            # cgroup: limits set, QEMU in it
            if a.cgroup is not None:
                cst = a.cgroup.stats()
                assert cst.memory_limit == (256 + opts.overhead_mib) * MIB
                assert (cst.pids_limit, cst.cpu_limit) == (256, 1.0)
                assert pid in a.cgroup.pids() and 0 < cst.memory_bytes <= cst.memory_limit
                seen["cg"] = 1
            # the RAM file: the sandbox's, in the supervisor's 0700 dir
            rst = (ram_dir / "a.ram").stat()
            assert (rst.st_uid, stat.S_IMODE(rst.st_mode)) == (a_id.uid, 0o600)
            assert (ram_dir.stat().st_uid, stat.S_IMODE(ram_dir.stat().st_mode)) == (0, 0o700)
            await a.guest.channel.run(["sh", "-c", "echo kept-in-memory > /run/mark"])
            await checkpoint_guest(a.guest, files=OverlayFiles(base / "a" / "disk.qcow2"), snap_dir=snap, user=None)
        assert stat.S_IMODE((snap / "memory").stat().st_mode) == 0o600 and (snap / "memory").stat().st_uid == 0
        mfd = guestmem.sealed_copy(snap / "memory")
        (base / "b").mkdir()
        try:
            opts_b = JailOptions(identity=b_id, base=base, ram_dir=ram_dir, cgroups=mgr)  # the Python stage
            async with jailed_guest(
                img,
                "b",
                opts_b,
                disk_dir=base / "b",
                restore=snap / "vmstate",
                restore_memory=snap / "memory",
                restore_memory_fd=mfd,
                restore_disk=snap / "disk.qcow2",
            ) as b:
                r = await b.guest.channel.run(["cat", "/run/mark"])
                assert r.stdout == b"kept-in-memory\n"
                bpid = b.guest.machine.pid
                assert proc_status(bpid)["Uid"].split()[0] == str(b_id.uid)
                memfds = [n for n in os.listdir(f"/proc/{bpid}/fd") if "memfd:" in os.readlink(f"/proc/{bpid}/fd/{n}")]
                assert memfds, "QEMU maps the sealed memfd"
                probe = f"""
import os, mmap
def tryit(what, f):
    try:
        f(); print(what, "OK")
    except OSError as e:
        print(what, e.errno)
tryit("snapshot-file-rw", lambda: os.open({str(snap / "memory")!r}, os.O_RDWR))
tryit("snapshot-file-ro", lambda: os.open({str(snap / "memory")!r}, os.O_RDONLY))
tryit("ram-file-rw", lambda: os.open({str(ram_dir / "a.ram")!r}, os.O_RDWR))
for n in {memfds!r}:
    p = "/proc/{bpid}/fd/" + n
    try:
        fd = os.open(p, os.O_RDWR)
    except OSError as e:
        print("memfd-open", e.errno); continue
    tryit("memfd-write", lambda: os.pwrite(fd, b"x", 0))
    tryit("memfd-truncate", lambda: os.ftruncate(fd, 0))
    tryit("memfd-shared-map", lambda: mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
"""
                # B's own uid (the QEMU that maps it): may open its memfd, may not change it
                out_b = run_as(b_id.uid, b_id.gid, probe).stdout.split("\n")
                assert "snapshot-file-rw 13" in out_b and "snapshot-file-ro 13" in out_b, out_b
                assert "ram-file-rw 13" in out_b
                assert "memfd-write 1" in out_b and "memfd-truncate 1" in out_b and "memfd-shared-map 1" in out_b
                # another sandbox's uid cannot even open it (ptrace access to B is denied)
                out_c = run_as(c_id.uid, c_id.gid, probe).stdout.split("\n")
                assert "memfd-open 13" in out_c and "snapshot-file-rw 13" in out_c, out_c
                assert guestmem.is_sealed(mfd)
        finally:
            os.close(mfd)
    # nothing left: processes, mount namespace, cgroups, jail dirs, RAM file
    assert not uids_with_processes({a_id.uid, b_id.uid})
    assert ns_holders(seen["mnt"], "mnt") == []
    assert not (base / "jail" / "a").exists() and not (base / "jail" / "b").exists()
    assert not (ram_dir / "a.ram").exists()
    if mgr is not None:
        assert not {"a", "b"} & mgr.names()


@root_only
@pytest.mark.vm
async def test_guest_over_its_memory_limit_fails_alone(
    img: Image, base: Path, shm: Path, qmp: None, test_cgroups: cgroups.CgroupManager | None
) -> None:
    """Guest A touches more than its cgroup allows: its QEMU is killed and the cgroup
    says so; guest B runs on. As A's uid, B's RAM file cannot be opened."""
    mgr = test_cgroups
    if mgr is None:
        pytest.skip("no cgroup controllers")
    alloc = allocator()
    a_id, b_id = alloc.allocate("a"), alloc.allocate("b")
    ram = shm / "ram"
    for n in ("a", "b"):
        (base / n).mkdir()
    with trio.fail_after(240):
        async with (
            jailed_guest(
                img,
                "oom-a",
                JailOptions(identity=a_id, base=base, ram_dir=ram, cgroups=mgr),
                disk_dir=base / "a",
                memory_mib=512,
                limits=CgroupLimits(memory_bytes=320 * MIB, pids=256, cpus=1),
            ) as a,
            jailed_guest(
                img,
                "oom-b",
                JailOptions(identity=b_id, base=base, ram_dir=ram, cgroups=mgr),
                disk_dir=base / "b",
            ) as b,
        ):
            bpid = b.guest.machine.pid
            out = run_as(
                a_id.uid,
                a_id.gid,
                f"import os\nfor p in ({str(ram / 'oom-b.ram')!r}, '/proc/{bpid}/fd/0', '/proc/{bpid}/mem'):\n"
                "    try:\n        os.open(p, os.O_RDWR); print(p, 'OK')\n"
                "    except OSError as e:\n        print(p, e.errno)\n",
            ).stdout
            assert "OK" not in out and out.count(" 13") == 3, out
            assert a.cgroup is not None
            try:
                await a.guest.channel.run(["sh", "-c", "head -c 400M /dev/zero > /dev/shm/fill"])
            except (GuestError, ChannelBroken, MachineError):
                pass
            rc = await a.guest.machine.wait()
            assert rc == -signal.SIGKILL
            assert a.cgroup.oom_kills() >= 1  # the error the lead reports: killed by its memory limit
            assert (await b.guest.channel.run(["echo", "alive"])).stdout == b"alive\n"
            assert b.cgroup is not None and b.cgroup.oom_kills() == 0


@root_only
@pytest.mark.vm
async def test_jail_network_namespace_hides_the_host(
    img: Image, base: Path, shm: Path, qmp: None, built_helper: Path | None
) -> None:
    """slirp runs in the jail's empty network namespace: the guest's 10.0.2.2 is the
    jail's loopback, not the host's (a host service on 127.0.0.1 is out of reach), and
    an exposed port (hostfwd) listens inside the jail, where the supervisor reaches it
    with a socket made in that namespace (jail.socket_in_netns)."""
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(4)
    host_port = host.getsockname()[1]
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    fwd_port = probe.getsockname()[1]  # free on the host loopback
    probe.close()
    ident = allocator().allocate("net")
    (base / "n").mkdir()
    opts = JailOptions(identity=ident, base=base, ram_dir=shm / "ram", helper=built_helper)
    try:
        with trio.fail_after(180):
            async with jailed_guest(img, "net", opts, disk_dir=base / "n", network=NetConfig(restrict=False)) as jg:
                chan, pid = jg.guest.channel, jg.guest.machine.pid
                assert pid is not None
                reach = (
                    "import socket, sys\n"
                    "try:\n"
                    f"    socket.create_connection(('10.0.2.2', {host_port}), timeout=5); print('reached')\n"
                    "except OSError as e:\n"
                    "    print('refused', e.errno)\n"
                )
                r = await chan.run(["python3", "-c", reach])
                assert r.stdout.startswith(b"refused"), r
                await chan.run(["sh", "-c", "(python3 -m http.server 8080 >/dev/null 2>&1 &)"])
                reply = await jg.guest.machine.hmp(f"hostfwd_add n0 tcp:127.0.0.1:{fwd_port}-:8080")
                assert reply.strip() == "", reply
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(("127.0.0.1", fwd_port), timeout=5).close()
                while True:  # the guest's server takes a moment to start under TCG
                    assert isinstance(jg.guest.machine.proc, jail.JailedProcess)
                    s = await jail.socket_in_netns(jg.guest.machine.proc)
                    try:
                        s.settimeout(5)
                        s.connect(("127.0.0.1", fwd_port))
                        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                        data = s.recv(100)
                        if data:
                            break
                    except OSError:
                        pass
                    finally:
                        s.close()
                    await trio.sleep(0.2)
                assert data.startswith(b"HTTP/1.0 200"), data
    finally:
        host.close()
