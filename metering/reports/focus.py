"""GET /v1/exports/focus: spend as FinOps FOCUS 1.2 rows (metering.reports.focus_columns), in
CSV or Parquet, streamed.

The rows come from the same single statement as GET /v1/spend grouped by hour, team, user,
token, model and provider (the rollups for whole hours, adjustments included), so the export's
BilledCost totals equal /v1/spend's cost over the same range. Each group gives:

* one Usage row per token kind it consumed: `Input Tokens` (prompt tokens not cached),
  `Cached Input Tokens`, `Output Tokens`; ConsumedQuantity and PricingQuantity are the tokens,
  ConsumedUnit and PricingUnit `Tokens`, ListUnitPrice the price in force at the hour (the price
  history), ListCost = ListUnitPrice x PricingQuantity. BilledCost (= EffectiveCost =
  ContractedCost) is ListCost, and the part of the group's charge that the list prices do not
  explain (a charge stopped at its hold, a price changed within the hour) is added to the
  group's largest row, so the rows sum to the charge exactly;
* a `Requests` row when it charged without counting tokens (a hold charged in full);
* one Adjustment row (ChargeFrequency One-Time) with the group's adjustments (price
  corrections, credits), when there are any.

A group is also split by the end user and the tags its events carry (FOCUS `Tags`: the team,
user and token, `end_user` when there is one, and each of the event's tags as `tag:<key>`, the
name /v1/spend gives a tag's column, so no tag can take a key of ours). The rollups keep no end
user or tags: the groups of the hour come from them whole, less the events that carry an end
user or tags, which are read from the ledger (and its archive) and added back by end user and
tags. The sums stay the rollups', so BilledCost still totals /v1/spend's cost, and a range whose
requests carry no attribution reads nothing more than before.

A CSV is written a chunk of groups at a time; a Parquet file one row group per chunk (its bytes
leave as each row group is written, the footer last), so no range is held whole in memory.
"""

import asyncio
import csv
import io
import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import String, case, func, literal, or_, select, union_all

from metering.db import Database, utcnow
from metering.errors import InvalidRequest
from metering.ledger.event import ADJUSTMENT, CHAT
from metering.ledger.prices import PriceBook
from metering.ledger.rollup import floor_hour, hour_text, hour_value
from metering.ledger.tables import LedgerEvent, LedgerEventArchive
from metering.reports.focus_columns import (
    BY_NAME,
    DATETIME,
    DECIMAL,
    SERVICE_CATEGORY,
    SERVICE_SUBCATEGORY,
    SPEC,
)
from metering.reports.spend import METRICS, check_range, parse_time, spend_query
from metering.timefmt import parse_rfc3339

CHUNK = 5_000  # groups read, turned into rows and written at a time (one Parquet row group)
KEYS = ["hour", "team_id", "user_id", "token_id", "model", "provider"]
# The ledger's columns a group is split by: its end user, its tags, and the API it was asked
# through (chat completions, the rollups' own, or the Responses API).
ATTRIBUTION = ("end_user", "tags", "endpoint")
NO_TAGS = "{}"
DEFAULT_DAYS = 30
# parse_range's whole hours as a JSON Schema pattern (the export's start and end): an RFC 3339
# date-time on a whole UTC hour: no seconds (nor any fraction of one), and minutes that its
# offset's take back to a whole hour (10:30+05:30 is 05:00 UTC, 10:30-03:30 14:00, 23:59-00:01
# 00:00).
_ON_HOUR = r"(?:[01][0-9]|2[0-3])"
WHOLE_HOUR_PATTERN = (
    rf"^(?:[0-9]{{3}}[1-9]|[0-9]{{2}}[1-9]0|[0-9][1-9]00|[1-9]000)-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])[Tt]{_ON_HOUR}:(?:"
    + "|".join(
        rf"{m:02d}:00(?:\.0+)?(?:{'[Zz]|' if m == 0 else ''}\+{_ON_HOUR}:{m:02d}"
        rf"|-{_ON_HOUR}:{(60 - m) % 60:02d})"
        for m in range(60)
    )
    + ")$"
)
TOKENS = "Tokens"
EXPORTED = frozenset(
    (
        "BilledCost",
        "BillingAccountId",
        "BillingAccountName",
        "BillingCurrency",
        "BillingPeriodEnd",
        "BillingPeriodStart",
        "ChargeCategory",
        "ChargeClass",
        "ChargeDescription",
        "ChargeFrequency",
        "ChargePeriodEnd",
        "ChargePeriodStart",
        "ConsumedQuantity",
        "ConsumedUnit",
        "ContractedCost",
        "ContractedUnitPrice",
        "EffectiveCost",
        "InvoiceId",
        "InvoiceIssuerName",
        "ListCost",
        "ListUnitPrice",
        "PricingCategory",
        "PricingCurrency",
        "PricingCurrencyContractedUnitPrice",
        "PricingCurrencyEffectiveCost",
        "PricingCurrencyListUnitPrice",
        "PricingQuantity",
        "PricingUnit",
        "ProviderName",
        "PublisherName",
        "ResourceId",
        "ResourceName",
        "ResourceType",
        "ServiceCategory",
        "ServiceName",
        "ServiceSubcategory",
        "SkuId",
        "SkuMeter",
        "SubAccountId",
        "SubAccountName",
        "Tags",
    )
)
COLUMNS = tuple(column.name for column in SPEC if column.name in EXPORTED)  # the spec's order


