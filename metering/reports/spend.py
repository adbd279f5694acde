"""GET /v1/spend: spend summed by any combination of team, user, token, model, provider, day and
hour, computed in SQL.

The ledger keeps several rollups (metering.ledger.rollup): per hour and per UTC day, each with
every key or only the team, user and token, or only the team, model and provider; with the
increments not yet folded into them (rollup_pending) they equal the ledger's sums. A report
reads its whole days from the coarsest daily rollup that has every key it groups or filters on
(unless it is by hour), the whole hours left at the days' edges from the coarsest hourly one,
each with the pending increments of the same hours, and only the partial hours at the range's
edges from the ledger itself (and its archive): a report over a month of a whole organisation
reads a few thousand rows, and is exact for any start and end.

A report holds at most MAX_REPORT_ROWS rows: one that could hold more (check_size's bound) is
refused with a 400 naming the limit. A page holds at most `limit` rows (default DEFAULT_ROWS,
at most MAX_ROWS), ordered by the group keys; `page` walks the rest. The page's rows carry the
report's row count and totals (window functions): the report is aggregated once per request;
but on PostgreSQL, a report by end user or tag that may hold more than a page a day is counted
and totalled apart (attributed_summary) and its page summed alone, in the keys' order.
Rows are read and written in chunks of CHUNK, never a whole page in memory, with the event loop
free between them, so a large report never stalls the requests the proxy is serving.
"""

import asyncio
import csv
import io
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import orjson
from sqlalchemy import (
    ColumnElement,
    Select,
    case,
    func,
    literal,
    select,
    text,
    union,
    union_all,
)

from metering.auth.service import Principal
from metering.db import Database, utcnow
from metering.errors import InvalidRequest
from metering.ledger.event import ADJUSTMENT, ENDPOINTS
from metering.ledger.rollup import (
    PENDING,
    ROLLUPS,
    Rollup,
    ceil_day,
    ceil_hour,
    day_text,
    day_value,
    floor_day,
    floor_hour,
    hour_text,
    hour_value,
)
from metering.ledger.tables import (
    WHO,
    LedgerEvent,
    LedgerEventArchive,
    SpendDaily,
    SpendDailyModel,
    SpendDailyToken,
)
from metering.money import format_usd
from metering.reports import attributed
from metering.reports.attributed import Attributes
from metering.reports.cells import row as csv_cells
from metering.reports.labels import label_keys, label_rows
from metering.reports.usage import check_range, check_text, group_by_pattern, own_user, parse_time
from metering.timefmt import rfc3339

DEFAULT_DAYS = 30
DEFAULT_ROWS = 10_000  # rows per page unless `limit` says otherwise
MAX_ROWS = 100_000  # the largest `limit`
MAX_PAGE = 1_000_000
# The most rows a report may hold (the largest page): a larger grouping is refused with a 400.
MAX_REPORT_ROWS = 100_000
CHUNK = 1_000  # rows read or written between two turns of the event loop
# A page of a report by end user or tag, its count and totals found apart: its groups summed
# in the keys' order (the planner, which cannot tell how many groups there are, would hash them
# all first), read from an index in that order where one has it, so it stops after the page.
STREAMED = "SELECT set_config('enable_hashagg', 'off', true)"
# group_by name -> the key it adds to each row
GROUPS = {
    "team": "team_id",
    "user": "user_id",
    "token": "token_id",
    "model": "model",
    "provider": "provider",
    "day": "day",
    "hour": "hour",
    "end_user": "end_user",
    "endpoint": "endpoint",
}
# Keys no rollup carries: a report by one of them sums the ledger itself, over its whole range.
LEDGER_ONLY = frozenset({"endpoint"})
METRICS = attributed.METRICS  # the sums of every report, its rollups' columns
MONEY = ("cost", "uncharged", "adjustments")


# group_by as /openapi.json declares it and parse_group_by takes it: names (or a name's `_id`
# form) and `tag:<key>`, comma-separated, nothing else; empty: one total row.
GROUP_BY_PATTERN = group_by_pattern(GROUPS, tags=True)


