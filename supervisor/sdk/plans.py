"""Every SDK operation, written once, as a plan (see :mod:`supervisor.sdk.ops`): the
typed request it builds, the effects it asks for, and how it reads the answers. No
I/O and no event loop here; the tables at the end are the public methods of both
SDKs (:mod:`supervisor.sdk.aio`, :mod:`supervisor.sdk.sync`).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal, Unpack

import attrs

from supervisor import protocol as W
from supervisor.errors import NotFound, SandboxError, error_for
from supervisor.protocol import (
    CheckpointResponse,
    LogEntry,
    MetricsResponse,
    ModifyResponse,
    OciImageInfo,
    PruneImagesResponse,
    PullImageProgress,
    RemoveImageResponse,
    SandboxEvent,
    SandboxInfo,
    SnapshotSummary,
    VolumeInfo,
)
from supervisor.sdk.ops import (
    TIMED_OUT,
    Blocking,
    Emit,
    Expired,
    Finish,
    Made,
    Now,
    Open,
    Plan,
    Pull,
    Receive,
    ReceiveTree,
    Send,
    SendTree,
    StreamPlan,
    Target,
    Unary,
    class_op,
    maker,
    op,
    stream,
    structure,
)
from supervisor.sdk.spec import (
    Output,
    Page,
    RunResult,
    RunSettings,
    SandboxSpec,
    Settings,
    SnapshotRef,
    _kv,
    _output,
    _snapshot_id,
    parse_size,
    size_mib,
)

CHUNK = 1 << 20
ENDED = ("ready", "failed", "stopped")  # the events that end a wait for ready
# s: a wait for ready asks Inspect after 1 s (an event before the server subscribed the
# wait is missed), then less often (by then the subscription is in place: the event
# ends the wait); every Inspect is a call the supervisor serves (issue 28: bursts)
READY_POLL_FIRST, READY_POLL_MAX = 1.0, 8.0


def _each(method: str, request: Any, item: type[Any]) -> StreamPlan[Any]:
    """A server stream's items, typed, to the caller."""
    call = yield Open(method, request)
    while (x := (yield Receive(call, item))) is not None:
        yield Emit(x)


def _collect(method: str, request: Any, item: type[Any]) -> Plan[list[Any]]:
    """A (short) server stream's items, typed, as a list."""
    call = yield Open(method, request)
    out = []
    while (x := (yield Receive(call, item))) is not None:
        out.append(x)
    return out


def _id(t: Target) -> W.IdRequest:
    return W.IdRequest(id=t.id)


# --- creation and lookup --------------------------------------------------------------------
def create(
    name: str = "",
    spec: SandboxSpec | None = None,
    *,
    socket: str | Path | None = None,
    replace: bool = False,
    detached: bool = False,
    wait: bool = True,
    timeout: float = 120.0,
    **settings: Unpack[Settings],
) -> Plan[Made]:
    """Create a sandbox from ``spec`` with ``settings`` applied on top, and by default
    wait until it is ready (``timeout`` seconds; a sandbox that fails to become ready
    is removed unless ``detached``). ``replace`` removes an existing sandbox of that
    name first. Leaving ``with`` removes it unless ``detached``."""
    req = (spec or SandboxSpec()).with_(**settings).request(name)
    if replace and name:
        try:
            yield Unary("Remove", W.RemoveSandboxRequest(id=name, force=True), W.Empty)
        except NotFound:
            pass
    resp: W.CreateSandboxResponse = yield Unary("Create", req, W.CreateSandboxResponse)
    if wait:
        try:
            yield from _wait_ready(resp.id, timeout)
        except BaseException:
            if not detached:
                with contextlib.suppress(SandboxError):
                    yield Unary("Remove", W.RemoveSandboxRequest(id=resp.id, force=True), W.Empty, cleanup=True)
            raise
    return Made(resp.id, detached)


def get(name: str, *, socket: str | Path | None = None) -> Plan[Made]:
    """A handle on an existing sandbox (NotFound if there is none); detached."""
    yield Unary("Inspect", W.IdRequest(id=name), SandboxInfo)
    return Made(name, True)


def list_(
    *,
    socket: str | Path | None = None,
    labels: Mapping[str, str] | None = None,
    state: str = "",
    limit: int = 20,
    cursor: str = "",
) -> Plan[Page]:
    """One page of sandboxes, newest first, filtered by state and labels (all must match)."""
    req = W.ListSandboxesRequest(state=state, labels=_kv(labels), limit=limit, cursor=cursor)
    r: W.ListSandboxesResponse = yield Unary("List", req, W.ListSandboxesResponse)
    return Page(r.sandboxes, r.next_cursor)


def metrics_all(*, socket: str | Path | None = None) -> Plan[builtins.list[MetricsResponse]]:
    """One sample of every ready or running sandbox."""
    r: W.MetricsAllResponse = yield Unary("MetricsAll", W.Empty(), W.MetricsAllResponse)
    return r.sandboxes


