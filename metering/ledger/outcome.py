"""How an event is made: from the outcome of an attempt, or from a hold that expired."""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from metering.db import utcnow
from metering.ledger.charge import Allowance, Usage, charge_for
from metering.ledger.event import CHAT, UNSETTLED, Event, bounded


@dataclass(frozen=True, slots=True)
class Attribution:
    """Who a request is charged to, for which model and provider, at which prices: what its
    event records before it ends. Kept with its hold, so a hold that expires can be charged
    too."""

    id: str  # the hold's and the event's
    token_id: str | None
    user_id: str
    team_id: str
    model: str
    provider: str
    upstream_model: str
    stream: bool
    input_price: int  # micro-USD per 1M tokens (picodollars per token), as the catalog lists
    cached_price: int
    output_price: int  # per output token of every choice
    prompt_bound: int  # the most prompt tokens the request can count
    run_id: str | None = None  # the run (x-metering-run) it is also held against
    end_user: str | None = None  # who it was made for, within the team
    tags: str = "{}"  # its tags, as the event keeps them (metering.ledger.attribution)
    endpoint: str = "chat.completions"  # the API the client called: chat.completions | responses

    @property
    def subjects(self) -> list[str]:
        """The budgets it is charged to: its token's (if any), its user's, its team's."""
        return [s for s in (self.token_id, self.user_id, self.team_id) if s]

    @property
    def prices(self) -> tuple[int, int, int]:
        return self.input_price, self.cached_price, self.output_price

    def prompt_cost(self) -> int:
        """The most its prompt can cost: the bound at the dearer of the input prices."""
        return self.prompt_bound * max(self.input_price, self.cached_price)


@dataclass(slots=True)
class Outcome:
    """How an attempt ended, as the forwarder saw it."""

    status: str = "ok"
    http_status: int | None = None
    usage: Usage | None = None
    finish_reason: str | None = None
    upstream_id: str | None = None
    delivered_text: str = ""
    # Estimated tokens of the generated text delivered; when None, delivered_text is
    # estimated instead.
    delivered_tokens: int | None = None
    ttft_ms: int | None = None
    error: str | None = None
    billable: bool = True  # False: the upstream refused the request, nothing to estimate


def event_for(
    attribution: Attribution,
    outcome: Outcome,
    *,
    started_at: datetime,
    latency_ms: int,
    allowance: Allowance,
    prompt_tokens: Callable[[], int],
    text_tokens: Callable[[str], int],
    max_tokens_clamped: int | None = None,
) -> Event:
    """The event of an attempt. `allowance` bounds what the reported usage may charge; when it
    cannot be used, the usage is estimated: `prompt_tokens()` of the request, and the
    delivered text's tokens (`text_tokens(text)` unless the forwarder counted them).
    `max_tokens_clamped`: the allowance max_tokens was lowered to, if it was."""

    def estimate() -> Usage:
        if not outcome.billable:
            return Usage()
        prompt = prompt_tokens()
        if outcome.delivered_tokens is not None:
            completion = outcome.delivered_tokens
        else:
            completion = text_tokens(outcome.delivered_text)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    charge = charge_for(outcome.usage, estimate, allowance, attribution.prices, outcome.billable)
    usage = charge.usage
    return Event(
        id=attribution.id,
        created_at=utcnow(),
        started_at=started_at,
        token_id=attribution.token_id,
        user_id=attribution.user_id,
        team_id=attribution.team_id,
        model=attribution.model,
        provider=attribution.provider,
        upstream_model=attribution.upstream_model,
        upstream_id=bounded("upstream_id", outcome.upstream_id),
        stream=attribution.stream,
        status=outcome.status,
        http_status=outcome.http_status,
        finish_reason=bounded("finish_reason", outcome.finish_reason),
        **usage.columns(),
        usage_source=charge.source,
        usage_anomaly=charge.anomaly,
        max_tokens_clamped=max_tokens_clamped,
        input_price=attribution.input_price,
        cached_price=attribution.cached_price,
        output_price=attribution.output_price,
        cost=charge.cost,
        uncharged=charge.uncharged,
        ttft_ms=outcome.ttft_ms,
        latency_ms=latency_ms,
        error=bounded("error", outcome.error) or None,
        run_id=attribution.run_id,
        end_user=attribution.end_user,
        tags=attribution.tags,
        endpoint=attribution.endpoint,
    )


NO_USAGE = Usage()  # an event that counts no tokens


def unsettled_event(hold: Any, now: datetime) -> Event:
    """A hold (a metering.models.Hold) whose request never settled, its replica gone, is charged
    in full. Should the request settle after all, its real outcome replaces this event."""
    return Event(
        id=hold.id,
        created_at=now,
        started_at=hold.created_at,
        token_id=hold.token_id,
        user_id=hold.user_id,
        team_id=hold.team_id,
        model=hold.model,
        provider=hold.provider,
        upstream_model=hold.upstream_model,
        upstream_id=None,
        stream=hold.stream,
        status=UNSETTLED,
        http_status=None,
        finish_reason=None,
        **NO_USAGE.columns(),
        usage_source=UNSETTLED,
        usage_anomaly=None,
        max_tokens_clamped=None,
        input_price=hold.input_price,
        cached_price=hold.cached_price,
        output_price=hold.output_price,
        cost=hold.amount,
        uncharged=0,
        ttft_ms=None,
        latency_ms=None,
        error="the request never settled: its hold was charged in full",
        run_id=hold.run_id,
        end_user=hold.end_user,
        tags=hold.tags or "{}",
        endpoint=hold.endpoint or CHAT,
    )
