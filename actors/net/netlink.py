"""A sandbox's network on the host: its pool address, and one life's link.

The pool address (tap: the guest's; a jailed user-mode sandbox with outbound access:
its uplink's) is held from Create to Remove, across lives: a stopped sandbox keeps
it. A link (:class:`~actors.net.hostnet.SandboxLink`: a TAP, or the uplink namespace a
jailed QEMU runs in, with its egress filter and DNS registration) is one life's: the
:class:`~actors.sandboxes.life.Life` opens it before QEMU starts and closes it (or, detached,
lets it go for the next supervisor) in its teardown.
"""

from __future__ import annotations

from ipaddress import IPv4Address
from pathlib import Path
from typing import Protocol

from actors.cells.cell import Cells, Uplink
from actors.channel.guest import GuestError
from actors.errors import FailedPrecondition, ResourceExhausted
from actors.machines.qemuproc import MachineError
from actors.machines.vm import Guest, NetConfig
from actors.model import NetMode, Network
from actors.net.egress import EgressPolicy
from actors.net.hostnet import HostNetwork, SandboxLink
from actors.net.ippool import PoolExhausted, link_name
from actors.net.netns import NetError
from actors.net.nft import NftError


class NetSettings(Protocol):
    """What a sandbox's network needs of the supervisor's settings (actors/settings.py's
    ``Settings`` is one; the settings sit above the network, which never imports them)."""

    @property
    def cells(self) -> Cells | None: ...

    @property
    def hostnet(self) -> HostNetwork | None: ...


def needs_pool_address(settings: NetSettings, net: Network) -> bool:
    """Tap sandboxes have a pool address; so do jailed user-mode sandboxes with
    outbound access (their uplink's)."""
    if net.mode == NetMode.TAP:
        return True
    return net.mode == NetMode.USER and net.outbound and settings.cells is not None


def check_network_available(settings: NetSettings, net: Network) -> None:
    """What a network needs of this supervisor (FAILED_PRECONDITION otherwise)."""
    if net.mode == NetMode.TAP and settings.hostnet is None:
        raise FailedPrecondition(
            "network mode 'tap' needs a root supervisor with tap networking (serve --ip-pool CIDR)"
        )
    if net.mode == NetMode.USER and net.outbound:
        if settings.cells is not None and settings.hostnet is None:
            raise FailedPrecondition(
                "outbound networking of jailed sandboxes goes through the supervisor's filter: start it with "
                "tap networking (serve --ip-pool CIDR)"
            )
        if settings.cells is None and net.egress is not None:
            raise FailedPrecondition(
                "an egress policy for user-mode networking needs jailed QEMUs (a root supervisor with the jail)"
            )


def egress_policy(net: Network) -> EgressPolicy:
    eg = net.egress
    return EgressPolicy.parse(eg.to_dict() if eg is not None else None)


def pool_address(settings: NetSettings, uid: str) -> IPv4Address | None:
    """``uid``'s IP pool address, if it holds one."""
    hn = settings.hostnet
    return hn.pool.address_of(uid) if hn is not None else None


def guest_net(settings: NetSettings, net: Network, uid: str) -> NetConfig | None:
    """The guest's network (user: slirp's fixed addresses; tap: its pool address,
    None until it has one)."""
    if net.mode == NetMode.USER:
        return NetConfig(restrict=not net.outbound)
    if net.mode != NetMode.TAP or settings.hostnet is None:
        return None
    address = pool_address(settings, uid)
    if address is None:
        return None
    hn = settings.hostnet
    g = hn.guest_net(address, link_name(uid))
    return NetConfig(
        restrict=False,
        net=str(hn.pool.network),
        address=str(g.address),
        gateway=str(g.gateway),
        dns=str(g.dns),
        prefix=g.prefix,
        tap=True,
        mac=g.mac,
        tap_name=g.tap_name,
    )


def lease(settings: NetSettings, net: Network, uid: str, want: str = "") -> None:
    """Hold a pool address when the network needs one (idempotent): ``want`` (a
    restore: its snapshot's) when that is free, else the next free one."""
    hn = settings.hostnet
    if hn is None or not needs_pool_address(settings, net):
        return
    try:
        hn.pool.allocate(uid, IPv4Address(want) if want else None)
    except PoolExhausted as exc:
        raise ResourceExhausted(str(exc)) from None


def release_lease(settings: NetSettings, uid: str) -> None:
    """The address goes back to the pool (Remove)."""
    hn = settings.hostnet
    if hn is not None:
        hn.pool.release(uid)


def open_link(settings: NetSettings, net: Network, uid: str, run_dir: Path) -> tuple[SandboxLink | None, Uplink | None]:
    """A life's host link, before QEMU starts: a TAP (its descriptor goes to QEMU), or
    for a jailed user-mode sandbox with outbound access the uplink namespace its QEMU
    runs in (returned, for the cell). The caller owns the link."""
    hn = settings.hostnet
    if hn is None or not needs_pool_address(settings, net):
        return None, None
    lease(settings, net, uid)
    address = pool_address(settings, uid)
    assert address is not None
    name = link_name(uid)
    policy = egress_policy(net)
    try:
        if net.mode == NetMode.TAP:
            return hn.open_tap(name, address, policy), None
        link = hn.open_uplink(name, address, policy)
    except (NetError, NftError) as exc:
        raise MachineError(f"cannot set up the sandbox's network: {exc}") from None
    try:
        resolv = run_dir / "resolv.conf"  # slirp forwards the guest's DNS to what it names
        resolv.write_text(f"nameserver {hn.gateway}\n")
        resolv.chmod(0o644)  # (whatever the umask: QEMU's identity reads it in the jail)
    except BaseException:
        link.close()
        raise
    return link, Uplink(Path(link.jail_netns_path), resolv)


def readopt_link(settings: NetSettings, net: Network, uid: str) -> SandboxLink | None:
    """An adopted QEMU's link (its TAP, its uplink), filtered again."""
    hn = settings.hostnet
    if hn is None or not needs_pool_address(settings, net):
        return None
    address = pool_address(settings, uid)
    if address is None:
        raise MachineError("its IP pool address is gone (the pool changed): it cannot be adopted")
    try:
        return hn.readopt(link_name(uid), address, egress_policy(net), uplink=net.mode == NetMode.USER)
    except (NetError, NftError) as exc:
        raise MachineError(f"cannot set up the sandbox's network again: {exc}") from None


def set_policy(link: SandboxLink | None, policy: EgressPolicy) -> None:
    """A warm pool member taken by a Create: the caller's egress policy."""
    if link is None or link.policy == policy:
        return
    try:
        link.set_policy(policy)
    except NftError as exc:
        raise MachineError(f"cannot apply the egress policy: {exc}") from None


async def configure_guest_net(guest: Guest, net: NetConfig | None) -> None:
    """A restored tap guest wakes up with its origin's address, MAC and resolver:
    this sandbox's own, before it is reported ready (guestd's net_config, ~1 ms)."""
    if net is None or not net.tap:
        return
    try:
        await guest.channel.net_config(net.address, net.prefix, net.gateway, [net.dns], net.mac)
    except GuestError as exc:
        raise MachineError(f"post-restore network configuration failed: {exc}") from None
