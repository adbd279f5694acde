"""Corrections that never rewrite history: rerating a range at the price history's prices, and
manual adjustments (a credit for an outage).

A price found wrong is corrected in the catalog by an entry with `effective_from` in the past;
reloading the catalog records it in the price history (metering.ledger.prices). `rerate()`
then walks the range's usage events of one model at one provider, a chunk at a time, and for
each compares what it is charged now (its cost plus the adjustments already made to it) with
what the price in force at its moment charges: a difference becomes one adjustment event
(`kind` adjustment, the id it corrects, the difference, the reason) appended through the
ledger, in the event's own hour (so every rollup and report agrees with a recomputation from
scratch) and charged to the budget window the event was charged in. The original row never
changes; a second rerate finds no difference and adds nothing. A manual adjustment
(usage_source manual) is kept out of that comparison: a rerate never undoes a credit.

An event whose charge stopped at its hold (it has `uncharged`) is never charged above the hold
by a rerate. `unsettled` placeholders (a whole hold, no usage) are not rerated.

Two rerates of one range at once cannot both correct one event: an adjustment's id is made
from the event's id and how many adjustments it had, so the second insert of the same
correction is refused and its chunk is read again.

A rerate is never refused for the budgets it charges (the usage happened; its price was
wrong): the windows it leaves above their limit are reported and raise budget.exhausted. A
manual adjustment is refused instead when it would take a counter it changes out of bounds
(a budget's spent below zero or past COUNTER_CEILING, a rollup row's sums past it either
way), or when its `at` is in the future or beyond the reach of ingested usage: the budgets
are locked before the check, in the transaction that writes it.
"""

import hashlib
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import overload

from sqlalchemy import func, select, tuple_
from sqlalchemy.exc import IntegrityError

from metering.billing.fields import MAX_AGE
from metering.budgets.dated import Charged, Dated, alert_over_limit, charge_dated
from metering.db import Database, utcnow
from metering.errors import InvalidRequest, NotFound
from metering.ledger import writer
from metering.ledger.attribution import NO_TAGS
from metering.ledger.bounds import past_ceiling
from metering.ledger.event import ADJUSTMENT, CHAT, UNSETTLED, USAGE, Event, bounded
from metering.ledger.external import MANUAL, RERATED, adjustment_event
from metering.ledger.prices import PriceBook
from metering.ledger.tables import LedgerEvent
from metering.models import ApiToken, Team, User
from metering.money import (
    CHANGE_USD_PATTERN,
    MAX_USD,
    cost_pico,
    format_usd,
    usd_to_pico,
)
from metering.timefmt import parse_rfc3339, rfc3339

CHUNK = 1_000  # events read, compared and corrected per transaction
MAX_REASON = 500
# check_reason's rule as a JSON Schema pattern (the bodies' `reason`): free text (tab, newline
# and carriage return but no other control character) with something besides whitespace in it.
_FREE = r"[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]"
REASON_PATTERN = rf"^{_FREE}*[^\s\x00-\x1f\x7f]{_FREE}*$"
RETRIES = 3

_t = LedgerEvent.__table__


@dataclass(slots=True)
class Rerated:
    adjusted: int = 0
    difference: int = 0  # picodollars, the sum of the adjustments made
    # The budget windows it charged more and left above their limit, as last charged.
    over_limit: dict[tuple[str, datetime], Charged] = field(default_factory=dict)

    def add(self, charged: list[Charged]) -> None:
        for window in charged:
            key = (window.subject_id, window.window_start)
            if window.over_limit:
                self.over_limit[key] = window
            elif key in self.over_limit:  # a later chunk credited it
                limit = window.credit_limit
                if limit is not None and window.spent > limit:
                    self.over_limit[key] = window
                else:
                    del self.over_limit[key]

    def out(self) -> dict:
        over = [self.over_limit[key] for key in sorted(self.over_limit)]
        return {
            "adjusted": self.adjusted,
            "difference": format_usd(self.difference),
            "over_limit": [
                {
                    "scope": w.scope,
                    "id": w.subject_id,
                    "window_start": rfc3339(w.window_start),
                    "credit_limit": format_usd(w.credit_limit),
                    "spent": format_usd(w.spent),
                }
                for w in over
            ],
        }


def check_reason(reason) -> str:
    if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON:
        raise InvalidRequest(
            f"reason must be a non-empty text of at most {MAX_REASON} characters", param="reason"
        )
    return bounded("reason", reason)


def check_name(value: str | None, name: str) -> None:
    """Text from outside that a query compares with: no NUL (PostgreSQL refuses it)."""
    if value is not None and "\x00" in value:
        raise InvalidRequest(f"{name} must not contain NUL characters", param=name)


