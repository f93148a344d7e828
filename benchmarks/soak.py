"""Soak: cycles of the whole life of a sandbox through the SDK against
``sandvisor serve`` as a child process, with a ``kill -9`` of the supervisor and a
restart every few cycles, bounded in time (default 10 minutes).

One cycle::

    create s  -> run -> exec (stdin round trip) -> write 1 MiB / read it back (cp)
              -> checkpoint -> restore r -> r reads the file -> remove r, s, snapshot

Every ``--kill-every`` cycles the supervisor is SIGKILLed right after ``s`` is ready
and a new one started; the cycle goes on with ``s`` adopted. Reported: failures per
step (target 0) and, against a baseline taken after the first cycle (the boot
template exists by then), the supervisor's fds and RSS, QEMU processes, files under
the state dir, run root and RAM dir, and our cgroups (target: back to baseline).

Usage: python benchmarks/soak.py [--minutes M] [--kill-every K] [--out results/]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import time
import traceback
from pathlib import Path
from typing import Any

import trio
from _harness import write_results

from actors.cells.cgroups import detect
from actors.recovery import our_qemus
from supervisor.client import AsyncSandbox, SandboxError
from supervisor.main.throwaway import Workdir, supervisor_process, workdir
from supervisor.wire.config import default_memory_dir

PAYLOAD = os.urandom(1 << 20)


def footprint(work: Workdir, pid: int) -> dict[str, int]:
    def count(root: Path | None) -> int:
        if root is None or not root.exists():
            return 0
        return sum(len(files) + len(dirs) for _, dirs, files in os.walk(root))

    key = hashlib.sha256(str(work.state.resolve()).encode()).hexdigest()[:12]
    cgroups = detect(parent=f"sandvisor-{key}")
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) // 1024
    return {
        "supervisor_fds": len(os.listdir(f"/proc/{pid}/fd")),
        "supervisor_rss_mib": rss,
        "qemu_processes": len(our_qemus(work.run_root)),
        "state_files": count(work.state / "sandboxes") + count(work.state / "snapshots"),
        "run_root_entries": count(work.run_root),
        "ram_files": count(default_memory_dir(work.state)),
        "cgroups": len(cgroups.names()) if cgroups is not None else 0,
    }


class Serve:
    """``sandvisor serve`` as a child process that a cycle can SIGKILL and start again."""

    def __init__(self, work: Workdir, log: Path | None) -> None:
        self.work = work
        self.log = log
        self._cm: Any = None
        self.pid = 0

    def start(self) -> None:
        self._cm = supervisor_process(self.work, log=self.log)
        _, proc = self._cm.__enter__()
        self._proc, self.pid = proc, proc.pid

    def stop(self) -> None:
        self._cm.__exit__(None, None, None)

    def kill_and_restart(self) -> None:
        self._proc.kill()  # SIGKILL: no cleanup at all
        self._proc.wait()
        self.stop()
        self.start()


class Soak:
    def __init__(self, work: Workdir) -> None:
        self.work = work
        self.sock = str(work.socket)
        self.failures: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.cycles = 0

    async def step(self, name: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            with trio.fail_after(180):
                return await fn(*args, **kw)
        except (SandboxError, AssertionError, trio.TooSlowError, OSError) as exc:
            self.failures[name] += 1
            self.errors.append(f"cycle {self.cycles} {name}: {type(exc).__name__}: {exc}"[:300])
            if isinstance(exc, AssertionError):
                traceback.print_exc()
            return None

    async def cycle(self, i: int, crash: Any) -> None:
        s = await self.step("create", AsyncSandbox.create, f"s{i}", socket=self.sock, detached=True)
        if s is None:
            return
        if crash is not None:
            await crash()
        await self.step("run", self._run, s)
        await self.step("exec", self._exec, s)
        await self.step("cp", self._cp, s)
        snap = await self.step("checkpoint", s.checkpoint)
        if snap is not None:
            r = await self.step("restore", self._restore, snap, i)
            if r is not None:
                await self.step("remove", r.remove, force=True)
        await self.step("remove", s.remove, force=True)  # (its disk stands on the snapshot's)
        if snap is not None:
            await self.step("delete-snapshot", AsyncSandbox.delete_snapshot, snap, socket=self.sock)
        self.cycles += 1

    async def _run(self, s: AsyncSandbox) -> None:
        r = await s.run(["sh", "-c", "echo soak; uname -r >/dev/null"])
        assert (r.exit_code, r.stdout) == (0, b"soak\n"), r

    async def _exec(self, s: AsyncSandbox) -> None:
        async with s.exec(["cat"]) as ex:
            await ex.send(b"round trip\n")
            await ex.close_stdin()
            got = b"".join([o.data async for o in ex])
        assert got == b"round trip\n" and ex.exit_code == 0, (got, ex.exit_code)

    async def _cp(self, s: AsyncSandbox) -> None:
        await s.fs.write("/root/payload", PAYLOAD)
        assert await s.fs.read("/root/payload") == PAYLOAD

    async def _restore(self, snap: Any, i: int) -> AsyncSandbox:
        r = await AsyncSandbox.restore(snap, name=f"r{i}", socket=self.sock, detached=True)
        await r.wait_ready()
        assert await r.fs.read("/root/payload") == PAYLOAD
        return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every", type=int, default=3)
    ap.add_argument("--out", default="results")
    ap.add_argument("--log", help="append the supervisors' logs to this file")
    a = ap.parse_args()
    deadline = time.monotonic() + a.minutes * 60
    res: dict[str, Any] = {"minutes": a.minutes, "kill_every": a.kill_every}
    with workdir("sv-soak-", private_state=True) as work:
        soak, sv = Soak(work), Serve(work, Path(a.log) if a.log else None)
        i, restarts = 0, 0
        baseline: dict[str, int] = {}

        async def crash() -> None:
            await trio.to_thread.run_sync(sv.kill_and_restart)

        sv.start()
        try:
            while i == 0 or time.monotonic() < deadline:
                kill = i % a.kill_every == a.kill_every - 1
                trio.run(soak.cycle, i, crash if kill else None)
                i += 1
                restarts += kill
                if i == 1:
                    baseline = footprint(work, sv.pid)
            final = footprint(work, sv.pid)
        finally:
            sv.stop()
        res.update(
            cycles=soak.cycles,
            attempted=i,
            restarts=restarts,
            failures=dict(soak.failures),
            errors=soak.errors[:20],
            baseline=baseline,
            final=final,
            back_to_baseline={k: final[k] <= v for k, v in baseline.items() if k != "supervisor_rss_mib"},
        )
    rows = [f"| {k} | {baseline.get(k, 0)} | {final[k]} |" for k in final]
    md = "\n".join(
        [
            f"# Soak: {a.minutes:g} minutes, kill -9 of the supervisor every {a.kill_every} cycles",
            "",
            f"{soak.cycles} of {i} cycles completed, {restarts} restarts, "
            f"failures: {sum(soak.failures.values())} {dict(soak.failures) or ''}",
            "",
            "| after | baseline (cycle 1) | end |",
            "|---|---|---|",
            *rows,
            "",
            *(f"- {e}" for e in soak.errors[:20]),
            "",
        ]
    )
    write_results(Path(a.out), "soak", res, md)


if __name__ == "__main__":
    main()
