"""QEMU inside actors.jail, for the jail's tests and benchmarks: the wiring Machine.run
and booted_guest get when the lead merges the jail (a Machine subclass whose run()
spawns through :func:`actors.jail.spawn`, and a booted_guest twin that builds the jail,
the cgroup and the guest memory around it and removes them after).

    jailed_guest()
      private RAM dir + RAM file (O_EXCL, the sandbox's uid)  | or a sealed memfd (restore)
      build_jail(spec); cgroup = manager.create(...)
      JailedMachine.run: argv with in-jail socket paths, mem-path=/proc/self/fd/N,
                         -accel tcg,tb-size=N; jail.spawn(argv, pass_fds, cgroup_procs)
      actors.vm._running: QMP, restore load, guest channel, hello ... shutdown ladder
      (after the reap) cgroup.remove(); remove_jail(); RAM file unlinked
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio
import trio_asyncio

from actors import jail
from actors._groups import collapse_single
from actors.cgroups import Cgroup, CgroupLimits, CgroupManager
from actors.disk import create_overlay
from actors.guestmem import create_ram_file, private_dir, remove_ram_file
from actors.machine import LaunchError, Machine, MachineSpec, MachineStateError, Runstate
from actors.vm import Guest, NetConfig, VmSpec, _running, kernel_cmdline, network_cmdline
from images.build import Image


def bounded_accel(argv: list[str], tb_size_mib: int | None) -> list[str]:
    """``-M microvm,accel=tcg,...`` -> ``-M microvm,...`` + ``-accel tcg,tb-size=N``
    (QEMU 7.2 refuses -accel together with -M accel=)."""
    if tb_size_mib is None:
        return argv
    out = list(argv)
    i = out.index("-M") + 1
    parts = out[i].split(",")
    accel = next(p.split("=", 1)[1] for p in parts if p.startswith("accel="))
    out[i] = ",".join(p for p in parts if not p.startswith("accel="))
    out[i + 1 : i + 1] = ["-accel", f"{accel},tb-size={tb_size_mib}" if accel == "tcg" else accel]
    return out


def qmp_on_socket(argv: list[str], path: str) -> list[str]:
    """QMP on a listening unix socket in the jail instead of the inherited socketpair
    (issue 13: it outlives the supervisor; fd passing works over it too)."""
    out = list(argv)
    for i, a in enumerate(out):
        if a.startswith("socket,id=qmp,fd="):
            out[i] = f"socket,id=qmp,path={path},server=on,wait=off"
    return out


class JailedMachine(Machine):
    """A Machine whose QEMU runs in a jail. ``run_dir`` is the jail's socket dir on the
    host; QEMU sees it as ``jail.socket_dir``."""

    def __init__(
        self,
        spec: MachineSpec,
        jail_spec: jail.JailSpec,
        *,
        cgroup: Cgroup | None = None,
        pass_fds: tuple[int, ...] = (),
        memory_fd: int | None = None,
        tb_size_mib: int | None = None,
        qmp_socket: bool = False,
        helper: Path | None = None,
        name: str = "vm",
    ) -> None:
        super().__init__(spec, jail_spec.socket_host_dir, name=name)
        self.helper = helper
        self.jail = jail_spec
        self.cgroup = cgroup
        self.extra_fds = pass_fds
        self.memory_fd = memory_fd
        self.tb_size_mib = tb_size_mib
        self.qmp_socket = qmp_socket
        self.argv: list[str] = []

    @property
    def qmp_path(self) -> Path:
        return self.jail.socket_host_dir / "qmp.sock"

    async def run(self, task_status: trio.TaskStatus[Machine] = trio.TASK_STATUS_IGNORED) -> None:
        if self.runstate is not Runstate.NEW:
            raise MachineStateError(f"machine is {self.runstate.value}, not new")
        files = self.spec.open_files()
        qmp_mine, qmp_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        con_mine, con_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = self.spec.argv(Path(self.jail.socket_dir), qmp_theirs.fileno(), con_theirs.fileno(), files)
        argv = bounded_accel(argv, self.tb_size_mib)
        passed = [con_theirs.fileno(), *files.values(), *self.extra_fds]
        if self.memory_fd is not None:
            # QEMU opens no path of ours: its RAM (file or sealed memfd) by descriptor
            assert self.spec.memory_file is not None
            old = f"mem-path={self.spec.memory_file},"
            argv = [a.replace(old, f"mem-path=/proc/self/fd/{self.memory_fd},") for a in argv]
            passed.append(self.memory_fd)
        if self.qmp_socket:
            argv = qmp_on_socket(argv, f"{self.jail.socket_dir}/qmp.sock")
        else:
            passed.append(qmp_theirs.fileno())
        self.argv = argv
        try:
            try:
                self.proc = await jail.spawn(  # type: ignore[assignment]
                    argv,
                    self.jail,
                    pass_fds=passed,
                    cgroup_procs=self.cgroup.procs_files() if self.cgroup else (),
                    helper=self.helper,
                )
            except jail.JailError as exc:
                raise LaunchError(f"cannot start QEMU in its jail: {exc}; argv: {shlex.join(argv)}") from exc
        finally:
            qmp_theirs.close()
            con_theirs.close()
            for fd in files.values():
                os.close(fd)
        self.runstate = Runstate.RUNNING
        try:
            if self.qmp_socket:
                qmp_mine.close()
                qmp_mine = await self._connect_qmp_socket()
            with collapse_single():
                await self._supervise(qmp_mine, con_mine, task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self._kill_and_reap()
                with contextlib.suppress(Exception):
                    await trio_asyncio.aio_as_trio(self.qmp.disconnect)()
                qmp_mine.close()
            self._nursery = None

    async def _connect_qmp_socket(self) -> socket.socket:
        with trio.fail_after(10):
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(str(self.qmp_path))
                    return s
                except (FileNotFoundError, ConnectionRefusedError):
                    s.close()
                    if self.proc is not None and self.proc.returncode is not None:
                        raise LaunchError(f"QEMU exited before its QMP socket: {self.describe_exit()}") from None
                    await trio.sleep(0.002)


@attrs.frozen
class JailOptions:
    identity: jail.Identity
    base: Path  # root-owned dir holding the jail dirs
    ram_dir: Path  # the private RAM dir (on tmpfs: a RAM file on disk is written back)
    cgroups: CgroupManager | None = None
    overhead_mib: int = 192
    tb_size_mib: int | None = 64
    qmp_socket: bool = False
    netns: jail.NetNS | Path = jail.NetNS.NEW
    helper: Path | None = None  # sandvisor-jail-exec (jail.build_helper); None: the Python stage


@attrs.define
class JailedGuest:
    guest: Guest
    spec: jail.JailSpec
    cgroup: Cgroup | None
    machine: JailedMachine
    vm: VmSpec


class OverlayFiles:
    """What checkpoint_guest needs of a sandbox's files: its overlay and the next one."""

    def __init__(self, disk: Path) -> None:
        self.disk = disk
        self.next_disk = disk.with_name("disk.next.qcow2")

    async def stage_next_disk(self, frozen: Path) -> Path:
        self.next_disk.unlink(missing_ok=True)
        await create_overlay(self.disk, self.next_disk, backing_as=frozen)
        return self.next_disk

    def swap_disks(self, frozen: Path) -> None:
        os.rename(self.disk, frozen)
        os.rename(self.next_disk, self.disk)

    def discard_next_disk(self) -> None:
        self.next_disk.unlink(missing_ok=True)


