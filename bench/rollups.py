"""The rollups of events written in bulk: for tools that fill a ledger with INSERT ... SELECT
(bench.reports' generator) and for the tests that rebuild a rollup to compare it. The service
itself never needs them: every append writes its increments, folded into every rollup
(metering.ledger.rollup)."""

from typing import Any

from sqlalchemy import ColumnElement, Insert, Table, case, func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from metering.db import dialect_name
from metering.ledger import writer
from metering.ledger.event import ADJUSTMENT, Event
from metering.ledger.rollup import (
    _SQLITE_UPSERTS,
    FIGURES,
    KEY,
    SUMS,
    Rollup,
    day_value,
    hour_value,
    pg_upserts,
    row_for,
    summed,
)
from metering.ledger.tables import SpendHourly


def rebuild_statement(source: Table, dialect: str, *, adjustments: bool = True) -> Insert:
    """INSERT INTO spend_hourly the sums of a ledger-shaped table. Without `adjustments`: a
    table and rollup from before adjustment events (revision 0012)."""
    hour = hour_value(source.c.created_at, dialect)
    token = func.coalesce(source.c.token_id, "")
    keys = (hour, source.c.team_id, source.c.user_id, token, source.c.model, source.c.provider)
    sums = [
        func.sum(source.c.prompt_tokens),
        func.sum(source.c.cached_tokens),
        func.sum(source.c.completion_tokens),
        func.sum(func.coalesce(source.c.reasoning_tokens, 0)),
        func.sum(source.c.cost),
        func.sum(source.c.uncharged),
    ]
    names = [*KEY, "requests", *SUMS]
    if adjustments:
        adjusting = source.c.kind == ADJUSTMENT
        requests = func.sum(case((adjusting, 0), else_=1))
        sums.append(func.sum(case((adjusting, source.c.cost), else_=0)))
    else:
        requests = func.count()
        names.remove("adjustments")
    query = select(*keys, requests, *sums).group_by(*keys)
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    table = SpendHourly.__table__
    return insert(table).from_select(names, query, include_defaults=False)


def derive_statement(rollup: Rollup, dialect: str, *where: ColumnElement[bool]) -> Insert:
    """INSERT INTO a coarser rollup the sums of spend_hourly's rows (`where`: only some of
    them)."""
    source = SpendHourly.__table__
    at: ColumnElement[Any] = source.c.hour
    if rollup.grain == "day":
        at = day_value(at, dialect)
    keys = (at, *(source.c[name] for name in rollup.keys))
    query = (
        select(*keys, *(func.sum(source.c[name]) for name in ("requests", *SUMS)))
        .where(*where)
        .group_by(*keys)
    )
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    return insert(rollup.table).from_select([*rollup.key, "requests", *SUMS], query)


def _direct_pg() -> Any:
    """The increments as arrays, upserted into every rollup in one WITH statement."""
    keys = ", ".join(KEY[1:])
    figures = ", ".join(FIGURES)
    arrays = ", ".join(
        ["CAST(:hour AS timestamptz[])"]
        + [f"CAST(:{k} AS text[])" for k in KEY[1:]]
        + [f"CAST(:{f} AS bigint[])" for f in FIGURES]
    )
    source = (
        f"e AS (SELECT hour, {keys}, {figures} FROM unnest({arrays}) "
        f"AS e_in(hour, {keys}, {figures}))"
    )
    return text("WITH " + ",\n".join([source, *pg_upserts("e")]) + "\nSELECT 1")


_DIRECT_PG = _direct_pg()


async def direct(conn: Any, events: list[Event]) -> None:
    """The events, then every rollup row they add to, upserted in the transaction: the way the
    general path kept the rollups before every append wrote its increments to rollup_pending
    (docs/decisions/rollups.md), kept for the benchmarks that compare the two."""
    await conn.execute(writer._INSERT, [e.params() for e in events])
    rows = [row_for(e) for e in events]
    if dialect_name(conn) == "postgresql":
        columns = (*KEY, *FIGURES)
        await conn.execute(_DIRECT_PG, {name: [row[name] for row in rows] for name in columns})
        return
    for each, upsert in _SQLITE_UPSERTS:
        sums = summed(each, rows)
        if sums:
            await conn.execute(upsert, sums)


_FIGURES_SQL = (
    "SUM(CASE WHEN e.kind = 'adjustment' THEN 0 ELSE 1 END), SUM(e.prompt_tokens), "
    "SUM(e.cached_tokens), SUM(e.completion_tokens), SUM(COALESCE(e.reasoning_tokens, 0)), "
    "SUM(e.cost), SUM(e.uncharged), SUM(CASE WHEN e.kind = 'adjustment' THEN e.cost ELSE 0 END)"
)


def attributed_statements() -> list[str]:
    """On PostgreSQL, INSERT INTO spend_daily_end_user, spend_daily_tag,
    spend_daily_tag_model and spend_hourly_tag the sums of ledger_events (as migrations 0020
    and 0021 backfill them)."""
    day = "date_trunc('day', e.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
    hour = "date_trunc('hour', e.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
    who = "e.team_id, e.user_id, COALESCE(e.token_id, '')"
    figures = ", ".join(FIGURES)
    tag = f"{who}, e.model, e.provider, pair.key, pair.value"
    return [
        f"INSERT INTO spend_daily_end_user (day, team_id, user_id, token_id, end_user, "
        f"{figures}) SELECT {day}, {who}, e.end_user, {_FIGURES_SQL} FROM ledger_events e "
        f"WHERE e.end_user IS NOT NULL GROUP BY {day}, {who}, e.end_user",
        f"INSERT INTO spend_daily_tag (day, team_id, user_id, token_id, model, provider, "
        f"tag_key, tag_value, {figures}) SELECT {day}, {tag}, {_FIGURES_SQL} "
        "FROM ledger_events e CROSS JOIN LATERAL jsonb_each_text(CAST(e.tags AS jsonb)) AS pair "
        f"WHERE e.tags <> '{{}}' GROUP BY {day}, {tag}",
        "INSERT INTO spend_daily_tag_model (day, team_id, model, provider, tag_key, tag_value, "
        f"{figures}) SELECT day, team_id, model, provider, tag_key, tag_value, "
        f"{', '.join(f'SUM({f})' for f in FIGURES)} FROM spend_daily_tag "
        "GROUP BY day, team_id, model, provider, tag_key, tag_value",
        f"INSERT INTO spend_hourly_tag (hour, team_id, tag_key, tag_value, {figures}) "
        f"SELECT {hour}, e.team_id, pair.key, pair.value, {_FIGURES_SQL} FROM ledger_events e "
        "CROSS JOIN LATERAL jsonb_each_text(CAST(e.tags AS jsonb)) AS pair "
        f"WHERE e.tags <> '{{}}' GROUP BY {hour}, e.team_id, pair.key, pair.value",
    ]
