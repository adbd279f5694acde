"""POST /v1/events: usage from outside the proxy, recorded exactly once.

Each event carries an idempotency key, unique per team (the team it is charged to: one team
can neither collide with nor learn of another's keys) and kept for good in `ingested_keys`
with the event it made and a digest of what was sent. A batch is written in one transaction:
the keys are inserted first (ON CONFLICT DO NOTHING, in key order, so concurrent batches on
any number of replicas queue on the same rows instead of deadlocking); a key that was already
there answers `duplicate` (same digest) or `conflict` (another), and changes nothing. The new
events are appended through the ledger (rollups in the same transaction) and charged to the
budget window each falls in (metering.budgets.service.charge_dated). Should the batch's
transaction fail, each event is written alone, so one event never costs the others theirs.
"""

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, tuple_
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from metering.auth.service import Principal
from metering.budgets.service import Dated, charge_dated
from metering.db import Database, dialect_name, utcnow
from metering.ledger import writer
from metering.ledger.charge import Usage
from metering.ledger.event import DETAIL_FIELDS, Event
from metering.ledger.prices import PriceBook
from metering.ledger.records import ingested_event
from metering.models import ApiToken, IngestedKey, User
from metering.settings import Catalog
from metering.timefmt import parse_rfc3339

MAX_BATCH = 1_000
MAX_AGE = timedelta(days=35)  # the oldest occurred_at taken
MAX_AHEAD = timedelta(minutes=5)  # a client's clock ahead of ours
MAX_KEY_CHARS = 200
COUNT_CEILING = 10**9  # tokens in one count
FIELDS = frozenset(
    (
        "idempotency_key",
        "model",
        "provider",
        "token_id",
        "user_id",
        "team_id",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "completion_tokens_details",
        "occurred_at",
    )
)


class Rejected(ValueError):
    """An event that cannot be recorded, and why."""


@dataclass(slots=True)
class Item:
    """One event of a batch as it goes: what was sent, then what it became."""

    key: str | None
    status: str | None = None
    event_id: str | None = None
    error: str | None = None
    event: Event | None = None
    team_id: str | None = None
    digest: str | None = None
    stored: str | None = None  # the digest recorded under the key

    def out(self) -> dict:
        out = {"idempotency_key": self.key, "status": self.status, "event_id": self.event_id}
        if self.error is not None:
            out["error"] = self.error
        return out


def _count(raw: dict, name: str, required: bool = True) -> int | None:
    value = raw.get(name)
    if value is None:
        if required:
            raise Rejected(f"{name} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Rejected(f"{name} must be a whole number")
    if not 0 <= value <= COUNT_CEILING:
        raise Rejected(f"{name} must be between 0 and {COUNT_CEILING}")
    return value


def _text(raw: dict, name: str, limit: int, required: bool = False) -> str | None:
    value = raw.get(name)
    if value is None:
        if required:
            raise Rejected(f"{name} is required")
        return None
    if not isinstance(value, str) or not value or len(value) > limit or "\x00" in value:
        raise Rejected(f"{name} must be a non-empty string of at most {limit} characters")
    return value


def _key(raw) -> str | None:
    if not isinstance(raw, dict):
        return None
    value = raw.get("idempotency_key")
    return value if isinstance(value, str) and 0 < len(value) <= MAX_KEY_CHARS else None


def _usage(raw: dict) -> Usage:
    prompt = _count(raw, "prompt_tokens")
    completion = _count(raw, "completion_tokens")
    cached = _count(raw, "cached_tokens", required=False) or 0
    if cached > prompt:
        raise Rejected("cached_tokens must be at most prompt_tokens")
    details = raw.get("completion_tokens_details")
    if details is None:
        details = {}
    if not isinstance(details, dict):
        raise Rejected("completion_tokens_details must be an object")
    unknown = set(details) - set(DETAIL_FIELDS)
    if unknown:
        raise Rejected(f"completion_tokens_details: unknown field {sorted(unknown)[0]!r}")
    counts = {name: _count(details, name, required=False) for name in DETAIL_FIELDS}
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        cached_tokens=cached,
        **counts,
    )


def _occurred_at(raw: dict, now: datetime) -> datetime | None:
    text = _text(raw, "occurred_at", 64)
    if text is None:
        return None
    try:
        value = parse_rfc3339(text)
    except ValueError:
        raise Rejected("occurred_at must be an RFC 3339 timestamp with its zone") from None
    if value < now - MAX_AGE:
        raise Rejected(f"occurred_at is more than {MAX_AGE.days} days back")
    if value > now + MAX_AHEAD:
        raise Rejected("occurred_at is in the future")
    return value


