"""Response bodies of the budget routes. Money is a decimal string of USD."""

from typing import Any, Literal

from pydantic import BaseModel, Field

from metering import limits
from metering.budgets.views import BudgetView
from metering.money import format_usd
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
