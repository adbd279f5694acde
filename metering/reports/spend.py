"""GET /v1/spend: spend summed by any combination of team, user, token, model, provider, day and
hour, computed in SQL.

Whole hours come from the hourly rollup (spend_hourly), which settle keeps equal to the ledger;
only the partial hours at the range's edges are read from the ledger itself (and its archive),
so a report over months reads a few thousand rollup rows, never millions of events, and is
exact for any start and end.

A report holds at most `limit` rows (default DEFAULT_ROWS, at most MAX_ROWS), ordered by its
group keys; `page` walks the rest. Rows are read and written in chunks with the event loop
free between them, so a large report never stalls the requests the proxy is serving.
"""

import asyncio
import csv
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial

from sqlalchemy import func, literal, select, union_all

from metering.auth.service import Principal
from metering.db import Database, utcnow
from metering.errors import InvalidRequest
from metering.ledger.rollup import ceil_hour, day_text, floor_hour, hour_text
from metering.models import LedgerEvent, LedgerEventArchive, SpendHourly
from metering.money import format_usd
from metering.reports.cells import row as csv_cells
from metering.reports.usage import check_range, check_text, own_user, parse_time
from metering.timefmt import rfc3339

DEFAULT_DAYS = 30
DEFAULT_ROWS = 10_000  # rows per page unless `limit` says otherwise
MAX_ROWS = 100_000  # the largest `limit`
MAX_PAGE = 1_000_000
CHUNK = 1_000  # rows read or written between two turns of the event loop
# group_by name -> the key it adds to each row
GROUPS = {
    "team": "team_id",
    "user": "user_id",
    "token": "token_id",
    "model": "model",
    "provider": "provider",
    "day": "day",
    "hour": "hour",
}
METRICS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost",
    "uncharged",
)


def parse_group_by(value: str | None) -> list[str]:
    names: list[str] = []
    for part in (value or "").split(","):
        name = part.strip().lower()
        if not name:
            continue
        name = name.removesuffix("_id") if name.removesuffix("_id") in GROUPS else name
        if name not in GROUPS:
            raise InvalidRequest(
                f"group_by: unknown key {part.strip()!r}; use any of {', '.join(GROUPS)}",
                param="group_by",
            )
        if name not in names:
            names.append(name)
    return names


def _keys(table, dialect: str, keys: list[str]) -> list:
    """The group keys of ledger rows, as the report names them."""
    out = []
    for key in keys:
        if key == "day":
            column = day_text(table.c.created_at, dialect)
        elif key == "hour":
            column = hour_text(table.c.created_at, dialect)
        else:
            column = table.c[key]
        out.append(column.label(key))
    return out


def _rollup_part(dialect, keys, filters, start: datetime, end: datetime):
    """Sums by the plain keys and the raw hour first (a hash aggregate over the rollup rows),
    then by the day or hour text: the text is made once per group, not once per rollup row."""
    t = SpendHourly.__table__
    plain = [k for k in keys if k not in ("day", "hour")]
    columns = [
        (func.nullif(t.c.token_id, "") if k == "token_id" else t.c[k]).label(k) for k in plain
    ]
    if len(plain) < len(keys):
        columns.append(t.c.hour.label("at"))
    inner = (
        select(*columns, *(func.sum(t.c[m]).label(m) for m in METRICS))
        .where(t.c.hour >= start, t.c.hour < end, *(t.c[k] == v for k, v in filters.items()))
        .group_by(*columns)
        .subquery("rollup")
    )
    outer = []
    for key in keys:
        if key == "day":
            outer.append(day_text(inner.c.at, dialect).label(key))
        elif key == "hour":
            outer.append(hour_text(inner.c.at, dialect).label(key))
        else:
            outer.append(inner.c[key].label(key))
    if "hour" in keys:  # one raw hour is one hour text: nothing more to sum
        return select(*outer, *(inner.c[m].label(m) for m in METRICS))
    return select(*outer, *(func.sum(inner.c[m]).label(m) for m in METRICS)).group_by(*outer)


def _ledger_part(table, dialect, keys, filters, start: datetime, end: datetime):
    t = table
    return select(
        *_keys(t, dialect, keys),
        literal(1).label("requests"),
        t.c.prompt_tokens.label("prompt_tokens"),
        t.c.cached_tokens.label("cached_tokens"),
        t.c.completion_tokens.label("completion_tokens"),
        func.coalesce(t.c.reasoning_tokens, 0).label("reasoning_tokens"),
        t.c.cost.label("cost"),
        t.c.uncharged.label("uncharged"),
    ).where(
        t.c.created_at >= start, t.c.created_at < end, *(t.c[k] == v for k, v in filters.items())
    )


def spend_query(dialect: str, keys: list[str], filters: dict, start: datetime, end: datetime):
    """One SQL statement: rollup rows for the whole hours in [start, end), ledger (and archive)
    rows for the partial hours at its edges, summed per group."""
    whole_start, whole_end = ceil_hour(start), floor_hour(end)
    parts = []
    edges = [(start, end)]
    if whole_start < whole_end:
        parts.append(_rollup_part(dialect, keys, filters, whole_start, whole_end))
        edges = [(start, whole_start), (whole_end, end)]
    for a, b in edges:
        if a < b:
            for table in (LedgerEvent.__table__, LedgerEventArchive.__table__):
                parts.append(_ledger_part(table, dialect, keys, filters, a, b))
    if not parts:
        return None
    source = (parts[0] if len(parts) == 1 else union_all(*parts)).subquery("source")
    group = [source.c[k] for k in keys]
    return (
        select(*group, *(func.sum(source.c[m]).label(m) for m in METRICS))
        .group_by(*group)
        .having(func.sum(source.c.requests) > 0)
        .order_by(*group)
    )


