"""Request and response bodies of POST /v1/events, /v1/rerate, /v1/adjustments."""

from typing import Any, Literal

from pydantic import BaseModel, Field

from metering.billing.ingest import MAX_BATCH


class UsageEventIn(BaseModel):
    """One usage record (documentation: each event is checked on its own, so one invalid event
    answers `rejected` without failing the others)."""

    idempotency_key: str = Field(max_length=200)
    model: str = Field(max_length=200, description="a model name of the catalog")
    provider: str | None = Field(None, max_length=100, description="default: its first route")
    token_id: str | None = None
    user_id: str | None = None
    team_id: str | None = None
    prompt_tokens: int = Field(ge=0, le=10**9)
    cached_tokens: int | None = Field(None, ge=0, le=10**9)
    completion_tokens: int = Field(ge=0, le=10**9)
    completion_tokens_details: dict[str, int] | None = None
    occurred_at: str | None = Field(None, description="RFC 3339; default now; at most 35 days back")


class EventsIn(BaseModel):
    events: list[Any] = Field(
        max_length=MAX_BATCH,
        description=f"Up to {MAX_BATCH:,} events, each checked on its own",
        json_schema_extra={"items": UsageEventIn.model_json_schema()},
    )


class EventResult(BaseModel):
    idempotency_key: str | None
    status: Literal["created", "duplicate", "conflict", "rejected"]
    event_id: str | None
    error: str | None = None


class EventsOut(BaseModel):
    data: list[EventResult]


class RerateIn(BaseModel):
    provider: str = Field(max_length=100)
    model: str = Field(max_length=200)
    start: str = Field(max_length=64, description="RFC 3339, inclusive")
    end: str | None = Field(None, max_length=64, description="RFC 3339, exclusive; default now")
    reason: str = Field(max_length=500)


class RerateOut(BaseModel):
    adjusted: int = Field(description="adjustment events appended (one per corrected event)")
    difference: str = Field(description="their sum, USD (negative: the range was overcharged)")


class AdjustmentIn(BaseModel):
    amount: str = Field(max_length=64, description='signed USD, e.g. "-5.00" for a credit')
    reason: str = Field(max_length=500)
    team_id: str | None = Field(None, max_length=40)
    user_id: str | None = Field(None, max_length=40)
    token_id: str | None = Field(None, max_length=40)
    corrects_event_id: str | None = Field(None, max_length=40)
    at: str | None = Field(
        None, max_length=64, description="RFC 3339: the moment (and budget window) it counts in"
    )


class AdjustmentOut(BaseModel):
    id: str
    kind: Literal["adjustment"]
    created_at: str
    team_id: str
    user_id: str
    token_id: str | None
    corrects_event_id: str | None
    cost: str
    reason: str
