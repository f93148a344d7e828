"""A running sandbox's vCPUs and memory set below its machine's ceilings (Modify, and
every boot), its root filesystem grown to its disk, and what was applied recorded.

The machine boots with its ceilings (actors/sandboxes/life.py: ``-smp max_vcpus``
with ``maxcpus=vcpus`` on the kernel command line, ``-m max_memory``); here:

* memory: QMP ``balloon`` to the value; the guest's balloon driver (no
  deflate-on-oom: it takes the pages out of the guest's managed memory, so MemTotal
  follows) inflates or deflates; settled when ``query-balloon``'s ``actual`` is the
  target. QEMU discards inflated pages (anonymous RAM: given back to the host; a
  mapped snapshot's memory: only the private copies, docs/modify.md).
* vCPUs: guestd's ``set_cpus`` (CPU hotplug in the guest, synchronous) and the
  cell's cgroup CPU ceiling (vCPUs + the jail's headroom) and weight, at once.
* disk: guestd's ``grow_root`` (EXT4_IOC_RESIZE_FS, online) at a boot whose overlay
  was grown (life.py grows it before QEMU opens it).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import attrs
import trio

from actors import defaults
from actors.cells.cell import Cell
from actors.cells.cgroups import CgroupError, CgroupLimits
from actors.channel.guest import GuestOpError
from actors.errors import FailedPrecondition
from actors.machines.disk import DiskError, virtual_size
from actors.machines.qemuproc import MachineError
from actors.machines.vm import Guest
from actors.model import Applied, Limits
from actors.sandboxes.files import SandboxFiles
from actors.sandboxes.logs import SandboxLog
from actors.store import Record


class TuneOwner(Protocol):
    """What tuning uses of a sandbox (the Sandbox is one; it is not imported here)."""

    record: Record
    files: SandboxFiles
    log: SandboxLog

    @property
    def id(self) -> str: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def guest(self) -> Guest | None: ...

    @property
    def cell(self) -> Cell | None: ...

    def note_applied(self, applied: Applied) -> None: ...


log = logging.getLogger("sandvisor.tune")

MIB = 1 << 20
BALLOON_POLL = 0.1  # s: query-balloon while the guest moves toward the target


@attrs.frozen
class Machine:
    """A running sandbox's machine as Modify sees it: its ceilings, whether it has a
    balloon, its root disk's size now (MiB)."""

    max_vcpus: int
    max_memory_mib: int
    balloon: bool
    disk_mib: int
    # its RAM is a snapshot's (a boot template's) memory mapped copy-on-write: the balloon
    # cannot give memory back, it costs some (docs/modify.md)
    mapped: bool = False


@attrs.frozen
class Resize:
    """One resource of a live resize as known once Modify answers: ``requested`` (the
    sandbox's value), ``actual`` (the guest's: vCPUs online by guestd's answer, the
    memory query-balloon says the guest has given up to), ``enforced`` (what the host
    holds: the cgroup CPU ceiling in vCPUs; the balloon target QEMU asks for), and
    ``state``: settled (all three agree), converging (the balloon still moving when
    the wait ended), guest-refused (the guest did not do it: set_cpus failed, or the
    balloon did not move at all)."""

    resource: str  # "cpus" | "memory"
    requested: int
    actual: int
    enforced: int
    state: str  # SETTLED | CONVERGING | GUEST_REFUSED
    why: str = ""


SETTLED = "settled"
CONVERGING = "converging"
GUEST_REFUSED = "guest-refused"


def machine_of(sb: TuneOwner) -> Machine:
    """The running machine's ceilings, balloon and disk (FAILED_PRECONDITION: none)."""
    guest = sb.guest
    if guest is None:
        raise FailedPrecondition(f"sandbox {sb.id} has no running machine")
    spec = guest.machine.spec
    applied = sb.record.applied
    return Machine(
        max_vcpus=spec.cpus,
        max_memory_mib=spec.memory_mib,
        balloon=spec.balloon,
        disk_mib=applied.disk_mib if applied is not None else disk_mib(sb),
        mapped=mapped(guest),
    )


def mapped(guest: Guest) -> bool:
    """The guest's RAM is a snapshot's memory mapped privately (copy-on-write)."""
    m = guest.machine.spec
    return m.memory_file is not None and not m.memory_shared


