"""GET /v1/refusals and /v1/refusals/summary (routes in metering.reports.endpoints): the
requests refused before anything was reserved (402 budget, 429 rate or parallel, 403 model),
listed newest first (cursor-paged, JSON or CSV) or counted by the keys of `group_by`, as
/v1/spend groups. A user's credential sees its own user's refusals only."""

import asyncio
import base64
import csv
import io
import re
from collections.abc import AsyncIterator
from datetime import datetime, timedelta

from sqlalchemy import Select, and_, func, or_, select

from metering.auth.service import Principal
from metering.db import Database, utcnow
from metering.errors import InvalidRequest
from metering.ledger.rollup import day_text, hour_text
from metering.models import Refusal
from metering.reports.cells import row as csv_cells
from metering.reports.labels import LABEL_KEYS, LABELS, label_keys, label_rows
from metering.reports.usage import check_range, check_text, group_by_pattern, own_user, parse_time
from metering.timefmt import parse_rfc3339, rfc3339

COLUMNS = (
    "id",
    "created_at",
    "token_id",
    "user_id",
    "team_id",
    "model",
    "reason",
    "scope",
    "subject_id",
    "http_status",
    "code",
    "message",
)
FILTERS = ("team_id", "user_id", "token_id", "model", "reason", "scope")
# group_by name -> the key it adds to each row
GROUPS = {
    "team": "team_id",
    "user": "user_id",
    "token": "token_id",
    "model": "model",
    "reason": "reason",
    "scope": "scope",
    "day": "day",
    "hour": "hour",
}
DEFAULT_DAYS = 30
MAX_SUMMARY_ROWS = 10_000


def _conditions(principal: Principal, filters: dict, start, end) -> list:
    for name, value in filters.items():
        check_text(value, name)
    own_user(principal, filters.get("user_id"))
    conditions = []
    if not principal.is_admin:
        conditions.append(Refusal.user_id == principal.user_id)
    for name, value in filters.items():
        if value is not None:
            conditions.append(getattr(Refusal, name) == value)
    if start is not None:
        conditions.append(Refusal.created_at >= start)
    if end is not None:
        conditions.append(Refusal.created_at < end)
    return conditions


def refusals_query(principal: Principal, *, start, end, filters: dict) -> Select:
    start_at, end_at = parse_time(start, "start"), parse_time(end, "end")
    check_range(start_at, end_at)
    return (
        select(Refusal)
        .where(*_conditions(principal, filters, start_at, end_at))
        .order_by(Refusal.created_at.desc(), Refusal.id.desc())
    )


def refusal_out(r: Refusal) -> dict:
    out = {name: getattr(r, name) for name in COLUMNS}
    out["created_at"] = rfc3339(r.created_at)
    return out


def _cursor(r: Refusal) -> str:
    return base64.urlsafe_b64encode(f"{rfc3339(r.created_at)}|{r.id}".encode()).decode()


def _older(at: datetime, refusal_id: str):
    """Refusals after (at, refusal_id) in newest-first order; the `created_at <=` conjunct lets
    the index range-scan each page."""
    return and_(Refusal.created_at <= at, or_(Refusal.created_at < at, Refusal.id < refusal_id))


def _after(cursor: str):
    try:
        created, _, refusal_id = base64.urlsafe_b64decode(cursor.encode()).decode().partition("|")
        check_text(refusal_id, "cursor")
        at = parse_rfc3339(created)
    except (ValueError, UnicodeDecodeError, OverflowError):
        raise InvalidRequest("cursor is not valid", param="cursor") from None
    return _older(at, refusal_id)


async def page(
    db: Database, query: Select, *, limit: int, cursor: str | None, labels: bool
) -> dict:
    if cursor:
        query = query.where(_after(cursor))
    async with db.reads() as session:
        found = list(await session.scalars(query.limit(limit + 1)))
    more = len(found) > limit
    found = found[:limit]
    data = [refusal_out(r) for r in found]
    if labels:
        await label_rows(db, data, LABELS)
    return {"object": "list", "data": data, "next_cursor": _cursor(found[-1]) if more else None}


def _columns(labels: bool) -> list[str]:
    return [*COLUMNS, *(LABEL_KEYS if labels else ())]


