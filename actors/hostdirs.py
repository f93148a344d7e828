"""Host directories mounted into a sandbox: checked against ``serve
--allow-path``, served by virtiofsd in a cell of its own, fixed at boot.

Why virtio-fs and not virtio-9p: the guest kernel (Debian's cloud kernel) is built
without 9p (``# CONFIG_NET_9P is not set``) and with virtio-fs (``CONFIG_VIRTIO_FS=m``);
QEMU 7.2's own virtiofsd ships in Debian 12 (``/usr/lib/qemu/virtiofsd``, package
qemu-system-common). microvm has no hotplug: the devices are on the command line, so a
sandbox's host directories are fixed when it is created::

    Life._launch (a Boot: a checkpoint of a sandbox with host directories is refused)
      Shares.open: per directory, a listening Unix socket (bound in a 0700 dir, unlinked)
        and our connected end; virtiofsd --fd=N (the listener) in a tool cell:
          root of the tools' user namespace (host ids shift_first + N: it owns nothing
          outside), keeping only the capabilities virtiofsd's request loop needs, a new
          netns, pid ns, cgroup (memory, pids), pivot_root into a root with /usr and the
          directory bound at its own path (read-only unless writable: the kernel
          refuses a write, whatever virtiofsd does), then virtiofsd's own chroot(2)
          into the directory and its seccomp filter
      QEMU gets the connected end (-chardev socket,fd=N; vhost-user-fs-device,tag=hostI)
      guestd mounts tag hostI at the path (ro unless writable) before ready
    teardown: QEMU gone -> virtiofsd sees the connection close and exits (or is
    killed with its cell when the life's scope is cancelled)

Symlinks: virtiofsd resolves every path relative to the directory (O_PATH descriptors,
no following), and is chrooted into it inside a jail holding nothing else: a link to
/etc in the directory is read by the guest as a link, which the guest resolves in its
own file system. Owners: the directory's files are seen through the tools' user
namespace: owners outside it appear as nobody (65534) and virtiofsd can only do what
"others" may (o+r to read; o+w to write); what the guest writes is owned on the host by
the shifted id of the guest's uid (guest root = ``shift_first``). The supervisor does
not change the directory's modes or ACLs: make it readable (or writable) by others, or
grant the shifted range with an ACL (docs/mounts.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import trio

from actors.cells.toolcell import ToolCells
from actors.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from actors.model import HOST_DIR_OPTION_CHARS, HostMount
from actors.settings import Settings
from images.tools import ToolError, bind

log = logging.getLogger("sandvisor.hostdirs")

VIRTIOFSD = Path("/usr/lib/qemu/virtiofsd")
# what virtiofsd keeps (it re-applies this set at start, bounding set included, and
# fails without one of them): CHOWN, DAC_OVERRIDE, FOWNER, FSETID, SETGID, SETUID,
# MKNOD, SETFCAP; and for its start only SYS_CHROOT (its chroot) and SETPCAP (to drop
# the rest of its bounding set) -- all in the tools' user namespace, where they reach
# only files its ids own
VIRTIOFSD_CAPS = (0, 1, 3, 4, 6, 7, 8, 18, 27, 31)
VIRTIOFSD_MEMORY_MIB = 256
TAG_PREFIX = "host"


def tag(i: int) -> str:
    """The virtio-fs tag of a sandbox's ``i``-th host directory."""
    return f"{TAG_PREFIX}{i}"


def check_host_file(what: str, path: str, allowed: tuple[Path, ...]) -> None:
    """A caller's own kernel or rootfs: a regular file, reached through no symlink, in a
    directory the operator allows. Root opens it for QEMU: without these rules a
    Create could hand a guest /etc/shadow or the host's disk."""
    p = Path(path)
    if not p.is_absolute() or ".." in p.parts:
        raise InvalidArgument(f"{what} must be an absolute path without '..'")
    dirs = [d.resolve() for d in allowed]
    if not any(p.is_relative_to(d) for d in dirs):
        where = ", ".join(map(str, dirs)) or "none (serve --allow-path DIR allows one)"
        raise FailedPrecondition(f"{what} {path!r} is not in a directory the supervisor allows; allowed: {where}")
    try:
        st = p.lstat()
    except FileNotFoundError:
        raise NotFound(f"{what} {path!r} is not a file on the supervisor's host") from None
    except OSError as exc:
        raise FailedPrecondition(f"{what} {path!r}: {exc.strerror}") from None
    if os.path.realpath(p) != str(p) or not stat.S_ISREG(st.st_mode):
        raise FailedPrecondition(f"{what} {path!r} must be a regular file reached through no symlink")


