"""How a sandbox's life starts (a :class:`~actors.sandboxes.life.Life` carries one out):
a fresh boot, a restore of a snapshot, a running QEMU adopted, or a wait for the boot
template another boot is making."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs

from actors.machines.qemuproc import AdoptedProcess
from actors.store import LifeState, SnapshotRecord

__all__ = ["Adopt", "AwaitTemplate", "Boot", "Plan", "Resume"]


@attrs.frozen
class Boot:
    """A fresh boot, or a stopped sandbox's disk booted again."""

    accepted: float = 0.0  # monotonic: when the request was accepted (for the timings)
    template: Callable[[], Awaitable[None]] | None = None  # saves the boot as a template
    disk_of: SnapshotRecord | None = None  # a restore of a disk-only snapshot: a boot on an overlay of its disk


@attrs.frozen
class Resume:
    """A restore of ``snapshot``. With ``fallback`` (a boot template), a restore that
    fails is reported there and the life boots instead: a Create must not fail on it."""

    snapshot: SnapshotRecord
    accepted: float = 0.0
    # (snapshot, why, transient): transient = the guest did not answer in time
    fallback: Callable[[SnapshotRecord, str, bool], None] | None = None
    wake: bool = False  # a paused sandbox's own saved state: it resumes as itself


@attrs.frozen
class Adopt:
    """A QEMU a previous supervisor started and recorded (``life``), still running
    (``proc``): reconnect and serve it, with its memory, processes and ports."""

    life: LifeState
    proc: AdoptedProcess
    accepted: float = 0.0


@attrs.frozen
class AwaitTemplate:
    """The boot template this configuration restores is being made by another
    sandbox's boot: ``resolve`` waits for that (the template is saved before the
    maker's first ready) and says what to do then -- restore it, or boot (it failed).
    Booting beside the maker instead would put N boots on the cores at once."""

    resolve: Callable[[], Awaitable[Boot | Resume]]
    accepted: float = 0.0


Plan = Boot | Resume | Adopt | AwaitTemplate
