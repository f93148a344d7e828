"""The two C helpers: built by the package build (setup.py's ``build_helpers``), checked
by ``serve`` at start, never compiled by the supervisor.

    sandvisor-jail-exec        jail_exec.c     static PIE; enters the jail, vforked (actors/cells/jail.py)
    sandvisor-ram-discard.so   ram_discard.c   LD_PRELOADed into a QEMU 7.2 whose balloon runs on
                                               privately mapped, sealed RAM (actors/cells/guestmem.py)

They land in ``actors/bin/`` -- the build dir's for ``pip install .`` and wheels (so the
installed package holds them), the source tree's for ``pip install -e .`` -- beside
``helpers.json``, which records the compiler (path, ``--version``, target), each
helper's flags, the sha256 of the source it was built from and of the binary. A build
without a C compiler (or whose compile fails) records why instead and warns, so that
``pip install`` works anywhere (``nox -s unit``); ``SANDVISOR_REQUIRE_HELPERS=1`` makes
that an error (the nox sessions that install the host packages set it). :func:`installed`
is what serve asks: the helper's path, or :class:`HelperError` -- one line saying what
is wrong and how to rebuild -- when it is missing, was built from another source or
with other flags (an editable checkout edited since), was changed after the build, or
could be written by someone other than the supervisor (root runs it).

Standard library only: setup.py loads this file by its path in the build environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
BIN_DIR = HERE / "bin"  # where serve looks (tests point it elsewhere)
MANIFEST = "helpers.json"
FORMAT = 1
REQUIRE_ENV = "SANDVISOR_REQUIRE_HELPERS"

# warnings are errors; glibc's checked string functions, stack canaries and probes;
# relocations read-only and bound at load (full RELRO); no executable stack
COMMON_FLAGS = (
    "-std=gnu11",
    "-O2",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-U_FORTIFY_SOURCE",  # (some compilers predefine it: a redefinition would be a warning)
    "-D_FORTIFY_SOURCE=2",
    "-fstack-protector-strong",
    "-fstack-clash-protection",
    "-Wl,-z,relro,-z,now",
    "-Wl,-z,noexecstack",
)


class Helper(NamedTuple):
    name: str  # the file in BIN_DIR
    source: str  # beside this module (package data)
    flags: tuple[str, ...]
    mode: int


# static: vforked from a threaded supervisor, it must not run the dynamic loader's
# code between vfork and exec, nor depend on the host's shared libraries; a static PIE
# keeps ASLR of its own code
JAIL_EXEC = Helper("sandvisor-jail-exec", "jail_exec.c", (*COMMON_FLAGS, "-fPIE", "-static-pie"), 0o755)
RAM_DISCARD = Helper("sandvisor-ram-discard.so", "ram_discard.c", (*COMMON_FLAGS, "-fPIC", "-shared"), 0o644)
HELPERS = (JAIL_EXEC, RAM_DISCARD)


class HelperError(Exception):
    """A helper serve needs is not there as built at install (the message is one line
    and says how to build it)."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rebuild_hint() -> str:
    """How to build the helpers again, for this installation."""
    if (HERE.parent / "pyproject.toml").exists():  # a source tree (an editable install)
        return f"with gcc and libc6-dev installed, reinstall: pip install -e {HERE.parent}"
    return "with gcc and libc6-dev installed, reinstall sandvisor (pip install --force-reinstall from its source)"


# -- at install ---------------------------------------------------------------------------


def compiler(cc: str | None = None) -> tuple[list[str], dict[str, str]] | None:
    """The C compiler's command ($CC or cc) and identity, or None when there is none."""
    argv = shlex.split(cc or os.environ.get("CC") or "cc")
    path = shutil.which(argv[0]) if argv else None
    if path is None:
        return None
    argv[0] = path

    def ask(*args: str) -> str:
        p = subprocess.run([*argv, *args], capture_output=True, text=True, check=False)
        return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else "?"

    return argv, {"path": path, "command": shlex.join(argv), "version": ask("--version"), "target": ask("-dumpmachine")}


