"""E2B's networking requests as the supervisor's create arguments
(the real SDK against real VMs with tap networking: tests/vm/test_e2b_net.py)."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.serve.e2b_http import HttpError
from supervisor.serve.e2b_net import network_of


def Egress(default: str = "allow", allow: tuple[str, ...] = (), deny: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"default": default, "allow": list(allow), "deny": list(deny)}


def test_default_is_internet_access_under_the_supervisors_denials() -> None:
    net = network_of({}, tap=True)
    assert net.kwargs == {"network": "tap", "egress": Egress()} and net.internet and not net.asked


def test_no_internet_access_is_a_deny_default_that_allow_out_still_opens() -> None:
    net = network_of({"allow_internet_access": False, "network": {"allowOut": ["1.1.1.1"]}}, tap=True)
    assert net.kwargs["egress"] == Egress(default="deny", allow=("1.1.1.1",))
    assert not net.internet and net.rules == {"allowOut": ["1.1.1.1"]}


def test_deny_out_all_traffic_is_the_default_and_allow_out_wins_over_deny_out() -> None:
    body = {"network": {"denyOut": ["0.0.0.0/0", "10.0.0.0/8", "a.test"], "allowOut": ["a.test"]}}
    net = network_of(body, tap=True)
    assert net.kwargs["egress"] == Egress(default="deny", allow=("a.test",), deny=("10.0.0.0/8",))
    assert not net.internet and net.asked
    only_deny = network_of({"network": {"denyOut": ["203.0.113.10"]}}, tap=True)
    assert only_deny.kwargs["egress"] == Egress(deny=("203.0.113.10",)) and only_deny.internet


def test_without_tap_the_default_has_no_network_and_asking_for_one_is_refused() -> None:
    net = network_of({}, tap=False)
    assert net.kwargs == {} and not net.internet and not net.asked
    assert network_of({"allow_internet_access": False}, tap=False).kwargs == {}
    for body in ({"allow_internet_access": True}, {"network": {"denyOut": ["0.0.0.0/0"]}}):
        with pytest.raises(HttpError, match="no tap networking") as err:
            network_of(body, tap=False)
        assert err.value.status == 400


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"network": {"dnsServers": ["1.1.1.1"]}}, "dnsServers"),
        ({"network": {"maskRequestHost": "x"}}, "maskRequestHost"),
        ({"network": {"allowPublicTraffic": True}}, "allowPublicTraffic"),
        ({"network": {"allowOut": "1.1.1.1"}}, "a list"),
        ({"network": {"denyOut": [""]}}, "a list"),
        ({"network": []}, "an object"),
        ({"allow_internet_access": "yes"}, "true or false"),
    ],
)
def test_bad_or_unserved_requests_are_400(body: dict[str, Any], why: str) -> None:
    with pytest.raises(HttpError, match=why) as err:
        network_of(body, tap=True)
    assert err.value.status == 400


# -- update_network ----------------------------------------------------------------------
def test_an_update_replaces_every_rule_as_e2b_does() -> None:
    from supervisor.serve.e2b_net import network_update

    cleared = network_update({}, tap=True)  # every field left out: internet access again
    assert cleared.kwargs["egress"] == Egress() and cleared.internet
    closed = network_update({"allow_internet_access": False, "allowOut": ["203.0.113.20"]}, tap=True)
    assert closed.kwargs["egress"] == Egress(default="deny", allow=("203.0.113.20",)) and not closed.internet
    assert closed.rules == {"allowOut": ["203.0.113.20"]}
    with pytest.raises(HttpError, match="dnsServers"):
        network_update({"dnsServers": ["1.1.1.1"]}, tap=True)
    with pytest.raises(HttpError, match="not fields"):
        network_update({"bogus": 1}, tap=True)
    # without tap networking: nothing to close, and nothing may be opened
    assert network_update({"allow_internet_access": False}, tap=False).kwargs == {}
    with pytest.raises(HttpError, match="no tap networking"):
        network_update({}, tap=False)
