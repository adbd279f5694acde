"""Dated charges: amounts charged to budgets at a moment that may be past (usage reported from
outside the proxy, a rerate's or a manual adjustment), each to the window of each budget it
falls in; and whether they fit there, checked before they are charged.

Both run in the caller's transaction, after the budgets are locked in subject_id order (the
order every writer of budgets takes them in) and rolled into their current windows: nothing can
move them between the check and the charge, so the check is exact on every replica. A charge to
a window that has closed goes to that window's kept total (corrected, never reopened for
admission: a closed window is where usage that already happened is recorded; a window that
closed without a recorded total gets one); one from before a budget existed to the calendar
window of its moment (hourly, daily, weekly, monthly), or to the budget's first window (fixed
windows, never).

The checks, on one reading of the windows (`_windows`) and one ceiling (`_past_ceiling`):
- `fit`: reported usage, charge by charge in order, under every counter's ceiling and, for a
  user's own credential, under the credit limit of every window each falls in (token, user,
  team, and the run the report names). One that does not fit is left out and the ones after it
  are checked against what the fitting ones before them added.
- `charge_dated(..., bounded=True)`: a manual adjustment, on the windows as it would leave
  them: never below zero (a credit), never past the ceiling (a charge); a counter already out
  of bounds may still be brought back.
The ceiling leaves headroom under the columns' own (BIGINT picodollars, 9,223,372 USD) for live
requests settling meanwhile, whose charges are never refused.
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from metering.alerts import record
from metering.budgets.runs import RunKey, lock_run
from metering.budgets.settle import charge_sums
from metering.budgets.views import current_window, load, resets_at, roll, upsert_ignore
from metering.errors import InvalidRequest
from metering.models import BudgetWindow
from metering.money import COUNTER_CEILING, format_usd
from metering.timefmt import rfc3339

BUDGET_EXCEEDED = "budget_exceeded"
COUNTER_CEILING_REACHED = "counter_ceiling"


@dataclass(frozen=True, slots=True)
class Dated:
    """An amount charged to budgets at a moment that may be past: ingested usage, or an
    adjustment (negative for a credit)."""

    subjects: list[str]
    at: datetime
    amount: int
    # Whose they are, for the alerts a charge to the current window may raise.
    team_id: str | None = None
    user_id: str | None = None


@dataclass(frozen=True, slots=True)
class Charged:
    """A budget window dated charges changed (the current one, or a closed one's kept total),
    as they left it."""

    scope: str
    subject_id: str
    window_start: datetime
    window_end: datetime | None
    credit_limit: int | None
    spent: int  # after the charges
    reserved: int  # the current window's; a closed window holds nothing
    added: int  # what the charges added to spent (negative: a credit)
    team_id: str | None
    user_id: str | None  # None for a team's budget

    @property
    def over_limit(self) -> bool:
        """Charged more and left above its credit_limit."""
        return self.added > 0 and self.credit_limit is not None and self.spent > self.credit_limit


@dataclass(frozen=True, slots=True)
class Unfit:
    """Why a charge was left out: the reason, the scope and subject whose counter refused it."""

    reason: str  # BUDGET_EXCEEDED or COUNTER_CEILING_REACHED
    scope: str  # token, user, team or run
    subject_id: str
    message: str


class OutOfBounds(InvalidRequest):
    """A charge that would take a budget's spent below zero or past COUNTER_CEILING."""


def _past_ceiling(held: int, amount: int) -> bool:
    """Whether adding `amount` to a counter holding `held` (spent and reserved) passes the most
    a counter keeps."""
    return held + amount > COUNTER_CEILING


# --- the windows charges fall in ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Place:
    """A window a charge falls in: its budget, start and end, and whether it is the current
    one."""

    subject_id: str
    start: datetime
    end: datetime | None
    current: bool


@dataclass(frozen=True, slots=True)
class _Windows:
    budgets: dict[str, Any]  # subject -> its row as locked (before its roll)
    now: dict[str, Any]  # subject -> its current window (start, end)
    places: list[list[_Place]]  # per charge, in order
    # (subject, closed window start) -> (spent, credit_limit) recorded
    kept: dict[tuple[str, datetime], Any]

    def current(self, subject: str) -> tuple[datetime, int]:
        """A budget's current window start and spent (a window that has ended restarted at 0
        when it was rolled)."""
        budget = self.budgets[subject]
        start = self.now[subject][0]
        if budget.window_start < start:
            return start, 0
        return budget.window_start, budget.spent

    def closed(self, place: _Place) -> tuple[int, int | None]:
        """A closed window's kept spent and credit_limit (none kept: nothing, today's limit)."""
        budget = self.budgets[place.subject_id]
        kept: tuple[int, int | None] = self.kept.get(
            (place.subject_id, place.start), (0, budget.credit_limit)
        )
        return kept


async def _windows(
    session: AsyncConnection | AsyncSession, charges: list[Dated], now: datetime
) -> _Windows:
    """Lock and roll the charges' budgets, and find the window of each budget each charge falls
    in, with the kept totals of the closed ones."""
    subjects = sorted({s for charge in charges for s in charge.subjects})
    budgets = await load(session, subjects, lock=True) if subjects else {}
    for row in budgets.values():
        await roll(session, row, now)
    windows = {s: current_window(b, now) for s, b in budgets.items()}
    places: list[list[_Place]] = []
    closed: set[tuple[str, datetime]] = set()
    for charge in charges:
        found = []
        for subject in charge.subjects:
            budget = budgets.get(subject)
            if budget is None:
                continue
            # Before the budget existed: its calendar window of then, or its first window.
            start, end = current_window(budget, charge.at)
            place = _Place(subject, start, end, start >= windows[subject][0])
            found.append(place)
            if not place.current:
                closed.add((subject, start))
        places.append(found)
    kept = await _closed_totals(session, closed)
    return _Windows(budgets, windows, places, kept)


async def _closed_totals(
    session: AsyncConnection | AsyncSession, keys: set[tuple[str, datetime]]
) -> dict[tuple[str, datetime], Any]:
    """(subject, window start) -> (spent, credit_limit) of the closed windows kept."""
    if not keys:
        return {}
    table = BudgetWindow.__table__
    rows = await session.execute(
        select(table.c.subject_id, table.c.window_start, table.c.spent, table.c.credit_limit).where(
            tuple_(table.c.subject_id, table.c.window_start).in_(sorted(keys))
        )
    )
    return {(r.subject_id, r.window_start): (r.spent, r.credit_limit) for r in rows}


# --- fit ----------------------------------------------------------------------------------


def _exceeded(
    scope: str,
    subject_id: str,
    limit: int,
    spent: int,
    reserved: int,
    amount: int,
    resets: datetime | None,
) -> Unfit:
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


def _ceiling(scope: str, subject_id: str, held: int, amount: int) -> Unfit:
    return Unfit(
        COUNTER_CEILING_REACHED,
        scope,
        subject_id,
        f"{scope} {subject_id} holds {format_usd(held)} USD in this window: adding this event's "
        f"{format_usd(amount)} would pass the {format_usd(COUNTER_CEILING)} USD a counter keeps",
    )


async def fit(
    session: AsyncConnection | AsyncSession,
    charges: list[Dated],
    now: datetime,
    *,
    limited: bool,
    run: RunKey | None = None,
) -> list[Unfit | None]:
    """Per charge, in order: None when it fits (and counts for the ones after it), else why
    not. With `limited`, credit limits refuse too; `run` (limited only): the run every charge
    is also held against, its row locked after the budgets."""
    windows = await _windows(session, charges, now)
    runs = await lock_run(session, run, now) if run is not None and limited else None
    added: dict[tuple[str, datetime], int] = {}
    run_added = 0
    out: list[Unfit | None] = []
    for charge, found in zip(charges, windows.places, strict=True):
        amount = charge.amount
        unfit = None
        for place in found:
            subject = place.subject_id
            budget = windows.budgets[subject]
            if place.current:
                start, spent = windows.current(subject)
                reserved, limit = budget.reserved, budget.credit_limit
                resets = resets_at(budget, start)
            else:
                spent, limit = windows.closed(place)
                reserved, resets = 0, place.end
            spent += added.get((subject, place.start), 0)
            if _past_ceiling(spent + reserved, amount):
                unfit = _ceiling(budget.scope, subject, spent + reserved, amount)
            elif limited and limit is not None and spent + reserved + amount > limit:
                unfit = _exceeded(budget.scope, subject, limit, spent, reserved, amount, resets)
            if unfit is not None:
                break
        if unfit is None and runs is not None:
            spent = runs.spent + run_added
            held = spent + runs.reserved
            if _past_ceiling(held, amount) or held + amount > runs.credit_limit:
                unfit = _exceeded(
                    "run", runs.id, runs.credit_limit, spent, runs.reserved, amount, None
                )
        out.append(unfit)
        if unfit is None:
            for place in found:
                key = (place.subject_id, place.start)
                added[key] = added.get(key, 0) + amount
            run_added += amount
    return out


# --- charge -------------------------------------------------------------------------------


def check_bounds(window: Charged) -> None:
    """Refuse a charge that takes a counter below zero (a credit) or past the ceiling (a
    charge): a counter already out of bounds may still be brought back."""
    before = window.spent - window.added
    where = f"{window.scope} {window.subject_id}'s spent in the window from"
    where += f" {rfc3339(window.window_start)}"
    if window.added < 0 and window.spent < 0:
        raise OutOfBounds(
            f"this amount would take {where} from {format_usd(before)} to "
            f"{format_usd(window.spent)} USD: below zero",
            param="amount",
        )
    if window.added > 0 and _past_ceiling(before + window.reserved, window.added):
        raise OutOfBounds(
            f"this amount would take {where} from {format_usd(before)} to "
            f"{format_usd(window.spent)} USD (reserved {format_usd(window.reserved)}): past the "
            f"{format_usd(COUNTER_CEILING)} USD a counter keeps",
            param="amount",
        )


def _closed_upsert(session: AsyncConnection | AsyncSession) -> Any:
    statement = upsert_ignore(session)(BudgetWindow.__table__)
    return statement.on_conflict_do_update(
        index_elements=["subject_id", "window_start"],
        set_={"spent": BudgetWindow.__table__.c.spent + statement.excluded.spent},
    )


async def charge_dated(
    session: AsyncConnection | AsyncSession,
    charges: list[Dated],
    now: datetime,
    *,
    bounded: bool = False,
) -> list[Charged]:
    """Charge each amount to the window of each budget it falls in, in the caller's
    transaction: the current window's `spent`, or a closed window's kept total. With
    `bounded`, a charge that would take one below zero or past COUNTER_CEILING raises
    OutOfBounds, with nothing written. Returns the windows charged, as left."""
    if not any(charge.subjects for charge in charges):
        return []
    windows = await _windows(session, charges, now)
    current: dict[str, int] = {}
    closed: dict[tuple[str, datetime], dict[str, Any]] = {}
    people: dict[str, Any] = {}
    for charge, found in zip(charges, windows.places, strict=True):
        for place in found:
            subject = place.subject_id
            owner = None if subject == charge.team_id else charge.user_id
            people.setdefault(subject, (charge.team_id, owner))
            if place.current:
                current[subject] = current.get(subject, 0) + charge.amount
                continue
            budget = windows.budgets[subject]
            row = closed.setdefault(
                (subject, place.start),
                {
                    "subject_id": subject,
                    "window_start": place.start,
                    "window_end": place.end,
                    "scope": budget.scope,
                    "credit_limit": budget.credit_limit,
                    "spent": 0,
                    "recorded_at": now,
                },
            )
            row["spent"] += charge.amount
    charged = [_charged_now(windows, s, current[s], people) for s in sorted(current)]
    for key in sorted(closed):
        row = closed[key]
        place = _Place(row["subject_id"], row["window_start"], row["window_end"], False)
        spent, limit = windows.closed(place)
        charged.append(
            Charged(
                row["scope"],
                row["subject_id"],
                row["window_start"],
                row["window_end"],
                limit,
                spent + row["spent"],
                0,
                row["spent"],
                *people[row["subject_id"]],
            )
        )
    if bounded:
        for window in charged:
            check_bounds(window)
    if current:  # the settle's path: a threshold a positive amount passes alerts as a settle's
        await charge_sums(session, {s: [cost, 0] for s, cost in current.items()}, {}, people, now)
    if closed:
        await session.execute(_closed_upsert(session), [closed[key] for key in sorted(closed)])
    return charged


def _charged_now(windows: _Windows, subject: str, amount: int, people: dict[str, Any]) -> Charged:
    """The current window `amount` is charged to, as it leaves it."""
    budget = windows.budgets[subject]
    start, spent = windows.current(subject)
    return Charged(
        budget.scope,
        subject,
        start,
        windows.now[subject][1],
        budget.credit_limit,
        spent + amount,
        budget.reserved,
        amount,
        *people[subject],
    )


async def alert_over_limit(
    session: AsyncConnection | AsyncSession, charged: list[Charged], now: datetime
) -> None:
    """budget.exhausted for each window a charge that is never refused (a rerate: the price was
    wrong) left above its credit_limit, once per window and limit (the key a refusal's has)."""
    rows = []
    for window in charged:
        if not window.over_limit:
            continue
        figures = record.Figures(
            window.scope,
            window.subject_id,
            window.team_id,
            window.credit_limit,
            window.spent,
            window.reserved,
            window.window_end,
        )
        key = f"{window.subject_id}:{rfc3339(window.window_start)}:{window.credit_limit}"
        data = figures.data(window_start=rfc3339(window.window_start))
        rows.append(record.event_row(record.EXHAUSTED, key, data, now, user_id=window.user_id))
    await record.write(session, rows)
