"""OCI images through a running supervisor: PullImage with progress,
ListImages, RemoveImage, PruneImages and Create{image} over the socket, from the SDK
(sync and async) and the CLI, against the real loopback registry of tests/host/conftest.py (its
session fixtures: images built here with umoci, pushed with skopeo).

The supervisor runs in this Trio run (``throwaway.supervisor``), so a test can look
into its store (no staging left, no registry contact) while it talks to it through
its socket like any client; the CLI runs as a child process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.registry import Registry
from images.build import Image as GuestImage
from images.ocilocal import TEST_PASSWORD, TEST_USER, ImageSpec, Layer, LocalRegistry, build_image, busybox_tree, push
from supervisor.client import (
    AsyncImages,
    AsyncSandbox,
    FailedPrecondition,
    Images,
    InvalidArgument,
    NotFound,
    PullImageProgress,
    Unavailable,
)
from supervisor.main.throwaway import Workdir, supervisor, workdir
from tests.support.registrylab import Built, Pushed


@pytest.fixture
async def served(image: GuestImage) -> AsyncIterator[tuple[Workdir, Registry]]:
    with workdir("sv-oci-", private_state=True) as work:
        # the tests' registries are on loopback, their images under /tmp: allowed explicitly
        async with supervisor(work, registry_allow=("127.0.0.1",), allow_paths=(Path("/tmp"),)) as (_cfg, reg):
            yield work, reg


async def cli(work: Workdir, *args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env={**work.env(), "COLUMNS": "400"},  # tables of long references, unwrapped
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


def assert_no_partial(reg: Registry, images: int) -> None:
    store = reg.settings.images
    assert store is not None
    assert list(store.tmp.iterdir()) == []
    assert len(list(store.images.iterdir())) == images == len(store.list_images())


async def still_serving(work: Workdir) -> None:
    assert len(await AsyncImages(work.socket).list()) >= 0


async def exec_out(sb: AsyncSandbox, cmd: list[str], **how: Any) -> tuple[int, bytes]:
    out = bytearray()
    async with sb.exec(cmd, **how) as x:
        await x.close_stdin()
        async for o in x:
            if o.stream == "stdout":
                out += o.data
        code = await x.wait()
    return code, bytes(out)


# --- pull, list, rm, prune: no VM ------------------------------------------------------


async def test_pull_by_tag_and_digest_with_progress_then_ls_rm_prune(
    served: tuple[Workdir, Registry], pushed: Pushed
) -> None:
    work, reg = served
    images = AsyncImages(work.socket)
    seen: list[PullImageProgress] = []
    with trio.fail_after(180):
        img = await images.pull(pushed.busybox, tls_verify=False, progress=seen.append)
        assert img.digest == pushed.digests["busybox"]
        assert img.refs == [pushed.busybox] and img.cmd == ["/bin/sh"] and not img.in_use
        phases = [p.phase for p in seen]
        assert phases[0] == "resolving" and phases[-1] == "done" and seen[-1].image == img
        assert {"downloading", "unpacking", "converting"} <= set(phases)
        dl = [p for p in seen if p.phase == "downloading" and p.total]
        assert dl and dl[-1].done == dl[-1].total > 0

        # by digest: the same image, no second conversion; a cached pull says so
        by_digest = pushed.busybox.rsplit(":", 1)[0] + "@" + img.digest
        store = reg.settings.images
        assert store is not None
        conversions = store.stats.conversions
        again = await images.pull(by_digest, tls_verify=False)
        assert again.digest == img.digest and set(again.refs) == {pushed.busybox, by_digest}
        assert store.stats.conversions == conversions
        seen.clear()
        await images.pull(pushed.busybox, progress=seen.append)  # if-missing: TLS never tried
        assert [p.phase for p in seen] == ["cached", "done"]

        # the CLI: pull (digest on stdout, progress on stderr), ls --json, rm, prune
        r = await cli(work, "image", "pull", pushed.app, "--tls-verify=false")
        assert r.returncode == 0, r.stderr
        assert r.stdout.decode().strip() == pushed.digests["app"]
        assert b"downloading" in r.stderr and b"converting" in r.stderr
        r = await cli(work, "image", "pull", "--policy", "always", by_digest, "--tls-verify=false", "-q")
        assert (r.returncode, r.stdout.decode().strip(), r.stderr) == (0, img.digest, b"")
        r = await cli(work, "image", "ls", "--json")
        listed = {i["digest"]: i for i in json.loads(r.stdout)}
        assert set(listed) == {pushed.digests["busybox"], pushed.digests["app"]}
        assert listed[pushed.digests["app"]]["user"] == "4242:4243"
        r = await cli(work, "image", "ls")
        assert pushed.app.encode() in r.stdout and img.id.encode() in r.stdout

        r = await cli(work, "image", "rm", img.digest)  # a digest: all its refs go
        assert r.returncode == 0, r.stderr
        assert f"deleted: {img.digest}".encode() in r.stdout
        assert [i.digest for i in await images.list()] == [pushed.digests["app"]]
        with pytest.raises(NotFound):
            await images.remove(pushed.busybox)
        r = await cli(work, "image", "rm", pushed.busybox)
        assert r.returncode == 1 and b"not in the store" in r.stderr

        r = await cli(work, "image", "prune", "--json")
        assert r.returncode == 0, r.stderr
        pruned = json.loads(r.stdout)
        assert pruned["deleted"] == [pushed.digests["app"]] and pruned["freed_bytes"] > 0
        assert await images.list() == []
        assert_no_partial(reg, 0)
        assert list((store.blobs / "sha256").iterdir()) == []  # no layer left behind


async def test_sync_sdk_pull_list_remove(served: tuple[Workdir, Registry], pushed: Pushed) -> None:
    """The blocking SDK (it drives its own Trio loop: here in a worker thread)."""
    work, reg = served
    images = Images(work.socket)
    with trio.fail_after(180):
        img = await trio.to_thread.run_sync(lambda: images.pull(pushed.busybox, tls_verify=False))
        phases = await trio.to_thread.run_sync(
            lambda: [p.phase for p in images.pull_stream(pushed.busybox, tls_verify=False, policy="always")]
        )
        assert phases[0] == "resolving" and phases[-1] == "done"  # always: asked again, nothing new to fetch
        listed = await trio.to_thread.run_sync(images.list)
        assert img.digest == pushed.digests["busybox"] and [i.digest for i in listed] == [img.digest]
        assert (await trio.to_thread.run_sync(images.inspect, img.id)).refs == [pushed.busybox]
        removed = await trio.to_thread.run_sync(images.remove, pushed.busybox)
        assert (removed.untagged, removed.deleted) == ([pushed.busybox], [img.digest])
        assert_no_partial(reg, 0)


@pytest.mark.parametrize(
    "case",
    ["missing tag", "unreachable", "wrong creds", "no creds", "malformed", "bad policy"],
)
async def test_pull_failures_are_typed_leave_nothing_and_the_daemon_serves_on(
    served: tuple[Workdir, Registry],
    pushed: Pushed,
    auth_registry: LocalRegistry,
    case: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    work, reg = served
    images = AsyncImages(work.socket)
    private = auth_registry.ref("private/busybox:1")
    calls = {
        "missing tag": (NotFound, "no such image", dict(ref=pushed.busybox.replace(":1", ":nope"), tls_verify=False)),
        "unreachable": (Unavailable, "cannot reach", dict(ref="docker://127.0.0.1:1/test/busybox:1", tls_verify=False)),
        "wrong creds": (
            FailedPrecondition,
            "refused the credentials",
            dict(ref=private, tls_verify=False, creds=f"{TEST_USER}:wrong-pass"),
        ),
        "no creds": (FailedPrecondition, "requires credentials", dict(ref=private, tls_verify=False)),
        "malformed": (InvalidArgument, "malformed", dict(ref="docker://UPPER/Case:1")),
        "bad policy": (InvalidArgument, "pull policy", dict(ref=pushed.busybox, policy="sometimes")),
    }
    cls, words, kw = calls[case]
    with trio.fail_after(120):
        with pytest.raises(cls, match=words) as exc:
            await images.pull(**kw)  # type: ignore[arg-type]
        assert "wrong-pass" not in str(exc.value)
        assert_no_partial(reg, 0)
        await still_serving(work)
        # the same through the CLI: one line, exit 1, the password nowhere
        args = ["image", "pull", str(kw["ref"]), "--tls-verify=false"]
        if "creds" in kw:
            args += ["--creds", str(kw["creds"])]
        if "policy" in kw:
            args += ["--policy", str(kw["policy"])]  # the CLI's own choices refuse it: a usage error
        r = await cli(work, *args)
        assert r.returncode == (2 if "policy" in kw else 1), r.stderr
        lines = r.stderr.decode().strip().splitlines()  # progress, then the error: one line
        assert lines[-1].startswith("error: ") and sum(ln.startswith("error: ") for ln in lines) == 1, lines
        assert b"wrong-pass" not in r.stderr + r.stdout
        assert_no_partial(reg, 0)
    assert "wrong-pass" not in caplog.text  # the supervisor's log, at debug level


async def test_a_host_path_is_refused_exactly_as_a_missing_one(
    served: tuple[Workdir, Registry], tmp_path: Path
) -> None:
    """The confused deputy: root does not read a host path a client names unless
    it is in an --allow-path directory, and the answer cannot tell "exists, not allowed"
    from "missing": same code, same words, only the path differs. (This supervisor allows
    /tmp: a symlink there to /etc/shadow is refused too.)"""
    work, reg = served
    (tmp_path / "shadow.tar").symlink_to("/etc/shadow")
    refs = {
        "missing": "docker-archive:/etc/no-such-archive",
        "shadow": "docker-archive:/etc/shadow",
        "symlink": f"docker-archive:{tmp_path}/shadow.tar",
        "oci dir": "oci:/etc",
    }
    with trio.fail_after(60):
        lines, sdk = {}, {}
        for case, ref in refs.items():
            with pytest.raises(NotFound) as exc:
                await AsyncImages(work.socket).pull(ref)
            sdk[case] = exc.value.message.replace(ref, "REF")
            r = await cli(work, "image", "pull", ref)
            assert r.returncode == 1, r.stderr
            lines[case] = r.stderr.decode().strip().splitlines()[-1].replace(ref, "REF")
        assert len(set(sdk.values())) == 1 and len(set(lines.values())) == 1, (sdk, lines)
        assert "no such image" in sdk["shadow"] and lines["shadow"].startswith("error: ")
        assert_no_partial(reg, 0)
        await still_serving(work)


async def test_credentials_and_auth_file_through_the_socket(
    served: tuple[Workdir, Registry], auth_registry: LocalRegistry, tmp_path: Path
) -> None:
    work, reg = served
    private = auth_registry.ref("private/busybox:1")
    with trio.fail_after(120):
        r = await cli(work, "image", "pull", private, "--tls-verify=false", "--creds", f"{TEST_USER}:{TEST_PASSWORD}")
        assert r.returncode == 0, r.stderr
        digest = r.stdout.decode().strip()
        await AsyncImages(work.socket).remove(digest)
        import base64

        token = base64.b64encode(f"{TEST_USER}:{TEST_PASSWORD}".encode()).decode()
        authfile = tmp_path / "auth.json"
        authfile.write_text(json.dumps({"auths": {auth_registry.host: {"auth": token}}}))
        img = await AsyncImages(work.socket).pull(private, tls_verify=False, authfile=authfile, policy="always")
        assert img.digest == digest
        r = await cli(work, "image", "pull", private, "--tls-verify=false", "--authfile", str(authfile), "-q")
        assert (r.returncode, r.stdout.decode().strip()) == (0, digest)
        assert_no_partial(reg, 1)


# --- Create{image}: real VMs ------------------------------------------------------------


@pytest.mark.vm
async def test_create_from_image_its_defaults_template_and_rm_refused(
    served: tuple[Workdir, Registry], built: Built, own_registry: LocalRegistry, pushed: Pushed
) -> None:
    """The image's config is the sandbox's default (a non-root USER, a WORKDIR the store
    made, ENV, Entrypoint+Cmd as the initial workload); ``if-missing`` does not contact
    the registry (it is stopped); the second Create restores the image's boot template;
    rm of the image is refused while anything stands on it, prune keeps it."""
    work, reg = served
    store = reg.settings.images
    assert store is not None
    ref = own_registry.ref("test/app:1")
    digest = push(built.layout, "app", ref)
    sock = work.socket
    with trio.fail_after(600):
        await AsyncImages(sock).pull(ref, tls_verify=False)
        own_registry.stop()  # if-missing: the store has it, the registry is never asked
        resolves = store.stats.resolves
        r = await cli(work, "create", "app1", "--image", ref)
        assert r.returncode == 0, r.stderr
        assert b"cached: in the store" in r.stderr  # the CLI shows the pull before it creates
        a = await AsyncSandbox.get("app1", socket=sock)
        async with a:
            a.detached = False
            while b"hello from /srv/app as 4242:4243" not in b"".join(e.data for e in await a.logs()):
                await trio.sleep(0.2)  # the image's Entrypoint+Cmd ran as the initial workload
            argv = ["/bin/sh", "-c", 'echo "$(id -u):$(id -g) $(pwd) $GREETING $PATH"; cd / && ls /srv']
            code, out = await exec_out(a, argv)
            assert (code, out) == (0, b"4242:4243 /srv/app hello /bin\napp\n")  # (the user reaches /srv)
            # a call's own values win over the image's
            code, out = await exec_out(a, ["/bin/sh", "-c", "id -u; pwd"], user="0", workdir="/")
            assert (code, out) == (0, b"0\n/\n")

            # in use: rm refused (FAILED_PRECONDITION), prune keeps it
            with pytest.raises(FailedPrecondition, match="in use"):
                await AsyncImages(sock).remove(digest)
            r = await cli(work, "image", "rm", ref)
            assert r.returncode == 1 and b"FAILED_PRECONDITION" in r.stderr
            unused = await AsyncImages(sock).pull(pushed.busybox, tls_verify=False)
            assert (await AsyncImages(sock).prune()).deleted == [unused.digest]  # only what nothing uses
            [listed] = await AsyncImages(sock).list()
            assert listed.in_use and listed.digest == digest

            async with await AsyncSandbox.create("app2", image=ref, socket=sock) as b:
                logs = b"".join(e.data for e in await b.logs() if e.source == "system")
                assert b"restored from the boot template" in logs, logs
                code, out = await exec_out(b, ["/bin/sh", "-c", "id -u; cat /etc/motd"])
                assert (code, out) == (0, b"4242\napp image\n")
        assert store.stats.resolves == resolves + 1  # busybox's pull only: neither Create asked the registry
        # policy always asks it: stopped, that is UNAVAILABLE, and the daemon serves on
        with pytest.raises(Unavailable):
            await AsyncSandbox.create("app3", image=ref, pull="always", tls_verify=False, socket=sock)
        with pytest.raises(NotFound):  # a Create whose pull failed made nothing
            await AsyncSandbox.get("app3", socket=sock)
        # the sandboxes are gone, but the boot template still stands on the image
        with pytest.raises(FailedPrecondition, match="in use"):
            await AsyncImages(sock).remove(digest)


@pytest.mark.vm
async def test_python_image_without_a_shell_boots_and_runs_its_cmd(
    served: tuple[Workdir, Registry], pushed: Pushed
) -> None:
    """No shell, no Create cmd: the image's Cmd (python3 -S) is the initial workload;
    its stdin is not a terminal left open, so it ends and the sandbox takes Runs."""
    work, _reg = served
    with trio.fail_after(300):
        img = await AsyncImages(work.socket).pull(pushed.python, tls_verify=False)
        assert img.cmd == ["/usr/bin/python3", "-S"] and img.entrypoint == []
        async with await AsyncSandbox.create("py", image=pushed.python, socket=work.socket) as sb:
            code, out = await exec_out(
                sb, ["/usr/bin/python3", "-S", "-c", "import os; print(os.getuid(), sorted(os.listdir('/opt/lower')))"]
            )
            assert (code, out) == (0, b"0 ['c']\n")
            while True:
                try:
                    r = await sb.run(["/usr/bin/python3", "-S", "-c", "print('a run')"])
                    break
                except FailedPrecondition:  # the initial workload is still running
                    await trio.sleep(0.2)
            assert (r.exit_code, r.stdout) == (0, b"a run\n")


async def wait_log(sb: AsyncSandbox, text: bytes, timeout: float = 60) -> None:
    with trio.move_on_after(timeout):
        while text not in b"".join(e.data for e in await sb.logs()):
            await trio.sleep(0.2)
        return
    raise AssertionError(f"{text!r} not in the logs: {await sb.logs()} {await sb.inspect()}")


@pytest.mark.vm
async def test_a_create_cmd_replaces_the_image_cmd_not_its_entrypoint(
    served: tuple[Workdir, Registry], tmp_path: Path
) -> None:
    """As a container runtime and the SDK reference's WithCmd: Entrypoint + the Create's
    cmd; Entrypoint + the image's Cmd without one. The image comes from an ``oci:`` dir."""
    work, _reg = served
    layout = tmp_path / "layout"
    spec = ImageSpec(user="app", entrypoint=("/bin/echo", "ep:"), cmd=("default",))  # a USER by name
    passwd = "root:x:0:0:root:/root:/bin/sh\napp:x:1234:1235:app:/:/bin/sh\n"
    old = os.umask(0o022)  # the tree as a user would make it (the in-process supervisor's is 077)
    try:
        build_image(layout, "ep", [Layer(busybox_tree(tmp_path / "bb", passwd))], spec)
    finally:
        os.umask(old)
    ref = f"oci:{layout}:ep"
    with trio.fail_after(300):
        # not pulled yet: the CLI's create pulls it first, with progress
        r = await cli(work, "create", "ep1", "--image", ref)
        assert r.returncode == 0, r.stderr
        assert b"unpacking" in r.stderr and b"converting" in r.stderr, r.stderr
        img = await AsyncImages(work.socket).inspect(ref)
        assert (img.entrypoint, img.cmd, img.refs) == (["/bin/echo", "ep:"], ["default"], [ref])
        async with await AsyncSandbox.get("ep1", socket=work.socket) as a:
            a.detached = False
            await wait_log(a, b"ep: default\n")
        async with await AsyncSandbox.create("ep2", image=ref, cmd=["given"], socket=work.socket) as b:
            await wait_log(b, b"ep: given\n")
            assert await exec_out(b, ["/bin/id", "-u"]) == (0, b"1234\n")  # the name, from the image's passwd


