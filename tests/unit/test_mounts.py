"""tmpfs mounts and host directories: the SDK's parse, the configuration's rules, the
host directory checks, QEMU's arguments, the gRPC conversion (no VM)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from actors.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from actors.hostdirs import check_host_dir
from actors.machines.qemuproc import LaunchError
from actors.machines.qemuspec import MachineSpec
from actors.model import HostMount, SandboxConfig, TmpfsMount, VolumeMount
from actors.rules import check_config
from supervisor import client
from supervisor.client import HostDir, Tmpfs
from supervisor.serve import mapping
from supervisor.wire import protocol


def test_tmpfs_parse() -> None:
    assert Tmpfs.parse("/scratch") == Tmpfs("/scratch", 0)
    assert Tmpfs.parse("/scratch:64M") == Tmpfs("/scratch", 64)
    assert Tmpfs.parse("/scratch:1G") == Tmpfs("/scratch", 1024)
    assert Tmpfs.parse("/scratch:100") == Tmpfs("/scratch", 100)  # a bare number: MiB
    assert Tmpfs.parse("/s:1500K") == Tmpfs("/s", 2)  # rounded up
    for bad in ("scratch", "/s:", "/s:lots"):
        with pytest.raises(client.InvalidArgument):
            Tmpfs.parse(bad)
    spec = client.SandboxSpec(tmpfs=["/a:8M", Tmpfs("/b")])
    assert [(t.target, t.size_mib) for t in spec.request().tmpfs] == [("/a", 8), ("/b", 0)]
    assert spec.with_(tmpfs=["/c"]).tmpfs == (Tmpfs("/a", 8), Tmpfs("/b"), Tmpfs("/c"))  # mounts merge by path


@pytest.mark.parametrize(
    ("tmpfs", "volumes", "why"),
    [
        ((TmpfsMount("rel"),), (), "absolute"),
        ((TmpfsMount("/proc"),), (), "cannot be mounted"),
        ((TmpfsMount("/"),), (), "cannot be mounted"),
        ((TmpfsMount("/a", -1),), (), "size_mib"),
        ((TmpfsMount("/a", (1 << 20) + 1),), (), "size_mib"),
        ((TmpfsMount("/a"), TmpfsMount("/a/")), (), "one path"),
        ((TmpfsMount("/data"),), (VolumeMount("v", "/data"),), "one path"),
        (tuple(TmpfsMount(f"/t{i}") for i in range(17)), (), "at most 16"),
    ],
)
def test_tmpfs_rules(tmpfs: tuple[TmpfsMount, ...], volumes: tuple[VolumeMount, ...], why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        check_config(SandboxConfig(tmpfs=tmpfs, volumes=volumes))
    check_config(SandboxConfig(tmpfs=(TmpfsMount("/a", 64), TmpfsMount("/b"))))


# --- host directories -----------------------------------------------------------------------


def test_host_dir_parse_and_request() -> None:
    assert HostDir.parse("/srv/data:/data") == HostDir("/srv/data", "/data", writable=False)  # read-only by default
    assert HostDir.parse("/srv/data:/data:ro") == HostDir("/srv/data", "/data", writable=False)
    assert HostDir.parse("/srv/data:/data:rw") == HostDir("/srv/data", "/data", writable=True)
    for bad in ("srv:/data", "/srv", "/srv:data", "/srv:/data:rx"):
        with pytest.raises(client.InvalidArgument):
            HostDir.parse(bad)
    req = client.SandboxSpec(mounts=["/a:/x", HostDir("/b", "/y", True)]).request()
    assert req.host_mounts == [protocol.HostMount("/a", "/x", False), protocol.HostMount("/b", "/y", True)]
    assert mapping.config(req).host_mounts == (HostMount("/a", "/x", False), HostMount("/b", "/y", True))


@pytest.mark.parametrize(
    ("mounts", "why"),
    [
        ((HostMount("rel", "/x"),), "absolute"),
        ((HostMount("/a/../etc", "/x"),), "'..'"),
        ((HostMount("/a", "x"),), "absolute path"),
        ((HostMount("/a", "/proc"),), "cannot be mounted"),
        ((HostMount("/a", "/x"), HostMount("/b", "/x/")), "one path"),
        (tuple(HostMount(f"/a{i}", f"/x{i}") for i in range(9)), "at most 8"),
        ((HostMount("/srv/a,modcaps=+sys_admin", "/x"),), "option list"),
        ((HostMount("/srv/a\\,b", "/x"),), "option list"),
        ((HostMount("/srv/a\\b", "/x"),), "option list"),
    ],
)
def test_host_mount_rules(mounts: tuple[HostMount, ...], why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        check_config(SandboxConfig(host_mounts=mounts))
    with pytest.raises(InvalidArgument, match="one path"):
        check_config(SandboxConfig(host_mounts=(HostMount("/a", "/t"),), tmpfs=(TmpfsMount("/t"),)))


def test_check_host_dir_codes(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    (allowed / "dir").mkdir(parents=True)
    (allowed / "file").write_text("x")
    (allowed / "link").symlink_to(allowed / "dir")
    (tmp_path / "outside").mkdir()
    check_host_dir(str(allowed / "dir"), (allowed,))
    check_host_dir(str(allowed), (allowed,))  # the allowed directory itself
    for path in (tmp_path / "outside", Path("/etc")):
        with pytest.raises(PermissionDenied, match="allow-path"):
            check_host_dir(str(path), (allowed,))
    with pytest.raises(PermissionDenied, match="none"):
        check_host_dir(str(allowed / "dir"), ())  # no --allow-path: none
    with pytest.raises(NotFound):
        check_host_dir(str(allowed / "missing"), (allowed,))
    for path in (allowed / "file", allowed / "link"):
        with pytest.raises(FailedPrecondition, match="no symlink"):
            check_host_dir(str(path), (allowed,))
    with pytest.raises(InvalidArgument):
        check_host_dir(f"{allowed}/../outside", (allowed,))
    # its server owns nothing there: others must be able to read it (and write, rw)
    (allowed / "dir").chmod(0o700)
    with pytest.raises(FailedPrecondition, match="by others"):
        check_host_dir(str(allowed / "dir"), (allowed,))
    (allowed / "dir").chmod(0o755)
    with pytest.raises(FailedPrecondition, match="writable"):
        check_host_dir(str(allowed / "dir"), (allowed,), writable=True)
    (allowed / "dir").chmod(0o777)
    check_host_dir(str(allowed / "dir"), (allowed,), writable=True)


def test_qemu_argv_for_host_dirs(tmp_path: Path) -> None:
    spec = MachineSpec(kernel=Path("/k"), initrd=Path("/i"), memory_file=tmp_path / "ram", fs_tags=("host0", "host1"))
    argv = spec.argv(tmp_path, {"fs0": 7, "fs1": 8})
    text = " ".join(argv)
    assert "socket,id=fs0,fd=7 -device vhost-user-fs-device,chardev=fs0,tag=host0" in text
    assert "socket,id=fs1,fd=8 -device vhost-user-fs-device,chardev=fs1,tag=host1" in text
    assert "-global virtio-mmio.force-legacy=off" in text  # libvhost-user serves modern devices only
    assert "share=on" in text and spec.virtio_devices() == 3
    assert "force-legacy" not in " ".join(attrs.evolve(spec, fs_tags=()).argv(tmp_path))
    with pytest.raises(LaunchError, match="no server"):
        spec.argv(tmp_path, {"fs0": 7})
    with pytest.raises(LaunchError, match="shared"):
        attrs.evolve(spec, memory_file=None).argv(tmp_path, {"fs0": 7, "fs1": 8})  # anonymous RAM
    with pytest.raises(LaunchError, match="shared"):
        attrs.evolve(spec, memory_shared=False).argv(tmp_path, {"fs0": 7, "fs1": 8})


def test_grpc_create_carries_host_mounts() -> None:
    from supervisor.serve import grpc_service
    from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv

    req = grpc_service.to_request(
        sv.CreateRequest(
            host_mounts=[
                sv.HostMount(source="/srv", target="/data"),
                sv.HostMount(source="/w", target="/w", writable=True),
            ]
        ),
        protocol.CreateSandboxRequest,
        grpc_service._sandvisor_create,
    )
    assert req.host_mounts == [protocol.HostMount("/srv", "/data", False), protocol.HostMount("/w", "/w", True)]


def test_host_dirs_need_the_jail_and_shared_ram() -> None:
    from types import SimpleNamespace
    from typing import Any

    from actors.hostdirs import servers

    unjailed: Any = SimpleNamespace(cells=None, memory_dir=Path("/dev/shm/x"))
    with pytest.raises(FailedPrecondition, match="root, with its jail"):
        servers(unjailed)
    anonymous: Any = SimpleNamespace(cells=SimpleNamespace(tools=object()), memory_dir=None)
    with pytest.raises(FailedPrecondition, match="shared files"):
        servers(anonymous)


def test_host_dir_option_syntax_refused_before_its_server(tmp_path: Path) -> None:
    """A directory whose name has ',' or '\\' (which virtiofsd's ``-o source=`` would
    split or unescape into more options) is refused at every boot, before any look at
    the path; one without them is served."""
    allowed = tmp_path / "allowed"
    for name in ("a,sandbox=none", "a\\b"):
        d = allowed / name
        d.mkdir(parents=True, mode=0o755)
        d.chmod(0o755)
        with pytest.raises(InvalidArgument, match="not allowed"):
            check_host_dir(str(d), (allowed,))
        with pytest.raises(InvalidArgument, match="not allowed"):
            check_host_dir(str(d), ())  # said before PERMISSION_DENIED: no probing either
    (allowed / "a b=c").mkdir(mode=0o755)
    (allowed / "a b=c").chmod(0o755)
    allowed.chmod(0o755)
    check_host_dir(str(allowed / "a b=c"), (allowed,))
