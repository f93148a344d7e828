"""Domain errors: every failure a caller can cause or see carries one of sandbox.v1's codes.

The domain raises these; each edge (the msgpack socket, gRPC) maps :class:`Code` to
its wire's code of the same name. Nothing here knows a wire.

Error tree::

    DomainError                 code
     +-- InvalidArgument        INVALID_ARGUMENT      the request is malformed
     +-- NotFound               NOT_FOUND             no such sandbox, snapshot, file
     +-- AlreadyExists          ALREADY_EXISTS        the id, port, file exists
     +-- FailedPrecondition     FAILED_PRECONDITION   not in a state that allows it
     +-- ResourceExhausted      RESOURCE_EXHAUSTED    a limit or quota was reached
     +-- DeadlineExceeded       DEADLINE_EXCEEDED     the guest did not answer in time
     +-- Unavailable            UNAVAILABLE           the guest or supervisor went away
     +-- Internal               INTERNAL              a bug, or QEMU refused a step
     +-- Cancelled              CANCELLED
     +-- PermissionDenied       PERMISSION_DENIED     a client the supervisor does not serve
"""

from __future__ import annotations

from typing import ClassVar

from guestd import codes

Code = codes.Code  # sandbox.v1's error codes: the one list is guestd/codes.py


class DomainError(Exception):
    """A failure with a code and a message for humans."""

    code: ClassVar[Code] = Code.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(f"{self.code}: {message}")
        self.message = message


class InvalidArgument(DomainError):
    code = Code.INVALID_ARGUMENT


class NotFound(DomainError):
    code = Code.NOT_FOUND


class AlreadyExists(DomainError):
    code = Code.ALREADY_EXISTS


class FailedPrecondition(DomainError):
    code = Code.FAILED_PRECONDITION


class ResourceExhausted(DomainError):
    code = Code.RESOURCE_EXHAUSTED


class DeadlineExceeded(DomainError):
    code = Code.DEADLINE_EXCEEDED


class Unavailable(DomainError):
    code = Code.UNAVAILABLE


class Internal(DomainError):
    code = Code.INTERNAL


class Unimplemented(DomainError):
    code = Code.UNIMPLEMENTED


class Cancelled(DomainError):
    code = Code.CANCELLED


class PermissionDenied(DomainError):
    code = Code.PERMISSION_DENIED


BY_CODE: dict[Code, type[DomainError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        DeadlineExceeded,
        Unavailable,
        Internal,
        Unimplemented,
        Cancelled,
        PermissionDenied,
    )
}


def error(code: Code, message: str) -> DomainError:
    return BY_CODE[code](message)
