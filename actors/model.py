"""The domain's values: states, events, a sandbox's configuration, and their rules.

Everything past the edge is one of these frozen attrs values, never a wire dict. An
edge builds a :class:`SandboxConfig` once from its request; the registry checks it
(:func:`check_config`) and keeps it as requested, so an idempotent Create compares
what was asked, not what the sandbox became (its live port mappings are in the
record, not here). :data:`converter` is the one cattrs converter the store uses.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import re
from pathlib import Path
from typing import Any, TypeVar

import attrs
from cattrs.preconf.msgpack import make_converter

from actors.egress_policy import EgressPolicy, PolicyError
from actors.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from actors.principals import LEGACY_OWNER
from actors.secrets.model import SecretRef, check_secrets, with_placeholders
from guestd import patch


class State(enum.StrEnum):
    """The sandbox states of sandbox.v1 (and paused, ours)."""

    STARTING = "starting"
    READY = "ready"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    PAUSED = "paused"  # hibernated to disk: no QEMU, no RAM (not in sandbox.v1's list)
    # ours (the microsandbox SDK's), not in sandbox.v1's list: its edge says "stopping"
    # for draining and "failed" (with the cause in ``error``) for crashed (V1_STATE)
    DRAINING = "draining"  # no new execs or runs; those in flight get the grace, then it stops
    CRASHED = "crashed"  # the guest died on its own (panic, QEMU killed, out of memory)


# sandbox.v1's word for each of our states (its SandboxInfo.state is a fixed list)
V1_STATE = {State.DRAINING: "stopping", State.CRASHED: "failed"}

ALIVE = frozenset({State.READY, State.RUNNING})
ENDED = frozenset({State.STOPPED, State.FAILED, State.CRASHED})
ON_IDLE = frozenset({"stop", "pause"})
TTL_ACTIONS = frozenset({"stop", "remove"})


class Action(enum.StrEnum):
    """The event actions of sandbox.v1 (and paused, ours)."""

    CREATED = "created"
    READY = "ready"
    RUNNING = "running"
    IDLE = "idle"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    REMOVED = "removed"
    LOST = "lost"  # a fleet sandbox whose node died (docs/fleet.md): told by every member
    PAUSED = "paused"  # hibernated
    RESUMED = "resumed"
    # sandvisor's: the secret proxy refused a request carrying a secret's placeholder to
    # a host that secret does not allow (attributes: secret, host; never the value)
    SECRET_BLOCKED = "secret_blocked"
    DRAINING = "draining"  # ours: new work refused, the sandbox stops once its work ends


class Ending(enum.StrEnum):
    """How a sandbox's life ended (:class:`Cause`)."""

    EXITED = "exited"  # the guest powered off on its own (a workload's poweroff)
    STOPPED = "stopped"  # asked to: by the user, its TTL, its idle timeout, a drain, a replace
    OUT_OF_MEMORY = "out_of_memory"  # the cgroup's OOM killer took QEMU
    GUEST_PANIC = "guest_panic"  # the guest kernel panicked (its console said so, then it reset)
    QEMU_DIED = "qemu_died"  # QEMU exited or was killed by a signal, not asked to
    HOST_RESTART = "host_restart"  # a supervisor start found its QEMU gone
    GAVE_UP = "gave_up"  # the supervisor gave up on it: a deadline passed (boot, restore)
    BOOT_FAILED = "boot_failed"  # its boot, restore or set-up failed
    ERROR = "error"  # anything else (the guest broke its channel, an internal error)


# who asked a stop (Cause.by of Ending.STOPPED)
STOPPED_BY = frozenset({"user", "ttl", "idle", "drain", "replace", "supervisor"})
CRASHES = frozenset({Ending.OUT_OF_MEMORY, Ending.GUEST_PANIC, Ending.QEMU_DIED})


