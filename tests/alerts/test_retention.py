"""Retention of the outbox: finished deliveries older than METERING_RETENTION_DAYS go with their
attempts, then the events no delivery names; a pending delivery stays, with its event, and so
does an event whose key could be written again (a budget's window still open)."""

import asyncio
import uuid
from datetime import timedelta
from decimal import Decimal

from sqlalchemy import func, select

from metering import jobs
from metering.alerts.record import rearms_until
from metering.alerts.retention import prune
from metering.db import Database, utcnow
from metering.models import AlertEvent, WebhookAttempt
from metering.timefmt import parse_rfc3339
from tests.alerts.conftest import alerts, ask, hold, hold_of, new_path, wait_for

RESET = "budget.window_reset"
CROSSED = "budget.threshold_crossed"


def tag() -> str:
    return f"t{uuid.uuid4().hex[:16]}"


def _deliveries(api, webhook_id: str) -> list[dict]:
    return api.ok("GET", f"/v1/webhooks/{webhook_id}/deliveries")["data"]


def _prune(url: str, days: int, later: timedelta) -> tuple[int, int]:
    async def run():
        db = Database(url, 2)
        try:
            return await prune(db, days, now=utcnow() + later)
        finally:
            await db.dispose()

    return asyncio.run(run())


def _count(url: str, query) -> int:
    async def run():
        db = Database(url, 2)
        try:
            async with db.begin() as conn:
                return (await conn.execute(query)).scalar_one()
        finally:
            await db.dispose()

    return asyncio.run(run())


def _events(url: str, event_id: str) -> int:
    return _count(url, select(func.count()).where(AlertEvent.id == event_id))


def test_old_finished_deliveries_and_their_events_are_pruned(alerts_db, alerts_api, receiver):
    api = alerts_api
    team = api.team()
    # Delivered at the first attempt.
    done = hold(api, receiver.url(new_path()), [RESET], team["id"])
    sent = api.ok("POST", f"/v1/webhooks/{done['id']}/test", 202)
    wait_for(
        lambda: [d for d in _deliveries(api, done["id"]) if d["status"] == "delivered"],
        message="the delivery",
    )
    # Refused at every attempt (nothing listens on port 1): pending, retried for a day.
    stuck = hold(api, "http://127.0.0.1:1/hook", [RESET], team["id"])
    pending = api.ok("POST", f"/v1/webhooks/{stuck['id']}/test", 202)
    wait_for(
        lambda: [d for d in _deliveries(api, stuck["id"]) if d["attempts"] >= 1],
        message="a failed attempt",
    )
    # Thresholds crossed in a budget that never resets and in one whose day ends.
    cost = Decimal(hold_of(api, tag()))
    _, _, forever = api.principal(token_limit=str(cost * 3 / 2))
    _, _, daily = api.principal(token_limit=str(cost * 3 / 2), interval="1d")
    ask(api, forever["token"], tag())
    ask(api, daily["token"], tag())
    (kept,) = alerts(api, subject_id=forever["id"], type=CROSSED)
    (gone,) = alerts(api, subject_id=daily["id"], type=CROSSED)

    undispatched = select(func.count()).where(AlertEvent.dispatched.is_(False))
    wait_for(lambda: _count(alerts_db, undispatched) == 0, message="the events fanned out")

    # Nothing is a day old yet.
    assert _prune(alerts_db, 1, timedelta(0)) == (0, 0)
    assert _deliveries(api, done["id"]) and _events(alerts_db, sent["event_id"]) == 1

    # Thirty days on, with one day kept.
    deliveries, events = _prune(alerts_db, 1, timedelta(days=30))
    assert deliveries >= 1 and events >= 2
    assert _deliveries(api, done["id"]) == []
    delivered = select(func.count()).where(WebhookAttempt.delivery_id == sent["delivery_id"])
    assert _count(alerts_db, delivered) == 0
    assert _events(alerts_db, sent["event_id"]) == 0
    assert _events(alerts_db, gone["id"]) == 0
    # The pending delivery stays, with its attempts and its event.
    (still,) = _deliveries(api, stuck["id"])
    assert still["id"] == pending["delivery_id"] and still["status"] == "pending"
    assert still["history"] and _events(alerts_db, pending["event_id"]) == 1
    # A never-resetting budget's crossing stays: its key would let it be recorded again.
    assert [e["id"] for e in alerts(api, subject_id=forever["id"], type=CROSSED)] == [kept["id"]]


def test_an_event_stays_while_its_key_could_come_back():
    ends = "2027-01-01T00:00:00.000000Z"
    for type_ in (CROSSED, "budget.soft_limit_reached", "budget.exhausted"):
        assert rearms_until(type_, {"resets_at": None}) is None
        assert rearms_until(type_, {"resets_at": ends}) == parse_rfc3339(ends)
    assert rearms_until("token.expiring", {"expires_at": ends}) == parse_rfc3339(ends)
    for type_ in (RESET, "reconciliation.differs", "webhook.test"):
        assert rearms_until(type_, {"resets_at": None}) < utcnow()


def test_the_outbox_is_pruned_only_with_a_retention_setting(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'jobs.db'}")

    async def scheduled(retention_days):
        scheduler = jobs.start_scheduler(db, 900, retention_days)
        try:
            return {job.id for job in scheduler.get_jobs()}
        finally:
            scheduler.shutdown(wait=False)

    assert "prune_alerts" in asyncio.run(scheduled(7))
    assert "prune_alerts" not in asyncio.run(scheduled(None))
