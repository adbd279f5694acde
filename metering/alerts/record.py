"""Alert events as rows of the outbox, written by whoever changes what they report, in the same
transaction: budget settles (thresholds and soft limits crossed), refusals, window resets, token
expiry and reconciliations. Each event has a `dedupe_key`; a second write of the same key does
nothing (INSERT ... ON CONFLICT DO NOTHING), so each is recorded once whatever the interleaving.

This module only builds and writes rows; it imports nothing above the data layer.
"""

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from metering.db import dialect_name
from metering.models import AlertEvent, ApiToken, EndUserBudget, User
from metering.money import format_usd
from metering.timefmt import parse_rfc3339, rfc3339

THRESHOLD_CROSSED = "budget.threshold_crossed"
SOFT_LIMIT_REACHED = "budget.soft_limit_reached"
EXHAUSTED = "budget.exhausted"
WINDOW_RESET = "budget.window_reset"
TOKEN_EXPIRING = "token.expiring"
RECONCILIATION_DIFFERS = "reconciliation.differs"
TYPES = (
    THRESHOLD_CROSSED,
    SOFT_LIMIT_REACHED,
    EXHAUSTED,
    WINDOW_RESET,
    TOKEN_EXPIRING,
    RECONCILIATION_DIFFERS,
)
DEFAULT_THRESHOLDS = (50, 80, 100)
MAX_THRESHOLDS = 10


def thresholds_of(stored: str | None) -> tuple[int, ...]:
    """A budget's thresholds (percentages of its credit_limit) from their stored JSON."""
    if stored is None:
        return DEFAULT_THRESHOLDS
    return tuple(json.loads(stored))


# When a charge passes an alert level: the one rule, written once and used in two forms. A
# budget's levels are its soft limit S and each threshold p (a percentage) of its credit_limit
# L > 0, a threshold's level being L x p at the scale PERCENT, so the arithmetic stays in whole
# numbers. `spent` has reached a level when level <= spent x scale; a charge taking spent from
# `before` to `after` passes it when it had not reached it before and has after. `reached` and
# `passes` use operators only: called with integers they decide here (`passed`, `crossings`,
# metering.budgets.views.BudgetView.threshold_passed); called with SQL expressions
# (SQLAlchemy) they are the SQL the one-statement settle decides with, in exact numeric
# arithmetic (metering.budgets.settle_pg). tests/alerts/test_levels.py holds every form to
# one table of cases.
PERCENT = 100


def reached(spent, level, scale: int = 1):
    """Whether `spent` has reached `level` (`scale`: PERCENT for a threshold's level)."""
    return level <= (spent if scale == 1 else spent * scale)


def passes(before, after, level, scale: int = 1):
    """Whether spent going from `before` to `after` passes `level`: not reached before, reached
    after."""
    return ((before if scale == 1 else before * scale) < level) & reached(after, level, scale)


def new_event_id() -> str:
    return f"evt_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class Figures:
    """A budget's figures for an event's `data` (picodollars)."""

    scope: str
    subject_id: str
    team_id: str | None
    credit_limit: int | None
    spent: int
    reserved: int
    resets_at: datetime | None

    def data(self, threshold=None, **extra) -> dict:
        remaining = (
            None
            if self.credit_limit is None
            else max(self.credit_limit - self.spent - self.reserved, 0)
        )
        return {
            "scope": self.scope,
            "subject_id": self.subject_id,
            "team_id": self.team_id,
            "credit_limit": format_usd(self.credit_limit),
            "spent": format_usd(self.spent),
            "reserved": format_usd(self.reserved),
            "remaining": format_usd(remaining),
            "threshold": threshold,
            "resets_at": rfc3339(self.resets_at),
            **extra,
        }


