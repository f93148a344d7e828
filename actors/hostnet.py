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

Ownership: :class:`HostNetwork` (``run(task_status)``) owns the bridge, the table
and the DNS proxy; each :class:`SandboxLink` owns one TAP (or attached veth), its
address on the host side, its chain and sets, and its DNS registration, created by
:meth:`HostNetwork.open_tap` / :meth:`HostNetwork.attach` and removed by
:meth:`SandboxLink.close` (idempotent). The address lease is the IP pool's
(actors/ippool.py), which outlives links: a stopped sandbox keeps its address.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network
from typing import Any

import attrs
import trio

from actors import egress
from actors.dnsproxy import DnsProxy, resolv_conf_upstreams
from actors.egress import EgressPolicy
from actors.ippool import DEFAULT_POOL, GATEWAY_MAC, IpPool, guest_mac
from actors.netns import NetError, NetNS
from actors.nft import Nft, NftError

log = logging.getLogger("sandvisor.net")

BRIDGE = "sandvisor0"


@attrs.frozen
class HostNetConfig:
    pool: str = DEFAULT_POOL
    bridge: str = BRIDGE
    upstreams: tuple[tuple[str, int], ...] = ()  # empty: the host's /etc/resolv.conf
    never: tuple[str, ...] = ()  # operator's ranges no sandbox reaches (e.g. the LAN)
    netns: NetNS = attrs.field(factory=NetNS)
    dns_port: int = 53
    ip_forward: bool = True


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

    def __init__(self, net: HostNetwork, name: str, guest: GuestNet, policy: EgressPolicy, tap_fd: int | None) -> None:
        self.net = net
        self.name = name
        self.guest = guest
        self.policy = policy
        self.tap_fd = tap_fd
        self.closed = False

    def netdev_args(self, fd: int, *, netdev_id: str = "n0") -> tuple[str, ...]:
        """QEMU's -netdev/-device pair for a TAP fd as QEMU will see it (``{net}``:
        MachineSpec puts the device model there)."""
        return (
            "-netdev",
            f"tap,id={netdev_id},fd={fd}",  # vnet_hdr: QEMU reads it from the fd (IFF_VNET_HDR)
            "-device",
            "{net}" + f",netdev={netdev_id},mac={self.guest.mac}",
        )

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
        QEMU's fd closes too). Until then the link is in no set: everything it sends is
        dropped (fail closed)."""
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

    # -- lifetime ----------------------------------------------------------------
    def setup(self) -> None:
        """Bridge, gateway address, forwarding, the table (a crashed run's leftovers go)."""
        cfg = self.config
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
        for link in list(self._links.values()):
            link.close()
        with contextlib.suppress(NftError):
            self.nft.run(f"delete table inet {egress.TABLE}")
        with contextlib.suppress(NetError):
            self.netns.ip(f"link del {self.config.bridge}")
        self.nft.close()

    async def run(self, task_status: trio.TaskStatus[HostNetwork] = trio.TASK_STATUS_IGNORED) -> None:
        self.setup()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.dns.run)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                self.teardown()

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
        """Configure an existing link (the host end of a veth: the jail's user-mode
        outbound, and the tests) as a sandbox link."""
        return self._configure(name, address, policy, None)

    def _configure(self, name: str, address: IPv4Address, policy: EgressPolicy, fd: int | None) -> SandboxLink:
        if name in self._links:
            raise NetError(f"link {name} is configured already")
        if address not in self.pool.network or address == self.gateway:
            raise NetError(f"{address} is not a sandbox address of {self.pool.network}")
        ns = self.netns
        ns.sysctl(f"ipv6/conf/{name}/disable_ipv6", 1)  # before up: no link-local address, ever
        ns.sysctl(f"ipv4/conf/{name}/proxy_arp", 1)
        ns.ip(
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
