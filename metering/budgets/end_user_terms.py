"""End users' budgets, as an operator sets and reads them: a team's default for each of its end
users, one end user's override, its budget as it stands and the team's end users (the hold
path is metering.budgets.end_users; a team's own fields are metering.identity's). Services flush; the endpoint's unit of work commits.

A change of terms applies to the end users' rows as a team's or user's change applies to its
own: a new limit to the current window at once; a new interval re-anchors the window at the
time of the change, keeping what was spent so far counted in it. Every change is recorded as a
change to the team (metering.auth.invalidation), so every replica forgets whether the team's
end users have budgets before the call returns.
"""

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Select, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from metering.auth import invalidation
from metering.budgets import end_users
from metering.budgets.views import BudgetView, load, roll, view
from metering.budgets.windows import parse_interval, window_for
from metering.db import utcnow
from metering.errors import NotFound
from metering.ledger import attribution
from metering.models import Budget, EndUserBudget, Team
from metering.money import usd_to_pico


async def get_team(session: AsyncSession, team_id: str) -> Team:
    team = await session.get(Team, team_id)
    if team is None or team.deleted_at is not None:
        raise NotFound(f"team {team_id} not found")
    return team


def check_end_user(end_user: str) -> str:
    """An end user named in a path: as a request names one (400 naming `end_user` otherwise)."""
    return attribution.end_user(end_user, "end_user")


def _pico(limit: Decimal | None) -> int | None:
    return None if limit is None else usd_to_pico(limit)


async def _retune(
    session: AsyncSession,
    subjects: Select[Any],
    credit_limit: int | None,
    interval: str | None,
    now: datetime,
) -> None:
    """New terms for these end users' budget rows: the limit always, the interval (re-anchored
    now, after closing any window that ended) when given."""
    values: dict[str, Any] = {"credit_limit": credit_limit}
    if interval is not None:
        for budget in (
            await session.execute(select(Budget.__table__).where(Budget.subject_id.in_(subjects)))
        ).all():
            await roll(session, budget, now)
        parsed = parse_interval(interval)
        values.update(
            reset_interval=parsed.text,
            anchor_at=now,
            window_start=window_for(parsed, now, now)[0],
        )
    await session.execute(
        update(Budget)
        .where(Budget.subject_id.in_(subjects))
        .values(**values)
        .execution_options(synchronize_session=False)
    )


_E = EndUserBudget.__table__.c


async def set_team_defaults(
    session: AsyncSession, team: Team, fields: dict[str, Any], *, new: bool = False
) -> None:
    """A team's default end-user budget (the fields sent: end_user_credit_limit,
    end_user_reset_interval), applied to the end users that have no override. A `new` team has
    none yet, and no replica has read anything of it."""
    changed = False
    new_interval = None
    if "end_user_credit_limit" in fields:
        team.end_user_credit_limit = _pico(fields["end_user_credit_limit"])
        changed = True
    interval = fields.get("end_user_reset_interval")
    if interval is not None:
        text = parse_interval(interval).text
        if text != team.end_user_reset_interval:
            new_interval = text
        team.end_user_reset_interval = text
        changed = True
    if not changed or new:
        return
    await session.flush()
    defaulted = select(_E.subject_id).where(_E.team_id == team.id, _E.override.is_(False))
    await _retune(session, defaulted, team.end_user_credit_limit, new_interval, utcnow())
    await invalidation.record(session, invalidation.subject("team", team.id))


async def _listed(session: AsyncSession, subject: str) -> Any:
    return (
        await session.execute(select(EndUserBudget.__table__).where(_E.subject_id == subject))
    ).first()


async def set_override(
    session: AsyncSession,
    team_id: str,
    end_user: str,
    credit_limit: Decimal | None,
    reset_interval: str,
) -> BudgetView:
    """One end user's own terms, in place of its team's default."""
    await get_team(session, team_id)
    now = utcnow()
    subject = end_users.subject_of(team_id, end_user)
    limit = _pico(credit_limit)
    interval = parse_interval(reset_interval).text
    if await _listed(session, subject) is None:
        await end_users.create(session, team_id, end_user, limit, interval, now)
    budget = (await load(session, [subject])).get(subject)
    moved = budget is None or budget.reset_interval != interval
    await _retune(
        session,
        select(_E.subject_id).where(_E.subject_id == subject),
        limit,
        interval if moved else None,
        now,
    )
    await session.execute(
        update(EndUserBudget)
        .where(_E.subject_id == subject)
        .values(override=True, credit_limit=limit, reset_interval=interval)
        .execution_options(synchronize_session=False)
    )
    await invalidation.record(session, invalidation.subject("team", team_id))
    return (await budget_of(session, team_id, end_user))[1]


async def clear_override(session: AsyncSession, team_id: str, end_user: str) -> None:
    """The end user back on its team's default (nothing to do without an override)."""
    team = await get_team(session, team_id)
    subject = end_users.subject_of(team_id, end_user)
    listed = await _listed(session, subject)
    if listed is None or not listed.override:
        return
    budget = (await load(session, [subject])).get(subject)
    default = team.end_user_reset_interval
    moved = budget is None or budget.reset_interval != default
    await _retune(
        session,
        select(_E.subject_id).where(_E.subject_id == subject),
        team.end_user_credit_limit,
        default if moved else None,
        utcnow(),
    )
    await session.execute(
        update(EndUserBudget)
        .where(_E.subject_id == subject)
        .values(override=False, credit_limit=None, reset_interval=None)
        .execution_options(synchronize_session=False)
    )
    await invalidation.record(session, invalidation.subject("team", team_id))


async def budget_of(session: AsyncSession, team_id: str, end_user: str) -> tuple[bool, BudgetView]:
    """(whether it has an override, its budget now). An end user without a row yet shows its
    team's default, as its first request would make it."""
    team = await get_team(session, team_id)
    subject = end_users.subject_of(team_id, end_user)
    now = utcnow()
    listed = await _listed(session, subject)
    budget = (await load(session, [subject])).get(subject)
    if listed is None or budget is None:
        fresh = end_users.budget_values(
            subject, team.end_user_credit_limit, team.end_user_reset_interval, now
        )
        return False, view(Budget(**fresh), now)
    return bool(listed.override), view(budget, now)


async def list_end_users(
    session: AsyncSession, team_id: str, *, limit: int, after: str | None
) -> list[tuple[str, bool, BudgetView]]:
    """The team's end users with a budget, by name: (end user, override, budget now)."""
    await get_team(session, team_id)
    query = (
        select(_E.end_user, _E.override, Budget.__table__)
        .join(Budget.__table__, Budget.subject_id == _E.subject_id)
        .where(_E.team_id == team_id)
        .order_by(_E.end_user)
        .limit(limit)
    )
    if after is not None:
        query = query.where(_E.end_user > after)
    now = utcnow()
    rows = (await session.execute(query)).all()
    return [(row.end_user, bool(row.override), view(row, now)) for row in rows]
