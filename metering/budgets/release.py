"""A hold given back untouched (its request never reached an upstream), and the holds of live
requests kept from expiring."""

from datetime import timedelta

from sqlalchemy import bindparam, update

from metering.budgets import rates
from metering.budgets.reserve import Reservation
from metering.budgets.runs import CHARGE_RUN, run_charge
from metering.budgets.settle import TAKE_HOLD, held_subjects, rate_returns
from metering.budgets.views import add_to_budgets
from metering.db import Database, utcnow
from metering.models import Budget, Hold

_RELEASE = add_to_budgets(reserved=Budget.reserved - bindparam("amount"))


async def release(
    db: Database,
    hold_id: str,
    reservation: Reservation | None = None,
    *,
    rates_too: bool = True,
) -> bool:
    """Give a hold back untouched: the request never reached an upstream. False when there was
    no such hold (never written, or settled or swept already). `rates_too`: its rate claim with
    it (False: the claim was given back already)."""
    claim = reservation.claim if reservation is not None else None
    released = False
    try:
        async with db.begin() as session:
            hold = (await session.execute(TAKE_HOLD, {"hold_id": hold_id})).first()
            if hold is not None:
                # A leased hold reserved in the rows only its end user's budget, if it has one.
                held = held_subjects(hold) if not hold.leased else [hold.end_user_budget]
                held = [s for s in held if s is not None]
                if held:
                    await session.execute(_RELEASE, {"ids": held, "amount": hold.amount})
            if hold is not None and hold.run_id is not None:
                await session.execute(CHARGE_RUN, [run_charge(hold, 0)])
            if hold is not None and rates_too:
                await rates.give_back(session, rate_returns(hold, None, released=True))
        released = hold is not None
    finally:
        if claim is not None:
            # A hold not found was swept (charged whole): its lease lost the whole hold.
            claim.end(released=released)
    return released


async def extend(db: Database, hold_ids: list[str], ttl_s: int) -> None:
    """Push live requests' hold expiry out in one statement: only holds whose request died
    are swept."""
    async with db.begin() as conn:
        await conn.execute(
            update(Hold.__table__)
            .where(Hold.id.in_(hold_ids))
            .values(expires_at=utcnow() + timedelta(seconds=ttl_s))
        )
