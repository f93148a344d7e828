"""The gRPC services of ``sandvisor serve``: the ``sandbox.v1`` contract as it is, and our ``sandvisor.v1``.

No handler is written here: every RPC is bound to a method of the table both edges
serve (:data:`supervisor.serve.api.METHODS`), whose handlers take and return the attrs
classes of :mod:`supervisor.wire.protocol`. This module only converts::

    seed client --HTTP/2--> GrpcEdge (grpc_bridge) --> shim of the RPC (Trio task):
        pb request --message_to_dict--> dict --prepare (sandvisor.v1 Create)--> proto3 zeros
        dropped where our default differs --structure (the msgpack edge's converter)-->
        request --METHODS[name].handler(registry, io, request)--> response | io.send(item)
        --unstructure--> dict --dict_to_message--> pb response | pb item

Proto3 zero values: an unset scalar reads as its zero value, so "" and 0 mean "the
default" here. The table's request classes mostly default to zero already; where they
do not (a terminal of 80x24, MetricsStream's interval of 1 s, protocol "tcp"), a zero
from a protobuf message is dropped before structuring so the class's default applies.
Unset messages and proto3 ``optional`` fields are absent (their class default, or
None: so ``ssh_public_key`` set to "" is a key that is not there, refused).

Streams: Run, Events, ReadFile, Logs and MetricsStream send with ``io.send``; Exec and
WriteFile read their first message as the request and the rest with ``io.receive``
(None at the client's half-close: Exec's end of stdin). A client cancel or a deadline
cancels the handler's Trio task (grpc_bridge), which kills a Run's or an Exec's
process in the guest as a msgpack ``Cancel`` does.

Principals: each call's (docs/security.md) is its client certificate's ``cert:<CN>``,
its bearer token's ``token:<label>`` (TCP), or its peer credentials' ``uid:N`` (a Unix
socket, through the relay): :func:`call_principal`, given to the handler as
``io.principal``.

Errors: the handlers raise domain errors (:mod:`actors.errors`) or, for malformed
requests, ``ApiError(INVALID_ARGUMENT)``; both carry a ``code`` that is a status code's
name, which the edge sends as that status with the message.

What sandbox.v1 cannot say (sandvisor.v1.CreateRequest's idle timeout, hostname,
ephemeral, ports at create, outbound networking; paging; logs, metrics, ping, touch,
start, kill, drain, ports, images) is in ``SandvisorService``, on the same sandboxes.
A seed client's ``network.mode`` is "" or "none" (no network: ExposePort is then
FAILED_PRECONDITION, naming what to do) or "tap" (FAILED_PRECONDITION until tap
networking lands); "user" is our mode, which sandvisor.v1 documents.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import attrs
from google.protobuf import message_factory
from google.protobuf.message import Message

from actors.face import V1_STATE, InvalidArgument, PermissionDenied, Principal, Registry, State, Unimplemented
from supervisor.serve import grpc_bridge
from supervisor.serve.api import METHODS
from supervisor.serve.api_store import SERVICES
from supervisor.serve.api_table import Method
from supervisor.serve.grpc_addresses import Address, TcpAddress, TlsConfig, UnixAddress, parse_address
from supervisor.serve.grpc_auth import TcpAuth, check_tcp_auth, read_grpc_tokens
from supervisor.serve.grpc_convert import dict_to_message, message_to_dict
from supervisor.serve.peers import ClientPolicy, Peer
from supervisor.wire import protocol
from supervisor.wire.proto.sandbox.v1 import sandbox_pb2
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2

SANDBOX, SNAPSHOTS, SANDVISOR = SERVICES
Prepare = Callable[[dict[str, Any]], dict[str, Any]]


@attrs.frozen
class Rpc:
    """An RPC of a service and the table method that serves it (None: not available yet)."""

    name: str
    method: str | None
    prepare: Prepare | None = None  # request dict fix-ups before structuring
    why: str = ""  # what an UNIMPLEMENTED says
    reply: Prepare | None = None  # response dict fix-ups before the message is filled


def _sandvisor_create(d: dict[str, Any]) -> dict[str, Any]:
    """sandvisor.v1.CreateRequest: ``outbound`` and ``egress`` are fields of the network."""
    if d.pop("outbound", False):
        d["network"] = {**d.get("network", {}), "outbound": True}
    if "egress" in d:  # (a field of the network, as on the msgpack edge)
        d["network"] = {**d.get("network", {}), "egress": d.pop("egress")}
    return d


def _sandvisor_config(d: dict[str, Any]) -> dict[str, Any]:
    """SandboxConfig's CreateRequest: ``outbound`` and ``egress`` are its own fields
    (the msgpack edge keeps them in the network), as in a Create."""
    cfg = d.get("config") or {}
    net = cfg.get("network") or {}
    if net.pop("outbound", False):
        cfg["outbound"] = True
    if net.get("egress") is not None:
        cfg["egress"] = net.pop("egress")
    return d


def _detachable(d: dict[str, Any]) -> dict[str, Any]:
    """sandvisor.v1 ExecDetachable's first message: sandbox.v1's init, detachable."""
    if "init" in d:
        d["init"] = {**d["init"], "detachable": True}
    return d


def _v1_state(d: dict[str, Any]) -> dict[str, Any]:
    """sandbox.v1's word for our states it lacks (draining: stopping; crashed: failed)."""
    state = d.get("state")
    return {**d, "state": V1_STATE.get(State(state), state)} if state in V1_STATE else d


