"""A budget as it stands: its current window, its rows loaded (and locked, in the one order every
writer of budgets takes them in), and the roll that closes a window that has ended.

A window rolls when the first request after its end touches it (no job needed): its total is
kept in budget_windows, then spent restarts at 0, and budget.window_reset is recorded for a
budget that alerts. Outstanding holds stay reserved across the roll, and a request is charged
to the window it settles in.
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BindParameter, Row, Update, bindparam, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from metering.alerts import record
from metering.budgets.windows import parse_interval, window_for
from metering.db import UTCDateTime, dialect_name
from metering.models import Budget, BudgetLease, BudgetWindow, Hold
from metering.timefmt import rfc3339

# A budget: its ORM object, or a row of its table's columns (select(Budget.__table__)).
BudgetRow = Budget | Row[*tuple[Any, ...]]


@dataclass(frozen=True, slots=True)
class BudgetView:
    """A budget as it stands now, its window rolled forward if it has ended."""

    scope: str
    subject_id: str
    credit_limit: int | None
    reset_interval: str
    window_start: datetime
    resets_at: datetime | None
    spent: int
    reserved: int
    thresholds: tuple[int, ...] = record.DEFAULT_THRESHOLDS  # alert thresholds, % of the limit

    @property
    def remaining(self) -> int | None:
        if self.credit_limit is None:
            return None
        return max(self.credit_limit - self.spent - self.reserved, 0)

    @property
    def threshold_passed(self) -> int | None:
        """The highest alert threshold `spent` has reached in this window, if any."""
        if not self.credit_limit:
            return None
        limit = self.credit_limit
        passed = [
            p for p in self.thresholds if record.reached(self.spent, limit * p, record.PERCENT)
        ]
        return max(passed, default=None)


def current_window(budget: BudgetRow, now: datetime) -> tuple[datetime, datetime | None]:
    return window_for(parse_interval(budget.reset_interval), budget.anchor_at, now)


def resets_at(row: BudgetRow, at: datetime) -> datetime | None:
    return window_for(parse_interval(row.reset_interval), row.anchor_at, at)[1]


def view(budget: BudgetRow, now: datetime, slack: int = 0) -> BudgetView:
    """`slack`: the part of `reserved` that is leased credit no request holds (shown as free:
    it is admitted against, or returned when idle)."""
    start, end = current_window(budget, now)
    rolled = budget.window_start < start
    return BudgetView(
        scope=budget.scope,
        subject_id=budget.subject_id,
        credit_limit=budget.credit_limit,
        reset_interval=budget.reset_interval,
        window_start=max(start, budget.window_start),
        resets_at=end,
        spent=0 if rolled else budget.spent,
        reserved=max(budget.reserved - slack, 0),
        thresholds=record.thresholds_of(getattr(budget, "alert_thresholds", None)),
    )


_LEASED = (
    select(BudgetLease.subject_id, func.sum(BudgetLease.amount))
    .where(BudgetLease.subject_id.in_(bindparam("ids", expanding=True)))
    .group_by(BudgetLease.subject_id)
)
_LEASE_HELD = (
    select(BudgetLease.subject_id, func.sum(Hold.amount))
    .join(
        Hold,
        (Hold.token_lease == BudgetLease.id)
        | (Hold.user_lease == BudgetLease.id)
        | (Hold.team_lease == BudgetLease.id),
    )
    .where(BudgetLease.subject_id.in_(bindparam("ids", expanding=True)))
    .group_by(BudgetLease.subject_id)
)


async def lease_slack(
    session: AsyncConnection | AsyncSession, subject_ids: list[str]
) -> dict[str, int]:
    """Per budget: its leases' credit that no request in flight holds."""
    leased = dict((await session.execute(_LEASED, {"ids": subject_ids})).all())
    if not leased:
        return {}
    held = dict((await session.execute(_LEASE_HELD, {"ids": list(leased)})).all())
    return {s: max(int(amount) - int(held.get(s) or 0), 0) for s, amount in leased.items()}


def new_budget(
    subject_id: str, scope: str, credit_limit: int | None, reset_interval: str, now: datetime
) -> Budget:
    interval = parse_interval(reset_interval)
    start, _ = window_for(interval, now, now)
    return Budget(
        subject_id=subject_id,
        scope=scope,
        credit_limit=credit_limit,
        reset_interval=interval.text,
        anchor_at=now,
        window_start=start,
        spent=0,
        reserved=0,
    )


def upsert_ignore(session: AsyncConnection | AsyncSession) -> Callable[..., Any]:
    return pg_insert if dialect_name(session) == "postgresql" else sqlite_insert


