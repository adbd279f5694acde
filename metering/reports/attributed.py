"""GET /v1/spend by end user and by tag: the parts of a report that filter or group on the
attribution below the token (the request's end user, its tags), exact like the rest.

Whole days come from the daily rollup that holds every key such a report groups or filters on
(spend_daily_end_user: team, user, token and end user; spend_daily_tag: every key and one tag
pair), with the increments not yet folded in (rollup_pending carries each increment's end user
and tags). Requests without an end user, or without the tag key grouped on, are the report's
null row: for whole days, the sums of the coarsest rollup with the other keys (spend_daily_token,
spend_daily) minus the end-user or tag rollup's rows. Whatever no rollup answers (the partial
days at a range's edges, a report by hour, an end user together with tags, two tag keys, the
model or provider of an end user's spend) is read from the ledger and its archive, but for
the whole hours of a report by one tag key (by team at most): spend_hourly_tag answers them
as spend_daily_tag answers whole days.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    String,
    Table,
    case,
    cast,
    func,
    literal,
    null,
    select,
    type_coerce,
    union,
    union_all,
)
from sqlalchemy.dialects.postgresql import JSONB

from metering.errors import InvalidRequest
from metering.ledger.attribution import MAX_TAG_KEY_CHARS, MAX_TAG_VALUE_CHARS, MAX_TAGS
from metering.ledger.event import ADJUSTMENT
from metering.ledger.rollup import (
    END_USER_DAILY,
    PENDING,
    ROLLUPS,
    TAG_HOURLY,
    TAGS,
    Rollup,
    ceil_day,
    ceil_hour,
    day_value,
    floor_day,
    floor_hour,
    hour_value,
)
from metering.ledger.tables import LedgerEvent, LedgerEventArchive
from metering.reports.usage import check_text

END_USER = "end_user"
DAY, HOUR = timedelta(days=1), timedelta(hours=1)
TAG = "tag:"  # group_by=tag:<key>, and the row key of its value
# An event has at most MAX_TAGS tags (more filters can never all match), and a tag's bounds.
MAX_TAG_FILTERS, MAX_KEY, MAX_VALUE = MAX_TAGS, MAX_TAG_KEY_CHARS, MAX_TAG_VALUE_CHARS
PLAIN = ("team_id", "user_id", "token_id", "model", "provider")
METRICS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost",
    "uncharged",
    "adjustments",
)


def parse_tags(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """`tag=<key>:<value>` filters (split at the first colon), each within a tag's bounds."""
    pairs: list[tuple[str, str]] = []
    if len(values or []) > MAX_TAG_FILTERS:
        raise InvalidRequest(f"tag: at most {MAX_TAG_FILTERS} filters", param="tag")
    for value in values or []:
        key, colon, text = value.partition(":")
        if not colon or not 1 <= len(key) <= MAX_KEY or len(text) > MAX_VALUE:
            raise InvalidRequest(
                f"tag: {value[:80]!r} is not <key>:<value> with a key of 1 to {MAX_KEY} "
                f"characters and a value of at most {MAX_VALUE}",
                param="tag",
            )
        check_text(key, "tag")
        check_text(text, "tag")
        if (key, text) not in pairs:
            pairs.append((key, text))
    return tuple(pairs)


def tag_key(name: str) -> str:
    """The tag key of a group_by name `tag:<key>`, within a tag's bounds."""
    key = name[len(TAG) :]
    if not 1 <= len(key) <= MAX_KEY:
        raise InvalidRequest(
            f"group_by: {name[:80]!r}: a tag key is 1 to {MAX_KEY} characters", param="group_by"
        )
    check_text(key, "group_by")
    return key