def _v1_states(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "sandboxes": [_v1_state(x) for x in d.get("sandboxes") or []]}


_BUILDS = "images are built on the supervisor's host: sandvisor image build"

BINDINGS: dict[str, tuple[Rpc, ...]] = {
    SANDBOX: (
        Rpc("Create", "Create"),
        Rpc("Run", "Run"),
        Rpc("Exec", "Exec"),
        Rpc("Stop", "Stop"),
        Rpc("Remove", "Remove"),
        Rpc("Inspect", "Inspect", reply=_v1_state),
        Rpc("List", "ListAll", reply=_v1_states),  # sandbox.v1's List has no paging: every match
        Rpc("Events", "Events"),
        Rpc("ReadFile", "ReadFile"),
        Rpc("WriteFile", "WriteFile"),
        Rpc("ExposePort", "ExposePort"),
        Rpc("UnexposePort", "UnexposePort"),
    ),
    SNAPSHOTS: (
        Rpc("Checkpoint", "Checkpoint"),
        Rpc("Restore", "Restore"),
        Rpc("ListSnapshots", "ListSnapshots"),
        Rpc("DeleteSnapshot", "DeleteSnapshot"),
    ),
    SANDVISOR: (
        Rpc("Info", "Info"),
        Rpc("Create", "Create", prepare=_sandvisor_create),
        Rpc("Start", "Start"),
        Rpc("Kill", "Kill"),
        Rpc("Drain", "Drain"),
        Rpc("WaitUntilStopped", "WaitUntilStopped"),
        Rpc("List", "List"),
        Rpc("Logs", "Logs"),
        Rpc("Metrics", "Metrics"),
        Rpc("MetricsStream", "MetricsStream"),
        Rpc("Ping", "Ping"),
        Rpc("Touch", "Touch"),
        Rpc("SetTtl", "SetTtl"),
        Rpc("ListPorts", "ListPorts"),
        Rpc("Checkpoint", "Checkpoint"),
        Rpc("ListSnapshots", "ListSnapshots"),
        Rpc("ListImages", "ListImages"),
        Rpc("InspectImage", "InspectImage"),
        Rpc("BuildImage", None, why=_BUILDS),
        Rpc("DeleteImage", None, why=_BUILDS),
        Rpc("PullImage", "PullImage"),
        Rpc("RemoveImage", "RemoveImage"),
        Rpc("PruneImages", "PruneImages"),
        Rpc("InspectOciImage", "InspectOciImage"),
        Rpc("CreateVolume", "CreateVolume"),
        Rpc("InspectVolume", "InspectVolume"),
        Rpc("ListVolumes", "ListVolumes"),
        Rpc("DeleteVolume", "DeleteVolume"),
        Rpc("ReadTree", "ReadTree"),
        Rpc("WriteTree", "WriteTree"),
        Rpc("Run", "Run"),
        Rpc("FsList", "FsList"),
        Rpc("FsStat", "FsStat"),
        Rpc("FsExists", "FsExists"),
        Rpc("FsMkdir", "FsMkdir"),
        Rpc("FsRemove", "FsRemove"),
        Rpc("FsRename", "FsRename"),
        Rpc("ExportSnapshot", "ExportSnapshot"),
        Rpc("ImportSnapshot", "ImportSnapshot"),
        Rpc("Pause", "Pause"),
        Rpc("Resume", "Resume"),
        Rpc("Modify", "Modify"),
        Rpc("Inspect", "Inspect"),
        Rpc("SetSecret", "SetSecret"),
        Rpc("ListSecrets", "ListSecrets"),
        Rpc("DeleteSecret", "DeleteSecret"),
        Rpc("RotateSecret", "RotateSecret"),
        Rpc("RevokeSecret", "RevokeSecret"),
        Rpc("ListSandboxSecrets", "ListSandboxSecrets"),
        Rpc("Config", "Config", reply=_sandvisor_config),
        Rpc("SshEndpoint", "SshEndpoint"),
        Rpc("ExecDetachable", "Exec", prepare=_detachable),
        Rpc("Attach", "Attach", prepare=lambda d: dict(d.get("attach") or {})),
        Rpc("RequestStop", "RequestStop"),
        Rpc("RequestKill", "RequestKill"),
        Rpc("WaitUntilStoppedResult", "WaitUntilStopped"),
        Rpc("Fork", "Fork"),
        Rpc("Diff", "Diff"),
        # the code interpreter (supervisor.serve.api_code)
        Rpc("RunCode", "RunCode"),
        Rpc("CreateCodeContext", "CreateCodeContext"),
        Rpc("ListCodeContexts", "ListCodeContexts"),
        Rpc("RestartCodeContext", "RestartCodeContext"),
        Rpc("RemoveCodeContext", "RemoveCodeContext"),
    ),
}


