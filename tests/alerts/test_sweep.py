"""An unsettled charge (a hold whose process died, charged in full by the sweeper) crosses
thresholds like a settle, once, whichever replica sweeps."""

import asyncio
import json
from decimal import Decimal

import pytest
from sqlalchemy import select

from metering.budgets.reserve import reserve
from metering.budgets.runtime import BudgetRuntime
from metering.db import Database, utcnow
from metering.jobs import expire_holds
from metering.models import AlertEvent, Budget
from tests.budgets.test_crash_recovery import _add_budgets, _spec, _subjects


@pytest.mark.anyio
async def test_the_sweepers_charge_crosses_thresholds_once(fresh_db):
    replicas = [Database(fresh_db, 4) for _ in range(3)]
    db = replicas[0]
    try:
        subjects = _subjects()
        first = _spec(subjects)
        hold = first.amount(first.max_tokens)
        # Three holds fill 3/4 of the token's budget: 25%, 50% and 75% once charged.
        limit = str(Decimal(hold * 4) / 10**12)
        await _add_budgets(db, subjects, limit, "never", utcnow())
        async with db.begin() as conn:
            await conn.execute(
                Budget.__table__.update()
                .where(Budget.subject_id == subjects["token"])
                .values(alert_thresholds=json.dumps([50, 70, 80]))
            )
        for _ in range(3):
            await reserve(BudgetRuntime(db), _spec(subjects), ttl_s=0)
        results = await asyncio.gather(*(expire_holds(r) for r in replicas))
        assert sum(results) == 3
        async with db.sessions() as session:
            events = list(
                await session.scalars(
                    select(AlertEvent).where(AlertEvent.subject_id == subjects["token"])
                )
            )
        assert sorted(json.loads(e.data)["threshold"] for e in events) == [50, 70]
        assert {e.type for e in events} == {"budget.threshold_crossed"}
        assert {e.team_id for e in events} == {subjects["team"]}
        assert {e.user_id for e in events} == {subjects["user"]}
    finally:
        for replica in replicas:
            await replica.dispose()
