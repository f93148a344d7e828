"""Workers (imported at the first tree, patch or mount request, never at boot): requests
served by a forked child of guestd, and the work they run."""

from __future__ import annotations

import _signal as signal  # the C module: 'signal' pulls in enum (~20 ms of boot)
import fcntl
import os
import select

from guestd import proto
from guestd.common import DEFAULT_PATH, SIGDEF, ExecFailed, errcode, read_text, set_nonblock
from guestd.session import InStream, OutStream, Req, Session
from guestd.users import resolve_user

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~30 ms of boot

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable
    from typing import Any

    from guestd.agent import Agent

F_SETPIPE_SZ = 1031
BLKFLSBUF = 0x1261
PIPE_SIZE = 1 << 20  # a worker's data pipe: fewer wakeups of both sides per MiB of tar
EPOLLIN = select.EPOLLIN
FSTYPES = ("ext4", "ext3", "ext2", "xfs", "btrfs", "vfat", "squashfs", "erofs", "iso9660")


class Worker(Req):
    """A request served by a forked child of guestd: work that blocks or takes long
    (tar packing and unpacking, patches, mounts) runs outside PID 1's event loop,
    which goes on serving every other request meanwhile. The child is guestd's own
    image (no exec, nothing to load but what the work imports, e.g. tarfile, which
    PID 1 itself never pays for), holding only its pipes::

        guestd (event loop)                          worker (fork, blocking I/O)
          data pipe <-- tar (read_tree) ------------  pack(dir) -> write
          data pipe --- tar (write_tree) ---------->  unpack(read) -> files
          status pipe <-- b"OK\0value" | b"CODE\0message", then exit

    The data streams follow the exec rules: output is read only while the host has
    granted credit (the child blocks in write meanwhile), input is credited back as
    the pipe takes it. The answer (Eof or Ok, or Error) is sent once the child
    exited and its output is drained. A tree worker whose host went away (or
    cancelled it with Signal) is killed; a patch or mount worker finishes its work."""

    def __init__(self, agent: Agent, session: Session, rid: int) -> None:
        super().__init__(session, rid)
        self.agent = agent
        self.pid = 0
        self.status_fd = -1
        self.out: OutStream | None = None  # the child's output, to the host on STDOUT (read_tree)
        # the host's STDIN data, to the child (write_tree); none (fd -1) is credited back
        self.stdin = InStream(self, agent, -1, eof=False, chunk=4 * proto.CHUNK)
        self.status: int | None = None
        self.killable = False
        self.streams_out = False  # success ends the output stream (Eof), else it is an Ok
        self.on_ok: Callable[[int], None] | None = None
        self.done = False

    def start(
        self,
        work: Callable[[int], int],
        *,
        out: bool = False,
        inp: bool = False,
        keep: tuple[int, ...] = (),
        killable: bool = False,
        first: proto.Message | None = None,
    ) -> None:
        fds: list[int] = []
        try:
            status_r, status_w = os.pipe()
            fds += [status_r, status_w]
            child_end = -1
            if out or inp:
                r, w = os.pipe()
                fds += [r, w]
                try:
                    fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_SIZE)
                except OSError:
                    pass
                mine, child_end = (r, w) if out else (w, r)
            pid = os.fork()
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if pid == 0:
            _worker_child(work, child_end, status_w, (*keep, self.agent.root_fd))
        os.close(status_w)
        if child_end >= 0:
            os.close(child_end)
            set_nonblock(mine)
        self.pid, self.status_fd, self.killable = pid, status_r, killable
        self.agent.procs[pid] = self
        assert self.session is not None
        self.session.reqs[self.rid] = self
        if first is not None:
            self.send(first)
        if out:
            self.out = OutStream(self, proto.STDOUT, mine)
            self.streams_out = True
            self.agent.watch(mine, EPOLLIN, self.on_out)
        elif inp:
            self.stdin.fd = mine
            self.stdin.watch()
        self.update()

    # -- output (read_tree) ------------------------------------------------------
    def on_out(self, _ev: int) -> None:
        s = self.out
        if s is None:
            return
        if s.pump() < 0:
            self.agent.unwatch(s.fd)
            os.close(s.fd)
            self.out = None
            self.maybe_finish()
            return
        self.update()

    def on_credit(self, ch: int, n: int) -> None:
        if ch == proto.STDOUT and self.out is not None:
            self.out.add_credit(n)
            self.update()

    # -- input (write_tree) ----------------------------------------------------------
    def on_data(self, ch: int, data: bytes) -> None:
        self.stdin.on_data(ch, data)

    def on_eof(self, ch: int) -> None:
        self.stdin.on_eof()

    # -- life ------------------------------------------------------------------------
    def update(self) -> None:
        if self.out is not None:
            self.agent.modify(self.out.fd, EPOLLIN if self.out.readable() else 0)
        self.stdin.update()

    def resume(self) -> None:
        self.update()

    def on_signal(self, signum: int) -> None:
        self.cancel()

    def cancel(self) -> None:
        """The host gave up on the request (Signal): stop the work, answer nothing."""
        self.orphan()
        self.finish()

    def orphan(self) -> None:
        super().orphan()
        self.stdin.abandon()
        if self.killable and self.status is None and self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        self.update()

    def on_exit(self, status: int) -> None:
        self.status = status
        self.maybe_finish()

    def maybe_finish(self) -> None:
        if self.done or self.status is None or self.out is not None:
            return
        self.done = True
        self.agent.procs.pop(self.pid, None)
        self.stdin.close()
        chunks = []
        while True:  # the child has exited: its end is closed, this cannot block
            b = os.read(self.status_fd, 4096)
            if not b:
                break
            chunks.append(b)
        os.close(self.status_fd)
        self.status_fd = -1
        code, _, text = b"".join(chunks).decode(errors="replace").partition("\0")
        if code == "OK":
            value = int(text or 0)
            if self.on_ok is not None:
                self.on_ok(value)
            if self.streams_out:
                self.send(proto.Eof(rid=self.rid, ch=proto.STDOUT))
            else:
                self.send(proto.Ok(rid=self.rid, value=value))
        elif code:
            self.send(proto.Error(rid=self.rid, code=code, message=text[:2000]))
        else:
            st = self.status
            why = f"signal {os.WTERMSIG(st)}" if os.WIFSIGNALED(st) else f"status {os.WEXITSTATUS(st)}"
            text = f"guestd worker ended without an answer ({why})"
            self.send(proto.Error(rid=self.rid, code=proto.E_INTERNAL, message=text))
        self.finish()


