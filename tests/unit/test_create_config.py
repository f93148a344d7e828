"""A Create's configuration, resolved once (fake VMs: tests/fakevm.py).

Two concurrent idempotent Creates of one id, with secrets and an OCI image, both get
the one sandbox: the idempotency is decided by one function with the whole request,
before and again after the pull (no second pass with part of the arguments). And a
sandbox's effective resources are resolved at Create and kept in its record: a
supervisor started later with other defaults boots it as it was made; a record kept
before they were stored gets the defaults of the first supervisor that loads it, once.
Restores of its snapshots inherit them as well.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from trio.testing import MockClock

from actors import create_checks
from actors.errors import AlreadyExists, InvalidArgument
from actors.model import Action, BootSource, Limits, NetMode, Network, PullAuth, SandboxConfig, State
from actors.modify import Modification, modify
from actors.registry import Registry
from actors.sandboxes.sandbox import Sandbox
from actors.secrets.model import SecretRef
from actors.secrets.vault import Vault
from actors.store import Store
from images.oci import Image, ImageConfig
from tests.support.clocks import work_aware_clock
from tests.support.fakevm import FakeLab, fake_settings

REF = "registry.test/app:1"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> MockClock:
    # virtual time, frozen while the store's thread or qemu-img runs (tests/support/clocks.py)
    return work_aware_clock(monkeypatch)


@asynccontextmanager
async def registry(root: Path, lab: FakeLab, **settings_kw: Any) -> AsyncIterator[Registry]:
    store = Store(root / "state" / "sandvisor.db")
    try:
        async with trio.open_nursery() as n:
            await n.start(lab.run)
            reg = await n.start(Registry(fake_settings(root, lab, **settings_kw), store, templates=False).run)
            try:
                yield reg
            finally:
                await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        store.close()


async def ready(sb: Sandbox) -> None:
    with trio.fail_after(120):
        await sb.ready_event.wait()
    assert sb.state == State.READY, sb.record.error


class SlowImages:
    """An image store whose pulls wait until ``expected`` of them are under way (the
    Creates overlap across the pull), and that keeps the credentials each was given."""

    def __init__(self, rootfs: Path, expected: int) -> None:
        self.rootfs = rootfs
        self.expected = expected
        self.auths: list[str | None] = []
        self.all_in = trio.Event()

    async def pull(self, ref: str, **kw: Any) -> Image:
        self.auths.append(kw.get("creds"))
        if len(self.auths) >= self.expected:
            self.all_in.set()
        with trio.fail_after(30):
            await self.all_in.wait()
        return Image(
            digest="sha256:" + "a" * 64,
            config_digest="sha256:" + "b" * 64,
            config=ImageConfig(env=("FROM_IMAGE=1",), cmd=("/bin/sh",)),
            rootfs=self.rootfs,
            rootfs_uuid="fake",
            refs=(ref,),
            layers=(),
            blobs=(),
            content_bytes=0,
            disk_bytes=self.rootfs.stat().st_size,
            download_bytes=0,
            source=ref,
            pulled_at=time.time(),
        )


async def test_concurrent_idempotent_creates_with_secrets_and_an_image_get_one_sandbox(
    tmp_path: Path, clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[dict[str, bytes]] = []

    def values_given(settings: Any, config: SandboxConfig, values: dict[str, bytes], *, fresh: bool = True) -> None:
        # the value rules of check_secrets_available; its network rule (a tap link or a
        # jailed uplink for the proxy) needs a root supervisor with an IP pool, which a
        # fake VM has no use for (the proxy is proved on real VMs: test_secrets*.py)
        checked.append(dict(values))
        missing = {r.name for r in config.secrets if not r.store} - set(values)
        if missing:
            raise InvalidArgument(f"secret {min(missing)}: no value (give value:, env: or store:)")

    monkeypatch.setattr(create_checks, "check_secrets_available", values_given)
    lab = FakeLab()
    images = SlowImages(fake_settings(tmp_path, lab).image.rootfs, expected=2)
    (tmp_path / "vault").mkdir()
    vault = Vault(tmp_path / "vault", tmp_path / "vault.key")
    settings_kw: dict[str, Any] = {"images": images, "vault": vault, "upstream_tls": ssl.create_default_context()}
    cfg = SandboxConfig(
        labels={"k": "v"},
        boot=BootSource(image=REF),
        network=Network(NetMode.USER, outbound=True),
        secrets=(SecretRef("API_KEY", ("api.example.com",)),),
    )
    auth = PullAuth(creds="user:password")
    async with registry(tmp_path, lab, **settings_kw) as reg:
        sub = reg.events.subscribe(action=Action.CREATED)
        got: list[Sandbox] = []

        async def create() -> None:
            got.append(await reg.create("twin", cfg, {"API_KEY": b"s3cret"}, pull_auth=auth, owner="uid:1000"))

        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(create)
                n.start_soon(create)
        assert len(got) == 2 and got[0] is got[1] is reg.get("twin")
        sb = got[0]
        assert images.auths == ["user:password", "user:password"]  # each pull with the caller's credentials
        assert checked == [{"API_KEY": b"s3cret"}] * 2  # each Create's secrets with its values
        [ref] = sb.config.secrets
        assert ref.generated and ref.placeholder  # the record keeps the generated placeholder
        assert sb.record.image is not None and sb.record.image.ref == REF
        assert vault.value(sb.record.uid, "API_KEY") == b"s3cret"
        # once made, the same request is the same sandbox at once (no pull); another is refused
        assert await reg.create("twin", cfg, {"API_KEY": b"s3cret"}, pull_auth=auth, owner="uid:1000") is sb
        assert len(images.auths) == 2
        with pytest.raises(AlreadyExists):
            await reg.create("twin", attrs.evolve(cfg, labels={"k": "w"}), {"API_KEY": b"s3cret"}, owner="uid:1000")
        with pytest.raises(AlreadyExists):  # (ids are one namespace: another owner's is taken)
            await reg.create("twin", cfg, {"API_KEY": b"s3cret"}, pull_auth=auth, owner="uid:1001")
        with trio.fail_after(10):
            async for ev in sub:
                assert (ev.sandbox_id, ev.action) == ("twin", Action.CREATED)
                break
        with trio.move_on_after(1):
            pytest.fail(f"a second created event: {await sub.__anext__()}")


async def stopped(reg: Registry, id: str) -> Sandbox:
    sb = reg.stop(id, 5)
    with trio.fail_after(30):
        await sb.wait_stopped()
    return sb


async def test_a_stopped_sandbox_boots_with_the_resources_it_was_made_with(tmp_path: Path, clock: MockClock) -> None:
    """serve's defaults changed between two supervisors: the sandbox keeps its own."""
    lab = FakeLab()
    async with registry(tmp_path, lab, default_memory_mib=256, default_vcpus=1) as reg:
        sb = await reg.create("a", SandboxConfig())
        await ready(sb)
        assert lab.machines[-1].spec.memory_mib == 256
        await stopped(reg, "a")
    async with registry(tmp_path, lab, default_memory_mib=512, default_vcpus=2) as reg:
        sb = reg.get("a")
        assert (sb.limits.memory_mib, sb.limits.vcpus) == (256, 1)
        await reg.start("a")
        await ready(sb)
        spec = lab.machines[-1].spec
        assert (spec.memory_mib, spec.cpus) == (256, 1)  # not the new defaults
        # a Modify of the CPUs leaves the memory as it was made, not as the defaults say now
        await stopped(reg, "a")
        plan = await modify(reg, "a", Modification(vcpus=2))
        assert plan.applied
        assert (sb.limits.memory_mib, sb.limits.vcpus) == (256, 2)
        await reg.start("a")
        await ready(sb)
        spec = lab.machines[-1].spec
        assert (spec.memory_mib, spec.cpus) == (256, 2)
        # a restore of its (disk-only) snapshot boots with them too
        await stopped(reg, "a")
        snap, _ = await reg.checkpoint("a", name="a-disk")
        with trio.fail_after(60):
            clone = await reg.restore(snap.id, id="clone")
        assert (clone.limits.memory_mib, clone.limits.vcpus) == (256, 2)
        spec = lab.machines[-1].spec
        assert (spec.memory_mib, spec.cpus) == (256, 2)
        # a new sandbox takes the defaults of now
        b = await reg.create("b", SandboxConfig())
        await ready(b)
        assert (lab.machines[-1].spec.memory_mib, b.limits.vcpus) == (512, 2)


