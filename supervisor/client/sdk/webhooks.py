"""Check a webhook delivery in a listener: ``verify_webhook(secret, headers, body)`` (docs/webhooks.md)."""

from __future__ import annotations

from supervisor.wire.webhooks import (
    ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WebhookVerificationError,
    sign,
    signature,
    verify_webhook,
)

__all__ = [
    "ID_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "WebhookVerificationError",
    "sign",
    "signature",
    "verify_webhook",
]
