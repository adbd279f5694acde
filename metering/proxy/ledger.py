"""What one upstream attempt becomes in the ledger."""

from dataclasses import dataclass, field
from datetime import datetime

from metering.budgets.service import HoldSpec
from metering.db import utcnow
from metering.money import cost_pico
from metering.proxy.estimate import estimate_prompt_tokens, estimate_text_tokens
from metering.proxy.usage import Usage

DETAIL_FIELDS = (
    "text_tokens",
    "reasoning_tokens",
    "audio_tokens",
    "image_tokens",
    "video_tokens",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
)


@dataclass(slots=True)
class Outcome:
    """How an attempt ended, as the forwarder saw it."""

    status: str = "ok"
    http_status: int | None = None
    usage: Usage | None = None
    finish_reason: str | None = None
    upstream_id: str | None = None
    delivered_text: str = ""
    ttft_ms: int | None = None
    error: str | None = None
    billable: bool = True  # False: the upstream refused the request, nothing to estimate
    extra: dict = field(default_factory=dict)


def event_for(
    spec: HoldSpec, body: dict, started_at: datetime, latency_ms: int, outcome: Outcome
) -> dict:
    usage, source = outcome.usage, "reported"
    if usage is None and outcome.billable:
        prompt = estimate_prompt_tokens(body)
        completion = estimate_text_tokens(outcome.delivered_text) if outcome.delivered_text else 0
        usage = Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
        source = "estimated"
    elif usage is None:
        usage = Usage()
    cost = cost_pico(
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.completion_tokens,
        spec.input_price,
        spec.cached_price,
        spec.output_price,
    )
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
        "usage_source": source,
        "input_price": spec.input_price,
        "cached_price": spec.cached_price,
        "output_price": spec.output_price,
        "cost": cost,
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
