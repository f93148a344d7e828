"""The init hand-off of a sandbox created with one (``SandboxConfig.init``): after
guestd's boot-time set-up, PID 1 becomes the image's init and guestd its child
(guestd/initsys.py). Stop then goes through the init's own shutdown: guestd asks the
init, the machine's ladder (QMP quit, SIGTERM, SIGKILL) follows after its grace."""

from __future__ import annotations

from collections.abc import Sequence

from actors.channel.guest import GuestError
from actors.errors import FailedPrecondition
from actors.machines.vm import Guest
from actors.sandboxes.life import LifeOwner, guest_error


async def hand_off(sb: LifeOwner, guest: Guest, initial_cmd: Sequence[str]) -> bool:
    """Hand PID 1 to the configured init (nothing when there is none); True when the
    init runs the initial workload itself (Init.Auto picked an init at the start of the
    image's ENTRYPOINT: tini -- app), so the sandbox does not run it again."""
    init = sb.config.init
    if init is None:
        return False
    if not guest.channel.has_feature("init"):
        raise FailedPrecondition("the guest runtime cannot hand PID 1 to an init (no 'init' feature): rebuild it")
    auto = init.path == "auto"
    # Init.Auto looks at the first element of what the sandbox would start (an image's
    # ENTRYPOINT + CMD: tini -- app, or a systemd image's CMD /lib/systemd/systemd)
    workload = list(initial_cmd) if auto else []
    try:
        ok = await guest.channel.hand_off("" if auto else init.path, init.args, init.env, workload)
    except GuestError as exc:
        raise guest_error(exc) from None
    sb.log.append("system", f"init: PID 1 is {ok.path} ({ok.kind}); guestd goes on as pid {ok.pid}".encode())
    return ok.workload