@attrs.frozen
class Cause:
    """The one description of why a sandbox's life ended: in its record, its stopped,
    failed and removed events, Inspect, WaitUntilStopped and sandbox.v1's ``error``."""

    ending: Ending
    by: str = ""  # STOPPED: who asked (STOPPED_BY); OUT_OF_MEMORY: "cgroup" or "guest"
    exit_code: int | None = None  # the workload's (STOPPED, EXITED), QEMU's (QEMU_DIED)
    signal: int | None = None  # the signal that ended QEMU
    detail: str = ""  # a sentence of the specifics (the limit, QEMU's last stderr lines)

    @property
    def crashed(self) -> bool:
        """The guest died on its own (state crashed, not stopped or failed)."""
        return self.ending in CRASHES

    @property
    def source(self) -> str:
        """Who or what ended it, in one word (the microsandbox SDK's stop source)."""
        if self.ending == Ending.STOPPED:
            return self.by or "user"
        if self.ending == Ending.OUT_OF_MEMORY:
            return "oom"
        return {
            Ending.EXITED: "guest-exit",
            Ending.GUEST_PANIC: "guest-panic",
            Ending.QEMU_DIED: "qemu-died",
            Ending.HOST_RESTART: "host-restart",
            Ending.GAVE_UP: "supervisor-gave-up",
            Ending.BOOT_FAILED: "boot-failed",
        }.get(self.ending, "error")

    def sentence(self) -> str:
        """A sentence for people (the CLI, sandbox.v1's ``error``)."""
        e = self.ending
        if e == Ending.STOPPED:
            text = {
                "ttl": "stopped: its maximum duration (TTL) expired",
                "idle": "stopped: its idle timeout expired",
                "drain": "stopped after a drain",
                "replace": "stopped to be replaced",
                "supervisor": "stopped by the supervisor",
            }.get(self.by, "stopped by the user")
        elif e == Ending.EXITED:
            text = "exited: the guest powered off on its own"
        elif e == Ending.OUT_OF_MEMORY:
            text = "out of memory: " + (
                "the guest's OOM killer" if self.by == "guest" else "QEMU killed by its cgroup's memory limit"
            )
        elif e == Ending.GUEST_PANIC:
            text = "crashed: the guest kernel panicked"
        elif e == Ending.QEMU_DIED:
            how = f"killed by signal {self.signal}" if self.signal else f"exited with status {self.exit_code}"
            text = f"crashed: QEMU {how}"
        elif e == Ending.HOST_RESTART:
            text = "lost at a supervisor restart: its QEMU was gone"
        elif e == Ending.GAVE_UP:
            text = "the supervisor gave up on it: a deadline passed"
        elif e == Ending.BOOT_FAILED:
            text = "its boot failed"
        else:
            text = "failed"
        return f"{text} ({self.detail})" if self.detail else text

    def attributes(self) -> dict[str, str]:
        """The cause as event attributes (``cause``, ``source``, ``by``, ``exit_code``, ``signal``)."""
        out = {"cause": self.ending.value, "source": self.source}
        if self.by:
            out["by"] = self.by
        if self.exit_code is not None:
            out["exit_code"] = str(self.exit_code)
        if self.signal is not None:
            out["signal"] = str(self.signal)
        if self.detail:
            out["detail"] = self.detail
        return out


class NetMode(enum.StrEnum):
    NONE = "none"
    USER = "user"
    TAP = "tap"


class Protocol(enum.StrEnum):
    TCP = "tcp"
    UDP = "udp"


class MemoryKind(enum.StrEnum):
    """How a snapshot holds guest RAM: a file restores map copy-on-write, or in the stream."""

    MAPPED = "mapped"
    STREAMED = "streamed"
    DISK = "disk"  # none: a snapshot of a stopped sandbox, its disk alone (restores boot)


@attrs.frozen
class SandboxEvent:
    sandbox_id: str
    action: Action
    timestamp: int  # unix ns
    attributes: dict[str, str] = attrs.field(factory=dict)
    owner: str = LEGACY_OWNER  # the sandbox's owner: who may see the event (actors/principals.py)
    # the event log's numbering (supervisor/serve/eventlog.py; 0: not logged): a client resumes after it
    cursor: int = 0
    sequence: int = 0  # the sandbox's own count of its events (1, 2, ...; 0: not logged)


@attrs.frozen
class SandboxMetrics:
    """One sample of a sandbox's resource use: the guest's view and QEMU's on the host."""

    id: str
    timestamp: int  # unix ns
    cpu_percent: float
    memory_total_bytes: int
    memory_available_bytes: int
    host_rss_bytes: int
    disk_read_bytes: int
    disk_write_bytes: int
    net_rx_bytes: int
    net_tx_bytes: int
    uptime_seconds: float
    # QEMU's cell (jailed): its cgroup's memory use and limit (0: no cgroup / no limit)
    cgroup_memory_bytes: int = 0
    cgroup_memory_limit_bytes: int = 0
    cgroup_oom_kills: int = 0
    # the root disk: used and free by the guest's statfs of / (its word: clamped, not
    # trusted), and the bytes its writable layer (the qcow2 overlay) takes on the host
    root_used_bytes: int = 0
    root_free_bytes: int = 0
    root_host_allocated_bytes: int = 0
    # memory per branch (docs/fork.md): QEMU's resident pages shared with other processes
    # (a fork's family maps one memory file) and its own private ones, as the host counts
    memory_shared_bytes: int = 0
    memory_own_bytes: int = 0


POOL_PREFIX = "\x00pool:"  # ids of warm pool members: no caller id can hold a control character


def is_hidden(id: str) -> bool:
    """A warm pool member's id: invisible to callers until it is taken."""
    return id.startswith(POOL_PREFIX)


# --- configuration ---------------------------------------------------------------------------
@attrs.frozen
class Limits:
    vcpus: int = 0  # 0: the supervisor's default
    memory_mib: int = 0
    # ceilings (docs/modify.md): QEMU's microvm hotplugs nothing, so a sandbox boots with
    # its ceilings and Modify moves vcpus and memory_mib below them live (CPUs taken
    # offline in the guest, memory through the balloon); 0: the value itself
    max_vcpus: int = 0
    max_memory_mib: int = 0
    disk_mib: int = 0  # the root disk's size (grown, never shrunk); 0: the image's

    @property
    def vcpu_ceiling(self) -> int:
        return max(self.vcpus, self.max_vcpus)

    @property
    def memory_ceiling(self) -> int:
        return max(self.memory_mib, self.max_memory_mib)

    def filled(self, vcpus: int, memory_mib: int) -> Limits:
        """The effective limits: these, with ``vcpus`` and ``memory_mib`` where they say 0
        (a ceiling is at least its value; the disk is as asked)."""
        cpus = self.vcpus or vcpus
        memory = self.memory_mib or memory_mib
        return Limits(
            vcpus=cpus,
            memory_mib=memory,
            max_vcpus=max(cpus, self.max_vcpus),
            max_memory_mib=max(memory, self.max_memory_mib),
            disk_mib=self.disk_mib,
        )