def parse_group_by(value: str | None) -> list[str]:
    if value and re.fullmatch(GROUP_BY_PATTERN, value) is None:
        raise InvalidRequest(
            f"group_by: {value[:80]!r} is not a comma-separated list of {', '.join(GROUPS)} "
            "or tag:<key>",
            param="group_by",
        )
    names: list[str] = []
    for part in (value or "").split(","):
        name = part
        if name.startswith(attributed.TAG):  # tag:<key>, the key as given
            name = attributed.TAG + attributed.tag_key(part)
            if name not in names:
                names.append(name)
            continue
        if not name:
            continue
        name = name.removesuffix("_id") if name.removesuffix("_id") in GROUPS else name
        if name not in GROUPS:
            raise InvalidRequest(
                f"group_by: unknown key {part.strip()!r}; use any of {', '.join(GROUPS)} "
                "or tag:<key>",
                param="group_by",
            )
        if name not in names:
            names.append(name)
    if "endpoint" in names and any(n == "end_user" or n.startswith(attributed.TAG) for n in names):
        raise InvalidRequest(
            "group_by: endpoint groups with team, user, token, model, provider, day and hour, "
            "not with end_user or tag:<key>",
            param="group_by",
        )
    return names


TIME_KEYS = ("day", "hour")


def _bucket(column, dialect: str, keys: list[str]):
    """The UTC day or hour a row's instant falls in, stored the way a UTCDateTime is (so the
    rows of every source group together); None when the report is by neither."""
    if "hour" in keys:
        return hour_value(column, dialect)
    if "day" in keys:
        return day_value(column, dialect)
    return None


def _plain(table, keys: list[str]) -> list:
    return [
        (func.nullif(table.c[k], "") if k == "token_id" else table.c[k]).label(k)
        for k in keys
        if k not in TIME_KEYS
    ]


def _rollup_part(
    rollup: Rollup, dialect, keys, filters, start: datetime, end: datetime
) -> Select[Any]:
    """The rollup's rows in [start, end), their keys as the report groups them (no sums here:
    the report sums every source once)."""
    t = rollup.table
    at = t.c[rollup.grain]
    columns = _plain(t, keys)
    if any(k in TIME_KEYS for k in keys):
        # A rollup's own grain is already its bucket; an hour's day is computed.
        bucket = at if rollup.grain in keys else _bucket(at, dialect, keys)
        columns.append(bucket.label("bucket"))
    return select(*columns, *(t.c[m].label(m) for m in METRICS)).where(
        at >= start, at < end, *(t.c[k] == v for k, v in filters.items())
    )


def _ledger_part(table, dialect, keys, filters, start: datetime, end: datetime) -> Select[Any]:
    t = table
    columns = _plain(t, keys)
    bucket = _bucket(t.c.created_at, dialect, keys)
    if bucket is not None:
        columns.append(bucket.label("bucket"))
    return select(
        *columns,
        case((t.c.kind == ADJUSTMENT, 0), else_=1).label("requests"),
        t.c.prompt_tokens.label("prompt_tokens"),
        t.c.cached_tokens.label("cached_tokens"),
        t.c.completion_tokens.label("completion_tokens"),
        func.coalesce(t.c.reasoning_tokens, 0).label("reasoning_tokens"),
        t.c.cost.label("cost"),
        t.c.uncharged.label("uncharged"),
        case((t.c.kind == ADJUSTMENT, t.c.cost), else_=0).label("adjustments"),
    ).where(
        t.c.created_at >= start, t.c.created_at < end, *(t.c[k] == v for k, v in filters.items())
    )


def read_model(grain: str, needed: set[str]) -> Rollup:
    """The coarsest rollup of `grain` that keeps every key a report groups or filters on."""
    fitting = [r for r in ROLLUPS if r.grain == grain and needed <= set(r.keys)]
    return min(fitting, key=lambda r: len(r.keys))


