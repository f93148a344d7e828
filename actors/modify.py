"""Modify: change a sandbox's configuration, live where its machine allows, and say how.

QEMU's ``microvm`` hotplugs nothing (no vCPU, no DIMM, no virtio-mmio device), so a
sandbox boots with its ceilings (``Limits.max_vcpus``, ``max_memory_mib``) and moves
below them live: vCPUs go offline and online in the guest (guestd's ``set_cpus``) and
the cgroup's CPU quota follows at once; memory goes to and from the virtio balloon.
Above a ceiling only a new machine helps: a restart, which the caller must ask for.

:func:`plan` is the whole decision, with no I/O: for each requested change a
:class:`Change` with its :class:`Status` and why, and the configuration after. A plan
is all or nothing: if one change is refused or needs a restart nobody asked for,
nothing is applied. :func:`modify` carries a plan out on a sandbox of the registry.
A change kind is one :class:`Kind` member and a few lines in :func:`plan` (secrets
will be one)::

    Modify{vcpus, memory, ceilings, disk, env (+remove), workdir, labels, ttl, idle,
           secrets, dry_run, policy}
      plan(config, running machine)  ->  changes + config after (+ conflicts, warnings)
      dry run, or refused            ->  the plan, nothing changed
      running, policy next_start     ->  config saved as pending: the next start takes it
      config saved (record, updated_at); secret values to the vault, the proxy told
      running, no_restart            ->  balloon / CPUs / cgroup now, wait until settled
      running, restart               ->  stop, start (new ceilings), wait until ready
      stopped                        ->  the next boot has it (a bigger disk is grown then)
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs
import trio

from actors.errors import FailedPrecondition, Internal, InvalidArgument
from actors.machines.qemuproc import MachineError
from actors.model import ALIVE, ENDED, Egress, Limits, Network, SandboxConfig
from actors.modify_secrets import BLOCKING, Change, Kind, Note, Policy, SecretChange, SecretPlan, Status
from actors.net.netlink import needs_pool_address, set_policy
from actors.rules import check_ceilings, check_labels, check_network, max_vcpus
from actors.sandboxes import secrets, tune
from actors.sandboxes.sandbox import Sandbox
from actors.sandboxes.tune import Machine, Resize
from actors.secrets import model as secrets_model
from actors.secrets.ca import new_ca
from actors.settings import Settings

__all__ = [
    "BLOCKING",
    "Change",
    "Kind",
    "Machine",
    "Modification",
    "Note",
    "Plan",
    "Policy",
    "Resize",
    "SecretChange",
    "Status",
    "check_disk_size",
    "check_machine",
    "modify",
    "plan",
]

RESTART_NOTE = (
    "a restart stops the sandbox (its processes end; guest memory, /tmp and /run are lost) and boots it "
    "again from its disk with the new ceilings; its id, disk, labels, ports and address are kept"
)
RESTART_TIMEOUT = 600.0  # s: the stop and the boot of a --restart


class ModifyHost(Protocol):
    """What Modify uses of the registry (which implements it)."""

    settings: Settings

    def get(self, id: str) -> Sandbox: ...

    def stop(self, id: str, timeout: float = ...) -> Sandbox: ...

    async def start(self, id: str) -> Sandbox: ...


@attrs.frozen
class Modification:
    """What a caller asks to change (None: leave it). ``env`` and ``labels`` are merged
    into the sandbox's (a label set to "" is removed)."""

    vcpus: int | None = None
    memory_mib: int | None = None
    disk_mib: int | None = None
    env: dict[str, str] | None = None
    working_dir: str | None = None
    labels: dict[str, str] | None = None
    ttl_seconds: int | None = None
    idle_timeout_seconds: int | None = None
    dry_run: bool = False
    restart: bool = False
    # SSH public keys (checked OpenSSH lines) added to / removed from the sandbox's (docs/ssh.md)
    ssh_keys_add: tuple[str, ...] = ()
    ssh_keys_remove: tuple[str, ...] = ()
    env_remove: tuple[str, ...] = ()  # env keys taken away
    # ceilings by themselves (QEMU's -smp maxcpus and -m at boot: a running machine's change
    # with a restart, or at the next start)
    max_vcpus: int | None = None
    max_memory_mib: int | None = None
    policy: Policy | None = None  # None: restart says (RESTART or NO_RESTART)
    secrets: tuple[SecretChange, ...] = ()
    # the egress policy, replaced whole (tap; user with outbound): live on a running sandbox
    egress: Egress | None = None

    @property
    def effective_policy(self) -> Policy:
        if self.policy is None:
            return Policy.RESTART if self.restart else Policy.NO_RESTART
        if self.restart and self.policy != Policy.RESTART:
            raise InvalidArgument(f"restart and policy {self.policy} exclude each other")
        return self.policy


