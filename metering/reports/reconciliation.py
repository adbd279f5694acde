"""Reconciliation: a provider's own usage export compared with the ledger.

The export is CSV with the columns date, provider, model, prompt_tokens, completion_tokens,
cost and, optionally, upstream_id; `model` is the provider's own name (our upstream_model).
The ledger's events of that provider on the days the file covers are summed per day and model
and compared with the file's sums, and request by request where the file gives upstream ids.
Figures agree when they differ by at most `tolerance` relative to the larger of the two.
"""

import asyncio
import csv
import io
import json
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from metering.alerts import record
from metering.db import Database, dialect_name, utcnow
from metering.errors import InvalidRequest
from metering.ledger.event import ADJUSTMENT
from metering.ledger.rollup import day_text
from metering.ledger.tables import LedgerEvent, LedgerEventArchive
from metering.models import Reconciliation
from metering.money import PICO, format_usd
from metering.numbers import NumberError, parse_count, parse_decimal
from metering.timefmt import EARLIEST, END, parse_rfc3339, rfc3339

REQUIRED = ("date", "provider", "model", "prompt_tokens", "completion_tokens", "cost")
STATUSES = ("matched", "differs", "missing_in_ledger", "missing_in_provider")
DEFAULT_TOLERANCE = Decimal("0.001")
ID_CHUNK = 500
# Bounds on one line of an export: far above any real request or day, far below what would
# make the sums slow or their text unreadable.
MAX_ROW_TOKENS = 10**15
MAX_ROW_COST = Decimal(10) ** 12  # USD
MAX_TEXT_CHARS = {"model": 200, "upstream_id": 200}
NOTE = (
    "{estimated} ledger event(s) in these rows have estimated usage (the upstream reported "
    "none) and {unsettled} were charged as unsettled (their request never settled, so the "
    "whole hold was charged): their tokens and cost are the proxy's own figures, which is "
    "what this reconciliation is for; see estimated_events and unsettled_events per row."
)


class MalformedExport(InvalidRequest):
    pass


@dataclass(slots=True)
class Sums:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: Decimal = Decimal(0)
    estimated: int = 0
    unsettled: int = 0
    uncharged: Decimal = Decimal(0)  # part of cost the budgets were not charged
    anomalies: int = 0  # events with a usage_anomaly

    def add(self, other: "Sums") -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cost += other.cost
        self.estimated += other.estimated
        self.unsettled += other.unsettled
        self.uncharged += other.uncharged
        self.anomalies += other.anomalies

    def out(self) -> dict:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost": usd_text(self.cost),
        }


def usd_text(amount: Decimal) -> str:
    pico = amount * PICO
    if pico == pico.to_integral_value():
        return format_usd(int(pico))
    return format(amount, "f")


@dataclass(slots=True)
class Export:
    rows: dict[tuple[str, str], Sums]  # (day, model) -> sums
    requests: dict[str, Sums]  # upstream_id -> sums
    days: set[date]


# parse_tolerance's rule, declared: a decimal from 0 to 1 (written with an exponent, or with
# spaces around it, it is taken but not declared).
TOLERANCE_PATTERN = r"^\+?(?:0*1(?:\.0*)?|0+(?:\.[0-9]*)?|0*\.[0-9]+)$"


def parse_tolerance(value: str | None) -> Decimal:
    if value is None:
        return DEFAULT_TOLERANCE
    try:
        return parse_decimal(value, "tolerance", low=0, high=1)
    except NumberError:
        raise InvalidRequest("tolerance must be a number from 0 to 1", param="tolerance") from None


FIRST_DAY, LAST_DAY = EARLIEST.date(), (END - timedelta(days=1)).date()  # the moments' bounds


def _day(value: str) -> date:
    value = value.strip()
    day = date.fromisoformat(value) if len(value) == 10 else parse_rfc3339(value).date()
    if not FIRST_DAY <= day <= LAST_DAY:
        raise ValueError("date out of range")
    return day


