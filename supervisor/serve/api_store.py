"""The server's own methods of the table (:mod:`supervisor.serve.api`): its info, named volumes,
the OCI image store and the secret store (docs/secrets.md), with a sandbox's own
secrets. Every handler acts for ``io.principal``, as those of :mod:`supervisor.serve.api`.
"""

from __future__ import annotations

import math
from importlib import metadata

import trio

from actors.face import (
    AlreadyExists,
    NotFound,
    PermissionDenied,
    Registry,
    VolumeRecord,
    check_labels,
    defaults,
    describe_sandbox_secrets,
    remove_sandbox_secret,
    remove_stored_secret,
    rotate_sandbox_secret,
    set_stored_secret,
)
from images.oci import PullProgress
from supervisor.serve import access, mapping
from supervisor.serve.api_table import CallIO, Table, stopped
from supervisor.wire import protocol

TABLE = Table()
method = TABLE.method


# --- the server and its images ------------------------------------------------------------
SERVICES = ("sandbox.v1.SandboxService", "sandbox.v1.SandboxSnapshotService", "sandvisor.v1.SandvisorService")


def _version() -> str:
    try:
        return metadata.version("sandvisor")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@method("Info", protocol.Empty)
async def _info(reg: Registry, io: CallIO, req: protocol.Empty) -> protocol.ServerInfo:
    by_state: dict[str, int] = {}
    for sb in access.visible(io.principal, reg.sandboxes.values()):
        by_state[sb.state.value] = by_state.get(sb.state.value, 0) + 1
    return protocol.ServerInfo(
        version=_version(),
        accel=reg.settings.accel,
        max_sandboxes=reg.admission.quotas.max_sandboxes,
        sandboxes_by_state=by_state,
        default_image=reg.settings.image.name,
        services=list(SERVICES),
    )


def _volume(reg: Registry, io: CallIO, rec: VolumeRecord) -> protocol.VolumeInfo:
    users = [
        id for id in reg.volumes.users(rec.name) if id not in reg.sandboxes or access.sees_id(reg, io.principal, id)
    ]
    return protocol.VolumeInfo(
        name=rec.name,
        size_mib=rec.size_bytes >> 20,
        created_at=rec.created_at,
        labels=dict(rec.labels),
        mounted_by=users,
    )


@method("CreateVolume", protocol.CreateVolumeRequest)
async def _create_volume(reg: Registry, io: CallIO, req: protocol.CreateVolumeRequest) -> protocol.VolumeInfo:
    check_labels(req.labels)
    rec = await reg.volumes.create(req.name, (req.size_mib or 256) << 20, req.labels, owner=io.principal.name)
    return _volume(reg, io, rec)


@method("InspectVolume", protocol.NameRequest)
async def _inspect_volume(reg: Registry, io: CallIO, req: protocol.NameRequest) -> protocol.VolumeInfo:
    return _volume(reg, io, access.volume(reg, io.principal, req.name))


@method("ListVolumes", protocol.ListVolumesRequest)
async def _list_volumes(reg: Registry, io: CallIO, req: protocol.ListVolumesRequest) -> protocol.ListVolumesResponse:
    recs = [
        r
        for r in reg.volumes.records.values()
        if req.labels.items() <= r.labels.items() and io.principal.may_see(r.owner)
    ]
    return protocol.ListVolumesResponse([_volume(reg, io, r) for r in sorted(recs, key=lambda r: r.name)])


@method("DeleteVolume", protocol.DeleteVolumeRequest)
async def _delete_volume(reg: Registry, io: CallIO, req: protocol.DeleteVolumeRequest) -> protocol.Empty:
    """FAILED_PRECONDITION while a live sandbox mounts it; ``force``: those sandboxes are
    killed first (as ``rm -f`` of each), then it goes."""
    access.volume(reg, io.principal, req.name)
    if req.force:
        users = [id for id in reg.volumes.users(req.name) if id in reg.sandboxes]
        if not all(access.sees_id(reg, io.principal, id) for id in users):
            raise PermissionDenied(f"volume {req.name!r} is mounted by a sandbox {io.principal.name} may not stop")
        killed = [reg.kill(id) for id in users]
        for sb in killed:
            await stopped(sb, defaults.STOP_GRACE)
    await reg.volumes.remove(req.name)
    return protocol.Empty()


@method("ListImages", protocol.Empty)
async def _list_images(reg: Registry, io: CallIO, req: protocol.Empty) -> protocol.ListImagesResponse:
    used = reg.images_in_use()
    oci = [mapping.oci_image(img, img.digest in used) for img in await trio.to_thread.run_sync(reg.oci.list)]
    return protocol.ListImagesResponse([await trio.to_thread.run_sync(mapping.image, reg.settings.image, True)], oci)


