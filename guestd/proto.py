"""The guest channel protocol: wire messages and the I/O-free frame codec.

This module is imported by guestd inside the guest (stdlib + msgpack only, and
fast to import: it must not pull in ``typing``, ``dataclasses`` or ``inspect``,
which cost tens of milliseconds of boot under TCG) and by the host side
(``actors.channel.guest``).  Both ends speak exactly the classes defined here.

Framing: every frame is a 4-byte big-endian length followed by that many bytes
of msgpack.  A frame longer than :data:`MAX_FRAME` is a protocol error.  The
payload is a msgpack map ``{"t": TAG, field: value, ...}``; unknown keys are
ignored (newer peers may add optional fields), missing keys take the field's
default, and a value of the wrong type is a protocol error.

Error tree (host and guest)::

    ProtocolError            the peer broke the protocol; the channel is closed
     +-- FrameTooLarge       length prefix above MAX_FRAME
     +-- BadMessage          not msgpack, not a map, unknown tag, wrong types
"""

from __future__ import annotations

import errno
import struct

import msgpack

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~30 ms of boot

if TYPE_CHECKING:  # pragma: no cover - typing only; never imported in the guest
    from collections.abc import Callable, Iterator
    from typing import Any, ClassVar, TypeVar, dataclass_transform

    _T = TypeVar("_T")
else:

    def dataclass_transform(**_kw):
        return lambda f: f


# 2: read_tree, write_tree, patch, mount, umount; write_file.owner
PROTOCOL_VERSION = 2
MAX_FRAME = 1 << 20  # 1 MiB: a frame above this closes the channel
CHUNK = 64 * 1024  # data payloads are split into chunks of at most this size
WINDOW = 256 * 1024  # initial flow-control credit per stream, in bytes
# a file's stream may run this far ahead of its reader: the host grants a ReadFile's data
# this much in all (WINDOW, then the rest at once); a WriteFile's ``window`` asks the guest
# to grant its data this much (an older guest ignores it and grants WINDOW). Four windows
# keep the virtio-serial pipe busy while the other end works (docs/results/chan.md).
FILE_WINDOW = 4 * WINDOW
# a file's data frames (write_file's from the host, read_file's from guestd) carry up to
# this much: a quarter of the frames for the same bytes (each costs guestd a turn of
# Python under TCG); older peers take any frame up to MAX_FRAME within credit
FILE_CHUNK = 4 * CHUNK
MAX_FILE = 256 * 1024 * 1024  # ReadFile / WriteFile limit
MAX_TREE = 1 << 30  # ReadTree / WriteTree: bytes of file contents in one tree
MAX_TREE_ENTRIES = 200_000  # ReadTree / WriteTree: entries (files, directories, links) in one tree
MAX_TREE_STREAM = MAX_TREE + MAX_TREE_ENTRIES * 2048  # the tar stream itself (contents + headers)
MAX_TREE_META = 1 << 20  # one pax or GNU long-name header's payload
MAX_FS_LIST = 100_000  # Fs list: entries of one directory's answer (TOO_LARGE beyond)
MAX_FS_ANSWER = 32 << 20  # Fs list or stat: bytes of the msgpack answer (TOO_LARGE beyond)
MAX_PATCH_ENTRIES = 10_000  # entries of one Patch request (its frame bounds their bytes)
_HDR = struct.Struct(">I")
# one Packer for every frame (msgpack.packb builds a new one per call); it resets after
# each pack, and neither end packs from two threads
_PACKER = msgpack.Packer(use_bin_type=True)

# Resynchronisation. A host can go away and another connect mid-frame (a reconnect,
# a restored snapshot's stale buffers). Each Hello is preceded by HOST_SYNC and each
# HelloOk by GUEST_SYNC; a receiver that lost the frame boundary discards bytes up to
# the peer's marker. Both start with 0xff, which as a length prefix exceeds MAX_FRAME,
# so a decoder at a frame boundary fails fast on a marker instead of waiting for data.
HOST_SYNC = b"\xffSANDVISOR-HOST-SYNC\x00\x01"
GUEST_SYNC = b"\xffSANDVISOR-GUEST-SYNC\x00\x01"
MAX_RESYNC = 4 * MAX_FRAME  # bytes a receiver discards looking for a marker before giving up

# stream channels of a request
STDIN, STDOUT, STDERR = 0, 1, 2

