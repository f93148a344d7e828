"""systemd's notify protocol (supervisor/main/notify.py): READY, STOPPING and the watchdog."""

from __future__ import annotations

from pathlib import Path

import trio


async def test_sd_notify_ready_stopping_and_the_watchdog(tmp_path: Path) -> None:
    import socket as socket_mod

    from supervisor.main.notify import Notifier

    path = tmp_path / "notify"
    with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_DGRAM) as sink:
        sink.bind(str(path))
        sink.settimeout(5)
        n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
        assert n.enabled and n.watchdog == 0.2
        n.ready("serving")
        assert sink.recv(100) == b"READY=1\nSTATUS=serving"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(n.keep_alive)
            await trio.sleep(0.25)
            nursery.cancel_scope.cancel()
        n.stopping()
        got = [sink.recv(100)]
        while got[-1] != b"STOPPING=1":
            got.append(sink.recv(100))
        assert got[:-1] and set(got[:-1]) == {b"WATCHDOG=1"}  # every 0.1 s: half the interval asked for
    quiet = Notifier({})
    assert not quiet.enabled
    quiet.ready()  # without systemd: nothing, no error
