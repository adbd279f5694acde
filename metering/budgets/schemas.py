"""Response bodies of the budget routes. Money is a decimal string of USD."""

from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from metering import limits
from metering.budgets.views import BudgetView
from metering.budgets.windows import INTERVAL_PATTERN, InvalidInterval, parse_interval
from metering.money import MoneyError, format_usd, usd_schema, usd_text
from metering.text import RequestBody
from metering.timefmt import rfc3339


class BudgetOut(BaseModel):
    """A budget as it stands now: its window rolled forward if that window has ended."""

    scope: Literal["token", "user", "team"]
    id: str
    credit_limit: str | None
    reset_interval: str
    window_start: str
    resets_at: str | None
    spent: str
    reserved: str
    remaining: str | None
    alert_thresholds: list[int]
    threshold_passed: int | None = Field(
        description="The highest of alert_thresholds that spent has reached in this window"
    )

    @classmethod
    def of(cls, current: BudgetView) -> "BudgetOut":
        return cls(
            scope=current.scope,
            id=current.subject_id,
            credit_limit=format_usd(current.credit_limit),
            reset_interval=current.reset_interval,
            window_start=rfc3339(current.window_start),
            resets_at=rfc3339(current.resets_at),
            spent=format_usd(current.spent),
            reserved=format_usd(current.reserved),
            remaining=format_usd(current.remaining),
            alert_thresholds=list(current.thresholds),
            threshold_passed=current.threshold_passed,
        )


class LimitsOut(BaseModel):
    """A subject's limits beyond credit and their use now: `requests` and `tokens` counted in
    the current rate window (the UTC minute, [window_start, resets_at)), `in_flight` the
    requests running. A limit that is null is not set at this scope."""

    scope: Literal["token", "user", "team"]
    id: str
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    allowed_models: list[str] | None
    expires_at: str | None
    window_start: str
    resets_at: str
    requests: int
    tokens: int
    in_flight: int

    @classmethod
    def of(cls, current: dict[str, Any]) -> "LimitsOut":
        models = limits.parse_models(current["allowed_models"])
        return cls(
            **{
                **current,
                "allowed_models": list(models) if models is not None else None,
                "expires_at": rfc3339(current["expires_at"]),
                "window_start": rfc3339(current["window_start"]),
                "resets_at": rfc3339(current["resets_at"]),
            }
        )


def _limit(value: object) -> Decimal | None:
    if value is None:
        return None
    try:
        return usd_text(value, "credit_limit")
    except MoneyError as exc:
        raise ValueError(str(exc)) from None


def _interval(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("reset_interval must be a string")
    try:
        return parse_interval(value).text
    except InvalidInterval as exc:
        raise ValueError(str(exc)) from None


class EndUserBudgetIn(RequestBody):
    """PUT /v1/teams/{team_id}/end-users/{end_user}/budget: one end user's own budget."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    credit_limit: Annotated[Decimal | None, WithJsonSchema(usd_schema(nullable=True))] = Field(
        description="USD as a decimal string; null: not limited"
    )
    reset_interval: str = Field(default="never", json_schema_extra={"pattern": INTERVAL_PATTERN})

    _check_limit = field_validator("credit_limit", mode="before")(_limit)
    _check_interval = field_validator("reset_interval", mode="before")(_interval)


class EndUserBudgetOut(BaseModel):
    """An end user's budget as it stands now (its window rolled forward if it has ended): its
    override's terms, or its team's default."""

    scope: Literal["end_user"] = "end_user"
    id: str = Field(description="The budget's id (eu_...), as alerts and refusals name it")
    team_id: str
    end_user: str
    override: bool = Field(description="Whether the end user has terms of its own")
    credit_limit: str | None
    reset_interval: str
    window_start: str
    resets_at: str | None
    spent: str
    reserved: str
    remaining: str | None

    @classmethod
    def of(cls, team_id: str, end_user: str, override: bool, now: BudgetView) -> "EndUserBudgetOut":
        return cls(
            id=now.subject_id,
            team_id=team_id,
            end_user=end_user,
            override=override,
            credit_limit=format_usd(now.credit_limit),
            reset_interval=now.reset_interval,
            window_start=rfc3339(now.window_start),
            resets_at=rfc3339(now.resets_at),
            spent=format_usd(now.spent),
            reserved=format_usd(now.reserved),
            remaining=format_usd(now.remaining),
        )


class EndUserList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EndUserBudgetOut]