@overload
def parse_moment(value: str, name: str) -> datetime: ...
@overload
def parse_moment(value: str | None, name: str) -> datetime | None: ...
def parse_moment(value: str | None, name: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 64:
        raise InvalidRequest(f"{name} must be an RFC 3339 timestamp", param=name)
    try:
        return parse_rfc3339(value)
    except ValueError:
        raise InvalidRequest(f"{name} must be an RFC 3339 timestamp", param=name) from None


def _adjustment_id(event_id: str, made: int) -> str:
    digest = hashlib.sha256(f"{event_id}:{made}".encode()).hexdigest()[:32]
    return f"adj_{digest}"


def target_cost(row, prices: tuple[int, int, int]) -> int:
    """What the event charges at `prices`: its usage priced, never above its hold."""
    full = cost_pico(row.prompt_tokens, row.cached_tokens, row.completion_tokens, *prices)
    return min(full, row.cost) if row.uncharged > 0 else full


def _chunk_query(model: str, provider: str, start: datetime, end: datetime, after):
    query = (
        select(_t)
        .where(
            _t.c.model == model,
            _t.c.provider == provider,
            _t.c.kind == USAGE,
            _t.c.usage_source != UNSETTLED,
            _t.c.created_at >= start,
            _t.c.created_at < end,
        )
        .order_by(_t.c.created_at, _t.c.id)
        .limit(CHUNK)
    )
    if after is not None:
        query = query.where(tuple_(_t.c.created_at, _t.c.id) > tuple_(*after))
    return query


_MADE = (
    select(_t.c.corrects_event_id, func.sum(_t.c.cost), func.count())
    .where(_t.c.kind == ADJUSTMENT, _t.c.usage_source == RERATED)
    .group_by(_t.c.corrects_event_id)
)


async def _rerate_chunk(
    conn, rows, book: PriceBook, reason: str, now: datetime
) -> tuple[list[Event], list[Charged]]:
    ids = [row.id for row in rows]
    made = {
        r[0]: (int(r[1]), int(r[2]))
        for r in await conn.execute(_MADE.where(_t.c.corrects_event_id.in_(ids)))
    }
    adjustments = []
    for row in rows:
        price = book.at(row.model, row.provider, row.created_at)
        if price is None:
            continue
        adjusted, count = made.get(row.id, (0, 0))
        difference = target_cost(row, price.prices) - (row.cost + adjusted)
        if difference == 0:
            continue
        event = adjustment_event(
            token_id=row.token_id,
            user_id=row.user_id,
            team_id=row.team_id,
            model=row.model,
            provider=row.provider,
            upstream_model=row.upstream_model,
            prices=price.prices,
            difference=difference,
            reason=reason,
            at=row.created_at,
            made_at=now,
            corrects=row.id,
            event_id=_adjustment_id(row.id, count),
            upstream_id=row.upstream_id,  # reconciled with the request it corrects
            end_user=row.end_user,
            tags=row.tags,
            endpoint=row.endpoint,
        )
        adjustments.append(event)
    charged: list[Charged] = []
    if adjustments:
        await writer.append_many(conn, adjustments)
        charges = [
            Dated(_subjects(e), e.created_at, e.cost, e.team_id, e.user_id) for e in adjustments
        ]
        # Never refused (the price was wrong): a budget taken past its limit is told instead.
        charged = await charge_dated(conn, charges, now)
        await alert_over_limit(conn, charged, now)
    return adjustments, charged


def _subjects(event: Event) -> list[str]:
    return [s for s in (event.token_id, event.user_id, event.team_id) if s]


async def rerate(
    db: Database,
    *,
    provider: str,
    model: str,
    start: datetime,
    end: datetime,
    reason: str,
) -> Rerated:
    """Correct every usage event of `model` at `provider` in [start, end) to the price history;
    the budget windows it leaves above their limit are reported and raise budget.exhausted."""
    if end <= start:
        raise InvalidRequest("end must be after start", param="end")
    check_name(provider, "provider")
    check_name(model, "model")
    reason = check_reason(reason)
    async with db.reads() as session:
        book = await PriceBook.load(session, {model})
    if not book.rows.get((model, provider)):
        raise NotFound(f"no price recorded for {model!r} at {provider!r}", param="model")
    result, after = Rerated(), None
    while True:
        for attempt in range(RETRIES):
            try:
                async with db.begin() as conn:
                    rows = (
                        await conn.execute(_chunk_query(model, provider, start, end, after))
                    ).all()
                    made, charged = await _rerate_chunk(conn, rows, book, reason, utcnow())
                break
            except IntegrityError:
                if attempt == RETRIES - 1:
                    raise  # corrected meanwhile, again and again: let the caller retry
        result.adjusted += len(made)
        result.difference += sum(e.cost for e in made)
        result.add(charged)
        if len(rows) < CHUNK:
            return result
        after = (rows[-1].created_at, rows[-1].id)


def parse_amount(value) -> int:
    """A signed USD amount ("-5.00": a credit) in picodollars, at most MAX_USD either way, never
    zero: money.CHANGE_USD_PATTERN, as /openapi.json declares it."""
    if not isinstance(value, str) or re.fullmatch(CHANGE_USD_PATTERN, value) is None:
        raise InvalidRequest(
            'amount must be a decimal string of signed USD such as "-5.00" (a credit) or '
            f'"12.5", not zero, between -{MAX_USD} and {MAX_USD}, at most 12 decimals',
            param="amount",
        )
    amount = usd_to_pico(Decimal(value.removeprefix("-")))
    return -amount if value.startswith("-") else amount


def reach(retention_days: int | None) -> timedelta:
    """How far back an adjustment's `at` may be: as far as ingested usage's (MAX_AGE), less
    when retention moves the ledger on sooner."""
    if retention_days is None:
        return MAX_AGE
    return min(MAX_AGE, timedelta(days=retention_days))


def check_at(at: datetime, now: datetime, retention_days: int | None) -> None:
    if at > now:
        raise InvalidRequest("at must not be in the future", param="at")
    back = reach(retention_days)
    if at < now - back:
        raise InvalidRequest(f"at must be at most {back.days} days back", param="at")


async def adjust(
    db: Database,
    *,
    amount: int,
    reason: str,
    team_id: str | None = None,
    user_id: str | None = None,
    token_id: str | None = None,
    corrects_event_id: str | None = None,
    at: datetime | None = None,
    retention_days: int | None = None,
) -> Event:
    """A manual adjustment (negative: a credit) to a team, a user, a token or one event, charged
    to the budget window of `at` (default now; an event's own moment when it corrects one).
    Refused, with nothing written, when it would take a counter it changes below zero or past
    COUNTER_CEILING: checked and written in one transaction, its budgets locked first."""
    reason = check_reason(reason)
    for name, value in (
        ("team_id", team_id),
        ("user_id", user_id),
        ("token_id", token_id),
        ("corrects_event_id", corrects_event_id),
    ):
        check_name(value, name)
    now = utcnow()
    if at is not None:
        check_at(at, now, retention_days)
    model = provider = upstream_model = ""
    upstream_id = end_user = None
    tags, endpoint = NO_TAGS, CHAT
    async with db.reads() as session:
        if corrects_event_id is not None:
            row = (await session.execute(select(_t).where(_t.c.id == corrects_event_id))).first()
            if row is None:
                raise NotFound(f"event {corrects_event_id!r} not found", param="corrects_event_id")
            token_id, user_id, team_id = row.token_id, row.user_id, row.team_id
            model, provider, upstream_model = row.model, row.provider, row.upstream_model
            upstream_id, at = row.upstream_id, at or row.created_at
            end_user, tags, endpoint = row.end_user, row.tags, row.endpoint
        elif user_id is not None or token_id is not None:
            if token_id is not None:
                owner = await session.scalar(
                    select(ApiToken.user_id).where(ApiToken.id == token_id)
                )
                if owner is None or (user_id is not None and user_id != owner):
                    raise NotFound(f"token {token_id!r} not found", param="token_id")
                user_id = owner
            team = await session.scalar(select(User.team_id).where(User.id == user_id))
            if team is None or (team_id is not None and team_id != team):
                raise NotFound(f"user {user_id!r} not found", param="user_id")
            team_id = team
        elif team_id is None:
            raise InvalidRequest(
                "name a team_id, user_id, token_id or corrects_event_id", param="team_id"
            )
        elif await session.scalar(select(Team.id).where(Team.id == team_id)) is None:
            raise NotFound(f"team {team_id!r} not found", param="team_id")
    event = adjustment_event(
        token_id=token_id,
        user_id=user_id or "",
        team_id=team_id,
        model=model,
        provider=provider,
        upstream_model=upstream_model,
        prices=(0, 0, 0),
        difference=amount,
        reason=reason,
        at=at or now,
        made_at=now,
        corrects=corrects_event_id,
        source=MANUAL,
        upstream_id=upstream_id,
        end_user=end_user,
        tags=tags,
        endpoint=endpoint,
    )
    async with db.begin() as conn:
        # Budgets first (locked, in the order every writer takes them), then the rollups.
        await charge_dated(
            conn,
            [Dated(_subjects(event), event.created_at, amount, event.team_id, event.user_id)],
            now,
            bounded=True,
        )
        problem = await past_ceiling(conn, event)
        if problem is not None:
            raise InvalidRequest(problem, param="amount")
        await writer.append(conn, event)
    return event
