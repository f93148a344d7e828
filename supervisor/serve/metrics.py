"""``serve --metrics HOST:PORT``: the supervisor's and every sandbox's metrics, Prometheus text format.

A tiny HTTP/1.1 server in Trio (no thread: a scrape runs in Trio's thread, so the
source reads the registry's state as it is, with no lock) answers ``GET /metrics``::

    Prometheus ──GET /metrics──► MetricsEndpoint ──await source.collect_metrics()──► registry
      Authorization: Bearer T        │ (401 without the token; scrape_timeout: 503 if the source is late;
                                     │  one collection at a time, kept for cache_for seconds)
                                     └─ prometheus_client renders samples + process_* of the supervisor

The endpoint is a door: it names every sandbox and image, and a collection asks every
guest. So every request carries ``Authorization: Bearer TOKEN`` (``serve
--metrics-token-file``, read by :mod:`supervisor.serve.tokens`; compared in constant time) or
gets 401 before anything is read; the address is loopback only (plain HTTP: a token must
not cross a network); and however often token holders scrape, the guests are asked at
most once per ``cache_for`` seconds (concurrent scrapes share one collection).

The source is anything with ``async def collect_metrics() -> MetricsSample``; the
daemon's is :class:`RegistrySource`: what each live sandbox's QEMU process has used on
the host (CPU time and RSS, read from /proc), its configured memory, and the memory
its guest reports available (asked concurrently at each scrape, each guest bounded by
``guest_timeout``: a silent guest loses that one series, not the scrape).
The text format (escaping, TYPE/HELP, counters' ``_total``) is prometheus_client's.

Series (``id`` is the sandbox id):

* ``sandvisor_sandboxes{state}``: sandboxes registered, by state
* ``sandvisor_sandbox_info{id,state,image}``: 1 per sandbox sampled
* ``sandvisor_sandbox_cpu_seconds_total{id}``: host CPU of the sandbox's VM (counter)
* ``sandvisor_sandbox_memory_rss_bytes{id}``: resident memory of the VM on the host
* ``sandvisor_sandbox_memory_limit_bytes{id}``: the guest's configured memory
* ``sandvisor_sandbox_guest_memory_available_bytes{id}``: as the guest last reported it
* ``sandvisor_webhook_*``: webhook delivery (docs/webhooks.md), with ``serve --webhook``
* ``process_*``: the supervisor's own CPU, memory and file descriptors
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from actors.face import ALIVE, ENDED, DomainError
from supervisor.serve.tokens import bearer_ok, check_token

if TYPE_CHECKING:
    from actors.face import Registry, Sandbox

log = logging.getLogger("sandvisor.metrics")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9464  # the Prometheus exporters' registry has no sandvisor entry; this one is free there
MAX_REQUEST = 8192
MAX_CONNECTIONS = 16
CACHE_FOR = 5.0  # s: a scrape within this long of the last collection is answered from it


@attrs.frozen
class SandboxSample:
    """One sandbox at scrape time."""

    id: str
    state: str
    cpu_seconds_total: float = 0.0  # the VM process's user + system time
    memory_rss_bytes: int = 0
    memory_limit_bytes: int = 0
    guest_memory_available_bytes: int | None = None  # None: no report from the guest
    image: str = ""


@attrs.frozen
class MetricsSample:
    sandboxes: Sequence[SandboxSample] = ()  # those with series (live ones)
    by_state: Mapping[str, int] = attrs.field(factory=dict)  # every registered sandbox, counted


class MetricsSource(Protocol):
    async def collect_metrics(self) -> MetricsSample: ...


class SampleCollector(Collector):
    """prometheus_client collector over one :class:`MetricsSample` (pure: testable with fakes)."""

    def __init__(self, sample: MetricsSample) -> None:
        self.sample = sample

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.sample
        states = GaugeMetricFamily("sandvisor_sandboxes", "Sandboxes registered, by state", labels=["state"])
        for state, n in sorted(s.by_state.items()):
            states.add_metric([state], n)
        yield states
        info = GaugeMetricFamily("sandvisor_sandbox_info", "A sandbox and its state", labels=["id", "state", "image"])
        cpu = CounterMetricFamily(
            "sandvisor_sandbox_cpu_seconds", "Host CPU time used by the sandbox's VM", labels=["id"]
        )
        rss = GaugeMetricFamily("sandvisor_sandbox_memory_rss_bytes", "Host memory resident in the VM", labels=["id"])
        limit = GaugeMetricFamily("sandvisor_sandbox_memory_limit_bytes", "The guest's memory size", labels=["id"])
        avail = GaugeMetricFamily(
            "sandvisor_sandbox_guest_memory_available_bytes", "Memory available, as the guest reports", labels=["id"]
        )
        for sb in s.sandboxes:
            info.add_metric([sb.id, sb.state, sb.image], 1)
            cpu.add_metric([sb.id], sb.cpu_seconds_total)
            rss.add_metric([sb.id], sb.memory_rss_bytes)
            limit.add_metric([sb.id], sb.memory_limit_bytes)
            if sb.guest_memory_available_bytes is not None:
                avail.add_metric([sb.id], sb.guest_memory_available_bytes)
        yield from (info, cpu, rss, limit, avail)


def render(sample: MetricsSample, *, process: bool = True, extra: Sequence[Collector] = ()) -> bytes:
    """The text exposition of ``sample`` (and the supervisor process's own metrics, and
    ``extra``'s: the webhooks' delivery)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SampleCollector(sample))
    for c in extra:
        registry.register(c)
    if process:
        ProcessCollector(registry=registry)
    return generate_latest(registry)


