"""The IP pool of tap networking: one IPv4 address per sandbox, from ``serve --ip-pool CIDR``.

Pure bookkeeping (no I/O but the persistence callback): who holds which address.
An address is held by an *owner* (the sandbox's uid, never its user-chosen id)
from Create (sandbox.v1's CreateSandboxResponse.ip_address is known while the
sandbox is still starting) until Remove; a stopped sandbox keeps its address, and
the leases survive a supervisor restart through a :class:`LeaseStore`.

Layout of a pool, e.g. ``10.88.0.0/16``::

    10.88.0.0      network            never leased
    10.88.0.1      gateway            the host: bridge `sandvisor0` and every sandbox link
    10.88.0.2 ...  sandboxes          leased next-fit (a released address is reused last)
    10.88.255.255  broadcast          never leased

Next-fit (a cursor that moves on) rather than lowest-free: an address that was
just released (a removed sandbox, whose peers may still hold ARP entries, TCP
state or DNS answers for it) is handed out again only after every other free one.

Persistence: every change goes to the store *before* it is applied in memory, so
a store that refuses it leaves both as they were and the caller gets the
exception. The supervisor's store is ``actors.store.StoreLeases`` (a table next to
the sandboxes, written by the store's writer in order with their records: a lease
is on disk once the Create that made it has answered); :class:`MemoryLeases`
serves tests.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable
from ipaddress import IPv4Address, IPv4Network
from typing import Protocol

from actors.defaults import IP_POOL

MIN_PREFIX = 8
MAX_PREFIX = 29  # a /29 holds 5 sandboxes: smaller pools are a configuration mistake
DEFAULT_POOL = IP_POOL

# MACs: locally administered, unicast (first octet 0x02). A sandbox's MAC is derived
# from its address (unique while the address is leased; a clone with a fresh address
# gets a fresh MAC); every host-side link has the same fixed MAC (each link is its own
# L2 segment), so a restored guest's neighbour entry for its gateway stays valid.
GUEST_MAC_PREFIX = (0x02, 0x73, 0x76)  # 02:73:76 = "sv"
GATEWAY_MAC = "02:73:77:00:00:01"
LINK_PREFIX = "svn"  # every sandbox link (tap or veth) on the host: "svn" + 12 hex digits
IFNAMSIZ = 16  # including the NUL: names have at most 15 characters


class PoolError(ValueError):
    """A pool that cannot be used (bad CIDR, too small, IPv6)."""


class PoolExhausted(Exception):
    """Every address of the pool is leased (the API's RESOURCE_EXHAUSTED)."""


class LeaseStore(Protocol):
    """Where leases persist. ``put`` and ``delete`` happen before the in-memory change."""

    def load(self) -> Iterable[tuple[str, str]]: ...
    def put(self, owner: str, address: str) -> None: ...
    def delete(self, owner: str) -> None: ...


class MemoryLeases:
    def __init__(self, rows: Iterable[tuple[str, str]] = ()) -> None:
        self.rows: dict[str, str] = dict(rows)

    def load(self) -> Iterable[tuple[str, str]]:
        return list(self.rows.items())

    def put(self, owner: str, address: str) -> None:
        self.rows[owner] = address

    def delete(self, owner: str) -> None:
        self.rows.pop(owner, None)


def parse_pool(cidr: str) -> IPv4Network:
    try:
        net = ipaddress.ip_network(cidr, strict=True)
    except ValueError as exc:
        raise PoolError(f"--ip-pool {cidr!r}: {exc}") from None
    if not isinstance(net, IPv4Network):
        raise PoolError(f"--ip-pool {cidr!r}: only IPv4 pools are supported")
    if not MIN_PREFIX <= net.prefixlen <= MAX_PREFIX:
        raise PoolError(f"--ip-pool {cidr!r}: the prefix must be /{MIN_PREFIX} to /{MAX_PREFIX}")
    if net.is_loopback or net.is_link_local or net.is_multicast or net.is_reserved or net.is_unspecified:
        raise PoolError(f"--ip-pool {cidr!r}: not a unicast range")
    return net


class IpPool:
    """Leases of one pool. Not thread-safe: called from the Trio thread only."""

    def __init__(self, cidr: str, store: LeaseStore | None = None) -> None:
        self.network = parse_pool(cidr)
        self.store: LeaseStore = store if store is not None else MemoryLeases()
        self.gateway = self.network.network_address + 1
        self._first = int(self.network.network_address) + 2
        self._last = int(self.network.broadcast_address) - 1
        self._by_owner: dict[str, int] = {}
        self._by_addr: dict[int, str] = {}
        self.dropped: list[tuple[str, str]] = []  # leases found in the store that do not fit
        for owner, addr in self.store.load():
            self._adopt(owner, addr)
        self._cursor = max(self._by_addr, default=self._first - 1)

    def _adopt(self, owner: str, addr: str) -> None:
        try:
            a = int(IPv4Address(addr))
        except ValueError:
            a = -1
        if not self._first <= a <= self._last or a in self._by_addr or owner in self._by_owner:
            # the pool changed between runs (or the row is damaged): the lease goes
            self.dropped.append((owner, addr))
            self.store.delete(owner)
            return
        self._by_owner[owner] = a
        self._by_addr[a] = owner

    @property
    def prefix(self) -> int:
        return self.network.prefixlen

    @property
    def size(self) -> int:
        """How many sandboxes the pool holds."""
        return self._last - self._first + 1

    def __len__(self) -> int:
        return len(self._by_owner)

    def allocate(self, owner: str, want: IPv4Address | None = None) -> IPv4Address:
        """The owner's address: the one it holds, else ``want`` when that is a free
        sandbox address of the pool (a restore keeping its snapshot's address), else a
        free one (next-fit)."""
        if owner in self._by_owner:
            return IPv4Address(self._by_owner[owner])
        if len(self._by_owner) >= self.size:
            raise PoolExhausted(f"the IP pool {self.network} is exhausted ({self.size} addresses leased)")
        cursor = self._cursor
        if want is not None and self._first <= int(want) <= self._last and int(want) not in self._by_addr:
            a = int(want)  # (the cursor stays: a wanted address is not the next-fit's doing)
        else:
            a = cursor
            while True:
                a = a + 1 if a < self._last else self._first
                if a not in self._by_addr:
                    break
            cursor = a
        address = IPv4Address(a)
        self.store.put(owner, str(address))
        self._by_owner[owner] = a
        self._by_addr[a] = owner
        self._cursor = cursor
        return address

    def release(self, owner: str) -> IPv4Address | None:
        """Give the owner's address back; None when it held none (idempotent)."""
        a = self._by_owner.get(owner)
        if a is None:
            return None
        self.store.delete(owner)
        del self._by_owner[owner]
        del self._by_addr[a]
        return IPv4Address(a)

    def address_of(self, owner: str) -> IPv4Address | None:
        a = self._by_owner.get(owner)
        return None if a is None else IPv4Address(a)

    def owner_of(self, address: IPv4Address | str) -> str | None:
        return self._by_addr.get(int(IPv4Address(address)))

    def leases(self) -> dict[str, IPv4Address]:
        return {o: IPv4Address(a) for o, a in self._by_owner.items()}


def guest_mac(address: IPv4Address) -> str:
    """The sandbox's MAC: 02:73:76 and the address's last three octets."""
    b = address.packed
    return ":".join(f"{x:02x}" for x in (*GUEST_MAC_PREFIX, b[1], b[2], b[3]))


def link_name(owner: str) -> str:
    """The host-side link (TAP) name of a sandbox: ``svn`` + 12 hex digits of a hash of
    its uid (15 characters: IFNAMSIZ). A collision (48 bits) is caught by the TAP's
    IFF_TUN_EXCL: creating a name that exists fails instead of attaching to it."""
    name = LINK_PREFIX + hashlib.sha256(owner.encode()).hexdigest()[:12]
    assert len(name) < IFNAMSIZ
    return name