@attrs.frozen
class Plan:
    changes: tuple[Change, ...]
    config: SandboxConfig  # the configuration once applied
    dry_run: bool = False
    restart: bool = False  # carrying it out restarts the sandbox
    note: str = ""
    # filled in by modify() once applied
    applied: bool = False
    settled: bool = False
    settle_seconds: float = 0.0
    policy: Policy = Policy.NO_RESTART
    warnings: tuple[Note, ...] = ()  # true and not blocking (env for future execs only, ...)
    resize: tuple[Resize, ...] = ()  # a live resize's outcome per resource (filled by modify())
    pending: bool = False  # saved for the next start (policy next_start on a running sandbox)
    secret_values: Mapping[str, bytes] = attrs.field(factory=dict, repr=False)  # to the vault once applied

    @property
    def accepted(self) -> bool:
        """Every change can be applied as asked."""
        return not any(c.status in BLOCKING for c in self.changes)

    @property
    def conflicts(self) -> tuple[Note, ...]:
        """What must be resolved before the plan applies: its refused changes and those
        that need a restart nobody asked for."""
        return tuple(Note(c.kind.value, c.why) for c in self.changes if c.status in BLOCKING)


def plan(
    config: SandboxConfig,
    effective: Limits,
    mod: Modification,
    machine: Machine | None,
    *,
    disk_mib: int,
    max_disk_mib: int = 0,
    balloon: bool = True,
    store_hosts: Mapping[str, Sequence[str]] | None = None,
    proxy_ports: tuple[int, ...] | None = None,
    removed_secrets: frozenset[str] = frozenset(),
) -> Plan:
    """The plan of ``mod`` on a sandbox with ``config`` (its limits as resolved when it
    was made, its record's: ``effective``), running on ``machine`` (None: stopped).
    ``disk_mib``: its root disk's size now; ``max_disk_mib``: serve's
    --max-sandbox-disk (0: none); ``balloon``: the supervisor gives machines a balloon
    (else memory moves only with a restart, and no ceiling is above the value).
    ``store_hosts``: the hosts of the store entries the caller may name (a secret's
    ``store``); ``proxy_ports``: the ports the running life's secret proxy intercepts
    (None: it runs none); ``removed_secrets``: the sandbox's secrets taken away.
    Policy next_start on a running sandbox plans as on a stopped one: the next start
    has it all. Bad values are INVALID_ARGUMENT; what the state forbids is a refused
    change."""
    policy = mod.effective_policy
    later = policy == Policy.NEXT_START and machine is not None
    running = machine  # (the machine the sandbox runs now, whatever the policy)
    machine = None if later else machine
    changes: list[Change] = []
    warnings: list[Note] = []
    limits = config.limits
    restart = False
    next_why = (
        "saved for the next start (policy next_start): the running sandbox is not changed"
        if later
        else "the sandbox is stopped: its next boot has it"
    )

    def machine_change(value: int, now: int, ceiling_now: int, live: bool) -> Status:
        nonlocal restart
        if value == now:
            return Status.UNCHANGED
        if machine is None:
            return Status.NEXT_BOOT
        if live and value <= ceiling_now:
            return Status.APPLIED
        if policy == Policy.RESTART:
            restart = True
            return Status.RESTART
        return Status.NEEDS_RESTART

    if mod.vcpus is not None:
        if not 1 <= mod.vcpus <= max_vcpus():
            raise InvalidArgument(f"cpus must be 1 to {max_vcpus()}")
        ceiling = machine.max_vcpus if machine else effective.vcpu_ceiling
        st = machine_change(mod.vcpus, effective.vcpus, ceiling, True)
        why = {
            Status.APPLIED: f"vCPUs online in the guest and its CPU quota now (ceiling {ceiling})",
            Status.NEXT_BOOT: next_why,
            Status.RESTART: f"above the ceiling of {ceiling} vCPUs: the sandbox restarts with {mod.vcpus}",
            Status.NEEDS_RESTART: f"above the ceiling of {ceiling} vCPUs (microvm has no CPU hotplug): "
            "only a restart raises it (--restart)",
        }.get(st, "")
        changes.append(Change(Kind.CPUS, st, str(mod.vcpus), str(effective.vcpus), why))
        limits = attrs.evolve(limits, vcpus=mod.vcpus, max_vcpus=max(effective.vcpu_ceiling, mod.vcpus))

    if mod.memory_mib is not None:
        if not 64 <= mod.memory_mib <= 65536:
            raise InvalidArgument("memory must be 64 to 65536 MiB")
        has_balloon = machine.balloon if machine else balloon
        ceiling = machine.max_memory_mib if machine else effective.memory_ceiling
        shrink_mapped = machine is not None and machine.mapped and mod.memory_mib < effective.memory_mib
        st = machine_change(mod.memory_mib, effective.memory_mib, ceiling, has_balloon and not shrink_mapped)
        why = {
            Status.APPLIED: f"through the balloon, now (ceiling {ceiling} MiB)",
            Status.NEXT_BOOT: next_why,
            Status.RESTART: f"the sandbox restarts with {mod.memory_mib} MiB",
            Status.NEEDS_RESTART: (
                "its memory is a snapshot's mapped copy-on-write (a restore or boot template): the balloon "
                "would take no memory back but allocate what it takes in the shared snapshot memory; only a "
                "restart (a fresh boot) lowers it (--restart)"
                if shrink_mapped
                else f"above the ceiling of {ceiling} MiB (microvm has no memory hotplug): only a restart raises it "
                "(--restart)"
                if has_balloon
                else "this supervisor runs its machines without a balloon: only a restart changes memory (--restart)"
            ),
        }.get(st, "")
        changes.append(Change(Kind.MEMORY, st, str(mod.memory_mib), str(effective.memory_mib), why))
        top = max(effective.memory_ceiling, mod.memory_mib) if balloon else mod.memory_mib
        limits = attrs.evolve(limits, memory_mib=mod.memory_mib, max_memory_mib=top)

    limits = _ceilings(mod, limits, effective, machine, balloon, changes, machine_change, next_why)

    if mod.disk_mib is not None:
        now = disk_mib
        if mod.disk_mib < 1:
            raise InvalidArgument("disk size must be positive")
        if mod.disk_mib < now:
            changes.append(
                Change(Kind.DISK, Status.REFUSED, str(mod.disk_mib), str(now), "a root disk only grows, never shrinks")
            )
        elif max_disk_mib and mod.disk_mib > max_disk_mib:
            changes.append(
                Change(
                    Kind.DISK,
                    Status.REFUSED,
                    str(mod.disk_mib),
                    str(now),
                    f"above the supervisor's --max-sandbox-disk of {max_disk_mib} MiB",
                )
            )
        else:
            st = machine_change(mod.disk_mib, now, now, False)
            why = {
                Status.NEXT_BOOT: "grown before the next boot; the guest grows its filesystem at boot"
                + (" (policy next_start)" if later else ""),
                Status.RESTART: "the sandbox restarts on the grown disk",
                Status.NEEDS_RESTART: "a running machine's disk does not grow: only a restart (--restart), "
                "or stop the sandbox first",
            }.get(st, "")
            changes.append(Change(Kind.DISK, st, str(mod.disk_mib), str(now), why))
            limits = attrs.evolve(limits, disk_mib=mod.disk_mib)

    workload, timers, labels = config.workload, config.timers, dict(config.labels)
    live = "for future Runs and Execs" if machine is not None else "saved; Runs and Execs after the next boot use it"
    at = Status.NEXT_BOOT if later else Status.APPLIED  # (what is no machine's: config, at once)
    if later:
        live = next_why
    if mod.env is not None:
        env = {**workload.env, **mod.env}
        st = Status.UNCHANGED if env == workload.env else at
        changes.append(Change(Kind.ENV, st, _kv(mod.env), _kv(workload.env), live))
        workload = attrs.evolve(workload, env=env)
    if mod.env_remove:
        both = sorted(set(mod.env_remove) & set(mod.env or {}))
        if both:
            raise InvalidArgument(f"env {', '.join(both)}: both set and removed")
        present = [k for k in mod.env_remove if k in workload.env]
        st = at if present else Status.UNCHANGED
        why = live if present else "not in its env"
        changes.append(Change(Kind.ENV_REMOVE, st, ",".join(mod.env_remove), ",".join(present), why))
        workload = attrs.evolve(workload, env={k: v for k, v in workload.env.items() if k not in mod.env_remove})
    if running is not None and not later and (mod.env is not None or mod.env_remove or mod.working_dir is not None):
        warnings.append(
            Note("env", "env and workdir apply to Runs and Execs started from now: running processes keep theirs")
        )
    if mod.working_dir is not None:
        if mod.working_dir and not mod.working_dir.startswith("/"):
            raise InvalidArgument("workdir must be an absolute path")
        st = Status.UNCHANGED if mod.working_dir == workload.working_dir else at
        changes.append(Change(Kind.WORKDIR, st, mod.working_dir, workload.working_dir, live))
        workload = attrs.evolve(workload, working_dir=mod.working_dir)
    if mod.labels is not None:
        check_labels({k: v for k, v in mod.labels.items() if v})
        for k, v in mod.labels.items():
            if v:
                labels[k] = v
            else:
                labels.pop(k, None)
        st = Status.UNCHANGED if labels == config.labels else at
        changes.append(Change(Kind.LABELS, st, _kv(mod.labels), _kv(config.labels), next_why if later else "now"))
    if mod.ttl_seconds is not None:
        if mod.ttl_seconds < 0:
            raise InvalidArgument("ttl must not be negative")
        st = Status.UNCHANGED if mod.ttl_seconds == timers.ttl_seconds else at
        why = next_why if later else "now, counted from the sandbox's creation (0: none)"
        changes.append(Change(Kind.TTL, st, str(mod.ttl_seconds), str(timers.ttl_seconds), why))
        timers = attrs.evolve(timers, ttl_seconds=mod.ttl_seconds)
    if mod.idle_timeout_seconds is not None:
        if mod.idle_timeout_seconds < 0:
            raise InvalidArgument("idle timeout must not be negative")
        st = Status.UNCHANGED if mod.idle_timeout_seconds == timers.idle_timeout_seconds else at
        why = next_why if later else "now, counted from the last activity (0: none)"
        changes.append(
            Change(Kind.IDLE_TIMEOUT, st, str(mod.idle_timeout_seconds), str(timers.idle_timeout_seconds), why)
        )
        timers = attrs.evolve(timers, idle_timeout_seconds=mod.idle_timeout_seconds)

    ssh_keys = config.ssh_keys
    if mod.ssh_keys_add or mod.ssh_keys_remove:
        ssh_keys = _ssh_keys(config.ssh_keys, mod.ssh_keys_add, mod.ssh_keys_remove)
        st = Status.UNCHANGED if ssh_keys == config.ssh_keys else at
        why = next_why if later else "for new SSH connections"
        changes.append(Change(Kind.SSH_KEYS, st, str(len(ssh_keys)), str(len(config.ssh_keys)), why))

    refs: tuple[secrets_model.SecretRef, ...] = config.secrets
    values: dict[str, bytes] = {}
    if mod.secrets:
        sp = SecretPlan(
            config.secrets, store_hosts or {}, proxy_ports, removed_secrets, policy, machine is not None, later
        )
        refs, values = sp.run(mod.secrets)
        changes.extend(sp.changes)
        warnings.extend(sp.warnings)
        restart = restart or sp.restart

    network = config.network
    if mod.egress is not None:
        live_egress = machine is not None
        why = "now: the sandbox's filter and DNS answers" if live_egress else next_why
        network = _egress(config, mod.egress, Status.APPLIED if live_egress else Status.NEXT_BOOT, why, changes)
    check_ceilings(limits)
    after = attrs.evolve(
        config,
        limits=limits,
        workload=workload,
        timers=timers,
        labels=labels,
        ssh_keys=ssh_keys,
        secrets=refs,
        network=network,
    )
    if restart:
        warnings.append(Note("restart", RESTART_NOTE))
    return Plan(
        tuple(changes),
        after,
        dry_run=mod.dry_run,
        restart=restart,
        note=RESTART_NOTE if restart else "",
        policy=policy,
        warnings=tuple(warnings),
        pending=later,
        secret_values=values,
    )


