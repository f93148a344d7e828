"""Tap networking on the host: routed per-sandbox links, the gateway, the filter, the DNS proxy.

Design: one TAP per sandbox, *routed* (not enslaved to a bridge). Each TAP is its
own point-to-point L3 link whose host side holds the gateway address with the
sandbox as its peer (``ip addr add GW peer IP/32``: one command gives the host the
gateway on that link and the /32 route to the sandbox). The bridge ``sandvisor0``
has no ports: it anchors the gateway address and the pool's route (traffic to an
unleased pool address dies there instead of leaving by the default route) and lets
the DNS proxy bind before the first sandbox exists. ::

    internet / LAN            supervisor's network namespace
          |          +----------------------------------------------+
        eth0 <-masq- |  ip_forward, table inet sandvisor            |
                     |  sandvisor0 (bridge, no ports) 10.88.0.1/16  |
                     |  DNS proxy 10.88.0.1:53 (udp+tcp, Trio)      |
                     |                                              |
                     |  svnAAAA: 10.88.0.1 peer 10.88.0.2/32 -------+-- TAP fd --> QEMU A --> eth0 10.88.0.2/16
                     |  svnBBBB: 10.88.0.1 peer 10.88.0.3/32 -------+-- TAP fd --> QEMU B --> eth0 10.88.0.3/16
                     +----------------------------------------------+   (each QEMU: own empty netns, own uid)

Why routed rather than a bridge: every packet a sandbox sends crosses the IP stack
(prerouting, input, forward), so one nftables table keyed by the input interface
filters all of it, sandbox to sandbox included; sandboxes share no L2 segment
(no ARP/MAC spoofing of each other, no broadcast between them, no br_netfilter);
MACs need no coordination (a restored clone that still has its origin's MAC until
guestd reconfigures it disturbs nobody); the host side of every link has the same
fixed MAC, so a restored guest's neighbour entry for its gateway stays right. The
guest keeps a pool-wide prefix (``10.88.0.2/16``, so /init's ``ip route add default
via GW`` works unchanged); proxy ARP on the link answers for other pool addresses,
which the filter then judges. Costs: one address per link and ``ip_forward=1`` in
the supervisor's namespace (as Docker), made explicit here.

The TAP is created in-process (TUNSETIFF on /dev/net/tun, IFF_VNET_HDR for virtio
offloads, IFF_TUN_EXCL) and is not persistent: it disappears with the last fd, so
a crashed supervisor leaves no device (its QEMUs die with it, see the registry's
recovery). The fd goes to QEMU (``-netdev tap,fd=N,vnet_hdr=on``), which needs no
network namespace of its own contents, no capability and no path.

User-mode networking with outbound access ("outbound without the host")
uses the same links: a jailed QEMU's slirp opens its sockets in the jail's network
namespace, which :meth:`HostNetwork.open_uplink` makes with one veth into it (host
end ``svn...``, jail end ``eth0`` holding a pool address): the same filter, egress
policy and DNS proxy apply to it as to a TAP::

    guest 10.0.2.15 --slirp (in QEMU)--> jail netns svj-KEY-HASH: eth0 10.88.0.7/16, lo
                                             | veth
                      supervisor's netns:  svnHASH 10.88.0.1 peer 10.88.0.7 --filter--> masquerade out
    slirp's DNS (10.0.2.3) -> the jail's /etc/resolv.conf: the gateway -> the DNS proxy

Ownership: :class:`HostNetwork` (``run(task_status)``) owns the bridge, the table
and the DNS proxy; each :class:`SandboxLink` owns one TAP (or veth, and the jail
namespace it leads into), its address on the host side, its chain and sets, and
its DNS registration, created by :meth:`HostNetwork.open_tap`,
:meth:`HostNetwork.open_uplink` or :meth:`HostNetwork.attach` and removed by
:meth:`SandboxLink.close` (idempotent). The address lease is the IP pool's
(actors/net/ippool.py), which outlives links: a stopped sandbox keeps its address.

A supervisor restart that keeps its sandboxes (``serve --keep-sandboxes``) leaves
the table in place when it exits: the next one replaces it in one transaction
(every sandbox link is then in no set: its traffic is dropped, never let through
unfiltered) and :meth:`HostNetwork.readopt` puts each adopted sandbox's link back.
Jail namespaces of lives that ended with a crashed supervisor are removed by
:meth:`HostNetwork.sweep`. One supervisor's tap networking per network namespace:
a second one is refused at start (a lock file per namespace in a root-only directory).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Sequence
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.net import egress
from actors.net.dnsproxy import DnsProxy, resolv_conf_upstreams
from actors.net.egress import EgressPolicy
from actors.net.ippool import DEFAULT_POOL, GATEWAY_MAC, LINK_PREFIX, IpPool, guest_mac
from actors.net.netns import NetError, NetNS
from actors.net.nft import Nft, NftError

log = logging.getLogger("sandvisor.net")

BRIDGE = "sandvisor0"
NETNS_DIR = "/run/netns"  # where `ip netns add` names namespaces
# one lock file per network namespace, in a directory only root can enter (an abstract
# socket name, the lock before, was one any local user could bind first)
LOCK_DIR = Path("/run/sandvisor-net")


def lock_netns(netns: NetNS, lock_dir: Path = LOCK_DIR) -> tuple[int, Path]:
    """Take the tap-networking lock of ``netns`` (flock on ``lock_dir/netns-DEV-INO.lock``,
    the namespace's identity): (its fd, its path). ``lock_dir`` is made 0700, and
    refused unless it is a directory of ours (not a symlink): nobody else can make or
    hold the lock. NetError when another process holds it."""
    try:
        os.mkdir(lock_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise NetError(f"tap networking's lock directory {lock_dir}: {exc.strerror}") from None
    st = os.lstat(lock_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise NetError(
            f"{lock_dir} is not a directory of uid {os.geteuid()} (owner {st.st_uid}): someone else made it; "
            "refusing tap networking's lock there (remove it)"
        )
    if st.st_mode & 0o077:
        os.chmod(lock_dir, 0o700)
    ns = os.stat(netns.path or "/proc/thread-self/ns/net")
    path = lock_dir / f"netns-{ns.st_dev}-{ns.st_ino}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NetError(
                "another supervisor runs tap networking in this network namespace (one per namespace: "
                "give this one --ip-pool none, or run it in its own namespace)"
            ) from None
        # the holder before us unlinks the file as it lets go: hold the one that is there
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                return fd, path
        os.close(fd)


def unlock_netns(fd: int, path: Path) -> None:
    """Let go of :func:`lock_netns`'s lock (the file goes first, while still held)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


@attrs.frozen
class HostNetConfig:
    pool: str = DEFAULT_POOL
    bridge: str = BRIDGE
    upstreams: tuple[tuple[str, int], ...] = ()  # empty: the host's /etc/resolv.conf
    never: tuple[str, ...] = ()  # operator's ranges no sandbox reaches (e.g. the LAN)
    netns: NetNS = attrs.field(factory=NetNS)
    dns_port: int = 53
    ip_forward: bool = True
    # jail namespaces (outbound user mode) are named <jail_prefix><12 hex digits>: one
    # prefix per supervisor, stable across its restarts (serve derives it from the state
    # dir), so a sweep never touches another supervisor's; random unless given
    jail_prefix: str = attrs.field(factory=lambda: f"svj-{secrets.token_hex(3)}-")
    lock_dir: Path = LOCK_DIR  # one supervisor's tap networking per namespace: lock_netns


@attrs.frozen
class GuestNet:
    """What the guest is configured with (boot: the kernel command line; after a
    restore: guestd's ``net_config``) and what Inspect reports."""

    address: IPv4Address
    prefix: int
    gateway: IPv4Address
    dns: IPv4Address
    mac: str
    tap_name: str

    def cmdline(self) -> str:
        return f"sandvisor.net={self.address}/{self.prefix},{self.gateway},{self.dns}"

    def net_config(self) -> dict[str, Any]:
        """The body of guestd's ``net_config`` request."""
        return {
            "address": str(self.address),
            "prefix": self.prefix,
            "gateway": str(self.gateway),
            "dns": [str(self.dns)],
            "mac": self.mac,
        }


class SandboxLink:
    """One sandbox's link on the host: the TAP fd (``tap_fd``: dup it for QEMU), the
    guest's configuration (``guest``) and the filter state behind it."""

    def __init__(
        self,
        net: HostNetwork,
        name: str,
        guest: GuestNet,
        policy: EgressPolicy,
        tap_fd: int | None,
        jail_netns: str = "",
    ) -> None:
        self.net = net
        self.name = name
        self.guest = guest
        self.policy = policy
        self.tap_fd = tap_fd
        self.jail_netns = jail_netns  # an uplink's namespace (its name under /run/netns), "" for a TAP
        self.closed = False

    @property
    def jail_netns_path(self) -> str:
        """The uplink's namespace file (for the jail: QEMU enters it), "" for a TAP."""
        return f"{NETNS_DIR}/{self.jail_netns}" if self.jail_netns else ""

    def set_policy(self, policy: EgressPolicy) -> None:
        """Replace the egress policy atomically (answers opened by DNS are forgotten)."""
        g = self.guest
        self.net.nft.run(
            [
                *egress.sandbox_removal(self.name, g.address, self.policy),
                *egress.sandbox_rules(self.name, g.address, policy, self.net.pool.network),
            ]
        )
        self.policy = policy
        self.net.dns.register(g.address, self.name, policy)

    def close(self) -> None:
        """Remove the filter state and the DNS registration, close the TAP (it goes when
        QEMU's fd closes too), delete an uplink's jail namespace (its veth goes with it).
        The rules go first: from then on the link is in no set, and everything it still
        sends is dropped (fail closed)."""
        if self.closed:
            return
        self.closed = True
        self.net._links.pop(self.name, None)
        self.net.dns.unregister(self.guest.address)
        try:
            self.net.nft.run(egress.sandbox_removal(self.name, self.guest.address, self.policy))
        except NftError as exc:
            log.warning("%s: removing its rules: %s", self.name, exc)
        if self.tap_fd is not None:
            os.close(self.tap_fd)
            self.tap_fd = None
        if self.jail_netns:
            self.net.delete_jail_netns(self.jail_netns, self.name)

    def detach(self) -> None:
        """The supervisor exits and the sandbox runs on (``--keep-sandboxes``): forget the
        link here and close our TAP descriptor; the device, its rules and the jail
        namespace stay for the next supervisor (:meth:`HostNetwork.readopt`)."""
        if self.closed:
            return
        self.closed = True
        self.net._links.pop(self.name, None)
        self.net.dns.unregister(self.guest.address)
        if self.tap_fd is not None:
            os.close(self.tap_fd)
            self.tap_fd = None


class _Watched:
    """The DNS proxy's task status: passes ``started`` on and remembers it was called."""

    def __init__(self, outer: trio.TaskStatus[None]) -> None:
        self.outer = outer
        self.done = False

    def started(self, value: object = None) -> None:
        self.done = True
        self.outer.started()


class HostNetwork:
    """The supervisor's tap networking. ``await nursery.start(net.run)``; leaving
    ``run`` (cancel) removes the table and the bridge."""

    def __init__(self, config: HostNetConfig, pool: IpPool) -> None:
        self.config = config
        self.pool = pool
        self.netns = config.netns
        self.gateway = pool.gateway
        self.nft = Nft(self.netns)
        never = [IPv4Network(n) for n in (*egress.NEVER4, *config.never)]
        self.dns = DnsProxy(
            self.gateway,
            config.upstreams or tuple(resolv_conf_upstreams()),
            self.nft,
            netns=self.netns,
            port=config.dns_port,
            closed=[*never, pool.network],
        )
        self._links: dict[str, SandboxLink] = {}
        self._lock: tuple[int, Path] | None = None
        self.keep_table = False  # at exit: sandboxes run on (detached), their filter must stay
        self.dns_down = False  # the DNS proxy died (logged): sandboxes resolve nothing

    # -- lifetime ----------------------------------------------------------------
    def _take_lock(self) -> None:
        """One supervisor's tap networking per network namespace: two would replace each
        other's table and bridge (:func:`lock_netns`; it goes with its holder)."""
        self._lock = lock_netns(self.netns, self.config.lock_dir)

    def setup(self) -> None:
        """Bridge, gateway address, forwarding, the table (a crashed run's leftovers go)."""
        cfg = self.config
        if self._lock is None:
            self._take_lock()
        with contextlib.suppress(NetError):
            self.netns.ip(f"link del {cfg.bridge}")
        self.netns.ip(
            f"link add {cfg.bridge} type bridge",
            f"addr add {self.gateway}/{self.pool.prefix} dev {cfg.bridge}",
            f"link set {cfg.bridge} up",
        )
        self.netns.sysctl(f"ipv6/conf/{cfg.bridge}/disable_ipv6", 1)
        if cfg.ip_forward:
            self.netns.sysctl("ipv4/ip_forward", 1)
        self.nft.run(egress.base_ruleset(self.gateway, self.pool.network, never=cfg.never, dns_port=cfg.dns_port))

    def teardown(self) -> None:
        """Every link closed, the table and the bridge removed -- unless sandboxes run on
        (``keep_table``): their links stay filtered, by the table as it is, until the
        next supervisor replaces it. Fail closed: while a link is still open (its
        sandbox was not stopped first: the supervisor is going down on an error, and
        its QEMUs may outlive this by a moment) the table stays too; the link's own
        rules go, so whatever it still sends is dropped, never forwarded unfiltered."""
        if self._links and not self.keep_table:
            log.error(
                "tap networking stops with %d sandbox link(s) still open: the filter stays in place "
                "(their traffic is dropped) until the next supervisor replaces it",
                len(self._links),
            )
        keep = self.keep_table or bool(self._links)
        for link in list(self._links.values()):
            link.detach() if self.keep_table else link.close()
        if not keep:
            with contextlib.suppress(NftError):
                self.nft.run(f"delete table inet {egress.TABLE}")
            with contextlib.suppress(NetError):
                self.netns.ip(f"link del {self.config.bridge}")
        self.nft.close()
        if self._lock is not None:
            unlock_netns(*self._lock)
            self._lock = None

    async def run(self, task_status: trio.TaskStatus[HostNetwork] = trio.TASK_STATUS_IGNORED) -> None:
        self.setup()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._run_dns)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                self.teardown()

    async def _run_dns(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The DNS proxy, whose failure (after it started: a bug, since it handles each
        query in its own error boundary) ends neither tap networking nor the supervisor:
        it is logged as an error and the filter stays as it is, failing closed (no name
        resolves, so nothing new opens; what is open stays open for its TTL)."""
        status = _Watched(task_status)
        try:
            await self.dns.run(task_status=status)
        except Exception:
            if not status.done:
                raise  # (it cannot bind: the supervisor does not start)
            self.dns_down = True
            log.exception("the DNS proxy for sandboxes died: DNS for sandboxes is down (the filter stays in place)")

    # -- links -------------------------------------------------------------------
    def guest_net(self, address: IPv4Address, name: str) -> GuestNet:
        return GuestNet(address, self.pool.prefix, self.gateway, self.gateway, guest_mac(address), name)

    def open_tap(self, name: str, address: IPv4Address, policy: EgressPolicy) -> SandboxLink:
        """A new TAP ``name`` for the sandbox at ``address`` (leased by the caller),
        configured and filtered before its fd is handed out."""
        fd = self.netns.open_tap(name)
        try:
            return self._configure(name, address, policy, fd)
        except BaseException:
            os.close(fd)
            raise

    def attach(self, name: str, address: IPv4Address, policy: EgressPolicy) -> SandboxLink:
        """Configure an existing link (the host end of a veth: the tests) as a sandbox link."""
        return self._configure(name, address, policy, None)

    def jail_netns_name(self, link: str) -> str:
        """The jail namespace of the uplink whose host end is ``link``."""
        return self.config.jail_prefix + link.removeprefix(LINK_PREFIX)

    def open_uplink(self, name: str, address: IPv4Address, policy: EgressPolicy) -> SandboxLink:
        """A jail network namespace for a jailed QEMU's user-mode networking with
        outbound access: one veth into it (``name`` here, ``eth0`` there, holding
        ``address``, default route via the gateway), loopback up (slirp's port forwards
        listen there), no IPv6; then filtered as any sandbox link."""
        ns_name = self.jail_netns_name(name)
        self.delete_jail_netns(ns_name, name)  # a stale one of a crashed life: never reuse it
        try:
            NetNS().ip(f"netns add {ns_name}")
            jail = NetNS(ns_name)
            jail.sysctl("ipv6/conf/all/disable_ipv6", 1)
            jail.sysctl("ipv6/conf/default/disable_ipv6", 1)
            self.netns.ip(f"link add {name} type veth peer name eth0 netns {ns_name}")
            jail.ip(
                "link set lo up",
                f"addr add {address}/{self.pool.prefix} dev eth0",
                "link set eth0 up",
                f"route add default via {self.gateway} dev eth0",
            )
            link = self._configure(name, address, policy, None)
        except BaseException:
            self.delete_jail_netns(ns_name, name)
            raise
        link.jail_netns = ns_name
        return link

    def delete_jail_netns(self, ns_name: str, link: str = "") -> None:
        """Delete a jail namespace and the veth into it (idempotent). The veth is deleted
        first, explicitly: a namespace is destroyed asynchronously, and its links with it."""
        if link and self.netns.link_exists(link):
            with contextlib.suppress(NetError):
                self.netns.ip(f"link del {link}")
        if not os.path.exists(f"{NETNS_DIR}/{ns_name}"):
            return
        try:
            NetNS().ip(f"netns del {ns_name}")
        except NetError as exc:
            log.warning("jail namespace %s: %s", ns_name, exc)

    def readopt(self, name: str, address: IPv4Address, policy: EgressPolicy, *, uplink: bool) -> SandboxLink:
        """The link of a sandbox a previous supervisor left running: its TAP (QEMU holds
        it) or its uplink's veth, configured again and filtered again."""
        link = self._configure(name, address, policy, None)
        if uplink:
            link.jail_netns = self.jail_netns_name(name)
        return link

    def sweep(self, keep: Iterable[str]) -> None:
        """Jail namespaces of ours that no running sandbox link (``keep``: link names)
        needs: a crashed supervisor's leftovers."""
        wanted = {self.jail_netns_name(k) for k in keep}
        try:
            names = os.listdir(NETNS_DIR)
        except OSError:
            return
        for ns_name in names:
            if ns_name.startswith(self.config.jail_prefix) and ns_name not in wanted:
                log.warning("removing the stale jail network namespace %s", ns_name)
                self.delete_jail_netns(ns_name, LINK_PREFIX + ns_name.removeprefix(self.config.jail_prefix))

    def _configure(self, name: str, address: IPv4Address, policy: EgressPolicy, fd: int | None) -> SandboxLink:
        if name in self._links:
            raise NetError(f"link {name} is configured already")
        if address not in self.pool.network or address == self.gateway:
            raise NetError(f"{address} is not a sandbox address of {self.pool.network}")
        ns = self.netns
        ns.sysctl(f"ipv6/conf/{name}/disable_ipv6", 1)  # before up: no link-local address, ever
        ns.sysctl(f"ipv4/conf/{name}/proxy_arp", 1)
        ns.ip(
            f"addr flush dev {name}",  # (a readopted link: its address is set again below)
            f"link set dev {name} address {GATEWAY_MAC} up",
            f"addr add {self.gateway}/32 peer {address}/32 dev {name}",
        )
        link = SandboxLink(self, name, self.guest_net(address, name), policy, fd)
        self.nft.run(egress.sandbox_rules(name, address, policy, self.pool.network))
        self._links[name] = link
        self.dns.register(address, name, policy)
        return link

    def links(self) -> Sequence[SandboxLink]:
        return list(self._links.values())