def sources(
    keys: list[str], start: datetime, end: datetime
) -> list[tuple[str, datetime, datetime]]:
    """[start, end) cut into what answers it exactly: ("day", a, b) whole days (unless the
    report is by hour), ("hour", a, b) whole hours, ("ledger", a, b) the partial hours."""
    parts: list[tuple[str, datetime, datetime]] = []

    def hours(a: datetime, b: datetime) -> None:
        whole_start, whole_end = ceil_hour(a), floor_hour(b)
        edges = [(a, b)]
        if whole_start < whole_end:
            parts.append(("hour", whole_start, whole_end))
            edges = [(a, whole_start), (whole_end, b)]
        parts.extend(("ledger", x, y) for x, y in edges if x < y)

    days_start, days_end = ceil_day(start), floor_day(end)
    if "hour" not in keys and days_start < days_end:
        parts.append(("day", days_start, days_end))
        hours(start, days_start)
        hours(days_end, end)
    else:
        hours(start, end)
    return parts


def keys_of(names: list[str]) -> tuple[list[str], Attributes]:
    """The SQL keys of group_by's names (`tag:<key>` is `tag_<i>`) and the tag keys grouped."""
    tags = [name[len(attributed.TAG) :] for name in names if name.startswith(attributed.TAG)]
    keys = [
        f"tag_{tags.index(n[len(attributed.TAG) :])}" if n.startswith(attributed.TAG) else GROUPS[n]
        for n in names
    ]
    return keys, Attributes(tag_keys=tuple(tags))


def spend_query(
    dialect: str,
    keys: list[str],
    filters: dict,
    start: datetime,
    end: datetime,
    attrs: Attributes = Attributes(),
):
    """One SQL statement: the coarsest rollups' rows for the whole days and hours in
    [start, end), ledger (and archive) rows for the partial hours at its edges, summed per
    group (by end user or tag: metering.reports.attributed's parts)."""
    found = _source(dialect, keys, filters, start, end, attrs)
    if found is None:
        return None
    source, group = found
    grouped = (
        select(*group, *(func.sum(source.c[m]).label(m) for m in METRICS))
        .group_by(*group)
        .having(_kept(source))
        .subquery("grouped")
    )
    out: list[ColumnElement[Any]] = []
    for key in keys:
        if key == "day":
            out.append(day_text(grouped.c.bucket, dialect).label(key))
        elif key == "hour":
            out.append(hour_text(grouped.c.bucket, dialect).label(key))
        else:
            out.append(grouped.c[key])
    return select(*out, *(grouped.c[m] for m in METRICS)).order_by(*out)


KEPT = ("requests", "adjustments")  # the sums that make a group a row (_kept)


def _kept(source) -> ColumnElement[bool]:
    """A group is a row of the report when it counts a request or an adjustment."""
    return (func.sum(source.c.requests) > 0) | (func.sum(source.c.adjustments) != 0)


def _source(
    dialect: str,
    keys: list[str],
    filters: dict,
    start: datetime,
    end: datetime,
    attrs: Attributes = Attributes(),
    name: str = "source",
    valued: bool = False,
):
    """The rows spend_query sums (a subquery `name`) and the columns it groups them by; None
    when nothing can match. `valued`: by end user or tag, without the parts that are the null
    row's only (attributed.parts)."""
    needed = {k for k in keys if k not in ("day", "hour")} | set(filters)
    parts = []
    if attrs.applies(keys):
        parts = attributed.parts(dialect, keys, filters, attrs, start, end, valued)
    elif LEDGER_ONLY & set(keys):
        parts = [
            _ledger_part(table, dialect, keys, filters, start, end)
            for table in (LedgerEvent.__table__, LedgerEventArchive.__table__)
        ]
    for name, a, b in [] if parts else sources(keys, start, end):
        if name == "ledger":
            for table in (LedgerEvent.__table__, LedgerEventArchive.__table__):
                parts.append(_ledger_part(table, dialect, keys, filters, a, b))
        else:
            rollup = read_model(name, needed)
            parts.append(_rollup_part(rollup, dialect, keys, filters, a, b))
            # The increments not yet folded into the rollups.
            parts.append(_rollup_part(PENDING, dialect, keys, filters, a, b))
    if not parts:
        return None
    source = (parts[0] if len(parts) == 1 else union_all(*parts)).subquery(name)
    # Summed once, by the plain keys and the raw bucket; the bucket's text is made once per
    # group, not once per row.
    group = [source.c[k] for k in keys if k not in TIME_KEYS]
    if len(group) < len(keys):
        group.append(source.c.bucket)
    return source, group