def _ceilings(
    mod: Modification,
    limits: Limits,
    effective: Limits,
    machine: Machine | None,
    balloon: bool,
    changes: list[Change],
    machine_change: _MachineChange,
    next_why: str,
) -> Limits:
    """A ceiling set by itself: QEMU's ``-smp maxcpus`` or ``-m`` (microvm hotplugs
    nothing): the running machine keeps its own, so a change is by restart or at the next
    start; it is never below its value (INVALID_ARGUMENT, check_ceilings)."""
    restart_why = "the sandbox restarts with the new ceiling"
    if mod.max_vcpus is not None:
        if not 1 <= mod.max_vcpus <= max_vcpus():
            raise InvalidArgument(f"max_cpus must be 1 to {max_vcpus()}")
        now = machine.max_vcpus if machine else effective.vcpu_ceiling
        st = machine_change(mod.max_vcpus, now, 0, False)
        why = {
            Status.NEXT_BOOT: next_why,
            Status.RESTART: restart_why,
            Status.NEEDS_RESTART: "a ceiling is the machine's (-smp maxcpus; microvm has no CPU hotplug): only a "
            "restart changes it (policy restart), or the next start (policy next_start)",
        }.get(st, "")
        changes.append(Change(Kind.MAX_CPUS, st, str(mod.max_vcpus), str(now), why))
        limits = attrs.evolve(limits, max_vcpus=mod.max_vcpus)
    if mod.max_memory_mib is not None:
        if not 64 <= mod.max_memory_mib <= 65536:
            raise InvalidArgument("max_memory must be 64 to 65536 MiB")
        now = machine.max_memory_mib if machine else effective.memory_ceiling
        has_balloon = machine.balloon if machine else balloon
        value = limits.memory_mib or effective.memory_mib
        if mod.max_memory_mib > value and not has_balloon:
            changes.append(
                Change(
                    Kind.MAX_MEMORY,
                    Status.REFUSED,
                    str(mod.max_memory_mib),
                    str(now),
                    "a memory ceiling above the memory needs the virtio balloon: this supervisor runs without one",
                )
            )
            return limits
        st = machine_change(mod.max_memory_mib, now, 0, False)
        why = {
            Status.NEXT_BOOT: next_why,
            Status.RESTART: restart_why,
            Status.NEEDS_RESTART: "a ceiling is the machine's RAM (-m; microvm has no memory hotplug): only a "
            "restart changes it (policy restart), or the next start (policy next_start)",
        }.get(st, "")
        changes.append(Change(Kind.MAX_MEMORY, st, str(mod.max_memory_mib), str(now), why))
        limits = attrs.evolve(limits, max_memory_mib=mod.max_memory_mib)
    return limits