def check_host_dir(source: str, allowed: tuple[Path, ...], *, writable: bool = False) -> None:
    """A host directory a Create may mount: inside an ``--allow-path`` directory (else
    PERMISSION_DENIED, said before the path is looked at: no probing outside), there
    (NOT_FOUND), a directory reached through no symlink, that others may read (and
    write, ``writable``) unless it has an ACL (FAILED_PRECONDITION)."""
    if any(c in HOST_DIR_OPTION_CHARS for c in source):  # (a record made before this rule, too)
        raise InvalidArgument(f"host directory {source!r}: ',' and '\\' are not allowed (virtiofsd's option syntax)")
    p = Path(source)
    if not p.is_absolute() or ".." in p.parts:
        raise InvalidArgument(f"host directory {source!r} must be an absolute path without '..'")
    dirs = [d.resolve() for d in allowed]
    if not any(p.is_relative_to(d) for d in dirs):
        where = ", ".join(map(str, dirs)) or "none (serve --allow-path DIR allows one)"
        raise PermissionDenied(
            f"host directory {source!r} is not in a directory the supervisor allows (serve --allow-path): {where}"
        )
    try:
        st = p.lstat()
    except FileNotFoundError:
        raise NotFound(f"host directory {source!r} does not exist on the supervisor's host") from None
    except OSError as exc:
        raise FailedPrecondition(f"host directory {source!r}: {exc.strerror}") from None
    if os.path.realpath(p) != str(p) or not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"host directory {source!r} must be a directory reached through no symlink")
    need = 0o007 if writable else 0o005
    if st.st_mode & need != need and not _has_acl(p):
        what = "readable, writable and searchable" if writable else "readable and searchable"
        raise FailedPrecondition(
            f"host directory {source!r} (mode {stat.S_IMODE(st.st_mode):o}) must be {what} by others: its server "
            "runs as an id that owns nothing there (or grant it with an ACL; docs/mounts.md)"
        )


def _has_acl(p: Path) -> bool:
    try:
        os.getxattr(p, "system.posix_acl_access", follow_symlinks=False)
    except OSError:
        return False
    return True


def servers(settings: Settings) -> ToolCells:
    """The tool cells that serve host directories, or FAILED_PRECONDITION naming why this
    supervisor cannot (checked at Create, before anything is made, and at every boot)."""
    tools = settings.cells.tools if settings.cells is not None else None
    if tools is None:
        raise FailedPrecondition(
            "host directories are served in a cell: they need a supervisor running as root, with its jail"
        )
    if settings.memory_dir is None:
        raise FailedPrecondition("host directories need guest RAM in shared files (serve without anonymous memory)")
    return tools


class Shares:
    """The virtiofsd servers of one life (owned by the Life: :meth:`open` runs them in
    its ``nursery``; the life's teardown cancels that nursery after QEMU is gone)."""

    def __init__(self, mounts: tuple[HostMount, ...], on_exit: Callable[[str], object]) -> None:
        self.mounts = mounts
        self.on_exit = on_exit  # told how a server ended (the sandbox's log)
        self.failure = ""  # why the first server that failed did (said before QEMU can see it)
        self._sockets: list[socket.socket] = []

    async def open(self, tools: ToolCells, nursery: trio.Nursery) -> dict[str, int]:
        """Start one virtiofsd per directory; the connected ends for QEMU, by the
        names :class:`~actors.machines.qemuspec.MachineSpec` reads (``fs0``, ...)."""
        if not VIRTIOFSD.exists():
            raise FailedPrecondition(f"host directories need virtiofsd ({VIRTIOFSD}, Debian's qemu-system-common)")
        fds: dict[str, int] = {}
        for i, m in enumerate(self.mounts):
            listener, client = _socket_pair()
            self._sockets += [listener, client]
            fds[f"fs{i}"] = client.fileno()
            await nursery.start(self._serve, tools, i, m, listener)
        return fds

    async def _serve(
        self,
        tools: ToolCells,
        i: int,
        m: HostMount,
        listener: socket.socket,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        argv = [
            str(VIRTIOFSD),
            f"--fd={listener.fileno()}",
            "-f",  # foreground: it is the cell's process
            "--rlimit-nofile=0",  # the cell's limit (raising it needs a capability it has not)
            "--thread-pool-size=4",
            "-o",
            f"source={m.source}",
            "-o",
            "sandbox=chroot",  # the cell made its namespaces already
            "-o",
            "cache=auto",
            "-o",
            "log_level=err",
        ]
        task_status.started()  # the listener queues QEMU's connection until virtiofsd accepts it
        why = ""
        try:
            r = await tools.run(
                argv,
                identity=None,
                binds=(bind(m.source, writable=m.writable),),
                keep_caps=VIRTIOFSD_CAPS,
                fds=(listener.fileno(),),
                memory_mib=VIRTIOFSD_MEMORY_MIB,
                full_proc=True,  # virtiofsd reads /proc/sys/fs/file-max at start, whatever its flags
            )
            if r.returncode != 0:
                err = r.stderr.decode(errors="replace").strip().replace("\n", "; ")[-500:]
                why = f"host directory {m.source}: virtiofsd exited with {r.returncode}: {err}"
        except ToolError as exc:
            why = f"host directory {m.source}: its server did not start: {exc}"
        finally:
            if why:
                self.failure = self.failure or why
                self.on_exit(why)
            # our copy of the listener is the last: QEMU's connection, if virtiofsd never
            # took it, is reset now (QEMU fails at once instead of waiting for a server)
            listener.close()

    def close(self) -> None:
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()
        self._sockets = []


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    """A listening Unix socket (for virtiofsd's ``--fd``) and our end connected to it:
    bound in a private directory and unlinked at once, so nothing else connects."""
    d = tempfile.mkdtemp(prefix="sandvisor-fs-")  # 0700, root's
    path = os.path.join(d, "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(1)
        client.connect(path)
    except OSError:
        listener.close()
        client.close()
        raise
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return listener, client
