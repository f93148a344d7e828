"""List cursors (actors/listing.py): round trips, and garbage is INVALID_ARGUMENT."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.errors import DomainError
from actors.listing import decode_cursor, encode_cursor


@given(st.integers(min_value=0, max_value=2**62))
def test_cursor_round_trip(seq: int) -> None:
    assert decode_cursor(encode_cursor(seq)) == seq


@given(st.text(max_size=30))
def test_garbage_cursors_are_invalid_argument(text: str) -> None:
    """Anything but a cursor the registry made is refused, typed."""
    import base64

    try:
        n = decode_cursor(text)
    except DomainError as e:
        assert e.code == "INVALID_ARGUMENT"
    else:  # accepted: then it must really be the encoding of "seq:N"
        assert base64.urlsafe_b64decode(text.encode()) == f"seq:{n}".encode(), text


def test_cursor_edge_cases_are_refused() -> None:
    import base64

    for raw in (b"seq:", b"seq:-1", b"seq:1x", b"other:5", b"seq", b"\xff\xfe"):
        with pytest.raises(DomainError):
            decode_cursor(base64.urlsafe_b64encode(raw).decode())
