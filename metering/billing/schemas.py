"""Request and response bodies of POST /v1/events, /v1/rerate, /v1/adjustments."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from metering.billing.ingest import MAX_BATCH
from metering.billing.rerate import MAX_REASON, REASON_PATTERN
from metering.ledger.attribution import END_USER_PATTERN
from metering.money import CHANGE_USD_PATTERN
from metering.text import TEXT_JSON_REF, RequestBody
from metering.timefmt import BOUNDS, MOMENT_SCHEMA, client_moment


class UsageEventIn(RequestBody):
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
    end_user: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="who the usage was for, within the team: 1 to 256 characters, no control, "
        "line-break, zero-width or bidi-control character",
        json_schema_extra={"pattern": END_USER_PATTERN},
    )
    endpoint: Literal["chat.completions", "responses"] = Field(
        "chat.completions", description="the API the usage was for"
    )
    tags: dict[str, str] | None = Field(
        None,
        max_length=16,
        description="at most 16 pairs: keys of 1 to 64 characters, values strings of at most "
        "512 (as a request's `metadata`)",
    )


class EventsIn(RequestBody):
    """The batch; RequestBody walks every event as sent (each is read on its own later), so a
    string that is not valid text refuses the whole request, naming where it is."""

    events: list[Any] = Field(
        max_length=MAX_BATCH,
        description=f"Up to {MAX_BATCH:,} events, each checked on its own as the UsageEventIn "
        "schema says: one that does not fit it (a field missing, out of bounds, unknown) is "
        "answered in `data` as `rejected` with reason `invalid_event`, the others taken. A "
        "string in any of them that is not valid text (a lone surrogate, a control character) "
        "refuses the whole request (400 naming it, e.g. `events[3].idempotency_key`)",
        json_schema_extra={"items": dict(TEXT_JSON_REF)},
    )


class EventResult(BaseModel):
    idempotency_key: str | None
    status: Literal["created", "duplicate", "conflict", "rejected", "retry"] = Field(
        description="`retry`: it could not be written now; sending it again is safe"
    )
    event_id: str | None
    error: str | None = None
    reason: (
        Literal[
            "invalid_event",
            "model_not_allowed",
            "rate_limit_exceeded",
            "budget_exceeded",
            "counter_ceiling",
        ]
        | None
    ) = Field(None, description="why it was rejected")
    scope: str | None = Field(None, description="whose limit rejected it: token, user, team or run")


class EventsOut(BaseModel):
    data: list[EventResult]


# A moment in a body or null: checked by client_moment (RFC 3339, within the bounds), declared
# by timefmt.MOMENT_SCHEMA.
Moment = Annotated[
    str | None,
    Field(max_length=64),
    WithJsonSchema(
        {"anyOf": [{"type": "string", "maxLength": 64, **MOMENT_SCHEMA}, {"type": "null"}]}
    ),
]
# A correction's reason: rerate.check_reason's rule, declared.
REASON = Field(
    max_length=MAX_REASON,
    json_schema_extra={"pattern": REASON_PATTERN},
    description="why (kept with the adjustments): text with something besides whitespace",
)


class RerateIn(RequestBody):
    free_text = frozenset({"reason"})

    provider: str = Field(max_length=100)
    model: str = Field(max_length=200)
    start: str = Field(
        max_length=64,
        description=f"RFC 3339, inclusive, {BOUNDS}",
        json_schema_extra=MOMENT_SCHEMA,
    )
    end: Moment = Field(None, description=f"RFC 3339, exclusive, {BOUNDS}; default now")
    reason: str = REASON

    _moments = field_validator("start", "end")(client_moment)


class OverLimit(BaseModel):
    scope: Literal["token", "user", "team"]
    id: str = Field(description="the token's, user's or team's id")
    window_start: str = Field(description="RFC 3339: the budget window (current or closed)")
    credit_limit: str = Field(description="USD")
    spent: str = Field(description="USD, as the rerate left it: above credit_limit")


class RerateOut(BaseModel):
    adjusted: int = Field(description="adjustment events appended (one per corrected event)")
    difference: str = Field(description="their sum, USD (negative: the range was overcharged)")
    over_limit: list[OverLimit] = Field(
        description="the budget windows the rerate charged more and left above their "
        "credit_limit (each also raises budget.exhausted); a rerate is never refused for them"
    )


# An adjustment names what it charges: one of these, not null (rerate.adjust's rule, declared).
SUBJECTS = ("team_id", "user_id", "token_id", "corrects_event_id")


class AdjustmentIn(RequestBody):
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": [name], "properties": {name: {"type": "string"}}} for name in SUBJECTS
            ]
        }
    )
    free_text = frozenset({"reason"})

    amount: str = Field(
        max_length=64,
        json_schema_extra={"pattern": CHANGE_USD_PATTERN},
        description='signed USD, e.g. "-5.00" for a credit; at most 1000000 either way, and '
        "never taking a budget's spent below zero or past 9000000 (400)",
    )
    reason: str = REASON
    team_id: str | None = Field(None, max_length=40)
    user_id: str | None = Field(None, max_length=40)
    token_id: str | None = Field(None, max_length=40)
    corrects_event_id: str | None = Field(None, max_length=40)
    at: Moment = Field(
        None,
        description=f"RFC 3339, {BOUNDS}: the moment (and budget window) it counts in; not "
        "in the future, at most 35 days back (fewer when METERING_RETENTION_DAYS is shorter)",
    )

    _moment = field_validator("at")(client_moment)


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


def declare_event_schema(app: Any) -> None:
    """Wraps app.openapi: the UsageEventIn component, the shape each event of POST /v1/events is
    checked against on its own (the body declares its events as free JSON, TEXT_JSON_REF)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema: dict[str, Any] = build()
        event = UsageEventIn.model_json_schema(ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {})["UsageEventIn"] = event
        return schema

    app.openapi = openapi
