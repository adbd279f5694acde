"""Webhooks and alerts: registering receivers (with safe URLs only), listing deliveries and
events, a test delivery, and the scheduled token.expiring events."""

import json
import secrets
import uuid
from datetime import timedelta

import httpx
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from metering.alerts import record
from metering.alerts.outbox.delivery import body_of, delivery_row
from metering.alerts.targets import Reach, is_loopback, literal
from metering.db import Database, utcnow
from metering.errors import InvalidRequest, NotFound
from metering.models import (
    AlertEvent,
    ApiToken,
    Budget,
    EndUserBudget,
    Team,
    User,
    Webhook,
    WebhookAttempt,
)
from metering.models import WebhookDelivery as Delivery
from metering.timefmt import rfc3339

MAX_WEBHOOKS = 100
MAX_DELIVERIES_LISTED = 100
TEST = "webhook.test"
EXPIRING_DAYS = (7, 1)
EXPIRING_BATCH = 1000


def check_url(url: str, reach: Reach) -> str:
    """A webhook URL: https, or http to a loopback address when allowed; no user info; not a
    literal internal address `reach` refuses (a name is checked when it is resolved)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        raise InvalidRequest("url is not a valid URL", param="url") from None
    if not parsed.host:
        raise InvalidRequest("url has no host", param="url")
    if parsed.userinfo:
        raise InvalidRequest("url must not carry a user name or password", param="url")
    if parsed.scheme != "https" and not (
        parsed.scheme == "http" and reach.loopback and is_loopback(parsed.host)
    ):
        allowed = (
            "https, or http to a loopback address"
            if reach.loopback
            else "https (http only to a loopback address with METERING_WEBHOOKS_ALLOW_LOOPBACK=true)"
        )
        raise InvalidRequest(f"url must be {allowed}", param="url")
    ip = literal(parsed.host)
    reason = reach.refusal(ip) if ip is not None else None
    if reason is not None:
        raise InvalidRequest(f"url points to an internal address: {reason}", param="url")
    return str(parsed)


def webhook_out(hook: Webhook) -> dict:
    return {
        "id": hook.id,
        "url": hook.url,
        "events": json.loads(hook.events),
        "team_id": hook.team_id,
        "created_at": rfc3339(hook.created_at),
    }


async def create_webhook(
    session: AsyncSession,
    *,
    url: str,
    events: list[str],
    team_id: str | None,
    secret: str | None,
    reach: Reach,
) -> dict:
    url = check_url(url, reach)
    if team_id is not None:
        team = await session.get(Team, team_id)
        if team is None or team.deleted_at is not None:
            raise InvalidRequest(f"team {team_id} not found", param="team_id")
    live = await session.scalar(
        select(Webhook.id).where(Webhook.deleted_at.is_(None)).offset(MAX_WEBHOOKS - 1).limit(1)
    )
    if live is not None:
        raise InvalidRequest(f"at most {MAX_WEBHOOKS} webhooks: delete one first")
    hook = Webhook(
        id=f"wh_{uuid.uuid4().hex[:24]}",
        url=url,
        events=json.dumps(events),
        team_id=team_id,
        secret=secret or f"whsec_{secrets.token_hex(32)}",
        created_at=utcnow(),
    )
    session.add(hook)
    await session.flush()
    return {**webhook_out(hook), "secret": hook.secret}


async def _live(session: AsyncSession, webhook_id: str) -> Webhook:
    hook = await session.get(Webhook, webhook_id)
    if hook is None or hook.deleted_at is not None:
        raise NotFound(f"webhook {webhook_id} not found")
    return hook


async def list_webhooks(session: AsyncSession) -> list[dict]:
    hooks = await session.scalars(
        select(Webhook).where(Webhook.deleted_at.is_(None)).order_by(Webhook.created_at)
    )
    return [webhook_out(h) for h in hooks]


async def delete_webhook(session: AsyncSession, webhook_id: str) -> None:
    """Its pending deliveries stop; what was sent stays listed."""
    await _live(session, webhook_id)
    now = utcnow()
    await session.execute(update(Webhook).where(Webhook.id == webhook_id).values(deleted_at=now))
    await session.execute(
        update(Delivery)
        .where(Delivery.webhook_id == webhook_id, Delivery.status == "pending")
        .values(status="failed", next_attempt_at=None, finished_at=now, last_error="deleted")
    )


async def test_webhook(session: AsyncSession, webhook_id: str) -> dict:
    """A `webhook.test` event for this webhook only, delivered (and retried) like any other."""
    hook = await _live(session, webhook_id)
    now = utcnow()
    data = {"scope": "webhook", "subject_id": hook.id, "team_id": hook.team_id}
    row = record.event_row(TEST, f"{hook.id}:{uuid.uuid4().hex}", data, now)
    row["dispatched"] = True  # its one delivery is made here
    session.add(AlertEvent(**row))
    delivery = delivery_row(hook.id, row["id"], now)
    session.add(Delivery(**delivery))
    await session.flush()
    return {"event_id": row["id"], "delivery_id": delivery["id"]}


async def list_deliveries(session: AsyncSession, webhook_id: str, limit: int) -> list[dict]:
    await _live(session, webhook_id)
    limit = min(limit, MAX_DELIVERIES_LISTED)
    rows = (
        await session.execute(
            select(Delivery, AlertEvent.type)
            .join(AlertEvent, AlertEvent.id == Delivery.event_id)
            .where(Delivery.webhook_id == webhook_id)
            .order_by(Delivery.created_at.desc(), Delivery.id)
            .limit(limit)
        )
    ).all()
    ids = [d.id for d, _ in rows]
    history: dict[str, list[dict]] = {}
    if ids:
        attempts = await session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id.in_(ids))
            .order_by(WebhookAttempt.delivery_id, WebhookAttempt.attempt)
        )
        for a in attempts:
            history.setdefault(a.delivery_id, []).append(
                {
                    "attempt": a.attempt,
                    "at": rfc3339(a.at),
                    "status_code": a.status_code,
                    "error": a.error,
                    "duration_ms": a.duration_ms,
                }
            )
    return [
        {
            "id": d.id,
            "event_id": d.event_id,
            "event_type": event_type,
            "status": d.status,
            "attempts": d.attempts,
            "created_at": rfc3339(d.created_at),
            "next_attempt_at": rfc3339(d.next_attempt_at) if d.status == "pending" else None,
            "last_status_code": d.last_status_code,
            "last_error": d.last_error,
            "finished_at": rfc3339(d.finished_at),
            "history": history.get(d.id, []),
        }
        for d, event_type in rows
    ]


async def list_alerts(
    db: Database,
    *,
    user_id: str | None,
    scope: str | None,
    type_: str | None,
    subject_id: str | None,
    limit: int,
) -> list[dict]:
    """Recent events, newest first; `user_id`: only that user's own (its user and tokens)."""
    query = select(AlertEvent).where(AlertEvent.type != TEST)
    if user_id is not None:
        query = query.where(AlertEvent.user_id == user_id)
    if scope is not None:
        query = query.where(AlertEvent.scope == scope)
    if type_ is not None:
        query = query.where(AlertEvent.type == type_)
    if subject_id is not None:
        query = query.where(AlertEvent.subject_id == subject_id)
    query = query.order_by(AlertEvent.created_at.desc(), AlertEvent.id.desc()).limit(limit)
    async with db.reads() as session:
        events = list(await session.scalars(query))
        names = await _end_users(session, {e.subject_id for e in events if e.scope == "end_user"})
    out = [json.loads(body_of(e)) for e in events]
    for event in out:
        data = event["data"]
        if data.get("scope") == "end_user" and not data.get("end_user"):
            data["end_user"] = names.get(data["subject_id"])
    return out


