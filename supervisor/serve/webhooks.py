"""``serve --webhook URL --webhook-secret FILE``: lifecycle events POSTed, signed, to the operator's listeners.

Each event the event bus publishes is committed to the event log's outbox
(supervisor/serve/eventlog.py) for every webhook before anything else sees it; a
:class:`WebhookSender` per supervisor delivers them::

    EventBus.publish ─► EventLog.append (commit: events + a pending row per webhook)
                              │ tells the sender
    WebhookSender ── a lane per (webhook, sandbox): its oldest pending event ──POST──► URL
                     2xx: out of the outbox, the next one; else: backoff and again

Delivery is at least once (a supervisor stopped between the listener's 2xx and the
outbox's delete sends it again: the body's ``id`` de-duplicates), in order per
sandbox (a sandbox's next event waits for its previous one), with no order between
sandboxes. Every attempt is a new connection (HTTP/1.1 by h11 over a Trio socket; TLS
by the system's CA store), signed anew with its own time (supervisor/wire/webhooks.py:
the scheme and ``verify_webhook``). Anything but a 2xx within ``timeout`` (a refused
connection, a 500, a redirect) is retried after ``base_delay * 2**n`` seconds, at most
``max_delay``, with full jitter (a random delay between half and all of it): for as long
as it takes, until the outbox's bound drops it.

A webhook is the operator's door out: it gets every sandbox's events, whoever owns
them (the owner's principal is in the body). Its secret is a private file (supervisor/serve/tokens.py's
checks), read once at start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import ssl
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import h11
import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from actors.face import SandboxEvent
from supervisor.serve.eventlog import EventLog
from supervisor.serve.tokens import read_private
from supervisor.wire.webhooks import ID_HEADER, sign

log = logging.getLogger("sandvisor.webhooks")

MIN_SECRET, MAX_SECRET = 32, 1024
MAX_RESPONSE = 64 * 1024  # bytes of a listener's answer read (the rest is not waited for)
USER_AGENT = "sandvisor-webhooks/1"


@attrs.frozen
class Webhook:
    url: str
    secret: bytes = attrs.field(repr=False)

    @property
    def key(self) -> str:
        """The outbox's name for it: its URL, hashed (a changed URL is a new webhook)."""
        return hashlib.sha256(self.url.encode()).hexdigest()[:16]


def check_url(url: str) -> urllib.parse.SplitResult:
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"--webhook {url!r}: an http:// or https:// URL with a host")
    if u.username or u.password:
        raise ValueError(f"--webhook {url!r}: no credentials in the URL (the signature authenticates)")
    if u.fragment:
        raise ValueError(f"--webhook {url!r}: no #fragment")
    u.port  # noqa: B018  (ValueError on a bad port)
    return u


def read_secret(path: Path) -> bytes:
    """The secret in ``path``: a private file (0600, ours, no symlink), one line of 32 to
    1024 printable ASCII characters."""
    secret = read_private(path, "--webhook-secret", MAX_SECRET + 2).strip()
    if not MIN_SECRET <= len(secret) <= MAX_SECRET or not all(0x21 <= b <= 0x7E for b in secret):
        raise ValueError(
            f"--webhook-secret {path}: one line of {MIN_SECRET} to {MAX_SECRET} printable characters "
            "(e.g. openssl rand -hex 32)"
        )
    return secret


def webhooks(urls: Sequence[str], secrets: Sequence[Path]) -> list[Webhook]:
    """The configured webhooks (ValueError on a bad URL, secret file or pairing)."""
    if len(urls) != len(secrets):
        raise ValueError(
            f"{len(urls)} --webhook and {len(secrets)} --webhook-secret: each webhook has its secret, in order"
        )
    out = []
    for url, path in zip(urls, secrets, strict=True):
        check_url(url)
        out.append(Webhook(url, read_secret(path)))
    if len({w.url for w in out}) != len(out):
        raise ValueError("--webhook: a URL given twice")
    return out