def _count(value: str, name: str, line: int) -> int:
    """ASCII digits only (int() would take "²"), bounded before int() reads them."""
    try:
        return parse_count(value, name, high=MAX_ROW_TOKENS)
    except NumberError as exc:
        raise MalformedExport(f"line {line}: {exc}", param=name) from None


def _cost(value: str, line: int) -> Decimal:
    try:
        return parse_decimal(value, "cost", low=0, high=MAX_ROW_COST)
    except NumberError as exc:
        raise MalformedExport(f"line {line}: {exc}", param="cost") from None


def _text(row: list, at: dict, name: str, line: int) -> str:
    """A text cell, as the ledger could hold it: bounded, no control characters (PostgreSQL
    refuses NUL even as a query parameter)."""
    value = row[at[name]].strip() if name in at else ""
    limit = MAX_TEXT_CHARS.get(name, 100)
    if len(value) > limit:
        raise MalformedExport(f"line {line}: {name} is longer than {limit} characters", param=name)
    if any(c < " " or c == "\x7f" for c in value):
        raise MalformedExport(f"line {line}: {name} contains control characters", param=name)
    return value


def parse_export(data: bytes, provider: str) -> Export:
    """The file's sums per day and model, and per upstream id; MalformedExport names the line."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise MalformedExport(f"line {line}: the file is not UTF-8 text") from None
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    export = Export(defaultdict(Sums), defaultdict(Sums), set())
    try:
        header = [name.strip().lower() for name in next(reader, [])]
        missing = [name for name in REQUIRED if name not in header]
        if missing:
            raise MalformedExport(f"line 1: missing column(s): {', '.join(missing)}")
        at = {name: header.index(name) for name in (*REQUIRED, "upstream_id") if name in header}
        for row in reader:
            if any(cell.strip() for cell in row):
                _add_row(export, row, len(header), at, provider, reader.line_num)
    except csv.Error as exc:
        raise MalformedExport(f"line {reader.line_num}: {exc}") from None
    if not export.days:
        raise MalformedExport("the file has no rows")
    return export


def _add_row(export: Export, row: list, width: int, at: dict, provider: str, line: int) -> None:
    if len(row) != width:
        raise MalformedExport(f"line {line}: {len(row)} fields where the header has {width}")
    try:
        day = _day(row[at["date"]])
    except (ValueError, OverflowError):
        raise MalformedExport(
            f"line {line}: date {row[at['date']][:40]!r} is not YYYY-MM-DD or an RFC 3339 "
            f"timestamp from {FIRST_DAY} to {LAST_DAY}",
            param="date",
        ) from None
    named = _text(row, at, "provider", line)
    if named and named != provider:
        raise MalformedExport(f"line {line}: provider {named!r} is not {provider!r}")
    model = _text(row, at, "model", line)
    if not model:
        raise MalformedExport(f"line {line}: model is empty")
    sums = Sums(
        requests=1,
        prompt_tokens=_count(row[at["prompt_tokens"]], "prompt_tokens", line),
        completion_tokens=_count(row[at["completion_tokens"]], "completion_tokens", line),
        cost=_cost(row[at["cost"]], line),
    )
    export.days.add(day)
    export.rows[(day.isoformat(), model)].add(sums)
    upstream_id = _text(row, at, "upstream_id", line)
    if upstream_id:
        export.requests[upstream_id].add(sums)


def _sums_columns(t) -> list:
    # Adjustments (price corrections, credits) count in the cost, not as requests.
    return [
        func.sum(case((t.c.kind == ADJUSTMENT, 0), else_=1)).label("requests"),
        func.sum(t.c.prompt_tokens).label("prompt_tokens"),
        func.sum(t.c.completion_tokens).label("completion_tokens"),
        # What the upstream reported: the charged cost plus what the hold did not cover.
        func.sum(t.c.cost + t.c.uncharged).label("cost"),
        func.sum(t.c.uncharged).label("uncharged"),
        func.sum(case((t.c.usage_anomaly.is_(None), 0), else_=1)).label("anomalies"),
        func.sum(case((t.c.usage_source == "estimated", 1), else_=0)).label("estimated"),
        func.sum(case((t.c.usage_source == "unsettled", 1), else_=0)).label("unsettled"),
    ]


def _sums(row) -> Sums:
    return Sums(
        requests=int(row.requests),
        prompt_tokens=int(row.prompt_tokens or 0),
        completion_tokens=int(row.completion_tokens or 0),
        cost=Decimal(int(row.cost or 0)) / PICO,
        estimated=int(row.estimated or 0),
        unsettled=int(row.unsettled or 0),
        uncharged=Decimal(int(row.uncharged or 0)) / PICO,
        anomalies=int(row.anomalies or 0),
    )


TABLES = (LedgerEvent.__table__, LedgerEventArchive.__table__)


def _billed(t):
    """Attempts the upstream did not bill (no tokens, no cost) are in no provider's export."""
    return (
        (t.c.prompt_tokens > 0)
        | (t.c.completion_tokens > 0)
        | (t.c.cost > 0)
        | (t.c.kind == ADJUSTMENT)
    )


