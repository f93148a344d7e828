"""Who a sandbox is and where it is on its network, read from its record and the
supervisor's settings: its id, state, configuration, effective limits, hostname,
guest network and addresses, egress policy, and its pool address's lease. The
:class:`~actors.sandboxes.sandbox.Sandbox` is one (and the one writer of the record)."""

from __future__ import annotations

from ipaddress import IPv4Address

from actors.machines.vm import NetConfig
from actors.model import Limits, SandboxConfig, State
from actors.net import netlink
from actors.net.egress import EgressPolicy
from actors.rules import default_hostname
from actors.settings import Settings
from actors.store import Record


class Identity:
    """What a sandbox's record and settings say about it (nothing here writes the record)."""

    record: Record
    settings: Settings

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> State:
        return self.record.state

    @property
    def config(self) -> SandboxConfig:
        return self.record.config

    @property
    def limits(self) -> Limits:
        """The effective resources, as resolved when the sandbox was made (or Modify
        changed them): never the supervisor's defaults of now."""
        limits = self.record.limits
        assert limits is not None  # (resolved by Sandbox.__init__)
        return limits

    @property
    def hostname(self) -> str:
        return self.config.hostname or default_hostname(self.id)

    @property
    def network(self) -> NetConfig | None:
        """The guest's network (user: slirp's fixed addresses; tap: its pool address,
        None until it has one)."""
        return netlink.guest_net(self.settings, self.config.network, self.record.uid)

    @property
    def ip_address(self) -> str:
        net = self.network
        return net.address if net else ""

    @property
    def gateway(self) -> str:
        net = self.network
        return net.gateway if net else ""

    @property
    def tap_name(self) -> str:
        net = self.network
        return net.tap_name if net else ""

    @property
    def pool_address(self) -> IPv4Address | None:
        """Its IP pool address (tap: the guest's; user mode with outbound in a jail: its
        uplink's), held from Create to Remove: a stopped sandbox keeps it."""
        return netlink.pool_address(self.settings, self.record.uid)

    @property
    def egress(self) -> EgressPolicy:
        return netlink.egress_policy(self.config.network)

    def lease(self, want: str = "") -> None:
        """Hold a pool address when the network needs one (see :func:`netlink.lease`)."""
        netlink.lease(self.settings, self.config.network, self.record.uid, want)

    def release_lease(self) -> None:
        """The address goes back to the pool (Remove)."""
        netlink.release_lease(self.settings, self.record.uid)
