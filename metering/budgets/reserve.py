"""Reserve: a request's worst case held against its budgets before anything is forwarded.

One short transaction. The request's budgets (its token's, its user's, its team's) are locked
in subject_id order, the one order every writer uses, so concurrent transactions queue instead
of deadlocking. Each is moved into its current window if it has rolled, then gets `reserved +=
hold` by a conditional UPDATE that only matches while `spent + reserved + hold <= limit`. The
database decides, so replicas sharing one PostgreSQL cannot together pass a limit. A request
this process's credit leases cover is admitted in memory instead (metering.budgets.leases).
"""

import functools
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, cast

import orjson
from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from metering.alerts import record
from metering.budgets import end_users, rates
from metering.budgets.runs import RESERVE_RUN, RunKey, lock_run, run_is, run_params, run_view
from metering.budgets.views import BudgetView, current_window, ids, lease_slack, load, roll, view
from metering.budgets.windows import parse_interval, window_for
from metering.db import Database, utcnow
from metering.errors import LedgerUnavailable
from metering.ledger.outcome import Attribution
from metering.models import Budget, Hold, Run
from metering.timefmt import rfc3339

RESERVE_ATTEMPTS = 4
log = logging.getLogger("metering.budgets")


@dataclass(frozen=True, slots=True)
class HoldSpec:
    """What reserve() needs: the request's billing (whose budgets; kept with the hold, so an
    expired hold can be charged) and what it may cost."""

    billing: Attribution
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

    def __init__(self, leases: tuple[Any, ...], amount: int) -> None:
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
    windows: dict[str, Any] = field(default_factory=dict)
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
def _window_end(interval: str, anchor: datetime, start: datetime) -> datetime | None:
    """When the window that starts at `start` ends (None: never); the same few windows are asked
    about by every settle."""
    return window_for(parse_interval(interval), anchor, start)[1]


class Exhausted:
    """The budget.exhausted events this process has recorded (the database keeps each once
    anyway): a budget refusing request after request costs one write per window, not one per
    refusal. Forgotten all at once past `size` keys."""

    __slots__ = ("keys", "size")

    def __init__(self, size: int = 10_000) -> None:
        self.keys: set[str] = set()
        self.size = size

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def add(self, key: str) -> None:
        if len(self.keys) >= self.size:
            self.keys.clear()
        self.keys.add(key)


class Admits(Protocol):
    """What reserve() asks of this process's credit leases (metering.budgets.leases.LeaseBook)."""

    async def admit(self, spec: HoldSpec) -> Reservation | None: ...


class Budgets(Protocol):
    """What reserve() takes of this process's budget state (metering.budgets.runtime.
    BudgetRuntime): the database and the exhausted budgets recorded."""

    @property
    def db(self) -> Database: ...

    @property
    def exhausted(self) -> Exhausted: ...


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


def request_view(spec: HoldSpec, now: datetime) -> BudgetView | None:
    """x-metering-max-cost as a budget of the request's own (scope `request`)."""
    if spec.max_cost is None:
        return None
    return BudgetView("request", spec.hold_id, spec.max_cost, "never", now, None, 0, 0)


def shortfall(spec: HoldSpec, budget: BudgetView) -> BudgetShortfall:
    """The refusal of `spec` by `budget`, with its figures: worked out only when refused."""
    needed = spec.amount(spec.max_tokens if spec.max_tokens is not None else 1)
    fits = None
    if spec.max_tokens is not None and spec.token_cost and budget.remaining is not None:
        largest = (budget.remaining - spec.prompt_cost) // spec.token_cost
        if 1 <= largest < spec.max_tokens:
            fits = largest
    return BudgetShortfall(Shortfall(budget, needed, spec.max_tokens, fits))


def _left(budget: BudgetView) -> int:
    """What a limited budget has left (its `remaining` is None only without a limit)."""
    assert budget.remaining is not None
    return budget.remaining


def _plan(spec: HoldSpec, views: list[BudgetView]) -> tuple[int, bool]:
    """The output allowance to hold for, and whether it was lowered to fit the credit left
    (`views`: the budgets', and the request's own and its run's when it has them)."""
    limited = [v for v in views if v.credit_limit is not None]
    wanted = spec.max_tokens if spec.max_tokens is not None else spec.model_max_output
    tightest = min(limited, key=_left, default=None)
    if tightest is None or spec.amount(wanted) <= _left(tightest):
        return wanted, False
    if spec.max_tokens is not None:
        raise shortfall(spec, tightest)
    left = _left(tightest) - spec.amount(0)
    affordable = left // spec.token_cost if spec.token_cost else wanted
    if affordable < 1:
        raise shortfall(spec, tightest)
    return min(affordable, wanted), True


def hold_row(
    spec: HoldSpec,
    amount: int,
    now: datetime,
    ttl_s: int,
    leases: dict[str, Any] | None = None,
    end_user_budget: str | None = None,
) -> dict[str, Any]:
    """The hold's row; `leases` (scope -> lease id, limited budgets only) when it was admitted
    against leases; `end_user_budget` when it is reserved in its end user's budget too."""
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
        "end_user": billing.end_user,
        "tags": billing.tags,
        "endpoint": billing.endpoint,
        "end_user_budget": end_user_budget,
    }


