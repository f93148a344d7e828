"""The client commands on sandboxes: create, run, exec, ls, inspect, logs, events, cp,
stop/kill/rm/start/ping/touch, status, metrics, top, port.

One-shot commands speak over a blocking socket (:func:`supervisor.client.cli_common.connect`);
create, start, exec and cp use the Trio SDK, imported when they run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from supervisor.client.cli_common import UsageError, connect, kv, on_trio, trailing_command
from supervisor.client.cli_output import PullProgress, markup_escape, print_json, print_table, rich_table, ts
from supervisor.client.cli_ssh import read_key_files

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms; mypy reads the name)
if TYPE_CHECKING:
    from typing import Any, Literal

    from supervisor.client import AsyncSandbox, RegistryAuth, Settings


@on_trio
async def create(a: argparse.Namespace) -> int:
    status = None
    if not a.json and not a.no_wait and sys.stderr.isatty():
        from rich.console import Console

        status = Console(stderr=True, emoji=False).status(f"booting {markup_escape(a.name or 'a sandbox')} ...")
        status.start()
    try:
        sb = await _create(a)
    finally:
        if status is not None:
            status.stop()
    info = await sb.inspect()
    if a.json:
        print_json({"id": sb.id, "state": info.state, "ip_address": info.network.ip_address})
    else:
        print(sb.id)
    return 0


async def _create(a: argparse.Namespace) -> AsyncSandbox:
    from supervisor.client import AsyncImages, AsyncSandbox, SandboxSpec

    pull: Literal["", "always", "if-missing", "never"] = a.pull or ""
    registry = _registry_auth(a)
    is_dir = (a.image or "").startswith(("dir:", "/", "./", "../"))  # a root filesystem directory: no pull
    if a.image and not is_dir and not a.json and a.pull != "never" and registry is None:
        # pull first, with progress (a Create pulls silently before it answers); the
        # Create then finds the reference in the store
        show = PullProgress()
        await AsyncImages(a.socket).pull(
            a.image,
            policy=pull,
            tls_verify=a.tls_verify,
            progress=lambda p: show(p.phase, p.message, p.done, p.total),
        )
        pull = "if-missing"
    shape: Any = shape_settings(a)  # (a TypedDict of other keys: mypy would see them twice)
    given = dict(
        cpus=a.cpus,
        memory_mib=a.memory,
        max_cpus=a.max_cpus,
        max_memory_mib=a.max_memory,
        **({"disk_size": a.disk_size} if a.disk_size else {}),
        env=kv(a.env),
        labels=kv(a.label),
        workdir=a.workdir or "",
        user=a.user or "",
        ttl=a.ttl,
        ttl_action=a.ttl_action,
        kill_timeout=a.kill_timeout,
        idle_timeout=a.idle_timeout,
        on_idle=a.on_idle,
        paused_ttl=a.paused_ttl,
        auto_resume=a.auto_resume,
        network=a.network,
        outbound=a.outbound,
        egress=_egress(a),
        port_bindings=_port_bindings(a.port),
        port_address=a.port_address or "",
        network_profile=a.network_profile or "",
        dns=_dns(a),
        image=a.image or "",
        pull=pull,
        tls_verify=a.tls_verify,
        registry=registry,
        volumes=a.volume or (),
        scripts=_scripts(a.script),
        tmpfs=a.tmpfs or (),
        mounts=a.mount or (),
        secrets=a.secret or (),
        ssh_keys=read_key_files(a.ssh_key or ()),
        init=a.init,
    )
    spec = None
    if a.from_config is not None:  # the file's settings, with the flags given on top
        spec = SandboxSpec().with_(**_read_config(a.from_config))
        given = {k: v for k, v in given.items() if not _unset(k, v)}
    given.update(shape)  # (only what was given: cmd=[] from --no-cmd clears a file's too)
    replace = {"replace_timeout": a.replace_timeout} if a.replace_timeout is not None else {"replace": a.replace}
    return await AsyncSandbox.create(
        a.name, spec, socket=a.socket, detached=True, wait=not a.no_wait, **replace, **given
    )


_FLAG_DEFAULTS = {"on_idle": "stop", "auto_resume": True, "network": "none", "tls_verify": True, "ttl_action": "stop"}


def _unset(key: str, value: object) -> bool:
    """A create flag left at its default (with --from-config, the file's value stays)."""
    if key in _FLAG_DEFAULTS:
        return value == _FLAG_DEFAULTS[key]
    return value is None or value in (0, "", False, (), [], {})


def _read_config(path: str) -> Settings:
    from supervisor.client import load_config_json

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"--from-config {path}: {exc.strerror}") from None
    return load_config_json(text)


