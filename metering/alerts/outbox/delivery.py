"""The outbox worker: every replica runs one. It fans new alert events out to the webhooks that
want them (one delivery row per event and webhook), claims deliveries that are due, POSTs them
and records each attempt.

No event is sent twice at once: a delivery is claimed in one transaction that picks due rows
with FOR UPDATE SKIP LOCKED (PostgreSQL) and sets `claimed_until` on those still unclaimed (so
on SQLite too, with one writer). At most `per_webhook` go to one webhook at once. A
replica that dies holding a claim leaves it to expire, and another sends it: delivery is at
least once, and `x-metering-event-id` lets a receiver drop a repeat. No database connection is
held while a receiver answers, and the worker has its own HTTP client (timeouts, no redirects,
a bounded pool): a receiver that hangs or fails costs the proxy nothing. Its connections reach
only the addresses the webhook settings allow (metering.alerts.targets), checked as each is
opened: a delivery whose host points to an internal address is failed at once, never sent.
"""

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from metering.alerts import signature
from metering.alerts.outbox.transport import GuardedTransport
from metering.alerts.targets import Reach, Refused
from metering.db import Database, utcnow
from metering.models import AlertEvent, Webhook, WebhookAttempt, WebhookDelivery
from metering.timefmt import rfc3339

log = logging.getLogger("metering.alerts")

BATCH = 100  # events fanned out, or deliveries claimed, per pass
EXCERPT_CHARS = 200  # of a receiver's answer kept (and shown) per attempt
READ_BYTES = 1024  # of a receiver's answer read at most
CLAIM_MARGIN_S = 30.0  # a claim outlives one POST's timeout by this much


@dataclass(frozen=True, slots=True)
class Policy:
    """Retries: the first after `base_s`, doubling, at most `max_s` apart, for `retry_for_s`."""

    base_s: float = 1.0
    max_s: float = 3600.0
    retry_for_s: float = 86400.0

    def next_attempt(self, attempts: int, created_at: datetime, now: datetime) -> datetime | None:
        """When to try again after `attempts` failed ones; None: give up (failed)."""
        delay = min(self.base_s * 2 ** min(attempts - 1, 40), self.max_s)
        at = now + timedelta(seconds=delay)
        return None if at > created_at + timedelta(seconds=self.retry_for_s) else at


def wants(hook, event) -> bool:
    """Whether a webhook takes an event: its type listed, and its team (or any, when global)."""
    types = json.loads(hook.events)
    return event.type in types and (hook.team_id is None or hook.team_id == event.team_id)


def body_of(event) -> bytes:
    """A delivery's body: the same bytes on every attempt."""
    payload = {
        "id": event.id,
        "type": event.type,
        "created_at": rfc3339(event.created_at),
        "data": json.loads(event.data),
    }
    return json.dumps(payload, separators=(",", ":")).encode()


def excerpt(raw: bytes) -> str:
    """A short, printable excerpt of a receiver's answer: never more is kept or shown."""
    text = raw.decode("utf-8", errors="replace")
    text = "".join(c if c.isprintable() else " " for c in text)
    return text[:EXCERPT_CHARS]


def _insert(db: Database):
    return pg_insert if db.dialect == "postgresql" else sqlite_insert


def delivery_row(webhook_id: str, event_id: str, now: datetime) -> dict:
    return {
        "id": f"dlv_{uuid.uuid4().hex}",
        "webhook_id": webhook_id,
        "event_id": event_id,
        "status": "pending",
        "attempts": 0,
        "created_at": now,
        "next_attempt_at": now,
    }


async def dispatch(db: Database) -> int:
    """Fan out events not yet dispatched: a delivery for each webhook that wants it."""
    now = utcnow()
    query = (
        select(AlertEvent.id, AlertEvent.type, AlertEvent.team_id)
        .where(AlertEvent.dispatched.is_(False))
        .order_by(AlertEvent.created_at)
        .limit(BATCH)
        .with_for_update(skip_locked=True)
    )
    async with db.begin() as conn:
        events = (await conn.execute(query)).all()
        if not events:
            return 0
        hooks = (
            await conn.execute(
                select(Webhook.id, Webhook.events, Webhook.team_id).where(
                    Webhook.deleted_at.is_(None)
                )
            )
        ).all()
        rows = [delivery_row(h.id, e.id, now) for e in events for h in hooks if wants(h, e)]
        if rows:
            insert = _insert(db)(WebhookDelivery.__table__).values(rows)
            await conn.execute(insert.on_conflict_do_nothing())
        await conn.execute(
            update(AlertEvent.__table__)
            .where(AlertEvent.id.in_([e.id for e in events]))
            .values(dispatched=True)
        )
    return len(events)


