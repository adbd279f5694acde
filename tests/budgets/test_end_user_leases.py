"""A request whose end user has a budget is admitted against the leases of its token, user and
team, and reserved in its end user's row only: the token's row is not touched per request. Its
end user's budget is given back, or charged, exactly once, whoever ends the hold. Both
databases."""

import asyncio

import pytest
from sqlalchemy import select, update

from metering.budgets.release import release
from metering.budgets.reserve import BudgetShortfall, reserve
from metering.budgets.settle_queue import settle
from metering.db import Database, utcnow
from metering.jobs import expire_holds
from metering.models import Budget, BudgetLease, Hold
from tests.budgets.test_crash_recovery import _budgets
from tests.budgets.test_end_user_holds import _end_user_budget, _setup, _spec
from tests.budgets.test_leases import _runtime
from tests.budgets.test_settle_after_sweep import _real


async def _leases(db: Database) -> dict[str, int]:
    async with db.sessions() as session:
        rows = await session.execute(select(BudgetLease.subject_id, BudgetLease.amount))
        return dict(rows.all())


async def _holds(db: Database) -> list:
    async with db.sessions() as session:
        return list((await session.execute(select(Hold.__table__))).all())


@pytest.mark.anyio
async def test_an_end_user_with_a_budget_is_admitted_on_the_leases(fresh_db):
    db = Database(fresh_db, 4)
    runtime = _runtime(db)
    book = runtime.leases
    try:
        subjects = await _setup(db)
        first = await reserve(runtime, _spec(subjects), 3600, book)
        leased = (await _budgets(db, subjects))["token"].reserved
        more = [await reserve(runtime, _spec(subjects), 3600, book) for _ in range(4)]
        reservations = [first, *more]
        assert all(r.claim is not None and not r.plain for r in reservations)
        assert (book.taken, book.admitted) == (1, 5)
        eu = await _end_user_budget(db, subjects["team"])
        holds = await _holds(db)
        leases = await _leases(db)
        ids = await _lease_ids(db)
        assert len(holds) == 5
        for hold in holds:
            assert (hold.leased, hold.end_user_budget) == (True, eu.subject_id)
            assert (hold.token_lease, hold.user_lease, hold.team_lease) == (
                ids[subjects["token"]],
                ids[subjects["user"]],
                ids[subjects["team"]],
            )
        # The token's, user's and team's rows hold only their leases, unchanged by the four
        # requests after the first; the end user's row holds every request's hold.
        rows = await _budgets(db, subjects)
        for scope, subject in subjects.items():
            assert rows[scope].reserved == leases[subject] == leased
        assert (eu.spent, eu.reserved) == (0, sum(r.amount for r in reservations))
    finally:
        await runtime.close()
        await db.dispose()


async def _lease_ids(db: Database) -> dict[str, str]:
    async with db.sessions() as session:
        rows = await session.execute(select(BudgetLease.subject_id, BudgetLease.id))
        return dict(rows.all())


@pytest.mark.anyio
async def test_leased_settles_release_and_expiry_end_the_end_user_hold_once(fresh_db):
    db = Database(fresh_db, 8)
    runtime = _runtime(db)
    book = runtime.leases
    try:
        subjects = await _setup(db)
        specs = [_spec(subjects) for _ in range(6)]
        reservations = [await reserve(runtime, spec, 3600, book) for spec in specs]
        assert all(r.claim is not None for r in reservations)
        # One settled alone, three together (twice each: nothing more), one released, one
        # swept and then settled late.
        alone = _real(specs[0], reservations[0], 10, 5)
        assert await settle(runtime.settles, alone, reservations[0]) is True
        together = [_real(specs[i], reservations[i], 20, i) for i in (1, 2, 3)]
        results = await asyncio.gather(
            *(settle(runtime.settles, e, reservations[i + 1]) for i, e in enumerate(together))
        )
        assert results == [True, True, True]
        assert await settle(runtime.settles, alone, reservations[0]) is False
        await release(db, specs[4].hold_id, reservations[4])
        await release(db, specs[4].hold_id, reservations[4])
        async with db.begin() as conn:
            await conn.execute(
                update(Hold.__table__)
                .where(Hold.id == specs[5].hold_id)
                .values(expires_at=utcnow())
            )
        assert await expire_holds(db) == 1
        eu = await _end_user_budget(db, subjects["team"])
        charged = alone.cost + sum(e.cost for e in together)
        assert (eu.spent, eu.reserved) == (charged + reservations[5].amount, 0)
        late = _real(specs[5], reservations[5], 10, 7)
        assert late.cost < reservations[5].amount
        assert await settle(runtime.settles, late, reservations[5]) is True
        eu = await _end_user_budget(db, subjects["team"])
        assert (eu.spent, eu.reserved) == (charged + late.cost, 0)
        # The token's budget: spent the same, and its lease still counted in reserved alone.
        rows = await _budgets(db, subjects)
        leases = await _leases(db)
        assert await _holds(db) == []
        for scope, subject in subjects.items():
            assert rows[scope].spent == charged + late.cost
            assert rows[scope].reserved == leases[subject]
    finally:
        await runtime.close()
        await db.dispose()


@pytest.mark.anyio
async def test_an_end_user_near_its_limit_takes_the_database_path(fresh_db):
    db = Database(fresh_db, 4)
    runtime = _runtime(db)
    book = runtime.leases
    try:
        subjects = await _setup(db)
        first = await reserve(runtime, _spec(subjects), 3600, book)
        assert first.claim is not None
        eu = await _end_user_budget(db, subjects["team"])
        # The end user has less left than one more hold: its row refuses, the leases give
        # the claim back, and the database path refuses it naming the end user's budget.
        async with db.begin() as conn:
            await conn.execute(
                update(Budget.__table__)
                .where(Budget.subject_id == eu.subject_id)
                .values(credit_limit=eu.reserved + first.amount - 1)
            )
        spec = _spec(subjects)
        with pytest.raises(BudgetShortfall) as refused:
            await reserve(runtime, spec, 3600, book)
        assert refused.value.shortfall.budget.scope == "end_user"
        assert book.admitted == 1
        assert [h.id for h in await _holds(db)] == [first.hold_id]  # nothing written for it
        assert all(lease.inflight == first.amount for lease in first.claim.leases)
    finally:
        await runtime.close()
        await db.dispose()
