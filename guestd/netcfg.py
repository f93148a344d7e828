"""guestd's ``net_config``: (re)configure the guest's eth0 over rtnetlink, stdlib only.

guestd runs it as PID 1 (lazily imported: only restores of networked sandboxes pay
for it) after a restore, before the host reports the clone ``ready``: a restored
clone wakes up with its origin's address, and gets a fresh address, MAC, gateway
and resolver here. No fork (busybox ``ip`` would cost ~10 ms a process under TCG):
a handful of netlink messages on one socket, ~1 ms in all::

    host (Sandbox._serve, a restore)          guestd
      NetConfig{address, prefix, gateway,  -->  configure(): MAC, old addresses out,
                dns, mac, iface}                new address, link up, default route,
                                                /etc/resolv.conf (of the sysroot)
                                       <--  Ok | Error(INVALID_ARGUMENT: a bad value)

Order matters: the old addresses go first (a new address in the same subnet would be
a *secondary* one, deleted with the primary when promote_secondaries is off), then
the new one (the kernel adds the subnet route), then the default route (replaced).
Neighbour entries are kept: on the host every sandbox link has the same MAC
(actors/net/ippool.py GATEWAY_MAC), so the gateway's entry a snapshot carries stays right.
"""

from __future__ import annotations

import os
import socket
import struct

RTM_NEWLINK, RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR, RTM_NEWROUTE = 16, 20, 21, 22, 24
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK = 0x1, 0x2, 0x4
NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE, NLM_F_DUMP = 0x100, 0x200, 0x400, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
IFLA_ADDRESS = 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_OIF, RTA_GATEWAY = 4, 5
RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_UNIVERSE, RTN_UNICAST = 254, 3, 0, 1
IFF_UP = 0x1

_NLMSG = struct.Struct("=IHHII")
_IFINFO = struct.Struct("=BxHiII")
_IFADDR = struct.Struct("=BBBBI")
_RTMSG = struct.Struct("=BBBBBBBBI")
_RTA = struct.Struct("=HH")


def _attr(kind: int, data: bytes) -> bytes:
    raw = _RTA.pack(_RTA.size + len(data), kind) + data
    return raw + b"\0" * (-len(raw) % 4)


def _attrs(data: bytes) -> dict[int, bytes]:
    out = {}
    pos = 0
    while pos + _RTA.size <= len(data):
        length, kind = _RTA.unpack_from(data, pos)
        if length < _RTA.size:
            break
        out[kind] = data[pos + _RTA.size : pos + length]
        pos += (length + 3) & ~3
    return out


class _Netlink:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.sock.settimeout(2.0)
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def request(self, kind: int, flags: int, body: bytes) -> list[tuple[int, bytes]]:
        """Send one request; return the (type, payload) of the answers (dump) or
        raise OSError on a negative acknowledgement."""
        self.seq += 1
        seq = self.seq
        msg = _NLMSG.pack(_NLMSG.size + len(body), kind, NLM_F_REQUEST | flags, seq, 0) + body
        self.sock.send(msg)
        out: list[tuple[int, bytes]] = []
        while True:
            data = self.sock.recv(65536)
            pos = 0
            while pos + _NLMSG.size <= len(data):
                length, mtype, mflags, mseq, _pid = _NLMSG.unpack_from(data, pos)
                if length < _NLMSG.size:
                    raise OSError("malformed netlink answer")
                payload = data[pos + _NLMSG.size : pos + length]
                pos += (length + 3) & ~3
                if mseq != seq:
                    continue
                if mtype == NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", payload)
                    if err:
                        raise OSError(-err, os.strerror(-err))
                    return out
                if mtype == NLMSG_DONE:
                    return out
                out.append((mtype, payload))
                if not mflags & NLM_F_MULTI and not flags & NLM_F_ACK:
                    return out


def _ip4(text: str) -> bytes:
    """The 4 bytes of a dotted-quad IPv4 address (ValueError otherwise: inet_aton alone
    takes "1" or "0x7f.1" too, and raises OSError)."""
    parts = text.split(".")
    if len(parts) != 4 or not all(p.isdigit() and len(p) <= 3 and int(p) <= 255 for p in parts):
        raise ValueError(f"not an IPv4 address: {text!r}")
    return bytes(int(p) for p in parts)


def configure(
    iface: str, address: str, prefix: int, gateway: str, mac: str = "", dns: list[str] | tuple[str, ...] = ()
) -> None:
    """Give ``iface`` exactly ``address/prefix``, a default route via ``gateway`` (none
    when empty), the MAC ``mac`` (when set) and ``dns`` as /etc/resolv.conf's
    nameservers; link up."""
    addr = _ip4(address)
    gw = _ip4(gateway) if gateway else b""
    if not 1 <= prefix <= 32:
        raise ValueError(f"prefix {prefix} out of range")
    hw = bytes.fromhex(mac.replace(":", "")) if mac else b""
    if mac and (len(hw) != 6 or hw[0] & 1):
        raise ValueError(f"bad unicast MAC {mac!r}")
    for d in dns:
        _ip4(d)
    index = socket.if_nametoindex(iface)
    nl = _Netlink()
    try:
        if hw:
            body = _IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0) + _attr(IFLA_ADDRESS, hw)
            try:
                nl.request(RTM_NEWLINK, NLM_F_ACK, body)
            except OSError:  # a device without live MAC change: down, change, up
                nl.request(RTM_NEWLINK, NLM_F_ACK, _IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, IFF_UP))
                nl.request(RTM_NEWLINK, NLM_F_ACK, body)
        for _kind, payload in nl.request(RTM_GETADDR, NLM_F_DUMP, _IFADDR.pack(socket.AF_INET, 0, 0, 0, 0)):
            family, plen, _flags, scope, idx = _IFADDR.unpack_from(payload)
            if family != socket.AF_INET or idx != index:
                continue
            a = _attrs(payload[_IFADDR.size :])
            if a.get(IFA_LOCAL) == addr and plen == prefix:
                continue  # already right: keep it (and its routes)
            keep = b"".join(_attr(k, a[k]) for k in (IFA_LOCAL, IFA_ADDRESS) if k in a)
            nl.request(RTM_DELADDR, NLM_F_ACK, _IFADDR.pack(socket.AF_INET, plen, 0, scope, index) + keep)
        body = _IFADDR.pack(socket.AF_INET, prefix, 0, RT_SCOPE_UNIVERSE, index)
        body += _attr(IFA_LOCAL, addr) + _attr(IFA_ADDRESS, addr)
        try:
            nl.request(RTM_NEWADDR, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, body)
        except FileExistsError:
            pass
        nl.request(RTM_NEWLINK, NLM_F_ACK, _IFINFO.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP))
        if gw:
            body = _RTMSG.pack(socket.AF_INET, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_UNIVERSE, RTN_UNICAST, 0)
            body += _attr(RTA_GATEWAY, gw) + _attr(RTA_OIF, struct.pack("=I", index))
            nl.request(RTM_NEWROUTE, NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE, body)
    finally:
        nl.close()
    if dns:
        write_resolv_conf(dns)


def write_resolv_conf(dns: list[str] | tuple[str, ...], path: str = "/etc/resolv.conf") -> None:
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        return
    tmp = f"{path}.sandvisor-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, "".join(f"nameserver {d}\n" for d in dns).encode())
    finally:
        os.close(fd)
    os.rename(tmp, path)  # replaces a symlink too, never writes through one