def shape_settings(a: argparse.Namespace) -> Settings:
    """The create's command, workload shape and copy patches: ``cmd`` only when one is
    given after ``--`` or ``--no-cmd`` clears the image's (an empty cmd clears it)."""
    import shlex

    from guestd.patch import Patch

    out: Settings = {}
    cmd = trailing_command(a)
    if cmd or a.no_cmd:
        if cmd and a.no_cmd:
            raise UsageError("--no-cmd and a command after -- exclude each other")
        out["cmd"] = cmd
    if a.entrypoint is not None:
        out["entrypoint"] = shlex.split(a.entrypoint)
    if a.shell:
        out["shell"] = a.shell
    if a.security_profile:
        out["security_profile"] = a.security_profile
    if a.log_level:
        out["log_level"] = a.log_level
    if a.quiet_logs:
        out["quiet_logs"] = True
    if a.thp:
        out["thp"] = a.thp
    if a.image_disk:
        out["image_disk"] = a.image_disk
    if a.from_snapshot:
        out["from_snapshot"] = a.from_snapshot
    copies = []
    for flag, items, make in (
        ("--copy-file", a.copy_file, Patch.copy_file),
        ("--copy-dir", a.copy_dir, Patch.copy_dir),
    ):
        for item in items or ():
            src, sep, dst = item.rpartition(":")
            if not sep or not src or not dst.startswith("/"):
                raise UsageError(f"{flag} {item!r}: HOST_PATH:/guest/path")
            copies.append(make(str(Path(src).absolute()), dst))
    if copies:
        out["patches"] = copies
    return out


def _registry_auth(a: argparse.Namespace) -> RegistryAuth | None:
    """``--registry-creds-file`` (- : stdin), ``--registry-authfile``, ``--registry-ca``:
    read here, never taken from argv (which every local user can read)."""
    from supervisor.client import RegistryAuth

    creds_file, authfile, ca = a.registry_creds_file, a.registry_authfile, a.registry_ca
    if creds_file is None and authfile is None and ca is None:
        return None
    if creds_file is not None and authfile is not None:
        raise UsageError("give --registry-creds-file or --registry-authfile, not both")
    try:
        creds = ""
        if creds_file == "-":
            creds = sys.stdin.readline().strip()
        elif creds_file is not None:
            creds = Path(creds_file).read_text().splitlines()[0].strip()
        auth = RegistryAuth.from_files(authfile=authfile, ca_file=ca)
    except (OSError, IndexError) as exc:
        raise UsageError(f"cannot read the registry credentials: {getattr(exc, 'strerror', None) or 'empty'}") from None
    if creds_file is not None and (":" not in creds or not creds.partition(":")[0]):
        raise UsageError("the registry credentials file must hold USER:PASSWORD")
    return RegistryAuth(creds=creds, auth_json=auth.auth_json, ca_pem=auth.ca_pem)


def _scripts(items: list[str] | None) -> dict[str, str]:
    """``--script NAME=FILE`` (repeatable): the file's text is the script."""
    out = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--script {item!r}: NAME=FILE")
        try:
            out[name] = Path(path).read_text()
        except OSError as exc:
            raise UsageError(f"--script {name}: {path}: {exc.strerror}") from None
    return out


def _egress(a: argparse.Namespace) -> Any:
    """``--egress-default/--allow/--deny`` as the SDK's Egress (None: not given)."""
    if a.egress_default is None and not a.allow and not a.deny:
        return None
    from supervisor.client import Egress

    return Egress(default=a.egress_default or "allow", allow=a.allow or (), deny=a.deny or ())


def _port_bindings(items: list[str] | None) -> list[Any]:
    """``--port [ADDR:]HOST:GUEST[/udp]`` (repeatable) as the SDK's PortBindings."""
    from supervisor.client import PortBinding

    out = []
    for item in items or ():
        try:
            out.append(PortBinding.parse(item))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return out


def _dns(a: argparse.Namespace) -> Any:
    """``--dns``/``--dns-search`` as the SDK's Dns (None: not given)."""
    if not a.dns and not a.dns_search:
        return None
    from supervisor.client import Dns

    return Dns(nameservers=a.dns or (), search=a.dns_search or ())


