"""tmpfs mounts: the SDK's parse and the configuration's rules (no VM)."""

from __future__ import annotations

import pytest

from actors.errors import InvalidArgument
from actors.model import SandboxConfig, TmpfsMount, VolumeMount, check_config
from supervisor import client as C
from supervisor.client import Tmpfs


def test_tmpfs_parse() -> None:
    assert Tmpfs.parse("/scratch") == Tmpfs("/scratch", 0)
    assert Tmpfs.parse("/scratch:64M") == Tmpfs("/scratch", 64)
    assert Tmpfs.parse("/scratch:1G") == Tmpfs("/scratch", 1024)
    assert Tmpfs.parse("/scratch:100") == Tmpfs("/scratch", 100)  # a bare number: MiB
    assert Tmpfs.parse("/s:1500K") == Tmpfs("/s", 2)  # rounded up
    for bad in ("scratch", "/s:", "/s:lots"):
        with pytest.raises(C.InvalidArgument):
            Tmpfs.parse(bad)
    spec = C.SandboxSpec(tmpfs=["/a:8M", Tmpfs("/b")])
    assert [(t.target, t.size_mib) for t in spec.request().tmpfs] == [("/a", 8), ("/b", 0)]
    assert spec.with_(tmpfs=["/c"]).tmpfs == (Tmpfs("/c"),)


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