def _due(now: datetime, full: list[str], limit: int):
    """Due deliveries not claimed by anyone, of webhooks not at their cap here (`full`)."""
    query = select(WebhookDelivery.id, WebhookDelivery.webhook_id).where(
        WebhookDelivery.status == "pending",
        WebhookDelivery.next_attempt_at <= now,
        (WebhookDelivery.claimed_until.is_(None)) | (WebhookDelivery.claimed_until < now),
    )
    if full:
        query = query.where(WebhookDelivery.webhook_id.not_in(full))
    return (
        query.order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def pick(due: Sequence[Any], room: int, per_webhook: int, busy: dict[str, int]) -> list[str]:
    """Of the due (id, webhook_id) rows in order, the ones to send: at most `room` in all and
    at most `per_webhook` in flight to one webhook, counting the `busy` ones already sent."""
    taken: dict[str, int] = {}
    ids: list[str] = []
    for row in due:
        if len(ids) >= room:
            break
        count = busy.get(row.webhook_id, 0) + taken.get(row.webhook_id, 0)
        if count < per_webhook:
            taken[row.webhook_id] = taken.get(row.webhook_id, 0) + 1
            ids.append(row.id)
    return ids


@dataclass(slots=True)
class Claimed:
    id: str
    webhook_id: str
    created_at: datetime
    url: str
    secret: str
    event_id: str
    body: bytes


async def claim(
    db: Database,
    limit: int,
    claim_s: float,
    per_webhook: int | None = None,
    busy: dict[str, int] | None = None,
) -> tuple[list[Claimed], bool]:
    """Take up to `limit` due deliveries for this replica (no other takes them meanwhile), at
    most `per_webhook` in flight to one webhook with the `busy` ones. Also says whether due
    deliveries were left for a webhook's cap (a next pass, without that webhook, takes others).
    """
    busy = busy or {}
    per_webhook = per_webhook or limit
    now = utcnow()
    until = now + timedelta(seconds=claim_s)
    full = sorted(w for w, n in busy.items() if n >= per_webhook)
    async with db.begin() as conn:
        due = (await conn.execute(_due(now, full, max(limit, BATCH)))).all()
        chosen = pick(due, limit, per_webhook, busy)
        if not chosen:
            return [], False
        # Still unclaimed (SQLite has no row locks: another replica may have claimed some).
        claimed = update(WebhookDelivery.__table__).where(
            WebhookDelivery.id.in_(chosen),
            WebhookDelivery.status == "pending",
            (WebhookDelivery.claimed_until.is_(None)) | (WebhookDelivery.claimed_until < now),
        )
        ids = list(
            (
                await conn.execute(
                    claimed.values(claimed_until=until).returning(WebhookDelivery.id)
                )
            ).scalars()
        )
        if not ids:
            return [], False
        rows = (
            await conn.execute(
                select(
                    WebhookDelivery.id,
                    WebhookDelivery.webhook_id,
                    WebhookDelivery.created_at,
                    Webhook.url,
                    Webhook.secret,
                    AlertEvent.id.label("event_id"),
                    AlertEvent.type,
                    AlertEvent.created_at.label("event_at"),
                    AlertEvent.data,
                )
                .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
                .join(AlertEvent, AlertEvent.id == WebhookDelivery.event_id)
                .where(WebhookDelivery.id.in_(ids))
            )
        ).all()
    left = len(chosen) < min(len(due), limit)
    return [
        Claimed(
            id=r.id,
            webhook_id=r.webhook_id,
            created_at=r.created_at,
            url=r.url,
            secret=r.secret,
            event_id=r.event_id,
            body=body_of(
                AlertEvent(id=r.event_id, type=r.type, created_at=r.event_at, data=r.data)
            ),
        )
        for r in rows
    ], left


@dataclass(frozen=True, slots=True)
class Answer:
    status_code: int | None
    error: str | None
    duration_ms: int
    final: bool = False  # refused before sending: not tried again

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


async def post(client: httpx.AsyncClient, delivery: Claimed) -> Answer:
    """One attempt: the signed POST, its status and a short excerpt of anything else."""
    headers = {
        "content-type": "application/json",
        "user-agent": "metering-webhooks/1",
        signature.HEADER: signature.sign(delivery.secret, delivery.body),
        signature.EVENT_ID_HEADER: delivery.event_id,
    }
    started = time.monotonic()
    try:
        async with client.stream("POST", delivery.url, content=delivery.body, headers=headers) as r:
            raw = b""
            if not 200 <= r.status_code < 300:
                async for chunk in r.aiter_raw():
                    raw += chunk
                    if len(raw) >= READ_BYTES:
                        break
            error = None if 200 <= r.status_code < 300 else f"HTTP {r.status_code}"
            if raw:
                error = f"{error}: {excerpt(raw)}"
            if r.is_redirect:
                error = f"HTTP {r.status_code}: redirects are not followed"
            return Answer(r.status_code, error, _ms(started))
    except Refused as exc:
        return Answer(None, excerpt(f"not sent: {exc}".encode()), _ms(started), final=True)
    except httpx.TimeoutException:
        return Answer(None, "timed out", _ms(started))
    except httpx.HTTPError as exc:
        return Answer(None, excerpt(f"{type(exc).__name__}: {exc}".encode()), _ms(started))


def _ms(started: float) -> int:
    return min(int((time.monotonic() - started) * 1000), 2**31 - 1)


async def finish(db: Database, delivery: Claimed, answer: Answer, policy: Policy) -> str:
    """Record an attempt and what follows: delivered, another try later, or failed."""
    now = utcnow()
    async with db.begin() as conn:
        attempts = (
            await conn.execute(
                update(WebhookDelivery.__table__)
                .where(WebhookDelivery.id == delivery.id)
                .values(attempts=WebhookDelivery.attempts + 1)
                .returning(WebhookDelivery.attempts)
            )
        ).scalar_one()
        await conn.execute(
            _insert(db)(WebhookAttempt.__table__)
            .values(
                delivery_id=delivery.id,
                attempt=attempts,
                at=now,
                status_code=answer.status_code,
                error=answer.error,
                duration_ms=answer.duration_ms,
            )
            .on_conflict_do_nothing()
        )
        if answer.ok:
            status, next_at = "delivered", None
        elif answer.final:
            status, next_at = "failed", None
        else:
            next_at = policy.next_attempt(attempts, delivery.created_at, now)
            status = "pending" if next_at is not None else "failed"
        await conn.execute(
            update(WebhookDelivery.__table__)
            .where(WebhookDelivery.id == delivery.id)
            .values(
                status=status,
                next_attempt_at=next_at,
                claimed_until=None,
                last_status_code=answer.status_code,
                last_error=answer.error,
                finished_at=None if status == "pending" else now,
            )
        )
    return status


def cap_of(per_webhook: int, concurrency: int) -> int:
    """Deliveries in flight to one webhook: at most `per_webhook`, and fewer than all the
    slots, so a receiver that hangs always leaves one to the others (none with one slot)."""
    return max(1, min(per_webhook, concurrency - 1))


class Outbox:
    """The worker of one replica: a pass every `poll_s` (at once when poked, or while there is
    more to do), sends at most `concurrency` at a time and at most `per_webhook` of them to
    one webhook, only to the addresses `reach` allows."""

    def __init__(
        self,
        db: Database,
        *,
        poll_s: float = 1.0,
        timeout_s: float = 10.0,
        concurrency: int = 16,
        per_webhook: int = 4,
        policy: Policy | None = None,
        reach: Reach | None = None,
    ) -> None:
        self.db = db
        self.poll_s = poll_s
        self.concurrency = concurrency
        self.per_webhook = cap_of(per_webhook, concurrency)
        self.policy = policy or Policy()
        self.timeout_s = timeout_s
        self.claim_s = timeout_s + CLAIM_MARGIN_S
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            follow_redirects=False,
            trust_env=False,
            transport=GuardedTransport(
                reach or Reach(),
                httpx.Limits(max_connections=concurrency, max_keepalive_connections=4),
            ),
        )
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Deliveries being sent: a receiver that hangs holds its slot until its timeout, never
        # the pass that claimed it, so the others go on being claimed and sent.
        self._sending: set[asyncio.Task] = set()
        # How many of them go to each webhook (no key for a webhook with none).
        self._busy: dict[str, int] = {}
        self.sent = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def poke(self) -> None:
        """Look for work now (an event was just written here)."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()  # a poke from here on wakes the wait below
            busy = False
            try:
                busy = await self.run_once()
            except Exception:
                log.warning("webhook delivery pass failed; trying again", exc_info=True)
            if busy:
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def run_once(self) -> bool:
        """One pass: fan out, then claim as many due deliveries as there are free slots and
        start sending them (a webhook at its cap waits for its own to finish). True when there
        may be more to do at once."""
        dispatched = await dispatch(self.db)
        room = self.concurrency - len(self._sending)
        claimed, left = (
            await claim(self.db, room, self.claim_s, self.per_webhook, self._busy)
            if room > 0
            else ([], False)
        )
        loop = asyncio.get_running_loop()
        for delivery in claimed:
            task = loop.create_task(self._deliver(delivery))
            self._sending.add(task)
            self._busy[delivery.webhook_id] = self._busy.get(delivery.webhook_id, 0) + 1
            task.add_done_callback(functools.partial(self._sent, delivery.webhook_id))
        full = room > 0 and len(claimed) >= room
        return dispatched >= BATCH or full or (left and len(claimed) > 0)

    def _sent(self, webhook_id: str, task: asyncio.Task) -> None:
        self._sending.discard(task)
        count = self._busy.get(webhook_id, 0) - 1
        if count > 0:
            self._busy[webhook_id] = count
        else:
            self._busy.pop(webhook_id, None)
        self.poke()  # a slot is free

    async def _deliver(self, delivery: Claimed) -> None:
        started = time.monotonic()
        try:
            # A receiver trickling bytes cannot stretch one attempt past its timeout either.
            answer = await asyncio.wait_for(post(self.client, delivery), self.timeout_s + 1)
        except TimeoutError:
            answer = Answer(None, "timed out", _ms(started))
        self.sent += 1
        try:
            await finish(self.db, delivery, answer, self.policy)
        except Exception:  # its claim expires and it is sent again: at least once
            log.warning("could not record delivery %s", delivery.id, exc_info=True)

    async def close(self) -> None:
        for task in list(self._sending):
            task.cancel()  # its claim expires and another replica sends it
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.client.aclose()
