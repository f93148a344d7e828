"""The plans of one sandbox's life and work (see :mod:`supervisor.client.sdk.ops`): create, get
and list; state (inspect, modify, wait, stop, start, pause, ...), logs, metrics and
events; Run and Exec; ports. No I/O and no event loop here; the tables of
:mod:`supervisor.client.sdk.plans` make them the SDKs' methods.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

import attrs

from supervisor.client.sdk.modify_spec import SecretUpdate, secret_specs
from supervisor.client.sdk.network import Egress, egress_spec
from supervisor.client.sdk.ops import (
    TIMED_OUT,
    Emit,
    Expired,
    Made,
    Now,
    Open,
    Plan,
    Receive,
    StreamPlan,
    Target,
    Unary,
    collect,
    each,
    id_request,
    structure,
)
from supervisor.client.sdk.spec import (
    Output,
    Page,
    RunResult,
    RunSettings,
    SandboxSpec,
    Secret,
    Settings,
    _kv,
    _output,
    size_mib,
)
from supervisor.wire import protocol
from supervisor.wire.errors import DeadlineExceeded, FailedPrecondition, NotFound, SandboxError, error_for
from supervisor.wire.protocol import (
    LogEntry,
    MetricsResponse,
    ModifyResponse,
    SandboxEvent,
    SandboxInfo,
)

ENDED = ("ready", "failed", "stopped")  # the events that end a wait for ready
# s: a wait for ready asks Inspect after 1 s (an event before the server subscribed the
# wait is missed), then less often (by then the subscription is in place: the event
# ends the wait); every Inspect is a call the supervisor serves (bursts: benchmarks/burst.py)
READY_POLL_FIRST, READY_POLL_MAX = 1.0, 8.0


# --- creation and lookup --------------------------------------------------------------------
def create(
    name: str = "",
    spec: SandboxSpec | None = None,
    *,
    socket: str | Path | None = None,
    replace: bool = False,
    replace_timeout: float | None = None,
    detached: bool = False,
    wait: bool = True,
    timeout: float = 120.0,
    **settings: Unpack[Settings],
) -> Plan[Made]:
    """Create a sandbox from ``spec`` with ``settings`` applied on top, and by default
    wait until it is ready (``timeout`` seconds; a sandbox that fails to become ready
    is removed unless ``detached``). ``replace`` replaces an existing sandbox of that
    name: it is stopped gracefully (its workloads get ``replace_timeout`` seconds, 10 by
    default; giving it implies ``replace``; 0: killed at once), then removed.
    Leaving ``with`` removes it unless ``detached``."""
    req = (spec or SandboxSpec()).with_(**settings).request(name)
    if (replace or replace_timeout is not None) and name:
        yield from _replace(name, REPLACE_TIMEOUT if replace_timeout is None else replace_timeout)
    resp: protocol.CreateSandboxResponse = yield Unary("Create", req, protocol.CreateSandboxResponse)
    if wait:
        try:
            yield from _wait_ready(resp.id, timeout)
        except BaseException:
            if not detached:
                with contextlib.suppress(SandboxError):
                    yield Unary(
                        "Remove", protocol.RemoveSandboxRequest(id=resp.id, force=True), protocol.Empty, cleanup=True
                    )
            raise
    return Made(resp.id, detached)


REPLACE_TIMEOUT = 10.0  # s: the grace a replaced sandbox's workloads get (the reference's)


def _replace(name: str, grace: float) -> Plan[None]:
    """Stop sandbox ``name`` (``grace`` seconds, then killed), then remove it; none: nothing."""
    try:
        if grace > 0:
            stop = protocol.StopSandboxRequest(id=name, timeout_seconds=max(1, math.ceil(grace)))
            with contextlib.suppress(FailedPrecondition, DeadlineExceeded):
                yield Unary("Stop", stop, protocol.Empty)
        yield Unary("Remove", protocol.RemoveSandboxRequest(id=name, force=True), protocol.Empty)
    except NotFound:
        pass


def get(name: str, *, socket: str | Path | None = None) -> Plan[Made]:
    """A handle on an existing sandbox (NotFound if there is none); detached."""
    yield Unary("Inspect", protocol.IdRequest(id=name), SandboxInfo)
    return Made(name, True)


def list_(
    *,
    socket: str | Path | None = None,
    labels: Mapping[str, str] | None = None,
    state: str = "",
    limit: int = 20,
    cursor: str = "",
    ancestor: str = "",
) -> Plan[Page]:
    """One page of sandboxes, newest first, filtered by state and labels (all must match)
    and ``ancestor`` (only its forks, and theirs)."""
    req = protocol.ListSandboxesRequest(state=state, labels=_kv(labels), limit=limit, cursor=cursor, ancestor=ancestor)
    r: protocol.ListSandboxesResponse = yield Unary("List", req, protocol.ListSandboxesResponse)
    return Page(r.sandboxes, r.next_cursor)


def metrics_all(*, socket: str | Path | None = None) -> Plan[builtins.list[MetricsResponse]]:
    """One sample of every ready or running sandbox."""
    r: protocol.MetricsAllResponse = yield Unary("MetricsAll", protocol.Empty(), protocol.MetricsAllResponse)
    return r.sandboxes


# --- state ----------------------------------------------------------------------------------
def inspect(t: Target) -> Plan[SandboxInfo]:
    info: SandboxInfo = yield Unary("Inspect", id_request(t), SandboxInfo)
    return info


def shell_argv(t: Target, shell: str | None = None) -> Plan[list[str]]:
    """What ``shell()`` runs: ``shell``, else the sandbox's (its Create's ``shell``), else /bin/sh."""
    if shell:
        return [shell]
    info = yield from inspect(t)
    return [info.shell or "/bin/sh"]


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
    env_remove: Iterable[str] = (),
    max_cpus: int | None = None,
    max_memory_mib: int | None = None,
    policy: str = "",
    secrets: Sequence[SecretUpdate | Secret | str] | None = None,
    egress: Egress | Mapping[str, Any] | None = None,
) -> Plan[ModifyResponse]:
    """Change the sandbox (docs/modify.md): vCPUs and memory live below its ceilings,
    the root disk (grow only) of a stopped sandbox, env and workdir of future runs,
    labels (a label set to "" is removed), TTL, idle timeout. Returns the plan: each
    change with its status and why; ``applied`` False (a dry run, or a change refused
    or needing ``restart``): nothing changed. ``restart``: a change only a new machine
    applies restarts the sandbox (its processes end, guest memory is lost).
    ``env_remove``: env keys taken away; ``max_cpus``/``max_memory_mib``: the ceilings
    by themselves (a running machine's change needs a restart, or the next start);
    ``policy``: ``no_restart`` (the default), ``restart`` (as ``restart=True``) or
    ``next_start`` (everything saved for the next start, the running sandbox not
    changed); ``secrets``: :class:`SecretUpdate` (add, re-host, new placeholder, source
    or value); ``egress``: the egress policy, replaced whole (an :class:`Egress` or
    its dict), live on a running sandbox. The response's ``conflicts`` and ``warnings`` say what blocks the plan
    and what is true of it; ``resize``: a live resize's outcome per resource."""
    req = protocol.ModifyRequest(
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
        env_remove=list(env_remove),
        max_vcpus=max_cpus,
        max_memory_mib=max_memory_mib,
        policy=policy,
        secrets=secret_specs(secrets),
        egress=egress_spec(egress),
    )
    r: ModifyResponse = yield Unary("Modify", req, ModifyResponse)
    return r


def state(t: Target) -> Plan[str]:
    return (yield from inspect(t)).state


def _wait_ready(id: str, timeout: float) -> Plan[SandboxInfo]:
    events = yield Open("Events", protocol.SandboxEventsRequest(id=id))
    info: SandboxInfo = yield Unary("Inspect", protocol.IdRequest(id=id), SandboxInfo)
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
        info = yield Unary("Inspect", protocol.IdRequest(id=id), SandboxInfo)
    if info.state not in ("ready", "running"):
        raise error_for(protocol.FAILED_PRECONDITION, f"sandbox {id} is {info.state}: {info.error}")
    return info


def wait_ready(t: Target, timeout: float = 120.0) -> Plan[SandboxInfo]:
    """Until the sandbox is ready (or running its initial command): FailedPrecondition
    if it failed or stopped instead, trio.TooSlowError after ``timeout`` seconds."""
    return (yield from _wait_ready(t.id, timeout))


def stop(t: Target, timeout: int = 0) -> Plan[None]:
    """Stop gracefully (``timeout`` seconds before it is killed; 0: the default)."""
    yield Unary("Stop", protocol.StopSandboxRequest(id=t.id, timeout_seconds=timeout), protocol.Empty)


def kill(t: Target, timeout: int = 0) -> Plan[None]:
    """Kill now and wait to see it stopped (``timeout`` seconds; 0: the sandbox's
    ``kill_timeout``, else the supervisor's default)."""
    yield Unary("Kill", protocol.KillRequest(id=t.id, timeout_seconds=timeout), protocol.Empty)


def request_stop(t: Target, timeout: int = 0) -> Plan[None]:
    """Ask for a graceful stop and return at once (:meth:`wait_until_stopped` waits)."""
    yield Unary("RequestStop", protocol.StopSandboxRequest(id=t.id, timeout_seconds=timeout), protocol.Empty)


def request_kill(t: Target) -> Plan[None]:
    """Ask for a kill and return at once (:meth:`wait_until_stopped` waits)."""
    yield Unary("RequestKill", protocol.KillRequest(id=t.id), protocol.Empty)


def drain(t: Target, grace: int = 0) -> Plan[None]:
    """State draining: new execs and runs are refused, those in flight get ``grace``
    seconds (0: as long as they take), then it stops. Returns at once."""
    yield Unary("Drain", protocol.DrainRequest(id=t.id, grace_seconds=grace), protocol.Empty)


@attrs.frozen
class StopResult:
    """How a sandbox's life ended (the reference's SandboxStopResult): ``status``
    stopped, crashed or failed; the workload's (or QEMU's) exit code and the signal
    when known; ``source``: user, ttl, idle, drain, replace, oom, guest-exit,
    guest-panic, qemu-died, host-restart, supervisor-gave-up, boot-failed, error;
    ``cause``: the whole cause (``cause.sentence`` for people)."""

    id: str
    status: str
    exit_code: int | None
    signal: int | None
    source: str | None
    observed_at: float  # unix seconds
    cause: protocol.StopCause | None
    info: SandboxInfo

    def describe(self) -> str:
        return self.cause.sentence if self.cause is not None and self.cause.sentence else self.status


def wait_until_stopped(t: Target) -> Plan[StopResult]:
    """Until no life of the sandbox runs (and its record says so on disk): how it ended."""
    info: SandboxInfo = yield Unary("WaitUntilStopped", id_request(t), SandboxInfo)
    c = info.cause
    return StopResult(
        id=info.id,
        status=info.state,
        exit_code=c.exit_code if c is not None else None,
        signal=c.signal if c is not None else None,
        source=c.source if c is not None else None,
        observed_at=time.time(),
        cause=c,
        info=info,
    )


def start(t: Target, *, wait: bool = True, timeout: float = 120.0) -> Plan[None]:
    """Boot a stopped sandbox again (from its disk)."""
    yield Unary("Start", id_request(t), protocol.CreateSandboxResponse)
    if wait:
        yield from _wait_ready(t.id, timeout)


def pause(t: Target) -> Plan[SandboxInfo]:
    """Hibernate to disk: no QEMU, no RAM; id, address, ports, processes and
    memory come back with :meth:`resume` (or with the next call that needs the guest)."""
    info: SandboxInfo = yield Unary("Pause", id_request(t), SandboxInfo)
    return info


def resume(t: Target) -> Plan[SandboxInfo]:
    """Bring a paused sandbox back, as itself; returns once it is ready."""
    info: SandboxInfo = yield Unary("Resume", id_request(t), SandboxInfo)
    return info


def remove(t: Target, *, force: bool = False, with_descendants: bool = False) -> Plan[None]:
    """Remove (``force``: stop it first if it runs; ``with_descendants``: its forks too,
    and theirs, those the caller sees; docs/fork.md)."""
    req = protocol.RemoveSandboxRequest(id=t.id, force=force, with_descendants=with_descendants)
    yield Unary("Remove", req, protocol.Empty)


def ping(t: Target) -> Plan[float]:
    """Round trip to the guest agent, in seconds (does not count as activity)."""
    r: protocol.PingResponse = yield Unary("Ping", id_request(t), protocol.PingResponse)
    return r.latency_ns / 1e9


def touch(t: Target) -> Plan[int]:
    """Count as activity (the idle timeout starts again); the guest's activity counter."""
    r: protocol.TouchResponse = yield Unary("Touch", id_request(t), protocol.TouchResponse)
    return r.activity


def set_ttl(t: Target, seconds: int) -> Plan[int]:
    """Remove the sandbox ``seconds`` from now (0: never), replacing its TTL; the unix
    time of its removal (0: never)."""
    r: protocol.SetTtlResponse = yield Unary(
        "SetTtl", protocol.SetTtlRequest(id=t.id, ttl_seconds=seconds), protocol.SetTtlResponse
    )
    return r.expires_at


def metrics(t: Target) -> Plan[MetricsResponse]:
    m: MetricsResponse = yield Unary("Metrics", id_request(t), MetricsResponse)
    return m


def metrics_stream(t: Target, interval: float = 1.0) -> StreamPlan[MetricsResponse]:
    """A sample every ``interval`` seconds while the sandbox is ready or running."""
    return each("MetricsStream", protocol.MetricsStreamRequest(id=t.id, interval_seconds=interval), MetricsResponse)


LogSources = Iterable[str]  # "stdout", "stderr", "output" (a TTY's), "system"


def logs(
    t: Target, *, tail: int = 0, since: int = 0, until: int = 0, cursor: int = 0, sources: LogSources = ()
) -> Plan[builtins.list[LogEntry]]:
    """Persisted output (also of a stopped sandbox): the last ``tail`` entries (0:
    all), between ``since`` and ``until`` (unix ns; 0: open), after the entry whose
    ``seq`` is ``cursor``, of ``sources`` (empty: all)."""
    req = protocol.LogsRequest(id=t.id, tail=tail, since=since, until=until, cursor=cursor, sources=list(sources))
    return (yield from collect("Logs", req, LogEntry))


def log_stream(
    t: Target,
    *,
    follow: bool = True,
    tail: int = 0,
    since: int = 0,
    until: int = 0,
    cursor: int = 0,
    sources: LogSources = (),
) -> StreamPlan[LogEntry]:
    """Log entries as they are written (``follow``), after the last ``tail`` ones;
    from ``since`` (unix ns) or after the entry whose ``seq`` is ``cursor`` (a
    stream's resume point), of ``sources`` (empty: all); up to ``until`` (unix ns, 0:
    open): a followed stream ends when the supervisor's clock passes it."""
    req = protocol.LogsRequest(
        id=t.id, follow=follow, tail=tail, since=since, until=until, cursor=cursor, sources=list(sources)
    )
    return each("Logs", req, LogEntry)


def events(t: Target, action: str = "", since: int | None = None) -> StreamPlan[SandboxEvent]:
    """This sandbox's lifecycle events from now on (``action``: only those); with
    ``since`` (an event's ``cursor``), first those after it from the supervisor's event
    log, then the live ones: no gap, no repeat (docs/webhooks.md)."""
    return each("Events", protocol.SandboxEventsRequest(id=t.id, action=action, since=since), SandboxEvent)


# --- work -----------------------------------------------------------------------------------
def run_request(t: Target, cmd: builtins.list[str] | str, how: RunSettings) -> protocol.RunRequest:
    """A run's request; a string is run with ``sh -c``."""
    return protocol.RunRequest(
        id=t.id,
        cmd=["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd),
        env=_kv(how.get("env")),
        working_dir=how.get("workdir", ""),
        user=how.get("user", ""),
        tty=how.get("tty", False),
        timeout_seconds=how.get("timeout", 0),
    )


def _outputs(req: protocol.RunRequest) -> StreamPlan[Output]:
    call = yield Open("Run", req)
    while (item := (yield Receive(call, protocol.RunOutput))) is not None:
        yield Emit(_output(item))


def _result(req: protocol.RunRequest) -> Plan[RunResult]:
    call = yield Open("Run", req)
    out, err, code, oom = bytearray(), bytearray(), -1, False
    while (item := (yield Receive(call, protocol.RunOutput))) is not None:
        o = _output(item)
        if o.stream == "stdout":
            out += o.data
        elif o.stream == "stderr":
            err += o.data
        else:
            code, oom = (o.exit_code if o.exit_code is not None else -1), o.oom_killed
    return RunResult(bytes(out), bytes(err), code, oom_killed=oom)


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


def exec_request(
    t: Target, cmd: builtins.list[str] | str, size: tuple[int, int], how: RunSettings, *, detachable: bool = False
) -> dict[str, Any]:
    """The opening message of an Exec (its body on the wire); ``detachable``: the
    session may be left running (:func:`exec_detach`) and attached again."""
    r = run_request(t, cmd, how)
    init = protocol.ExecRequest(
        id=r.id,
        cmd=r.cmd,
        env=r.env,
        working_dir=r.working_dir,
        user=r.user,
        tty=r.tty,
        tty_size=protocol.TerminalSize(width=size[0], height=size[1]),
        timeout_seconds=r.timeout_seconds,
        detachable=detachable,
    )
    return protocol.unstructure_body(protocol.ExecInput(init=init))


def exec_detach() -> dict[str, Any]:
    return protocol.unstructure_body(protocol.ExecInput(detach=True))


def attach_request(t: Target, session_id: int) -> dict[str, Any]:
    """The opening message of an Attach to detached session ``session_id``."""
    return protocol.unstructure_body(protocol.AttachRequest(id=t.id, session_id=session_id))


def exec_stdin(data: bytes) -> dict[str, Any]:
    return protocol.unstructure_body(protocol.ExecInput(stdin=bytes(data)))


def exec_close_stdin() -> dict[str, Any]:
    return protocol.unstructure_body(protocol.ExecInput(close_stdin=True))


def exec_resize(width: int, height: int) -> dict[str, Any]:
    return protocol.unstructure_body(protocol.ExecInput(resize=protocol.TerminalSize(width=width, height=height)))


def exec_output(body: dict[str, Any]) -> Output:
    return _output(structure(body, protocol.ExecOutput, "Exec"))


# --- ports ----------------------------------------------------------------------------------
def expose(t: Target, sandbox_port: int, host_port: int = 0, *, udp: bool = False, address: str = "") -> Plan[int]:
    """Forward a host port to ``sandbox_port``; returns it. ``address``: the host address
    it listens on ("": the sandbox's ``port_address``, else the supervisor's loopback)."""
    req = protocol.ExposePortRequest(
        id=t.id, sandbox_port=sandbox_port, host_port=host_port, protocol="udp" if udp else "tcp", host_address=address
    )
    r: protocol.ExposePortResponse = yield Unary("ExposePort", req, protocol.ExposePortResponse)
    return r.host_port


def unexpose(t: Target, sandbox_port: int, *, udp: bool = False) -> Plan[None]:
    req = protocol.UnexposePortRequest(id=t.id, sandbox_port=sandbox_port, protocol="udp" if udp else "tcp")
    yield Unary("UnexposePort", req, protocol.Empty)


def ports(t: Target) -> Plan[builtins.list[protocol.PortMapping]]:
    """The port mappings (``sandbox_port``, ``host_port``, ``protocol``,
    ``host_address``): a restored sandbox's carried ones with the host ports it got."""
    r: protocol.ListPortsResponse = yield Unary("ListPorts", id_request(t), protocol.ListPortsResponse)
    return r.ports
