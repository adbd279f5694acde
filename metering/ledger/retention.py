"""Retention: events older than METERING_RETENTION_DAYS move from the hot ledger to
ledger_events_archive (same columns), one transaction per batch.

Spend reports lose nothing: the hourly rollup keeps every total, and the partial hours a report
reads from events are read from the archive too. /v1/usage lists the hot ledger only.
Every replica may run this at once: on PostgreSQL a batch's rows are claimed with FOR UPDATE
SKIP LOCKED, so two replicas move disjoint batches; SQLite has one writer at a time.
"""

import logging
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import CursorResult

from metering.db import Database, utcnow
from metering.ledger.tables import LedgerEvent, LedgerEventArchive

log = logging.getLogger("metering.retention")

BATCH = 1000


async def archive_batch(db: Database, cutoff: datetime, batch: int = BATCH) -> int | None:
    """Move up to `batch` events created before `cutoff`: how many moved, None if none was left."""
    ledger, archive = LedgerEvent.__table__, LedgerEventArchive.__table__
    insert = pg_insert if db.dialect == "postgresql" else sqlite_insert
    async with db.transaction() as session:
        ids = list(
            await session.scalars(
                select(ledger.c.id)
                .where(ledger.c.created_at < cutoff)
                .order_by(ledger.c.created_at)
                .limit(batch)
                .with_for_update(skip_locked=True)
            )
        )
        if not ids:
            return None
        names = [c.name for c in archive.columns]
        await session.execute(
            insert(archive)
            .from_select(names, select(*(ledger.c[n] for n in names)).where(ledger.c.id.in_(ids)))
            .on_conflict_do_nothing()
        )
        deleted = cast(
            CursorResult[Any], await session.execute(delete(ledger).where(ledger.c.id.in_(ids)))
        )
    # What this batch moved: on SQLite another replica may have moved some of `ids` between the
    # SELECT and the writes; the INSERT then copied only the rows still there, as DELETE counts.
    return deleted.rowcount


async def archive_old_events(
    db: Database, days: int, batch: int = BATCH, now: datetime | None = None
) -> int:
    """Move every event older than `days` days, batch by batch; returns how many moved."""
    cutoff = (now or utcnow()) - timedelta(days=days)
    moved = 0
    while True:
        count = await archive_batch(db, cutoff, batch)
        if count is None:
            break
        moved += count
    if moved:
        log.info("archived %d ledger events created before %s", moved, cutoff.isoformat())
    return moved