# error codes carried by Error.code (guest-side failures)
E_INVALID = "INVALID_ARGUMENT"
E_NOT_FOUND = "NOT_FOUND"
E_IS_DIR = "IS_A_DIRECTORY"
E_PERM = "PERMISSION_DENIED"
E_TOO_LARGE = "TOO_LARGE"
E_EXISTS = "ALREADY_EXISTS"
E_FAILED = "FAILED_PRECONDITION"
E_INTERNAL = "INTERNAL"
E_UNSUPPORTED = "UNIMPLEMENTED"

_ERRNO_CODES = {
    errno.ENOENT: E_NOT_FOUND,
    errno.ENOTDIR: E_NOT_FOUND,
    errno.EISDIR: E_IS_DIR,
    errno.EACCES: E_PERM,
    errno.EPERM: E_PERM,
    errno.EROFS: E_PERM,
    errno.EEXIST: E_EXISTS,
    errno.EFBIG: E_TOO_LARGE,
    errno.ENOSPC: E_TOO_LARGE,
    errno.EDQUOT: E_TOO_LARGE,
    errno.ENAMETOOLONG: E_INVALID,
    errno.ELOOP: E_INVALID,
    errno.ENOEXEC: E_INVALID,  # exec of a script without a #! line
}


def errcode(exc: OSError) -> str:
    """The error code of a failed system call (guestd's, and the host's tree unpacking)."""
    return _ERRNO_CODES.get(exc.errno or 0, E_INTERNAL)


class ProtocolError(Exception):
    """The peer broke the protocol. The channel that saw it must be closed."""


class FrameTooLarge(ProtocolError):
    """A frame's length prefix exceeds MAX_FRAME."""


class BadMessage(ProtocolError):
    """A frame that is not a well-formed message of this protocol."""


# ---------------------------------------------------------------------------
# message classes
# ---------------------------------------------------------------------------

_CHECKS: dict[str, Callable[[object], bool]] = {
    "int": lambda v: type(v) is int,
    "float": lambda v: type(v) in (int, float),
    "str": lambda v: type(v) is str,
    "bytes": lambda v: type(v) is bytes,
    "bool": lambda v: type(v) is bool,
    "int | None": lambda v: v is None or type(v) is int,
    "float | None": lambda v: v is None or type(v) in (int, float),
    "str | None": lambda v: v is None or type(v) is str,
    "list[str]": lambda v: type(v) is list and all(type(x) is str for x in v),
    "dict[str, str]": lambda v: type(v) is dict and all(type(k) is str and type(x) is str for k, x in v.items()),
    "dict[str, int]": lambda v: type(v) is dict and all(type(k) is str and type(x) is int for k, x in v.items()),
    "dict[str, float]": lambda v: (
        type(v) is dict and all(type(k) is str and type(x) in (int, float) for k, x in v.items())
    ),
    "list[list[Any]]": lambda v: type(v) is list and all(type(x) is list for x in v),
    "list[dict[str, Any]]": lambda v: (
        type(v) is list and all(type(x) is dict and all(type(k) is str for k in x) for x in v)
    ),
}

REGISTRY: dict[str, type[Message]] = {}
_MISSING = object()


class Message:
    """Base of all wire messages: immutable, keyword-constructed, compared by value."""

    TAG: ClassVar[str]
    _fields: ClassVar[tuple[tuple[str, Callable[[object], bool], object], ...]]

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(getattr(self, f) == getattr(other, f) for f, _, _ in self._fields)

    def __hash__(self) -> int:
        return hash((self.TAG, *(repr(getattr(self, f)) for f, _, _ in self._fields)))

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f, _, _ in self._fields)
        return f"{type(self).__name__}({inner})"

    def to_wire(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f, _, _ in self._fields}
        d["t"] = self.TAG
        return d


