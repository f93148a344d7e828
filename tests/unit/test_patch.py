"""One Patch: the SDK's, the wire's, the domain's record and the guest channel's entry
are one class (guestd/patch.py); gRPC's message has its fields."""

from __future__ import annotations

import dataclasses

import msgpack

from actors import model
from actors.channel import guest
from guestd.patch import Patch
from supervisor import client
from supervisor.wire import protocol
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2

FIELDS = ("op", "path", "data", "target", "mode", "owner", "replace", "source")
SAMPLE = (
    Patch.mkdir("/srv/app", mode=0o750, owner="nobody"),
    Patch.file("/srv/app/run.sh", "#!/bin/sh\n", mode=0o755, replace=True),
    Patch.symlink("/srv/app/run.sh", "/usr/local/bin/app"),
    Patch.append("/etc/motd", b"\x00hi"),
    Patch.remove("/etc/issue"),
)


def test_one_definition() -> None:
    assert model.Patch is guest.PatchEntry is protocol.PatchSpec is Patch
    assert model.PATCH_OPS == guest.PATCH_OPS
    assert tuple(f.name for f in dataclasses.fields(Patch)) == FIELDS


def test_the_sdk_and_grpc_say_the_same_fields() -> None:
    """The SDK's Patch is the one Patch; gRPC's PatchSpec has its fields."""
    assert client.Patch is Patch
    assert tuple(f.name for f in sandvisor_pb2.PatchSpec.DESCRIPTOR.fields) == FIELDS


def test_a_create_carries_its_patches_through_the_wire_into_the_domain() -> None:
    from supervisor.serve import mapping

    req = protocol.CreateSandboxRequest(patches=list(SAMPLE))
    raw = msgpack.unpackb(msgpack.packb(protocol.unstructure_body(req)), raw=False)
    back = protocol.structure_body(raw, protocol.CreateSandboxRequest)
    assert back == req and all(type(p) is Patch for p in back.patches)
    assert mapping.config(back).patches == SAMPLE
    assert SAMPLE[3].to_wire() == {"op": "append", "path": "/etc/motd", "data": b"\x00hi"}
