"""The microsandbox Go SDK reference's own examples, each written with sandvisor's sync
SDK and run against one real ``sandvisor serve`` (TCG) and real VMs.

Every Go snippet of the reference is numbered in order of appearance; its equivalent
carries ``# ref N: [Section] first line`` (tests/unit/test_reference_coverage.py fails
when a snippet has none). Snippets share sandboxes where they can: "api" (the
CreateSandbox example, with the options of the WithPatches / WithMounts / WithCmd
examples folded in) serves most of them, "worker" the systemd ones. Images the
reference names (python:3.12, example/worker:latest, jrei/systemd-debian:12) are not
pulled from the internet: the default image stands in, and for systemd the ext4 Debian
root that tests/support/systemdimage.py builds.

The WithNetwork example and Modify's secret examples run on a second supervisor with
tap networking in namespaces of its own (secrets need the proxy). The examples of
features still being built (drain, request_stop/request_kill, the stop source, kill
timeout, replace grace) are at the end, under their own heading, skipped."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from images.build import Image
from supervisor.client import (
    Boot,
    FailedPrecondition,
    Init,
    NotFound,
    Patch,
    Sandbox,
    SandboxSpec,
    SecretUpdate,
    Volumes,
)
from supervisor.main.throwaway import supervisor_process, workdir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    def __init__(self, root: Path, env: dict[str, str], ssh_port: int, systemd_root: Path | None) -> None:
        self.root, self.env, self.ssh_port, self.systemd_root = root, env, ssh_port, systemd_root
        self.socket = env["SANDVISOR_SOCKET"]
        self.key = root / "id_ed25519"


def idle(sb: Sandbox) -> None:
    """Until the initial workload (the CMD, run at each boot) has ended: a sandbox runs one
    Run at a time, and its state is ``running`` meanwhile."""
    deadline = time.monotonic() + 120
    while (state := sb.state()) == "running":
        assert time.monotonic() < deadline, "the initial workload did not end"
        time.sleep(0.1)
    assert state == "ready", state


def system_running(sb: Sandbox) -> str:
    """systemd's own answer once it is up (the sandbox is ready before systemd has started)."""
    r = sb.run(
        ["sh", "-c", "until [ -S /run/systemd/private ]; do sleep 0.1; done; systemctl is-system-running --wait"],
        timeout=240,
    )
    return r.stdout.decode().strip()


def _systemd_root() -> Path | None:
    if os.geteuid() != 0:
        return None  # mmdebstrap builds it as root
    from tests.support.systemdimage import systemd_rootfs

    return systemd_rootfs()


@pytest.fixture(scope="module")
def served(image: Image) -> Iterator[Served]:
    root = _systemd_root()
    with workdir("sv-ref-") as work:
        port = _free_port()
        allow = ["--allow-path", str(root.parent)] if root else []
        args = ["--ssh", f"127.0.0.1:{port}", *allow]
        with supervisor_process(work, *args, log=work.root / "serve.log") as (env, _):
            deadline = time.monotonic() + 60
            while True:  # the socket is there before the SSH port
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            s = Served(work.root, env, port, root)
            if shutil.which("ssh-keygen"):
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(s.key)], check=True)
            yield s


