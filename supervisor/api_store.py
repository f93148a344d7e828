"""The server's own methods of the table (:mod:`supervisor.api`): its info, named volumes,
the OCI image store and the secret store (docs/secrets.md), with a sandbox's own
secrets. Every handler acts for ``io.principal``, as those of :mod:`supervisor.api`.
"""

from __future__ import annotations

import math
from importlib import metadata

import trio

from actors import defaults
from actors.errors import (
    AlreadyExists,
    NotFound,
    PermissionDenied,
)
from actors.model import (
    VolumeRecord,
    check_labels,
)
from actors.registry import Registry
from actors.sandboxes import secrets
from images.oci import PullProgress
from supervisor import access as A
from supervisor import mapping as M
from supervisor import protocol as W
from supervisor.api_table import CallIO, Table, stopped

TABLE = Table()
method = TABLE.method


# --- the server and its images ------------------------------------------------------------
SERVICES = ("sandbox.v1.SandboxService", "sandbox.v1.SandboxSnapshotService", "sandvisor.v1.SandvisorService")


def _version() -> str:
    try:
        return metadata.version("sandvisor")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@method("Info", W.Empty)
async def _info(reg: Registry, io: CallIO, req: W.Empty) -> W.ServerInfo:
    by_state: dict[str, int] = {}
    for sb in A.visible(io.principal, reg.sandboxes.values()):
        by_state[sb.state.value] = by_state.get(sb.state.value, 0) + 1
    return W.ServerInfo(
        version=_version(),
        accel=reg.settings.accel,
        max_sandboxes=reg.admission.quotas.max_sandboxes,
        sandboxes_by_state=by_state,
        default_image=reg.settings.image.name,
        services=list(SERVICES),
    )


def _volume(reg: Registry, io: CallIO, rec: VolumeRecord) -> W.VolumeInfo:
    users = [id for id in reg.volumes.users(rec.name) if id not in reg.sandboxes or A.sees_id(reg, io.principal, id)]
    return W.VolumeInfo(
        name=rec.name,
        size_mib=rec.size_bytes >> 20,
        created_at=rec.created_at,
        labels=dict(rec.labels),
        mounted_by=users,
    )


@method("CreateVolume", W.CreateVolumeRequest)
async def _create_volume(reg: Registry, io: CallIO, req: W.CreateVolumeRequest) -> W.VolumeInfo:
    check_labels(req.labels)
    rec = await reg.volumes.create(req.name, (req.size_mib or 256) << 20, req.labels, owner=io.principal.name)
    return _volume(reg, io, rec)


@method("InspectVolume", W.NameRequest)
async def _inspect_volume(reg: Registry, io: CallIO, req: W.NameRequest) -> W.VolumeInfo:
    return _volume(reg, io, A.volume(reg, io.principal, req.name))


@method("ListVolumes", W.ListVolumesRequest)
async def _list_volumes(reg: Registry, io: CallIO, req: W.ListVolumesRequest) -> W.ListVolumesResponse:
    recs = [
        r
        for r in reg.volumes.records.values()
        if req.labels.items() <= r.labels.items() and io.principal.may_see(r.owner)
    ]
    return W.ListVolumesResponse([_volume(reg, io, r) for r in sorted(recs, key=lambda r: r.name)])


@method("DeleteVolume", W.DeleteVolumeRequest)
async def _delete_volume(reg: Registry, io: CallIO, req: W.DeleteVolumeRequest) -> W.Empty:
    """FAILED_PRECONDITION while a live sandbox mounts it; ``force``: those sandboxes are
    killed first (as ``rm -f`` of each), then it goes."""
    A.volume(reg, io.principal, req.name)
    if req.force:
        users = [id for id in reg.volumes.users(req.name) if id in reg.sandboxes]
        if not all(A.sees_id(reg, io.principal, id) for id in users):
            raise PermissionDenied(f"volume {req.name!r} is mounted by a sandbox {io.principal.name} may not stop")
        killed = [reg.kill(id) for id in users]
        for sb in killed:
            await stopped(sb, defaults.STOP_GRACE)
    await reg.volumes.remove(req.name)
    return W.Empty()


@method("ListImages", W.Empty)
async def _list_images(reg: Registry, io: CallIO, req: W.Empty) -> W.ListImagesResponse:
    used = reg.images_in_use()
    oci = [M.oci_image(img, img.digest in used) for img in await trio.to_thread.run_sync(reg.oci.list)]
    return W.ListImagesResponse([await trio.to_thread.run_sync(M.image, reg.settings.image, True)], oci)


