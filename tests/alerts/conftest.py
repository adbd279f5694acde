"""Alert fixtures: a webhook receiver on loopback (a real HTTP server in a thread, answering as
each test scripts it), metering servers that allow loopback webhooks and retry fast, and
helpers that make budgets cross their thresholds."""

import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from metering import migrate
from metering.clock import MovableClock
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.budgets.conftest import (  # noqa: F401 - fixtures shared with the budget tests
    SIM_KEYS,
    catalog_file,
    fresh_db,
    fresh_pg,
    fresh_sqlite,
    new_pg_database,
    serve,
    wait_for,
)
from tests.conftest import ADMIN_KEY, Api, catalog_for

# Fast retries and polling, so a test sees a whole schedule in well under a second.
FAST = {
    "webhooks_allow_loopback": True,
    "webhook_poll_s": 0.05,
    "webhook_backoff_base_s": 0.05,
    "webhook_backoff_max_s": 0.2,
    "webhook_timeout_s": 30,
}
# sim:usage far above any hold: each request is charged exactly its hold (a usage anomaly
# capped at the authorisation), so a budget fills in exact steps.
OVER = 'sim:usage={"prompt_tokens":100000,"completion_tokens":100000,"total_tokens":200000}'


class Receiver:
    """A webhook receiver. `script[path]`: statuses to answer in turn (then 200); a path in
    `hang` is held until `release` is set; `redirect` paths answer 302 to /elsewhere."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.script: dict[str, list[int]] = {}
        self.hang: set[str] = set()
        self.hanging = 0
        self.release = threading.Event()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # the stdlib's name
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                with receiver.lock:
                    receiver.received.append(
                        {"path": self.path, "headers": dict(self.headers.items()), "body": body}
                    )
                    statuses = receiver.script.get(self.path) or []
                    status = statuses.pop(0) if statuses else 200
                    hang = self.path in receiver.hang
                    if hang:
                        receiver.hanging += 1
                if hang:
                    receiver.release.wait(60)
                    with receiver.lock:
                        receiver.hanging -= 1
                if self.path.startswith("/redirect"):
                    status = 302
                answer = b"receiver says " + (b"x" * 5000) if status >= 300 else b"ok"
                self.send_response(status)
                if status == 302:
                    self.send_header("location", "/elsewhere")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def at(self, path: str) -> list[dict]:
        with self.lock:
            return [r for r in self.received if r["path"] == path]

    def start(self) -> "Receiver":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver():
    server = Receiver().start()
    yield server
    server.stop()


def new_path() -> str:
    return f"/hook/{uuid.uuid4().hex[:12]}"


def settings_for(url: str, **overrides) -> Settings:
    return Settings(database_url=url, admin_key=ADMIN_KEY, _env_file=None, **{**FAST, **overrides})


def start_server(url: str, sim, run_jobs: bool = True, **overrides):
    catalog = parse_catalog(catalog_for(sim), environ=SIM_KEYS)
    settings = settings_for(url, **overrides)
    clock = MovableClock()
    server = metering_server(settings, catalog, run_jobs=run_jobs, clock=clock)
    backend = "postgresql" if "postgresql" in url else "sqlite"
    return server, Api(server.url, backend, settings, clock)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def alerts_db(request, tmp_path_factory):
    """A migrated database of this module's own, per backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('alerts') / 'metering.db'}"
        migrate.upgrade(url)
        yield url
        return
    with new_pg_database() as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture(scope="module")
def alerts_api(alerts_db, sim):
    server, api = start_server(alerts_db, sim)
    yield api
    server.stop()


@pytest.fixture
def alerts_clock(alerts_api) -> Iterator[MovableClock]:
    """alerts_api's clock, for a test to move forward; back on the wall clock after it."""
    yield alerts_api.clock
    alerts_api.clock.reset()


def hold(api: Api, url: str, events: list[str], team_id: str | None = None, **extra) -> dict:
    body = {"url": url, "events": events, "team_id": team_id, **extra}
    return api.ok("POST", "/v1/webhooks", 201, json=body)


def alerts(api: Api, key: str | None = None, **params) -> list[dict]:
    return api.ok("GET", "/v1/alerts", params={"limit": 1000, **params}, key=key)["data"]


def ask(api: Api, key: str, tag: str, **fields):
    """One request through the official SDK, charged exactly its hold (see OVER)."""
    client = api.openai(key)
    return client.chat.completions.create(
        model="gpt-sim",
        messages=[{"role": "user", "content": f"{tag} {OVER}"}],
        max_tokens=5,
        **fields,
    )


def hold_of(api: Api, tag: str) -> str:
    """What one request of `ask`'s shape is charged (its hold), measured on a fresh token."""
    _, _, token = api.principal()
    ask(api, token["token"], tag)
    (event,) = api.events(token_id=token["id"])
    return event["cost"]


def body_json(record: dict) -> dict:
    return json.loads(record["body"])
