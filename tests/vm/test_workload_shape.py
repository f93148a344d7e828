"""The workload shape against real VMs: an OCI image's ENTRYPOINT and CMD as the initial
workload (as the image says, CMD cleared by the CLI, ENTRYPOINT replaced by the sync
SDK), the restricted security profile (no_new_privs, nosuid,nodev) beside an
unrestricted control, the THP policy, the scripts directory on PATH, the stored shell,
and copy patches read on the host. One supervisor in this Trio run; its sandboxes boot
one after another (two cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Generator
from contextlib import aclosing, closing
from pathlib import Path
from typing import cast

import pytest
import trio

from images.build import Image
from images.ocilocal import ImageSpec, Layer, build_image, busybox_tree
from supervisor.client import AsyncSandbox, InvalidArgument, LogEntry, Patch, PermissionDenied, Sandbox
from supervisor.main.throwaway import Workdir, supervisor, workdir

# ENTRYPOINT echoes its arguments: the initial workload's output says what ran
EP_SPEC = ImageSpec(entrypoint=("/bin/echo", "ep"), cmd=("image-cmd",))
# a setuid-root copy of id, run as nobody: "0" when the bit is honoured
SETUID_ID = "cp /usr/bin/id /usr/local/bin/sid && chmod 4755 /usr/local/bin/sid"


async def cli(work: Workdir, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        stdin=stdin,
        env=work.env(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def first_output(sb: AsyncSandbox) -> bytes:
    """What the sandbox's initial workload wrote first (its log, followed until then)."""
    async with aclosing(sb.log_stream(follow=True)) as entries:
        async for e in entries:
            if e.source in ("stdout", "stderr"):
                return e.data
    raise AssertionError("the log ended without output")


