"""Login throttling per email, kept in the database so that every replica applies one count.

Each attempt is counted as a failure *before* the password is checked (a success then clears
the count), under a row lock: parallel guesses queue on the row and cannot slip past the limit.
FREE_FAILURES failures in a row are allowed; the next attempt locks the email for LOCK_BASE_S,
doubling with each further failure up to LOCK_MAX_S. While locked, every attempt (the right
password too) gets 429 `rate_limited` with `retry-after`, and is not counted, so a lock always
ends LOCK_MAX_S at most after the last counted failure. Failures are forgotten FORGET_AFTER_S
after the last one. Unknown emails are throttled the same way, so the answer never tells
whether an email exists.
"""

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from metering.auth.tokens import digest
from metering.db import Database
from metering.errors import MeteringError, retry_after
from metering.models import LoginThrottle

log = logging.getLogger("metering.auth")

FREE_FAILURES = 5
LOCK_BASE_S = 30
LOCK_MAX_S = 900
FORGET_AFTER_S = 3600


class LoginThrottled(MeteringError):
    status, code = 429, "rate_limited"


@dataclass(frozen=True, slots=True)
class Count:
    failures: int
    locked_until: datetime | None


def email_key(email: str) -> str:
    return digest("login:" + email.strip().lower())


def lock_seconds(failures: int) -> int:
    """How long the email is locked once it has `failures` failures in a row."""
    if failures < FREE_FAILURES:
        return 0
    doublings: int = 2 ** min(failures - FREE_FAILURES, 32)
    return min(LOCK_BASE_S * doublings, LOCK_MAX_S)


def count_attempt(
    failures: int, last_failure_at: datetime | None, locked_until: datetime | None, now: datetime
) -> Count:
    """The row after one more attempt, counted as a failure until the password proves right."""
    if locked_until is not None and locked_until > now:
        retry = max(1, math.ceil((locked_until - now).total_seconds()))
        raise LoginThrottled(
            f"too many failed logins for this email: retry in {retry} s",
            headers=retry_after((locked_until - now).total_seconds()),
        )
    if last_failure_at is None or now - last_failure_at >= timedelta(seconds=FORGET_AFTER_S):
        failures = 0
    failures += 1
    lock = lock_seconds(failures)
    return Count(failures, now + timedelta(seconds=lock) if lock else None)


async def admit(db: Database, key: str, now: datetime) -> None:
    """Count one login attempt for this email, or raise LoginThrottled (one short transaction)."""
    insert = pg_insert if db.dialect == "postgresql" else sqlite_insert
    async with db.transaction() as s:
        await s.execute(
            insert(LoginThrottle)
            .values(email_hash=key, failures=0, last_failure_at=None, locked_until=None)
            .on_conflict_do_nothing(index_elements=["email_hash"])
        )
        row = (
            await s.execute(
                select(LoginThrottle).where(LoginThrottle.email_hash == key).with_for_update()
            )
        ).scalar_one()
        count = count_attempt(row.failures, row.last_failure_at, row.locked_until, now)
        await s.execute(
            update(LoginThrottle)
            .where(LoginThrottle.email_hash == key)
            .values(failures=count.failures, last_failure_at=now, locked_until=count.locked_until)
        )
    if count.locked_until is not None:
        # The email's digest, not the email: enough to correlate, nothing personal in the log.
        log.warning(
            "logins for email %s locked for %d s (%d attempts without a successful login)",
            key[:12],
            lock_seconds(count.failures),
            count.failures,
        )
    await _forget_old(db, now)


async def _forget_old(db: Database, now: datetime) -> None:
    """Rows of emails nobody has tried for a while (unknown ones included) go away. Rows another
    transaction holds are skipped, so this never waits on, or deadlocks with, a login."""
    old = (
        select(LoginThrottle.email_hash)
        .where(LoginThrottle.last_failure_at < now - timedelta(seconds=FORGET_AFTER_S))
        .limit(100)
        .with_for_update(skip_locked=True)
    )
    async with db.transaction() as s:
        await s.execute(delete(LoginThrottle).where(LoginThrottle.email_hash.in_(old)))


async def clear(db_session: AsyncSession, key: str) -> None:
    """The password was right: the email starts again with no failures."""
    await db_session.execute(delete(LoginThrottle).where(LoginThrottle.email_hash == key))
