"""POST /v1/events: usage from outside the proxy, recorded exactly once.

Each event carries an idempotency key, unique per team (the team it is charged to: one team
can neither collide with nor learn of another's keys) and kept for good in `ingested_keys`
with the event it made and a digest of what was sent. A batch is written in one transaction:
the keys are inserted first (ON CONFLICT DO NOTHING, in key order, so concurrent batches on
any number of replicas queue on the same rows instead of deadlocking); a key that was already
there answers `duplicate` (same digest) or `conflict` (another), and changes nothing. The new
events are appended through the ledger (their rollup increments in the same transaction) and
charged to the budget window each falls in (metering.budgets.dated.charge_dated).

Who reports decides what is checked. The admin key and a team's ingestion key report usage
that already happened: it is charged in full (an ingestion key only for its own team). A user's
own credential reports usage of its own, admitted like a proxied request of that credential:
its model allow-lists, its rpm and tpm (each event one request and its tokens) and its credit
at token, user, team (and run) scope; an event that does not fit answers `rejected` with the
`reason` and the `scope`, is recorded as a refusal and is never charged. No event, whoever
reports it, may take a counter past its ceiling (metering.budgets.dated.fit,
metering.ledger.rollup.overflowing): such an event is `rejected` too. Should the batch's
transaction fail, each event is written alone, so one event never costs the others theirs; an
event that could not be written then answers `retry`: sending it again is safe.
"""

import hashlib
import json
import logging
from dataclasses import dataclass, replace
from datetime import datetime

from sqlalchemy import bindparam, delete, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from metering.auth.service import Principal
from metering.billing.fields import Rejected, attributed, occurred_at, text_of, usage_of
from metering.budgets import rates
from metering.budgets.dated import Dated, Unfit, charge_dated, fit
from metering.budgets.rates import AdmissionQueue, RateClaim, RateLimited
from metering.budgets.refusals import RefusalLog, Refused
from metering.budgets.runs import RunKey, UnknownRun
from metering.db import Database, dialect_name, utcnow
from metering.ids import time_ordered
from metering.ledger import rollup, writer
from metering.ledger.attribution import NO_TAGS
from metering.ledger.event import CHAT, DETAIL_FIELDS, ENDPOINTS, Event
from metering.ledger.external import ingested_event
from metering.ledger.prices import PriceBook
from metering.limits import Limits
from metering.models import ApiToken, IngestedKey, Run, User
from metering.settings import Catalog

log = logging.getLogger("metering.billing")

MAX_BATCH = 1_000
MAX_KEY_CHARS = 200
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
        "end_user",
        "tags",
        "endpoint",
    )
)
# An event's `reason` when it is rejected: what it broke.
INVALID = "invalid_event"
MODEL_NOT_ALLOWED = "model_not_allowed"
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
# and metering.budgets.dated's: budget_exceeded, counter_ceiling
# Each refusal as the refusals table records it: (reason there, status, code).
_REFUSALS = {
    MODEL_NOT_ALLOWED: (403, "model_not_allowed"),
    RATE_LIMIT_EXCEEDED: (429, "rate_limit_exceeded"),
    "budget_exceeded": (402, "budget_exceeded"),
}


@dataclass(slots=True)
class Item:
    """One event of a batch as it goes: what was sent, then what it became."""

    key: str | None
    status: str | None = None
    event_id: str | None = None
    error: str | None = None
    reason: str | None = None  # why it was rejected
    scope: str | None = None  # whose limit rejected it
    subject_id: str | None = None
    refusal: str | None = None  # the refusals table's reason, when it records one
    event: Event = None  # type: ignore[assignment]  # set by _prepare, read only after it
    team_id: str | None = None
    digest: str | None = None
    stored: str | None = None  # the digest recorded under the key
    claim: RateClaim | None = None  # what it took from the rate counters, until it ends

    def reject(self, reason: str, error: str, scope: str | None = None, subject=None) -> None:
        self.status, self.event_id, self.reason, self.error = "rejected", None, reason, error
        self.scope, self.subject_id = scope, subject

    def out(self) -> dict:
        out = {"idempotency_key": self.key, "status": self.status, "event_id": self.event_id}
        if self.error is not None:
            out["error"] = self.error
        if self.reason is not None:
            out["reason"] = self.reason
        if self.scope is not None:
            out["scope"] = self.scope
        return out


def _key(raw) -> str | None:
    if not isinstance(raw, dict):
        return None
    value = raw.get("idempotency_key")
    return value if isinstance(value, str) and 0 < len(value) <= MAX_KEY_CHARS else None


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


