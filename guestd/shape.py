"""(lazy) The sandbox's workload shape in the guest: the scripts directory on every
exec's PATH, the restricted security profile, the transparent huge page policy and
guestd's own log level (proto.Configure, once per boot before mounts and patches).

Restricted: every exec runs under busybox's ``setpriv --nnp`` (the initramfs' static
busybox, reached through guestd's root fd: it needs nothing of the user's root), so
no_new_privs is set before the workload's program is executed and setuid/setgid bits
and file capabilities give it nothing; the root file system is remounted nosuid,nodev
and every writable mount guestd makes after it is too (guestd/workers.py).
"""

from __future__ import annotations

from guestd import common, proto
from guestd.common import ExecFailed

TYPE_CHECKING = False  # not typing's: guestd does not import typing
if TYPE_CHECKING:
    from guestd.agent import Agent

THP_POLICIES = ("always", "madvise", "never")
THP_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
LOG_LEVELS = ("", "trace", "debug", "info", "warn", "error", "off")


def configure(agent: Agent, msg: proto.Configure) -> None:
    """Apply ``msg`` (checked first: nothing is applied from a message with a bad value)."""
    if msg.thp not in ("", *THP_POLICIES):
        raise ExecFailed(proto.E_INVALID, f"thp policy {msg.thp!r}: always, madvise or never")
    if msg.log_level not in LOG_LEVELS:
        raise ExecFailed(proto.E_INVALID, f"log level {msg.log_level!r}: one of {', '.join(LOG_LEVELS[1:])}")
    if msg.path_extra and (not msg.path_extra.startswith("/") or ":" in msg.path_extra):
        raise ExecFailed(proto.E_INVALID, "path_extra: an absolute directory without ':'")
    common.QUIET = msg.log_level in ("error", "off")
    if msg.thp:
        try:
            with open(THP_FILE, "w") as f:
                f.write(msg.thp)
        except OSError as exc:
            raise ExecFailed(common.errcode(exc), f"thp: {THP_FILE}: {exc.strerror}") from None
    agent.path_extra = msg.path_extra
    if msg.restricted and not agent.restricted:
        from guestd import workers

        workers.busybox_run(agent.root_fd, ["mount", "-o", "remount,nosuid,nodev", "/"])
        workers.RESTRICTED = True  # the mounts made from now on
        agent.restricted = True


def with_path(env: dict[str, str], extra: str) -> None:
    """``extra`` at the end of ``env``'s PATH (once)."""
    path = env.get("PATH", "")
    if extra and extra not in path.split(":"):
        env["PATH"] = f"{path}:{extra}" if path else extra


def nnp_argv(root_fd: int, path: str, argv: list[str]) -> tuple[str, list[str]]:
    """The program and argv that run ``path`` (``argv`` as given) with no_new_privs."""
    return f"/proc/self/fd/{root_fd}/usr/bin/busybox", ["busybox", "setpriv", "--nnp", "--", path, *argv[1:]]