async def ledger_rows(session: AsyncSession, provider: str, days: set[date]) -> dict:
    """The ledger's (and its archive's) sums per day and upstream model, on the file's days."""
    start = datetime.combine(min(days), time(), UTC)
    end = datetime.combine(max(days), time(), UTC) + timedelta(days=1)
    wanted = {d.isoformat() for d in days}
    out: dict[tuple[str, str], Sums] = defaultdict(Sums)
    for t in TABLES:
        day = day_text(t.c.created_at, dialect_name(session)).label("day")
        query = (
            select(day, t.c.upstream_model, *_sums_columns(t))
            .where(
                t.c.provider == provider,
                t.c.created_at >= start,
                t.c.created_at < end,
                _billed(t),
            )
            .group_by(day, t.c.upstream_model)
        )
        for row in await session.execute(query):
            if row.day in wanted:
                out[(row.day, row.upstream_model)].add(_sums(row))
    return out


async def ledger_requests(
    session: AsyncSession, provider: str, days: set[date], ids: set[str]
) -> dict:
    """The ledger's events by upstream id: every one of the file's days, and the file's ids
    wherever they fall (a request near midnight may be dated differently by the provider)."""
    start = datetime.combine(min(days), time(), UTC)
    end = datetime.combine(max(days), time(), UTC) + timedelta(days=1)
    dialect = dialect_name(session)
    wanted = {d.isoformat() for d in days}
    out: dict[str, Sums] = defaultdict(Sums)
    for t in TABLES:
        day = day_text(t.c.created_at, dialect).label("day")
        query = (
            select(t.c.upstream_id, day, *_sums_columns(t))
            .where(
                t.c.provider == provider,
                t.c.created_at >= start,
                t.c.created_at < end,
                t.c.upstream_id.is_not(None),
                _billed(t),
            )
            .group_by(t.c.upstream_id, day)
        )
        for row in await session.execute(query):
            if row.day in wanted:
                out[row.upstream_id].add(_sums(row))
    elsewhere = sorted(ids - set(out))
    for i in range(0, len(elsewhere), ID_CHUNK):
        chunk = elsewhere[i : i + ID_CHUNK]
        for t in TABLES:
            query = (
                select(t.c.upstream_id, *_sums_columns(t))
                .where(t.c.provider == provider, t.c.upstream_id.in_(chunk))
                .group_by(t.c.upstream_id)
            )
            for row in await session.execute(query):
                out[row.upstream_id].add(_sums(row))
    return out


def _close(a, b, tolerance: Decimal) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def status_of(ledger: Sums | None, provider: Sums | None, tolerance: Decimal) -> str:
    if ledger is None:
        return "missing_in_ledger"
    if provider is None:
        return "missing_in_provider"
    fields = ("prompt_tokens", "completion_tokens", "cost")
    same = all(_close(getattr(provider, f), getattr(ledger, f), tolerance) for f in fields)
    return "matched" if same else "differs"


