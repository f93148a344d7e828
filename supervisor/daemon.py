"""``sandvisor serve``: the long-running supervisor.

Owns, in one nursery: the registry actor (and through it every sandbox), the
Unix-socket server, and the asyncio loop QMP runs on. SIGTERM or SIGINT: stop
accepting, stop every sandbox within a bound, exit 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

import attrs
import trio

from actors.cell import Cells, JailConfig
from actors.machine import qmp_loop, resolve_accel, unprivileged_user
from actors.quotas import Quotas, gated, start_slots
from actors.registry import Registry
from actors.settings import Settings
from actors.store import Store
from actors.vm import booted_guest
from images.build import Builder, Image, load_default
from images.oci import ImageStore
from supervisor.config import claim_runtime_dir, default_memory_dir, default_run_root, runtime_dir
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
    jail: bool = True  # as root: every QEMU in its own jail, uid and cgroup (actors/cell.py)
    jail_overhead_mib: int = 192  # a QEMU's memory limit: guest RAM + this
    keep_sandboxes: bool = False  # at SIGTERM, leave sandboxes running for the next supervisor
    allow_paths: tuple[Path, ...] = ()  # where a Create's own kernel and rootfs may come from
    stop_timeout: float = 10.0
    guest_timeout: float = 30.0  # every guest request's deadline on the host (DEADLINE_EXCEEDED)
    group: str | None = None
    qemu_user: str | None = None  # None: sandvisor-qemu or nobody when root; "": run QEMU as ourselves
    expose_address: str = "127.0.0.1"  # where exposed ports listen on the host
    memory_dir: Path | None = None  # guest RAM files (default: per state dir under /dev/shm)
    anonymous_memory: bool = False  # no RAM files: checkpoints stream RAM (slower restores)
    pool_size: int = 0  # warm pool members kept per snapshot
    pools: dict[str, int] = attrs.field(factory=dict)  # per snapshot id or name
    templates: bool = True  # Creates restore a boot template of their configuration
    template_pool: int = 0  # restored members kept ready per boot template
    balloon: bool = True  # free page reporting, where it is safe (Settings.balloon)
    max_starting: int = 0  # VMs brought up at once (0: one per core, at least 2; quotas.gated)
    tb_size_mib: int = 64  # TCG's translation cache per QEMU (0: QEMU's default, 1 GiB)


def default_image(state_dir: Path) -> Image:
    img = load_default(state_dir / "images")
    if img is None:
        log.info("the default image is not built yet: building it (once)")
        img = Builder(state_dir / "images", progress=lambda part, msg: log.info("image %s: %s", part, msg)).build()
    return img


async def serve(
    cfg: DaemonConfig, task_status: trio.TaskStatus[tuple[Registry, Server]] = trio.TASK_STATUS_IGNORED
) -> None:
    if os.geteuid() != 0 and (cfg.run_root is None or cfg.socket.parent == runtime_dir()):
        claim_runtime_dir()  # ours and 0700, or refused: a predictable /tmp name someone may have made
    accel = resolve_accel(cfg.accel)
    image = await trio.to_thread.run_sync(default_image, cfg.state_dir)
    memory_dir = None if cfg.anonymous_memory else (cfg.memory_dir or default_memory_dir(cfg.state_dir))
    cells = None
    if cfg.jail and os.geteuid() == 0:
        cells = await trio.to_thread.run_sync(
            lambda: Cells.setup(
                JailConfig(overhead_mib=cfg.jail_overhead_mib),
                state_dir=cfg.state_dir,
                ram_dir=memory_dir,
                kvm=accel == "kvm",
            )
        )
    store = Store(cfg.state_dir / "sandvisor.db")
    # a balloon's discards are safe in anonymous RAM and in a machine's own RAM file; a
    # restore maps a snapshot's memory privately, which only a jail seals (and the
    # discard shim lets give memory back): without both, no balloons
    balloon = cfg.balloon and (cells.discard_shim is not None if cells is not None else memory_dir is None)
    if cfg.balloon and not balloon:
        log.warning("no free page reporting: guest RAM files need a jail and the discard shim (a root supervisor)")
    settings = Settings(
        image=image,
        sandboxes_dir=cfg.state_dir / "sandboxes",
        run_root=cfg.run_root or default_run_root(),
        accel=accel,
        boot_timeout=cfg.boot_timeout,
        guest_timeout=cfg.guest_timeout,
        qemu_user=unprivileged_user(cfg.qemu_user),
        expose_address=cfg.expose_address,
        memory_dir=memory_dir,
        cells=cells,
        allowed_paths=cfg.allow_paths,
        images=ImageStore(cfg.state_dir / "oci") if os.geteuid() == 0 else None,
        balloon=balloon,
        tb_size_mib=cfg.tb_size_mib or None,
        launch=gated(booted_guest, trio.CapacityLimiter(cfg.max_starting or start_slots())),
    )
    log.info(
        "serving on %s (state %s, accel %s, QEMU %s)",
        cfg.socket,
        cfg.state_dir,
        accel,
        "jailed, each as its own user"
        if cells
        else f"as {settings.qemu_user.name}"
        if settings.qemu_user
        else "as the supervisor's user",
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
                if cfg.keep_sandboxes:
                    await registry.detach_all()
                else:
                    await registry.shutdown(cfg.stop_timeout)
                nursery.cancel_scope.cancel()
    finally:
        store.close()
        if cells is not None:
            cells.close()
        if settings.memory_dir is not None and not cfg.keep_sandboxes:
            with contextlib.suppress(OSError):
                settings.memory_dir.rmdir()  # empty once every sandbox is gone
