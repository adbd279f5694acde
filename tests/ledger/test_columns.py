"""The event's columns are declared once (metering.ledger.event): the migrated table, the typed
event, GET /v1/usage's JSON and CSV, and the hourly rollup all agree with the declaration."""

import asyncio
import csv
import io
import uuid
from dataclasses import asdict, fields
from datetime import UTC, datetime

from sqlalchemy import BigInteger, Boolean, Integer, MetaData, String, Table, create_engine, pool
from sqlalchemy import select as sql_select

from bench.rollups import rebuild_statement
from metering.db import Database, sync_url
from metering.ledger import rollup, writer
from metering.ledger.charge import Usage
from metering.ledger.event import (
    COMPLETION_DETAILS,
    DETAIL_FIELDS,
    LIMITS,
    NAMES,
    NULLABLE,
    PROMPT_DETAILS,
    PUBLIC,
    SPECS,
    Event,
    bounded,
)
from metering.ledger.tables import LedgerEvent, LedgerEventArchive, RollupPending, SpendHourly
from tests.ledger.folds import fold_all

# The types each declared SQL type may reflect as (SQLite and PostgreSQL name them their way).
REFLECTED = {
    "String": (String,),
    "Text": (String,),  # a Text reflects as TEXT, a String subclass
    "BigInteger": (BigInteger,),
    "Integer": (Integer,),
    "Boolean": (Boolean,),
}


def reflect(url: str, name: str) -> Table:
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return Table(name, MetaData(), autoload_with=conn)
    finally:
        engine.dispose()


def sample_event(**values) -> Event:
    """An event with every column set to a value of its own, so a column mixed up shows."""
    at = datetime(2026, 3, 4, 5, 6, 7, 890000, tzinfo=UTC)
    event = {
        "id": f"req_{uuid.uuid4().hex}",
        "created_at": at,
        "started_at": at.replace(second=1),
        "token_id": f"tok_{uuid.uuid4().hex[:12]}",
        "user_id": f"usr_{uuid.uuid4().hex[:12]}",
        "team_id": f"team_{uuid.uuid4().hex[:12]}",
        "model": "gpt-columns",
        "provider": "sim-openai",
        "upstream_model": "sim/gpt",
        "upstream_id": "chatcmpl-columns",
        "stream": True,
        "status": "ok",
        "http_status": 200,
        "finish_reason": "length",
        "prompt_tokens": 1001,
        "completion_tokens": 502,
        "total_tokens": 1503,
        "cached_tokens": 300,
        "text_tokens": 11,
        "reasoning_tokens": 12,
        "audio_tokens": 13,
        "image_tokens": 14,
        "video_tokens": 15,
        "accepted_prediction_tokens": 16,
        "rejected_prediction_tokens": 17,
        "usage_source": "reported",
        "usage_anomaly": "prompt_above_bound",
        "max_tokens_clamped": 77,
        "input_price": 150_000,
        "cached_price": 75_000,
        "output_price": 600_000,
        "cost": 123_456_789,
        "uncharged": 987_654,
        "ttft_ms": 40,
        "latency_ms": 900,
        "error": None,
    }
    return Event(**{**event, **values})


def test_the_typed_event_is_the_declaration():
    assert tuple(f.name for f in fields(Event)) == NAMES
    assert len(NAMES) == 43
    assert {
        "token_id",
        "upstream_id",
        "http_status",
        "finish_reason",
        *DETAIL_FIELDS,
        "usage_anomaly",
        "max_tokens_clamped",
        "ttft_ms",
        "latency_ms",
        "error",
        "corrects_event_id",
        "reason",
        "run_id",
        "end_user",
    } == NULLABLE
    # The counts an event records are the upstream usage's, detail for detail.
    usage_fields = {f.name for f in fields(Usage)}
    assert {"prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens"} < usage_fields
    assert set(DETAIL_FIELDS) < usage_fields


def test_params_are_the_columns_and_values_of_the_event():
    event = sample_event()
    assert event.params() == asdict(event)
    assert tuple(event.params()) == NAMES


def test_text_from_outside_is_bounded_by_its_column():
    assert LIMITS["upstream_id"] == 200 and LIMITS["finish_reason"] == 64
    assert bounded("upstream_id", "a\x00b" * 150) == ("ab" * 150)[:200]
    assert bounded("finish_reason", "x" * 100) == "x" * 64
    assert bounded("error", "e" * 5000) == "e" * 2000
    assert bounded("upstream_id", None) is None