def _difference(ledger: Sums | None, provider: Sums | None) -> dict:
    """Provider side minus ledger, a missing side counting as zero."""
    ledger, provider = ledger or Sums(), provider or Sums()
    return {
        "requests": provider.requests - ledger.requests,
        "prompt_tokens": provider.prompt_tokens - ledger.prompt_tokens,
        "completion_tokens": provider.completion_tokens - ledger.completion_tokens,
        "cost": usd_text(provider.cost - ledger.cost),
    }


def _compared(ledger: Sums | None, provider: Sums | None, tolerance: Decimal) -> dict:
    return {
        "status": status_of(ledger, provider, tolerance),
        "ledger": ledger.out() if ledger else None,
        "provider_side": provider.out() if provider else None,
        "difference": _difference(ledger, provider),
        "estimated_events": ledger.estimated if ledger else 0,
        "unsettled_events": ledger.unsettled if ledger else 0,
        # The ledger's cost is what the upstream reported; this much of it was above the
        # requests' holds and not charged to budgets (see usage_anomaly in /v1/usage).
        "uncharged": usd_text(ledger.uncharged if ledger else Decimal(0)),
        "anomalous_events": ledger.anomalies if ledger else 0,
    }


def compare(provider: str, tolerance: Decimal, export: Export, ledger: dict, requests: dict):
    rows = []
    for day, model in sorted(set(export.rows) | set(ledger)):
        found = _compared(ledger.get((day, model)), export.rows.get((day, model)), tolerance)
        rows.append({"day": day, "provider": provider, "model": model, **found})
    by_id = []
    if export.requests:
        for upstream_id in sorted(set(export.requests) | set(requests)):
            found = _compared(
                requests.get(upstream_id), export.requests.get(upstream_id), tolerance
            )
            by_id.append({"upstream_id": upstream_id, **found})
    estimated = sum(r["estimated_events"] for r in rows)
    unsettled = sum(r["unsettled_events"] for r in rows)
    return {
        "summary": {s: sum(r["status"] == s for r in rows) for s in STATUSES},
        "request_summary": {s: sum(r["status"] == s for r in by_id) for s in STATUSES},
        "estimated_events": estimated,
        "unsettled_events": unsettled,
        "note": NOTE.format(estimated=estimated, unsettled=unsettled)
        if estimated or unsettled
        else None,
        "rows": rows,
        "requests": by_id,
    }


async def reconcile(db: Database, provider: str, tolerance: Decimal, data: bytes) -> dict:
    """Compare an export with the ledger, store the result and return it."""
    # Reading a file of up to 64 MiB is CPU work: in a worker thread, the proxy keeps serving.
    export = await asyncio.to_thread(parse_export, data, provider)
    async with db.sessions() as session:
        ledger = await ledger_rows(session, provider, export.days)
        requests = (
            await ledger_requests(session, provider, export.days, set(export.requests))
            if export.requests
            else {}
        )
    now = utcnow()
    result = {
        "id": f"rec_{uuid.uuid4().hex[:24]}",
        "provider": provider,
        "created_at": rfc3339(now),
        "tolerance": str(tolerance),
        "days": sorted(d.isoformat() for d in export.days),
        **compare(provider, tolerance, export, ledger, requests),
    }
    async with db.transaction() as session:
        session.add(
            Reconciliation(
                id=result["id"],
                provider=provider,
                created_at=now,
                tolerance=str(tolerance),
                result=json.dumps(result),
            )
        )
        await _alert_differs(session, result, now)
    return result


async def _alert_differs(session, result: dict, now) -> None:
    """reconciliation.differs, in the transaction that stores a comparison that differs."""
    differing = {
        status: result["summary"][status] + result["request_summary"][status]
        for status in STATUSES
        if status != "matched"
    }
    if not any(differing.values()):
        return
    data = {
        "scope": "reconciliation",
        "subject_id": result["id"],
        "team_id": None,
        "provider": result["provider"],
        "days": result["days"][:31],
        **differing,
    }
    row = record.event_row(record.RECONCILIATION_DIFFERS, result["id"], data, now)
    await record.write(session, [row])


async def load(db: Database, reconciliation_id: str) -> dict | None:
    async with db.sessions() as session:
        stored = await session.get(Reconciliation, reconciliation_id)
    return json.loads(stored.result) if stored else None
