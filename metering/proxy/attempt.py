"""One upstream attempt of a request, and the two ways its hold ends: settle (a ledger event)
or release (nothing reached an upstream)."""

import logging
import time
from dataclasses import dataclass
from datetime import datetime

import anyio

from metering import metrics
from metering.budgets import service as budgets
from metering.budgets.service import HoldSpec, Reservation
from metering.proxy.dialects import Dialect
from metering.proxy.ledger import Outcome, event_for
from metering.proxy.request import ChatRequest
from metering.settings import Provider

log = logging.getLogger("metering.proxy")


@dataclass(slots=True)
class Attempt:
    spec: HoldSpec
    chat: ChatRequest
    provider: Provider
    dialect: Dialect
    upstream_body: bytes
    started_at: datetime
    t0: float
    headers: dict  # response headers we add (x-request-id, x-max-tokens-clamped)

    last_extended: float = 0.0
    reservation: Reservation | None = None

    def elapsed_ms(self) -> int:
        return int((time.perf_counter() - self.t0) * 1000)


async def keep_hold(state, attempt: Attempt) -> None:
    """A request still streaming keeps its hold from being swept as unsettled."""
    ttl = state.settings.hold_ttl_s
    now = time.monotonic()
    if not attempt.last_extended:
        attempt.last_extended = now
    elif now - attempt.last_extended > ttl / 3:
        attempt.last_extended = now
        try:
            await budgets.extend(state.db, attempt.spec.hold_id, ttl)
        except Exception:
            log.warning("could not extend hold %s", attempt.spec.hold_id, exc_info=True)


async def settle(state, attempt: Attempt, outcome: Outcome) -> None:
    """Write the attempt's one ledger event. Shielded: a client going away must not cancel it."""
    event = event_for(
        attempt.spec,
        attempt.chat.body,
        attempt.started_at,
        attempt.elapsed_ms(),
        outcome,
        attempt.reservation,
        attempt.chat.choices,
    )
    with anyio.CancelScope(shield=True):
        try:
            settled = await budgets.settle(
                state.db, attempt.spec.hold_id, event, attempt.reservation
            )
        except Exception:
            # The hold stays; the sweeper charges it as unsettled, so nothing is lost.
            log.exception(
                "settle failed for %s; its hold will be charged on expiry", attempt.spec.hold_id
            )
        else:
            if settled:
                metrics.observe_event(event)


async def release(state, attempt: Attempt) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await budgets.release(state.db, attempt.spec.hold_id)
        except Exception:
            log.exception("release failed for %s", attempt.spec.hold_id)
