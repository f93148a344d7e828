"""E2B's default user on endpoint sandboxes: envd runs commands, file operations and
uploads as ``user`` (home ``/home/user``, where commands start) unless the call names
another. A sandbox gets ``user`` on its first envd call through the endpoint (and at
create) if its image lacks it: ``useradd`` in the guest, or, where the image has no
``useradd``, lines added to ``/etc/passwd``, ``/etc/group`` and ``/etc/shadow`` and the
home made. Files uploaded are then owned by the user the call acts as.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from supervisor.serve.guest_fs import exec_collect
from supervisor.wire import errors

log = logging.getLogger("sandvisor.e2b")

DEFAULT_USER = "user"
HOME = "/home/user"

# idempotent; run as root in the guest
ENSURE = r"""
id -u user >/dev/null 2>&1 && exit 0
if command -v useradd >/dev/null 2>&1; then
  useradd -m -U -s /bin/bash user 2>/dev/null || useradd -m -s /bin/sh user
else
  uid=1000; while grep -q "^[^:]*:[^:]*:$uid:" /etc/passwd; do uid=$((uid+1)); done
  sh=/bin/sh; [ -x /bin/bash ] && sh=/bin/bash
  echo "user:x:$uid:$uid::/home/user:$sh" >> /etc/passwd
  grep -q '^user:' /etc/group 2>/dev/null || echo "user:x:$uid:" >> /etc/group
  [ -f /etc/shadow ] && echo 'user:!:19000::::::' >> /etc/shadow
  mkdir -p /home/user && chown "$uid:$uid" /home/user && chmod 750 /home/user
fi
id -u user >/dev/null
"""


class Users:
    """Which sandboxes (by uid) are known to have ``user``; made once each, serially."""

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self._lock = trio.Lock()

    async def ensure(self, sb: Any, uid: str) -> None:
        if uid in self.ready:
            return
        async with self._lock:
            if uid in self.ready:
                return
            r = await exec_collect(sb, ["/bin/sh", "-c", ENSURE], "root")
            if r.exit_code != 0:
                msg = r.stderr.decode("utf-8", "replace").strip()[-300:]
                raise errors.FailedPrecondition(
                    errors.FAILED_PRECONDITION, f"cannot make E2B's default user 'user' in the sandbox: {msg}"
                )
            self.ready.add(uid)

    def forget(self, uid: str) -> None:
        self.ready.discard(uid)


def user_or_default(user: str) -> str:
    return user or DEFAULT_USER


def default_cwd(user: str, cwd: str) -> str:
    """E2B starts a command of the default user in its home."""
    return cwd or (HOME if user == DEFAULT_USER else "")


async def chown(sb: Any, user: str, paths: list[str]) -> None:
    """Give uploaded files to ``user`` (they are written by the supervisor, as root)."""
    if not paths or user == "root":
        return
    script = 'u="$1"; shift; exec chown -h -- "$u:" "$@"'
    r = await exec_collect(sb, ["/bin/sh", "-c", script, "sh", user, *paths], "root")
    if r.exit_code != 0:
        msg = r.stderr.decode("utf-8", "replace").strip()[-300:]
        raise errors.InvalidArgument(errors.INVALID_ARGUMENT, f"cannot give the file to {user}: {msg}")
