"""Files beyond read and write (list, stat, exists, mkdir, rm, mv), the logs' source
filter and cursor, and the sandbox.v1 proto's loose ends, against real VMs.

One supervisor in this Trio run (so a test may shorten its Stop grace), one sandbox
(``fsbox``, mounting the volume ``vol``) for the file: each file operation through the
SDK, the CLI and sandvisor.v1; the log filter on each edge; then, with a client
generated from sandbox.v1's proto: a WriteFile without ``done`` or with data after it
(INVALID_ARGUMENT, no file left), a second Exec ``init`` (INVALID_ARGUMENT), a Run or
an Exec of a missing executable (exit 127, a message on stderr), a Stop that gives up
(DEADLINE_EXCEEDED); then a start again, and DeleteVolume with ``force``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import aclosing
from types import ModuleType
from typing import Any

import grpc
import pytest
import trio

from actors import defaults
from actors.model import State
from actors.registry import Registry
from images.build import Image
from supervisor.client import AlreadyExists, AsyncSandbox, AsyncVolumes, FailedPrecondition, InvalidArgument, NotFound
from supervisor.main.throwaway import Workdir, supervisor, workdir
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc
from tests.support.grpc_clients import generate

SC = grpc.StatusCode
BOX = "fsbox"


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args))


async def status(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    """The status a call ends with (a stream is drained)."""

    def call() -> tuple[grpc.StatusCode, str]:
        try:
            result = fn()
            if hasattr(result, "__next__"):
                list(result)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        raise AssertionError("no error")

    return await trio.to_thread.run_sync(call)


def drain(stream: Any) -> None:
    """A call's stream to its end, however it ends."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError:
        pass


