"""``sandvisor serve``: the long-running supervisor.

Owns, in one nursery: the registry actor (and through it every sandbox), the
Unix-socket server, the gRPC edge and the metrics endpoint (when configured), the
asyncio loop QMP runs on, and (root, ``ip_pool`` set) the host network: the IP pool,
the egress filter, the DNS proxy (actors/net/hostnet.py). SIGTERM or SIGINT: stop
accepting (the gRPC edge first), stop every sandbox within a bound, exit 0.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import stat
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from actors import helpers, sandlog
from actors.cells.cell import Cells, JailConfig
from actors.machines.qemuproc import unprivileged_user, unsearchable_parent
from actors.machines.qemuspec import resolve_accel
from actors.machines.vm import booted_guest
from actors.model import Egress, SandboxConfig
from actors.net import profiles
from actors.net.hostnet import HostNetConfig, HostNetwork
from actors.net.ippool import IpPool, parse_pool
from actors.principals import Principal
from actors.quotas import Quotas, gated, start_slots
from actors.registry import Registry
from actors.sandboxes.secrets import upstream_context
from actors.secrets.vault import Vault
from actors.settings import Settings
from actors.store import Store, StoreLeases
from images.build import Builder, Image, hold_parts, load_default
from images.oci import ImageStore
from images.profiles import load_profile
from images.refs import RefPolicy
from supervisor.main.daemon_config import DaemonConfig
from supervisor.main.notify import Notifier
from supervisor.serve.e2b_kernels import warmup_argv
from supervisor.serve.eventlog import EventLog
from supervisor.serve.grpc_addresses import Address, TcpAddress
from supervisor.serve.grpc_service import addresses, build_edge, call_principal, tcp_auth
from supervisor.serve.metrics import MetricsEndpoint, RegistrySource, parse_listen
from supervisor.serve.metrics import check_listen as check_metrics_listen
from supervisor.serve.server import Server
from supervisor.serve.tokens import make_token_file, read_token_file
from supervisor.serve.webhooks import WebhookCollector, WebhookSender, webhooks
from supervisor.wire.config import (
    claim_runtime_dir,
    default_memory_dir,
    default_run_root,
    make_dirs,
    passable_runtime_dir,
    runtime_dir,
)

if TYPE_CHECKING:
    from supervisor.serve.fleet.member import FleetConfig, FleetMember

log = logging.getLogger("sandvisor.daemon")


def host_network(cfg: DaemonConfig, store: Store) -> HostNetwork | None:
    """The tap networking of a root supervisor with an IP pool (not started yet)."""
    if not cfg.ip_pool:
        return None
    if os.geteuid() != 0:
        log.info("tap networking needs root: network mode 'tap' is not available")
        return None
    key = hashlib.sha256(str(cfg.state_dir.resolve()).encode()).hexdigest()[:6]
    config = HostNetConfig(
        pool=cfg.ip_pool,
        upstreams=tuple(parse_upstream(u) for u in cfg.dns_upstreams),
        never=cfg.egress_never,
        jail_prefix=f"svj-{key}-",
    )
    return HostNetwork(config, IpPool(cfg.ip_pool, StoreLeases(store)))


def network_profiles(cfg: DaemonConfig) -> dict[str, Egress]:
    """The operator's named network profiles (--network-profiles), read once at start."""
    if cfg.network_profiles is None:
        return {}
    try:
        return profiles.load(cfg.network_profiles)
    except profiles.ProfileFileError as exc:
        raise Refused(f"--network-profiles: {exc}") from None


