"""The jail (actors/cells/jail.py), cgroups (actors/cells/cgroups.py) and guest memory
(actors/cells/guestmem.py): units against fakes where the host cannot show a case (cgroup v2
here), real processes and real jailed QEMUs for the rest."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from actors.cells import cgroups, guestmem, identities, jail
from actors.cells.cgroups import CgroupError, CgroupLimits, CgroupV1Manager, CgroupV2Manager
from actors.cells.guestmem import MemoryFileError, UnsafeDirectory
from actors.net.netns import NetError
from images.build import Image, load_default


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the jail needs root")
MIB = 1 << 20


@pytest.fixture
def img(request: pytest.FixtureRequest) -> Image:
    """The built default image, read-only (the session's ``image`` builds it when absent)."""
    found = load_default()
    return found if found is not None else request.getfixturevalue("image")


@pytest.fixture
def helper(jail_helpers: tuple[Path, Path]) -> Path:
    """sandvisor-jail-exec, the one way into the jail (built at install)."""
    return jail_helpers[0]


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
    """The host's cgroups under a parent of this test run's own (test runs in other
    checkouts go on beside it), removed after; parents of runs that are gone too."""
    v2, v1 = cgroups.cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    roots = [r for r in (v2, *v1.values()) if r is not None]
    for name in {d.name for root in roots for d in root.glob("sandvisor-test-*")}:
        pid = name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            stale = cgroups.detect(parent=name)
            if stale is not None:
                stale.collect(keep=set())
                stale.remove_parent()
    mgr = cgroups.detect(parent=f"sandvisor-test-{os.getpid()}")
    yield mgr
    if mgr is not None:
        mgr.remove_parent()
        assert not any(d.exists() for d in mgr.parent_dirs())


def allocator() -> identities.IdentityAllocator:
    """Sandbox ids, none of which a process on this host has (other test runs, benchmarks)."""
    alloc = identities.IdentityAllocator()
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
    with pytest.raises(identities.JailError, match="passwd has 'bob'"):
        identities.IdentityAllocator(4000, 2000, etc=tmp_path)
    with pytest.raises(identities.JailError, match="subuid gives 'bob'"):
        identities.IdentityAllocator(150000, 10, etc=tmp_path)
    with pytest.raises(identities.JailError, match="65534"):
        identities.IdentityAllocator(60000, 10000, etc=tmp_path)
    with pytest.raises(identities.JailError, match="not a valid range"):
        identities.IdentityAllocator(0, 10, etc=tmp_path)
    identities.IdentityAllocator(200000, 1000, etc=tmp_path)  # clear of everything


def test_identities_are_never_shared_and_reused_late(tmp_path: Path) -> None:
    alloc = identities.IdentityAllocator(1_900_100_000, 3, etc=tmp_path)
    a, b, c = (alloc.allocate(x) for x in "abc")
    assert len({a.uid, b.uid, c.uid}) == 3 and all(i.uid == i.gid for i in (a, b, c))
    with pytest.raises(identities.JailError, match="no free sandbox uid"):
        alloc.allocate("d")
    alloc.release(b)
    assert alloc.allocate("d") == b  # the only free one
    alloc.release(a)
    alloc.release(c)
    # round-robin: the next after the last handed out, not the lowest free
    assert alloc.allocate("e") == c
    with pytest.raises(identities.JailError, match="live for e"):
        alloc.adopt(c, "f")
    alloc.adopt(a, "a-again")
    assert alloc.live == {a.uid: "a-again", b.uid: "d", c.uid: "e"}


@root_only
def test_running_processes_keep_their_uid(tmp_path: Path) -> None:
    alloc = identities.IdentityAllocator(1_900_200_000, 2, etc=tmp_path)
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
    assert (sbx / "cpu.max").read_text() == "300000 100000"  # 2 vCPUs + the I/O thread's headroom
    assert (sbx / "cpu.weight").read_text() == "200"  # shared by vCPUs under contention
    assert cg.procs_files() == (sbx / "cgroup.procs",)
    (sbx / "memory.current").write_text("1234\n")
    (sbx / "memory.peak").write_text("5678\n")
    (sbx / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 1\n")
    (sbx / "pids.current").write_text("7\n")
    (sbx / "cpu.stat").write_text("usage_usec 42\nuser_usec 40\n")
    st = cg.stats()
    assert (st.memory_bytes, st.memory_limit, st.memory_peak, st.oom_kills) == (1234, 384 * MIB, 5678, 1)
    assert (st.pids, st.pids_limit, st.cpu_usage_ns, st.cpu_limit) == (7, 100, 42000, 3.0)
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
    base: Path, test_cgroups: cgroups.CgroupManager | None, helper: Path
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
        p1 = await jail.spawn(
            ["/usr/bin/python3", "-c", hog], specs[0], cgroup_procs=greedy.procs_files(), helper=helper
        )
        procs.append(p1)
        p2 = await jail.spawn(["/usr/bin/sleep", "30"], specs[1], cgroup_procs=calm.procs_files(), helper=helper)
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


@root_only
async def test_a_private_map_of_a_memfd_charges_its_holes_to_the_toucher(
    base: Path, test_cgroups: cgroups.CgroupManager | None, helper: Path
) -> None:
    """Why a restore's memfd gets its holes allocated by the supervisor: a process that
    writes 64 MiB to its private (copy-on-write) map of a sealed memfd with holes is
    charged twice that (its copies and the memfd's new pages) and killed by a 112 MiB
    cgroup; the same writes to a memfd the cache handed out (holes allocated) fit."""
    m = test_cgroups
    if m is None:
        pytest.skip("no cgroup controllers")
    alloc = allocator()
    src = base / "memory"
    with open(src, "wb") as f:
        f.truncate(64 * MIB)
    cache = guestmem.SealedMemoryCache()
    writer = (
        "import mmap, sys\n"
        "m = mmap.mmap(int(sys.argv[1]), 64 << 20, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)\n"
        "for i in range(0, 64 << 20, 4096): m[i] = 1\n"
    )
    outcomes: list[int] = []
    try:
        for n, fd in enumerate((guestmem.sealed_copy(src), cache.acquire("s", src))):
            cg = m.create(f"toucher{n}-{os.getpid()}", CgroupLimits(memory_bytes=112 * MIB, pids=16))
            spec = jail.JailSpec(identity=alloc.allocate(f"t{n}"), root=base / f"t{n}")
            try:
                jail.build_jail(spec)
                p = await jail.spawn(
                    ["/usr/bin/python3", "-I", "-S", "-c", writer, str(fd)],
                    spec,
                    pass_fds=(fd,),
                    cgroup_procs=cg.procs_files(),
                    helper=helper,
                )
                with trio.fail_after(60):
                    outcomes.append(await p.wait())
            finally:
                if n:
                    cache.release("s", fd)
                else:
                    os.close(fd)
                cg.remove()
                jail.remove_jail(spec.root)
    finally:
        cache.close()
    assert outcomes == [-signal.SIGKILL, 0]
    assert not m.names()


# -- the jail ------------------------------------------------------------------------------------------


@root_only
async def test_spawn_runs_contained_with_only_passed_fds(base: Path, helper: Path) -> None:
    spec = jail.JailSpec(identity=allocator().allocate("t"), root=base / "j")
    jail.build_jail(spec)
    extra = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    leak = os.open("/etc/hostname", os.O_RDONLY)  # inheritable, not passed: must not reach it
    r, w = os.pipe()
    go_r, go_w = os.pipe()  # the child waits on its stdin until its /proc entries are read
    code = (
        "import os; os.read(0, 1); print(sorted(int(x) for x in os.listdir('/proc/self/fd')));"
        "print(sorted(os.listdir('/'))); print(os.path.exists('/etc/hostname'))"
    )
    try:
        p = await jail.spawn(
            ["/usr/bin/python3", "-I", "-S", "-c", code],
            spec,
            pass_fds=(extra,),
            stdin=go_r,
            stdout=w,
            helper=helper,
        )
        os.close(w)
        os.close(go_r)
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
        os.write(go_w, b"g")  # (a child that had exited already is a zombie: no namespaces, no root to read)
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
        for fd in (extra, leak, r, go_w):
            os.close(fd)
        jail.remove_jail(spec.root)
    assert not spec.root.exists()


@root_only
async def test_spawn_failures_name_the_step(base: Path, helper: Path) -> None:
    ident = allocator().allocate("t")
    spec = jail.JailSpec(identity=ident, root=base / "j", netns=Path("/etc/hostname"))
    jail.build_jail(spec)
    try:
        with pytest.raises(identities.JailError, match="enter the network namespace"):
            await jail.spawn(["/usr/bin/true"], spec, helper=helper)
        with pytest.raises(identities.JailError, match="outside every bind"):
            await jail.spawn(
                [shutil.which("python3") or "/nonexistent"],
                jail.JailSpec(identity=ident, root=base / "j", binds=()),
                helper=helper,
            )
        with pytest.raises(identities.JailError, match="No such file"):
            await jail.spawn(
                ["/usr/bin/true"], jail.JailSpec(identity=ident, root=base / "j", netns=Path("/nope")), helper=helper
            )
        missing = jail.JailSpec(
            identity=ident, root=base / "j", binds=(*jail.default_binds(), jail.Bind(base / "gone", "/x"))
        )
        with pytest.raises(identities.JailError, match=r"mount .*/x: No such file"):
            await jail.spawn(["/usr/bin/true"], missing, helper=helper)
    finally:
        jail.remove_jail(spec.root)
    spec.root.mkdir()
    with pytest.raises(identities.JailError, match="exists already"):
        jail.build_jail(spec)
    spec.root.rmdir()
    with pytest.raises(identities.JailError, match="only /dev/null"):
        jail.build_jail(jail.JailSpec(identity=ident, root=base / "dev", devices=("/dev/sda",)))
    assert not (base / "dev").exists()
    (base / "open").mkdir(mode=0o777)
    (base / "open").chmod(0o777)
    with pytest.raises(identities.JailError, match="writable by group or others"):
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
    ident = identities.Identity(1_900_300_001, 1_900_300_001)
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


# -- no cgroups: serve fails closed; `ip netns exec` keeps them ------------------------------------


def test_hierarchy_mounts_from_proc_self_cgroup() -> None:
    v1 = "9:name=systemd:/\n8:pids:/\n7:blkio:/\n4:memory:/a/b\n2:cpu,cpuacct:/\n0::/\n"
    assert cgroups.hierarchy_mounts(v1) == [
        ("cgroup", "pids"),
        ("cgroup", "memory"),
        ("cgroup", "cpu,cpuacct"),  # co-mounted: mounted again only together
        ("cgroup2", ""),
    ]
    assert cgroups.hierarchy_mounts("0::/user.slice/session-1.scope\n") == [("cgroup2", "")]  # v2 host
    assert cgroups.hierarchy_mounts("1:name=systemd:/\n") == []


def test_mount_hierarchies_refuses_others_dirs_and_no_hierarchy(tmp_path: Path) -> None:
    with pytest.raises(CgroupError, match="no cgroup hierarchy"):
        cgroups.mount_hierarchies(tmp_path / "m", proc_cgroup="1:name=systemd:/\n")
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(CgroupError, match="not a 0700 directory"):
        cgroups.mount_hierarchies(loose, proc_cgroup="4:memory:/\n")
    assert not any(loose.iterdir())


def test_serve_refuses_to_start_without_cgroups_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A jailed supervisor with no usable hierarchy (detect finds none, mounting fails)
    does not start; with --no-cgroups (cgroups=False) it starts unlimited, warning."""
    from actors.cells import cell

    monkeypatch.setattr(cgroups, "detect", lambda parent="", mountinfo=None: None)  # /sys/fs/cgroup empty
    monkeypatch.setattr(cgroups, "MOUNT_DIR", tmp_path / "loose")
    (tmp_path / "loose").mkdir(mode=0o755)
    (tmp_path / "loose").chmod(0o755)  # mounting refused too
    (tmp_path / "state").mkdir(mode=0o700)  # (serve makes it before the cells)
    cfg = cell.JailConfig()
    given = {"helper": tmp_path / "unused", "discard_shim": None, "state_dir": tmp_path / "state", "ram_dir": None}
    with pytest.raises(CgroupError, match=r"without memory, process and CPU limits.*--no-cgroups"):
        cell.Cells.setup(cfg, kvm=False, **given)
    cells = cell.Cells.setup(cfg, kvm=False, cgroups=False, **given)
    try:
        assert cells.cgroups is None
        assert "--no-cgroups: QEMUs run without resource limits" in caplog.text
    finally:
        cells.close()


@root_only
def test_an_exit_removes_what_closes_left_and_the_parent_in_every_hierarchy(
    test_cgroups: cgroups.CgroupManager | None,
) -> None:
    """A cgroup a cell's close could not remove (busy then) goes at supervisor exit,
    and the parent with it in every hierarchy; one that holds a process stays, and the
    parent with it, until it is empty."""
    m = test_cgroups
    if m is None:
        pytest.skip("no cgroup hierarchy with memory and pids")
    m.create("left", CgroupLimits(memory_bytes=64 << 20, pids=8))
    busy = m.create("busy", CgroupLimits(memory_bytes=64 << 20, pids=8))
    p = subprocess.Popen(["sleep", "60"])
    try:
        for f in busy.procs_files():
            f.write_text(str(p.pid))
        assert not m.remove_empty()
        assert m.names() == {"busy"}
        assert all(d.is_dir() for d in m.parent_dirs())
    finally:
        p.kill()
        p.wait()
    assert m.remove_empty()
    assert not any(d.exists() for d in m.parent_dirs())


@root_only
def test_ip_netns_exec_still_finds_the_cgroups(tmp_path: Path) -> None:
    """`ip netns exec` gives its command a mount namespace with a fresh /sys (no
    /sys/fs/cgroup mounts): find() mounts the process's own hierarchies privately
    there, and a cgroup made through them has the limits (the same kernel hierarchy)."""
    if not shutil.which("ip"):
        pytest.skip("needs ip")
    parent = f"sandvisor-test-netns-{os.getpid()}"
    script = f"""
import sys
from pathlib import Path
from actors.cells import cgroups
assert cgroups.detect({parent!r}) is None, "ip netns exec hid no cgroup mount"
m = cgroups.find({parent!r}, mount_dir=Path({str(tmp_path / "cg")!r}))
cg = m.create("probe", cgroups.CgroupLimits(memory_bytes=64 << 20, pids=17))
try:
    st = cg.stats()
    print(m.version, st.memory_limit, st.pids_limit, *sorted(str(d) for d in m.parent_dirs()))
finally:
    cg.remove()
    m.remove_parent()
"""
    ns = f"svt-cg-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        res = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).parents[2],
            check=False,
        )
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    assert res.returncode == 0, res.stderr
    version, memory, pids, *dirs = res.stdout.split()
    assert (memory, pids) == (str(64 << 20), "17")
    assert all(d.startswith(str(tmp_path / "cg")) for d in dirs)
    # the mounts stayed in that namespace: nothing of them here
    assert str(tmp_path / "cg") not in Path("/proc/self/mountinfo").read_text()
    assert version in ("1", "2") and not any(Path(d).exists() for d in dirs)


@pytest.mark.parametrize(
    "exc",
    [
        CgroupError("no cgroup hierarchy with memory and pids ...; not starting (serve --no-cgroups runs them so)"),
        NetError("another supervisor runs tap networking in this network namespace"),
    ],
)
def test_serve_refusals_are_one_line(
    tmp_path: Path, exc: Exception, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from supervisor.main import cli, daemon

    async def refused(cfg: daemon.DaemonConfig) -> None:
        assert not cfg.cgroups  # --no-cgroups reached the config
        raise exc

    monkeypatch.setattr(daemon, "serve", refused)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--no-cgroups", "--state-dir", str(tmp_path), "--socket", str(tmp_path / "s")])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: sandvisor serve: ") and str(exc) in err.replace("\n", " ") and "Traceback" not in err
