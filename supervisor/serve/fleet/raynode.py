"""This host's Ray node: ``ray start --block`` as the member's child, as Ray's own user,
stopped by its pid.

``ray start --block`` (the head, or a worker joining the head) runs in its own session,
so its process group is all of Ray's processes here (raylet, GCS, agents, workers); the
stop signals that group by its id (never ``ray stop``, which kills every Ray process of
the machine by name). The group id is written to ``<state>/fleet/ray.pid``. A supervisor
killed without a stop (kill -9) leaves its Ray node running, as it leaves its QEMUs
(which a restart adopts): the fleet still sees the node alive and its sandboxes placed;
the restart kills that group first and starts a fresh node. (No parent-death signal:
Trio spawns from a worker thread, and Linux sends it when that *thread* exits, which
killed the node at random.)

What the node may touch (supervisor/serve/fleet/rayhost.py): it runs as the fleet's Ray user
(``setpriv``: no capabilities, no_new_privs, no supplementary groups), in a clean
environment, with Ray's temp dir ``RUN_ROOT/ray`` (0700, that user's) holding its
sockets, logs and a copy of the token; its ports are pinned and filtered (nftables) before
it starts, and the Ray Client server is off (supervisor/serve/fleet/raystart.py).
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

from actors.face import FailedPrecondition, Unavailable, defaults
from supervisor.serve.fleet import rayhost
from supervisor.serve.fleet.placement import NodeSpec
from supervisor.serve.fleet.ray_backend import resources
from supervisor.serve.fleet.transfer import NodeTls

log = logging.getLogger("sandvisor.fleet")

LAUNCHER = "supervisor.serve.fleet.raystart"  # (also how a stale node's group is recognised)
START_GRACE = 120.0  # a node that exits sooner failed to start: it is started again,
START_TRIES = 3  # this many times in all


@attrs.frozen
class RayNodeConfig:
    ray_address: str  # HOST:PORT of the head's GCS
    node_ip: str  # this host's address on the cluster network
    spec: NodeSpec
    dir: Path  # <state>/fleet: the pid file and Ray's log
    ray_dir: Path  # RUN_ROOT/ray: Ray's temp dir (sockets, session, the token's copy), its user's
    token: Path  # the fleet's token file (0600, root's)
    peers: tuple[str, ...] = ()  # who may reach Ray's ports (networks)
    user: str = defaults.FLEET_RAY_USER
    python: str = sys.executable  # must be Ray's user's to run, and the driver's version
    head: bool = False
    object_store_mib: int = defaults.FLEET_OBJECT_STORE_MIB
    firewall: bool = True  # (off only in unit tests)
    tls: NodeTls | None = None  # Ray's TLS with the node's certificate (None: Ray's traffic in the clear)

    @property
    def ports(self) -> rayhost.RayPorts:
        return rayhost.RayPorts(int(self.ray_address.rpartition(":")[2]))


def argv(cfg: RayNodeConfig, user: rayhost.RayUser) -> list[str]:
    out = [
        "setpriv",
        f"--reuid={user.uid}",
        f"--regid={user.gid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
        cfg.python,
        "-m",
        LAUNCHER,
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
        str(cfg.ray_dir),
        *cfg.ports.flags(),
    ]
    if cfg.head:
        out += ["--head", "--port", str(cfg.ports.gcs), "--include-dashboard=false"]
    else:
        out += ["--address", cfg.ray_address]
    return out


def environment(cfg: RayNodeConfig, user: rayhost.RayUser, token: Path) -> dict[str, str]:
    """Ray's processes' whole environment (nothing of the supervisor's): the token by path,
    the copies of the node's certificate, key and CA (when TLS is on) in Ray's dir."""
    tls = (
        rayhost.tls_env(cfg.ray_dir / "ca.pem", cfg.ray_dir / "node.pem", cfg.ray_dir / "node.key")
        if cfg.tls is not None
        else {}
    )
    return {
        **tls,
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(cfg.ray_dir),
        "USER": user.name,
        "LOGNAME": user.name,
        "TMPDIR": str(cfg.ray_dir),
        "RAY_TMPDIR": str(cfg.ray_dir),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
        "AUTOSCALER_METRIC_PORT": str(cfg.ports.autoscaler_metrics),
        "RAY_health_check_period_ms": str(defaults.FLEET_HEALTH_PERIOD_MS),
        "RAY_health_check_failure_threshold": str(defaults.FLEET_HEALTH_MISSES),
    }


def ray_dir_for(run_root: Path) -> Path:
    """Ray's temp dir under a run root: its Unix sockets live under it (sun_path is 108
    bytes: the run root is short), away from /tmp."""
    return run_root / "ray"


def _kill_stale(pidfile: Path) -> None:
    try:
        pgid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if LAUNCHER.encode() in cmdline or b"ray.scripts.scripts" in cmdline:  # (or an older serve's, as root)
        log.warning("fleet: a Ray node left by an earlier run (group %d): killed", pgid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def _fresh_dir(cfg: RayNodeConfig, user: rayhost.RayUser) -> Path:
    """Ray's dir, empty, 0700, its user's; the token's copy in it (the path)."""
    shutil.rmtree(cfg.ray_dir, ignore_errors=True)  # a session a crash left: start afresh
    cfg.ray_dir.mkdir(mode=0o700)
    os.chown(cfg.ray_dir, user.uid, user.gid)
    why = rayhost.reachable_by(cfg.ray_dir, user) or rayhost.reachable_by(Path(cfg.python), user)
    if why:
        raise FailedPrecondition(f"the fleet's Ray node runs as {user.name}, but {why}")
    if cfg.tls is not None:
        for src, name in ((cfg.tls.ca, "ca.pem"), (cfg.tls.cert, "node.pem"), (cfg.tls.key, "node.key")):
            rayhost.install(src.read_bytes(), cfg.ray_dir / name, user)
    return rayhost.install_token(cfg.token, cfg.ray_dir, user)


