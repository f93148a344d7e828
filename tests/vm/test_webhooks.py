"""``serve --webhook``: a real ``sandvisor serve`` delivers a real sandbox's create, ready,
stop and remove to a listener on loopback, each signed; ``sandvisor events --since``
replays them with their cursors."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from images.build import Image
from supervisor.client.sdk.webhooks import verify_webhook
from supervisor.main.throwaway import supervisor_process, workdir

SECRET = "9f" * 32


@contextmanager
def listener() -> Iterator[tuple[str, list[tuple[dict[str, str], bytes]], threading.Condition]]:
    got: list[tuple[dict[str, str], bytes]] = []
    cond = threading.Condition()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with cond:
                got.append((dict(self.headers.items()), body))
                cond.notify_all()
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/sandvisor", got, cond
    finally:
        server.shutdown()
        server.server_close()
        t.join()


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=300,
        check=False,
    )


def test_a_real_sandbox_lifecycle_reaches_the_webhook_signed(image: Image) -> None:
    with listener() as (url, got, cond), workdir("sv-webhooks-") as work:
        secret = Path(work.root) / "webhook.secret"
        secret.write_text(SECRET + "\n")
        secret.chmod(0o600)
        with supervisor_process(work, "--webhook", url, "--webhook-secret", str(secret)) as (env, _):
            for args in (("create", "hooked", "--json"), ("stop", "hooked"), ("rm", "hooked")):
                r = cli(env, *args)
                assert r.returncode == 0, r.stderr
            want = ["created", "ready", "stopping", "stopped", "removed"]

            def arrived() -> list[str]:
                events = {}
                for headers, body in got:
                    ev = verify_webhook(SECRET, headers, body)
                    events[ev["id"]] = ev  # (de-duplicated by id)
                return [e["action"] for e in sorted(events.values(), key=lambda e: e["sequence"])]

            with cond:
                assert cond.wait_for(lambda: arrived()[: len(want)] == want, timeout=120), arrived()
            evs = [json.loads(body) for _, body in got]
            assert all(e["sandbox_id"] == "hooked" for e in evs)
            assert [e["sequence"] for e in evs][: len(want)] == [1, 2, 3, 4, 5]
            # the CLI replays the log after a cursor, each line with its own
            p = subprocess.Popen(
                [sys.executable, "-m", "supervisor.main.cli", "events", "--since", str(evs[1]["cursor"]), "--json"],
                env=env,
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
            )
            try:
                assert p.stdout is not None
                lines = [json.loads(p.stdout.readline()) for _ in range(3)]
            finally:
                p.kill()
                p.wait()
                if p.stdout is not None:
                    p.stdout.close()
            assert [(e["action"], e["cursor"]) for e in lines] == [(e["action"], e["cursor"]) for e in evs[2:5]]
