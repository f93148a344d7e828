"""DNS messages (RFC 1035), I/O-free: what the supervisor's DNS proxy needs and no more.

Parse a query (header + question), parse an answer (records of every section, names
decompressed, A/AAAA addresses and CNAME targets decoded), build an error answer
(REFUSED, SERVFAIL, FORMERR) from a query, and build simple messages (queries, and
answers for the tests' DNS server). Everything the guest sends is hostile: every
parse error is a :class:`DnsError`, and no input makes the parser loop, recurse or
allocate beyond its length (compression pointers are bounded by a jump count and a
255-octet name limit).

A label is any 1..63 octets on the wire, a dot or a 0xff included. Names are read as
raw labels (:func:`read_labels`) and shown as text losslessly (:func:`name_text`:
RFC 1035 escapes, ``\\.`` and ``\\255``), so text goes back to exactly the labels it
came from (:func:`name_labels`) and an error answer echoes the question's own octets
(:func:`error_response`). :func:`is_plain` tells a name a text suffix match can judge.

Hand-written rather than dnspython: the proxy needs ~5% of that library (whose
import costs ~60 ms and whose objects are far heavier per message than these tuples),
and owning this small decoder keeps the house rule (one module per wire protocol,
I/O-free, fuzzed with Hypothesis: tests/unit/test_net.py, tests/unit/test_hostile_dns.py).
"""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, IPv6Address

import attrs

HEADER = struct.Struct("!HHHHHH")
QTAIL = struct.Struct("!HH")
RRTAIL = struct.Struct("!HHIH")

A, NS, CNAME, SOA, PTR, MX, TXT, AAAA, OPT, ANY = 1, 2, 5, 6, 12, 15, 16, 28, 41, 255
IN = 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5

QR = 0x8000
AA = 0x0400
TC = 0x0200
RD = 0x0100
RA = 0x0080
OPCODE_MASK = 0x7800
RCODE_MASK = 0x000F

MAX_NAME = 255
MAX_JUMPS = 64
MAX_RECORDS = 512


class DnsError(ValueError):
    """A malformed or unsupported DNS message."""


@attrs.frozen
class Question:
    name: str  # presentation form (name_text): lower case, no trailing dot ("" is the root)
    qtype: int
    qclass: int = IN


@attrs.frozen
class Record:
    name: str
    rtype: int
    rclass: int
    ttl: int
    rdata: bytes
    target: str | None = None  # CNAME: the name it points to

    @property
    def address(self) -> IPv4Address | IPv6Address | None:
        if self.rtype == A and len(self.rdata) == 4:
            return IPv4Address(self.rdata)
        if self.rtype == AAAA and len(self.rdata) == 16:
            return IPv6Address(self.rdata)
        return None


@attrs.frozen
class Message:
    id: int
    flags: int
    questions: tuple[Question, ...] = ()
    answers: tuple[Record, ...] = ()
    authority: tuple[Record, ...] = ()
    additional: tuple[Record, ...] = ()

    @property
    def rcode(self) -> int:
        return self.flags & RCODE_MASK

    @property
    def is_response(self) -> bool:
        return bool(self.flags & QR)


def read_labels(data: bytes, pos: int) -> tuple[tuple[bytes, ...], int]:
    """The (decompressed) name at ``pos`` as its raw labels, and the offset just after
    it in the message. Label bytes are kept as sent (any octet, a dot included)."""
    labels: list[bytes] = []
    length = 1  # the root's zero octet
    jumps = 0
    end = -1
    while True:
        if pos >= len(data):
            raise DnsError("name runs past the end of the message")
        n = data[pos]
        if n == 0:
            pos += 1
            break
        kind = n & 0xC0
        if kind == 0xC0:
            if pos + 1 >= len(data):
                raise DnsError("truncated compression pointer")
            jumps += 1
            if jumps > MAX_JUMPS:
                raise DnsError("too many compression pointers")
            if end < 0:
                end = pos + 2
            pos = ((n & 0x3F) << 8) | data[pos + 1]
            continue
        if kind:
            raise DnsError(f"unsupported label type 0x{kind:02x}")
        label = data[pos + 1 : pos + 1 + n]
        if len(label) != n:
            raise DnsError("label runs past the end of the message")
        length += n + 1
        if length > MAX_NAME:
            raise DnsError("name longer than 255 octets")
        labels.append(bytes(label))
        pos += 1 + n
    return tuple(labels), (end if end >= 0 else pos)


