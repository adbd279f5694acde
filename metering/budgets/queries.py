"""Reading one budget as it stands now, for the budget routes."""

from typing import Any

from sqlalchemy import func, select

from metering.budgets import rates
from metering.budgets.views import BudgetView, lease_slack, view
from metering.db import Database, utcnow
from metering.errors import NotFound
from metering.models import ApiToken, Budget, Hold, Team, User

# A budget is shown while its subject exists: a team or user not deleted, any token (a revoked
# token's budget still shows what it spent).
# scope -> (its table, the condition of a live row)
_SUBJECTS: dict[str, tuple[Any, Any]] = {
    "team": (Team, Team.deleted_at.is_(None)),
    "user": (User, User.deleted_at.is_(None)),
    "token": (ApiToken, True),
}


async def current_budget(db: Database, scope: str, subject_id: str) -> BudgetView:
    """The budget of a team, user or token, its window rolled forward if it has ended;
    NotFound if there is no such subject."""
    table, live = _SUBJECTS[scope]
    query = (
        select(Budget)
        .join(table, table.id == Budget.subject_id)
        .where(Budget.subject_id == subject_id, Budget.scope == scope, live)
    )
    async with db.sessions() as session:
        if db.dialect == "postgresql":
            # The budget row, its leases and their holds from one snapshot: a lease given back
            # between two reads would otherwise show its slice as reserved.
            await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        budget = await session.scalar(query)
        if budget is None:
            raise NotFound(f"{scope} {subject_id} not found")
        slack = await lease_slack(session, [subject_id])
    return view(budget, utcnow(), slack.get(subject_id, 0))


async def open_holds(db: Database) -> int:
    """Holds of requests in flight (or of crashed replicas, until they expire)."""
    async with db.sessions() as session:
        return (await session.execute(select(func.count()).select_from(Hold))).scalar_one()


USED_RATIOS_SHOWN = 500


async def used_ratios(db: Database, limit: int = USED_RATIOS_SHOWN) -> list[tuple[str, str, float]]:
    """(scope, subject_id, spent / credit_limit) of the most used limited budgets, in their
    current windows (a window that ended counts as 0): for the /metrics gauge. End users'
    budgets are left out: their number is unbounded, a series each would be too."""
    ratio = Budget.spent * 1.0 / Budget.credit_limit
    query = (
        select(Budget)
        .where(Budget.credit_limit > 0, Budget.spent > 0, Budget.scope != "end_user")
        .order_by(ratio.desc())
        .limit(limit)
    )
    now = utcnow()
    async with db.reads() as session:
        budgets = list(await session.scalars(query))
    views = [view(b, now) for b in budgets]
    return [
        (v.scope, v.subject_id, v.spent / v.credit_limit)
        for v in views
        if v.spent and v.credit_limit  # the query keeps limited budgets only
    ]


async def current_limits(db: Database, scope: str, subject_id: str) -> dict[str, Any]:
    """A subject's limits beyond credit and how much of each is in use now."""
    table, live = _SUBJECTS[scope]
    async with db.sessions() as session:
        subject = await session.scalar(select(table).where(table.id == subject_id, live))
        if subject is None:
            raise NotFound(f"{scope} {subject_id} not found")
        counters = await rates.counters(session, [subject_id])
    now = utcnow()
    start, end = rates.window_of(now)

    def used(kind: str) -> int:
        window, count = counters.get((subject_id, kind), (start, 0))
        return count if kind == "parallel" or window >= start else 0

    return {
        "scope": scope,
        "id": subject_id,
        "rpm_limit": subject.rpm_limit,
        "tpm_limit": subject.tpm_limit,
        "max_parallel_requests": subject.max_parallel_requests,
        "allowed_models": subject.allowed_models,
        "expires_at": getattr(subject, "expires_at", None),
        "window_start": start,
        "resets_at": end,
        "requests": used("rpm"),
        "tokens": used("tpm"),
        "in_flight": used("parallel"),
    }
