"""Holds and settles: the only code that writes budget counters.

reserve(): one short transaction. The request's budgets (its token's, its user's, its
team's) are locked in subject_id order, the one order every writer here uses, so concurrent
transactions queue instead of deadlocking. Each is moved into its current window if it has
rolled, then gets `reserved += hold` by a conditional UPDATE that only matches while
`spent + reserved + hold <= limit`. The database decides, so replicas sharing one PostgreSQL
cannot together pass a limit. settle(): one short transaction that deletes the hold (a
retried settle finds nothing and does nothing), moves `hold` from reserved and `cost` to
spent, and appends the request's ledger event through metering.ledger.writer.

settle() charges at most the hold: a cost above it moves to the event's `uncharged`. A
request that settles after its hold was swept (charged in full as an `unsettled` event, see
metering.jobs) replaces that event with its real outcome in the same transaction, and the
budgets get back the difference, in the window that was charged.

A window rolls when the first request after its end touches it (no job needed):
its total is kept in budget_windows, then spent restarts at 0. Outstanding holds
stay reserved across the roll, and a request is charged to the window it settles in.
"""

import asyncio
import functools
import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import asyncpg
import orjson
from sqlalchemy import (
    BigInteger,
    Row,
    String,
    bindparam,
    delete,
    func,
    insert,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from metering.alerts import record
from metering.budgets import rates, settle_pg
from metering.budgets.groups import GroupWriter, answer
from metering.budgets.windows import parse_interval, window_for
from metering.db import AttrRecord, Database, UTCDateTime, dialect_name, utcnow
from metering.errors import InvalidRequest, LedgerUnavailable
from metering.ledger import writer
from metering.ledger.event import UNSETTLED, Event
from metering.ledger.outcome import Billing
from metering.models import Budget, BudgetLease, BudgetWindow, Hold, Run
from metering.money import COUNTER_CEILING, format_usd
from metering.timefmt import rfc3339

if TYPE_CHECKING:
    from metering.budgets.leases import LeaseBook

RESERVE_ATTEMPTS = 4
log = logging.getLogger("metering.budgets")


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
        passed = [p for p in self.thresholds if self.spent * 100 >= self.credit_limit * p]
        return max(passed, default=None)


def current_window(budget: Budget, now: datetime) -> tuple[datetime, datetime | None]:
    return window_for(parse_interval(budget.reset_interval), budget.anchor_at, now)


def view(budget: Budget, now: datetime, slack: int = 0) -> BudgetView:
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


async def lease_slack(session, subject_ids: list[str]) -> dict[str, int]:
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


def _upsert_ignore(session: AsyncSession):
    return pg_insert if dialect_name(session) == "postgresql" else sqlite_insert


async def roll(session: AsyncSession, budget: Budget, now: datetime) -> None:
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
        _upsert_ignore(session)(BudgetWindow)
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
                _literal(old_end),
                Budget.scope,
                Budget.credit_limit,
                Budget.spent,
                _literal(now),
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
            .returning(*_CHARGED)
        )
    ).first()
    if reset is not None and closed_spent is not None:
        await _alert_reset(session, reset, closed_spent, old_start, now)


async def _alert_reset(session, row, closed_spent: int, old_start: datetime, now) -> None:
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


def _literal(value: datetime | None):
    return bindparam(None, value, type_=UTCDateTime)


def _ids():
    return bindparam("ids", expanding=True)


# The hot path's statements are built once, on the tables (not the ORM classes, whose
# statements take the ORM's bulk paths): building a statement costs more than running it.
_LOAD = select(Budget.__table__).where(Budget.subject_id.in_(_ids())).order_by(Budget.subject_id)
_LOAD_LOCKED = _LOAD.with_for_update()


async def load(
    session: AsyncSession, subject_ids: list[str], *, lock: bool = False
) -> dict[str, Row]:
    """Budget rows as plain rows (the columns of Budget, not tracked objects): the UPDATEs
    below are the writes. With `lock`, the rows are locked in subject_id order, the one order
    every writer here uses, so concurrent transactions on the same budgets queue instead of
    deadlocking."""
    rows = await session.execute(_LOAD_LOCKED if lock else _LOAD, {"ids": subject_ids})
    return {row.subject_id: row for row in rows}