def descriptors() -> dict[str, Any]:
    """The service descriptors, by full name (sandbox.v1's are the vendored proto's)."""
    return {
        SANDBOX: sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"],
        SNAPSHOTS: sandbox_pb2.DESCRIPTOR.services_by_name["SandboxSnapshotService"],
        SANDVISOR: sandvisor_pb2.DESCRIPTOR.services_by_name["SandvisorService"],
    }


# ---------------------------------------------------------------------------------------
# protobuf <-> the table's classes
# ---------------------------------------------------------------------------------------
_SCALARS = (bool, int, float, str, bytes)


def _attrs_class(t: Any) -> tuple[type | None, bool]:
    """The attrs class a field holds (directly, optionally or as a list's items) and
    whether it is a list; (None, False) for anything else."""
    origin = get_origin(t)
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(t) if a is not type(None)]
        return _attrs_class(members[0]) if len(members) == 1 else (None, False)
    if origin is list:
        cls, _ = _attrs_class(get_args(t)[0])
        return cls, cls is not None
    return (t, False) if isinstance(t, type) and attrs.has(t) else (None, False)


@functools.cache
def _zero_plan(cls: type) -> tuple[dict[str, Any], dict[str, tuple[type, bool]]]:
    """For ``cls``: the scalar fields whose default is not their type's zero (name -> that
    zero), and the fields holding attrs classes (name -> (class, is a list))."""
    attrs.resolve_types(cls)
    zeros: dict[str, Any] = {}
    nested: dict[str, tuple[type, bool]] = {}
    for f in attrs.fields(cls):
        sub, many = _attrs_class(f.type)
        if sub is not None:
            nested[f.name] = (sub, many)
            continue
        default = f.default
        if isinstance(default, _SCALARS) and default != type(default)():
            zeros[f.name] = type(default)()
    return zeros, nested


def zeros_to_defaults(data: dict[str, Any], cls: type) -> dict[str, Any]:
    """Drop proto3 zero values where ``cls`` has another default (``data`` is changed)."""
    zeros, nested = _zero_plan(cls)
    for name, zero in zeros.items():
        if name in data and type(data[name]) is type(zero) and data[name] == zero:
            del data[name]
    for name, (sub, many) in nested.items():
        value = data.get(name)
        if value is None:
            continue
        if many:
            for item in value:
                zeros_to_defaults(item, sub)
        else:
            zeros_to_defaults(value, sub)
    return data


def to_request(msg: Message, cls: type, prepare: Prepare | None = None) -> Any:
    """A protobuf request as the table's class (INVALID_ARGUMENT if it does not fit)."""
    data = message_to_dict(msg)
    if prepare is not None:
        data = prepare(data)
    return protocol.structure_body(zeros_to_defaults(data, cls), cls)