def _digest(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _an_id(value) -> bool:
    """An id worth looking up (anything else is rejected when its event is checked)."""
    return isinstance(value, str) and 0 < len(value) <= 40 and "\x00" not in value


async def _owners(session, raws: list[dict]) -> tuple[dict, dict]:
    """token id -> user id, user id -> team id, for the ids the batch names."""
    tokens = {r["token_id"] for r in raws if _an_id(r.get("token_id"))}
    users = {r["user_id"] for r in raws if _an_id(r.get("user_id"))}
    token_users: dict[str, str] = {}
    if tokens:
        rows = await session.execute(
            select(ApiToken.id, ApiToken.user_id).where(ApiToken.id.in_(sorted(tokens)))
        )
        token_users = {row.id: row.user_id for row in rows}
    users |= set(token_users.values())
    user_teams: dict[str, str] = {}
    if users:
        rows = await session.execute(
            select(User.id, User.team_id).where(User.id.in_(sorted(users)))
        )
        user_teams = {row.id: row.team_id for row in rows}
    return token_users, user_teams


def _who(raw: dict, principal: Principal, token_users: dict, user_teams: dict) -> tuple:
    token_id = _text(raw, "token_id", 40)
    user_id = _text(raw, "user_id", 40)
    team_id = _text(raw, "team_id", 40)
    if not principal.is_admin:
        # A user's credential records its own usage only: its ids fill the event.
        for name, value, own in (
            ("token_id", token_id, principal.token_id),
            ("user_id", user_id, principal.user_id),
            ("team_id", team_id, principal.team_id),
        ):
            if value is not None and value != own:
                raise Rejected(f"{name}: this credential records its own usage only")
        return principal.token_id, principal.user_id, principal.team_id
    if token_id is not None:
        owner = token_users.get(token_id)
        if owner is None:
            raise Rejected(f"token_id {token_id!r} not found")
        if user_id is not None and user_id != owner:
            raise Rejected("user_id is not the token's user")
        user_id = owner
    if user_id is None:
        raise Rejected("user_id or token_id is required")
    team = user_teams.get(user_id)
    if team is None:
        raise Rejected(f"user_id {user_id!r} not found")
    if team_id is not None and team_id != team:
        raise Rejected("team_id is not the user's team")
    return token_id, user_id, team


def _prepare(item: Item, raw, ctx: dict) -> None:
    """Check one event and make the ledger event it would record (priced at its moment)."""
    if not isinstance(raw, dict):
        raise Rejected("each event must be an object")
    unknown = set(raw) - FIELDS
    if unknown:
        raise Rejected(f"unknown field {sorted(unknown)[0]!r}")
    if item.key is None:
        raise Rejected(f"idempotency_key must be a non-empty string of at most {MAX_KEY_CHARS}")
    if "\x00" in item.key:
        raise Rejected("idempotency_key must not hold NUL")
    model = _text(raw, "model", 200, required=True)
    routes = ctx["catalog"].routes(model)
    if not routes:
        raise Rejected(f"model {model!r} is not in the catalog")
    provider = _text(raw, "provider", 100)
    route = (
        routes[0] if provider is None else next((r for r in routes if r.provider == provider), None)
    )
    if route is None:
        raise Rejected(f"provider {provider!r} does not offer {model!r}")
    usage = _usage(raw)
    now = ctx["now"]
    given_at = _occurred_at(raw, now)
    token_id, user_id, team_id = _who(raw, ctx["principal"], *ctx["owners"])
    at = given_at or now
    row = ctx["prices"].at(route.name, route.provider, at)
    if row is None:  # nothing recorded from then: the catalog's price
        prices = (route.input_micro, route.cached_micro, route.output_micro)
        upstream_model = route.upstream_model
    else:
        prices, upstream_model = row.prices, row.upstream_model
    item.team_id = team_id
    item.digest = _digest(
        {
            "model": route.name,
            "provider": route.provider,
            "who": [token_id, user_id, team_id],
            "usage": [
                usage.prompt_tokens,
                usage.cached_tokens,
                usage.completion_tokens,
                *(getattr(usage, name) for name in DETAIL_FIELDS),
            ],
            "occurred_at": given_at.isoformat() if given_at else None,
        }
    )
    item.event = ingested_event(
        token_id=token_id,
        user_id=user_id,
        team_id=team_id,
        model=route.name,
        provider=route.provider,
        upstream_model=upstream_model,
        usage=usage,
        prices=prices,
        occurred_at=at,
    )


def _insert_keys(conn):
    insert = pg_insert if dialect_name(conn) == "postgresql" else sqlite_insert
    table = IngestedKey.__table__
    return (
        insert(table)
        .on_conflict_do_nothing(index_elements=["team_id", "idempotency_key"])
        .returning(table.c.team_id, table.c.idempotency_key)
    )


def _subjects(event: Event) -> list[str]:
    return [s for s in (event.token_id, event.user_id, event.team_id) if s]


async def _write(db: Database, items: list[Item], now: datetime) -> None:
    """Record the new events of `items` (first of their key in the batch) in one transaction;
    set each item's status."""
    table = IngestedKey.__table__
    ordered = sorted(items, key=lambda i: (i.team_id, i.key))
    async with db.begin() as conn:
        rows = [
            {
                "team_id": i.team_id,
                "idempotency_key": i.key,
                "event_id": i.event.id,
                "digest": i.digest,
                "created_at": now,
            }
            for i in ordered
        ]
        # RETURNING names the keys inserted (in no promised order: a set).
        result = await conn.execute(_insert_keys(conn).values(rows))
        inserted = {(row.team_id, row.idempotency_key) for row in result}
        new = [i for i in ordered if (i.team_id, i.key) in inserted]
        seen = [i for i in ordered if (i.team_id, i.key) not in inserted]
        if seen:
            wanted = sorted({(i.team_id, i.key) for i in seen})
            found = await conn.execute(
                select(
                    table.c.team_id, table.c.idempotency_key, table.c.event_id, table.c.digest
                ).where(tuple_(table.c.team_id, table.c.idempotency_key).in_(wanted))
            )
            known = {(r.team_id, r.idempotency_key): r for r in found}
            for item in seen:
                row = known[(item.team_id, item.key)]
                item.event_id, item.stored = row.event_id, row.digest
                item.status = "duplicate" if row.digest == item.digest else "conflict"
                if item.status == "conflict":
                    item.error = "this idempotency_key was recorded with other content"
        if new:
            events = [i.event for i in new]
            await writer.append_many(conn, events)
            await charge_dated(
                conn,
                [Dated(_subjects(e), e.created_at, e.cost, e.team_id, e.user_id) for e in events],
                now,
            )
        for item in new:
            item.status, item.event_id, item.stored = "created", item.event.id, item.digest


async def ingest(db: Database, catalog: Catalog, principal: Principal, raws: list) -> list[dict]:
    """Record a batch; one answer per event, in the order sent."""
    now = utcnow()
    items = [Item(_key(raw)) for raw in raws]
    dicts = [raw for raw in raws if isinstance(raw, dict)]
    async with db.reads() as session:
        owners = await _owners(session, dicts) if principal.is_admin else ({}, {})
        sent = (raw.get("model") for raw in dicts)
        models = {m for m in sent if isinstance(m, str) and m in catalog.models}
        prices = await PriceBook.load(session, models)
    ctx = {"catalog": catalog, "principal": principal, "now": now, "owners": owners}
    ctx["prices"] = prices
    firsts: dict[tuple[str, str], Item] = {}
    later: list[Item] = []
    for item, raw in zip(items, raws, strict=True):
        try:
            _prepare(item, raw, ctx)
        except Rejected as exc:
            item.status, item.error = "rejected", str(exc)
            continue
        first = firsts.get((item.team_id, item.key))
        if first is None:
            firsts[(item.team_id, item.key)] = item
        else:
            later.append(item)  # the same key again in this batch: compared with the first
    new = list(firsts.values())
    if new:
        try:
            await _write(db, new, now)
        except Exception:
            # One at a time: an event that cannot be written costs the others nothing.
            for item in new:
                item.status = None
                try:
                    await _write(db, [item], now)
                except Exception:
                    item.status, item.event_id = "rejected", None
                    item.error = "the event could not be recorded; send it again"
    for item in later:
        first = firsts[(item.team_id, item.key)]
        if first.stored is not None:
            item.event_id = first.event_id
            same = item.digest == first.stored
            item.status = "duplicate" if same else "conflict"
            if not same:
                item.error = "this idempotency_key was recorded with other content"
        else:
            item.status, item.error = first.status, first.error
    return [item.out() for item in items]
