"""Build the default guest image: kernel, guest runtime (initramfs with guestd) and rootfs.

Every part is content-keyed: its key hashes the recipe (this file, the init script,
guestd's sources) and the exact Debian package versions it is made of, so a second
build with nothing changed does nothing and says so, and a change rebuilds only the
parts it touches. Parts are built in a temporary directory beside the cache and
renamed into place when complete, so an interrupted build never leaves a half part.

Layout of the image cache (``<state>/images``)::

    kernel-<key>/vmlinux  vmlinuz  config  modules/<name>.ko  (from linux-image-*-cloud-amd64)
    runtime-<key>/initrd.cpio                                (busybox, python3.11, msgpack, guestd)
    rootfs-<key>/rootfs.ext4                                 (Debian minbase + python3, read-only base)
    default.json                                             (the manifest: which parts make "default")
    debs/<package>_<version>_<arch>.deb                      (what kernel and runtime were made of, kept)

Only Debian's packages are used, fetched with apt (``apt-get download`` and
mmdebstrap over the host's apt sources); never the host's own kernel or files.

Modes: the parts are public (Debian's bits and guestd), and a jailed QEMU, another
uid, opens the kernel and initrd itself (``-kernel /proc/self/fd/N`` is a new open,
checked against the file's mode), so they must be readable by all whoever builds
them: a build runs under umask 022 whatever its caller's (``serve`` runs under 077),
which also gives the initramfs and rootfs trees the modes of an ordinary build, and
each published part gets its modes explicitly (directories 0755, files 0644, the
read-only rootfs 0444), a cached one too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

HERE = Path(__file__).resolve().parent
GUESTD = HERE.parent / "guestd"
KERNEL_META = "linux-image-cloud-amd64"
RUNTIME_PACKAGES = (
    "libc6",
    "libgcc-s1",
    "zlib1g",
    "libexpat1",
    "python3.11-minimal",
    "libpython3.11-minimal",
    "python3-msgpack",
    "busybox-static",
)
# from the full stdlib package, only what guestd imports beyond python3.11-minimal:
# tarfile (and shutil, which it imports) for read_tree/write_tree, imported only by the
# worker guestd forks for one of those (termios went: guestd has the two ioctl numbers)
STDLIB_PACKAGE = "libpython3.11-stdlib"
STDLIB_PICK: tuple[str, ...] = ("tarfile.py", "shutil.py")
# shared libraries python3.11 and msgpack link against (the rest of libc6 goes)
RUNTIME_LIBS = ("ld-linux-x86-64.so", "libc.so", "libm.so", "libz.so", "libexpat.so.1", "libgcc_s.so")
# imported by guestd after boot, on paths not taken at import time
LAZY_IMPORTS = (
    "socket",
    "traceback",
    "tarfile",
    "guestd.files",
    "guestd.workers",
    "guestd.tree",
    "guestd.tarformat",
    "guestd.fsops",
    "guestd.netcfg",
    "guestd.trust",
    "guestd.initsys",
)
ROOTFS_INCLUDE = ("python3", "bash", "coreutils", "procps", "ca-certificates", "curl")
ROOTFS_SIZE_MIB = 2048  # the ext4 file is sparse: this is room for the sandbox, not disk use
MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_console",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    "vsock",
    "vmw_vsock_virtio_transport_common",
    "vmw_vsock_virtio_transport",
    "vsock_loopback",
    "virtio_balloon",  # loaded by guestd after the first hello (free page reporting)
    "fuse",
    "virtiofs",  # host directories (docs/mounts.md): loaded by /init when the device is there
)
# runtime trimming: what guestd never touches
_RUNTIME_DROP = (
    "usr/share",
    "usr/lib/x86_64-linux-gnu/gconv",
    "usr/lib/python3.11/email",
    "usr/lib/python3.11/importlib/metadata",
    "usr/lib/python3.11/pydoc_data",
    "usr/lib/python3.11/ensurepip",
    "usr/lib/python3.11/unittest",
    "usr/lib/python3.11/test",
    "etc",
    "var",
)


class BuildError(Exception):
    """The image could not be built; the message says which step and why."""


@attrs.frozen
class Image:
    """A built image: the three paths a sandbox boots from."""

    name: str
    kernel: Path  # uncompressed vmlinux (PVH direct boot)
    kernel_bz: Path  # the package's bzImage, for -M pc and other loaders
    initrd: Path
    rootfs: Path
    kernel_version: str
    keys: dict[str, str]

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kernel": str(self.kernel),
            "kernel_bz": str(self.kernel_bz),
            "initrd": str(self.initrd),
            "rootfs": str(self.rootfs),
            "kernel_version": self.kernel_version,
            "keys": self.keys,
        }

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Image:
        return cls(
            name=str(d["name"]),
            kernel=Path(str(d["kernel"])),
            kernel_bz=Path(str(d["kernel_bz"])),
            initrd=Path(str(d["initrd"])),
            rootfs=Path(str(d["rootfs"])),
            kernel_version=str(d["kernel_version"]),
            keys={str(k): str(v) for k, v in dict(d["keys"]).items()},  # type: ignore[call-overload]
        )

    def exists(self) -> bool:
        return all(p.exists() for p in (self.kernel, self.kernel_bz, self.initrd, self.rootfs))

    def readable(self) -> bool:
        """Every part readable by all (what a jailed QEMU, another uid, needs)."""
        return all(p.stat().st_mode & stat.S_IROTH for p in (self.kernel, self.kernel_bz, self.initrd, self.rootfs))


Progress = Callable[[str, str], None]  # (part, message)


def _quiet(_part: str, _msg: str) -> None: ...


def run(argv: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    try:
        p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise BuildError(f"{argv[0]} is not installed (run the README's set-up command)") from None
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        raise BuildError(f"{' '.join(argv[:3])}... failed ({p.returncode}): " + " | ".join(tail))
    return p.stdout


def candidates(pkgs: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """The versions apt would install of ``pkgs`` (one apt-cache call; lists must be present)."""
    out = run(["apt-cache", "policy", *pkgs])
    found = dict(re.findall(r"^(\S+):\n\s+Installed:.*\n\s+Candidate:\s*(\S+)", out, re.M))
    result = []
    for pkg in pkgs:
        ver = found.get(pkg)
        if not ver or ver == "(none)":
            raise BuildError(f"apt knows no candidate for {pkg}; run 'apt-get update'")
        result.append((pkg, ver))
    return result


def kernel_package() -> str:
    out = run(["apt-cache", "depends", KERNEL_META])
    m = re.search(r"Depends:\s*(linux-image-\S+-cloud-amd64)\b", out)
    if not m:
        raise BuildError(f"cannot resolve {KERNEL_META} to a kernel package")
    return m.group(1)


def digest(*parts: object) -> str:
    """A cache part's key: its recipe's values and the contents of the files named."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, Path):
            h.update(p.read_bytes())
        else:
            h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def guestd_sources() -> list[Path]:
    return sorted(p for p in GUESTD.glob("*.py"))