def _firewall(script: str) -> None:
    from actors.face import Nft

    with Nft() as nft:
        nft.run(script)


class RayNode:
    """Owns this host's Ray processes: started by :meth:`run`, their group killed when it ends."""

    def __init__(self, cfg: RayNodeConfig) -> None:
        self.cfg = cfg
        self.pid: int | None = None
        self.user: rayhost.RayUser | None = None

    async def driver_connected(self) -> None:
        """After the supervisor's driver joined: what it made in Ray's dir is Ray's user's."""
        if self.user is not None:
            user = self.user
            n = await trio.to_thread.run_sync(lambda: rayhost.give_back(self.cfg.ray_dir, user))
            log.debug("fleet: %d of the driver's files in Ray's dir handed to %s", n, user.name)

    async def run(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.cfg
        cfg.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        pidfile = cfg.dir / "ray.pid"
        _kill_stale(pidfile)
        user = self.user = await trio.to_thread.run_sync(rayhost.ray_user, cfg.user)
        token = _fresh_dir(cfg, user)
        if cfg.firewall:  # before Ray listens: its ports are never open to all
            _firewall(rayhost.firewall(cfg.ports, cfg.peers, user))
        try:
            for attempt in range(1, START_TRIES + 1):
                proc = await self._start(user, token, pidfile)
                if attempt == 1:
                    task_status.started(proc.pid)
                started = trio.current_time()
                try:
                    code = await proc.wait()
                finally:
                    with trio.CancelScope(shield=True):
                        await self._stop(proc)
                        pidfile.unlink(missing_ok=True)
                if trio.current_time() - started > START_GRACE or attempt == START_TRIES:
                    break
                # `ray start` gives its raylet 30 s to register (fixed in Ray): a loaded host misses it
                log.warning("fleet: this host's Ray node exited while starting (status %d): started again", code)
            raise Unavailable(f"this host's Ray node exited (status {code}): see {cfg.dir / 'ray.log'}")
        finally:
            with trio.CancelScope(shield=True):
                # Ray's session (sockets, logs, the token's copy): ours, gone with the node
                await trio.to_thread.run_sync(lambda: shutil.rmtree(cfg.ray_dir, ignore_errors=True))
                if cfg.firewall:
                    _firewall(rayhost.firewall_off())

    async def _start(self, user: rayhost.RayUser, token: Path, pidfile: Path) -> trio.Process:
        cfg = self.cfg
        with open(cfg.dir / "ray.log", "ab") as out:
            proc = await trio.lowlevel.open_process(
                argv(cfg, user),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=environment(cfg, user, token),
            )
        self.pid = proc.pid
        pidfile.write_text(f"{proc.pid}\n")
        log.info(
            "fleet: Ray node started (%s, as %s, group %d; log %s)",
            "head" if cfg.head else "worker",
            user.name,
            proc.pid,
            out.name,
        )
        return proc

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