def read_name(data: bytes, pos: int) -> tuple[str, int]:
    """The (decompressed) name at ``pos``, in presentation form (:func:`name_text`,
    lower case), and the offset just after it in the message."""
    labels, pos = read_labels(data, pos)
    return name_text(labels), pos


def _label_text(label: bytes) -> str:
    out = []
    for b in label.lower():  # ASCII letters only: bytes.lower never touches other octets
        if b in (0x2E, 0x5C):  # "." and "\\" inside a label
            out.append("\\" + chr(b))
        elif 0x21 <= b <= 0x7E:
            out.append(chr(b))
        else:
            out.append(f"\\{b:03d}")
    return "".join(out)


def name_text(labels: tuple[bytes, ...]) -> str:
    """Raw labels as one lower-case string, losslessly (RFC 1035 5.1 escapes): a dot or a
    backslash inside a label is escaped (``\\.``), any octet outside ``!``..``~`` is
    ``\\DDD``; :func:`name_labels` gives the labels back."""
    return ".".join(_label_text(label) for label in labels)


def is_plain(name: str) -> bool:
    """A name (from :func:`read_name`) whose every label is printable ASCII without a dot
    or a backslash: its text is the plain dotted join of its labels, so a suffix match
    on the text is a match on whole labels."""
    return "\\" not in name


def name_labels(name: str) -> tuple[bytes, ...]:
    """The labels of a name in presentation form (the inverse of :func:`name_text`; a
    trailing dot is allowed). Anything it cannot be is a :class:`DnsError`."""
    if name in ("", "."):
        return ()
    labels: list[bytes] = []
    cur = bytearray()
    i = 0
    while i < len(name):
        c = name[i]
        if c == ".":
            if not cur:
                raise DnsError(f"empty label in {name[:80]!r}")
            labels.append(bytes(cur))
            cur = bytearray()
            i += 1
            continue
        if c == "\\":
            digits = name[i + 1 : i + 4]
            if len(digits) == 3 and all(d in "0123456789" for d in digits):
                value = int(digits)
                if value > 255:
                    raise DnsError(f"bad escape \\{digits} in {name[:80]!r}")
                cur.append(value)
                i += 4
                continue
            if i + 1 >= len(name) or not 0x20 <= ord(name[i + 1]) <= 0x7E:
                raise DnsError(f"bad escape in {name[:80]!r}")
            cur.append(ord(name[i + 1]))
            i += 2
            continue
        if not 0x20 <= ord(c) <= 0x7E:
            raise DnsError(f"non-ASCII or control character in name {name[:80]!r}")
        cur.append(ord(c))
        i += 1
    if cur:
        labels.append(bytes(cur))
    return tuple(labels)


def wire_name(labels: tuple[bytes, ...]) -> bytes:
    """Labels on the wire (uncompressed)."""
    out = bytearray()
    for raw in labels:
        if not 1 <= len(raw) <= 63:
            raise DnsError(f"bad label {raw[:80]!r}")
        out += bytes([len(raw)]) + raw
    out.append(0)
    if len(out) > MAX_NAME:
        raise DnsError("name longer than 255 octets")
    return bytes(out)


def encode_name(name: str) -> bytes:
    """A name in presentation form (as :func:`read_name` gives it) on the wire."""
    return wire_name(name_labels(name))


def _header(data: bytes) -> tuple[int, int, int, int, int, int]:
    if len(data) < HEADER.size:
        raise DnsError("shorter than a DNS header")
    return HEADER.unpack_from(data)


def _question(data: bytes, pos: int) -> tuple[Question, int]:
    name, pos = read_name(data, pos)
    if pos + QTAIL.size > len(data):
        raise DnsError("truncated question")
    qtype, qclass = QTAIL.unpack_from(data, pos)
    return Question(name, qtype, qclass), pos + QTAIL.size


def _record(data: bytes, pos: int) -> tuple[Record, int]:
    name, pos = read_name(data, pos)
    if pos + RRTAIL.size > len(data):
        raise DnsError("truncated record")
    rtype, rclass, ttl, rdlen = RRTAIL.unpack_from(data, pos)
    pos += RRTAIL.size
    rdata = data[pos : pos + rdlen]
    if len(rdata) != rdlen:
        raise DnsError("record data runs past the end of the message")
    target = None
    if rtype == CNAME:
        target, after = read_name(data, pos)
        if after > pos + rdlen:
            raise DnsError("CNAME target runs past its record")
    return Record(name, rtype, rclass, ttl, rdata, target), pos + rdlen


