"""A hold reserved in an end user's budget gives it back, or charges it, exactly once, whoever
ends it: a settle (alone or in a group), a release, the sweeper on expiry (several at once),
and a settle that arrives after the sweep. Both databases."""

import asyncio
import uuid
from dataclasses import replace
from decimal import Decimal

import pytest
from sqlalchemy import select

from metering.budgets.end_users import subject_of
from metering.budgets.queries import used_ratios
from metering.budgets.release import release
from metering.budgets.reserve import reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.settle_queue import settle
from metering.db import Database, utcnow
from metering.jobs import expire_holds
from metering.models import Budget, EndUserBudget, Hold, Team
from metering.money import usd_to_pico
from tests.budgets.test_crash_recovery import _add_budgets, _subjects
from tests.budgets.test_crash_recovery import _spec as _plain_spec
from tests.budgets.test_settle_after_sweep import _real

END_USER = "olga"


async def _setup(db: Database, end_user_limit: str | None = "1"):
    subjects = _subjects()
    await _add_budgets(db, subjects, "1", "never", utcnow())
    async with db.transaction() as session:
        session.add(
            Team(
                id=subjects["team"],
                name=f"team-{uuid.uuid4().hex[:8]}",
                created_at=utcnow(),
                end_user_credit_limit=None
                if end_user_limit is None
                else usd_to_pico(Decimal(end_user_limit)),
            )
        )
    return subjects


def _spec(subjects, end_user: str | None = END_USER):
    spec = _plain_spec(subjects)
    return replace(spec, billing=replace(spec.billing, end_user=end_user))


async def _end_user_budget(db: Database, team_id: str, end_user: str = END_USER):
    async with db.sessions() as session:
        return await session.get(Budget, subject_of(team_id, end_user))


@pytest.mark.anyio
async def test_settles_alone_and_together_charge_the_end_user_budget_once(fresh_db):
    db = Database(fresh_db, 8)
    runtime = BudgetRuntime(db)
    try:
        subjects = await _setup(db)
        specs = [_spec(subjects) for _ in range(6)]
        reservations = [await reserve(runtime, spec, ttl_s=3600) for spec in specs]
        assert all(not r.plain and r.claim is None for r in reservations)  # the database path
        eu = await _end_user_budget(db, subjects["team"])
        assert (eu.scope, eu.spent, eu.reserved) == (
            "end_user",
            0,
            sum(r.amount for r in reservations),
        )
        async with db.sessions() as session:
            listed = await session.get(EndUserBudget, eu.subject_id)
            held = set(await session.scalars(select(Hold.end_user_budget)))
        assert (listed.team_id, listed.end_user, listed.override) == (
            subjects["team"],
            END_USER,
            False,
        )
        assert held == {eu.subject_id}
        events = [
            _real(s, r, 10, 7 + i) for i, (s, r) in enumerate(zip(specs, reservations, strict=True))
        ]
        # Together: the settles arriving at once are written as a group.
        done = await asyncio.gather(
            *(settle(runtime.settles, e, r) for e, r in zip(events, reservations, strict=True))
        )
        assert done == [True] * 6
        # Again: a retried settle finds no hold and charges nothing more.
        assert await settle(runtime.settles, events[0], reservations[0]) is False
        eu = await _end_user_budget(db, subjects["team"])
        assert (eu.spent, eu.reserved) == (sum(e.cost for e in events), 0)
        # The /metrics gauge has a series per budget it shows: never one per end user.
        shown = {(scope, subject) for scope, subject, _ in await used_ratios(db)}
        assert ("team", subjects["team"]) in shown
        assert not [s for s in shown if s[0] == "end_user"]
    finally:
        await runtime.close()
        await db.dispose()


@pytest.mark.anyio
async def test_a_release_gives_the_end_user_budget_back(fresh_db):
    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = await _setup(db)
        spec = _spec(subjects)
        reservation = await reserve(runtime, spec, ttl_s=3600)
        assert (await _end_user_budget(db, subjects["team"])).reserved == reservation.amount
        await release(db, spec.hold_id, reservation)
        await release(db, spec.hold_id, reservation)  # twice: nothing more
        eu = await _end_user_budget(db, subjects["team"])
        assert (eu.spent, eu.reserved) == (0, 0)
    finally:
        await runtime.close()
        await db.dispose()


@pytest.mark.anyio
async def test_expired_holds_charge_the_end_user_budget_once_and_a_late_settle_corrects_it(
    fresh_db,
):
    replicas = [Database(fresh_db, 4) for _ in range(3)]
    db = replicas[0]
    runtime = BudgetRuntime(db)
    try:
        subjects = await _setup(db)
        specs = [_spec(subjects) for _ in range(3)]
        swept = [await reserve(runtime, spec, ttl_s=0) for spec in specs]
        results = await asyncio.gather(*(expire_holds(r) for r in replicas))
        assert sum(results) == 3
        eu = await _end_user_budget(db, subjects["team"])
        assert (eu.spent, eu.reserved) == (sum(r.amount for r in swept), 0)

        late = _real(specs[0], swept[0], 10, 7)
        assert late.cost < swept[0].amount
        assert await settle(runtime.settles, late, swept[0]) is True
        eu = await _end_user_budget(db, subjects["team"])
        assert eu.spent == late.cost + swept[1].amount + swept[2].amount
    finally:
        await runtime.close()
        for replica in replicas:
            await replica.dispose()


@pytest.mark.anyio
async def test_an_end_user_without_a_budget_is_held_in_nothing_of_its_own(fresh_db):
    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = await _setup(db, end_user_limit=None)
        spec = _spec(subjects)
        reservation = await reserve(runtime, spec, ttl_s=3600)
        assert await _end_user_budget(db, subjects["team"]) is None
        async with db.sessions() as session:
            hold = await session.get(Hold, spec.hold_id)
        assert (hold.end_user, hold.end_user_budget) == (END_USER, None)
        assert await settle(runtime.settles, _real(spec, reservation, 10, 7), reservation)
        assert await _end_user_budget(db, subjects["team"]) is None
    finally:
        await runtime.close()
        await db.dispose()