def restore(
    snapshot: SnapshotRef,
    *,
    name: str = "",
    labels: Mapping[str, str] | None = None,
    ttl: int = 0,
    network_override: bool = False,
    detached: bool = False,
    socket: str | Path | None = None,
) -> Plan[Made]:
    """A new sandbox from a snapshot (id, unique snapshot name, or a checkpoint's
    result), ready when this returns. As a context manager it is removed on exit
    unless ``detached``. A tap clone keeps the snapshot's address when it is free,
    unless ``network_override``."""
    req = W.RestoreRequest(
        snapshot_id=_snapshot_id(snapshot),
        id=name,
        labels=_kv(labels),
        ttl_seconds=ttl,
        network_override=network_override,
    )
    r: W.RestoreResponse = yield Unary("Restore", req, W.RestoreResponse)
    return Made(r.id, detached)


def snapshots(
    *, sandbox: str = "", labels: Mapping[str, str] | None = None, socket: str | Path | None = None
) -> Plan[builtins.list[SnapshotSummary]]:
    """Snapshots, oldest first; filtered by origin sandbox id and labels (all must match)."""
    req = W.ListSnapshotsRequest(sandbox_id=sandbox, labels=_kv(labels))
    r: W.ListSnapshotsResponse = yield Unary("ListSnapshots", req, W.ListSnapshotsResponse)
    return r.snapshots


def delete_snapshot(snapshot: SnapshotRef, *, socket: str | Path | None = None) -> Plan[None]:
    yield Unary("DeleteSnapshot", W.DeleteSnapshotRequest(snapshot_id=_snapshot_id(snapshot)), W.Empty)


def export_snapshot(
    snapshot: SnapshotRef,
    path: str | Path | BinaryIO,
    *,
    include_base: bool = False,
    socket: str | Path | None = None,
) -> Plan[int]:
    """Write the snapshot as one export file at ``path`` (a directory: ``snapshot.svsnap``
    in it), streamed; the file appears when whole (nothing is left on a failure). A
    binary file object (a pipe: ``sys.stdout.buffer``) is written as the data comes.
    ``include_base``: carry the image's root filesystem too (else the importing
    supervisor must have that image). Returns the file's size in bytes."""
    from supervisor.treecopy import commit_temp, create_temp, open_target

    req = W.ExportSnapshotRequest(snapshot_id=_snapshot_id(snapshot), include_base=include_base)
    if not isinstance(path, str | os.PathLike):
        call = yield Open("ExportSnapshot", req)
        n = 0
        while (ch := (yield Receive(call, W.FileChunk))) is not None:
            yield Blocking(path.write, (ch.data,))
            n += len(ch.data)
        yield Blocking(path.flush)
        return n
    dfd, name = yield Blocking(open_target, (os.fspath(path), "/snapshot.svsnap"))
    total = 0
    try:
        tmp, fd = yield Blocking(create_temp, (dfd, name))
        done = False
        try:
            with open(fd, "wb", closefd=True) as f:
                call = yield Open("ExportSnapshot", req)
                while (ch := (yield Receive(call, W.FileChunk))) is not None:
                    yield Blocking(f.write, (ch.data,))
                    total += len(ch.data)
                yield Blocking(f.flush)
                yield Blocking(os.fsync, (f.fileno(),))
            yield Blocking(commit_temp, (dfd, tmp, name))
            done = True
        finally:
            if not done:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
    finally:
        os.close(dfd)
    return total


def import_snapshot(
    path: str | Path | BinaryIO,
    *,
    name: str = "",
    labels: Mapping[str, str] | None = None,
    socket: str | Path | None = None,
) -> Plan[SnapshotSummary]:
    """A new snapshot (a new id) from an export file, streamed; recorded only once the
    whole file arrived and matched its digest. ``name``: "" keeps the export's (a name
    another snapshot has is AlreadyExists); ``labels`` are added to the export's.
    ``path``: a file, or a binary file object (a pipe: ``sys.stdin.buffer``)."""
    op_ = W.ImportSnapshotOpen(name=name, labels=_kv(labels))
    f = (yield Blocking(open, (Path(path), "rb"))) if isinstance(path, str | os.PathLike) else path
    with f if f is not path else contextlib.nullcontext(f):
        call = yield Open("ImportSnapshot", W.ImportSnapshotRequest(open=op_))
        while piece := (yield Blocking(f.read, (3 * CHUNK,))):  # (under the wires' 4 MiB message cap)
            yield Send(call, W.ImportSnapshotRequest(chunk=W.FileChunk(data=piece)))
        yield Send(call, W.ImportSnapshotRequest(chunk=W.FileChunk(done=True)))
        r: SnapshotSummary = yield Finish(call, SnapshotSummary)
    return r


# --- state ----------------------------------------------------------------------------------
def inspect(t: Target) -> Plan[SandboxInfo]:
    info: SandboxInfo = yield Unary("Inspect", _id(t), SandboxInfo)
    return info


