"""The C helpers are built by the package build (setup.py, actors/helpers.py), with the
recorded flags, and serve refuses to start -- one line saying how to build them -- when
one is missing, stale or loose; nothing is compiled at start and nothing falls back."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from actors import helpers
from supervisor.main import daemon
from supervisor.main.daemon import DaemonConfig, Refused

ROOT = Path(__file__).resolve().parents[2]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the helpers are run by a root supervisor")

ET_DYN = 3
PT_INTERP, PT_DYNAMIC, PT_GNU_STACK, PT_GNU_RELRO = 3, 2, 0x6474E551, 0x6474E552
PF_X = 1
DT_FLAGS, DT_FLAGS_1 = 30, 0x6FFFFFFB
DF_BIND_NOW, DF_1_NOW, DF_1_PIE = 0x8, 0x1, 0x08000000


def built() -> dict[str, Any]:
    """The install's manifest; skipped where that build had no compiler (it says so)."""
    m = helpers.manifest()
    for entry in m["helpers"].values():
        if "skipped" in entry:
            pytest.skip(f"the package build made no C helpers ({entry['skipped']})")
    return m


def elf(path: Path) -> tuple[int, dict[int, int], dict[int, int]]:
    """(e_type, {segment type: flags}, {dynamic tag: value}) of a 64-bit little-endian ELF."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":
        pytest.skip("not a 64-bit little-endian ELF host")
    (e_type,) = struct.unpack_from("<H", data, 16)
    (phoff,) = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    segments: dict[int, int] = {}
    dynamic: dict[int, int] = {}
    for i in range(phnum):
        p_type, p_flags, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        segments[p_type] = p_flags
        if p_type == PT_DYNAMIC:
            for k in range(p_offset, p_offset + p_filesz, 16):
                tag, value = struct.unpack_from("<qQ", data, k)
                if tag == 0:
                    break
                dynamic[tag] = value
    return e_type, segments, dynamic


def test_the_installed_helpers_carry_their_record_and_their_hardening() -> None:
    m = built()
    assert m["format"] == helpers.FORMAT
    assert m["compiler"]["path"] and m["compiler"]["version"] != "?"
    for h in helpers.HELPERS:
        entry = m["helpers"][h.name]
        path = helpers.BIN_DIR / h.name
        assert entry["flags"] == list(h.flags)
        assert {"-Wall", "-Wextra", "-Werror", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong"} <= set(h.flags)
        assert "-Wl,-z,relro,-z,now" in h.flags
        assert entry["source_sha256"] == hashlib.sha256((helpers.HERE / h.source).read_bytes()).hexdigest()
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        e_type, segments, dynamic = elf(path)
        assert e_type == ET_DYN, h.name  # position-independent (a PIE; the shim a shared object)
        assert PT_GNU_RELRO in segments, h.name
        assert PT_GNU_STACK in segments and not segments[PT_GNU_STACK] & PF_X, h.name
        assert dynamic.get(DT_FLAGS, 0) & DF_BIND_NOW or dynamic.get(DT_FLAGS_1, 0) & DF_1_NOW, h.name  # full RELRO
    _, segments, dynamic = elf(helpers.BIN_DIR / helpers.JAIL_EXEC.name)
    assert PT_INTERP not in segments  # static: no dynamic loader runs between vfork and exec
    assert dynamic[DT_FLAGS_1] & DF_1_PIE  # a static PIE
    assert os.access(helpers.BIN_DIR / helpers.JAIL_EXEC.name, os.X_OK)


def test_a_build_without_a_compiler_records_why_and_serve_would_refuse(tmp_path: Path) -> None:
    said: list[str] = []
    m = helpers.build(tmp_path / "bin", cc="/nonexistent/cc", require=False, warn=said.append)
    assert sorted(m["helpers"]) == sorted(h.name for h in helpers.HELPERS) and m["compiler"] is None
    assert all("no C compiler (/nonexistent/cc)" in e["skipped"] for e in m["helpers"].values())
    assert len(said) == 2 and "serve will refuse to start" in said[0]
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == [helpers.MANIFEST]
    with pytest.raises(helpers.HelperError, match=r"not built at install \(no C compiler.*pip install -e"):
        helpers.installed(helpers.JAIL_EXEC, tmp_path / "bin")
    with pytest.raises(RuntimeError, match="SANDVISOR_REQUIRE_HELPERS"):
        helpers.build(tmp_path / "strict", cc="/nonexistent/cc", require=True)
    # a compiler that fails: recorded (and an error when required), never half a build
    m = helpers.build(tmp_path / "bin", cc="false", require=False, warn=said.append)
    assert all("false failed" in e["skipped"] for e in m["helpers"].values())
    with pytest.raises(RuntimeError, match="not built"):
        helpers.build(tmp_path / "bin", cc="false", require=True)


def test_a_missing_stale_changed_or_loose_helper_is_refused(tmp_path: Path) -> None:
    built()
    d = tmp_path / "bin"
    shutil.copytree(helpers.BIN_DIR, d)
    good = json.loads((d / helpers.MANIFEST).read_text())
    exe = d / helpers.JAIL_EXEC.name
    assert helpers.installed(helpers.JAIL_EXEC, d) == exe

    def refused(match: str) -> None:
        with pytest.raises(helpers.HelperError, match=match) as info:
            helpers.installed(helpers.JAIL_EXEC, d)
        assert "pip install" in str(info.value) or "only we can write" in str(info.value)
        assert "\n" not in str(info.value)

    def record(**change: Any) -> None:
        m = json.loads(json.dumps(good))
        m["helpers"][helpers.JAIL_EXEC.name].update(change)
        (d / helpers.MANIFEST).write_text(json.dumps(m))

    record(flags=["-O2"])
    refused(r"stale \(built with other flags")
    record(source_sha256="0" * 64)
    refused(r"stale \(built from another jail_exec.c\)")
    record()
    with exe.open("ab") as f:
        f.write(b"\0")
    refused("changed after the build")
    shutil.copy2(helpers.BIN_DIR / exe.name, exe)
    exe.chmod(0o775)
    refused("only we can write")
    exe.chmod(0o755)
    d.chmod(0o777)
    refused("only we can write")
    d.chmod(0o755)
    assert helpers.installed(helpers.JAIL_EXEC, d) == exe
    exe.unlink()
    refused(f"{exe} is missing")
    (d / helpers.MANIFEST).unlink()
    refused(r"not built at install \(no .*helpers.json\)")


@root_only
def test_serve_refuses_in_one_line_without_the_helpers(tmp_path: Path) -> None:
    """``sandvisor serve`` with its helpers dir empty (pointed there as the package
    would be installed without them): exit 1, one line naming the fix, no traceback,
    and nothing compiled or made (no state dir bin/, no sandbox)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    code = (
        "import sys; from pathlib import Path; from actors import helpers; "
        f"helpers.BIN_DIR = Path({str(empty)!r}); from supervisor.main.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "serve", "--state-dir", str(tmp_path / "state"), "--socket", str(tmp_path / "s")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert "not built at install" in errors[0] and f"pip install -e {ROOT}" in errors[0], errors[0]
    assert list(empty.iterdir()) == [] and not (tmp_path / "state" / "bin").exists()
    assert not (tmp_path / "s").exists()


@root_only
def test_a_missing_discard_shim_refuses_balloons_unless_no_balloon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = built()
    d = tmp_path / "bin"
    shutil.copytree(helpers.BIN_DIR, d)
    (d / helpers.RAM_DISCARD.name).unlink()
    m["helpers"][helpers.RAM_DISCARD.name] = {"skipped": "no C compiler (cc) at build time"}
    (d / helpers.MANIFEST).write_text(json.dumps(m))
    monkeypatch.setattr(helpers, "BIN_DIR", d)
    cfg = DaemonConfig(socket=tmp_path / "s", state_dir=tmp_path / "state")
    with pytest.raises(Refused, match=r"sandvisor-ram-discard.so was not built at install.*--no-balloon"):
        daemon._built_helpers(cfg)
    assert daemon._built_helpers(DaemonConfig(socket=tmp_path / "s", state_dir=tmp_path / "state", balloon=False)) == (
        d / helpers.JAIL_EXEC.name,
        None,
    )
    assert daemon._built_helpers(DaemonConfig(socket=tmp_path / "s", state_dir=tmp_path / "state", jail=False)) is None


# in a process with the shim preloaded: punch a 1 MiB hole at the start of each file
# named, through libc's fallocate (what QEMU calls), and say how each went
PUNCH = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
out = {}
for name in sys.argv[1:]:
    fd = os.open(name, os.O_RDWR)
    r = libc.fallocate(fd, 0x01 | 0x02, 0, 1 << 20)  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
    out[name] = r if r == 0 else -ctypes.get_errno()
    os.close(fd)
print(json.dumps(out))
"""


def test_the_discard_shim_never_punches_the_private_ram_it_is_told_of(tmp_path: Path) -> None:
    """A resume's QEMU maps a paused sandbox's saved memory privately from the file
    itself: the balloon's hole punches in that file (SANDVISOR_PRIVATE_RAM names it)
    succeed without touching it -- the file is the sandbox's saved state until the
    resume is done --, while any other file's (a disk's discard) go to the kernel."""
    built()
    shim = helpers.BIN_DIR / helpers.RAM_DISCARD.name
    saved, disk = tmp_path / "memory", tmp_path / "disk"
    for f in (saved, disk):
        f.write_bytes(b"\x5a" * (2 << 20))
    st = saved.stat()

    def punch(private_ram: str) -> dict[str, int]:
        env = {**os.environ, "LD_PRELOAD": str(shim), "SANDVISOR_PRIVATE_RAM": private_ram}
        r = subprocess.run(
            [sys.executable, "-c", PUNCH, str(saved), str(disk)], env=env, capture_output=True, text=True, check=True
        )
        result: dict[str, int] = json.loads(r.stdout)
        return result

    assert punch(f"{st.st_dev}:{st.st_ino}") == {str(saved): 0, str(disk): 0}
    assert saved.read_bytes() == b"\x5a" * (2 << 20)  # not punched: whole, and not written
    assert [saved.stat().st_size, saved.stat().st_mtime_ns] == [st.st_size, st.st_mtime_ns]
    if disk.read_bytes()[: 1 << 20] != bytes(1 << 20):
        pytest.skip(f"{tmp_path}'s file system cannot punch holes")
    assert disk.read_bytes()[1 << 20 :] == b"\x5a" * (1 << 20)  # the other file was punched, as asked
    # a malformed or absent name protects nothing (and breaks nothing)
    for bad in ("", "x", f"{st.st_dev}:", f"{st.st_dev}:{st.st_ino}x"):
        saved.write_bytes(b"\x5a" * (2 << 20))
        assert punch(bad)[str(saved)] == 0
        assert saved.read_bytes()[: 1 << 20] == bytes(1 << 20), bad
