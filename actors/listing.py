"""Pages of a List of sandboxes: newest first, filtered, and the cursor of the next
page (opaque to the caller; garbage is INVALID_ARGUMENT)."""

from __future__ import annotations

import base64
from collections.abc import Iterable

from actors.errors import InvalidArgument
from actors.model import State
from actors.principals import Principal
from actors.sandboxes.sandbox import Sandbox


def page(
    sandboxes: Iterable[Sandbox],
    *,
    state: State | None = None,
    labels: dict[str, str] | None = None,
    limit: int = 20,
    cursor: str = "",
    viewer: Principal | None = None,
) -> tuple[list[Sandbox], str]:
    """Newest first, filtered by state and labels (all must match) and what ``viewer``
    may see (None: all); a page of ``limit`` and the cursor of the next page ("" on
    the last)."""
    if not 1 <= limit <= 100:
        raise InvalidArgument("limit must be between 1 and 100")
    labels = labels or {}
    before = decode_cursor(cursor) if cursor else None
    matches = [
        sb
        for sb in sorted(sandboxes, key=lambda s: s.record.seq, reverse=True)
        if (state is None or sb.state == state)
        and all(sb.config.labels.get(k) == v for k, v in labels.items())
        and (before is None or sb.record.seq < before)
        and (viewer is None or viewer.may_see(sb.record.owner))
    ]
    found = matches[:limit]
    return found, encode_cursor(found[-1].record.seq) if len(matches) > limit else ""


def encode_cursor(seq: int) -> str:
    return base64.urlsafe_b64encode(f"seq:{seq}".encode()).decode()


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor.encode()).decode()
        kind, _, value = raw.partition(":")
        if kind != "seq" or not value.isdigit():
            raise ValueError
        return int(value)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument("invalid cursor") from None
