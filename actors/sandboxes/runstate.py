"""What one start of a sandbox controls, from Start to stopped: the stop request and
how (forced, its timeout, draining, detached), ready and done, the serving life's
task group, the cold-start timings and why it ends. The Sandbox makes one fresh at
each start and is its only user."""

from __future__ import annotations

import attrs
import trio

from actors.model import Cause


@attrs.define(eq=False)
class RunState:
    """What one start controls, from Start to stopped (fresh at each start)."""

    stop: trio.Event = attrs.Factory(trio.Event)  # asked to stop (or QEMU died)
    force: bool = False
    timeout: float = 30.0
    draining: bool = False  # no new work
    detached: bool = False  # it ends by letting QEMU run on (serve --keep-sandboxes)
    ready: trio.Event = attrs.Factory(trio.Event)  # it reached ready (or ended)
    done: trio.Event = attrs.Factory(trio.Event)  # no life runs
    scope: trio.CancelScope | None = None  # while it runs
    work: trio.Nursery | None = None  # the serving life's tasks (its watch, the initial cmd)
    timings: dict[str, float] = attrs.Factory(dict)  # monotonic: the cold-start breakdown
    pausing: bool = False  # it ends for a pause (the record says paused already)
    waking: bool = False  # a paused sandbox resuming: paused until it serves
    served: bool = False  # it reached ready (or resumed)
    cause: Cause | None = None  # why it ends (asked to stop, or how QEMU died), once known
