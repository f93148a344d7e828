"""The error codes of sandbox.v1: the one list.

Every layer takes them from here: the domain's errors (actors/errors.py), the SDK's
exceptions and the wire's codes (supervisor/wire/errors.py; the SDK may import guestd's
stdlib-only modules, never the domain) and gRPC's status codes of the same names.
Stdlib only. guestd itself does not import it (enum would cost the guest's boot): its
Error codes (guestd/proto.py E_*) are these names and two of its own, a test says so.
"""

from __future__ import annotations

import enum


class Code(enum.StrEnum):
    """The error codes of sandbox.v1 (a ``str``: ``Code.NOT_FOUND == "NOT_FOUND"``)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the request is malformed
    NOT_FOUND = "NOT_FOUND"  # no such sandbox, snapshot, file
    ALREADY_EXISTS = "ALREADY_EXISTS"  # the id, port, file exists
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # not in a state that allows it
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # a limit or quota was reached
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the guest did not answer in time
    INTERNAL = "INTERNAL"  # a bug, or QEMU refused a step
    UNAVAILABLE = "UNAVAILABLE"  # the guest or supervisor went away
    UNIMPLEMENTED = "UNIMPLEMENTED"
    CANCELLED = "CANCELLED"
    PERMISSION_DENIED = "PERMISSION_DENIED"  # a client the supervisor does not serve (peer credentials)


CODES = frozenset(c.value for c in Code)
