"""The hourly spend rollup (table spend_hourly): one row per UTC hour, team, user, token, model
and provider, kept equal to the ledger's sums.

metering.ledger.writer appends each event and adds it here in the same transaction, so the
rollup can never disagree with the ledger: both are committed or neither is. A late settle
that replaces an `unsettled` placeholder adds the difference (no new request) to the same
hour. Reports read whole hours from here and only the partial hours at a range's edges from
the ledger.
"""

from datetime import UTC, datetime, timedelta

from sqlalchemy import String, case, func, literal_column, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from metering.db import dialect_name
from metering.ledger.event import Event
from metering.models import SpendHourly

KEY = ("hour", "team_id", "user_id", "token_id", "model", "provider")
SUMS = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost",
    "uncharged",
)
# Sums that saturate instead of overflowing: uncharged is what upstreams claimed beyond the holds.
SATURATED = {"uncharged": 2**63 - 1}


def floor_hour(value: datetime) -> datetime:
    return value.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def ceil_hour(value: datetime) -> datetime:
    floor = floor_hour(value)
    return floor if floor == value else floor + timedelta(hours=1)


def row_for(event: Event, **override) -> dict:
    """The rollup increment one ledger event makes (`override`: e.g. requests=0 and the cost
    difference, when an event replaces a placeholder already counted)."""
    return {
        "hour": floor_hour(event.created_at),
        "team_id": event.team_id,
        "user_id": event.user_id,
        "token_id": event.token_id or "",
        "model": event.model,
        "provider": event.provider,
        "requests": 1,
        "prompt_tokens": event.prompt_tokens,
        "cached_tokens": event.cached_tokens,
        "completion_tokens": event.completion_tokens,
        "reasoning_tokens": event.reasoning_tokens or 0,
        "cost": event.cost,
        "uncharged": event.uncharged,
        **override,
    }


def _upsert(insert):
    table = SpendHourly.__table__
    statement = insert(table)

    def added(name: str):
        column, more = table.c[name], statement.excluded[name]
        if name in SATURATED:
            most = SATURATED[name]
            return case((column > most - more, most), else_=column + more)
        return column + more

    return statement.on_conflict_do_update(
        index_elements=list(KEY), set_={name: added(name) for name in ("requests", *SUMS)}
    )


# Built once per dialect: every appended event runs it.
_UPSERTS = {"postgresql": _upsert(pg_insert), "sqlite": _upsert(sqlite_insert)}


async def add(session: AsyncSession, event: Event, **override) -> None:
    """Add one ledger event to its hour's row: one upsert, in the caller's transaction."""
    await session.execute(_UPSERTS[dialect_name(session)], row_for(event, **override))


async def add_many(session: AsyncSession, events: list[Event]) -> None:
    """Add several events to their hours' rows: one upsert per row, summed here first (a row
    is written once however many of the events it counts)."""
    rows: dict[tuple, dict] = {}
    for event in events:
        row = row_for(event)
        key = tuple(row[name] for name in KEY)
        sums = rows.get(key)
        if sums is None:
            rows[key] = row
            continue
        sums["requests"] += 1
        for name in SUMS:
            sums[name] += row[name]
    for row in rows.values():
        for name, most in SATURATED.items():
            row[name] = min(row[name], most)
    # In key order: concurrent groups (other processes) lock shared rows in one order.
    ordered = [rows[key] for key in sorted(rows)]
    await session.execute(_UPSERTS[dialect_name(session)], ordered)


def hour_text(column, dialect: str):
    """A UTC datetime column as RFC 3339 text on its hour (`2026-11-30T05:00:00Z`), in SQL."""
    if dialect == "postgresql":
        return func.to_char(
            column.op("AT TIME ZONE")(literal_column("'UTC'")), 'YYYY-MM-DD"T"HH24:00:00"Z"'
        )
    return func.strftime("%Y-%m-%dT%H:00:00Z", column, type_=String)


def day_text(column, dialect: str):
    """A UTC datetime column as its UTC day (`2026-11-30`), in SQL."""
    if dialect == "postgresql":
        return func.to_char(column.op("AT TIME ZONE")(literal_column("'UTC'")), "YYYY-MM-DD")
    return func.strftime("%Y-%m-%d", column, type_=String)


def hour_value(column, dialect: str):
    """A UTC datetime column truncated to its hour, stored the way a UTCDateTime is."""
    if dialect == "postgresql":
        utc = column.op("AT TIME ZONE")(literal_column("'UTC'"))
        return func.date_trunc("hour", utc).op("AT TIME ZONE")(literal_column("'UTC'"))
    return func.strftime("%Y-%m-%d %H:00:00.000000", column)


def rebuild_statement(source, dialect: str):
    """INSERT INTO spend_hourly the sums of a ledger-shaped table (for tools that write events
    in bulk, e.g. the benchmark's generator; appending keeps the rollup itself)."""
    hour = hour_value(source.c.created_at, dialect)
    token = func.coalesce(source.c.token_id, "")
    keys = (hour, source.c.team_id, source.c.user_id, token, source.c.model, source.c.provider)
    query = select(
        *keys,
        func.count(),
        func.sum(source.c.prompt_tokens),
        func.sum(source.c.cached_tokens),
        func.sum(source.c.completion_tokens),
        func.sum(func.coalesce(source.c.reasoning_tokens, 0)),
        func.sum(source.c.cost),
        func.sum(source.c.uncharged),
    ).group_by(*keys)
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    return insert(SpendHourly).from_select([*KEY, "requests", *SUMS], query)
