"""The supervisor's OCI images, as the domain offers them: pull, list, inspect, remove
and prune on the image store (images/oci), its errors as the domain's codes, and the
:class:`~actors.model.ImageUse` a Create's image becomes. What stands on an image
(never removed) is the registry's to say: ``in_use``.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable

from actors.errors import Code, FailedPrecondition, error
from actors.model import ImageUse, PullAuth, SandboxConfig
from actors.settings import Settings
from images.oci import Image, ImageError, ImageStore, ProgressFn, PruneResult, RemoveResult, rootdir


class OciImages:
    def __init__(self, settings: Settings, in_use: Callable[[], set[str]]) -> None:
        self.settings = settings
        self.in_use = in_use  # digests of the images some sandbox, member or snapshot stands on

    def store(self) -> ImageStore:
        store = self.settings.images
        if store is None:
            raise FailedPrecondition("this supervisor has no image store (OCI images need a root supervisor)")
        return store

    async def pull(
        self,
        ref: str,
        *,
        policy: str = "if-missing",
        tls_verify: bool = True,
        creds: str | None = None,
        auth_json: bytes | None = None,
        ca_pem: bytes | None = None,
        progress: ProgressFn | None = None,
    ) -> Image:
        """Pull ``ref`` into the store (the store's errors as the domain's codes). The
        credentials go to skopeo in a 0600 file and nowhere else: not in a log line,
        not in an error message."""
        store = self.store()
        try:
            return await store.pull(
                ref,
                policy=policy,
                tls_verify=tls_verify,
                creds=creds,
                auth_json=auth_json,
                ca_pem=ca_pem,
                progress=progress,
            )
        except ImageError as exc:
            raise error(Code(exc.code), exc.message) from None

    def list(self) -> builtins.list[Image]:
        return self.settings.images.list_images() if self.settings.images is not None else []

    def inspect(self, ref: str) -> Image:
        try:
            return self.store().get(ref)
        except ImageError as exc:
            raise error(Code(exc.code), exc.message) from None

    async def remove(self, ref: str) -> RemoveResult:
        """Untag or delete; an image a sandbox, a warm pool member, a snapshot or a boot
        template stands on is FAILED_PRECONDITION (the in-use set is taken and the image
        moved out with no checkpoint between: a Create cannot slip in)."""
        store = self.store()
        try:
            return await store.remove(ref, in_use=self.in_use())
        except ImageError as exc:
            raise error(Code(exc.code), exc.message) from None

    async def prune(self, *, dangling_only: bool = False) -> PruneResult:
        """Every image nothing stands on (see remove), unused layers, stale staging."""
        store = self.store()
        try:
            return await store.prune(self.in_use(), dangling_only=dangling_only)
        except ImageError as exc:
            raise error(Code(exc.code), exc.message) from None

    async def use(self, config: SandboxConfig, auth: PullAuth | None = None) -> ImageUse:
        """The OCI image a Create names, pulled as its policy says (a pull happens before
        Create answers: a bad reference, a missing tag, a refused pull are the Create's errors)."""
        store = self.store()
        boot = config.boot
        auth = auth or PullAuth()
        try:
            if rootdir.is_dir_ref(boot.image):  # a root filesystem directory (images/oci/rootdir.py)
                img = await rootdir.from_directory(store, boot.image)
            else:
                img = await store.pull(
                    boot.image,
                    policy=boot.pull,
                    tls_verify=boot.tls_verify,
                    creds=auth.creds or None,
                    auth_json=auth.auth_json or None,
                    ca_pem=auth.ca_pem or None,
                )
        except ImageError as exc:
            raise error(Code(exc.code), exc.message) from None
        c = img.config
        return ImageUse(
            ref=boot.image,
            digest=img.digest,
            template_key=img.template_key,
            rootfs=str(img.rootfs),
            env=c.env_dict(),
            working_dir=c.working_dir,
            user=c.user,
            argv=tuple(c.argv()),
            entrypoint=c.entrypoint,
        )