@attrs.frozen
class Applied:
    """What a running sandbox's machine has now (Inspect's read-back; docs/modify.md):
    its ceilings (the machine's vCPUs and RAM), the vCPUs online and the memory the
    balloon leaves the guest, the root disk's size; ``settled``: the guest reached
    them (balloon at its target, CPUs online)."""

    vcpus: int
    memory_mib: int
    max_vcpus: int
    max_memory_mib: int
    disk_mib: int = 0
    balloon: bool = False
    settled: bool = True


@attrs.frozen
class Egress:
    """Where a sandbox may connect to (tap mode, and user mode with outbound): entries
    are CIDRs or addresses, ``host:port`` (ranges ``lo-hi``), or domain names
    (``example.com``, ``*.example.com``, with an optional ``:port``), checked by
    actors/net/egress.py; the most specific entry wins, deny on a tie. Whatever it says,
    the host, link-local/metadata addresses and other sandboxes stay out of reach
    (docs/network.md)."""

    default: str = "allow"  # "allow" | "deny": what no entry matches
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"default": self.default, "allow": list(self.allow), "deny": list(self.deny)}


@attrs.frozen
class Dns:
    """What the guest's /etc/resolv.conf says (docs/network.md, "Per-sandbox DNS"):
    ``nameservers`` (IPv4 addresses; none: the supervisor's DNS proxy's address) and
    ``search`` domains. Every DNS query a sandbox sends, to any address, is answered by
    the supervisor's DNS proxy under the sandbox's egress policy (the filter redirects
    port 53 to it): a listed nameserver is a name for the proxy, never a way around it."""

    nameservers: tuple[str, ...] = ()
    search: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.nameservers or self.search)


@attrs.frozen
class Network:
    mode: NetMode = NetMode.NONE
    outbound: bool = False  # user mode: the guest may open connections out
    egress: Egress | None = None  # None: everything but what no sandbox ever reaches
    # named network profile the egress policy was expanded from at Create ("" : none);
    # the expanded rules are what is kept (actors/net/profiles.py)
    profile: str = ""
    # host address the sandbox's exposed ports listen on ("": serve --expose-address;
    # others only as serve --port-address allows: actors/net/bindaddr.py)
    port_address: str = ""
    dns: Dns = Dns()  # the guest's resolv.conf (nameservers, search domains)

    @property
    def reaches_out(self) -> bool:
        """The guest can open connections beyond the host (tap; user with outbound)."""
        return self.mode == NetMode.TAP or (self.mode == NetMode.USER and self.outbound)


@attrs.frozen
class PortSpec:
    """A sandbox port forwarded from a host port (0: the supervisor picks one)."""

    sandbox_port: int
    host_port: int = 0
    protocol: Protocol = Protocol.TCP
    host_address: str = ""  # where the host port listens ("": the sandbox's, else serve's)

    @property
    def key(self) -> tuple[int, Protocol]:
        return self.sandbox_port, self.protocol

    def label(self) -> str:
        return f"{self.sandbox_port}/{self.protocol}"


@attrs.frozen
class Workload:
    """The initial command, and the defaults of every Run and Exec (a call's own win)."""

    cmd: tuple[str, ...] = ()
    env: dict[str, str] = attrs.field(factory=dict)
    working_dir: str = ""
    user: str = ""


@attrs.frozen
class BootSource:
    """What the VM boots: the default image unless the caller names an OCI image
    (``image``, a reference as skopeo spells it, pulled by ``pull`` policy) or its own files."""

    kernel: str = ""
    rootfs: str = ""
    boot_args: str = ""
    image: str = ""
    pull: str = "if-missing"  # always | if-missing | never
    tls_verify: bool = True
    # the file system type of a caller's own disk (rootfs), told to the guest's /init ("": ext4)
    rootfs_fstype: str = ""

    @property
    def custom(self) -> bool:
        """A boot that depends on the caller's own files: no boot template applies."""
        return bool(self.kernel or self.rootfs or self.boot_args)


@attrs.frozen
class ImageUse:
    """The OCI image a sandbox boots, as resolved when it was created (the reference
    may name another image later): its root filesystem and its defaults."""

    ref: str
    digest: str
    template_key: str  # digest + the converted ext4's identity: what a boot template depends on
    rootfs: str
    env: dict[str, str] = attrs.field(factory=dict)
    working_dir: str = ""
    user: str = ""
    argv: tuple[str, ...] = ()  # Entrypoint + Cmd: the initial workload when the Create gives none
    entrypoint: tuple[str, ...] = ()  # what a Create's own cmd runs under (it replaces Cmd only)


