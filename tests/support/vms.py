"""VMs and supervisors the VM tests share: a cold boot's spec, the session's shared guest
(owned by conftest's ``shared_vm`` fixture), a real ``sandvisor serve`` process."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import trio

from actors.machines.disk import create_overlay
from actors.machines.qemuspec import MachineSpec
from actors.machines.vm import VmSpec, kernel_cmdline
from images.build import Image
from supervisor.main.throwaway import supervisor_process, workdir


async def cold_spec(image: Image, run_dir: Path, *, rootfs: Path | None = None, **kw: object) -> VmSpec:
    """A fresh boot of ``image`` on a scratch overlay in ``run_dir`` (on ``rootfs``, if given)."""
    disk = run_dir / "disk.qcow2"
    await create_overlay(rootfs or image.rootfs, disk)
    return VmSpec.boot(image, disk=disk, **kw)  # type: ignore[arg-type]


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


@contextmanager
def serve_process(prefix: str, *, reachable: bool = False) -> Iterator[tuple[dict[str, str], Path]]:
    """A real ``sandvisor serve`` process on a throwaway state dir sharing the built
    image; yields the environment the SDK and CLI find it by, and its work dir.
    ``reachable``: QEMU's user can map files under the state dir (else restores link
    snapshot memory into their run dirs)."""
    with workdir(prefix, private_state=not reachable) as work, supervisor_process(work) as (env, _):
        yield env, work.root