def literal(value: datetime | None) -> BindParameter[Any]:
    return bindparam(None, value, type_=UTCDateTime)


def ids() -> BindParameter[Any]:
    return bindparam("ids", expanding=True)


_B = Budget.__table__.c
# What a charge (or a roll) returns: enough to tell, with no further round trip, whether it
# crossed a threshold or a soft limit (metering.alerts.record).
CHARGED = (
    _B.subject_id,
    _B.scope,
    _B.credit_limit,
    _B.soft_limit,
    _B.alert_thresholds,
    _B.spent,
    _B.reserved,
    _B.reset_interval,
    _B.anchor_at,
    _B.window_start,
)


async def roll(session: AsyncConnection | AsyncSession, budget: BudgetRow, now: datetime) -> None:
    """Close the budget's window if it has ended: keep its total, restart spent at 0."""
    start, _ = current_window(budget, now)
    old_start = budget.window_start
    if old_start >= start:
        return
    # Lock the row before copying its total: on PostgreSQL a settle of the old window that
    # commits while this waits is then part of the copy, instead of being zeroed unrecorded.
    locked = await session.scalar(
        select(Budget.subject_id)
        .where(Budget.subject_id == budget.subject_id, Budget.window_start == old_start)
        .with_for_update()
    )
    if locked is None:
        return  # rolled meanwhile by another transaction
    _, old_end = current_window(budget, old_start)
    closed = (
        upsert_ignore(session)(BudgetWindow)
        .from_select(
            [
                "subject_id",
                "window_start",
                "window_end",
                "scope",
                "credit_limit",
                "spent",
                "recorded_at",
            ],
            select(
                Budget.subject_id,
                Budget.window_start,
                literal(old_end),
                Budget.scope,
                Budget.credit_limit,
                Budget.spent,
                literal(now),
            ).where(Budget.subject_id == budget.subject_id, Budget.window_start == old_start),
        )
        .on_conflict_do_nothing()
        .returning(BudgetWindow.spent)
    )
    closed_spent = (await session.execute(closed)).scalar()
    reset = (
        await session.execute(
            update(Budget.__table__)
            .where(Budget.subject_id == budget.subject_id, Budget.window_start == old_start)
            .values(spent=0, window_start=start)
            .returning(*CHARGED)
        )
    ).first()
    if reset is not None and closed_spent is not None:
        await _alert_reset(session, reset, closed_spent, old_start, now)


async def _alert_reset(
    session: AsyncConnection | AsyncSession,
    row: Any,
    closed_spent: int,
    old_start: datetime,
    now: datetime,
) -> None:
    """budget.window_reset, once per closed window, for a budget that alerts (a limit or a soft
    limit): its figures as the window closed; the new window re-arms its thresholds."""
    if row.credit_limit is None and row.soft_limit is None:
        return
    team_id, user_id = await record.owners(session, row.scope, row.subject_id)
    figures = record.Figures(
        row.scope,
        row.subject_id,
        team_id,
        row.credit_limit,
        closed_spent,
        row.reserved,
        resets_at(row, row.window_start),
    )
    data = figures.data(window_start=rfc3339(old_start), new_window_start=rfc3339(row.window_start))
    key = f"{row.subject_id}:{rfc3339(old_start)}"
    await record.write(
        session, [record.event_row(record.WINDOW_RESET, key, data, now, user_id=user_id)]
    )


# The hot path's statements are built once, on the tables (not the ORM classes, whose
# statements take the ORM's bulk paths): building a statement costs more than running it.
_LOAD = select(Budget.__table__).where(Budget.subject_id.in_(ids())).order_by(Budget.subject_id)
_LOAD_LOCKED = _LOAD.with_for_update()


async def load(
    session: AsyncConnection | AsyncSession, subject_ids: list[str], *, lock: bool = False
) -> dict[str, Row[*tuple[Any, ...]]]:
    """Budget rows as plain rows (the columns of Budget, not tracked objects): the UPDATEs
    of the writers are the writes. With `lock`, the rows are locked in subject_id order, the one
    order every writer uses, so concurrent transactions on the same budgets queue instead of
    deadlocking."""
    rows = await session.execute(_LOAD_LOCKED if lock else _LOAD, {"ids": subject_ids})
    return {row.subject_id: row for row in rows}


def add_to_budgets(**values: Any) -> Update:
    """One UPDATE of several budgets that first locks them in key order (see `load`)."""
    locked = (
        select(Budget.subject_id)
        .where(Budget.subject_id.in_(ids()))
        .order_by(Budget.subject_id)
        .with_for_update()
        .subquery()
    )
    return (
        update(Budget.__table__)
        .where(Budget.subject_id == locked.c.subject_id)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