@attrs.frozen
class PullAuth:
    """A registry's credentials and CA certificates for one pull (a Create's): never
    part of a configuration, never stored or printed."""

    creds: str = attrs.field(default="", repr=False)  # USER:PASSWORD
    auth_json: bytes = attrs.field(default=b"", repr=False)  # a docker-style auth file's content
    ca_pem: bytes = attrs.field(default=b"", repr=False)  # CA certificates (PEM)


@attrs.frozen
class Timers:
    ttl_seconds: int = 0  # removed this long after creation (activity does not reset it)
    idle_timeout_seconds: int = 0  # stopped after this long without activity
    ephemeral: bool = False  # removed once it stops
    on_idle: str = "stop"  # what the idle timeout does: "stop" or "pause" (hibernate)
    paused_ttl_seconds: int = 0  # a paused sandbox is removed after this long paused (0: never)
    auto_resume: bool = True  # a call needing the guest (or a connection) resumes a paused sandbox
    # -- lifetime (the microsandbox SDK's) --
    # what the TTL does: "remove" (sandbox.v1's, from creation) or "stop" (drain, then stop:
    # the microsandbox SDK's, from each start; the SDK's and CLI's default)
    ttl_action: str = "remove"
    kill_timeout_seconds: int = 0  # how long Kill waits to see it stopped (0: the default)


PATCH_OPS = patch.OPS
MAX_PATCHES = 1000
MAX_PATCH_BYTES = 4 << 20  # patches live in the sandbox's record: bigger trees go in with cp -r


Patch = patch.Patch  # a change to the sandbox's file system (the one definition: guestd/patch.py)


@attrs.frozen
class VolumeMount:
    """A named volume (:mod:`actors.volumes`) mounted at ``path`` in the guest."""

    name: str
    path: str
    read_only: bool = False


@attrs.frozen
class TmpfsMount:
    """A tmpfs mounted at ``path`` in the guest by guestd before the sandbox is ready
    (``size_mib`` 0: the kernel's default, half the guest's RAM). Its pages are guest
    RAM: the limit bounds what it may take of the sandbox's memory."""

    path: str
    size_mib: int = 0


@attrs.frozen
class HostMount:
    """A host directory (under a ``serve --allow-path`` directory) mounted at ``path`` in
    the guest, served by virtiofsd in a cell of its own (:mod:`actors.hostdirs`);
    read-only unless ``writable``."""

    source: str
    path: str
    writable: bool = False


MAX_HOST_MOUNTS = 8
# characters a host directory's path may not hold: virtiofsd reads it as ``-o source=PATH``,
# an option list (libfuse's fuse_opt) where ',' separates options and '\' escapes
HOST_DIR_OPTION_CHARS = frozenset(",\\")
MAX_TMPFS_MIB = 1 << 20  # a limit, not an allocation: the guest's RAM bounds it anyway


@attrs.frozen
class VolumeRecord:
    """A named volume (:mod:`actors.volumes`): its image is ``<state>/volumes/<uid>.ext4``."""

    name: str
    uid: str
    size_bytes: int
    created_at: int  # unix seconds
    labels: dict[str, str] = attrs.field(factory=dict)
    # how many lives have mounted it read-write: a snapshot records it, and Restore
    # refuses when another sandbox may have written the volume since
    generation: int = 0
    owner: str = LEGACY_OWNER  # the principal that made it (actors/principals.py)


@attrs.frozen
class InitSpec:
    """The init PID 1 is handed to once guestd has set the guest up (guestd/initsys.py):
    ``path`` an absolute path in the guest, or "auto" (Init.Auto: the ENTRYPOINT's first
    element when it is an init, else /sbin/init, /lib/systemd/systemd); its arguments
    and the environment added to what the kernel gives an init."""

    path: str = "auto"
    args: tuple[str, ...] = ()
    env: dict[str, str] = attrs.field(factory=dict)


MAX_INIT_ARGS = 256


def check_init(init: InitSpec) -> None:
    if init.path != "auto" and not init.path.startswith("/"):
        raise InvalidArgument(f"init {init.path!r}: an absolute path in the guest, or 'auto'")
    if len(init.args) > MAX_INIT_ARGS or len(init.env) > MAX_INIT_ARGS:
        raise InvalidArgument(f"init: at most {MAX_INIT_ARGS} arguments and {MAX_INIT_ARGS} variables")
    for text in (init.path, *init.args, *init.env, *init.env.values()):
        if "\0" in text:
            raise InvalidArgument("init: no NUL in its path, arguments or environment")
    if any(not k or "=" in k for k in init.env):
        raise InvalidArgument("init: environment names must be non-empty, without '='")
    size = sum(len(x.encode()) for x in (init.path, *init.args, *init.env, *init.env.values()))
    if size > MAX_WORKLOAD_BYTES:
        raise InvalidArgument(f"init: its path, arguments and environment take {size} bytes; at most 256 KiB")