def parse_upstream(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` of a DNS upstream (IPv4)."""
    host, _, port = text.partition(":")
    try:
        return str(ipaddress.IPv4Address(host)), int(port or 53)
    except ValueError:
        raise ValueError(f"DNS upstream {text!r}: expected an IPv4 address, optionally with :PORT") from None


def default_image(state_dir: Path) -> Image:
    img = load_default(state_dir / "images")
    if img is None or not img.readable():  # (unreadable: made under a umask like serve's by an older build)
        log.info("the default image is not built yet, or not readable by a jailed QEMU: building it (once)")
        img = Builder(state_dir / "images", progress=lambda part, msg: log.info("image %s: %s", part, msg)).build()
    return img


def e2b_key_file(cfg: DaemonConfig) -> Path:
    """--e2b's key file, checked (private, ours, some keys); ValueError otherwise."""
    if cfg.e2b_key_file is None:
        raise ValueError("--e2b needs --e2b-key-file FILE (API keys, one a line)")
    from supervisor.serve.e2b_server import check_key_file

    check_key_file(cfg.e2b_key_file)
    return cfg.e2b_key_file


def metrics_token(cfg: DaemonConfig) -> bytes:
    """--metrics's bearer token: read from --metrics-token-file (made, 0600, with a new
    random token if there is no file there); ValueError otherwise."""
    if cfg.metrics_token_file is None:
        raise ValueError("--metrics needs --metrics-token-file FILE (scrapers send 'Authorization: Bearer TOKEN')")
    if make_token_file(cfg.metrics_token_file, "--metrics-token-file"):
        log.info("--metrics-token-file %s: a new token, mode 0600", cfg.metrics_token_file)
    return read_token_file(cfg.metrics_token_file, "--metrics-token-file")


async def _sandbox_log_levels(registry: Registry) -> None:
    """The supervisor's log lines about a sandbox at that sandbox's level, until cancelled."""

    def lookup(id: str) -> SandboxConfig | None:
        sb = registry.sandboxes.get(id)
        return sb.config if sb is not None else None

    with sandlog.filtering(lookup):
        await trio.sleep_forever()


async def serve(
    cfg: DaemonConfig, task_status: trio.TaskStatus[tuple[Registry, Server]] = trio.TASK_STATUS_IGNORED
) -> None:
    # what the supervisor makes is its own: overlays, logs, snapshots and the database
    # hold sandbox data (what others must reach -- the run root, the socket of a
    # --group, a jail -- gets its mode explicitly)
    umask = os.umask(0o077)
    try:
        await _serve(cfg, task_status)
    finally:
        os.umask(umask)


class Refused(Exception):
    """serve cannot start as configured: one line that says what to change."""


def _private_state_dir(path: Path) -> None:
    make_dirs(path, 0o700)  # (parents too: nothing else needs to pass through them)
    st = path.stat()
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        log.info("state dir %s was mode %o: now 0700 (it holds sandbox disks and logs)", path, st.st_mode & 0o777)
        path.chmod(0o700)


@contextlib.contextmanager
def _state_lock(state_dir: Path) -> Iterator[None]:
    """One supervisor per state dir: a second would sweep the first one's QEMUs and files
    as strays. A lock on a file in the (private) state dir, held for serve's life and
    dropped by the kernel when the process ends, however it ends."""
    fd = os.open(state_dir / "serve.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise Refused(
                f"another sandvisor serve (pid {other}) uses the state dir {state_dir}: stop it, or give this one "
                "its own --state-dir and --socket"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _check_socket_free(path: Path) -> None:
    """A socket file some running supervisor answers on is not ours to replace."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)  # a live one with a full backlog holds a blocking connect
        try:
            probe.connect(str(path))
        except TimeoutError:
            pass  # someone listens there, too busy to accept: live
        except OSError:
            return  # a dead supervisor's: the server replaces it
    raise Refused(f"another supervisor serves on {path}: stop it, or choose another --socket")


def _check(cfg: DaemonConfig) -> None:
    """Settings a flag gave that nothing else checks before it is used: refused by the
    flag's name, before anything starts."""
    if cfg.upstream_ca is not None and not cfg.upstream_ca.is_file():
        raise Refused(f"--upstream-ca {cfg.upstream_ca}: no such file")
    for cidr in cfg.egress_never:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise Refused(f"--egress-never {cidr!r}: expected a CIDR such as 192.168.0.0/16") from None
    if cfg.ip_pool:
        parse_pool(cfg.ip_pool)  # (PoolError names --ip-pool)
    for upstream in cfg.dns_upstreams:
        try:
            parse_upstream(upstream)
        except ValueError as exc:
            raise Refused(f"--dns-upstream: {exc}") from None
    for address in cfg.port_addresses:
        try:
            ipaddress.IPv4Address(address)
        except ValueError:
            raise Refused(f"--port-address {address!r}: expected an IPv4 address such as 192.0.2.10") from None
    network_profiles(cfg)  # (a bad file is refused by its flag before anything starts)
    if cfg.jail_uids is not None:
        first, count = cfg.jail_uids
        if first <= 0 or first + count > 2**32 - 1:
            raise Refused(f"--jail-uids {first}:{count}: ids must lie in 1..{2**32 - 2}")
    for name, value in (("--boot-timeout", cfg.boot_timeout), ("--guest-timeout", cfg.guest_timeout)):
        if not value > 0:
            raise Refused(f"{name} {value}: must be more than 0 seconds")
    for name, n in (
        ("--max-sandboxes", cfg.max_sandboxes),
        ("--max-paused", cfg.max_paused),
        ("--max-memory", cfg.max_memory_mib),
        ("--max-disk", cfg.max_disk_mib),
        ("--jail-overhead", cfg.jail_overhead_mib),
        ("--pool-size", cfg.pool_size),
        ("--template-pool", cfg.template_pool),
        ("--max-starting", cfg.max_starting),
        ("--tb-size", cfg.tb_size_mib),
    ):
        if n < 0:
            raise Refused(f"{name} {n}: must not be negative")
    for path in cfg.allow_paths:
        if not path.is_dir():
            raise Refused(f"--allow-path {path}: not a directory")


def _layout(cfg: DaemonConfig, run_root: Path, qemu_user: str | None) -> None:
    """The socket's dir and the run root, made with the modes they need: passable (0711)
    where QEMU's user or a --group must pass, private (the non-root runtime dir) where
    nothing else must. Refusals name what to change."""
    if os.geteuid() == 0:
        passable_runtime_dir()
        make_dirs(cfg.socket.parent, 0o711)
        make_dirs(run_root, 0o711)
        if qemu_user is not None:
            blocked = unsearchable_parent(run_root / "x")
            if blocked is not None:
                raise Refused(
                    f"the run root {run_root} is not reachable by QEMU's user {qemu_user!r}: {blocked} is not o+x "
                    f"(chmod o+x {blocked}, or choose another --run-root)"
                )
    else:
        if cfg.run_root is None or cfg.socket.parent == runtime_dir():
            claim_runtime_dir()  # ours and 0700, or refused: a predictable /tmp name someone may have made
        make_dirs(cfg.socket.parent, 0o700)
        make_dirs(run_root, 0o700)
    _check_socket_free(cfg.socket)


def _built_helpers(cfg: DaemonConfig) -> tuple[Path, Path | None] | None:
    """The C helpers a jailed supervisor runs, as the package build made them
    (actors/helpers.py): the jail helper, and the discard shim unless --no-balloon.
    Missing or stale: refused, saying how to build them (nothing is compiled here, and
    nothing falls back). None: no jail (not root, or --no-jail)."""
    if not (cfg.jail and os.geteuid() == 0):
        return None
    try:
        helper = helpers.installed(helpers.JAIL_EXEC)
    except helpers.HelperError as exc:
        raise Refused(str(exc)) from None
    shim = None
    if cfg.balloon:
        try:
            shim = helpers.installed(helpers.RAM_DISCARD)
        except helpers.HelperError as exc:
            raise Refused(f"{exc} (or serve --no-balloon: no free page reporting)") from None
    log.info("C helpers: %s, %s (built by %s)", helper, shim, helpers.manifest()["compiler"]["version"])
    return helper, shim


def _fleet_config(cfg: DaemonConfig, grpc_addrs: list[Address]) -> FleetConfig | None:
    """``--fleet``'s settings, checked: the advertised address is a --grpc TCP listener
    whose clients present certificates (mTLS), as other hosts and clients call it."""
    if cfg.fleet is None:
        for name, given in (("--advertise", cfg.advertise), ("--fleet-node", cfg.fleet_node)):
            if given:
                raise Refused(f"{name} is for a fleet member: give --fleet RAY_ADDRESS too")
        if cfg.fleet_head:
            raise Refused("--fleet-head needs --fleet HOST:PORT (where the head listens)")
        return None
    if not cfg.advertise:
        raise Refused("--fleet needs --advertise HOST:PORT (the --grpc address other hosts reach this one at)")
    from supervisor.serve.fleet.member import fleet_config
    from supervisor.serve.fleet.transfer import NodeTls

    tls = (
        NodeTls(cfg.grpc_client_ca, cfg.grpc_cert, cfg.grpc_key)
        if cfg.grpc_client_ca and cfg.grpc_cert and cfg.grpc_key
        else None
    )

    try:
        fc = fleet_config(
            cfg.fleet,
            cfg.advertise,
            cfg.fleet_node,
            cfg.fleet_slots,
            cfg.fleet_memory_mib,
            cfg.state_dir,
            cfg.fleet_head,
            tls,
            run_root=cfg.run_root or default_run_root(),
            token_file=cfg.fleet_token_file,
            peers=cfg.fleet_peers,
            ray_user=cfg.fleet_user,
            ray_python=cfg.fleet_python,
        )
    except ValueError as exc:
        raise Refused(str(exc)) from None
    listener = next((a for a in grpc_addrs if isinstance(a, TcpAddress) and a.target == cfg.advertise), None)
    if listener is None:
        raise Refused(f"--advertise {cfg.advertise}: not one of the --grpc HOST:PORT addresses")
    if (listener.tls is None or not listener.tls.require_client_cert) and not cfg.grpc_insecure:
        raise Refused(
            f"--advertise {cfg.advertise}: a fleet's listener is mTLS (--grpc-cert, --grpc-key, --grpc-client-ca)"
        )
    if importlib.util.find_spec("ray") is None:
        raise Refused("--fleet needs Ray: pip install 'sandvisor[fleet]'")
    return fc


def _fleet_member(fc: FleetConfig, registry: Registry) -> Callable[[trio.TaskStatus[FleetMember]], Awaitable[None]]:
    from supervisor.serve.fleet.member import FleetMember

    return FleetMember(fc, registry).run


async def _serve(cfg: DaemonConfig, task_status: trio.TaskStatus[tuple[Registry, Server]]) -> None:
    _check(cfg)
    _private_state_dir(cfg.state_dir)
    with _state_lock(cfg.state_dir):
        await _serve_locked(cfg, task_status)


async def _serve_locked(cfg: DaemonConfig, task_status: trio.TaskStatus[tuple[Registry, Server]]) -> None:
    built = _built_helpers(cfg)  # before anything starts: nothing is compiled at start
    grpc_auth = tcp_auth(cfg.grpc_token_file, cfg.grpc_insecure, cfg.grpc_admin_cert_cn)  # the token read once, here
    grpc_addrs = addresses(
        cfg.grpc,
        cert=cfg.grpc_cert,
        key=cfg.grpc_key,
        client_ca=cfg.grpc_client_ca,
        group=cfg.group,
        admin_group=cfg.admin_group,
        auth=grpc_auth,
    )  # before anything starts: a wrong flag fails fast
    metrics_at = check_metrics_listen(cfg.metrics) if cfg.metrics else None
    metrics_key = metrics_token(cfg) if metrics_at is not None else b""
    e2b_at = parse_listen(cfg.e2b) if cfg.e2b else None
    e2b_keys = e2b_key_file(cfg) if e2b_at is not None else Path()
    ssh_at = parse_listen(cfg.ssh) if cfg.ssh else None
    try:
        hooks = webhooks(cfg.webhooks, cfg.webhook_secrets)  # the secrets read once, here
    except (ValueError, OSError) as exc:
        raise Refused(str(exc)) from None
    fleet = _fleet_config(cfg, grpc_addrs)
    image_refs = RefPolicy(
        allowed_paths=cfg.allow_paths, registry_allow=cfg.registry_allow, registry_mirrors=cfg.registry_mirrors
    )
    qemu_user = unprivileged_user(cfg.qemu_user)
    _layout(cfg, cfg.run_root or default_run_root(), qemu_user.name if qemu_user is not None else None)
    accel = resolve_accel(cfg.accel)
    image = await trio.to_thread.run_sync(default_image, cfg.state_dir)
    # the code-interpreter profile's rootfs, if built (sandvisor image build --profile
    # code-interpreter): its part directory is allowed as a Create's root disk (the E2B
    # endpoint's code-interpreter templates boot it; so may any caller: a public part)
    code_image = load_profile("code-interpreter", cfg.state_dir / "images")
    served_roots = (code_image.rootfs.resolve().parent,) if code_image is not None else ()
    # ... and its boot templates hold the kernel server, started and warm
    warmups = {str(code_image.rootfs.resolve()): warmup_argv()} if code_image is not None else {}
    memory_dir = None if cfg.anonymous_memory else (cfg.memory_dir or default_memory_dir(cfg.state_dir))
    cells = None
    if built is not None:
        cells = await trio.to_thread.run_sync(
            lambda: Cells.setup(
                JailConfig(overhead_mib=cfg.jail_overhead_mib)
                if cfg.jail_uids is None
                else JailConfig(
                    first_uid=cfg.jail_uids[0], uid_count=cfg.jail_uids[1], overhead_mib=cfg.jail_overhead_mib
                ),
                helper=built[0],
                discard_shim=built[1],
                state_dir=cfg.state_dir,
                ram_dir=memory_dir,
                kvm=accel == "kvm",
                cgroups=cfg.cgroups,
            )
        )
    store = Store(cfg.state_dir / "sandvisor.db")
    event_log = EventLog(cfg.state_dir / "events.db", [h.key for h in hooks])
    sender = WebhookSender(event_log, hooks) if hooks else None
    # a balloon's discards are safe in anonymous RAM and in a machine's own RAM file; a
    # restore maps a snapshot's memory privately, which only a jail seals (and the
    # discard shim, required above, lets give memory back): without a jail, no balloons
    balloon = cfg.balloon and (cells is not None or memory_dir is None)
    if cfg.balloon and not balloon:
        log.warning("no free page reporting: guest RAM files need a jail (a root supervisor; or --anonymous-memory)")
    hostnet = host_network(cfg, store)
    settings = Settings(
        image=image,
        sandboxes_dir=cfg.state_dir / "sandboxes",
        run_root=cfg.run_root or default_run_root(),
        accel=accel,
        boot_timeout=cfg.boot_timeout,
        guest_timeout=cfg.guest_timeout,
        qemu_user=qemu_user,
        expose_address=cfg.expose_address,
        memory_dir=memory_dir,
        cells=cells,
        allowed_paths=cfg.allow_paths + served_roots,
        max_sandbox_disk_mib=cfg.max_sandbox_disk_mib,
        images=ImageStore(
            cfg.state_dir / "oci",
            max_image_bytes=cfg.max_image_bytes,
            refs=image_refs,
            tools=cells.tools if cells is not None else None,  # skopeo, umoci, mkfs in cells
        )
        if os.geteuid() == 0
        else None,
        balloon=balloon,
        tb_size_mib=cfg.tb_size_mib or None,
        launch=gated(booted_guest, trio.CapacityLimiter(cfg.max_starting or start_slots())),
        hostnet=hostnet,
        vault=Vault(cfg.state_dir, cfg.secrets_key),
        upstream_tls=upstream_context(str(cfg.upstream_ca or "")),
        port_addresses=cfg.port_addresses,
        network_profiles=network_profiles(cfg),
        freeze_fs=cfg.freeze_fs,
        template_warmups=warmups,
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
    parts = hold_parts(image)  # a build elsewhere leaves the parts we boot from in place
    try:
        async with trio.open_nursery() as nursery:
            if hostnet is not None:  # before the registry: adopted sandboxes get their links back
                await nursery.start(hostnet.run)
                log.info("tap networking: pool %s, gateway and DNS proxy %s", hostnet.pool.network, hostnet.gateway)
            if sender is not None:
                await nursery.start(sender.run)
                log.info("webhooks: %s", ", ".join(h.url for h in hooks))
            registry = Registry(
                settings,
                store,
                quotas=Quotas(
                    max_sandboxes=cfg.max_sandboxes,
                    max_memory_mib=cfg.max_memory_mib,
                    max_disk_mib=cfg.max_disk_mib,
                    max_paused=cfg.max_paused,
                ),
                templates=cfg.templates,
                template_pool=cfg.template_pool,
                pool_size=cfg.pool_size,
                pools=cfg.pools,
            )
            registry.events.journal = event_log.append  # every event logged (and queued for the webhooks) first
            registry.events.backlog = event_log.after  # events --since replays from it
            await nursery.start(registry.run)
            # the sandboxes' own log levels for the lines about them (actors/sandlog.py)
            nursery.start_soon(_sandbox_log_levels, registry)
            server_scope = trio.CancelScope()

            async def run_server(task_status: trio.TaskStatus[Server]) -> None:
                with server_scope:
                    await Server(registry, cfg.socket, group=cfg.group, admin_group=cfg.admin_group).serve(
                        task_status=task_status
                    )

            server = await nursery.start(run_server)
            member = await nursery.start(_fleet_member(fleet, registry)) if fleet is not None else None
            edge_scope = trio.CancelScope()
            if grpc_addrs:

                async def run_edge(task_status: trio.TaskStatus[object]) -> None:
                    with edge_scope:
                        edge = build_edge(registry, grpc_addrs, tcp_auth=grpc_auth)
                        if member is not None:
                            from supervisor.serve.fleet import service as fleet_service

                            def who(call: Any) -> Principal:
                                return call_principal(call, edge.tcp_auth, edge.unix_peers)

                            edge.add_methods(fleet_service.SERVICE, fleet_service.methods(member, who))
                        await edge.run(task_status=task_status)

                await nursery.start(run_edge)
                log.info("gRPC on %s", ", ".join(map(str, grpc_addrs)))
            if metrics_at is not None:
                endpoint = MetricsEndpoint(
                    RegistrySource(registry),
                    *metrics_at,
                    token=metrics_key,
                    extra=[WebhookCollector(sender)] if sender is not None else [],
                )
                await nursery.start(endpoint.run)
                log.info("metrics on http://%s:%d/metrics", metrics_at[0], endpoint.port)
            e2b_scope = trio.CancelScope()
            if e2b_at is not None:
                from supervisor.serve.e2b_server import E2BEndpoint

                code_rootfs = str(code_image.rootfs.resolve()) if code_image is not None else ""
                e2b = E2BEndpoint(
                    str(cfg.socket), *e2b_at, key_file=e2b_keys, code_rootfs=code_rootfs, tap=hostnet is not None
                )

                async def run_e2b(task_status: trio.TaskStatus[None]) -> None:
                    with e2b_scope:
                        await e2b.run(task_status=task_status)

                await nursery.start(run_e2b)
            if ssh_at is not None:
                from supervisor.serve.ssh_gateway import SSHGateway

                ssh = SSHGateway(str(cfg.socket), *ssh_at, state_dir=cfg.state_dir)

                async def run_ssh(task_status: trio.TaskStatus[None]) -> None:
                    with e2b_scope:  # (stops with the other listeners, before the socket)
                        await ssh.run(task_status=task_status)

                await nursery.start(run_ssh)
                registry.endpoints.update(ssh=ssh.address, ssh_host_key=ssh.host_key_line)
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
                edge_scope.cancel()  # stop accepting: gRPC first (remote callers), then the socket
                e2b_scope.cancel()
                server_scope.cancel()
                if cfg.keep_sandboxes:
                    if hostnet is not None:
                        hostnet.keep_table = True  # the sandboxes that run on stay filtered
                    await registry.detach_all()
                else:
                    await registry.shutdown(cfg.stop_timeout)
                nursery.cancel_scope.cancel()
    finally:
        parts.close()
        store.close()
        event_log.close()
        if cells is not None:
            cells.close()
        if not cfg.keep_sandboxes:  # empty once every sandbox is gone: nothing of ours stays in /run or /dev/shm
            for d in (settings.memory_dir, settings.run_root):
                if d is not None:
                    with contextlib.suppress(OSError):
                        d.rmdir()