def default_state_dir() -> Path:
    """``SANDVISOR_STATE_DIR``, else /var/lib/sandvisor for root, else ~/.local/share/sandvisor.
    (Here, the lowest layer that needs it: the image cache lives in the state dir.)"""
    env = os.environ.get("SANDVISOR_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/sandvisor")
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "sandvisor"


def default_cache() -> Path:
    return default_state_dir() / "images"


@contextmanager
def staging(cache: Path, name: str) -> Iterator[Path]:
    """A scratch directory in the cache for a part being built (gone at the end)."""
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


BUILD_UMASK = 0o022  # what the build and the tools it runs create is readable by all
PART_FILE_MODE, PART_DIR_MODE = 0o644, 0o755


@contextmanager
def build_umask() -> Iterator[None]:
    old = os.umask(BUILD_UMASK)
    try:
        yield
    finally:
        os.umask(old)


def public_modes(part: Path) -> None:
    """A part's directory and everything in it readable by all, written by its owner
    alone: directories 0755, files 0644, a file without its owner's write bit (the
    rootfs) 0444. Explicit, whatever the umask it was made under; a mode that is right
    already is left alone (a cache someone else owns stays usable)."""

    def chmod(path: str, want: int) -> None:
        st = os.lstat(path)
        if stat.S_IMODE(st.st_mode) != want and not stat.S_ISLNK(st.st_mode):
            os.chmod(path, want)

    for d, _dirs, files in os.walk(part):
        chmod(d, PART_DIR_MODE)
        for name in files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                chmod(p, PART_FILE_MODE if st.st_mode & stat.S_IWUSR else PART_FILE_MODE & ~0o222)