def _usd(pico: int) -> Decimal:
    return Decimal(pico).scaleb(-12)


def _month(at: datetime) -> tuple[datetime, datetime]:
    start = at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else (start.replace(month=start.month + 1))
    )
    return start, end


def parse_range(start: str | None, end: str | None) -> tuple[datetime, datetime]:
    """[start, end) on whole UTC hours (a FOCUS charge period here is an hour); default the
    30 days up to the end of the current hour."""
    end_at = parse_time(end, "end") or floor_hour(utcnow()) + timedelta(hours=1)
    start_at = parse_time(start, "start") or end_at - timedelta(days=DEFAULT_DAYS)
    for name, text in (("start", start), ("end", end)):
        # the text as sent, as the document declares it: clamped into the stored years, a
        # moment far off would be on a whole hour whatever it said
        if text is not None and re.fullmatch(WHOLE_HOUR_PATTERN, text) is None:
            raise InvalidRequest(f"{name} must be on a whole UTC hour", param=name)
    check_range(start_at, end_at)
    return start_at, end_at


def focus_tags(g) -> str:
    """FOCUS Tags of a group: team_id, user_id and token_id, end_user when its requests had one,
    endpoint when they were asked through the Responses API (`responses`; chat completions, the
    rest, say none), and their tags, each as `tag:<key>`."""
    tags: dict[str, str | None] = {
        "team_id": g.team_id,
        "user_id": g.user_id or None,
        "token_id": g.token_id,
    }
    if g.end_user is not None:
        tags["end_user"] = g.end_user
    if g.endpoint != CHAT:
        tags["endpoint"] = g.endpoint
    for key, value in sorted(json.loads(g.tags or NO_TAGS).items()):
        tags[f"tag:{key}"] = value
    return json.dumps(tags, separators=(",", ":"), ensure_ascii=False)


def _attributed(table, dialect: str, filters: dict, start: datetime, end: datetime, sign: int):
    """The events of [start, end) that carry an end user or tags, as rows of the report's
    shape: by their end user and tags (sign 1), or as the part of the rollups' unattributed
    groups to take away (sign -1: no end user, no tags, every figure negated)."""
    t = table
    keys = [
        hour_text(hour_value(t.c.created_at, dialect), dialect).label("hour"),
        t.c.team_id,
        t.c.user_id,
        t.c.token_id,
        t.c.model,
        t.c.provider,
    ]
    if sign > 0:
        keys += [t.c.end_user, t.c.tags, t.c.endpoint]
    else:
        keys += [
            literal(None, String).label("end_user"),
            literal(NO_TAGS).label("tags"),
            literal(CHAT).label("endpoint"),
        ]
    adjustment = t.c.kind == ADJUSTMENT
    figures = {
        "requests": func.sum(case((adjustment, 0), else_=1)),
        "prompt_tokens": func.sum(t.c.prompt_tokens),
        "cached_tokens": func.sum(t.c.cached_tokens),
        "completion_tokens": func.sum(t.c.completion_tokens),
        "reasoning_tokens": func.sum(func.coalesce(t.c.reasoning_tokens, 0)),
        "cost": func.sum(t.c.cost),
        "uncharged": func.sum(t.c.uncharged),
        "adjustments": func.sum(case((adjustment, t.c.cost), else_=0)),
    }
    return (
        select(*keys, *((func.coalesce(figures[m], 0) * sign).label(m) for m in METRICS))
        .where(
            t.c.created_at >= start,
            t.c.created_at < end,
            or_(t.c.end_user.is_not(None), t.c.tags != NO_TAGS, t.c.endpoint != CHAT),
            *(t.c[k] == v for k, v in filters.items()),
        )
        .group_by(*keys[:6], *(keys[6:] if sign > 0 else ()))
    )


