"""Events made outside the proxy's request path (those of an attempt: metering.ledger.outcome):
usage recorded through POST /v1/events (`usage_source` ingested), and adjustments (`kind`
adjustment) that correct another event's charge or credit a team, appended to the ledger while
the rows they correct never change."""

from dataclasses import replace
from datetime import datetime

from metering.ids import time_ordered
from metering.ledger.attribution import NO_TAGS
from metering.ledger.charge import Usage
from metering.ledger.event import ADJUSTMENT, CHAT, INGESTED, Event, bounded
from metering.ledger.outcome import NO_USAGE
from metering.money import cost_pico

RERATED = "rerated"  # usage_source of an adjustment a rerate made
MANUAL = "manual"  # usage_source of an adjustment made by hand (a credit, a correction)


def new_event_id() -> str:
    return time_ordered("evt")


def ingested_event(
    *,
    token_id: str | None,
    user_id: str,
    team_id: str,
    model: str,
    provider: str,
    upstream_model: str,
    usage: Usage,
    prices: tuple[int, int, int],
    occurred_at: datetime,
    end_user: str | None = None,
    tags: str = NO_TAGS,
    endpoint: str = CHAT,
) -> Event:
    """Usage reported from outside, priced at `prices` (those in force when it happened) and
    charged in full: no hold bounds it. `end_user`, `tags`: as metering.ledger.attribution
    checked and encoded them."""
    cost = cost_pico(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, *prices)
    return Event(
        id=new_event_id(),
        created_at=occurred_at,
        started_at=occurred_at,
        token_id=token_id,
        user_id=user_id,
        team_id=team_id,
        model=model,
        provider=provider,
        upstream_model=upstream_model,
        upstream_id=None,
        stream=False,
        status="ok",
        http_status=None,
        finish_reason=None,
        **replace(usage, total_tokens=usage.prompt_tokens + usage.completion_tokens).columns(),
        usage_source=INGESTED,
        usage_anomaly=None,
        input_price=prices[0],
        cached_price=prices[1],
        output_price=prices[2],
        cost=cost,
        uncharged=0,
        ttft_ms=None,
        latency_ms=None,
        error=None,
        end_user=end_user,
        tags=tags,
        endpoint=endpoint,
    )


def adjustment_event(
    *,
    token_id: str | None,
    user_id: str,
    team_id: str,
    model: str,
    provider: str,
    upstream_model: str,
    prices: tuple[int, int, int],
    difference: int,
    reason: str,
    at: datetime,
    made_at: datetime,
    corrects: str | None = None,
    source: str = RERATED,
    event_id: str | None = None,
    upstream_id: str | None = None,
    end_user: str | None = None,
    tags: str = NO_TAGS,
    endpoint: str = CHAT,
) -> Event:
    """An adjustment of `difference` picodollars (negative: a credit), charged in the hour of
    `at` (the corrected event's, so every report over any range equals a recomputation at the
    right prices); `made_at` (started_at) is when it was made. It counts no tokens and no
    request. `source`: rerated (a rerate's: `prices` are those it applied) or manual;
    `event_id`: its id (a new one unless given); `upstream_id`, `end_user`, `tags`: the
    corrected request's (so that spend by end user and by tag stays exact after a correction)."""
    return Event(
        id=event_id or new_event_id(),
        created_at=at,
        started_at=made_at,
        token_id=token_id,
        user_id=user_id,
        team_id=team_id,
        model=model,
        provider=provider,
        upstream_model=upstream_model,
        upstream_id=upstream_id,
        stream=False,
        status="ok",
        http_status=None,
        finish_reason=None,
        **NO_USAGE.columns(),
        usage_source=source,
        usage_anomaly=None,
        input_price=prices[0],
        cached_price=prices[1],
        output_price=prices[2],
        cost=difference,
        uncharged=0,
        ttft_ms=None,
        latency_ms=None,
        error=None,
        kind=ADJUSTMENT,
        corrects_event_id=corrects,
        reason=bounded("reason", reason),
        end_user=end_user,
        tags=tags,
        endpoint=endpoint,
    )
