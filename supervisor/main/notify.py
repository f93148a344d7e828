"""systemd's notify protocol (sd_notify): READY, STOPPING and the watchdog, when
``$NOTIFY_SOCKET`` is set (``Type=notify`` units); nothing otherwise.

The watchdog keep-alive is sent by a Trio task of the supervisor's own loop: a loop
that stops turning (blocked, deadlocked) stops the pings, and systemd restarts the
service after ``WatchdogSec``; sandboxes survive that (``KillMode=process``).
"""

from __future__ import annotations

import os
import socket

import trio


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET", "")
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog = int(usec) / 1e6 if usec.isdigit() and (not pid or pid == str(os.getpid())) else 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *fields: str) -> None:
        if not self.address:
            return
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(addr)
                s.sendall("\n".join(fields).encode())
        except OSError:
            pass  # systemd went away: nothing to tell

    def ready(self, status: str = "") -> None:
        self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self) -> None:
        self.send("STOPPING=1")

    async def keep_alive(self) -> None:
        """WATCHDOG=1 at half the interval systemd asked for, forever (a no-op task without one)."""
        if not self.watchdog:
            await trio.sleep_forever()
        while True:
            self.send("WATCHDOG=1")
            await trio.sleep(self.watchdog / 2)