@attrs.frozen
class SandboxConfig:
    labels: dict[str, str] = attrs.field(factory=dict)
    limits: Limits = Limits()
    network: Network = Network()
    workload: Workload = Workload()
    ports: tuple[PortSpec, ...] = ()
    timers: Timers = Timers()
    boot: BootSource = BootSource()
    hostname: str = ""
    patches: tuple[Patch, ...] = ()
    volumes: tuple[VolumeMount, ...] = ()
    tmpfs: tuple[TmpfsMount, ...] = ()  # mounted by guestd at every boot, before ready
    host_mounts: tuple[HostMount, ...] = ()  # host directories (virtio-fs), fixed at boot
    # named scripts: written to SCRIPTS_DIR/<name> (0755) with the patches; Run{script}
    scripts: dict[str, str] = attrs.field(factory=dict)
    # secrets (actors/secrets): names, hosts, placeholders -- never values (the vault's)
    secrets: tuple[SecretRef, ...] = ()
    # SSH public keys (OpenSSH lines) that serve --ssh accepts for this sandbox (docs/ssh.md)
    ssh_keys: tuple[str, ...] = ()
    # -- workload shape (the microsandbox SDK's; checked by check_shape) --
    # the image ENTRYPOINT for the initial workload (None: the image's; (): none)
    entrypoint: tuple[str, ...] | None = None
    cmd_cleared: bool = False  # the image CMD is dropped (a Create's cmd given empty)
    shell: str = ""  # what the SDK's and CLI's shell() run when the call names none ("": /bin/sh)
    security_profile: str = ""  # "" (default) | "restricted": no_new_privs, nosuid,nodev (guestd/shape.py)
    log_level: str = ""  # guestd's and the supervisor's lines of this sandbox (actors/sandlog.py)
    quiet_logs: bool = False  # none of them (as log_level "off")
    thp: str = ""  # the guest's transparent huge page policy: always | madvise | never ("": the kernel's)
    # the init PID 1 is handed to after guestd's set-up (None: guestd stays PID 1)
    init: InitSpec | None = None

    def restored(self, labels: dict[str, str], ttl_seconds: int) -> SandboxConfig:
        """The configuration of a sandbox restored from a snapshot of this one: its own
        labels and TTL, no initial command, and its own host ports."""
        return attrs.evolve(
            self,
            labels=dict(labels),
            workload=attrs.evolve(self.workload, cmd=()),
            timers=Timers(ttl_seconds=ttl_seconds),
            ports=tuple(attrs.evolve(p, host_port=0) for p in self.ports),
            secrets=with_placeholders(self.secrets),  # fresh placeholders (the generated ones)
            ssh_keys=(),  # a key opens the sandboxes it was given to, not their restored copies
        )


# --- rules -----------------------------------------------------------------------------------
def default_hostname(id: str) -> str:
    """A sandbox's hostname when its config names none: its id as a hostname (runs of
    anything but ASCII letters, digits and '-' as one '-', at most 63 characters), or
    "sandbox" when nothing of the id is left."""
    name = re.sub(r"[^A-Za-z0-9-]+", "-", id).strip("-")[:63].strip("-")
    return name or "sandbox"


MAX_ID_BYTES = 128
RESERVED_LABEL_PREFIXES = ("sandbox.", "sandvisor.")
MAX_WORKLOAD_BYTES = 256 * 1024  # well inside the guest channel's frame cap


def check_id(id: str) -> None:
    if len(id.encode()) > MAX_ID_BYTES:
        raise InvalidArgument(f"id is {len(id.encode())} bytes; at most {MAX_ID_BYTES} UTF-8 bytes")
    if any(ord(c) < 32 or ord(c) == 127 for c in id):
        raise InvalidArgument("id must not contain control characters")
    if id.strip() != id:
        raise InvalidArgument("id must not start or end with whitespace")


def check_labels(labels: dict[str, str]) -> None:
    for k, v in labels.items():
        if not k:
            raise InvalidArgument("label keys must not be empty")
        if len(k.encode()) > 256 or len(v.encode()) > 4096:
            raise InvalidArgument(f"label {k[:40]!r} is too long")
        if k.startswith(RESERVED_LABEL_PREFIXES):
            raise InvalidArgument(f"label {k!r}: the prefixes sandbox. and sandvisor. are reserved")


def check_port(sandbox_port: int, host_port: int = 0) -> None:
    if not 0 < sandbox_port <= 65535 or not 0 <= host_port <= 65535:
        raise InvalidArgument("ports must be 1-65535 (host_port 0 allocates one)")


def check_name(name: str) -> None:
    if len(name.encode()) > 256 or any(ord(c) < 32 for c in name):
        raise InvalidArgument("name must be at most 256 bytes without control characters")


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
MAX_NAMESERVERS = 3  # what a resolver reads of resolv.conf (glibc's MAXNS)
MAX_SEARCH = 6


def check_bind_address(address: str) -> None:
    """A host address exposed ports may listen on: a dotted-quad IPv4 address (whether
    this supervisor lets a sandbox use it is actors/net/bindaddr.py's)."""
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        raise InvalidArgument(f"bind address {address!r}: an IPv4 address such as 127.0.0.1") from None