@dataclass(frozen=True, slots=True)
class Attributes:
    """What a report asks of the attribution below the token: the tag keys it groups by (the
    SQL column `tag_<i>` is tag_keys[i]), and its end-user and tag filters."""

    tag_keys: tuple[str, ...] = ()
    end_user: str | None = None
    tags: tuple[tuple[str, str], ...] = ()

    def applies(self, keys: list[str]) -> bool:
        return END_USER in keys or bool(self.tag_keys or self.tags) or self.end_user is not None

    def name(self, key: str) -> str:
        """A report's SQL key as its row shows it (`tag_0` -> `tag:<key>`)."""
        if key.startswith("tag_"):
            return TAG + self.tag_keys[int(key[4:])]
        return key

    def plan(self, keys: list[str], filters: dict[str, Any]) -> Rollup | None:
        """The daily rollup that answers the report's whole days, or None: the ledger does."""
        if "hour" in keys:
            return None
        tag_keys = set(self.tag_keys) | {key for key, _ in self.tags}
        by_end_user = END_USER in keys or self.end_user is not None
        if by_end_user and not tag_keys:
            asked = set(keys) | set(filters)
            return None if asked & {"model", "provider"} else END_USER_DAILY
        if tag_keys and not by_end_user and len(tag_keys) == 1 and len(self.tags) <= 1:
            return coarsest(TAGS, {k for k in keys if k in PLAIN} | set(filters))
        return None

    def hourly(self, keys: list[str], filters: dict[str, Any]) -> Rollup | None:
        """The hourly rollup that answers the report's whole hours outside its whole days (all
        of them, by hour), or None: the ledger does. By one tag key, and of the plain keys the
        team only (TAG_HOURLY's)."""
        tag_keys = set(self.tag_keys) | {key for key, _ in self.tags}
        if END_USER in keys or self.end_user is not None:
            return None
        if len(tag_keys) != 1 or len(self.tags) > 1:
            return None
        needed = {k for k in keys if k in PLAIN} | set(filters)
        return TAG_HOURLY if needed <= set(TAG_HOURLY.keys) else None


def tag_value(column: ColumnElement[Any], key: str, dialect: str) -> ColumnElement[Any]:
    """The value of tag `key` in a tags column (JSON text), NULL when the tags lack it."""
    if dialect == "postgresql":
        return type_coerce(cast(column, JSONB).op("->>")(literal(key, String)), String)
    pairs = func.json_each(column).table_valued("key", "value")
    found = select(pairs.c.value).where(pairs.c.key == literal(key, String))
    return type_coerce(found.scalar_subquery(), String)


def _bucket(column: ColumnElement[Any], dialect: str, keys: list[str]) -> ColumnElement[Any]:
    return hour_value(column, dialect) if "hour" in keys else day_value(column, dialect)


def _timed(keys: list[str]) -> bool:
    return "day" in keys or "hour" in keys


def _figures(t: Table) -> list[ColumnElement[Any]]:
    return [t.c[m].label(m) for m in METRICS]


def _plain(t: Table, keys: list[str]) -> list[ColumnElement[Any]]:
    return [
        (func.nullif(t.c[k], "") if k == "token_id" else t.c[k]).label(k)
        for k in keys
        if k in PLAIN
    ]


def _ledger_part(
    t: Table, dialect: str, keys: list[str], filters: dict, attrs: Attributes, a, b
) -> Select[Any]:
    columns = _plain(t, keys)
    for key in keys:
        if key == END_USER:
            columns.append(t.c.end_user.label(key))
        elif key.startswith("tag_"):
            columns.append(tag_value(t.c.tags, attrs.name(key)[len(TAG) :], dialect).label(key))
    if _timed(keys):
        columns.append(_bucket(t.c.created_at, dialect, keys).label("bucket"))
    adjusting = t.c.kind == ADJUSTMENT
    where = [t.c.created_at >= a, t.c.created_at < b]
    where += [t.c[k] == v for k, v in filters.items()]
    if attrs.end_user is not None:
        where.append(t.c.end_user == attrs.end_user)
    where += [tag_value(t.c.tags, key, dialect) == value for key, value in attrs.tags]
    return select(
        *columns,
        case((adjusting, 0), else_=1).label("requests"),
        t.c.prompt_tokens.label("prompt_tokens"),
        t.c.cached_tokens.label("cached_tokens"),
        t.c.completion_tokens.label("completion_tokens"),
        func.coalesce(t.c.reasoning_tokens, 0).label("reasoning_tokens"),
        t.c.cost.label("cost"),
        t.c.uncharged.label("uncharged"),
        case((adjusting, t.c.cost), else_=0).label("adjustments"),
    ).where(*where)


def _value(
    rollup: Rollup, t: Table, dialect: str, key: str, attrs: Attributes
) -> ColumnElement[Any]:
    """The end user or tag value column `key` of a rollup's (or rollup_pending's) rows."""
    if rollup is PENDING:
        if key == END_USER:
            return func.nullif(t.c.end_user, "")
        return tag_value(t.c.tags, attrs.name(key)[len(TAG) :], dialect)
    return t.c.end_user if key == END_USER else t.c.tag_value