def payload(log_: EventLog, ev: SandboxEvent) -> bytes:
    """The body of the delivery of ``ev`` (docs/webhooks.md)."""
    return json.dumps(
        {
            "id": log_.event_id(ev),
            "type": f"sandbox.{ev.action.value}",
            "sandbox_id": ev.sandbox_id,
            "action": ev.action.value,
            "sequence": ev.sequence,
            "cursor": ev.cursor,
            "timestamp": ev.timestamp,
            "attributes": ev.attributes,
            "owner": ev.owner,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


class DeliveryError(Exception):
    pass


async def post(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout: float,
    ssl_context: ssl.SSLContext | None = None,
) -> int:
    """POST ``body`` to ``url`` on a new connection; the response's status (DeliveryError
    when there is none within ``timeout``)."""
    u = check_url(url)
    host = u.hostname or ""
    port = u.port or (443 if u.scheme == "https" else 80)
    target = (u.path or "/") + (f"?{u.query}" if u.query else "")
    try:
        with trio.fail_after(timeout):
            stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
            async with stream:
                if u.scheme == "https":
                    ctx = ssl_context or ssl.create_default_context()
                    tls = trio.SSLStream(stream, ctx, server_hostname=host, https_compatible=True)
                    await tls.do_handshake()
                    stream = tls
                conn = h11.Connection(h11.CLIENT)
                hostport = host if u.port is None else f"{host}:{u.port}"
                head = [
                    ("Host", hostport),
                    ("User-Agent", USER_AGENT),
                    ("Content-Type", "application/json"),
                    ("Content-Length", str(len(body))),
                    ("Connection", "close"),
                    *headers.items(),
                ]
                out = conn.send(h11.Request(method="POST", target=target, headers=head))
                out += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
                await stream.send_all(out)
                while True:
                    ev = conn.next_event()
                    if ev is h11.NEED_DATA:
                        data = await stream.receive_some(MAX_RESPONSE)
                        conn.receive_data(bytes(data))
                        continue
                    if isinstance(ev, h11.Response):
                        return int(ev.status_code)
                    if isinstance(ev, h11.ConnectionClosed):
                        raise DeliveryError("the connection closed with no response")
    except trio.TooSlowError:
        raise DeliveryError(f"no response within {timeout} s") from None
    except (OSError, trio.BrokenResourceError, ssl.SSLError, h11.ProtocolError) as exc:
        raise DeliveryError(f"{type(exc).__name__}: {exc}") from None


@attrs.define
class Stats:
    delivered: int = 0  # events a listener took (2xx)
    retried: int = 0  # attempts that failed (each retried later)


class WebhookSender:
    """Delivers the outbox of ``log`` to ``hooks`` (see the module's docstring)."""

    def __init__(
        self,
        log_: EventLog,
        hooks: Sequence[Webhook],
        *,
        base_delay: float = 1.0,
        max_delay: float = 300.0,
        timeout: float = 10.0,
        concurrency: int = 8,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.log = log_
        self.hooks = list(hooks)
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.timeout = timeout
        self.ssl_context = ssl_context
        self.limiter = trio.CapacityLimiter(concurrency)
        self.stats = {h.key: Stats() for h in self.hooks}
        self.lanes: set[tuple[str, str]] = set()
        self._changed = trio.Event()

    def _wake(self) -> None:
        self._changed.set()

    async def run(self, task_status: trio.TaskStatus[WebhookSender] = trio.TASK_STATUS_IGNORED) -> None:
        self.log.listeners.append(self._wake)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(self)
                while True:
                    self._changed = trio.Event()
                    for hook in self.hooks:
                        for sid in list(self.log.queues[hook.key]):
                            if (hook.key, sid) not in self.lanes:
                                self.lanes.add((hook.key, sid))
                                nursery.start_soon(self._lane, hook, sid)
                    await self._changed.wait()
        finally:
            self.log.listeners.remove(self._wake)

    async def _lane(self, hook: Webhook, sid: str) -> None:
        """``sid``'s events to ``hook``, one at a time, oldest first, until none is left."""
        failures = 0
        try:
            while q := self.log.queues[hook.key].get(sid):
                ev = q[0]
                if await self._attempt(hook, ev):
                    self.log.delivered(hook.key, ev)
                    self.stats[hook.key].delivered += 1
                    failures = 0
                    continue
                self.stats[hook.key].retried += 1
                failures += 1
                delay = min(self.max_delay, self.base_delay * 2 ** min(failures - 1, 30))
                await trio.sleep(random.uniform(delay / 2, delay))
        finally:
            self.lanes.discard((hook.key, sid))
        self._wake()  # (an event that came as this lane ended gets a new one)

    async def _attempt(self, hook: Webhook, ev: SandboxEvent) -> bool:
        body = payload(self.log, ev)
        headers = {**sign(hook.secret, body), ID_HEADER: self.log.event_id(ev)}
        async with self.limiter:
            try:
                status = await post(hook.url, body, headers, timeout=self.timeout, ssl_context=self.ssl_context)
            except DeliveryError as exc:
                log.info("webhook %s: %s not delivered: %s (retrying)", hook.url, self.log.event_id(ev), exc)
                return False
        if 200 <= status < 300:
            return True
        log.info("webhook %s: %s answered %d (retrying)", hook.url, self.log.event_id(ev), status)
        return False


class WebhookCollector(Collector):
    """The delivery metrics (supervisor/serve/metrics.py's registry adds them to a scrape)."""

    def __init__(self, sender: WebhookSender) -> None:
        self.sender = sender

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s, lg = self.sender, self.sender.log
        delivered = CounterMetricFamily(
            "sandvisor_webhook_delivered", "Events a webhook's listener took (2xx)", labels=["url"]
        )
        retried = CounterMetricFamily(
            "sandvisor_webhook_retries", "Delivery attempts that failed (each retried later)", labels=["url"]
        )
        depth = GaugeMetricFamily("sandvisor_webhook_queue_depth", "Events not yet delivered", labels=["url"])
        for h in s.hooks:
            st = s.stats[h.key]
            delivered.add_metric([h.url], st.delivered)
            retried.add_metric([h.url], st.retried)
            depth.add_metric([h.url], sum(len(q) for q in lg.queues[h.key].values()))
        yield from (delivered, retried, depth)
        oldest = lg.oldest_ns()
        yield GaugeMetricFamily(
            "sandvisor_webhook_oldest_age_seconds",
            "Age of the oldest undelivered event (0: none)",
            value=max(0.0, time.time() - oldest / 1e9) if oldest else 0.0,
        )
        yield CounterMetricFamily(
            "sandvisor_webhook_dropped", "Undelivered events dropped by the outbox's bound", value=lg.counters.dropped
        )
        yield CounterMetricFamily(
            "sandvisor_events_lost", "Events the event log could not commit", value=lg.counters.lost
        )
