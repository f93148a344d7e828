"""``sandvisor serve``'s configuration, declared once: :class:`DaemonConfig`'s fields
carry their command-line flag (:class:`Flag` in the field's metadata), and the
``serve`` parser (:func:`add_flags`), the parsed arguments' mapping
(:func:`from_args`) and its inverse (:func:`to_argv`) are made from that declaration.

Flag kinds: a value (``--boot-timeout 60``), a switch (``--keep-sandboxes``: the field
True), a negation (``--no-jail``: the field False), a repeatable one (``--grpc``, one
per element). ``parse`` turns what argparse made into the field's value (a path, the
default socket, ``none``); ``show`` turns one value (or element) back into its text.

Light on purpose (attrs and the defaults only): the CLI builds the parser without the
daemon's imports (trio, the domain).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from actors import defaults

FLAG = "sandvisor.flag"  # the metadata key of a field's Flag
FIELDS = "the field's"  # Flag.default: the flag's default is the field's


@attrs.frozen
class Flag:
    """How one field is set from ``sandvisor serve``'s command line."""

    name: str  # --boot-timeout
    help: str | None = None
    kind: str = "value"  # value | switch | negation | repeat
    type: Callable[[str], Any] | None = None  # argparse's type (each element of a repeat)
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    default: Any = FIELDS  # the flag's default, when it is not the field's (value flags)
    parse: Callable[[Any], Any] | None = None  # argparse's value -> the field's
    show: Callable[[Any], str] = str  # a value (an element of a repeat) -> its argument


def flag(value: Any = attrs.NOTHING, /, *, factory: Callable[[], Any] | None = None, **kw: Any) -> Any:
    """A field (default ``value``, or made by ``factory``) set by a flag (``kw``: :class:`Flag`'s)."""
    meta = {FLAG: Flag(**kw)}
    if factory is not None:
        return attrs.field(factory=factory, metadata=meta)
    return attrs.field(default=value, metadata=meta)


def _path(v: str | None) -> Path | None:
    return Path(v) if v else None


def _socket(v: str | None) -> Path:
    from supervisor.wire.config import default_socket

    return Path(v) if v else default_socket()


def _state_dir(v: str | None) -> Path:
    from images.build import default_state_dir

    return Path(v) if v else default_state_dir()


def _uid_range(text: str) -> tuple[int, int]:
    first, sep, count = text.partition(":")
    if not sep or not first.isdigit() or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"--jail-uids {text!r}: FIRST:COUNT")
    return int(first), int(count)


def _image_size(text: str) -> int:
    from supervisor.client import InvalidArgument, parse_size

    try:
        n = parse_size(text)
    except InvalidArgument:
        n = 0
    if n < 1 << 20:
        raise argparse.ArgumentTypeError(f"--max-image-size {text!r}: a size of at least 1M (512M, 8G, ...)")
    return n


def _pool_arg(text: str) -> tuple[str, int]:
    snap, sep, n = text.rpartition("=")
    if not sep or not snap or not n.isdigit():
        raise argparse.ArgumentTypeError(f"--pool {text!r}: SNAPSHOT=N")
    return snap, int(n)


