"""Reading the rollup tables themselves in a test: every increment an append left pending
folded in first (metering.ledger.rollup.fold), whoever else folds them meanwhile."""

import asyncio

from sqlalchemy import func, select

from metering.db import Database
from metering.ledger import rollup
from metering.ledger.tables import RollupPending


async def fold_all(db: Database) -> None:
    """Fold until nothing is pending: another folder (the test's server, a replica) may hold
    some rows in a fold of its own, committed a moment later."""
    for _ in range(500):
        await rollup.fold(db)
        async with db.sessions() as session:
            left = await session.scalar(select(func.count()).select_from(RollupPending))
        if not left:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{left} rollup increments still pending")
