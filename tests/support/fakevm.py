"""A fake VM for the unit layer: the registry and sandbox actors without QEMU.

:class:`FakeLab` is a launcher (``Settings.launch``): each life gets a
:class:`~fakeguest.FakeGuest` (guestd's protocol, in-process) behind a real
:class:`~actors.channel.guest.GuestChannel`, and a :class:`FakeMachine` standing in for QEMU
(pid, exit, HMP port forwards, the checkpoint steps). A checkpoint keeps the guest's
files under the vmstate it "wrote"; a restore of that vmstate starts a guest with
those files, so a clone sees its snapshot's disk. Tests reach every guest through
``lab.guests`` and make the next ones misbehave with ``lab.hostile``.

What it is not: QEMU. Boot and restore take no time, memory is not modelled, disks
are real qcow2 overlays (qemu-img) on a tiny raw "rootfs" so the sandbox's files
behave as in production. Every feature is proved against real VMs elsewhere.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.channel.guest import open_channel
from actors.machines.machine import StagedDisk
from actors.machines.qemuproc import LaunchError
from actors.machines.qemuspec import MachineSpec
from actors.machines.qmp import Event
from actors.machines.vm import Attach, BootError, BootTimeout, Guest, VmSpec
from actors.settings import Settings
from images.build import Image
from tests.support.fakeguest import FakeGuest, Hostile

_pids = itertools.count(4_000_000)  # above any real pid: /proc lookups find nothing


class FakeProc:
    def __init__(self, machine: FakeMachine) -> None:
        self._m = machine
        self.returncode: int | None = None

    def kill(self) -> None:
        self._m.die(-9)


class FakeConsole:
    """The guest's serial console: what a test says the guest printed."""

    def __init__(self) -> None:
        self.output = ""

    def text(self) -> str:
        return self.output


