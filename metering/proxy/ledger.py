"""What one upstream attempt becomes in the ledger.

Usage is checked before it is charged. The upstream's counts are parsed with bounds and
checked against each other (metering.proxy.usage), then against what the request allowed:
completion_tokens within the max_tokens sent upstream (times n, the choices asked for), and
prompt_tokens within the prompt bound the hold was computed from. Usage that cannot be used
(an invalid or missing count) is replaced by an estimate. Usage that can be used is recorded
as reported (each count at most COUNT_CEILING), with the reason it looks wrong in
`usage_anomaly`; the budgets are charged its cost but never more than the hold, like a card
capture that cannot exceed its authorisation. `cost` is what was charged, `uncharged` the
reported cost above it (at most MAX_UNCHARGED per event).
"""

from dataclasses import dataclass, field
from datetime import datetime

from metering.budgets.service import HoldSpec, Reservation
from metering.db import utcnow
from metering.money import cost_pico
from metering.proxy.estimate import estimate_prompt_tokens, estimate_text_tokens
from metering.proxy.usage import (
    COMPLETION_ABOVE_MAX_TOKENS,
    ESTIMATE_ABOVE_HOLD,
    PROMPT_ABOVE_BOUND,
    Usage,
    first_anomaly,
)

DETAIL_FIELDS = (
    "text_tokens",
    "reasoning_tokens",
    "audio_tokens",
    "image_tokens",
    "video_tokens",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
)
# The uncharged amount kept per event: 1,000 USD, far above any real request's cost (the
# counts themselves are kept, so the reported cost can be recomputed), and small enough that
# sums over millions of events fit a signed 64-bit column.
MAX_UNCHARGED = 10**15


@dataclass(slots=True)
class Outcome:
    """How an attempt ended, as the forwarder saw it."""

    status: str = "ok"
    http_status: int | None = None
    usage: Usage | None = None
    finish_reason: str | None = None
    upstream_id: str | None = None
    delivered_text: str = ""
    # Estimated tokens of the generated text delivered (StreamObserver.delivered_tokens(),
    # summarize_completion()); when None, delivered_text is estimated instead.
    delivered_tokens: int | None = None
    ttft_ms: int | None = None
    error: str | None = None
    billable: bool = True  # False: the upstream refused the request, nothing to estimate
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Limits:
    """What the request allowed: the bounds reported usage is checked against."""

    prompt_tokens: int | None = None  # the prompt bound the hold was computed from
    completion_tokens: int | None = None  # the max_tokens sent upstream x choices
    hold: int | None = None  # picodollars held: the most the budgets may be charged

    @classmethod
    def of(cls, spec: HoldSpec, reservation: Reservation | None, choices: int = 1) -> "Limits":
        if reservation is None:
            return cls(prompt_tokens=spec.prompt_bound)
        return cls(
            prompt_tokens=spec.prompt_bound,
            completion_tokens=reservation.max_tokens * max(choices, 1),
            hold=reservation.amount,
        )


@dataclass(frozen=True, slots=True)
class Charge:
    """The usage an event records and what the budgets are charged for it."""

    usage: Usage
    source: str  # reported | estimated
    anomaly: str | None
    cost: int  # charged, at most the hold
    uncharged: int  # the usage's cost above the charge, at most MAX_UNCHARGED


def charge_for(
    reported: Usage | None,
    estimate,
    limits: Limits,
    prices: tuple[int, int, int],
    billable: bool = True,
) -> Charge:
    """Check reported usage (None: not reported) and price it. `estimate()` gives the Usage to
    record when the reported usage cannot be used; `prices` are (input, cached, output).
    Not `billable` (the upstream refused the request) and nothing reported: zero usage."""
    found = []
    if reported is None and not billable:
        usage, source = Usage(), "reported"
    elif reported is not None and reported.usable:
        usage, source = reported, "reported"
        found.append(usage.anomaly)
        if limits.prompt_tokens is not None and usage.prompt_tokens > limits.prompt_tokens:
            found.append(PROMPT_ABOVE_BOUND)
        if (
            limits.completion_tokens is not None
            and usage.completion_tokens > limits.completion_tokens
        ):
            found.append(COMPLETION_ABOVE_MAX_TOKENS)
    else:
        usage, source = estimate(), "estimated"
        if reported is not None:
            found.append(reported.anomaly)
    cost = cost_pico(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, *prices)
    charged = cost if limits.hold is None else min(cost, limits.hold)
    if charged < cost and source == "estimated":
        found.append(ESTIMATE_ABOVE_HOLD)
    return Charge(
        usage=usage,
        source=source,
        anomaly=first_anomaly(found),
        cost=charged,
        uncharged=min(cost - charged, MAX_UNCHARGED),
    )


def event_for(
    spec: HoldSpec,
    body: dict,
    started_at: datetime,
    latency_ms: int,
    outcome: Outcome,
    reservation: Reservation | None = None,
    choices: int = 1,
) -> dict:
    """The ledger event of an attempt; `reservation` (and the `choices` asked for) bound what
    the reported usage may charge."""

    def estimate() -> Usage:
        if not outcome.billable:
            return Usage()
        prompt = estimate_prompt_tokens(body)
        if outcome.delivered_tokens is not None:
            completion = outcome.delivered_tokens
        else:
            completion = estimate_text_tokens(outcome.delivered_text)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    charge = charge_for(
        outcome.usage,
        estimate,
        Limits.of(spec, reservation, choices),
        (spec.input_price, spec.cached_price, spec.output_price),
        outcome.billable,
    )
    usage = charge.usage
    return {
        "id": spec.hold_id,
        "created_at": utcnow(),
        "started_at": started_at,
        "token_id": spec.token_id,
        "user_id": spec.user_id,
        "team_id": spec.team_id,
        "model": spec.model,
        "provider": spec.provider,
        "upstream_model": spec.upstream_model,
        "upstream_id": _text(outcome.upstream_id, 200),
        "stream": spec.stream,
        "status": outcome.status,
        "http_status": outcome.http_status,
        "finish_reason": _text(outcome.finish_reason, 64),
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "cached_tokens": usage.cached_tokens,
        **{name: getattr(usage, name) for name in DETAIL_FIELDS},
        "usage_source": charge.source,
        "usage_anomaly": charge.anomaly,
        "input_price": spec.input_price,
        "cached_price": spec.cached_price,
        "output_price": spec.output_price,
        "cost": charge.cost,
        "uncharged": charge.uncharged,
        "ttft_ms": outcome.ttft_ms,
        "latency_ms": latency_ms,
        "error": _text(outcome.error[:2000]) if outcome.error else None,
    }


def _text(value: str | None, limit: int | None = None) -> str | None:
    """Upstream-supplied text as the ledger can store it: no NUL (PostgreSQL refuses it), and
    no longer than its column, so a strange upstream can never make a settle fail."""
    if not value:
        return value
    return value.replace("\x00", "")[:limit]