@pytest.fixture(scope="module")
def api(served: Served) -> Iterator[Sandbox]:
    """The CreateSandbox example's sandbox, with the WithPatches, WithMounts and WithCmd
    examples' options given to the same Create (one boot for all of them)."""
    # WithMounts' m.Mount.Named("my-vol", ...) names a volume that exists
    Volumes(served.socket).create("my-vol", "64M")
    keys = [(served.root / "id_ed25519.pub").read_text()] if served.key.exists() else []
    sb = Sandbox.create(
        "api",
        socket=served.socket,
        # image: the default image stands in for python:3.12 (no pull from the internet)
        memory_mib=512,  # m.WithMemory(512)
        cpus=2,  # m.WithCPUs(2)
        max_memory_mib=1024,  # the live resize below grows memory within this ceiling
        env={"PYTHONDONTWRITEBYTECODE": "1"},  # m.WithEnv(...)
        labels={"user.id": "alice"},  # the ListSandboxesWith example filters by it
        # WithPatches: m.Patch.Mkdir("/app"), m.Patch.Text("/app/config.txt", "ready\n")
        patches=[Patch.mkdir("/app"), Patch.file("/app/config.txt", "ready\n")],
        # WithMounts: "/data": Mount.Named("my-vol"), "/tmp": Mount.Tmpfs{SizeMiB: 256}; the
        # guest's /tmp is a tmpfs of guestd's already (a second mount there is refused), so
        # the example's tmpfs goes to /var/tmp
        volumes=["my-vol:/data"],
        tmpfs=["/var/tmp:256"],
        # WithCmd("worker.py", "--once"): the image's CMD replaced (sandvisor runs it as
        # the initial workload at ready; worker.py is not in the default image)
        cmd=["sh", "-c", "echo worker --once"],
        ssh_keys=keys,
        detached=True,  # the tests below share it; the last one removes it
    )
    try:
        idle(sb)
        yield sb
    finally:
        with contextlib.suppress(NotFound):
            sb.remove(force=True)


# --- top-level functions --------------------------------------------------------------------


def test_create_sandbox(api: Sandbox) -> None:
    # ref 1: [CreateSandbox] sb, err := m.CreateSandbox(ctx, "api",
    # (made by the ``api`` fixture: Sandbox.create("api", memory_mib=512, cpus=2, env=...);
    # the Go example's deferred Stop + Close is the last tests' stop and remove)
    out = api.run("echo $PYTHONDONTWRITEBYTECODE; nproc")
    assert out.stdout == b"1\n2\n", out.stderr
    assert api.inspect().limits.memory_mib == 512


def test_get_sandbox(api: Sandbox) -> None:
    # ref 2: [GetSandbox] h, err := m.GetSandbox(ctx, "api")
    h = Sandbox.get("api", socket=api.socket)
    print(h.state())
    assert h.state() == "ready"
    with pytest.raises(NotFound):  # Kind == ErrSandboxNotFound
        Sandbox.get("no-such", socket=api.socket)


def test_list_sandboxes(api: Sandbox) -> None:
    # ref 3: [ListSandboxes] page, err := m.ListSandboxes(ctx)
    page = Sandbox.list(socket=api.socket)
    for h in page.sandboxes:
        print(f"{h.id} - {h.state}")
    assert ("api", "ready") in [(h.id, h.state) for h in page.sandboxes]


def test_list_sandboxes_with(api: Sandbox) -> None:
    # ref 4: [ListSandboxesWith] page, err := m.ListSandboxesWith(
    page = Sandbox.list(socket=api.socket, limit=50, labels={"user.id": "alice"})
    seen = [h.id for h in page.sandboxes]
    while page.next_cursor:
        page = Sandbox.list(socket=api.socket, limit=50, cursor=page.next_cursor, labels={"user.id": "alice"})
        seen += [h.id for h in page.sandboxes]
    assert seen == ["api"]
    # the cursor itself: a page of one, then the next (empty: one sandbox matches)
    first = Sandbox.list(socket=api.socket, limit=1, labels={"user.id": "alice"})
    assert [h.id for h in first.sandboxes] == ["api"]
    if first.next_cursor:
        rest = Sandbox.list(socket=api.socket, limit=1, cursor=first.next_cursor, labels={"user.id": "alice"})
        assert rest.sandboxes == []


def test_all_sandbox_metrics(api: Sandbox) -> None:
    # ref 7: [AllSandboxMetrics] all, err := m.AllSandboxMetrics(ctx)
    every = Sandbox.metrics_all(socket=api.socket)  # a list, each with .id (not a map)
    for m in every:
        print(f"{m.id}: {m.cpu_percent:.1f}% CPU")
    assert "api" in [m.id for m in every]


# --- the live sandbox -----------------------------------------------------------------------


def test_fs_write(api: Sandbox) -> None:
    # ref 8: [FS] err := sb.FS().Write(ctx, "/tmp/hello.txt", []byte("hi"))
    api.fs.write("/tmp/hello.txt", b"hi")
    assert api.fs.read("/tmp/hello.txt") == b"hi"