def parse_listen(spec: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` (loopback); ``[::1]:PORT`` for IPv6."""
    host, sep, port = spec.rpartition(":")
    if not sep:
        host, port = "", spec
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {spec!r}")
    host = host.removeprefix("[").removesuffix("]") or DEFAULT_HOST
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Every address ``host`` names is a loopback one (its class, 127.0.0.0/8 and ::1: not
    a list of spellings); a name is resolved first (False if it does not resolve)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    addrs = {str(info[4][0]).split("%", 1)[0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


NOT_LOOPBACK = "plain HTTP with a bearer token is for loopback addresses only (127.0.0.0/8, ::1)"


def check_listen(spec: str) -> tuple[str, int]:
    """``--metrics``'s address, parsed and loopback (ValueError otherwise)."""
    host, port = parse_listen(spec)
    if not is_loopback(host):
        raise ValueError(f"{host}: {NOT_LOOPBACK}; scrape from another host through a tunnel or a TLS proxy")
    return host, port


class MetricsEndpoint:
    """``GET /metrics`` on ``host:port``. ``await nursery.start(ep.run)`` returns once listening
    (``ep.port`` then holds the bound port, for port 0)."""

    def __init__(
        self,
        source: MetricsSource,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        *,
        token: bytes,
        scrape_timeout: float = 5.0,
        cache_for: float = CACHE_FOR,
        extra: Sequence[Collector] = (),
    ) -> None:
        self.source = source
        self.extra = tuple(extra)  # collectors of the supervisor's own services (webhooks)
        self.host = host
        self.port = port
        self.token = check_token(token)
        self.scrape_timeout = scrape_timeout
        self.cache_for = cache_for
        self.scrapes = 0  # scrapes answered 200
        self.collections = 0  # times the source was asked
        self.unauthorized = 0
        self._slots = trio.Semaphore(MAX_CONNECTIONS)
        self._collecting = trio.Lock()
        self._last: tuple[float, MetricsSample] | None = None

    async def run(self, task_status: trio.TaskStatus[MetricsEndpoint] = trio.TASK_STATUS_IGNORED) -> None:
        if not is_loopback(self.host):
            raise ValueError(f"the metrics endpoint on {self.host}: {NOT_LOOPBACK}")
        try:
            listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        except OSError as exc:
            raise OSError(exc.errno, f"the metrics endpoint {self.host}:{self.port}: {exc.strerror}") from None
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept, listener)
            task_status.started(self)

    async def _accept(self, listener: trio.SocketListener) -> None:
        async with listener, trio.open_nursery() as nursery:
            while True:
                stream = await listener.accept()
                if self._slots.value == 0:
                    await stream.aclose()  # a flood of connections must not grow tasks without bound
                    continue
                nursery.start_soon(self._connection, stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with self._slots, stream:
            try:
                with trio.move_on_after(10):
                    head = await _read_head(stream)
                    if head is None:
                        return
                    status, body, ctype = await self._respond(head)
                    await stream.send_all(_response(status, body, ctype, head_only=head.startswith(b"HEAD ")))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    async def _respond(self, head: bytes) -> tuple[str, bytes, str]:
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return "400 Bad Request", b"bad request\n", "text/plain"
        verb, target, _ = parts
        if verb not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        if not bearer_ok(_header(head, b"authorization"), self.token):
            self.unauthorized += 1
            return "401 Unauthorized", b"Authorization: Bearer TOKEN (serve --metrics-token-file)\n", "text/plain"
        if target.split("?", 1)[0] != "/metrics":
            return "404 Not Found", b"GET /metrics\n", "text/plain"
        sample: MetricsSample | None = None
        with trio.move_on_after(self.scrape_timeout):
            sample = await self._sample()
        if sample is None:
            return "503 Service Unavailable", b"the supervisor did not answer in time\n", "text/plain"
        self.scrapes += 1
        return "200 OK", render(sample, extra=self.extra), CONTENT_TYPE_LATEST

    async def _sample(self) -> MetricsSample:
        """The last collection if it is younger than ``cache_for``, else a new one (one at a
        time: scrapes that arrive during a collection get its result)."""
        async with self._collecting:
            if self._last is not None and trio.current_time() - self._last[0] < self.cache_for:
                return self._last[1]
            sample = await self.source.collect_metrics()
            self.collections += 1
            self._last = (trio.current_time(), sample)
            return sample


def _header(head: bytes, name: bytes) -> bytes | None:
    """The value of the request head's one ``name`` header (None if absent or repeated)."""
    found = [
        line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n")[1:]
        if b":" in line and line.split(b":", 1)[0].strip().lower() == name
    ]
    return found[0] if len(found) == 1 else None


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_REQUEST:
            return None
        data = await stream.receive_some(4096)
        if not data:
            return None
        buf += data
    return buf.split(b"\r\n\r\n", 1)[0]


def _response(status: str, body: bytes, ctype: str, *, head_only: bool = False) -> bytes:
    challenge = 'WWW-Authenticate: Bearer realm="sandvisor metrics"\r\n' if status.startswith("401") else ""
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{challenge}"
        "Connection: close\r\nCache-Control: no-store\r\n\r\n"
    )
    return head.encode() + (b"" if head_only else body)


class RegistrySource:
    """The registry's sandboxes as a :class:`MetricsSource` (series for each one with a VM)."""

    def __init__(self, registry: Registry, *, guest_timeout: float = 1.0) -> None:
        self.registry = registry
        self.guest_timeout = guest_timeout

    async def collect_metrics(self) -> MetricsSample:
        reg = self.registry
        sandboxes = list(reg.sandboxes.values())
        live = [sb for sb in sandboxes if not sb.stopped and sb.state not in ENDED]
        available: dict[str, int] = {}

        async def ask(sb: Sandbox) -> None:
            with trio.move_on_after(self.guest_timeout):
                try:
                    m = await sb.guest_call(lambda g: g.channel.metrics())
                except DomainError:
                    return
                if "available" in m.mem:
                    available[sb.id] = int(m.mem["available"])

        async with trio.open_nursery() as nursery:
            for sb in live:
                if sb.state in ALIVE:
                    nursery.start_soon(ask, sb)
        image = reg.settings.image.name
        return MetricsSample(
            sandboxes=[
                SandboxSample(
                    id=sb.id,
                    state=sb.state.value,
                    cpu_seconds_total=sb.host_cpu_seconds(),
                    memory_rss_bytes=sb.host_rss(),
                    memory_limit_bytes=sb.limits.memory_mib << 20,
                    guest_memory_available_bytes=available.get(sb.id),
                    image=sb.config.boot.image or sb.config.boot.rootfs or image,  # an OCI image by its reference
                )
                for sb in live
            ],
            by_state=dict(Counter(sb.state.value for sb in sandboxes)),
        )