class _MachineChange(Protocol):
    def __call__(self, value: int, now: int, ceiling_now: int, live: bool) -> Status: ...


MAX_SSH_KEYS = 32


def _ssh_keys(now: tuple[str, ...], add: tuple[str, ...], remove: tuple[str, ...]) -> tuple[str, ...]:
    """The keys after removing and adding (a key is its type and data: comments aside)."""

    def data(key: str) -> str:
        return " ".join(key.split()[:2])

    gone = {data(k) for k in remove}
    keys = [k for k in now if data(k) not in gone]
    for k in add:
        if data(k) not in {data(x) for x in keys}:
            keys.append(k)
    if len(keys) > MAX_SSH_KEYS:
        raise InvalidArgument(f"at most {MAX_SSH_KEYS} ssh keys per sandbox")
    return tuple(keys)


def check_machine(limits: Limits, *, balloon: bool) -> None:
    """A memory ceiling above the value needs the balloon (FAILED_PRECONDITION)."""
    if limits.memory_ceiling > limits.memory_mib and not balloon:
        raise FailedPrecondition(
            "a memory ceiling above the memory needs the virtio balloon: this supervisor runs without one "
            "(root, without --no-balloon)"
        )


def check_disk_size(disk_mib: int, image_bytes: int) -> None:
    """A root disk size at create is at least the image's (INVALID_ARGUMENT)."""
    if disk_mib and disk_mib << 20 < image_bytes:
        raise InvalidArgument(f"disk size {disk_mib} MiB is below the image's {-(-image_bytes // (1 << 20))} MiB")