def check_dns(net: Network) -> None:
    """The guest's resolv.conf settings: IPv4 nameservers, domain names to search."""
    dns = net.dns
    if not dns:
        return
    if not net.reaches_out:
        raise FailedPrecondition(
            "DNS settings need network mode 'tap', or 'user' with outbound: this sandbox resolves nothing"
        )
    if len(dns.nameservers) > MAX_NAMESERVERS:
        raise InvalidArgument(f"at most {MAX_NAMESERVERS} nameservers (a resolver reads no more)")
    for ns in dns.nameservers:
        try:
            ipaddress.IPv4Address(ns)
        except ValueError:
            raise InvalidArgument(f"nameserver {ns!r}: an IPv4 address") from None
    if len(dns.search) > MAX_SEARCH:
        raise InvalidArgument(f"at most {MAX_SEARCH} search domains")
    for d in dns.search:
        name = d.removesuffix(".")
        if not name or len(name) > 253 or not all(_DNS_LABEL.fullmatch(x) for x in name.split(".")):
            raise InvalidArgument(f"search domain {d!r}: a domain name (letters, digits, '-', '_', dots)")


def check_network(net: Network) -> None:
    """The network's rules that need no supervisor: an egress policy that parses, and only
    where the guest reaches out at all."""
    if net.mode == NetMode.TAP and net.outbound:
        raise InvalidArgument("outbound is a user-mode option: tap sandboxes reach out as their egress policy says")
    check_dns(net)
    if net.port_address:
        check_bind_address(net.port_address)
    if net.egress is None:
        return
    if not net.reaches_out:
        raise FailedPrecondition(
            "an egress policy needs network mode 'tap', or 'user' with outbound: this sandbox reaches nothing"
        )
    try:
        EgressPolicy.parse(net.egress.to_dict())
    except PolicyError as exc:
        raise InvalidArgument(str(exc)) from None


def max_vcpus() -> int:
    return max(1, os.cpu_count() or 1) * 4


def check_config(cfg: SandboxConfig) -> None:
    """The rules of a configuration that need no I/O (files are checked by the registry)."""
    check_labels(cfg.labels)
    if cfg.boot.image and (cfg.boot.rootfs or cfg.boot.kernel):
        raise InvalidArgument("image and rootfs/kernel exclude each other: the image is the root filesystem")
    if cfg.boot.pull not in ("always", "if-missing", "never"):
        raise InvalidArgument(f"image pull policy {cfg.boot.pull!r}: always, if-missing or never")
    check_network(cfg.network)
    if cfg.ports and cfg.network.mode == NetMode.NONE:
        raise FailedPrecondition("ports need network mode 'tap' or 'user'")
    seen: set[tuple[int, Protocol]] = set()
    for pm in cfg.ports:
        check_port(pm.sandbox_port, pm.host_port)
        if pm.host_address:
            check_bind_address(pm.host_address)
        if pm.protocol == Protocol.UDP and cfg.network.mode == NetMode.USER and not cfg.network.outbound:
            raise FailedPrecondition(
                "QEMU's restricted user networking drops the guest's UDP replies: a UDP port needs network "
                "mode 'tap', or 'user' with outbound"
            )
        if pm.key in seen:
            raise AlreadyExists(f"port {pm.label()} is given twice")
        seen.add(pm.key)
    if not 0 <= cfg.limits.vcpus <= max_vcpus():
        raise InvalidArgument(f"vcpus must be 0 (default) to {max_vcpus()}")
    if cfg.limits.memory_mib and not 64 <= cfg.limits.memory_mib <= 65536:
        raise InvalidArgument("memory_mib must be 0 (default) or 64 to 65536")
    check_ceilings(cfg.limits)
    if cfg.timers.ttl_seconds < 0 or cfg.timers.idle_timeout_seconds < 0:
        raise InvalidArgument("ttl_seconds and idle_timeout_seconds must not be negative")
    if cfg.timers.on_idle not in ON_IDLE:
        raise InvalidArgument(f"on_idle must be one of {', '.join(sorted(ON_IDLE))}, not {cfg.timers.on_idle!r}")
    if cfg.timers.paused_ttl_seconds < 0:
        raise InvalidArgument("paused_ttl_seconds must not be negative")
    if cfg.timers.ttl_action not in TTL_ACTIONS:
        raise InvalidArgument(f"ttl_action {cfg.timers.ttl_action!r}: stop or remove")
    if cfg.timers.kill_timeout_seconds < 0:
        raise InvalidArgument("kill_timeout_seconds must not be negative")
    if cfg.hostname and (len(cfg.hostname) > 63 or not cfg.hostname.replace("-", "").isalnum()):
        raise InvalidArgument("hostname must be 1-63 letters, digits or '-'")
    w = cfg.workload
    if w.cmd and not w.cmd[0]:
        raise InvalidArgument("cmd[0] must not be empty")
    size = sum(len(x.encode()) for x in (*w.cmd, *w.env, *w.env.values(), w.working_dir, w.user))
    if size > MAX_WORKLOAD_BYTES:
        raise InvalidArgument(f"cmd, env, working_dir and user take {size} bytes; at most 256 KiB")
    if len(cfg.boot.boot_args) > 1024 or "\n" in cfg.boot.boot_args:
        raise InvalidArgument("boot_args must be one line of at most 1024 bytes")
    check_patches(cfg.patches)
    check_volume_mounts(cfg.volumes)
    check_tmpfs_mounts(cfg.tmpfs, cfg.volumes)
    check_host_mounts(cfg)
    check_scripts(cfg.scripts)
    check_secrets(cfg.secrets)
    check_shape(cfg)
    if cfg.secrets and not cfg.network.reaches_out:
        raise FailedPrecondition(
            "secrets need network mode 'tap', or 'user' with outbound: this sandbox reaches nothing"
        )
    size = sum(len(p.data) for p in cfg.patches) + sum(len(b.encode()) for b in cfg.scripts.values())
    if size > MAX_PATCH_BYTES:
        raise InvalidArgument(f"patches and scripts carry {size} bytes; at most {MAX_PATCH_BYTES}")
    if cfg.init is not None:
        check_init(cfg.init)


