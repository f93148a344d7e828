"""Guest runtime benchmark: ratios against peers measured in the same run.

1. boot-to-ready of our guest (QEMU spawn -> guestd hello answered) vs the floor:
   the same kernel, booted by plain ``qemu-system-x86_64 -M microvm`` with a
   busybox initramfs that prints a marker on the serial port.
2. exec of ``true`` and a 64 MiB file write, ours vs qemu-guest-agent (Debian's
   ``qemu-guest-agent``, copied from the host into the same guest and started there
   on a second virtio-serial port): ``guest-exec`` + ``guest-exec-status`` polling,
   and ``guest-file-open/write/close``.

Usage: python benchmarks/guest.py [-n N] [--out results/]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from actors.channel.guest import GuestChannel
from actors.machines.disk import create_overlay
from actors.machines.vm import BASE_CMDLINE, VmSpec, booted_guest, kernel_cmdline
from images.build import Builder, Image, default_cache

QGA_PORT = "org.qemu.guest_agent.0"


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def floor_initrd(dest: Path) -> Path:
    """busybox + an /init that prints MARKER on the serial port and powers off."""
    root = dest / "floor-root"
    (root / "bin").mkdir(parents=True)
    for d in ("dev", "proc"):
        (root / d).mkdir()
    bb = shutil.which("busybox")
    assert bb, "busybox-static is needed (images/host-packages.sh installs it)"
    shutil.copy(bb, root / "bin" / "busybox")
    init = root / "init"
    init.write_text(
        "#!/bin/busybox sh\n"
        "/bin/busybox mount -t devtmpfs dev /dev\n"
        "echo SANDVISOR-FLOOR-MARKER > /dev/ttyS0\n"
        # after the marker (not timed): the kernel clock then, for boot_floor_phases
        "/bin/busybox mount -t proc proc /proc\n"
        "read -r U _ < /proc/uptime\n"
        "echo SANDVISOR-FLOOR-UPTIME=$U > /dev/ttyS0\n"
        "/bin/busybox poweroff -f\n"
    )
    init.chmod(0o755)
    out = dest / "floor.cpio"
    names = subprocess.run(["find", "."], cwd=root, capture_output=True, check=True).stdout
    with open(out, "wb") as f:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=names, stdout=f, check=True)
    return out


def boot_floor(image: Image, initrd: Path, cmdline: str, machine: str = "microvm") -> float:
    """QEMU spawn -> marker on the serial port. ``pc`` boots the package's bzImage
    through the default firmware, as a user who just runs QEMU would."""
    return boot_floor_phases(image, initrd, cmdline, machine)[0]


def boot_floor_phases(image: Image, initrd: Path, cmdline: str, machine: str = "microvm") -> tuple[float, float]:
    """:func:`boot_floor`'s time, and when the guest's kernel clock (CLOCK_BOOTTIME, what
    our boot marks count from) started, seconds after QEMU's spawn: QEMU's start and
    the kernel's work before its clock runs, which a sandbox's "firmware/loader" phase
    holds as well. (The uptime is read just after the marker: a few ms late, so this is
    a few ms early.)"""
    argv = [
        "qemu-system-x86_64",
        "-M",
        f"{machine},accel=tcg",
        "-cpu",
        "max",
        "-m",
        "256",
        "-smp",
        "1",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-serial",
        "stdio",
        "-kernel",
        str(image.kernel if machine == "microvm" else image.kernel_bz),
        "-initrd",
        str(initrd),
        "-append",
        cmdline,
    ]
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    assert p.stdout is not None
    buf = b""
    t = None
    while True:
        chunk = p.stdout.read1(4096)
        if not chunk:
            break
        buf += chunk
        if t is None and b"SANDVISOR-FLOOR-MARKER" in buf:
            t = time.monotonic() - t0
        if t is not None and re.search(rb"SANDVISOR-FLOOR-UPTIME=([0-9.]+)\s", buf):
            break
    p.kill()
    p.wait()
    if t is None:
        raise RuntimeError(f"floor boot printed no marker: {buf[-500:]!r}")
    m = re.search(rb"SANDVISOR-FLOOR-UPTIME=([0-9.]+)\s", buf)
    return t, (t - float(m.group(1))) if m else 0.0


# --- qemu-guest-agent ----------------------------------------------------------
class QGA:
    """A minimal QGA client (JSON lines over the port's unix socket)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.s = stream
        self.buf = b""

    async def call(self, cmd: str, **args: object) -> object:
        msg: dict[str, object] = {"execute": cmd}
        if args:
            msg["arguments"] = args
        await self.s.send_all(json.dumps(msg).encode() + b"\n")
        while True:
            while b"\n" not in self.buf:
                data = await self.s.receive_some(1 << 16)
                if not data:
                    raise EOFError("qga closed")
                self.buf += data
            line, self.buf = self.buf.split(b"\n", 1)
            line = line.strip(b"\xff").strip()
            if not line:
                continue
            reply = json.loads(line)
            if "error" in reply:
                raise RuntimeError(f"{cmd}: {reply['error']}")
            if "return" in reply:
                return reply["return"]

    async def sync(self) -> None:
        await self.call("guest-sync", id=12345)

    async def exec_wait(self, path: str) -> float:
        t = time.monotonic()
        r = await self.call("guest-exec", path=path, arg=[], **{"capture-output": True})
        pid = r["pid"]  # type: ignore[index]
        while True:
            st = await self.call("guest-exec-status", pid=pid)
            if st["exited"]:  # type: ignore[index]
                return time.monotonic() - t

    async def write_file(self, path: str, data: bytes, chunk: int = 1 << 20) -> float:
        t = time.monotonic()
        h = await self.call("guest-file-open", path=path, mode="w")
        for i in range(0, len(data), chunk):
            await self.call("guest-file-write", handle=h, **{"buf-b64": base64.b64encode(data[i : i + chunk]).decode()})
        await self.call("guest-file-close", handle=h)
        return time.monotonic() - t


def qga_payload() -> tuple[Path, list[Path]]:
    """The host's qemu-ga (Debian's qemu-guest-agent) and the libraries it links."""
    qga = Path("/usr/sbin/qemu-ga")
    if not qga.exists():
        raise RuntimeError("qemu-guest-agent is not installed (images/host-packages.sh installs it)")
    out = subprocess.run(["ldd", str(qga)], capture_output=True, text=True, check=True).stdout
    libs = [Path(w) for line in out.splitlines() for w in line.split() if w.startswith("/") and "ld-linux" not in w]
    return qga, libs


async def cold_boot(image: Image, run_dir: Path, **kw: Any) -> VmSpec:
    """A fresh boot of the default image on a scratch overlay in ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    await create_overlay(image.rootfs, run_dir / "disk.qcow2")
    return VmSpec.boot(image, disk=run_dir / "disk.qcow2", **kw)


async def start_qga(chan: GuestChannel) -> None:
    qga, libs = qga_payload()
    await chan.run(["mkdir", "-p", "/opt/qga/lib"])
    await chan.write_file("/opt/qga/qemu-ga", qga.read_bytes(), mode=0o755)
    for lib in libs:
        await chan.write_file(f"/opt/qga/lib/{lib.name}", lib.read_bytes(), mode=0o755)
    script = (
        f'for p in /sys/class/virtio-ports/*; do [ "$(cat $p/name)" = {QGA_PORT} ] && dev=/dev/$(basename $p); done; '
        "LD_LIBRARY_PATH=/opt/qga/lib setsid /opt/qga/qemu-ga -m virtio-serial -p $dev "
        "</dev/null >/tmp/qga.log 2>&1 &"
    )
    r = await chan.run(["sh", "-c", script])
    assert r.exit_code == 0, r


async def bench(n: int, out_dir: Path) -> dict[str, object]:
    image = Builder(default_cache()).build()
    results: dict[str, object] = {"n": n, "kernel": image.kernel_version}
    work = Path(tempfile.mkdtemp(prefix="sandvisor-bench-"))
    try:
        # --- boot -----------------------------------------------------------------
        initrd = floor_initrd(work)
        cmd = kernel_cmdline("tcg", root=False)
        floor_cmd = " ".join(w for w in cmd.split() if not w.startswith("sandvisor."))
        assert floor_cmd.startswith(BASE_CMDLINE)
        floors: list[float] = []
        ours: list[float] = []
        phases: list[dict[str, float]] = []
        for i in range(n):  # interleaved, so drift in machine load hits both alike
            floors.append(await trio.to_thread.run_sync(boot_floor, image, initrd, floor_cmd))
            run_dir = work / f"boot{i}"
            async with booted_guest(await cold_boot(image, run_dir), run_dir) as g:
                ours.append(g.t_ready - g.t_launch)
                info = g.channel.hello_info
                assert info is not None
                phases.append({k: float(v) for k, v in info.marks.items()})
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"  boot {i + 1}/{n}: floor {floors[-1]:.2f}s ours {ours[-1]:.2f}s", flush=True)
        results["boot"] = {
            "floor_s": floors,
            "ours_s": ours,
            "floor_median_s": med(floors),
            "ours_median_s": med(ours),
            "ratio": med(ours) / med(floors),
            "target_ratio": 1.3,
            "guest_marks_median_s": {k: med([p[k] for p in phases]) for k in phases[0]},
        }

        # --- exec and file write vs qemu-guest-agent, same guest ------------
        run_dir = work / "agents"
        async with booted_guest(await cold_boot(image, run_dir, memory_mib=512, extra_ports=(QGA_PORT,)), run_dir) as g:
            chan = g.channel
            await start_qga(chan)
            qga_sock = await trio.open_unix_socket(str(run_dir / "port0.sock"))
            qga = QGA(qga_sock)
            with trio.fail_after(30):
                while True:
                    try:
                        await qga.sync()
                        break
                    except (EOFError, json.JSONDecodeError, RuntimeError):
                        await trio.sleep(0.2)
            # in-guest cost of the process itself (the floor under both agents)
            r = await chan.run(
                [
                    "python3",
                    "-c",
                    "import os,time;t=time.perf_counter()\n"
                    "for _ in range(30): os.waitpid(os.posix_spawn('/bin/true',['true'],{}),0)\n"
                    "print((time.perf_counter()-t)/30)",
                ]
            )
            spawn_floor = float(r.stdout)
            ours_exec, qga_exec = [], []
            for _ in range(3):  # warm both paths
                await chan.run(["/bin/true"])
                await qga.exec_wait("/bin/true")
            for _ in range(max(n, 20)):
                t = time.monotonic()
                await chan.run(["/bin/true"])
                ours_exec.append(time.monotonic() - t)
                qga_exec.append(await qga.exec_wait("/bin/true"))
            ping = []
            for _ in range(50):
                t = time.monotonic()
                await chan.ping()
                ping.append(time.monotonic() - t)
            results["exec_true"] = {
                "ours_median_ms": med(ours_exec) * 1e3,
                "qga_median_ms": med(qga_exec) * 1e3,
                "speedup": med(qga_exec) / med(ours_exec),
                "in_guest_spawn_ms": spawn_floor * 1e3,
                "ours_overhead_ms": (med(ours_exec) - spawn_floor) * 1e3,
                "qga_overhead_ms": (med(qga_exec) - spawn_floor) * 1e3,
                "overhead_ratio": (med(qga_exec) - spawn_floor) / max(med(ours_exec) - spawn_floor, 1e-6),
                "ping_median_ms": med(ping) * 1e3,
                "target_speedup": 3.0,
            }
            data = os.urandom(64 << 20)
            ours_w, qga_w = [], []
            for _ in range(max(2, n // 2)):
                t = time.monotonic()
                await chan.write_file("/tmp/ours.bin", data)
                ours_w.append(time.monotonic() - t)
                qga_w.append(await qga.write_file("/tmp/qga.bin", data))
            r = await chan.run(["sh", "-c", "sha256sum /tmp/ours.bin /tmp/qga.bin | cut -c1-64 | uniq | wc -l"])
            assert r.stdout.strip() == b"1", "the two agents wrote different bytes"
            mib = len(data) / (1 << 20)
            results["write_64mib"] = {
                "ours_mib_s": mib / med(ours_w),
                "qga_mib_s": mib / med(qga_w),
                "speedup": med(qga_w) / med(ours_w),
                "target_speedup": 3.0,
            }
            await qga_sock.aclose()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "guest.json").write_text(json.dumps(results, indent=2))
    md = markdown(results)
    (out_dir / "guest.md").write_text(md)
    print(md)
    return results


def markdown(r: dict[str, object]) -> str:
    b, e, w = r["boot"], r["exec_true"], r["write_64mib"]
    assert isinstance(b, dict) and isinstance(e, dict) and isinstance(w, dict)
    marks = " ".join(f"{k}={v:.2f}" for k, v in sorted(b["guest_marks_median_s"].items(), key=lambda kv: kv[1]))
    return "\n".join(
        [
            f"## Guest runtime benchmark (TCG, n={r['n']}, kernel {r['kernel']})",
            "",
            "| measure | ours | peer | ratio | target |",
            "|---|---|---|---|---|",
            f"| boot to ready (s, median) | {b['ours_median_s']:.3f} | floor {b['floor_median_s']:.3f} "
            f"| {b['ratio']:.2f}x | <= {b['target_ratio']}x |",
            f"| exec `true` round trip (ms) | {e['ours_median_ms']:.1f} | qga {e['qga_median_ms']:.1f} "
            f"| {e['speedup']:.2f}x faster | >= {e['target_speedup']}x |",
            f"| agent overhead on exec (ms, minus in-guest spawn {e['in_guest_spawn_ms']:.1f}) "
            f"| {e['ours_overhead_ms']:.1f} | qga {e['qga_overhead_ms']:.1f} | {e['overhead_ratio']:.1f}x less | |",
            f"| 64 MiB file write (MiB/s) | {w['ours_mib_s']:.1f} | qga {w['qga_mib_s']:.1f} "
            f"| {w['speedup']:.2f}x faster | >= {w['target_speedup']}x |",
            f"| ping round trip (ms) | {e['ping_median_ms']:.2f} | | | |",
            "",
            f"guest boot marks (median, seconds since kernel start): {marks}",
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    trio.run(bench, a.n, Path(a.out))


if __name__ == "__main__":
    main()