@dataclass_transform(kw_only_default=True, frozen_default=True)
def message(tag: str) -> Callable[[type[_T]], type[_T]]:
    """Class decorator: register a wire message under ``tag`` and give it an __init__."""

    def wrap(cls: Any) -> Any:
        fields = []
        for name, ann in cls.__dict__.get("__annotations__", {}).items():  # noqa: RUF063 - no inspect
            if ann.startswith("ClassVar"):
                continue
            try:
                check = _CHECKS[ann]
            except KeyError:
                raise TypeError(f"{cls.__name__}.{name}: unsupported wire type {ann}") from None
            fields.append((name, check, cls.__dict__.get(name, _MISSING)))
        cls._fields = tuple(fields)
        cls.TAG = tag

        def __init__(self: Any, **kw: Any) -> None:
            for name, _check, default in cls._fields:
                if name in kw:
                    value = kw.pop(name)
                elif default is _MISSING:
                    raise TypeError(f"{cls.__name__}: missing field {name!r}")
                else:
                    value = default
                object.__setattr__(self, name, value)
            if kw:
                raise TypeError(f"{cls.__name__}: unknown fields {sorted(kw)}")

        cls.__init__ = __init__
        if tag in REGISTRY:
            raise TypeError(f"duplicate tag {tag}")
        REGISTRY[tag] = cls
        return cls

    return wrap


# --- session -----------------------------------------------------------------
@message("hello")
class Hello(Message):
    """Host -> guest, first frame of every connection. Resets the session."""

    version: int
    host_time_ns: int = 0


@message("hello_ok")
class HelloOk(Message):
    """Guest -> host answer to Hello."""

    version: int
    pid: int
    boot_ns: int  # CLOCK_BOOTTIME when guestd's main module started
    ready_ns: int  # CLOCK_BOOTTIME when this answer was sent
    activity: int
    marks: dict[str, float] = {}  # boot milestones, seconds since kernel start
    features: list[str] = []


@message("ping")
class Ping(Message):
    rid: int


@message("pong")
class Pong(Message):
    rid: int
    activity: int
    guest_ns: int  # CLOCK_REALTIME in the guest


@message("touch")
class Touch(Message):
    rid: int


@message("ok")
class Ok(Message):
    """Generic success answer to a request (touch, set_clock, signal, shutdown, write end)."""

    rid: int
    activity: int = 0
    value: int = 0


@message("error")
class Error(Message):
    """Failure of the request ``rid``; ends any stream of that request."""

    rid: int
    code: str
    message: str


# --- exec --------------------------------------------------------------------
@message("exec")
class Exec(Message):
    rid: int
    argv: list[str]
    env: dict[str, str] = {}
    cwd: str = ""
    user: str = ""  # user name or numeric uid; "" = root
    tty: bool = False
    rows: int = 24
    cols: int = 80
    timeout: float = 0.0  # seconds, 0 = none
    stdin: bool = False  # False: stdin is /dev/null


@message("exec_started")
class ExecStarted(Message):
    rid: int
    pid: int


@message("exit")
class Exit(Message):
    """Ends an exec stream. ``code`` is the exit status, or 128+signal if killed."""

    rid: int
    code: int
    signal: int = 0
    timed_out: bool = False
    oom_killed: bool = False  # killed by the guest kernel's OOM killer (its log said so: guestd/oom.py)


@message("resize")
class Resize(Message):
    rid: int
    rows: int
    cols: int


@message("signal")
class Signal(Message):
    rid: int
    signum: int


# --- streams (exec stdio and file contents) ----------------------------------
@message("data")
class Data(Message):
    """A chunk of a stream. Never more bytes than the receiver granted credit for."""

    rid: int
    ch: int
    data: bytes


@message("eof")
class Eof(Message):
    rid: int
    ch: int


@message("credit")
class Credit(Message):
    """The receiver of stream ``(rid, ch)`` grants ``n`` more bytes."""

    rid: int
    ch: int
    n: int


# --- files -------------------------------------------------------------------
@message("read_file")
class ReadFile(Message):
    """Guest answers FileInfo, then streams Data on ch=STDOUT and Eof, within credit."""

    rid: int
    path: str


@message("write_file")
class WriteFile(Message):
    """Guest answers Credit on ch=STDIN; host streams Data and Eof; guest answers Ok (value=size)."""

    rid: int
    path: str
    mode: int = 0o644
    size: int = -1  # announced size if known, checked against MAX_FILE up front
    owner: str = ""  # user[:group] (names from the guest's /etc/passwd, or ids); "" = root
    # credit the host asks for, in all (at most FILE_WINDOW); 0 = WINDOW (the guest's
    # first Credit grants the difference; the host refuses more than it asked for)
    window: int = 0


@message("file_info")
class FileInfo(Message):
    rid: int
    size: int
    mode: int


