"""Images by plain name (docker's rules), registry mirrors, and registry credentials that
are never printed. No registry here (the loopback mirror is test_image_mirror.py's)."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import pytest
import trio

from actors.model import PullAuth
from images.oci import InvalidReference, parse_reference
from images.refs import RefPolicy, RegistryRefused, parse_mirror
from supervisor.client.sdk.spec import RegistryAuth, SandboxSpec
from supervisor.serve.grpc_service import _sandvisor_create, to_request
from supervisor.wire import protocol
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2 as spb
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv

D = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("ref", "canonical"),
    [
        # docker's normalisation: docker.io, library/ for one component, latest
        ("alpine", "docker://docker.io/library/alpine:latest"),
        ("python:3.12", "docker://docker.io/library/python:3.12"),
        ("library/python:3.12-slim", "docker://docker.io/library/python:3.12-slim"),
        ("foo/bar", "docker://docker.io/foo/bar:latest"),
        ("docker.io/alpine", "docker://docker.io/library/alpine:latest"),
        ("index.docker.io/library/alpine:3", "docker://docker.io/library/alpine:3"),
        ("registry-1.docker.io/foo/bar:1", "docker://docker.io/foo/bar:1"),
        # a first component with '.' or ':', or localhost, is a registry host
        ("ghcr.io/org/x:1", "docker://ghcr.io/org/x:1"),
        ("localhost:5000/x", "docker://localhost:5000/x:latest"),
        ("localhost/x", "docker://localhost/x:latest"),
        ("127.0.0.1:5000/team/app:v2", "docker://127.0.0.1:5000/team/app:v2"),
        ("[::1]:5000/x:1", "docker://[::1]:5000/x:1"),
        ("quay.io/a/b/c/d:e", "docker://quay.io/a/b/c/d:e"),
        # digests pin the image (a tag beside one is decoration)
        (f"alpine@{D}", f"docker://docker.io/library/alpine@{D}"),
        (f"alpine:3.19@{D}", f"docker://docker.io/library/alpine@{D}"),
        (f"ghcr.io/o/r@{D}", f"docker://ghcr.io/o/r@{D}"),
        # a transport only with its own syntax: these are image names, as docker reads them
        ("oci:latest", "docker://docker.io/library/oci:latest"),
        ("docker:busybox", "docker://docker.io/library/docker:busybox"),
        ("busybox:latest", "docker://docker.io/library/busybox:latest"),
        # the transports as before
        ("docker://busybox", "docker://docker.io/library/busybox:latest"),
        ("oci:/srv/layout:v2", "oci:/srv/layout:v2"),
        ("docker-archive:/tmp/x.tar", "docker-archive:/tmp/x.tar"),
    ],
)
def test_plain_names_resolve_as_docker_does(ref: str, canonical: str) -> None:
    r = parse_reference(ref)
    assert r.canonical() == canonical
    assert parse_reference(canonical) == r  # a fixed point
    if not ref.startswith(("oci:/", "docker-archive:", "docker://")):
        assert parse_reference(canonical.removeprefix("docker://")) == r  # and its plain spelling too


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("Alpine", "component"),  # docker: repository names are lowercase
        ("http://x/y", "transport 'http'"),
        ("dir:/tmp/x", "transport 'dir'"),
        ("a:b:c", "component"),
        (":x", "no repository"),
        ("x:", "bad tag"),
        ("x@sha256:abc", "digest"),
        ("host_name.com:5000/x", "registry host"),
        ("a//b", "component"),
        ("alpine:3 ", "whitespace"),
        ("x" * 300, "longer than 255"),
    ],
)
def test_bad_names(ref: str, words: str) -> None:
    with pytest.raises(InvalidReference) as e:
        parse_reference(ref)
    assert words in e.value.message
    assert e.value.code == "INVALID_ARGUMENT"


def test_mirror_specs() -> None:
    m = parse_mirror("docker.io=http://127.0.0.1:5000")
    assert (m.registry, m.host, m.insecure) == ("docker.io", "127.0.0.1:5000", True)
    m = parse_mirror("docker.io=https://mirror.example/")
    assert (m.registry, m.host, m.insecure) == ("docker.io", "mirror.example", False)
    assert parse_mirror("ghcr.io=[::1]:5000").host == "[::1]:5000"
    for bad in ("docker.io", "=x", "docker.io=", "docker.io=http://h/path", "docker.io=h:99999"):
        with pytest.raises(ValueError, match="registry"):
            parse_mirror(bad)
    with pytest.raises(ValueError, match="one mirror per registry"):
        RefPolicy(registry_mirrors=("docker.io=a", "docker.io=b"))


async def test_a_mirrored_registry_is_not_resolved_or_refused() -> None:
    asked: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.1"]

    policy = RefPolicy(registry_mirrors=("docker.io=http://127.0.0.1:5000",), resolver=resolver)
    alpine = parse_reference("alpine")
    assert policy.mirror(alpine) is not None and policy.mirror(parse_reference("ghcr.io/o/x")) is None
    with trio.fail_after(5):
        await policy.check_registry(alpine)  # the operator's mirror: not looked up
        assert asked == []
        with pytest.raises(RegistryRefused, match="registry-allow"):
            await policy.check_registry(parse_reference("ghcr.io/o/x"))  # (resolves to loopback here)
    assert asked == ["ghcr.io"]


def test_registry_secrets_are_never_printed() -> None:
    secret, pem = "alice:hunter2", b"-----BEGIN CERTIFICATE-----\nMIIsecret\n"
    auth = RegistryAuth(creds=secret, ca_pem=pem)
    spec = SandboxSpec().with_(image="alpine", registry=auth)
    req = spec.request("x")
    assert (req.image_creds, req.image_ca_pem) == (secret, pem)
    pull = protocol.PullImageRequest(ref="alpine", creds=secret, ca_pem=pem)
    for value in (auth, spec, req, pull, PullAuth(secret, b"{}", pem)):
        for text in (repr(value), str(value)):
            assert "hunter2" not in text and "MIIsecret" not in text, text


def test_grpc_create_carries_registry_auth_beside_the_seed_request() -> None:
    msg = sv.CreateRequest(
        base=spb.CreateSandboxRequest(id="p", image="python:3.12"),
        image_creds="u:p",
        image_auth_json=b"{}",
        image_ca_pem=b"PEM",
    )
    req = to_request(msg, protocol.CreateSandboxRequest, _sandvisor_create)
    assert (req.id, req.image, req.image_creds, req.image_auth_json, req.image_ca_pem) == (
        "p",
        "python:3.12",
        "u:p",
        b"{}",
        b"PEM",
    )


def test_cli_reads_registry_secrets_from_files_or_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``create --registry-creds-file FILE|-``, ``--registry-authfile``, ``--registry-ca``:
    never argv."""
    from supervisor.client.cli_common import UsageError
    from supervisor.client.cli_sandboxes import _registry_auth

    def ns(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"registry_creds_file": None, "registry_authfile": None, "registry_ca": None, **kw})

    assert _registry_auth(ns()) is None
    (tmp_path / "creds").write_text("alice:s3cret\n")
    (tmp_path / "ca.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    auth = _registry_auth(ns(registry_creds_file=str(tmp_path / "creds"), registry_ca=str(tmp_path / "ca.pem")))
    assert auth is not None and (auth.creds, auth.ca_pem) == ("alice:s3cret", b"-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("bob:pw\n"))
    auth = _registry_auth(ns(registry_creds_file="-"))
    assert auth is not None and auth.creds == "bob:pw"
    (tmp_path / "bad").write_text("nocolon\n")
    for bad in (ns(registry_creds_file=str(tmp_path / "bad")), ns(registry_creds_file=str(tmp_path / "missing"))):
        with pytest.raises(UsageError):
            _registry_auth(bad)
    with pytest.raises(UsageError, match="not both"):
        _registry_auth(ns(registry_creds_file="-", registry_authfile=str(tmp_path / "creds")))
