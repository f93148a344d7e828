"""Who asks: the principal of a request, and what it may see.

Every edge names the principal of each request (docs/security.md, "Principals"):

=====================  ==========================  ===========================================
door                   principal                   admin when
=====================  ==========================  ===========================================
Unix socket (msgpack,  ``uid:N`` (SO_PEERCRED)     uid 0, the supervisor's uid, or a member of
gRPC on a socket)                                  ``serve --admin-group``
gRPC on TCP            ``cert:<CN>`` or            the CN is in ``--grpc-admin-cert-cn``; the
                       ``token:<label>``           token's line says ``admin`` (an unlabelled
                                                   token is the operator's own: admin)
acting for another     ``act_as`` of the hello     ``act_as_admin`` (only an admin may act)
=====================  ==========================  ===========================================

Sandboxes, snapshots, volumes and stored secrets record their ``owner`` (a principal's
name). A principal sees and acts on what it owns; an admin on everything. What it may
not see does not exist for it: NOT_FOUND with the text of a real miss. Records stored
before owners were recorded belong to :data:`LEGACY_OWNER` (admins only); what the
supervisor makes for itself (boot templates, warm pool members, a pause's hibernated
state) is :data:`SYSTEM`'s, hidden from every caller as before.
"""

from __future__ import annotations

import attrs

LEGACY_OWNER = "uid:0"  # the owner of records stored before owners were recorded
MAX_NAME = 200  # characters of a principal's name


def check_name(name: str) -> str | None:
    """None when ``name`` can name a principal, else why not."""
    if not name or len(name) > MAX_NAME:
        return f"a principal's name is 1 to {MAX_NAME} characters"
    if not name.isprintable() or any(c.isspace() for c in name):
        return "a principal's name is printable, without spaces"
    if ":" not in name.strip(":"):
        return "a principal's name is KIND:NAME (uid:1000, token:ci, e2b:key1)"
    return None


@attrs.frozen
class Principal:
    """The one who asks: ``name`` as ``KIND:NAME`` (``uid:1000``, ``e2b:key1``,
    ``cert:ci.example``, ``token:ci``), and whether it is an admin."""

    name: str
    admin: bool = False

    def may_see(self, owner: str) -> bool:
        """May this principal see (and so act on) what ``owner`` owns?"""
        return self.admin or owner == self.name

    @classmethod
    def uid(cls, uid: int, *, admin: bool = False) -> Principal:
        return cls(f"uid:{uid}", admin)


SYSTEM = Principal("system:sandvisor", admin=True)  # the supervisor's own work (pools, templates, fleet)
