"""On PostgreSQL the grouped settle writes its events' rollup increments to rollup_pending (one
row per key and statement), and `rollup.fold` moves them into every rollup: the rollups plus
what is pending equal the ledger's sums at every instant, the spend report reads both, and
replicas folding at once count each increment once."""

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import func, select, text

from metering import migrate
from metering.budgets.reserve import reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.settle_queue import settle
from metering.db import Database, utcnow
from metering.ledger import rollup
from metering.ledger.event import NAMES, Event
from metering.ledger.rollup import PENDING, ROLLUPS
from metering.ledger.tables import LedgerEvent, RollupPending
from metering.reports import spend
from tests.budgets.conftest import fresh_db, fresh_pg, fresh_sqlite, wait_for  # noqa: F401
from tests.budgets.test_crash_recovery import _add_budgets, _event, _spec, _subjects
from tests.budgets.writes import Writes

pytestmark = pytest.mark.postgres

FIGURES = ("requests", "prompt_tokens", "completion_tokens", "cost")


async def _settle_many(runtime: BudgetRuntime, subjects: dict, n: int, first: int = 0) -> None:
    async def one(i: int) -> None:
        spec = _spec(subjects)
        reservation = await reserve(runtime, spec, ttl_s=60)
        assert await settle(runtime.settles, _event(spec, 1 + i % 17), reservation) is True

    await asyncio.gather(*(one(first + i) for i in range(n)))


async def _ledger(db: Database, team: str) -> tuple:
    async with db.sessions() as session:
        row = (
            await session.execute(
                select(
                    func.count(),
                    func.sum(LedgerEvent.prompt_tokens),
                    func.sum(LedgerEvent.completion_tokens),
                    func.sum(LedgerEvent.cost),
                ).where(LedgerEvent.team_id == team)
            )
        ).one()
    return tuple(int(v or 0) for v in row)


async def _sums(db: Database, table, team: str) -> tuple:
    t = table if hasattr(table, "c") else table.__table__
    async with db.sessions() as session:
        row = (
            await session.execute(
                select(*(func.sum(t.c[f]) for f in FIGURES)).where(t.c.team_id == team)
            )
        ).one()
    return tuple(int(v or 0) for v in row)


async def _count(db: Database, team: str) -> int:
    async with db.sessions() as session:
        return int(
            (
                await session.execute(
                    select(func.count()).where(RollupPending.__table__.c.team_id == team)
                )
            ).scalar()
        )


def _by_key(rows) -> dict[tuple, tuple]:
    """Rows of rollup.PENDING_KEY then rollup.FIGURES, summed per key."""
    width = len(rollup.PENDING_KEY)
    out: dict[tuple, tuple] = {}
    for row in rows:
        key, figures = row[:width], tuple(int(v) for v in row[width:])
        out[key] = _plus(out[key], figures) if key in out else figures
    return out


def _plus(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b, strict=True))


async def _live(db: Database, team: str) -> dict[str, tuple]:
    """The sums of the two views Grafana reads (rollup rows plus pending increments)."""
    sums = ", ".join(f"COALESCE(SUM({f}), 0)" for f in FIGURES)
    out = {}
    async with db.sessions() as session:
        for view in ("spend_hourly_model_live", "spend_hourly_token_live"):
            row = (
                await session.execute(
                    text(f"SELECT {sums} FROM {view} WHERE team_id = :t"), {"t": team}
                )
            ).one()
            out[view] = tuple(int(v) for v in row)
    return out


async def _report(db: Database, token: str, keys: list[str]) -> dict:
    """The spend report's rows for the token over the last and next day, by `keys`."""
    now = utcnow()
    start = rollup.floor_day(now) - timedelta(days=1)
    end = rollup.floor_day(now) + timedelta(days=2)
    query = spend.spend_query(db.dialect, keys, {"token_id": token}, start, end)
    async with db.sessions() as session:
        rows = (await session.execute(query)).mappings().all()
    return {tuple(r[k] for k in keys): tuple(int(r[f]) for f in FIGURES if f in r) for r in rows}