def _kv(d: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(d.items()))


async def modify(reg: ModifyHost, id: str, mod: Modification) -> Plan:
    """Plan ``mod`` on sandbox ``id`` and carry the plan out (unless it is a dry run or
    not accepted): saved in the record, applied to the running machine (waiting until
    the guest settled), or by a restart when the caller asked for one."""
    sb = reg.get(id)
    async with sb.modify_lock:
        return await _modify(reg, sb, mod)


async def _modify(reg: ModifyHost, sb: Sandbox, mod: Modification) -> Plan:
    id = sb.id
    if sb.state not in (*ALIVE, *ENDED) or (sb.state not in ALIVE and not sb.stopped):
        raise FailedPrecondition(f"sandbox {id} is {sb.state}: modify it once it is ready or stopped")
    if sb.checkpointing:
        raise FailedPrecondition(f"sandbox {id} is being checkpointed: modify it after")
    s = reg.settings
    machine = tune.machine_of(sb) if sb.state in ALIVE else None
    policy = mod.effective_policy
    pending = sb.record.pending
    if pending is not None and machine is not None and policy == Policy.NO_RESTART:
        raise FailedPrecondition(
            f"sandbox {id} has changes saved for its next start: modify it with policy next_start (they add up) "
            "or restart (it restarts with them)"
        )
    base = pending if pending is not None else sb.config
    effective = base.limits.filled(sb.limits.vcpus, sb.limits.memory_mib) if pending is not None else sb.limits
    life = sb.life
    proxy = life.secrets if life is not None else None
    v = s.vault
    p = plan(
        base,
        effective,
        mod,
        machine,
        disk_mib=machine.disk_mib if machine else tune.disk_mib(sb),
        max_disk_mib=s.max_sandbox_disk_mib,
        balloon=s.balloon,
        store_hosts={n: v.named_hosts(n) for n in v.named} if v is not None else {},
        proxy_ports=proxy.ports if proxy is not None and proxy.cell is not None else None,
        removed_secrets=frozenset(r.name for r in base.secrets if v is not None and v.removed(sb.record.uid, r.name)),
    )
    if pending is not None and machine is not None and not p.pending:  # (policy restart: a new machine has them)
        p = attrs.evolve(p, restart=True, note=RESTART_NOTE)
    if mod.secrets and p.accepted:
        _check_secrets_possible(s, p.config)
    if mod.dry_run or not p.accepted:
        return p
    before = sb.limits
    changed = any(c.status != Status.UNCHANGED for c in p.changes)
    if p.pending:
        sb.save_pending(p.config)
    else:
        sb.retune(p.config, changed=changed)  # (its limits and configuration)
    await sb.store.flush()
    if changed:
        sb.log.append(
            "system",
            (
                ("saved for the next start: " if p.pending else "modified: ")
                + "; ".join(f"{c.kind} {c.value} ({c.status})" for c in p.changes)
            ).encode(),
        )
    if p.secret_values or (mod.secrets and changed):
        _secrets_applied(sb, p)
    if machine is not None and not p.pending and _egress_changed(p):
        _egress_applied(sb)
    if machine is None or not changed or p.pending:
        return attrs.evolve(p, applied=True, settled=machine is not None)
    if p.restart:
        t0 = time.monotonic()
        await _restart(reg, id)
        return attrs.evolve(p, applied=True, settled=True, settle_seconds=time.monotonic() - t0)
    after = sb.limits
    if after.vcpus == before.vcpus and after.memory_mib == before.memory_mib:
        return attrs.evolve(p, applied=True, settled=True)
    resized, seconds = await tune.apply_live(sb)
    settled = all(r.state == tune.SETTLED for r in resized)
    return attrs.evolve(p, applied=True, settled=settled, settle_seconds=seconds, resize=resized)


