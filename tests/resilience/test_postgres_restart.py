"""PostgreSQL restarted under a steady load: no 500, nothing lost, nothing counted twice.

A request either fails before the upstream with 503 ledger_unavailable, or reaches the upstream
and ends as exactly one ledger event (settled after the reconnect, or charged as `unsettled`
when its settle met the outage). The database is a private instance, restarted with
`pg_ctl restart -m fast` or stopped for a second, so the machine's shared cluster is never
touched."""

import threading
import time
import uuid
from decimal import Decimal

import httpx
import pytest

from metering import migrate
from metering.jobs import sweep_interval_s
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.budgets.conftest import budget, holds_of, pico, sim_records, usd, wait_for
from tests.conftest import ADMIN_KEY, Api, catalog_for
from tests.resilience.private_pg import PrivatePostgres, why_unavailable

HOLD_TTL_S = 6
WORKERS = 4
BEFORE_RESTART = 40  # responses before the restart
AFTER_RESTART = 60  # 200s needed after it (the database is back)
MAX_REQUESTS = 600
MAX_SECONDS = 120
# Long enough for every worker's request under way to meet it (their settles retry across it:
# METERING_SETTLE_RETRY_S, 30 s), shorter than anything that would give up.
OUTAGE_S = 1
RETRY_PAUSE_S = 0.1


@pytest.fixture
def private_pg():
    reason = why_unavailable()
    if reason:
        pytest.skip(f"no private PostgreSQL instance: {reason}")
    pg = PrivatePostgres().init()
    try:
        pg.start()
        yield pg
    finally:
        pg.destroy()


@pytest.fixture
def served(private_pg, sim):
    url = private_pg.create_database(f"metering_{uuid.uuid4().hex[:8]}")
    migrate.upgrade(url)
    settings = Settings(
        database_url=url,
        admin_key=ADMIN_KEY,
        hold_ttl_s=HOLD_TTL_S,
        db_pool_size=4,
        _env_file=None,
    )
    catalog = parse_catalog(
        catalog_for(sim), environ={"SIM_EXASCALE_KEY": "k", "SIM_OPENAI_KEY": "k"}
    )
    server = metering_server(settings, catalog)
    try:
        yield Api(server.url, "postgresql", settings)
    finally:
        server.stop()


class Load:
    """WORKERS threads sending chat completions one after another, half of them streamed, each
    with a marker of its own so the upstream's log tells which ones reached it."""

    def __init__(self, url: str, key: str, tag: str) -> None:
        self.url, self.key, self.tag = url, key, tag
        self.results: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.count = 0

    def _next(self) -> int | None:
        with self.lock:
            if self.stop.is_set() or self.count >= MAX_REQUESTS:
                return None
            self.count += 1
            return self.count

    def _one(self, client: httpx.Client, n: int) -> dict:
        marker = f"{self.tag}-{n}"
        stream = n % 2 == 0
        directives = "sim:tokens=6" + (" sim:chunks=6 sim:delay_ms=40" if stream else "")
        body = {
            "model": "gpt-sim",
            # Streams last a while, so some are under way when the database goes.
            "messages": [{"role": "user", "content": f"restart {marker} {directives}"}],
            "max_tokens": 6,
            "stream": stream,
        }
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            content = response.read()
        result = {
            "marker": marker,
            "status": response.status_code,
            "request_id": response.headers.get("x-request-id"),
            "stream": stream,
            "body": content.decode(errors="replace"),
        }
        if response.status_code != 200:
            result["code"] = response.json()["error"]["code"]
        return result

    def _work(self) -> None:
        headers = {"authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=90) as client:
            while (n := self._next()) is not None:
                result = self._one(client, n)
                with self.lock:
                    self.results.append(result)
                if result["status"] == 503:
                    time.sleep(RETRY_PAUSE_S)  # as a client would, before trying again

    def ok_count(self) -> int:
        with self.lock:
            return sum(r["status"] == 200 for r in self.results)

    def run(self, during) -> None:
        threads = [threading.Thread(target=self._work, daemon=True) for _ in range(WORKERS)]
        for thread in threads:
            thread.start()
        try:
            during(self)
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(120)


@pytest.mark.postgres
@pytest.mark.parametrize("outage", ["restart", "stop-pause-start"])
def test_postgres_restarted_under_load_loses_nothing(private_pg, served, sim, outage):
    api = served
    team, user, token = api.principal(token_limit="100", user_limit="100", team_limit="100")
    tag = f"pgr{uuid.uuid4().hex[:10]}"
    load = Load(api.url, token["token"], tag)
    restarted = {}

    def during(load: Load) -> None:
        deadline = time.monotonic() + MAX_SECONDS
        wait_for(lambda: len(load.results) >= BEFORE_RESTART, timeout=MAX_SECONDS)
        restarted["before"] = len(load.results)
        if outage == "restart":
            private_pg.restart()  # pg_ctl restart -m fast
        else:
            private_pg.stop()
            time.sleep(OUTAGE_S)  # requests keep coming while the database is away
            private_pg.start()
        restarted["ok_at_restart"] = load.ok_count()
        while load.ok_count() < restarted["ok_at_restart"] + AFTER_RESTART:
            assert time.monotonic() < deadline, "the load did not recover after the restart"
            time.sleep(0.05)

    load.run(during)
    results = load.results

    # No 500 and nothing else: a 200, or a 503 ledger_unavailable.
    statuses = {(r["status"], r.get("code")) for r in results}
    assert statuses <= {(200, None), (503, "ledger_unavailable")}, [
        r for r in results if r["status"] not in (200, 503)
    ][:3]
    ok = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 503]
    assert len(ok) >= BEFORE_RESTART + AFTER_RESTART - WORKERS

    # Wait out the hold TTL: a settle that met the outage is charged by the sweeper.
    wait_for(
        lambda: not holds_of(served.settings.database_url, token["id"]),
        timeout=HOLD_TTL_S + 4 * sweep_interval_s(HOLD_TTL_S) + 20,
        interval=0.2,
        message="every hold settled or swept",
    )

    received = sim_records(sim, tag)
    by_marker: dict[str, list[dict]] = {}
    for record in received:
        marker = record["received"]["messages"][-1]["content"].split()[1]
        by_marker.setdefault(marker, []).append(record)
    # A 503 was refused before the upstream; a 200 reached it exactly once.
    assert [r["marker"] for r in refused if r["marker"] in by_marker] == []
    assert all(len(by_marker.get(r["marker"], [])) == 1 for r in ok)
    assert len(received) == len(ok)

    events = api.events(token_id=token["id"])
    ids = [e["id"] for e in events]
    assert len(ids) == len(set(ids))  # no double event
    assert len(events) == len(received)  # one event per request the upstream received
    assert {r["request_id"] for r in ok} == set(ids)
    assert {e["usage_source"] for e in events} <= {"reported", "unsettled"}

    print(
        "DEBUG", len(ok), len(refused), sorted(e["usage_source"] for e in events).count("unsettled")
    )
    total = sum(usd(e["cost"]) for e in events)
    assert sum(pico(e["cost"]) for e in events) > 0
    for scope, subject in (("token", token["id"]), ("user", user["id"]), ("team", team["id"])):
        status = budget(api, scope, subject)
        assert usd(status["reserved"]) == 0, status
        assert usd(status["spent"]) == total, status
        assert usd(status["remaining"]) == Decimal(100) - total