class FakeMachine:
    """What a sandbox asks of its Machine, without a process."""

    def __init__(self, spec: MachineSpec, guest: FakeGuest, lab: FakeLab) -> None:
        self.spec = spec
        self.guest = guest
        self.lab = lab
        self.name = "fake"
        self.pid: int | None = next(_pids)
        self.proc = FakeProc(self)
        self.returncode: int | None = None
        self._exited = trio.Event()
        self.forwards: set[str] = set()
        self.paused_now = False
        self.staged = 0
        self.disk_top = "disk0"
        self.console = FakeConsole()
        self._migrate_fd = -1

    # -- the process -----------------------------------------------------------------
    def die(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self.proc.returncode = code
            self.guest.power_off()
            self._exited.set()

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def describe_exit(self) -> str:
        rc = self.returncode
        return f"QEMU killed by signal {-rc}" if rc is not None and rc < 0 else f"QEMU exit status {rc}"

    async def shutdown(self, ask: Any = None) -> int:
        with trio.CancelScope(shield=True):
            if not self.exited and ask is not None:
                with trio.move_on_after(1):
                    try:
                        await ask()
                    except Exception:
                        pass
            self.die(0 if self.returncode is None else self.returncode)
        return self.returncode or 0

    # -- QMP -------------------------------------------------------------------------
    async def hmp(self, line: str) -> str:
        verb, _, rest = line.partition(" ")
        rule = rest.split(" ", 1)[1]
        if verb == "hostfwd_add":
            key = rule.rsplit("-", 1)[0]
            if key in self.forwards or key in self.lab.taken_ports:
                return "Could not set up host forwarding rule"
            self.forwards.add(key)
            return ""
        if verb == "hostfwd_remove":
            self.forwards.discard(rule)
            return "host forwarding rule removed"
        return f"unknown command {verb}"

    async def qmp_execute(self, cmd: str, args: dict[str, Any] | None = None) -> Any:
        if cmd == "cont":
            self.paused_now = False
        return {}

    async def status(self) -> str:
        return "paused" if self.paused_now else "running"

    async def stage_disk(self, path: Path) -> StagedDisk:
        self.staged += 1
        if self.lab.fail_checkpoints:
            raise LaunchError("fake: QEMU refused blockdev-add")
        return StagedDisk(node=f"ov{self.staged}", fdset=100 + self.staged)

    async def unstage_disk(self, staged: StagedDisk) -> None:
        pass

    async def switch_disk(self, staged: StagedDisk) -> None:
        self.disk_top = staged.node

    @contextlib.contextmanager
    def events(self) -> Iterator[trio.MemoryReceiveChannel[Event]]:
        """QEMU's events: a fake QEMU sends none (the channel ends with the block)."""
        send, recv = trio.open_memory_channel[Event](0)
        with send, recv:
            yield recv

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[float]:
        self.paused_now = True
        try:
            yield trio.current_time()
        finally:
            self.paused_now = False

    async def prepare_migration(self, fd: int, *, ignore_shared: bool) -> None:
        self._migrate_fd = fd

    async def migrate_prepared(self) -> dict[str, Any]:
        return await self.migrate_to_fd(self._migrate_fd, ignore_shared=False)

    async def migrate_to_fd(self, fd: int, *, ignore_shared: bool) -> dict[str, Any]:
        token = f"fake-vmstate-{next(_pids)}".encode()
        os.write(fd, token)
        self.lab.saved[token] = dict(self.guest.files)
        return {"status": "completed"}


@attrs.define
class FakeLab:
    """The launcher and what it launched."""

    guests: list[FakeGuest] = attrs.Factory(list)
    hostile: Hostile = attrs.Factory(Hostile)  # copied into each new guest
    fail_boots: int = 0  # the next N boots fail (QEMU exits at once)
    fail_restores: int = 0  # the next N restores fail to load
    late_restores: int = 0  # the next N restored guests do not say hello in time
    bring_up_s: float = 0.0  # (mock clock) seconds from launch to hello
    going_s: float = 0.0  # (mock clock) seconds a machine takes to go away once it exited
    boots: int = 0
    restores: int = 0
    bringing_up: int = 0  # launched, no hello yet
    most_bringing_up: int = 0
    fail_checkpoints: bool = False
    taken_ports: set[str] = attrs.Factory(set)  # "tcp:127.0.0.1:PORT" already in use on the "host"
    saved: dict[bytes, dict[str, tuple[int, bytes]]] = attrs.Factory(dict)  # vmstate -> the guest's files
    machines: list[FakeMachine] = attrs.Factory(list)
    nursery: trio.Nursery | None = None

    async def run(self, task_status: trio.TaskStatus[FakeLab] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            task_status.started(self)
            await trio.sleep_forever()

    @asynccontextmanager
    async def launch(self, spec: VmSpec, at: Attach) -> AsyncIterator[Guest]:
        assert self.nursery is not None, "start the lab first: await nursery.start(lab.run)"
        assert at.adopt is None, "the fake VM cannot be adopted (a real supervisor restart is a VM test)"
        files: dict[str, tuple[int, bytes]] = {}
        if spec.restore is not None:
            self.restores += 1
            if self.fail_restores:
                self.fail_restores -= 1
                raise BootError("restore failed: fake: the saved state does not load")
            if self.late_restores:
                self.late_restores -= 1
                raise BootTimeout(f"guest did not become ready within {spec.boot_timeout:g}s")
            files = self.saved.get(spec.restore.read_bytes(), {})
        else:
            self.boots += 1
            if self.fail_boots:
                self.fail_boots -= 1
                raise BootError("QEMU exited during boot: fake")
        self.bringing_up += 1
        self.most_bringing_up = max(self.most_bringing_up, self.bringing_up)
        try:
            await trio.sleep(self.bring_up_s)
        finally:
            self.bringing_up -= 1
        guest = FakeGuest(hostname=spec.name, files=files, hostile=attrs.evolve(self.hostile))
        self.guests.append(guest)
        await self.nursery.start(guest.run)
        machine = FakeMachine(spec.machine, guest, self)
        self.machines.append(machine)
        if at.on_spawned is not None:
            assert machine.pid is not None
            at.on_spawned(machine.pid, 1)
        t0 = trio.current_time()
        try:
            async with open_channel(
                guest.connect(), hello_timeout=spec.boot_timeout, answer_timeout=spec.answer_timeout
            ) as chan:
                yield Guest(machine, chan, t0, t0, trio.current_time())  # type: ignore[arg-type]
                await machine.shutdown(ask=chan.shutdown if not chan.broken else None)
        except trio.TooSlowError:
            raise BootError(f"guest did not become ready within {spec.boot_timeout:g}s") from None
        finally:
            machine.die(0)
            if self.going_s:
                with trio.CancelScope(shield=True):
                    await trio.sleep(self.going_s)


def fake_image(root: Path) -> Image:
    """Tiny files where an image's parts would be (the rootfs is a raw file qemu-img can back)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("vmlinux", "bzImage", "initrd"):
        (root / name).write_bytes(b"fake")
    rootfs = root / "rootfs.ext4"
    with open(rootfs, "wb") as f:
        f.truncate(64 << 20)
    return Image(
        name="fake",
        kernel=root / "vmlinux",
        kernel_bz=root / "bzImage",
        initrd=root / "initrd",
        rootfs=rootfs,
        kernel_version="fake",
        keys={},
    )


def fake_settings(root: Path, lab: FakeLab, **kw: Any) -> Settings:
    return Settings(
        image=fake_image(root / "image"),
        sandboxes_dir=root / "state" / "sandboxes",
        run_root=root / "run",
        launch=kw.pop("launch", lab.launch),
        **kw,
    )