def _check_secrets_possible(s: Settings, config: SandboxConfig) -> None:
    """A sandbox with secrets needs the vault and a link the proxy sits on."""
    if s.vault is None or s.upstream_tls is None:
        raise FailedPrecondition("this supervisor keeps no secrets (its vault is off)")
    if config.secrets and (not needs_pool_address(s, config.network) or s.hostnet is None):
        raise FailedPrecondition(
            "secrets need network mode 'tap', or 'user' with outbound in the jail (a root supervisor with --ip-pool)"
        )


def _secrets_applied(sb: Sandbox, p: Plan) -> None:
    """The plan's secret values into the vault (with a CA for a sandbox that had none),
    and the running proxy told (it reads the configuration and the vault again)."""
    vault = secrets.vault_of(sb)
    uid = sb.record.uid
    if vault.ca(uid) is None:
        vault.put_owner(uid, dict(p.secret_values), new_ca(uid[:12]))
    for name, value in p.secret_values.items():
        vault.set_value(uid, name, value)
    life = sb.life
    if life is not None and life.secrets is not None and life.secrets.cell is not None:
        life.secrets.cell.push()


async def _restart(reg: ModifyHost, id: str) -> None:
    """Stop the sandbox and start it again (a new machine: the new ceilings), ready."""
    with trio.fail_after(RESTART_TIMEOUT):
        sb = reg.stop(id)
        await sb.wait_stopped()
        sb = await reg.start(id)
        await sb.ready_event.wait()
    if sb.state not in ALIVE:
        raise FailedPrecondition(f"sandbox {id} did not come back after the restart: {sb.record.error}")