@method("PullImage", W.PullImageRequest, streams=True)
async def _pull_image(reg: Registry, io: CallIO, req: W.PullImageRequest) -> None:
    """Progress items as the store reports them, then ``done`` with the image. The
    store calls back synchronously; an unbounded channel carries the items to this
    task (a few a second: the download watcher polls every 0.25 s)::

        store.pull --progress(p)--> send_nowait --> forward() --io.send--> client
    """
    items_in, items_out = trio.open_memory_channel[W.PullImageProgress](math.inf)

    def progress(p: PullProgress) -> None:
        if p.phase != "done":  # the last item is ours, with the image
            items_in.send_nowait(M.pull_progress(p))

    async def forward() -> None:
        async for item in items_out:
            await io.send(item)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(forward)
        with items_in:
            img = await reg.oci.pull(
                req.ref,
                policy=req.policy or "if-missing",
                tls_verify=req.tls_verify is not False,
                creds=req.creds or None,
                auth_json=req.auth_json or None,
                ca_pem=req.ca_pem or None,
                progress=progress,
            )
    info = M.oci_image(img, img.digest in reg.images_in_use())
    await io.send(W.PullImageProgress(phase="done", message=", ".join(img.refs), digest=img.digest, image=info))


@method("RemoveImage", W.ImageRefRequest)
async def _remove_image(reg: Registry, io: CallIO, req: W.ImageRefRequest) -> W.RemoveImageResponse:
    A.admin_only(io.principal, "removing an image (images are shared)")
    r = await reg.oci.remove(req.ref)
    return W.RemoveImageResponse(list(r.untagged), list(r.deleted), r.freed_bytes)


@method("PruneImages", W.PruneImagesRequest)
async def _prune_images(reg: Registry, io: CallIO, req: W.PruneImagesRequest) -> W.PruneImagesResponse:
    A.admin_only(io.principal, "pruning images (images are shared)")
    r = await reg.oci.prune(dangling_only=req.dangling_only)
    return W.PruneImagesResponse(list(r.deleted), r.blobs_deleted, r.freed_bytes)


@method("InspectOciImage", W.ImageRefRequest)
async def _inspect_oci_image(reg: Registry, io: CallIO, req: W.ImageRefRequest) -> W.OciImageInfo:
    img = reg.oci.inspect(req.ref)
    return M.oci_image(img, img.digest in reg.images_in_use())


@method("InspectImage", W.NameRequest)
async def _inspect_image(reg: Registry, io: CallIO, req: W.NameRequest) -> W.ImageInfo:
    image = reg.settings.image
    if req.name not in ("", image.name):
        raise NotFound(f"no image {req.name!r}; this supervisor serves {image.name!r}")
    return await trio.to_thread.run_sync(M.image, image, True)


# --- secrets (docs/secrets.md) ------------------------------------------------------------------
@method("SetSecret", W.SetSecretRequest)
async def _set_secret(reg: Registry, io: CallIO, req: W.SetSecretRequest) -> W.Empty:
    vault = reg.settings.vault
    owner = io.principal.name
    if vault is not None and req.name in vault.named:
        owner = vault.named_owner(req.name)  # (a new value keeps its owner)
        if not io.principal.may_see(owner):
            # stored secrets' names are one namespace: another's is taken, not overwritten
            raise AlreadyExists(f"secret {req.name!r} is another principal's: choose another name")
    secrets.set_named(reg.settings, req.name, bytes(req.value), list(req.hosts), owner=owner)
    return W.Empty()


@method("ListSecrets", W.Empty)
async def _list_secrets(reg: Registry, io: CallIO, req: W.Empty) -> W.ListSecretsResponse:
    vault = reg.settings.vault
    if vault is None:
        return W.ListSecretsResponse([])
    return W.ListSecretsResponse(sorted(n for n in vault.named if io.principal.may_see(vault.named_owner(n))))


@method("DeleteSecret", W.NameRequest)
async def _delete_secret(reg: Registry, io: CallIO, req: W.NameRequest) -> W.Empty:
    A.stored_secret(reg, io.principal, req.name)
    secrets.remove_named(reg.settings, req.name)
    return W.Empty()


@method("RotateSecret", W.RotateSecretRequest)
async def _rotate_secret(reg: Registry, io: CallIO, req: W.RotateSecretRequest) -> W.Empty:
    secrets.rotate(A.sandbox(reg, io.principal, req.id), req.name, bytes(req.value))
    return W.Empty()


@method("RevokeSecret", W.SandboxSecretRequest)
async def _revoke_secret(reg: Registry, io: CallIO, req: W.SandboxSecretRequest) -> W.Empty:
    secrets.remove(A.sandbox(reg, io.principal, req.id), req.name)
    return W.Empty()


@method("ListSandboxSecrets", W.IdRequest)
async def _sandbox_secrets(reg: Registry, io: CallIO, req: W.IdRequest) -> W.SandboxSecretsResponse:
    sb = A.sandbox(reg, io.principal, req.id)
    return W.SandboxSecretsResponse([W.SandboxSecretInfo(*s) for s in secrets.describe(sb)])