MAX_DISK_MIB = 1 << 20  # 1 TiB: a root disk's size (serve --max-sandbox-disk caps it lower)


def check_ceilings(limits: Limits) -> None:
    """The ceilings and the disk size: in range, and not below the values they bound."""
    if not 0 <= limits.max_vcpus <= max_vcpus():
        raise InvalidArgument(f"max_vcpus must be 0 (the vcpus) to {max_vcpus()}")
    if limits.max_vcpus and limits.vcpus > limits.max_vcpus:
        raise InvalidArgument(f"vcpus {limits.vcpus} is above max_vcpus {limits.max_vcpus}")
    if limits.max_memory_mib and not 64 <= limits.max_memory_mib <= 65536:
        raise InvalidArgument("max_memory_mib must be 0 (the memory) or 64 to 65536")
    if limits.max_memory_mib and limits.memory_mib > limits.max_memory_mib:
        raise InvalidArgument(f"memory_mib {limits.memory_mib} is above max_memory_mib {limits.max_memory_mib}")
    if not 0 <= limits.disk_mib <= MAX_DISK_MIB:
        raise InvalidArgument(f"disk size must be 0 (the image's) to {MAX_DISK_MIB} MiB")


SCRIPTS_DIR = "/.sandvisor/scripts"
SCRIPT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def check_scripts(scripts: dict[str, str]) -> None:
    if len(scripts) > 100:
        raise InvalidArgument(f"{len(scripts)} scripts; at most 100")
    for name, body in scripts.items():
        if not SCRIPT_NAME.fullmatch(name):
            raise InvalidArgument(f"script name {name[:80]!r}: 1-64 of [A-Za-z0-9_.-], not starting with . or -")
        if not body.strip():
            raise InvalidArgument(f"script {name!r} is empty")


def script_patches(scripts: dict[str, str]) -> tuple[Patch, ...]:
    """The named scripts as files (a body without ``#!`` runs with /bin/sh)."""
    if not scripts:
        return ()
    out = [Patch("mkdir", SCRIPTS_DIR, mode=0o755)]
    for name, body in sorted(scripts.items()):
        text = body if body.startswith("#!") else "#!/bin/sh\n" + body
        out.append(Patch("file", f"{SCRIPTS_DIR}/{name}", text.encode(), mode=0o755, replace=True))
    return tuple(out)


def script_argv(scripts: dict[str, str], name: str, args: list[str]) -> list[str]:
    """What Run{script: name, cmd: args} runs (NOT_FOUND for a name the config lacks)."""
    if name not in scripts:
        known = ", ".join(sorted(scripts)) or "none"
        raise NotFound(f"no script {name!r} (this sandbox's: {known})")
    return [f"{SCRIPTS_DIR}/{name}", *args]


def check_guest_path(path: str, what: str) -> None:
    if not path.startswith("/") or "\0" in path or len(path.encode()) > 4096:
        raise InvalidArgument(f"{what} {path[:80]!r}: an absolute path without NUL, at most 4096 bytes")


def check_patches(patches: tuple[Patch, ...]) -> None:
    if len(patches) > MAX_PATCHES:
        raise InvalidArgument(f"{len(patches)} patches; at most {MAX_PATCHES}")
    size = 0
    for i, p in enumerate(patches):
        if p.op not in PATCH_OPS and p.op not in patch.HOST_OPS:
            ops = ", ".join((*PATCH_OPS, *patch.HOST_OPS))
            raise InvalidArgument(f"patch {i}: op {p.op!r} is not one of {ops}")
        if (p.op in patch.HOST_OPS) != bool(p.source):
            raise InvalidArgument(f"patch {i}: a host source is for copy_file and copy_dir, and they need one")
        if p.source:
            src = p.source
            if not src.startswith("/") or "\0" in src or ".." in src.split("/") or len(src.encode()) > 4096:
                raise InvalidArgument(f"patch {i}: host source {src[:80]!r}: an absolute path without '..' or NUL")
        check_guest_path(p.path, f"patch {i}: path")
        if p.mode is not None and not 0 <= p.mode <= 0o7777:
            raise InvalidArgument(f"patch {i}: mode must be 0 to 0o7777")
        if p.op == "symlink" and not p.target:
            raise InvalidArgument(f"patch {i}: a symlink needs a target")
        size += len(p.data) + len(p.path) + len(p.target) + len(p.owner)
    if size > MAX_PATCH_BYTES:
        raise InvalidArgument(f"patches carry {size} bytes; at most {MAX_PATCH_BYTES} (copy bigger trees with cp -r)")


