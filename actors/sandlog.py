"""A sandbox's own log level for the supervisor's lines about it (``log_level``,
``quiet_logs`` of its configuration; guestd applies the same to its diagnostics).

The supervisor's log calls about a sandbox name it first (``log.warning("sandbox %s
...", sb.id, ...)``), or carry it as ``extra={"sandbox": id}``; :class:`SandboxLogFilter`
finds the sandbox by that id and drops the record below the sandbox's level. A level
below the supervisor's own (``serve -v``) shows nothing more: the loggers' level
decides before any filter. Installed on the root logger's handlers for one serve
(:func:`filtering`): a filter on a logger would not see its children's records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from actors.model import SandboxConfig

TRACE = 5
LEVELS = {
    "trace": TRACE,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}
Lookup = Callable[[str], SandboxConfig | None]


def threshold(config: SandboxConfig) -> int | None:
    """The lowest level of the sandbox's lines that are logged (None: the supervisor's)."""
    level = "off" if config.quiet_logs else config.log_level
    return LEVELS.get(level) if level else None


class SandboxLogFilter(logging.Filter):
    """Drops a record about a sandbox below that sandbox's level; every other passes."""

    def __init__(self, lookup: Lookup) -> None:
        super().__init__()
        self.lookup = lookup

    def filter(self, record: logging.LogRecord) -> bool:
        sid = getattr(record, "sandbox", None)
        if not isinstance(sid, str):
            args = record.args
            if not (isinstance(args, tuple) and args and isinstance(args[0], str)):
                return True
            sid = args[0]
        config = self.lookup(sid)
        if config is None:
            return True
        level = threshold(config)
        return level is None or record.levelno >= level


@contextmanager
def filtering(lookup: Lookup) -> Iterator[SandboxLogFilter]:
    """:class:`SandboxLogFilter` on the root logger's handlers while the block runs."""
    f = SandboxLogFilter(lookup)
    handlers = list(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(f)
    try:
        yield f
    finally:
        for h in handlers:
            h.removeFilter(f)
