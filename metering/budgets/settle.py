"""Settle, the general path: a hold turned into its request's ledger event, in one transaction
through SQLAlchemy, alone (`settle_in`) or with the settles that arrived together
(`settle_group`). The hold is deleted (a retried settle finds nothing and does nothing), the
hold moves out of `reserved` and the cost into `spent`, and the event is appended through
metering.ledger.writer. Which settles are written together, and how PostgreSQL writes a group
in one statement, is metering.budgets.settle_queue's.

A settle charges at most the hold: a cost above it moves to the event's `uncharged`. A request
that settles after its hold was swept (charged in full as an `unsettled` event, see
metering.jobs) replaces that event with its real outcome in the same transaction, and the
budgets get back the difference, in the window that was charged. A charge that passes an alert
threshold or a soft limit records the alert in the same transaction (`alert_crossings`).
"""

from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, String, bindparam, delete, func, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from metering.alerts import record
from metering.budgets import end_users, rates
from metering.budgets.reserve import Reservation
from metering.budgets.runs import CHARGE_RUN, run_charge
from metering.budgets.views import CHARGED, add_to_budgets, ids, load, resets_at, roll
from metering.db import Database, dialect_name
from metering.ledger import writer
from metering.ledger.event import UNSETTLED, Event
from metering.models import Budget, BudgetLease, BudgetWindow, Hold

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
    Hold.end_user_budget,
)
# A hold taken (deleted) by whoever ends it: its row comes back, for what it gives back.
TAKE_HOLD = delete(Hold.__table__).where(Hold.id == bindparam("hold_id")).returning(*_HELD)
# A group's holds taken in one statement.
_TAKE_HOLDS = delete(Hold.__table__).where(Hold.id.in_(ids())).returning(Hold.id, *_HELD)
_CHARGE = add_to_budgets(
    spent=Budget.spent + bindparam("cost"), reserved=Budget.reserved - bindparam("amount")
).returning(*CHARGED)


def rate_returns(
    hold: Any, used_tokens: int | None, *, released: bool = False
) -> list[dict[str, Any]]:
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


async def settle_one(db: Database, event: Event, reservation: Reservation | None = None) -> bool:
    """A settle in a transaction of its own."""
    async with db.begin() as session:
        return await settle_in(session, event, reservation)


async def settle_in(
    session: AsyncConnection | AsyncSession, event: Event, reservation: Reservation | None = None
) -> bool:
    """Turn a hold into its ledger event (the event's id is the hold's), in the caller's
    transaction; False when it was already settled (or expired)."""
    hold = (await session.execute(TAKE_HOLD, {"hold_id": event.id})).first()
    if hold is None:
        if event.status == UNSETTLED:
            return False  # the sweeper, after the request settled: nothing to do
        if reservation is not None and reservation.claim is not None:
            reservation.claim.swept = True  # its lease lost the whole hold to the sweeper
        return await _settle_late(session, event)
    event = event.capped(hold.amount)
    now = event.created_at
    subjects = held_subjects(hold)
    if reservation is None or not reservation.window_unchanged(now):
        # A window may have ended while the request ran: close it before charging.
        for budget in (await load(session, subjects, lock=True)).values():
            await roll(session, budget, now)
    if hold.leased:
        charges: dict[str, list[int]] = {}
        leases: dict[str, int] = {}
        _add_charges(charges, leases, hold, event.cost)
        await charge_sums(session, charges, leases, _people({}, hold), now)
    else:
        params = {"ids": subjects, "cost": event.cost, "amount": hold.amount}
        charged = (await session.execute(_CHARGE, params)).all()
        await alert_crossings(
            session, charged, {s: event.cost for s in subjects}, _people({}, hold), now
        )
    if hold.run_id is not None:
        await session.execute(CHARGE_RUN, [run_charge(hold, event.cost)])
    await writer.append(session, event)
    # Last: the counters' rows are locked until the commit that follows.
    await rates.give_back(session, rate_returns(hold, _used_tokens(event)))
    return True


def held_subjects(hold: Any) -> list[str]:
    """The budgets a hold reserved in the rows (or leased): its token's, user's, team's, and
    its end user's when it was held there too."""
    return [s for s in (hold.token_id, hold.user_id, hold.team_id, hold.end_user_budget) if s]


def hold_additions(hold: Any, cost: int) -> Iterator[tuple[str, int, int, str | None]]:
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
    if hold.end_user_budget is not None:
        # Always reserved in its row (never leased): its whole amount leaves `reserved`.
        yield hold.end_user_budget, cost, hold.amount, None


def _add_charges(
    charges: dict[str, list[int]], leases: dict[str, int], hold: Any, cost: int
) -> None:
    """Add one settled hold to per-budget [cost, reserved taken] and per-lease sums."""
    for subject, charged, taken, lease in hold_additions(hold, cost):
        sums = charges.setdefault(subject, [0, 0])
        sums[0] += charged
        sums[1] += taken
        if lease is not None:
            leases[lease] = leases.get(lease, 0) + charged


def _people(people: dict[str, Any], hold: Any) -> dict[str, Any]:
    """subject -> (team_id, user_id) of a hold's budgets, for the alerts they may raise."""
    people[hold.team_id] = (hold.team_id, None)
    people[hold.user_id] = (hold.team_id, hold.user_id)
    if hold.token_id:
        people[hold.token_id] = (hold.team_id, hold.user_id)
    if hold.end_user_budget is not None:
        people[hold.end_user_budget] = (hold.team_id, None)
    return people


