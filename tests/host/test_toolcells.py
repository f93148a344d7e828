"""Host tools on hostile data in cells: e2fsck on a guest's volume, skopeo,
umoci and mkfs.ext4 on a registry's image, each in a cell built by the jail's own
machinery (actors/cells/toolcell.py); image pulls capped while the bytes arrive.

Real tools, a real loopback docker-registry, real cells (root: uids, namespaces,
cgroups). Each run is observed while it runs: its /proc says which uid, which
namespaces, which capabilities."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from actors.cells.cell import Cells, JailConfig
from actors.cells.toolcell import ToolSpawn
from actors.model import VolumeMount
from actors.store import Store
from actors.volumes import Volumes
from images.build import Image as GuestImage
from images.oci import DiskFull, ImageStore
from images.ocilocal import ImageSpec, Layer, LocalRegistry, build_image, busybox_tree, push
from supervisor.client import AsyncSandbox, AsyncVolumes
from supervisor.main.throwaway import supervisor, workdir
from tests.support.registrylab import REFS, Built, Pushed, assert_clean, owner

MIB = 1 << 20


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


@pytest.fixture
def cells(tmp_path: Path, jail_helpers: tuple[Path, Path]) -> Iterator[Cells]:
    if os.geteuid() != 0:
        pytest.skip("cells need root")
    (tmp_path / "state").mkdir(mode=0o700)
    c = Cells.setup(
        JailConfig(), helper=jail_helpers[0], discard_shim=None, state_dir=tmp_path / "state", ram_dir=None, kvm=False
    )
    try:
        yield c
    finally:
        c.close()


class Watch:
    """Every tool spawn, and what /proc said of it right after (stopped for the look)."""

    def __init__(self) -> None:
        self.spawns: list[tuple[ToolSpawn, dict[str, str], dict[str, bool]]] = []

    def __call__(self, s: ToolSpawn) -> None:
        os.kill(s.pid, 19)  # SIGSTOP: look at it while it runs
        try:
            st = _status(s.pid)
            ns: dict[str, bool] = {}
            try:
                for n in ("mnt", "pid", "net", "ipc", "uts", "user"):
                    ns[n] = os.readlink(f"/proc/{s.pid}/ns/{n}") != os.readlink(f"/proc/self/ns/{n}")
            except OSError:
                # It had exited already. All or nothing: a zombie still shows its pid and
                # user namespaces (they hang off its struct pid and creds) but not the rest.
                ns = {}
            self.spawns.append((s, st, ns))
        finally:
            os.kill(s.pid, 18)  # SIGCONT

    def of(self, tool: str) -> list[tuple[ToolSpawn, dict[str, str], dict[str, bool]]]:
        return [x for x in self.spawns if x[0].argv[0] == tool]


def assert_confined(cells: Cells, seen: tuple[ToolSpawn, dict[str, str], dict[str, bool]], *, userns: bool) -> None:
    s, st, ns = seen
    uids = {int(x) for x in st["Uid"].split()}
    assert len(uids) == 1 and 0 not in uids, st["Uid"]
    (uid,) = uids
    assert cells.allocator.first <= uid < cells.allocator.first + cells.allocator.count + 65536
    assert st["NoNewPrivs"] == "1" and int(st["CapBnd"], 16) == int(st["CapPrm"], 16)
    if not userns:
        assert int(st["CapEff"], 16) == 0 and int(st["CapBnd"], 16) == 0 and uid == s.host_uid
    if ns:  # not yet exited when we looked
        assert ns["mnt"] and ns["pid"] and ns["ipc"] and ns["uts"], ns
        assert ns["net"] != s.host_network
        assert ns["user"] == userns


# -- e2fsck on a guest's volume --------------------------------------------------------------------


async def test_a_corrupted_volume_is_checked_in_a_cell(tmp_path: Path, cells: Cells) -> None:
    assert cells.tools is not None
    watch = Watch()
    cells.tools.observers.append(watch)
    store = Store(tmp_path / "sandvisor.db")
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            vols = Volumes(tmp_path / "volumes", store)
            vols.tools = cells.tools
            vols.load()
            rec = await vols.create("data", 64 * MIB)
            img = vols.path(rec)
            # what a guest can leave: blocks in use marked free, the file system "not clean"
            subprocess.run(["debugfs", "-w", "-R", "freeb 3000 40", str(img)], check=True, capture_output=True)
            subprocess.run(["debugfs", "-w", "-R", "ssv state 0", str(img)], check=True, capture_output=True)
            vols.claim("uid-a", "a", (VolumeMount("data", "/data"),))
            notes = await vols.release_checked("uid-a")
            assert notes == ["volume data: its journal was replayed (e2fsck)"], notes
            (seen,) = watch.of("e2fsck")
            assert_confined(cells, seen, userns=False)
            assert seen[0].fsize == img.stat().st_size  # it cannot grow the image
            st = img.stat()
            assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600)  # root's again
            fixed = subprocess.run(["e2fsck", "-n", "-f", str(img)], check=False, capture_output=True)
            assert fixed.returncode == 0, fixed.stdout  # usable: clean

            # beyond repair (no superblock anywhere): refused cleanly, the host unharmed
            with open(img, "r+b") as f:
                for off in range(0, 64 * MIB, 4 * MIB):
                    f.seek(off)
                    f.write(b"\xde\xad" * 65536)
            vols.claim("uid-b", "b", (VolumeMount("data", "/data"),))
            notes = await vols.release_checked("uid-b")
            assert len(notes) == 1 and "cannot fix safely" in notes[0], notes
            assert vols.users("data") == []
            assert len(watch.of("e2fsck")) == 2
            assert not [o for o in cells.allocator.live.values() if o.startswith("tool")]  # every tool id released
            assert list(cells.tools.dir.iterdir()) == []  # every cell gone
            nursery.cancel_scope.cancel()


# -- images ------------------------------------------------------------------------------------------


async def test_pulls_run_their_tools_in_cells(
    tmp_path: Path,
    cells: Cells,
    built: Built,
    pushed: Pushed,
) -> None:
    assert cells.tools is not None
    watch = Watch()
    cells.tools.observers.append(watch)
    store = ImageStore(tmp_path / "store", tools=cells.tools, max_image_bytes=1 << 30, refs=REFS)
    old = os.umask(0o077)  # as serve runs
    try:
        with trio.fail_after(120):
            img = await store.pull(pushed.app, tls_verify=False)
            local = await store.pull(f"docker-archive:{built.archive}")
    finally:
        os.umask(old)
    assert img.digest == pushed.digests["app"] and local.config == img.config
    # the image's owners survived umoci's user namespace and mkfs
    assert owner(img.rootfs, "/srv/app") == (0o755, 4242, 4243)
    assert owner(img.rootfs, "/bin")[1:] == (0, 0) and owner(img.rootfs, "/proc")[1:] == (0, 0)
    st = img.rootfs.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o444)
    skopeo = watch.of("skopeo")
    assert len(skopeo) >= 4  # inspect + copy, twice
    for s in skopeo:
        assert_confined(cells, s, userns=False)
    assert [s[0].host_network for s in skopeo] == [True, True, False, False]
    for tool in ("umoci", "mkfs.ext4"):
        runs = watch.of(tool)
        assert len(runs) == 2
        for s in runs:
            assert_confined(cells, s, userns=True)
            assert s[0].host_uid == cells.tools.shifted(0) and not s[0].host_network
    assert not [o for o in cells.allocator.live.values() if o.startswith("tool")]
    assert_clean(store, images=2)


async def test_an_image_over_the_cap_is_refused_while_streaming(tmp_path: Path, cells: Cells) -> None:
    assert cells.tools is not None
    w = tmp_path / "img"
    layout = w / "layout"
    bb = busybox_tree(w / "bb")
    zeros = w / "zeros"
    (zeros / "data").mkdir(parents=True)
    for i in range(32):  # compresses to ~300 KiB, unpacks to 256 MiB (files under the cap each)
        with open(zeros / "data" / f"z{i}", "wb") as f:
            f.truncate(8 * MIB)
    (zeros / "one").mkdir()
    with open(zeros / "one" / "big", "wb") as f:  # one file over the cap
        f.truncate(64 * MIB)
    noise = w / "noise"
    (noise / "data").mkdir(parents=True)
    (noise / "data" / "blob").write_bytes(os.urandom(24 * MIB))
    build_image(layout, "bomb", [Layer(bb), Layer(zeros / "data", "/data")], ImageSpec(cmd=("/bin/sh",)))
    build_image(layout, "onebig", [Layer(bb), Layer(zeros / "one", "/one")], ImageSpec(cmd=("/bin/sh",)))
    build_image(layout, "fat", [Layer(bb), Layer(noise)], ImageSpec(cmd=("/bin/sh",)))
    reg = LocalRegistry(tmp_path / "registry").start()
    try:
        push(layout, "bomb", reg.ref("t/bomb:1"))
        push(layout, "fat", reg.ref("t/fat:1"))
        push(layout, "onebig", reg.ref("t/onebig:1"))
        store = ImageStore(tmp_path / "store", tools=cells.tools, max_image_bytes=16 * MIB, refs=REFS)
        with trio.fail_after(120):
            # a small compressed layer that unpacks past the cap: umoci is stopped on the way
            with pytest.raises(DiskFull) as e:
                await store.pull(reg.ref("t/bomb:1"), tls_verify=False)
            assert e.value.code == "RESOURCE_EXHAUSTED" and "--max-image-size" in e.value.message
            assert "unpacking" in e.value.message
            so_far = int(e.value.message.split(": ")[-1].split(" bytes")[0])
            assert 16 * MIB < so_far < 200 * MIB, e.value.message  # stopped well before 256 MiB
            assert_clean(store)
            # one file over the cap: RLIMIT_FSIZE of umoci's cell stops it at the cap
            with pytest.raises(DiskFull) as e:
                await store.pull(reg.ref("t/onebig:1"), tls_verify=False)
            assert "unpacking" in e.value.message and "--max-image-size" in e.value.message
            assert_clean(store)
            # a download bigger than the cap is refused before its bytes land
            with pytest.raises(DiskFull) as e:
                await store.pull(reg.ref("t/fat:1"), tls_verify=False)
            assert "--max-image-size" in e.value.message
            assert_clean(store)
            # what fits still pulls
            store.max_image_bytes = 1 << 30
            await store.pull(reg.ref("t/bomb:1"), tls_verify=False)
    finally:
        reg.stop()
    assert not [o for o in cells.allocator.live.values() if o.startswith("tool")]


# -- through a supervisor: a guest corrupts its volume -----------------------------------------------


@pytest.mark.vm
async def test_a_volume_its_guest_corrupted_is_checked_in_a_cell(image: GuestImage) -> None:
    """A guest scribbles over its volume's block device (unmounted: what a hostile guest
    can do); at the end of its life the supervisor's e2fsck runs in a cell, and the
    volume is either repaired and usable or refused with a note: the host is unharmed
    and the supervisor serves on."""
    with workdir("sv-tc-", private_state=True) as work:
        async with supervisor(work) as (_cfg, reg):
            cells = reg.settings.cells
            assert cells is not None and cells.tools is not None
            watch = Watch()
            cells.tools.observers.append(watch)
            sock = work.socket
            with trio.fail_after(600):
                await AsyncVolumes(sock).create("scratch", "64M")
                async with await AsyncSandbox.create("vandal", socket=sock, volumes=["scratch:/data"]) as sb:
                    script = (
                        "echo hi > /data/f && sync && umount /data && for b in /sys/block/*; do "
                        '[ "$(cat $b/serial 2>/dev/null)" = v0 ] && '
                        "{ dd if=/dev/urandom of=/dev/${b##*/} bs=4096 seek=2 count=8 conv=fsync; "
                        # and the superblock's s_state: "errors" (e2fsck -p then checks it all)
                        "printf '\\002\\000' | dd of=/dev/${b##*/} bs=1 seek=1082 conv=notrunc,fsync; } 2>/dev/null; "
                        "done; true"
                    )
                    r = await sb.run(["/bin/sh", "-c", script])
                    assert r.exit_code == 0, r.stderr
                    await sb.stop()
                    notes = [e.data for e in await sb.logs() if e.source == "system" and b"volume scratch" in e.data]
                    (seen,) = watch.of("e2fsck")
                    assert_confined(cells, seen, userns=False)
                    path = reg.volumes.path(reg.volumes.get("scratch"))
                    st = path.stat()
                    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
                    clean = subprocess.run(["e2fsck", "-f", "-n", str(path)], check=False, capture_output=True)
                    if clean.returncode == 0:  # repaired: usable again
                        assert notes, "a repair is noted"
                        await sb.start()
                        assert (await sb.run(["/bin/sh", "-c", "ls /data >/dev/null && echo ok"])).stdout == b"ok\n"
                    else:  # beyond what -p may fix: refused, said so
                        assert any(b"cannot fix safely" in n for n in notes), notes
                # the supervisor serves on
                assert [v.name for v in await AsyncVolumes(sock).list()] == ["scratch"]