def run(a: argparse.Namespace) -> int:
    cmd = trailing_command(a)
    if not cmd and not a.script:
        raise UsageError("run needs a command after -- (or --script NAME)")
    body = {
        "id": a.name,
        "cmd": cmd,
        "script": a.script or "",
        "env": kv(a.env),
        "working_dir": a.workdir or "",
        "user": a.user or "",
        "tty": a.tty,
        "timeout_seconds": a.timeout,
    }
    code = 0
    with connect(a) as c:
        for o in c.stream("Run", body):
            if o.get("done"):
                code = o.get("exit_code") or 0
                if o.get("oom_killed"):  # the guest kernel's OOM killer took it (exit 137)
                    print("killed: out of memory", file=sys.stderr)
            elif o["stream"] == "stdout":
                sys.stdout.buffer.write(o["data"])
                sys.stdout.buffer.flush()
            elif o["stream"] == "stderr":
                sys.stderr.buffer.write(o["data"])
                sys.stderr.buffer.flush()
    return int(code)


@on_trio
async def exec_(a: argparse.Namespace) -> int:
    from supervisor.client import AsyncSandbox

    cmd = trailing_command(a)
    if not cmd:
        raise UsageError("exec needs a command after --")
    sb = AsyncSandbox(a.name, socket=a.socket)
    if not a.interactive and not a.tty:
        # output only: stdin is not the process's
        with open(os.devnull, "rb") as devnull:
            return await sb.attach(
                cmd, tty=False, env=kv(a.env), workdir=a.workdir or "", user=a.user or "", stdin_fd=devnull.fileno()
            )
    from supervisor.client import Detached

    try:
        # detach keys on a terminal only: piped stdin is data, where any byte sequence may occur
        keys = a.detach_keys if a.tty else ""
        return await sb.attach(
            cmd, tty=a.tty, env=kv(a.env), workdir=a.workdir or "", user=a.user or "", detach_keys=keys
        )
    except Detached as d:
        print(f"\r\ndetached: sandvisor attach {a.name} {d.session_id}", file=sys.stderr)
        return 0


@on_trio
async def attach(a: argparse.Namespace) -> int:
    """Back to a detached exec session (its output since the detach first)."""
    from supervisor.client import AsyncSandbox, Detached

    try:
        return await AsyncSandbox(a.name, socket=a.socket).attach_session(a.session, detach_keys=a.detach_keys)
    except Detached as d:
        print(f"\r\ndetached: sandvisor attach {a.name} {d.session_id}", file=sys.stderr)
        return 0


@on_trio
async def shell(a: argparse.Namespace) -> int:
    from supervisor.client import AsyncSandbox

    return await AsyncSandbox(a.name, socket=a.socket).shell(a.shell or None)


