"""Patches: files, directories and links written into the guest in order (``patch``).

Imported by the forked worker that serves a patch request (never at boot; unlike
:mod:`guestd.tree` it needs nothing beyond ``os``). Paths are the user's: symlinks
in a path's parents are followed (``/bin`` may be a link to ``usr/bin``), the last
component never is: a file or a link is written under a temporary name and renamed
over what was there, a directory is removed by descriptors.
"""

from __future__ import annotations

import errno
import os
import stat

from guestd import proto

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TreeError(Exception):
    """A tree or patch operation refused or failed: ``code`` is a proto E_* code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


PATCH_OPS = ("file", "append", "mkdir", "remove", "symlink")


def _field(entry: dict[str, object], key: str, kind: type, default: object) -> object:
    value = entry.get(key, default)
    if type(value) is not kind:
        raise TreeError(proto.E_INVALID, f"{key} must be {kind.__name__}")
    return value


def rmtree_at(pfd: int, name: str) -> None:
    """``rm -r`` of the directory ``name`` in ``pfd``, by descriptors (symlinks are unlinked, not followed)."""
    fd = os.open(name, DIR_FLAGS, dir_fd=pfd)
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if is_dir:
                rmtree_at(fd, child)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=pfd)


def apply_patch(entries: list[dict[str, object]], resolve: Callable[[str], tuple[int, int]], base: int = 0) -> int:
    """Apply ``entries`` in order (see ``proto.Patch``); ``resolve`` maps an owner spec
    to (uid, gid). Returns how many were applied; the first failure raises TreeError
    naming its entry."""
    if len(entries) > proto.MAX_PATCH_ENTRIES:
        raise TreeError(proto.E_INVALID, f"more than {proto.MAX_PATCH_ENTRIES} patch entries")
    for i, entry in enumerate(entries):
        path = entry.get("path")
        what = f"entry {base + i} ({str(path)[:200]})"
        try:
            _patch_one(entry, resolve)
        except TreeError as exc:
            raise TreeError(exc.code, f"{what}: {exc.message}") from None
        except LookupError as exc:
            raise TreeError(proto.E_INVALID, f"{what}: {exc.args[0] if exc.args else exc}") from None
        except OSError as exc:
            raise TreeError(proto.errcode(exc), f"{what}: {exc.strerror or exc}") from None
    return len(entries)


def _patch_one(entry: dict[str, object], resolve: Callable[[str], tuple[int, int]]) -> None:
    op = _field(entry, "op", str, "")
    path = _field(entry, "path", str, "")
    data = _field(entry, "data", bytes, b"")
    target = _field(entry, "target", str, "")
    mode = _field(entry, "mode", int, -1)
    owner_spec = _field(entry, "owner", str, "")
    replace = _field(entry, "replace", bool, False)
    assert isinstance(path, str) and isinstance(mode, int) and isinstance(data, bytes) and isinstance(target, str)
    if op not in PATCH_OPS:
        raise TreeError(proto.E_INVALID, f"op must be one of {', '.join(PATCH_OPS)}")
    if not path.startswith("/") or "\0" in path:
        raise TreeError(proto.E_INVALID, "path must be absolute")
    if mode < -1 or mode > 0o7777:
        raise TreeError(proto.E_INVALID, "mode must be -1 or 0..0o7777")
    path = os.path.normpath(path)
    if path in ("/", "//"):
        raise TreeError(proto.E_INVALID, "the root directory cannot be patched")
    ids = resolve(owner_spec) if isinstance(owner_spec, str) and owner_spec else None
    parent, leaf = os.path.split(path)
    if op != "remove":
        os.makedirs(parent, 0o755, exist_ok=True)
    try:
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if op == "remove":
            return
        raise
    try:
        try:
            st: os.stat_result | None = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        is_dir = st is not None and stat.S_ISDIR(st.st_mode)
        if op == "remove":
            if st is None:
                return
            if is_dir:
                rmtree_at(pfd, leaf)
            else:
                os.unlink(leaf, dir_fd=pfd)
        elif op == "mkdir":
            if st is not None and not is_dir:
                raise TreeError(proto.E_EXISTS, "exists and is not a directory")
            if st is None:
                os.mkdir(leaf, 0o755, dir_fd=pfd)
            fd = os.open(leaf, DIR_FLAGS, dir_fd=pfd)
            try:
                if ids is not None:
                    os.fchown(fd, *ids)
                if mode >= 0 or st is None:
                    os.fchmod(fd, 0o755 if mode < 0 else mode)
            finally:
                os.close(fd)
        elif op in ("file", "symlink"):
            if is_dir:
                raise TreeError(proto.E_IS_DIR, "a directory is in the way")
            if st is not None and not replace:
                raise TreeError(proto.E_EXISTS, "exists (replace is false)")
            tmp = f".sandvisor-patch.{os.getpid()}"
            try:
                os.unlink(tmp, dir_fd=pfd)
            except FileNotFoundError:
                pass
            if op == "symlink":
                if not target:
                    raise TreeError(proto.E_INVALID, "a symlink needs a target")
                os.symlink(target, tmp, dir_fd=pfd)
                if ids is not None:
                    os.chown(tmp, *ids, dir_fd=pfd, follow_symlinks=False)
            else:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(tmp, flags, 0o600, dir_fd=pfd)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    if ids is not None:
                        os.fchown(fd, *ids)
                    os.fchmod(fd, 0o644 if mode < 0 else mode)
                finally:
                    os.close(fd)
            try:
                os.rename(tmp, leaf, src_dir_fd=pfd, dst_dir_fd=pfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=pfd)
                except OSError:
                    pass
                raise
        else:  # append
            if is_dir:
                raise TreeError(proto.E_IS_DIR, "a directory is in the way")
            fd = os.open(leaf, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=pfd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise TreeError(proto.E_INVALID, "not a regular file")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if ids is not None:
                    os.fchown(fd, *ids)
                if mode >= 0 or st is None:
                    os.fchmod(fd, 0o644 if mode < 0 else mode)
            finally:
                os.close(fd)
    finally:
        os.close(pfd)


# ---------------------------------------------------------------------------
# fs requests (list, stat, mkdir, remove, rename): run in a forked worker
# ---------------------------------------------------------------------------
FS_OPS = ("list", "stat", "mkdir", "remove", "rename")
_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}


def _entry(name: str, st: os.stat_result, target: str) -> list[object]:
    """One entry of a list or stat answer: [name, kind, size, mode, uid, gid, mtime_ns, target]."""
    kind = _KINDS.get(stat.S_IFMT(st.st_mode), "other")
    name, target = _text(name)[:4096], _text(target)[:4096]
    return [name, kind, st.st_size, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns, target]


def _text(name: str) -> str:
    """A name as text the host can carry (bytes that are not UTF-8 as escapes)."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _link_target(name: str, dir_fd: int | None, st: os.stat_result) -> str:
    if not stat.S_ISLNK(st.st_mode):
        return ""
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return ""