def parse(data: bytes) -> Message:
    """A whole message (query or answer)."""
    mid, flags, qd, an, ns, ar = _header(data)
    if qd + an + ns + ar > MAX_RECORDS:
        raise DnsError("too many records")
    pos = HEADER.size
    questions = []
    for _ in range(qd):
        q, pos = _question(data, pos)
        questions.append(q)
    sections: list[list[Record]] = [[], [], []]
    for sec, count in zip(sections, (an, ns, ar), strict=True):
        for _ in range(count):
            r, pos = _record(data, pos)
            sec.append(r)
    return Message(mid, flags, tuple(questions), tuple(sections[0]), tuple(sections[1]), tuple(sections[2]))


def parse_query(data: bytes) -> tuple[int, int, Question]:
    """(id, flags, question) of a standard query with exactly one question."""
    mid, flags, qd, _an, _ns, _ar = _header(data)
    if flags & QR:
        raise DnsError("a response, not a query")
    if flags & OPCODE_MASK:
        raise DnsError("only standard queries are served")
    if qd != 1:
        raise DnsError(f"{qd} questions (exactly one is served)")
    q, _ = _question(data, HEADER.size)
    return mid, flags, q


def error_response(query: bytes, rcode: int) -> bytes:
    """An answer with ``rcode`` to ``query``: its id and (when it parses) its question,
    echoed as the raw label and type/class octets it came with (never re-encoded from
    text: any label a parser accepts is echoed, and compression is undone). Only a
    query shorter than a header is a :class:`DnsError`."""
    mid, flags, *_ = _header(query)
    out_flags = QR | RA | (flags & (RD | OPCODE_MASK)) | (rcode & RCODE_MASK)
    try:
        parse_query(query)
        labels, pos = read_labels(query, HEADER.size)
        question = wire_name(labels) + query[pos : pos + QTAIL.size]
    except DnsError:
        return HEADER.pack(mid, out_flags, 0, 0, 0, 0)
    return HEADER.pack(mid, out_flags, 1, 0, 0, 0) + question


def response_id(data: bytes) -> int:
    return _header(data)[0]


def with_id(data: bytes, mid: int) -> bytes:
    """``data`` with its message id replaced."""
    if len(data) < 2:
        raise DnsError("shorter than a DNS header")
    return struct.pack("!H", mid) + data[2:]


def build(msg: Message) -> bytes:
    """Encode a message (no name compression: for queries and the tests' server)."""
    out = bytearray(
        HEADER.pack(msg.id, msg.flags, len(msg.questions), len(msg.answers), len(msg.authority), len(msg.additional))
    )
    for q in msg.questions:
        out += encode_name(q.name) + QTAIL.pack(q.qtype, q.qclass)
    for r in (*msg.answers, *msg.authority, *msg.additional):
        rdata = encode_name(r.target) if r.rtype == CNAME and r.target is not None else r.rdata
        out += encode_name(r.name) + RRTAIL.pack(r.rtype, r.rclass, r.ttl, len(rdata)) + rdata
    return bytes(out)


def query(name: str, qtype: int = A, mid: int = 0, rd: bool = True) -> bytes:
    canonical = name_text(name_labels(name.lower()))  # (no trailing dot)
    return build(Message(mid, RD if rd else 0, (Question(canonical, qtype),)))


def address_record(name: str, address: IPv4Address | IPv6Address, ttl: int) -> Record:
    return Record(name, A if address.version == 4 else AAAA, IN, ttl, address.packed)


def answered_addresses(msg: Message, qname: str) -> list[tuple[IPv4Address | IPv6Address, int]]:
    """(address, ttl) answering ``qname``: A/AAAA records of the answer section owned by
    the name or by a name its CNAME chain leads to (never by an unrelated owner an
    upstream slipped in). The TTL is the smallest along the chain."""
    names = {qname.lower().rstrip("."): 2**31}
    changed = True
    while changed:  # CNAME chains, in whatever order the records come
        changed = False
        for r in msg.answers:
            if r.rtype == CNAME and r.target is not None and r.name in names and r.target not in names:
                names[r.target] = min(names[r.name], r.ttl)
                changed = True
    out = []
    for r in msg.answers:
        addr = r.address
        if addr is not None and r.name in names:
            out.append((addr, min(r.ttl, names[r.name])))
    return out