def crossings(
    charged: Sequence[Any], costs: dict[str, int], people: dict[str, Any], now: datetime
) -> list[dict[str, Any]]:
    """The thresholds and soft limits the charged budgets just passed (rows returned by the
    charge: `spent` after it; before it, `spent - cost`), as alert events to record."""
    events: list[dict[str, Any]] = []
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


async def alert_crossings(
    conn: AsyncConnection | AsyncSession,
    charged: Sequence[Any],
    costs: dict[str, int],
    people: dict[str, Any],
    now: datetime,
) -> None:
    """Record the crossings of the charged budgets; nothing is written, and no round trip
    made, when none was passed."""
    await record.write(conn, crossings(charged, costs, people, now))


_CHARGE_LEASE = (
    update(BudgetLease.__table__)
    .where(BudgetLease.id == bindparam("lease_id"))
    .values(amount=BudgetLease.amount - bindparam("cost"))
    .execution_options(synchronize_session=False)
)
_B = Budget.__table__.c
# Budgets charged their sums, one row each.
_CHARGE_ONE = (
    update(Budget.__table__)
    .where(Budget.subject_id == bindparam("charged_id"))
    .values(spent=Budget.spent + bindparam("cost"), reserved=Budget.reserved - bindparam("amount"))
    .returning(*CHARGED)
    .execution_options(synchronize_session=False)
)
# PostgreSQL: every budget of a group charged in one statement, the rows locked first in
# subject_id order (see `load`); the sums joined as VALUES.
_LOCKED = (
    select(Budget.subject_id)
    .where(Budget.subject_id.in_(ids()))
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
    .returning(*CHARGED)
    .execution_options(synchronize_session=False)
)


async def charge_sums(
    conn: AsyncConnection | AsyncSession,
    charges: dict[str, list[int]],
    leases: dict[str, int],
    people: dict[str, Any],
    now: datetime,
) -> None:
    """Charge the sums (subject -> [cost to spent, taken from reserved]): budgets in subject_id
    order (locked in the order every writer uses), then their leases. The charged rows come
    back, for the alerts they may raise."""
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


async def settle_group(db: Database, items: list[tuple[Event, Reservation]]) -> list[bool | None]:
    """Settle several requests in one transaction: their holds taken in one statement, their
    events in one INSERT, their rollup rows summed per row, each budget (locked in subject_id
    order) charged once with the sums. Per request: True when settled here, None when its hold
    was not found (settled alone afterwards: the late path)."""
    results: list[bool | None] = []
    taken: list[Event] = []
    totals: dict[str, list[int]] = {}
    leases: dict[str, int] = {}
    returns: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    people: dict[str, Any] = {}
    now = max(event.created_at for event, _ in items)
    async with db.begin() as conn:
        rows = await conn.execute(_TAKE_HOLDS, {"ids": [event.id for event, _ in items]})
        holds = {row.id: row for row in rows}
        for event, _ in items:
            hold = holds.pop(event.id, None)  # a repeated id: the first takes the hold
            if hold is None:
                results.append(None)
                continue
            event = event.capped(hold.amount)
            taken.append(event)
            results.append(True)
            _add_charges(totals, leases, hold, event.cost)
            _people(people, hold)
            returns += rate_returns(hold, _used_tokens(event))
            if hold.run_id is not None:
                runs.append(run_charge(hold, event.cost))
        if taken:
            await charge_sums(conn, totals, leases, people, now)
            if runs:  # after the budgets: the order every writer takes them in
                await conn.execute(CHARGE_RUN, sorted(runs, key=lambda r: (r["r_team"], r["r_id"])))
            await writer.append_many(conn, taken)
            # Last: the counters' rows are locked until the commit that follows.
            await rates.give_back(conn, _summed(returns))
    return results


def _summed(returns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One give-back row per counter and window (several settles of one subject sum)."""
    sums: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in returns:
        key = (row["s_id"], row["s_kind"], row["s_window"])
        if key in sums:
            sums[key]["s_amount"] += row["s_amount"]
        else:
            sums[key] = dict(row)
    return list(sums.values())


_CORRECT = add_to_budgets(spent=Budget.spent + bindparam("delta")).where(
    Budget.window_start <= bindparam("at")
)
_CORRECT_CLOSED = (
    update(BudgetWindow.__table__)
    .where(
        BudgetWindow.subject_id.in_(ids()),
        BudgetWindow.window_start <= bindparam("at"),
        (BudgetWindow.window_end.is_(None)) | (BudgetWindow.window_end > bindparam("at")),
    )
    .values(spent=BudgetWindow.spent + bindparam("delta"))
)


async def _settle_late(session: AsyncConnection | AsyncSession, event: Event) -> bool:
    """The request settled after its hold was swept: the ledger replaces its `unsettled`
    charge, and the budgets get back the difference. False when there is no such placeholder
    (the request was settled already)."""
    replaced = await writer.replace_unsettled(session, event)
    if replaced is None:
        return False
    # The charge was made in the window that held it: the current one, or a closed one. The
    # two conditions are exclusive, so each budget is corrected once.
    subjects = list(replaced.subjects)
    if event.end_user is not None:
        # The sweeper charged its end user's budget too, if the hold was held there; a budget
        # made after the charge is not corrected (its window starts after it).
        subjects.append(end_users.subject_of(replaced.team_id, event.end_user))
    correction = {"ids": subjects, "delta": replaced.delta, "at": replaced.charged_at}
    await session.execute(_CORRECT, correction)
    await session.execute(_CORRECT_CLOSED, correction)
    if replaced.run_id is not None:  # its run was charged the whole hold too
        run = {"r_team": replaced.team_id, "r_id": replaced.run_id, "cost": replaced.delta}
        await session.execute(CHARGE_RUN, [{**run, "amount": 0}])
    return True
