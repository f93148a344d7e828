"""A sandbox life's cell: the jail, cgroup, identity and RAM file one QEMU runs in.

When the supervisor is root, every QEMU runs in a cell (Firecracker's
jailer is the model)::

    Cells (one per supervisor)             Cell (one per VM life; made before QEMU, gone after its reap)
      IdentityAllocator  uids 1.9e9+   ->    identity    its own uid = gid, recorded with the sandbox
      CgroupManager      v1 or v2,     ->    cgroup      memory = RAM + overhead, pids, CPU quota
                         sandvisor-<state dir key>
      jail helper        (C, vforked)  ->    jail dir    <run_dir>/root: /usr ro, devices, /proc, /run
      private RAM dir    0700, checked ->    RAM file    O_EXCL|O_NOFOLLOW, the identity's, 0600
      SealedMemoryCache                ->    (restores)  snapshot memory as a sealed memfd

and QEMU is spawned by :func:`actors.cells.jail.spawn` into new mount, pid, ipc, uts,
cgroup and network namespaces, ``pivot_root``-ed into the jail dir, with no
capabilities, no_new_privs, rlimits, and only the descriptors it is given. Its
sockets are in the jail's ``/run``, which the host reaches at ``<jail>/run``.

A cell is torn down by :meth:`Cell.close` after QEMU is reaped: cgroup, jail dir,
RAM file, identity. An adopted QEMU (a previous supervisor's) gets its cell back
with :meth:`Cells.reopen` from what its sandbox recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from pathlib import Path

import attrs

from actors import defaults
from actors.cells import jail
from actors.cells.cgroups import Cgroup, CgroupError, CgroupLimits, CgroupManager
from actors.cells.cgroups import find as find_cgroups
from actors.cells.guestmem import SealedMemoryCache, create_ram_file, private_dir, remove_ram_file
from actors.cells.identities import DEFAULT_ID_COUNT, DEFAULT_ID_FIRST, Identity, IdentityAllocator, JailError
from actors.cells.toolcell import ToolCells

log = logging.getLogger("sandvisor.cell")

SOCKET_DIR = "/run"  # QEMU's socket dir, in the jail


@attrs.frozen
class JailConfig:
    """How QEMUs are jailed (``serve``'s options)."""

    first_uid: int = DEFAULT_ID_FIRST
    uid_count: int = DEFAULT_ID_COUNT
    overhead_mib: int = defaults.JAIL_OVERHEAD_MIB  # memory limit = guest RAM + this (QEMU, its TCG cache, page cache)
    sealed_budget_mib: int = 1024  # sealed snapshot memory kept for later restores


@attrs.frozen
class Uplink:
    """The network namespace a jailed QEMU runs in instead of an empty one: made by
    actors/net/hostnet.py (a veth to the supervisor's filter: user-mode networking with
    outbound access), with ``resolv_conf`` as the jail's /etc/resolv.conf (slirp
    forwards the guest's DNS queries to the resolver it names: the DNS proxy)."""

    netns: Path  # /run/netns/NAME
    resolv_conf: Path  # a file of the supervisor's, bound read-only

    def into(self, spec: jail.JailSpec) -> jail.JailSpec:
        return attrs.evolve(
            spec,
            netns=self.netns,
            loopback=False,  # (the network layer brought it up)
            binds=(*spec.binds, jail.Bind(self.resolv_conf, "/etc/resolv.conf")),
        )


class Cell:
    """One life's jail, cgroup, identity and RAM file."""

    def __init__(
        self,
        cells: Cells,
        name: str,
        identity: Identity,
        spec: jail.JailSpec,
        cgroup: Cgroup | None,
    ) -> None:
        self.cells = cells
        self.name = name
        self.identity = identity
        self.spec = spec
        self.cgroup = cgroup
        self.ram: Path | None = None
        self._closed = False

    @property
    def sock_dir(self) -> Path:
        """QEMU's socket dir, as the host reaches it."""
        return self.spec.socket_host_dir

    @property
    def qemu_dir(self) -> Path:
        return Path(self.spec.socket_dir)

    async def spawn(
        self, argv: list[str], fds: tuple[int, ...], stderr: int, env: dict[str, str]
    ) -> jail.JailedProcess:
        """QEMU in this cell (a ``Machine``'s spawner; a refused step is a ``JailError``,
        which the machine reports as its ``LaunchError``)."""
        return await jail.spawn(
            argv,
            self.spec,
            pass_fds=fds,
            env=env,
            cgroup_procs=self.cgroup.procs_files() if self.cgroup else (),
            stderr_fd=stderr,
            helper=self.cells.helper,
        )

    def make_ram(self, size_mib: int) -> tuple[Path, int]:
        """The life's RAM file, the identity's: its path (for checkpoints) and a descriptor for QEMU."""
        directory = self.cells.ram_dir
        if directory is None:
            raise JailError("no RAM dir: guest RAM is anonymous")
        fd = create_ram_file(directory, f"{self.name}.ram", size_mib << 20, self.identity)
        self.ram = directory / f"{self.name}.ram"
        return self.ram, fd

    def oom_killed(self) -> bool:
        if self.cgroup is None:
            return False
        with contextlib.suppress(CgroupError, OSError):
            return self.cgroup.oom_kills() > 0
        return False

    def close(self) -> None:
        """After QEMU's reap: everything of the cell goes (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.cgroup is not None:
            with contextlib.suppress(CgroupError, OSError):
                self.cgroup.kill_all()  # nothing may outlive the QEMU it was made for
            try:
                self.cgroup.remove()
            except (CgroupError, OSError) as exc:
                log.warning("cell %s: cgroup: %s", self.name, exc)
        try:
            jail.remove_jail(self.spec.root)
        except JailError as exc:
            log.warning("cell %s: %s", self.name, exc)
        if self.ram is not None and self.cells.ram_dir is not None:
            with contextlib.suppress(OSError):
                remove_ram_file(self.cells.ram_dir, self.ram.name)
        self.cells.allocator.release(self.identity)


class Cells:
    """The jailer of one supervisor."""

    def __init__(
        self,
        config: JailConfig,
        *,
        helper: Path,
        cgroups: CgroupManager | None,
        allocator: IdentityAllocator,
        ram_dir: Path | None,
        kvm: bool,
        discard_shim: Path | None = None,
    ) -> None:
        self.config = config
        self.helper = helper  # sandvisor-jail-exec, as built at install (actors/helpers.py)
        self.discard_shim = discard_shim  # preloaded into QEMUs with a balloon on a sealed memfd
        self.cgroups = cgroups
        self.allocator = allocator
        self.ram_dir = ram_dir
        self.kvm = kvm
        self.sealed = SealedMemoryCache(config.sealed_budget_mib << 20)
        self.tools: ToolCells | None = None  # host tools on hostile data, in cells (actors/cells/toolcell.py)

    @classmethod
    def setup(
        cls,
        config: JailConfig,
        *,
        helper: Path,
        discard_shim: Path | None,
        state_dir: Path,
        ram_dir: Path | None,
        kvm: bool,
        cgroups: bool = True,
    ) -> Cells:
        """At start, given the helpers serve checked (``helpers.installed``; no shim:
        no balloons): the cgroup hierarchy (v2 or v1, mounted privately where none is
        visible; none: CgroupError, the supervisor does not start -- unless ``cgroups``
        is False, serve --no-cgroups: then none is used, with a warning), the identity
        range (refused if it touches real ids; ids owned by running processes stay
        taken), the RAM dir (made 0700, or refused if someone else made it)."""
        # one parent per state dir: two supervisors on a host never sweep each other's cgroups
        key = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
        manager: CgroupManager | None = None
        if cgroups:
            try:
                manager = find_cgroups(parent=f"sandvisor-{key}")
            except CgroupError as exc:  # fail closed: never an unlimited QEMU the operator did not ask for
                raise CgroupError(
                    f"{exc}: QEMUs would run without memory, process and CPU limits; not starting "
                    "(serve --no-cgroups runs them so)"
                ) from None
        else:
            log.warning("serve --no-cgroups: QEMUs run without resource limits (memory, processes, CPU)")
        allocator = IdentityAllocator(config.first_uid, config.uid_count)
        allocator.adopt_running()
        cells = cls(
            config,
            helper=helper,
            cgroups=manager,
            allocator=allocator,
            ram_dir=private_dir(ram_dir) if ram_dir is not None else None,
            kvm=kvm,
            discard_shim=discard_shim,
        )
        cells.tools = ToolCells(cells, state_dir / "toolcells")  # (its id range is checked: JailError)
        return cells

    def _spec(self, identity: Identity, run_dir: Path, hostname: str, uplink: Uplink | None = None) -> jail.JailSpec:
        spec = jail.JailSpec(
            identity=identity, root=run_dir / "root", kvm=self.kvm, socket_dir=SOCKET_DIR, hostname=hostname[:63]
        )
        return spec if uplink is None else uplink.into(spec)

    def _limits(self, memory_mib: int, vcpus: int) -> CgroupLimits:
        return CgroupLimits.for_guest(memory_mib, vcpus, overhead_mib=self.config.overhead_mib)

    def open(
        self,
        name: str,
        run_dir: Path,
        *,
        memory_mib: int,
        vcpus: int,
        hostname: str = "sandbox",
        uplink: Uplink | None = None,
    ) -> Cell:
        """A new cell in ``run_dir`` (which exists, root's): identity, jail dir, cgroup;
        QEMU's network namespace an empty one, or ``uplink``'s."""
        identity = self.allocator.allocate(name)
        try:
            spec = self._spec(identity, run_dir, hostname, uplink)
            jail.build_jail(spec)
            cgroup = None
            if self.cgroups is not None:
                try:
                    cgroup = self.cgroups.create(name, self._limits(memory_mib, vcpus))
                except CgroupError as exc:
                    jail.remove_jail(spec.root)
                    raise JailError(f"cgroup for {name}: {exc}") from None
        except BaseException:
            self.allocator.release(identity)
            raise
        return Cell(self, name, identity, spec, cgroup)

    def reopen(self, name: str, run_dir: Path, uid: int, ram: str, hostname: str = "sandbox") -> Cell:
        """The cell of a QEMU a previous supervisor started (to tear it down after)."""
        identity = Identity(uid, uid)
        self.allocator.adopt(identity, name)
        cgroup = None
        if self.cgroups is not None:
            with contextlib.suppress(CgroupError, OSError):
                cgroup = self.cgroups.open(name)
        cell = Cell(self, name, identity, self._spec(identity, run_dir, hostname), cgroup)
        cell.ram = Path(ram) if ram else None
        return cell

    def sweep(self, keep: set[str]) -> None:
        """Cgroups no recorded life owns (a crash's leftovers): their processes killed
        (what is under our parent is ours), the cgroups removed once empty."""
        if self.cgroups is None:
            return
        for name, pids in self.cgroups.collect(keep).items():
            cg = self.cgroups.open(name)
            with contextlib.suppress(CgroupError, OSError):
                cg.kill_all()
            for _ in range(100):  # SIGKILLed processes leave the cgroup as they exit: ~ms
                if not cg.pids():
                    break
                time.sleep(0.01)
            try:
                cg.remove()
                log.warning("killed %d processes of an unrecorded cgroup %s", len(pids), name)
            except (CgroupError, OSError) as exc:
                log.warning("unrecorded cgroup %s (%d processes) could not be removed: %s", name, len(pids), exc)

    def close(self) -> None:
        """At supervisor exit: the sealed memory, and our cgroup parent when no cell is
        left under it (--keep-sandboxes leaves running ones to the next supervisor)."""
        self.sealed.close()
        if self.tools is not None:
            self.tools.close()
        if self.cgroups is not None:
            try:
                if not self.cgroups.remove_empty():
                    log.info("cgroup parent %s stays: cgroups under it hold processes", self.cgroups.parent)
            except (CgroupError, OSError) as exc:
                log.warning("cgroup parent %s left: %s", self.cgroups.parent, exc)
