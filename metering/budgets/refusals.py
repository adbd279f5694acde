"""Refused requests, recorded (table refusals): a request refused before anything was reserved
or sent (402 budget, 429 rate or parallel, 403 model) is one row with who, what, which scope
refused it and why. Never a ledger event, never charged to a budget.

The refusal path stays short and bounded: rows are written in groups (metering.budgets.groups),
one multi-row INSERT in autocommit for the refusals that arrive together. At most MAX_PENDING
rows wait for a write; beyond, or when the database refuses the write, a row is dropped and
counted (`on_drop`, the metric metering_refusals_dropped_total): the client's answer never waits
on a queue that grows or fails because of the record.
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import CursorResult

from metering.budgets.groups import GroupWriter, write_and_answer
from metering.db import Database, utcnow
from metering.models import Refusal

log = logging.getLogger("metering.budgets")

MAX_PENDING = 1000  # rows waiting for a write; more are dropped (and counted)
MAX_MESSAGE = 1000
REASONS = ("budget", "rpm", "tpm", "parallel", "model")


@dataclass(frozen=True, slots=True)
class Refused:
    """What refused a request: the reason, and the scope (token, user, team) whose limit it was."""

    reason: str  # one of REASONS
    scope: str
    subject_id: str


class RefusalLog:
    def __init__(self, db: Database, on_drop: Callable[[str], None] = lambda reason: None):
        self.db = db
        self.on_drop = on_drop
        self.groups = GroupWriter(self._write, lambda: RuntimeError("refusal not written"))

    async def record(
        self,
        refusal_id: str,
        *,
        principal: Any,
        model: str,
        refused: Refused,
        status: int,
        code: str,
        message: str,
    ) -> None:
        """One refused request; dropped (and counted) when too many wait or the write fails."""
        row = {
            "id": refusal_id,
            "created_at": utcnow(),
            "token_id": principal.token_id,
            "user_id": principal.user_id,
            "team_id": principal.team_id,
            "model": model[:200].replace("\x00", ""),
            "reason": refused.reason,
            "scope": refused.scope,
            "subject_id": refused.subject_id,
            "http_status": status,
            "code": code,
            "message": message[:MAX_MESSAGE].replace("\x00", ""),
        }
        if len(self.groups.pending) >= MAX_PENDING:
            self.on_drop(refused.reason)
            return
        try:
            await self.groups.submit(row)
        except Exception as exc:
            log.warning("refusal %s not recorded: %s", refusal_id, exc)
            self.on_drop(refused.reason)

    async def _one(self, rows: list[dict[str, Any]]) -> None:
        async with self.db.single() as conn:
            await conn.execute(insert(Refusal), rows)

    async def _write(self, batch: list[tuple[dict[str, Any], asyncio.Future[Any]]]) -> None:
        await write_and_answer(batch, self._one)


async def forget_old(
    db: Database, days: int, batch: int = 1000, now: datetime | None = None
) -> int:
    """Delete refusals older than `days` days (METERING_RETENTION_DAYS), a batch per
    transaction; returns how many went."""
    cutoff = (now or utcnow()) - timedelta(days=days)
    removed = 0
    while True:
        async with db.transaction() as session:
            ids = list(
                await session.scalars(
                    select(Refusal.id).where(Refusal.created_at < cutoff).limit(batch)
                )
            )
            if not ids:
                return removed
            result = cast(
                CursorResult[Any],
                await session.execute(delete(Refusal).where(Refusal.id.in_(ids))),
            )
        removed += result.rowcount