def modify(
    t: Target,
    *,
    cpus: int | None = None,
    memory_mib: int | None = None,
    disk_size: int | str | None = None,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    labels: Mapping[str, str] | None = None,
    ttl: int | None = None,
    idle_timeout: int | None = None,
    dry_run: bool = False,
    restart: bool = False,
) -> Plan[ModifyResponse]:
    """Change the sandbox (docs/modify.md): vCPUs and memory live below its ceilings,
    the root disk (grow only) of a stopped sandbox, env and workdir of future runs,
    labels (a label set to "" is removed), TTL, idle timeout. Returns the plan: each
    change with its status and why; ``applied`` False (a dry run, or a change refused
    or needing ``restart``): nothing changed. ``restart``: a change only a new machine
    applies restarts the sandbox (its processes end, guest memory is lost)."""
    req = W.ModifyRequest(
        id=t.id,
        vcpus=cpus,
        memory_mib=memory_mib,
        disk_size_mib=size_mib(disk_size) if disk_size is not None else None,
        env=_kv(env),
        working_dir=workdir,
        labels=_kv(labels),
        ttl_seconds=ttl,
        idle_timeout_seconds=idle_timeout,
        dry_run=dry_run,
        restart=restart,
    )
    r: ModifyResponse = yield Unary("Modify", req, ModifyResponse)
    return r


def state(t: Target) -> Plan[str]:
    return (yield from inspect(t)).state


def _wait_ready(id: str, timeout: float) -> Plan[SandboxInfo]:
    events = yield Open("Events", W.SandboxEventsRequest(id=id))
    info: SandboxInfo = yield Unary("Inspect", W.IdRequest(id=id), SandboxInfo)
    deadline = (yield Now()) + timeout
    interval = READY_POLL_FIRST
    while info.state == "starting":
        # the event ends the wait at once; the poll covers an event that came before
        # the server had subscribed this call (the calls run concurrently)
        poll = min(deadline, (yield Now()) + interval)
        interval = min(interval * 2, READY_POLL_MAX)
        while (ev := (yield Receive(events, SandboxEvent, poll))) is not TIMED_OUT:
            if ev is None:  # the stream ended (the sandbox is gone): Inspect says how
                break
            if ev.action in ENDED:
                break
        else:
            if poll >= deadline:
                yield Expired()
        info = yield Unary("Inspect", W.IdRequest(id=id), SandboxInfo)
    if info.state not in ("ready", "running"):
        raise error_for(W.FAILED_PRECONDITION, f"sandbox {id} is {info.state}: {info.error}")
    return info


def wait_ready(t: Target, timeout: float = 120.0) -> Plan[SandboxInfo]:
    """Until the sandbox is ready (or running its initial command): FailedPrecondition
    if it failed or stopped instead, trio.TooSlowError after ``timeout`` seconds."""
    return (yield from _wait_ready(t.id, timeout))


def stop(t: Target, timeout: int = 0) -> Plan[None]:
    """Stop gracefully (``timeout`` seconds before it is killed; 0: the default)."""
    yield Unary("Stop", W.StopSandboxRequest(id=t.id, timeout_seconds=timeout), W.Empty)


def kill(t: Target) -> Plan[None]:
    yield Unary("Kill", _id(t), W.Empty)


def drain(t: Target) -> Plan[None]:
    """Refuse new work, let the running workload finish, then stop."""
    yield Unary("Drain", _id(t), W.Empty)


def wait_until_stopped(t: Target) -> Plan[SandboxInfo]:
    info: SandboxInfo = yield Unary("WaitUntilStopped", _id(t), SandboxInfo)
    return info


def start(t: Target, *, wait: bool = True, timeout: float = 120.0) -> Plan[None]:
    """Boot a stopped sandbox again (from its disk)."""
    yield Unary("Start", _id(t), W.CreateSandboxResponse)
    if wait:
        yield from _wait_ready(t.id, timeout)


def pause(t: Target) -> Plan[SandboxInfo]:
    """Hibernate to disk (issue 25): no QEMU, no RAM; id, address, ports, processes and
    memory come back with :meth:`resume` (or with the next call that needs the guest)."""
    info: SandboxInfo = yield Unary("Pause", _id(t), SandboxInfo)
    return info


def resume(t: Target) -> Plan[SandboxInfo]:
    """Bring a paused sandbox back, as itself; returns once it is ready."""
    info: SandboxInfo = yield Unary("Resume", _id(t), SandboxInfo)
    return info


def remove(t: Target, *, force: bool = False) -> Plan[None]:
    """Remove (``force``: stop it first if it runs)."""
    yield Unary("Remove", W.RemoveSandboxRequest(id=t.id, force=force), W.Empty)


def ping(t: Target) -> Plan[float]:
    """Round trip to the guest agent, in seconds (does not count as activity)."""
    r: W.PingResponse = yield Unary("Ping", _id(t), W.PingResponse)
    return r.latency_ns / 1e9