def event_row(
    type_: str,
    key: str,
    data: dict,
    now: datetime,
    *,
    user_id: str | None = None,
) -> dict:
    return {
        "id": new_event_id(),
        "type": type_,
        "created_at": now,
        "scope": data["scope"],
        "subject_id": data["subject_id"],
        "team_id": data.get("team_id"),
        "user_id": user_id,
        "dedupe_key": f"{type_}:{key}"[:200],
        "data": json.dumps(data, separators=(",", ":")),
        "dispatched": False,
    }


def crossings(
    figures: Figures,
    before: int,
    thresholds: tuple[int, ...],
    soft_limit: int | None,
    window_start: datetime,
    now: datetime,
    user_id: str | None,
) -> list[dict]:
    """The events a change of `spent` from `before` to `figures.spent` makes: each threshold
    (a percentage of the limit) and the soft limit passed on the way up, once per window."""
    after = figures.spent
    if after <= before:
        return []
    window = rfc3339(window_start)
    rows = []
    limit = figures.credit_limit
    if limit is not None and limit > 0:
        for percent in thresholds:
            if passes(before, after, limit * percent, PERCENT):
                key = f"{figures.subject_id}:{percent}:{window}"
                data = figures.data(threshold=percent)
                rows.append(event_row(THRESHOLD_CROSSED, key, data, now, user_id=user_id))
    if soft_limit is not None and passes(before, after, soft_limit):
        key = f"{figures.subject_id}:{window}"
        data = figures.data(soft_limit=format_usd(soft_limit))
        rows.append(event_row(SOFT_LIMIT_REACHED, key, data, now, user_id=user_id))
    return rows


def rearms_until(type_: str, data: dict) -> datetime | None:
    """Until when an event's key could be written again were its row gone (None: for ever):
    a budget's events until its window ends (their key holds the window's start; a budget that
    never resets keeps them), token.expiring until the token expires (its key holds the
    expiry); the others never (a closed window, a stored reconciliation, a test)."""
    if type_ in (THRESHOLD_CROSSED, SOFT_LIMIT_REACHED, EXHAUSTED):
        ends = data.get("resets_at")
        return None if ends is None else parse_rfc3339(ends)
    if type_ == TOKEN_EXPIRING:
        return parse_rfc3339(data["expires_at"])
    return datetime.min.replace(tzinfo=UTC)


def _insert(conn):
    return pg_insert if dialect_name(conn) == "postgresql" else sqlite_insert


async def write(conn, rows: list[dict]) -> int:
    """Write events once each (an event whose key exists already is dropped); how many were new."""
    if not rows:
        return 0
    statement = _insert(conn)(AlertEvent.__table__).values(rows)
    result = await conn.execute(statement.on_conflict_do_nothing(index_elements=["dedupe_key"]))
    return result.rowcount


def passed(
    before: int,
    after: int,
    limit: int | None,
    thresholds: tuple[int, ...],
    soft_limit: int | None,
) -> bool:
    """Whether going from `before` to `after` passes a threshold or the soft limit."""
    if soft_limit is not None and passes(before, after, soft_limit):
        return True
    if limit is None or limit <= 0:
        return False
    return any(passes(before, after, limit * p, PERCENT) for p in thresholds)


async def owners(conn, scope: str, subject_id: str) -> tuple[str | None, str | None]:
    """(team_id, user_id) of a budget's subject (user_id None for a team)."""
    if scope == "team":
        return subject_id, None
    if scope == "end_user":  # an end user's budget is its team's
        team_id = (
            await conn.execute(
                select(EndUserBudget.team_id).where(EndUserBudget.subject_id == subject_id)
            )
        ).scalar()
        return team_id, None
    if scope == "user":
        team_id = (await conn.execute(select(User.team_id).where(User.id == subject_id))).scalar()
        return team_id, subject_id
    found = (
        await conn.execute(
            select(User.team_id, User.id)
            .join(ApiToken, ApiToken.user_id == User.id)
            .where(ApiToken.id == subject_id)
        )
    ).first()
    return (found.team_id, found.id) if found is not None else (None, None)
