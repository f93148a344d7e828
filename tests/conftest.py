"""Shared fixtures. VMs are expensive under TCG (~2 s a boot): tests share one booted
guest where state allows. The shared guest is owned by a synchronous session fixture
(so it outlives each test's trio.run); every test connects its own channel to it,
which also exercises guestd's host-reconnect path on every test."""

from __future__ import annotations

import os

# grpcio's fork support (pthread_atfork handlers, on by default in this release) aborts
# the process when it forks while grpc threads run: every QEMU spawn forks. Off, before
# anything imports grpc (supervisor/grpc_bridge.py does the same for serve).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from actors import helpers
from actors.channel.guest import GuestChannel, open_channel
from actors.machines.disk import create_overlay
from actors.machines.qemuspec import MachineSpec
from actors.machines.vm import VmSpec, kernel_cmdline
from images.build import Builder, Image, default_cache
from supervisor import throwaway
from supervisor.throwaway import supervisor_process, workdir


@pytest.fixture(scope="session")
def image() -> Image:
    """The default image, built (or found in the cache) once per session."""
    return Builder(default_cache()).build()  # does nothing when the cache is current


@pytest.fixture(scope="session")
def jail_helpers() -> tuple[Path, Path]:
    """sandvisor-jail-exec and the discard shim as the package build made them
    (actors/helpers.py). Skipped where that build found no C compiler (the unit layer on
    a bare machine: the build records why); missing or stale: an error (reinstall)."""
    if os.geteuid() != 0:
        pytest.skip("the C helpers run as root (jails, cells)")
    skipped = [e["skipped"] for e in helpers.manifest()["helpers"].values() if "skipped" in e]
    if skipped:
        pytest.skip(f"the package build made no C helpers ({skipped[0]})")
    return helpers.installed(helpers.JAIL_EXEC), helpers.installed(helpers.RAM_DISCARD)


async def cold_spec(image: Image, run_dir: Path, *, rootfs: Path | None = None, **kw: object) -> VmSpec:
    """A fresh boot of ``image`` on a scratch overlay in ``run_dir`` (on ``rootfs``, if given)."""
    disk = run_dir / "disk.qcow2"
    await create_overlay(rootfs or image.rootfs, disk)
    return VmSpec.boot(image, disk=disk, **kw)  # type: ignore[arg-type]


@pytest.fixture
def tmp_run(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


class SharedVM:
    def __init__(self, proc: subprocess.Popen[bytes], run_dir: Path, keep: list[socket.socket]) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.keep = keep

    @property
    def guest_socket(self) -> Path:
        return self.run_dir / "guest.sock"


def launch_sync(image: Image, run_dir: Path, extra_cmdline: str = "") -> SharedVM:
    trio.run(create_overlay, image.rootfs, run_dir / "disk.qcow2")
    spec = MachineSpec(
        kernel=image.kernel,
        initrd=image.initrd,
        disk=run_dir / "disk.qcow2",
        disk_chain=(image.rootfs,),
        memory_mib=512,
        append=kernel_cmdline("tcg", hostname="shared", extra=extra_cmdline),
    )
    argv = spec.argv(run_dir)  # QMP and the console listen in run_dir; nobody needs them here
    with open(run_dir / "qemu.err", "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 10
    while not (run_dir / "guest.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"QEMU failed: {(run_dir / 'qemu.err').read_text()}")
        time.sleep(0.005)
    return SharedVM(proc, run_dir, [])


@pytest.fixture(scope="session")
def shared_vm(image: Image) -> Iterator[SharedVM]:
    run_dir = Path(tempfile.mkdtemp(prefix="sandvisor-test-"))
    vm = launch_sync(image, run_dir, extra_cmdline="sandvisor.vsock=loopback")
    try:
        yield vm
    finally:
        vm.proc.kill()
        vm.proc.wait()
        for s in vm.keep:
            s.close()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
async def chan(shared_vm: SharedVM) -> AsyncIterator[GuestChannel]:
    """A fresh channel (and guest session) to the shared VM."""
    if shared_vm.proc.poll() is not None:
        pytest.fail("the shared VM died")
    stream = await trio.open_unix_socket(str(shared_vm.guest_socket))
    async with open_channel(stream, hello_timeout=90) as c:
        yield c


@contextmanager
def serve_process(prefix: str, *, reachable: bool = False) -> Iterator[tuple[dict[str, str], Path]]:
    """A real ``sandvisor serve`` process on a throwaway state dir sharing the built
    image; yields the environment the SDK and CLI find it by, and its work dir.
    ``reachable``: QEMU's user can map files under the state dir (else restores link
    snapshot memory into their run dirs)."""
    with workdir(prefix, private_state=not reachable) as work, supervisor_process(work) as (env, _):
        yield env, work.root


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SANDVISOR_SKIP_VM") == "1":
        skip = pytest.mark.skip(reason="SANDVISOR_SKIP_VM=1")
        for item in items:
            if "vm" in item.keywords:
                item.add_marker(skip)


# -- nothing of a test's supervisors outlives them (house rule: no orphans) ---------------
# Each throwaway workdir checks at its exit, after its supervisors are gone, that none of
# their processes (QEMU, virtiofsd, secret proxies, tool cells: by the workdir's cgroups
# and dirs, never another run's) or jail namespaces are left; what it finds it kills and
# records. A test (or a fixture it tore down) that left any fails in its teardown.
_left_before: dict[str, int] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _left_before[item.nodeid] = len(throwaway.LEFT_BEHIND)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # (module and session fixtures end in the teardown of their last test)
    new = throwaway.LEFT_BEHIND[_left_before.pop(item.nodeid, len(throwaway.LEFT_BEHIND)) :]
    if new:
        pytest.fail("left behind by the supervisors (killed after):\n  " + "\n  ".join(new), pytrace=False)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    if throwaway.LEFT_BEHIND:
        terminalreporter.section("left behind by supervisors (house rule: no orphans)")
        for line in throwaway.LEFT_BEHIND:
            terminalreporter.line(line)