def _csv(data: list[dict], columns: list[str], header: bool) -> bytes:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    if header:
        writer.writerow(columns)
    for row in data:
        writer.writerow(csv_cells(row.get(c) for c in columns))
    return buffer.getvalue().encode()


def as_csv(data: list[dict], labels: bool) -> bytes:
    """One page as CSV, header first."""
    return _csv(data, _columns(labels), header=True)


CSV_BATCH = 2000


async def csv_stream(
    db: Database, query: Select, *, labels: bool, batch: int = CSV_BATCH
) -> AsyncIterator[bytes]:
    """Every matching refusal as CSV, read in pages of `batch` (newest first, each page after
    the last row of the one before), so memory stays flat however many there are."""
    columns = _columns(labels)
    yield _csv([], columns, header=True)
    last = None
    while True:
        page = query if last is None else query.where(_older(last.created_at, last.id))
        async with db.reads() as session:
            found = list(await session.scalars(page.limit(batch)))
        if not found:
            return
        data = [refusal_out(r) for r in found]
        if labels:
            await label_rows(db, data, LABELS)
        yield _csv(data, columns, header=False)
        # A send that does not block does not yield: let the proxy's requests run.
        await asyncio.sleep(0)
        last = found[-1]


# group_by as /openapi.json declares it and parse_group_by takes it.
GROUP_BY_PATTERN = group_by_pattern(GROUPS, tags=False)


def parse_group_by(value: str | None) -> list[str]:
    if value and re.fullmatch(GROUP_BY_PATTERN, value) is None:
        raise InvalidRequest(
            f"group_by: {value[:80]!r} is not a comma-separated list of {', '.join(GROUPS)}",
            param="group_by",
        )
    names: list[str] = []
    for part in (value or "").split(","):
        name = part
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


async def summary(
    db: Database,
    principal: Principal,
    *,
    start: str | None,
    end: str | None,
    group_by: str | None,
    filters: dict,
    limit: int,
    page: int,
    labels: bool,
) -> dict:
    """Refusals counted by the keys of group_by over [start, end) (default: the last 30 days),
    ordered by the keys; `total` over the whole range."""
    end_at = parse_time(end, "end") or utcnow()
    start_at = parse_time(start, "start") or end_at - timedelta(days=DEFAULT_DAYS)
    check_range(start_at, end_at)
    names = parse_group_by(group_by)
    keys = [GROUPS[n] for n in names]
    conditions = _conditions(principal, filters, start_at, end_at)
    columns = []
    for key in keys:
        if key == "day":
            columns.append(day_text(Refusal.created_at, db.dialect).label("day"))
        elif key == "hour":
            columns.append(hour_text(Refusal.created_at, db.dialect).label("hour"))
        else:
            columns.append(getattr(Refusal, key).label(key))
    counted = select(*columns, func.count().label("refusals")).where(*conditions)
    if columns:
        counted = counted.group_by(*columns)
    report = counted.subquery("report")
    offset = (page - 1) * limit
    async with db.reads() as session:
        row_count, total = (
            await session.execute(
                select(func.count(), func.coalesce(func.sum(report.c.refusals), 0))
            )
        ).one()
        rows = (
            await session.execute(
                select(report).order_by(*(report.c[k] for k in keys)).offset(offset).limit(limit)
            )
        ).all()
    out = [{**{k: getattr(r, k) for k in keys}, "refusals": int(r.refusals)} for r in rows]
    if labels:
        await label_rows(db, out, keys)
    return {
        "start": rfc3339(start_at),
        "end": rfc3339(end_at),
        "group_by": names,
        "total": {"refusals": int(total)},
        "row_count": int(row_count),
        "page": page,
        "limit": limit,
        "next_page": page + 1 if offset + limit < row_count else None,
        "rows": out,
    }


def summary_csv(report: dict, labels: bool) -> bytes:
    keys = [GROUPS[n] for n in report["group_by"]]
    columns = [*keys, *(label_keys(keys) if labels else ()), "refusals"]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(columns)
    for row in report["rows"]:
        writer.writerow(csv_cells(row.get(c) for c in columns))
    return buffer.getvalue().encode()
