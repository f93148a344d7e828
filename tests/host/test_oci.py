"""OCI images as root filesystems: a real docker-registry on loopback, images
built here from directories with umoci and pushed with skopeo, the store pulling and
converting them; and converted images booted in real VMs.

The registry and the images are session fixtures (tests/host/conftest.py: a registry starts
in ~0.1 s, but the images take a second to build); every test gets its own store in its tmp_path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from actors.machines.vm import booted_guest
from images.build import Image as GuestImage
from images.oci import (
    DigestMismatch,
    DiskFull,
    Image,
    ImageConfig,
    ImageInUse,
    ImageNotFound,
    ImageStore,
    InvalidReference,
    PullProgress,
    RegistryAuthError,
    RegistryUnavailable,
    UnsupportedImage,
    classify_failure,
    parse_config,
    parse_reference,
)
from images.ocilocal import (
    TEST_PASSWORD,
    TEST_USER,
    Layer,
    LocalRegistry,
    build_image,
    push,
    run,
)
from tests.support.registrylab import APP_SPEC, REFS, Built, Pushed, assert_clean, names, owner
from tests.support.vms import cold_spec


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store", refs=REFS)


# -- references, configs, error classification (no registry) ------------------------


@pytest.mark.parametrize(
    ("ref", "canonical"),
    [
        ("docker://busybox", "docker://docker.io/library/busybox:latest"),
        ("docker://library/busybox:1.36", "docker://docker.io/library/busybox:1.36"),
        ("docker://127.0.0.1:5000/a/b:v1", "docker://127.0.0.1:5000/a/b:v1"),
        ("docker://localhost/x", "docker://localhost/x:latest"),
        ("docker://[::1]:5000/x:1", "docker://[::1]:5000/x:1"),
        ("docker://ghcr.io/o/r@sha256:" + "a" * 64, "docker://ghcr.io/o/r@sha256:" + "a" * 64),
        ("docker://ghcr.io/o/r:t@sha256:" + "b" * 64, "docker://ghcr.io/o/r@sha256:" + "b" * 64),
        ("docker-archive:/tmp/x.tar", "docker-archive:/tmp/x.tar"),
        ("docker-archive:/tmp/x.tar:app:1", "docker-archive:/tmp/x.tar:app:1"),
        ("oci-archive:/tmp//y.tar", "oci-archive:/tmp/y.tar"),
        ("oci:/srv/layout:v2", "oci:/srv/layout:v2"),
        ("oci:/srv/layout", "oci:/srv/layout"),
    ],
)
def test_reference_forms(ref: str, canonical: str) -> None:
    assert parse_reference(ref).canonical() == canonical
    assert parse_reference(canonical).canonical() == canonical  # a fixed point


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("", "empty"),
        ("http://x/y", "transport"),
        ("docker://", "no repository"),
        ("docker://Upper/Case", "component"),
        ("docker://127.0.0.1:5000/x:bad tag", "whitespace"),
        ("docker://127.0.0.1:5000/x:-bad", "bad tag"),
        ("docker://127.0.0.1:5000/x@sha256:abc", "digest"),
        ("docker://127.0.0.1:5000/x@md5:" + "a" * 32, "digest"),
        ("docker://host_name.com:5000/x", "registry host"),
        ("docker://a//b", "component"),
        ("oci:/x:bad tag!", "whitespace"),
        ("oci:/x:ta!g", "image name"),
        ("dir:/tmp/x", "transport"),
        # (busybox:latest, docker:busybox, oci:, containers-storage:x are plain image
        # names now, as docker reads them: tests/unit/test_image_names.py)
    ],
)
def test_malformed_references(ref: str, words: str) -> None:
    with pytest.raises(InvalidReference) as e:
        parse_reference(ref)
    assert words in e.value.message
    assert e.value.code == "INVALID_ARGUMENT"


_REF_ALPHABET = "abcXYZ019:/@._-+ \t" + "sha256" + "\u00e9"


@given(
    st.one_of(
        st.text(alphabet=_REF_ALPHABET, max_size=80),
        st.builds(lambda t, r: t + r, st.sampled_from(["docker://", "oci:", "oci:/", "docker-archive:/"]), st.text()),
    )
)
def test_reference_parser_fuzz(ref: str) -> None:
    """Anything either parses to a fixed point or is INVALID_ARGUMENT; nothing else escapes."""
    try:
        r = parse_reference(ref)
    except InvalidReference:
        return
    assert parse_reference(r.canonical()) == r
    assert r.transport in ("docker", "docker-archive", "oci-archive", "oci")


def test_config_parsing_and_defaults() -> None:
    raw = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": "2024-01-01T00:00:00Z",
            "config": {
                "Env": ["PATH=/usr/bin", "A=1", "A=2", "EMPTY="],
                "Entrypoint": ["/entry"],
                "Cmd": ["--flag"],
                "User": "app:staff",
                "WorkingDir": "/w",
                "Labels": {"b": "2", "a": "1"},
                "ExposedPorts": {"80/tcp": {}},
                "Volumes": {"/data": {}},
                "StopSignal": "SIGINT",
            },
            "rootfs": {"type": "layers", "diff_ids": []},
        }
    ).encode()
    c = parse_config(raw)
    assert c.env_dict() == {"PATH": "/usr/bin", "A": "2", "EMPTY": ""}
    assert c.argv() == ["/entry", "--flag"]
    assert c.argv(["run", "x"]) == ["/entry", "run", "x"]  # a Create's cmd replaces Cmd only
    assert (c.user, c.working_dir, c.stop_signal) == ("app:staff", "/w", "SIGINT")
    assert c.labels == (("a", "1"), ("b", "2"))
    assert c.exposed_ports == ("80/tcp",) and c.volumes == ("/data",)
    # a minimal config: nulls and absences are defaults
    assert parse_config(b'{"config": {"Env": null, "Cmd": null}}') == ImageConfig()
    for bad in (b"[]", b"{", b'{"config": {"Env": [1]}}', b'{"config": {"User": 0}}', b'{"config": []}'):
        with pytest.raises(UnsupportedImage):
            parse_config(bad)


@pytest.mark.parametrize(
    ("stderr", "cls"),
    [
        ('level=fatal msg="writing blob: write /x: no space left on device"', DiskFull),
        ('level=fatal msg="Digest did not match, expected sha256:a, got sha256:b"', DigestMismatch),
        ('level=fatal msg="reading manifest 1 in h/x: unauthorized: authentication required"', RegistryAuthError),
        ('level=fatal msg="... denied: requested access to the resource is denied"', RegistryAuthError),
        ('level=fatal msg="reading manifest 2 in h/x: manifest unknown: manifest unknown"', ImageNotFound),
        ('level=fatal msg="pinging container registry h: dial tcp 127.0.0.1:1: connect: connection refused"', None),
        ('level=fatal msg="Get \\"https://h/v2/\\": http: server gave HTTP response to HTTPS client"', None),
        ('level=fatal msg="pinging container registry h: x509: certificate signed by unknown authority"', None),
    ],
)
def test_failure_classification(stderr: str, cls: type[Exception] | None) -> None:
    err = classify_failure(stderr, parse_reference("docker://h:1/x:1"), "copying", has_creds=False)
    assert isinstance(err, cls or RegistryUnavailable)
    assert "level=fatal" not in err.message  # the tool's words, not its log framing


# -- pulling from a registry ----------------------------------------------------------


async def test_pull_by_tag_converts_and_applies_config(store: ImageStore, pushed: Pushed) -> None:
    seen: list[PullProgress] = []
    with trio.fail_after(60):
        img = await store.pull(pushed.app, tls_verify=False, progress=seen.append)
    assert img.digest == pushed.digests["app"]
    assert img.refs == ("docker://" + pushed.app.removeprefix("docker://"),)
    c = img.config
    assert (c.user, c.working_dir) == ("4242:4243", "/srv/app")
    assert c.env_dict() == {"PATH": "/bin", "GREETING": "hello"}
    assert c.argv() == list(APP_SPEC.cmd)
    # the progress a display shows: each phase in order, bytes up to the total
    phases = [p.phase for p in seen]
    for a, b in [("resolving", "downloading"), ("downloading", "unpacking"), ("unpacking", "converting")]:
        assert phases.index(a) < phases.index(b)
    assert phases[-1] == "done"
    last_dl = [p for p in seen if p.phase == "downloading"][-1]
    assert last_dl.done == last_dl.total == img.download_bytes > 0
    # the rootfs: read-only, sparse, room for the guest's writes, bootable
    st = img.rootfs.stat()
    assert st.st_mode & 0o777 == 0o444
    assert st.st_size >= img.content_bytes + (1 << 30)
    assert st.st_blocks * 512 < img.content_bytes + (64 << 20)
    assert {"bin", "etc", "proc", "sys", "dev", "tmp", "run", "srv"} <= names(img.rootfs, "/")
    assert owner(img.rootfs, "/tmp")[0] & 0o7777 == 0o1777
    assert owner(img.rootfs, "/srv/app") == (0o755, 4242, 4243)  # WORKDIR made for USER
    assert "motd" in names(img.rootfs, "/etc") and "busybox" in names(img.rootfs, "/bin")
    assert store.get(pushed.app) == img == store.get(img.digest) == store.get(img.id)
    assert_clean(store, images=1)


async def test_pull_by_digest_then_tag_shares_the_image(store: ImageStore, pushed: Pushed) -> None:
    digest = pushed.digests["busybox"]
    by_digest = pushed.busybox.rsplit(":", 1)[0] + "@" + digest
    with trio.fail_after(60):
        a = await store.pull(by_digest, tls_verify=False)
        b = await store.pull(pushed.busybox, tls_verify=False)
    assert a.digest == b.digest == digest
    assert store.stats.copies == 1 and store.stats.conversions == 1  # the tag resolved to a known digest
    assert set(b.refs) == {by_digest, pushed.busybox}
    with pytest.raises(ImageNotFound):  # a digest the registry does not have
        await store.pull(pushed.busybox.rsplit(":", 1)[0] + "@sha256:" + "0" * 64, tls_verify=False)
    assert_clean(store, images=1)


async def test_whiteouts_and_opaque_dirs_are_applied(store: ImageStore, pushed: Pushed, tmp_path: Path) -> None:
    with trio.fail_after(60):
        img = await store.pull(pushed.python, tls_verify=False)
    assert len(img.layers) == 3
    assert names(img.rootfs, "/etc") == {"kept.txt"}  # doomed.txt whited out
    assert names(img.rootfs, "/opt/lower") == {"c"}  # a and b hidden by the opaque layer
    # and the image's own python runs from its own root (no shell in this image)
    out = tmp_path / "root"
    out.mkdir()
    subprocess.run(["debugfs", "-R", f"rdump / {out}", str(img.rootfs)], capture_output=True, check=True)
    p = subprocess.run(
        ["chroot", str(out), "/usr/bin/python3", "-S", "-c", "import os; print(sorted(os.listdir('/opt/lower')))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert p.stdout == "['c']\n"


async def test_if_missing_does_not_contact_the_registry(
    store: ImageStore, built: Built, own_registry: LocalRegistry
) -> None:
    ref = own_registry.ref("solo/busybox:1")
    push(built.layout, "busybox", ref)
    with trio.fail_after(60):
        first = await store.pull(ref, tls_verify=False)
        own_registry.stop()
        resolves = store.stats.resolves
        again = await store.pull(ref, tls_verify=False)  # if-missing, the default
        never = await store.pull(ref, policy="never")
        assert again == first == never
        assert store.stats.resolves == resolves  # not one request
        with pytest.raises(RegistryUnavailable) as e:
            await store.pull(ref, tls_verify=False, policy="always")
        assert "connection refused" in e.value.message and e.value.code == "UNAVAILABLE"
        own_registry.start()  # same port and storage
        assert (await store.pull(ref, tls_verify=False, policy="always")) == first
    assert store.stats.copies == 1  # always re-resolves, but the digest is known: no copy
    assert_clean(store, images=1)


async def test_never_policy_and_unknown_local_names(store: ImageStore, pushed: Pushed) -> None:
    with pytest.raises(ImageNotFound) as e:
        await store.pull(pushed.busybox, policy="never")
    assert "never" in e.value.message
    with pytest.raises(ImageNotFound):
        store.get("sha256:" + "f" * 64)
    with pytest.raises(InvalidReference):
        await store.pull(pushed.busybox, policy="sometimes")
    assert_clean(store)


async def test_docker_archive_oci_archive_and_oci_dir(store: ImageStore, built: Built, pushed: Pushed) -> None:
    with trio.fail_after(60):
        from_archive = await store.pull(f"docker-archive:{built.archive}")
        from_dir = await store.pull(f"oci:{built.layout}:app")
        from_oci_archive = await store.pull(f"oci-archive:{built.oci_archive}:busybox")
    # the same config and files whichever way the image came
    assert from_archive.config == from_dir.config
    assert from_archive.config.user == "4242:4243"
    assert from_dir.digest == pushed.digests["app"]  # an OCI layout keeps the pushed manifest
    assert owner(from_archive.rootfs, "/srv/app")[1:] == (4242, 4243)
    assert "motd" in names(from_archive.rootfs, "/etc")
    assert from_oci_archive.digest == pushed.digests["busybox"]
    # if-missing: a local reference is cached too
    assert await store.pull(f"oci:{built.layout}:app") == from_dir
    assert store.stats.copies == 3
    assert_clean(store, images=3)


# -- bad input: a typed error, nothing left behind, the store keeps working ------------


@pytest.mark.parametrize(
    ("case", "cls", "words"),
    [
        ("missing tag", ImageNotFound, "manifest unknown"),
        ("missing repository", ImageNotFound, "no such image"),
        ("unreachable registry", RegistryUnavailable, "connection refused"),
        ("https to a plain-http registry", RegistryUnavailable, "tls_verify=False"),
        ("no credentials", RegistryAuthError, "requires credentials"),
        ("wrong password", RegistryAuthError, "refused the credentials"),
        ("unknown user", RegistryAuthError, "refused the credentials"),
        ("bad creds syntax", InvalidReference, "USER:PASSWORD"),
        ("missing auth file", InvalidReference, "auth file"),
        ("missing archive", ImageNotFound, "no such image on the supervisor's host"),
        ("not an archive", UnsupportedImage, "docker-archive"),
        ("missing oci tag", ImageNotFound, "nope"),
        ("oci dir of several images, no tag", InvalidReference, "several images"),
        ("malformed reference", InvalidReference, "component"),
    ],
)
async def test_bad_input_is_a_typed_error_and_leaves_nothing(
    case: str,
    cls: type[Exception],
    words: str,
    store: ImageStore,
    pushed: Pushed,
    auth_registry: LocalRegistry,
    built: Built,
    tmp_path: Path,
) -> None:
    private = auth_registry.ref("private/busybox:1")
    ref, kw = {
        "missing tag": (pushed.reg.ref("test/busybox:nope"), {"tls_verify": False}),
        "missing repository": (pushed.reg.ref("test/nothing:1"), {"tls_verify": False}),
        "unreachable registry": ("docker://127.0.0.1:1/test/busybox:1", {"tls_verify": False}),
        "https to a plain-http registry": (pushed.busybox, {}),
        "no credentials": (private, {"tls_verify": False}),
        "wrong password": (private, {"tls_verify": False, "creds": f"{TEST_USER}:wrong"}),
        "unknown user": (private, {"tls_verify": False, "creds": "mallory:x"}),
        "bad creds syntax": (private, {"tls_verify": False, "creds": "nocolon"}),
        "missing auth file": (private, {"tls_verify": False, "authfile": tmp_path / "nope.json"}),
        "missing archive": (f"docker-archive:{tmp_path}/nope.tar", {}),
        "not an archive": (f"docker-archive:{built.layout}/index.json", {}),
        "missing oci tag": (f"oci:{built.layout}:nope", {}),
        "oci dir of several images, no tag": (f"oci:{built.layout}", {}),
        "malformed reference": ("Busy/Box", {}),
    }[case]
    with trio.fail_after(60), pytest.raises(cls) as e:
        await store.pull(ref, **kw)  # type: ignore[arg-type]
    assert words in str(e.value), str(e.value)
    assert_clean(store)
    assert list((store.blobs / "sha256").iterdir()) == []
    # and the store still serves
    with trio.fail_after(60):
        assert (await store.pull(pushed.busybox, tls_verify=False)).digest == pushed.digests["busybox"]


async def test_credentials_and_auth_file(store: ImageStore, auth_registry: LocalRegistry, tmp_path: Path) -> None:
    ref = auth_registry.ref("private/busybox:1")
    with trio.fail_after(60):
        a = await store.pull(ref, tls_verify=False, creds=f"{TEST_USER}:{TEST_PASSWORD}")
        other = ImageStore(tmp_path / "other", refs=REFS)
        authfile = tmp_path / "auth.json"
        token = __import__("base64").b64encode(f"{TEST_USER}:{TEST_PASSWORD}".encode()).decode()
        authfile.write_text(json.dumps({"auths": {auth_registry.host: {"auth": token}}}))
        b = await other.pull(ref, tls_verify=False, authfile=authfile)
    assert a.digest == b.digest
    # the password never reached argv: skopeo read it from a 0600 file, now gone
    assert_clean(store, images=1)


async def test_layer_digest_mismatch(store: ImageStore, built: Built, own_registry: LocalRegistry) -> None:
    ref = own_registry.ref("corrupt/app:1")
    push(built.layout, "app", ref)
    manifest = json.loads(run(["skopeo", "inspect", "--raw", "--tls-verify=false", ref]))
    top = manifest["layers"][-1]["digest"]
    blob = own_registry.blob_file(top)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with trio.fail_after(60), pytest.raises(DigestMismatch) as e:
        await store.pull(ref, tls_verify=False)
    assert top in e.value.message, (top, e.value.message)
    assert e.value.code == "FAILED_PRECONDITION"
    assert_clean(store)
    assert not (store.blobs / top.replace(":", "/")).exists()  # the bad bytes were not kept


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A tmpfs of 24 MiB (and one of 72 MiB) for stores that must run out of space."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounts = []
    try:
        for name, size in (("small", 24), ("medium", 72)):
            d = tmp_path / name
            d.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m,mode=0755", "tmpfs", str(d)], check=True)
            mounts.append(d)
        yield tmp_path, 0
    finally:
        for d in mounts:
            subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.parametrize(
    ("disk", "content", "step"),
    [
        ("small", "zeros", "unpacking"),  # 64 MiB of zeros: a tiny layer, a big tree
        ("medium", "random", "making the ext4 file"),  # 30 MiB of noise: blob + tree fit, ext4 does not
    ],
)
async def test_disk_full_during_conversion(
    small_disk: tuple[Path, int], built: Built, pushed: Pushed, disk: str, content: str, step: str
) -> None:
    root, _ = small_disk
    layout = root / "layouts"
    big = root / f"big-{content}"
    (big / "data").mkdir(parents=True)
    with open(big / "data" / "blob", "wb") as f:
        if content == "zeros":
            f.truncate(64 << 20)
        else:
            f.write(os.urandom(30 << 20))
    build_image(layout, "big", [Layer(big)])
    store = ImageStore(root / disk / "store", refs=REFS)
    with trio.fail_after(120), pytest.raises(DiskFull) as e:
        await store.pull(f"oci:{layout}:big")
    assert step in e.value.message and e.value.code == "RESOURCE_EXHAUSTED"
    assert_clean(store)
    # the space came back, and the store serves what fits
    await store.prune(())
    with trio.fail_after(60):
        assert (await store.pull(pushed.busybox, tls_verify=False)).digest == pushed.digests["busybox"]


async def test_size_cap(tmp_path: Path, pushed: Pushed) -> None:
    store = ImageStore(tmp_path / "store", max_image_bytes=1 << 20, refs=REFS)
    with trio.fail_after(60), pytest.raises(DiskFull) as e:
        await store.pull(pushed.busybox, tls_verify=False)
    assert "cap" in e.value.message
    assert_clean(store)


# -- concurrency and cancellation ----------------------------------------------------------


class GatedStore(ImageStore):
    """Holds the first conversion at a gate, so a second pull surely finds it running;
    ``fail_first``: the held pull then fails (as with its caller's bad credentials)."""

    def __init__(self, root: Path, *, fail_first: bool = False) -> None:
        super().__init__(root, refs=REFS)
        self.gate = trio.Event()
        self.fail_first = fail_first
        self.entered = 0

    async def _fetch_and_convert(self, *args: Any) -> None:
        self.entered += 1
        if self.entered == 1:
            await self.gate.wait()
            if self.fail_first:
                raise RegistryAuthError("the first caller's credentials were refused")
        await super()._fetch_and_convert(*args)


@pytest.mark.parametrize("fail_first", [False, True])
async def test_concurrent_pulls_do_the_work_once(tmp_path: Path, pushed: Pushed, fail_first: bool) -> None:
    store = GatedStore(tmp_path / "store", fail_first=fail_first)
    manifest = json.loads(run(["skopeo", "inspect", "--raw", "--tls-verify=false", pushed.python]))
    layer = manifest["layers"][0]["digest"]
    gets = pushed.reg.blob_gets(layer)
    results: dict[str, Image | Exception] = {}
    waiting = trio.Event()

    def watch(p: PullProgress) -> None:
        if p.phase == "waiting":
            waiting.set()

    async def one(name: str) -> None:
        try:
            results[name] = await store.pull(pushed.python, tls_verify=False, progress=watch)
        except RegistryAuthError as exc:
            results[name] = exc

    with trio.fail_after(90):
        async with trio.open_nursery() as n:
            n.start_soon(one, "first")
            n.start_soon(one, "second")
            await waiting.wait()  # the second found the first's conversion running
            store.gate.set()
    # whichever resolved first led; with fail_first it failed and the waiter did the work
    images = [r for r in results.values() if isinstance(r, Image)]
    errors = [r for r in results.values() if isinstance(r, RegistryAuthError)]
    assert (len(images), len(errors)) == ((1, 1) if fail_first else (2, 0))
    assert {i.digest for i in images} == {pushed.digests["python"]}
    assert store.stats.copies == 1 and store.stats.conversions == 1
    assert pushed.reg.blob_gets(layer) == gets + 1  # the big layer crossed the wire once
    assert_clean(store, images=1)


async def test_cancelled_pull_leaves_nothing(store: ImageStore, pushed: Pushed) -> None:
    with trio.fail_after(60):
        for phase in ("downloading", "unpacking", "converting"):
            with trio.CancelScope() as cs:

                def cancel_at(p: PullProgress, phase: str = phase, cs: trio.CancelScope = cs) -> None:
                    if p.phase == phase:
                        cs.cancel()

                await store.pull(pushed.python, tls_verify=False, progress=cancel_at)
            assert cs.cancelled_caught
            assert_clean(store)
        img = await store.pull(pushed.python, tls_verify=False)
    assert_clean(store, images=1)
    assert img.digest == pushed.digests["python"]


# -- removal and pruning -----------------------------------------------------------------


async def test_remove_untags_then_deletes_keeping_shared_layers(store: ImageStore, pushed: Pushed) -> None:
    latest = pushed.reg.ref("test/busybox:latest")
    run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false", pushed.busybox, latest])
    with trio.fail_after(60):
        bb = await store.pull(pushed.busybox, tls_verify=False)
        await store.pull(latest, tls_verify=False)
        app = await store.pull(pushed.app, tls_verify=False)
    shared = set(bb.layers) & set(app.layers)
    assert shared  # app is built on busybox: one blob for its base layer
    r = await store.remove(latest)
    assert r.untagged == (latest,) and r.deleted == ()
    with pytest.raises(ImageInUse) as e:
        await store.remove(pushed.busybox, in_use={bb.digest})
    assert e.value.code == "FAILED_PRECONDITION"
    r = await store.remove(pushed.busybox)
    assert r.deleted == (bb.digest,) and r.freed_bytes > 0
    left = {p.name for p in (store.blobs / "sha256").iterdir()}
    assert {d.removeprefix("sha256:") for d in shared} <= left  # still app's
    assert bb.digest.removeprefix("sha256:") not in left  # busybox's own manifest went
    assert store.list_images() == [app]
    with pytest.raises(ImageNotFound):
        await store.remove(pushed.busybox)
    # prune keeps what is in use, then takes the rest and every blob
    assert (await store.prune({app.digest})).deleted == ()
    refs = json.loads((store.root / "refs.json").read_text())
    refs["refs"]["docker://h:1/gone:1"] = "sha256:" + "e" * 64  # as a crash mid-delete leaves it
    (store.root / "refs.json").write_text(json.dumps(refs))
    res = await store.prune(())
    assert res.deleted == (app.digest,) and not res.blobs_skipped
    assert json.loads((store.root / "refs.json").read_text())["refs"] == {}
    assert list((store.blobs / "sha256").iterdir()) == []
    assert_clean(store)


async def test_moved_tag_leaves_a_dangling_image_for_prune(
    store: ImageStore, built: Built, own_registry: LocalRegistry
) -> None:
    ref = own_registry.ref("moving/thing:1")
    push(built.layout, "busybox", ref)
    with trio.fail_after(60):
        old = await store.pull(ref, tls_verify=False)
        push(built.layout, "app", ref)
        assert (await store.pull(ref, tls_verify=False)) == old  # if-missing: the cached one
        new = await store.pull(ref, tls_verify=False, policy="always")
    assert new.digest != old.digest
    assert store.get(old.digest).refs == ()  # dangling
    res = await store.prune((), dangling_only=True)
    assert res.deleted == (old.digest,)
    assert [i.digest for i in store.list_images()] == [new.digest]


def test_staging_of_a_dead_process_is_swept(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ImageStore(root)
    dead = root / "tmp" / "pull-999999999-abc"  # no such pid
    (dead / "tree").mkdir(parents=True)
    mine = root / "tmp" / f"pull-{os.getpid()}-abc"
    mine.mkdir()
    ImageStore(root)
    assert not dead.exists() and mine.exists()  # one of ours might still be working
    shutil.rmtree(mine)


# -- booting converted images ------------------------------------------------------------------


@pytest.mark.vm
async def test_boot_app_image_runs_as_its_user_in_its_workdir(
    image: GuestImage, tmp_run: Path, store: ImageStore, pushed: Pushed
) -> None:
    with trio.fail_after(180):
        img = await store.pull(pushed.app, tls_verify=False)
        c = img.config
        async with booted_guest(await cold_spec(image, tmp_run, rootfs=img.rootfs), tmp_run) as g:
            r = await g.channel.run(c.argv(), user=c.user, cwd=c.working_dir, env=c.env_dict())
            assert (r.exit_code, r.stdout) == (0, b"hello from /srv/app as 4242:4243\n"), r.stderr
            # the WORKDIR is the user's, and the guest writes through the overlay
            r = await g.channel.run(
                ["/bin/sh", "-c", "touch f && stat -c '%u:%g' f && ls /proc/self >/dev/null && echo ok > /tmp/t"],
                user=c.user,
                cwd=c.working_dir,
            )
            assert (r.exit_code, r.stdout) == (0, b"4242:4243\n"), r.stderr
    assert img.rootfs.stat().st_mode & 0o222 == 0  # the image itself is untouched


@pytest.mark.vm
async def test_boot_python_image_without_a_shell(
    image: GuestImage, tmp_run: Path, store: ImageStore, pushed: Pushed
) -> None:
    with trio.fail_after(180):
        img = await store.pull(pushed.python, tls_verify=False)
        async with booted_guest(await cold_spec(image, tmp_run, rootfs=img.rootfs), tmp_run) as g:
            code = "import os; print(sorted(os.listdir('/opt/lower')), os.path.exists('/etc/doomed.txt'))"
            r = await g.channel.run([*img.config.argv(), "-c", code])
            assert (r.exit_code, r.stdout) == (0, b"['c'] False\n"), r.stderr


async def test_conversion_ignores_the_supervisors_umask(store: ImageStore, pushed: Pushed) -> None:
    """``serve`` runs under umask 077 (its files are its own): directories the image's
    layers imply, and a WORKDIR the store makes, must still be 0755, or a non-root USER
    cannot reach its programs or its working directory."""
    old = os.umask(0o077)
    try:
        with trio.fail_after(60):
            img = await store.pull(pushed.app, tls_verify=False)
    finally:
        os.umask(old)
    assert owner(img.rootfs, "/srv") == (0o755, 0, 0)
    assert owner(img.rootfs, "/srv/app") == (0o755, 4242, 4243)
    assert owner(img.rootfs, "/bin")[0] == 0o755
