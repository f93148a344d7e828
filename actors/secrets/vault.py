"""The supervisor's secret values: in memory, and on disk encrypted (AES-256-GCM).

``<state>/secrets.vault`` (0600, replaced atomically) holds, encrypted with a key that
lives *outside* the state dir (``serve --secrets-key``, by default
/etc/sandvisor/secrets.key for root, ``~/.config/sandvisor/secrets.key`` otherwise;
made 0600 at first use): the store's named entries (``secret set``), each sandbox's
own values (by its uid), the secrets removed from it, and its CA (certificate and
private key: the guest trusts that CA across a supervisor restart, so the next
supervisor must mint leaves from the same key). A snapshot's copy is kept by the
snapshot's uid, for its clones.

Why a key outside the state dir rather than the root-only file alone: the state dir
is what gets copied (backups, a move to another host, a bug report's tarball); the
file alone is worth nothing there. Why not the runtime dir (/run, tmpfs): a reboot
would lose the key, and every stopped sandbox with a secret would lose it too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from actors.errors import FailedPrecondition, NotFound
from actors.principals import LEGACY_OWNER

AAD = b"sandvisor-secrets-v1"
VAULT_FILE = "secrets.vault"


def default_key_path() -> Path:
    if os.geteuid() == 0:
        return Path("/etc/sandvisor/secrets.key")
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "sandvisor" / "secrets.key"


def load_key(path: Path) -> bytes:
    """The vault's 32-byte key, made (0600, its directory 0700) if missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = AESGCM.generate_key(bit_length=256)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        return key
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077 or st.st_uid != os.geteuid():
            raise FailedPrecondition(f"secrets key {path}: must be 0600 and ours (it is {st.st_mode & 0o777:o})")
        key = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(key) != 32:
        raise FailedPrecondition(f"secrets key {path}: expected 32 bytes")
    return key


class Vault:
    """The values, the CAs. Every change is written through (small: one file)."""

    def __init__(self, state_dir: Path, key_path: Path | None = None) -> None:
        self.path = state_dir / VAULT_FILE
        self.key_path = key_path or default_key_path()
        self._cipher: AESGCM | None = None  # the key is read (or made) at the first need
        self.named: dict[str, bytes] = {}
        self.named_owners: dict[str, str] = {}  # a named entry's owner (absent: LEGACY_OWNER's)
        self.owners: dict[str, dict[str, Any]] = {}
        # called after every change (the live proxies' ``push``: actors/sandboxes/secrets.py)
        self.listeners: list[Callable[[], None]] = []
        self._load()

    # -- persistence -------------------------------------------------------------------
    @property
    def _aead(self) -> AESGCM:
        if self._cipher is None:
            self._cipher = AESGCM(load_key(self.key_path))
        return self._cipher

    def _load(self) -> None:
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            return
        aead = self._aead  # (a key that is not ours, or not 0600: FAILED_PRECONDITION as it is)
        try:
            data = msgpack.unpackb(aead.decrypt(blob[:12], blob[12:], AAD), raw=False)
        except Exception:
            raise FailedPrecondition(
                f"{self.path} does not decrypt with {self.key_path}: the wrong key (or a damaged file)"
            ) from None
        self.named = dict(data.get("named", {}))
        self.owners = dict(data.get("owners", {}))
        self.named_owners = dict(data.get("named_owners", {}))

    def _save(self) -> None:
        plain = msgpack.packb(
            {"named": self.named, "owners": self.owners, "named_owners": self.named_owners}, use_bin_type=True
        )
        nonce = os.urandom(12)
        blob = nonce + self._aead.encrypt(nonce, plain, AAD)
        tmp = self.path.with_name(VAULT_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, blob)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path)
        for changed in list(self.listeners):
            changed()

    # -- the store's named entries -------------------------------------------------------
    def set_named(self, name: str, value: bytes, owner: str = LEGACY_OWNER) -> None:
        self.named[name] = value
        self.named_owners[name] = owner
        self._save()

    def named_owner(self, name: str) -> str:
        return self.named_owners.get(name, LEGACY_OWNER)

    def remove_named(self, name: str) -> None:
        if name not in self.named:
            raise NotFound(f"no secret {name!r} in the store")
        del self.named[name]
        self.named_owners.pop(name, None)
        self._save()

    # -- a sandbox's (or a snapshot's) own ----------------------------------------------
    def owner(self, uid: str) -> dict[str, Any]:
        return self.owners.get(uid, {})

    def put_owner(self, uid: str, values: dict[str, bytes], ca: tuple[bytes, bytes]) -> None:
        self.owners[uid] = {"values": dict(values), "ca": list(ca), "removed": []}
        self._save()

    def set_value(self, uid: str, name: str, value: bytes) -> None:
        own = self.owners.setdefault(uid, {"values": {}, "ca": [], "removed": []})
        own["values"][name] = value
        if name in own["removed"]:
            own["removed"].remove(name)
        self._save()

    def remove_value(self, uid: str, name: str) -> None:
        own = self.owners.setdefault(uid, {"values": {}, "ca": [], "removed": []})
        own["values"].pop(name, None)
        if name not in own["removed"]:
            own["removed"].append(name)
        self._save()

    def copy_owner(self, src: str, dst: str, *, ca: tuple[bytes, bytes] | None = None) -> None:
        """``dst`` gets ``src``'s values (a snapshot of a sandbox; a clone of a snapshot),
        with its own CA when given."""
        own = self.owners.get(src)
        if own is None:
            return
        self.owners[dst] = {
            "values": dict(own["values"]),
            "ca": list(ca) if ca is not None else list(own["ca"]),
            "removed": list(own["removed"]),
        }
        self._save()

    def drop_owner(self, uid: str) -> None:
        if self.owners.pop(uid, None) is not None:
            self._save()

    def keep_only(self, uids: set[str]) -> None:
        """Forget owners that are gone (sandboxes and snapshots removed while we were down)."""
        gone = [u for u in self.owners if u not in uids]
        for u in gone:
            del self.owners[u]
        if gone:
            self._save()

    def value(self, uid: str, name: str, store: str = "") -> bytes | None:
        """The value to put in, None when there is none (removed; a store entry deleted)."""
        own = self.owners.get(uid)
        if own is not None and name in own["removed"]:
            return None
        if store:
            return self.named.get(store)
        return None if own is None else own["values"].get(name)

    def removed(self, uid: str, name: str) -> bool:
        own = self.owners.get(uid)
        return own is not None and name in own["removed"]

    def ca(self, uid: str) -> tuple[bytes, bytes] | None:
        own = self.owners.get(uid)
        if own is None or len(own["ca"]) != 2:
            return None
        return own["ca"][0], own["ca"][1]


def remove_stale_tmp(state_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(state_dir / (VAULT_FILE + ".tmp"))
