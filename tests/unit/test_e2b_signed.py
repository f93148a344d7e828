"""Signed file URLs and file metadata on the E2B endpoint, without a VM: the endpoint's
signature is the SDK's, a URL opens only the sandbox whose token signed it, for its
path, operation and user, until it expires or the sandbox goes; metadata headers are
checked as envd checks them. (The real SDK against a real VM:
tests/vm/test_e2b_more.py::test_signed_file_urls, ::test_file_metadata_on_writes.)"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlencode

import pytest

from supervisor.serve.e2b_http import Exchange, HttpError
from supervisor.serve.e2b_keys import Key, Tokens
from supervisor.serve.e2b_meta import metadata_of
from supervisor.serve.e2b_signed import is_signed, opened, signature

UID = "0123456789abcdef0123456789abcdef"
OTHER_UID = "fedcba9876543210fedcba9876543210"


def exchange(method: str, query: dict[str, str], headers: dict[str, str] | None = None) -> Exchange:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(_: dict[str, Any]) -> None:
        pass

    scope = {
        "method": method,
        "path": "/files",
        "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
        "query_string": urlencode(query).encode(),
    }
    return Exchange(scope, receive, send)


def test_the_signature_is_the_sdks() -> None:
    get_signature = pytest.importorskip("e2b.sandbox.signature").get_signature
    for exp in (None, 60):
        sdk = get_signature("/home/user/a b.txt", "read", None, "tok", exp)
        assert signature("/home/user/a b.txt", "read", "", "tok", sdk["expiration"]) == sdk["signature"]


def test_a_url_opens_only_its_sandbox_path_operation_and_user() -> None:
    key = Key("agent", "k" * 32)
    tokens = Tokens([key])
    mine = tokens.mint(key, "sb-1", UID)
    tokens.mint(key, "sb-2", OTHER_UID)
    sig = signature("/tmp/x", "read", "", mine, None)
    ex = exchange("GET", {"path": "/tmp/x", "signature": sig})
    assert is_signed(ex) and opened(ex, tokens) == ("sb-1", mine)
    for method, query in (
        ("GET", {"path": "/tmp/y", "signature": sig}),  # another path
        ("POST", {"path": "/tmp/x", "signature": sig}),  # another operation
        ("GET", {"path": "/tmp/x", "username": "root", "signature": sig}),  # another user
        ("GET", {"path": "/tmp/x", "signature": "v1_forged"}),
    ):
        with pytest.raises(HttpError) as refused:
            opened(exchange(method, query), tokens)
        assert refused.value.status == 401
    past = int(time.time()) - 5
    expired = signature("/tmp/x", "read", "", mine, past)
    with pytest.raises(HttpError, match="expired"):
        opened(exchange("GET", {"path": "/tmp/x", "signature": expired, "signature_expiration": str(past)}), tokens)
    tokens.forget(UID)  # the sandbox was removed
    with pytest.raises(HttpError, match="invalid signature"):
        opened(ex, tokens)
    # a call with the sandbox header or no signature is not a signed URL
    assert not is_signed(exchange("GET", {"path": "/tmp/x", "signature": sig}, {"e2b-sandbox-id": "sb-1"}))
    assert not is_signed(exchange("GET", {"path": "/tmp/x"}))


def test_metadata_headers_are_checked_as_envd_checks_them() -> None:
    ex = exchange("POST", {}, {"X-Metadata-Owner": "agent 7", "X-Metadata-stage": "draft", "X-Other": "no"})
    assert metadata_of(ex) == {"owner": "agent 7", "stage": "draft"}
    with pytest.raises(HttpError, match="printable"):
        metadata_of(exchange("POST", {}, {"X-Metadata-k": "caf\u00e9".encode().decode("latin-1")}))
    with pytest.raises(HttpError, match="at most"):
        metadata_of(exchange("POST", {}, {f"X-Metadata-k{i}": "v" for i in range(65)}))
