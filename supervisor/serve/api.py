"""The method table both edges serve: one handler per method, transport-neutral.

:data:`METHODS` maps a method's name (this module's: a sandbox's life, work, files and
snapshots; :mod:`supervisor.serve.api_store`'s: the server's info, volumes, images and
secrets; each declared with ``@method``, :mod:`supervisor.serve.api_table`) to its request
class and shape and its handler ``handler(registry, io, request) -> response | None`` on typed
values (the attrs classes of :mod:`supervisor.wire.protocol`), with ``io.send(message)``
for a server stream and ``io.receive() -> message | None`` for a client stream (None:
the client half-closed). Each edge adapts its wire to it::

    msgpack Call{method, body} --structure (cattrs)--> request --handler--> response
        --unstructure--> Reply | Item* End                       (supervisor.serve.server)
    gRPC request (protobuf) --message_to_dict, structure--> request --handler--> response
        --unstructure, dict_to_message--> response (protobuf)    (supervisor.serve.grpc_service)

Every handler acts for ``io.principal`` (:mod:`actors.principals`): a sandbox, snapshot,
volume or stored secret it may not see is NOT_FOUND with the text of a real miss
(:mod:`supervisor.serve.access`), lists hold only what it may see, and what it makes is its
own.

Handlers check wire shapes (the first ExecInput carries init, paths are absolute),
map the wire to domain values and back (:mod:`supervisor.serve.mapping`), call the registry
or a sandbox, and raise domain errors (:mod:`actors.errors`), which each edge turns
into its wire's code of the same name. Every lifecycle rule lives in the domain
(:mod:`actors`). No transport here.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import attrs
import trio

from actors.face import (
    ALIVE,
    DEFAULT_STOP_TIMEOUT,
    LOG_SOURCES,
    CommandNotRun,
    DomainError,
    FailedPrecondition,
    FsEntry,
    InvalidArgument,
    Lagged,
    MemoryKind,
    NotFound,
    Registry,
    ResourceExhausted,
    RunExit,
    Sandbox,
    SandboxConfig,
    State,
    check_port,
    contents_with_snapshot,
    defaults,
    descendants,
    diff_trees,
    diff_with_snapshot,
    fork,
    fork_point_of,
    from_snapshot,
    modify,
    profiles,
    remove_with_descendants,
    rfc3339,
    sandbox_head,
    script_argv,
)
from guestd import proto
from supervisor.serve import access, api_code, api_readback, api_store, mapping
from supervisor.serve.api_table import CallIO, Method, Table, feed, joined, stopped
from supervisor.wire import protocol

MAX_IMPORT = 1 << 40  # bytes of one snapshot import's stream (the import bounds each file itself)
_TABLE = Table()
method = _TABLE.method


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise InvalidArgument("path must be absolute")
    return path


@method("Create", protocol.CreateSandboxRequest)
async def _create(reg: Registry, io: CallIO, req: protocol.CreateSandboxRequest) -> protocol.CreateSandboxResponse:
    config = mapping.config(req)
    config = attrs.evolve(config, network=profiles.expand(config.network, reg.settings.network_profiles))
    for address in {config.network.port_address, *(p.host_address for p in config.ports)}:
        reg.settings.check_bind_address(address)
    if req.from_snapshot:  # a restore with the Create's other settings (actors/from_snapshot.py)
        return await _create_from_snapshot(reg, io, req, config)
    access.check_uses(reg, io.principal, config)
    sb = await reg.create(
        req.id, config, mapping.secret_values(req), pull_auth=mapping.pull_auth(req), owner=io.principal.name
    )
    # sandbox.v1: "State at time of response: always starting" (ready follows as an event,
    # at once when a warm pool member served it)
    return protocol.CreateSandboxResponse(id=sb.id, ip_address=sb.ip_address, state=State.STARTING.value)


async def _create_from_snapshot(
    reg: Registry, io: CallIO, req: protocol.CreateSandboxRequest, config: SandboxConfig
) -> protocol.CreateSandboxResponse:
    if req.secrets:
        raise InvalidArgument("from_snapshot: the snapshot's secrets are kept (a Create from one names none)")
    if from_snapshot.is_path(req.from_snapshot):
        snap = await from_snapshot.import_file(reg, req.from_snapshot, owner=io.principal.name)
    else:
        snap = access.snapshot(reg, io.principal, req.from_snapshot)
    blank = mapping.config(protocol.CreateSandboxRequest())
    sb = await from_snapshot.create(reg, snap, req.id, config, blank, owner=io.principal.name)
    return protocol.CreateSandboxResponse(id=sb.id, ip_address=sb.ip_address, state=sb.state.value)


@method("Start", protocol.IdRequest)
async def _start(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.CreateSandboxResponse:
    sb = await reg.start(access.sandbox(reg, io.principal, req.id).id)
    return protocol.CreateSandboxResponse(id=sb.id, ip_address=sb.ip_address, state=sb.state.value)


@method("Inspect", protocol.IdRequest)
async def _inspect(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.SandboxInfo:
    return mapping.info(access.sandbox(reg, io.principal, req.id))


@method("Modify", protocol.ModifyRequest)
async def _modify(reg: Registry, io: CallIO, req: protocol.ModifyRequest) -> protocol.ModifyResponse:
    sb = access.sandbox(reg, io.principal, req.id)
    for spec in req.secrets:  # a principal names only store entries it may see (else as a miss)
        if spec.store:
            access.stored_secret(reg, io.principal, spec.store)
    return mapping.modify_response(await modify(reg, sb.id, mapping.modification(req)))


@method("List", protocol.ListSandboxesRequest)
async def _list(reg: Registry, io: CallIO, req: protocol.ListSandboxesRequest) -> protocol.ListSandboxesResponse:
    page, cursor = reg.list(
        state=mapping.state(req.state),
        labels=req.labels,
        limit=req.limit or 20,
        cursor=req.cursor,
        viewer=io.principal,
        within=_family(reg, io, req.ancestor),
    )
    return protocol.ListSandboxesResponse([mapping.summary(sb) for sb in page], cursor)


def _family(reg: Registry, io: CallIO, ancestor: str) -> list[Sandbox] | None:
    """List's ``ancestor``: its descendants (the ancestor one the caller sees); "": all."""
    return descendants(reg, access.sandbox(reg, io.principal, ancestor)) if ancestor else None