def focus_query(dialect: str, filters: dict, start: datetime, end: datetime):
    """The export's groups: /v1/spend's by hour, team, user, token, model and provider (whole
    hours: from the rollups), each split by the end user and the tags of its events."""
    whole = spend_query(dialect, KEYS, filters, start, end)
    if whole is None:
        return None
    report = whole.order_by(None).subquery("report")
    unattributed = select(
        *(report.c[k] for k in KEYS),
        literal(None, String).label("end_user"),
        literal(NO_TAGS).label("tags"),
        literal(CHAT).label("endpoint"),
        *(report.c[m] for m in METRICS),
    )
    parts = [unattributed]
    for table in (LedgerEvent.__table__, LedgerEventArchive.__table__):
        for sign in (-1, 1):
            parts.append(_attributed(table, dialect, filters, start, end, sign))
    source = union_all(*parts).subquery("source")
    keys = [source.c[k] for k in (*KEYS, *ATTRIBUTION)]
    sums = [func.sum(source.c[m]).label(m) for m in METRICS]
    return (
        select(*keys, *sums)
        .group_by(*keys)
        .having(or_(*(func.sum(source.c[m]) != 0 for m in ("requests", "cost", "adjustments"))))
        .order_by(*keys)
    )


class Rows:
    """Turns the report's groups into FOCUS rows (dicts of Python values)."""

    def __init__(self, book: PriceBook, account: str) -> None:
        self.book, self.account = book, account

    def common(self, g, hour: datetime) -> dict:
        billing_start, billing_end = _month(hour)
        provider = g.provider or self.account  # a credit named no provider: ours
        service = g.model or "adjustments"
        token = g.token_id
        return {
            "BillingAccountId": self.account,
            "BillingAccountName": self.account,
            "BillingCurrency": "USD",
            "BillingPeriodStart": billing_start,
            "BillingPeriodEnd": billing_end,
            "ChargeClass": None,
            "ChargePeriodStart": hour,
            "ChargePeriodEnd": hour + timedelta(hours=1),
            "InvoiceId": None,
            "InvoiceIssuerName": provider,
            "PricingCurrency": "USD",
            "ProviderName": provider,
            "PublisherName": provider,
            "ResourceId": token or g.user_id or g.team_id,
            "ResourceName": None,
            "ResourceType": "API Token" if token else ("User" if g.user_id else "Team"),
            "ServiceCategory": SERVICE_CATEGORY,
            "ServiceName": service,
            "ServiceSubcategory": SERVICE_SUBCATEGORY,
            "SkuId": f"{provider}/{service}",
            "SubAccountId": g.team_id,
            "SubAccountName": None,
            "Tags": focus_tags(g),
        }

    def of(self, g) -> list[dict]:
        hour = parse_rfc3339(g.hour)
        common = self.common(g, hour)
        adjustments = int(g.adjustments or 0)
        charged = int(g.cost or 0) - adjustments
        price = self.book.at(g.model, g.provider, hour) if g.model else None
        prices = price.prices if price is not None else (None, None, None)
        prompt, cached = int(g.prompt_tokens or 0), int(g.cached_tokens or 0)
        kinds = (
            ("Input Tokens", prompt - cached, prices[0]),
            ("Cached Input Tokens", cached, prices[1]),
            ("Output Tokens", int(g.completion_tokens or 0), prices[2]),
        )
        usage: list[list[Any]] = []  # meter, quantity, unit price, listed, billed
        for meter, quantity, micro in kinds:
            if quantity <= 0:
                continue
            listed = quantity * micro if micro is not None else None
            usage.append([meter, quantity, micro, listed, listed or 0])
        if usage and any(row[2] is None for row in usage):
            # No price recorded for the hour: the charge itself, on the first kind.
            for row in usage:
                row[3], row[4] = None, 0
        residual = charged - sum(row[4] for row in usage)
        if usage:
            max(usage, key=lambda row: row[4])[4] += residual
        elif charged or int(g.requests or 0):
            usage.append(["Requests", int(g.requests or 0), None, None, charged])
        out = []
        for meter, quantity, micro, listed, billed in usage:
            unit = _usd(micro) if micro is not None else None
            unit_name = TOKENS if meter != "Requests" else "Requests"
            out.append(
                {
                    **common,
                    "ChargeCategory": "Usage",
                    "ChargeFrequency": "Usage-Based",
                    "ChargeDescription": f"{g.model} {meter.lower()} at {g.provider}",
                    "SkuMeter": meter,
                    "ConsumedQuantity": Decimal(quantity),
                    "ConsumedUnit": unit_name,
                    "PricingQuantity": Decimal(quantity),
                    "PricingUnit": unit_name,
                    "PricingCategory": "Standard",
                    "ListUnitPrice": unit,
                    "ContractedUnitPrice": unit,
                    "PricingCurrencyListUnitPrice": unit,
                    "PricingCurrencyContractedUnitPrice": unit,
                    "ListCost": _usd(listed if listed is not None else billed),
                    "BilledCost": _usd(billed),
                    "EffectiveCost": _usd(billed),
                    "ContractedCost": _usd(billed),
                    "PricingCurrencyEffectiveCost": _usd(billed),
                }
            )
        if adjustments:
            out.append(
                {
                    **common,
                    "ChargeCategory": "Adjustment",
                    "ChargeFrequency": "One-Time",
                    "ChargeDescription": "adjustments: price corrections and credits",
                    "SkuMeter": None,
                    "ConsumedQuantity": None,
                    "ConsumedUnit": None,
                    "PricingQuantity": None,
                    "PricingUnit": None,
                    "PricingCategory": None,
                    "ListUnitPrice": None,
                    "ContractedUnitPrice": None,
                    "PricingCurrencyListUnitPrice": None,
                    "PricingCurrencyContractedUnitPrice": None,
                    "ListCost": _usd(adjustments),
                    "BilledCost": _usd(adjustments),
                    "EffectiveCost": _usd(adjustments),
                    "ContractedCost": _usd(adjustments),
                    "PricingCurrencyEffectiveCost": _usd(adjustments),
                }
            )
        return out


