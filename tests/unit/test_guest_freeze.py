"""guestd's freeze (guestd/freeze.py) without a VM: which mounts it freezes and in what
order, the thaw in reverse, a mount that refuses skipped, the timeout's own thaw.
(The real FIFREEZE on a real guest: tests/vm/test_freeze.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from guestd import freeze

MOUNTINFO = """\
20 1 254:0 / / rw,relatime - ext4 /dev/vda rw
21 20 0:5 / /proc rw,nosuid - proc proc rw
22 20 0:20 / /run rw - tmpfs tmpfs rw,size=1024k
23 20 254:16 / /data rw,relatime - ext4 /dev/vdb rw
24 23 254:32 / /data/deep\\040er rw - xfs /dev/vdc rw
25 20 254:48 / /ro rw - ext4 /dev/vdd ro
26 20 254:64 / /ro2 ro - ext4 /dev/vde rw
27 20 0:40 / /host rw - virtiofs tag rw
28 20 254:16 /sub /bound rw - ext4 /dev/vdb rw
"""


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, str]]:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    real_open = open

    def fake_open(path: str, *a: object, **kw: object) -> object:
        return real_open(info if path == "/proc/self/mountinfo" else path, *a, **kw)  # type: ignore[call-overload]

    seen: list[tuple[str, str]] = []

    def ioctl(point: str, op: int) -> None:
        if point == "/data" and op == freeze.FIFREEZE and ("refuse", "/data") in seen:
            raise OSError(95, "Operation not supported")
        seen.append(("freeze" if op == freeze.FIFREEZE else "thaw", point))

    monkeypatch.setattr(freeze, "open", fake_open, raising=False)
    monkeypatch.setattr(freeze, "_ioctl", ioctl)
    monkeypatch.setattr(freeze.os, "sync", lambda: None)
    return seen


def test_writable_block_mounts_deepest_first_one_per_device(calls: list[tuple[str, str]]) -> None:
    assert freeze.writable_mounts() == ["/data/deep er", "/data", "/"]


def test_freeze_then_thaw_in_reverse(calls: list[tuple[str, str]]) -> None:
    f = freeze.Freezer()
    assert f.freeze(30.0) == 3
    assert f.next_deadline() < float("inf")
    assert f.thaw() == 3
    assert calls == [
        ("freeze", "/data/deep er"),
        ("freeze", "/data"),
        ("freeze", "/"),
        ("thaw", "/"),
        ("thaw", "/data"),
        ("thaw", "/data/deep er"),
    ]
    assert f.next_deadline() == float("inf") and f.thaw() == 0


def test_a_mount_that_refuses_is_skipped(calls: list[tuple[str, str]]) -> None:
    calls.append(("refuse", "/data"))
    f = freeze.Freezer()
    assert f.freeze(30.0) == 2
    assert f.frozen == ["/data/deep er", "/"]


def test_the_timeout_thaws_on_its_own(calls: list[tuple[str, str]]) -> None:
    f = freeze.Freezer()
    f.freeze(5.0)
    f.tick(f.next_deadline() - 1)
    assert f.frozen
    f.tick(f.next_deadline())
    assert not f.frozen and calls[-1] == ("thaw", "/data/deep er")


def test_a_second_freeze_thaws_the_first(calls: list[tuple[str, str]]) -> None:
    f = freeze.Freezer()
    f.freeze(5.0)
    f.freeze(5.0)
    assert [c for c in calls if c[0] == "thaw"] == [("thaw", "/"), ("thaw", "/data"), ("thaw", "/data/deep er")]
    assert len(f.frozen) == 3
