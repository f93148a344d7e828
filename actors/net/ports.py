"""A life's exposed ports: the forwards and relays one QEMU life holds.

User mode, unjailed: QEMU's slirp binds the host port itself (HMP ``hostfwd_add``).
Jailed, slirp lives in QEMU's network namespace (empty, or its uplink's): its forward
listens on that namespace's loopback, on the same port number, and a relay task of
ours holds the host port and carries each connection (or UDP flow) there through a
socket made in the namespace. Tap: a relay from the host port to the sandbox's
address (actors/net/portfwd.py says why not a DNAT). A restarted supervisor re-creates
the relays of an adopted QEMU (``relay_only``: its forwards live in QEMU still).

:class:`Exposed` (one per sandbox) holds the record's mappings, across lives.

:class:`PortRelays` is owned by a :class:`~actors.sandboxes.life.Life`: its relays run in the
life's relay nursery and end with it. The record's ``ports`` (what is exposed,
across lives) is the sandbox's; this module only makes a mapping real.
"""

from __future__ import annotations

import socket
import typing
from collections.abc import Awaitable, Callable

import attrs
import trio

from actors.errors import AlreadyExists, FailedPrecondition, NotFound
from actors.machines.vm import NETDEV_ID, Guest, NetConfig
from actors.model import PortSpec, Protocol
from actors.net.hostnet import HostNetwork
from actors.net.netns import NetNS
from actors.net.portfwd import PortInUse, Target, bind_listener, relay_tcp, relay_udp
from actors.store import Record


class PortSettings(typing.Protocol):
    """What port relays need of the supervisor's settings (actors/settings.py's ``Settings``
    is one; the settings sit above the network, which never imports them)."""

    @property
    def expose_address(self) -> str: ...

    @property
    def hostnet(self) -> HostNetwork | None: ...

    def bind_address(self, pm: PortSpec) -> str: ...

    def check_bind_address(self, address: str) -> None: ...


class Exposed:
    """A sandbox's exposed ports: the record's mappings (across lives: the next life
    forwards them again), changed one call at a time. It reads the sandbox's
    ``record``; ``save`` (the sandbox's) stores the mappings it changed."""

    def __init__(self, record: Record, save: Callable[[list[PortSpec]], None]) -> None:
        self.record, self.save = record, save
        self._lock = trio.Lock()

    async def expose(self, wanted: PortSpec, net: NetConfig | None, relays: PortRelays | None) -> PortSpec:
        """Forward ``wanted`` in the serving life (``relays``). A port that is exposed
        already answers with its mapping (a retried call is safe), unless the call names
        another host port or address for it (ALREADY_EXISTS)."""
        rec = self.record
        if net is None:
            raise FailedPrecondition(f"sandbox {rec.id} has no network (create it with network mode 'tap' or 'user')")
        if wanted.protocol == Protocol.UDP and net.restrict:
            raise FailedPrecondition(
                "QEMU's restricted user networking drops the guest's UDP replies (measured); expose UDP on a "
                "sandbox created with outbound networking allowed"
            )
        async with self._lock:
            for p in rec.ports:
                if p.key == wanted.key:
                    if wanted.host_port in (0, p.host_port) and wanted.host_address in ("", p.host_address):
                        return p  # idempotent: the mapping as it is
                    raise AlreadyExists(
                        f"port {wanted.label()} is exposed already, on {p.host_address or 'the default address'} "
                        f"port {p.host_port}"
                    )
            if relays is None:
                raise FailedPrecondition(f"sandbox {rec.id} is {rec.state}, not ready or running")
            pm = await relays.forward(wanted)  # (its own bind address, checked there)
            self.save([*rec.ports, pm])
        return pm

    async def unexpose(
        self, key: tuple[int, Protocol], relays: PortRelays | None, *, hostfwd: Callable[[], bool]
    ) -> None:
        """Undo a mapping: QEMU's forward while it serves (``hostfwd()``), the relay."""
        async with self._lock:
            match = [p for p in self.record.ports if p.key == key]
            if not match:
                raise NotFound(f"port {key[0]}/{key[1]} is not exposed")
            pm = match[0]
            if relays is not None:
                await relays.unforward(pm, hostfwd=hostfwd())
            self.save([p for p in self.record.ports if p is not pm])


