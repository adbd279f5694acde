"""GET /v1/usage's logic (its route is in metering.reports.endpoints): the ledger events a
caller may see, newest first, as cursor-paginated JSON pages or streamed CSV. The filter checks
are shared with GET /v1/spend."""

import asyncio
import base64
import csv
import io
from collections.abc import AsyncIterator, Iterable
from datetime import datetime
from operator import attrgetter

import orjson
from sqlalchemy import Boolean, Select, and_, or_, select

from metering import text
from metering.auth.service import Principal
from metering.db import Database, UTCDateTime
from metering.errors import Forbidden, InvalidRequest
from metering.ledger.attribution import MAX_TAG_KEY_CHARS
from metering.ledger.event import PUBLIC, SPECS
from metering.ledger.tables import LedgerEvent
from metering.money import format_price, format_usd
from metering.reports.cells import row as csv_cells
from metering.reports.labels import LABEL_KEYS, LABELS, label_rows, lookup
from metering.reports.tag_filter import parse_tags, tag_conditions
from metering.timefmt import parse_rfc3339, range_edge, rfc3339

CSV_COLUMNS = PUBLIC  # the event's public columns, the detail objects flattened


def _shown(name: str):
    """How GET /v1/usage shows a column's value: money as decimal USD, prices as decimal USD per
    1M tokens, times in RFC 3339, JSON text (the tags) as the object it holds."""
    spec = SPECS[name]
    if spec.json_text:
        return orjson.loads
    if spec.money:
        return format_usd
    if spec.price:
        return format_price
    if isinstance(spec.sql, UTCDateTime):
        return rfc3339
    return None


def csv_bool(value: bool) -> str:
    """CSV booleans as JSON writes them (a spreadsheet and a script read both)."""
    return "true" if value else "false"


def _csv_shown(name: str):
    if SPECS[name].json_text:
        return None  # one cell holding the JSON text
    return csv_bool if isinstance(SPECS[name].sql, Boolean) else _shown(name)


_SHOWN = tuple((name, SPECS[name].group, _shown(name)) for name in PUBLIC)
_CSV_SHOWN = tuple(
    (i, shown) for i, name in enumerate(PUBLIC) if (shown := _csv_shown(name)) is not None
)
_csv_values = attrgetter(*PUBLIC)


def event_out(e) -> dict:
    """One event (a LedgerEvent or a row of its columns) as JSON: the public columns, the
    prompt and completion details nested as in OpenAI's usage object."""
    out: dict = {}
    for name, group, shown in _SHOWN:
        value = getattr(e, name)
        if shown is not None and value is not None:
            value = shown(value)
        if group is None:
            out[name] = value
        elif group in out:
            out[group][name] = value
        else:
            out[group] = {name: value}
    return out


def csv_row(e) -> list:
    values = list(_csv_values(e))
    for i, shown in _CSV_SHOWN:
        if values[i] is not None:
            values[i] = shown(values[i])
    return csv_cells(values)