async def test_a_record_kept_without_its_resources_takes_the_first_loaders_defaults_once(
    tmp_path: Path, clock: MockClock
) -> None:
    lab = FakeLab()
    async with registry(tmp_path, lab, default_memory_mib=256) as reg:
        sb = await reg.create("old", SandboxConfig())
        await ready(sb)
        await stopped(reg, "old")
        await reg.store.flush()
    store = Store(tmp_path / "state" / "sandvisor.db")  # as a supervisor that kept no limits wrote it
    try:
        store.db.execute("UPDATE sandboxes SET tuning=NULL")
        store.db.commit()
        assert [r.limits for r in store.all()] == [None]
    finally:
        store.close()
    async with registry(tmp_path, lab, default_memory_mib=384) as reg:
        assert reg.get("old").limits.memory_mib == 384
        await reg.store.flush()
    async with registry(tmp_path, lab, default_memory_mib=512) as reg:
        await reg.start("old")
        await ready(reg.get("old"))
        assert lab.machines[-1].spec.memory_mib == 384  # written back by the first, kept since


async def test_a_snapshot_stored_without_resources_restores_with_its_machines(tmp_path: Path, clock: MockClock) -> None:
    """A snapshot whose configuration kept no resources (stored before they were) restores
    with the machine it was saved with, not with the defaults of the supervisor of now."""
    lab = FakeLab()
    async with registry(tmp_path, lab, default_memory_mib=256, default_vcpus=1) as reg:
        sb = await reg.create("a", SandboxConfig())
        await ready(sb)
        await stopped(reg, "a")
        snap, _ = await reg.checkpoint("a", name="a-disk")
        assert (snap.machine.memory_mib, snap.machine.cpus) == (256, 1)
        old = attrs.evolve(snap, config=attrs.evolve(snap.config, limits=Limits()))
        reg.store.update_snapshot(old)  # as a supervisor that kept no resources wrote it
        await reg.store.flush()
    async with registry(tmp_path, lab, default_memory_mib=512, default_vcpus=2) as reg:
        assert reg.snapshots.get("a-disk").config.limits == Limits()
        with trio.fail_after(60):
            clone = await reg.restore("a-disk", id="clone")
        assert (clone.limits.memory_mib, clone.limits.vcpus) == (256, 1)
        spec = lab.machines[-1].spec
        assert (spec.memory_mib, spec.cpus) == (256, 1)