def disk_mib(sb: TuneOwner) -> int:
    """The root disk's size now (MiB): its overlay's, or what its first boot will make."""
    try:
        return -(-virtual_size(sb.files.disk) // MIB)
    except (DiskError, OSError):
        return sb.limits.disk_mib


async def apply_live(sb: TuneOwner) -> tuple[tuple[Resize, ...], float]:
    """The sandbox's vCPUs and memory given to its running guest now; (how each
    resource stands, seconds)."""
    guest = sb.guest
    if guest is None:
        raise FailedPrecondition(f"sandbox {sb.id} has no running machine")
    t0 = time.monotonic()
    resized = await _settle(sb, guest)
    return resized, time.monotonic() - t0


async def at_boot(sb: TuneOwner, guest: Guest, *, fresh: bool) -> None:
    """A life's guest given the sandbox's vCPUs and memory before it is ready (a
    restore's machine is its snapshot's: the same moves), its root filesystem grown
    (``fresh``: a boot, of an overlay that may have grown; its vCPUs above the value
    are offline already: maxcpus)."""
    chan = guest.channel
    if fresh and sb.limits.disk_mib and chan.has_feature("resources"):
        try:
            size = await chan.grow_root()
            sb.log.append("system", f"root filesystem: {size >> 20} MiB".encode())
        except GuestOpError as exc:  # an image whose root is not ext4, say: it boots as it is
            sb.log.append("system", f"root filesystem not grown: {exc}".encode())
    await _settle(sb, guest, boot=True)


async def _settle(sb: TuneOwner, guest: Guest, *, boot: bool = False) -> tuple[Resize, ...]:
    """Balloon target, CPUs online, CPU quota; wait for the balloon; record what applies.
    ``boot``: before ready, where a machine without ceilings needs nothing (all its vCPUs
    online, its balloon empty; a snapshot's configuration matches its machine): no
    request then, so a boot or restore costs nothing more."""
    spec, chan, limits = guest.machine.spec, guest.channel, sb.limits
    vcpus = min(limits.vcpus, spec.cpus)
    memory = min(limits.memory_mib, spec.memory_mib) if spec.balloon else spec.memory_mib
    online, cpu_why = vcpus, ""
    if chan.has_feature("resources") and (vcpus != spec.cpus or not boot):
        try:
            online = await chan.set_cpus(vcpus)
        except GuestOpError as exc:  # the guest's answer (its sysfs is its own): not settled, not fatal
            sb.log.append("system", f"vCPUs not set: {exc}".encode())
            online, cpu_why = 0, f"the guest did not set its CPUs: {exc}"
    cell = sb.cell
    enforced_cpus = 0  # no cgroup: the machine's vCPUs online are the only bound
    if cell is not None and cell.cgroup is not None:
        try:
            # the jail's rule for a machine of ``vcpus`` (its ceiling: vCPUs + headroom; its weight)
            cell.cgroup.set_cpu(CgroupLimits.for_guest(spec.memory_mib, vcpus))
            enforced_cpus = vcpus
        except CgroupError as exc:
            log.warning("sandbox %s: CPU quota: %s", sb.id, exc)
    settled = online == vcpus
    cpus = Resize(
        "cpus",
        vcpus,
        online,
        enforced_cpus or online,
        SETTLED if settled else GUEST_REFUSED,
        cpu_why
        or (
            "vCPUs online in the guest; the jail's cgroup CPU ceiling follows (vCPUs + its headroom)"
            if enforced_cpus
            else "vCPUs online in the guest (no cgroup: they are the only bound)"
        ),
    )
    actual = memory
    mem_state, mem_why = SETTLED, ""
    if spec.balloon and (memory != spec.memory_mib or not boot):
        try:
            start = int((await guest.machine.qmp_execute("query-balloon")).get("actual", 0)) // MIB
            if mapped(guest):
                # never inflate over a snapshot's mapped memory: the guest zeroes what it
                # gives the balloon (init_on_alloc), so every page taken that the clone
                # had not touched becomes a page of the shared memfd, charged to this
                # clone, that no discard frees (measured: docs/modify.md)
                memory = max(memory, start)
            actual = await _balloon(guest, memory)
            if actual != memory:
                mem_state = CONVERGING if actual != start else GUEST_REFUSED
                mem_why = (
                    f"the balloon moved {start} -> {actual} MiB of {memory} in the wait: QEMU keeps the target"
                    if actual != start
                    else f"the guest's balloon driver did not move from {start} MiB in the wait"
                )
        except MachineError as exc:
            log.warning("sandbox %s: balloon: %s", sb.id, exc)
            actual, mem_state, mem_why = 0, GUEST_REFUSED, f"the balloon: {exc}"
        settled = settled and actual == memory
    sb.note_applied(
        Applied(
            vcpus=online,
            memory_mib=actual,
            max_vcpus=spec.cpus,
            max_memory_mib=spec.memory_mib,
            disk_mib=disk_mib(sb),
            balloon=spec.balloon,
            settled=settled,
        )
    )
    mem = Resize(
        "memory",
        memory,
        actual,
        memory if spec.balloon else spec.memory_mib,
        mem_state,
        mem_why
        or (
            "through the balloon (the guest's cooperation); the host's hard bound is the jail's cgroup limit, "
            f"counted at the ceiling of {spec.memory_mib} MiB"
            if spec.balloon
            else "no balloon: the machine's memory is its RAM"
        ),
    )
    return cpus, mem


async def _balloon(guest: Guest, memory_mib: int) -> int:
    """Ask the balloon for ``memory_mib`` of guest memory; wait (bounded) until the guest
    has it; the MiB it has then."""
    vm = guest.machine
    await vm.qmp_execute("balloon", {"value": memory_mib * MIB})
    actual = memory_mib
    with trio.move_on_after(defaults.MODIFY_SETTLE_TIMEOUT):
        while True:
            info = await vm.qmp_execute("query-balloon")
            actual = int(info.get("actual", 0)) // MIB
            if actual == memory_mib:
                break
            await trio.sleep(BALLOON_POLL)
    return actual
