"""Every rollup equals the ledger: after settles alone and in groups over several days, a budget
window that rolls, a late settle that replaces an `unsettled` charge and retention moving old
events to the archive, each rollup table is recomputed here from the events (hot ledger and
archive) and compared row by row, to the picodollar."""

import asyncio
import random
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, union_all

from bench.rollups import rebuild_statement
from metering.budgets.reserve import reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.settle_queue import settle
from metering.db import Database, utcnow
from metering.jobs import close_windows, expire_holds
from metering.ledger.retention import archive_old_events
from metering.ledger.rollup import ROLLUPS, fold
from metering.ledger.tables import LedgerEvent, LedgerEventArchive
from tests.budgets.test_crash_recovery import _add_budgets, _spec, _subjects
from tests.budgets.test_settle_after_sweep import _real
from tests.reports.test_spend import ROUTES, as_event, hold_spec, ledger_event

SUMS = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "cost")
RETENTION_DAYS = 4


@pytest.fixture(params=["sqlite", "postgresql"])
def backend_url(request) -> str:
    """An empty database of the test's own, not migrated."""
    return request.getfixturevalue("fresh_pg" if request.param == "postgresql" else "fresh_sqlite")


def expected_rows(events: list, grain: str, keys: tuple[str, ...]) -> dict:
    """A rollup's rows summed here from the events, with nothing but the events' own values."""
    out: dict = defaultdict(lambda: dict.fromkeys(("requests", *SUMS, "uncharged"), 0))
    for e in events:
        at = e.created_at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
        if grain == "day":
            at = at.replace(hour=0)
        values = {"token_id": e.token_id or "", "user_id": e.user_id, "team_id": e.team_id}
        values |= {"model": e.model, "provider": e.provider}
        row = out[(at, *(values[k] for k in keys))]
        row["requests"] += 1
        for name in SUMS:
            row[name] += getattr(e, name) or 0
        row["uncharged"] += e.uncharged
    return dict(out)


async def stored_rows(db: Database, rollup) -> dict:
    async with db.sessions() as session:
        rows = (await session.execute(select(rollup.table))).all()
    return {
        tuple(getattr(r, k) for k in rollup.key): {
            name: getattr(r, name) for name in ("requests", *SUMS, "uncharged")
        }
        for r in rows
    }


async def every_event(db: Database) -> list:
    ledger, archive = LedgerEvent.__table__, LedgerEventArchive.__table__
    async with db.sessions() as session:
        return (await session.execute(union_all(select(ledger), select(archive)))).all()


async def settle_past_traffic(db: Database, now: datetime, count: int) -> None:
    """`count` requests over the last 8 days (across UTC days, so retention takes some), two
    teams, users with and without a token, several models; settled together, in groups."""
    rng = random.Random(7)
    people = []
    for team in range(2):
        for user in range(2):
            tokens = [f"tok_{uuid.uuid4().hex[:10]}", None]
            people.append((f"team_{team}_{now:%H%M%S}", f"usr_{team}_{user}", tokens))
    runtime = BudgetRuntime(db)

    async def one(i: int) -> None:
        team_id, user_id, tokens = people[i % len(people)]
        spec = hold_spec(team_id, user_id, rng.choice(tokens), ROUTES[i % len(ROUTES)])
        created = now - timedelta(minutes=rng.randrange(8 * 24 * 60), seconds=rng.random())
        completion = rng.randrange(0, 2000)
        event = ledger_event(
            spec, created, rng.randrange(1, 9000), completion, reasoning=completion // 3
        )
        reservation = await reserve(runtime, spec, ttl_s=900)
        assert await settle(runtime.settles, as_event(event), reservation)

    await asyncio.gather(*(one(i) for i in range(count)))


@pytest.mark.anyio
async def test_every_rollup_equals_the_ledger_after_rolls_late_settles_and_retention(
    fresh_db, task_clock
):
    db = Database(fresh_db, 8)
    runtime = BudgetRuntime(db)
    try:
        now = utcnow()
        await settle_past_traffic(db, now, 120)

        # A request charged in full by the sweeper (1 s budget windows), the window rolls,
        # then the request settles late: its real usage replaces the charge.
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "1s", utcnow())
        spec = _spec(subjects)
        swept = await reserve(runtime, spec, ttl_s=0)
        assert await expire_holds(db) == 1
        task_clock.advance(1.5)
        assert await close_windows(db) == 3
        late = _real(spec, swept, 10, 7)
        assert late.cost < swept.amount
        assert await settle(runtime.settles, late, swept) is True
        # And one settled in time in the new window.
        fresh = _spec(subjects)
        reservation = await reserve(runtime, fresh, ttl_s=900)
        assert await settle(runtime.settles, _real(fresh, reservation, 20, 3), reservation) is True

        moved = await archive_old_events(db, RETENTION_DAYS, batch=16, now=now)
        assert moved > 0

        events = await every_event(db)
        assert len(events) == 122 and len({e.id for e in events}) == 122
        # Every settle's increments wait in rollup_pending until folded.
        assert await fold(db) > 0
        replaced = next(e for e in events if e.id == spec.hold_id)
        assert (replaced.status, replaced.cost) == ("ok", late.cost)
        for rollup in ROLLUPS:
            wanted = expected_rows(events, rollup.grain, rollup.keys)
            assert len({k[0] for k in wanted}) > 1  # several hours or days: not vacuous
            assert await stored_rows(db, rollup) == wanted, rollup.table.name
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_the_0008_migration_fills_the_new_rollups_from_spend_hourly(request, backend_url):
    """Events recorded (and summed into spend_hourly) before revision 0008 are in every rollup
    it adds, and settles afterwards land on the same rows."""
    from alembic import command
    from sqlalchemy import create_engine, insert, pool

    from metering import migrate
    from metering.db import sync_url
    from metering.ledger import writer

    url = backend_url
    command.upgrade(migrate.alembic_config(url), "0007")
    rng = random.Random(11)
    base = datetime(2025, 5, 6, 20, tzinfo=UTC)  # across a UTC midnight
    people = [("team_a", "usr_1", "tok_1"), ("team_a", "usr_1", None), ("team_b", "usr_2", "tok_2")]
    events = []
    for i in range(60):
        spec = hold_spec(*people[i % 3], ROUTES[i % len(ROUTES)])
        created = base + timedelta(minutes=rng.randrange(600), microseconds=rng.randrange(10**6))
        completion = rng.randrange(0, 900)
        events.append(
            as_event(ledger_event(spec, created, rng.randrange(1, 900), completion, reasoning=7))
        )
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    dialect = engine.dialect.name
    # The ledger as it was then: without the columns of revisions 0011 and 0012.
    added = (
        "max_tokens_clamped",
        "kind",
        "corrects_event_id",
        "reason",
        "run_id",
        "end_user",
        "tags",
        "endpoint",
    )
    old = [{k: v for k, v in e.params().items() if k not in added} for e in events[:50]]
    with engine.begin() as conn:
        conn.execute(insert(LedgerEvent.__table__), old)
        conn.execute(rebuild_statement(LedgerEvent.__table__, dialect, adjustments=False))
    engine.dispose()
    command.upgrade(migrate.alembic_config(url), "head")

    db = Database(url, pool_size=1)
    try:
        async with db.transaction() as session:
            await writer.append_many(session, events[50:])
        assert await fold(db) > 0
        stored = await every_event(db)
        assert len(stored) == 60
        for each in ROLLUPS:
            wanted = expected_rows(stored, each.grain, each.keys)
            assert len({k[0] for k in wanted}) > 1
            assert await stored_rows(db, each) == wanted, each.table.name
    finally:
        await db.dispose()