async def cli(work: Workdir, *args: str) -> tuple[int, bytes, bytes]:
    p = await trio.run_process(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=work.env(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return p.returncode, p.stdout, p.stderr


async def until(cond: Callable[[], bool], timeout: float = 120) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.05)


async def test_files_logs_and_the_seed_loose_ends(
    image: Image, monkeypatch: pytest.MonkeyPatch, seed: tuple[ModuleType, ModuleType]
) -> None:
    spb, sgrpc = seed
    with workdir("sv-fs-") as work:
        sock = work.root / "g.sock"
        with trio.fail_after(900):
            async with supervisor(work, grpc=(f"unix://{sock}",), templates=False, stop_timeout=5) as (_cfg, reg):
                await AsyncVolumes(work.socket).create("vol", "32M")
                sb = await AsyncSandbox.create(BOX, socket=work.socket, volumes=["vol:/data"], detached=True)
                with grpc.insecure_channel(f"unix:{sock}") as ch:
                    ours, s = sv_grpc.SandvisorServiceStub(ch), sgrpc.SandboxServiceStub(ch)
                    await _fs_sdk(sb)
                    await _fs_cli(work)
                    await _fs_grpc(ours)
                    await _logs(sb, ours, work)
                    await _loose_ends(reg, s, spb, ours, monkeypatch)


@pytest.fixture(scope="module")
def seed() -> tuple[ModuleType, ModuleType]:
    return generate()


async def _fs_sdk(sb: AsyncSandbox) -> None:
    fs = sb.fs
    await fs.mkdir("/srv/a/b")  # parents by default, as mkdir -p
    await fs.mkdir("/srv/a/b")  # ... and one that is there is fine
    await fs.write("/srv/a/b/f.txt", b"hello")
    [f] = await fs.list("/srv/a/b")
    assert (f.name, f.path, f.kind, f.size, f.mode, f.uid) == ("f.txt", "/srv/a/b/f.txt", "file", 5, 0o644, 0)
    d = await fs.stat("/srv/a/b")
    assert (d.name, d.path, d.kind, d.mode) == ("b", "/srv/a/b", "dir", 0o755) and d.mtime_ns > 0
    assert await fs.exists("/srv/a/b/f.txt") and not await fs.exists("/srv/nope")
    await fs.rename("/srv/a/b/f.txt", "/srv/a/g.txt")
    assert await fs.read("/srv/a/g.txt") == b"hello" and not await fs.exists("/srv/a/b/f.txt")
    # a link is reported as one, never followed; hostile names come back escaped, as text
    r = await sb.run("ln -s g.txt /srv/a/l && ln -s /nowhere /srv/a/dangling && touch \"/srv/a/$(printf 'x\\n\\377')\"")
    assert r.exit_code == 0, r.stderr
    ln = await fs.stat("/srv/a/l")
    assert (ln.kind, ln.target) == ("symlink", "g.txt")
    assert await fs.exists("/srv/a/dangling")
    names = {e.name: e.kind for e in await fs.list("/srv/a")}
    assert names == {"b": "dir", "dangling": "symlink", "g.txt": "file", "l": "symlink", "x\n\\xff": "file"}
    # typed errors
    with pytest.raises(FailedPrecondition, match="not empty"):
        await fs.remove("/srv/a")
    with pytest.raises(FailedPrecondition, match="not a directory"):
        await fs.mkdir("/srv/a/g.txt")
    with pytest.raises(FailedPrecondition, match="not a directory"):
        await fs.list("/srv/a/g.txt")
    with pytest.raises(AlreadyExists):
        await fs.mkdir("/srv/a", parents=False)
    with pytest.raises(NotFound):
        await fs.mkdir("/srv/q/r", parents=False)
    for call in (fs.stat, fs.list, fs.remove):
        with pytest.raises(NotFound):
            await call("/srv/nope")
    with pytest.raises(NotFound):
        await fs.rename("/srv/nope", "/srv/x")
    with pytest.raises(InvalidArgument):
        await fs.list("relative")
    await fs.remove("/srv/a/l")  # the link goes, not its target
    assert await fs.exists("/srv/a/g.txt")
    await fs.remove("/srv/a", recursive=True)
    assert not await fs.exists("/srv/a")
    # a directory larger than one page of the list
    r = await sb.run("mkdir /srv/big && cd /srv/big && seq -f '%04g' 2500 | xargs touch")
    assert r.exit_code == 0, r.stderr
    big = await fs.list("/srv/big")  # three pages
    assert len(big) == 2500 and (big[0].name, big[-1].path) == ("0001", "/srv/big/2500")
    await fs.remove("/srv/big", recursive=True)


async def _fs_cli(work: Workdir) -> None:
    assert (await cli(work, "fs", "mkdir", "-p", f"{BOX}:/cli/x/y"))[0] == 0
    assert (await cli(work, "fs", "mv", f"{BOX}:/cli/x/y", "/cli/z"))[0] == 0
    rc, out, err = await cli(work, "fs", "ls", "--json", f"{BOX}:/cli")
    assert rc == 0, err
    assert [(e["name"], e["kind"]) for e in json.loads(out)] == [("x", "dir"), ("z", "dir")]
    rc, out, _ = await cli(work, "fs", "stat", "--json", f"{BOX}:/cli/z")
    assert rc == 0 and (json.loads(out)["kind"], json.loads(out)["mode"]) == ("dir", 0o755)
    rc, out, _ = await cli(work, "fs", "ls", f"{BOX}:/cli")
    assert rc == 0 and b"drwxr-xr-x" in out and b"z" in out
    rc, _, err = await cli(work, "fs", "rm", f"{BOX}:/cli")
    assert rc == 1 and b"not empty" in err
    assert (await cli(work, "fs", "rm", "-r", f"{BOX}:/cli"))[0] == 0
    assert (await cli(work, "fs", "exists", f"{BOX}:/cli"))[0] == 1
    assert (await cli(work, "fs", "exists", f"{BOX}:/etc/passwd"))[0] == 0


async def _fs_grpc(ours: Any) -> None:
    await in_thread(ours.FsMkdir, sv.FsMkdirRequest(id=BOX, path="/g/d", parents=True, mode=0o700))
    st = await in_thread(ours.FsStat, sv.FsPathRequest(id=BOX, path="/g/d"))
    assert (st.kind, st.mode, st.path) == ("dir", 0o700, "/g/d")
    await in_thread(ours.FsRename, sv.FsRenameRequest(id=BOX, path="/g/d", dest="/g/e"))
    listed = await in_thread(lambda: list(ours.FsList(sv.FsPathRequest(id=BOX, path="/g"))))
    assert [(e.name, e.path) for page in listed for e in page.entries] == [("e", "/g/e")]
    assert (await in_thread(ours.FsExists, sv.FsPathRequest(id=BOX, path="/g/e"))).exists
    code, _ = await status(lambda: ours.FsMkdir(sv.FsMkdirRequest(id=BOX, path="/g/e")))
    assert code == SC.ALREADY_EXISTS
    code, _ = await status(lambda: ours.FsRemove(sv.FsRemoveRequest(id=BOX, path="/g")))
    assert code == SC.FAILED_PRECONDITION
    code, _ = await status(lambda: ours.FsStat(sv.FsPathRequest(id=BOX, path="/g/nope")))
    assert code == SC.NOT_FOUND
    code, _ = await status(lambda: ours.FsList(sv.FsPathRequest(id="no-such-box", path="/")))
    assert code == SC.NOT_FOUND
    await in_thread(ours.FsRemove, sv.FsRemoveRequest(id=BOX, path="/g", recursive=True))
    assert not (await in_thread(ours.FsExists, sv.FsPathRequest(id=BOX, path="/g"))).exists


async def _logs(sb: AsyncSandbox, ours: Any, work: Workdir) -> None:
    r = await sb.run("echo to-out; echo to-err >&2")
    assert r.exit_code == 0
    errs = await sb.logs(sources=["stderr"])
    assert errs and {e.source for e in errs} == {"stderr"} and errs[-1].data == b"to-err\n"
    assert [e.data for e in await sb.logs(sources=["stdout"], tail=1)] == [b"to-out\n"]
    with pytest.raises(InvalidArgument):
        await sb.logs(sources=["bogus"])
    last = (await sb.logs())[-1]  # (of either source: the two pipes' records come in either order)
    # the stream resumes after a cursor, or starts at a time, of the sources asked for
    await sb.run("echo later; echo later-err >&2")
    got = []
    async with aclosing(sb.log_stream(follow=True, cursor=last.seq, sources=["stdout"])) as stream:
        async for e in stream:
            got.append(e)
            break
    assert [(e.source, e.data) for e in got] == [("stdout", b"later\n")]
    async with aclosing(sb.log_stream(follow=False, since=last.timestamp + 1)) as stream:
        since = [e async for e in stream]
    assert {e.data for e in since} == {b"later\n", b"later-err\n"}
    via_grpc = await in_thread(lambda: list(ours.Logs(sv.LogsRequest(id=BOX, sources=["stderr"], tail=1))))
    assert [(e.source, e.data) for e in via_grpc] == [("stderr", b"later-err\n")]
    rc, out, err = await cli(work, "logs", BOX, "--source", "stdout")
    assert rc == 0 and b"later\n" in out and b"later-err" not in out + err


async def _loose_ends(reg: Registry, s: Any, spb: Any, ours: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # WriteFile ending without done, or with data after done: INVALID_ARGUMENT, no file
    def write(*chunks: Any) -> Any:
        opening = spb.WriteFileRequest(open=spb.WriteFileOpen(id=BOX, path="/data/w.txt"))
        return s.WriteFile(iter([opening, *(spb.WriteFileRequest(chunk=c) for c in chunks)]))

    code, why = await status(lambda: write(spb.FileChunk(data=b"partial")))
    assert code == SC.INVALID_ARGUMENT and "done" in why
    code, why = await status(lambda: write(spb.FileChunk(data=b"all", done=True), spb.FileChunk(data=b"more")))
    assert code == SC.INVALID_ARGUMENT and "after" in why
    left = await in_thread(lambda: list(ours.FsList(sv.FsPathRequest(id=BOX, path="/data"))))
    assert [e.name for page in left for e in page.entries if e.name != "lost+found"] == []  # nor a temporary file
    await in_thread(write, spb.FileChunk(data=b"whole", done=True))
    read = await in_thread(lambda: list(s.ReadFile(spb.ReadFileRequest(id=BOX, path="/data/w.txt"))))
    assert b"".join(c.data for c in read) == b"whole"

    # a second Exec init
    init = spb.ExecInput(init=spb.ExecRequest(id=BOX, cmd=["cat"]))
    code, _ = await status(lambda: s.Exec(iter([init, spb.ExecInput(stdin=b"x"), init])))
    assert code == SC.INVALID_ARGUMENT

    # a Run of a missing executable ends as a shell's would: 127, and why on stderr
    out = await in_thread(lambda: list(s.Run(spb.RunRequest(id=BOX, cmd=["no-such-program", "x"]))))
    assert out[0].stream == "stderr" and b"no-such-program" in out[0].data and b"not found" in out[0].data
    assert (out[-1].stream, out[-1].exit_code, out[-1].done) == ("exit", 127, True)
    missing = spb.ExecInput(init=spb.ExecRequest(id=BOX, cmd=["/no/such/program"]))
    out = await in_thread(lambda: list(s.Exec(iter([missing]))))  # so does an Exec's
    assert out[0].stream == "stderr" and (out[-1].exit_code, out[-1].done) == (127, True)

    # an empty hostname is the sandbox id
    out = await in_thread(lambda: list(s.Run(spb.RunRequest(id=BOX, cmd=["hostname"]))))
    assert out[0].data == f"{BOX}\n".encode()

    # a Stop that gives up says so: a workload holds it for its whole timeout, and the
    # grace after it is none here
    monkeypatch.setattr(defaults, "STOP_GRACE", 0.0)
    held = s.Run(spb.RunRequest(id=BOX, cmd=["sleep", "600"]))
    await until(lambda: reg.get(BOX).state == State.RUNNING)
    code, why = await status(lambda: s.Stop(spb.StopSandboxRequest(id=BOX, timeout_seconds=1)))
    assert code == SC.DEADLINE_EXCEEDED and "did not stop" in why
    await until(lambda: reg.get(BOX).state == State.STOPPED)
    await in_thread(drain, held)  # its stream ended with the sandbox
    monkeypatch.undo()

    # DeleteVolume: refused while a sandbox mounts it; force stops that sandbox first
    await in_thread(ours.Start, sv.StartRequest(id=BOX))
    await until(lambda: reg.get(BOX).state == State.READY)
    code, _ = await status(lambda: ours.DeleteVolume(sv.DeleteVolumeRequest(name="vol")))
    assert code == SC.FAILED_PRECONDITION
    await in_thread(ours.DeleteVolume, sv.DeleteVolumeRequest(name="vol", force=True))
    assert reg.get(BOX).state == State.STOPPED and "vol" not in reg.volumes.records
