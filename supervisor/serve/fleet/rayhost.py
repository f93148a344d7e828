"""What a member's Ray node may touch: its user, its token, its ports and who reaches them.

* **The user.** Ray's processes (``ray start``, the GCS, the raylet, its agents and every
  worker the raylet spawns) run as one unprivileged system user, ``sandvisor-ray`` by
  default (``serve --fleet-user``; made with ``useradd --system`` when absent), without
  capabilities and with ``no_new_privs``. It owns only Ray's own dir (``RUN_ROOT/ray``,
  0700); the supervisor's state dir (0700 root), its sockets (peer credentials: only root
  and ``--group``) and the sandboxes' jails (their own uids) are closed to it.
* **The token.** Ray's token authentication (``RAY_AUTH_MODE=token``): every Ray RPC
  carries it. The token is a file, 0600: made by the head's serve (``STATE/fleet/ray-token``)
  or given (``serve --fleet-token-file``, the same file on every member, copied there by the
  operator's set-up). Ray's processes read a copy in Ray's own dir through
  ``RAY_AUTH_TOKEN_PATH``; it is never on a command line or in an environment.
* **The ports.** Every port of Ray pinned (:class:`RayPorts`); an nftables table admits
  them from the fleet's peers (``--fleet-peer``) only, and from this host only to root
  (the supervisor's driver) and Ray's own user (``meta skuid`` on output). Ray binds most
  of them on every address: the filter, not the bind, keeps others out.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import secrets
import stat
import subprocess
from collections.abc import Iterable
from pathlib import Path

import attrs

from actors.face import FailedPrecondition, defaults

TABLE = "sandvisor-fleet"  # one per network namespace: one member per host


@attrs.frozen
class RayUser:
    name: str
    uid: int
    gid: int


def ray_user(name: str = defaults.FLEET_RAY_USER) -> RayUser:
    """``name``'s uid and gid; the default user is made (a system user, its own group, no
    home, no shell) when absent. Root, or a user sharing root's group, is refused."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        if name != defaults.FLEET_RAY_USER:
            raise FailedPrecondition(f"--fleet-user {name!r}: no such user") from None
        useradd = ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent"]
        subprocess.run(
            [*useradd, "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )
        pw = pwd.getpwnam(name)
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise FailedPrecondition(f"--fleet-user {name!r}: Ray never runs as root (uid or gid 0)")
    return RayUser(name, pw.pw_uid, pw.pw_gid)


def reachable_by(path: Path, user: RayUser) -> str | None:
    """Why ``user`` cannot execute ``path`` (each directory on the way searchable, the
    file executable, by owner, group or others' bits); None when it can."""

    def allowed(st: os.stat_result, bit: int) -> bool:  # bit: 1 (x) for "other"
        if st.st_uid == user.uid:
            return bool(st.st_mode & (bit << 6))
        if st.st_gid == user.gid:
            return bool(st.st_mode & (bit << 3))
        return bool(st.st_mode & bit)

    real = path.resolve()
    for d in [*reversed(path.absolute().parents), *reversed(real.parents)]:
        if not allowed(d.stat(), 1):
            return f"{d} is not searchable by {user.name}"
    if not allowed(real.stat(), 1):
        return f"{real} is not executable by {user.name}"
    return None


def make_token(path: Path) -> Path:
    """A fresh token in ``path`` (0600) unless one is there already; the path."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return check_token(path)


def check_token(path: Path) -> Path:
    """The token file as given: a regular file of this uid, 0600 or stricter, not empty."""
    try:
        st = path.lstat()
    except OSError as exc:
        raise FailedPrecondition(f"the fleet's token file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise FailedPrecondition(
            f"the fleet's token file {path} must be a regular file of uid {os.geteuid()}, mode 0600 "
            f"(it is mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})"
        )
    if not path.read_text().strip():
        raise FailedPrecondition(f"the fleet's token file {path} is empty")
    return path


def install_token(token: Path, dir: Path, user: RayUser) -> Path:
    """A copy of the token in Ray's own dir, readable by Ray's user only (0400)."""
    return install(token.read_text().strip().encode(), dir / "auth_token", user)


def install(data: bytes, dest: Path, user: RayUser) -> Path:
    """``data`` as ``dest``, Ray's user's, 0400."""
    dest.unlink(missing_ok=True)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        # by the descriptor: the dir is the Ray user's, who could swap the name for a
        # symlink between the open and a chown by path (root would chown its target)
        os.fchown(f.fileno(), user.uid, user.gid)
    return dest


def tls_env(ca: Path, cert: Path, key: Path) -> dict[str, str]:
    """Ray's own TLS (mutual: every Ray RPC, both ends present a certificate of the CA)."""
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_CA_CERT": str(ca),
        "RAY_TLS_SERVER_CERT": str(cert),
        "RAY_TLS_SERVER_KEY": str(key),
    }


def give_back(dir: Path, user: RayUser) -> int:
    """Whatever root made under Ray's dir (the supervisor's driver makes its log files and
    may make a shared dir first, e.g. ``logs/export_events``, which Ray's workers then
    cannot write in) handed to Ray's user; how many. Walked by directory descriptors
    without following links (Ray's user may change the tree meanwhile)."""
    n = 0
    for _, dirs, files, fd in os.fwalk(dir, follow_symlinks=False):
        for name in [*dirs, *files]:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if st.st_uid == 0:
                    os.chown(name, user.uid, user.gid, dir_fd=fd, follow_symlinks=False)
                    n += 1
            except FileNotFoundError:
                continue
    return n


@attrs.frozen
class RayPorts:
    """Every TCP port a member's Ray node listens on (the GCS on the head only)."""

    gcs: int
    base: int = defaults.FLEET_RAY_PORT_BASE

    @property
    def node_manager(self) -> int:
        return self.base

    @property
    def object_manager(self) -> int:
        return self.base + 1

    @property
    def metrics_export(self) -> int:
        return self.base + 2

    @property
    def agent_grpc(self) -> int:
        return self.base + 3

    @property
    def agent_http(self) -> int:
        return self.base + 4

    @property
    def runtime_env_agent(self) -> int:
        return self.base + 5

    @property
    def autoscaler_metrics(self) -> int:  # the head's monitor (Ray's AUTOSCALER_METRIC_PORT)
        return self.base + 6

    @property
    def dashboard(self) -> int:  # (the dashboard is off; its port is pinned all the same)
        return self.base + 7

    @property
    def workers(self) -> tuple[int, int]:  # the drivers' and workers' own servers (first, last)
        return self.base + 10, self.base + 41

    RAY_CLIENT = 10001  # Ray Client's default: off here, refused all the same

    def all(self) -> list[str]:
        """For nftables: each port, and the workers' range."""
        single = [
            self.gcs,
            self.node_manager,
            self.object_manager,
            self.metrics_export,
            self.agent_grpc,
            self.agent_http,
            self.runtime_env_agent,
            self.autoscaler_metrics,
            self.dashboard,
            self.RAY_CLIENT,
        ]
        lo, hi = self.workers
        return [str(p) for p in sorted(set(single))] + [f"{lo}-{hi}"]

    def flags(self) -> list[str]:
        lo, hi = self.workers
        return [
            "--node-manager-port", str(self.node_manager),
            "--object-manager-port", str(self.object_manager),
            "--metrics-export-port", str(self.metrics_export),
            "--dashboard-agent-grpc-port", str(self.agent_grpc),
            "--dashboard-agent-listen-port", str(self.agent_http),
            "--runtime-env-agent-port", str(self.runtime_env_agent),
            "--dashboard-port", str(self.dashboard),
            "--min-worker-port", str(lo),
            "--max-worker-port", str(hi),
        ]  # fmt: skip


def check_peers(peers: Iterable[str]) -> tuple[str, ...]:
    """``--fleet-peer`` values as networks (an address is its /32 or /128); ValueError names one."""
    out = []
    for p in peers:
        try:
            out.append(str(ipaddress.ip_network(p.strip("[]"), strict=False)))
        except ValueError:
            raise ValueError(f"--fleet-peer {p!r}: expected an address or a CIDR") from None
    return tuple(dict.fromkeys(out))


def firewall(ports: RayPorts, peers: Iterable[str], user: RayUser) -> str:
    """The nftables script (one transaction): Ray's ports from the peers only; from this
    host (judged on output, where the kernel knows the socket's owner) to root and Ray's
    user only. A table of an earlier run is replaced."""
    nets = [ipaddress.ip_network(p) for p in peers]
    v4 = ", ".join(str(n) for n in nets if n.version == 4)
    v6 = ", ".join(str(n) for n in nets if n.version == 6)
    port_set = ", ".join(ports.all())
    return f"""
table inet {TABLE}
delete table inet {TABLE}
table inet {TABLE} {{
    set ray_ports {{ type inet_service; flags interval; elements = {{ {port_set} }} }}
    set peers4 {{ type ipv4_addr; flags interval; {f"elements = {{ {v4} }}" if v4 else ""} }}
    set peers6 {{ type ipv6_addr; flags interval; {f"elements = {{ {v6} }}" if v6 else ""} }}
    chain input {{
        type filter hook input priority filter - 5; policy accept;
        iif "lo" accept
        tcp dport @ray_ports ip saddr @peers4 accept
        tcp dport @ray_ports ip6 saddr @peers6 accept
        tcp dport @ray_ports reject with tcp reset
    }}
    chain output {{
        type filter hook output priority filter - 5; policy accept;
        ct state established,related accept
        tcp dport @ray_ports meta skuid {{ 0, {user.uid} }} accept
        tcp dport @ray_ports reject with tcp reset
    }}
}}
"""


def firewall_off() -> str:
    return f"table inet {TABLE}\ndelete table inet {TABLE}\n"
