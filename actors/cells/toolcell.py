"""Host tools on hostile data, each in a cell: e2fsck on a volume a guest
wrote, skopeo on what a registry sends, umoci on its layers, mkfs.ext4 on the tree
they unpack to. The machinery is QEMU's (actors/cells/cell.py, actors/cells/jail.py, the helper
sandvisor-jail-exec, actors/cells/cgroups.py); a tool's cell differs in what it binds and
who it runs as::

    ToolCells (one per supervisor, made by Cells.setup; None with --no-jail or non-root)
      run(argv, binds=..., identity=...)         each run: a jail dir under <dir>/<name>,
        |                                        a cgroup (memory, pids), then jail.spawn:
        v                                        new mnt/pid/ipc/uts/cgroup (+ net) ns,
      the tool, pid 1 of its pid namespace       pivot_root, no_new_privs, rlimits
                                                 (FSIZE: no file over the caller's bound)

    who it runs as
      identity=Identity   an id of the QEMU range (Cells.allocator), no capabilities:
                          e2fsck (the volume by fd, chowned to it for the run), skopeo
                          (its staging dir is the id's)
      identity=None       root of the tools' user namespace: ids 0-65535 there are
                          host ids [first, first + 65536) (``shifted``), just above the
                          QEMU range, checked against passwd/group/subuid like it.
                          umoci (keeps CAP_CHOWN/FOWNER/DAC_OVERRIDE/FSETID/SETFCAP
                          *there*: it makes the image's owners, shifted) and mkfs.ext4
                          -d (reads them back unshifted: the ext4 holds the image's ids)

    network              none (a new, empty netns) unless ``host_network`` (skopeo's
                         pull from a registry: the supervisor's own network namespace)

A bug in a tool then yields an unprivileged id (or root of a user namespace whose ids
own nothing outside its cell) in namespaces of its own, that sees /usr read-only and
the paths it was given. Every run's cell is gone when :meth:`ToolCells.run` returns
(or is cancelled): the process and its cgroup killed, the jail dir removed, the id
released.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import resource
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import attrs
import trio

from actors.cells import jail
from actors.cells.cgroups import Cgroup, CgroupError, CgroupLimits, CgroupManager
from actors.cells.identities import Identity, IdentityAllocator, JailError
from images.tools import SHIFT_COUNT, ToolBind, ToolError, ToolIdentity, ToolResult, bind


class ToolHost(Protocol):
    """What tool cells take of the QEMU cells (actors/cells/cell.py's ``Cells``, which
    makes its ``ToolCells``): the identity range, the cgroup manager, the jail helper."""

    @property
    def allocator(self) -> IdentityAllocator: ...

    @property
    def cgroups(self) -> CgroupManager | None: ...

    @property
    def helper(self) -> Path: ...


log = logging.getLogger("sandvisor.toolcell")

OUTPUT_MAX = 16 << 20  # a tool's stdout or stderr kept (skopeo inspect: a 4 MiB manifest at most)
# what a registry pull reads of the host's /etc (DNS, CAs, containers policy)
NETWORK_ETC = (
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/host.conf",
    "/etc/gai.conf",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/pki",
    "/etc/containers",
)
SCRATCH = "/.sandvisor-tool"  # (a path no bind shares: the socket dir is mounted over what is under it)
ENV = {
    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": SCRATCH,
    "TMPDIR": SCRATCH,
    "LANG": "C.UTF-8",
    "EXT2FS_NO_MTAB_OK": "1",  # e2fsck: no /etc/mtab in a cell (the image is by fd: mounted nowhere)
}


@attrs.frozen
class ToolSpawn:
    """What one run was started as (for tests and logs): host pid, the host uid it runs
    as, whether in the tools' user namespace, its network."""

    name: str
    argv: tuple[str, ...]
    pid: int
    host_uid: int
    userns: bool
    host_network: bool
    keep_caps: tuple[int, ...]
    fsize: int | None


