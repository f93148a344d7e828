"""A request on the host's guest channel (actors/channel/guest.py) keeps what the guest sends in order."""

from __future__ import annotations

from actors.channel.guest import _Request
from guestd import proto


class _NoGrant:
    """A channel (``RequestChannel``) that grants nothing back and sends nothing."""

    async def send_message(self, msg: proto.Message) -> None:
        raise AssertionError(msg)

    async def grant_credit(self, rid: int, ch: int, n: int) -> None:
        pass

    async def fail_protocol(self, text: str) -> None:
        raise AssertionError(text)


async def test_guest_request_keeps_data_queued_behind_a_message() -> None:
    """Data arriving while a message (file_info) is still queued is kept, in order, and
    data merges only into the trailing run of data entries."""
    req = _Request(_NoGrant(), 1)
    req.deliver(proto.FileInfo(rid=1, size=6, mode=0o644))
    req.deliver(proto.Data(rid=1, ch=proto.STDOUT, data=b"abc"))
    req.deliver(proto.Data(rid=1, ch=proto.STDERR, data=b"!"))
    req.deliver(proto.Data(rid=1, ch=proto.STDOUT, data=b"def"))
    req.deliver(proto.Eof(rid=1, ch=proto.STDOUT))
    req.deliver(proto.Data(rid=1, ch=proto.STDERR, data=b"?"))
    got = []
    for _ in range(5):
        m = await req.next()
        got.append((m.TAG, getattr(m, "ch", None), getattr(m, "data", None)))
    assert got == [
        ("file_info", None, None),
        ("data", proto.STDOUT, b"abcdef"),
        ("data", proto.STDERR, b"!"),
        ("eof", proto.STDOUT, None),
        ("data", proto.STDERR, b"?"),
    ]
