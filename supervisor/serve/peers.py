"""Who may use the supervisor: peer credentials of a local socket's client.

The socket's mode (0600, or 0660 for ``serve --group``) is the first gate; this is
the second, and it does not depend on file permissions someone may have loosened
(a chmod, a bind mount, a copied socket path)::

    client --connect--> kernel records (pid, uid, gid, groups) --SO_PEERCRED/SO_PEERGROUPS-->
    hello --> ClientPolicy.refusal(peer) -- None --> ServerHello
                                         -- why  --> Fail PERMISSION_DENIED, hang up

Served: root, the supervisor's own uid, and members of the ``--group`` group
(primary or supplementary, as the kernel saw them at connect time: no /proc race).

Each served peer is the principal ``uid:N`` (:meth:`ClientPolicy.principal`); an admin
(sees and acts on every sandbox, snapshot, volume and stored secret) when it is root,
the supervisor's own uid, or a member of ``serve --admin-group``. ``--group`` members
are served but see only what they own (docs/security.md).
"""

from __future__ import annotations

import grp
import os
import socket
import struct

import attrs

from actors.face import Principal

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13; Python has no name for it


@attrs.frozen
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    @classmethod
    def of(cls, sock: socket.socket) -> Peer:
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        groups: frozenset[int] = frozenset()
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)  # (CPython caps it: 256 groups)
            groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw))
        except OSError:
            pass
        return cls(pid, uid, gid, groups)


@attrs.frozen
class ClientPolicy:
    owner: int  # the supervisor's effective uid
    group: int | None = None  # the gid of ``serve --group``
    group_name: str = ""
    admin_group: int | None = None  # the gid of ``serve --admin-group``: its members are admins

    @classmethod
    def for_serve(cls, group: str | None, admin_group: str | None = None) -> ClientPolicy:
        """KeyError for a group that does not exist."""
        admins = grp.getgrnam(admin_group).gr_gid if admin_group else None
        if not group:
            return cls(os.geteuid(), admin_group=admins)
        return cls(os.geteuid(), grp.getgrnam(group).gr_gid, group, admins)

    def is_admin(self, peer: Peer) -> bool:
        if peer.uid in (0, self.owner):
            return True
        g = self.admin_group
        return g is not None and (peer.gid == g or g in peer.groups)

    def principal(self, peer: Peer) -> Principal:
        """The principal of a served peer: ``uid:N``, an admin or not."""
        return Principal.uid(peer.uid, admin=self.is_admin(peer))

    def refusal(self, peer: Peer) -> str | None:
        """None when ``peer`` is served, else why not (for the client to read)."""
        if self.is_admin(peer):
            return None
        if self.group is not None and (peer.gid == self.group or self.group in peer.groups):
            return None
        who = "root" if self.owner == 0 else f"uid {self.owner}"
        also = f" or members of group {self.group_name!r}" if self.group is not None else ""
        return f"uid {peer.uid} may not use this supervisor: it serves {who}{also} only"
