"""The guest channel's vocabulary on the host side: its error tree, the ranges of the
guest's numbers the host accepts (:func:`check_ranges`), and the values its requests
take and give (ExecResult, ChannelStatistics, PatchEntry). The channel itself is
actors/channel/guest.py's; the streams of one request actors/channel/gueststreams.py's.

Error tree::

    GuestError
     +-- ChannelClosed (trio.ClosedResourceError)   we closed the channel, then used it
     +-- ChannelBroken (trio.BrokenResourceError)   the guest went away or broke the protocol
     |    +-- GuestProtocolError                     ... specifically, it sent something illegal
     +-- HelloTimeout (trio.TooSlowError)           no hello answer in time (boot hung)
     +-- GuestTimeout (trio.TooSlowError)           no answer to a request in time (a silent guest)
     +-- GuestOpError                               the guest refused one request (code, message)
"""

from __future__ import annotations

import math

import attrs
import msgpack
import trio

from guestd import patch, proto

# What the host takes of a guest's numbers. The codec checks types only; these ranges are
# what the rest of the host can hold (SQLite and protobuf int64, int32 exit codes, uint64
# counters): a guest that sends more breaks the protocol, and only its own channel.
_U31, _U63 = (0, 2**31 - 1), (0, 2**63 - 1)
_I64 = (-(2**63), 2**63 - 1)
_RANGES: dict[str, dict[str, tuple[float, float]]] = {
    "hello_ok": {"pid": _U31, "boot_ns": _U63, "ready_ns": _U63, "activity": _U63, "version": _U31},
    "pong": {"activity": _U63, "guest_ns": _I64},
    "ok": {"activity": _U63, "value": _U63},
    "exec_started": {"pid": _U31},
    "exit": {"code": _U31, "signal": _U31},
    "file_info": {"size": _U63, "mode": (0, 0o177777)},
    "metrics_ok": {"uptime": (0, math.inf), "ncpu": _U31, "procs": _U31, "oom_kills": _U63},
    "data": {"ch": _U31},
    "eof": {"ch": _U31},
    "credit": {"ch": _U31, "n": _U63},
    "oom_kill": {
        "pid": (1, 2**22),  # PID_MAX_LIMIT
        "total_vm_kb": _U63,
        "anon_rss_kb": _U63,
        "file_rss_kb": _U63,
        "shmem_rss_kb": _U63,
        "seq": _U63,
    },
}
# the longest text the host takes in a field of an unsolicited report (guestd/oom.py's bounds)
_LENGTHS: dict[str, dict[str, int]] = {"oom_kill": {"comm": 64, "constraint": 32, "cgroup": 256}}
_VALUE_RANGES: dict[str, dict[str, tuple[float, float]]] = {  # every value of a map field
    "hello_ok": {"marks": (0, math.inf)},
    "metrics_ok": {"cpu_seconds": (0, math.inf), "mem": _U63, "disk": _U63, "net": _U63},
}


def check_ranges(msg: proto.Message) -> None:
    """BadMessage unless every number of ``msg`` is finite and in the host's range (and
    every bounded text within its length)."""
    for name, (lo, hi) in _RANGES.get(msg.TAG, {}).items():
        v = getattr(msg, name)
        if not (lo <= v <= hi and math.isfinite(v)):
            raise proto.BadMessage(f"{msg.TAG}.{name} out of range: {str(v)[:40]}")
    for name, (lo, hi) in _VALUE_RANGES.get(msg.TAG, {}).items():
        for key, v in getattr(msg, name).items():
            if not (lo <= v <= hi and math.isfinite(v)):
                raise proto.BadMessage(f"{msg.TAG}.{name}[{key[:40]!r}] out of range: {str(v)[:40]}")
    for name, most in _LENGTHS.get(msg.TAG, {}).items():
        if len(getattr(msg, name)) > most:
            raise proto.BadMessage(f"{msg.TAG}.{name}: longer than {most} characters")


class GuestError(Exception):
    """Base of every error of the guest channel."""


class ChannelClosed(GuestError, trio.ClosedResourceError):
    """This end closed the channel and then tried to use it."""


class ChannelBroken(GuestError, trio.BrokenResourceError):
    """The guest went away (EOF, reset) or the channel was torn down under a request."""


class GuestProtocolError(ChannelBroken):
    """The guest sent something the protocol forbids; the channel is now closed."""


class HelloTimeout(GuestError, trio.TooSlowError):
    """The guest did not answer the hello in time."""


class GuestTimeout(GuestError, trio.TooSlowError):
    """The guest did not answer a request within the channel's answer timeout."""


class GuestOpError(GuestError):
    """The guest refused a request. ``code`` is one of the proto E_* codes."""

    MAX_TEXT = 4096  # a guest's code and message, as far as the host keeps them (records, logs, replies)

    def __init__(self, code: str, message: str) -> None:
        code, message = code[:200], message[: self.MAX_TEXT]
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@attrs.frozen
class ExecResult:
    exit_code: int
    signal: int
    timed_out: bool
    stdout: bytes
    stderr: bytes
    oom_killed: bool = False  # the guest kernel's OOM killer killed it


@attrs.frozen
class ChannelStatistics:
    requests_in_flight: int
    frames_in: int
    frames_out: int
    bytes_in: int
    bytes_out: int
    dropped: int  # messages for requests that no longer exist


FS_KINDS = ("file", "dir", "symlink", "other")


@attrs.frozen
class FsEntry:
    """One entry of a guest's fs list or stat answer (checked: the guest chose it)."""

    name: str
    kind: str  # file | dir | symlink | other
    size: int
    mode: int  # permission bits (0..0o7777)
    uid: int
    gid: int
    mtime_ns: int
    target: str = ""  # a symlink's


def parse_fs_entries(body: bytes) -> list[FsEntry]:
    """A guest's msgpack answer to an Fs list or stat; ValueError unless every entry
    has the shape and ranges ``proto.Fs`` gives (names: 1..4096 characters)."""
    try:
        raw = msgpack.unpackb(
            body, raw=False, use_list=True, max_array_len=proto.MAX_FS_LIST, max_map_len=0, max_ext_len=0
        )
    except Exception as exc:  # msgpack's zoo of errors on garbage
        raise ValueError(f"undecodable ({type(exc).__name__})") from None
    if type(raw) is not list:
        raise ValueError("not an array")
    out = []
    for item in raw:
        if type(item) is not list or len(item) != 8:
            raise ValueError("an entry is not an array of 8")
        name, kind, size, mode, uid, gid, mtime, target = item
        if type(name) is not str or not 0 < len(name) <= 4096 or type(target) is not str or len(target) > 4096:
            raise ValueError("bad name or target")
        if kind not in FS_KINDS:
            raise ValueError(f"bad kind {str(kind)[:20]!r}")
        ints = (size, mode, uid, gid, mtime)
        if any(type(v) is not int for v in ints) or not (
            0 <= size < 2**63 and 0 <= mode <= 0o7777 and 0 <= uid < 2**32 and 0 <= gid < 2**32
        ):
            raise ValueError("a number out of range")
        if not -(2**63) <= mtime < 2**63:
            raise ValueError("mtime out of range")
        out.append(FsEntry(name, kind, size, mode, uid, gid, mtime, target))
    return out


PATCH_OPS = patch.OPS
PatchEntry = patch.Patch  # one patch of the guest's file system (the one definition: guestd/patch.py)