def _row_out(row, keys: list[str]) -> dict:
    out = {k: getattr(row, k) for k in keys}
    for metric in METRICS:
        out[metric] = int(getattr(row, metric) or 0)
    return out


def _money(row: dict) -> dict:
    return {**row, "cost": format_usd(row["cost"]), "uncharged": format_usd(row["uncharged"])}


async def summary(db, query) -> tuple[int, dict]:
    """(number of rows, sums over all of them) of a report, whatever page is asked for."""
    zero = {m: 0 for m in METRICS}
    if query is None:
        return 0, zero
    rows = query.order_by(None).subquery("report")
    totals = select(func.count().label("rows"), *(func.sum(rows.c[m]).label(m) for m in METRICS))
    async with db.reads() as session:
        found = (await session.execute(totals)).one()
    return int(found.rows), {m: int(getattr(found, m) or 0) for m in METRICS}


async def page_rows(db, query, keys: list[str], offset: int, limit: int) -> list[dict]:
    """One page of a report, read in chunks with the event loop free between them."""
    if query is None or limit <= 0:
        return []
    out: list[dict] = []
    async with db.reads() as session:
        result = await session.stream(query.offset(offset).limit(limit))
        async for part in result.partitions(CHUNK):
            out.extend(_row_out(r, keys) for r in part)
            await asyncio.sleep(0)
    return out


def _dumps(value) -> str:
    # Plain str/int values only: json.dumps directly, without FastAPI's per-value encoder walk.
    return json.dumps(value, separators=(",", ":"))


async def _json(head: dict, read_rows):
    """The report as JSON, `rows` last: the head (totals, paging) leaves at once, then the rows
    are read and written CHUNK at a time, the event loop free between two chunks."""
    yield _dumps(head)[:-1].encode() + b',"rows":['
    rows = await read_rows()
    for start in range(0, len(rows), CHUNK):
        text = ",".join(_dumps(_money(row)) for row in rows[start : start + CHUNK])
        yield (b"," if start else b"") + text.encode()
        await asyncio.sleep(0)
    yield b"]}"


async def _csv(keys: list[str], read_rows):
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow([*keys, *METRICS])
    yield buffer.getvalue().encode()
    columns = (*keys, *METRICS)
    done = await read_rows()
    for start in range(0, len(done), CHUNK):
        buffer.seek(0)
        buffer.truncate()
        for row in done[start : start + CHUNK]:
            money = _money(row)
            writer.writerow(csv_cells(money[c] for c in columns))
        yield buffer.getvalue().encode()
        await asyncio.sleep(0)


@dataclass(frozen=True, slots=True)
class SpendReport:
    """One page of a report: its head (range, totals, paging) at once, its rows when read."""

    head: dict
    keys: list[str]
    read_rows: Callable[[], Awaitable[list[dict]]]

    def paging(self) -> dict[str, str]:
        """The paging headers of both formats."""
        out = {"x-row-count": str(self.head["row_count"]), "x-page": str(self.head["page"])}
        if self.head["next_page"] is not None:
            out["x-next-page"] = str(self.head["next_page"])
        return out

    def json(self) -> AsyncIterator[bytes]:
        return _json(self.head, self.read_rows)

    def csv(self) -> AsyncIterator[bytes]:
        return _csv(self.keys, self.read_rows)


async def spend_report(
    db: Database,
    principal: Principal,
    *,
    start: str | None,
    end: str | None,
    group_by: str | None,
    filters: dict[str, str | None],
    limit: int,
    page: int,
) -> SpendReport:
    """The report a caller asked for: a user's credential sees its own user's spend only."""
    end_at = parse_time(end, "end") or utcnow()
    start_at = parse_time(start, "start") or end_at - timedelta(days=DEFAULT_DAYS)
    check_range(start_at, end_at)
    names = parse_group_by(group_by)
    keys = [GROUPS[n] for n in names]
    given = {k: v for k, v in filters.items() if v is not None}
    for name, value in given.items():
        check_text(value, name)
    own_user(principal, given.get("user_id"))
    if not principal.is_admin:
        given["user_id"] = principal.user_id
    query = spend_query(db.dialect, keys, given, start_at, end_at)
    if "" in given.values():  # no id, model or provider is empty
        query = None
    count, total = await summary(db, query)
    offset = (page - 1) * limit
    head = {
        "start": rfc3339(start_at),
        "end": rfc3339(end_at),
        "group_by": names,
        "total": _money(total),
        "row_count": count,
        "page": page,
        "limit": limit,
        "next_page": page + 1 if offset + limit < count else None,
    }
    # Read when the response starts: the first bytes leave before the rows are read.
    rows = partial(page_rows, db, query, keys, offset, min(limit, max(count - offset, 0)))
    return SpendReport(head, keys, rows)