def check_volume_mounts(mounts: tuple[VolumeMount, ...]) -> None:
    seen: set[str] = set()
    for m in mounts:
        check_guest_path(m.path, f"volume {m.name!r}: path")
        if m.path.rstrip("/") in ("", "/proc", "/sys", "/dev"):
            raise InvalidArgument(f"volume {m.name!r}: cannot be mounted at {m.path}")
        if m.name in seen:
            raise InvalidArgument(f"volume {m.name!r} is given twice")
        seen.add(m.name)
    if len({m.path.rstrip("/") for m in mounts}) != len(mounts):
        raise InvalidArgument("two volumes at one path")


def check_tmpfs_mounts(mounts: tuple[TmpfsMount, ...], volumes: tuple[VolumeMount, ...] = ()) -> None:
    if len(mounts) > 16:
        raise InvalidArgument(f"{len(mounts)} tmpfs mounts; at most 16")
    for m in mounts:
        check_guest_path(m.path, "tmpfs: path")
        if m.path.rstrip("/") in ("", "/proc", "/sys", "/dev"):
            raise InvalidArgument(f"tmpfs: cannot be mounted at {m.path}")
        if not 0 <= m.size_mib <= MAX_TMPFS_MIB:
            raise InvalidArgument(f"tmpfs {m.path}: size_mib must be 0 (the kernel's default) to {MAX_TMPFS_MIB}")
    paths = [m.path.rstrip("/") for m in mounts] + [v.path.rstrip("/") for v in volumes]
    if len(set(paths)) != len(paths):
        raise InvalidArgument("two mounts (tmpfs or volumes) at one path")


def check_host_mounts(cfg: SandboxConfig) -> None:
    """The rules of host directory mounts that need no I/O (the directories themselves:
    actors.hostdirs.check_host_dir)."""
    mounts = cfg.host_mounts
    if len(mounts) > MAX_HOST_MOUNTS:
        raise InvalidArgument(f"{len(mounts)} host directories; at most {MAX_HOST_MOUNTS}")
    for m in mounts:
        src = m.source
        if not src.startswith("/") or "\0" in src or ".." in src.split("/") or len(src.encode()) > 4096:
            raise InvalidArgument(f"host directory {src[:80]!r}: an absolute path without '..' or NUL")
        if any(c in HOST_DIR_OPTION_CHARS for c in src):
            raise InvalidArgument(
                f"host directory {src[:80]!r}: its server takes the path in an option list, "
                "where ',' and '\\' are syntax: rename the directory (or mount a parent)"
            )
        check_guest_path(m.path, f"host directory {src[:80]!r}: path")
        if m.path.rstrip("/") in ("", "/proc", "/sys", "/dev"):
            raise InvalidArgument(f"host directory {src[:80]!r}: cannot be mounted at {m.path}")
    paths = [m.path.rstrip("/") for m in mounts] + [t.path.rstrip("/") for t in cfg.tmpfs]
    paths += [v.path.rstrip("/") for v in cfg.volumes]
    if len(set(paths)) != len(paths):
        raise InvalidArgument("two mounts (tmpfs, volumes or host directories) at one path")


SECURITY_PROFILES = ("", "default", "restricted")
LOG_LEVELS = ("", "trace", "debug", "info", "warn", "error", "off")
THP_POLICIES = ("", "always", "madvise", "never")


def check_shape(cfg: SandboxConfig) -> None:
    """The workload shape's values: an entrypoint whose program is named, a shell path,
    profiles, levels and policies by name, and the host sources of copy patches."""
    if cfg.entrypoint and not cfg.entrypoint[0]:
        raise InvalidArgument("entrypoint[0] must not be empty")
    if cfg.entrypoint and sum(len(a.encode()) for a in cfg.entrypoint) > MAX_WORKLOAD_BYTES:
        raise InvalidArgument("entrypoint: at most 256 KiB")
    if cfg.cmd_cleared and cfg.workload.cmd:
        raise InvalidArgument("cmd_cleared and a cmd exclude each other")
    if cfg.shell and ("\0" in cfg.shell or len(cfg.shell.encode()) > 4096 or not cfg.shell.strip()):
        raise InvalidArgument("shell: a program path (or name on PATH) without NUL, at most 4096 bytes")
    if cfg.security_profile not in SECURITY_PROFILES:
        raise InvalidArgument(f"security_profile {cfg.security_profile!r}: default or restricted")
    if cfg.log_level not in LOG_LEVELS:
        raise InvalidArgument(f"log_level {cfg.log_level!r}: one of {', '.join(LOG_LEVELS[1:])}")
    if cfg.thp not in THP_POLICIES:
        raise InvalidArgument(f"thp {cfg.thp!r}: always, madvise or never")


# --- the converter (the store's; msgpack) ------------------------------------------------------
converter = make_converter(forbid_extra_keys=False)
converter.register_unstructure_hook(Path, str)
converter.register_structure_hook(Path, lambda v, _: Path(v))


def dump(obj: Any) -> Any:
    return converter.unstructure(obj)


T = TypeVar("T")


def load(data: Any, cls: type[T]) -> T:
    return converter.structure(data, cls)