# --- trees, patches, mounts (protocol 2) ---------------------------------------
@message("read_tree")
class ReadTree(Message):
    """A directory as one tar stream (POSIX pax). Guest answers Ok once the directory
    is open, then streams Data on ch=STDOUT within credit, then Eof; an Error ends the
    stream instead (what came before it is not a whole archive). Symlinks are archived
    as links, never followed; hard links as links to the first name; sockets, FIFOs
    and devices are left out; directories on other file systems are archived empty
    (tar --one-file-system). Bounded by MAX_TREE bytes and MAX_TREE_ENTRIES entries
    (TOO_LARGE)."""

    rid: int
    path: str


@message("write_tree")
class WriteTree(Message):
    """Host streams a tar as Data on ch=STDIN and Eof, within credit (WINDOW to start,
    as for write_file); guest unpacks it into ``path`` (made, with its parents, if
    missing) and answers Ok(value=entries) or Error. Refused (INVALID_ARGUMENT): an
    absolute name or a ``..`` component, a name through a symlink, a hard link to
    anything but a file of the same archive, devices and FIFOs, a malformed or
    truncated stream; beyond the tree limits: TOO_LARGE. Existing files are replaced
    (never written through), existing directories merged."""

    rid: int
    path: str
    owner: str = ""  # "": the archive's numeric uid/gid; else user[:group] owns every entry


@message("patch")
class Patch(Message):
    """Files, directories and links written in order (before the workload, typically).
    Each entry is a map: ``op`` (file, append, mkdir, remove, symlink), ``path``
    (absolute), ``data`` (bytes: file, append), ``target`` (symlink), ``mode`` (-1:
    0644 files, 0755 directories), ``owner`` (user[:group], "" = root), ``replace``
    (file, symlink: an existing path is replaced, else ALREADY_EXISTS). Missing parent
    directories are made (root, 0755). Answered Ok(value=entries applied), or Error
    naming the first entry that failed (the ones before it stay applied)."""

    rid: int
    entries: list[dict[str, Any]]
    base: int = 0  # the first entry's number in error messages (a host that split a long patch)


@message("mount")
class Mount(Message):
    """Mount a block device at ``path`` (made if missing). ``device``: a /dev path, or
    ``serial:NAME`` for the virtio disk whose serial is NAME. Answered Ok. guestd
    unmounts what it mounted when it powers off. ``fstype`` "tmpfs" mounts a tmpfs
    (``device`` ignored; mode 1777, nosuid, nodev) of at most ``size_mib`` (0: the
    kernel's default)."""

    rid: int
    device: str
    path: str
    fstype: str = "ext4"
    read_only: bool = False
    size_mib: int = 0


@message("umount")
class Umount(Message):
    rid: int
    path: str


@message("fs")
class Fs(Message):
    """A file-system operation (feature "fs"; served by a forked worker). ``op``:

    - ``list``: the directory ``path`` (its own symlink followed); ``stat``: ``path``
      itself (a symlink not followed). Answered Ok, then one msgpack array on
      ch=STDOUT as Data within credit, then Eof: entries ``[name, kind, size, mode,
      uid, gid, mtime_ns, target]`` (kind: file, dir, symlink, other; target: a
      link's), by name; stat's one entry is named ``path``. A non-directory's list
      is FAILED_PRECONDITION; more than MAX_FS_LIST entries or MAX_FS_ANSWER bytes
      TOO_LARGE.
    - ``mkdir``: ``path`` (``recursive``: its parents too, and one that exists is
      fine); ``mode`` its permission bits. Over a file: FAILED_PRECONDITION.
    - ``remove``: a file, a link (not followed), an empty directory; a non-empty one
      with ``recursive`` only, else FAILED_PRECONDITION.
    - ``rename``: ``path`` to ``dest`` (rename(2): one file system).

    mkdir, remove and rename are answered Ok. A missing path is NOT_FOUND."""

    rid: int
    op: str
    path: str
    dest: str = ""
    recursive: bool = False
    mode: int = 0o755


# --- system ------------------------------------------------------------------
@message("metrics")
class Metrics(Message):
    rid: int