def encode_cursor(e: LedgerEvent) -> str:
    return base64.urlsafe_b64encode(f"{rfc3339(e.created_at)}|{e.id}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created, _, event_id = base64.urlsafe_b64decode(cursor.encode()).decode().partition("|")
        check_text(event_id, "cursor")
        return parse_rfc3339(created), event_id
    except (ValueError, UnicodeDecodeError, OverflowError):
        raise InvalidRequest("cursor is not valid", param="cursor") from None


def parse_time(value: str | None, name: str) -> datetime | None:
    """A report's start or end: any RFC 3339 date-time (the document's `format: date-time`),
    read within the stored bounds (timefmt.range_edge)."""
    if value is None:
        return None
    try:
        return range_edge(value)
    except ValueError:
        raise InvalidRequest(f"{name} must be an RFC 3339 timestamp", param=name) from None


def group_by_pattern(groups: Iterable[str], *, tags: bool) -> str:
    """A report's group_by, as a JSON Schema pattern: its names (each also with `_id`) and, with
    `tags`, `tag:<key>` (a tag's key: 1 to 64 characters, no comma), comma-separated: no
    space, no empty key, lowercase as listed."""
    names = "|".join(groups)
    key = f"(?:{names})(?:_id)?"
    if tags:
        key += f"|tag:[^,\\x00-\\x1f\\x7f]{{1,{MAX_TAG_KEY_CHARS}}}"
    return f"^(?:(?:{key})(?:,(?:{key}))*)?$"  # empty: no key, one total row


def check_text(value: str | None, name: str) -> None:
    """A filter is compared with stored text: NUL (which PostgreSQL refuses in a parameter)
    and other control characters are in no id or name (metering.text)."""
    text.check(value, name)


def check_range(start: datetime | None, end: datetime | None) -> None:
    if start is not None and end is not None and start > end:
        raise InvalidRequest("start must not be after end", param="start")


def own_user(principal: Principal, user_id: str | None) -> None:
    """A user's credential may filter on its own user only (the admin on anyone)."""
    if not principal.is_admin and user_id is not None and user_id != principal.user_id:
        raise Forbidden("this credential may only report its own usage and spend")


def scoped_filters(principal: Principal, **filters) -> list:
    """Filters on the ledger; a user's credential only ever sees its own user's events."""
    conditions = []
    for name, value in filters.items():
        check_text(value, name)
    own_user(principal, filters.get("user_id"))
    if not principal.is_admin:
        conditions.append(LedgerEvent.user_id == principal.user_id)
    for name, value in filters.items():
        if value is not None:
            conditions.append(getattr(LedgerEvent, name) == value)
    return conditions


def events_query(
    principal: Principal,
    *,
    start: str | None,
    end: str | None,
    filters: dict[str, str | None],
    tags: list[str] | None = None,
) -> Select:
    """The events matching the filters, every `tags` filter (`key:value`) and the range
    [start, end), newest first; a user's credential sees only its own user's."""
    conditions = scoped_filters(principal, **filters)
    conditions += tag_conditions(LedgerEvent.__table__.c.tags, parse_tags(tags))
    start_at, end_at = parse_time(start, "start"), parse_time(end, "end")
    check_range(start_at, end_at)
    if start_at:
        conditions.append(LedgerEvent.created_at >= start_at)
    if end_at:
        conditions.append(LedgerEvent.created_at < end_at)
    return (
        select(LedgerEvent)
        .where(*conditions)
        .order_by(LedgerEvent.created_at.desc(), LedgerEvent.id.desc())
    )


async def page_events(
    db: Database, query: Select, *, limit: int, cursor: str | None
) -> tuple[list[LedgerEvent], str | None]:
    """At most `limit` events after the cursor's event (if one is given), and the next cursor."""
    if cursor:
        created, event_id = decode_cursor(cursor)
        query = query.where(before(created, event_id))
    async with db.reads() as session:
        events = list(await session.scalars(query.limit(limit + 1)))
    more = len(events) > limit
    events = events[:limit]
    return events, encode_cursor(events[-1]) if more else None


async def page(
    db: Database, query: Select, *, limit: int, cursor: str | None, labels: bool = False
) -> dict:
    """One page of at most `limit` events, after the cursor's event if one is given; with
    `labels`, each event carries team_name, user_email and token_name."""
    events, next_cursor = await page_events(db, query, limit=limit, cursor=cursor)
    data = [event_out(e) for e in events]
    if labels:
        await label_rows(db, data, LABELS)
    return {"object": "list", "data": data, "next_cursor": next_cursor}


def before(created: datetime, event_id: str):
    """Events after (created, event_id) in newest-first order. The `created_at <=` conjunct is
    what lets the index range-scan each page; the OR alone made every page scan from the top."""
    return and_(
        LedgerEvent.created_at <= created,
        or_(LedgerEvent.created_at < created, LedgerEvent.id < event_id),
    )


COLUMNS = tuple(LedgerEvent.__table__.columns)


def csv_header(labels: bool) -> list[str]:
    return [*CSV_COLUMNS, *(LABEL_KEYS if labels else ())]


async def _csv_rows(db: Database, events, labels: bool) -> list[list]:
    rows = [csv_row(e) for e in events]
    if labels:
        names = await lookup(db, {k: {getattr(e, k) for e in events} for k in LABELS})
        for e, row in zip(events, rows, strict=True):
            row.extend(csv_cells(names[k].get(getattr(e, k)) for k in LABELS))
    return rows


def _write(buffer: io.StringIO, writer, rows) -> bytes:
    buffer.seek(0)
    buffer.truncate()
    writer.writerows(rows)
    return buffer.getvalue().encode()


async def csv_page(db: Database, events, labels: bool) -> bytes:
    """One page of events (`limit` given) as CSV, header first."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    return _write(buffer, writer, [csv_header(labels), *await _csv_rows(db, events, labels)])


async def csv_stream(
    db: Database, query: Select, batch: int = 2000, labels: bool = False
) -> AsyncIterator[bytes]:
    """Streams every matching event in pages, so memory stays flat however many rows there are."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    yield _write(buffer, writer, [csv_header(labels)])
    last = None
    while True:
        page = query
        if last is not None:
            page = page.where(before(last.created_at, last.id))
        async with db.reads() as session:
            # Plain rows, not ORM objects: the same attributes at half the cost per row.
            events = (await session.execute(page.limit(batch).with_only_columns(*COLUMNS))).all()
        if not events:
            return
        for start in range(0, len(events), 500):
            yield _write(buffer, writer, await _csv_rows(db, events[start : start + 500], labels))
            # A send that does not block does not yield: let the proxy's requests run.
            await asyncio.sleep(0)
        last = events[-1]
