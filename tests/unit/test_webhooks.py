"""Webhooks (supervisor/serve/webhooks.py) and the event log (supervisor/serve/eventlog.py) on fake VMs,
with a real HTTP listener on loopback: a listener down, then failing, then up gets every
event once (after de-duplication), in order per sandbox, each verified; a crashed
supervisor's queued events are delivered by the next one; a forged signature fails; the
outbox's bound drops the oldest, counted; ``events --since`` resumes with no gap."""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import h11
import pytest
import trio
import trustme

from actors.model import Action, SandboxConfig, SandboxEvent, State
from actors.principals import Principal
from actors.registry import Registry
from actors.store import Store
from supervisor.client.sdk.aio import connect
from supervisor.client.sdk.webhooks import WebhookVerificationError, sign, verify_webhook
from supervisor.serve.api import METHODS
from supervisor.serve.eventlog import EventLog
from supervisor.serve.metrics import MetricsSample, render
from supervisor.serve.server import Server
from supervisor.serve.webhooks import Webhook, WebhookCollector, WebhookSender, read_secret, webhooks
from supervisor.wire.protocol import SandboxEventsRequest
from tests.support.fakevm import FakeLab, fake_settings

SECRET = b"s3cret-" + b"x" * 40


@attrs.define
class Listener:
    """An HTTP listener on 127.0.0.1: ``status`` answers each POST (None: not listening)."""

    port: int = 0
    status: int | None = None
    got: list[tuple[dict[str, str], bytes]] = attrs.Factory(list)
    attempts: int = 0
    ssl_context: ssl.SSLContext | None = None
    changed: trio.Event = attrs.Factory(trio.Event)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        sock.listen(16)
        listener = trio.SocketListener(sock)
        async with listener, trio.open_nursery() as n:
            task_status.started()
            while True:
                stream = await listener.accept()
                n.start_soon(self._serve, stream)

    async def _serve(self, raw: trio.SocketStream) -> None:
        try:
            await self._exchange(raw)
        except trio.BrokenResourceError:
            pass  # (a client that refused our certificate)

    async def _exchange(self, raw: trio.SocketStream) -> None:
        stream: trio.abc.Stream = raw
        async with raw:
            if self.ssl_context is not None:
                stream = trio.SSLStream(raw, self.ssl_context, server_side=True)
            conn = h11.Connection(h11.SERVER)
            headers: dict[str, str] = {}
            body = b""
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(ev, h11.Request):
                    headers = {k.decode(): v.decode() for k, v in ev.headers}
                elif isinstance(ev, h11.Data):
                    body += ev.data
                elif isinstance(ev, h11.EndOfMessage):
                    break
            self.attempts += 1
            status = self.status or 500
            if status < 300:
                self.got.append((headers, body))
            self.changed.set()
            self.changed = trio.Event()
            out = conn.send(h11.Response(status_code=status, headers=[("Content-Length", "0")]))
            await stream.send_all(out + conn.send(h11.EndOfMessage()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def registry(root: Path, lab: FakeLab, log: EventLog, *, crash: bool = False) -> AsyncIterator[Registry]:
    """A registry on fake VMs whose events go to ``log``; ``crash``: dropped with no shutdown."""
    store = Store(root / "state" / "sandvisor.db")
    try:
        async with trio.open_nursery() as n:
            await n.start(lab.run)
            reg = Registry(fake_settings(root, lab, allowed_paths=(root,)), store, templates=False)
            reg.events.journal = log.append
            reg.events.backlog = log.after
            await n.start(reg.run)
            try:
                yield reg
            finally:
                if not crash:
                    await reg.shutdown(5)
                n.cancel_scope.cancel()
    finally:
        if not crash:
            store.close()


async def lifecycle(reg: Registry, *ids: str) -> None:
    for id in ids:
        sb = await reg.create(id, SandboxConfig())
        with trio.fail_after(60):
            await sb.ready_event.wait()
        assert sb.state == State.READY
    for id in ids:
        reg.stop(id, 5)
        await reg.get(id).wait_stopped()
        await reg.remove(id, force=True)


def check_deliveries(got: list[tuple[dict[str, str], bytes]], log: EventLog) -> dict[str, list[dict[str, Any]]]:
    """Each delivery verified; after de-duplication by id every logged event once, in
    order per sandbox. Returns the events by sandbox."""
    seen: dict[str, dict[str, Any]] = {}
    by_sandbox: dict[str, list[dict[str, Any]]] = {}
    for headers, body in got:
        ev = verify_webhook(SECRET, headers, body)
        assert headers["sandvisor-webhook-id"] == ev["id"]  # (h11 gives names lower case)
        if ev["id"] in seen:
            assert seen[ev["id"]] == ev  # a repeat is the same event
            continue
        seen[ev["id"]] = ev
        by_sandbox.setdefault(ev["sandbox_id"], []).append(ev)
    logged = log.after(0, 10_000)
    assert sorted(seen) == sorted(log.event_id(e) for e in logged)
    for evs in by_sandbox.values():
        assert [e["sequence"] for e in evs] == list(range(1, len(evs) + 1))  # in order, none missing
        assert [e["cursor"] for e in evs] == sorted(e["cursor"] for e in evs)
    return by_sandbox


async def test_a_listener_down_then_failing_then_up_gets_every_event_once_in_order(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    listener = Listener(port=free_port())  # nothing listens there yet: connections are refused
    hook = Webhook(f"http://127.0.0.1:{listener.port}/hooks/sandvisor?x=1", SECRET)
    log = EventLog(tmp_path / "state" / "events.db", [hook.key])
    sender = WebhookSender(log, [hook], base_delay=0.02, max_delay=0.2, timeout=5)
    lab = FakeLab()
    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            await n.start(sender.run)
            async with registry(tmp_path, lab, log) as reg:
                await lifecycle(reg, "a", "b")
            assert sender.stats[hook.key].delivered == 0 and sender.stats[hook.key].retried > 0
            assert log.depth() == len(log.after(0)) > 0
            listener.status = 500  # up, but failing
            await n.start(listener.run)
            while listener.attempts < 4:
                await listener.changed.wait()
            assert not listener.got
            listener.status = 200
            while log.depth():  # (the listener answers before the sender records it)
                await trio.sleep(0.01)
            n.cancel_scope.cancel()
    by_sandbox = check_deliveries(listener.got, log)
    assert [e["action"] for e in by_sandbox["a"]] == ["created", "ready", "stopping", "stopped", "removed"]
    assert [e["action"] for e in by_sandbox["b"]] == ["created", "ready", "stopping", "stopped", "removed"]
    first = json.loads(listener.got[0][1])
    assert set(first) == {
        "id",
        "type",
        "sandbox_id",
        "action",
        "sequence",
        "cursor",
        "timestamp",
        "attributes",
        "owner",
    }
    assert listener.got[0][0]["host"] == f"127.0.0.1:{listener.port}"
    text = render(MetricsSample(), process=False, extra=[WebhookCollector(sender)]).decode()
    assert f'sandvisor_webhook_delivered_total{{url="{hook.url}"}} 10.0' in text
    assert f'sandvisor_webhook_queue_depth{{url="{hook.url}"}} 0.0' in text
    assert "sandvisor_webhook_oldest_age_seconds 0.0" in text
    log.close()


async def test_a_crashed_supervisors_queued_events_are_delivered_by_the_next(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    listener = Listener(port=free_port(), status=200)  # (down until it runs)
    hook = Webhook(f"http://127.0.0.1:{listener.port}/", SECRET)
    path = tmp_path / "state" / "events.db"
    log = EventLog(path, [hook.key])
    with trio.fail_after(120):
        async with trio.open_nursery() as n:  # the first supervisor: the listener is down
            await n.start(WebhookSender(log, [hook], base_delay=0.02, max_delay=0.1).run)
            async with registry(tmp_path, FakeLab(), log, crash=True) as reg:
                sb = await reg.create("c", SandboxConfig())
                await sb.ready_event.wait()
            n.cancel_scope.cancel()  # a crash: no shutdown, the log not closed
    queued = [log.event_id(e) for e in log.after(0)]
    actions = [e.action.value for e in log.after(0)]
    assert actions[:2] == ["created", "ready"]
    # a cleanly stopped one next: its events queued as well
    log2 = EventLog(path, [hook.key])
    assert log2.depth() == len(queued)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            await n.start(WebhookSender(log2, [hook], base_delay=0.02, max_delay=0.1).run)
            log2.append(SandboxEvent("c", Action.STOPPED, 1))
            n.cancel_scope.cancel()
    log2.close()
    log3 = EventLog(path, [hook.key])  # the third: the listener is up now
    assert log3.depth() == len(queued) + 1
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            await n.start(listener.run)
            await n.start(WebhookSender(log3, [hook], base_delay=0.02, max_delay=0.1).run)
            while log3.depth():
                await trio.sleep(0.01)
            n.cancel_scope.cancel()
    by_sandbox = check_deliveries(listener.got, log3)
    assert [e["action"] for e in by_sandbox["c"]] == [*actions, "stopped"]
    assert [e["id"] for e in by_sandbox["c"]][: len(queued)] == queued
    log3.close()
    log.close()


async def test_https_with_the_system_store_or_a_given_ca(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    listener = Listener(status=204, ssl_context=server_ctx)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(listener.run)
            hook = Webhook(f"https://127.0.0.1:{listener.port}/", SECRET)
            log = EventLog(tmp_path / "events.db", [hook.key])
            untrusted = WebhookSender(log, [hook], base_delay=0.05, max_delay=0.1)  # the system store: not our CA
            async with trio.open_nursery() as inner:
                await inner.start(untrusted.run)
                log.append(SandboxEvent("t", Action.CREATED, 1))
                while untrusted.stats[hook.key].retried < 2:
                    await trio.sleep(0.02)
                inner.cancel_scope.cancel()
            assert listener.attempts == 0 and log.depth() == 1
            client_ctx = ssl.create_default_context()
            ca.configure_trust(client_ctx)
            await n.start(WebhookSender(log, [hook], base_delay=0.05, ssl_context=client_ctx).run)
            while log.depth():  # (the listener answers before the sender records it)
                await trio.sleep(0.01)
            n.cancel_scope.cancel()
    check_deliveries(listener.got, log)
    log.close()


def test_a_wrong_signature_or_secret_or_an_old_one_fails_verify() -> None:
    body = b'{"id":"evt_1","action":"ready"}'
    headers = sign(SECRET, body)
    assert verify_webhook(SECRET, headers, body)["action"] == "ready"
    assert verify_webhook(SECRET, {k.lower(): v for k, v in headers.items()}, body)["id"] == "evt_1"
    for secret, h, b, why in (
        (b"another" * 6, headers, body, "does not match"),
        (SECRET, headers, body.replace(b"ready", b"stopd"), "does not match"),
        (SECRET, {"Sandvisor-Signature": headers["Sandvisor-Signature"].replace("v1=", "v1=0")}, body, "not match"),
        (SECRET, {}, body, "no Sandvisor-Signature"),
        (SECRET, {"Sandvisor-Signature": "t=x,v1=ab"}, body, "not a number"),
        (SECRET, sign(SECRET, body, timestamp=1_000_000), body, "away"),  # a replay of an old one
    ):
        with pytest.raises(WebhookVerificationError, match=why):
            verify_webhook(secret, h, b)


def test_the_outbox_is_bounded_the_oldest_dropped_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = EventLog(tmp_path / "events.db", ["h"], max_events=5)
    for i in range(8):
        log.append(SandboxEvent("s", Action.READY, i))
    assert log.count == 5 and log.depth() == 5 and log.counters.dropped == 3
    assert [e.sequence for e in log.queues["h"]["s"]] == [4, 5, 6, 7, 8]
    assert "undelivered events dropped" in caplog.text
    with pytest.raises(Exception, match="no longer in the log"):
        log.after(1)
    assert [e.cursor for e in log.after(3)] == [4, 5, 6, 7, 8]
    log.close()
    again = EventLog(tmp_path / "events.db", [], max_events=5)  # the webhook no longer configured
    assert again.depth() == 0 and again.sequences == {"s": 8}
    again.close()


def test_the_secret_file_is_private_and_webhooks_pair_with_secrets(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="0600"):
        read_secret(f)
    f.chmod(0o600)
    assert read_secret(f) == SECRET
    link = tmp_path / "link"
    link.symlink_to(f)
    with pytest.raises(ValueError, match="--webhook-secret"):
        read_secret(link)
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="printable"):
        read_secret(short)
    with pytest.raises(ValueError, match="in order"):
        webhooks(["http://127.0.0.1:1/"], [])
    for bad in ("ftp://x/", "http://u:p@host/", "http:///nohost", "http://h:99999/"):
        with pytest.raises(ValueError):
            webhooks([bad], [f])
    assert [w.url for w in webhooks(["https://hooks.example/in"], [f])] == ["https://hooks.example/in"]


async def test_events_since_a_cursor_resumes_with_no_gap(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    short = Path(os.environ.get("TMPDIR", "/tmp"))
    sock_dir = trio.Path(short) / f"wh{os.getpid()}"
    await sock_dir.mkdir(exist_ok=True)
    log = EventLog(tmp_path / "state" / "events.db")
    try:
        with trio.fail_after(60):
            async with registry(tmp_path, FakeLab(), log) as reg, trio.open_nursery() as n:
                await n.start(Server(reg, Path(sock_dir) / "m.sock").serve)
                async with connect(Path(sock_dir) / "m.sock") as c:
                    seen: list[dict[str, Any]] = []
                    # since 0: the log's events first (a create that comes before the
                    # server's subscription is not missed), then the live ones
                    async with c.open_call("Events", {"id": "r", "since": 0}) as call:
                        sb = await reg.create("r", SandboxConfig())
                        async for e in call:
                            seen.append(e)
                            if e["action"] == "created":
                                break  # a disconnect
                    await sb.ready_event.wait()  # ready happens while no one listens
                    reg.stop("r", 5)
                    await sb.wait_stopped()
                    async with c.open_call("Events", {"id": "r", "since": seen[-1]["cursor"]}) as call:
                        async for e in call:
                            seen.append(e)
                            if e["action"] == "stopped":
                                break
                    assert [e["action"] for e in seen] == ["created", "ready", "stopping", "stopped"]
                    assert [e["sequence"] for e in seen] == [1, 2, 3, 4]
                    with pytest.raises(Exception, match="cursor is 0 or more"):
                        async with c.open_call("Events", {"since": -1}) as call:
                            async for _ in call:
                                pass
                n.cancel_scope.cancel()
    finally:
        log.close()
        for p in ("m.sock",):
            (Path(sock_dir) / p).unlink(missing_ok=True)
        Path(sock_dir).rmdir()


def test_unlogged_events_pass_when_the_log_cannot_commit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog(tmp_path / "events.db", ["h"])
    log.db.execute("PRAGMA query_only=1")  # as a full disk would, every commit fails
    ev = log.append(SandboxEvent("s", Action.READY, 1))
    assert ev.cursor == 0 and log.counters.lost == 1 and log.depth() == 0
    assert "not logged" in caplog.text
    with caplog.at_level(logging.INFO):
        log.close()


@attrs.define
class StubIO:
    """A call's I/O as the edges give it to a handler: who asks, and what it is sent."""

    principal: Principal
    sent: list[Any] = attrs.Factory(list)

    async def send(self, message: Any) -> None:
        self.sent.append(message)

    async def receive(self) -> Any | None:
        return None


async def test_a_replay_shows_a_principal_only_its_own_sandboxes_events(tmp_path: Path) -> None:
    """``since`` replays through the same filter as the live stream: another owner's
    events are not in it, an admin's replay has them all."""
    (tmp_path / "state").mkdir()
    log = EventLog(tmp_path / "state" / "events.db")
    events = METHODS["Events"].handler
    with trio.fail_after(60):
        async with registry(tmp_path, FakeLab(), log) as reg:
            for id, owner in (("mine", "uid:1000"), ("theirs", "uid:2000")):
                sb = await reg.create(id, SandboxConfig(), owner=owner)
                await sb.ready_event.wait()
            for who, want in ((Principal.uid(1000), {"mine"}), (Principal.uid(0, admin=True), {"mine", "theirs"})):
                io = StubIO(who)
                with trio.move_on_after(0.5):  # (the replay, then the live stream waits)
                    await events(reg, io, SandboxEventsRequest(since=0))
                assert {e.sandbox_id for e in io.sent} == want
                assert all(e.cursor for e in io.sent)
    log.close()