def test_ssh(served: Served, api: Sandbox) -> None:
    # ref 9: [SSH] client, err := sb.SSH().OpenClient(ctx)
    # sandvisor gives the endpoint (sb.ssh()) for the system's OpenSSH, not an in-process client
    if not (served.key.exists() and shutil.which("ssh")):
        pytest.skip("OpenSSH's ssh and ssh-keygen are needed")
    ep = api.ssh()
    known = served.root / "known_hosts"
    known.write_text(ep.known_hosts + "\n")
    opts = ["-o", "StrictHostKeyChecking=yes", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-F", "/dev/null"]
    at = ["-p", str(ep.port), "-i", str(served.key), "-o", f"UserKnownHostsFile={known}"]
    r = subprocess.run(
        ["ssh", *at, *opts, f"{ep.user}@{ep.host}", "cat /app/config.txt"],
        capture_output=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert (r.returncode, r.stdout) == (0, b"ready\n"), r.stderr


def test_logs(api: Sandbox) -> None:
    # ref 10: [Logs] entries, err := sb.Logs(ctx, m.LogOptions{
    api.run("echo to-stdout; echo to-stderr >&2")
    entries = api.logs(sources=["stdout", "stderr"])
    for e in entries:
        print(f"[{e.source}] {e.text()}", end="")
    got = {(e.source, e.text()) for e in entries}
    assert {("stdout", "to-stdout\n"), ("stderr", "to-stderr\n")} <= got
    assert {e.source for e in entries} <= {"stdout", "stderr"}


def test_log_stream(api: Sandbox) -> None:
    # ref 11: [LogStream] stream, err := sb.LogStream(ctx, m.LogStreamOptions{Follow: true})
    api.run("echo streamed-line")
    seen = ""
    with contextlib.closing(api.log_stream(follow=True)) as stream:  # defer stream.Close()
        for entry in stream:
            print(entry.text(), end="")
            seen += entry.text()
            if "streamed-line" in seen:
                break
    assert "streamed-line" in seen


def test_ping_and_touch(api: Sandbox) -> None:
    # ref 12: [Ping] health, err := sb.Ping(ctx)
    latency = api.ping()  # seconds (the reference: {Name, Latency})
    print(f"{api.id}: {latency}")
    assert latency > 0
    # ref 13: [Touch] keepalive, err := sb.Touch(ctx)
    seq = api.touch()  # the activity sequence (the reference: {Name, ActivitySeq})
    print(f"{api.id}: {seq}")
    assert api.touch() > seq


def test_metrics_and_stream(api: Sandbox) -> None:
    # ref 20: [Metrics] metrics, err := sb.Metrics(ctx)
    m = api.metrics()
    print(f"cpu {m.cpu_percent:.1f}% · mem {m.memory_total_bytes // (1 << 20)} MiB")
    assert m.memory_total_bytes > 0
    # ref 21: [MetricsStream] stream, err := sb.MetricsStream(ctx, 500*time.Millisecond)
    got = []
    with contextlib.closing(api.metrics_stream(0.5)) as stream:
        for m in stream:
            print(f"CPU: {m.cpu_percent:.1f}%")
            got.append(m)
            if len(got) == 2:
                break
    assert got[1].timestamp > got[0].timestamp


def test_attach_with(served: Served, api: Sandbox) -> None:
    # ref 22: [AttachWith] exitCode, err := sb.AttachWith(ctx, "bash", []string{"-l"},
    # WithAttachUser("dev") -> user= (the default image has no "dev": nobody), WithAttachCwd("/app")
    # -> workdir=, WithAttachEnv -> env=, WithAttachDetachKeys("ctrl-q") -> detach_keys=. The
    # caller's terminal is a pipe here, so the shell reads a script instead of a person.
    script, out = served.root / "attach.in", served.root / "attach.out"
    script.write_text('echo "$DEBUG $(pwd) $(id -u)"\nexit 3\n')
    with script.open("rb") as stdin, out.open("wb") as stdout:
        code = api.attach(
            ["sh", "-l"],
            tty=False,
            user="nobody",
            workdir="/app",
            env={"DEBUG": "1"},
            detach_keys="ctrl-q",
            stdin_fd=stdin.fileno(),
            stdout_fd=stdout.fileno(),
            stderr_fd=stdout.fileno(),
        )
    assert code == 3
    assert out.read_bytes() == b"1 /app 65534\n"


def test_create_options_patches_mounts_cmd(api: Sandbox) -> None:
    # ref 31: [WithPatches] sb, err := m.CreateSandbox(ctx, "api",
    r = api.run("stat -c %F /app; cat /app/config.txt")
    assert r.stdout == b"directory\nready\n", r.stderr
    # ref 32: [WithMounts] sb, err := m.CreateSandbox(ctx, "api",
    mounts = api.run("grep -E ' /(data|var/tmp) ' /proc/mounts").stdout.decode()
    assert " /data ext4 " in mounts, mounts
    assert " /var/tmp tmpfs " in mounts and "size=262144k" in mounts, mounts
    # ref 28: [WithCmd] sb, err := m.CreateSandbox(ctx, "worker",
    # (the CMD is durable configuration, read back by Config, and run as the initial workload)
    assert api.config()["cmd"] == ["sh", "-c", "echo worker --once"]
    deadline = time.monotonic() + 60
    while not any(e.text() == "worker --once\n" for e in api.logs(sources=["stdout"])):
        assert time.monotonic() < deadline, "the initial workload wrote nothing"
        time.sleep(0.2)


def test_modify(api: Sandbox) -> None:
    # ref 14: [Modify] plan, err := sb.Modify(ctx, m.ModifyOptions{CPUs: 4, MemoryMiB: 4096})
    # a live resize within the booted ceiling, scaled to a 2-core TCG host (2 vCPUs, 512 ->
    # 1024 MiB under max_memory_mib=1024); plan.ResizeStatus -> plan.resize
    plan = api.modify(cpus=2, memory_mib=1024)
    for r in plan.resize:
        print(f"{r.resource}: {r.requested} -> {r.actual} ({r.state})")
    assert plan.applied and not plan.restarted
    assert ("memory", "applied_live") in [(c.kind, c.status) for c in plan.changes]
    assert "memory" in [r.resource for r in plan.resize]
    # ref 15: [Modify] preview, err := sb.Modify(ctx, m.ModifyOptions{MaxMemoryMiB: 16384, DryRun: true})
    # (scaled: a 2048 MiB ceiling); Changes' Field/Disposition -> kind/status
    preview = api.modify(max_memory_mib=2048, dry_run=True)
    for c in preview.changes:
        print(f"{c.kind}: {c.status}")
    assert not preview.applied
    assert "max_memory" in [c.kind for c in preview.changes]
    # ref 16: [Modify] _, err = sb.Modify(ctx, m.ModifyOptions{
    # Env MODE=prod, ModificationPolicyRestart -> restart=True
    plan = api.modify(env={"MODE": "prod"}, restart=True)
    assert plan.applied
    idle(api)
    assert api.run("echo $MODE").stdout == b"prod\n"
    # ref 17: [Modify] _, err = sb.Modify(ctx, m.ModifyOptions{
    # RootDiskSizeMiB: 8192, ModificationPolicyRestart -> disk_size="8G", restart=True
    plan = api.modify(disk_size="8G", restart=True)
    assert plan.applied and plan.restarted
    idle(api)
    size = int(api.run("df -k / | tail -1 | awk '{print $2}'").stdout)
    assert size > 6 * 1024 * 1024, size
    # ModifyOptions.EnvRemove and Policy NextStart (no snippet of their own)
    plan = api.modify(env_remove=["MODE"])
    assert plan.applied
    assert api.run("echo ${MODE:-unset}").stdout == b"unset\n"
    plan = api.modify(workdir="/app", policy="next_start")
    assert plan.pending and plan.policy == "next_start"


def test_stop_then_start(api: Sandbox) -> None:
    # ref 23: [Stop] err := sb.Stop(ctx, m.WithStopTimeout(30*time.Second))
    api.stop(timeout=30)
    assert api.state() == "stopped"
    # ref 5: [StartSandbox] sb, err := m.StartSandbox(ctx, "api")
    sb = Sandbox.get("api", socket=api.socket)
    sb.start()
    idle(sb)
    assert sb.fs.read("/app/config.txt") == b"ready\n"


def test_detach(api: Sandbox) -> None:
    # ref 26: [Detach] err := sb.Detach(ctx) // keeps running in the background
    # a detached sandbox (create(..., detached=True)) outlives its handle; the handle is an
    # id, so "releasing" it is dropping it, and Sandbox.get reconnects (GetSandbox)
    assert api.detached
    del_me = Sandbox("api", socket=api.socket)
    del del_me
    again = Sandbox.get("api", socket=api.socket)
    assert again.state() == "ready" and again.run("true").exit_code == 0


def test_kill_wait_remove(api: Sandbox) -> None:
    # ref 24: [Kill] err := sb.Kill(ctx)
    api.kill()
    # ref 25: [WaitUntilStopped] result, err := sb.WaitUntilStopped(ctx)
    result = api.wait_until_stopped()
    print(f"ended as {result.status} ({result.source})")
    assert (result.status, result.source) == ("stopped", "user")
    # ref 6: [RemoveSandbox] err := m.RemoveSandbox(ctx, "api")
    api.remove()
    with pytest.raises(NotFound):
        Sandbox.get("api", socket=api.socket)


# --- other Create examples ----------------------------------------------------------------


# the guest's probe: a TCP connect, and the server's first line (or "refused")
PROBE = """import socket, sys
try:
    print(socket.create_connection((sys.argv[1], 80), timeout=3).recv(100).decode().split()[0])
except OSError:
    print("refused")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="tap networking in namespaces of its own needs root")
async def test_with_network_profile(image: Image) -> None:
    # ref 30: [WithNetwork] sb, err := m.CreateSandbox(ctx, "api",
    # NetworkPolicy.FromProfiles(NetworkProfilePublic) -> network_profile="public"; the default
    # image for "python". A profile that reaches out needs tap networking (serve --ip-pool),
    # so this example runs on a second supervisor, in namespaces of its own with a stand-in
    # internet (tests/support/taplab.py): nothing leaves the machine. The sync SDK runs in a
    # thread (that supervisor runs in this Trio run).
    from tests.support.netlab import SERVERS
    from tests.support.taplab import net_lab, serving

    async with net_lab("sv-refn-") as lab, serving(lab):

        def example() -> tuple[str, str, dict[str, object]]:
            with Sandbox.create("api", socket=lab.work.socket, network_profile="public") as sb:
                sb.fs.write("/tmp/probe.py", PROBE.encode())
                public = sb.run(["python3", "/tmp/probe.py", SERVERS[0]]).stdout.decode().strip()
                host = sb.run(["python3", "/tmp/probe.py", "169.254.169.254"]).stdout.decode().strip()
                cfg = sb.config()
                # Secrets need tap networking (the proxy substitutes them), so the Modify
                # secret examples run on this sandbox.
                # ref 18: [Modify] _, err = sb.Modify(ctx, m.ModifyOptions{
                # Secrets{"API_KEY": {Env: "API_KEY", AllowedHosts}}, Policy restart
                os.environ["API_KEY"] = "s3cret-value"  # the client reads env= sources
                plan = sb.modify(
                    secrets=[SecretUpdate(name="API_KEY", env="API_KEY", hosts=["api.example.com"])], restart=True
                )
                assert plan.applied and "s3cret" not in repr(plan)  # values never in a plan
                idle(sb)
                assert [s.name for s in sb.secrets()] == ["API_KEY"]
                # ref 19: [Modify] _, err = sb.Modify(ctx, m.ModifyOptions{
                # SecretsRemove: ["OLD_API_KEY"] -> sb.revoke_secret(name), a call of its own
                sb.revoke_secret("API_KEY")
                assert [(x.name, x.removed) for x in sb.secrets()] == [("API_KEY", True)]  # revoked, kept as a name
                return public, host, cfg

        public, metadata, cfg = await trio.to_thread.run_sync(example)
    # the profile, expanded at Create, is what the sandbox keeps (and Config reads back)
    assert cfg["network"] == "tap" and cfg["egress"]["default"] == "allow", cfg  # type: ignore[index]
    assert public == "server0"  # the (stand-in) internet: reached
    assert metadata == "refused"  # cloud metadata is not part of "public"


def test_with_init_systemd(served: Served) -> None:
    if served.systemd_root is None:
        pytest.skip("the systemd root is built as root")
    spec = SandboxSpec(boot=Boot(rootfs=str(served.systemd_root)))  # jrei/systemd-debian:12's stand-in
    # ref 29: [WithInit] sb, err := m.CreateSandbox(ctx, "worker",
    # ref 33: [Auto] m.WithInit(m.Init.Auto())
    # ref 27: [Close] defer sb.Close()
    # (leaving ``with`` is Close: a sandbox not created detached is stopped and removed)
    with Sandbox.create("worker", spec, socket=served.socket, init=Init.auto(), timeout=300) as sb:
        assert system_running(sb) in ("running", "degraded")
        assert sb.run(["cat", "/proc/1/comm"]).stdout == b"systemd\n"
    with pytest.raises(NotFound):
        Sandbox.get("worker", socket=served.socket)
    # ref 34: [Cmd] m.WithInit(m.Init.Cmd(
    init = Init.cmd("/lib/systemd/systemd", args=["--unit=multi-user.target"], env={"container": "sandvisor"})
    with Sandbox.create("worker", spec, socket=served.socket, init=init, timeout=300) as sb:
        assert system_running(sb) in ("running", "degraded")
        assert sb.run(["cat", "/proc/1/comm"]).stdout == b"systemd\n"
        environ = sb.run(["sh", "-c", "tr '\\0' '\\n' < /proc/1/environ"]).stdout
        assert b"container=sandvisor" in environ
        cmdline = sb.run(["sh", "-c", "tr '\\0' ' ' < /proc/1/cmdline"]).stdout
        assert b"--unit=multi-user.target" in cmdline


# ----- lifetime: RequestStop/RequestKill, drain, kill and replace graces -----


@pytest.fixture
def fresh(served: Served) -> Iterator[Sandbox]:
    sb = Sandbox.create("pending", socket=served.socket, max_cpus=2, max_memory_mib=1024, detached=True)
    try:
        yield sb
    finally:
        with contextlib.suppress(NotFound):
            sb.remove(force=True)


def test_request_stop_and_wait_until_stopped_source(fresh: Sandbox) -> None:
    # RequestStop / RequestKill return at once; WaitUntilStopped gives Status, ExitCode,
    # Signal and Source
    fresh.request_stop()
    result = fresh.wait_until_stopped()
    assert (result.status, result.source) == ("stopped", "user")
    fresh.start()
    fresh.request_kill()
    assert fresh.wait_until_stopped().status == "stopped"


def test_drain(fresh: Sandbox) -> None:
    # RequestDrain: running execs finish, new ones refused, then stopped; a visible draining state
    with fresh.exec("sleep 3; echo done") as p:
        fresh.drain()
        assert fresh.state() == "draining"
        with pytest.raises(FailedPrecondition):  # new execs refused while draining
            fresh.run("true")
        assert p.wait() == 0
    assert fresh.wait_until_stopped().source == "drain"


def test_kill_timeout_and_replace_grace(served: Served, fresh: Sandbox) -> None:
    # WithKillTimeout (a KillOption) and WithReplaceWithTimeout(d)
    fresh.kill(timeout=5)
    assert fresh.state() == "stopped"
    fresh.start()
    again = Sandbox.create("pending", socket=served.socket, replace=True, replace_timeout=2, detached=True)
    assert again.state() == "ready"


# ===== pending: features not built yet (none today) ==========================================