class ToolCells:
    """Runs host tools in cells; one per supervisor (``Cells.tools``). The image store's
    ``images.tools.ToolRunner``."""

    def __init__(
        self,
        cells: ToolHost,
        directory: Path,
        *,
        memory_mib: int = 1024,
        pids: int = 256,
        shift_first: int | None = None,
    ) -> None:
        self.cells = cells
        self.dir = jail.make_root_dir(directory, 0o700)
        self.memory_mib = memory_mib
        self.pids = pids
        first = shift_first if shift_first is not None else cells.allocator.first + cells.allocator.count
        IdentityAllocator(first, SHIFT_COUNT)  # refused if it touches real ids (JailError)
        self.shift_first = first
        self._userns_fd = -1
        self._seq = itertools.count(1)
        self.observers: list[Callable[[ToolSpawn], None]] = []  # called at every spawn
        self._sweep()

    def _sweep(self) -> None:
        """Jail dirs a dead supervisor left (its cgroups go with Cells.sweep)."""
        for d in self.dir.iterdir():
            parts = d.name.split("-")
            if len(parts) > 2 and parts[0] == "tool" and parts[1].isdigit() and int(parts[1]) != os.getpid():
                try:
                    os.kill(int(parts[1]), 0)
                except ProcessLookupError:
                    with contextlib.suppress(JailError):
                        jail.remove_jail(d)
                except PermissionError:
                    pass

    # -- identities --------------------------------------------------------------------
    @contextlib.contextmanager
    def identity(self, owner: str) -> Iterator[Identity]:
        """An id of the QEMU range for one job (a pull's skopeo runs, one e2fsck)."""
        ident = self.cells.allocator.allocate(f"tool {owner}")
        try:
            yield ident
        finally:
            self.cells.allocator.release(ident)

    def shifted(self, ns_id: int) -> int:
        """The host id of ``ns_id`` in the tools' user namespace (0: its root)."""
        if not 0 <= ns_id < SHIFT_COUNT:
            raise ValueError(f"id {ns_id} is outside the tools' user namespace (0-{SHIFT_COUNT - 1})")
        return self.shift_first + ns_id

    def _userns(self) -> int:
        """The tools' user namespace, made once: a child unshares it and is killed once
        we wrote its maps and hold it by a descriptor."""
        if self._userns_fd >= 0:
            return self._userns_fd
        sleep = shutil.which("sleep") or "/bin/sleep"

        def child() -> None:
            jail._check(jail._libc.unshare(jail.CLONE_NEWUSER), "unshare the user namespace")

        try:
            p = subprocess.Popen(
                [sleep, "3600"],
                preexec_fn=child,  # noqa: PLW1509 (one syscall, values computed before the fork)
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise ToolError(f"cannot make the tools' user namespace: {exc}") from None
        try:
            line = f"0 {self.shift_first} {SHIFT_COUNT}\n"
            for f in ("uid_map", "gid_map"):
                with open(f"/proc/{p.pid}/{f}", "w") as fh:
                    fh.write(line)
            self._userns_fd = os.open(f"/proc/{p.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ToolError(f"cannot map the tools' user namespace: {exc}") from None
        finally:
            p.kill()
            p.wait()
        return self._userns_fd

    # -- a run -----------------------------------------------------------------------------
    async def run(
        self,
        argv: Sequence[str],
        *,
        identity: ToolIdentity | None,
        binds: Sequence[ToolBind] = (),
        host_network: bool = False,
        keep_caps: Sequence[int] = (),
        fds: Sequence[int] = (),
        fsize: int | None = None,
        memory_mib: int | None = None,
        full_proc: bool = False,
    ) -> ToolResult:
        """``argv`` in a cell of its own, to its exit: its status and output (each cut at
        16 MiB). ``identity`` None: root of the tools' user namespace (with ``keep_caps``
        there). ``fsize``: no file it writes grows past this (EFBIG; SIGXFSZ is ignored).
        ``full_proc``: /proc with /proc/sys (read-only there: its files are the host's
        root's), for a tool that reads it (virtiofsd: fs/file-max).
        A cancel kills it and removes its cell."""
        name = f"tool-{os.getpid()}-{next(self._seq)}-{uuid.uuid4().hex[:6]}"
        ids = (self.shift_first, self.shift_first) if identity is None else (identity.uid, identity.gid)
        host = Identity(*ids)
        extra = []
        if fsize is not None:
            extra.append((resource.RLIMIT_FSIZE, max(fsize, 1 << 20)))
        spec = jail.JailSpec(
            identity=host,
            root=self.dir / name,
            binds=(
                *jail.default_binds(),
                *(jail.Bind(b.path, str(b.path), b.writable) for b in (*self._etc(host_network), *binds)),
            ),
            socket_dir=SCRATCH,  # the tool's own scratch dir (and HOME): bound last, so not /tmp
            netns=jail.NetNS.HOST if host_network else jail.NetNS.NEW,
            hostname="sandvisor-tool",
            rlimits=jail.Rlimits(nofile=4096, nproc=4096, core=0, extra=tuple(extra)),
            keep_caps=tuple(keep_caps) if identity is None else (),
            proc_subset_pid=not full_proc,
        )
        userns_fd = await trio.to_thread.run_sync(self._userns) if identity is None else -1
        try:
            await trio.to_thread.run_sync(jail.build_jail, spec)
        except (JailError, OSError) as exc:
            raise ToolError(f"{argv[0]}: cannot build its cell: {exc}") from None
        cgroup: Cgroup | None = None
        try:
            if self.cells.cgroups is not None:
                try:
                    cgroup = self.cells.cgroups.create(
                        name, CgroupLimits(memory_bytes=(memory_mib or self.memory_mib) << 20, pids=self.pids)
                    )
                except CgroupError as exc:
                    raise ToolError(f"{argv[0]}: cgroup: {exc}") from None
            return await self._spawn_and_wait(name, argv, spec, identity is None, userns_fd, fds, cgroup, fsize)
        finally:
            with trio.CancelScope(shield=True):
                if cgroup is not None:
                    with contextlib.suppress(CgroupError, OSError):
                        cgroup.kill_all()
                    try:
                        cgroup.remove()
                    except (CgroupError, OSError) as exc:
                        log.warning("tool cell %s: cgroup: %s", name, exc)
                try:
                    await trio.to_thread.run_sync(jail.remove_jail, spec.root)
                except JailError as exc:
                    log.warning("tool cell %s: %s", name, exc)

    def _etc(self, host_network: bool) -> list[ToolBind]:
        if not host_network:
            return []
        return [bind(p) for p in NETWORK_ETC if os.path.exists(p)]

    async def _spawn_and_wait(
        self,
        name: str,
        argv: Sequence[str],
        spec: jail.JailSpec,
        in_userns: bool,
        userns_fd: int,
        fds: Sequence[int],
        cgroup: Cgroup | None,
        fsize: int | None,
    ) -> ToolResult:
        r_out, w_out = os.pipe2(os.O_CLOEXEC)
        try:
            proc = await jail.spawn(
                argv,
                attrs.evolve(spec, identity=Identity(0, 0)) if in_userns else spec,
                pass_fds=tuple(fds),
                cgroup_procs=cgroup.procs_files() if cgroup is not None else (),
                stdout=w_out,
                env=ENV,
                helper=self.cells.helper,
                userns_fd=userns_fd,
            )
        except JailError as exc:
            os.close(r_out)
            raise ToolError(f"cannot start {argv[0]} in its cell: {exc}") from None
        finally:
            os.close(w_out)
        info = ToolSpawn(
            name,
            tuple(argv),
            proc.pid,
            spec.identity.uid,
            in_userns,
            spec.netns is jail.NetNS.HOST,
            spec.keep_caps,
            fsize,
        )
        for observe in self.observers:
            observe(info)
        os.set_blocking(r_out, False)
        out_stream = trio.lowlevel.FdStream(r_out)
        err_stream = proc.stderr
        outs: dict[str, bytes] = {}

        async def drain(key: str, stream: trio.lowlevel.FdStream | None) -> None:
            buf = bytearray()
            if stream is not None:
                async with stream:
                    while chunk := await stream.receive_some(65536):
                        if len(buf) < OUTPUT_MAX:
                            buf += chunk[: OUTPUT_MAX - len(buf)]
            outs[key] = bytes(buf)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain, "out", out_stream)
                nursery.start_soon(drain, "err", err_stream)
                rc = await proc.wait()
        finally:
            if proc.returncode is None:
                with trio.CancelScope(shield=True):
                    with contextlib.suppress(ProcessLookupError, OSError):
                        proc.kill()
                    await proc.wait()
        oom = False
        if cgroup is not None:
            with contextlib.suppress(CgroupError, OSError):
                oom = cgroup.oom_kills() > 0
        if rc < 0 and -rc == signal.SIGKILL and oom:
            outs["err"] = outs.get("err", b"") + f"\n{argv[0]} was killed by its cell's memory limit".encode()
        return ToolResult(rc, outs.get("out", b""), outs.get("err", b""), oom)

    def close(self) -> None:
        if self._userns_fd >= 0:
            os.close(self._userns_fd)
            self._userns_fd = -1


# -- e2fsck ----------------------------------------------------------------------------------


async def fsck_in_cell(tools: ToolCells, path: Path, *, args: Sequence[str] = ("-p",)) -> ToolResult:
    """``e2fsck ARGS /proc/self/fd/N`` on the image at ``path``, in a cell: the image is
    opened here (O_NOFOLLOW, a regular file) and passed as a descriptor; for the run it
    belongs to the cell's id (e2fsck reopens it by that path), then to its owner again.
    RLIMIT_FSIZE is its size: e2fsck cannot grow it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ToolError(f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000 == 0o100000):
            raise ToolError(f"{path} is not a regular file")
        with tools.identity("e2fsck") as ident:
            os.fchown(fd, ident.uid, ident.gid)
            try:
                os.fchmod(fd, 0o600)
                return await tools.run(
                    ["e2fsck", *args, f"/proc/self/fd/{fd}"], identity=ident, fds=(fd,), fsize=st.st_size
                )
            finally:
                os.fchown(fd, st.st_uid, st.st_gid)
                os.fchmod(fd, st.st_mode & 0o7777)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise ToolError(f"{path}: {exc.strerror}") from None
        raise
    finally:
        os.close(fd)


def make_stage(base: Path) -> Path:
    """A staging directory for one tool cell's work under ``base``: ``.stage-PID-RANDOM``
    (0711) holding ``work`` (0700, what the cell binds), made after sweeping those a dead
    supervisor left. The caller owns it and removes it."""
    sweep_stages(base)
    stage = base / f".stage-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    stage.mkdir(mode=0o711)
    (stage / "work").mkdir(mode=0o700)
    return stage


def sweep_stages(base: Path) -> None:
    """The staging directories under ``base`` whose supervisor is gone."""
    if not base.is_dir():
        return
    for p in base.glob(".stage-*"):
        pid = p.name.split("-")[1]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(p, ignore_errors=True)