@asynccontextmanager
async def jailed_guest(
    image: Image,
    name: str,
    opts: JailOptions,
    *,
    disk_dir: Path,
    memory_mib: int = 256,
    cpus: int = 1,
    restore: Path | None = None,
    restore_memory: Path | None = None,
    restore_memory_fd: int | None = None,
    restore_disk: Path | None = None,
    boot_timeout: float = 60.0,
    limits: CgroupLimits | None = None,
    network: NetConfig | None = None,
) -> AsyncIterator[JailedGuest]:
    """Boot -- or restore ``restore`` (a vmstate) with ``restore_memory`` (the snapshot's
    RAM file, for the record), ``restore_memory_fd`` (a sealed memfd of it) and
    ``restore_disk`` (the snapshot's disk) -- a guest whose QEMU runs in a jail.
    ``disk_dir`` holds the overlay (root's: QEMU gets it by fd). The VmSpec names host
    paths (a checkpoint copies the RAM file by its path); QEMU's argv gets
    /proc/self/fd/N instead."""
    spec = jail.JailSpec(identity=opts.identity, root=opts.base / "jail" / name, netns=opts.netns)
    ram_dir = private_dir(opts.ram_dir)
    ram_fd = -1
    cg: Cgroup | None = None
    built = False
    try:
        overlay = disk_dir / "disk.qcow2"
        if not overlay.exists():
            await create_overlay(restore_disk or image.rootfs, overlay)
        mem_fd: int | None = None
        if restore is not None:
            assert restore_memory_fd is not None and restore_memory is not None
            vm = VmSpec(
                kernel=image.kernel,
                initrd=image.initrd,
                append=kernel_cmdline("tcg", extra=network_cmdline(network)),
                disk=overlay,
                cpus=cpus,
                memory_mib=memory_mib,
                network=network,
                ram=restore_memory,
                ram_shared=False,
                restore=restore,
                boot_timeout=boot_timeout,
                name=name,
            )
            mem_fd = restore_memory_fd
        else:
            ram_fd = create_ram_file(ram_dir, f"{name}.ram", memory_mib << 20, opts.identity)
            mem_fd = ram_fd
            vm = VmSpec.boot(
                image,
                disk=overlay,
                network=network,
                cpus=cpus,
                memory_mib=memory_mib,
                ram=ram_dir / f"{name}.ram",
                boot_timeout=boot_timeout,
            )
        jail.make_root_dir(opts.base / "jail")
        jail.build_jail(spec)
        built = True
        if opts.cgroups is not None:
            cg = opts.cgroups.create(
                name, limits or CgroupLimits.for_guest(memory_mib, cpus, overhead_mib=opts.overhead_mib)
            )
        machine = JailedMachine(
            vm.machine_spec(),
            spec,
            cgroup=cg,
            memory_fd=mem_fd,
            tb_size_mib=opts.tb_size_mib,
            qmp_socket=opts.qmp_socket,
            helper=opts.helper,
            name=name,
        )
        async with _running(machine, time.monotonic(), vm.boot_timeout, vm) as guest:
            yield JailedGuest(guest, spec, cg, machine, vm)
    finally:
        with trio.CancelScope(shield=True):
            if ram_fd >= 0:
                os.close(ram_fd)
                remove_ram_file(ram_dir, f"{name}.ram")
            if cg is not None:
                cg.remove()
            if built:
                jail.remove_jail(spec.root)


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def run_as(uid: int, gid: int, code: str) -> subprocess.CompletedProcess[str]:
    """A Python snippet as another uid (no capabilities): what an escaped QEMU could do."""
    return subprocess.run(
        ["/usr/bin/python3", "-I", "-S", "-c", code],
        user=uid,
        group=gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