def _rollup_part(
    rollup: Rollup,
    dialect: str,
    keys: list[str],
    filters: dict,
    attrs: Attributes,
    a: datetime,
    b: datetime,
    *,
    sign: int = 1,
    valued: bool = True,
) -> Select[Any]:
    """A rollup's rows in [a, b) (rollup_pending's: as increments of the end user and tags
    they carry), keyed as the report groups them; `valued=False`: with a NULL end user or tag
    value (the null row's part), `sign=-1`: subtracted, row by row."""
    t = rollup.table
    at = t.c[rollup.grain]
    columns = _plain(t, keys)
    for key in keys:
        if key == END_USER or key.startswith("tag_"):
            value = _value(rollup, t, dialect, key, attrs) if valued else null()
            columns.append(type_coerce(value, String).label(key))
    if _timed(keys):
        bucket = at if rollup.grain == "day" else _bucket(at, dialect, keys)
        columns.append(bucket.label("bucket"))
    # One day (hour) of a rollup of that grain: an equality, so an index (grain, key) gives
    # the rows in the key's order (a report by end user of one day streams its page).
    one = rollup is not PENDING and b - a == (DAY if rollup.grain == "day" else HOUR)
    where = [at == a] if one else [at >= a, at < b]
    where += [t.c[k] == v for k, v in filters.items()]
    if rollup is PENDING:
        if attrs.end_user is not None:
            where.append(t.c.end_user == attrs.end_user)
        where += [tag_value(t.c.tags, key, dialect) == value for key, value in attrs.tags]
    elif rollup is END_USER_DAILY and attrs.end_user is not None:
        where.append(t.c.end_user == attrs.end_user)
    elif rollup.attribute == "tag":
        [key] = {*attrs.tag_keys, *(k for k, _ in attrs.tags)}
        where.append(t.c.tag_key == key)
        where += [t.c.tag_value == value for _, value in attrs.tags]
    if sign < 0:
        # Each row negated as it is (a bigint, as the report's other parts: a union takes the
        # widest type of its parts): the end-user rollup's read from the index (day, end_user)
        # with the sums, no aggregate of its own before the report's.
        return select(*columns, *((-t.c[m]).label(m) for m in METRICS)).where(*where)
    return select(*columns, *_figures(t)).where(*where)


def coarsest(rollups: tuple[Rollup, ...], needed: set[str], grain: str = "day") -> Rollup:
    """The rollup of `grain` among `rollups` with the fewest keys that has every key `needed`
    (the first of them when none has: whatever it lacks is then not filtered on)."""
    fitting = [r for r in rollups if r.grain == grain and needed <= set(r.keys)] or [rollups[0]]
    return min(fitting, key=lambda r: len(r.keys))


def base(needed: set[str], grain: str = "day") -> Rollup:
    """The coarsest rollup of `grain` of every event with the keys `needed`."""
    return coarsest(ROLLUPS, needed, grain)


def _days(
    rollup: Rollup,
    dialect: str,
    keys: list[str],
    filters: dict,
    attrs: Attributes,
    a,
    b,
    valued: bool = False,
) -> list[Select[Any]]:
    """The whole days (or hours, by an hourly rollup) [a, b): the attributed rollup's rows and
    the pending increments, and unless the report filters on the end user or tag (then every
    event has one), the null row: the coarsest rollup of the same grain with the other keys
    minus the attributed rollup's rows (not with `valued`: the rows with a value only)."""
    parts = [
        _rollup_part(rollup, dialect, keys, filters, attrs, a, b),
        _rollup_part(PENDING, dialect, keys, filters, attrs, a, b),
    ]
    filtered = attrs.end_user is not None if rollup is END_USER_DAILY else bool(attrs.tags)
    if not filtered and not valued:
        whole = base({k for k in keys if k in PLAIN} | set(filters), rollup.grain)
        parts += [
            _rollup_part(whole, dialect, keys, filters, attrs, a, b, valued=False),
            _rollup_part(rollup, dialect, keys, filters, attrs, a, b, sign=-1, valued=False),
        ]
    return parts


def parts(
    dialect: str,
    keys: list[str],
    filters: dict,
    attrs: Attributes,
    start,
    end,
    valued: bool = False,
) -> list[Select[Any]]:
    """The report's sources over [start, end), rows to be summed per group: whole days from
    the attributed rollup the report's keys fit, the rest from the ledger and its archive
    (`valued`: without the null row's rollup parts; the rest may still be without a value)."""
    rollup, hourly = attrs.plan(keys, filters), attrs.hourly(keys, filters)
    days_start, days_end = ceil_day(start), floor_day(end)
    spans = [(start, end)]
    out: list[Select[Any]] = []
    if rollup is not None and days_start < days_end:
        out += _days(rollup, dialect, keys, filters, attrs, days_start, days_end, valued)
        spans = [(start, days_start), (days_end, end)]
    for a, b in spans:
        ledger = [(a, b)]
        if hourly is not None and ceil_hour(a) < floor_hour(b):
            hours = ceil_hour(a), floor_hour(b)
            out += _days(hourly, dialect, keys, filters, attrs, *hours, valued)
            ledger = [(a, ceil_hour(a)), (floor_hour(b), b)]
        for x, y in ledger:
            if x < y:
                for table in (LedgerEvent.__table__, LedgerEventArchive.__table__):
                    out.append(_ledger_part(table, dialect, keys, filters, attrs, x, y))
    return out