@method("ListAll", protocol.ListSandboxesRequest)
async def _list_all(reg: Registry, io: CallIO, req: protocol.ListSandboxesRequest) -> protocol.ListSandboxesResponse:
    """Every match, newest first, in one response (sandbox.v1's List has no paging)."""
    state, out, cursor = mapping.state(req.state), [], ""
    while True:
        page, cursor = reg.list(
            state=state,
            labels=req.labels,
            limit=100,
            cursor=cursor,
            viewer=io.principal,
            within=_family(reg, io, req.ancestor),
        )
        out += [mapping.summary(sb) for sb in page]
        if not cursor:
            return protocol.ListSandboxesResponse(out)


@method("Stop", protocol.StopSandboxRequest)
async def _stop(reg: Registry, io: CallIO, req: protocol.StopSandboxRequest) -> None:
    if req.timeout_seconds < 0:
        raise InvalidArgument("timeout_seconds must not be negative")
    timeout = float(req.timeout_seconds or DEFAULT_STOP_TIMEOUT)
    sb = reg.stop(access.sandbox(reg, io.principal, req.id).id, timeout)
    await stopped(sb, timeout + defaults.STOP_GRACE)


@method("Kill", protocol.KillRequest)
async def _kill(reg: Registry, io: CallIO, req: protocol.KillRequest) -> None:
    sb = reg.kill(access.sandbox(reg, io.principal, req.id).id)
    await stopped(sb, _kill_timeout(sb, req.timeout_seconds))


def _kill_timeout(sb: Sandbox, timeout: int) -> float:
    """How long a Kill waits to see it stopped: the call's, the sandbox's, else STOP_GRACE."""
    if timeout < 0:
        raise InvalidArgument("timeout_seconds must not be negative")
    return float(timeout or sb.config.timers.kill_timeout_seconds or defaults.STOP_GRACE)


@method("RequestStop", protocol.StopSandboxRequest)
async def _request_stop(reg: Registry, io: CallIO, req: protocol.StopSandboxRequest) -> None:
    """Stop without waiting: the sandbox's own run carries the stop out (WaitUntilStopped)."""
    if req.timeout_seconds < 0:
        raise InvalidArgument("timeout_seconds must not be negative")
    reg.stop(access.sandbox(reg, io.principal, req.id).id, float(req.timeout_seconds or DEFAULT_STOP_TIMEOUT))


