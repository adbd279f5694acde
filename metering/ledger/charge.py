"""What an event charges: the usage it records, checked against what the request allowed.

Usage is checked before it is charged. The upstream's counts are parsed with bounds and
checked against each other (metering.proxy.reported), then here against what the request
allowed: completion_tokens within the max_tokens sent upstream (times n, the choices asked
for), and prompt_tokens within the prompt bound the hold was computed from. Usage that cannot
be used (an invalid or missing count) is replaced by an estimate. Usage that can be used is
recorded as reported, with the reason it looks wrong in `usage_anomaly`; the budgets are
charged its cost but never more than the hold, like a card capture that cannot exceed its
authorisation. `cost` is what was charged, `uncharged` the reported cost above it (at most
MAX_UNCHARGED per event).
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from metering.ledger.event import MAX_UNCHARGED
from metering.money import cost_pico

# Reason codes of `usage_anomaly`, most serious first: an event records the first that applies.
INVALID_COUNT = "invalid_count"  # a count that is not a whole number >= 0
MISSING_COUNT = "missing_count"  # usage with prompt_tokens or completion_tokens absent
INVALID_DETAIL = "invalid_detail"  # total_tokens or a detail that is not a whole number >= 0
COUNT_ABOVE_CEILING = "count_above_ceiling"
PROMPT_ABOVE_BOUND = "prompt_above_bound"
COMPLETION_ABOVE_MAX_TOKENS = "completion_above_max_tokens"
CACHED_ABOVE_PROMPT = "cached_above_prompt"
DETAILS_ABOVE_PROMPT = "details_above_prompt"
DETAILS_ABOVE_COMPLETION = "details_above_completion"
ESTIMATE_ABOVE_HOLD = "estimate_above_hold"  # no usage reported; the estimate exceeds the hold
ANOMALIES = (
    INVALID_COUNT,
    MISSING_COUNT,
    COUNT_ABOVE_CEILING,
    PROMPT_ABOVE_BOUND,
    COMPLETION_ABOVE_MAX_TOKENS,
    CACHED_ABOVE_PROMPT,
    DETAILS_ABOVE_PROMPT,
    DETAILS_ABOVE_COMPLETION,
    INVALID_DETAIL,
    ESTIMATE_ABOVE_HOLD,
)
# Usage with these cannot be used at all: the event is estimated.
UNUSABLE = (INVALID_COUNT, MISSING_COUNT)


def first_anomaly(found: Iterable[str | None]) -> str | None:
    """The most serious of the reason codes found (see ANOMALIES), or None."""
    found = set(found) - {None}
    return next((code for code in ANOMALIES if code in found), None)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts as an event records them (the detail fields: metering.ledger.event)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # prompt_tokens_details.cached_tokens as reported (see anomaly)
    # completion_tokens_details.*; None when the upstream did not report the field.
    text_tokens: int | None = None
    reasoning_tokens: int | None = None
    audio_tokens: int | None = None
    image_tokens: int | None = None
    video_tokens: int | None = None
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    anomaly: str | None = None  # what was wrong with the usage as reported (see ANOMALIES)

    @property
    def usable(self) -> bool:
        return self.anomaly not in UNUSABLE

    def columns(self) -> dict[str, Any]:
        """The event's token columns (metering.ledger.event.Event) these counts fill."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "cached_tokens": self.cached_tokens,
            "text_tokens": self.text_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "audio_tokens": self.audio_tokens,
            "image_tokens": self.image_tokens,
            "video_tokens": self.video_tokens,
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
        }


class Bounded(Protocol):
    """What an allowance reads of a request's attribution (metering.ledger.outcome)."""

    @property
    def prompt_bound(self) -> int:
        """The most prompt tokens the request can count."""


class Held(Protocol):
    """What was reserved for a request (a budgets Reservation)."""

    @property
    def amount(self) -> int:
        """Picodollars held."""

    @property
    def max_tokens(self) -> int:
        """The max_tokens sent upstream, per choice."""


@dataclass(frozen=True, slots=True)
class Allowance:
    """What the request allowed: the bounds reported usage is checked against."""

    prompt_tokens: int | None = None  # the prompt bound the hold was computed from
    completion_tokens: int | None = None  # the max_tokens sent upstream x choices
    hold: int | None = None  # picodollars held: the most the budgets may be charged

    @classmethod
    def of(cls, attribution: Bounded, held: Held | None, choices: int = 1) -> "Allowance":
        """`attribution`: a metering.ledger.outcome.Attribution (its prompt bound)."""
        if held is None:
            return cls(prompt_tokens=attribution.prompt_bound)
        return cls(
            prompt_tokens=attribution.prompt_bound,
            completion_tokens=held.max_tokens * max(choices, 1),
            hold=held.amount,
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
    estimate: Callable[[], Usage],
    allowance: Allowance,
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
        if allowance.prompt_tokens is not None and usage.prompt_tokens > allowance.prompt_tokens:
            found.append(PROMPT_ABOVE_BOUND)
        if (
            allowance.completion_tokens is not None
            and usage.completion_tokens > allowance.completion_tokens
        ):
            found.append(COMPLETION_ABOVE_MAX_TOKENS)
    else:
        usage, source = estimate(), "estimated"
        if reported is not None:
            found.append(reported.anomaly)
    cost = cost_pico(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, *prices)
    charged = cost if allowance.hold is None else min(cost, allowance.hold)
    if charged < cost and source == "estimated":
        found.append(ESTIMATE_ABOVE_HOLD)
    return Charge(
        usage=usage,
        source=source,
        anomaly=first_anomaly(found),
        cost=charged,
        uncharged=min(cost - charged, MAX_UNCHARGED),
    )