def _tree() -> Any:
    """guestd.tree, imported by PID 1 itself at the first tree request (never at boot).
    In PID 1, not in each worker: the import (tarfile, shutil, re, enum) costs ~250 ms
    under TCG, once per guest this way instead of once per tree request (measured, a
    read_tree of an empty directory: 150-500 ms importing in the worker; a worker
    that imports nothing, an empty patch: 26-59 ms). The price: PID 1's loop stalls
    for that one import, and ~1.5 MB more of its memory."""
    from guestd import tree

    return tree


def _worker_child(work: Callable[[int], int], data_fd: int, status_w: int, keep: tuple[int, ...]) -> None:
    """The forked worker: reset what PID 1 set up for itself, do the work, report, exit."""
    code = 1
    try:
        try:
            signal.set_wakeup_fd(-1)
            for sig in SIGDEF:
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a reader gone is an EPIPE error, not a death
            low = 3
            for fd in sorted({data_fd, status_w, *keep} - {-1}):
                if fd >= low:
                    os.closerange(low, fd)
                    low = fd + 1
            os.closerange(low, 1 << 20)  # (close_range: one system call)
            os.umask(0o022)
            answer = f"OK\0{int(work(data_fd))}"
            code = 0
        except BaseException as exc:
            answer = _describe(exc)
        os.write(status_w, answer.encode(errors="replace")[:4000])  # below PIPE_BUF: one write
    finally:
        os._exit(code)


def _describe(exc: BaseException) -> str:
    c = getattr(exc, "code", None)
    if isinstance(c, str) and isinstance(getattr(exc, "message", None), str):  # tree.TreeError, ExecFailed
        return f"{c}\0{exc.message}"  # type: ignore[attr-defined]
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{errcode(exc)}\0{exc.strerror or exc}{where}"
    if isinstance(exc, LookupError):
        return f"{proto.E_INVALID}\0{exc.args[0] if exc.args else exc}"
    return f"{proto.E_INTERNAL}\0{type(exc).__name__}: {exc}"


# the restricted security profile (guestd/shape.py): writable mounts made from then on
# are nosuid,nodev (tmpfs mounts always are)
RESTRICTED = False
RESTRICTED_OPTS = ",nosuid,nodev"