def test_the_migrated_tables_have_the_declared_columns(api):
    """`alembic upgrade head` (the api fixture's database, on each backend) built ledger_events
    and its archive with exactly the declared columns, types, lengths and nullability."""
    for name in ("ledger_events", "ledger_events_archive"):
        table = reflect(api.settings.database_url, name)
        # The change feed's transaction id (migration 0026), on PostgreSQL's ledger only: set by
        # the database, declared by no statement (metering.reports.changes).
        feed = {"txid"} if name == "ledger_events" and api.backend == "postgresql" else set()
        assert {c.name for c in table.columns} == set(NAMES) | feed, name
        for column in table.columns:
            if column.name in feed:
                continue
            spec = SPECS[column.name]
            declared = type(spec.sql).__name__
            if declared == "UTCDateTime":
                assert column.type.python_type is datetime, column.name
            else:
                assert isinstance(column.type, REFLECTED[declared]), (column.name, column.type)
            if declared == "String":
                assert column.type.length == spec.sql.length, column.name
            if declared == "Text":
                assert getattr(column.type, "length", None) is None, column.name
            assert column.nullable == (column.name in NULLABLE), column.name
            assert column.primary_key == (column.name == "id"), column.name
    # The ORM tables are built from the same declaration.
    for orm in (LedgerEvent, LedgerEventArchive):
        assert tuple(c.name for c in orm.__table__.columns) == NAMES


def test_usage_json_and_csv_show_the_public_columns(api):
    """A real request's event, as GET /v1/usage returns it: the JSON's keys (the details nested)
    and the CSV header are the declared public columns, in their order."""
    _, _, token = api.principal()
    response = api.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        json={"model": "gpt-sim", "messages": [{"role": "user", "content": "hi sim:tokens=3"}]},
    )
    assert response.status_code == 200, response.text
    [event] = api.events(token_id=token["id"])
    flat = []
    for key, value in event.items():
        if key in (PROMPT_DETAILS, COMPLETION_DETAILS):
            assert all(SPECS[name].group == key for name in value)
            flat.extend(value)
        else:
            flat.append(key)
    assert tuple(flat) == PUBLIC
    assert tuple(event[COMPLETION_DETAILS]) == DETAIL_FIELDS
    assert PUBLIC == NAMES  # the ledger shown whole
    text = api.request("GET", "/v1/usage", params={"token_id": token["id"], "format": "csv"}).text
    header, row = list(csv.reader(io.StringIO(text)))
    assert tuple(header) == PUBLIC
    assert dict(zip(header, row, strict=True))["completion_tokens"] == "3"


def test_the_rollup_projects_declared_columns(api):
    """An appended event's rollup row holds the event's own values under its key, and a rebuild
    from the migrated ledger table gives the same row."""
    event = sample_event()
    projection = rollup.row_for(event)
    pending = {c.name for c in RollupPending.__table__.columns} - {"id"}
    assert (
        set(projection)
        == pending
        == {c.name for c in SpendHourly.__table__.columns}
        | {
            "end_user",
            "tags",
        }
    )
    assert set(rollup.PENDING_KEY) - {"hour"} <= set(NAMES)
    assert set(rollup.SUMS) - {"adjustments"} <= set(NAMES)  # the adjustments' cost

    async def append_and_rebuild() -> tuple[list, list]:
        db = Database(api.settings.database_url, pool_size=1)
        key = SpendHourly.token_id == event.token_id
        try:
            async with db.transaction() as session:
                await writer.append(session, event)
            await fold_all(db)  # its increment, from rollup_pending into the rollups
            async with db.sessions() as session:
                kept = [
                    tuple(r)
                    for r in await session.execute(sql_select(SpendHourly.__table__).where(key))
                ]
            async with db.transaction() as session:
                await session.execute(SpendHourly.__table__.delete().where(key))
                ledger = LedgerEvent.__table__
                only = sql_select(ledger).where(ledger.c.token_id == event.token_id).subquery()
                await session.execute(rebuild_statement(only, db.dialect))
            async with db.sessions() as session:
                rebuilt = [
                    tuple(r)
                    for r in await session.execute(sql_select(SpendHourly.__table__).where(key))
                ]
        finally:
            await db.dispose()
        return kept, rebuilt

    kept, rebuilt = asyncio.run(append_and_rebuild())
    columns = [c.name for c in SpendHourly.__table__.columns]
    assert [dict(zip(columns, r, strict=True)) for r in kept] == [
        {k: v for k, v in projection.items() if k in columns}
        | {"hour": datetime(2026, 3, 4, 5, tzinfo=UTC)}
    ]
    assert rebuilt == kept
