"""Webhook signatures (docs/webhooks.md): how the supervisor signs a delivery, how a listener checks it
(an SDK user imports it from ``supervisor.client.sdk.webhooks``).

A delivery is ``POST`` of a JSON body with the header::

    Sandvisor-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>

(Stripe's scheme). :func:`verify_webhook` checks it in constant time, refuses a ``t``
more than ``tolerance`` seconds from now (a replay), and returns the event. Several
``v1=`` entries may be given (any one that matches will do). Stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from typing import Any

SIGNATURE_HEADER = "Sandvisor-Signature"
ID_HEADER = "Sandvisor-Webhook-Id"
TIMESTAMP_HEADER = "Sandvisor-Webhook-Timestamp"
TOLERANCE = 300  # seconds


class WebhookVerificationError(ValueError):
    """The delivery is not signed by the secret (or is too old, or malformed)."""


def _key(secret: bytes | str) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def signature(secret: bytes | str, timestamp: int, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``"<timestamp>." + body`` under ``secret``."""
    return hmac.new(_key(secret), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def sign(secret: bytes | str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The signature headers of a delivery of ``body`` at ``timestamp`` (now when None)."""
    t = int(time.time()) if timestamp is None else timestamp
    return {SIGNATURE_HEADER: f"t={t},v1={signature(secret, t, body)}", TIMESTAMP_HEADER: str(t)}


def verify_webhook(
    secret: bytes | str,
    headers: Mapping[str, str],
    body: bytes,
    tolerance: float = TOLERANCE,
    now: float | None = None,
) -> dict[str, Any]:
    """The event of a delivery whose ``Sandvisor-Signature`` header (any case) matches
    ``body`` under ``secret`` and whose ``t`` is within ``tolerance`` seconds of ``now``;
    :class:`WebhookVerificationError` otherwise. ``body``: the raw bytes as received."""
    value = next((v for k, v in headers.items() if k.lower() == SIGNATURE_HEADER.lower()), None)
    if value is None:
        raise WebhookVerificationError(f"no {SIGNATURE_HEADER} header")
    t: int | None = None
    sigs: list[str] = []
    for part in value.split(","):
        k, _, v = part.strip().partition("=")
        if k == "t":
            try:
                t = int(v)
            except ValueError:
                raise WebhookVerificationError("the signature's t is not a number") from None
        elif k == "v1":
            sigs.append(v)
    if t is None or not sigs:
        raise WebhookVerificationError("the signature header has no t= or no v1=")
    expected = signature(secret, t, body)
    if not any(hmac.compare_digest(expected.encode(), s.encode()) for s in sigs):
        raise WebhookVerificationError("the signature does not match the body and secret")
    if abs((time.time() if now is None else now) - t) > tolerance:
        raise WebhookVerificationError(f"the signature's timestamp is more than {tolerance} s away")
    event = json.loads(body)
    if not isinstance(event, dict):
        raise WebhookVerificationError("the body is not a JSON object")
    return event
