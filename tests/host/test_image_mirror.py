"""Images by plain name through a loopback registry mirror (serve --registry-mirror
docker.io=http://127.0.0.1:PORT), and a Create's own registry credentials and CA
certificates (never stored, never logged), against the loopback registries of tests/host/conftest.py and a
TLS one made here. Nothing leaves loopback: docker.io is never resolved (the mirror is
the operator's)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from actors.registry import Registry
from images.build import Image as GuestImage
from images.ocilocal import TEST_PASSWORD, TEST_USER, LocalRegistry, push
from supervisor.client import AsyncImages, AsyncSandbox, FailedPrecondition, NotFound, RegistryAuth, Unavailable
from supervisor.main.throwaway import Workdir, supervisor, workdir
from tests.support.grpc_clients import make_pki
from tests.support.registrylab import Built, Pushed


@pytest.fixture(scope="module")
def tls_registry(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalRegistry, bytes]]:
    pki = make_pki()
    d = tmp_path_factory.mktemp("tls-registry")
    (d / "cert.pem").write_bytes(pki["server_cert"])
    (d / "key.pem").write_bytes(pki["server_key"])
    reg = LocalRegistry(d / "reg", tls=(d / "cert.pem", d / "key.pem")).start()
    try:
        push(built.layout, "busybox", reg.ref("secure/busybox:1"))
        yield reg, pki["ca"]
    finally:
        reg.stop()


@pytest.fixture
async def mirrored(image: GuestImage, pushed: Pushed) -> AsyncIterator[tuple[Workdir, Registry]]:
    with workdir("sv-mirror-", private_state=True) as work:
        mirror = f"docker.io=http://{pushed.reg.host}"
        async with supervisor(work, registry_allow=("127.0.0.1",), registry_mirrors=(mirror,)) as (_cfg, reg):
            yield work, reg


@pytest.mark.vm
async def test_a_plain_name_is_pulled_through_the_mirror_and_boots(
    mirrored: tuple[Workdir, Registry], pushed: Pushed
) -> None:
    work, _reg = mirrored
    sock = work.socket
    with trio.fail_after(600):
        # "test/busybox:1" is docker.io/test/busybox:1, which the mirror serves
        img = await AsyncImages(sock).pull("test/busybox:1")
        assert img.digest == pushed.digests["busybox"]
        assert img.refs == ["docker://docker.io/test/busybox:1"]  # its name, not the mirror's
        # a Create by plain name finds it (and would pull it the same way)
        async with await AsyncSandbox.create("plain", image="docker.io/test/busybox:1", socket=sock) as sb:
            out = bytearray()
            async with sb.exec(["busybox", "echo", "from the mirror"]) as x:  # (its Cmd, a shell, runs)
                await x.close_stdin()
                async for o in x:
                    out += o.data if o.stream == "stdout" else b""
                assert await x.wait() == 0
            assert bytes(out) == b"from the mirror\n"
        # a name the mirror does not have is NOT_FOUND, as from docker.io itself
        with pytest.raises(NotFound, match="no such image"):
            await AsyncImages(sock).pull("test/nothing:1")


async def test_create_with_registry_credentials_never_logged(
    mirrored: tuple[Workdir, Registry], auth_registry: LocalRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    work, _reg = mirrored
    sock = work.socket
    private = auth_registry.ref("private/busybox:1")
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(300):
        with pytest.raises(FailedPrecondition, match="credentials"):
            await AsyncSandbox.create("p0", image=private, tls_verify=False, socket=sock, wait=False)
        auth = RegistryAuth(creds=f"{TEST_USER}:{TEST_PASSWORD}")
        sb = await AsyncSandbox.create("p1", image=private, tls_verify=False, registry=auth, socket=sock, wait=False)
        info = await sb.inspect()
        assert info.id == "p1"
        await sb.remove(force=True)
    assert TEST_PASSWORD not in caplog.text
    assert TEST_PASSWORD.encode() not in b"".join(p.read_bytes() for p in work.state.rglob("*") if p.is_file())


async def test_create_with_a_registry_ca(
    mirrored: tuple[Workdir, Registry], tls_registry: tuple[LocalRegistry, bytes], tmp_path: Path
) -> None:
    work, _reg = mirrored
    sock = work.socket
    reg, ca = tls_registry
    ref = reg.ref("secure/busybox:1")
    with trio.fail_after(300):
        with pytest.raises(Unavailable, match=r"certificate|x509|tls"):
            await AsyncSandbox.create("t0", image=ref, socket=sock, wait=False)  # the host does not trust it
        (tmp_path / "ca.pem").write_bytes(ca)
        auth = RegistryAuth.from_files(ca_file=tmp_path / "ca.pem")
        sb = await AsyncSandbox.create("t1", image=ref, registry=auth, socket=sock, wait=False)
        await sb.remove(force=True)
        img = await AsyncImages(sock).pull(ref, policy="always", ca=tmp_path / "ca.pem")  # PullImage's ca_pem
        assert img.refs == [ref]