@method("PullImage", protocol.PullImageRequest, streams=True)
async def _pull_image(reg: Registry, io: CallIO, req: protocol.PullImageRequest) -> None:
    """Progress items as the store reports them, then ``done`` with the image. The
    store calls back synchronously; an unbounded channel carries the items to this
    task (a few a second: the download watcher polls every 0.25 s)::

        store.pull --progress(p)--> send_nowait --> forward() --io.send--> client
    """
    items_in, items_out = trio.open_memory_channel[protocol.PullImageProgress](math.inf)

    def progress(p: PullProgress) -> None:
        if p.phase != "done":  # the last item is ours, with the image
            items_in.send_nowait(mapping.pull_progress(p))

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
    info = mapping.oci_image(img, img.digest in reg.images_in_use())
    await io.send(protocol.PullImageProgress(phase="done", message=", ".join(img.refs), digest=img.digest, image=info))


@method("RemoveImage", protocol.ImageRefRequest)
async def _remove_image(reg: Registry, io: CallIO, req: protocol.ImageRefRequest) -> protocol.RemoveImageResponse:
    access.admin_only(io.principal, "removing an image (images are shared)")
    r = await reg.oci.remove(req.ref)
    return protocol.RemoveImageResponse(list(r.untagged), list(r.deleted), r.freed_bytes)


@method("PruneImages", protocol.PruneImagesRequest)
async def _prune_images(reg: Registry, io: CallIO, req: protocol.PruneImagesRequest) -> protocol.PruneImagesResponse:
    access.admin_only(io.principal, "pruning images (images are shared)")
    r = await reg.oci.prune(dangling_only=req.dangling_only)
    return protocol.PruneImagesResponse(list(r.deleted), r.blobs_deleted, r.freed_bytes)


@method("InspectOciImage", protocol.ImageRefRequest)
async def _inspect_oci_image(reg: Registry, io: CallIO, req: protocol.ImageRefRequest) -> protocol.OciImageInfo:
    img = reg.oci.inspect(req.ref)
    return mapping.oci_image(img, img.digest in reg.images_in_use())


@method("InspectImage", protocol.NameRequest)
async def _inspect_image(reg: Registry, io: CallIO, req: protocol.NameRequest) -> protocol.ImageInfo:
    image = reg.settings.image
    if req.name not in ("", image.name):
        raise NotFound(f"no image {req.name!r}; this supervisor serves {image.name!r}")
    return await trio.to_thread.run_sync(mapping.image, image, True)


# --- secrets (docs/secrets.md) ------------------------------------------------------------------
@method("SetSecret", protocol.SetSecretRequest)
async def _set_secret(reg: Registry, io: CallIO, req: protocol.SetSecretRequest) -> protocol.Empty:
    vault = reg.settings.vault
    owner = io.principal.name
    if vault is not None and req.name in vault.named:
        owner = vault.named_owner(req.name)  # (a new value keeps its owner)
        if not io.principal.may_see(owner):
            # stored secrets' names are one namespace: another's is taken, not overwritten
            raise AlreadyExists(f"secret {req.name!r} is another principal's: choose another name")
    set_stored_secret(reg.settings, req.name, bytes(req.value), list(req.hosts), owner=owner)
    return protocol.Empty()


@method("ListSecrets", protocol.Empty)
async def _list_secrets(reg: Registry, io: CallIO, req: protocol.Empty) -> protocol.ListSecretsResponse:
    vault = reg.settings.vault
    if vault is None:
        return protocol.ListSecretsResponse([])
    return protocol.ListSecretsResponse(sorted(n for n in vault.named if io.principal.may_see(vault.named_owner(n))))


@method("DeleteSecret", protocol.NameRequest)
async def _delete_secret(reg: Registry, io: CallIO, req: protocol.NameRequest) -> protocol.Empty:
    access.stored_secret(reg, io.principal, req.name)
    users = [sb.config for sb in reg.sandboxes.values()] + [s.config for s in reg.snapshots.snapshots.values()]
    remove_stored_secret(reg.settings, req.name, users)
    return protocol.Empty()


@method("RotateSecret", protocol.RotateSecretRequest)
async def _rotate_secret(reg: Registry, io: CallIO, req: protocol.RotateSecretRequest) -> protocol.Empty:
    rotate_sandbox_secret(access.sandbox(reg, io.principal, req.id), req.name, bytes(req.value))
    return protocol.Empty()


@method("RevokeSecret", protocol.SandboxSecretRequest)
async def _revoke_secret(reg: Registry, io: CallIO, req: protocol.SandboxSecretRequest) -> protocol.Empty:
    remove_sandbox_secret(access.sandbox(reg, io.principal, req.id), req.name)
    return protocol.Empty()


@method("ListSandboxSecrets", protocol.IdRequest)
async def _sandbox_secrets(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.SandboxSecretsResponse:
    sb = access.sandbox(reg, io.principal, req.id)
    return protocol.SandboxSecretsResponse([protocol.SandboxSecretInfo(*s) for s in describe_sandbox_secrets(sb)])