def build(
    out_dir: Path,
    *,
    src_dir: Path = HERE,
    cc: str | None = None,
    require: bool | None = None,
    warn: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Compile every helper into ``out_dir`` (made 0755) and write the manifest there.
    Without a compiler, or when a compile fails, the helper is recorded as skipped with
    the reason (a warning) -- unless ``require`` (default: $SANDVISOR_REQUIRE_HELPERS=1):
    then RuntimeError. Returns the manifest."""
    if require is None:
        require = os.environ.get(REQUIRE_ENV, "") not in ("", "0")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir.chmod(0o755)
    found = compiler(cc)
    manifest: dict[str, Any] = {"format": FORMAT, "compiler": found[1] if found else None, "helpers": {}}
    for h in HELPERS:
        out = out_dir / h.name
        out.unlink(missing_ok=True)  # never an old binary beside a new manifest
        src = src_dir / h.source
        entry: dict[str, Any] = {"source": h.source, "source_sha256": _sha256(src), "flags": list(h.flags)}
        if found is None:
            entry["skipped"] = f"no C compiler ({cc or os.environ.get('CC') or 'cc'}) at build time"
        else:
            tmp = out_dir / f".{h.name}.tmp"
            p = subprocess.run(
                [*found[0], *h.flags, "-o", str(tmp), str(src)], capture_output=True, text=True, check=False
            )
            if p.returncode == 0:
                tmp.chmod(h.mode)
                os.replace(tmp, out)
                entry["sha256"] = _sha256(out)
            else:
                tmp.unlink(missing_ok=True)
                lines = [x for x in p.stderr.strip().splitlines() if x.strip()] or [f"exit status {p.returncode}"]
                entry["skipped"] = f"{found[1]['command']} failed: {lines[0].strip()[:300]}"
        if "skipped" in entry:
            if require:
                raise RuntimeError(f"sandvisor: {h.name} not built: {entry['skipped']} ({REQUIRE_ENV} is set)")
            warn(f"WARNING: sandvisor: {h.name} not built ({entry['skipped']}); serve will refuse to start")
        manifest["helpers"][h.name] = entry
    tmp_manifest = out_dir / f".{MANIFEST}.tmp"
    tmp_manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp_manifest.chmod(0o644)
    os.replace(tmp_manifest, out_dir / MANIFEST)
    return manifest


# -- at serve -----------------------------------------------------------------------------


def manifest(directory: Path | None = None) -> dict[str, Any]:
    """The build's record (HelperError when there is none)."""
    d = directory or BIN_DIR
    try:
        data = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        raise HelperError(f"the C helpers were not built at install (no {d / MANIFEST}): {rebuild_hint()}") from None
    except (OSError, ValueError) as exc:
        raise HelperError(f"{d / MANIFEST} is unreadable ({exc}): {rebuild_hint()}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("helpers"), dict):
        raise HelperError(f"{d / MANIFEST} is from another sandvisor build: {rebuild_hint()}")
    return data


def _check_owned(path: Path, what: str) -> None:
    """``path`` is ours (the supervisor's user) and nobody else can write it."""
    st = path.lstat()
    kind = stat.S_ISDIR if what == "directory" else stat.S_ISREG
    if not kind(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise HelperError(f"{path} is not a {what} of ours that only we can write: refusing to run it")


def installed(helper: Helper, directory: Path | None = None) -> Path:
    """The helper as built at install, checked against its record and against the
    source and flags of this sandvisor; HelperError (one line) otherwise."""
    d = directory or BIN_DIR
    entry = manifest(d)["helpers"].get(helper.name)
    if not isinstance(entry, dict):
        raise HelperError(f"{helper.name} is not in {d / MANIFEST}: {rebuild_hint()}")
    if "skipped" in entry:
        raise HelperError(f"{helper.name} was not built at install ({entry['skipped']}): {rebuild_hint()}")
    try:
        source = _sha256(HERE / helper.source)
    except OSError as exc:
        raise HelperError(f"{HERE / helper.source}: {exc.strerror} (a broken installation): {rebuild_hint()}") from None
    if entry.get("source_sha256") != source:
        raise HelperError(f"{helper.name} is stale (built from another {helper.source}): {rebuild_hint()}")
    if entry.get("flags") != list(helper.flags):
        raise HelperError(f"{helper.name} is stale (built with other flags than this sandvisor's): {rebuild_hint()}")
    path = d / helper.name
    try:
        _check_owned(d, "directory")
        _check_owned(path, "regular file")
        changed = _sha256(path) != entry.get("sha256")
    except FileNotFoundError:
        raise HelperError(f"{path} is missing: {rebuild_hint()}") from None
    if changed:
        raise HelperError(f"{path} was changed after the build (its sha256 differs from {MANIFEST}): {rebuild_hint()}")
    return path
