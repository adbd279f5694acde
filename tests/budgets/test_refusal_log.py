"""The refusals table's writer: refusals that arrive together are one INSERT, and a flood never
grows a queue without bound: beyond MAX_PENDING waiting rows, a refusal is dropped and counted."""

import asyncio
import uuid
from types import SimpleNamespace

from sqlalchemy import func, select

from metering.budgets import refusals
from metering.budgets.refusals import RefusalLog, Refused
from metering.db import Database
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
