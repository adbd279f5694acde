"""Response bodies of the budget routes. Money is a decimal string of USD."""

from typing import Literal

from pydantic import BaseModel

from metering.budgets.service import BudgetView
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
        )
