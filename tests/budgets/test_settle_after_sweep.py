"""A request that settles after its hold was swept (charged in full as `unsettled`) replaces
that charge with its real usage in one transaction: exactly one event per request, budgets and
the rollup as if it had settled in time, in the window and hour where it was charged."""

import pytest
from sqlalchemy import select

from metering.budgets.reserve import reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.settle_queue import settle
from metering.db import Database, utcnow
from metering.jobs import close_windows, expire_holds
from metering.ledger import rollup
from metering.ledger.charge import Allowance, Usage
from metering.ledger.outcome import Outcome, event_for
from metering.ledger.tables import LedgerEvent, SpendHourly
from metering.models import Budget, BudgetWindow
from tests.budgets.test_crash_recovery import _add_budgets, _budgets, _count, _spec, _subjects


async def _events(db: Database, *ids: str) -> dict[str, LedgerEvent]:
    async with db.sessions() as session:
        rows = await session.scalars(select(LedgerEvent).where(LedgerEvent.id.in_(ids)))
        return {row.id: row for row in rows}


async def _rollup(db: Database, token_id: str) -> list:
    await rollup.fold(db)  # the increments a grouped settle left pending (PostgreSQL)
    async with db.sessions() as session:
        return list(
            await session.scalars(select(SpendHourly).where(SpendHourly.token_id == token_id))
        )


def _real(spec, reservation, prompt: int, completion: int) -> dict:
    usage = Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
    outcome = Outcome(
        http_status=200, usage=usage, upstream_id="chatcmpl-late", finish_reason="stop"
    )
    return event_for(
        spec.billing,
        outcome,
        started_at=utcnow(),
        latency_ms=9000,
        allowance=Allowance.of(spec.billing, reservation),
        prompt_tokens=lambda: 0,
        text_tokens=len,
    )


@pytest.mark.anyio
async def test_a_late_settle_replaces_the_unsettled_charge(fresh_db):
    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        spec = _spec(subjects)
        swept = await reserve(runtime, spec, ttl_s=0)
        assert await expire_holds(db) == 1
        placeholder = (await _events(db, spec.hold_id))[spec.hold_id]
        assert (placeholder.status, placeholder.cost) == ("unsettled", swept.amount)
        charged_at = placeholder.created_at

        event = _real(spec, swept, 10, 7)
        assert event.cost == 10 * 150_000 + 7 * 600_000 < swept.amount
        assert await settle(runtime.settles, event, swept) is True

        row = (await _events(db, spec.hold_id))[spec.hold_id]
        assert (row.status, row.usage_source, row.http_status) == ("ok", "reported", 200)
        assert (row.prompt_tokens, row.completion_tokens) == (10, 7)
        assert (row.cost, row.uncharged, row.usage_anomaly) == (event.cost, 0, None)
        assert (row.upstream_id, row.latency_ms) == ("chatcmpl-late", 9000)
        assert row.created_at == charged_at  # same window, same rollup hour
        assert await _count(db, LedgerEvent, LedgerEvent.token_id == subjects["token"]) == 1
        for budget in (await _budgets(db, subjects)).values():
            assert (budget.spent, budget.reserved) == (event.cost, 0)
        (hour,) = await _rollup(db, subjects["token"])
        assert (hour.requests, hour.cost, hour.prompt_tokens, hour.completion_tokens) == (
            1,
            event.cost,
            10,
            7,
        )

        # Settled now: a retry (or the sweeper) changes nothing.
        assert await settle(runtime.settles, _real(spec, swept, 99, 99), swept) is False
        assert await expire_holds(db) == 0
        assert (await _events(db, spec.hold_id))[spec.hold_id].cost == event.cost
        for budget in (await _budgets(db, subjects)).values():
            assert budget.spent == event.cost
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_late_settle_is_capped_at_the_hold_and_reports_the_rest(fresh_db):
    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        spec = _spec(subjects, max_tokens=50)
        swept = await reserve(runtime, spec, ttl_s=0)
        assert await expire_holds(db) == 1
        event = _real(spec, swept, 10, 5000)  # 5000 completion tokens for max_tokens 50
        reported = 10 * 150_000 + 5000 * 600_000
        assert (event.cost, event.uncharged) == (swept.amount, reported - swept.amount)
        assert event.usage_anomaly == "completion_above_max_tokens"
        assert await settle(runtime.settles, event, swept) is True
        row = (await _events(db, spec.hold_id))[spec.hold_id]
        assert (row.cost, row.uncharged) == (swept.amount, reported - swept.amount)
        assert row.completion_tokens == 5000
        for budget in (await _budgets(db, subjects)).values():
            assert budget.spent == swept.amount
        (hour,) = await _rollup(db, subjects["token"])
        assert (hour.requests, hour.cost, hour.uncharged) == (
            1,
            swept.amount,
            reported - swept.amount,
        )
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_late_settle_corrects_the_closed_window_it_was_charged_in(fresh_db, task_clock):
    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        # 1 s windows: the sweep charges the first, the late settle comes in a later one.
        created = utcnow()
        await _add_budgets(db, subjects, "1", "1s", created)
        spec = _spec(subjects)
        swept = await reserve(runtime, spec, ttl_s=0)
        assert await expire_holds(db) == 1
        charged_at = (await _events(db, spec.hold_id))[spec.hold_id].created_at
        task_clock.advance(2.2)
        assert await close_windows(db) == 3  # the charge is now in closed windows
        event = _real(spec, swept, 10, 7)
        assert await settle(runtime.settles, event, swept) is True
        async with db.sessions() as session:
            windows = list(
                await session.scalars(
                    select(BudgetWindow).where(BudgetWindow.subject_id.in_(list(subjects.values())))
                )
            )
            budgets = list(
                await session.scalars(
                    select(Budget).where(Budget.subject_id.in_(list(subjects.values())))
                )
            )
        # The window that held the charge now holds the real cost; the current one nothing.
        holding = [w for w in windows if w.window_start <= charged_at < w.window_end]
        assert len(holding) == 3
        assert {w.spent for w in holding} == {event.cost}
        assert len(windows) == 3
        assert {b.spent for b in budgets} == {0}
        assert all(b.window_start > charged_at for b in budgets)
    finally:
        await db.dispose()


def test_limits_of_a_reservation_cover_every_choice():
    from metering.budgets.reserve import Reservation

    spec = _spec(_subjects())
    limits = Allowance.of(spec.billing, Reservation(spec.hold_id, 123, 40, False), choices=3)
    assert limits == Allowance(prompt_tokens=100, completion_tokens=120, hold=123)
    assert Allowance.of(spec.billing, None) == Allowance(prompt_tokens=100)