def attributed_key(keys: list[str]) -> str | None:
    """The first end user or tag key a report groups by, if any."""
    return next((k for k in keys if k == "end_user" or k.startswith("tag_")), None)


def count_query(
    dialect: str,
    keys: list[str],
    filters: dict,
    start: datetime,
    end: datetime,
    attrs: Attributes,
):
    """The row count of a report by end user or tag, without summing each of its groups: the
    distinct groups with a value (their rows, of the rollups, the pending increments and the
    ledger, all count requests at or above zero), less those without a request whose
    adjustments sum to zero (only adjustments, rare: the few rows without a request are looked
    at), plus the groups without a value that are rows (the null rows, summed: the coarser
    rollup less the attributed one; by the end user or tag alone, the valued rows' requests
    and adjustments instead, which the report's totals less are the null row's). None when the
    report is neither by end user nor tag."""
    key = attributed_key(keys)
    full = _source(dialect, keys, filters, start, end, attrs)
    found = _source(dialect, keys, filters, start, end, attrs, "valued", True)
    other = _source(dialect, keys, filters, start, end, attrs, "other", True)
    if key is None or full is None or found is None or other is None:
        return None
    # The groups with a value, from the parts that can have one only.
    (source, group), named = found, found[0].c[key]
    busy = select(literal(1)).where(
        *(o.is_not_distinct_from(g) for o, g in zip(other[1], group, strict=True)),
        other[0].c.requests > 0,
    )
    idle = (
        select(*group)
        .where(named.is_not(None), source.c.requests == 0, ~busy.exists())
        .group_by(*group)
        .having(func.sum(source.c.adjustments) == 0)
        .subquery("idle")
    )
    less = select(func.count()).select_from(idle).scalar_subquery()
    if keys == [key]:
        # By the end user or tag alone: one null row, its sums the report's totals less the
        # valued rows' (attributed_summary), found in the same pass as the distinct values.
        return select(
            (func.count(func.distinct(named)) - less).label("rows"),
            *(func.coalesce(func.sum(source.c[m]), 0).label(m) for m in KEPT),
        ).where(named.is_not(None))
    valued = select(*group).where(named.is_not(None)).distinct().subquery("distinct_valued")
    count = select(func.count()).select_from(valued).scalar_subquery() - less
    every, groups = full
    unvalued = (
        select(*groups).where(every.c[key].is_(None)).group_by(*groups).having(_kept(every))
    ).subquery("unvalued")
    count += select(func.count()).select_from(unvalued).scalar_subquery()
    return select(count.label("rows"), *(literal(None).label(m) for m in KEPT))


def bound_query(keys: list[str], filters: dict, start: datetime, end: datetime):
    """How many distinct attributions (team, user, token) and distinct (model, provider) the
    report's range holds, from the daily rollups by team, user and token and by team, model
    and provider (a few rows a day each) and the increments not yet folded into them; None for
    the part the report does not group by."""
    plain = [k for k in keys if k not in ("day", "hour")]
    counts: list[ColumnElement[Any]] = []
    for rollup_keys, model in ((WHO, SpendDailyToken), (("model", "provider"), SpendDailyModel)):
        grouped = [k for k in plain if k in rollup_keys]
        if not grouped:
            counts.append(literal(None))
            continue
        t = model.__table__
        if any(k not in t.c for k in filters):
            # A filter this rollup has no column for (models for one token, tokens of one
            # model): the daily rollup with every key applies it.
            t = SpendDaily.__table__
        pending = PENDING.table
        distinct = union(
            *(
                select(*(source.c[k] for k in grouped)).where(
                    at >= floor_day(start),
                    at < end,
                    *(source.c[k] == v for k, v in filters.items()),
                )
                for source, at in ((t, t.c.day), (pending, pending.c.hour))
            )
        ).subquery()
        counts.append(select(func.count()).select_from(distinct).scalar_subquery())
    return select(*counts)


def _who_label(keys: list[str]) -> str:
    finest = [k for k in ("token_id", "user_id", "team_id") if k in keys]
    return finest[0].removesuffix("_id") + "s" if finest else ""


