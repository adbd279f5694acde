"""Whether dated charges fit their budgets, before they are charged (metering.budgets.service
charge_dated): under every counter's ceiling, and, for usage a user's own credential reports,
under the credit limit of every window each falls in (token, user, team, and the run the
report names).

Called in the transaction that then charges them, after the budgets are locked in subject_id
order (the order every writer of budgets takes them in) and rolled into their current windows:
no other transaction can move them between this check and the charge, so the check is exact on
every replica. Charges are taken in order; one that does not fit is left out and the ones after
it are checked against what the fitting ones before them added.

A charge to a window that has closed is checked against that window's kept total and limit
(never reopened for admission: a closed window is where usage that already happened is
recorded). The ceiling leaves headroom under the columns' own (BIGINT picodollars, 9,223,372
USD) for live requests settling meanwhile, whose charges are never refused.
"""

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

from metering.budgets.service import (
    Dated,
    RunKey,
    _lock_run,
    current_window,
    load,
    resets_at,
    roll,
)
from metering.models import BudgetWindow
from metering.money import COUNTER_CEILING, format_usd
from metering.timefmt import rfc3339

BUDGET_EXCEEDED = "budget_exceeded"
COUNTER_CEILING_REACHED = "counter_ceiling"


@dataclass(frozen=True, slots=True)
class Unfit:
    """Why a charge was left out: the reason, the scope and subject whose counter refused it."""

    reason: str  # BUDGET_EXCEEDED or COUNTER_CEILING_REACHED
    scope: str  # token, user, team or run
    subject_id: str
    message: str


def _exceeded(scope, subject_id, limit, spent, reserved, amount, resets) -> Unfit:
    when = f"resets at {rfc3339(resets)}" if resets else "never resets"
    left = max(limit - spent - reserved, 0)
    return Unfit(
        BUDGET_EXCEEDED,
        scope,
        subject_id,
        f"{scope} budget {subject_id} cannot cover this event's {format_usd(amount)} USD: limit "
        f"{format_usd(limit)} USD, spent {format_usd(spent)}, reserved {format_usd(reserved)}, "
        f"remaining {format_usd(left)}; {when}",
    )


def _ceiling(scope, subject_id, held, amount) -> Unfit:
    return Unfit(
        COUNTER_CEILING_REACHED,
        scope,
        subject_id,
        f"{scope} {subject_id} holds {format_usd(held)} USD in this window: adding this event's "
        f"{format_usd(amount)} would pass the {format_usd(COUNTER_CEILING)} USD a counter keeps",
    )


async def _closed_totals(session: AsyncSession, wanted: set[tuple[str, datetime]]) -> dict:
    if not wanted:
        return {}
    table = BudgetWindow.__table__
    rows = await session.execute(
        select(table.c.subject_id, table.c.window_start, table.c.spent, table.c.credit_limit).where(
            tuple_(table.c.subject_id, table.c.window_start).in_(sorted(wanted))
        )
    )
    return {(r.subject_id, r.window_start): (r.spent, r.credit_limit) for r in rows}


async def fit(
    session: AsyncSession,
    charges: list[Dated],
    now: datetime,
    *,
    limited: bool,
    run: RunKey | None = None,
) -> list[Unfit | None]:
    """Per charge, in order: None when it fits (and counts for the ones after it), else why
    not. With `limited`, credit limits refuse too; `run` (limited only): the run every charge
    is also held against, its row locked after the budgets."""
    subjects = sorted({s for charge in charges for s in charge.subjects})
    rows = await load(session, subjects, lock=True)
    for row in rows.values():
        await roll(session, row, now)
    budgets = await load(session, subjects)  # as rolled (still locked by this transaction)
    runs = await _lock_run(session, run, now) if run is not None and limited else None
    current = {s: current_window(b, now)[0] for s, b in budgets.items()}
    places: list[list[tuple[str, datetime, datetime | None]]] = []
    closed_wanted: set[tuple[str, datetime]] = set()
    for charge in charges:
        found = []
        for subject in charge.subjects:
            budget = budgets.get(subject)
            if budget is None:
                continue
            start, end = current_window(budget, charge.at)
            found.append((subject, start, end))
            if start < current[subject]:
                closed_wanted.add((subject, start))
        places.append(found)
    closed = await _closed_totals(session, closed_wanted)
    added: dict[tuple[str, datetime], int] = {}
    run_added = 0
    out: list[Unfit | None] = []
    for charge, found in zip(charges, places, strict=True):
        amount = charge.amount
        unfit = None
        for subject, start, end in found:
            budget = budgets[subject]
            if start >= current[subject]:
                spent, reserved, limit = budget.spent, budget.reserved, budget.credit_limit
                resets = resets_at(budget, budget.window_start)
            else:
                spent, limit = closed.get((subject, start), (0, budget.credit_limit))
                reserved, resets = 0, end
            spent += added.get((subject, start), 0)
            if spent + reserved + amount > COUNTER_CEILING:
                unfit = _ceiling(budget.scope, subject, spent + reserved, amount)
            elif limited and limit is not None and spent + reserved + amount > limit:
                unfit = _exceeded(budget.scope, subject, limit, spent, reserved, amount, resets)
            if unfit is not None:
                break
        if unfit is None and runs is not None:
            spent = runs.spent + run_added
            if spent + runs.reserved + amount > min(runs.credit_limit, COUNTER_CEILING):
                unfit = _exceeded(
                    "run", runs.id, runs.credit_limit, spent, runs.reserved, amount, None
                )
        out.append(unfit)
        if unfit is None:
            for subject, start, _ in found:
                added[(subject, start)] = added.get((subject, start), 0) + amount
            run_added += amount
    return out
