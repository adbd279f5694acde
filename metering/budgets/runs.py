"""Runs (x-metering-run): a budget of the run's own, the fourth scope a request is held against.

A run's row is made by its first request (with the budget it gives), locked after the request's
budgets (the order every writer takes them in), and forgotten once unused for its idle time
with nothing held.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from metering.budgets.views import BudgetView, upsert_ignore
from metering.db import Database, utcnow
from metering.models import Run


@dataclass(frozen=True, slots=True)
class RunKey:
    """A run named by a request: its team's, its id, the budget its first request gives
    (x-metering-run-budget; later requests' is ignored), and how long it lives unused."""

    team_id: str
    run_id: str
    budget: int | None
    idle_s: int


class UnknownRun(Exception):
    """A run named without x-metering-run-budget that has no row (never started, or expired)."""


_runs = Run.__table__


def run_is(key: RunKey) -> tuple[Any, ...]:
    return (_runs.c.team_id == key.team_id, _runs.c.id == key.run_id)


def run_params(key: RunKey, amount: int, now: datetime) -> dict[str, Any]:
    return {"r_team": key.team_id, "r_id": key.run_id, "amount": amount, "now": now}


def run_charge(hold: Any, cost: int) -> dict[str, Any]:
    """CHARGE_RUN's parameters for a hold of a run: `cost` to spent, its whole amount out of
    reserved."""
    return {"r_team": hold.team_id, "r_id": hold.run_id, "cost": cost, "amount": hold.amount}


RESERVE_RUN = (
    update(_runs)
    .where(
        _runs.c.team_id == bindparam("r_team"),
        _runs.c.id == bindparam("r_id"),
        _runs.c.spent + _runs.c.reserved + bindparam("amount") <= _runs.c.credit_limit,
    )
    .values(reserved=_runs.c.reserved + bindparam("amount"), last_used_at=bindparam("now"))
)
CHARGE_RUN = (
    update(_runs)
    .where(_runs.c.team_id == bindparam("r_team"), _runs.c.id == bindparam("r_id"))
    .values(
        spent=_runs.c.spent + bindparam("cost"), reserved=_runs.c.reserved - bindparam("amount")
    )
)


def run_view(run: Any, now: datetime) -> BudgetView:
    return BudgetView(
        "run", run.id, run.credit_limit, "never", run.created_at, None, run.spent, run.reserved
    )


async def lock_run(session: AsyncConnection | AsyncSession, key: RunKey, now: datetime) -> Any:
    """The run's row, locked; made by its first request (with the budget it gives), and made
    anew when the one there has been idle past its time with nothing held."""
    if key.budget is not None:
        fresh = {
            "team_id": key.team_id,
            "id": key.run_id,
            "credit_limit": key.budget,
            "spent": 0,
            "reserved": 0,
            "created_at": now,
            "last_used_at": now,
        }
        await session.execute(upsert_ignore(session)(_runs).values(fresh).on_conflict_do_nothing())
    run = (await session.execute(select(_runs).where(*run_is(key)).with_for_update())).first()
    if run is None:
        raise UnknownRun(key.run_id)
    idle = now - run.last_used_at > timedelta(seconds=key.idle_s)
    if idle and run.reserved == 0 and run.created_at != now:
        if key.budget is None:
            raise UnknownRun(key.run_id)
        # Expired: the id starts a new run.
        await session.execute(
            update(_runs)
            .where(*run_is(key))
            .values(credit_limit=key.budget, spent=0, created_at=now, last_used_at=now)
        )
        run = (await session.execute(select(_runs).where(*run_is(key)))).first()
    return run


async def expire_runs(db: Database, idle_s: int, batch: int = 500) -> int:
    """Forget runs unused for `idle_s` with nothing held."""
    before = utcnow() - timedelta(seconds=idle_s)
    async with db.begin() as conn:
        stale = (
            select(_runs.c.team_id, _runs.c.id)
            .where(_runs.c.last_used_at < before, _runs.c.reserved == 0)
            .limit(batch)
        )
        rows = (await conn.execute(stale)).all()
        for row in rows:
            await conn.execute(
                delete(_runs).where(
                    _runs.c.team_id == row.team_id,
                    _runs.c.id == row.id,
                    _runs.c.last_used_at < before,
                    _runs.c.reserved == 0,
                )
            )
    return len(rows)
