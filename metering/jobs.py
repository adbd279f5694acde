"""Background jobs (APScheduler). Every replica runs them: each one is idempotent SQL."""

import logging
from datetime import UTC, datetime, timedelta

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from sqlalchemy import select

from metering import metrics
from metering.alerts import retention as alerts_retention
from metering.alerts import service as alerts
from metering.budgets import leases, rates, refusals
from metering.budgets.runs import expire_runs
from metering.budgets.settle import settle_in
from metering.budgets.views import current_window, roll
from metering.db import Database, utcnow
from metering.ledger import retention, rollup
from metering.ledger.outcome import unsettled_event
from metering.models import Budget, Hold
from metering.responses import store as responses_store

log = logging.getLogger("metering.jobs")
RETENTION_EVERY_S = 600
FOLD_EVERY_S = 1.0  # pending rollup increments folded into the rollups
EXPIRING_EVERY_S = 600


async def expire_holds(db: Database, batch: int = 500, ttl_s: float | None = None) -> int:
    """Charge every expired hold as an `unsettled` event; a hold settled meanwhile is skipped.
    Should its request settle after all, its real outcome replaces the event (budgets.settle)."""
    now = utcnow()
    async with db.sessions() as session:
        expired = list(
            await session.scalars(
                select(Hold).where(Hold.expires_at <= now).order_by(Hold.expires_at).limit(batch)
            )
        )
    charged = 0
    for hold in expired:
        async with db.transaction() as session:
            event = unsettled_event(hold, utcnow())
            settled = await settle_in(session, event)
        if settled:
            charged += 1
            metrics.observe_event(event)
    if charged:
        log.warning("charged %d expired holds as unsettled", charged)
    # Then the leases of processes that stopped extending them, now that no hold names them.
    await leases.expire_leases(db, batch)
    if ttl_s is not None:
        # Parallel slots whose request has no hold (its process died before writing it).
        await rates.heal_parallel(db, ttl_s)
    return charged


async def close_windows(db: Database) -> int:
    """Roll every budget whose window has ended, keeping the closed window's total."""
    now = utcnow()
    closed = 0
    async with db.sessions() as session:
        rows = list(
            await session.execute(select(Budget.__table__).where(Budget.reset_interval != "never"))
        )
    for row in rows:
        start, _ = current_window(row, now)
        if row.window_start < start:
            async with db.transaction() as session:
                await roll(session, row, now)
            closed += 1
    return closed


def sweep_interval_s(hold_ttl_s: int) -> float:
    return max(1.0, min(60.0, hold_ttl_s / 4))


def start_scheduler(
    db: Database,
    hold_ttl_s: int,
    retention_days: int | None = None,
    run_idle_s: int | None = None,
    responses_retention_days: int = 30,
) -> AsyncIOScheduler:
    scheduler = AsyncIOScheduler(timezone="UTC")
    # The scheduler keeps the wall clock's time, whatever the clock the jobs read.
    first = datetime.now(UTC) + timedelta(seconds=1)

    def every(seconds: float, job_id: str, job, *args) -> None:
        """Run `job(*args)` every `seconds`, the first time a second from now; never two at once."""
        scheduler.add_job(
            guard(job, *args),
            "interval",
            seconds=seconds,
            next_run_time=first,
            id=job_id,
            max_instances=1,
            coalesce=True,
        )

    every(sweep_interval_s(hold_ttl_s), "expire_holds", expire_holds, db, 500, hold_ttl_s)
    every(60, "close_windows", close_windows, db)
    every(FOLD_EVERY_S, "fold_rollups", rollup.fold, db)
    if run_idle_s is not None:
        every(60, "expire_runs", expire_runs, db, run_idle_s)
    every(EXPIRING_EVERY_S, "expiring_tokens", alerts.expiring_tokens, db)
    every(RETENTION_EVERY_S, "sweep_responses", responses_store.sweep, db, responses_retention_days)
    if retention_days is not None:
        every(
            RETENTION_EVERY_S,
            "archive_old_events",
            retention.archive_old_events,
            db,
            retention_days,
        )
        every(RETENTION_EVERY_S, "forget_old_refusals", refusals.forget_old, db, retention_days)
        every(RETENTION_EVERY_S, "prune_alerts", alerts_retention.prune, db, retention_days)
    scheduler.start()
    return scheduler


def guard(job, *args):
    """Run a job, logging (not raising) its failure: the next interval tries again."""

    async def run() -> None:
        try:
            await job(*args)
        except Exception:
            log.exception("job %s failed; it runs again at its next interval", job.__name__)

    run.__name__ = job.__name__
    return run
