"""Settles that arrive together are written in one transaction: one event per request, the
budgets charged exactly and nothing left reserved; a group with one bad row still commits the
others, and a request whose hold was swept meanwhile still replaces its placeholder."""

import asyncio
from dataclasses import replace

import httpx
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import func, select, update

from metering.budgets.reserve import reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.settle_queue import settle
from metering.db import Database, utcnow
from metering.jobs import expire_holds
from metering.ledger import rollup
from metering.ledger.tables import LedgerEvent, SpendHourly
from metering.models import AlertEvent, Budget, Hold
from tests.budgets.conftest import budget, chat_body, marker, usd
from tests.budgets.test_crash_recovery import (
    _add_budgets,
    _budgets,
    _count,
    _event,
    _spec,
    _subjects,
)
from tests.budgets.writes import Writes

REQUESTS = 100


async def _rollup(db: Database, token_id: str) -> tuple[int, int]:
    await rollup.fold(db)  # the increments the grouped settle left pending (PostgreSQL)
    async with db.sessions() as session:
        row = (
            await session.execute(
                select(func.sum(SpendHourly.requests), func.sum(SpendHourly.cost)).where(
                    SpendHourly.token_id == token_id
                )
            )
        ).one()
        return int(row[0] or 0), int(row[1] or 0)


async def _alerts(db: Database, subjects: dict[str, str]) -> list[tuple[str, str]]:
    """The (type, subject) of every alert recorded for these budgets, sorted."""
    async with db.sessions() as session:
        rows = await session.execute(
            select(AlertEvent.type, AlertEvent.subject_id).where(
                AlertEvent.subject_id.in_(list(subjects.values()))
            )
        )
        return sorted(tuple(row) for row in rows.all())