def _what_label(keys: list[str]) -> str:
    if "model" in keys and "provider" in keys:
        return "model and provider pairs"
    return "models" if "model" in keys else "providers"


async def check_size(
    db,
    keys: list[str],
    filters: dict,
    start: datetime,
    end: datetime,
    attrs: Attributes = Attributes(),
) -> int:
    """Refuse (400) a report that could hold more than MAX_REPORT_ROWS rows; else the most
    rows it could hold. The bound: the
    hours (days) the range touches, times the distinct attributions it holds by the keys
    grouped on (tokens, users or teams), times the distinct models or providers; by end user
    or tag, times their distinct values (null included), or instead of all but the time, the
    distinct groups of the end user or tag with the other keys, when its rollup has them."""
    bound, parts = 1, []
    if "hour" in keys:
        bound = (ceil_hour(end) - floor_hour(start)) // timedelta(hours=1)
        parts.append(f"{bound:,} hours")
    elif "day" in keys:
        bound = (ceil_day(end) - floor_day(start)).days
        parts.append(f"{bound:,} days")
    below = attributed.bound_query(db.dialect, keys, filters, attrs, start, end)
    joint = False
    if below is not None:
        named = [attrs.name(k) for k in keys if k == "end_user" or k.startswith("tag_")]
        # First, at most as many values as would already be too many (a short index walk):
        # a report by hour of a million end users is refused without counting them all.
        cap = MAX_REPORT_ROWS // bound + 1
        least = 0
        if bound > 1:
            some = attributed.values_query(db.dialect, keys, filters, attrs, start, end, cap)
            async with db.reads() as session:
                least = int((await session.execute(some)).scalar() or 0)
        if least >= cap:
            _refuse(bound * least, [*parts, f"at least {least:,} {_named(named[0])}"], True)
        # Then the rows the distinct groups are found among (an index's entries counted): when
        # even they are few enough the report is, and the distinct groups need no counting.
        upper = attributed.bound_query(db.dialect, keys, filters, attrs, start, end, True)
        async with db.reads() as session:
            joint, *most = (await session.execute(upper)).one()
        if joint and bound * most[0] <= MAX_REPORT_ROWS:
            return bound * most[0]
        async with db.reads() as session:
            joint, *counts = (await session.execute(below)).one()
        if joint:
            bound *= counts[0]
            parts.append(f"{counts[0]:,} {attributed.joint_label(attrs, keys)}")
        else:
            for count, name in zip(counts, named, strict=True):
                bound *= count
                parts.append(f"{count:,} {_named(name)}")
    if "endpoint" in keys:
        bound *= len(ENDPOINTS)
        parts.append(f"{len(ENDPOINTS)} endpoints")
    if not joint and any(k not in ("day", "hour", "endpoint") for k in keys):
        async with db.reads() as session:
            who, what = (await session.execute(bound_query(keys, filters, start, end))).one()
        for count, label in ((who, _who_label(keys)), (what, _what_label(keys))):
            if count is not None:
                bound *= count
                parts.append(f"{count:,} {label}")
    if bound > MAX_REPORT_ROWS:
        _refuse(bound, parts)
    return bound


def _named(name: str) -> str:
    return "end users" if name == "end_user" else f"values of {name}"


def _refuse(bound: int, parts: list[str], more: bool = False) -> None:
    """The 400 of a report that could hold `bound` rows (`more`: at least that many)."""
    raise InvalidRequest(
        f"this report could hold {'at least' if more else 'up to'} {bound:,} rows "
        f"({' x '.join(parts)}); a report holds at most {MAX_REPORT_ROWS:,}: narrow the range, "
        "group by day instead of hour, or filter by team, user, token, model, end user or tag",
        param="group_by",
        code="report_too_large",
    )


def _row_out(row, keys: list[str], adjusted: bool = True, names: list[str] | None = None) -> dict:
    out = {name: getattr(row, k) for k, name in zip(keys, names or keys, strict=True)}
    for metric in METRICS:
        out[metric] = int(getattr(row, metric) or 0)
    return _without_adjustments(out) if not adjusted else out


