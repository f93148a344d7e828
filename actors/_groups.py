"""Exception groups at API boundaries.

Trio wraps every error that leaves a nursery in an ExceptionGroup. Our context
managers run their body inside a nursery (a reader task beside the caller), so a
caller's own ``BootError`` would come back wrapped. At such boundaries a group of
exactly one leaf is collapsed back into that leaf; a real multi-error group stays.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _leaves(e)
    else:
        yield exc


@contextmanager
def collapse_single() -> Iterator[None]:
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1:
            raise leaves[0] from leaves[0].__cause__
        raise