@pytest.mark.anyio
async def test_concurrent_settles_commit_in_groups_with_exact_budgets(fresh_db):
    db = Database(fresh_db, 8)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "daily", utcnow())

        async def one(completion_tokens: int) -> tuple[str, int]:
            spec = _spec(subjects)
            reservation = await reserve(runtime, spec, ttl_s=60)
            event = _event(spec, completion_tokens)
            assert await settle(runtime.settles, event, reservation) is True
            return event.id, event.cost

        with Writes(db) as seen:
            done = await asyncio.gather(*(one(1 + i % 40) for i in range(REQUESTS)))
        total = sum(cost for _, cost in done)
        assert total == REQUESTS * 10 * 150_000 + sum(
            (1 + i % 40) * 600_000 for i in range(REQUESTS)
        )
        # Some settles shared a transaction; on PostgreSQL each group was one statement alone.
        assert len(seen.events) < REQUESTS and all(w.committed for w in seen.events)
        assert {w.alone for w in seen.events} == {db.dialect == "postgresql"}
        token = subjects["token"]
        assert await _count(db, LedgerEvent, LedgerEvent.token_id == token) == REQUESTS
        ids = {event_id for event_id, _ in done}
        assert await _count(db, LedgerEvent, LedgerEvent.id.in_(ids)) == REQUESTS
        assert await _count(db, Hold, Hold.token_id == token) == 0
        for row in (await _budgets(db, subjects)).values():
            assert (row.spent, row.reserved) == (total, 0)
        assert await _rollup(db, token) == (REQUESTS, total)
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_group_with_a_bad_row_commits_the_others(fresh_db):
    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "daily", utcnow())
        specs = [_spec(subjects) for _ in range(5)]
        reservations = [await reserve(runtime, spec, ttl_s=60) for spec in specs]
        events = [_event(spec, 3 + i) for i, spec in enumerate(specs)]
        events[2] = replace(events[2], model=None)  # refused by the ledger (NOT NULL)
        with Writes(db) as seen:
            results = await asyncio.gather(
                *(settle(runtime.settles, e, r) for e, r in zip(events, reservations, strict=True)),
                return_exceptions=True,
            )
        assert results[:2] + results[3:] == [True] * 4
        assert isinstance(results[2], sa_exc.IntegrityError)
        # The group failed, nothing of it kept; then one settle at a time, the bad one failing.
        first, *alone = [w.committed for w in seen.events]
        assert (first, sorted(alone)) == (False, [False, True, True, True, True])

        good = [e for i, e in enumerate(events) if i != 2]
        total = sum(e.cost for e in good)
        token = subjects["token"]
        assert await _count(db, LedgerEvent, LedgerEvent.token_id == token) == 4
        assert await _count(db, LedgerEvent, LedgerEvent.id == events[2].id) == 0
        # The bad request's hold stays, for the sweeper to charge as `unsettled`.
        assert await _count(db, Hold, Hold.token_id == token) == 1
        for row in (await _budgets(db, subjects)).values():
            assert (row.spent, row.reserved) == (total, reservations[2].amount)
        assert await _rollup(db, token) == (4, total)
        assert await expire_holds(db) == 0  # not expired yet: nothing charged twice
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_group_settles_a_request_whose_hold_was_swept(fresh_db, caplog):
    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        specs = [_spec(subjects) for _ in range(3)]
        swept = await reserve(runtime, specs[0], ttl_s=0)
        assert await expire_holds(db) == 1  # charged in full as `unsettled`
        live = [await reserve(runtime, spec, ttl_s=60) for spec in specs[1:]]
        events = [_event(spec, 4) for spec in specs]
        with Writes(db) as seen:
            results = await asyncio.gather(
                *(
                    settle(runtime.settles, e, r)
                    for e, r in zip(events, [swept, *live], strict=True)
                )
            )
        assert results == [True, True, True]
        # The two live settles in one transaction, the swept one's in another.
        assert [w.committed for w in seen.events] == [True, True]
        token = subjects["token"]
        assert await _count(db, LedgerEvent, LedgerEvent.token_id == token) == 3
        assert await _count(db, LedgerEvent, LedgerEvent.status == "unsettled") == 0
        total = sum(e.cost for e in events)
        assert total == 3 * (10 * 150_000 + 4 * 600_000)
        for row in (await _budgets(db, subjects)).values():
            assert (row.spent, row.reserved) == (total, 0)
        assert await _rollup(db, token) == (3, total)
        # A hold swept is not one found otherwise: nothing logged as a bug.
        assert "not the ones written" not in caplog.text
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_hold_not_as_its_reservation_wrote_it_takes_the_general_path(fresh_db, caplog):
    """The one-statement settle charges from what the reservation wrote; a hold found otherwise
    (here its amount raised behind the process's back, with its budgets' `reserved`) is left
    untouched by it and settled alone by the general path, which charges from the hold's row;
    the others of its group are committed by the statement."""

    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        specs = [_spec(subjects) for _ in range(3)]
        reservations = [await reserve(runtime, spec, ttl_s=60) for spec in specs]
        changed = specs[1].hold_id
        async with db.transaction() as session:
            await session.execute(
                update(Hold).where(Hold.id == changed).values(amount=Hold.amount + 7)
            )
            await session.execute(
                update(Budget)
                .where(Budget.subject_id.in_(list(subjects.values())))
                .values(reserved=Budget.reserved + 7)
            )
        events = [_event(spec, 5) for spec in specs]
        with Writes(db) as seen:
            results = await asyncio.gather(
                *(settle(runtime.settles, e, r) for e, r in zip(events, reservations, strict=True))
            )
        assert results == [True, True, True]
        # The changed hold never goes through the statement: nothing charged twice. On
        # PostgreSQL the statement writes the two others, the general path the changed one.
        if db.dialect == "postgresql":
            assert [w.alone for w in seen.events] == [True, False]
            assert "not the ones written" in caplog.text and changed in caplog.text
        else:
            assert not any(w.alone for w in seen.events)
        total = sum(e.cost for e in events)
        for row in (await _budgets(db, subjects)).values():
            assert (row.spent, row.reserved) == (total, 0)
        assert await _count(db, LedgerEvent, LedgerEvent.token_id == subjects["token"]) == 3
        assert await _rollup(db, subjects["token"]) == (3, total)
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_settle_passing_a_threshold_is_written_with_its_alert(fresh_db):
    """Settles that pass no threshold take the one statement; the one that passes 50% of the
    limits aborts it (nothing of it kept) and is written by the general path with its alerts,
    one per budget, in the charge's transaction."""

    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        # 0.0002 USD: four holds of 50 tokens fit; four events of 40 tokens pass 50%.
        await _add_budgets(db, subjects, "0.0002", "never", utcnow())
        specs = [_spec(subjects) for _ in range(4)]
        reservations = [await reserve(runtime, spec, ttl_s=60) for spec in specs]
        events = [_event(spec, 40) for spec in specs]
        limit = 200_000_000
        assert sum(e.cost for e in events[:3]) * 2 < limit <= sum(e.cost for e in events) * 2
        with Writes(db) as seen:
            for event, reservation in zip(events, reservations, strict=True):
                assert await settle(runtime.settles, event, reservation) is True
        written = [(w.alone, w.committed) for w in seen.events]
        if db.dialect == "postgresql":
            # Three statements alone; the fourth's is aborted (nothing of it kept), and the
            # general path writes it.
            assert written == [(True, True)] * 3 + [(True, False), (False, True)]
        else:
            assert written == [(False, True)] * 4
        total = sum(e.cost for e in events)
        for row in (await _budgets(db, subjects)).values():
            assert (row.spent, row.reserved) == (total, 0)
        assert await _alerts(db, subjects) == sorted(
            ("budget.threshold_crossed", subject) for subject in subjects.values()
        )
        assert await _count(db, LedgerEvent, LedgerEvent.token_id == subjects["token"]) == 4
        assert await _rollup(db, subjects["token"]) == (4, total)
    finally:
        await db.dispose()


def test_a_hundred_concurrent_requests_one_event_each(api):
    """Through the server: 100 requests at once on one token (half streamed), each answered,
    each one event with its request id, the budgets charged their exact sum."""
    team, user, token = api.principal(token_limit="1", user_limit="1", team_limit="1")
    tag = marker()

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = chat_body(f"group {tag} {i} sim:tokens=5", max_tokens=5, stream=i % 2 == 1)
        headers = {"authorization": f"Bearer {token['token']}", "content-type": "application/json"}
        response = await client.post(
            f"{api.url}/v1/chat/completions", content=body, headers=headers
        )
        assert response.status_code == 200, response.text
        if i % 2 == 1:
            assert response.text.endswith("data: [DONE]\n\n")
        return response.headers["x-request-id"]

    async def burst() -> list[str]:
        limits = httpx.Limits(max_connections=REQUESTS)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(REQUESTS)))

    ids = asyncio.run(burst())
    events = api.events(token_id=token["id"])
    assert sorted(e["id"] for e in events) == sorted(ids)
    assert len(set(ids)) == REQUESTS
    assert all((e["status"], e["completion_tokens"]) == ("ok", 5) for e in events)
    total = sum(usd(e["cost"]) for e in events)
    assert total > 0
    for scope, subject in (("token", token), ("user", user), ("team", team)):
        status = budget(api, scope, subject["id"])
        assert (usd(status["spent"]), usd(status["reserved"])) == (total, 0), status