def touch(t: Target) -> Plan[int]:
    """Count as activity (the idle timeout starts again); the guest's activity counter."""
    r: W.TouchResponse = yield Unary("Touch", _id(t), W.TouchResponse)
    return r.activity


def set_ttl(t: Target, seconds: int) -> Plan[int]:
    """Remove the sandbox ``seconds`` from now (0: never), replacing its TTL; the unix
    time of its removal (0: never)."""
    r: W.SetTtlResponse = yield Unary("SetTtl", W.SetTtlRequest(id=t.id, ttl_seconds=seconds), W.SetTtlResponse)
    return r.expires_at


def metrics(t: Target) -> Plan[MetricsResponse]:
    m: MetricsResponse = yield Unary("Metrics", _id(t), MetricsResponse)
    return m


def metrics_stream(t: Target, interval: float = 1.0) -> StreamPlan[MetricsResponse]:
    """A sample every ``interval`` seconds while the sandbox is ready or running."""
    return _each("MetricsStream", W.MetricsStreamRequest(id=t.id, interval_seconds=interval), MetricsResponse)


LogSources = Iterable[str]  # "stdout", "stderr", "output" (a TTY's), "system"


def logs(
    t: Target, *, tail: int = 0, since: int = 0, until: int = 0, cursor: int = 0, sources: LogSources = ()
) -> Plan[builtins.list[LogEntry]]:
    """Persisted output (also of a stopped sandbox): the last ``tail`` entries (0:
    all), between ``since`` and ``until`` (unix ns; 0: open), after the entry whose
    ``seq`` is ``cursor``, of ``sources`` (empty: all)."""
    req = W.LogsRequest(id=t.id, tail=tail, since=since, until=until, cursor=cursor, sources=list(sources))
    return (yield from _collect("Logs", req, LogEntry))


def log_stream(
    t: Target, *, follow: bool = True, tail: int = 0, since: int = 0, cursor: int = 0, sources: LogSources = ()
) -> StreamPlan[LogEntry]:
    """Log entries as they are written (``follow``), after the last ``tail`` ones;
    from ``since`` (unix ns) or after the entry whose ``seq`` is ``cursor`` (a
    stream's resume point), of ``sources`` (empty: all)."""
    req = W.LogsRequest(id=t.id, follow=follow, tail=tail, since=since, cursor=cursor, sources=list(sources))
    return _each("Logs", req, LogEntry)


def events(t: Target, action: str = "") -> StreamPlan[SandboxEvent]:
    """This sandbox's lifecycle events from now on (``action``: only those)."""
    return _each("Events", W.SandboxEventsRequest(id=t.id, action=action), SandboxEvent)