@message("metrics_ok")
class MetricsOk(Message):
    rid: int
    uptime: float
    cpu_seconds: dict[str, float]  # user, nice, system, idle, iowait, irq, softirq, steal
    ncpu: int
    mem: dict[str, int]  # total, available, free, buffers, cached (bytes)
    disk: dict[str, int]  # read_bytes, write_bytes, reads, writes
    net: dict[str, int]  # rx_bytes, tx_bytes, rx_packets, tx_packets
    load: list[str] = []
    procs: int = 0
    oom_kills: int = 0  # the guest kernel's OOM kills since it booted (/proc/vmstat oom_kill)


@message("set_clock")
class SetClock(Message):
    rid: int
    realtime_ns: int


@message("add_entropy")
class AddEntropy(Message):
    """Mix host entropy into the guest kernel RNG (credited), e.g. after a restore."""

    rid: int
    data: bytes


@message("set_hostname")
class SetHostname(Message):
    rid: int
    hostname: str


@message("net_config")
class NetConfig(Message):
    """Configure ``iface`` (tap networking: after a restore, before the host reports the
    clone ready, a fresh address, MAC, gateway and resolvers). Answered with Ok, or
    Error (INVALID_ARGUMENT for bad values; the kernel's errno otherwise)."""

    rid: int
    address: str
    prefix: int
    gateway: str
    dns: list[str] = []
    mac: str = ""
    iface: str = "eth0"


@message("set_cpus")
class SetCpus(Message):
    """Bring vCPUs 0..online-1 online and the others offline (CPU hotplug through
    /sys/devices/system/cpu/cpuN/online: QEMU's microvm has no vCPU hotplug, so a
    machine boots with its ceiling and the guest takes the rest offline). Answered
    Ok(value=the CPUs online after)."""

    rid: int
    online: int


@message("grow_root")
class GrowRoot(Message):
    """Grow the root ext4 filesystem online to the size of its device (a disk that
    was made bigger than its filesystem: EXT4_IOC_RESIZE_FS, as resize2fs does on a
    mounted filesystem). Answered Ok(value=the filesystem's size in bytes)."""

    rid: int


@message("trust_ca")
class TrustCa(Message):
    """Install the sandbox's CA certificate (PEM, public) into the guest's trust stores
    (guestd/trust.py; a sandbox with secrets, after boot or restore). Answered with Ok,
    or Error (INVALID_ARGUMENT: not a certificate)."""

    rid: int
    pem: bytes


@message("configure")
class Configure(Message):
    """The sandbox's workload shape, sent once per boot before its mounts and patches
    (a restore holds it already). ``path_extra``: a directory appended to every exec's
    PATH (the scripts directory); ``restricted``: every exec runs with no_new_privs
    (setuid bits and file capabilities ignored) and the root file system and every
    writable mount after it are nosuid,nodev; ``thp``: the transparent huge page
    policy (always | madvise | never; "": the kernel's); ``log_level``: what guestd's
    own diagnostics show ("": warnings; "error" or "off": none). Answered with Ok, or
    Error (INVALID_ARGUMENT for a value it does not know)."""

    rid: int
    path_extra: str = ""
    restricted: bool = False
    thp: str = ""
    log_level: str = ""


@message("freeze")
class Freeze(Message):
    """Sync, then freeze every writable block file system (FIFREEZE, deepest mount
    first) for a crash-consistent capture of the disk (guestd/freeze.py). It holds
    until a Thaw, the next Hello, or ``timeout`` seconds of the guest's running time,
    whichever comes first. Answered Ok(value=the file systems frozen)."""

    rid: int
    timeout: float = 30.0


@message("thaw")
class Thaw(Message):
    """Thaw what a Freeze froze (last first). Answered Ok(value=the file systems thawed)."""

    rid: int


@message("shutdown")
class Shutdown(Message):
    """Sync, stop every process, power off (or reboot). Answered with Ok first."""

    rid: int
    reboot: bool = False


@message("hand_off")
class HandOff(Message):
    """Make ``path`` (an absolute path in the guest; "" or "auto": Init.Auto, see
    guestd/initsys.py) PID 1 with ``args`` and ``env``; guestd goes on as its child.
    ``workload``: what the sandbox would start (an image's Entrypoint + Cmd; for
    Init.Auto: an init at its start becomes PID 1 and runs the rest). Sent once, after
    the boot-time set-up. Answered with HandOffOk, or Error (NOT_FOUND: no such init;
    FAILED_PRECONDITION: not PID 1, or processes running)."""

    rid: int
    path: str = ""
    args: list[str] = []
    env: dict[str, str] = {}
    workload: list[str] = []


