"""The socket protocol's bodies (supervisor/wire/protocol.py): envelopes and snapshot bodies round-trip
through msgpack, and wrong types are refused, never coerced."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.wire import protocol
from supervisor.wire.protocol import ApiError


@given(st.builds(protocol.Call, id=st.integers(1, 2**31), method=st.text(max_size=20), body=st.just({"id": "x"})))
def test_envelopes_round_trip(msg: protocol.Call) -> None:
    frame = protocol.encode(msg)
    assert protocol.decode(frame[4:]) == msg


def test_wrong_types_never_coerce() -> None:
    for body in ({"id": 1}, {"id": "a", "ttl_seconds": "3"}, {"id": "a", "labels": {"k": 1}}, {"id": "a", "cmd": "sh"}):
        with pytest.raises(ApiError) as e:
            protocol.structure_body(body, protocol.CreateSandboxRequest)
        assert e.value.code == "INVALID_ARGUMENT"


_text = st.text(max_size=30)


_labels = st.dictionaries(_text, _text, max_size=3)


@given(
    st.one_of(
        st.builds(protocol.CheckpointRequest, sandbox_id=_text, name=_text, labels=_labels),
        st.builds(
            protocol.RestoreRequest,
            snapshot_id=_text,
            id=_text,
            labels=_labels,
            network_override=st.booleans(),
            ttl_seconds=st.integers(0, 2**31),
        ),
        st.builds(protocol.ListSnapshotsRequest, sandbox_id=_text, labels=_labels),
        st.builds(
            protocol.SnapshotSummary,
            id=_text,
            sandbox_id=_text,
            name=_text,
            labels=_labels,
            snapshot_dir=_text,
            created_at=_text,
            size_bytes=st.integers(0, 2**40),
            memory=st.sampled_from(["mapped", "streamed"]),
        ),
        st.builds(protocol.DeleteSnapshotRequest, snapshot_id=_text),
    )
)
def test_snapshot_bodies_round_trip(body: object) -> None:
    raw = msgpack.unpackb(msgpack.packb(protocol.unstructure_body(body)), raw=False)
    assert protocol.structure_body(raw, type(body)) == body


def test_snapshot_requests_never_coerce() -> None:
    for body in ({"snapshot_id": 5}, {"snapshot_id": "s", "ttl_seconds": "9"}, {"snapshot_id": "s", "labels": []}):
        with pytest.raises(ApiError) as e:
            protocol.structure_body(body, protocol.RestoreRequest)
        assert e.value.code == "INVALID_ARGUMENT"
