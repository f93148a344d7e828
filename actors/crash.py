"""Crash points: a test-only fault hook that SIGKILLs the supervisor at a named step.

``SANDVISOR_CRASH_AT=<step>`` in the supervisor's environment (read once, at import)
makes :func:`crash_point` of that name kill the process on the spot, as an OOM killer
or a power cut would; with the variable unset it does nothing and costs a string
compare. The crash-point tests restart the supervisor afterwards and check that
every QEMU is adopted or gone, every recorded disk is consistent, and nothing stray
is left (tests/vm/test_durability.py).

Steps: ``spawned`` (QEMU started, before QMP), ``hello`` (the guest answered),
``template-checkpoint`` (a boot template's checkpoint, before its record),
``checkpoint-swap`` (between the two steps of a checkpoint's disk swap),
``snapshot-record`` (a snapshot written, before its record), ``pool-fill`` (a warm
pool member being restored), ``remove`` (a sandbox's record gone, before its files),
``convert`` (a streamed snapshot's conversion: its helper QEMU paused with the state
loaded, both files of the conversion written, the record not switched);
``pause-saved`` (a pause's state saved and recorded, the sandbox still ready, its
QEMU stopped), ``pause-stopping`` (the sandbox recorded paused, its QEMU not ended),
``resume-loaded`` (a resume's guest answered, the sandbox still recorded paused);
``fork-switchover`` (a fork's live copy: the parent stopped at the switchover, its disk
cut, its helper QEMU loading).
"""

from __future__ import annotations

import os
import signal

STEPS = frozenset(
    {
        "spawned",
        "hello",
        "template-checkpoint",
        "checkpoint-swap",
        "snapshot-record",
        "pool-fill",
        "remove",
        "convert",
        "pause-saved",
        "pause-stopping",
        "resume-loaded",
        "fork-switchover",
    }
)
_AT = os.environ.get("SANDVISOR_CRASH_AT", "")


def crash_point(step: str) -> None:
    assert step in STEPS, step
    if step == _AT:
        os.kill(os.getpid(), signal.SIGKILL)
