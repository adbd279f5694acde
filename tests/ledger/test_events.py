"""How an event is made: a hold kept with the request's real prices, so the event of an expired
hold records the same prices as a settled one, whatever the number of choices held for."""

import uuid
from decimal import Decimal

import pytest
from sqlalchemy import select

from metering.budgets.reserve import HoldSpec, reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.views import new_budget
from metering.db import Database, utcnow
from metering.jobs import expire_holds
from metering.ledger.charge import Allowance, Usage
from metering.ledger.outcome import Attribution, Outcome, event_for
from metering.ledger.tables import LedgerEvent
from metering.models import Hold
from metering.money import usd_to_pico

CHOICES = 3


def _billing() -> Attribution:
    suffix = uuid.uuid4().hex[:12]
    return Attribution(
        id=f"req_{uuid.uuid4().hex}",
        token_id=f"tok_{suffix}",
        user_id=f"user_{suffix}",
        team_id=f"team_{suffix}",
        model="gpt-sim",
        provider="sim-openai",
        upstream_model="sim/gpt",
        stream=True,
        input_price=150_000,
        cached_price=75_000,
        output_price=600_000,
        prompt_bound=100,
    )


def _spec(billing: Attribution) -> HoldSpec:
    return HoldSpec(
        billing,
        prompt_cost=billing.prompt_cost(),
        token_cost=billing.output_price * CHOICES,
        max_tokens=50,
        model_max_output=4096,
    )


@pytest.mark.anyio
async def test_a_hold_for_several_choices_is_priced_per_choice_and_kept_at_the_real_price(fresh_db):
    db = Database(fresh_db, 2)
    try:
        billing = _billing()
        async with db.transaction() as session:
            for scope, subject in zip(("token", "user", "team"), billing.subjects, strict=True):
                session.add(new_budget(subject, scope, usd_to_pico(Decimal(1)), "never", utcnow()))
        held = await reserve(BudgetRuntime(db), _spec(billing), ttl_s=0)
        assert held.amount == 100 * 150_000 + 50 * CHOICES * 600_000
        async with db.sessions() as session:
            hold = await session.scalar(select(Hold).where(Hold.id == billing.id))
        assert (hold.input_price, hold.cached_price, hold.output_price) == billing.prices

        assert await expire_holds(db) == 1
        async with db.sessions() as session:
            event = await session.scalar(select(LedgerEvent).where(LedgerEvent.id == billing.id))
        assert (event.status, event.cost) == ("unsettled", held.amount)
        assert (event.input_price, event.cached_price, event.output_price) == billing.prices
    finally:
        await db.dispose()


def test_a_settled_event_records_the_real_price_and_is_bounded_by_every_choice():
    billing = _billing()
    held = type("Held", (), {"amount": 10**9, "max_tokens": 50})()
    usage = Usage(prompt_tokens=10, completion_tokens=120, total_tokens=130)
    event = event_for(
        billing,
        Outcome(http_status=200, usage=usage),
        started_at=utcnow(),
        latency_ms=7,
        allowance=Allowance.of(billing, held, CHOICES),
        prompt_tokens=lambda: 0,
        text_tokens=len,
    )
    assert event.output_price == 600_000
    assert event.cost == 10 * 150_000 + 120 * 600_000
    assert event.usage_anomaly is None  # 120 completion tokens are within 3 x 50
