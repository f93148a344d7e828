"""The public surface of both SDKs, declared once: the method tables
(:class:`SandboxMethods`, :class:`FSMethods`, ...) over the plans (see
:mod:`supervisor.client.sdk.ops`), which are written once, by area, in
:mod:`~supervisor.client.sdk.sandbox_plans`, :mod:`~supervisor.client.sdk.snapshot_plans`,
:mod:`~supervisor.client.sdk.file_plans`, :mod:`~supervisor.client.sdk.image_plans` and
:mod:`~supervisor.client.sdk.secret_plans`. The SDKs (:mod:`supervisor.client.sdk.aio`,
:mod:`supervisor.client.sdk.sync`) subclass the tables.
"""

from __future__ import annotations

from supervisor.client.sdk.code_plans import (
    create_code_context,
    list_code_contexts,
    remove_code_context,
    restart_code_context,
    run_code,
)
from supervisor.client.sdk.config_plans import config, config_json, ssh
from supervisor.client.sdk.file_plans import (
    copy_in,
    copy_out,
    copy_tree_in,
    copy_tree_out,
    fs_exists,
    fs_list,
    fs_mkdir,
    fs_remove,
    fs_rename,
    fs_stat,
    read,
    write,
)
from supervisor.client.sdk.image_plans import (
    image_inspect,
    image_list,
    image_prune,
    image_pull,
    image_pull_stream,
    image_remove,
    volume_create,
    volume_get,
    volume_list,
    volume_remove,
)
from supervisor.client.sdk.ops import class_op, maker, op, stream
from supervisor.client.sdk.sandbox_plans import (
    create,
    drain,
    events,
    expose,
    get,
    inspect,
    kill,
    list_,
    log_stream,
    logs,
    metrics,
    metrics_all,
    metrics_stream,
    modify,
    pause,
    ping,
    ports,
    remove,
    request_kill,
    request_stop,
    resume,
    run,
    run_script,
    run_stream,
    set_ttl,
    shell_argv,
    start,
    state,
    stop,
    touch,
    unexpose,
    wait_ready,
    wait_until_stopped,
)
from supervisor.client.sdk.secret_plans import (
    revoke_secret,
    rotate_secret,
    secret_list,
    secret_remove,
    secret_set,
    secrets,
)
from supervisor.client.sdk.snapshot_plans import (
    checkpoint,
    delete_snapshot,
    export_snapshot,
    import_snapshot,
    restore,
    snapshots,
)


class SandboxMethods:
    """The sandbox's methods (:class:`~supervisor.client.sdk.aio.AsyncSandbox`, awaitable;
    :class:`~supervisor.client.sdk.sync.Sandbox`, blocking)."""

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
    shell_argv = op(shell_argv)
    modify = op(modify)
    state = op(state)
    wait_ready = op(wait_ready)
    stop = op(stop)
    kill = op(kill)
    request_stop = op(request_stop)
    request_kill = op(request_kill)
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
    config = op(config)
    config_json = op(config_json)
    ssh = op(ssh)
    # the code interpreter (docs/code.md)
    run_code = op(run_code)
    create_code_context = op(create_code_context)
    list_code_contexts = op(list_code_contexts)
    restart_code_context = op(restart_code_context)
    remove_code_context = op(remove_code_context)


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
    """The supervisor's OCI image store: pull (with progress), list, inspect,
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
