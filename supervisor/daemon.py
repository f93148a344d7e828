"""``sandvisor serve``: the long-running supervisor.

Owns, in one nursery: the registry actor (and through it every sandbox), the
Unix-socket server, and the asyncio loop QMP runs on. SIGTERM or SIGINT: stop
accepting, stop every sandbox within a bound, exit 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from pathlib import Path

import attrs
import trio

from actors.machine import qmp_loop, resolve_accel, unprivileged_user
from actors.quotas import Quotas
from actors.registry import Registry
from actors.settings import Settings
from actors.store import Store
from images.build import Builder, Image, load_default
from supervisor.config import default_memory_dir, default_run_root
from supervisor.notify import Notifier
from supervisor.server import Server

log = logging.getLogger("sandvisor.daemon")


@attrs.frozen
class DaemonConfig:
    socket: Path
    state_dir: Path
    accel: str = "auto"
    run_root: Path | None = None
    boot_timeout: float = 60.0
    max_sandboxes: int = 64  # live sandboxes, warm pool members included
    max_memory_mib: int = 0  # total guest RAM (0: the host's RAM less 1 GiB)
    max_disk_mib: int = 0  # the state dir's use: logs, overlays, snapshots (0: no limit)
    stop_timeout: float = 10.0
    group: str | None = None
    qemu_user: str | None = None  # None: sandvisor-qemu or nobody when root; "": run QEMU as ourselves
    expose_address: str = "127.0.0.1"  # where exposed ports listen on the host
    memory_dir: Path | None = None  # guest RAM files (default: per state dir under /dev/shm)
    anonymous_memory: bool = False  # no RAM files: checkpoints stream RAM (slower restores)
    pool_size: int = 0  # warm pool members kept per snapshot
    pools: dict[str, int] = attrs.field(factory=dict)  # per snapshot id or name
    templates: bool = True  # Creates restore a boot template of their configuration
    template_pool: int = 0  # restored members kept ready per boot template


def default_image(state_dir: Path) -> Image:
    img = load_default(state_dir / "images")
    if img is None:
        log.info("the default image is not built yet: building it (once)")
        img = Builder(state_dir / "images", progress=lambda part, msg: log.info("image %s: %s", part, msg)).build()
    return img


async def serve(
    cfg: DaemonConfig, task_status: trio.TaskStatus[tuple[Registry, Server]] = trio.TASK_STATUS_IGNORED
) -> None:
    accel = resolve_accel(cfg.accel)
    image = await trio.to_thread.run_sync(default_image, cfg.state_dir)
    store = Store(cfg.state_dir / "sandvisor.db")
    settings = Settings(
        image=image,
        sandboxes_dir=cfg.state_dir / "sandboxes",
        run_root=cfg.run_root or default_run_root(),
        accel=accel,
        boot_timeout=cfg.boot_timeout,
        qemu_user=unprivileged_user(cfg.qemu_user),
        expose_address=cfg.expose_address,
        memory_dir=None if cfg.anonymous_memory else (cfg.memory_dir or default_memory_dir(cfg.state_dir)),
    )
    log.info(
        "serving on %s (state %s, accel %s, QEMU as %s)",
        cfg.socket,
        cfg.state_dir,
        accel,
        settings.qemu_user.name if settings.qemu_user else "the supervisor's user",
    )
    try:
        async with qmp_loop(), trio.open_nursery() as nursery:
            registry = await nursery.start(
                Registry(
                    settings,
                    store,
                    quotas=Quotas(
                        max_sandboxes=cfg.max_sandboxes,
                        max_memory_mib=cfg.max_memory_mib,
                        max_disk_mib=cfg.max_disk_mib,
                    ),
                    templates=cfg.templates,
                    template_pool=cfg.template_pool,
                    pool_size=cfg.pool_size,
                    pools=cfg.pools,
                ).run
            )
            server_scope = trio.CancelScope()

            async def run_server(task_status: trio.TaskStatus[Server]) -> None:
                with server_scope:
                    await Server(registry, cfg.socket, group=cfg.group).serve(task_status=task_status)

            server = await nursery.start(run_server)
            notify = Notifier()
            nursery.start_soon(notify.keep_alive)
            notify.ready(f"serving on {cfg.socket}")
            task_status.started((registry, server))
            try:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for sig in signals:
                        log.info("signal %s: shutting down", signal.Signals(sig).name)
                        break
            finally:
                notify.stopping()
                server_scope.cancel()  # stop accepting first
                await registry.shutdown(cfg.stop_timeout)
                nursery.cancel_scope.cancel()
    finally:
        store.close()
        if settings.memory_dir is not None:
            with contextlib.suppress(OSError):
                settings.memory_dir.rmdir()  # empty once every sandbox is gone