def _add_to_budgets(**values):
    """One UPDATE of several budgets that first locks them in key order (see `load`)."""
    locked = (
        select(Budget.subject_id)
        .where(Budget.subject_id.in_(_ids()))
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


_B = Budget.__table__.c
# What a charge returns: enough to tell, with no further round trip, whether it crossed a
# threshold or a soft limit (metering.alerts.record).
_CHARGED = (
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
_CHARGE = _add_to_budgets(
    spent=Budget.spent + bindparam("cost"), reserved=Budget.reserved - bindparam("amount")
).returning(*_CHARGED)
_RELEASE = _add_to_budgets(reserved=Budget.reserved - bindparam("amount"))
# Conditional write: matches every budget only while each can still cover the hold.
_RESERVE = (
    update(Budget.__table__)
    .where(
        Budget.subject_id.in_(_ids()),
        (Budget.credit_limit.is_(None))
        | (Budget.spent + Budget.reserved + bindparam("amount") <= Budget.credit_limit),
    )
    .values(reserved=Budget.reserved + bindparam("amount"))
    .execution_options(synchronize_session=False)
)
_HELD = (
    Hold.amount,
    Hold.token_id,
    Hold.user_id,
    Hold.team_id,
    Hold.leased,
    Hold.token_lease,
    Hold.user_lease,
    Hold.team_lease,
    Hold.rate_kinds,
    Hold.rate_window,
    Hold.rate_tokens,
    Hold.run_id,
)
_TAKE_HOLD = delete(Hold.__table__).where(Hold.id == bindparam("hold_id")).returning(*_HELD)
_INSERT_HOLD = insert(Hold.__table__)


@dataclass(frozen=True, slots=True)
class Shortfall:
    """The budget that could not cover a request, as it stood; what the request needed to
    hold (picodollars: for the client's max_tokens, or, when it set none, for the smallest
    answer, one output token); and, when the client set max_tokens, the largest that would
    fit (None: none would, or it set none)."""

    budget: BudgetView
    needed: int | None = None
    max_tokens: int | None = None
    fits: int | None = None


class BudgetShortfall(Exception):
    def __init__(self, shortfall: Shortfall) -> None:
        super().__init__(shortfall.budget.scope)
        self.shortfall = shortfall


@dataclass(frozen=True, slots=True)
class RunKey:
    """A run named by a request: its team's, its id, the budget its first request gives
    (x-metering-run-budget; later requests' is ignored), and how long it lives unused."""

    team_id: str
    run_id: str
    budget: int | None
    idle_s: int


@dataclass(frozen=True, slots=True)
class HoldSpec:
    """What reserve() needs: the request's billing (whose budgets; kept with the hold, so an
    expired hold can be charged) and what it may cost."""

    billing: Billing
    prompt_cost: int  # picodollars held whatever the output: the prompt at its bound
    token_cost: int  # picodollars per output token allowed, every choice counted
    max_tokens: int | None  # the client's own, or None
    model_max_output: int
    # The rate counters the request took (metering.budgets.rates), written on its hold.
    rates: "rates.RateClaim | None" = None
    # x-metering-max-cost: the most this request may cost (picodollars), or None.
    max_cost: int | None = None
    # x-metering-run: the run whose own budget the request is also held against, or None.
    run: "RunKey | None" = None

    @property
    def hold_id(self) -> str:
        return self.billing.id

    @property
    def subjects(self) -> list[str]:
        return self.billing.subjects

    def amount(self, output_tokens: int) -> int:
        return self.prompt_cost + output_tokens * self.token_cost


class Claim:
    """What a request admitted against leases took from them (metering.budgets.leases): given
    back once, when the request ends. The process's view of a lease never exceeds its row: a
    settle that charged `cost` takes that from both; when the outcome is unknown (a settle that
    failed, or one that found its hold already swept) the whole hold is taken, as the sweeper
    takes it from the row."""

    __slots__ = ("leases", "amount", "ended", "swept")

    def __init__(self, leases: tuple, amount: int) -> None:
        self.leases = leases  # metering.budgets.leases.Lease, one per budget of the request
        self.amount = amount
        self.ended = False
        self.swept = False

    def end(self, *, released: bool = False, cost: int | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        taken = 0 if released else (self.amount if cost is None else cost)
        for lease in self.leases:
            if lease.id is not None:
                lease.inflight -= self.amount
                lease.amount -= taken


@dataclass(frozen=True, slots=True)
class Reservation:
    hold_id: str
    amount: int
    max_tokens: int  # what goes upstream
    clamped: bool
    # subject -> (reset_interval, anchor, window start) as reserved: settle needs no re-read
    # of the budgets unless a window has ended since.
    windows: dict = field(default_factory=dict)
    # Set when the hold was admitted against this process's leases, not reserved in the rows.
    claim: Claim | None = None
    # No rate claim and no run on its hold: its settle may take the one-statement path.
    plain: bool = True

    def window_unchanged(self, now: datetime) -> bool:
        """Every window the request was reserved in is still the current one."""
        if not self.windows:
            return False
        for window in self.windows.values():
            end = _window_end(*window)
            if end is not None and now >= end:
                return False
        return True


@functools.lru_cache(maxsize=4096)
def _window_end(interval: str, anchor: datetime | None, start: datetime) -> datetime | None:
    """When the window that starts at `start` ends (None: never); the same few windows are asked
    about by every settle."""
    return window_for(parse_interval(interval), anchor, start)[1]


def request_view(spec: HoldSpec, now: datetime) -> BudgetView | None:
    """x-metering-max-cost as a budget of the request's own (scope `request`)."""
    if spec.max_cost is None:
        return None
    return BudgetView("request", spec.hold_id, spec.max_cost, "never", now, None, 0, 0)


def run_view(run, now: datetime) -> BudgetView:
    return BudgetView(
        "run", run.id, run.credit_limit, "never", run.created_at, None, run.spent, run.reserved
    )


def shortfall(spec: HoldSpec, budget: BudgetView) -> BudgetShortfall:
    """The refusal of `spec` by `budget`, with its figures: worked out only when refused."""
    needed = spec.amount(spec.max_tokens if spec.max_tokens is not None else 1)
    fits = None
    if spec.max_tokens is not None and spec.token_cost and budget.remaining is not None:
        largest = (budget.remaining - spec.prompt_cost) // spec.token_cost
        if 1 <= largest < spec.max_tokens:
            fits = largest
    return BudgetShortfall(Shortfall(budget, needed, spec.max_tokens, fits))


def _plan(spec: HoldSpec, views: list[BudgetView]) -> tuple[int, bool]:
    """The output allowance to hold for, and whether it was lowered to fit the credit left
    (`views`: the budgets', and the request's own and its run's when it has them)."""
    limited = [v for v in views if v.credit_limit is not None]
    wanted = spec.max_tokens if spec.max_tokens is not None else spec.model_max_output
    tightest = min(limited, key=lambda v: v.remaining, default=None)
    if tightest is None or spec.amount(wanted) <= tightest.remaining:
        return wanted, False
    if spec.max_tokens is not None:
        raise shortfall(spec, tightest)
    left = tightest.remaining - spec.amount(0)
    affordable = left // spec.token_cost if spec.token_cost else wanted
    if affordable < 1:
        raise shortfall(spec, tightest)
    return min(affordable, wanted), True


def hold_row(
    spec: HoldSpec, amount: int, now: datetime, ttl_s: int, leases: dict | None = None
) -> dict:
    """The hold's row; `leases` (scope -> lease id, limited budgets only) when it was admitted
    against leases."""
    billing = spec.billing
    leased = leases is not None
    leases = leases or {}
    return {
        "id": billing.id,
        "token_id": billing.token_id,
        "user_id": billing.user_id,
        "team_id": billing.team_id,
        "amount": amount,
        "model": billing.model,
        "provider": billing.provider,
        "upstream_model": billing.upstream_model,
        "stream": billing.stream,
        "input_price": billing.input_price,
        "cached_price": billing.cached_price,
        "output_price": billing.output_price,
        "created_at": now,
        "expires_at": now + timedelta(seconds=ttl_s),
        "leased": leased,
        "token_lease": leases.get("token"),
        "user_lease": leases.get("user"),
        "team_lease": leases.get("team"),
        "rate_kinds": spec.rates.kinds if spec.rates is not None else None,
        "rate_window": spec.rates.window if spec.rates is not None else None,
        "rate_tokens": spec.rates.tokens if spec.rates is not None else None,
        "run_id": spec.run.run_id if spec.run is not None else None,
    }


def rate_returns(hold, used_tokens: int | None, *, released: bool = False) -> list[dict]:
    """What ending this hold gives back to its rate counters (none without rate limits): a
    release all of it, a settle its parallel slot and the tokens it did not use, the sweeper's
    charge (`used_tokens` None) its parallel slot."""
    if hold.rate_kinds is None:
        return []
    subjects = {"token": hold.token_id, "user": hold.user_id, "team": hold.team_id}
    return rates.returns_of(
        hold.rate_kinds,
        subjects,
        hold.rate_window,
        hold.rate_tokens or 0,
        0 if released else used_tokens,
        requests=released,
    )


def _used_tokens(event: Event) -> int | None:
    """The tokens a settled request counts for tpm; None for the sweeper's whole charge."""
    if event.status == UNSETTLED:
        return None
    return (event.prompt_tokens or 0) + (event.completion_tokens or 0)


async def _try_reserve(session: AsyncSession, spec: HoldSpec, now: datetime, ttl_s: int):
    budgets = await load(session, spec.subjects, lock=True)
    ordered = [budgets[s] for s in spec.subjects if s in budgets]
    views = [view(b, now) for b in ordered]
    run = await _lock_run(session, spec.run, now) if spec.run is not None else None
    extra = [v for v in (request_view(spec, now),) if v is not None]
    if run is not None:
        extra.append(run_view(run, now))
    output_tokens, clamped = _plan(spec, views + extra)
    amount = spec.amount(output_tokens)
    starts = {}
    for budget in ordered:
        await roll(session, budget, now)
        starts[budget.subject_id] = current_window(budget, now)[0]
    # The rows are locked and in their current windows; the write still checks every limit.
    result = await session.execute(_RESERVE, {"ids": list(starts), "amount": amount})
    if result.rowcount != len(starts):
        return None
    if run is not None:
        held = await session.execute(_RESERVE_RUN, _run_params(spec.run, amount, now))
        if held.rowcount != 1:
            return None
    await session.execute(_INSERT_HOLD, hold_row(spec, amount, now, ttl_s))
    windows = {b.subject_id: (b.reset_interval, b.anchor_at, starts[b.subject_id]) for b in ordered}
    plain = spec.rates is None and spec.run is None
    return Reservation(spec.hold_id, amount, output_tokens, clamped, windows, plain=plain)


async def reserve(
    db: Database, spec: HoldSpec, ttl_s: int, leases: "LeaseBook | None" = None
) -> Reservation:
    """Reserve the request's worst case against every budget at once, or raise BudgetShortfall.
    With `leases`, a request their slices cover is admitted in memory (one INSERT of its hold,
    written in a group); any other takes the database path below."""
    try:
        return await _reserve(db, spec, ttl_s, leases)
    except BudgetShortfall as refused:
        await record_exhausted(db, spec, refused.shortfall.budget)
        raise


# Exhausted budgets this process has recorded (the database keeps each once anyway): a budget
# refusing request after request costs one write per window, not one per refusal.
_EXHAUSTED_SEEN: set[str] = set()
_EXHAUSTED_SEEN_MAX = 10_000


async def record_exhausted(db: Database, spec: HoldSpec, budget: BudgetView) -> None:
    """budget.exhausted: the first refusal of a window, per budget and credit_limit (a limit
    changed inside the window re-arms it). Never fails the refusal."""
    if budget.scope in ("request", "run"):  # x-metering-max-cost and a run: no budget row
        return
    key = f"{budget.subject_id}:{rfc3339(budget.window_start)}:{budget.credit_limit}"
    if key in _EXHAUSTED_SEEN:
        return
    billing = spec.billing
    user_id = None if budget.scope == "team" else billing.user_id
    figures = record.Figures(
        budget.scope,
        budget.subject_id,
        billing.team_id,
        budget.credit_limit,
        budget.spent,
        budget.reserved,
        budget.resets_at,
    )
    row = record.event_row(record.EXHAUSTED, key, figures.data(), utcnow(), user_id=user_id)
    try:
        async with db.begin() as conn:
            await record.write(conn, [row])
    except Exception:  # the refusal stands; a later one records it
        log.warning("could not record budget.exhausted for %s", budget.subject_id, exc_info=True)
        return
    if len(_EXHAUSTED_SEEN) >= _EXHAUSTED_SEEN_MAX:
        _EXHAUSTED_SEEN.clear()
    _EXHAUSTED_SEEN.add(key)


async def _reserve(
    db: Database, spec: HoldSpec, ttl_s: int, leases: "LeaseBook | None"
) -> Reservation:
    if leases is not None and spec.run is None:
        # A request of a run is held in the run's row too: always the database path.
        reservation = await leases.admit(spec)
        if reservation is not None:
            return reservation
    for _ in range(RESERVE_ATTEMPTS):
        now = utcnow()
        async with db.begin() as conn:
            reservation = await _try_reserve(conn, spec, now, ttl_s)
            if reservation is None:
                await conn.rollback()
                continue
        return reservation
    # Lost every race to concurrent requests: what is left is genuinely too little.
    async with db.transaction() as session:
        budgets = await load(session, spec.subjects)
        slack = await lease_slack(session, spec.subjects)
        now = utcnow()
        views = [view(budgets[s], now, slack.get(s, 0)) for s in spec.subjects if s in budgets]
        if spec.run is not None:
            run = await session.scalar(select(Run).where(*_run_is(spec.run)))
            if run is not None:
                views.append(run_view(run, now))
        extra = request_view(spec, now)
        if extra is not None:
            views.append(extra)
    limited = [v for v in views if v.credit_limit is not None]
    if not limited:
        # Only unlimited budgets, yet every conditional write missed: the rows moved under us
        # (a window rolled or a budget was deleted) on every try. Not the client's fault.
        raise LedgerUnavailable("could not reserve credit for this request; retry")
    raise shortfall(spec, min(limited, key=lambda v: v.remaining))


async def settle(db: Database, event: Event, reservation: Reservation | None = None) -> bool:
    """Turn a hold into its ledger event (the event's id is the hold's); False when it was
    already settled (or expired). Settles that arrive together are written in one
    transaction (see SettleQueue); this returns once the event is committed."""
    claim = reservation.claim if reservation is not None else None
    if claim is None:
        return await _queue(db).settle(event, reservation)
    settled = None
    try:
        settled = await _queue(db).settle(event, reservation)
        return settled
    finally:
        # Charged from its hold: the lease lost exactly the cost; otherwise (not settled here,
        # or its hold swept first) the whole hold.
        claim.end(cost=event.cost if settled and not claim.swept else None)


async def settle_one(db: Database, event: Event, reservation: Reservation | None = None) -> bool:
    """settle() in a transaction of its own."""
    async with db.begin() as session:
        return await settle_in(session, event, reservation)


async def settle_in(
    session: AsyncSession, event: Event, reservation: Reservation | None = None
) -> bool:
    hold = (await session.execute(_TAKE_HOLD, {"hold_id": event.id})).first()
    if hold is None:
        if event.status == UNSETTLED:
            return False  # the sweeper, after the request settled: nothing to do
        if reservation is not None and reservation.claim is not None:
            reservation.claim.swept = True  # its lease lost the whole hold to the sweeper
        return await _settle_late(session, event)
    event.cap(hold.amount)
    now = event.created_at
    subjects = [s for s in (hold.token_id, hold.user_id, hold.team_id) if s]
    if reservation is None or not reservation.window_unchanged(now):
        # A window may have ended while the request ran: close it before charging.
        for budget in (await load(session, subjects, lock=True)).values():
            await roll(session, budget, now)
    if hold.leased:
        charges: dict[str, list[int]] = {}
        leases: dict[str, int] = {}
        _add_charges(charges, leases, hold, event.cost)
        await _charge(session, charges, leases, _people({}, hold), now)
    else:
        charge = {"ids": subjects, "cost": event.cost, "amount": hold.amount}
        charged = (await session.execute(_CHARGE, charge)).all()
        await alert_crossings(
            session, charged, {s: event.cost for s in subjects}, _people({}, hold), now
        )
    if hold.run_id is not None:
        await session.execute(_CHARGE_RUN, [_run_charge(hold, event.cost)])
    await writer.append(session, event)
    # Last: the counters' rows are locked until the commit that follows.
    await rates.give_back(session, rate_returns(hold, _used_tokens(event)))
    return True


def hold_additions(hold, cost: int):
    """What settling one hold adds to each of its budgets: (subject, cost to spent, amount taken
    from reserved, lease id or None). A hold reserved in the rows gives its whole amount back to
    `reserved`; one admitted against leases turns `cost` of each lease into spent (the rest stays
    in the lease, for later requests), and a budget without a limit had nothing reserved."""
    scopes = (
        (hold.token_id, hold.token_lease),
        (hold.user_id, hold.user_lease),
        (hold.team_id, hold.team_lease),
    )
    for subject, lease in scopes:
        if not subject:
            continue
        if not hold.leased:
            yield subject, cost, hold.amount, None
        elif lease is not None:
            yield subject, cost, cost, lease
        else:
            yield subject, cost, 0, None


def _add_charges(charges: dict[str, list[int]], leases: dict[str, int], hold, cost: int) -> None:
    """Add one settled hold to per-budget [cost, reserved taken] and per-lease sums."""
    for subject, charged, taken, lease in hold_additions(hold, cost):
        sums = charges.setdefault(subject, [0, 0])
        sums[0] += charged
        sums[1] += taken
        if lease is not None:
            leases[lease] = leases.get(lease, 0) + charged


_CHARGE_LEASE = (
    update(BudgetLease.__table__)
    .where(BudgetLease.id == bindparam("lease_id"))
    .values(amount=BudgetLease.amount - bindparam("cost"))
    .execution_options(synchronize_session=False)
)


def _people(people: dict, hold) -> dict:
    """subject -> (team_id, user_id) of a hold's budgets, for the alerts they may raise."""
    people[hold.team_id] = (hold.team_id, None)
    people[hold.user_id] = (hold.team_id, hold.user_id)
    if hold.token_id:
        people[hold.token_id] = (hold.team_id, hold.user_id)
    return people


def resets_at(row, at: datetime) -> datetime | None:
    return window_for(parse_interval(row.reset_interval), row.anchor_at, at)[1]


def crossings(charged, costs: dict[str, int], people, now: datetime) -> list[dict]:
    """The thresholds and soft limits the charged budgets just passed (rows returned by the
    charge: `spent` after it; before it, `spent - cost`), as alert events to record."""
    events: list[dict] = []
    for row in charged:
        cost = costs.get(row.subject_id, 0)
        if cost <= 0 or (row.credit_limit is None and row.soft_limit is None):
            continue
        before = row.spent - cost
        thresholds = record.thresholds_of(row.alert_thresholds)
        if not record.passed(before, row.spent, row.credit_limit, thresholds, row.soft_limit):
            continue
        team_id, user_id = people.get(row.subject_id, (None, None))
        figures = record.Figures(
            row.scope,
            row.subject_id,
            team_id,
            row.credit_limit,
            row.spent,
            row.reserved,
            resets_at(row, row.window_start),
        )
        events += record.crossings(
            figures, before, thresholds, row.soft_limit, row.window_start, now, user_id
        )
    return events


async def alert_crossings(conn, charged, costs: dict[str, int], people, now: datetime) -> None:
    """Record the crossings of the charged budgets; nothing is written, and no round trip
    made, when none was passed."""
    await record.write(conn, crossings(charged, costs, people, now))


async def _charge(
    conn, charges: dict[str, list[int]], leases: dict[str, int], people: dict, now: datetime
) -> None:
    """Charge the sums: budgets in subject_id order (locked in the order every writer here
    uses), then their leases. The charged rows come back, for the alerts they may raise."""
    subjects = sorted(charges)
    rows = [{"charged_id": s, "cost": charges[s][0], "amount": charges[s][1]} for s in subjects]
    if dialect_name(conn) == "postgresql":
        sums = {
            "ids": subjects,
            "charged_ids": subjects,
            "costs": [r["cost"] for r in rows],
            "amounts": [r["amount"] for r in rows],
        }
        charged = (await conn.execute(_CHARGE_ALL, sums)).all()
    else:  # SQLite: in process, one writer; a statement per budget costs no round trip
        charged = [(await conn.execute(_CHARGE_ONE, row)).one() for row in rows]
    await alert_crossings(conn, charged, {s: charges[s][0] for s in subjects}, people, now)
    if leases:
        taken = [{"lease_id": lease, "cost": cost} for lease, cost in sorted(leases.items())]
        await conn.execute(_CHARGE_LEASE, taken)


# A group of settles: its holds taken in one statement, its budgets locked in subject_id
# order (the order every writer uses) and charged their sums, one row each.
_TAKE_HOLDS = delete(Hold.__table__).where(Hold.id.in_(_ids())).returning(Hold.id, *_HELD)
_CHARGE_ONE = (
    update(Budget.__table__)
    .where(Budget.subject_id == bindparam("charged_id"))
    .values(spent=Budget.spent + bindparam("cost"), reserved=Budget.reserved - bindparam("amount"))
    .returning(*_CHARGED)
    .execution_options(synchronize_session=False)
)
# PostgreSQL: every budget of a group charged in one statement, the rows locked first in
# subject_id order (see `load`); the sums joined as VALUES.
_LOCKED = (
    select(Budget.subject_id)
    .where(Budget.subject_id.in_(_ids()))
    .order_by(Budget.subject_id)
    .with_for_update()
    .subquery()
)
_SUMS = (
    func.unnest(
        bindparam("charged_ids", type_=ARRAY(String)),
        bindparam("costs", type_=ARRAY(BigInteger)),
        bindparam("amounts", type_=ARRAY(BigInteger)),
    )
    .table_valued("charged_id", "cost", "amount", name="sums")
    .render_derived()
)
_CHARGE_ALL = (
    update(Budget.__table__)
    .where(_B.subject_id == _LOCKED.c.subject_id, _SUMS.c.charged_id == _B.subject_id)
    .values(spent=_B.spent + _SUMS.c.cost, reserved=_B.reserved - _SUMS.c.amount)
    .returning(*_CHARGED)
    .execution_options(synchronize_session=False)
)


async def _settle_group(db: Database, items: list[tuple[Event, Reservation]]) -> list[bool | None]:
    """Settle several requests in one transaction: their events in one INSERT, their rollup
    rows summed per row, each budget charged once with the sums. Per request: True when
    settled here, None when its hold was not found (settled alone afterwards: the late path)."""
    results: list[bool | None] = []
    taken: list[Event] = []
    totals: dict[str, list[int]] = {}
    leases: dict[str, int] = {}
    returns: list[dict] = []
    runs: list[dict] = []
    people: dict = {}
    now = max(event.created_at for event, _ in items)
    async with db.begin() as conn:
        rows = await conn.execute(_TAKE_HOLDS, {"ids": [event.id for event, _ in items]})
        holds = {row.id: row for row in rows}
        for event, _ in items:
            hold = holds.pop(event.id, None)  # a repeated id: the first takes the hold
            if hold is None:
                results.append(None)
                continue
            event.cap(hold.amount)
            taken.append(event)
            results.append(True)
            _add_charges(totals, leases, hold, event.cost)
            _people(people, hold)
            returns += rate_returns(hold, _used_tokens(event))
            if hold.run_id is not None:
                runs.append(_run_charge(hold, event.cost))
        if taken:
            await _charge(conn, totals, leases, people, now)
            if runs:  # after the budgets: the order every writer takes them in
                await conn.execute(
                    _CHARGE_RUN, sorted(runs, key=lambda r: (r["r_team"], r["r_id"]))
                )
            await writer.append_many(conn, taken)
            # Last: the counters' rows are locked until the commit that follows.
            await rates.give_back(conn, _summed(returns))
    return results


class _Crossed(Exception):
    """The one-statement settle passed a threshold and was aborted: the general path charges
    it and records the alert in one transaction."""


def expected_hold(event: Event, reservation: Reservation) -> settle_pg.Expected:
    claim = reservation.claim
    leases = {}
    if claim is not None:
        leases = {lease.scope: lease.id for lease in claim.leases if lease.id is not None}
    return settle_pg.Expected(
        event.id,
        event.token_id,
        event.user_id,
        event.team_id,
        reservation.amount,
        claim is not None,
        leases.get("token"),
        leases.get("user"),
        leases.get("team"),
    )


def hold_json(rows: list[dict]) -> str:
    """Hold rows (hold_row) as the one JSON parameter of settle_pg's hold INSERT."""
    return orjson.dumps(rows).decode()


async def _settle_group_pg(
    db: Database, items: list[tuple[Event, Reservation]], new_holds: list[dict] | None = None
) -> list:
    """_settle_group in one statement (metering.budgets.settle_pg) through asyncpg itself, for
    settles whose holds carry no rate claim and no run: True for each settle it committed,
    None for each it left to be settled alone (hold swept, or not as its reservation wrote it).
    Raises _Crossed, with nothing written, when a budget would pass a threshold. `new_holds`:
    hold rows the same statement inserts (all of them, or none if it fails)."""
    holds, adds = [], []
    for event, reservation in items:
        hold = expected_hold(event, reservation)
        event.cap(hold.amount)
        holds.append(hold)
        adds += [(hold.id, *added) for added in hold_additions(hold, event.cost)]
    events = [event for event, _ in items]
    params = settle_pg.parameters(events, holds, adds)
    statement = settle_pg.STATEMENT
    if new_holds:
        statement = settle_pg.with_holds(tuple(new_holds[0]))
        params["new_holds"] = hold_json(new_holds)
    try:
        async with db.raw() as conn:
            row = await conn.fetchrow(
                statement.sql, *statement.args(params), record_class=AttrRecord
            )
    except asyncpg.PostgresError as exc:
        if exc.sqlstate == settle_pg.ABORTED:
            raise _Crossed() from None
        raise
    ok = set(row.ok or ())
    if missed := [event.id for event in events if event.id not in ok]:
        await _not_taken(db, missed)
    return [True if event.id in ok else None for event in events]


async def _not_taken(db: Database, ids: list[str]) -> None:
    """Holds the one-statement settle did not take: swept while their requests ran (not found
    now), or found but not as their reservations wrote them, which is a bug, logged. Only a
    diagnostic, after the group's statement committed: it never fails the group."""
    try:
        async with db.raw() as conn:
            found = await conn.fetchval(settle_pg.FOUND, ids)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        log.warning("could not look for holds the settle did not take: %s", exc)
        return
    if found:
        log.error(
            "settled holds were not the ones written (%s); settling them by the general path",
            ", ".join(sorted(found)),
        )


def _summed(returns: list[dict]) -> list[dict]:
    """One give-back row per counter and window (several settles of one subject sum)."""
    sums: dict[tuple, dict] = {}
    for row in returns:
        key = (row["s_id"], row["s_kind"], row["s_window"])
        if key in sums:
            sums[key]["s_amount"] += row["s_amount"]
        else:
            sums[key] = dict(row)
    return list(sums.values())


_HOLD = object()  # marks a hold in the settle queue (PostgreSQL)

HoldBatch = list[tuple[dict, asyncio.Future]]


class SettleQueue:
    """A process's settles, written in groups (metering.budgets.groups): each caller returns
    when its own event is committed. A group that fails (say one bad row) is retried one
    settle at a time, so one request's failure never costs the others their events.

    On PostgreSQL the holds of leased requests join the same queue (`hold`): one statement per
    group inserts the holds and settles the settles that waited together, so a busy process
    sends one statement per group where it sent one per kind. A group with holds and no
    settles is the holds' own INSERT; a combined statement that fails (a hold refused, a
    threshold passed) keeps nothing, and its holds and settles are written apart, as they are
    when some settle of the group must take the general path."""

    def __init__(self, db: Database, loop: asyncio.AbstractEventLoop) -> None:
        self.db = db
        self.loop = loop
        self.groups = GroupWriter(
            self._write, lambda: LedgerUnavailable("settle interrupted; retry")
        )
        self.one_statement = 0  # settles committed by the one-statement path (PostgreSQL)
        self.grouped = 0  # settles committed in groups of two or more
        self.retried = 0  # groups that failed and were retried one settle at a time
        self.carried = 0  # holds inserted by a settle group's statement (PostgreSQL)
        self.split = 0  # statements of settles and holds that failed and were written apart

    async def settle(self, event: Event, reservation: Reservation | None) -> bool:
        if (
            reservation is None
            or event.status == UNSETTLED
            or not reservation.window_unchanged(event.created_at)
        ):
            # A window to roll first, or no reservation to vouch for the windows: alone.
            return await settle_one(self.db, event, reservation)
        return await self.groups.submit((event, reservation))

    async def hold(self, row: dict, apart: Callable[[HoldBatch], Awaitable[None]]) -> None:
        """Insert a hold (PostgreSQL) with the next group; `apart(batch)` writes holds on their
        own (a group of holds alone, or after a combined statement failed) and answers them."""
        await self.groups.submit((_HOLD, row, apart))

    async def _write(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        holds: HoldBatch = []
        settles = []
        apart = None
        for item, future in batch:
            if item[0] is _HOLD:
                holds.append((item[1], future))
                apart = item[2]  # every hold writer of this database writes holds alike
            else:
                settles.append((item, future))
        if not holds:
            await self._settles(settles)
        elif not settles:
            await apart(holds)
        elif not all(r.plain for (_, r), _ in settles):
            await asyncio.gather(self._settles(settles), apart(holds))
        else:
            await self._combined(settles, holds, apart)

    async def _combined(self, settles, holds: HoldBatch, apart) -> None:
        """The settles and the holds in one statement; if it fails, nothing of it is kept,
        and both are written apart (the settles by the general path if they passed a
        threshold)."""
        items = [item for item, _ in settles]
        try:
            results = await _settle_group_pg(self.db, items, [row for row, _ in holds])
        except _Crossed:
            self.split += 1
            await asyncio.gather(self._answer_general(settles), apart(holds))
            return
        except Exception:
            self.split += 1
            await asyncio.gather(self._settles(settles), apart(holds))
            return
        for _, future in holds:
            answer(future)
        self.carried += len(holds)
        self._count(results, len(settles))
        await self._answer(settles, results)

    async def _answer_general(self, batch) -> None:
        await self._answer(batch, await self._general([item for item, _ in batch]))

    def _count(self, results: list, size: int) -> None:
        settled = sum(1 for result in results if result)
        self.one_statement += settled
        if size > 1:
            self.grouped += settled

    async def _settles(self, batch) -> None:
        items = [item for item, _ in batch]
        if self.db.dialect == "postgresql" and all(r.plain for _, r in items):
            try:
                results = await _settle_group_pg(self.db, items)
            except _Crossed:
                results = await self._general(items)
            except Exception:
                self.retried += 1
                results = [None] * len(batch)  # one at a time below: the good ones commit
            else:
                self._count(results, len(batch))
        else:
            results = await self._general(items)
        await self._answer(batch, results)

    async def _general(self, items: list[tuple[Event, Reservation]]) -> list[bool | None]:
        results: list[bool | None] = [None] * len(items)
        if len(items) > 1:
            try:
                results = await _settle_group(self.db, items)
            except Exception:
                self.retried += 1
                results = [None] * len(items)  # one at a time below: the good ones commit
            else:
                self.grouped += sum(1 for result in results if result)
        return results

    async def _answer(self, batch, results: list[bool | None]) -> None:
        """Answer the settles written; those not (a group that failed, a hold not found)
        are written one at a time."""
        alone = []
        for (item, future), result in zip(batch, results, strict=True):
            if result is None:
                alone.append((item, future))
            else:
                answer(future, result)
        if not alone:
            return
        # Side by side, each in its own transaction: a database that stopped answering costs
        # one timeout, not one per settle.
        ends = await asyncio.gather(
            *(settle_one(self.db, event, reservation) for (event, reservation), _ in alone),
            return_exceptions=True,
        )
        for (_, future), end in zip(alone, ends, strict=True):
            if isinstance(end, BaseException):
                answer(future, error=end)
            else:
                answer(future, end)


_QUEUES: "weakref.WeakKeyDictionary[Database, SettleQueue]" = weakref.WeakKeyDictionary()


def _queue(db: Database) -> SettleQueue:
    loop = asyncio.get_running_loop()
    queue = _QUEUES.get(db)
    if queue is None or queue.loop is not loop:
        queue = _QUEUES[db] = SettleQueue(db, loop)
    return queue


def settle_queue(db: Database) -> SettleQueue:
    """The process's settle queue for this database (for its counters)."""
    return _queue(db)


_CORRECT = _add_to_budgets(spent=Budget.spent + bindparam("delta")).where(
    Budget.window_start <= bindparam("at")
)
_CORRECT_CLOSED = (
    update(BudgetWindow.__table__)
    .where(
        BudgetWindow.subject_id.in_(_ids()),
        BudgetWindow.window_start <= bindparam("at"),
        (BudgetWindow.window_end.is_(None)) | (BudgetWindow.window_end > bindparam("at")),
    )
    .values(spent=BudgetWindow.spent + bindparam("delta"))
)


async def _settle_late(session: AsyncSession, event: Event) -> bool:
    """The request settled after its hold was swept: the ledger replaces its `unsettled`
    charge, and the budgets get back the difference. False when there is no such placeholder
    (the request was settled already)."""
    replaced = await writer.replace_unsettled(session, event)
    if replaced is None:
        return False
    # The charge was made in the window that held it: the current one, or a closed one. The
    # two conditions are exclusive, so each budget is corrected once.
    correction = {"ids": replaced.subjects, "delta": replaced.delta, "at": replaced.charged_at}
    await session.execute(_CORRECT, correction)
    await session.execute(_CORRECT_CLOSED, correction)
    if replaced.run_id is not None:  # its run was charged the whole hold too
        run = {"r_team": replaced.team_id, "r_id": replaced.run_id, "cost": replaced.delta}
        await session.execute(_CHARGE_RUN, [{**run, "amount": 0}])
    return True


async def extend(db: Database, hold_ids: list[str], ttl_s: int) -> None:
    """Push live requests' hold expiry out in one statement: only holds whose request died
    are swept."""
    async with db.begin() as conn:
        await conn.execute(
            update(Hold.__table__)
            .where(Hold.id.in_(hold_ids))
            .values(expires_at=utcnow() + timedelta(seconds=ttl_s))
        )


async def release(db: Database, hold_id: str, reservation: Reservation | None = None) -> None:
    """Give a hold back untouched: the request never reached an upstream."""
    claim = reservation.claim if reservation is not None else None
    released = False
    try:
        async with db.begin() as session:
            hold = (await session.execute(_TAKE_HOLD, {"hold_id": hold_id})).first()
            if hold is not None and not hold.leased:
                subjects = [s for s in (hold.token_id, hold.user_id, hold.team_id) if s]
                await session.execute(_RELEASE, {"ids": subjects, "amount": hold.amount})
            if hold is not None and hold.run_id is not None:
                await session.execute(_CHARGE_RUN, [_run_charge(hold, 0)])
            if hold is not None:
                await rates.give_back(session, rate_returns(hold, None, released=True))
        released = hold is not None
    finally:
        if claim is not None:
            # A hold not found was swept (charged whole): its lease lost the whole hold.
            claim.end(released=released)


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


class OutOfBounds(InvalidRequest):
    """A charge that would take a budget's spent below zero or past COUNTER_CEILING."""


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
    if window.added > 0 and window.spent + window.reserved > COUNTER_CEILING:
        raise OutOfBounds(
            f"this amount would take {where} from {format_usd(before)} to "
            f"{format_usd(window.spent)} USD (reserved {format_usd(window.reserved)}): past the "
            f"{format_usd(COUNTER_CEILING)} USD a counter keeps",
            param="amount",
        )


def _closed_upsert(session: AsyncSession):
    statement = _upsert_ignore(session)(BudgetWindow.__table__)
    return statement.on_conflict_do_update(
        index_elements=["subject_id", "window_start"],
        set_={"spent": BudgetWindow.__table__.c.spent + statement.excluded.spent},
    )


async def _closed_totals(session: AsyncSession, keys: list[tuple[str, datetime]]) -> dict:
    """(subject, window start) -> (spent, credit_limit) of the closed windows kept."""
    table = BudgetWindow.__table__
    rows = await session.execute(
        select(table.c.subject_id, table.c.window_start, table.c.spent, table.c.credit_limit).where(
            tuple_(table.c.subject_id, table.c.window_start).in_(keys)
        )
    )
    return {(r.subject_id, r.window_start): (r.spent, r.credit_limit) for r in rows}


async def charge_dated(
    session: AsyncSession, charges: list[Dated], now: datetime, *, bounded: bool = False
) -> list[Charged]:
    """Charge each amount to the window of each budget it falls in, in the caller's
    transaction: the current window's `spent`, or a closed window's kept total (corrected,
    never reopened for admission; a window that closed without a recorded total gets one). An
    amount from before a budget existed is charged to the calendar window of its moment (hourly,
    daily, weekly, monthly), or to the budget's first window (fixed windows, never). The budgets
    are locked in subject_id order (the order every writer here uses) and rolled first, so
    what they hold cannot move before the charge: with `bounded`, a charge that would take one
    below zero or past COUNTER_CEILING raises OutOfBounds, with nothing written. Returns the
    windows charged, as left."""
    subjects = sorted({s for charge in charges for s in charge.subjects})
    if not subjects:
        return []
    budgets = await load(session, subjects, lock=True)
    for budget in budgets.values():
        await roll(session, budget, now)
    current: dict[str, int] = {}
    closed: dict[tuple[str, datetime], dict] = {}
    people: dict = {}
    for charge in charges:
        for subject in charge.subjects:
            budget = budgets.get(subject)
            if budget is None:
                continue
            owner = None if subject == charge.team_id else charge.user_id
            people.setdefault(subject, (charge.team_id, owner))
            # Before the budget existed: its calendar window of then, or its first window.
            start, end = current_window(budget, charge.at)
            if start >= current_window(budget, now)[0]:
                current[subject] = current.get(subject, 0) + charge.amount
                continue
            row = closed.setdefault(
                (subject, start),
                {
                    "subject_id": subject,
                    "window_start": start,
                    "window_end": end,
                    "scope": budget.scope,
                    "credit_limit": budget.credit_limit,
                    "spent": 0,
                    "recorded_at": now,
                },
            )
            row["spent"] += charge.amount
    charged = _current_charged(budgets, current, people, now)
    if closed:
        kept = await _closed_totals(session, sorted(closed))
        for key in sorted(closed):
            row = closed[key]
            spent, limit = kept.get(key, (0, row["credit_limit"]))
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
        await _charge(session, {s: [cost, 0] for s, cost in current.items()}, {}, people, now)
    if closed:
        await session.execute(_closed_upsert(session), [closed[key] for key in sorted(closed)])
    return charged


def _current_charged(budgets: dict, current: dict[str, int], people: dict, now) -> list[Charged]:
    """The current windows `current` charges, from the locked rows (rolled: a window that has
    ended restarted at 0)."""
    out = []
    for subject in sorted(current):
        budget = budgets[subject]
        start, end = current_window(budget, now)
        before = 0 if budget.window_start < start else budget.spent
        out.append(
            Charged(
                budget.scope,
                subject,
                max(start, budget.window_start),
                end,
                budget.credit_limit,
                before + current[subject],
                budget.reserved,
                current[subject],
                *people[subject],
            )
        )
    return out


async def alert_over_limit(session: AsyncSession, charged: list[Charged], now: datetime) -> None:
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


# Runs (x-metering-run): a budget of the run's own, the fourth scope a request is held against.
# Its row is locked after the request's budgets (the order every writer here takes them in).
_runs = Run.__table__


def _run_is(key: RunKey) -> tuple:
    return (_runs.c.team_id == key.team_id, _runs.c.id == key.run_id)


def _run_params(key: RunKey, amount: int, now: datetime) -> dict:
    return {"r_team": key.team_id, "r_id": key.run_id, "amount": amount, "now": now}


_RESERVE_RUN = (
    update(_runs)
    .where(
        _runs.c.team_id == bindparam("r_team"),
        _runs.c.id == bindparam("r_id"),
        _runs.c.spent + _runs.c.reserved + bindparam("amount") <= _runs.c.credit_limit,
    )
    .values(reserved=_runs.c.reserved + bindparam("amount"), last_used_at=bindparam("now"))
)
_CHARGE_RUN = (
    update(_runs)
    .where(_runs.c.team_id == bindparam("r_team"), _runs.c.id == bindparam("r_id"))
    .values(
        spent=_runs.c.spent + bindparam("cost"), reserved=_runs.c.reserved - bindparam("amount")
    )
)


def _run_charge(hold, cost: int) -> dict:
    return {"r_team": hold.team_id, "r_id": hold.run_id, "cost": cost, "amount": hold.amount}


class UnknownRun(Exception):
    """A run named without x-metering-run-budget that has no row (never started, or expired)."""


async def _lock_run(session: AsyncSession, key: RunKey, now: datetime):
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
        await session.execute(_upsert_ignore(session)(_runs).values(fresh).on_conflict_do_nothing())
    run = (await session.execute(select(_runs).where(*_run_is(key)).with_for_update())).first()
    if run is None:
        raise UnknownRun(key.run_id)
    idle = now - run.last_used_at > timedelta(seconds=key.idle_s)
    if idle and run.reserved == 0 and run.created_at != now:
        if key.budget is None:
            raise UnknownRun(key.run_id)
        # Expired: the id starts a new run.
        await session.execute(
            update(_runs)
            .where(*_run_is(key))
            .values(credit_limit=key.budget, spent=0, created_at=now, last_used_at=now)
        )
        run = (await session.execute(select(_runs).where(*_run_is(key)))).first()
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
