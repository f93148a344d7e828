"""Modify's egress policy (actors/modify.py): replaced whole, live on a running sandbox,
saved for a stopped one or the next start; only where the guest reaches out; on the
wire (msgpack, gRPC) and from the SDK. The filter itself is tests/vm/test_e2b_net.py's
(a running sandbox's egress changed through E2B's update_network)."""

from __future__ import annotations

from typing import Any

import pytest

from actors.errors import FailedPrecondition, InvalidArgument
from actors.model import Egress, Limits, NetMode, Network, SandboxConfig
from actors.modify import Kind, Machine, Modification, Policy, Status, plan
from supervisor.client.sdk.network import egress_spec
from supervisor.serve import mapping
from supervisor.wire import protocol

LIMITS = Limits(vcpus=1, memory_mib=256, max_vcpus=2, max_memory_mib=1024)
TAP = SandboxConfig(limits=LIMITS, network=Network(mode=NetMode.TAP, profile="web"))
RUNNING = Machine(max_vcpus=2, max_memory_mib=1024, balloon=True, disk_mib=2048)
CLOSED = Egress(default="deny", allow=("203.0.113.20",))


def change(p: Any) -> Any:
    return next(c for c in p.changes if c.kind == Kind.EGRESS)


def test_a_running_sandbox_gets_the_new_policy_now() -> None:
    p = plan(TAP, LIMITS, Modification(egress=CLOSED), RUNNING, disk_mib=2048)
    c = change(p)
    assert p.accepted and not p.restart and c.status == Status.APPLIED
    assert (c.value, c.previous) == ("default=deny allow=203.0.113.20 deny=", "default=allow allow= deny=")
    assert p.config.network.egress == CLOSED and p.config.network.mode == NetMode.TAP
    assert p.config.network.profile == ""  # the profile no longer names the policy
    # the same policy again changes nothing
    same = plan(p.config, LIMITS, Modification(egress=CLOSED), RUNNING, disk_mib=2048)
    assert change(same).status == Status.UNCHANGED and same.config.network == p.config.network
    # no policy is "allow": asking for it is no change
    assert change(plan(TAP, LIMITS, Modification(egress=Egress()), RUNNING, disk_mib=2048)).status == Status.UNCHANGED


def test_a_stopped_sandbox_or_next_start_saves_it() -> None:
    stopped = plan(TAP, LIMITS, Modification(egress=CLOSED), None, disk_mib=2048)
    assert change(stopped).status == Status.NEXT_BOOT and stopped.config.network.egress == CLOSED
    later = plan(TAP, LIMITS, Modification(egress=CLOSED, policy=Policy.NEXT_START), RUNNING, disk_mib=2048)
    assert later.pending and change(later).status == Status.NEXT_BOOT


def test_only_where_the_guest_reaches_out() -> None:
    none = SandboxConfig(limits=LIMITS)
    with pytest.raises(FailedPrecondition, match="reaches nothing"):
        plan(none, LIMITS, Modification(egress=CLOSED), RUNNING, disk_mib=2048)
    user = SandboxConfig(limits=LIMITS, network=Network(mode=NetMode.USER, outbound=True))
    assert change(plan(user, LIMITS, Modification(egress=CLOSED), RUNNING, disk_mib=2048)).status == Status.APPLIED
    with pytest.raises(InvalidArgument):
        plan(TAP, LIMITS, Modification(egress=Egress(default="maybe")), RUNNING, disk_mib=2048)
    with pytest.raises(InvalidArgument):
        plan(TAP, LIMITS, Modification(egress=Egress(allow=("not a host!",))), RUNNING, disk_mib=2048)


def test_on_the_wire_and_from_the_sdk() -> None:
    spec = egress_spec({"default": "deny", "allow": ["203.0.113.20"]})
    assert spec == protocol.EgressSpec("deny", ["203.0.113.20"], [])
    assert egress_spec(None) is None
    mod = mapping.modification(protocol.ModifyRequest(id="m", egress=spec))
    assert mod.egress == CLOSED
    assert mapping.modification(protocol.ModifyRequest(id="m")).egress is None
    from supervisor.serve.grpc_service import descriptors

    fields = descriptors()["sandvisor.v1.SandvisorService"].methods_by_name["Modify"].input_type.fields_by_name
    assert fields["egress"].number == 380