@pytest.mark.anyio
async def test_settles_write_pending_increments_the_report_reads_and_fold_moves(fresh_pg):  # noqa: F811
    migrate.upgrade(fresh_pg)

    db = Database(fresh_pg, 8)
    try:
        subjects = _subjects()
        token, team = subjects["token"], subjects["team"]
        await _add_budgets(db, subjects, "1", "daily", utcnow())
        runtime = BudgetRuntime(db)
        with Writes(db) as seen:
            await _settle_many(runtime, subjects, 40)
        # Every settle by the one statement: each group's events written by a statement alone.
        assert seen.events and all(w.alone and w.committed for w in seen.events)
        ledger = await _ledger(db, team)
        assert ledger[0] == 40
        # Every increment is pending; no rollup holds any of them yet.
        assert await _sums(db, RollupPending, team) == (40, *ledger[1:])
        for r in ROLLUPS:
            assert await _sums(db, r.table, team) == (0, 0, 0, 0), r.table.name
        # The report is exact already: the rollups plus what is pending.
        by_day = await _report(db, token, ["day"])
        by_hour = await _report(db, token, ["hour", "model"])
        assert sum(v[0] for v in by_day.values()) == 40
        assert tuple(map(sum, zip(*by_day.values(), strict=True))) == (40, *ledger[1:])
        assert tuple(map(sum, zip(*by_hour.values(), strict=True))) == (40, *ledger[1:])
        # So are Grafana's views.
        live = await _live(db, team)
        assert set(live.values()) == {(40, *ledger[1:])}

        rows = await _count(db, team)
        assert 1 <= rows <= 40  # one per key and statement: the settles were grouped
        assert await rollup.fold(db, batch=7) == rows  # rows // 7 + 1 statements
        assert await _sums(db, RollupPending, team) == (0, 0, 0, 0)
        for r in ROLLUPS:
            assert await _sums(db, r.table, team) == (40, *ledger[1:]), r.table.name
        # The same report, now from the rollups alone.
        assert await _report(db, token, ["day"]) == by_day
        assert await _report(db, token, ["hour", "model"]) == by_hour
        assert await _live(db, team) == live
        assert await rollup.fold(db) == 0
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_each_pending_increment_is_row_for_of_the_event_written(fresh_pg):  # noqa: F811
    """The one-statement settle makes each event's increment in SQL from the row it inserts:
    every key and figure equals what rollup.row_for makes of the event read back (a missing
    reasoning count, a charge above the hold, a token-less request among them)."""
    migrate.upgrade(fresh_pg)

    db = Database(fresh_pg, 8)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "daily", utcnow())
        variants = [
            {},
            {"reasoning_tokens": 7, "cached_tokens": 3},
            {"reasoning_tokens": None},
            {"cost": 10**9, "uncharged": 5},  # above the hold: capped, the rest uncharged
            {"token_id": None},
            {"end_user": "cust-1", "tags": '{"project":"a"}'},
            {"end_user": "cust-2"},
            {"tags": '{"feature":"x","project":"b"}'},
        ]
        runtime = BudgetRuntime(db)

        async def one(overrides: dict) -> None:
            spec = _spec(subjects)
            reservation = await reserve(runtime, spec, ttl_s=60)
            event = _event(spec, 9, **overrides)
            assert await settle(runtime.settles, event, reservation) is True

        with Writes(db) as seen:
            await asyncio.gather(*(one(v) for v in variants))
        assert seen.events and all(w.alone and w.committed for w in seen.events)
        async with db.sessions() as session:
            events = (
                await session.execute(
                    select(LedgerEvent.__table__).where(LedgerEvent.team_id == subjects["team"])
                )
            ).mappings()
            increments = [rollup.row_for(Event(**{n: e[n] for n in NAMES})) for e in events]
            pending = (
                await session.execute(
                    select(
                        *(
                            RollupPending.__table__.c[c]
                            for c in (*rollup.PENDING_KEY, *rollup.FIGURES)
                        )
                    ).where(RollupPending.team_id == subjects["team"])
                )
            ).all()
        assert len(increments) == len(variants)
        # The rows of one key written by one statement are one row: compare per key.
        assert _by_key(tuple(row) for row in pending) == _by_key(
            tuple(row.values()) for row in increments
        )
        assert any(row["token_id"] == "" for row in increments)  # the token-less request
        assert any(row["uncharged"] > 0 for row in increments)  # uncharged, summed
        # The end users and tags the statement carried, folded into their rollups.
        await rollup.fold(db)
        async with db.sessions() as session:
            found = {}
            for r in rollup.ATTRIBUTED:
                t = r.table
                value = (t.c.end_user,) if "end_user" in t.c else (t.c.tag_key, t.c.tag_value)
                rows = await session.execute(
                    select(*value, t.c.requests).where(t.c.team_id == subjects["team"])
                )
                found[t.name] = {tuple(row[:-1]): row[-1] for row in rows}
        tagged = {("project", "a"): 1, ("feature", "x"): 1, ("project", "b"): 1}
        assert found == {
            "spend_daily_end_user": {("cust-1",): 1, ("cust-2",): 1},
            "spend_daily_tag": tagged,
            "spend_daily_tag_model": tagged,
        }
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_replicas_folding_while_settles_go_on_count_each_increment_once(fresh_pg):  # noqa: F811
    migrate.upgrade(fresh_pg)

    # Small pools: three replicas beside the rest of the parallel suite on one server.
    replicas = [Database(fresh_pg, 4) for _ in range(3)]
    db = replicas[0]
    try:
        subjects = _subjects()
        team = subjects["team"]
        await _add_budgets(db, subjects, "5", "daily", utcnow())
        settling = True

        async def folding(replica: Database) -> int:
            folded = 0
            while settling:
                folded += await rollup.fold(replica, batch=5, rounds=2)
                await asyncio.sleep(0)
            return folded

        folders = [asyncio.create_task(folding(r)) for r in replicas]
        runtimes = [BudgetRuntime(r) for r in replicas]
        for round_ in range(6):
            await _settle_many(runtimes[round_ % 3], subjects, 25, first=round_ * 25)
        settling = False
        folded = sum(await asyncio.gather(*folders))
        folded += await rollup.fold(db)
        # Each increment folded by exactly one replica: every rollup's sums are the
        # ledger's below (a row folded twice would count its requests twice).
        assert 1 <= folded <= 150
        ledger = await _ledger(db, team)
        assert ledger[0] == 150
        assert await _sums(db, RollupPending, team) == (0, 0, 0, 0)
        for r in ROLLUPS:
            assert await _sums(db, r.table, team) == (150, *ledger[1:]), r.table.name
    finally:
        for replica in replicas:
            await replica.dispose()


def test_the_pending_read_model_has_every_key_of_the_hourly_rollup():
    assert PENDING.grain == "hour"
    assert PENDING.keys == (*rollup.HOURLY.keys, "end_user", "tags")
    columns = {c.name for c in RollupPending.__table__.columns}
    assert columns == {"id", *rollup.PENDING_KEY, *rollup.FIGURES}
