"""Response bodies of /v1/spend and /v1/reconciliations. Money is a decimal string of USD."""

from typing import Literal

from pydantic import BaseModel


class SpendSums(BaseModel):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cost: str
    uncharged: str


class SpendRow(SpendSums):
    """One group's sums; only the keys named by group_by are present."""

    team_id: str | None = None
    user_id: str | None = None
    token_id: str | None = None
    model: str | None = None
    provider: str | None = None
    day: str | None = None
    hour: str | None = None


class SpendOut(BaseModel):
    start: str
    end: str
    group_by: list[str]
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
