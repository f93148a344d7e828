"""This host's Ray node: ``ray start --block`` as the member's child, stopped by its pid.

``ray start --block`` (the head, or a worker joining the head) runs in its own session,
so its process group is all of Ray's processes here (raylet, GCS, agents); the stop
signals that group by its id (never ``ray stop``, which kills every Ray process of the
machine by name). The group id is written to ``<state>/fleet/ray.pid``. A supervisor
killed without a stop (kill -9) leaves its Ray node running, as it leaves its QEMUs
(which a restart adopts): the fleet still sees the node alive and its sandboxes placed;
the restart kills that group first and starts a fresh node. (No parent-death signal:
Trio spawns from a worker thread, and Linux sends it when that *thread* exits, which
killed the node at random.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import attrs
import trio

from actors import defaults as D
from actors.errors import Unavailable
from supervisor.fleet.placement import NodeSpec
from supervisor.fleet.ray_backend import resources

log = logging.getLogger("sandvisor.fleet")


@attrs.frozen
class RayNodeConfig:
    ray_address: str  # HOST:PORT of the head's GCS
    node_ip: str  # this host's address on the cluster network (Ray binds its ports there)
    spec: NodeSpec
    dir: Path  # <state>/fleet: the pid file, Ray's log and its temp dir
    head: bool = False
    object_store_mib: int = D.FLEET_OBJECT_STORE_MIB


def argv(cfg: RayNodeConfig) -> list[str]:
    port = cfg.ray_address.rpartition(":")[2]
    out = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address",
        cfg.node_ip,
        "--num-cpus",
        "0",  # Ray runs no tasks here: its scheduler places our slots, nothing else
        "--object-store-memory",
        str(cfg.object_store_mib << 20),
        "--resources",
        json.dumps(resources(cfg.spec)),
        "--temp-dir",
        str(temp_dir(cfg)),
    ]
    if cfg.head:
        out += ["--head", "--port", port, "--include-dashboard=false"]
    else:
        out += ["--address", cfg.ray_address]
    return out


def temp_dir(cfg: RayNodeConfig) -> Path:
    return temp_dir_for(cfg.dir)


def temp_dir_for(fleet_dir: Path) -> Path:
    """Ray's temp dir of the member whose fleet dir is ``fleet_dir``: its Unix sockets live
    under it, so a short path (sun_path is 108 bytes), unique to the state dir."""
    import hashlib

    return Path("/tmp") / f"svray-{hashlib.sha256(str(fleet_dir.resolve()).encode()).hexdigest()[:10]}"


def _kill_stale(pidfile: Path) -> None:
    try:
        pgid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if b"ray.scripts.scripts" in cmdline:
        log.warning("fleet: a Ray node left by an earlier run (group %d): killed", pgid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


class RayNode:
    """Owns this host's Ray processes: started by :meth:`run`, their group killed when it ends."""

    def __init__(self, cfg: RayNodeConfig) -> None:
        self.cfg = cfg
        self.pid: int | None = None

    async def run(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.cfg
        cfg.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        pidfile = cfg.dir / "ray.pid"
        _kill_stale(pidfile)
        shutil.rmtree(temp_dir(cfg), ignore_errors=True)  # a session a crash left: start afresh
        env = {
            **os.environ,
            "RAY_health_check_period_ms": str(D.FLEET_HEALTH_PERIOD_MS),
            "RAY_health_check_failure_threshold": str(D.FLEET_HEALTH_MISSES),
        }
        with open(cfg.dir / "ray.log", "ab") as out:
            proc = await trio.lowlevel.open_process(
                argv(cfg),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
            )
        self.pid = proc.pid
        pidfile.write_text(f"{proc.pid}\n")
        log.info("fleet: Ray node started (%s, group %d; log %s)", "head" if cfg.head else "worker", proc.pid, out.name)
        try:
            task_status.started(proc.pid)
            code = await proc.wait()
            raise Unavailable(f"this host's Ray node exited (status {code}): see {cfg.dir / 'ray.log'}")
        finally:
            with trio.CancelScope(shield=True):
                await self._stop(proc)
                pidfile.unlink(missing_ok=True)
                # Ray's session (sockets, logs, the object store's spill): ours, gone with the node
                await trio.to_thread.run_sync(lambda: shutil.rmtree(temp_dir(cfg), ignore_errors=True))

    async def _stop(self, proc: trio.Process) -> None:
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with trio.move_on_after(grace):
                await proc.wait()
                # the group's other processes (Ray's own children die with `ray start`), or now
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                return
