"""Retention: events older than N days move to ledger_events_archive in batches, nothing is lost
from the spend reports, and replicas running the job at once move each event exactly once."""

import asyncio
import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import func, select

from metering import jobs, migrate
from metering.db import Database
from metering.ledger.retention import archive_old_events
from metering.ledger.tables import LedgerEvent, LedgerEventArchive
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.conftest import ADMIN_KEY, Api, catalog_for
from tests.reports.test_spend import (
    ROUTES,
    hold_spec,
    ledger_event,
    own_pg,  # noqa: F401 (a fixture)
    reserve_and_settle,
    rfc,
)

SIM_KEYS = {"SIM_OPENAI_KEY": "sim-key", "SIM_EXASCALE_KEY": "sim-key"}
NOW = datetime.now(UTC).replace(microsecond=0)


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request, sim, tmp_path):
    """A server on a database of the test's own (the job moves every old event it finds)."""
    if request.param == "postgresql":
        url = request.getfixturevalue("own_pg")
    else:
        url = f"sqlite:///{tmp_path / 'metering.db'}"
        migrate.upgrade(url)
    settings = Settings(database_url=url, admin_key=ADMIN_KEY, _env_file=None)
    catalog = parse_catalog(catalog_for(sim), environ=SIM_KEYS)
    running = metering_server(settings, catalog, run_jobs=False)
    yield Api(running.url, request.param, settings)
    running.stop()


def settle_events(api: Api, ages_h: list[float], seed: int) -> None:
    rng = random.Random(seed)
    team, user, token = api.principal()

    async def run() -> None:
        db = Database(api.settings.database_url, pool_size=2)
        try:
            for age in ages_h:
                spec = hold_spec(team["id"], user["id"], token["id"], rng.choice(ROUTES))
                created = NOW - timedelta(hours=age)
                prompt, completion = rng.randrange(1, 5000), rng.randrange(0, 900)
                event = ledger_event(spec, created, prompt, completion, reasoning=completion // 3)
                await reserve_and_settle(db, spec, event)
        finally:
            await db.dispose()

    asyncio.run(run())


def counts(url: str) -> tuple[int, int, int]:
    """Events in the hot ledger, in the archive, and distinct ids across both."""

    async def run():
        db = Database(url, pool_size=1)
        try:
            async with db.sessions() as session:
                hot = await session.scalar(select(func.count()).select_from(LedgerEvent))
                cold = await session.scalar(select(func.count()).select_from(LedgerEventArchive))
                both = select(LedgerEvent.id).union(select(LedgerEventArchive.id)).subquery()
                distinct = await session.scalar(select(func.count()).select_from(both))
            return hot, cold, distinct
        finally:
            await db.dispose()

    return asyncio.run(run())


def archive(url: str, days: int, batch: int = 1000, replicas: int = 1) -> int:
    async def run() -> int:
        dbs = [Database(url, pool_size=2) for _ in range(replicas)]
        try:
            moved = await asyncio.gather(
                *(archive_old_events(db, days, batch=batch, now=NOW) for db in dbs)
            )
            return sum(moved)
        finally:
            for db in dbs:
                await db.dispose()

    return asyncio.run(run())


REPORTS = [[], ["day"], ["hour", "model"], ["token", "provider", "day"]]


def reports(api: Api, windows) -> list:
    out = []
    for start, end in windows:
        for keys in REPORTS:
            params = {"start": rfc(start), "end": rfc(end), "group_by": ",".join(keys)}
            body = api.ok("GET", "/v1/spend", params=params)
            out.append((body["rows"], body["total"]))
    return out


def test_old_events_move_to_the_archive_and_reports_keep_them(server):
    api = server
    old = [24 * 40 + i * 1.7 for i in range(60)]  # 40 to 44 days ago
    recent = [i * 0.9 for i in range(1, 40)]
    settle_events(api, old + recent, seed=1)
    windows = [
        (NOW - timedelta(days=60), NOW + timedelta(minutes=1)),
        # Partial hours at both edges, inside the archived stretch: read from the archive.
        (NOW - timedelta(days=43, minutes=17), NOW - timedelta(days=41, minutes=44)),
        (NOW - timedelta(days=42, minutes=50), NOW - timedelta(days=42, minutes=5)),
    ]
    before = reports(api, windows)
    listed = {e["id"] for e in api.events()}
    assert len(listed) == 99

    assert archive(api.settings.database_url, days=30, batch=7) == 60
    assert counts(api.settings.database_url) == (39, 60, 99)
    assert reports(api, windows) == before
    # /v1/usage lists the hot ledger only.
    kept = {e["id"] for e in api.events()}
    assert len(kept) == 39 and kept < listed
    assert archive(api.settings.database_url, days=30) == 0  # nothing left to move


def test_the_archive_keeps_every_column(server):
    api = server
    settle_events(api, [24 * 50.5], seed=2)
    [listed] = api.events()
    assert archive(api.settings.database_url, days=30) == 1

    async def rows():
        db = Database(api.settings.database_url, pool_size=1)
        try:
            async with db.sessions() as session:
                return (await session.execute(select(LedgerEventArchive.__table__))).all()
        finally:
            await db.dispose()

    [row] = asyncio.run(rows())
    assert row.id == listed["id"]
    assert rfc(row.created_at) == listed["created_at"]
    assert (row.prompt_tokens, row.completion_tokens) == (
        listed["prompt_tokens"],
        listed["completion_tokens"],
    )
    assert row.cost == Decimal(listed["cost"]) * 10**12
    assert row.reasoning_tokens == listed["completion_tokens_details"]["reasoning_tokens"]


def test_replicas_running_the_job_at_once_move_each_event_once(server):
    api = server
    settle_events(api, [24 * 31 + i * 0.05 for i in range(300)], seed=3)
    moved = archive(api.settings.database_url, days=30, batch=20, replicas=3)
    assert moved == 300
    assert counts(api.settings.database_url) == (0, 300, 300)


def test_the_job_runs_only_with_a_retention_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("METERING_RETENTION_DAYS", "90")
    assert Settings(_env_file=None).retention_days == 90
    db = Database(f"sqlite:///{tmp_path / 'jobs.db'}")

    async def scheduled(retention_days):
        scheduler = jobs.start_scheduler(db, 900, retention_days)
        try:
            return {job.id for job in scheduler.get_jobs()}
        finally:
            scheduler.shutdown(wait=False)

    assert "archive_old_events" in asyncio.run(scheduled(90))
    assert "archive_old_events" not in asyncio.run(scheduled(None))
