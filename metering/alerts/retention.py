"""Retention of the outbox: with METERING_RETENTION_DAYS, deliveries finished (delivered or
failed) before the cutoff are deleted with their attempts, then events created before it that
no delivery names any more. A pending delivery is never deleted, nor its event.

An event also stays while its key could be written again without it (record.rearms_until): a
budget's threshold or exhaustion in a window still open, a token.expiring before the token
expires. Its key is what records it once; deleting it early would send it twice.
Every replica may run this at once: deleting a row twice deletes it once.
"""

import json
import logging
from datetime import datetime, timedelta

from sqlalchemy import and_, delete, exists, or_, select

from metering.alerts import record
from metering.db import Database, utcnow
from metering.models import AlertEvent, WebhookAttempt, WebhookDelivery

log = logging.getLogger("metering.retention")

BATCH = 1000
FINISHED = ("delivered", "failed")


async def prune_deliveries_batch(db: Database, cutoff: datetime, batch: int = BATCH) -> int:
    """Delete up to `batch` deliveries finished before `cutoff`, and their attempts."""
    async with db.begin() as conn:
        ids = list(
            (
                await conn.execute(
                    select(WebhookDelivery.id)
                    .where(
                        WebhookDelivery.status.in_(FINISHED),
                        WebhookDelivery.finished_at < cutoff,
                    )
                    .limit(batch)
                    .with_for_update(skip_locked=True)
                )
            ).scalars()
        )
        if not ids:
            return 0
        await conn.execute(
            delete(WebhookAttempt.__table__).where(WebhookAttempt.delivery_id.in_(ids))
        )
        await conn.execute(
            delete(WebhookDelivery.__table__).where(
                WebhookDelivery.id.in_(ids), WebhookDelivery.status.in_(FINISHED)
            )
        )
    return len(ids)


def _old_events(cutoff: datetime, after: tuple[datetime, str] | None, batch: int):
    """Events created before `cutoff`, dispatched, that no delivery names: a page of them in
    (created_at, id) order, after `after`."""
    named = exists().where(WebhookDelivery.event_id == AlertEvent.id)
    query = select(AlertEvent.id, AlertEvent.type, AlertEvent.created_at, AlertEvent.data).where(
        AlertEvent.created_at < cutoff, AlertEvent.dispatched.is_(True), ~named
    )
    if after is not None:
        at, last = after
        query = query.where(
            or_(AlertEvent.created_at > at, and_(AlertEvent.created_at == at, AlertEvent.id > last))
        )
    return query.order_by(AlertEvent.created_at, AlertEvent.id).limit(batch)


async def prune_events(db: Database, cutoff: datetime, now: datetime, batch: int = BATCH) -> int:
    """Delete the events created before `cutoff` that no delivery names and whose key cannot
    come back by `now`; the others are passed over (a page at a time, so each is read once)."""
    pruned, after = 0, None
    while True:
        async with db.begin() as conn:
            rows = (await conn.execute(_old_events(cutoff, after, batch))).all()
            if not rows:
                return pruned
            after = (rows[-1].created_at, rows[-1].id)
            ids = []
            for row in rows:
                until = record.rearms_until(row.type, json.loads(row.data))
                if until is not None and until <= now:
                    ids.append(row.id)
            if ids:
                named = exists().where(WebhookDelivery.event_id == AlertEvent.id)
                result = await conn.execute(
                    delete(AlertEvent.__table__).where(AlertEvent.id.in_(ids), ~named)
                )
                pruned += result.rowcount


async def prune(db: Database, days: int, now: datetime | None = None) -> tuple[int, int]:
    """Prune deliveries, then events, older than `days` days: how many of each went."""
    now = now or utcnow()
    cutoff = now - timedelta(days=days)
    deliveries = 0
    while True:
        count = await prune_deliveries_batch(db, cutoff)
        if not count:
            break
        deliveries += count
    events = await prune_events(db, cutoff, now)
    if deliveries or events:
        log.info(
            "pruned %d webhook deliveries and %d alert events from before %s",
            deliveries,
            events,
            cutoff.isoformat(),
        )
    return deliveries, events
