"""Who asks the E2B endpoint (:mod:`supervisor.serve.e2b_server`): its API keys as principals,
the access tokens it hands out for a sandbox, and the supervisor client that acts for a key.

The key file, one key a line (blank lines and ``#`` comments skipped)::

    LABEL KEY           # the principal e2b:LABEL
    LABEL KEY admin     # the principal e2b:LABEL, an admin (sees and acts on every sandbox)
    KEY                 # the principal e2b:key-<16 hex>, a hash of the key (never the key)

A label is 1-64 of ``[A-Za-z0-9_@-]`` (no ``.``: tokens are split at dots). Labels and
keys are unique in a file. The key itself is never logged and never recorded: records
say ``e2b:<label>``.

An access token (``envdAccessToken``; the SDK sends it as ``X-Access-Token`` with every
call to the sandbox) is ``<label>.<uid>.<mac>``: the key it was handed to, the uid of the
sandbox it was handed out for (its per-create identity, not its user-chosen id) and an
HMAC-SHA256 of the three (label, uid, id) under a secret the endpoint makes at start. It
opens that sandbox only while the sandbox with that uid is there: removed, its tokens
open nothing, a later sandbox given the same id included (another uid).
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any

import attrs

from supervisor.client.sdk.acting import acting_as
from supervisor.client.sdk.aio import AsyncConnection, AsyncSandbox, connect
from supervisor.wire import protocol

LABEL = re.compile(r"[A-Za-z0-9_@-]{1,64}")
_UID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DERIVED = b"sandvisor e2b key label\0"


@attrs.frozen
class Key:
    """One API key: its label (the principal's name is ``e2b:<label>``), the key, admin or not."""

    label: str
    secret: bytes = attrs.field(repr=False)
    admin: bool = False

    @property
    def principal(self) -> str:
        return f"e2b:{self.label}"


def derived_label(key: bytes) -> str:
    """A bare key's label: a hash of the key (the key itself never appears in a record or log)."""
    return "key-" + hashlib.sha256(_DERIVED + key).hexdigest()[:16]


def parse_keys(text: str, source: str = "key file") -> list[Key]:
    """The keys of a key file's ``text``; ValueError (naming the line, never the key) otherwise."""
    keys: list[Key] = []
    labels: set[str] = set()
    secrets_seen: set[bytes] = set()
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) == 1:
            key = Key(derived_label(words[0].encode()), words[0].encode())
        elif len(words) == 2 or (len(words) == 3 and words[2] == "admin"):
            if not LABEL.fullmatch(words[0]):
                raise ValueError(f"{source}, line {n}: a label is 1-64 of A-Z a-z 0-9 _ @ -")
            key = Key(words[0], words[1].encode(), admin=len(words) == 3)
        else:
            raise ValueError(f"{source}, line {n}: expected KEY, LABEL KEY or LABEL KEY admin")
        if key.label in labels:
            raise ValueError(f"{source}, line {n}: label {key.label!r} is given twice")
        if key.secret in secrets_seen:
            raise ValueError(f"{source}, line {n}: this key is given twice")
        labels.add(key.label)
        secrets_seen.add(key.secret)
        keys.append(key)
    if not keys:
        raise ValueError(f"{source}: no API keys (one a line: KEY, LABEL KEY or LABEL KEY admin)")
    return keys


def read_keys(path: Path) -> list[Key]:
    return parse_keys(path.read_text(), str(path))


def find_key(keys: list[Key], given: str | None) -> Key | None:
    """The key ``given`` is, compared in constant time with every key."""
    if not given:
        return None
    g = given.encode()
    found = None
    for k in keys:  # every key compared, whichever matches
        if hmac.compare_digest(g, k.secret):
            found = k
    return found


class Tokens:
    """Access tokens: made for (key, sandbox id, uid), opened back to (key, uid)."""

    def __init__(self, keys: list[Key], secret: bytes | None = None) -> None:
        self.by_label = {k.label: k for k in keys}
        self.secret = secret if secret is not None else secrets.token_bytes(32)
        # every token handed out, with its sandbox (id, uid): what a signed file URL is checked against
        self.handed: dict[str, tuple[str, str]] = {}

    def _mac(self, label: str, uid: str, sandbox: str) -> str:
        msg = b"\0".join((label.encode(), uid.encode(), sandbox.encode()))
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()

    def mint(self, key: Key, sandbox: str, uid: str) -> str:
        if not _UID.fullmatch(uid):
            raise ValueError(f"sandbox {sandbox!r} has no uid to bind a token to")
        token = f"{key.label}.{uid}.{self._mac(key.label, uid, sandbox)}"
        self.handed[token] = (sandbox, uid)
        return token

    def forget(self, uid: str) -> None:
        """A removed sandbox's tokens (they open nothing any more)."""
        for token in [t for t, (_, u) in self.handed.items() if u == uid]:
            del self.handed[token]

    def open(self, token: str | None, sandbox: str) -> tuple[Key, str] | None:
        """(the key it was handed to, the uid it is bound to), or None: not a token of ours
        for ``sandbox`` (its MAC compared in constant time)."""
        parts = (token or "").split(".")
        if len(parts) != 3:
            return None
        label, uid, mac = parts
        key = self.by_label.get(label)
        if key is None or not _UID.fullmatch(uid):
            return None
        if not hmac.compare_digest(self._mac(label, uid, sandbox).encode(), mac.encode()):
            return None
        return key, uid


@attrs.frozen
class Client:
    """The supervisor as one key sees it: every connection to the socket acts as the
    key's principal (the hello's ``act_as``; the endpoint runs inside serve, an admin
    peer), so the domain's ownership rules apply to it. The SDK's classes open a
    connection per operation and take the principal from the context: a handle of
    :meth:`sandbox` is used inside :meth:`acting` (the endpoint enters it for each
    request and each held process)."""

    socket: str
    key: Key

    @contextmanager
    def acting(self) -> Iterator[None]:
        with acting_as(self.key.principal, admin=self.key.admin):
            yield

    def connect(self) -> AbstractAsyncContextManager[AsyncConnection]:
        return connect(self.socket, act_as=self.key.principal, act_as_admin=self.key.admin)

    def sandbox(self, sid: str) -> AsyncSandbox:
        return AsyncSandbox(sid, socket=self.socket)

    async def create(self, **kw: Any) -> AsyncSandbox:
        with self.acting():
            return await AsyncSandbox.create(socket=self.socket, **kw)

    async def restore(self, snapshot: str, **kw: Any) -> AsyncSandbox:
        with self.acting():
            return await AsyncSandbox.restore(snapshot, socket=self.socket, **kw)

    async def list(self, **kw: Any) -> Any:
        with self.acting():
            return await AsyncSandbox.list(socket=self.socket, **kw)

    async def snapshots(self) -> builtins.list[protocol.SnapshotSummary]:
        with self.acting():
            return builtins.list(await AsyncSandbox.snapshots(socket=self.socket))