def _without_adjustments(sums: dict) -> dict:
    """The sums as the original events charged them: cost without the adjustments."""
    return {**sums, "cost": sums["cost"] - sums["adjustments"], "adjustments": 0}


def _money(row: dict) -> dict:
    return {**row, **{m: format_usd(row[m]) for m in MONEY}}


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


async def attributed_summary(
    db, keys: list[str], filters: dict, start: datetime, end: datetime, attrs: Attributes
) -> tuple[int, dict] | None:
    """(number of rows, sums over all of them) of a report by end user or tag on PostgreSQL,
    without summing each group: the count from count_query, the totals those of the same
    report grouped by nothing (its groups share out the same events, and a group that is no
    row of the report counts no request and adjusts nothing: all its sums are zero); None for
    any other report (its page's rows carry both, page_query)."""
    if db.dialect != "postgresql":
        return None
    counted = count_query(db.dialect, keys, filters, start, end, attrs)
    if counted is None:
        return None
    whole = spend_query(
        db.dialect, [], filters, start, end, Attributes((), attrs.end_user, attrs.tags)
    )
    async with db.reads() as session:
        rows, *valued = (await session.execute(counted)).one()
        found = (await session.execute(whole)).first() if whole is not None else None
    total = {m: int(getattr(found, m) or 0) if found else 0 for m in METRICS}
    if valued[0] is not None:  # by the end user or tag alone: is the null row a row?
        kept = zip(KEPT, valued, strict=True)
        requests, adjustments = (total[m] - int(v) for m, v in kept)
        rows += requests > 0 or adjustments != 0
    return int(rows), total


def page_query(query, keys: list[str], offset: int, limit: int, counted: bool = False):
    """A page of the report, each row carrying the report's row count and totals (window
    functions over every row, computed before the page is cut): one aggregate serves both;
    `counted`: the page's rows only (the count and totals found apart, attributed_summary),
    which a database can read in the keys' order and stop after."""
    report = query.order_by(None).subquery("report")
    if counted:
        order = [report.c[k] for k in keys]
        return select(*report.c).order_by(*order).offset(offset).limit(limit)
    return (
        select(
            *report.c,
            func.count().over().label("row_count"),
            *(func.sum(report.c[m]).over().label(f"total_{m}") for m in METRICS),
        )
        .order_by(*(report.c[k] for k in keys))
        .offset(offset)
        .limit(limit)
    )


async def page_parts(db, query, keys: list[str], offset: int, limit: int, counted: bool = False):
    """The page's rows, CHUNK at a time as the database sends them (never the whole page in
    memory), the event loop free between two chunks. `counted` (PostgreSQL): the page alone,
    its groups summed in the keys' order (no hash of every group first): it stops after it."""
    async with db.reads() as session:
        if counted:
            await session.execute(text(STREAMED))
        result = await session.stream(page_query(query, keys, offset, limit, counted))
        async for part in result.partitions(CHUNK):
            yield part
            await asyncio.sleep(0)


async def _rows_out(first, rest, keys: list[str], adjusted: bool = True, labelled=None, names=None):
    """The page's rows as dicts (keyed by `names`, the keys' names in a row), a chunk at a
    time; `labelled(rows)` adds their labels."""
    if first:
        rows = [_row_out(r, keys, adjusted, names) for r in first]
        yield await labelled(rows) if labelled else rows
    if rest is not None:
        async for part in rest:
            rows = [_row_out(r, keys, adjusted, names) for r in part]
            yield await labelled(rows) if labelled else rows


def _dumps(value) -> str:
    # Plain str/int values only: json.dumps directly, without FastAPI's per-value encoder walk.
    return json.dumps(value, separators=(",", ":"))


async def _json(head: dict, read_rows):
    """The report as JSON, `rows` last: the head (totals, paging) leaves at once, then the rows
    are read and written a chunk at a time."""
    yield _dumps(head)[:-1].encode() + b',"rows":['
    first = True
    async for rows in read_rows():
        text = orjson.dumps([_money(row) for row in rows])[1:-1]  # the objects, comma-separated
        yield text if first else b"," + text
        first = False
    yield b"]}"


