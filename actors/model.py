"""The domain's values: states, events and a sandbox's configuration.

Everything past the edge is one of these frozen attrs values, never a wire dict. An
edge builds a :class:`SandboxConfig` once from its request; the registry checks it
(actors.rules.check_config) and keeps it as requested, so an idempotent Create compares
what was asked, not what the sandbox became (its live port mappings are in the
record, not here). :data:`converter` is the one cattrs converter the store uses.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, TypeVar

import attrs
from cattrs.preconf.msgpack import make_converter

from actors.errors import InvalidArgument
from actors.principals import LEGACY_OWNER
from actors.secrets.model import SecretRef, with_placeholders
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
    # sandvisor's: the guest kernel's OOM killer killed a process (the sandbox lives on;
    # attributes: pid, process, by, constraint, cgroup, sizes: actors/sandboxes/oomkills.py)
    OOM_KILL = "oom_kill"
    # sandvisor's: QEMU could not carry out a guest's disk request (a full host disk, a
    # failing one); the guest got an I/O error (attributes: disk, operation, nospace,
    # reason, count: actors/sandboxes/diskerrors.py)
    DISK_ERROR = "disk_error"


class Ending(enum.StrEnum):
    """How a sandbox's life ended (:class:`Cause`)."""

    EXITED = "exited"  # the guest powered off on its own (a workload's poweroff)
    STOPPED = "stopped"  # asked to: by the user, its TTL, its idle timeout, a drain, a replace
    # the cgroup's OOM killer took QEMU (by "cgroup"), or the guest's took what its init ran (by "guest")
    OUT_OF_MEMORY = "out_of_memory"
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
    # the guest kernel's own OOM kills since it booted (its /proc/vmstat: the guest's word)
    guest_oom_kills: int = 0


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
MAX_WORKLOAD_BYTES = 256 * 1024  # well inside the guest channel's frame cap


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
    # named scripts: written to actors.rules.SCRIPTS_DIR/<name> (0755) with the patches; Run{script}
    scripts: dict[str, str] = attrs.field(factory=dict)
    # secrets (actors/secrets): names, hosts, placeholders -- never values (the vault's)
    secrets: tuple[SecretRef, ...] = ()
    # SSH public keys (OpenSSH lines) that serve --ssh accepts for this sandbox (docs/ssh.md)
    ssh_keys: tuple[str, ...] = ()
    # -- workload shape (the microsandbox SDK's; checked by actors.rules.check_shape) --
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


# --- the converter (the store's; msgpack) ------------------------------------------------------
converter = make_converter(forbid_extra_keys=False)
converter.register_unstructure_hook(Path, str)
converter.register_structure_hook(Path, lambda v, _: Path(v))


def dump(obj: Any) -> Any:
    return converter.unstructure(obj)


T = TypeVar("T")


def load(data: Any, cls: type[T]) -> T:
    return converter.structure(data, cls)
