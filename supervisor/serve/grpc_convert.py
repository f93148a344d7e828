"""Protobuf messages <-> the plain dicts our attrs wire classes structure from and unstructure to.

So both edges can share request/response classes (``supervisor.wire.protocol``, later the
domain's types) and the handler code behind them::

    pb.CreateSandboxRequest ──message_to_dict──► dict ──structure──► CreateSandboxRequest (attrs)
    pb.SandboxInfo ◄──dict_to_message── dict ◄──unstructure── SandboxInfo (attrs)

proto3 rules: scalars are always present (their zero value when unset), a message
field or a proto3 ``optional`` only when set (so the attrs default applies), a oneof
only as its set member. An extended sandvisor.v1 message's ``base`` (the embedded seed
message) is flattened into the top level, so ``sandvisor.v1.CreateRequest`` and
``sandbox.v1.CreateSandboxRequest`` both structure into one class. Keys a message
does not have (extensions sandbox.v1 lacks) are left out of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)
BASE = "base"


# descriptors are typed Any: the stubs give a union of the pure-Python and upb classes
def _is_repeated(f: Any) -> bool:
    return bool(f.is_repeated)


def _is_map(f: Any) -> bool:
    mt = f.message_type
    return mt is not None and _is_repeated(f) and bool(mt.GetOptions().map_entry)


def _map_values_are_messages(f: Any) -> bool:
    return bool(f.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE)


def message_to_dict(msg: Message, *, flatten_base: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base: dict[str, Any] = {}
    f: Any
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if _is_map(f):
            nested = _map_values_are_messages(f)
            out[f.name] = {k: (message_to_dict(v) if nested else v) for k, v in value.items()}
        elif _is_repeated(f):
            out[f.name] = [message_to_dict(v) if f.type == FieldDescriptor.TYPE_MESSAGE else v for v in value]
        elif f.has_presence and not msg.HasField(f.name):
            continue  # unset message, oneof member or optional: the attrs default applies
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            if flatten_base and f.name == BASE:
                base = message_to_dict(value)
            else:
                out[f.name] = message_to_dict(value)
        else:
            out[f.name] = value
    return {**base, **out}


def dict_to_message(data: Mapping[str, Any], cls: type[M]) -> M:
    msg = cls()
    _fill(msg, data)
    return msg


def _fill(msg: Message, data: Mapping[str, Any]) -> None:
    fields: Mapping[str, Any] = msg.DESCRIPTOR.fields_by_name
    base = fields.get(BASE)
    if base is not None and base.type == FieldDescriptor.TYPE_MESSAGE and BASE not in data:
        _fill(getattr(msg, BASE), {k: v for k, v in data.items() if k not in fields})
    for name, value in data.items():
        f = fields.get(name)
        if f is None or value is None:
            continue
        target = getattr(msg, name)
        if _is_map(f):
            nested = _map_values_are_messages(f)
            for k, v in value.items():
                if nested:
                    _fill(target[k], v)
                else:
                    target[k] = v
        elif _is_repeated(f):
            for v in value:
                if f.type == FieldDescriptor.TYPE_MESSAGE:
                    _fill(target.add(), v)
                else:
                    target.append(v)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            target.SetInParent()  # present even when all its fields are zero
            _fill(target, value)
        else:
            setattr(msg, name, value)
