"""Fixtures of the host tests: docker-registries on loopback with the test images pushed
(tests/support/registrylab.py builds them). The registry and the images are session
fixtures (a registry starts in ~0.1 s, but the images take a second to build)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from images.ocilocal import TEST_PASSWORD, TEST_USER, LocalRegistry, push
from tests.support.registrylab import Built, Pushed, build_images


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_images(tmp_path_factory.mktemp("oci-images"))


@pytest.fixture(scope="session")
def pushed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushed]:
    reg = LocalRegistry(tmp_path_factory.mktemp("registry")).start()
    try:
        digests = {n: push(built.layout, n, reg.ref(f"test/{n}:1")) for n in ("busybox", "python", "app")}
        yield Pushed(reg, reg.ref("test/busybox:1"), reg.ref("test/python:1"), reg.ref("test/app:1"), digests)
    finally:
        reg.stop()


@pytest.fixture(scope="session")
def auth_registry(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    reg = LocalRegistry(tmp_path_factory.mktemp("auth-registry"), auth=True).start()
    try:
        push(built.layout, "busybox", reg.ref("private/busybox:1"), creds=f"{TEST_USER}:{TEST_PASSWORD}")
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def own_registry(built: Built, tmp_path: Path) -> Iterator[LocalRegistry]:
    """A registry of this test's own, to stop or corrupt."""
    reg = LocalRegistry(tmp_path / "registry").start()
    try:
        yield reg
    finally:
        reg.stop()
