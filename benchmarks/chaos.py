"""Chaos: a seeded, randomized run of operations and faults against a real
``sandvisor serve`` (its own state dir and run root in a temp dir), driven through the
SDK, with the invariants checked after every step (benchmarks/chaos_checks.py).

Operations: create (some with user networking and an exposed port, some with the
volume), run, write-then-fsync in the guest, volume writes, checkpoint, restore,
pause, resume, Modify, stop, start, remove, port traffic, fork.
Faults: kill -9 of the supervisor at a random moment of an operation, and at each
crash point (``SANDVISOR_CRASH_AT``, actors/crash.py), then a restart on the same
state dir and adoption; SIGKILL of a QEMU; a guest kernel panic (sysrq); a guest out
of memory; a guest disk filled; the state dir's filesystem filled (a small
loop-mounted ext4: root only, else skipped and said); a client dropped mid-stream.

Invariants after every step: every fsynced write the API acknowledged is there byte
for byte (and memory, by the guest's boot id, kept or lost as the model says); each
sandbox's state is one the harness's model allows; no orphans (QEMUs, helpers,
cgroups, mounts, network namespaces, run dirs, RAM files, half-done files); the
supervisor's fds and RSS bounded; every error a client sees has one of sandbox.v1's
codes; no traceback in serve's log. The report lists operations, faults and
violations, each with its seed and step (``--steps N`` stops after step N: the
choices replay from a seed; timings, and so outcomes, may differ).

``--trace FILE`` appends the run's account: each call's target sandbox, each write's
file and hash, each answer and fault, a line each, so a violation's path can be read back.

Usage: python benchmarks/chaos.py [--seed N] [--minutes M] [--steps N] [--no-fault KIND] [--trace FILE]
       nox -s chaos -- --seed N --minutes M
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import random
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from supervisor.client import AsyncSandbox, AsyncVolumes, SandboxError, connect
from supervisor.main.throwaway import Workdir, workdir

if __package__:
    from benchmarks import chaos_checks as checks
    from benchmarks.chaos_host import (
        Serve,
        footprint,
        host_facts,
        http_get,
        qemu_pid,
        saved_states,
        sha,
        state_filesystem,
    )
else:  # (run as a script: benchmarks/ is on the path)
    import chaos_checks as checks  # type: ignore[no-redef]
    from chaos_host import (  # type: ignore[no-redef]
        Serve,
        footprint,
        host_facts,
        http_get,
        qemu_pid,
        saved_states,
        sha,
        state_filesystem,
    )

ABSENT, MISSING, ANY = checks.ABSENT, checks.MISSING, checks.ANY
OP_TIMEOUT = 240.0
EVENTUALLY = 30.0  # s: a fault's effect on a state (a QEMU gone: failed) must show by then
FAULTS = ("kill", "crash-point", "qemu-kill", "panic", "oom", "disk-full", "state-full", "client-drop")
# crash point -> the operation that reaches it ("pool-fill" needs a template pool: not in this run's config)
CRASH_OPS = {
    "spawned": "create",
    "hello": "create",
    "template-checkpoint": "create-new-config",
    "checkpoint-swap": "checkpoint",
    "snapshot-record": "checkpoint",
    "convert": "checkpoint",
    "remove": "remove",
    "pause-saved": "pause",
    "pause-stopping": "pause",
    "resume-loaded": "resume",
}
MAX_SANDBOXES, MAX_SNAPSHOTS, FILES = 4, 3, 6
VOLUME = "chaosvol"
LOOK = (
    "cat /proc/sys/kernel/random/boot_id; for d in /root/chaos /data/chaos; do echo ==$d; "
    '[ -d $d ] && cd $d && for f in *; do [ -f "$f" ] && sha256sum "$f"; done; done; true'
)
HTTPD = (
    "[ -f /run/httpd.pid ] && kill -0 $(cat /run/httpd.pid) 2>/dev/null || { mkdir -p /root/chaos; cd /root/chaos; "
    "(python3 -m http.server 8000 >/dev/null 2>&1 & echo $! > /run/httpd.pid); }"
)
FILL = (  # the guest's root filesystem full: what is free allocated, then the last blocks written
    "fallocate -l $(( $(df -k --output=avail /root | tail -1) - 512 ))k /root/fill; "
    "dd if=/dev/zero of=/root/fill2 bs=64k 2>/dev/null; sync; true"
)
FSYNC_FAILED = 75  # WRITE's exit when the rename was done and its fsync failed
# acknowledged only once fsync of the file and both directories says it is on the disk:
# a plain `sync` returns 0 even when the writeback failed (an I/O error the guest got
# from a full host disk), so a write it "acknowledged" could be lost with no error
WRITE = (
    'mkdir -p "$1" "$1-tmp" && printf %s "$3" > "$1-tmp/$2" && mv "$1-tmp/$2" "$1/$2" '
    f'&& {{ sync "$1/$2" "$1" "$1-tmp" || exit {FSYNC_FAILED}; }}'
)


@dataclass
class Report:
    seed: int
    steps: int = 0
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # op:CODE the API answered
    notes: list[str] = field(default_factory=list)
    violations: list[checks.Violation] = field(default_factory=list)
    peak: dict[str, int] = field(default_factory=dict)

    def text(self) -> str:
        lines = [
            f"chaos: seed {self.seed}, {self.steps} steps",
            "operations: " + ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items())),
            "faults: " + (", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"),
            "errors answered (coded): " + (", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"),
            "peak: " + ", ".join(f"{k} {v}" for k, v in self.peak.items()),
            *(f"note: {n}" for n in self.notes),
            f"violations: {len(self.violations)}",
            *(f"  {v.line()}" for v in self.violations),
        ]
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "steps": self.steps,
            "ops": dict(self.ops),
            "faults": dict(self.faults),
            "errors": dict(self.errors),
            "notes": self.notes,
            "peak": self.peak,
            "violations": [v.__dict__ for v in self.violations],
        }


class Failed(Exception):
    """An operation the API refused (its code recorded) or a fault cut."""


# --- the run ---------------------------------------------------------------------------------------
class Chaos:
    def __init__(
        self,
        work: Workdir,
        serve: Serve,
        seed: int,
        faults: set[str],
        state_mount: Path | None,
        trace: Path | None = None,
    ) -> None:
        self.work, self.serve, self.seed = work, serve, seed
        self.trace_to = trace  # each call's target, what it wrote and its answer, a line each
        self.sock = str(work.socket)
        self.rng = random.Random(seed)
        self.faults = faults
        self.state_mount = state_mount
        self.report = Report(seed)
        self.model: dict[str, checks.SandboxModel] = {}
        self.snaps: dict[str, checks.SnapshotModel] = {}
        self.forks: list[list[str]] = []  # each fork's children (its hidden snapshot lives while one may)
        self.volume_files: dict[str, set[str]] = {}
        self.step = 0
        self.counter = 0
        self.log_offset = 0
        self.touched: set[str] = set()  # sandboxes to look into after this step
        self.target = ""  # the sandbox of the last operation
        self.look_all = False
        self.faulting = False  # this step injects a fault: refusals are excused

    # -- bookkeeping
    def violate(self, found: list[tuple[str, str]]) -> None:
        for inv, what in found:
            v = checks.Violation(self.seed, self.step, inv, what)
            self.report.violations.append(v)
            print(f"VIOLATION {v.line()}", flush=True)
            self.trace(f"VIOLATION {v.line()}")

    def trace(self, line: str) -> None:
        """One line of the run's account (``--trace``): which sandbox each call aimed at,
        the file a write wrote and its hash, each answer, each fault; a violation's path
        is read back from it (a seed replays the choices, not the timings)."""
        if self.trace_to is not None:
            with open(self.trace_to, "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} step {self.step}: {line}\n")

    def new_id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def sb(self, id: str) -> AsyncSandbox:
        return AsyncSandbox(id, socket=self.sock)

    def pick(self, *states: str, where: Callable[[checks.SandboxModel], bool] = lambda m: True) -> str | None:
        ids = sorted(id for id, m in self.model.items() if m.allowed <= set(states) and m.allowed and where(m))
        return self.rng.choice(ids) if ids else None

    async def act(
        self,
        op: str,
        id: str,
        post: set[str],
        fn: Callable[[], Awaitable[Any]],
        failed: bool = False,
        halfway: frozenset[str] = frozenset(),
    ) -> Any:
        """Run one SDK call against sandbox ``id``: acknowledged, the model takes
        ``post``; refused, it keeps its states; cut by a supervisor kill (or failed in
        a way that may have taken effect), either. ``failed``: an operation that boots
        (create, restore, start) may also leave the sandbox failed when refused.
        ``halfway``: states an operation cut by a supervisor kill may also leave (a
        remove is a stop, then the record's removal: cut between, the sandbox is stopped).
        Raises Failed unless acknowledged."""
        self.report.ops[op] += 1
        self.touched.add(id)
        self.target = id
        m = self.model.get(id)
        pre = (set(m.allowed) if m is not None else {ABSENT}) | ({"failed"} if failed else set())
        kills = self.serve.kills
        self.trace(f"{op} {id} (allowed {','.join(sorted(pre))})")
        try:
            with trio.fail_after(OP_TIMEOUT):
                result = await fn()
        except SandboxError as exc:
            self.trace(f"{op} {id}: {exc.code} {exc!s:.300}")
            self.report.errors[f"{op}:{exc.code}"] += 1
            self.violate(checks.check_error(op, exc))
            if not self.faulting and self.serve.kills == kills:  # (nothing excuses it)
                self.violate(checks.check_refusal(f"{op} {id}", exc))
            cut = self.serve.kills != kills
            self._uncertain(id, pre | post | (halfway if cut else set()) if cut or exc.code in MAYBE_DONE else pre)
            raise Failed(exc.code) from exc
        except trio.TooSlowError:
            self.violate([("liveness", f"{op} {id}: no answer in {OP_TIMEOUT:g} s")])
            self._uncertain(id, pre | post)
            raise Failed("timeout") from None
        except Exception as exc:  # what the SDK raised without a code
            self.violate(checks.check_error(op, exc))
            self._uncertain(id, pre | post | (halfway if self.serve.kills != kills else set()))
            raise Failed(type(exc).__name__) from exc
        if id in self.model:
            self.model[id].allowed = set(post)
        self.trace(f"{op} {id}: done{f' (exit {result.exit_code})' if hasattr(result, 'exit_code') else ''}")
        return result

    def _uncertain(self, id: str, allowed: set[str]) -> None:
        m = self.model.get(id)
        if m is not None:
            if allowed != m.allowed:
                m.boot = m.not_boot = ""  # (whether its machine restarted is unknown)
            m.allowed = allowed

    # -- operations
    async def op_create(self, *, new_config: bool = False, room: bool = False) -> None:
        """``room``: one over the limit (a crash point's create must reach its boot)."""
        if sum(1 for m in self.model.values() if ABSENT not in m.allowed) >= MAX_SANDBOXES + room:
            return await self.op_remove()
        id = self.new_id("c")
        m = checks.SandboxModel(id, {ABSENT})
        settings: dict[str, Any] = {}
        if self.rng.random() < 0.3:
            m.net = True
            settings.update(network="user", ports={8000: 0})
        if not any(x.volume for x in self.model.values()) and self.rng.random() < 0.4:
            m.volume = VOLUME
            settings["volumes"] = [f"{VOLUME}:/data"]
        if new_config:  # a configuration no boot template has yet
            settings["memory_mib"] = 256 + 16 * self.rng.randrange(1, 64)
        self.model[id] = m
        await self.act(
            "create",
            id,
            {"ready"},
            lambda: AsyncSandbox.create(id, socket=self.sock, detached=True, **settings),
            failed=True,
        )

    async def op_run(self) -> None:
        id = self.pick("ready")
        if id is None:
            return await self.op_create()
        word = f"w{self.rng.randrange(1 << 30)}"
        r = await self.act("run", id, {"ready"}, lambda: self.sb(id).run(["echo", word]))
        if (r.exit_code, r.stdout) != (0, f"{word}\n".encode()):
            self.violate([("run", f"{id}: echo {word} gave {r.exit_code} {r.stdout[:80]!r}")])

    async def op_write(self, volume: bool = False) -> None:
        id = self.pick("ready", where=lambda m: bool(m.volume) or not volume)
        if id is None:
            return await self.op_create()
        m = self.model[id]
        files = self.volume_files if volume else m.files
        name = f"f{self.rng.randrange(FILES)}"
        path = f"{'/data' if volume else '/root'}/chaos/{name}"
        content = os.urandom(self.rng.randrange(1, 48 << 10)).hex()
        h = sha(content.encode())
        old = files.get(path, {MISSING})
        files[path] = old | {h}  # (until acknowledged: either)
        was_unsynced = path in m.unsynced  # (its page cache may show it: unsettled until a boot)
        m.unsynced.add(path)
        op = "volume-write" if volume else "write"
        self.trace(f"{op} {id}: {path} {h[:12]} (was {','.join(sorted(x[:12] or 'missing' for x in old))})")
        r = await self.act(
            op, id, {"ready"}, lambda: self.sb(id).run(["sh", "-c", WRITE, "sh", path.rsplit("/", 1)[0], name, content])
        )
        if r.exit_code == 0:
            files[path] = {h}
            m.unsynced.discard(path)
        else:
            # refused before the rename (a full guest disk): the old content stays; after
            # it (the fsync failed: an I/O error) its content is unspecified -- the new
            # one from the guest's cache, the old one or part of either from its disk
            files[path] = {ANY} if r.exit_code == FSYNC_FAILED else old
            if r.exit_code != FSYNC_FAILED and not was_unsynced:
                m.unsynced.discard(path)
            self.report.errors[f"{op}:exit {r.exit_code}"] += 1

    async def op_volume_write(self) -> None:
        await self.op_write(volume=True)

    async def op_checkpoint(self) -> None:
        id = self.pick("ready", "stopped", where=lambda m: not m.volume)
        if id is None:
            return await self.op_create()
        m = self.model[id]
        name = self.new_id("snap")
        state = next(iter(m.allowed))
        files, boot = copy.deepcopy(m.files), m.boot
        cut = CAPTURE_CUT if state == "ready" else frozenset()
        await self.act("checkpoint", id, set(m.allowed), lambda: self.sb(id).checkpoint(name), halfway=cut)
        live = state == "ready"  # (a restore has its memory, page cache and all)
        self.snaps[name] = checks.SnapshotModel(
            name, files, boot if live else "", m.boot or m.not_boot, m.net, set(m.unsynced) if live else set()
        )

    async def op_restore(self) -> None:
        if not self.snaps or sum(1 for m in self.model.values() if ABSENT not in m.allowed) >= MAX_SANDBOXES:
            return await self.op_create()
        snap = self.snaps[self.rng.choice(sorted(self.snaps))]
        id = self.new_id("r")
        m = checks.SandboxModel(id, {ABSENT}, files=copy.deepcopy(snap.files), boot=snap.boot)
        m.net, m.unsynced = snap.net, set(snap.unsynced)
        if not snap.boot:
            m.not_boot = snap.origin_boot
        self.model[id] = m
        await self.act(
            "restore",
            id,
            {"ready"},
            lambda: AsyncSandbox.restore(snap.name, name=id, socket=self.sock, detached=True),
            failed=True,
        )

    async def op_delete_snapshot(self) -> None:
        name = self.rng.choice(sorted(self.snaps))
        self.report.ops["delete-snapshot"] += 1
        try:
            await AsyncSandbox.delete_snapshot(name, socket=self.sock)
        except SandboxError as exc:  # (a sandbox's disk stands on it: refused)
            self.report.errors[f"delete-snapshot:{exc.code}"] += 1
            self.violate(checks.check_error("delete-snapshot", exc))
            return
        del self.snaps[name]

    async def op_pause(self) -> None:
        id = self.pick("ready")
        if id is None:
            return await self.op_create()
        await self.act("pause", id, {"paused"}, lambda: self.sb(id).pause(), halfway=CAPTURE_CUT)

    async def op_resume(self) -> None:
        id = self.pick("paused")
        if id is None:
            return await self.op_pause()
        await self.act("resume", id, {"ready"}, lambda: self.sb(id).resume())

    async def op_modify(self) -> None:
        id = self.pick("ready", "stopped")
        if id is None:
            return await self.op_create()
        m = self.model[id]
        env = {"CHAOS": str(self.step)}
        await self.act(
            "modify", id, set(m.allowed), lambda: self.sb(id).modify(labels={"step": str(self.step)}, env=env)
        )

    async def op_stop(self) -> None:
        id = self.pick("ready")
        if id is None:
            return await self.op_create()
        await self.act("stop", id, {"stopped"}, lambda: self.sb(id).stop(timeout=5))
        self.model[id].rebooted()  # (acknowledged: its next boot is a new one)

    async def op_start(self) -> None:
        id = self.pick("stopped", "failed", "crashed")
        if id is None:
            return await self.op_stop()
        await self.act("start", id, {"ready"}, lambda: self.sb(id).start(), failed=True)

    async def op_remove(self) -> None:
        ids = sorted(id for id, m in self.model.items() if ABSENT not in m.allowed)
        if not ids:
            return await self.op_create()
        id = self.rng.choice(ids)
        await self.act("remove", id, {ABSENT}, lambda: self.sb(id).remove(force=True), halfway=frozenset({"stopped"}))

    async def op_port(self) -> None:
        id = self.pick("ready", where=lambda m: m.net)
        if id is None:
            return await self.op_create()
        m = self.model[id]
        await self.act("port", id, {"ready"}, lambda: self.sb(id).run(["sh", "-c", HTTPD]))
        [port] = [p.host_port for p in await self.sb(id).ports() if p.sandbox_port == 8000]
        known = sorted(p for p, hs in m.files.items() if len(hs) == 1 and not hs & {MISSING, ANY})
        path = self.rng.choice(known).rsplit("/", 1)[1] if known else ""
        reply, kills = b"", self.serve.kills
        with trio.move_on_after(60):  # (the relay is the supervisor's: a kill meanwhile cuts the check)
            while not reply.startswith(b"HTTP/1.0 200") and self.serve.kills == kills:
                with contextlib.suppress(OSError):
                    reply = await trio.to_thread.run_sync(http_get, port, path)
                await trio.sleep(0.5)
        if self.serve.kills != kills:
            return  # (a kill meanwhile also cuts a reply short: it claims nothing)
        head, _, body = reply.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.0 200"):
            self.violate([("port", f"{id}: no answer on host port {port} in 60 s")])
        elif path and {sha(body)} != m.files[f"/root/chaos/{path}"]:
            self.violate(
                [("durability", f"{id}: /root/chaos/{path} over its exposed port differs from the acknowledged write")]
            )

    async def op_fork(self) -> None:
        """fork(n) of a ready sandbox: each child starts with the parent's files and
        memory (its boot id), like a restore of the fork point; the parent runs on.
        (A sandbox with the read-write volume is refused by design: not picked.)"""
        alive = sum(1 for m in self.model.values() if ABSENT not in m.allowed)
        id = self.pick("ready", where=lambda m: not m.volume)
        if id is None or alive >= MAX_SANDBOXES:
            return await (self.op_create() if id is None else self.op_remove())
        parent = self.model[id]
        n = self.rng.randint(1, min(2, MAX_SANDBOXES - alive))
        names = [self.new_id("k") for _ in range(n)]
        for child in names:  # (until acknowledged: made or not, booted or failed)
            m = checks.SandboxModel(child, {ABSENT, "ready", "failed"}, files=copy.deepcopy(parent.files))
            m.net, m.server, m.unsynced = parent.net, parent.server, set(parent.unsynced)
            self.model[child] = m
        self.forks.append(names)
        boot = parent.boot
        await self.act("fork", id, {"ready"}, lambda: self.sb(id).fork(n, names=names), halfway=CAPTURE_CUT)
        for child in names:
            self.model[child].allowed = {"ready"}
            self.model[child].boot = boot
            self.touched.add(child)

    # -- faults
    async def fault_kill(self) -> None:
        """kill -9 of the supervisor at a random moment of a random operation."""
        self.report.faults["kill"] += 1
        delay = self.rng.uniform(0, 4)
        op = self.choose_op()
        async with trio.open_nursery() as n:
            n.start_soon(self.guarded, op)
            await trio.sleep(delay)
            self.trace(f"serve killed after {delay:.2f} s")
            await trio.to_thread.run_sync(self.serve.kill)
        await self.restart()

    async def fault_crash_point(self) -> None:
        need: dict[str, Callable[[checks.SandboxModel], bool]] = {
            "pause": lambda m: m.allowed == {"ready"},
            "resume": lambda m: m.allowed == {"paused"},
            "checkpoint": lambda m: m.allowed <= {"ready", "stopped"} and not m.volume,
            "remove": lambda m: ABSENT not in m.allowed,
        }
        steps = [
            step
            for step, op in sorted(CRASH_OPS.items())
            if op not in need or any(need[op](m) for m in self.model.values())
        ]
        step = self.rng.choice(steps)  # (one its operation can reach now)
        self.report.faults[f"crash-point:{step}"] += 1
        self.trace(f"serve restarted to crash at {step}")
        await trio.to_thread.run_sync(self.serve.kill)
        try:
            await trio.to_thread.run_sync(self.serve.start, step)
        except RuntimeError:  # it got there while starting (a conversion it took up again)
            self.report.notes.append(f"step {self.step}: crash point {step} reached while serve started")
            return await self.restart()
        await self.adopted()
        op = CRASH_OPS[step]
        if op == "create-new-config":
            await self.guarded(lambda: self.op_create(new_config=True, room=True))
        elif op == "create":
            await self.guarded(lambda: self.op_create(room=True))
        else:
            await self.guarded(getattr(self, f"op_{op}"))
        target = self.target
        with trio.move_on_after(30 if step == "convert" else 3):
            while self.serve.alive():
                await trio.sleep(0.2)
        if self.serve.alive():
            self.report.notes.append(f"step {self.step}: crash point {step} not reached (killed instead)")
        elif step == "checkpoint-swap" and (m := self.model.get(target)) is not None:
            # its QEMU paused mid-swap: failed, as documented. Judged once serve is gone:
            # right after the call it may still be dying (the freeze before a capture
            # made that window wider), and the model then missed the failure
            m.allowed |= {"failed"}
            m.boot = m.not_boot = ""
        await trio.to_thread.run_sync(self.serve.kill)
        await self.restart()

    async def fault_qemu_kill(self) -> None:
        id = self.pick("ready")
        if id is None:
            return await self.op_create()
        pid = qemu_pid(self.work, id)
        if not pid:
            return
        self.report.faults["qemu-kill"] += 1
        self.trace(f"QEMU of {id} (pid {pid}) killed")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        m = self.model[id]
        m.rebooted()
        m.allowed = {"crashed"}  # (the guest died on its own: its cause, QEMU's signal)
        self.touched.add(id)

    async def fault_panic(self) -> None:
        id = self.pick("ready")
        if id is None:
            return await self.op_create()
        self.report.faults["panic"] += 1
        with contextlib.suppress(Failed), trio.move_on_after(60):
            await self.act(
                "panic", id, {"crashed"}, lambda: self.sb(id).run(["sh", "-c", "echo c > /proc/sysrq-trigger"])
            )
        m = self.model[id]
        m.rebooted()
        m.allowed = {"crashed"}  # (a guest kernel panic, read from its console)

    async def fault_oom(self) -> None:
        id = self.pick("ready")
        if id is None:
            return await self.op_create()
        self.report.faults["oom"] += 1
        hog = "python3 -c 'a=[]\nwhile True: a.append(b\"x\" * (1 << 24))'"
        with contextlib.suppress(Failed):
            r = await self.act("oom", id, {"ready"}, lambda: self.sb(id).run(["sh", "-c", hog]))
            if r.exit_code == 0:
                self.violate([("oom", f"{id}: the memory hog exited 0")])

    async def fault_disk_full(self) -> None:
        id = self.pick("ready")
        if id is None:
            return await self.op_create()
        self.report.faults["disk-full"] += 1
        with contextlib.suppress(Failed):
            await self.act("disk-fill", id, {"ready"}, lambda: self.sb(id).run(["sh", "-c", FILL]))
            self.touched.add(id)
            for _ in range(2):  # writes on a full disk: refused, acknowledged ones intact
                await self.guarded(self.op_write)
        with contextlib.suppress(Failed):
            await self.act(
                "disk-free", id, {"ready"}, lambda: self.sb(id).run(["sh", "-c", "rm -f /root/fill /root/fill2; sync"])
            )

    async def fault_state_full(self) -> None:
        if self.state_mount is None:
            return
        self.report.faults["state-full"] += 1
        filler = self.state_mount / "filler"
        free = shutil.disk_usage(self.state_mount).free
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, max(free - (256 << 10), 1))
        try:
            for _ in range(3):
                await self.guarded(self.choose_op())
        finally:
            filler.unlink(missing_ok=True)

    async def fault_client_drop(self) -> None:
        id = self.pick("ready")
        if id is None:
            return await self.op_create()
        self.report.faults["client-drop"] += 1
        self.touched.add(id)
        with trio.move_on_after(30):
            cmd = ["sh", "-c", "echo start; sleep 2; echo end"]
            async with connect(self.work.socket) as c, c.open_call("Run", {"id": id, "cmd": cmd}) as call:
                async for item in call:
                    if item.get("data"):
                        break  # the client goes, mid-stream

    # -- the loop
    def choose_op(self) -> Callable[[], Awaitable[None]]:
        ops: list[tuple[float, Callable[[], Awaitable[None]]]] = [
            (3, self.op_create),
            (3, self.op_run),
            (6, self.op_write),
            (2, self.op_volume_write),
            (2, self.op_checkpoint),
            (2, self.op_restore),
            (2, self.op_pause),
            (2, self.op_resume),
            (1, self.op_modify),
            (1.5, self.op_stop),
            (1.5, self.op_start),
            (1.5, self.op_remove),
            (1.5, self.op_port),
            (1.5, self.op_fork),
        ]
        if len(self.snaps) > MAX_SNAPSHOTS:
            ops.append((4, self.op_delete_snapshot))
        return self.rng.choices([f for _, f in ops], weights=[w for w, _ in ops])[0]

    def choose_fault(self) -> Callable[[], Awaitable[None]] | None:
        kinds = [k for k in FAULTS if k in self.faults and (k != "state-full" or self.state_mount is not None)]
        if not kinds or self.rng.random() > 0.25:
            return None
        kind = self.rng.choice(kinds)
        return getattr(self, "fault_" + kind.replace("-", "_"))  # type: ignore[no-any-return]

    async def guarded(self, fn: Callable[[], Awaitable[None]]) -> None:
        """One operation or fault; what the API answered outside :meth:`act` (a port
        lookup, a List) is recorded and checked too."""
        try:
            await fn()
        except Failed:
            pass
        except SandboxError as exc:
            self.report.errors[f"{getattr(fn, '__name__', 'op')}:{exc.code}"] += 1
            self.violate(checks.check_error(getattr(fn, "__name__", "op"), exc))
        except (OSError, EOFError, trio.BrokenResourceError) as exc:  # (a client's end without a code)
            self.violate(checks.check_error(getattr(fn, "__name__", "op"), exc))
        except Exception as exc:
            traceback.print_exc()
            self.violate([("harness", f"{getattr(fn, '__name__', 'op')}: {type(exc).__name__}: {exc!s:.200}")])

    async def run(self, deadline: float, max_steps: int) -> None:
        await self.adopted()
        await AsyncVolumes(self.sock).create(VOLUME, "64M")
        while time.monotonic() < deadline and (not max_steps or self.step < max_steps):
            self.step += 1
            self.report.steps = self.step
            self.touched, self.look_all = set(), False
            what = self.choose_fault() or self.choose_op()
            self.faulting = what.__name__.startswith("fault_")
            t = time.monotonic()
            await self.guarded(what)
            if not self.serve.alive():  # a crash nobody asked for (or a crash point armed late)
                self.violate([("crash", "the supervisor died on its own")])
                await self.restart()
            await self.check()
            states = " ".join(f"{id}:{'/'.join(sorted(m.allowed))}" for id, m in sorted(self.model.items()))
            print(
                f"step {self.step}: {what.__name__.removeprefix('op_')} ({time.monotonic() - t:.1f} s) {states}",
                flush=True,
            )

    async def restart(self) -> None:
        self.look_all = True
        if not self.serve.alive():
            await trio.to_thread.run_sync(self.serve.start)
        await self.adopted()

    async def adopted(self) -> None:
        with trio.fail_after(180):
            while True:
                try:
                    await AsyncSandbox.list(socket=self.sock, limit=1)
                    return
                except SandboxError:
                    await trio.sleep(0.2)

    async def listed(self) -> dict[str, str]:
        """The states serve lists, once none is in passage (ready/stopped/failed/paused)
        and, for up to EVENTUALLY seconds, once each is one the model allows (a killed
        QEMU, a panic: the supervisor learns of them a moment later)."""
        t = time.monotonic()
        with trio.move_on_after(180):
            while True:
                page = await AsyncSandbox.list(socket=self.sock, limit=100)
                states = {s.id: s.state for s in page.sandboxes}
                if all(s in checks.SETTLED for s in states.values()):
                    allowed = all(checks.state_of(states.get(id, ABSENT)) in m.allowed for id, m in self.model.items())
                    if allowed or time.monotonic() - t > EVENTUALLY:
                        return states
                await trio.sleep(0.5)
        self.violate([("liveness", f"states still in passage after 180 s: {states}")])
        return states

    async def look(self, id: str) -> None:
        """A ready sandbox's boot id and chaos files, against the model."""
        m = self.model[id]
        try:
            with trio.fail_after(60):
                r = await self.sb(id).run(["sh", "-c", LOOK])
        except (SandboxError, trio.TooSlowError) as exc:
            self.violate([("state", f"{id} is ready and does not answer: {exc!s:.200}")])
            return
        lines = r.stdout.decode().splitlines()
        seen: dict[str, str] = {}
        where = ""
        for line in lines[1:]:
            if line.startswith("=="):
                where = line[2:]
            elif line.strip():
                h, name = line.split(None, 1)
                seen[f"{where}/{name}"] = h
        self.violate(checks.check_boot(m, lines[0].strip() if lines else ""))
        root = {p: h for p, h in seen.items() if p.startswith("/root/")}
        self.violate(checks.check_files(id, m.files, root, m.unsynced))
        if m.volume:
            data = {p: h for p, h in seen.items() if p.startswith("/data/")}
            self.violate(checks.check_files(VOLUME, self.volume_files, data, m.unsynced))

    def saved_state_holders(self) -> tuple[int, int]:
        """The forks with a child that may still live, and the sandboxes that may be
        paused: what may hold a hidden saved state now."""
        self.forks = [c for c in self.forks if any(self.model.get(x, _GONE).allowed - {ABSENT} for x in c)]
        return len(self.forks), sum(1 for m in self.model.values() if "paused" in m.allowed)

    async def check(self) -> None:
        try:
            states = await self.listed()
        except SandboxError as exc:
            self.violate([("liveness", f"List failed: {exc}")])
            return
        self.violate(checks.check_states(self.model, states))
        for id in [id for id, m in self.model.items() if m.allowed == {ABSENT}]:
            del self.model[id]  # (its volume's files stay the volume's)
        ready = [id for id, m in self.model.items() if m.allowed == {"ready"}]
        for id in ready:
            if self.look_all or id in self.touched:
                await self.look(id)
        running = len(ready)
        with_net = sum(1 for id in ready if self.model[id].net)
        found: list[tuple[str, str]] = []
        for _ in range(30):  # (a conversion, a merge, a stopping QEMU: passing; an orphan stays)
            facts = host_facts(self.work, self.serve.pid, self.state_mount)
            found = checks.check_orphans(facts, running, with_net)
            found += checks.check_saved_states(saved_states(self.work), *self.saved_state_holders())
            if not found:
                break
            await trio.sleep(1)
        self.violate(found)
        fds, rss = footprint(self.serve.pid)
        self.report.peak["fds"] = max(self.report.peak.get("fds", 0), fds)
        self.report.peak["rss_mib"] = max(self.report.peak.get("rss_mib", 0), rss)
        self.report.peak["sandboxes"] = max(self.report.peak.get("sandboxes", 0), len(self.model))
        self.violate(checks.check_bounded(fds, rss, len(self.model)))
        with open(self.serve.log, "rb") as f:
            f.seek(self.log_offset)
            new = f.read()
            self.log_offset += len(new)
        self.violate(checks.check_log(new.decode(errors="replace").splitlines()))


_GONE = checks.SandboxModel("", {ABSENT})
# a capture of a running sandbox's memory and disk (a pause, a checkpoint, a fork) cut
# by a supervisor kill: its QEMU, stopped mid-capture, is not adopted and the sandbox
# is failed with its disk whole (docs/hibernation.md)
CAPTURE_CUT = frozenset({"failed"})
MAYBE_DONE = frozenset({"DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED", "INTERNAL"})


def run_chaos(
    seed: int,
    minutes: float,
    *,
    steps: int = 0,
    faults: set[str] | None = None,
    log: Path | None = None,
    trace: Path | None = None,
) -> Report:
    """One chaos run; its report (printed too). ``trace``: the run's account, a line per
    call and fault (:meth:`Chaos.trace`)."""
    faults = set(FAULTS) if faults is None else faults
    deadline = time.monotonic() + minutes * 60
    with workdir("sv-chaos-", private_state=True) as work, state_filesystem(work, 6144) as mount:
        serve = Serve(work, log or work.root / "serve.log")
        chaos = Chaos(work, serve, seed, faults, mount, trace)
        if mount is None and "state-full" in faults:
            chaos.report.notes.append("state-full skipped: not root (the state dir's filesystem is a loop mount)")
        serve.start()
        try:
            trio.run(chaos.run, deadline, steps)
        finally:
            status = serve.stop()
        if status != 0:
            chaos.violate([("stop", f"serve's graceful stop exited {status}")])
        left = work.processes()
        chaos.violate([("orphans", f"after serve stopped: {what}") for what in left.values()])
        with open(serve.log, "rb") as f:
            f.seek(chaos.log_offset)
            chaos.violate(checks.check_log(f.read().decode(errors="replace").splitlines()))
    print(chaos.report.text(), flush=True)
    return chaos.report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=0, help="stop after this step (replay up to a violation)")
    ap.add_argument("--no-fault", action="append", default=[], choices=FAULTS)
    ap.add_argument("--log", help="serve's log (default: in the temp dir, removed)")
    ap.add_argument("--json", help="write the report here too")
    ap.add_argument("--trace", help="append the run's account here: each call's target, each write's file, each answer")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    report = run_chaos(
        seed,
        a.minutes,
        steps=a.steps,
        faults=set(FAULTS) - set(a.no_fault),
        log=Path(a.log) if a.log else None,
        trace=Path(a.trace) if a.trace else None,
    )
    if a.json:
        Path(a.json).write_text(json.dumps(report.as_json(), indent=1))
    sys.exit(1 if report.violations else 0)


if __name__ == "__main__":
    main()
