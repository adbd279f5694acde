"""One upstream attempt of a request, and the two ways its hold ends: settle (a ledger event)
or release (nothing reached an upstream)."""

import logging
import time
from dataclasses import dataclass
from datetime import datetime

import anyio
from sqlalchemy import exc as sa_exc

from metering import metrics
from metering.budgets import service as budgets
from metering.budgets.service import HoldSpec, Reservation
from metering.ledger.charge import Limits
from metering.ledger.outcome import Outcome, event_for
from metering.proxy.dialects import Dialect
from metering.proxy.estimate import estimate_prompt_tokens, estimate_text_tokens
from metering.proxy.request import ChatRequest
from metering.settings import Provider

log = logging.getLogger("metering.proxy")
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0


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

    reservation: Reservation | None = None

    def elapsed_ms(self) -> int:
        return int((time.perf_counter() - self.t0) * 1000)

    def deadline(self, max_s: float) -> float:
        """When a request that may run max_s seconds must end, on anyio's clock."""
        return anyio.current_time() + max_s - (time.perf_counter() - self.t0)


def database_unreachable(exc: BaseException) -> bool:
    """A failure of the connection to the database (restarting, network, pool), not of the
    statement: the same transaction may succeed once it is back."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated or isinstance(exc, sa_exc.InterfaceError):
            return True
        sqlstate = getattr(exc.orig, "sqlstate", None) or ""
        return (
            sqlstate.startswith("08")
            or sqlstate in _UNREACHABLE
            or (isinstance(exc, sa_exc.OperationalError) and not sqlstate)
        )
    return isinstance(exc, sa_exc.TimeoutError | OSError)


# Server shutting down or starting up, too many connections.
_UNREACHABLE = frozenset({"57P01", "57P02", "57P03", "53300"})


async def _retrying(state, what: str, hold_id: str, write) -> bool | None:
    """Run `write` until it commits, retrying while the database cannot be reached (for at
    most settings.settle_retry_s); None when it never could."""
    deadline = time.monotonic() + state.settings.settle_retry_s
    pause = RETRY_FIRST_S
    while True:
        try:
            return await write()
        except Exception as exc:
            if not database_unreachable(exc) or time.monotonic() + pause > deadline:
                # The hold stays; the sweeper charges it as unsettled, so nothing is lost.
                log.exception("%s failed for %s; its hold will be charged on expiry", what, hold_id)
                return None
            log.warning("%s of %s waits for the database: %s", what, hold_id, exc)
        await anyio.sleep(pause)
        pause = min(pause * 2, RETRY_MAX_S)


async def settle(state, attempt: Attempt, outcome: Outcome) -> bool:
    """Write the attempt's one ledger event. Shielded: a client going away must not cancel it.
    False when it could not be written (the hold is left to the sweeper)."""
    billing, body = attempt.spec.billing, attempt.chat.body
    event = event_for(
        billing,
        outcome,
        started_at=attempt.started_at,
        latency_ms=attempt.elapsed_ms(),
        limits=Limits.of(billing, attempt.reservation, attempt.chat.choices),
        prompt_tokens=lambda: estimate_prompt_tokens(body),
        text_tokens=estimate_text_tokens,
    )
    hold_id = attempt.spec.hold_id
    with anyio.CancelScope(shield=True):
        try:
            settled = await _retrying(
                state,
                "settle",
                hold_id,
                lambda: budgets.settle(state.db, event, attempt.reservation),
            )
        finally:
            state.live_holds.discard(hold_id)
        if settled:
            metrics.observe_event(event)
        return settled is not None


async def release(state, attempt: Attempt) -> None:
    hold_id = attempt.spec.hold_id
    with anyio.CancelScope(shield=True):
        try:
            await _retrying(state, "release", hold_id, lambda: budgets.release(state.db, hold_id))
        finally:
            state.live_holds.discard(hold_id)
