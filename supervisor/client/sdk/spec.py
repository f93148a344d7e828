"""What a sandbox is made of (the spec), and the SDK's own result types.

No I/O and no event loop: frozen attrs classes that build the wire's typed requests
(:meth:`SandboxSpec.request`), shared by the Trio SDK (:mod:`supervisor.client.sdk.aio`) and
the blocking one (:mod:`supervisor.client.sdk.sync`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict, TypeVar, Unpack

import attrs

from guestd.patch import Patch
from supervisor.client.sdk.network import (
    Dns,
    Egress,
    Network,
    PortBinding,
    PortKey,
    _bindings,
    _dns_spec,
    _ports,
    _strs,
)
from supervisor.wire import protocol
from supervisor.wire.errors import InvalidArgument
from supervisor.wire.protocol import CheckpointResponse, SandboxSummary, SnapshotSummary


def _kv(d: Mapping[str, str] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (d or {}).items()}


def _argv(cmd: Sequence[str] | None) -> tuple[str, ...]:
    if isinstance(cmd, str):
        raise TypeError("cmd is a sequence of arguments (a string would be split into characters)")
    return tuple(cmd or ())


@attrs.frozen(kw_only=True)
class Resources:
    """vCPUs and guest RAM; 0 takes the supervisor's default. ``max_cpus`` and
    ``max_memory_mib``: the ceilings ``modify`` moves them below, live (0: the values);
    ``disk_size_mib``: the root disk's size (0: the image's; docs/modify.md)."""

    cpus: int = 0
    memory_mib: int = 0
    max_cpus: int = 0
    max_memory_mib: int = 0
    disk_size_mib: int = 0


@attrs.frozen(kw_only=True)
class Workload:
    """The sandbox's initial command (none: it waits for runs), and the environment,
    working directory and user that its runs and execs inherit."""

    cmd: tuple[str, ...] = attrs.field(default=(), converter=_argv)
    env: dict[str, str] = attrs.field(factory=dict, converter=_kv)
    workdir: str = ""
    user: str = ""


@attrs.frozen(kw_only=True)
class Lifetime:
    """``ttl``: the sandbox's maximum duration in seconds: then it drains (no new work;
    work in flight gets the stop grace) and stops (``ttl_action="remove"``: removed
    that long after creation, sandbox.v1's TTL); ``idle_timeout``: seconds without
    activity until it stops; ``ephemeral``: removed once it stops. 0/False: never.
    Hibernation: ``on_idle="pause"`` pauses it at the idle timeout instead
    (no QEMU, no RAM; it resumes as itself); ``paused_ttl``: seconds a paused sandbox is
    kept (0: until its ``ttl``); ``auto_resume``: a call that needs the guest, or a
    connection to an exposed port, resumes it (False: FailedPrecondition instead)."""

    ttl: int = 0
    idle_timeout: int = 0
    ephemeral: bool = False
    on_idle: Literal["stop", "pause"] = "stop"
    paused_ttl: int = 0
    auto_resume: bool = True
    ttl_action: Literal["stop", "remove"] = "stop"
    kill_timeout: int = 0  # seconds kill() waits to see it stopped (0: the supervisor's default)


@attrs.frozen(kw_only=True)
class RegistryAuth:
    """An image registry's credentials and CA certificates, for a Create's pull only:
    the supervisor never stores or logs them, and nothing here prints them (repr).
    ``creds``: "USER:PASSWORD", or ``auth_json``: a docker-style auth file's content;
    ``ca_pem``: CA certificates (PEM) for a registry the host's trust store does not
    vouch for. :meth:`from_files` reads them from files (the CLI's way: never argv)."""

    creds: str = attrs.field(default="", repr=False)
    auth_json: bytes = attrs.field(default=b"", repr=False)
    ca_pem: bytes = attrs.field(default=b"", repr=False)

    @classmethod
    def from_files(
        cls,
        *,
        creds_file: str | os.PathLike[str] | None = None,
        authfile: str | os.PathLike[str] | None = None,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> RegistryAuth:
        """``creds_file``: USER:PASSWORD on its first line; ``authfile``: a docker-style
        auth file; ``ca_file``: PEM. Read here, by the caller's rights."""
        creds = Path(creds_file).read_text().splitlines()[0].strip() if creds_file is not None else ""
        auth_json = Path(authfile).read_bytes() if authfile is not None else b""
        ca_pem = Path(ca_file).read_bytes() if ca_file is not None else b""
        return cls(creds=creds, auth_json=auth_json, ca_pem=ca_pem)


@attrs.frozen(kw_only=True)
class Boot:
    """What boots: empty fields take the supervisor's default image. ``image``: an OCI
    image reference: a plain name as docker reads it (``alpine``, ``python:3.12``,
    ``ghcr.io/org/x:1``) or as skopeo spells it (``docker://HOST/NAME:TAG``, ``oci:DIR``,
    ...), pulled by ``pull`` policy ("always", "if-missing" (""), "never");
    ``tls_verify=False`` for a plain-HTTP registry; ``registry``: its credentials and
    CA (:class:`RegistryAuth`; or pull first with :class:`Images`)."""

    image: str = ""
    pull: Literal["", "always", "if-missing", "never"] = ""
    tls_verify: bool | None = None
    kernel: str = ""
    rootfs: str = ""
    boot_args: str = ""
    registry: RegistryAuth | None = attrs.field(default=None, repr=False)
    rootfs_fstype: str = ""  # rootfs's file system type ("": ext4)


@attrs.frozen
class VolumeMount:
    """Named volume ``name`` mounted at ``path``; ``VolumeMount.parse("NAME:/path[:ro]")``."""

    name: str
    path: str
    read_only: bool = False

    @classmethod
    def parse(cls, text: str) -> VolumeMount:
        name, sep, rest = text.partition(":")
        path, _, flag = rest.partition(":")
        if not sep or not name or not path.startswith("/") or flag not in ("", "ro", "rw"):
            raise InvalidArgument(protocol.INVALID_ARGUMENT, f"volume {text!r}: NAME:/path[:ro]")
        return cls(name, path, flag == "ro")


@attrs.frozen
class Tmpfs:
    """A tmpfs at ``path`` of at most ``size_mib`` (0: the guest kernel's default, half
    its RAM); ``Tmpfs.parse("/path[:SIZE]")``, SIZE as ``64M``, ``1G`` or MiB."""

    path: str
    size_mib: int = 0

    @classmethod
    def parse(cls, text: str) -> Tmpfs:
        path, sep, size = text.partition(":")
        if not path.startswith("/") or (sep and not size):
            raise InvalidArgument(protocol.INVALID_ARGUMENT, f"tmpfs {text!r}: /path[:SIZE]")
        if not size:
            return cls(path)
        mib = int(size) if size.isdigit() else -(-parse_size(size) // (1 << 20))
        return cls(path, mib)


@attrs.frozen
class HostDir:
    """A host directory ``source`` (inside a ``serve --allow-path`` directory) mounted
    at ``path``, read-only unless ``writable``; ``HostDir.parse("HOST_DIR:/path[:ro|rw]")``."""

    source: str
    path: str
    writable: bool = False

    @classmethod
    def parse(cls, text: str) -> HostDir:
        source, sep, rest = text.partition(":")
        path, _, flag = rest.partition(":")
        if not sep or not source.startswith("/") or not path.startswith("/") or flag not in ("", "ro", "rw"):
            raise InvalidArgument(protocol.INVALID_ARGUMENT, f"mount {text!r}: HOST_DIR:/path[:ro|rw]")
        return cls(source, path, flag == "rw")


M = TypeVar("M", VolumeMount, Tmpfs, HostDir)


def _guest_path(path: str) -> str:
    return path.rstrip("/") or "/"


def by_path(mounts: Sequence[M]) -> tuple[M, ...]:
    """Mounts keyed by guest path: a later entry for a path replaces an earlier one
    (as the reference's WithMounts map does), in the order the paths were last given."""
    out: dict[str, M] = {}
    for m in mounts:
        out.pop(_guest_path(m.path), None)
        out[_guest_path(m.path)] = m
    return tuple(out.values())


@attrs.frozen
class Init:
    """The init PID 1 is handed to once the guest agent has set the guest up (systemd,
    tini, s6, ...): the agent goes on as its child, and a stop goes through the init's
    own shutdown. ``Init.auto()``: the image ENTRYPOINT's first element when it is an
    init (it then runs the workload: ``tini -- app``), else ``/sbin/init``,
    ``/lib/systemd/systemd``; ``Init.cmd(path, args=, env=)``: that init, ``args``
    after argv[0], ``env`` added to the environment the kernel gives an init."""

    path: str = "auto"
    args: tuple[str, ...] = attrs.field(default=(), converter=_argv)
    env: dict[str, str] = attrs.field(factory=dict, converter=_kv)

    @classmethod
    def auto(cls) -> Init:
        return cls()

    @classmethod
    def cmd(cls, path: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Init:
        if not path.startswith("/"):
            raise InvalidArgument(protocol.INVALID_ARGUMENT, f"init {path!r}: an absolute path in the guest")
        return cls(path, _argv(args), _kv(env))

    @classmethod
    def parse(cls, text: str) -> Init:
        """``auto`` or an absolute path (the CLI's ``--init``)."""
        return cls.auto() if text == "auto" else cls.cmd(text)

    def spec(self) -> protocol.InitSpec:
        return protocol.InitSpec(self.path, list(self.args), dict(self.env))


def _init(v: Init | str | Mapping[str, Any] | None) -> Init | None:
    """An Init, ``"auto"`` or a path, or one as a read-back configuration spells it
    (``{"path", "args", "env"}``)."""
    if v is None or isinstance(v, Init):
        return v
    if isinstance(v, str):
        return Init.parse(v)
    path = str(v.get("path", "auto"))
    return Init.auto() if path == "auto" else Init.cmd(path, v.get("args", ()), v.get("env"))


def _host_dirs(v: Sequence[HostDir | str] | None) -> tuple[HostDir, ...]:
    return by_path([m if isinstance(m, HostDir) else HostDir.parse(m) for m in v or ()])


def _tmpfs(v: Sequence[Tmpfs | str] | None) -> tuple[Tmpfs, ...]:
    return by_path([m if isinstance(m, Tmpfs) else Tmpfs.parse(m) for m in v or ()])


def _hosts(v: Sequence[str] | str) -> tuple[str, ...]:
    return tuple(h.strip() for h in v.split(",")) if isinstance(v, str) else tuple(v)


def secret_value(name: str, value: str | bytes, env: str) -> bytes:
    """A secret's bytes: its ``value``, or the ``env`` variable of this process, read now."""
    if env:
        if env not in os.environ:
            raise InvalidArgument(protocol.INVALID_ARGUMENT, f"secret {name}: ${env} is not set here")
        value = os.environ[env]
    return value.encode() if isinstance(value, str) else bytes(value)


@attrs.frozen(kw_only=True)
class Secret:
    """A secret the guest never holds (docs/secrets.md): its environment variable
    ``name`` holds a placeholder; the supervisor's proxy replaces the placeholder with
    the value in HTTPS requests to ``hosts`` (``api.example.com``, ``*.example.com``,
    optionally ``:port``) and refuses it anywhere else. Exactly one source: ``value``,
    ``env`` (a variable of *this* process's environment, read when the request is made)
    or ``store`` (an entry of the supervisor's store: :class:`Secrets`; its hosts
    must be within the entry's). ``substitute``: where the placeholder is replaced,
    ``"headers"`` (the default: the request's headers only) or ``"all"`` (its URL and
    body too: only for a host that hands nothing it is sent back to others).
    ``Secret.parse("API_KEY=env:API_KEY@api.example.com,other.example.com;substitute=all")``."""

    name: str
    hosts: tuple[str, ...] = attrs.field(converter=_hosts)
    value: str | bytes = attrs.field(default="", repr=False)
    env: str = ""
    store: str = ""
    placeholder: str = ""  # "": the supervisor makes one (name + 128 random bits)
    substitute: Literal["headers", "all"] = "headers"

    @classmethod
    def parse(cls, text: str) -> Secret:
        """``NAME=SOURCE@HOST[,HOST...][;substitute=headers|all][;placeholder=P]``, SOURCE
        ``env:VAR``, ``value:LITERAL`` or ``store:NAME``."""
        usage = "a secret is NAME=env:VAR@HOST[,HOST...][;substitute=all] (or value:LITERAL, store:NAME)"
        name, eq, rest = text.partition("=")
        source, at, tail = rest.rpartition("@")
        hosts, _, options = tail.partition(";")
        kind, colon, arg = source.partition(":")
        if not eq or not at or not colon or not name or not hosts or kind not in ("env", "value", "store"):
            raise InvalidArgument(protocol.INVALID_ARGUMENT, usage)
        substitute, placeholder = "headers", ""
        for option in filter(None, options.split(";")):
            key, _, val = option.partition("=")
            if key.strip() == "placeholder" and val.strip():
                placeholder = val.strip()
                continue
            if key.strip() != "substitute" or val.strip() not in ("headers", "all"):
                raise InvalidArgument(protocol.INVALID_ARGUMENT, f"{usage}: not {option[:40]!r}")
            substitute = val.strip()
        return cls(name=name, hosts=hosts, substitute=substitute, placeholder=placeholder, **{kind: arg})  # type: ignore[arg-type]

    def spec(self) -> protocol.SecretSpec:
        """The wire's form: an ``env`` source read now, from this process's environment."""
        sources = [bool(self.value), bool(self.env), bool(self.store)]
        if sum(sources) != 1:
            raise InvalidArgument(protocol.INVALID_ARGUMENT, f"secret {self.name}: exactly one of value, env and store")
        raw = secret_value(self.name, self.value, self.env)
        return protocol.SecretSpec(self.name, list(self.hosts), raw, self.store, self.placeholder, self.substitute)


def _secrets(v: Sequence[Secret | str] | None) -> tuple[Secret, ...]:
    return tuple(s if isinstance(s, Secret) else Secret.parse(s) for s in v or ())


def _entrypoint(v: Sequence[str] | None) -> tuple[str, ...] | None:
    return None if v is None else _argv(v)


LogLevel = Literal["", "trace", "debug", "info", "warn", "error", "off"]


@attrs.frozen(kw_only=True)
class Shape:
    """How the sandbox's workload is shaped. ``entrypoint``: replaces the image's
    ENTRYPOINT for the initial workload (and drops its CMD, as ``docker run
    --entrypoint``); None: the image's, []: none. ``cmd_cleared``: the image's CMD is
    dropped (``cmd=[]`` given sets it). ``shell``: what :meth:`shell` runs when the call
    names none ("": /bin/sh). ``security_profile`` "restricted": every exec with
    no_new_privs (setuid bits give nothing), the writable mounts nosuid,nodev.
    ``log_level``/``quiet_logs``: the guest agent's diagnostics and the supervisor's
    lines about this sandbox. ``thp``: the guest's transparent huge page policy."""

    entrypoint: tuple[str, ...] | None = attrs.field(default=None, converter=_entrypoint)
    cmd_cleared: bool = False
    shell: str = ""
    security_profile: Literal["", "default", "restricted"] = ""
    log_level: LogLevel = ""
    quiet_logs: bool = False
    thp: Literal["", "always", "madvise", "never"] = ""


def _patch(p: Patch | Mapping[str, Any]) -> Patch:
    """A Patch, or one as a read-back configuration spells it (a dict: op, path, mode,
    owner, target, replace, and its bytes as ``data_base64``; one described by ``size``
    alone was read back without them: refused, naming it)."""
    if isinstance(p, Patch):
        return p
    import base64

    data = base64.b64decode(p["data_base64"]) if "data_base64" in p else b""
    if not data and p.get("size"):
        raise InvalidArgument(
            protocol.INVALID_ARGUMENT,
            f"patch {p.get('op')} {p.get('path')}: its {p['size']} bytes were not read back (config(patch_data=True))",
        )
    return Patch(
        str(p["op"]),
        str(p["path"]),
        data,
        target=str(p.get("target", "")),
        mode=p.get("mode"),
        owner=str(p.get("owner", "")),
        replace=bool(p.get("replace", False)),
        source=str(p.get("source", "")),
    )


def _patches(v: Sequence[Patch | Mapping[str, Any]] | None) -> tuple[Patch, ...]:
    return tuple(_patch(p) for p in v or ())


def _mounts(v: Sequence[VolumeMount | str] | None) -> tuple[VolumeMount, ...]:
    return by_path([m if isinstance(m, VolumeMount) else VolumeMount.parse(m) for m in v or ()])


MountKinds = tuple[tuple[VolumeMount, ...], tuple[Tmpfs, ...], tuple[HostDir, ...]]


def later_mounts(before: MountKinds, given: Settings) -> MountKinds:
    """The mounts of every kind (volumes, tmpfs, host directories) after ``given``'s, as
    one map keyed by guest path: they merge, and an entry given now replaces whatever
    was mounted at its path before, of any kind (the reference's WithMounts)."""
    new = (_mounts(given.get("volumes")), _tmpfs(given.get("tmpfs")), _host_dirs(given.get("mounts")))
    now = {_guest_path(m.path) for kind in new for m in kind}
    vols = by_path([*(m for m in before[0] if _guest_path(m.path) not in now), *new[0]])
    tmps = by_path([*(m for m in before[1] if _guest_path(m.path) not in now), *new[1]])
    dirs = by_path([*(m for m in before[2] if _guest_path(m.path) not in now), *new[2]])
    return vols, tmps, dirs


class Settings(TypedDict, total=False):
    """The common settings, as keyword arguments of ``create`` and :meth:`SandboxSpec.with_`."""

    cpus: int
    memory_mib: int
    max_cpus: int
    max_memory_mib: int
    disk_size: int | str  # "4G", "512M", or bytes
    env: Mapping[str, str]
    labels: Mapping[str, str]
    cmd: Sequence[str]
    workdir: str
    user: str
    hostname: str
    network: Literal["none", "tap", "user", "outbound"]
    outbound: bool
    egress: Egress | Mapping[str, Any] | None
    ports: Mapping[PortKey, int]
    ttl: int
    idle_timeout: int
    ephemeral: bool
    on_idle: Literal["stop", "pause"]
    paused_ttl: int
    auto_resume: bool
    ttl_action: Literal["stop", "remove"]
    kill_timeout: int
    image: str
    pull: Literal["", "always", "if-missing", "never"]
    tls_verify: bool
    registry: RegistryAuth | None
    patches: Sequence[Patch | Mapping[str, Any]]
    volumes: Sequence[VolumeMount | str]
    scripts: Mapping[str, str]
    tmpfs: Sequence[Tmpfs | str]
    mounts: Sequence[HostDir | str]
    secrets: Sequence[Secret | str]
    ssh_keys: Sequence[str]
    # workload shape (Shape): cmd=[] clears the image CMD
    entrypoint: Sequence[str] | None
    shell: str
    security_profile: Literal["", "default", "restricted"]
    log_level: LogLevel
    quiet_logs: bool
    thp: Literal["", "always", "madvise", "never"]
    # networking: ports on explicit host addresses ("[ADDR:]HOST:GUEST[/udp]" or
    # PortBinding), the host address every port listens on, a named profile, resolv.conf
    port_bindings: Sequence[PortBinding | str]
    port_address: str
    network_profile: str
    dns: Dns | Mapping[str, Any] | None
    # the boot's own files (a read-back configuration names them when it has them)
    kernel: str
    rootfs: str
    boot_args: str
    init: Init | str | Mapping[str, Any] | None
    # images and disks: a disk image of your own as the root ("PATH[:FSTYPE]" or (PATH, FSTYPE);
    # raw, qcow2, vmdk, vdi, vhdx, vpc; under serve --allow-path); a snapshot to start from
    # (id, name, or an exported snapshot file under --allow-path)
    image_disk: str | tuple[str, str]
    from_snapshot: str


def _image_disk(disk: str | tuple[str, str]) -> dict[str, str]:
    """``image_disk``: "PATH[:FSTYPE]" or (PATH, FSTYPE), the path made absolute (the
    supervisor shares this host: it opens the same file)."""
    if isinstance(disk, str):
        path, sep, fstype = disk.rpartition(":")
        if not sep or fstype not in _FSTYPES:
            path, fstype = disk, ""
    else:
        path, fstype = disk
    return {"rootfs": os.path.abspath(path) if path else "", "rootfs_fstype": fstype}


def _image(image: str) -> str:
    """A root filesystem directory (``dir:PATH``, ``/...``, ``./...``, ``../...``) as
    ``dir:/absolute/path``; an OCI reference as it is."""
    if image.startswith("dir:"):
        return "dir:" + os.path.abspath(image[4:])
    if image.startswith(("/", "./", "../")) or image in (".", ".."):
        return "dir:" + os.path.abspath(image)
    return image


def _from_snapshot(ref: str) -> str:
    """A snapshot id or name as it is; a path (it has a '/') made absolute."""
    return os.path.abspath(ref) if "/" in ref else ref


_FSTYPES = ("ext4", "ext3", "ext2", "xfs", "btrfs", "vfat", "squashfs", "erofs", "iso9660")


@attrs.frozen(kw_only=True)
class SandboxSpec:
    """Everything a sandbox is made of, grouped; frozen and reusable (a template for
    many sandboxes). ``spec.with_(cpus=2, env={...})`` is a copy with settings applied:
    maps (env, labels, ports, scripts) merge, and so do mounts (volumes, tmpfs, host
    directories), keyed by guest path: a later entry replaces an earlier one at its
    path, of any kind; everything else replaces."""

    labels: dict[str, str] = attrs.field(factory=dict, converter=_kv)
    hostname: str = ""
    resources: Resources = Resources()
    workload: Workload = Workload()
    network: Network = Network()
    lifetime: Lifetime = Lifetime()
    boot: Boot = Boot()
    patches: tuple[Patch, ...] = attrs.field(default=(), converter=_patches)
    volumes: tuple[VolumeMount, ...] = attrs.field(default=(), converter=_mounts)
    # named scripts (name -> body; no "#!": /bin/sh), run by name: run_script(name, *args)
    scripts: dict[str, str] = attrs.field(factory=dict, converter=_kv)
    tmpfs: tuple[Tmpfs, ...] = attrs.field(default=(), converter=_tmpfs)  # ("/path[:SIZE]" or Tmpfs)
    # host directories ("HOST_DIR:/path[:ro|rw]" or HostDir), read-only by default
    mounts: tuple[HostDir, ...] = attrs.field(default=(), converter=_host_dirs)
    # secrets the guest holds only placeholders of (docs/secrets.md); an env source is read at request()
    secrets: tuple[Secret, ...] = attrs.field(default=(), converter=_secrets)
    # SSH public keys (OpenSSH .pub lines) that serve --ssh accepts for it (docs/ssh.md)
    ssh_keys: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    shape: Shape = Shape()  # entrypoint, CMD cleared, shell, security profile, logs, THP
    # the init PID 1 is handed to (Init.auto(), Init.cmd(...), or "auto"/a path; None: none)
    init: Init | None = attrs.field(default=None, converter=_init)
    from_snapshot: str = ""  # a snapshot (id, name, exported file) the sandbox starts from

    def with_(self, **settings: Unpack[Settings]) -> SandboxSpec:
        if not settings:
            return self
        s = settings
        wl, net, life, res, boot = self.workload, self.network, self.lifetime, self.resources, self.boot
        volumes, tmpfs, mounts = later_mounts((self.volumes, self.tmpfs, self.mounts), s)
        return attrs.evolve(
            self,
            boot=attrs.evolve(
                boot,
                image=_image(s["image"]) if "image" in s else boot.image,
                pull=s.get("pull", boot.pull),
                tls_verify=s.get("tls_verify", boot.tls_verify),
                registry=s.get("registry", boot.registry),
                boot_args=s.get("boot_args", boot.boot_args),
                **{"kernel": s.get("kernel", boot.kernel), "rootfs": s.get("rootfs", boot.rootfs)}
                | (_image_disk(s["image_disk"]) if "image_disk" in s else {}),
            ),
            labels={**self.labels, **_kv(s.get("labels"))},
            hostname=s.get("hostname", self.hostname),
            resources=Resources(
                cpus=s.get("cpus", res.cpus),
                memory_mib=s.get("memory_mib", res.memory_mib),
                max_cpus=s.get("max_cpus", res.max_cpus),
                max_memory_mib=s.get("max_memory_mib", res.max_memory_mib),
                disk_size_mib=size_mib(s["disk_size"]) if "disk_size" in s else res.disk_size_mib,
            ),
            workload=Workload(
                cmd=s.get("cmd", wl.cmd),
                env={**wl.env, **_kv(s.get("env"))},
                workdir=s.get("workdir", wl.workdir),
                user=s.get("user", wl.user),
            ),
            network=Network(
                mode=s.get("network", net.mode),
                outbound=s.get("outbound", net.outbound),
                egress=s.get("egress", net.egress),
                ports={**net.ports, **_ports(s.get("ports"))},
                port_bindings=(*net.port_bindings, *_bindings(s.get("port_bindings"))),
                port_address=s.get("port_address", net.port_address),
                profile=s.get("network_profile", net.profile),
                dns=s.get("dns", net.dns),
            ),
            lifetime=Lifetime(
                ttl=s.get("ttl", life.ttl),
                idle_timeout=s.get("idle_timeout", life.idle_timeout),
                ephemeral=s.get("ephemeral", life.ephemeral),
                on_idle=s.get("on_idle", life.on_idle),
                paused_ttl=s.get("paused_ttl", life.paused_ttl),
                auto_resume=s.get("auto_resume", life.auto_resume),
                ttl_action=s.get("ttl_action", life.ttl_action),
                kill_timeout=s.get("kill_timeout", life.kill_timeout),
            ),
            patches=_patches(s.get("patches", self.patches)),
            volumes=volumes,
            scripts={**self.scripts, **_kv(s.get("scripts"))},
            tmpfs=tmpfs,
            mounts=mounts,
            secrets=_secrets(s.get("secrets", self.secrets)),
            ssh_keys=_strs(s.get("ssh_keys", self.ssh_keys)),
            shape=Shape(
                entrypoint=s.get("entrypoint", self.shape.entrypoint),
                cmd_cleared=not s["cmd"] if "cmd" in s else self.shape.cmd_cleared,
                shell=s.get("shell", self.shape.shell),
                security_profile=s.get("security_profile", self.shape.security_profile),
                log_level=s.get("log_level", self.shape.log_level),
                quiet_logs=s.get("quiet_logs", self.shape.quiet_logs),
                thp=s.get("thp", self.shape.thp),
            ),
            init=_init(s.get("init", self.init)),
            from_snapshot=_from_snapshot(s.get("from_snapshot", self.from_snapshot)),
        )

    def request(self, name: str = "") -> protocol.CreateSandboxRequest:
        """The wire's Create request for a sandbox called ``name`` ("": the supervisor names it)."""
        return protocol.CreateSandboxRequest(
            id=name,
            labels=dict(self.labels),
            image=self.boot.image,
            image_pull=self.boot.pull,
            image_tls_verify=self.boot.tls_verify,
            image_creds=self.boot.registry.creds if self.boot.registry else "",
            image_auth_json=self.boot.registry.auth_json if self.boot.registry else b"",
            image_ca_pem=self.boot.registry.ca_pem if self.boot.registry else b"",
            kernel=self.boot.kernel,
            rootfs=self.boot.rootfs,
            boot_args=self.boot.boot_args,
            limits=protocol.ResourceLimits(vcpus=self.resources.cpus, memory_mib=self.resources.memory_mib),
            cmd=list(self.workload.cmd),
            env=dict(self.workload.env),
            working_dir=self.workload.workdir,
            user=self.workload.user,
            network=self.network.spec(),
            ports=self.network.port_mappings(),
            ttl_seconds=self.lifetime.ttl,
            idle_timeout_seconds=self.lifetime.idle_timeout,
            hostname=self.hostname,
            ephemeral=self.lifetime.ephemeral,
            patches=list(self.patches),
            volumes=[protocol.VolumeMount(m.name, m.path, m.read_only) for m in self.volumes],
            scripts=dict(self.scripts),
            tmpfs=[protocol.TmpfsMount(m.path, m.size_mib) for m in self.tmpfs],
            host_mounts=[protocol.HostMount(m.source, m.path, m.writable) for m in self.mounts],
            on_idle="" if self.lifetime.on_idle == "stop" else self.lifetime.on_idle,
            paused_ttl_seconds=self.lifetime.paused_ttl,
            no_auto_resume=not self.lifetime.auto_resume,
            max_vcpus=self.resources.max_cpus,
            max_memory_mib=self.resources.max_memory_mib,
            disk_size_mib=self.resources.disk_size_mib,
            secrets=[s.spec() for s in self.secrets],
            ssh_public_key="\n".join(self.ssh_keys) if self.ssh_keys else None,
            entrypoint=list(self.shape.entrypoint or ()),
            entrypoint_cleared=self.shape.entrypoint == (),
            cmd_cleared=self.shape.cmd_cleared and not self.workload.cmd,
            shell=self.shape.shell,
            security_profile=self.shape.security_profile,
            log_level=self.shape.log_level,
            quiet_logs=self.shape.quiet_logs,
            thp=self.shape.thp,
            network_profile=self.network.profile,
            port_address=self.network.port_address,
            dns=_dns_spec(self.network.dns),
            init=None if self.init is None else self.init.spec(),
            rootfs_fstype=self.boot.rootfs_fstype,
            from_snapshot=self.from_snapshot,
            ttl_action=self.lifetime.ttl_action,
            kill_timeout_seconds=self.lifetime.kill_timeout,
        )


# ---------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------


@attrs.frozen
class RunResult:
    stdout: bytes
    stderr: bytes
    exit_code: int
    oom_killed: bool = False  # the guest kernel's OOM killer killed the process (exit_code 137)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def text(self) -> str:
        return self.stdout.decode(errors="replace")


@attrs.frozen
class Output:
    """One chunk of a streaming run: ``stream`` is stdout, stderr or exit (or, ending a
    detachable exec the client detached from, "detached" with its ``session_id``)."""

    stream: str
    data: bytes
    exit_code: int | None = None
    session_id: int = 0
    oom_killed: bool = False  # on "exit": the guest kernel's OOM killer killed the process


@attrs.frozen
class Page:
    """One page of List, newest first; ``next_cursor`` ("" on the last page) asks for the next."""

    sandboxes: list[SandboxSummary]
    next_cursor: str


SnapshotRef = str | CheckpointResponse | SnapshotSummary
"""A snapshot: its id, a unique snapshot name, or what Checkpoint or ListSnapshots gave."""


def _snapshot_id(ref: SnapshotRef) -> str:
    if isinstance(ref, CheckpointResponse):
        return ref.snapshot_id
    if isinstance(ref, SnapshotSummary):
        return ref.id
    return ref


class RunSettings(TypedDict, total=False):
    """How a run or exec runs: env (on top of the sandbox's), workdir, user, tty, timeout (s)."""

    env: Mapping[str, str]
    workdir: str
    user: str
    tty: bool
    timeout: int


def _output(item: protocol.RunOutput) -> Output:
    if item.done and item.stream == "detached":
        return Output("detached", b"", session_id=item.session_id)
    if item.done:
        return Output("exit", b"", item.exit_code, oom_killed=item.oom_killed)
    return Output(item.stream, item.data)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(size: int | str) -> int:
    """Bytes: an int, or "256M", "1G", "512MiB", "1024" (bytes)."""
    if isinstance(size, int):
        return size
    text = size.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    number = text[: len(text) - len(unit)] if unit else text
    try:
        value = float(number)
    except ValueError:
        raise InvalidArgument(protocol.INVALID_ARGUMENT, f"size {size!r}: a number with K, M, G or T") from None
    return int(value * _UNITS[unit])


def size_mib(size: int | str) -> int:
    """MiB, rounded up: "4G", "512M", or bytes."""
    return -(-parse_size(size) // (1 << 20))
