"""The client protocol's error codes (sandbox.v1's) and the exceptions that carry them.

Both ends raise :class:`ApiError`; the SDK raises the subclass named after the code
(:class:`NotFound`, :class:`InvalidArgument`, ...), all of them :class:`SandboxError`.
Stdlib only: the one-shot CLI imports this without an event loop or a converter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from guestd import codes
from guestd.codes import Code

# sandbox.v1's codes, from the one list (guestd/codes.py: stdlib only, which the SDK may import)
CODES = codes.CODES
INVALID_ARGUMENT = Code.INVALID_ARGUMENT.value
NOT_FOUND = Code.NOT_FOUND.value
ALREADY_EXISTS = Code.ALREADY_EXISTS.value
FAILED_PRECONDITION = Code.FAILED_PRECONDITION.value
RESOURCE_EXHAUSTED = Code.RESOURCE_EXHAUSTED.value
DEADLINE_EXCEEDED = Code.DEADLINE_EXCEEDED.value
INTERNAL = Code.INTERNAL.value
UNAVAILABLE = Code.UNAVAILABLE.value
UNIMPLEMENTED = Code.UNIMPLEMENTED.value
CANCELLED = Code.CANCELLED.value
PERMISSION_DENIED = Code.PERMISSION_DENIED.value  # a client the supervisor does not serve (peer credentials)


class ApiError(Exception):
    """An error with one of sandbox.v1's codes and a human message (both ends use it)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class SandboxError(ApiError):
    """Base of the SDK's errors; ``code`` is sandbox.v1's error code."""


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


def _code_of(cls: type[SandboxError]) -> str:
    """The code a class is named after: InvalidArgument -> INVALID_ARGUMENT."""
    return "".join(f"_{ch}" if ch.isupper() and i else ch for i, ch in enumerate(cls.__name__)).upper()


# one class per code (a test says so), found by their names
_ERRORS: dict[str, type[SandboxError]] = {_code_of(cls): cls for cls in SandboxError.__subclasses__()}


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