async def _end_users(session: AsyncSession, subject_ids: set[str]) -> dict[str, str]:
    """The end user's own id (as its client sent it) of each end-user budget's subject id:
    an alert stores the subject id, a hash no reader can place."""
    if not subject_ids:
        return {}
    rows = await session.execute(
        select(EndUserBudget.subject_id, EndUserBudget.end_user).where(
            EndUserBudget.subject_id.in_(subject_ids)
        )
    )
    return {row.subject_id: row.end_user for row in rows}


async def expiring_tokens(db: Database) -> int:
    """token.expiring, 7 days and 1 day before a live token's expires_at: once per token and
    threshold (a changed expiry arms them again)."""
    now = utcnow()
    rows = (
        await _expiring(db, now, now + timedelta(days=max(EXPIRING_DAYS))) if EXPIRING_DAYS else []
    )
    events = []
    for row in rows:
        left = row.expires_at - now
        for days in EXPIRING_DAYS:
            if left > timedelta(days=days):
                continue
            key = f"{row.id}:{days}d:{rfc3339(row.expires_at)}"
            figures = record.Figures(
                "token",
                row.id,
                row.team_id,
                row.credit_limit,
                row.spent or 0,
                row.reserved or 0,
                None,
            )
            data = figures.data(expires_at=rfc3339(row.expires_at), days_before=days)
            events.append(
                record.event_row(record.TOKEN_EXPIRING, key, data, now, user_id=row.user_id)
            )
    if not events:
        return 0
    async with db.begin() as conn:
        return await record.write(conn, events)


async def _expiring(db: Database, now, until) -> list:
    async with db.sessions() as session:
        return list(
            await session.execute(
                select(
                    ApiToken.id,
                    ApiToken.user_id,
                    ApiToken.expires_at,
                    User.team_id,
                    Budget.credit_limit,
                    Budget.spent,
                    Budget.reserved,
                )
                .join(User, User.id == ApiToken.user_id)
                .outerjoin(Budget, Budget.subject_id == ApiToken.id)
                .where(
                    ApiToken.revoked_at.is_(None),
                    ApiToken.expires_at > now,
                    ApiToken.expires_at <= until,
                )
                .order_by(ApiToken.expires_at)
                .limit(EXPIRING_BATCH)
            )
        )