def to_message(value: Any, cls: type[Message], reply: Prepare | None = None) -> Message:
    """A table response as protobuf ``cls`` (None: the empty message). Fields ``cls`` lacks
    are left out; a seed message embedded as ``base`` is filled from the top level."""
    if value is None:
        return cls()
    data = protocol.unstructure_body(value)
    return dict_to_message(reply(data) if reply is not None else data, cls)


def call_principal(call: grpc_bridge.Call[Any, Any], auth: TcpAuth, unix_peers: Mapping[str, Principal]) -> Principal:
    """Who makes ``call`` (the gate let it in: TcpGate on TCP, the relay on a Unix socket)."""
    kind, _, name = call.peer.partition(":")
    if kind == "unix-abstract":  # through the relay: the peer credentials it read
        p = unix_peers.get(name)
        if p is None:
            raise PermissionDenied("peer credentials unavailable")
        return p
    if kind == "unix":  # a socket with no peer policy: its file mode alone let the caller in
        return Principal.uid(os.geteuid(), admin=True)
    # (only a verifying address asks for a certificate: one present was verified); its
    # common name, else its first subject alternative name
    names = call.auth.get("x509_common_name") or call.auth.get("x509_subject_alternative_name")
    if names:
        return auth.cert_principal(names[0].decode(errors="replace"))
    value = call.metadata_value("authorization")
    if value is not None:
        token = auth.bearer(value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape"))
        if token is not None:
            return token.principal
    if auth.insecure:
        return Principal("insecure:loopback", admin=True)
    raise PermissionDenied("no principal: a client certificate or a bearer token is needed")


class GrpcIO:
    """A gRPC call as the table's :class:`~supervisor.serve.api.CallIO`."""

    __slots__ = ("call", "inputs", "out", "principal")

    def __init__(
        self, call: grpc_bridge.Call[Any, Any], out: type[Message], inputs: type | None, principal: Principal
    ) -> None:
        self.call = call
        self.out = out
        self.inputs = inputs
        self.principal = principal

    async def send(self, message: Any) -> None:
        await self.call.send(to_message(message, self.out))

    async def receive(self) -> Any | None:
        msg = await self.call.receive()
        if msg is None:
            return None
        assert self.inputs is not None
        return to_request(msg, self.inputs)


def _check_shape(path: str, rpc: Any, m: Method) -> None:
    if rpc.server_streaming != m.streams or rpc.client_streaming != (m.inputs is not None):
        raise TypeError(f"{path}: the RPC's streams do not match method {m.name}")


def _unimplemented(service: str, rpc: Any, why: str) -> grpc_bridge.Method:
    async def refuse(*_: Any) -> None:
        raise Unimplemented(f"{rpc.name}: {why}")

    return grpc_bridge.Method(
        service, rpc.name, grpc_bridge.Kind.of(rpc.client_streaming, rpc.server_streaming), refuse
    )


Who = Callable[[grpc_bridge.Call[Any, Any]], Principal]


def bind(registry: Registry, service: str, rpc: Any, binding: Rpc, who: Who) -> grpc_bridge.Method:
    """The edge's method for one RPC: convert, call the table's handler (as ``who`` says
    the caller is), convert back."""
    if binding.method is None:
        return _unimplemented(service, rpc, binding.why)
    m = METHODS[binding.method]
    path = f"/{service}/{rpc.name}"
    _check_shape(path, rpc, m)
    req_cls = message_factory.GetMessageClass(rpc.input_type)
    out_cls = message_factory.GetMessageClass(rpc.output_type)
    kind = grpc_bridge.Kind.of(rpc.client_streaming, rpc.server_streaming)
    handler, request, prepare = m.handler, m.request, binding.prepare
    handle: grpc_bridge.Handler

    if not rpc.client_streaming:

        async def unary_in(msg: Message, call: grpc_bridge.Call[Any, Any]) -> Message | None:
            io = GrpcIO(call, out_cls, None, who(call))
            result = await handler(registry, io, to_request(msg, request, prepare))
            return None if rpc.server_streaming else to_message(result, out_cls, binding.reply)

        handle = unary_in
    else:

        async def stream_in(call: grpc_bridge.Call[Any, Any]) -> Message | None:
            first = await call.receive()
            if first is None:
                raise InvalidArgument(f"{rpc.name} needs a first message")
            io = GrpcIO(call, out_cls, m.inputs, who(call))
            result = await handler(registry, io, to_request(first, request, prepare))
            return None if rpc.server_streaming else to_message(result, out_cls)

        handle = stream_in
    return grpc_bridge.Method(
        service,
        rpc.name,
        kind,
        handle,
        request_deserializer=req_cls.FromString,
        response_serializer=out_cls.SerializeToString,
    )


def add_services(edge: grpc_bridge.GrpcEdge, registry: Registry) -> None:
    """Serve sandbox.v1 and sandvisor.v1 on ``edge``; every RPC of each is bound."""

    def who(call: grpc_bridge.Call[Any, Any]) -> Principal:
        return call_principal(call, edge.tcp_auth, edge.unix_peers)

    for name, desc in descriptors().items():
        bindings = {b.name: b for b in BINDINGS[name]}
        missing = [r.name for r in desc.methods if r.name not in bindings]
        if missing:
            raise TypeError(f"{name}: no binding for {', '.join(missing)}")
        edge.add_methods(name, [bind(registry, name, rpc, bindings[rpc.name], who) for rpc in desc.methods])


# ---------------------------------------------------------------------------------------
# the daemon's configuration
# ---------------------------------------------------------------------------------------
@attrs.frozen
class ServePolicy:
    """The msgpack socket's :class:`~supervisor.serve.peers.ClientPolicy` as the gRPC edge's
    :class:`~supervisor.serve.grpc_addresses.PeerPolicy`: one rule for both sockets."""

    policy: ClientPolicy

    def check(self, sock: Any) -> str | None:
        return self.policy.refusal(Peer.of(sock))

    def principal(self, sock: Any) -> Principal:
        return self.policy.principal(Peer.of(sock))

    def served(self) -> str:
        p = self.policy
        who = "root" if p.owner == 0 else f"root and uid {p.owner}"
        also = f" and members of group {p.group_name!r}" if p.group is not None else ""
        return f"peer credentials refused: this supervisor serves {who}{also} only"


def addresses(
    specs: Iterable[str],
    *,
    cert: Path | None = None,
    key: Path | None = None,
    client_ca: Path | None = None,
    group: str | None = None,
    admin_group: str | None = None,
    auth: TcpAuth | None = None,
) -> list[Address]:
    """``serve --grpc`` addresses: Unix sockets get ``group`` and the peer-credential policy
    of the msgpack socket, TCP ones the TLS files (required off loopback) and must
    authenticate clients (``client_ca`` or ``auth``: :func:`tcp_auth`). ValueError names
    what is wrong."""
    specs = list(specs)
    if bool(cert) != bool(key):
        raise ValueError("--grpc-cert and --grpc-key go together")
    if client_ca and not cert:
        raise ValueError("--grpc-client-ca needs --grpc-cert and --grpc-key")
    tls = TlsConfig.from_files(cert, key, client_ca) if cert and key else None
    try:
        policy = ServePolicy(ClientPolicy.for_serve(group, admin_group))
    except KeyError:
        raise ValueError(f"--group {group!r} or --admin-group {admin_group!r}: no such group") from None
    out = [parse_address(s, tls=tls, group=group) for s in specs]
    out = [attrs.evolve(a, policy=policy) if isinstance(a, UnixAddress) else a for a in out]
    if tls is not None and not any(isinstance(a, TcpAddress) for a in out):
        raise ValueError("--grpc-cert is for HOST:PORT addresses; none is given")
    check_tcp_auth(out, auth)
    return out


def tcp_auth(token_file: Path | None = None, insecure: bool = False, admin_cns: Sequence[str] = ()) -> TcpAuth | None:
    """``serve --grpc-token-file`` (read now, once), ``--grpc-insecure`` and
    ``--grpc-admin-cert-cn`` as the edge's :class:`~supervisor.serve.grpc_auth.TcpAuth` (None:
    none of them). ValueError names what is wrong."""
    if token_file is None and not insecure and not admin_cns:
        return None
    tokens = read_grpc_tokens(token_file) if token_file else ()
    return TcpAuth(insecure=insecure, tokens=tokens, admin_cns=frozenset(admin_cns) if admin_cns else None)


def build_edge(registry: Registry, addrs: Sequence[Address], **options: Any) -> grpc_bridge.GrpcEdge:
    """The daemon's gRPC edge: both protos' services, health and reflection."""
    edge = grpc_bridge.GrpcEdge(addrs, **options)
    add_services(edge, registry)
    return edge