# -- the egress policy ---------------------------------------------------------------------
def _egress(config: SandboxConfig, egress: Egress, at: Status, why: str, changes: list[Change]) -> Network:
    """The network with ``egress`` as its whole egress policy (a named profile it was
    expanded from no longer names it). Only where the guest reaches out: tap, or user
    with outbound (FAILED_PRECONDITION otherwise, as at create); a policy that does not
    parse is INVALID_ARGUMENT."""
    before = config.network.egress or Egress()
    network = attrs.evolve(config.network, egress=egress, profile="")
    check_network(network)
    st = Status.UNCHANGED if egress == before else at
    changes.append(Change(Kind.EGRESS, st, _policy_text(egress), _policy_text(before), why))
    return network if st != Status.UNCHANGED else config.network


def _policy_text(e: Egress) -> str:
    return f"default={e.default} allow={','.join(e.allow)} deny={','.join(e.deny)}"


def _egress_changed(p: Plan) -> bool:
    return any(c.kind == Kind.EGRESS and c.status == Status.APPLIED for c in p.changes)


def _egress_applied(sb: Sandbox) -> None:
    """The running life's link filters by the record's policy now (atomically; the DNS
    answers it had opened are forgotten)."""
    life = sb.life
    if life is None:
        return
    try:
        set_policy(life.link, sb.egress)
    except MachineError as exc:
        raise Internal(f"sandbox {sb.id}: the new egress policy is saved but not applied: {exc}") from None
