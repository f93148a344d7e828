"""Signed file URLs: ``sb.download_url(path)`` and ``sb.upload_url(path)``, E2B's
``/files?path=...&username=...&signature=v1_...&signature_expiration=...``, fetched
(GET) or posted to (POST, multipart) by anyone holding the URL, with no key or token
in the request.

The SDK signs with the sandbox's access token: ``v1_`` and the unpadded base64 of
SHA-256 of ``path:operation:user:token`` (``:expiration`` when it has one; operation
``read`` for GET, ``write`` for POST; user "" for the default). The URL names no
sandbox (``E2B_SANDBOX_URL`` is the endpoint itself), so the endpoint finds it by the
signature: it checks it against each token it has handed out (:class:`~supervisor.
serve.e2b_keys.Tokens`, ``handed``), compared in constant time. The request then acts
for that token's key on that sandbox, for that one path, operation and user, as an
envd call with the token would. Refused (401): no match (a changed path, operation or
user, a token of a removed sandbox, a token of a previous supervisor run), an expired
``signature_expiration``; a signature without an expiration lasts as long as the
sandbox and the endpoint's run."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

from supervisor.serve.e2b_http import Exchange, HttpError
from supervisor.serve.e2b_keys import Tokens

OPERATIONS = {"GET": "read", "POST": "write"}


def signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{user}:{token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode("ascii")


def is_signed(ex: Exchange) -> bool:
    """A file URL the SDK signed (no key, no token, no sandbox header)."""
    return ex.path == "/files" and "signature" in ex.query and "e2b-sandbox-id" not in ex.headers


def opened(ex: Exchange, tokens: Tokens) -> tuple[str, str]:
    """(the sandbox id, the token) the signature was made with; 401 otherwise."""
    operation = OPERATIONS.get(ex.method)
    if operation is None:
        raise HttpError(405, "GET or POST")
    given = ex.query.get("signature", "")
    raw_exp = ex.query.get("signature_expiration")
    expiration = None
    if raw_exp is not None:
        if not raw_exp.isdigit() or len(raw_exp) > 12:
            raise HttpError(401, "invalid signature")
        expiration = int(raw_exp)
        if expiration < time.time():
            raise HttpError(401, "signature expired")
    path, user = ex.query.get("path", ""), ex.query.get("username", "")
    found = None
    for token, (sandbox, _uid) in list(tokens.handed.items()):
        if hmac.compare_digest(signature(path, operation, user, token, expiration).encode(), given.encode()):
            found = (sandbox, token)
    if found is None:
        raise HttpError(401, "invalid signature")
    return found