def _checked(path: str) -> str:
    if not path.startswith("/") or "\0" in path:
        raise TreeError(proto.E_INVALID, "path must be absolute")
    path = os.path.normpath(path)
    return "/" + path.lstrip("/")  # (normpath keeps a leading "//")


def fs_list(path: str) -> list[list[object]]:
    """The entries of the directory ``path`` (its own symlink followed, as ``ls``
    does), by name; each entry's own symlink is not followed."""
    path = _checked(path)
    try:  # (O_DIRECTORY: never open a FIFO or a device)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except NotADirectoryError:
        if os.path.exists(path):
            raise TreeError(proto.E_FAILED, f"{path} is not a directory") from None
        raise
    try:
        out: list[list[object]] = []
        size = 0
        with os.scandir(fd) as it:
            for e in it:
                if len(out) >= proto.MAX_FS_LIST:
                    raise TreeError(proto.E_TOO_LARGE, f"{path} holds more than {proto.MAX_FS_LIST} entries")
                try:
                    st = os.stat(e.name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed meanwhile
                entry = _entry(e.name, st, _link_target(e.name, fd, st))
                size += 4 * (len(str(entry[0])) + len(str(entry[7]))) + 64  # (at most: 4 UTF-8 bytes a character)
                if size > proto.MAX_FS_ANSWER:
                    raise TreeError(proto.E_TOO_LARGE, f"the entries of {path} exceed {proto.MAX_FS_ANSWER} bytes")
                out.append(entry)
    finally:
        os.close(fd)
    out.sort(key=lambda x: str(x[0]))
    return out


def fs_stat(path: str) -> list[object]:
    """``path`` itself (a symlink is reported as one, not followed)."""
    path = _checked(path)
    st = os.stat(path, follow_symlinks=False)
    return _entry(path, st, _link_target(path, None, st))


def fs_mkdir(path: str, parents: bool, mode: int) -> int:
    """``mkdir [-p] path``: made (1), or there already with ``parents`` (0)."""
    path = _checked(path)
    if path == "/":
        if parents:
            return 0
        raise TreeError(proto.E_EXISTS, "/ exists")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise TreeError(proto.E_FAILED, f"a parent of {path} is not a directory") from None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise TreeError(proto.E_FAILED, f"{path} exists and is not a directory")
        if parents:
            return 0
        raise TreeError(proto.E_EXISTS, f"{path} exists")
    parent = os.path.dirname(path)
    if parents:
        try:
            os.makedirs(parent, 0o755, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise TreeError(proto.E_FAILED, f"a parent of {path} is not a directory") from None
    elif not os.path.isdir(parent):
        if os.path.lexists(parent):
            raise TreeError(proto.E_FAILED, f"{parent} is not a directory")
        raise TreeError(proto.E_NOT_FOUND, f"{parent} does not exist (parents is false)")
    os.mkdir(path, mode)
    os.chmod(path, mode)  # (not the umask's)
    return 1


def fs_remove(path: str, recursive: bool) -> int:
    """``rm [-r] path``: a file, a link (never followed) or an empty directory; a
    non-empty one only with ``recursive``."""
    path = _checked(path)
    if path == "/":
        raise TreeError(proto.E_INVALID, "the root directory cannot be removed")
    parent, leaf = os.path.split(path)
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(leaf, dir_fd=pfd)
        elif recursive:
            rmtree_at(pfd, leaf)
        else:
            try:
                os.rmdir(leaf, dir_fd=pfd)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise TreeError(proto.E_FAILED, f"{path} is not empty (recursive is false)") from None
                raise
    finally:
        os.close(pfd)
    return 1


def fs_rename(src: str, dest: str) -> int:
    """``mv src dest`` on one file system (the last component of either is not followed)."""
    src, dest = _checked(src), _checked(dest)
    if "/" in (src, dest):
        raise TreeError(proto.E_INVALID, "the root directory cannot be renamed")
    try:
        os.rename(src, dest)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise TreeError(proto.E_FAILED, f"{dest} is a directory that is not empty") from None
        if exc.errno == errno.EXDEV:
            raise TreeError(proto.E_FAILED, f"{src} and {dest} are on different file systems") from None
        if exc.errno == errno.EINVAL:
            raise TreeError(proto.E_INVALID, f"cannot move {src} into itself") from None
        if exc.errno in (errno.EISDIR, errno.ENOTDIR) and os.path.lexists(src) and os.path.lexists(dest):
            raise TreeError(proto.E_FAILED, f"{dest} is in the way: a directory and a non-directory") from None
        raise
    return 1
