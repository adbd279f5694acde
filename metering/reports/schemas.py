"""Response bodies of /v1/usage, /v1/spend and /v1/reconciliations. Money is a decimal string
of USD."""

from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from metering.db import UTCDateTime
from metering.ledger.event import NULLABLE, Event, Spec
from metering.reports.labels import LABEL_KEYS


class SpendSums(BaseModel):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cost: str
    uncharged: str
    # The part of cost made by adjustment events (price corrections, credits); "0" when the
    # report was asked for with adjustments=exclude, whose cost is the original charges only.
    adjustments: str


class SpendRow(SpendSums):
    """One group's sums; only the keys named by group_by are present."""

    model_config = ConfigDict(extra="allow")  # tag:<key>, by group_by=tag:<key>

    team_id: str | None = None
    user_id: str | None = None
    token_id: str | None = None
    model: str | None = None
    provider: str | None = None
    day: str | None = None
    hour: str | None = None
    end_user: str | None = None
    # By tag:<key>, also the key `tag:<key>` (its value, or null): not a declared field.
    # With labels=true, beside the ids the row is grouped by:
    team_name: str | None = None
    user_email: str | None = None
    token_name: str | None = None


class SpendOut(BaseModel):
    start: str
    end: str
    group_by: list[str]
    adjustments: Literal["included", "excluded"]
    total: SpendSums
    row_count: int
    page: int
    limit: int
    next_page: int | None
    rows: list[SpendRow]


Status = Literal["matched", "differs", "missing_in_ledger", "missing_in_provider"]


class ReconciledSums(BaseModel):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost: str


class Compared(BaseModel):
    status: Status
    ledger: ReconciledSums | None
    provider_side: ReconciledSums | None
    difference: ReconciledSums
    estimated_events: int
    unsettled_events: int
    uncharged: str
    anomalous_events: int


class ReconciledDay(Compared):
    day: str
    provider: str
    model: str


class ReconciledRequest(Compared):
    upstream_id: str


class StatusCounts(BaseModel):
    matched: int
    differs: int
    missing_in_ledger: int
    missing_in_provider: int


class ReconciliationOut(BaseModel):
    id: str
    provider: str
    created_at: str
    tolerance: str
    days: list[str]
    summary: StatusCounts
    request_summary: StatusCounts
    estimated_events: int
    unsettled_events: int
    note: str | None
    rows: list[ReconciledDay]
    requests: list[ReconciledRequest]


EXACT = ConfigDict(extra="forbid")  # the schema says no other key is sent


def _shown_type(name: str, annotation: object, spec: Spec) -> object:
    """A column's type in GET /v1/usage's JSON: money as a decimal USD string, times as RFC 3339
    text, everything else as the event declares it (nullable where the column is)."""
    if spec.money:
        shown: Any = Annotated[str, Field(description="USD, as an exact decimal string")]
    elif spec.price:
        shown = Annotated[str, Field(description="USD per 1M tokens, as an exact decimal string")]
    elif isinstance(spec.sql, UTCDateTime):
        shown = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
    elif spec.json_text:
        shown = Annotated[
            dict[str, str],
            Field(description="the request's tags (its metadata and x-metering-tags); {} if none"),
        ]
    else:
        return annotation
    return shown | None if name in NULLABLE else shown


def _usage_event_model() -> type[BaseModel]:
    """One event of GET /v1/usage, built from the ledger event's declaration: its public
    columns in their order, the grouped ones nested (as in OpenAI's usage object) where the
    group's first column stands."""
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for column in fields(Event):
        spec: Spec = column.metadata["spec"]
        if not spec.public:
            continue
        definition = (_shown_type(column.name, column.type, spec), ...)
        if spec.group is None:
            top[column.name] = definition
            continue
        if spec.group not in groups:
            groups[spec.group] = {}
            top[spec.group] = None  # keeps the group's place among the columns
        groups[spec.group][column.name] = definition
    for group, members in groups.items():
        title = "".join(part.capitalize() for part in group.split("_"))
        top[group] = (create_model(title, __config__=EXACT, **members), ...)
    for label in LABEL_KEYS:  # only with labels=true
        top[label] = (str | None, None)
    return create_model(
        "UsageEvent",
        __config__=EXACT,
        __doc__="One ledger event, as GET /v1/usage shows it.",
        **top,
    )


UsageEvent = _usage_event_model()


class UsageOut(BaseModel):
    """A page of events, newest first; next_cursor fetches the next one (None: the last)."""

    object: Literal["list"]
    data: list[UsageEvent]  # type: ignore[valid-type]
    next_cursor: str | None


class ChangesOut(BaseModel):
    """Events in the order they became visible; poll again with `next` (the same cursor when
    nothing new was found; null only before the first event)."""

    data: list[UsageEvent]  # type: ignore[valid-type]
    next: str | None


RefusalReason = Literal["budget", "rpm", "tpm", "parallel", "model"]


class RefusalOut(BaseModel):
    """A request refused before anything was reserved or sent: never a ledger event."""

    id: str = Field(description="The refused answer's x-request-id")
    created_at: str = Field(json_schema_extra={"format": "date-time"})
    token_id: str | None
    user_id: str
    team_id: str
    model: str
    reason: RefusalReason = Field(
        description="budget (402 budget_exceeded), rpm or tpm (429 rate_limit_exceeded), "
        "parallel (429, max_parallel_requests), model (403 model_not_allowed)"
    )
    scope: Literal["token", "user", "team", "end_user", "request", "run"] = Field(
        description="Whose limit refused it (request: x-metering-max-cost; run: its budget; "
        "end_user: the budget of the request's end user)"
    )
    subject_id: str = Field(
        description="That token's, user's or team's id (an end user's budget: its eu_ id)"
    )
    http_status: int
    code: str
    message: str
    team_name: str | None = None
    user_email: str | None = None
    token_name: str | None = None


class RefusalsOut(BaseModel):
    """A page of refusals, newest first; next_cursor fetches the next one (None: the last)."""

    object: Literal["list"]
    data: list[RefusalOut]
    next_cursor: str | None


class RefusalCount(BaseModel):
    """One group's count; only the keys named by group_by (and, with labels, their names)."""

    team_id: str | None = None
    user_id: str | None = None
    token_id: str | None = None
    model: str | None = None
    reason: RefusalReason | None = None
    scope: str | None = None
    day: str | None = None
    hour: str | None = None
    team_name: str | None = None
    user_email: str | None = None
    token_name: str | None = None
    refusals: int


class RefusalTotal(BaseModel):
    refusals: int


class RefusalSummaryOut(BaseModel):
    start: str
    end: str
    group_by: list[str]
    total: RefusalTotal
    row_count: int
    page: int
    limit: int
    next_page: int | None
    rows: list[RefusalCount]