@message("hand_off_ok")
class HandOffOk(Message):
    """The init runs as PID 1: its path, kind ("systemd" or "other"), guestd's pid
    now, and whether the init runs the workload (the host then does not)."""

    rid: int
    path: str
    kind: str
    pid: int
    workload: bool = False


@message("log")
class Log(Message):
    """Unsolicited guest -> host diagnostic line (bounded by the frame cap)."""

    level: str
    text: str


@message("oom_kill")
class OomKill(Message):
    """Unsolicited guest -> host: the guest kernel's OOM killer killed a process (its
    log said so; guestd/oom.py). ``constraint``: CONSTRAINT_NONE (the whole guest's
    memory), CONSTRAINT_MEMCG (a guest cgroup's limit), ...; ``cgroup``: the victim's
    memory cgroup as the kernel names it; sizes in KiB at the kill; ``seq``: guestd's
    count of the kills it reported."""

    pid: int
    comm: str
    constraint: str = ""
    cgroup: str = ""
    total_vm_kb: int = 0
    anon_rss_kb: int = 0
    file_rss_kb: int = 0
    shmem_rss_kb: int = 0
    seq: int = 0


# ---------------------------------------------------------------------------
# codec
# ---------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    """Serialise one message into a complete frame (length prefix included)."""
    body: bytes = _PACKER.pack(msg.to_wire())
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _HDR.pack(len(body)) + body


def decode(body: bytes | memoryview) -> Message:
    """Parse one frame body (without its length prefix) into a message."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise BadMessage(f"undecodable frame: {type(exc).__name__}") from None
    if type(obj) is not dict:
        raise BadMessage(f"frame is a {type(obj).__name__}, not a map")
    tag = obj.get("t")
    cls = REGISTRY.get(tag) if type(tag) is str else None
    if cls is None:
        raise BadMessage(f"unknown message tag {tag!r}"[:200])
    kw = {}
    for name, check, default in cls._fields:
        value = obj.get(name, default)
        if value is _MISSING:
            raise BadMessage(f"{tag}: missing field {name!r}")
        if not check(value):
            raise BadMessage(f"{tag}.{name}: wrong type {type(value).__name__}")
        kw[name] = value
    return cls(**kw)


class FrameDecoder:
    """Incremental, I/O-free frame splitter with a hard cap on buffered bytes.

    Feed it whatever the transport returned; iterate :meth:`messages` to get the
    complete messages. It never holds more than one partial frame (at most
    ``MAX_FRAME + 4`` bytes) plus the unconsumed tail of the last feed. Frames are
    consumed by advancing an offset; the buffer is compacted once per batch, not once
    per frame (a front ``del`` per 64 KiB frame memmoves ~1 MiB: ~1 ms under TCG).
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._max = max_frame

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def reset(self) -> None:
        self._buf.clear()
        self._pos = 0

    def resync(self, marker: bytes) -> bool:
        """Drop buffered bytes up to and including ``marker``. False (keeping only a
        possible partial marker at the end) if it is not there yet."""
        i = self._buf.find(marker, self._pos)
        if i >= 0:
            del self._buf[: i + len(marker)]
            self._pos = 0
            return True
        keep = len(marker) - 1
        del self._buf[: max(self._pos, len(self._buf) - keep)]
        self._pos = 0
        return False

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def at(self, marker: bytes) -> bool:
        """The unconsumed bytes start with ``marker`` (all of it that has come)."""
        head = bytes(self._buf[self._pos : self._pos + len(marker)])
        return bool(head) and marker.startswith(head)

    def messages(self) -> Iterator[Message]:
        buf = self._buf
        while len(buf) - self._pos >= 4:
            (n,) = _HDR.unpack_from(buf, self._pos)
            if n > self._max:
                raise FrameTooLarge(f"frame length {n} exceeds {self._max}")
            start = self._pos + 4
            if len(buf) < start + n:
                return
            self._pos = start + n
            # decoded in place: msgpack copies what it keeps (a Data's bytes), so the
            # body is not copied out first (the view is gone before the buffer changes)
            with memoryview(buf) as mv, mv[start : start + n] as body:
                msg = decode(body)
            yield msg