def _sandbox_disk_arg(text: str) -> int:
    """--max-sandbox-disk: MiB, from "16G", "512M", "2T" or a bare number of MiB ("0": no cap)."""
    from supervisor.client import parse_size
    from supervisor.wire.errors import SandboxError

    t = text.strip()
    try:
        mib = int(t) if t.isdigit() else -(-parse_size(t) // (1 << 20))
    except SandboxError:
        mib = -1
    if mib < 0:
        raise argparse.ArgumentTypeError(f"--max-sandbox-disk {text!r}: a size such as 16G, 512M, or 0 (no cap)")
    return mib


def _tuple(v: Sequence[Any] | None) -> tuple[Any, ...]:
    return tuple(v or ())


def _resolved(v: Sequence[str] | None) -> tuple[Path, ...]:
    return tuple(Path(p).resolve() for p in v or ())


def _ip_pool(v: str) -> str:
    return "" if v.lower() == "none" else v


# The fields in the order `sandvisor serve --help` lists their flags.
@attrs.frozen
class DaemonConfig:
    socket: Path = flag(
        name="--socket",
        help="socket path (default: $SANDVISOR_SOCKET, /run/sandvisor/sandvisor.sock for root)",
        default=None,
        parse=_socket,
    )
    state_dir: Path = flag(
        name="--state-dir",
        help="state directory (default: $SANDVISOR_STATE_DIR, /var/lib/sandvisor for root)",
        default=None,
        parse=_state_dir,
    )
    accel: str = flag("auto", name="--accel", choices=("auto", "kvm", "tcg"))
    run_root: Path | None = flag(  # per-VM sockets and run dirs
        None, name="--run-root", help="per-VM sockets and run dirs (default: /run/sandvisor/vms for root)", parse=_path
    )
    boot_timeout: float = flag(
        defaults.BOOT_TIMEOUT, name="--boot-timeout", type=float, help="seconds a boot may take before it fails"
    )
    jail_overhead_mib: int = flag(  # a QEMU's memory limit: guest RAM + this
        defaults.JAIL_OVERHEAD_MIB,
        name="--jail-overhead",
        type=int,
        metavar="MIB",
        help="each jailed QEMU's memory limit is its guest RAM + this (QEMU, TCG's cache; "
        f"default {defaults.JAIL_OVERHEAD_MIB})",
    )
    jail_uids: tuple[int, int] | None = flag(  # (first, count) of the cells' identities (None: the default range)
        None,
        name="--jail-uids",
        type=_uid_range,
        metavar="FIRST:COUNT",
        help="the uid/gid range jailed QEMUs get ids from (no real user may have one; "
        f"default {defaults.JAIL_ID_FIRST}:{defaults.JAIL_ID_COUNT})",
        show=lambda r: f"{r[0]}:{r[1]}",
    )
    guest_timeout: float = flag(  # every guest request's deadline on the host (DEADLINE_EXCEEDED)
        defaults.GUEST_TIMEOUT,
        name="--guest-timeout",
        type=float,
        help="seconds any guest request may take on the host's side before DEADLINE_EXCEEDED "
        f"(default {defaults.GUEST_TIMEOUT:g})",
    )
    max_sandboxes: int = flag(
        defaults.MAX_SANDBOXES, name="--max-sandboxes", type=int
    )  # live ones, warm pools' included
    max_paused: int = flag(  # hibernated ones: they hold disk, not RAM or a --max-sandboxes slot
        0, name="--max-paused", type=int, help="paused sandboxes at once (0: no limit; they count against disk)"
    )
    group: str | None = flag(
        None, name="--group", help="make the socket 0660 for this group (default: owner only, 0600)"
    )
    admin_group: str | None = flag(  # docs/security.md: principals; --group members see only their own
        None,
        name="--admin-group",
        help="members of this group are admins on the sockets: they see and act on every sandbox, snapshot, "
        "volume and stored secret (default: root and the supervisor's uid only)",
    )
    qemu_user: str | None = flag(  # None: sandvisor-qemu or nobody when root; "": run QEMU as ourselves
        None,
        name="--qemu-user",
        help="user QEMU runs as when serve runs as root (default: sandvisor-qemu if it exists, else nobody; "
        "'' to keep root)",
    )
    expose_address: str = flag(  # where exposed ports listen on the host
        defaults.EXPOSE_ADDRESS,
        name="--expose-address",
        help="host address exposed ports listen on (default: loopback only)",
    )
    memory_dir: Path | None = flag(  # guest RAM files (default: per state dir under /dev/shm)
        None, name="--memory-dir", help="guest RAM files, on tmpfs (default: /dev/shm/sandvisor-<key>)", parse=_path
    )
    anonymous_memory: bool = flag(  # no RAM files: checkpoints stream RAM (slower restores)
        False,
        name="--anonymous-memory",
        kind="switch",
        help="no RAM files: checkpoints then stream RAM into the snapshot (restores load it, slower)",
    )
    templates: bool = flag(  # Creates restore a boot template of their configuration
        True,
        name="--no-templates",
        kind="negation",
        help="always boot: do not restore Creates from a snapshot of the first fresh boot of their configuration",
    )
    template_pool: int = flag(  # restored members kept ready per boot template
        0,
        name="--template-pool",
        type=int,
        metavar="N",
        help="restored sandboxes kept ready per boot template: a Create takes one (default 0)",
    )
    pool_size: int = flag(  # warm pool members kept per snapshot
        0, name="--pool-size", type=int, help="restored sandboxes kept ready per snapshot (default 0)"
    )
    keep_sandboxes: bool = flag(  # at SIGTERM, leave sandboxes running for the next supervisor
        False,
        name="--keep-sandboxes",
        kind="switch",
        help="at SIGTERM, leave sandboxes running for the next supervisor (upgrades); default: stop them",
    )
    jail: bool = flag(  # as root: every QEMU in its own jail, uid and cgroup (actors/cells/cell.py)
        True,
        name="--no-jail",
        kind="negation",
        help="as root: do not jail QEMUs (each in its own uid, namespaces, cgroup)",
    )
    cgroups: bool = flag(  # jailed: no usable cgroup hierarchy refuses to start; False: QEMUs unlimited
        True,
        name="--no-cgroups",
        kind="negation",
        help="jailed: run QEMUs without cgroup limits (memory, processes, CPU); default: refuse to start without them",
    )
    # where a Create's kernel and rootfs, local image refs and host directories (--mount) may come from
    allow_paths: tuple[Path, ...] = flag(
        (),
        name="--allow-path",
        kind="repeat",
        metavar="DIR",
        help="a directory a Create's own kernel and disk image (--image-disk), root filesystem directories "
        "(--image ./DIR), oci:/oci-archive:/docker-archive: images, snapshot export files (--from-snapshot), "
        "copies and host directories it mounts (create --mount) may come from (repeatable; none by default)",
        parse=_resolved,
    )
    registry_allow: tuple[str, ...] = flag(  # HOST[:PORT]: the only registries pulled from
        (),
        name="--registry-allow",
        kind="repeat",
        metavar="HOST[:PORT]",
        help="pull images only from these registries (repeatable; default: any, except registries on loopback "
        "or link-local addresses, which only this flag allows)",
    )
    registry_mirrors: tuple[str, ...] = flag(  # REGISTRY=URL: where REGISTRY's images are fetched from
        (),
        name="--registry-mirror",
        kind="repeat",
        metavar="REGISTRY=URL",
        help="fetch REGISTRY's images (docker.io: plain names like alpine) from a mirror: URL is HOST[:PORT], "
        "https://HOST[:PORT] or http://HOST[:PORT] (plain HTTP); the images keep their names (repeatable)",
    )
    max_memory_mib: int = flag(  # total guest RAM (0: the host's RAM less 1 GiB)
        0, name="--max-memory", type=int, metavar="MIB", help="total guest RAM (default: host RAM - 1 GiB)"
    )
    max_disk_mib: int = flag(  # the state dir's use: logs, overlays, snapshots (0: no limit)
        0, name="--max-disk", type=int, metavar="MIB", help="state dir use (default: no limit)"
    )
    max_sandbox_disk_mib: int = flag(  # one sandbox's overlay + rw volumes, virtual sizes (0: no cap)
        defaults.MAX_SANDBOX_DISK_MIB,
        name="--max-sandbox-disk",
        type=_sandbox_disk_arg,
        metavar="SIZE",
        help="one sandbox's disk and read-write volumes, e.g. 16G (default; 0: no cap)",
    )
    max_image_bytes: int = flag(  # an OCI image's download and unpacked tree, each, as bytes arrive
        defaults.MAX_IMAGE_BYTES,
        name="--max-image-size",
        type=_image_size,
        metavar="SIZE",
        help="an OCI image's download and its unpacked tree, each (e.g. 512M, 8G; enforced as the bytes arrive)",
    )
    max_starting: int = flag(  # VMs brought up at once (0: one per core, at least 2; quotas.gated)
        0,
        name="--max-starting",
        type=int,
        metavar="N",
        help="VMs brought up (booted or restored) at once; more wait their turn (default: one per core, at least 2)",
    )
    balloon: bool = flag(  # free page reporting, where it is safe (Settings.balloon)
        True,
        name="--no-balloon",
        kind="negation",
        help="no virtio-balloon: memory a guest frees stays with its QEMU (default: reported and given back)",
    )
    tb_size_mib: int = flag(  # TCG's translation cache per QEMU (0: QEMU's default, 1 GiB)
        defaults.TB_SIZE_MIB,
        name="--tb-size",
        type=int,
        metavar="MIB",
        help=f"TCG's translation cache per QEMU (default {defaults.TB_SIZE_MIB}; 0: QEMU's own, 1 GiB)"
        "; ignored under KVM",
    )
    pools: dict[str, int] = flag(  # per snapshot id or name
        factory=dict,
        name="--pool",
        kind="repeat",
        type=_pool_arg,
        metavar="SNAPSHOT=N",
        help="warm pool size for one snapshot (id or name); repeatable",
        parse=lambda v: dict(v or []),
        show=lambda item: f"{item[0]}={item[1]}",
    )
    grpc: tuple[str, ...] = flag(  # unix:///PATH (mode as the socket's), HOST:PORT (TLS off loopback)
        (),
        name="--grpc",
        kind="repeat",
        metavar="ADDR",
        help="also serve sandbox.v1 and sandvisor.v1 over gRPC: unix:///PATH (mode as --socket's) or HOST:PORT "
        "(TLS unless loopback; clients authenticate: --grpc-client-ca or --grpc-token-file); repeatable",
    )
    grpc_cert: Path | None = flag(  # PEM certificate chain and key for the HOST:PORT addresses
        None, name="--grpc-cert", metavar="PEM", help="TLS certificate chain for --grpc HOST:PORT", parse=_path
    )
    grpc_key: Path | None = flag(
        None, name="--grpc-key", metavar="PEM", help="TLS private key for --grpc HOST:PORT", parse=_path
    )
    grpc_client_ca: Path | None = flag(  # require client certificates signed by this CA
        None, name="--grpc-client-ca", metavar="PEM", help="require client certificates signed by this CA", parse=_path
    )
    grpc_token_file: Path | None = flag(  # TCP callers send "authorization: Bearer <its token>" (0600, ours)
        None,
        name="--grpc-token-file",
        metavar="FILE",
        help="TCP clients send metadata 'authorization: Bearer TOKEN' with a token in FILE "
        "(ours, mode 0600; read at start): lines 'TOKEN [LABEL [admin]]', the principal token:LABEL "
        "(a token without a label is the operator's: an admin)",
        parse=_path,
    )
    grpc_admin_cert_cn: tuple[str, ...] = flag(  # docs/security.md: principals
        (),
        name="--grpc-admin-cert-cn",
        kind="repeat",
        metavar="CN",
        help="client certificates with this common name are admins; the others are the principal cert:CN "
        "and see only their own (default: every verified client certificate is an admin); repeatable",
    )
    grpc_insecure: bool = flag(  # TCP on loopback with no client authentication: tests only (a WARNING)
        False,
        name="--grpc-insecure",
        kind="switch",
        help="TESTS ONLY: gRPC on loopback TCP with no client authentication (any local user controls every sandbox)",
    )
    metrics: str | None = flag(  # HOST:PORT of the Prometheus endpoint (None: not served)
        None,
        name="--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (loopback only); needs --metrics-token-file",
    )
    metrics_token_file: Path | None = flag(  # scrapers send "Authorization: Bearer <its token>" (0600, ours)
        None,
        name="--metrics-token-file",
        metavar="FILE",
        help="scrapers of --metrics send 'Authorization: Bearer TOKEN' with the token in FILE "
        "(ours, mode 0600; made with a new random token if absent; read at start)",
        parse=_path,
    )
    e2b: str | None = flag(  # HOST:PORT of the E2B-compatible API (None: not served; host: loopback)
        None,
        name="--e2b",
        metavar="HOST:PORT",
        help="serve the E2B API (the e2b SDK with E2B_API_URL/E2B_SANDBOX_URL) at http://HOST:PORT (host: loopback); "
        "needs --e2b-key-file",
    )
    e2b_key_file: Path | None = flag(  # API keys, one a line (ours, mode 0600; read at start)
        None,
        name="--e2b-key-file",
        metavar="FILE",
        help="the E2B API keys, one a line (ours, mode 0600; read at start)",
        parse=_path,
    )
    ssh: str | None = flag(  # HOST:PORT of the SSH endpoint (None: not served; host: loopback)
        None,
        name="--ssh",
        metavar="HOST:PORT",
        help="serve SSH (ssh, scp, sftp to SANDBOX@HOST by the keys a sandbox was given) at HOST:PORT "
        "(host: loopback; docs/ssh.md)",
    )
    # tap networking (root): the IP pool's CIDR ("" = none: no tap mode, no outbound for
    # jailed user-mode sandboxes). `sandvisor serve` defaults it to 10.88.0.0/16.
    ip_pool: str = flag(
        "",
        name="--ip-pool",
        default=defaults.IP_POOL,
        metavar="CIDR",
        help=f"as root: tap networking's addresses (default {defaults.IP_POOL}; 'none': no tap, no jailed outbound)",
        parse=_ip_pool,
        show=lambda v: v or "none",
    )
    dns_upstreams: tuple[str, ...] = flag(  # the DNS proxy's resolvers, HOST[:PORT] (default: /etc/resolv.conf's)
        (),
        name="--dns-upstream",
        kind="repeat",
        metavar="HOST[:PORT]",
        help="the sandboxes' DNS proxy asks these (repeatable; default: /etc/resolv.conf's)",
    )
    egress_never: tuple[str, ...] = flag(  # CIDRs no sandbox reaches whatever its policy says (e.g. the LAN)
        (),
        name="--egress-never",
        kind="repeat",
        metavar="CIDR",
        help="a range no sandbox reaches whatever its egress policy (e.g. your LAN; repeatable)",
    )
    # the fleet (docs/fleet.md): join the Ray cluster at this address (HOST:PORT of its head)
    fleet: str | None = flag(
        None,
        name="--fleet",
        metavar="RAY_ADDRESS",
        help="join a fleet: start this host's Ray node in the cluster at HOST:PORT (its head's GCS); "
        "needs --advertise and a --grpc HOST:PORT with --grpc-client-ca (mTLS)",
    )
    fleet_head: bool = flag(  # start the cluster's head here (the --fleet address is then this host's)
        False, name="--fleet-head", kind="switch", help="start the fleet's Ray head here, at --fleet's HOST:PORT"
    )
    advertise: str | None = flag(  # the gRPC HOST:PORT other hosts and clients reach this one at
        None, name="--advertise", metavar="HOST:PORT", help="the --grpc address the fleet's clients reach this host at"
    )
    fleet_node: str | None = flag(  # this node's name in the fleet (default: --advertise's host)
        None, name="--fleet-node", metavar="NAME", help="this host's name in the fleet (default: --advertise's host)"
    )
    fleet_slots: int = flag(
        defaults.FLEET_SLOTS,
        name="--fleet-slots",
        type=int,
        help=f"sandboxes the fleet may place here (default {defaults.FLEET_SLOTS})",
    )
    fleet_memory_mib: int = flag(
        defaults.FLEET_MEMORY_MIB,
        name="--fleet-memory",
        type=int,
        metavar="MIB",
        help=f"guest memory the fleet may place here, MiB (default {defaults.FLEET_MEMORY_MIB})",
    )
    fleet_token_file: Path | None = flag(  # Ray's token (0600): the head makes STATE/fleet/ray-token
        None,
        name="--fleet-token-file",
        metavar="FILE",
        help="the fleet's Ray token, a 0600 file (the head makes STATE/fleet/ray-token when not given; "
        "every other member needs a copy of it)",
        parse=_path,
    )
    fleet_peers: tuple[str, ...] = flag(  # who may reach this host's Ray ports (nftables)
        (),
        name="--fleet-peer",
        kind="repeat",
        metavar="ADDRESS|CIDR",
        help="a member of the fleet, allowed to reach this host's Ray ports (repeatable; default: the head)",
    )
    fleet_user: str = flag(
        defaults.FLEET_RAY_USER,
        name="--fleet-user",
        metavar="USER",
        help=f"the unprivileged user Ray runs as (default {defaults.FLEET_RAY_USER}, made when absent)",
    )
    fleet_python: str | None = flag(
        None,
        name="--fleet-python",
        metavar="PATH",
        help="the Python Ray's user runs Ray with (default: serve's own; the same version)",
    )
    # secrets (docs/secrets.md): the vault's key, outside the state dir
    secrets_key: Path | None = flag(
        None,
        name="--secrets-key",
        metavar="FILE",
        help="the key of the secret vault, 0600 (default /etc/sandvisor/secrets.key as root; made at first use)",
        parse=_path,
    )
    upstream_ca: Path | None = flag(  # the secret proxy trusts these besides the system store
        None,
        name="--upstream-ca",
        metavar="PEM",
        help="CA certificates the secret proxy trusts for real servers, besides the system store",
        parse=_path,
    )
    stop_timeout: float = 10.0  # (no flag) the stop of every sandbox at SIGTERM
    # networking (docs/network.md): non-loopback host addresses a sandbox's exposed ports
    # may listen on (a door: every host of that network reaches the port; docs/security.md)
    port_addresses: tuple[str, ...] = flag(
        (),
        name="--port-address",
        kind="repeat",
        metavar="ADDRESS",
        help="a host address (IPv4; 0.0.0.0 for all) a Create may expose its ports on, besides loopback and "
        "--expose-address (repeatable; opens those ports to that network)",
    )
    network_profiles: Path | None = flag(  # named egress policies a Create may name (TOML)
        None,
        name="--network-profiles",
        metavar="FILE",
        help="a TOML file of named network profiles ([profile.NAME] default/allow/deny) besides "
        "public, private and none; read at start",
        parse=_path,
    )
    # webhooks (docs/webhooks.md): the n-th --webhook is signed with the n-th --webhook-secret
    webhooks: tuple[str, ...] = flag(
        (),
        name="--webhook",
        kind="repeat",
        metavar="URL",
        help="POST every sandbox's lifecycle events, signed, to this http(s) URL (repeatable; each with its "
        "--webhook-secret, paired in order)",
    )
    webhook_secrets: tuple[Path, ...] = flag(
        (),
        name="--webhook-secret",
        kind="repeat",
        metavar="FILE",
        help="the HMAC-SHA256 secret of the --webhook of the same position (ours, mode 0600; read at start)",
        parse=lambda v: tuple(Path(p) for p in v or ()),
    )
    freeze_fs: bool = flag(  # FIFREEZE the guest's file systems while a pause or checkpoint captures its disk
        True,
        name="--no-fs-freeze",
        kind="negation",
        help="do not freeze the guest's file systems while a pause or checkpoint captures its disk "
        "(captures are then only crash-consistent: a disk-only restore replays the journal)",
    )


def flags() -> list[tuple[attrs.Attribute[Any], Flag]]:
    """Every flagged field of :class:`DaemonConfig`, with its flag, in the help's order."""
    return [(a, a.metadata[FLAG]) for a in attrs.fields(DaemonConfig) if FLAG in a.metadata]


def _dest(f: Flag) -> str:
    return f.name.removeprefix("--").replace("-", "_")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags, from :class:`DaemonConfig`'s declaration."""
    for a, f in flags():
        kw: dict[str, Any] = {"help": f.help}
        if f.metavar is not None:
            kw["metavar"] = f.metavar
        if f.kind in ("switch", "negation"):
            kw["action"] = "store_true"
        elif f.kind == "repeat":
            kw["action"] = "append"
            if f.type is not None:
                kw["type"] = f.type
        else:
            kw["default"] = a.default if f.default is FIELDS else f.default
            if f.type is not None:
                kw["type"] = f.type
            if f.choices is not None:
                kw["choices"] = list(f.choices)
        parser.add_argument(f.name, **kw)


def from_args(args: argparse.Namespace) -> DaemonConfig:
    """The configuration ``serve``'s parsed arguments say."""
    values: dict[str, Any] = {}
    for a, f in flags():
        v = getattr(args, _dest(f))
        if f.kind == "negation":
            v = not v
        elif f.kind == "repeat" and f.parse is None:
            v = _tuple(v)
        if f.parse is not None:
            v = f.parse(v)
        values[a.name] = v
    return DaemonConfig(**values)


def to_argv(cfg: DaemonConfig) -> list[str]:
    """``serve``'s arguments that make ``cfg`` (the inverse of :func:`from_args`; the
    fields without a flag are not said)."""
    out: list[str] = []
    for a, f in flags():
        v = getattr(cfg, a.name)
        if f.kind == "switch":
            out += [f.name] if v else []
        elif f.kind == "negation":
            out += [] if v else [f.name]
        elif f.kind == "repeat":
            for item in v.items() if isinstance(v, dict) else v:
                out += [f.name, f.show(item)]
        elif v is not None:
            out += [f.name, f.show(v)]
    return out