class PortRelays:
    """The forwards of one life's guest: HMP host forwards and relay tasks (in
    ``nursery``, the life's), each relay in its own cancel scope (Unexpose cancels it)."""

    def __init__(
        self,
        settings: PortSettings,
        guest: Guest,
        net: NetConfig | None,
        *,
        jailed: bool,
        nursery: trio.Nursery,
        held: Callable[[PortSpec], socket.socket | None] | None = None,
    ) -> None:
        self.settings = settings
        self.guest = guest
        self.net = net
        self.jailed = jailed
        self._nursery = nursery
        self._relays: dict[tuple[int, Protocol], trio.CancelScope] = {}
        self._held = held  # a resumed sandbox's listeners, held while it was paused

    async def forward(self, pm: PortSpec, *, relay_only: bool = False) -> PortSpec:
        """Forward ``pm``; the host port it got."""
        addr = self.settings.bind_address(pm)
        self.settings.check_bind_address(addr)  # (again at each life: the operator may have closed it)
        net, guest = self.net, self.guest
        if net is not None and net.tap:
            return await self._forward_tap(net, pm)
        if not self.jailed:
            host_port = pm.host_port or free_port(addr, pm.protocol)
            await self._hostfwd(f"{pm.protocol}:{addr}:{host_port}-:{pm.sandbox_port}", host_port, pm)
            return attrs.evolve(pm, host_port=host_port)

        async def inside_cell(host_port: int) -> Target:
            # QEMU's hostfwd listens on the cell's own loopback, on the same port number
            if not relay_only:
                await self._hostfwd(f"{pm.protocol}:127.0.0.1:{host_port}-:{pm.sandbox_port}", host_port, pm)
            return Target("127.0.0.1", host_port, NetNS(file=f"/proc/{guest.machine.pid}/ns/net"))

        return await self._relay_from_host(pm, inside_cell)

    async def unforward(self, pm: PortSpec, *, hostfwd: bool) -> None:
        """Undo ``pm``'s forward (``hostfwd``: QEMU's too, while it serves) and its relay."""
        net = self.net
        if hostfwd and not (net is not None and net.tap):
            where = "127.0.0.1" if self.jailed else self.settings.bind_address(pm)
            reply = await self.guest.machine.hmp(f"hostfwd_remove {NETDEV_ID} {pm.protocol}:{where}:{pm.host_port}")
            if reply.strip() and "removed" not in reply:  # success is reported as text too
                raise FailedPrecondition(f"hostfwd_remove: {reply.strip()[:200]}")
        relay = self._relays.pop(pm.key, None)
        if relay is not None:
            relay.cancel()

    async def _forward_tap(self, net: NetConfig, pm: PortSpec) -> PortSpec:
        """A relay from the host port to the sandbox's address (sandbox.v1's design: "the daemon
        binds a host listener"). The host reaches every sandbox; the filter stops only
        what sandboxes send."""
        hn = self.settings.hostnet
        assert hn is not None

        async def sandbox_address(host_port: int) -> Target:
            return Target(net.address, pm.sandbox_port, hn.netns)

        return await self._relay_from_host(pm, sandbox_address)

    async def _relay_from_host(self, pm: PortSpec, target_for: Callable[[int], Awaitable[Target]]) -> PortSpec:
        """Bind the host listener for ``pm`` (its port, or any), then relay it to the
        target ``target_for(host_port)`` names; the listener closes if that fails."""
        addr = self.settings.bind_address(pm)
        kind = socket.SOCK_DGRAM if pm.protocol == Protocol.UDP else socket.SOCK_STREAM
        try:
            listener = (self._held(pm) if self._held is not None else None) or bind_listener(addr, pm.host_port, kind)
        except PortInUse:
            raise AlreadyExists(f"host port {pm.host_port}/{pm.protocol} is in use on {addr}") from None
        host_port = int(listener.getsockname()[1])
        try:
            target = await target_for(host_port)
            relay = relay_udp if kind == socket.SOCK_DGRAM else relay_tcp
            scope = await self._nursery.start(_relay, relay, listener, target)
        except BaseException:
            listener.close()
            raise
        self._relays[pm.key] = scope
        return attrs.evolve(pm, host_port=host_port)

    async def _hostfwd(self, rule: str, host_port: int, pm: PortSpec) -> None:
        reply = await self.guest.machine.hmp(f"hostfwd_add {NETDEV_ID} {rule}")
        if reply.strip():  # HMP reports failure as text, not as a QMP error
            if "host forwarding" in reply.lower():
                raise AlreadyExists(
                    f"host port {host_port}/{pm.protocol} is in use on {self.settings.bind_address(pm)}"
                )
            raise FailedPrecondition(f"hostfwd_add: {reply.strip()[:200]}")


async def _relay(
    relay: Callable[..., Awaitable[None]],
    listener: socket.socket,
    target: Target,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One mapping's relay, in its own cancel scope (Unexpose cancels it)."""
    with trio.CancelScope() as scope:
        await relay(listener, target, task_status=_Started(task_status, scope))


class _Started:
    """Passes the relay's ``started`` on as its cancel scope."""

    def __init__(self, outer: trio.TaskStatus[trio.CancelScope], scope: trio.CancelScope) -> None:
        self.outer, self.scope = outer, scope

    def started(self, value: object = None) -> None:
        self.outer.started(self.scope)


def free_port(address: str, protocol: str) -> int:
    """A port nobody listens on right now (the kernel's choice)."""
    kind = socket.SOCK_DGRAM if protocol == Protocol.UDP else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
