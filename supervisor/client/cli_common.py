"""What every client command of the ``sandvisor`` CLI uses: argument helpers, the
connection (a plain blocking socket), and the runner of the commands written on Trio.

Stdlib only at import (a one-shot command loads no Trio, rich or attrs: tests/unit/test_frames.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager

from supervisor.wire.frames import BlockingConnection

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms; mypy reads the name)
if TYPE_CHECKING:
    from typing import Any


class UsageError(Exception):
    """A command-line mistake: one line, exit code 2."""


def kv(items: list[str] | None, what: str = "K=V") -> dict[str, str]:
    result = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"expected {what}, got {item!r}")
        result[k] = v
    return result


def tls_flag(text: str) -> bool:
    """``--tls-verify=false`` as podman and skopeo spell it."""
    v = text.lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def unix_ns(text: str) -> int:
    """A point in time for ``logs --since/--until``: unix nanoseconds, or an ISO 8601
    time (``2026-01-02T03:04:05Z``; without a zone: UTC)."""
    if text.isdigit():
        return int(text)
    import datetime

    try:
        t = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected unix ns or an ISO 8601 time, got {text!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.UTC)
    delta = t - datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    return max(0, (delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000)


def trailing_command(args: argparse.Namespace) -> list[str]:
    """The command after ``--`` (split off before argparse: see cli.main)."""
    return list(getattr(args, "cmd", None) or [])


@contextmanager
def connect(a: argparse.Namespace) -> Iterator[BlockingConnection]:
    with BlockingConnection.open(a.socket) as c:
        yield c


def configure_logging(verbose: bool) -> None:
    import logging

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def on_trio(fn: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]) -> Callable[[argparse.Namespace], int]:
    """A command written against the Trio SDK, run in its own event loop."""

    def run(a: argparse.Namespace) -> int:
        import trio

        configure_logging(getattr(a, "verbose", False))

        from supervisor.wire.errors import collapse_single

        with collapse_single():  # one error leaves as itself, for a one-line message
            return int(trio.run(fn, a))

    run.__name__ = run.__qualname__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run
