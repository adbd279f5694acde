"""The refusals table's writer: refusals that arrive together are one INSERT, and a flood never
grows a queue without bound: beyond MAX_PENDING waiting rows, a refusal is dropped and counted."""

import asyncio
import uuid
from datetime import timedelta
from types import SimpleNamespace

from sqlalchemy import func, select, update

from metering.budgets import refusals
from metering.budgets.refusals import RefusalLog, Refused
from metering.db import Database, utcnow
from metering.models import Refusal


def test_a_flood_keeps_at_most_max_pending_waiting_and_counts_the_rest(api, monkeypatch):
    monkeypatch.setattr(refusals, "MAX_PENDING", 5)
    team = f"team_{uuid.uuid4().hex[:12]}"
    who = SimpleNamespace(token_id=None, user_id=f"user_{uuid.uuid4().hex[:12]}", team_id=team)
    dropped: list[str] = []

    async def flood() -> int:
        db = Database(api.settings.database_url, pool_size=1)
        log = RefusalLog(db, dropped.append)
        try:
            await asyncio.gather(
                *(
                    log.record(
                        f"req_{uuid.uuid4().hex}",
                        principal=who,
                        model="gpt-sim",
                        refused=Refused("rpm", "team", team),
                        status=429,
                        code="rate_limit_exceeded",
                        message="over its rpm_limit",
                    )
                    for _ in range(50)
                )
            )
            async with db.sessions() as session:
                return await session.scalar(
                    select(func.count()).select_from(Refusal).where(Refusal.team_id == team)
                )
        finally:
            await db.dispose()

    written = asyncio.run(flood())
    # The first five queue for one write (it starts when the loop next turns); the rest drop.
    assert written == 5
    assert dropped == ["rpm"] * 45


def test_retention_forgets_refusals_older_than_its_days(api):
    team = f"team_{uuid.uuid4().hex[:12]}"
    who = SimpleNamespace(token_id=None, user_id=f"user_{uuid.uuid4().hex[:12]}", team_id=team)

    async def run() -> tuple[int, int, int]:
        db = Database(api.settings.database_url, pool_size=1)
        log = RefusalLog(db)
        try:
            for _ in range(3):
                await log.record(
                    f"req_{uuid.uuid4().hex}",
                    principal=who,
                    model="gpt-sim",
                    refused=Refused("budget", "team", team),
                    status=402,
                    code="budget_exceeded",
                    message="cannot cover",
                )
            kept = await refusals.forget_old(db, 1)  # none is a day old
            # Made two days old (only these: other tests' refusals are kept).
            async with db.transaction() as session:
                await session.execute(
                    update(Refusal)
                    .where(Refusal.team_id == team)
                    .values(created_at=utcnow() - timedelta(days=2))
                )
            gone = await refusals.forget_old(db, 1, batch=2)
            async with db.sessions() as session:
                left = await session.scalar(
                    select(func.count()).select_from(Refusal).where(Refusal.team_id == team)
                )
            return kept, gone, left
        finally:
            await db.dispose()

    kept, gone, left = asyncio.run(run())
    assert (kept, gone, left) == (0, 3, 0)