def busybox_run(root_fd: int, argv: list[str]) -> None:
    """Run a busybox applet of the initramfs (in a worker: this blocks). Its stderr
    becomes the message of a FAILED_PRECONDITION when it fails."""
    r, w = os.pipe()
    try:
        pid = os.posix_spawn(
            f"/proc/self/fd/{root_fd}/usr/bin/busybox",
            ["busybox", *argv],
            {"PATH": DEFAULT_PATH},
            file_actions=[(os.POSIX_SPAWN_DUP2, w, 2), (os.POSIX_SPAWN_DUP2, w, 1)],
            setsigdef=SIGDEF,
        )
    finally:
        os.close(w)
    try:
        out = b""
        while len(out) < 4096:
            b = os.read(r, 4096)
            if not b:
                break
            out += b
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        text = out.decode(errors="replace").strip().replace("\n", "; ") or f"{argv[0]} failed ({status})"
        raise ExecFailed(proto.E_FAILED, text)


def find_disk(device: str) -> str:
    """``/dev/vdX`` or ``serial:NAME`` -> the block device's /dev path."""
    if device.startswith("serial:"):
        want = device[len("serial:") :]
        for name in sorted(os.listdir("/sys/block")):
            if want and read_text(f"/sys/block/{name}/serial").strip() == want:
                return f"/dev/{name}"
        raise ExecFailed(proto.E_NOT_FOUND, f"no disk with serial {want!r}")
    if not device.startswith("/dev/"):
        raise LookupError("device must be a /dev path or serial:NAME")
    return device


def mount_work(root_fd: int, msg: proto.Mount) -> int:
    """In a worker: mount ``msg.device`` at ``msg.path``."""
    import stat

    if msg.fstype == "tmpfs":
        return mount_tmpfs(root_fd, msg)
    if msg.fstype == "virtiofs":
        return mount_virtiofs(root_fd, msg)
    dev = find_disk(msg.device)
    st = os.stat(dev)
    if not stat.S_ISBLK(st.st_mode):
        raise ExecFailed(proto.E_INVALID, f"{dev} is not a block device")
    name = os.path.basename(dev)
    if not msg.read_only and read_text(f"/sys/class/block/{name}/ro").strip() == "1":
        # busybox mount would quietly fall back to a read-only mount
        raise ExecFailed(proto.E_PERM, f"{dev} is attached read-only; mount it read-only")
    if os.path.ismount(msg.path):
        raise ExecFailed(proto.E_EXISTS, f"{msg.path} is a mount point already")
    os.makedirs(msg.path, 0o755, exist_ok=True)
    # A restored snapshot's kernel may hold pages of this device read before the
    # snapshot (another disk then, e.g. a template's placeholder): drop them.
    fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, BLKFLSBUF, 0)
    finally:
        os.close(fd)
    opts = "ro" if msg.read_only else "rw,noatime" + RESTRICTED_OPTS * RESTRICTED
    busybox_run(root_fd, ["mount", "-t", msg.fstype, "-o", opts, dev, msg.path])
    return 0


