"""End users' budgets: the fifth scope a request is held against, beside its token, user, team
and run, when it names an end user (metering.ledger.outcome.Attribution.end_user).

An end user's budget is a row of `budgets` (scope `end_user`) keyed by a subject id derived from
its team and its name (`subject_of`), listed in `end_user_budgets` with its override if it has
one. The row is made by the end user's first request while its team has a default limit
(`end_user_credit_limit`), or by an override; an end user with neither has no budget and is
held against nothing of its own.

An end user's budget is small and its requests few, so it is never leased: a request of an end
user with a budget is always reserved in that budget's row, by the same conditional UPDATE as
its other budgets on the database path (metering.budgets.reserve). Its token's, user's and
team's budgets may still admit it against this process's leases (metering.budgets.leases):
then only the end user's row is locked, by `reserve_in_row`, in the transaction that writes
the hold. Each process remembers which teams have end-user budgets (`EndUserTeams`), forgotten
on every change to a team (the credential listener drops it before the changing call returns,
on every replica).
"""

import hashlib
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, exists, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from metering.budgets.views import current_window, load, roll, upsert_ignore
from metering.budgets.windows import parse_interval, window_for
from metering.db import Database
from metering.models import Budget, EndUserBudget, Team

SCOPE = "end_user"


def subject_of(team_id: str, end_user: str) -> str:
    """The budget's subject id: the same for the same team and end user, on every replica."""
    digest = hashlib.sha256(f"{team_id}\x00{end_user}".encode()).hexdigest()
    return f"eu_{digest[:32]}"


_E = EndUserBudget.__table__.c
_TERMS = (
    select(
        Team.end_user_credit_limit,
        Team.end_user_reset_interval,
        _E.subject_id,
        _E.override,
    )
    .select_from(Team)
    .outerjoin(EndUserBudget.__table__, _E.subject_id == bindparam("subject"))
    .where(Team.id == bindparam("team_id"))
)


async def held_in(
    conn: AsyncConnection | AsyncSession, team_id: str, end_user: str, now: datetime
) -> str | None:
    """The budget a request of this end user is held in (made now from the team's default on
    its first use), or None when it has none: no override, and no default limit."""
    subject = subject_of(team_id, end_user)
    terms = (await conn.execute(_TERMS, {"subject": subject, "team_id": team_id})).first()
    if terms is None:
        return None
    if terms.override:
        return subject
    if terms.end_user_credit_limit is None:
        return None
    if terms.subject_id is None:
        await create(
            conn,
            team_id,
            end_user,
            terms.end_user_credit_limit,
            terms.end_user_reset_interval,
            now,
        )
    return subject


def budget_values(
    subject: str, credit_limit: int | None, reset_interval: str, now: datetime
) -> dict[str, Any]:
    interval = parse_interval(reset_interval)
    return {
        "subject_id": subject,
        "scope": SCOPE,
        "credit_limit": credit_limit,
        "reset_interval": interval.text,
        "anchor_at": now,
        "window_start": window_for(interval, now, now)[0],
        "spent": 0,
        "reserved": 0,
    }


async def create(
    conn: AsyncConnection | AsyncSession,
    team_id: str,
    end_user: str,
    credit_limit: int | None,
    reset_interval: str,
    now: datetime,
) -> str:
    """The end user's budget row and its listing, made unless they exist (requests racing to
    make them meet at the primary keys: one makes them, the others find them)."""
    subject = subject_of(team_id, end_user)
    insert = upsert_ignore(conn)
    await conn.execute(
        insert(Budget.__table__)
        .values(budget_values(subject, credit_limit, reset_interval, now))
        .on_conflict_do_nothing()
    )
    listed = {
        "subject_id": subject,
        "team_id": team_id,
        "end_user": end_user,
        "override": False,
        "credit_limit": None,
        "reset_interval": None,
        "created_at": now,
    }
    await conn.execute(insert(EndUserBudget.__table__).values(listed).on_conflict_do_nothing())
    return subject


_RESERVE_ONE = (
    update(Budget.__table__)
    .where(
        Budget.subject_id == bindparam("subject"),
        (Budget.credit_limit.is_(None))
        | (Budget.spent + Budget.reserved + bindparam("amount") <= Budget.credit_limit),
    )
    .values(reserved=Budget.reserved + bindparam("amount"))
    .execution_options(synchronize_session=False)
)


async def reserve_in_row(
    conn: AsyncConnection, subject: str, amount: int, now: datetime
) -> tuple[Any, ...] | None:
    """Hold `amount` in one end user's budget row (locked, moved into its current window, then
    the conditional UPDATE): its window (reset_interval, anchor, start), or None when the row
    cannot cover the amount."""
    budget = (await load(conn, [subject], lock=True)).get(subject)
    if budget is None:
        return None
    await roll(conn, budget, now)
    start, _ = current_window(budget, now)
    held = await conn.execute(_RESERVE_ONE, {"subject": subject, "amount": amount})
    if held.rowcount != 1:
        return None
    return (budget.reset_interval, budget.anchor_at, start)


_TEAM_HAS = select(
    or_(
        Team.end_user_credit_limit.is_not(None),
        exists().where(_E.team_id == Team.id, _E.override.is_(True)),
    )
).where(Team.id == bindparam("team_id"))


class EndUserTeams:
    """Which teams have end-user budgets (a default limit, or an override), as this process
    last read them: their end users' requests take the database path. Forgotten on a change to
    the team (`drop`, called by the credential listener before the change is acknowledged);
    a read that a change overtook is not kept."""

    def __init__(self, db: Database, size: int = 100_000) -> None:
        self.db = db
        self.size = size
        self.known: dict[str, bool] = {}
        self.epoch = 0

    def drop(self, subjects: frozenset[str] | None) -> None:
        self.epoch += 1
        if subjects is None:
            self.known.clear()
            return
        for subject in subjects:
            kind, _, ident = subject.partition(":")
            if kind == "team":
                self.known.pop(ident, None)

    async def limited(self, team_id: str) -> bool:
        """Whether the team's end users may have budgets."""
        known = self.known.get(team_id)
        if known is not None:
            return known
        epoch = self.epoch
        async with self.db.sessions() as session:
            found = bool((await session.execute(_TEAM_HAS, {"team_id": team_id})).scalar())
        if self.epoch == epoch:
            if len(self.known) >= self.size:
                self.known.clear()
            self.known[team_id] = found
        return found