async def test_workload_shape(image: Image, tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    layout = tmp_path / "layout"
    old = os.umask(0o022)
    try:
        build_image(layout, "ep", [Layer(busybox_tree(tmp_path / "bb"))], EP_SPEC)
    finally:
        os.umask(old)
    host = tmp_path / "host"
    (host / "tree" / "sub").mkdir(parents=True)
    (host / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (host / "tool.sh").chmod(0o754)
    (host / "tree" / "a.txt").write_text("A\n")
    (host / "tree" / "sub" / "b.txt").write_text("B\n")
    (host / "tree" / "link").symlink_to("a.txt")
    with workdir("sv-shape-") as work:
        with trio.fail_after(900):
            async with supervisor(work, templates=False, allow_paths=(tmp_path,)):
                await _entrypoint_and_cmd(work, f"oci:{layout}:ep")
                await _restricted_and_control(work, host)


async def _entrypoint_and_cmd(work: Workdir, ref: str) -> None:
    sock = str(work.socket)
    sb = await AsyncSandbox.create("as-image", socket=sock, image=ref, detached=True)
    assert await first_output(sb) == b"ep image-cmd\n"
    await sb.remove(force=True)
    # CLI: --no-cmd clears the image's CMD, its ENTRYPOINT runs alone
    r = await cli(work, "create", "no-cmd", "--image", ref, "--no-cmd")
    assert r.returncode == 0, r.stderr
    sb = AsyncSandbox("no-cmd", socket=sock)
    assert await first_output(sb) == b"ep\n"
    await sb.remove(force=True)

    # sync SDK: an entrypoint of its own replaces the image's and drops its CMD
    def sync_create() -> bytes:
        s = Sandbox.create("own-ep", socket=sock, image=ref, entrypoint=["/bin/echo", "override"])
        with s, closing(cast("Generator[LogEntry]", s.log_stream(follow=True))) as entries:
            return next(e.data for e in entries if e.source == "stdout")

    assert await trio.to_thread.run_sync(sync_create) == b"override\n"
    sb = await AsyncSandbox.create("own-ep", socket=sock, image=ref, entrypoint=["/bin/echo", "override"], cmd=["x"])
    assert await first_output(sb) == b"override x\n"
    await sb.remove(force=True)


async def _restricted_and_control(work: Workdir, host: Path) -> None:
    sock = str(work.socket)
    # a copy patch outside serve --allow-path: refused at Create, nothing booted
    with pytest.raises(PermissionDenied):
        await AsyncSandbox.create("out", socket=sock, patches=[Patch.copy_file("/etc/hostname", "/x")])
    with pytest.raises(InvalidArgument):  # a symlink is not a file to copy
        await AsyncSandbox.create("link", socket=sock, patches=[Patch.copy_file(str(host / "tree/link"), "/x")])

    sb = await AsyncSandbox.create(
        "restricted",
        socket=sock,
        security_profile="restricted",
        thp="never",
        log_level="error",
        scripts={"hello": 'echo "hi-$1"'},
        detached=True,
    )
    r = await sb.run("grep NoNewPrivs /proc/self/status")
    assert r.stdout.split() == [b"NoNewPrivs:", b"1"], r
    assert (await sb.run(SETUID_ID)).ok
    r = await sb.run(["/usr/local/bin/sid", "-u"], user="nobody")
    assert r.stdout == b"65534\n", r  # the setuid bit gave nothing
    opts = (await sb.run("awk '$2 == \"/\" {print $4}' /proc/mounts | tail -1")).stdout.decode()
    assert {"nosuid", "nodev"} <= set(opts.strip().split(",")), opts
    assert b"[never]" in (await sb.run("cat /sys/kernel/mm/transparent_hugepage/enabled")).stdout
    assert (await sb.run("hello there")).stdout == b"hi-there\n"  # the scripts directory is on PATH
    async with sb.exec(["sh", "-c", "command -v hello"]) as proc:  # execs too, not only runs
        out = b"".join([o.data async for o in proc if o.stream == "stdout"])
    assert out == b"/.sandvisor/scripts/hello\n"
    await sb.remove(force=True)

    sb = await AsyncSandbox.create(
        "control",
        socket=sock,
        thp="madvise",
        shell="/bin/bash",
        patches=[
            Patch.copy_file(str(host / "tool.sh"), "/usr/local/bin/tool"),
            Patch.copy_dir(str(host / "tree"), "/srv/tree"),
        ],
        detached=True,
    )
    assert (await sb.run("grep NoNewPrivs /proc/self/status")).stdout.split() == [b"NoNewPrivs:", b"0"]
    assert (await sb.run(SETUID_ID)).ok
    assert (await sb.run(["/usr/local/bin/sid", "-u"], user="nobody")).stdout == b"0\n"  # the control: honoured
    assert b"[madvise]" in (await sb.run("cat /sys/kernel/mm/transparent_hugepage/enabled")).stdout
    assert (await sb.run("tool")).stdout == b"tool\n"
    r = await sb.run("stat -c %a /usr/local/bin/tool; cat /srv/tree/a.txt /srv/tree/sub/b.txt; readlink /srv/tree/link")
    assert r.stdout == b"754\nA\nB\na.txt\n", r
    # the stored shell: shell() runs it when the call names none
    assert (await sb.inspect()).shell == "/bin/bash"
    argv = await sb.shell_argv()
    assert argv == ["/bin/bash"]
    rin, win = os.pipe()
    rout, wout = os.pipe()
    os.write(win, b'echo "shell=$0"\nexit 3\n')
    os.close(win)
    try:
        code = await sb.attach(argv, tty=False, stdin_fd=rin, stdout_fd=wout, stderr_fd=wout)
        os.close(wout)
        wout = -1
        assert code == 3
        assert os.read(rout, 4096) == b"shell=/bin/bash\n"
    finally:
        for fd in (rin, rout, wout):
            if fd >= 0:
                os.close(fd)
    # the CLI's shell: the same, on a terminal in the guest
    r = await cli(work, "shell", "control", stdin=b'echo "shell=$0"; exit 3\n')
    assert r.returncode == 3 and b"shell=/bin/bash" in r.stdout, r
    await sb.remove(force=True)
