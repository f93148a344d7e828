"""Acting for another principal: what the SDK's connections say in their hello.

An admin client (root, the supervisor's uid, ``serve --admin-group``) may open its
connections for another principal (docs/security.md): the supervisor then treats
every call on them as that principal's (``act_as``; an admin one with ``act_as_admin``).
A non-admin's hello that asks is refused PERMISSION_DENIED.

The connect functions take the two keywords (:func:`supervisor.client.sdk.aio.connect`,
:func:`supervisor.client.sdk.sync.open_connection`); the classes (``AsyncSandbox``,
``Sandbox``, ...), which open a connection per operation, take them from the
context instead::

    with acting_as("e2b:key1"):
        await AsyncSandbox.create(socket=path)   # owned by e2b:key1, sees only its own

(a context variable: Trio tasks started inside the block inherit it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_ACTING: ContextVar[tuple[str, bool]] = ContextVar("sandvisor_acting_as", default=("", False))


@contextmanager
def acting_as(name: str, *, admin: bool = False) -> Iterator[None]:
    """Connections opened inside the block act for ``name`` (an admin one if ``admin``)."""
    token = _ACTING.set((name, admin))
    try:
        yield
    finally:
        _ACTING.reset(token)


def hello_fields(act_as: str = "", act_as_admin: bool = False) -> tuple[str, bool]:
    """The hello's (act_as, act_as_admin): the arguments when ``act_as`` is given, else the context's."""
    if act_as:
        return act_as, act_as_admin
    if act_as_admin:
        raise ValueError("act_as_admin needs act_as")
    return _ACTING.get()
