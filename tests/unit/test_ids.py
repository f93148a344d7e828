"""Sandbox ids and labels as the API accepts them (actors/model.py)."""

from __future__ import annotations

import pytest

from actors.errors import DomainError
from actors.rules import check_id, check_labels


@pytest.mark.parametrize("bad", ["x" * 129, "é" * 65, "a\x00b", " padded", "tab\t"])
def test_bad_ids(bad: str) -> None:
    with pytest.raises(DomainError) as e:
        check_id(bad)
    assert e.value.code == "INVALID_ARGUMENT"


def test_good_ids_and_labels() -> None:
    check_id("x" * 128)
    check_id("é" * 64)
    check_labels({"team": "a", "sandboxing": "ok"})
    for bad in ({"sandbox.x": "1"}, {"sandvisor.y": ""}, {"": "v"}):
        with pytest.raises(DomainError):
            check_labels(bad)