async def _groups(db: Database, start: datetime, end: datetime, filters: dict):
    """The report's groups, CHUNK at a time as the database sends them."""
    query = focus_query(db.dialect, filters, start, end)
    if query is None:
        return
    async with db.reads() as session:
        result = await session.stream(query)
        async for part in result.partitions(CHUNK):
            yield part
            await asyncio.sleep(0)


async def _rows(db: Database, start, end, filters: dict, account: str):
    async with db.reads() as session:
        book = await PriceBook.load(session, None)
    rows = Rows(book, account)
    async for part in _groups(db, start, end, filters):
        yield [row for g in part for row in rows.of(g)]


def _text(name: str, value) -> str:
    if value is None:
        return ""
    kind = BY_NAME[name].type
    if kind == DECIMAL:
        return f"{value:f}"
    if kind == DATETIME:
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value)


async def csv_stream(db, start, end, filters: dict, account: str) -> AsyncIterator[bytes]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    yield buffer.getvalue().encode()
    async for rows in _rows(db, start, end, filters, account):
        buffer.seek(0)
        buffer.truncate()
        for row in rows:
            writer.writerow([_text(name, row[name]) for name in COLUMNS])
        yield buffer.getvalue().encode()


def parquet_schema():
    import pyarrow as pa

    types = {
        DECIMAL: pa.decimal128(38, 12),
        DATETIME: pa.timestamp("us", tz="UTC"),
    }
    return pa.schema(
        [
            pa.field(name, types.get(BY_NAME[name].type, pa.string()), BY_NAME[name].nullable)
            for name in COLUMNS
        ]
    )


class _Drain(io.RawIOBase):
    """A file the Parquet writer writes to and the response empties after each row group."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.position = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        self.position += len(data)
        return len(data)

    def tell(self) -> int:
        return self.position

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


async def parquet_stream(db, start, end, filters: dict, account: str) -> AsyncIterator[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    sink = _Drain()
    writer = pq.ParquetWriter(sink, schema)
    try:
        async for rows in _rows(db, start, end, filters, account):
            if rows:
                columns = {name: [row[name] for row in rows] for name in COLUMNS}
                writer.write_table(pa.table(columns, schema=schema))
                yield sink.take()
    finally:
        writer.close()
    yield sink.take()
