"""The client protocol's error codes (the seed's) and the exceptions that carry them.

Both ends raise :class:`ApiError`; the SDK raises the subclass named after the code
(:class:`NotFound`, :class:`InvalidArgument`, ...), all of them :class:`SandboxError`.
Stdlib only: the one-shot CLI imports this without an event loop or a converter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

INVALID_ARGUMENT = "INVALID_ARGUMENT"
NOT_FOUND = "NOT_FOUND"
ALREADY_EXISTS = "ALREADY_EXISTS"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
INTERNAL = "INTERNAL"
UNAVAILABLE = "UNAVAILABLE"
UNIMPLEMENTED = "UNIMPLEMENTED"
CANCELLED = "CANCELLED"
PERMISSION_DENIED = "PERMISSION_DENIED"  # a client the supervisor does not serve (peer credentials)
CODES = frozenset(
    {
        INVALID_ARGUMENT,
        NOT_FOUND,
        ALREADY_EXISTS,
        FAILED_PRECONDITION,
        RESOURCE_EXHAUSTED,
        DEADLINE_EXCEEDED,
        INTERNAL,
        UNAVAILABLE,
        UNIMPLEMENTED,
        CANCELLED,
        PERMISSION_DENIED,
    }
)


class ApiError(Exception):
    """An error with one of the seed's codes and a human message (both ends use it)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class SandboxError(ApiError):
    """Base of the SDK's errors; ``code`` is the seed's error code."""


class InvalidArgument(SandboxError):
    pass


class NotFound(SandboxError):
    pass


class AlreadyExists(SandboxError):
    pass


class FailedPrecondition(SandboxError):
    pass


class ResourceExhausted(SandboxError):
    pass


class DeadlineExceeded(SandboxError):
    pass


class Internal(SandboxError):
    pass


class Unavailable(SandboxError):
    pass


class Unimplemented(SandboxError):
    pass


class Cancelled(SandboxError):
    pass


class PermissionDenied(SandboxError):
    pass


_ERRORS: dict[str, type[SandboxError]] = {
    INVALID_ARGUMENT: InvalidArgument,
    NOT_FOUND: NotFound,
    ALREADY_EXISTS: AlreadyExists,
    FAILED_PRECONDITION: FailedPrecondition,
    RESOURCE_EXHAUSTED: ResourceExhausted,
    DEADLINE_EXCEEDED: DeadlineExceeded,
    INTERNAL: Internal,
    UNAVAILABLE: Unavailable,
    UNIMPLEMENTED: Unimplemented,
    CANCELLED: Cancelled,
    PERMISSION_DENIED: PermissionDenied,
}


def error_for(code: str, message: str) -> SandboxError:
    """The SDK's exception for a code from the wire (an unknown code: SandboxError)."""
    return _ERRORS.get(code, SandboxError)(code, message)


# --- exception groups at the API boundary ------------------------------------------------
def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _leaves(e)
    else:
        yield exc


@contextmanager
def collapse_single() -> Iterator[None]:
    """Trio wraps whatever leaves a nursery in an ExceptionGroup; a connection runs its
    body beside a reader task, so a caller's own ``NotFound`` would come back wrapped.
    Here a group of exactly one leaf is collapsed back into that leaf (a real
    multi-error group stays). The same as ``actors._groups``, which the SDK must not
    import (the SDK depends on the wire modules only)."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1:
            raise leaves[0] from leaves[0].__cause__
        raise