def hold_json(rows: list[dict[str, Any]]) -> str:
    """Hold rows (hold_row) as the one JSON parameter of settle_pg's hold INSERT."""
    return orjson.dumps(rows).decode()


# Conditional write: matches every budget only while each can still cover the hold.
_RESERVE = (
    update(Budget.__table__)
    .where(
        Budget.subject_id.in_(ids()),
        (Budget.credit_limit.is_(None))
        | (Budget.spent + Budget.reserved + bindparam("amount") <= Budget.credit_limit),
    )
    .values(reserved=Budget.reserved + bindparam("amount"))
    .execution_options(synchronize_session=False)
)
_INSERT_HOLD = insert(Hold.__table__)


async def _try_reserve(
    session: AsyncConnection | AsyncSession, spec: HoldSpec, now: datetime, ttl_s: int
) -> Reservation | None:
    subjects = spec.subjects
    end_user = spec.billing.end_user
    held_in = None
    if end_user is not None:
        # Made now on its first use; locked below with the others, in subject_id order.
        held_in = await end_users.held_in(session, spec.billing.team_id, end_user, now)
        if held_in is not None:
            subjects = [*subjects, held_in]
    budgets = await load(session, subjects, lock=True)
    ordered = [budgets[s] for s in subjects if s in budgets]
    views = [view(b, now) for b in ordered]
    run = await lock_run(session, spec.run, now) if spec.run is not None else None
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
    result = cast(
        CursorResult[Any],
        await session.execute(_RESERVE, {"ids": list(starts), "amount": amount}),
    )
    if result.rowcount != len(starts):
        return None
    if run is not None:
        assert spec.run is not None  # its row was locked above
        held = cast(
            CursorResult[Any],
            await session.execute(RESERVE_RUN, run_params(spec.run, amount, now)),
        )
        if held.rowcount != 1:
            return None
    await session.execute(_INSERT_HOLD, hold_row(spec, amount, now, ttl_s, end_user_budget=held_in))
    windows = {b.subject_id: (b.reset_interval, b.anchor_at, starts[b.subject_id]) for b in ordered}
    # A hold of a run, of rate counters or of an end user's budget: the general settle.
    plain = spec.rates is None and spec.run is None and held_in is None
    return Reservation(spec.hold_id, amount, output_tokens, clamped, windows, plain=plain)


async def reserve(
    budgets: Budgets, spec: HoldSpec, ttl_s: int, leases: Admits | None = None
) -> Reservation:
    """Reserve the request's worst case against every budget at once, or raise BudgetShortfall.
    With `leases` (the process's: BudgetRuntime.leases), a request their slices cover is
    admitted in memory (one INSERT of its hold, written in a group); any other takes the
    database path below."""
    try:
        return await _reserve(budgets.db, spec, ttl_s, leases)
    except BudgetShortfall as refused:
        await record_exhausted(budgets.db, budgets.exhausted, spec, refused.shortfall.budget)
        raise


async def record_exhausted(
    db: Database, seen: Exhausted, spec: HoldSpec, budget: BudgetView
) -> None:
    """budget.exhausted: the first refusal of a window, per budget and credit_limit (a limit
    changed inside the window re-arms it). Never fails the refusal."""
    if budget.scope in ("request", "run"):  # x-metering-max-cost and a run: no budget row
        return
    key = f"{budget.subject_id}:{rfc3339(budget.window_start)}:{budget.credit_limit}"
    if key in seen:
        return
    billing = spec.billing
    # A team's budget and its end users' are the team's, not the requesting user's.
    user_id = None if budget.scope in ("team", end_users.SCOPE) else billing.user_id
    figures = record.Figures(
        budget.scope,
        budget.subject_id,
        billing.team_id,
        budget.credit_limit,
        budget.spent,
        budget.reserved,
        budget.resets_at,
    )
    # An end user by its own id too: a first request refused leaves no row that would name it.
    named = {"end_user": billing.end_user} if budget.scope == end_users.SCOPE else {}
    row = record.event_row(record.EXHAUSTED, key, figures.data(**named), utcnow(), user_id=user_id)
    try:
        async with db.begin() as conn:
            await record.write(conn, [row])
    except Exception:  # the refusal stands; a later one records it
        log.warning("could not record budget.exhausted for %s", budget.subject_id, exc_info=True)
        return
    seen.add(key)


async def _reserve(db: Database, spec: HoldSpec, ttl_s: int, leases: Admits | None) -> Reservation:
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
        subjects = spec.subjects
        if spec.billing.end_user is not None:
            subjects = [
                *subjects,
                end_users.subject_of(spec.billing.team_id, spec.billing.end_user),
            ]
        budgets = await load(session, subjects)
        slack = await lease_slack(session, subjects)
        now = utcnow()
        views = [view(budgets[s], now, slack.get(s, 0)) for s in subjects if s in budgets]
        if spec.run is not None:
            run = await session.scalar(select(Run).where(*run_is(spec.run)))
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
    raise shortfall(spec, min(limited, key=_left))