# --- work -----------------------------------------------------------------------------------
def run_request(t: Target, cmd: builtins.list[str] | str, how: RunSettings) -> W.RunRequest:
    """A run's request; a string is run with ``sh -c``."""
    return W.RunRequest(
        id=t.id,
        cmd=["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd),
        env=_kv(how.get("env")),
        working_dir=how.get("workdir", ""),
        user=how.get("user", ""),
        tty=how.get("tty", False),
        timeout_seconds=how.get("timeout", 0),
    )


def _outputs(req: W.RunRequest) -> StreamPlan[Output]:
    call = yield Open("Run", req)
    while (item := (yield Receive(call, W.RunOutput))) is not None:
        yield Emit(_output(item))


def _result(req: W.RunRequest) -> Plan[RunResult]:
    call = yield Open("Run", req)
    out, err, code = bytearray(), bytearray(), -1
    while (item := (yield Receive(call, W.RunOutput))) is not None:
        o = _output(item)
        if o.stream == "stdout":
            out += o.data
        elif o.stream == "stderr":
            err += o.data
        else:
            code = o.exit_code if o.exit_code is not None else -1
    return RunResult(bytes(out), bytes(err), code)


def run_stream(t: Target, cmd: builtins.list[str] | str, **how: Unpack[RunSettings]) -> StreamPlan[Output]:
    """Run a workload, streaming its output; the last Output is ("exit", b"", code).
    A string is run with ``sh -c``."""
    return _outputs(run_request(t, cmd, how))


def run(t: Target, cmd: builtins.list[str] | str, **how: Unpack[RunSettings]) -> Plan[RunResult]:
    """Run a workload to its end: its stdout, stderr and exit code."""
    return (yield from _result(run_request(t, cmd, how)))


def run_script(t: Target, name: str, *args: str, **how: Unpack[RunSettings]) -> Plan[RunResult]:
    """Run the named script of the sandbox's config (``scripts=`` at create) with
    ``args``, as a workload; NOT_FOUND for a name it does not have."""
    return (yield from _result(attrs.evolve(run_request(t, list(args), how), script=name)))


def exec_request(t: Target, cmd: builtins.list[str] | str, size: tuple[int, int], how: RunSettings) -> dict[str, Any]:
    """The opening message of an Exec (its body on the wire)."""
    r = run_request(t, cmd, how)
    init = W.ExecRequest(
        id=r.id,
        cmd=r.cmd,
        env=r.env,
        working_dir=r.working_dir,
        user=r.user,
        tty=r.tty,
        tty_size=W.TerminalSize(width=size[0], height=size[1]),
        timeout_seconds=r.timeout_seconds,
    )
    return W.unstructure_body(W.ExecInput(init=init))


def exec_stdin(data: bytes) -> dict[str, Any]:
    return W.unstructure_body(W.ExecInput(stdin=bytes(data)))


def exec_close_stdin() -> dict[str, Any]:
    return W.unstructure_body(W.ExecInput(close_stdin=True))


def exec_resize(width: int, height: int) -> dict[str, Any]:
    return W.unstructure_body(W.ExecInput(resize=W.TerminalSize(width=width, height=height)))


def exec_output(body: dict[str, Any]) -> Output:
    return _output(structure(body, W.ExecOutput, "Exec"))


# --- ports and snapshots --------------------------------------------------------------------
def expose(t: Target, sandbox_port: int, host_port: int = 0, *, udp: bool = False) -> Plan[int]:
    """Forward a host port (on the supervisor's loopback) to ``sandbox_port``; returns it."""
    req = W.ExposePortRequest(id=t.id, sandbox_port=sandbox_port, host_port=host_port, protocol="udp" if udp else "tcp")
    r: W.ExposePortResponse = yield Unary("ExposePort", req, W.ExposePortResponse)
    return r.host_port


def unexpose(t: Target, sandbox_port: int, *, udp: bool = False) -> Plan[None]:
    req = W.UnexposePortRequest(id=t.id, sandbox_port=sandbox_port, protocol="udp" if udp else "tcp")
    yield Unary("UnexposePort", req, W.Empty)


def ports(t: Target) -> Plan[builtins.list[W.PortMapping]]:
    """The port mappings (``sandbox_port``, ``host_port``, ``protocol``,
    ``host_address``): a restored sandbox's carried ones with the host ports it got."""
    r: W.ListPortsResponse = yield Unary("ListPorts", _id(t), W.ListPortsResponse)
    return r.ports


def checkpoint(t: Target, name: str = "", *, labels: Mapping[str, str] | None = None) -> Plan[CheckpointResponse]:
    """Snapshot this sandbox; ``.snapshot_id`` names the snapshot. Ready: its disk and
    memory, and it runs on; stopped: its disk alone (``.disk_only``; restores boot)."""
    req = W.CheckpointRequest(sandbox_id=t.id, name=name, labels=_kv(labels))
    r: CheckpointResponse = yield Unary("Checkpoint", req, CheckpointResponse)
    return r


# --- files ----------------------------------------------------------------------------------
def read(t: Target, path: str) -> Plan[bytes]:
    chunks: list[W.FileChunk] = yield from _collect("ReadFile", W.ReadFileRequest(id=t.id, path=path), W.FileChunk)
    return b"".join(ch.data for ch in chunks)


def write(
    t: Target, path: str, data: bytes | Iterable[bytes] | AsyncIterable[bytes], *, mode: int = 0o644
) -> Plan[None]:
    """Write ``data`` (bytes, or an iterable of pieces; async too on Trio) to the file
    ``path``, streamed in 1 MiB chunks."""
    call = yield Open("WriteFile", W.WriteFileRequest(open=W.WriteFileOpen(id=t.id, path=path, mode=mode)))
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for i in range(0, len(view), CHUNK):
            yield Send(call, W.WriteFileRequest(chunk=W.FileChunk(data=bytes(view[i : i + CHUNK]))))
    else:
        source = data if isinstance(data, AsyncIterable) else iter(data)
        while (piece := (yield Pull(source))) is not None:
            yield Send(call, W.WriteFileRequest(chunk=W.FileChunk(data=bytes(piece))))
    yield Send(call, W.WriteFileRequest(chunk=W.FileChunk(done=True)))
    yield Finish(call, W.Empty)


def copy_in(t: Target, local: str | Path, path: str) -> Plan[None]:
    """``cp FILE box:/path``: the host file ``local`` (its mode too) into the sandbox."""
    src = Path(local)
    mode = src.stat().st_mode & 0o7777
    f = yield Blocking(open, (src, "rb"))
    with f:
        call = yield Open("WriteFile", W.WriteFileRequest(open=W.WriteFileOpen(id=t.id, path=path, mode=mode)))
        while piece := (yield Blocking(f.read, (CHUNK,))):
            yield Send(call, W.WriteFileRequest(chunk=W.FileChunk(data=piece)))
        yield Send(call, W.WriteFileRequest(chunk=W.FileChunk(done=True)))
        yield Finish(call, W.Empty)


def copy_out(t: Target, path: str, local: str | Path) -> Plan[None]:
    """``cp box:/path DEST``: the sandbox's file ``path`` into the host file ``local``.
    ``local`` naming a directory (a symlink to one too, as ``cp`` follows it; the
    kernel's protected_symlinks rule applies) means ``local/<basename of path>``.
    The file is written to a new, unpredictable name in the target directory
    (O_CREAT|O_EXCL|O_NOFOLLOW, mode 0666 & ~umask) and renamed into place when whole:
    whatever is at the final name (a file, a symlink a guest's tree or another
    user planted) is replaced, never written through or followed; nothing is left
    behind on a failure."""
    from supervisor.treecopy import commit_temp, create_temp, open_target

    dfd, name = yield Blocking(open_target, (os.fspath(local), path))
    try:
        tmp, fd = yield Blocking(create_temp, (dfd, name))
        done = False
        try:
            with open(fd, "wb", closefd=True) as f:
                call = yield Open("ReadFile", W.ReadFileRequest(id=t.id, path=path))
                while (ch := (yield Receive(call, W.FileChunk))) is not None:
                    yield Blocking(f.write, (ch.data,))
            yield Blocking(commit_temp, (dfd, tmp, name))
            done = True
        finally:
            if not done:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
    finally:
        os.close(dfd)


def copy_tree_in(t: Target, local: str | Path, path: str, *, owner: str = "") -> Plan[int]:
    """``cp -r DIR box:/path``: the host directory ``local`` into the sandbox's
    directory ``path`` (made if missing; existing directories merged, files
    replaced) as one tar stream packed here, with the caller's rights: modes,
    mtimes, symlinks, hard links, empty directories. ``owner`` "": every entry
    keeps its numeric uid/gid; else user[:group] (the guest's names) owns all.
    Returns the number of entries written."""
    from supervisor.treecopy import open_dir

    fd = yield Blocking(open_dir, (Path(local),))
    try:
        call = yield Open("WriteTree", W.WriteTreeRequest(open=W.WriteTreeOpen(id=t.id, path=path, owner=owner)))
        yield SendTree(call, fd, lambda piece: W.WriteTreeRequest(chunk=W.FileChunk(data=piece)))
    finally:
        os.close(fd)
    yield Send(call, W.WriteTreeRequest(chunk=W.FileChunk(done=True)))
    r: W.WriteTreeResponse = yield Finish(call, W.WriteTreeResponse)
    return r.entries


def copy_tree_out(t: Target, path: str, local: str | Path, *, keep_owners: bool = False) -> Plan[int]:
    """``cp -r box:/path DIR``: the sandbox's directory ``path`` into the host
    directory ``local`` (made if missing; the guest directory's mode and mtime
    become its own) as one tar stream, unpacked here by guestd's hostile-stream
    unpacker (no absolute names, '..', writes through symlinks, devices,
    setuid bits). ``keep_owners``: the guest's numeric owners (root only); else
    the files are the caller's. Returns the number of entries."""
    from supervisor.treecopy import open_dir

    dest = Path(local)
    yield Blocking(functools.partial(dest.parent.mkdir, parents=True, exist_ok=True))
    try:  # a DEST that was there keeps its mode, owner and times (as every directory in it)
        yield Blocking(dest.mkdir)
        made = True
    except FileExistsError:
        made = False
    fd = yield Blocking(open_dir, (dest,))
    try:
        call = yield Open("ReadTree", W.ReadTreeRequest(id=t.id, path=path))
        n: int = yield ReceiveTree(call, fd, keep_owners, made)
        return n
    finally:
        os.close(fd)


def fs_list(t: Target, path: str) -> Plan[builtins.list[W.FsEntry]]:
    """The entries of the directory ``path``, by name (``.kind``: file, dir, symlink,
    other; symlinks are not followed); NotFound, FailedPrecondition (not a directory)."""
    pages: list[W.FsListResponse] = yield from _collect("FsList", W.FsPathRequest(id=t.id, path=path), W.FsListResponse)
    return [e for page in pages for e in page.entries]


def fs_stat(t: Target, path: str) -> Plan[W.FsEntry]:
    """``path`` itself (a symlink as one, not followed); NotFound if it is not there."""
    e: W.FsEntry = yield Unary("FsStat", W.FsPathRequest(id=t.id, path=path), W.FsEntry)
    return e


def fs_exists(t: Target, path: str) -> Plan[bool]:
    r: W.FsExistsResponse = yield Unary("FsExists", W.FsPathRequest(id=t.id, path=path), W.FsExistsResponse)
    return r.exists


def fs_mkdir(t: Target, path: str, *, parents: bool = True, mode: int = 0o755) -> Plan[None]:
    """``mkdir -p`` (``parents=False``: ``mkdir``, AlreadyExists if it is there)."""
    yield Unary("FsMkdir", W.FsMkdirRequest(id=t.id, path=path, parents=parents, mode=mode), W.Empty)


def fs_remove(t: Target, path: str, *, recursive: bool = False) -> Plan[None]:
    """``rm`` of a file, a link or an empty directory; ``recursive``: ``rm -r``."""
    yield Unary("FsRemove", W.FsRemoveRequest(id=t.id, path=path, recursive=recursive), W.Empty)


def fs_rename(t: Target, path: str, dest: str) -> Plan[None]:
    """``mv path dest`` (one file system)."""
    yield Unary("FsRename", W.FsRenameRequest(id=t.id, path=path, dest=dest), W.Empty)


# --- volumes and images ---------------------------------------------------------------------
def volume_create(
    t: Target, name: str, size: int | str = "256M", *, labels: Mapping[str, str] | None = None
) -> Plan[VolumeInfo]:
    mib = -(-parse_size(size) // (1 << 20))
    req = W.CreateVolumeRequest(name=name, size_mib=mib, labels=dict(labels or {}))
    info: VolumeInfo = yield Unary("CreateVolume", req, VolumeInfo)
    return info


def volume_get(t: Target, name: str) -> Plan[VolumeInfo]:
    info: VolumeInfo = yield Unary("InspectVolume", W.NameRequest(name=name), VolumeInfo)
    return info


def volume_list(t: Target, *, labels: Mapping[str, str] | None = None) -> Plan[builtins.list[VolumeInfo]]:
    r: W.ListVolumesResponse = yield Unary(
        "ListVolumes", W.ListVolumesRequest(labels=dict(labels or {})), W.ListVolumesResponse
    )
    return r.volumes


def volume_remove(t: Target, name: str, *, force: bool = False) -> Plan[None]:
    """FAILED_PRECONDITION while a live sandbox mounts it; ``force``: those sandboxes
    are killed first (they stay, stopped)."""
    yield Unary("DeleteVolume", W.DeleteVolumeRequest(name=name, force=force), W.Empty)


Pull_ = Literal["", "always", "if-missing", "never"]


def _pull_request(
    ref: str, policy: Pull_, tls_verify: bool, creds: str, authfile: str | Path | None, ca: str | Path | None = None
) -> W.PullImageRequest:
    auth = Path(authfile).read_bytes() if authfile is not None else b""
    ca_pem = Path(ca).read_bytes() if ca is not None else b""
    return W.PullImageRequest(
        ref=ref, policy=policy, tls_verify=None if tls_verify else False, creds=creds, auth_json=auth, ca_pem=ca_pem
    )


def image_pull_stream(
    t: Target,
    ref: str,
    *,
    policy: Pull_ = "",
    tls_verify: bool = True,
    creds: str = "",
    authfile: str | Path | None = None,
    ca: str | Path | None = None,
) -> StreamPlan[PullImageProgress]:
    """Progress items; the last is ``phase == "done"`` with ``.image`` set. ``ca``: a
    PEM file of CA certificates for the registry (read here, sent as content)."""
    return _each("PullImage", _pull_request(ref, policy, tls_verify, creds, authfile, ca), PullImageProgress)


def image_pull(
    t: Target,
    ref: str,
    *,
    policy: Pull_ = "",
    tls_verify: bool = True,
    creds: str = "",
    authfile: str | Path | None = None,
    progress: Any = None,
    ca: str | Path | None = None,
) -> Plan[OciImageInfo]:
    """Pull ``ref`` (as ``policy`` says; default if-missing) and return the image;
    ``progress`` (a callable) sees every item on the way; ``ca``: a PEM file of CA
    certificates for the registry."""
    image = None
    call = yield Open("PullImage", _pull_request(ref, policy, tls_verify, creds, authfile, ca))
    while (item := (yield Receive(call, PullImageProgress))) is not None:
        if progress is not None:
            progress(item)
        if item.image is not None:
            image = item.image
    if image is None:
        raise error_for(W.INTERNAL, "PullImage ended without an image")
    got: OciImageInfo = image
    return got


def image_list(t: Target) -> Plan[builtins.list[OciImageInfo]]:
    r: W.ListImagesResponse = yield Unary("ListImages", W.Empty(), W.ListImagesResponse)
    return r.oci_images


def image_inspect(t: Target, ref: str) -> Plan[OciImageInfo]:
    info: OciImageInfo = yield Unary("InspectOciImage", W.ImageRefRequest(ref), OciImageInfo)
    return info


def image_remove(t: Target, ref: str) -> Plan[RemoveImageResponse]:
    """Untag ``ref``, or delete the image (a digest, or its last reference);
    FailedPrecondition while a sandbox, snapshot or template stands on it."""
    r: RemoveImageResponse = yield Unary("RemoveImage", W.ImageRefRequest(ref), RemoveImageResponse)
    return r


def image_prune(t: Target, *, dangling_only: bool = False) -> Plan[PruneImagesResponse]:
    r: PruneImagesResponse = yield Unary("PruneImages", W.PruneImagesRequest(dangling_only), PruneImagesResponse)
    return r


# --- secrets (docs/secrets.md) ------------------------------------------------------------------
def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def secret_set(t: Target, name: str, value: str | bytes, hosts: Sequence[str] | str = ()) -> Plan[None]:
    """An entry of the supervisor's store (made or replaced): every sandbox whose secret
    names it (``store=NAME``) puts the new value in from its next request on. ``hosts``
    (``"api.example.com,*.example.org"`` or a list): where its value may go; a sandbox's
    secret may narrow them, never widen them. None given: the entry keeps its own (a new
    entry must be given them)."""
    listed = [h.strip() for h in hosts.split(",")] if isinstance(hosts, str) else builtins.list(hosts)
    yield Unary("SetSecret", W.SetSecretRequest(name, _bytes(value), listed), W.Empty)


def secret_list(t: Target) -> Plan[builtins.list[str]]:
    """The store's entry names (never a value)."""
    r: W.ListSecretsResponse = yield Unary("ListSecrets", W.Empty(), W.ListSecretsResponse)
    return r.names


def secret_remove(t: Target, name: str) -> Plan[None]:
    yield Unary("DeleteSecret", W.NameRequest(name=name), W.Empty)


def rotate_secret(t: Target, name: str, value: str | bytes) -> Plan[None]:
    """A new value for this sandbox's own secret ``name``: its next request carries it
    (the placeholder stays)."""
    yield Unary("RotateSecret", W.RotateSecretRequest(t.id, name, _bytes(value)), W.Empty)


def revoke_secret(t: Target, name: str) -> Plan[None]:
    """Take secret ``name`` away from this running sandbox: its placeholder is no longer replaced."""
    yield Unary("RevokeSecret", W.SandboxSecretRequest(t.id, name), W.Empty)


def secrets(t: Target) -> Plan[builtins.list[W.SandboxSecretInfo]]:
    """This sandbox's secrets: names, hosts, placeholders, sources (never a value)."""
    r: W.SandboxSecretsResponse = yield Unary("ListSandboxSecrets", W.IdRequest(t.id), W.SandboxSecretsResponse)
    return r.secrets


# --- the method tables: the public surface of both SDKs, declared once ----------------------
class SandboxMethods:
    """The sandbox's methods (:class:`~supervisor.sdk.aio.AsyncSandbox`, awaitable;
    :class:`~supervisor.sdk.sync.Sandbox`, blocking)."""

    create = maker(create)
    get = maker(get)
    restore = maker(restore)
    list = class_op(list_)
    metrics_all = class_op(metrics_all)
    snapshots = class_op(snapshots)
    delete_snapshot = class_op(delete_snapshot)
    export_snapshot = class_op(export_snapshot)
    import_snapshot = class_op(import_snapshot)
    inspect = op(inspect)
    modify = op(modify)
    state = op(state)
    wait_ready = op(wait_ready)
    stop = op(stop)
    kill = op(kill)
    drain = op(drain)
    wait_until_stopped = op(wait_until_stopped)
    start = op(start)
    remove = op(remove)
    ping = op(ping)
    touch = op(touch)
    set_ttl = op(set_ttl)
    metrics = op(metrics)
    metrics_stream = stream(metrics_stream)
    logs = op(logs)
    log_stream = stream(log_stream)
    events = stream(events)
    run = op(run)
    run_script = op(run_script)
    run_stream = stream(run_stream)
    expose = op(expose)
    unexpose = op(unexpose)
    ports = op(ports)
    checkpoint = op(checkpoint)
    pause = op(pause)
    resume = op(resume)
    rotate_secret = op(rotate_secret)
    revoke_secret = op(revoke_secret)
    secrets = op(secrets)


class FSMethods:
    """Files in the sandbox (absolute paths)."""

    read = op(read)
    write = op(write)
    copy_in = op(copy_in)
    copy_out = op(copy_out)
    copy_tree_in = op(copy_tree_in)
    copy_tree_out = op(copy_tree_out)
    list = op(fs_list)
    stat = op(fs_stat)
    exists = op(fs_exists)
    mkdir = op(fs_mkdir)
    remove = op(fs_remove)
    rename = op(fs_rename)


class VolumeMethods:
    """The named volumes of a supervisor: persistent ext4 disks a Create mounts
    (``volumes=["NAME:/path", "NAME:/path:ro"]``), read-write in one live sandbox at a
    time, read-only in many; they outlive the sandboxes."""

    id = ""
    create = op(volume_create)
    get = op(volume_get)
    list = op(volume_list)
    remove = op(volume_remove)


class ImageMethods:
    """The supervisor's OCI image store (issue 15): pull (with progress), list, inspect,
    remove, prune. Credentials: ``creds="USER:PASSWORD"`` or ``authfile=PATH`` (a
    docker-style auth file, read here and sent as its content: the supervisor opens no
    path of yours)."""

    id = ""
    pull = op(image_pull)
    pull_stream = stream(image_pull_stream)
    list = op(image_list)
    inspect = op(image_inspect)
    remove = op(image_remove)
    prune = op(image_prune)


class SecretMethods:
    """The supervisor's secret store (docs/secrets.md): named values a sandbox's secret
    can take (``Secret(name=..., store=NAME, hosts=...)``); values go in, never out."""

    id = ""
    set = op(secret_set)
    list = op(secret_list)
    remove = op(secret_remove)
