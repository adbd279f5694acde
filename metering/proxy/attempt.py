"""One upstream attempt of a request: the hold it reserved, and the one way that hold ends.

An Attempt is an async context manager that ends exactly once. The code that forwards it
records what happened as its `outcome`; when the attempt ends it settles that outcome (one
ledger event: the request reached an upstream) or, when there is none, releases the hold
(nothing went out). A streaming response takes the end over (`hand_over()`) and ends the
attempt itself when its stream is done. Ending is shielded from cancellation and retried while
the database cannot be reached; a hold that still cannot end is left to the sweeper.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from types import TracebackType

import anyio
from opentelemetry.trace import Span, StatusCode
from sqlalchemy import exc as sa_exc

from metering import metrics
from metering.budgets.release import release
from metering.budgets.reserve import HoldSpec, Reservation
from metering.budgets.settle_queue import settle
from metering.db import utcnow
from metering.errors import MeteringError
from metering.ledger.charge import Allowance
from metering.ledger.event import Event
from metering.ledger.outcome import Outcome, event_for
from metering.proxy.dialects import Dialect
from metering.proxy.estimate import estimate_prompt_tokens, estimate_text_tokens
from metering.proxy.request import ChatRequest
from metering.proxy.runtime import ProxyServices
from metering.proxy.tracing import RequestTrace
from metering.settings import Provider

log = logging.getLogger("metering.proxy")
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0


class Attempt:
    __slots__ = (
        "services",
        "spec",
        "reservation",
        "chat",
        "provider",
        "dialect",
        "upstream_body",
        "started_at",
        "t0",
        "headers",
        "outcome",
        "sent",
        "trace",
        "upstream_span",
        "charged",
        "_handed_over",
        "_ended",
    )

    def __init__(
        self,
        services: ProxyServices,
        spec: HoldSpec,
        reservation: Reservation,
        chat: ChatRequest,
        provider: Provider,
        dialect: Dialect,
        t0: float,
        trace: RequestTrace | None = None,
    ) -> None:
        self.services = services
        self.spec = spec
        self.reservation = reservation
        self.chat = chat
        self.provider = provider
        self.dialect = dialect
        self.upstream_body = b""
        self.started_at: datetime = utcnow()
        self.t0 = t0  # perf_counter() when the request arrived
        # Headers every answer of this attempt carries (the response's own are added to them).
        self.headers: dict[str, str] = {}
        if reservation.clamped:
            self.headers["x-max-tokens-clamped"] = str(reservation.max_tokens)
        # What reached an upstream and how it ended; None while nothing did.
        self.outcome: Outcome | None = None
        # Set just before the request is handed to the upstream's client: from then on the
        # upstream may have done (and billed) the work, whatever happens here.
        self.sent = False
        # The request's spans when tracing is on, and the upstream call's once it is made.
        self.trace = trace
        self.upstream_span: Span | None = None
        # The ledger event as it was settled (what its budgets were charged), once it was.
        self.charged: Event | None = None
        self._handed_over = False
        self._ended = False

    async def __aenter__(self) -> "Attempt":
        # Until it ends, this process keeps the hold from expiring (metering.proxy.live).
        self.services.live_holds.add(self.spec.hold_id)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and self.outcome is None and self.sent and not expected(exc):
            # A bug or a shutdown cancelling the request after it went out: the upstream may
            # have answered, so the request is one estimated event, never a silent release.
            self.outcome = Outcome(status=INTERRUPTED, billable=True, error=repr(exc)[:500])
        if not self._handed_over:
            await self.end()

    def hand_over(self) -> None:
        """A streaming response ends the attempt when its stream is done, not the `with`."""
        self._handed_over = True

    def elapsed_ms(self) -> int:
        return int((time.perf_counter() - self.t0) * 1000)

    def deadline(self, max_s: float) -> float:
        """When a request that may run max_s seconds must end, on the event loop's clock (which
        is anyio's on asyncio)."""
        return asyncio.get_running_loop().time() + max_s - (time.perf_counter() - self.t0)

    async def end(self) -> None:
        """Settle the outcome (one ledger event) or release the hold when nothing reached an
        upstream. Only the first call does anything; a client going away cannot cancel it."""
        if self._ended:
            return
        self._ended = True
        if self.trace is not None:
            await self._traced_end(self.trace)
        else:
            await self._end()

    async def _traced_end(self, trace: RequestTrace) -> None:
        """end(), in a span of its own (`settle`, or `release` when nothing went out), the
        upstream call's span ended first (the answer has been read, or the call failed)."""
        span, outcome = self.upstream_span, self.outcome
        if span is not None:
            # No outcome: the request never reached the provider.
            error = "unreached" if outcome is None else outcome.status
            if outcome is not None and outcome.http_status is not None:
                span.set_attribute("http.response.status_code", outcome.http_status)
            if error != "ok":
                span.set_attribute("error.type", error)
                span.set_status(StatusCode.ERROR)
            span.end()
        with trace.step("release" if self.outcome is None else "settle"):
            await self._end()

    async def _end(self) -> None:
        hold_id = self.spec.hold_id
        with anyio.CancelScope(shield=True):
            try:
                if self.outcome is None:
                    await _retrying(
                        self.services,
                        "release",
                        hold_id,
                        lambda: release(self.services.db, hold_id, self.reservation),
                    )
                else:
                    await self._settle(self.outcome)
            finally:
                self.services.live_holds.discard(hold_id)

    async def _settle(self, outcome: Outcome) -> None:
        started = time.perf_counter()
        billing, body = self.spec.billing, self.chat.body
        event = event_for(
            billing,
            outcome,
            started_at=self.started_at,
            latency_ms=self.elapsed_ms(),
            allowance=Allowance.of(billing, self.reservation, self.chat.choices),
            prompt_tokens=lambda: estimate_prompt_tokens(body),
            text_tokens=estimate_text_tokens,
            max_tokens_clamped=self.reservation.max_tokens if self.reservation.clamped else None,
        ).capped(self.reservation.amount)  # as settle charges it: the metrics count that
        settled = await _retrying(
            self.services,
            "settle",
            self.spec.hold_id,
            lambda: settle(self.services.budgets.settles, event, self.reservation),
        )
        if settled:
            self.charged = event
            metrics.settled(time.perf_counter() - started)
            metrics.observe_event(event)
        if self.trace is not None:
            self.trace.settled(event)


INTERRUPTED = "interrupted"


class Chosen(Exception):  # a base for signals, not an error
    """An ending the forwarding code chose and recorded itself (e.g. try the next provider)."""


def expected(exc: BaseException) -> bool:
    """An answer the forwarding code chose (an error for the client, a signal to try the next
    provider): it recorded the outcome itself when the request went out."""
    return isinstance(exc, MeteringError | Chosen)


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


async def _retrying(
    services: ProxyServices, what: str, hold_id: str, write: Callable[[], Awaitable[bool | None]]
) -> bool | None:
    """Run `write` until it commits, retrying while the database cannot be reached (for at
    most settings.settle_retry_s); None when it never could."""
    deadline = time.monotonic() + services.settings.settle_retry_s
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