async def test_the_image_rpcs_over_grpc(image: GuestImage, pushed: Pushed) -> None:
    """sandvisor.v1 PullImage (streamed), ListImages, RemoveImage, PruneImages: the same
    table as the socket; ``tls_verify`` is a proto3 optional (unset: verify)."""
    import grpc

    from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
    from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc

    with workdir("sv-ocig-", private_state=True) as work:
        sock = work.root / "g.sock"
        async with supervisor(work, grpc=(f"unix://{sock}",), registry_allow=("127.0.0.1",)) as (_cfg, reg):
            channel = grpc.insecure_channel(f"unix:{sock}")
            stub = sv_grpc.SandvisorServiceStub(channel)

            def pull(**kw: Any) -> list[Any]:
                return list(stub.PullImage(sv.PullImageRequest(**kw)))

            def code_of(fn: Any, **kw: Any) -> tuple[Any, str]:
                try:
                    fn(**kw)
                except grpc.RpcError as exc:
                    return exc.code(), exc.details()
                raise AssertionError("no error")

            try:
                with trio.fail_after(120):
                    items = await trio.to_thread.run_sync(lambda: pull(ref=pushed.busybox, tls_verify=False))
                    assert items[0].phase == "resolving" and items[-1].phase == "done"
                    assert items[-1].image.digest == pushed.digests["busybox"]
                    assert items[-1].image.cmd == ["/bin/sh"]
                    # TLS verified when unset: the plain-HTTP registry is UNAVAILABLE, saying why
                    code, why = await trio.to_thread.run_sync(
                        lambda: code_of(pull, ref=pushed.app)  # (not cached: it must ask)
                    )
                    assert code == grpc.StatusCode.UNAVAILABLE and "tls_verify" in why
                    listed = await trio.to_thread.run_sync(lambda: stub.ListImages(sv.ListImagesRequest()))
                    assert [i.digest for i in listed.oci_images] == [pushed.digests["busybox"]]
                    code, _ = await trio.to_thread.run_sync(
                        lambda: code_of(pull, ref=pushed.busybox.replace(":1", ":nope"), tls_verify=False)
                    )
                    assert code == grpc.StatusCode.NOT_FOUND
                    r = await trio.to_thread.run_sync(
                        lambda: stub.RemoveImage(sv.RemoveImageRequest(ref=pushed.busybox))
                    )
                    assert list(r.deleted) == [pushed.digests["busybox"]]
                    p = await trio.to_thread.run_sync(lambda: stub.PruneImages(sv.PruneImagesRequest()))
                    assert list(p.deleted) == []
                    assert_no_partial(reg, 0)
            finally:
                channel.close()


async def test_two_pulls_of_one_image_at_once_do_the_work_once(
    served: tuple[Workdir, Registry], pushed: Pushed
) -> None:
    work, reg = served
    store = reg.settings.images
    assert store is not None
    phases: dict[str, list[str]] = {"a": [], "b": []}
    digests: dict[str, str] = {}

    async def one(name: str) -> None:
        img = await AsyncImages(work.socket).pull(
            pushed.python, tls_verify=False, progress=lambda p: phases[name].append(p.phase)
        )
        digests[name] = img.digest

    with trio.fail_after(180):
        async with trio.open_nursery() as n:
            n.start_soon(one, "a")
            n.start_soon(one, "b")
    assert digests["a"] == digests["b"] == pushed.digests["python"]
    assert store.stats.conversions == 1 and store.stats.copies == 1
    assert phases["a"][-1] == phases["b"][-1] == "done"  # (the later one waited for the first, or found it done)
    assert_no_partial(reg, 1)
