"""Image references a client may name (images/refs.py): no tools, no registry.

The store refuses a local path outside ``serve --allow-path`` exactly as a missing one
(no probing of the host's files), and a registry on loopback or link-local unless
``serve --registry-allow`` names it. Resolution is faked: no traffic leaves the test."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from images.oci import ImageError, ImageNotFound, ImageStore, parse_reference
from images.refs import RefPolicy, RegistryRefused, internal_address, split_host


def fake_dns(table: dict[str, list[str]]) -> object:
    asked: list[str] = []

    async def resolver(host: str, port: int) -> Sequence[str]:
        asked.append(host)
        if host not in table:
            raise OSError("Name or service not known")
        return table[host]

    resolver.asked = asked  # type: ignore[attr-defined]
    return resolver


async def refusal(store: ImageStore, ref: str) -> ImageError:
    with trio.fail_after(10), pytest.raises(ImageError) as e:
        await store.pull(ref)
    return e.value


async def test_a_host_path_outside_allow_path_is_refused_as_a_missing_one(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "img.tar").write_bytes(b"not really")
    (allowed / "layout").mkdir()
    (allowed / "shadow.tar").symlink_to("/etc/shadow")  # a symlink inside the allowed dir
    (allowed / "up").symlink_to("/etc")
    for store in (
        ImageStore(tmp_path / "s0"),  # the default: no local reference at all
        ImageStore(tmp_path / "s1", refs=RefPolicy(allowed_paths=(allowed,))),
    ):
        missing = await refusal(store, "docker-archive:/etc/no-such-file-here")
        cases = [
            "docker-archive:/etc/shadow",  # exists, root-only: the confused deputy
            "oci-archive:/etc/shadow:x",
            "oci:/etc",
            f"docker-archive:{allowed}/shadow.tar",  # a symlink out
            f"docker-archive:{allowed}/up/shadow",  # a symlinked directory on the way
            f"docker-archive:{allowed}/layout",  # a directory where a file is meant
            f"oci:{allowed}/img.tar",  # a file where a directory is meant
        ]
        if store.refs.allowed_paths == ():
            cases.append(f"docker-archive:{allowed}/img.tar")  # fine, but no directory is allowed
        for ref in cases:
            r = parse_reference(ref)
            exc = await refusal(store, ref)
            assert type(exc) is ImageNotFound and exc.code == missing.code == "NOT_FOUND", ref
            # the same words, only the path the client gave differs
            assert exc.message.replace(f"{r.transport}:{r.path}", "X") == missing.message.replace(
                "docker-archive:/etc/no-such-file-here", "X"
            ), (ref, exc.message)
        assert list(store.tmp.iterdir()) == []


def test_an_allowed_path_passes_the_check(tmp_path: Path) -> None:
    (tmp_path / "img.tar").write_bytes(b"x")
    (tmp_path / "layout").mkdir()
    policy = RefPolicy(allowed_paths=(tmp_path,))
    policy.check_local(parse_reference(f"docker-archive:{tmp_path}/img.tar:app:1"))
    policy.check_local(parse_reference(f"oci:{tmp_path}/layout:v1"))
    with pytest.raises(ImageNotFound):
        policy.check_local(parse_reference(f"oci:{tmp_path}/nope"))
    RefPolicy(unrestricted=True).check_local(parse_reference("docker-archive:/etc/shadow"))  # the operator's CLI


@pytest.mark.parametrize(
    ("ref", "dns"),
    [
        ("docker://127.0.0.1:5000/a/b:1", {}),
        ("docker://localhost:5000/a/b:1", {}),
        ("docker://[::1]:5000/a/b:1", {}),
        ("docker://[::ffff:7f00:1]:5000/a/b:1", {}),
        ("docker://169.254.169.254/latest/meta:1", {}),  # a cloud's metadata service
        ("docker://[fe80::1]:5000/a:1", {}),
        ("docker://0.0.0.0:5000/a:1", {}),
        ("docker://rebind.example:5000/a:1", {"rebind.example": ["93.184.216.34", "127.0.0.2"]}),
        ("docker://meta.example/a:1", {"meta.example": ["169.254.169.254"]}),
    ],
)
async def test_registries_on_the_host_or_link_are_refused(ref: str, dns: dict[str, list[str]]) -> None:
    resolver = fake_dns(
        {
            **dns,
            **{h: [h] for h in ("127.0.0.1", "::1", "::ffff:7f00:1", "169.254.169.254", "fe80::1", "0.0.0.0")},
        }
    )
    r = parse_reference(ref)
    with trio.fail_after(5), pytest.raises(RegistryRefused) as e:
        await RefPolicy(resolver=resolver).check_registry(r)  # type: ignore[arg-type]
    assert e.value.code == "FAILED_PRECONDITION"
    assert f"--registry-allow {r.domain}" in e.value.message
    # named explicitly, it is allowed (and not even resolved)
    await RefPolicy(registry_allow=(r.domain,), resolver=fake_dns({})).check_registry(r)  # type: ignore[arg-type]


@pytest.mark.parametrize("host", ["2130706433", "127.1", "0x7f.0.0.1", "017700000001"])
async def test_numeric_spellings_of_loopback_are_resolved_then_refused(host: str) -> None:
    """inet_aton's spellings reach 127.0.0.1: the check is on the address, not the text
    (the real resolver: a numeric host never leaves the machine)."""
    with trio.fail_after(10), pytest.raises(RegistryRefused, match=r"127\.0\.0\.1"):
        await RefPolicy().check_registry(parse_reference(f"docker://{host}:5000/a:1"))


async def test_registry_allow_is_a_list_of_the_only_registries() -> None:
    dns = fake_dns({"registry.example": ["93.184.216.34"], "docker.io": ["3.3.3.3"]})
    open_policy = RefPolicy(resolver=dns)  # type: ignore[arg-type]
    await open_policy.check_registry(parse_reference("docker://registry.example/a:1"))
    await open_policy.check_registry(parse_reference("docker://busybox:1"))  # docker.io
    listed = RefPolicy(registry_allow=("registry.example", "127.0.0.1:5000"), resolver=dns)  # type: ignore[arg-type]
    await listed.check_registry(parse_reference("docker://registry.example:8443/a:1"))  # any port of a HOST
    await listed.check_registry(parse_reference("docker://127.0.0.1:5000/a:1"))
    for ref in ("docker://busybox:1", "docker://127.0.0.1:5001/a:1", "docker://other.example/a:1"):
        with pytest.raises(RegistryRefused, match="not one this supervisor pulls from"):
            await listed.check_registry(parse_reference(ref))
    with pytest.raises(ImageError, match="does not resolve") as e:
        await open_policy.check_registry(parse_reference("docker://nowhere.example/a:1"))
    assert e.value.code == "UNAVAILABLE"


async def test_the_store_checks_the_registry_before_skopeo(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "s")  # the default policy: no loopback registry
    exc = await refusal(store, "docker://127.0.0.1:5000/test/busybox:1")
    assert isinstance(exc, RegistryRefused) and "--registry-allow 127.0.0.1:5000" in exc.message
    assert list(store.tmp.iterdir()) == [] and store.stats.resolves == 0


def test_registry_specs() -> None:
    assert split_host("Registry.Example:5000") == ("registry.example", 5000)
    assert split_host("[::1]:5000") == ("::1", 5000)
    assert split_host("[fe80::1]") == ("fe80::1", None)
    assert split_host("127.0.0.1") == ("127.0.0.1", None)
    for bad in ("", "::1", "host:0", "host:x", "a/b", "[::1", "host:99999"):
        with pytest.raises(ValueError):
            split_host(bad)
    with pytest.raises(ValueError):
        RefPolicy(registry_allow=("bad:port",))
    assert internal_address("127.8.9.10") and internal_address("::ffff:169.254.1.1") and internal_address("::")
    assert not internal_address("10.0.0.1") and not internal_address("2001:db8::1")