def mount_tmpfs(root_fd: int, msg: proto.Mount) -> int:
    """In a worker: a tmpfs at ``msg.path``, at most ``msg.size_mib`` (0: the kernel's default)."""
    if os.path.ismount(msg.path):
        raise ExecFailed(proto.E_EXISTS, f"{msg.path} is a mount point already")
    if not 0 <= msg.size_mib <= 1 << 20:
        raise ExecFailed(proto.E_INVALID, f"tmpfs size {msg.size_mib} MiB")
    os.makedirs(msg.path, 0o755, exist_ok=True)
    opts = "nosuid,nodev,mode=1777" + (f",size={msg.size_mib}m" if msg.size_mib else "")
    if msg.read_only:
        opts += ",ro"
    busybox_run(root_fd, ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", msg.path])
    return 0


def mount_virtiofs(root_fd: int, msg: proto.Mount) -> int:
    """In a worker: the virtio-fs share tagged ``msg.device`` at ``msg.path``."""
    if os.path.ismount(msg.path):
        raise ExecFailed(proto.E_EXISTS, f"{msg.path} is a mount point already")
    os.makedirs(msg.path, 0o755, exist_ok=True)
    opts = "ro" if msg.read_only else "rw" + RESTRICTED_OPTS * RESTRICTED
    busybox_run(root_fd, ["mount", "-t", "virtiofs", "-o", opts, msg.device, msg.path])
    return 0


# ---------------------------------------------------------------------------
# the requests served by workers
# ---------------------------------------------------------------------------


def read_tree(agent: Agent, session: Session, msg: proto.ReadTree) -> None:
    if not msg.path.startswith("/"):
        raise LookupError("path must be absolute")
    dfd = os.open(msg.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the path's own symlink is followed
    tree = _tree()

    def work(out_fd: int) -> int:
        return int(tree.pack(dfd, tree.write_fd(out_fd)))

    try:
        Worker(agent, session, msg.rid).start(work, out=True, keep=(dfd,), killable=True, first=proto.Ok(rid=msg.rid))
    finally:
        os.close(dfd)


def write_tree(agent: Agent, session: Session, msg: proto.WriteTree) -> None:
    if not msg.path.startswith("/"):
        raise LookupError("path must be absolute")
    ids = resolve_user(msg.owner)[:2] if msg.owner else None
    created = False
    if not os.path.isdir(msg.path):
        os.makedirs(msg.path, 0o755)  # EEXIST if a file is there
        created = True
    dfd = os.open(msg.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    tree = _tree()

    def work(in_fd: int) -> int:
        return int(tree.unpack(tree.read_fd(in_fd), dfd, owner=ids, root_meta=created))

    try:
        Worker(agent, session, msg.rid).start(work, inp=True, keep=(dfd,), killable=True)
    finally:
        os.close(dfd)


def patch(agent: Agent, session: Session, msg: proto.Patch) -> None:
    if len(msg.entries) > proto.MAX_PATCH_ENTRIES:
        raise LookupError(f"more than {proto.MAX_PATCH_ENTRIES} patch entries")

    def work(_fd: int) -> int:
        from guestd import fsops

        return fsops.apply_patch(msg.entries, lambda spec: resolve_user(spec)[:2], msg.base)

    Worker(agent, session, msg.rid).start(work)


def mount(agent: Agent, session: Session, msg: proto.Mount) -> None:
    if not msg.path.startswith("/") or os.path.normpath(msg.path) == "/":
        raise LookupError("mount path must be absolute and not /")
    if msg.fstype not in (*FSTYPES, "tmpfs", "virtiofs"):
        raise LookupError(f"unsupported file system type {msg.fstype!r}")
    path = os.path.normpath(msg.path)
    w = Worker(agent, session, msg.rid)
    w.on_ok = lambda _v: agent.mounts.append(path)
    w.start(lambda _fd: mount_work(agent.root_fd, msg))


def umount(agent: Agent, session: Session, msg: proto.Umount) -> None:
    path = os.path.normpath(msg.path) if msg.path.startswith("/") else ""
    if not path or not os.path.ismount(path):
        raise LookupError(f"{msg.path} is not a mount point")
    w = Worker(agent, session, msg.rid)

    def forget(_v: int) -> None:
        if path in agent.mounts:
            agent.mounts.remove(path)

    def work(_fd: int) -> int:
        busybox_run(agent.root_fd, ["umount", path])
        return 0

    w.on_ok = forget
    w.start(work)


def fs(agent: Agent, session: Session, msg: proto.Fs) -> None:
    """A file-system operation (see ``proto.Fs``); list and stat answer a msgpack array."""
    from guestd import fsops

    if msg.op not in fsops.FS_OPS:
        raise LookupError(f"op must be one of {', '.join(fsops.FS_OPS)}")
    if not 0 <= msg.mode <= 0o7777:
        raise LookupError("mode must be 0..0o7777")
    if msg.op in ("list", "stat"):

        def answer(out_fd: int) -> int:
            import msgpack

            found = fsops.fs_list(msg.path) if msg.op == "list" else [fsops.fs_stat(msg.path)]
            view = memoryview(msgpack.Packer(use_bin_type=True).pack(found))  # (the runtime's msgpack has no packb)
            while view:
                view = view[os.write(out_fd, view) :]
            return len(found)

        Worker(agent, session, msg.rid).start(answer, out=True, killable=True, first=proto.Ok(rid=msg.rid))
        return

    def work(_fd: int) -> int:
        if msg.op == "mkdir":
            return fsops.fs_mkdir(msg.path, msg.recursive, msg.mode)
        if msg.op == "remove":
            return fsops.fs_remove(msg.path, msg.recursive)
        return fsops.fs_rename(msg.path, msg.dest)

    Worker(agent, session, msg.rid).start(work)