def _own(raw: dict, principal: Principal) -> tuple:
    """A user's credential records its own usage only: its ids fill the event."""
    for name, own in (
        ("token_id", principal.token_id),
        ("user_id", principal.user_id),
        ("team_id", principal.team_id),
    ):
        value = text_of(raw, name, 40)
        if value is not None and value != own:
            raise Rejected(f"{name}: this credential records its own usage only")
    return principal.token_id, principal.user_id, principal.team_id


def _who(raw: dict, principal: Principal, token_users: dict, user_teams: dict) -> tuple:
    if not principal.charged_in_full:
        return _own(raw, principal)
    token_id = text_of(raw, "token_id", 40)
    user_id = text_of(raw, "user_id", 40)
    team_id = text_of(raw, "team_id", 40)
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
    if principal.kind == "ingest" and team != principal.team_id:
        # The same answer as an unknown id: a key learns nothing of other teams.
        raise Rejected(
            f"{'token_id' if token_id is not None else 'user_id'} not found in this ingestion "
            f"key's team {principal.team_id}"
        )
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
    model = text_of(raw, "model", 200, required=True)
    routes = ctx["catalog"].routes(model)
    if not routes:
        raise Rejected(f"model {model!r} is not in the catalog")
    provider = text_of(raw, "provider", 100)
    route = (
        routes[0] if provider is None else next((r for r in routes if r.provider == provider), None)
    )
    if route is None:
        raise Rejected(f"provider {provider!r} does not offer {model!r}")
    usage = usage_of(raw)
    end_user, tags = attributed(raw)
    endpoint = raw.get("endpoint", CHAT)
    if endpoint not in ENDPOINTS:
        raise Rejected(f"endpoint must be one of {', '.join(ENDPOINTS)}")
    now = ctx["now"]
    given_at = occurred_at(raw, now)
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
            # Only when sent: the digest of an event without them is the one it always had.
            **({"end_user": end_user} if end_user is not None else {}),
            **({"tags": tags} if tags != NO_TAGS else {}),
            **({"endpoint": endpoint} if endpoint != CHAT else {}),
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
        end_user=end_user,
        tags=tags,
        endpoint=endpoint,
    )


def _without_parallel(limits: Limits | None) -> Limits | None:
    """The rate limits an event counts against: rpm and tpm (it is no request in flight)."""
    if limits is None:
        return None
    kept = Limits.of(*(replace(scope, parallel=None) for scope in limits.scopes))
    return kept if kept is not None and kept.rated else None


async def _admit(admissions: AdmissionQueue, principal: Principal, items: list[Item]) -> None:
    """A user's own events, in order, through its model allow-lists and rate limits, as its
    proxied requests go: one refused is rejected with the limit that refused it."""
    limits = principal.limits
    rated = _without_parallel(limits)
    for item in items:
        event = item.event
        refusing = limits.refusing(event.model) if limits is not None else None
        if refusing is not None:
            allowed = ", ".join(refusing.models or ()) or "(none)"
            item.reject(
                MODEL_NOT_ALLOWED,
                f"model {event.model} is not allowed for {refusing.scope} {refusing.subject_id}: "
                f"its allowed_models are {allowed}",
                refusing.scope,
                refusing.subject_id,
            )
            item.refusal = "model"
            continue
        if rated is None:
            continue
        tokens = event.prompt_tokens + event.completion_tokens
        try:
            item.claim = await admissions.admit(rated, tokens)
        except RateLimited as exc:
            refusal = exc.refusal
            item.reject(
                RATE_LIMIT_EXCEEDED,
                rates.explain(refusal, utcnow()),
                refusal.scope,
                refusal.subject_id,
            )
            item.refusal = refusal.kind


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


def _dated(event: Event) -> Dated:
    return Dated(_subjects(event), event.created_at, event.cost, event.team_id, event.user_id)


async def _fitting(conn, new: list[Item], now: datetime, limited: bool, run) -> list[Item]:
    """The new items whose events fit every ceiling (and, `limited`, every limit); the others
    are rejected."""
    overflowing = await rollup.overflowing(conn, [i.event for i in new])
    for item, over in zip(new, overflowing, strict=True):
        if over:
            item.reject(
                "counter_ceiling",
                "this event would take a spend rollup past the most it keeps (9,000,000 USD or "
                "9e18 tokens in a day)",
            )
    candidates = [i for i in new if i.status is None]
    verdicts = await fit(conn, [_dated(i.event) for i in candidates], now, limited=limited, run=run)
    for item, unfit in zip(candidates, verdicts, strict=True):
        if unfit is not None:
            _refuse(item, unfit)
    return [i for i in candidates if i.status is None]


def _refuse(item: Item, unfit: Unfit) -> None:
    item.reject(unfit.reason, unfit.message, unfit.scope, unfit.subject_id)
    if unfit.reason == "budget_exceeded":
        item.refusal = "budget"