# --- the report's bound ------------------------------------------------------------------


def _distinct(selects: list[Select[Any]], upper: bool = False) -> Select[Any]:
    """How many distinct rows the selects give together; `upper`: how many rows (at least as
    many: a count of index entries, without the hash that finds the distinct ones)."""
    found = (union_all(*selects) if upper else union(*selects)).subquery()
    return select(func.count()).select_from(found)


def _valued_rows(
    rollup: Rollup, dialect: str, columns: list[str], filters: dict, attrs: Attributes, key, a, b
) -> list[Select[Any]]:
    """The distinct (columns, value of `key`) the range holds, as selects to be unioned: the
    attributed rollup's and the pending increments' (each with its filters, those its table
    has), and the null rows' (the coarsest rollup with the columns)."""
    out = []
    for source in (rollup, PENDING):
        t = source.table
        value = _value(source, t, dialect, key, attrs)
        at = t.c[source.grain]
        where = [at >= a, at < b, *(t.c[k] == v for k, v in filters.items() if k in t.c)]
        if source.attribute == "tag":
            where.append(t.c.tag_key == attrs.name(key)[len(TAG) :])
        elif source is END_USER_DAILY and attrs.end_user is not None:
            where.append(t.c.end_user == attrs.end_user)
        out.append(select(*(t.c[c] for c in columns), type_coerce(value, String)).where(*where))
    whole = base(set(columns) | {k for k in filters if k in PLAIN})
    t = whole.table
    where = [t.c.day >= a, t.c.day < b, *(t.c[k] == v for k, v in filters.items())]
    out.append(select(*(t.c[c] for c in columns), type_coerce(null(), String)).where(*where))
    return out


def bound_query(
    dialect: str,
    keys: list[str],
    filters: dict,
    attrs: Attributes,
    start: datetime,
    end,
    upper: bool = False,
) -> Select[Any] | None:
    """The distinct groups of the end user or tag grouped on, with the other keys when its
    rollup has them all (one count: the report's bound but for time), else the distinct values
    of each (to be multiplied with the other keys' counts); None when neither is grouped.
    `upper`: each count's upper bound, the rows it would find distinct ones among."""
    grouped = [k for k in keys if k == END_USER or k.startswith("tag_")]
    if not grouped:
        return None
    a = floor_day(start)
    plain = [k for k in keys if k in PLAIN]
    needed = set(plain) | set(filters)
    rollup_of = {k: END_USER_DAILY if k == END_USER else coarsest(TAGS, needed) for k in grouped}
    joint = len(grouped) == 1 and set(plain) <= set(rollup_of[grouped[0]].keys)
    counts = []
    for key in grouped:
        columns = plain if joint else []
        selects = _valued_rows(rollup_of[key], dialect, columns, filters, attrs, key, a, end)
        counts.append(_distinct(selects, upper).scalar_subquery())
    return select(literal(joint), *counts)


def values_query(
    dialect: str, keys: list[str], filters: dict, attrs: Attributes, start, end, cap: int
) -> Select[Any]:
    """How many distinct values of the first end user or tag key grouped on the attributed
    rollup holds over the range, counted up to `cap` (the report's bound is at least that)."""
    key = next(k for k in keys if k == END_USER or k.startswith("tag_"))
    needed = {k for k in keys if k in PLAIN} | set(filters)
    rollup = END_USER_DAILY if key == END_USER else coarsest(TAGS, needed)
    t = rollup.table
    value = _value(rollup, t, dialect, key, attrs)
    where = [t.c.day >= floor_day(start), t.c.day < end]
    where += [t.c[k] == v for k, v in filters.items() if k in t.c]
    if rollup.attribute == "tag":
        where.append(t.c.tag_key == attrs.name(key)[len(TAG) :])
    found = select(value).where(*where).distinct().limit(cap).subquery()
    return select(func.count()).select_from(found)


def joint_label(attrs: Attributes, keys: list[str]) -> str:
    named = [attrs.name(k) for k in keys if k == END_USER or k.startswith("tag_")]
    others = [k.removesuffix("_id") for k in keys if k in PLAIN]
    what = "end users" if named == [END_USER] else f"values of {named[0]}"
    return f"{what} by {', '.join(others)}" if others else what