@method("RequestKill", protocol.KillRequest)
async def _request_kill(reg: Registry, io: CallIO, req: protocol.KillRequest) -> None:
    reg.kill(access.sandbox(reg, io.principal, req.id).id)


@method("Drain", protocol.DrainRequest)
async def _drain(reg: Registry, io: CallIO, req: protocol.DrainRequest) -> None:
    if req.grace_seconds < 0:
        raise InvalidArgument("grace_seconds must not be negative")
    reg.drain(access.sandbox(reg, io.principal, req.id).id, float(req.grace_seconds))


@method("WaitUntilStopped", protocol.IdRequest)
async def _wait(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.SandboxInfo:
    sb = access.sandbox(reg, io.principal, req.id)
    await sb.wait_stopped()
    return mapping.info(sb)


@method("Remove", protocol.RemoveSandboxRequest)
async def _remove(reg: Registry, io: CallIO, req: protocol.RemoveSandboxRequest) -> None:
    sb = access.sandbox(reg, io.principal, req.id)
    if req.with_descendants:  # (those the caller sees: others' forks stay)
        await remove_with_descendants(
            reg, sb.id, force=req.force, may_remove=lambda d: io.principal.may_see(d.record.owner)
        )
    else:
        await reg.remove(sb.id, req.force)


@method("Run", protocol.RunRequest, streams=True)
async def _run(reg: Registry, io: CallIO, req: protocol.RunRequest) -> None:
    sb = access.sandbox(reg, io.principal, req.id)
    cmd = script_argv(sb.config.scripts, req.script, req.cmd) if req.script else req.cmd
    workload = sb.run_workload(
        cmd, env=req.env, cwd=req.working_dir, user=req.user, tty=req.tty, timeout=float(req.timeout_seconds)
    )
    # closed here, in this task: a cancelled Run (the client's cancel, a gRPC deadline, a
    # disconnect) kills its process and returns the sandbox to ready at once, not when
    # the garbage collector finds the generator
    async with aclosing(workload) as outputs:
        async for stream, data, code in outputs:
            if code is None:
                await io.send(protocol.RunOutput(stream=stream, data=data))
            else:
                oom = isinstance(code, RunExit) and code.oom_killed
                await io.send(protocol.RunOutput(stream="exit", exit_code=code, done=True, oom_killed=oom))


@method("Exec", protocol.ExecInput, streams=True, inputs=protocol.ExecInput)
async def _exec(reg: Registry, io: CallIO, first: protocol.ExecInput) -> None:
    if first.init is None:
        raise InvalidArgument("the first ExecInput must carry init")
    if first.stdin is not None or first.resize is not None or first.close_stdin:
        raise InvalidArgument("the first ExecInput carries init only")
    req = first.init
    sb = access.sandbox(reg, io.principal, req.id)
    try:
        if req.detachable:
            await api_readback.held_exec(sb, req, io)
            return
        await _exec_session(sb, req, io)
    except CommandNotRun as exc:  # raised before any output: the stream ends as a shell's
        sb.log.append("stderr", exc.stderr)
        await io.send(protocol.RunOutput(stream="stderr", data=exc.stderr))
        await io.send(protocol.RunOutput(stream="exit", exit_code=exc.exit_code, done=True))


async def _exec_session(sb: Sandbox, req: protocol.ExecRequest, io: CallIO) -> None:
    session = sb.log.new_session()  # its log entries carry it
    async with (
        sb.exec_session(
            req.cmd,
            env=req.env,
            cwd=req.working_dir,
            user=req.user,
            tty=req.tty,
            rows=req.tty_size.height,
            cols=req.tty_size.width,
            timeout=float(req.timeout_seconds),
        ) as h,
        trio.open_nursery() as nursery,
    ):

        async def pump_input() -> None:
            while True:
                msg: protocol.ExecInput | None = await io.receive()
                if msg is None:  # the client half-closed: end of stdin
                    await h.close_stdin()
                    return
                await feed(h, msg, tty=req.tty)
                sb.touch()

        nursery.start_soon(pump_input)
        async for ch, data in h:
            name = "stderr" if ch == proto.STDERR else "stdout"
            sb.log.append("output" if req.tty else name, data, session)
            await io.send(protocol.RunOutput(stream=name, data=data))
        nursery.cancel_scope.cancel()
    assert h.exit is not None
    await io.send(protocol.RunOutput(stream="exit", exit_code=h.exit.code, done=True, oom_killed=h.exit.oom_killed))


@method("Events", protocol.SandboxEventsRequest, streams=True)
async def _events(reg: Registry, io: CallIO, req: protocol.SandboxEventsRequest) -> None:
    sub = reg.events.subscribe(req.id, req.action, viewer=io.principal)  # first: nothing falls between
    try:
        last = 0  # the last cursor sent from the log: the live events up to it were sent already
        if req.since is not None:
            if reg.events.backlog is None:
                raise FailedPrecondition("this supervisor keeps no event log: since cannot resume")
            if req.since < 0:
                raise InvalidArgument(f"since {req.since}: a cursor is 0 or more")
            last = req.since
            while page := reg.events.backlog(last, 1000):
                for ev in page:
                    if sub.wants(ev):
                        await io.send(mapping.event(ev))
                last = page[-1].cursor
        async for ev in sub:
            if ev.cursor and ev.cursor <= last:
                continue
            await io.send(mapping.event(ev))
    except Lagged as exc:
        raise ResourceExhausted(str(exc)) from None
    finally:
        reg.events.unsubscribe(sub)


@method("ReadFile", protocol.ReadFileRequest, streams=True)
async def _read_file(reg: Registry, io: CallIO, req: protocol.ReadFileRequest) -> None:
    sb = access.sandbox(reg, io.principal, req.id)
    async with sb.read_file(_absolute(req.path)) as f:
        async for chunk in f:
            await io.send(protocol.FileChunk(data=chunk))
    await io.send(protocol.FileChunk(done=True))


@method("WriteFile", protocol.WriteFileRequest, inputs=protocol.WriteFileRequest)
async def _write_file(reg: Registry, io: CallIO, first: protocol.WriteFileRequest) -> None:
    if first.open is None:
        raise InvalidArgument("the first WriteFileRequest must carry open")
    op = first.open
    path = _absolute(op.path)
    sb = access.sandbox(reg, io.principal, op.id)

    await sb.write_file(path, _chunks_in(io, protocol.WriteFileRequest, proto.MAX_FILE, "file"), mode=op.mode or 0o644)


async def _chunks_in(io: CallIO, cls: type[Any], limit: int, what: str) -> AsyncGenerator[bytes]:
    """The ``chunk`` bytes of a client stream after its opening message, up to ``limit``.
    The stream must end with a chunk marked ``done`` and then the client's half-close:
    one that ends without it, or sends more after it, is INVALID_ARGUMENT, raised before
    the guest is told the data ended, so nothing is committed (the guest discards its
    temporary file when the request goes)."""
    total = 0
    while True:
        msg = await io.receive()
        if msg is None:
            raise InvalidArgument(f"the {what} stream ended without a chunk marked done: nothing was written")
        assert isinstance(msg, cls)
        if msg.chunk is None:
            raise InvalidArgument("after open, only chunks")
        total += len(msg.chunk.data)
        if total > limit:
            raise ResourceExhausted(f"{what} exceeds {limit} bytes")
        if msg.chunk.data:
            yield msg.chunk.data
        if msg.chunk.done:
            if await io.receive() is not None:
                raise InvalidArgument(f"the {what} stream sent data after its chunk marked done: nothing was written")
            return


@method("ReadTree", protocol.ReadTreeRequest, streams=True)
async def _read_tree(reg: Registry, io: CallIO, req: protocol.ReadTreeRequest) -> None:
    """``cp -r box:/path DIR``: the guest packs, the client unpacks (with its own rights)."""
    sb = access.sandbox(reg, io.principal, req.id)
    async with sb.read_tree(_absolute(req.path)) as tar:
        async for chunk in tar:
            await io.send(protocol.FileChunk(data=chunk))
    await io.send(protocol.FileChunk(done=True))


@method("WriteTree", protocol.WriteTreeRequest, inputs=protocol.WriteTreeRequest)
async def _write_tree(reg: Registry, io: CallIO, first: protocol.WriteTreeRequest) -> protocol.WriteTreeResponse:
    """``cp -r DIR box:/path``: the client packs, guestd unpacks (hostile archives refused)."""
    if first.open is None:
        raise InvalidArgument("the first WriteTreeRequest must carry open")
    sb = access.sandbox(reg, io.principal, first.open.id)
    chunks = _chunks_in(io, protocol.WriteTreeRequest, proto.MAX_TREE_STREAM, "tree stream")
    n = await sb.write_tree(_absolute(first.open.path), chunks, owner=first.open.owner)
    return protocol.WriteTreeResponse(entries=n)


# --- file-system operations (guestd's fs requests) -------------------------------------------
def _fs_entry(e: FsEntry, path: str) -> protocol.FsEntry:
    return protocol.FsEntry(e.name, path, e.kind, e.size, e.mode, e.uid, e.gid, e.mtime_ns, e.target)


FS_PAGE = 1000  # entries of one FsList item at most
FS_PAGE_BYTES = 1 << 20  # ... and about this many bytes of names (a frame or gRPC message: 4 MiB)


@method("FsList", protocol.FsPathRequest, streams=True)
async def _fs_list(reg: Registry, io: CallIO, req: protocol.FsPathRequest) -> None:
    """The entries of a directory of the guest, by name (symlinks as links), in pages
    (a directory's entries may take more than one message may carry)."""
    path = _absolute(req.path)
    base = "/" + posixpath.normpath(path).lstrip("/")
    page: list[protocol.FsEntry] = []
    size = 0
    for e in await access.sandbox(reg, io.principal, req.id).fs_list(path):
        entry = _fs_entry(e, posixpath.join(base, e.name))
        page.append(entry)
        size += len(entry.name.encode()) + len(entry.path.encode()) + len(entry.target.encode()) + 64
        if len(page) >= FS_PAGE or size >= FS_PAGE_BYTES:
            await io.send(protocol.FsListResponse(page))
            page, size = [], 0
    if page:
        await io.send(protocol.FsListResponse(page))


@method("FsStat", protocol.FsPathRequest)
async def _fs_stat(reg: Registry, io: CallIO, req: protocol.FsPathRequest) -> protocol.FsEntry:
    path = _absolute(req.path)
    e = await access.sandbox(reg, io.principal, req.id).fs_stat(path)
    return _fs_entry(attrs.evolve(e, name=posixpath.basename(e.name) or "/"), posixpath.normpath(path))


@method("FsExists", protocol.FsPathRequest)
async def _fs_exists(reg: Registry, io: CallIO, req: protocol.FsPathRequest) -> protocol.FsExistsResponse:
    """Whether the path exists (a dangling symlink does: it is there)."""
    sb = access.sandbox(reg, io.principal, req.id)  # (a missing sandbox is NOT_FOUND)
    try:
        await sb.fs_stat(_absolute(req.path))
    except NotFound:
        return protocol.FsExistsResponse(False)
    return protocol.FsExistsResponse(True)


@method("FsMkdir", protocol.FsMkdirRequest)
async def _fs_mkdir(reg: Registry, io: CallIO, req: protocol.FsMkdirRequest) -> None:
    if not 0 <= req.mode <= 0o7777:
        raise InvalidArgument("mode must be 0..0o7777")
    path = _absolute(req.path)
    await access.sandbox(reg, io.principal, req.id).fs_change(
        "mkdir", path, recursive=req.parents, mode=req.mode or 0o755
    )


@method("FsRemove", protocol.FsRemoveRequest)
async def _fs_remove(reg: Registry, io: CallIO, req: protocol.FsRemoveRequest) -> None:
    await access.sandbox(reg, io.principal, req.id).fs_change("remove", _absolute(req.path), recursive=req.recursive)


@method("FsRename", protocol.FsRenameRequest)
async def _fs_rename(reg: Registry, io: CallIO, req: protocol.FsRenameRequest) -> None:
    await access.sandbox(reg, io.principal, req.id).fs_change("rename", _absolute(req.path), dest=_absolute(req.dest))


@method("Ping", protocol.IdRequest)
async def _ping(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.PingResponse:
    sb = access.sandbox(reg, io.principal, req.id)
    t = time.monotonic_ns()
    pong = await sb.guest_call(lambda g: g.channel.ping())
    return protocol.PingResponse(latency_ns=time.monotonic_ns() - t, activity=pong.activity)


@method("Touch", protocol.IdRequest)
async def _touch(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.TouchResponse:
    sb = access.sandbox(reg, io.principal, req.id)
    activity = await sb.guest_call(lambda g: g.channel.touch())
    sb.touch()
    return protocol.TouchResponse(activity=activity)


@method("SetTtl", protocol.SetTtlRequest)
async def _set_ttl(reg: Registry, io: CallIO, req: protocol.SetTtlRequest) -> protocol.SetTtlResponse:
    return protocol.SetTtlResponse(
        expires_at=reg.set_ttl(access.sandbox(reg, io.principal, req.id).id, req.ttl_seconds)
    )


@method("Logs", protocol.LogsRequest, streams=True)
async def _logs(reg: Registry, io: CallIO, req: protocol.LogsRequest) -> None:
    if req.tail < 0:
        raise InvalidArgument("tail must not be negative")
    bad = sorted(set(req.sources) - set(LOG_SOURCES))
    if bad:
        raise InvalidArgument(f"unknown log source {bad[0][:40]!r}: the sources are {', '.join(LOG_SOURCES)}")
    sources = frozenset(req.sources)
    sb = access.sandbox(reg, io.principal, req.id)
    cursor, tail = req.cursor, req.tail
    if req.follow:
        # the stream ends at ``until`` by the clock too, not only at a later entry; only
        # the wait for the next entry is cancelled (never a send: the frame stays whole)
        end = trio.current_time() + (req.until - time.time_ns()) / 1e9 if req.until else float("inf")
        follow = sb.log.follow(tail=req.tail, since=req.since, cursor=req.cursor, sources=sources)
        async with aclosing(follow) as records:
            while True:
                r = None
                with trio.move_on_at(end):
                    try:
                        r = await anext(records)
                    except StopAsyncIteration:
                        return
                if r is None:
                    break
                if req.until and r.timestamp > req.until:
                    return
                await io.send(protocol.LogEntry(r.seq, r.timestamp, r.source, r.data, r.session))
                cursor, tail = r.seq, 0
        # the clock passed ``until``: what was written up to it and is not sent yet
    for r in await sb.log.read(tail=tail, since=req.since, until=req.until, cursor=cursor, sources=sources):
        await io.send(protocol.LogEntry(r.seq, r.timestamp, r.source, r.data, r.session))


async def _metrics_of(sb: Sandbox) -> protocol.MetricsResponse:
    return mapping.metrics(await sb.metrics(), cpu_seconds_total=sb.host_cpu_seconds())


@method("Metrics", protocol.IdRequest)
async def _metrics(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.MetricsResponse:
    return await _metrics_of(access.sandbox(reg, io.principal, req.id))


def _alive(sandboxes: list[Sandbox]) -> list[Sandbox]:
    return [sb for sb in sandboxes if sb.state in ALIVE]


async def _sample(sandboxes: list[Sandbox]) -> list[protocol.MetricsResponse]:
    """Live sandboxes' metrics, asked concurrently: a silent guest costs its own answer
    (bounded by the guest deadline), not everyone's."""
    alive = _alive(sandboxes)
    found: dict[str, protocol.MetricsResponse] = {}

    async def one(sb: Sandbox) -> None:
        try:
            found[sb.id] = await _metrics_of(sb)
        except DomainError:
            pass

    async with trio.open_nursery() as nursery:
        for sb in alive:
            nursery.start_soon(one, sb)
    return [found[sb.id] for sb in alive if sb.id in found]


@method("MetricsStream", protocol.MetricsStreamRequest, streams=True)
async def _metrics_stream(reg: Registry, io: CallIO, req: protocol.MetricsStreamRequest) -> None:
    if not 0.1 <= req.interval_seconds <= 3600:
        raise InvalidArgument("interval_seconds must be 0.1 to 3600")
    while True:
        if req.id:
            sb = access.sandbox(reg, io.principal, req.id)
            if sb.state in ALIVE:
                await io.send(await _metrics_of(sb))
        else:
            for m in await _sample(access.visible(io.principal, reg.sandboxes.values())):
                await io.send(m)
        await trio.sleep(req.interval_seconds)


@method("MetricsAll", protocol.Empty)
async def _metrics_all(reg: Registry, io: CallIO, req: protocol.Empty) -> protocol.MetricsAllResponse:
    return protocol.MetricsAllResponse(await _sample(access.visible(io.principal, reg.sandboxes.values())))


@method("ExposePort", protocol.ExposePortRequest)
async def _expose(reg: Registry, io: CallIO, req: protocol.ExposePortRequest) -> protocol.ExposePortResponse:
    check_port(req.sandbox_port, req.host_port)
    pm = await access.sandbox(reg, io.principal, req.id).expose(
        req.sandbox_port, req.host_port, mapping.port_protocol(req.protocol), req.host_address
    )
    # idempotent: a port exposed already answers with its mapping. The guest needs no
    # relay port: slirp forwards, and on tap the relay connects, to the sandbox port
    return protocol.ExposePortResponse(host_port=pm.host_port, guest_port=pm.sandbox_port)


@method("UnexposePort", protocol.UnexposePortRequest)
async def _unexpose(reg: Registry, io: CallIO, req: protocol.UnexposePortRequest) -> None:
    check_port(req.sandbox_port)
    await access.sandbox(reg, io.principal, req.id).unexpose(req.sandbox_port, mapping.port_protocol(req.protocol))


@method("ListPorts", protocol.IdRequest)
async def _list_ports(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.ListPortsResponse:
    return mapping.ports(access.sandbox(reg, io.principal, req.id))


@method("Checkpoint", protocol.CheckpointRequest)
async def _checkpoint(reg: Registry, io: CallIO, req: protocol.CheckpointRequest) -> protocol.CheckpointResponse:
    sb = access.sandbox(reg, io.principal, req.sandbox_id)
    rec, ck = await reg.checkpoint(sb.id, name=req.name, labels=req.labels, owner=io.principal.name)
    return protocol.CheckpointResponse(
        snapshot_id=rec.id,
        snapshot_dir=rec.dir,
        created_at=rfc3339(rec.created_ns),
        size_bytes=sum(rec.sizes.values()),
        memory=rec.memory.value,
        paused_ms=round(ck.paused_s * 1000, 3),
        disk_only=rec.memory == MemoryKind.DISK,
    )


@method("Restore", protocol.RestoreRequest)
async def _restore(reg: Registry, io: CallIO, req: protocol.RestoreRequest) -> protocol.RestoreResponse:
    sb = await reg.restore(
        access.snapshot(reg, io.principal, req.snapshot_id).id,
        id=req.id,
        labels=req.labels,
        ttl_seconds=req.ttl_seconds,
        network_override=req.network_override,
        owner=io.principal.name,
    )
    return protocol.RestoreResponse(id=sb.id, ip_address=sb.ip_address)


@method("Fork", protocol.ForkRequest)
async def _fork(reg: Registry, io: CallIO, req: protocol.ForkRequest) -> protocol.ForkResponse:
    """Children of a sandbox the caller sees, the caller's own (docs/fork.md)."""
    parent = access.sandbox(reg, io.principal, req.id)
    done = await fork(
        reg,
        parent.id,
        req.count,
        names=req.names,
        name_prefix=req.name_prefix,
        labels=req.labels,
        owner=io.principal.name,
    )
    return protocol.ForkResponse(
        [protocol.ForkedSandbox(sb.id, sb.ip_address, sb.record.uid) for sb in done.children],
        snapshot_id=done.snapshot.id,
        paused_ms=round(done.paused_s * 1000, 3),
    )


@method("Diff", protocol.DiffRequest)
async def _diff(reg: Registry, io: CallIO, req: protocol.DiffRequest) -> protocol.DiffResponse:
    """What differs between two sandboxes the caller sees, under ``path`` (docs/fork.md):
    each guest packs only its own tree; the host hashes and compares. Or between the
    snapshot a sandbox was forked from (``fork_point``), or one the caller sees
    (``snapshot``), and the sandbox: that side is the snapshot's disk, read on the host.
    ``content``: both sides of one file instead."""
    b = access.sandbox(reg, io.principal, req.id)
    if req.fork_point or req.snapshot:
        if req.other or (req.fork_point and req.snapshot):
            raise InvalidArgument("compare a sandbox with one of: another sandbox, its fork point, a snapshot")
        # (looked up and held in one step: a retired fork point cannot go in between)
        snap = fork_point_of(reg, b) if req.fork_point else access.snapshot(reg, io.principal, req.snapshot)
        if req.content:
            ca, cb = await contents_with_snapshot(reg, b, snap, _absolute(req.content))
            return _contents(ca, cb, base=snap.id)
        changes, n_a, n_b = await diff_with_snapshot(reg, b, snap, _absolute(req.path or "/"))
        return protocol.DiffResponse(
            [mapping.diff_change(c) for c in changes], entries_a=n_a, entries_b=n_b, base=snap.id
        )
    a, b = b, access.sandbox(reg, io.principal, req.other)
    if req.content:
        path = _absolute(req.content)
        return _contents(await sandbox_head(a, path), await sandbox_head(b, path))
    changes, n_a, n_b = await diff_trees(a.read_tree, b.read_tree, _absolute(req.path or "/"))
    return protocol.DiffResponse([mapping.diff_change(c) for c in changes], entries_a=n_a, entries_b=n_b)


def _contents(a: bytes | None, b: bytes | None, base: str = "") -> protocol.DiffResponse:
    return protocol.DiffResponse(
        [],
        base=base,
        content_a=a or b"",
        content_b=b or b"",
        found_a=a is not None,
        found_b=b is not None,
    )


@method("ListSnapshots", protocol.ListSnapshotsRequest)
async def _list_snapshots(
    reg: Registry, io: CallIO, req: protocol.ListSnapshotsRequest
) -> protocol.ListSnapshotsResponse:
    return protocol.ListSnapshotsResponse(
        [
            mapping.snapshot(r, reg.pool_ready(r))
            for r in reg.list_snapshots(req.sandbox_id, req.labels, viewer=io.principal)
        ]
    )


@method("DeleteSnapshot", protocol.DeleteSnapshotRequest)
async def _delete_snapshot(reg: Registry, io: CallIO, req: protocol.DeleteSnapshotRequest) -> None:
    await reg.delete_snapshot(access.snapshot(reg, io.principal, req.snapshot_id).id)


@method("ExportSnapshot", protocol.ExportSnapshotRequest, streams=True)
async def _export_snapshot(reg: Registry, io: CallIO, req: protocol.ExportSnapshotRequest) -> None:
    """The snapshot as one file, in chunks of about 1 MiB, then ``done``."""
    snap = access.snapshot(reg, io.principal, req.snapshot_id)
    async with aclosing(reg.export_snapshot(snap.id, include_base=req.include_base)) as pieces:
        async for piece in pieces:
            await io.send(protocol.FileChunk(data=piece))
    await io.send(protocol.FileChunk(done=True))


@method("ImportSnapshot", protocol.ImportSnapshotRequest, inputs=protocol.ImportSnapshotRequest)
async def _import_snapshot(
    reg: Registry, io: CallIO, first: protocol.ImportSnapshotRequest
) -> protocol.SnapshotSummary:
    """An export file's bytes in, a new snapshot (a new id) out; nothing is recorded
    unless every byte arrived and matched the file's digest."""
    if first.open is None:
        raise InvalidArgument("the first ImportSnapshotRequest must carry open")
    op = first.open
    async with aclosing(_chunks_in(io, protocol.ImportSnapshotRequest, MAX_IMPORT, "snapshot import")) as chunks:
        rec = await reg.import_snapshot(chunks, name=op.name or None, labels=op.labels or None, owner=io.principal.name)
    return mapping.snapshot(rec, 0)


# --- hibernation ------------------------------------------------------------------------------
@method("Pause", protocol.IdRequest)
async def _pause(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.SandboxInfo:
    """Hibernate a ready sandbox to disk; answers once it is paused (no QEMU)."""
    return mapping.info(await reg.pause(access.sandbox(reg, io.principal, req.id).id))


@method("Resume", protocol.IdRequest)
async def _resume(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.SandboxInfo:
    """Bring a paused sandbox back as itself; answers once it is ready."""
    return mapping.info(await reg.resume(access.sandbox(reg, io.principal, req.id).id))


# every method both edges serve
METHODS: dict[str, Method] = joined(_TABLE, api_store.TABLE, api_readback.TABLE, api_code.TABLE)
