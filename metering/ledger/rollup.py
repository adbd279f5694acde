"""The spend rollups: the ledger's sums per UTC hour (spend_hourly, every key: team, user, token,
model, provider) and the coarser read models made of the same sums (by team, user and token; by
team, model and provider; per whole UTC day), kept equal to the ledger's sums.

They are kept one way, on both databases (docs/decisions/rollups.md): whoever appends an event
writes its hourly increment to rollup_pending in the same transaction (metering.ledger.writer:
`pend`) or, on PostgreSQL's one-statement settle (metering.budgets.settle_pg), in the same
statement (`pg_pending_insert`): one new row per key, however many of the events have it, and
no rollup row locked by a request. A late settle that replaces an `unsettled` placeholder
writes the difference (no new request) in the same hour. `fold`, a job of every replica, moves
the increments into every rollup a batch at a time, in the transaction that deletes them. The
rollups plus rollup_pending equal the ledger's sums at every instant: the spend report reads
both (PENDING) in one statement, whole days and hours from the coarsest rollup that has their
keys and only the partial hours at a range's edges from the ledger.

Three daily rollups keep the sums below the token (ATTRIBUTED): by end user (the increments
that have one) and by tag pair (one increment per pair of an event's tags), and one hourly by
team and tag pair (TAG_HOURLY), filled by the same fold from the end user and tags each pending
increment carries.
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import (
    ColumnElement,
    SQLColumnExpression,
    String,
    Table,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal_column,
    select,
    text,
    tuple_,
    type_coerce,
)
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from metering.db import Base, Database, UTCDateTime, dialect_name
from metering.ledger.event import ADJUSTMENT, Event
from metering.ledger.tables import (
    RollupPending,
    SpendDaily,
    SpendDailyEndUser,
    SpendDailyModel,
    SpendDailyTag,
    SpendDailyTagModel,
    SpendDailyToken,
    SpendHourly,
    SpendHourlyModel,
    SpendHourlyTag,
    SpendHourlyToken,
)
from metering.money import COUNTER_CEILING

KEY = ("hour", "team_id", "user_id", "token_id", "model", "provider")
# An increment's key: KEY and the events' end user ('' for none) and tags (JSON text).
PENDING_KEY = (*KEY, "end_user", "tags")
SUMS = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost",
    "uncharged",
    "adjustments",
)
# Sums that saturate instead of overflowing: uncharged is what upstreams claimed beyond the holds.
SATURATED = {"uncharged": 2**63 - 1}


@dataclass(frozen=True, slots=True)
class Rollup:
    """One read model: its table, its grain ("hour" or "day", also the time column's name) and
    the attribution keys it keeps; `attribute`: "end_user" (only the increments with an end
    user) or "tag" (one row per tag pair of an increment), "" for the sums of every event."""

    table: Table
    grain: str
    keys: tuple[str, ...]
    attribute: str = ""

    @property
    def key(self) -> tuple[str, ...]:
        return (self.grain, *self.keys)


def _rollup(model: type[Base], grain: str, attribute: str = "") -> Rollup:
    table = model.__table__
    keys = tuple(c.name for c in table.primary_key.columns if c.name != grain)
    return Rollup(table, grain, keys, attribute)


HOURLY = _rollup(SpendHourly, "hour")
# Every rollup: spend_hourly first, then the read models made of its sums (a report reads the
# one of its grain with the fewest keys that has every key it needs).
ROLLUPS = (
    HOURLY,
    _rollup(SpendHourlyToken, "hour"),
    _rollup(SpendHourlyModel, "hour"),
    _rollup(SpendDaily, "day"),
    _rollup(SpendDailyToken, "day"),
    _rollup(SpendDailyModel, "day"),
)
DERIVED = ROLLUPS[1:]  # made from spend_hourly's rows
# By the attribution below the token, whole UTC days only: the increments with an end user, and
# each tag pair of an increment (a report reads them for the days they answer, and spend_daily's
# or spend_daily_token's rows minus theirs for the events without one).
END_USER_DAILY = _rollup(SpendDailyEndUser, "day", "end_user")
TAG_DAILY = _rollup(SpendDailyTag, "day", "tag")
TAG_MODEL_DAILY = _rollup(SpendDailyTagModel, "day", "tag")  # by team, model and provider only
TAGS = (TAG_DAILY, TAG_MODEL_DAILY)
ATTRIBUTED = (END_USER_DAILY, *TAGS)
# By team and tag pair per UTC hour: the whole hours a range of whole days leaves at its edges.
TAG_HOURLY = _rollup(SpendHourlyTag, "hour", "tag")
FOLDED = (*ROLLUPS, *ATTRIBUTED, TAG_HOURLY)  # every rollup the fold adds the increments to


def floor_hour(value: datetime) -> datetime:
    return value.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def ceil_hour(value: datetime) -> datetime:
    floor = floor_hour(value)
    return floor if floor == value else floor + timedelta(hours=1)


def floor_day(value: datetime) -> datetime:
    return value.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def ceil_day(value: datetime) -> datetime:
    floor = floor_day(value)
    return floor if floor == value else floor + timedelta(days=1)


def row_for(event: Event, **override: int) -> dict[str, Any]:
    """The hourly rollup increment one ledger event makes (`override`: e.g. requests=0 and the
    cost difference, when an event replaces a placeholder already counted). An adjustment
    counts no request: its cost is a correction, also summed in `adjustments`."""
    adjusting = event.kind == ADJUSTMENT
    return {
        "hour": floor_hour(event.created_at),
        "team_id": event.team_id,
        "user_id": event.user_id,
        "token_id": event.token_id or "",
        "model": event.model,
        "provider": event.provider,
        "end_user": event.end_user or "",
        "tags": event.tags,
        "requests": 0 if adjusting else 1,
        "prompt_tokens": event.prompt_tokens,
        "cached_tokens": event.cached_tokens,
        "completion_tokens": event.completion_tokens,
        "reasoning_tokens": event.reasoning_tokens or 0,
        "cost": event.cost,
        "uncharged": event.uncharged,
        "adjustments": event.cost if adjusting else 0,
        **override,
    }


def project(rollup: Rollup, row: dict[str, Any], **more: str) -> dict[str, Any]:
    """An hourly row (row_for's shape) as the increment it makes to `rollup` (`more`: the keys
    the row has no field for, a tag's key and value)."""
    out = {rollup.grain: floor_day(row["hour"]) if rollup.grain == "day" else row["hour"]}
    for name in rollup.keys:
        out[name] = more[name] if name in more else row[name]
    for name in ("requests", *SUMS):
        out[name] = row[name]
    return out


def tag_pairs(tags: str) -> list[tuple[str, str]]:
    """An event's tags (the JSON text of an object) as (key, value) pairs, values as text."""
    if tags == "{}":
        return []
    pairs = orjson.loads(tags)
    return [(k, v if isinstance(v, str) else orjson.dumps(v).decode()) for k, v in pairs.items()]


def increments(rollup: Rollup, row: dict[str, Any]) -> list[dict[str, Any]]:
    """What an hourly row adds to `rollup`: one increment, none (the end-user rollup, for a row
    without one) or one per tag pair (the tag rollup)."""
    if rollup.attribute == "end_user":
        return [project(rollup, row)] if row["end_user"] else []
    if rollup.attribute == "tag":
        return [
            project(rollup, row, tag_key=key, tag_value=value)
            for key, value in tag_pairs(row["tags"])
        ]
    return [project(rollup, row)]


def summed(rollup: Rollup, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hourly rows summed into `rollup`'s rows, in key order (concurrent writers, other
    processes, lock shared rows in one order), each sum saturated where it must be."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for part in (part for row in rows for part in increments(rollup, row)):
        key = tuple(part[name] for name in rollup.key)
        sums = out.get(key)
        if sums is None:
            out[key] = dict(part)
            continue
        sums["requests"] += part["requests"]
        for name in SUMS:
            sums[name] += part[name]
    for sums in out.values():
        for name, most in SATURATED.items():
            sums[name] = min(sums[name], most)
    return [out[key] for key in sorted(out)]


def _upsert(insert: Callable[[Table], Any], rollup: Rollup) -> Any:
    table = rollup.table
    statement = insert(table)

    def added(name: str) -> ColumnElement[Any]:
        column: ColumnElement[Any] = table.c[name]
        more: ColumnElement[Any] = statement.excluded[name]
        if name in SATURATED:
            most = SATURATED[name]
            return case((column > most - more, most), else_=column + more)
        return column + more

    return statement.on_conflict_do_update(
        index_elements=list(rollup.key),
        set_={name: added(name) for name in ("requests", *SUMS)},
    )


# SQLite's fold: every rollup's upsert, built once.
_SQLITE_UPSERTS = [(rollup, _upsert(sqlite_insert, rollup)) for rollup in FOLDED]


_MOST = {name: SATURATED.get(name) for name in ("requests", *SUMS)}


FIGURES = ("requests", *SUMS)


def _pg_sums() -> str:
    """FIGURES summed in SQL, each saturated where it must be (SATURATED)."""
    return ", ".join(f"LEAST(SUM({f}), {_MOST[f]})" if _MOST[f] else f"SUM({f})" for f in FIGURES)


def _positions(n: int) -> str:
    """GROUP BY / ORDER BY positions 1 to n."""
    return ", ".join(str(i) for i in range(1, n + 1))


# What each attributed rollup reads of an increment (PENDING_KEY's columns): the rows with an
# end user; each tag pair of a row (tag_key and tag_value are the pair's).
_PG_FROM = {
    "": "{source}",
    "end_user": "{source} WHERE end_user <> ''",
    "tag": "{source} CROSS JOIN LATERAL jsonb_each_text(CAST({source}.tags AS jsonb)) "
    "AS pair(tag_key, tag_value) WHERE {source}.tags <> '{{}}'",
}


def pg_upserts(source: str, rollups: tuple[Rollup, ...] = ROLLUPS) -> list[str]:
    """On PostgreSQL, every rollup's upsert as a data-modifying WITH query reading the rows of
    relation `source` (columns KEY and FIGURES; PENDING_KEY's for the attributed rollups):
    summed per rollup in SQL, in key order (concurrent folds lock shared rows in one order)."""
    parts = []
    for i, rollup in enumerate(rollups):
        name = rollup.table.name
        at = "hour"
        if rollup.grain == "day":
            at = "date_trunc('day', hour AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
        read = _PG_FROM[rollup.attribute].format(source=source)
        sums = _pg_sums()
        updates = ", ".join(
            f"{f} = CASE WHEN t.{f} > {_MOST[f]} - EXCLUDED.{f} THEN {_MOST[f]} "
            f"ELSE t.{f} + EXCLUDED.{f} END"
            if _MOST[f]
            else f"{f} = t.{f} + EXCLUDED.{f}"
            for f in FIGURES
        )
        columns = ", ".join(rollup.key)
        positions = _positions(len(rollup.key))
        parts.append(
            f"r{i} AS (INSERT INTO {name} AS t ({columns}, {', '.join(FIGURES)}) "
            f"SELECT {at}, {', '.join(rollup.keys)}, {sums} FROM {read} "
            f"GROUP BY {positions} ORDER BY {positions} "
            f"ON CONFLICT ({columns}) DO UPDATE SET {updates})"
        )
    return parts


# The increments written with their events and not yet folded in: read as an hourly rollup
# with every key (duplicates allowed; the report sums them with the rollups' rows).
PENDING = Rollup(RollupPending.__table__, "hour", (*HOURLY.keys, "end_user", "tags"))


# The ledger columns pg_pending_insert reads: what row_for makes an event's increment of.
PENDING_SOURCE = (
    "created_at, team_id, user_id, token_id, model, provider, kind, prompt_tokens, "
    "cached_tokens, completion_tokens, reasoning_tokens, cost, uncharged, end_user, tags"
)


def pg_pending_insert(events: str = "ev") -> str:
    """On PostgreSQL, a data-modifying WITH query writing to rollup_pending the hourly
    increments of the events in relation `events` (ledger columns, at least PENDING_SOURCE: the
    RETURNING of the events' own INSERT): row_for in SQL, summed per key, so a statement writes
    one row per hour, team, user, token, model and provider whatever the number of its events
    with them (each sum saturated as the rollups' are), and locks no rollup row."""
    adjusting = f"kind = '{ADJUSTMENT}'"
    increments = ", ".join(
        [
            "date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS hour",
            "team_id, user_id, COALESCE(token_id, '') AS token_id, model, provider",
            "COALESCE(end_user, '') AS end_user, tags",
            f"CASE WHEN {adjusting} THEN 0 ELSE 1 END AS requests",
            "prompt_tokens, cached_tokens, completion_tokens",
            "COALESCE(reasoning_tokens, 0) AS reasoning_tokens, cost, uncharged",
            f"CASE WHEN {adjusting} THEN cost ELSE 0 END AS adjustments",
        ]
    )
    keys = ", ".join(PENDING_KEY)
    return (
        f"pending AS (INSERT INTO rollup_pending ({keys}, {', '.join(FIGURES)}) "
        f"SELECT {keys}, {_pg_sums()} FROM (SELECT {increments} FROM {events}) AS increment "
        f"GROUP BY {_positions(len(PENDING_KEY))})"
    )


_PENDING_TABLE = RollupPending.__table__
_PEND = insert(_PENDING_TABLE)


async def pend(conn: AsyncConnection | AsyncSession, rows: list[dict[str, Any]]) -> None:
    """Write hourly increments (row_for's) to rollup_pending, in the caller's transaction: the
    rows of one key summed first, so a key is one row however many of them have it."""
    await conn.execute(_PEND, rows if len(rows) == 1 else summed(PENDING, rows))


FOLD_BATCH = 5000


def _fold_pg() -> str:
    """Take up to :batch of the oldest pending increments and add them to every rollup, in one
    statement: the rows leave rollup_pending in the statement that adds them, so a report
    (one statement, one snapshot) sees each increment exactly once, in one place or the
    other. Two replicas folding at once take different rows: each skips the rows the other
    has locked (SKIP LOCKED), so neither waits for the other and none is taken twice."""
    columns = ", ".join((*PENDING_KEY, *FIGURES))
    moved = (
        "moved AS (DELETE FROM rollup_pending WHERE id IN "
        "(SELECT id FROM rollup_pending ORDER BY id LIMIT CAST(:batch AS integer) "
        "FOR UPDATE SKIP LOCKED) "
        f"RETURNING {columns})"
    )
    upserts = pg_upserts("moved", FOLDED)
    return "WITH " + ",\n".join([moved, *upserts]) + "\nSELECT count(*) FROM moved"


_FOLD_PG = text(_fold_pg())
# SQLite's: the oldest increments deleted (the first statement a write: the transaction takes
# the one writer's lock at once), then summed here and upserted into every rollup, in the same
# transaction (a report's snapshot sees each increment once).
_TAKE_SQLITE = (
    delete(_PENDING_TABLE)
    .where(
        _PENDING_TABLE.c.id.in_(
            select(_PENDING_TABLE.c.id).order_by(_PENDING_TABLE.c.id).limit(bindparam("batch"))
        )
    )
    .returning(*(_PENDING_TABLE.c[name] for name in (*PENDING_KEY, *FIGURES)))
)


async def _fold_once(db: Database, batch: int) -> int:
    if db.dialect == "postgresql":
        async with db.single() as conn:
            return int((await conn.execute(_FOLD_PG, {"batch": batch})).scalar() or 0)
    async with db.begin() as conn:
        taken = await conn.execute(_TAKE_SQLITE, {"batch": batch})
        rows = [dict(row) for row in taken.mappings()]
        if rows:
            for rollup, upsert in _SQLITE_UPSERTS:
                sums = summed(rollup, rows)
                if sums:  # none for the attributed rollups when no event had an end user or tag
                    await conn.execute(upsert, sums)
    return len(rows)


async def fold(db: Database, batch: int = FOLD_BATCH, rounds: int = 20) -> int:
    """Fold pending increments into the rollups, `batch` at a time, until fewer than a batch
    were left or `rounds` batches were folded (the next run goes on). Returns how many were
    folded."""
    folded = 0
    for _ in range(rounds):
        moved = await _fold_once(db, batch)
        folded += moved
        if moved < batch:
            break
    return folded


def hour_text(column: SQLColumnExpression[Any], dialect: str) -> ColumnElement[Any]:
    """A UTC datetime column as RFC 3339 text on its hour (`2026-11-30T05:00:00Z`), in SQL."""
    if dialect == "postgresql":
        return func.to_char(
            column.op("AT TIME ZONE")(literal_column("'UTC'")), 'YYYY-MM-DD"T"HH24:00:00"Z"'
        )
    return func.strftime("%Y-%m-%dT%H:00:00Z", column, type_=String)


def day_text(column: SQLColumnExpression[Any], dialect: str) -> ColumnElement[Any]:
    """A UTC datetime column as its UTC day (`2026-11-30`), in SQL."""
    if dialect == "postgresql":
        return func.to_char(column.op("AT TIME ZONE")(literal_column("'UTC'")), "YYYY-MM-DD")
    return func.strftime("%Y-%m-%d", column, type_=String)


def hour_value(column: SQLColumnExpression[Any], dialect: str) -> ColumnElement[Any]:
    """A UTC datetime column truncated to its hour, stored the way a UTCDateTime is."""
    if dialect == "postgresql":
        utc = column.op("AT TIME ZONE")(literal_column("'UTC'"))
        return func.date_trunc("hour", utc).op("AT TIME ZONE")(literal_column("'UTC'"))
    return func.strftime("%Y-%m-%d %H:00:00.000000", column)


def day_value(column: SQLColumnExpression[Any], dialect: str) -> ColumnElement[Any]:
    """A UTC datetime column truncated to its day, stored the way a UTCDateTime is."""
    if dialect == "postgresql":
        utc = column.op("AT TIME ZONE")(literal_column("'UTC'"))
        return func.date_trunc("day", utc).op("AT TIME ZONE")(literal_column("'UTC'"))
    return func.strftime("%Y-%m-%d 00:00:00.000000", column)


# The most a rollup's sum may hold after an append that can be refused (ingested usage), in
# picodollars and in tokens alike (metering.money.COUNTER_CEILING).
SUM_CEILING = COUNTER_CEILING
# The rollups whose rows sum the most events of a day: every other rollup row is a part of one
# of theirs (spend_daily by every key, and each hourly row, sum fewer events).
_WIDEST = (_rollup(SpendDailyToken, "day"), _rollup(SpendDailyModel, "day"))
_CHECKED = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "cost")


def _day_key(rollup: Rollup, row: dict[str, Any]) -> tuple[Any, ...]:
    return (floor_day(row["hour"]), *(row[name] for name in rollup.keys))


async def _sums(
    session: AsyncConnection | AsyncSession, rollup: Rollup, keys: set[tuple[Any, ...]]
) -> dict[tuple[Any, ...], list[int]]:
    """The current sums of `rollup`'s rows at `keys`, with the increments not yet folded in."""
    table = rollup.table
    columns = [table.c[name] for name in rollup.key]
    found: dict[tuple[Any, ...], list[int]] = {}
    ordered = sorted(keys)
    for start in range(0, len(ordered), 500):
        part = ordered[start : start + 500]
        rows = await session.execute(
            select(*columns, *(table.c[name] for name in _CHECKED)).where(
                tuple_(*columns).in_(part)
            )
        )
        for row in rows:
            found[tuple(row[: len(columns)])] = list(row[len(columns) :])
    pending = PENDING.table
    day = type_coerce(day_value(pending.c.hour, dialect_name(session)), UTCDateTime())
    grouped = [day, *(pending.c[name] for name in rollup.keys)]
    days = sorted({key[0] for key in keys})
    rows = await session.execute(
        select(*grouped, *(func.sum(pending.c[name]) for name in _CHECKED))
        .where(pending.c.hour >= days[0], pending.c.hour < days[-1] + timedelta(days=1))
        .group_by(*grouped)
    )
    for row in rows:
        key = tuple(row[: len(grouped)])
        if key in keys:
            sums = found.setdefault(key, [0] * len(_CHECKED))
            for i, value in enumerate(row[len(grouped) :]):
                sums[i] += int(value or 0)
    return found


async def overflowing(session: AsyncConnection | AsyncSession, events: list[Event]) -> list[bool]:
    """Per event, in order: whether appending it after the ones before it (those not
    overflowing) would take a rollup's sum past SUM_CEILING."""
    rows = [row_for(event) for event in events]
    current = {
        rollup: await _sums(session, rollup, {_day_key(rollup, row) for row in rows})
        for rollup in _WIDEST
    }
    out = []
    for row in rows:
        wanted = [(rollup, _day_key(rollup, row)) for rollup in _WIDEST]
        sums = [current[rollup].get(key, [0] * len(_CHECKED)) for rollup, key in wanted]
        over = any(
            total + row[name] > SUM_CEILING
            for part in sums
            for total, name in zip(part, _CHECKED, strict=True)
        )
        out.append(over)
        if not over:
            for (rollup, key), part in zip(wanted, sums, strict=True):
                current[rollup][key] = [
                    total + row[name] for total, name in zip(part, _CHECKED, strict=True)
                ]
    return out