def publish(tmp: Path, final: Path) -> None:
    public_modes(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


DEBS = "debs"  # the cache's downloaded packages, kept: a rebuild downloads none of them again


def deb_glob(pkg: str, ver: str) -> str:
    """The name apt-get download gives ``pkg`` at ``ver`` (any architecture)."""
    return f"{pkg}_{ver.replace(':', '%3a')}_*.deb"


def _link(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy(src, dest)


def _download(versions: list[tuple[str, str]], dest: Path, kept: Path) -> list[Path]:
    """The .deb of each (package, version) in ``dest``: linked from ``kept`` when it is
    there, else fetched with apt-get download (and kept)."""
    dest.mkdir(parents=True, exist_ok=True)
    kept.mkdir(exist_ok=True)
    missing = []
    for pkg, ver in versions:
        found = sorted(kept.glob(deb_glob(pkg, ver)))
        if found:
            _link(found[0], dest / found[0].name)
        else:
            missing.append((pkg, ver))
    if missing:
        run(["apt-get", "download", "-q", *(f"{pkg}={ver}" for pkg, ver in missing)], cwd=dest)
        for pkg, ver in missing:
            for deb in dest.glob(deb_glob(pkg, ver)):
                with contextlib.suppress(FileExistsError):
                    _link(deb, kept / deb.name)
    debs = sorted(dest.glob("*.deb"))
    if len(debs) < len(versions):
        raise BuildError(f"apt-get download gave {len(debs)} packages for {len(versions)}")
    return debs


BOOT_PY = """\
import sys
sys.path[:0] = ['/sandvisor', '/usr/lib/python3/dist-packages']
# msgpack's C extension imports the datetime C API; datetime.py defines a pure-Python
# implementation and then replaces it with the C one (_datetime). Importing the C one
# directly: ~25 ms less boot.
import _datetime
sys.modules['datetime'] = _datetime
# msgpack/__init__ imports msgpack.ext, whose ExtType is a collections.namedtuple:
# collections plus a class compiled from source at import, ~50 ms of boot under TCG
# (measured with -X importtime). guestd needs only Packer and unpackb of the C
# extension, and no ext types (the protocol has none: decode() refuses them). So the
# package is a bare module here and msgpack.ext a two-class stand-in the extension
# can import; an ext type on the wire still decodes to an ExtType, which proto then
# rejects by type, and a timestamp ext raises, which proto reports as undecodable.
_m = type(sys)('msgpack')
_m.__path__ = ['/usr/lib/python3/dist-packages/msgpack']
_e = type(sys)('msgpack.ext')
class ExtType:
    __slots__ = ('code', 'data')
    def __init__(self, code, data):
        self.code, self.data = code, data
class Timestamp:
    __slots__ = ()
    @staticmethod
    def from_bytes(b):
        raise ValueError('timestamp ext types are not part of the guest protocol')
_e.ExtType, _e.Timestamp = ExtType, Timestamp
sys.modules['msgpack'], sys.modules['msgpack.ext'] = _m, _e
from msgpack._cmsgpack import Packer, unpackb, Unpacker
_m.Packer, _m.unpackb, _m.Unpacker, _m.ext = Packer, unpackb, Unpacker, _e
del _m, _e, ExtType, Timestamp, Packer, unpackb, Unpacker
# every guestd module starts with `from __future__ import annotations`, which at run
# time imports __future__ (a module of _Feature objects) to bind that one name: a
# stand-in spares boot the module's load (nothing guestd imports reads its features)
_f = type(sys)('__future__')
_f.annotations = None
sys.modules['__future__'] = _f
del _f
from guestd.agent import entry
entry()
"""

# mounted by /init with one `mount -a` each (a process per mount costs ~10 ms under TCG)
FSTAB_EARLY = "sys /sys sysfs defaults 0 0\ndev /dev devtmpfs defaults 0 0\n"
_FSTAB_USER = (
    "proc {r}/proc proc defaults 0 0\n"
    "sys {r}/sys sysfs defaults 0 0\n"
    "dev {r}/dev devtmpfs defaults 0 0\n"
    "devpts {r}/dev/pts devpts gid=5,mode=620,ptmxmode=0666 0 0\n"
    "shm {r}/dev/shm tmpfs mode=1777,nosuid,nodev 0 0\n"
    "tmp {r}/tmp tmpfs mode=1777,nosuid,nodev 0 0\n"
    "run {r}/run tmpfs mode=755,nosuid,nodev 0 0\n"
)


def write_fstabs(etc: Path) -> None:
    (etc / "fstab.early").write_text(FSTAB_EARLY)
    (etc / "fstab.sysroot").write_text(_FSTAB_USER.format(r="/sysroot"))
    # without a disk the runtime itself is the root: proc, sys and dev are mounted already
    (etc / "fstab.initramfs").write_text("".join(_FSTAB_USER.format(r="").splitlines(True)[3:]))


# the trailer the kernel's sign-file appends to a signed module (include/linux/module_signature.h)
MODULE_SIG_MAGIC = b"~Module signature appended~\n"


def strip_module(src: Path, dest: Path) -> None:
    """``src`` without its signature and its BTF, at ``dest``: what the guest kernel spends
    loading it under TCG, not what it runs. Debian signs every module (SHA-256 over the
    file, an RSA check) and ships its BTF, which the kernel parses and validates at load;
    the cloud kernel does not enforce signatures (MODULE_SIG_FORCE off, no lockdown
    outside EFI Secure Boot), so an unsigned module loads, marking the kernel tainted
    (``E``). Nothing here is a trust boundary: guest root can load modules anyway; QEMU
    is the boundary. Measured: docs/results/boot.md."""
    run(["objcopy", "--remove-section=.BTF", "--remove-section=.BTF.ext", str(src), str(dest)])
    data = dest.read_bytes()
    if data.endswith(MODULE_SIG_MAGIC):  # (objcopy drops appended bytes; this is the guard)
        sig_len = int.from_bytes(data[-len(MODULE_SIG_MAGIC) - 4 : -len(MODULE_SIG_MAGIC)], "big")
        dest.write_bytes(data[: -len(MODULE_SIG_MAGIC) - 12 - sig_len])
    if dest.read_bytes()[:4] != b"\x7fELF":
        raise BuildError(f"stripping module {src.name} left no ELF")


def install_modules(src: Path, moddir: Path) -> None:
    """Copy the modules (signature and BTF stripped) and write modules.dep (from each
    module's own depends=), so one busybox modprobe loads a driver with its dependencies."""
    deps: dict[str, list[str]] = {}
    for ko in sorted(src.glob("*.ko")):
        strip_module(ko, moddir / ko.name)
        m = re.search(rb"depends=([\w,-]*)", ko.read_bytes())
        deps[ko.stem] = [d for d in (m.group(1).decode().split(",") if m else []) if d]
    lines = []
    for name, ds in deps.items():
        missing = [d for d in ds if d not in deps]
        if missing:
            raise BuildError(f"module {name} needs {missing}, which the image does not carry")
        lines.append(f"{name}.ko: " + " ".join(f"{d}.ko" for d in _dep_closure(name, deps)))
    (moddir / "modules.dep").write_text("\n".join(lines) + "\n")


def _dep_closure(name: str, deps: dict[str, list[str]]) -> list[str]:
    """All dependencies of ``name``, the ones to load last first (modules.dep order)."""
    seen: list[str] = []

    def visit(n: str) -> None:
        for d in deps[n]:
            visit(d)
            if d not in seen:
                seen.append(d)

    visit(name)
    return list(reversed(seen))


def extract_vmlinux(bzimage: Path, out: Path) -> None:
    """The uncompressed ELF vmlinux from an LZ4 bzImage (for PVH direct boot)."""
    data = bzimage.read_bytes()
    i = data.find(b"\x02\x21\x4c\x18")  # LZ4 legacy frame magic
    if i < 0:
        raise BuildError("kernel is not LZ4-compressed; cannot extract vmlinux")
    with open(out, "wb") as f:
        p = subprocess.run(["lz4", "-dc"], input=data[i:], stdout=f, stderr=subprocess.PIPE, check=False)
    # lz4 exits 1 on the bzImage's trailing bytes after the frame; the ELF is whole by then
    if out.read_bytes()[:4] != b"\x7fELF":
        raise BuildError(f"vmlinux extraction failed: {p.stderr.decode(errors='replace')[-200:]}")


@attrs.define
class Builder:
    cache: Path
    progress: Progress = _quiet
    built: list[str] = attrs.field(factory=list)
    wanted_debs: list[tuple[str, str]] = attrs.field(factory=list)  # (package, version) of this image

    # -- parts ---------------------------------------------------------------
    def kernel(self) -> tuple[Path, str, str]:
        pkg = kernel_package()
        ((_, ver),) = candidates([pkg])
        self.wanted_debs.append((pkg, ver))
        key = digest("kernel", 2, pkg, ver, MODULES)
        final = self.cache / f"kernel-{key}"
        release = pkg.removeprefix("linux-image-")
        if (final / "vmlinux").exists():
            self.progress("kernel", f"cached {pkg} {ver}")
            public_modes(final)  # (a part an older build made under serve's umask)
            return final, release, key
        self.progress("kernel", f"downloading {pkg} {ver}")
        with staging(self.cache, "kernel") as tmp:
            (deb,) = [d for d in _download([(pkg, ver)], tmp / "debs", self.cache / DEBS) if d.name.startswith(pkg)]
            tree = tmp / "tree"
            run(["dpkg-deb", "-x", str(deb), str(tree)])
            out = tmp / "out"
            (out / "modules").mkdir(parents=True)
            shutil.copy(tree / "boot" / f"vmlinuz-{release}", out / "vmlinuz")
            shutil.copy(tree / "boot" / f"config-{release}", out / "config")
            moddir = tree / "lib" / "modules" / release / "kernel"
            found = {p.name.removesuffix(".ko"): p for p in moddir.rglob("*.ko")}
            for m in MODULES:
                if m not in found:
                    raise BuildError(f"kernel module {m} missing from {pkg}")
                shutil.copy(found[m], out / "modules" / f"{m}.ko")
            self.progress("kernel", "extracting vmlinux for PVH boot")
            extract_vmlinux(out / "vmlinuz", out / "vmlinux")
            publish(out, final)
        self.built.append("kernel")
        return final, release, key

    def runtime(self, kernel_dir: Path, kernel_key: str, release: str) -> tuple[Path, str]:
        versions = candidates((*RUNTIME_PACKAGES, STDLIB_PACKAGE))
        self.wanted_debs.extend(versions)
        key = digest("runtime", 3, versions, kernel_key, Path(__file__), HERE / "init.sh", *guestd_sources())
        final = self.cache / f"runtime-{key}"
        if (final / "initrd.cpio").exists():
            self.progress("runtime", "cached")
            public_modes(final)
            return final, key
        self.progress("runtime", f"downloading {len(versions)} packages")
        with staging(self.cache, "runtime") as tmp:
            root = tmp / "root"
            root.mkdir()
            for deb in _download(versions, tmp / "debs", self.cache / DEBS):
                if deb.name.startswith(STDLIB_PACKAGE + "_"):
                    run(["dpkg-deb", "-x", str(deb), str(tmp / "stdlib")])
                else:
                    run(["dpkg-deb", "-x", str(deb), str(root)])
            for rel in STDLIB_PICK:
                shutil.copy(tmp / "stdlib/usr/lib/python3.11" / rel, root / "usr/lib/python3.11" / rel)
            self.progress("runtime", "assembling the initramfs")
            for rel in _RUNTIME_DROP:
                shutil.rmtree(root / rel, ignore_errors=True)
            # usrmerge: bookworm packages still ship /lib and /lib64 paths
            for d in ("bin", "sbin", "lib", "lib64"):
                src = root / d
                if src.is_dir() and not src.is_symlink():
                    (root / "usr" / d).mkdir(parents=True, exist_ok=True)
                    shutil.copytree(src, root / "usr" / d, symlinks=True, dirs_exist_ok=True)
                    shutil.rmtree(src)
                if not src.exists():
                    src.symlink_to(f"usr/{d}")
            bb = root / "usr" / "bin" / "busybox"
            if not bb.exists():
                raise BuildError("busybox-static did not provide /bin/busybox")
            moddir = root / "lib" / "modules" / release
            for d in ("proc", "sys", "dev/pts", "dev/shm", "tmp", "run", "sysroot", "sandvisor/guestd", "etc"):
                (root / d).mkdir(parents=True, exist_ok=True)
            moddir.mkdir(parents=True)
            install_modules(kernel_dir / "modules", moddir)
            write_fstabs(root / "etc")
            for src in guestd_sources():
                shutil.copy(src, root / "sandvisor" / "guestd" / src.name)
            (root / "sandvisor" / "boot.py").write_text(BOOT_PY)
            shutil.copy(HERE / "init.sh", root / "init")
            (root / "init").chmod(0o755)
            py = root / "usr" / "bin" / "python3.11"
            # guestd must import cleanly in its own runtime (catches a missing stdlib piece
            # now), and what it imports -- eagerly, or lazily later -- is all we keep
            probe = root / "sandvisor" / "probe.py"
            probe.write_text(
                BOOT_PY.replace("entry()\n", "")
                + f"import {', '.join(LAZY_IMPORTS)}\n"
                + "import encodings.latin_1, encodings.ascii\n"
                + "print('\\n'.join(getattr(m, '__file__', None) or '' for m in list(sys.modules.values())))\n"
            )
            used = run(["chroot", str(root), "/usr/bin/python3.11", "-S", "-E", "-B", "/sandvisor/probe.py"])
            probe.unlink()
            if "guestd/agent.py" not in used:
                raise BuildError("the guestd import probe listed no modules")
            assert py.exists()
            # sourceless byte code (compiled by the guest's own interpreter, before the
            # trim: compileall needs more of the stdlib than guestd does): no .py to stat,
            # no __pycache__ lookups, half the bytes in the initramfs
            compile_argv = [
                "/usr/bin/python3.11",
                "-S",
                "-m",
                "compileall",
                "-q",
                "-b",
                "/usr/lib/python3.11",
                "/usr/lib/python3/dist-packages",
                "/sandvisor",
            ]
            run(["chroot", str(root), *compile_argv])
            self._trim_stdlib(root, {u for u in used.splitlines() if u})
            for base in (root / "usr/lib/python3.11", root / "usr/lib/python3/dist-packages", root / "sandvisor"):
                for p in base.rglob("*.py"):
                    p.unlink()
                for p in base.rglob("__pycache__"):
                    shutil.rmtree(p)
            # the trimmed, sourceless tree must still import everything guestd will
            check = BOOT_PY.replace("entry()\n", "") + f"import {', '.join(LAZY_IMPORTS)}\n"
            run(["chroot", str(root), "/usr/bin/python3.11", "-S", "-E", "-B", "-c", check])
            libdir = root / "usr/lib/x86_64-linux-gnu"
            for lib in libdir.iterdir():
                if not any(lib.name.startswith(k) for k in RUNTIME_LIBS):
                    lib.unlink() if not lib.is_dir() or lib.is_symlink() else shutil.rmtree(lib)
            out = tmp / "out"
            out.mkdir()
            self._cpio(root, out / "initrd.cpio")
            publish(out, final)
        self.built.append("runtime")
        return final, key

    def rootfs(self, include: tuple[str, ...] = ROOTFS_INCLUDE, size: int = ROOTFS_SIZE_MIB) -> tuple[Path, str]:
        """The rootfs of ``include`` (a profile's is the default's and more: images/profiles.py)."""
        versions = candidates(include)
        key = digest("rootfs", 2, versions, size)
        final = self.cache / f"rootfs-{key}"
        if (final / "rootfs.ext4").exists():
            self.progress("rootfs", "cached")
            public_modes(final)
            return final, key
        self.progress("rootfs", f"mmdebstrap minbase, {len(include)} packages (a minute or more)")
        with staging(self.cache, "rootfs") as tmp:
            tree = tmp / "tree"
            debian_tree(tree, include)
            self.progress("rootfs", "making ext4")
            out = tmp / "out"
            out.mkdir()
            img = out / "rootfs.ext4"
            run(
                [
                    "mkfs.ext4",
                    "-q",
                    "-F",
                    "-L",
                    "sandvisor-root",
                    "-b",
                    "4096",
                    "-m",
                    "0",
                    "-E",
                    "lazy_itable_init=1,root_owner=0:0",
                    "-d",
                    str(tree),
                    str(img),
                    f"{size}M",
                ]
            )
            img.chmod(0o444)  # the read-only base; sandboxes write to qcow2 overlays
            publish(out, final)
        self.built.append("rootfs")
        return final, key

    @staticmethod
    def _trim_stdlib(root: Path, used: set[str]) -> None:
        """Keep only the modules (and their .pyc) that guestd's import closure touched."""
        keep: set[Path] = set()
        for f in used:
            p = root / f.lstrip("/")
            keep.add(p)
            if p.suffix == ".py":
                keep.add(p.with_suffix(".pyc"))
        for base in (root / "usr/lib/python3.11", root / "usr/lib/python3/dist-packages"):
            for p in sorted(base.rglob("*"), reverse=True):
                if p.is_file() and p not in keep and p.suffix in (".py", ".pyc", ".so"):
                    p.unlink()
                elif p.is_dir() and not any(p.iterdir()) and p.name != "lib-dynload":
                    p.rmdir()  # (lib-dynload stays, empty: it is getpath's exec_prefix landmark)

    @staticmethod
    def _cpio(root: Path, out: Path) -> None:
        names = subprocess.run(
            ["find", ".", "-mindepth", "1"], cwd=root, capture_output=True, check=True
        ).stdout.splitlines()
        names.sort()  # reproducible member order
        with open(out, "wb") as f:
            p = subprocess.run(
                ["cpio", "-o", "-H", "newc", "--quiet", "--reproducible"],
                cwd=root,
                input=b"\n".join(names) + b"\n",
                stdout=f,
                stderr=subprocess.PIPE,
                check=False,
            )
        if p.returncode != 0:
            raise BuildError(f"cpio failed: {p.stderr.decode(errors='replace')[-300:]}")

    # -- the whole image -------------------------------------------------------
    def build(self) -> Image:
        """Build (or find) every part and write the manifest; under umask 022 (see the
        module's docstring on modes)."""
        with build_umask():
            return self._build()

    def _build(self) -> Image:
        self.cache.mkdir(parents=True, exist_ok=True)
        kdir, release, kkey = self.kernel()
        rdir, rkey = self.runtime(kdir, kkey, release)
        fdir, fkey = self.rootfs()
        img = Image(
            name="default",
            kernel=kdir / "vmlinux",
            kernel_bz=kdir / "vmlinuz",
            initrd=rdir / "initrd.cpio",
            rootfs=fdir / "rootfs.ext4",
            kernel_version=release,
            keys={"kernel": kkey, "runtime": rkey, "rootfs": fkey},
        )
        manifest = self.cache / "default.json"
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps(img.to_json(), indent=2))
        tmp.chmod(PART_FILE_MODE)
        tmp.rename(manifest)
        self._gc(keep={kdir.name, rdir.name, fdir.name})
        return img

    def _gc(self, keep: set[str]) -> None:
        """Superseded parts of the default image, and stale staging dirs, are removed;
        but not a part a running supervisor (or test session) holds (:func:`hold_parts`):
        it boots every new sandbox from it. A superseded rootfs stays: the disks of
        stopped sandboxes and snapshots, in any state dir, stand on it as their base."""
        for p in self.cache.iterdir():
            if not p.is_dir() or p.is_symlink():
                continue
            superseded = p.name not in keep and re.match(r"^(kernel|runtime)-[0-9a-f]{16}$", p.name)
            stale_staging = p.name.startswith(".") and time.time() - p.stat().st_mtime > 3600
            if stale_staging:
                shutil.rmtree(p, ignore_errors=True)
            elif superseded:
                with _unheld(p) as free:
                    if free:
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        self.progress(p.name.split("-")[0], f"kept superseded {p.name}: in use")
        wanted = {d.name for pkg, ver in self.wanted_debs for d in (self.cache / DEBS).glob(deb_glob(pkg, ver))}
        for deb in (self.cache / DEBS).glob("*.deb"):
            if deb.name not in wanted:  # a version no part of this image is made of
                deb.unlink(missing_ok=True)


def hold_parts(img: Image) -> contextlib.ExitStack:
    """Shared locks (flock) on the directories of ``img``'s parts, held until the
    returned stack closes: a build elsewhere that supersedes them leaves them in place
    meanwhile. A supervisor holds its image's for its life, a test session for its own."""
    stack = contextlib.ExitStack()
    try:
        for part in {img.kernel.parent, img.initrd.parent, img.rootfs.parent}:
            fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            stack.callback(os.close, fd)
            fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        stack.close()
        raise
    return stack


@contextmanager
def _unheld(part: Path) -> Iterator[bool]:
    """Whether no process holds ``part`` (its exclusive lock taken, kept until the
    block ends so nobody starts holding it while it is removed)."""
    try:
        fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        free = True
    except BlockingIOError:
        free = False
    try:
        yield free
    finally:
        os.close(fd)


def debian_tree(tree: Path, include: Iterable[str]) -> None:
    """A Debian bookworm minbase tree at ``tree`` with ``include`` (mmdebstrap over the
    host's apt sources), without apt's lists and caches; its hostname "sandbox"."""
    argv = ["mmdebstrap", "--quiet", "--variant=minbase", "--include=" + ",".join(include)]
    argv += [f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("man", "doc", "locale")]
    run([*argv, "bookworm", str(tree)])
    for junk in ("var/lib/apt/lists", "var/cache/apt"):
        for p in (tree / junk).glob("*"):
            if p.is_file():
                p.unlink()
    (tree / "etc" / "hostname").write_text("sandbox\n")


def load_default(cache: Path | None = None) -> Image | None:
    """The default image, if built (without touching apt)."""
    manifest = (cache or default_cache()) / "default.json"
    try:
        img = Image.from_json(json.loads(manifest.read_text()))
    except (OSError, ValueError, KeyError):
        return None
    return img if img.exists() else None


def host_tsc_khz() -> int | None:
    """The host TSC frequency, for ``tsc_early_khz=`` (TCG boots hang calibrating without it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m images.build [CACHE]``: build the default image with plain progress lines."""
    args = argv if argv is not None else sys.argv[1:]
    cache = Path(args[0]) if args else default_cache()
    b = Builder(cache, progress=lambda part, msg: print(f"[{part}] {msg}", flush=True))
    img = b.build()
    print("built: " + ", ".join(b.built) if b.built else "image up to date: nothing to do")
    print(json.dumps(img.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