async def _csv(keys: list[str], read_rows, labels: bool = False):
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    columns = (*keys, *(label_keys(keys) if labels else ()), *METRICS)
    writer.writerow(columns)
    yield buffer.getvalue().encode()
    async for rows in read_rows():
        buffer.seek(0)
        buffer.truncate()
        for row in rows:
            money = _money(row)
            writer.writerow(csv_cells(money[c] for c in columns))
        yield buffer.getvalue().encode()


@dataclass(frozen=True, slots=True)
class SpendReport:
    """One page of a report: its head (range, totals, paging) at once, its rows when read."""

    head: dict
    keys: list[str]  # the rows' key names
    read_rows: Callable[[], AsyncIterator[list[dict]]]
    labels: bool = False

    def paging(self) -> dict[str, str]:
        """The paging headers of both formats."""
        out = {"x-row-count": str(self.head["row_count"]), "x-page": str(self.head["page"])}
        if self.head["next_page"] is not None:
            out["x-next-page"] = str(self.head["next_page"])
        return out

    def json(self) -> AsyncIterator[bytes]:
        return _json(self.head, self.read_rows)

    def csv(self) -> AsyncIterator[bytes]:
        return _csv(self.keys, self.read_rows, self.labels)


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
    adjusted: bool = True,
    labels: bool = False,
    end_user: str | None = None,
    tags: list[str] | None = None,
) -> SpendReport:
    """The report a caller asked for: a user's credential sees its own user's spend only."""
    end_at = parse_time(end, "end") or utcnow()
    start_at = parse_time(start, "start") or end_at - timedelta(days=DEFAULT_DAYS)
    check_range(start_at, end_at)
    names = parse_group_by(group_by)
    keys, attrs = keys_of(names)
    if end_user is not None:
        check_text(end_user, "end_user")
    attrs = Attributes(attrs.tag_keys, end_user, attributed.parse_tags(tags))
    given: dict[str, str | None] = {k: v for k, v in filters.items() if v is not None}
    for name, value in given.items():
        check_text(value, name)
    own_user(principal, given.get("user_id"))
    if not principal.is_admin:
        given["user_id"] = principal.user_id
    query = spend_query(db.dialect, keys, given, start_at, end_at, attrs)
    most = 0
    if "" in given.values() or end_user == "":  # no id, model, provider or end user is empty
        query = None
    else:
        most = await check_size(db, keys, given, start_at, end_at, attrs)
    offset = (page - 1) * limit
    # A report that may hold more rows than the page (more than a page's worth a day, by its
    # bound: a day of 95,000 end users, not 30 days of 2,000): its count and totals found apart
    # (by end user or tag, on PostgreSQL), the page summed alone; a smaller one is summed once
    # whole. Either is exact: this only chooses the faster.
    days = max(1, (ceil_day(end_at) - floor_day(start_at)).days)
    counted = (
        await attributed_summary(db, keys, given, start_at, end_at, attrs)
        if query is not None and most // days > limit
        else None
    )
    # The first chunk is read now: its rows carry the count and totals the head (and the
    # paging headers) need (unless counted apart); the rest is read as the response is sent.
    parts = (
        page_parts(db, query, keys, offset, limit, counted is not None)
        if query is not None
        else None
    )
    first = await anext(parts, None) if parts is not None else None
    if counted is not None:
        count, total = counted
    elif first:
        count = int(first[0].row_count)
        total = {m: int(getattr(first[0], f"total_{m}") or 0) for m in METRICS}
    else:  # an empty report, or a page after the last
        count, total = await summary(db, query)
    if not adjusted:
        total = _without_adjustments(total)
    head = {
        "start": rfc3339(start_at),
        "end": rfc3339(end_at),
        "group_by": names,
        "adjustments": "included" if adjusted else "excluded",
        "total": _money(total),
        "row_count": count,
        "page": page,
        "limit": limit,
        "next_page": page + 1 if offset + limit < count else None,
    }
    labelled = partial(label_rows, db, keys=keys) if labels else None
    row_keys = [attrs.name(k) for k in keys]
    return SpendReport(
        head,
        row_keys,
        partial(_rows_out, first, parts, keys, adjusted, labelled, row_keys),
        labels,
    )
