"""``sb.get_host(port)`` on the E2B endpoint: a request whose ``Host`` is
``PORT-SANDBOXID.DOMAIN`` (the name ``get_host`` gives, ``DOMAIN`` being the endpoint's
own host as the create call named it) is proxied to ``127.0.0.1:PORT`` inside that
sandbox. It must carry the sandbox's access token (``e2b-traffic-access-token``, the
``trafficAccessToken`` of create/connect, or ``X-Access-Token``): anything else is 401,
as E2B's proxy answers a private sandbox; the request then acts for the token's key.

The sandbox needs no network: each request is one Exec in the guest (bash's
``/dev/tcp`` relay between its stdin/stdout and the port), the request sent as
HTTP/1.1 with ``Connection: close`` and the answer parsed with h11 and streamed back.
Plain HTTP requests only: no WebSocket or other upgrades; a request body is held
(up to :data:`MAX_BODY`) before it is sent.
"""

from __future__ import annotations

import re
from typing import Any

import h11

from supervisor.serve.e2b_http import Exchange, HttpError
from supervisor.serve.e2b_keys import Client
from supervisor.wire import errors

HOST = re.compile(r"^(\d{1,5})-([A-Za-z0-9][A-Za-z0-9_-]{0,127})\.")
MAX_BODY = 16 << 20
NOT_OPEN = 97
_RELAY = f'exec 3<>"/dev/tcp/127.0.0.1/$1" || exit {NOT_OPEN}; cat <&3 & cat >&3; wait'
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "e2b-traffic-access-token",
        "x-access-token",
    }
)


def target(ex: Exchange) -> tuple[int, str] | None:
    """(port, sandbox id) when the request's Host names a sandbox's port."""
    m = HOST.match(ex.headers.get("host", "") or ex.headers.get(":authority", ""))
    if m is None:
        return None
    port = int(m.group(1))
    if not 0 < port < 65536:
        raise HttpError(400, f"port {port} out of range")
    return port, m.group(2)


def _not_open(sandbox: str, port: int) -> dict[str, Any]:
    return {
        "code": 502,
        "message": "The sandbox is running but port is not open",
        "sandboxId": sandbox,
        "port": port,
    }


async def proxy(ex: Exchange, client: Client, sandbox: str, uid: str, port: int) -> None:
    """Forward one request to ``port`` in the sandbox and stream its answer back."""
    body = await ex.body(MAX_BODY)
    path = ex.scope.get("raw_path") or ex.path.encode()
    query = ex.scope.get("query_string", b"")
    headers = [(k, v) for k, v in ex.headers.items() if k not in _HOP and not k.startswith(":")]
    if "host" not in ex.headers:
        headers.append(("host", ex.headers.get(":authority", "localhost")))
    headers += [("connection", "close"), ("content-length", str(len(body)))]
    conn = h11.Connection(our_role=h11.CLIENT)
    request = conn.send(h11.Request(method=ex.method, target=path + (b"?" + query if query else b""), headers=headers))
    request = (
        (request or b"") + (conn.send(h11.Data(data=body)) if body else b"") + (conn.send(h11.EndOfMessage()) or b"")
    )
    sb = client.sandbox(sandbox)
    info = await sb.inspect()
    if info.uid != uid:
        raise errors.NotFound(errors.NOT_FOUND, f"sandbox {sandbox} not found")
    async with sb.exec(["/bin/bash", "-c", _RELAY, "relay", str(port)], user="root") as execd:
        await execd.send(request)
        await execd.close_stdin()
        done = False
        async for o in execd:
            if o.stream == "exit":
                if o.exit_code == NOT_OPEN and not ex.started:
                    await ex.send_json(_not_open(sandbox, port), 502)
                    return
                break
            if o.stream != "stdout" or not o.data or done:
                continue
            conn.receive_data(o.data)
            done = await _relay_events(ex, conn)
        if not done:
            conn.receive_data(b"")
            done = await _relay_events(ex, conn)
    if not ex.started:
        await ex.send_json({"code": 502, "message": f"port {port} answered no HTTP response"}, 502)
    elif not done:
        await ex.write(b"", more=False)


async def _relay_events(ex: Exchange, conn: h11.Connection) -> bool:
    """Pass on what h11 parsed of the answer; True at its end."""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            if not ex.started:
                raise HttpError(502, "the sandbox's port answered malformed HTTP") from None
            await ex.write(b"", more=False)
            return True
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return False
        if isinstance(event, h11.Response):
            hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers]
            kept = [(k, v) for k, v in hdrs if k.lower() not in _HOP and k.lower() != "content-type"]
            ctype = next((v for k, v in hdrs if k.lower() == "content-type"), "application/octet-stream")
            await ex.start(event.status_code, ctype, kept)
        elif isinstance(event, h11.Data):
            await ex.write(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            await ex.write(b"", more=False)
            return True