def ls(a: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    cursor = ""
    with connect(a) as c:
        while True:
            req = {"labels": kv(a.label), "state": a.state or "", "limit": 100, "cursor": cursor}
            page = c.call("List", {**req, "ancestor": a.ancestor or ""})
            rows += page["sandboxes"]
            cursor = page.get("next_cursor", "")
            if not cursor:
                break
    if a.json:
        print_json([{k: r[k] for k in ("id", "state", "labels", "ip_address", "created_at")} for r in rows])
        return 0
    print_table(
        ("ID", "STATE", "LABELS", "IP", "CREATED"),
        [
            (
                r["id"],
                r["state"],
                ",".join(f"{k}={v}" for k, v in sorted(r["labels"].items())),
                r["ip_address"] or "-",
                ts(r["created_at"]),
            )
            for r in rows
        ],
    )
    return 0


def inspect(a: argparse.Namespace) -> int:
    with connect(a) as c:
        info = c.call("Inspect", {"id": a.name})
    if a.json:
        print_json(info)
        return 0
    rows = []
    for k in ("id", "state", "labels", "limits", "network", "created_at", "ready_at", "last_exited_at"):
        v = info[k]
        if k.endswith("_at"):
            v = ts(v)
        rows.append((k, str(v)))
    rows.append(("last_exit_code", str(info["last_exit_code"])))
    if info["error"]:
        rows.append(("error", info["error"]))
    if info.get("cause"):
        rows.append(("cause", info["cause"]["sentence"]))
    if info.get("guest_oom_kills"):  # processes the guest's OOM killer took in this life
        rows.append(("guest_oom_kills", str(info["guest_oom_kills"])))
    for k in ("requested", "applied"):
        if info.get(k):
            rows.append((k, _settings(info[k])))
    if info.get("updated_at"):
        rows.append(("updated_at", ts(info["updated_at"])))
    if info.get("parent_uid"):  # a fork's child (docs/fork.md)
        rows.append(("parent", info["parent"]))
        rows.append(("fork_point", f"{info['fork_snapshot']} at {ts(info['forked_at'])}"))
    print_table(("FIELD", "VALUE"), rows, show_header=False)
    return 0


def _settings(s: dict[str, Any]) -> str:
    parts = [
        f"cpus {s['vcpus']}/{s['max_vcpus']}",
        f"memory {s['memory_mib']}/{s['max_memory_mib']} MiB",
        f"disk {s['disk_size_mib'] or 'image'}" + (" MiB" if s["disk_size_mib"] else ""),
    ]
    if s.get("working_dir"):
        parts.append(f"workdir {s['working_dir']}")
    if s.get("env"):
        parts.append("env " + ",".join(sorted(s["env"])))
    if s.get("settled"):
        parts.append("settled")
    return ", ".join(parts)


def modify_secrets(a: argparse.Namespace) -> list[dict[str, Any]]:
    """``--secret`` (create's form), ``--secret-hosts``, ``--secret-placeholder``: one
    wire SecretSpec per name (an ``env:`` source read here, as at create)."""
    from supervisor.client.sdk.spec import Secret

    by: dict[str, dict[str, Any]] = {}
    for text in a.secret or ():
        sp = Secret.parse(text).spec()
        by[sp.name] = {"name": sp.name, "hosts": sp.hosts, "value": sp.value, "store": sp.store}
        if sp.placeholder:
            by[sp.name]["placeholder"] = sp.placeholder
    for name, hosts in kv(a.secret_hosts or []).items():
        by.setdefault(name, {"name": name})["hosts"] = [h.strip() for h in hosts.split(",") if h.strip()]
    for name, placeholder in kv(a.secret_placeholder or []).items():
        by.setdefault(name, {"name": name})["placeholder"] = placeholder
    return list(by.values())


def modify(a: argparse.Namespace) -> int:
    """One call: the plan, a row per change; exit 1 when a change is refused or needs
    --restart (then nothing changed), 0 otherwise (a dry run that would apply too)."""
    body: dict[str, Any] = {"id": a.name, "dry_run": a.dry_run, "restart": a.restart}
    for key, value in (
        ("vcpus", a.cpus),
        ("memory_mib", a.memory),
        ("working_dir", a.workdir),
        ("ttl_seconds", a.ttl),
        ("idle_timeout_seconds", a.idle_timeout),
    ):
        if value is not None:
            body[key] = value
    if a.disk_size:
        from supervisor.client.sdk.spec import size_mib

        body["disk_size_mib"] = size_mib(a.disk_size)
    if a.env:
        body["env"] = kv(a.env)
    if a.label:
        body["labels"] = kv(a.label)
    for key, value in (("max_vcpus", a.max_cpus), ("max_memory_mib", a.max_memory)):
        if value is not None:
            body[key] = value
    if a.env_remove:
        body["env_remove"] = list(a.env_remove)
    if a.policy:
        body["policy"] = a.policy
    secrets = modify_secrets(a)
    if secrets:
        body["secrets"] = secrets
    with connect(a) as c:
        r = c.call("Modify", body)
    if a.json:
        print_json(r)
    else:
        rows = [(c["kind"], c["value"], c["status"], c["why"]) for c in r["changes"]]
        print_table(("CHANGE", "VALUE", "STATUS", "WHY"), rows)
        for n in r.get("conflicts", []):
            print(f"conflict: {n['field']}: {n['message']}", file=sys.stderr)
        for n in r.get("warnings", []):
            print(f"warning: {n['field']}: {n['message']}")
        if r.get("resize"):
            print_table(
                ("RESOURCE", "REQUESTED", "ACTUAL", "ENFORCED", "STATE"),
                [(x["resource"], x["requested"], x["actual"], x["enforced"], x["state"]) for x in r["resize"]],
            )
        if r.get("pending"):
            print("saved for the next start: the running sandbox is not changed")
        if r["dry_run"]:
            print("dry run: nothing changed")
        elif not r["applied"]:
            print("not applied: nothing changed", file=sys.stderr)
        else:
            if r["note"]:
                print(r["note"])
            if r["settled"]:
                print(f"settled in {r['settle_seconds']:.2f} s")
    blocked = any(c["status"] in ("refused", "needs_restart") for c in r["changes"])
    return 1 if blocked else 0


def _print_log(e: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(e)
        return
    target = sys.stderr.buffer if e["source"] == "stderr" else sys.stdout.buffer
    data = e["data"] if e["source"] != "system" else b"[system] " + e["data"] + b"\n"
    target.write(data)
    target.flush()


def logs(a: argparse.Namespace) -> int:
    with connect(a) as c:
        req = {"id": a.name, "follow": a.follow, "tail": a.tail, "since": a.since, "until": a.until, "cursor": a.cursor}
        for e in c.stream("Logs", {**req, "sources": a.source or []}):
            _print_log(e, a.json)
    return 0


def events(a: argparse.Namespace) -> int:
    import datetime

    with connect(a) as c:
        req: dict[str, object] = {"id": a.id or "", "action": a.action or ""}
        if a.since is not None:
            req["since"] = a.since
        for e in c.stream("Events", req):
            if a.json:
                print_json(e)
            else:
                attrs = " ".join(f"{k}={v}" for k, v in sorted(e["attributes"].items()))
                ts = datetime.datetime.fromtimestamp(e["timestamp"] / 1e9, datetime.UTC).isoformat()
                where = f"cursor={e.get('cursor', 0)} "  # resume after it: events --since CURSOR
                print(f"{where}{ts} {e['sandbox_id']} {e['action']} {attrs}".rstrip(), flush=True)
    return 0


@on_trio
async def cp(a: argparse.Namespace) -> int:
    from supervisor.client import AsyncSandbox

    src_remote, dst_remote = ":" in a.src and not a.src.startswith("/"), ":" in a.dst and not a.dst.startswith("/")
    if src_remote == dst_remote:
        raise UsageError("exactly one of SRC and DST must be NAME:/path")
    if src_remote:
        name, _, path = a.src.partition(":")
        fs = AsyncSandbox(name, socket=a.socket).fs
        if a.recursive:  # one tar stream; DST is the directory the tree becomes
            await fs.copy_tree_out(path, a.dst, keep_owners=a.archive)
        else:
            await fs.copy_out(path, a.dst)
    else:
        name, _, path = a.dst.partition(":")
        fs = AsyncSandbox(name, socket=a.socket).fs
        if a.recursive:
            if not Path(a.src).is_dir():
                raise UsageError(f"{a.src}: no such directory")
            await fs.copy_tree_in(a.src, path, owner="" if a.archive else a.owner)
        elif not Path(a.src).is_file():
            raise UsageError(f"{a.src}: no such file" + (" (a directory needs -r)" if Path(a.src).is_dir() else ""))
        else:
            await fs.copy_in(a.src, path)
    return 0


@on_trio
async def _start(a: argparse.Namespace) -> int:
    from supervisor.client import AsyncSandbox, SandboxError

    failed = []
    for name in a.names:  # several names: each is tried, as rm/stop/kill do
        try:
            await AsyncSandbox(name, socket=a.socket).start()  # boots, then waits until ready
        except SandboxError as exc:
            if len(a.names) == 1:
                raise
            print(f"{name}: {exc.message}", file=sys.stderr)
            failed.append(name)
    return 1 if failed else 0


def status(a: argparse.Namespace) -> int:
    """Whether the supervisor answers; with --wait, poll until it does (scripts start
    ``sandvisor serve &`` and go on once this returns)."""
    import time

    from supervisor.wire.errors import ApiError

    deadline = time.monotonic() + max(a.wait, 0)
    while True:
        try:
            with connect(a) as c:
                n = len(c.call("List", {"labels": {}, "state": "", "limit": 100, "cursor": ""})["sandboxes"])
            break
        except ApiError as exc:
            if exc.code != "UNAVAILABLE" or time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
    if a.json:
        print_json({"serving": True, "sandboxes": n})
    else:
        print(f"serving: {n if n < 100 else '100+'} sandboxes")
    return 0


def wait(a: argparse.Namespace) -> int:
    """Until the sandbox stops: how it ended; exits with its exit code (1 when it
    crashed or failed with none, 0 when stopped with none)."""
    with connect(a) as c:
        info = c.call("WaitUntilStopped", {"id": a.name})
    cause = info.get("cause") or {}
    if a.json:
        print_json({"id": info["id"], "status": info["state"], **cause})
    else:
        print(f"{info['id']}: {info['state']}: {cause.get('sentence') or info['error'] or info['state']}")
    code = cause.get("exit_code")
    if code is None and cause.get("signal"):
        code = 128 + int(cause["signal"])
    if code is None:
        code = 0 if info["state"] == "stopped" else 1
    return int(code) & 0xFF


def simple(a: argparse.Namespace) -> int:
    if a.command == "start":
        return _start(a)
    from supervisor.wire.errors import ApiError

    failed: list[str] = []
    with connect(a) as c:
        for name in a.names:  # several names: each is tried, as docker's rm/stop/kill do
            try:
                if a.command == "stop":
                    c.call("Stop", {"id": name, "timeout_seconds": a.timeout})
                elif a.command == "kill":
                    c.call("Kill", {"id": name, "timeout_seconds": a.timeout})
                elif a.command == "drain":
                    c.call("Drain", {"id": name, "grace_seconds": a.grace})
                elif a.command == "rm":
                    c.call("Remove", {"id": name, "force": a.force, "with_descendants": a.with_descendants})
                elif a.command == "ping":
                    print(f"{int(c.call('Ping', {'id': name})['latency_ns']) / 1e9 * 1000:.2f} ms")
                elif a.command == "touch":
                    print(int(c.call("Touch", {"id": name})["activity"]))
                elif a.command == "ttl":
                    import time

                    end = int(c.call("SetTtl", {"id": name, "ttl_seconds": a.seconds})["expires_at"])
                    print(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(end)) if end else "never")
                elif a.command in ("pause", "resume"):
                    print(f"{name}: {c.call(a.command.capitalize(), {'id': name})['state']}")
            except ApiError as exc:
                if len(a.names) == 1:
                    raise
                print(f"{name}: {exc.message}", file=sys.stderr)
                failed.append(name)
    return 1 if failed else 0


_METRICS = ("ID", "CPU", "MEM", "HOST RSS", "DISK R/W", "NET RX/TX", "ROOT USED/FREE (HOST)", "SHARED/OWN", "UP")


def _metrics_row(m: dict[str, Any]) -> tuple[str, ...]:
    return (
        m["id"],
        f"{m['cpu_percent']:.1f}%",
        f"{(m['memory_total_bytes'] - m['memory_available_bytes']) >> 20}/{m['memory_total_bytes'] >> 20} MiB",
        f"{m['host_rss_bytes'] >> 20} MiB",
        f"{m['disk_read_bytes'] >> 10}/{m['disk_write_bytes'] >> 10} KiB",
        f"{m['net_rx_bytes']}/{m['net_tx_bytes']}",
        f"{m.get('root_used_bytes', 0) >> 20}/{m.get('root_free_bytes', 0) >> 20} MiB"
        f" ({m.get('root_host_allocated_bytes', 0) >> 20})",
        f"{m.get('memory_shared_bytes', 0) >> 20}/{m.get('memory_own_bytes', 0) >> 20} MiB",
        f"{m['uptime_seconds']:.0f}s",
    )


def metrics(a: argparse.Namespace) -> int:
    def show(m: dict[str, Any]) -> None:
        if a.json:
            print_json(m)
        else:
            print_table(_METRICS, [_metrics_row(m)])

    with connect(a) as c:
        if not a.watch:
            show(c.call("Metrics", {"id": a.name}))
            return 0
        for m in c.stream("MetricsStream", {"id": a.name, "interval_seconds": 1.0}):
            show(m)
    return 0


def top(a: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.live import Live

    with Live(rich_table(_METRICS, []), console=Console(), refresh_per_second=2) as live:
        while True:
            with connect(a) as c:
                every = c.call("MetricsAll", {})
            live.update(rich_table(_METRICS, [_metrics_row(m) for m in every["sandboxes"]]))
            time.sleep(1.0)


def port(a: argparse.Namespace) -> int:
    proto = "udp" if a.udp else "tcp"
    if a.action == "ls":
        with connect(a) as c:
            mappings = c.call("ListPorts", {"id": a.name})["ports"]
        if a.json:
            print_json(mappings)
            return 0
        print_table(
            ("SANDBOX PORT", "HOST", "PROTOCOL"),
            [(str(m["sandbox_port"]), f"{m['host_address']}:{m['host_port']}", m["protocol"]) for m in mappings],
        )
        return 0
    if a.sandbox_port is None:
        raise UsageError(f"port {a.action} needs SANDBOX_PORT")
    with connect(a) as c:
        if a.action == "add":
            body = {"id": a.name, "sandbox_port": a.sandbox_port, "host_port": a.host_port, "protocol": proto}
            if a.address:
                body["host_address"] = a.address
            r = c.call("ExposePort", body)
            print(r["host_port"])
        else:
            c.call("UnexposePort", {"id": a.name, "sandbox_port": a.sandbox_port, "protocol": proto})
    return 0
