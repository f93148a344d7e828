"""A checkpoint whose disk switch fails in the way that leaves its outcome unsaid, against
a real VM: QEMU did the switch and its answer was lost (a timeout, a cancelled caller), or
the disk's names would not move after it. Whatever the checkpoint answers, every write the
guest synced afterwards while the sandbox ran on is there after a SIGKILL of its QEMU and
a Start (before the fix the guest ran on an overlay the checkpoint's undo had unlinked:
every write after it was gone at the next kill)."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.errors import DomainError
from actors.machines.machine import Machine
from actors.machines.qemuproc import MachineError, QMPCommandError
from actors.sandboxes.files import SandboxFiles
from images.build import Image
from supervisor.client import connect
from supervisor.main.throwaway import supervisor, workdir
from tests.support.client import run, wait_state

ENDED = ("stopped", "crashed", "failed")


@pytest.mark.parametrize("fault", ["answer-late", "caller-cancelled", "names-stuck"])
async def test_a_switch_that_failed_unsaid_loses_no_synced_write(
    image: Image, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    cut = trio.CancelScope()
    execute = Machine.qmp_execute

    async def lossy(self: Machine, cmd: str, args: dict[str, Any] | None = None, *, timeout: float = 30) -> Any:
        answer = await execute(self, cmd, args, timeout=timeout)
        if cmd == "blockdev-snapshot":  # QEMU did it; its answer never reaches the caller
            if fault == "answer-late":
                raise QMPCommandError(f"{cmd}: no answer within {timeout:g}s")
            cut.cancel()
            await trio.lowlevel.checkpoint()
        return answer

    def stuck(self: SandboxFiles, frozen: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if fault == "names-stuck":
        monkeypatch.setattr(SandboxFiles, "swap_disks", stuck)
    else:
        monkeypatch.setattr(Machine, "qmp_execute", lossy)

    with workdir("sv-switch-", private_state=True) as work, trio.fail_after(300):
        async with supervisor(work, templates=False) as (_, reg), connect(work.socket) as c:
            await c.call("Create", {"id": "a"})
            await wait_state(c, "a", "ready")
            synced = {"before": b"1"}
            assert (await run(c, "a", ["sh", "-c", "mkdir -p /root/w && echo 1 > /root/w/before && sync"]))[1] == 0

            with cut, pytest.raises((DomainError, MachineError)):  # (the cancel passes through, to ``cut``)
                await reg.checkpoint("a")
            if fault == "caller-cancelled":
                assert cut.cancelled_caught

            info = await c.call("Inspect", {"id": "a"})
            if info["state"] == "ready":  # it ran on: what it syncs now must stay
                out, code = await run(c, "a", ["sh", "-c", "echo 2 > /root/w/after && sync && echo ok"])
                assert (out, code) == (b"ok\n", 0)
                synced["after"] = b"2"
                os.kill(reg.get("a").record.qemu_pid, signal.SIGKILL)
            else:  # it could not run on safely (its QEMU was killed): it says so
                assert fault == "names-stuck", info
            await wait_state(c, "a", *ENDED)

            await c.call("Start", {"id": "a"})
            await wait_state(c, "a", "ready")
            for name, content in synced.items():
                out, code = await run(c, "a", ["cat", f"/root/w/{name}"])
                assert (out.strip(), code) == (content, 0), (name, out)
