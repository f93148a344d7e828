"""A client of the msgpack socket for another uid: stdlib and msgpack only.

Run by Debian's /usr/bin/python3 as an unprivileged uid (``setpriv``/``user=``), with a
copy of msgpack's pure-Python package beside it (:func:`install`): the venv's
interpreter may sit where that uid cannot reach it. ``python3 peerclient.py SOCKET
HELLO CALLS`` (HELLO and CALLS as JSON: the hello's extra fields, and a list of
``[method, body]``) prints one JSON line: ``{"hello": [code, message]}`` when the hello
was refused, else ``{"results": [...]}``, each ``{"ok": body}``, ``{"items": [...]}``
or ``{"fail": [code, message]}`` (bytes as text).
"""

from __future__ import annotations

import json
import shutil
import socket
import struct
import sys
from pathlib import Path
from typing import Any


def install(into: Path) -> Path:
    """This script and msgpack's Python files in ``into`` (made 0755); the script's path."""
    import msgpack

    into.mkdir(mode=0o755, exist_ok=True)
    into.chmod(0o755)
    pkg = into / "msgpack"
    pkg.mkdir(mode=0o755, exist_ok=True)
    for f in Path(msgpack.__file__).parent.glob("*.py"):
        shutil.copy(f, pkg / f.name)
        (pkg / f.name).chmod(0o644)
    script = into / "peerclient.py"
    shutil.copy(__file__, script)
    script.chmod(0o644)
    return script


def _text(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, dict):
        return {_text(k): _text(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_text(x) for x in v]
    return v


def main() -> None:
    import msgpack

    path, hello, calls = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    buf = b""

    def send(env: dict[str, Any]) -> None:
        body = msgpack.packb(env, use_bin_type=True)
        s.sendall(struct.pack(">I", len(body)) + body)

    def receive() -> dict[str, Any]:
        nonlocal buf
        while True:
            if len(buf) >= 4:
                (n,) = struct.unpack(">I", buf[:4])
                if len(buf) >= 4 + n:
                    body, buf = buf[4 : 4 + n], buf[4 + n :]
                    return dict(msgpack.unpackb(body, raw=False))
            data = s.recv(65536)
            if not data:
                raise SystemExit("the supervisor hung up")
            buf += data

    send({"t": "hello", "version": 1, "client": "peerclient", **hello})
    msg = receive()
    if msg["t"] == "fail":
        print(json.dumps({"hello": [msg["code"], msg["message"]]}))
        return
    results = []
    for n, (method, body) in enumerate(calls, 1):
        send({"t": "call", "id": n, "method": method, "body": body})
        items = []
        while True:
            msg = receive()
            if msg["t"] == "item":
                items.append(_text(msg["body"]))
                continue
            if msg["t"] == "reply":
                results.append({"ok": _text(msg["body"])})
            elif msg["t"] == "end":
                results.append({"items": items})
            else:
                results.append({"fail": [msg["code"], msg["message"]]})
            break
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
