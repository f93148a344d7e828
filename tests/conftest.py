"""Shared fixtures. VMs are expensive under TCG (~2 s a boot): tests share one booted
guest where state allows. The shared guest is owned by a synchronous session fixture
(so it outlives each test's trio.run); every test connects its own channel to it,
which also exercises guestd's host-reconnect path on every test."""

from __future__ import annotations

import os

# grpcio's fork support (pthread_atfork handlers, on by default in this release) aborts
# the process when it forks while grpc threads run: every QEMU spawn forks. Off, before
# anything imports grpc (supervisor/serve/grpc_bridge.py does the same for serve).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import hypothesis
import pytest
import trio

from actors import helpers
from actors.channel.guest import GuestChannel, open_channel
from images.build import Builder, Image, default_cache, hold_parts
from supervisor.main import throwaway
from tests.support.vms import SharedVM, launch_sync


@pytest.fixture(scope="session")
def image() -> Iterator[Image]:
    """The default image, built (or found in the cache) once per session, and held
    (a build of another tree sharing the cache leaves its parts in place meanwhile)."""
    img = Builder(default_cache()).build()  # does nothing when the cache is current
    with hold_parts(img):
        yield img


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


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory under /tmp with a short path, for Unix sockets."""
    d = Path(tempfile.mkdtemp(prefix="g", dir="/tmp"))  # Unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmp_run(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


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


# -- no wall-clock bound on a property ----------------------------------------------------
# Hypothesis fails an example that takes longer than 200 ms by default: a timed assertion
# (speed is the benchmarks' to check), and on a loaded shared machine a correct example
# takes longer (test_net's paint: 330 ms once). Off for the whole suite, not test by test.
def pytest_configure(config: pytest.Config) -> None:
    hypothesis.settings.register_profile("sandvisor", deadline=None)
    hypothesis.settings.load_profile("sandvisor")


# -- markers follow folders --------------------------------------------------------------
# tests/unit: no QEMU, no host tools (nox -s unit: -m "not vm and not host"); tests/vm: boots
# real QEMU VMs; tests/host: drives the host's tools and namespaces (and may boot VMs too:
# such tests also carry an explicit vm mark). A file in unit/ may mark a few of its tests
# vm or host (the same check run on a fake and on a real guest); one in vm/ or host/ never
# needs to restate its folder.
_FOLDER_MARKS = {"vm": pytest.mark.vm, "host": pytest.mark.host}
_TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.resolve().relative_to(_TESTS).parts[0]
        if folder in _FOLDER_MARKS:
            item.add_marker(_FOLDER_MARKS[folder])
        elif folder != "unit":
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in tests/unit, tests/vm or tests/host")
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