_runs = Run.__table__
_CHARGE_RUN = (
    update(_runs)
    .where(_runs.c.team_id == bindparam("team"), _runs.c.id == bindparam("run"))
    .values(spent=_runs.c.spent + bindparam("cost"), last_used_at=bindparam("now"))
)


async def _write(
    db: Database, items: list[Item], now: datetime, limited: bool, run: RunKey | None
) -> None:
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
        new = [i for i in items if (i.team_id, i.key) in inserted]  # in the order sent
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
        if not new:
            return
        fitting = await _fitting(conn, new, now, limited, run)
        left_out = sorted((i.team_id, i.key) for i in new if i.status is not None)
        if left_out:  # never recorded: the key stays free for a later try
            await conn.execute(
                delete(table).where(tuple_(table.c.team_id, table.c.idempotency_key).in_(left_out))
            )
        if fitting:
            events = [i.event for i in fitting]
            await writer.append_many(conn, events)
            await charge_dated(conn, [_dated(e) for e in events], now)
            if run is not None and limited:
                cost = sum(e.cost for e in events)
                params = {"team": run.team_id, "run": run.run_id, "cost": cost, "now": now}
                await conn.execute(_CHARGE_RUN, params)
        for item in fitting:
            item.status, item.event_id, item.stored = "created", item.event.id, item.digest


async def _end(db: Database, principal: Principal, items: list[Item], refusals) -> None:
    """Give back what the events not recorded took from the rate counters (a duplicate is no
    new request), and record the refused ones as refusals."""
    rated = _without_parallel(principal.limits)
    for item in items:
        if item.claim is not None and item.status != "created" and rated is not None:
            await rates.release_claim(db, item.claim, rated)
        item.claim = None
        if refusals is not None and item.refusal is not None and item.status == "rejected":
            assert item.reason is not None and item.scope is not None  # set by reject()
            status, code = _REFUSALS[item.reason]
            await refusals.record(
                time_ordered("evt"),
                principal=principal,
                model=item.event.model,
                refused=Refused(item.refusal, item.scope, (item.subject_id or "")[:40]),
                status=status,
                code=code,
                message=item.error or "",
            )


async def ingest(
    db: Database,
    catalog: Catalog,
    principal: Principal,
    raws: list,
    *,
    admissions: AdmissionQueue,
    refusals: RefusalLog | None = None,
    run: RunKey | None = None,
) -> list[dict]:
    """Record a batch; one answer per event, in the order sent. `admissions`: the process's
    rate admission queue, a user's own events are counted in; `run`: the run a user's
    credential reports in (x-metering-run), held against as its requests are."""
    now = utcnow()
    items = [Item(_key(raw)) for raw in raws]
    dicts = [raw for raw in raws if isinstance(raw, dict)]
    async with db.reads() as session:
        owners = await _owners(session, dicts) if principal.charged_in_full else ({}, {})
        sent = (raw.get("model") for raw in dicts)
        models = {m for m in sent if isinstance(m, str) and m in catalog.models}
        prices = await PriceBook.load(session, models)
    ctx = {"catalog": catalog, "principal": principal, "now": now, "owners": owners}
    ctx["prices"] = prices
    firsts: dict[tuple[str | None, str | None], Item] = {}
    later: list[Item] = []
    for item, raw in zip(items, raws, strict=True):
        try:
            _prepare(item, raw, ctx)
        except Rejected as exc:
            item.reject(INVALID, str(exc))
            continue
        first = firsts.get((item.team_id, item.key))
        if first is None:
            firsts[(item.team_id, item.key)] = item
        else:
            later.append(item)  # the same key again in this batch: compared with the first
    new = list(firsts.values())
    limited = not principal.charged_in_full
    try:
        if limited:
            await _admit(admissions, principal, new)
        await _record(db, [i for i in new if i.status is None], now, limited, run)
    finally:
        await _end(db, principal, new, refusals)
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
            item.reason, item.scope = first.reason, first.scope
    return [item.out() for item in items]


async def _record(
    db: Database, new: list[Item], now: datetime, limited: bool, run: RunKey | None
) -> None:
    if not new:
        return
    try:
        await _write(db, new, now, limited, run)
        return
    except UnknownRun:
        raise
    except Exception:
        log.warning("a batch of %d events could not be written at once", len(new), exc_info=True)
    # One at a time: an event that cannot be written costs the others nothing.
    for item in new:
        item.status = item.reason = item.scope = item.error = None
        try:
            await _write(db, [item], now, limited, run)
        except UnknownRun:
            raise
        except Exception as exc:
            log.warning("event %s could not be written: %s", item.key, exc)
            item.status, item.event_id = "retry", None
            item.error = "the event could not be recorded now; send it again"
