"""RFC 3339 UTC timestamps in and out.

Every moment read from text is between 2000-01-01T00:00:00Z and 2999-12-31T23:59:59.999999Z
(UTC): parse_rfc3339, the one parser, refuses any other, so a client's year 9999 never reaches
the arithmetic of windows and hours (where it would overflow Python's datetime)."""

from datetime import UTC, datetime
from typing import Any

EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
END = datetime(3000, 1, 1, tzinfo=UTC)  # the first moment after the bound
BOUNDS = "between 2000-01-01T00:00:00Z and 2999-12-31T23:59:59Z"


class OutOfBounds(ValueError):
    """A well-formed moment outside the years 2000 to 2999 (UTC)."""

    def __init__(self) -> None:
        super().__init__(f"must be {BOUNDS}")


def rfc3339(value: datetime | None) -> str | None:
    if value is None:
        return None
    value = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    return value.isoformat(timespec="microseconds").replace("+00:00", "Z")


def bounded(value: datetime) -> datetime:
    """An aware moment in UTC, within the bounds; OutOfBounds otherwise."""
    try:
        value = value.astimezone(UTC)
    except OverflowError:  # e.g. 9999-12-31T23:00:00-01:00 is past year 9999 in UTC
        raise OutOfBounds() from None
    if not EARLIEST <= value < END:
        raise OutOfBounds()
    return value


def parse_rfc3339(text: str) -> datetime:
    """An RFC 3339 timestamp with its zone, in UTC, within the bounds. ValueError otherwise
    (OutOfBounds, a ValueError, when only the bounds refuse it)."""
    value = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError("timestamp needs a time zone (e.g. 2026-01-01T00:00:00Z)")
    return bounded(value)


def range_edge(text: str) -> datetime:
    """An RFC 3339 timestamp with its zone as the edge of a range read (a report's start or
    end), in UTC: any valid one is taken, one before the bounds read as their first moment and
    one after as the first moment after them (nothing is stored outside them, so the range
    holds the same). ValueError when it is no RFC 3339 timestamp."""
    value = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError("timestamp needs a time zone (e.g. 2026-01-01T00:00:00Z)")
    try:
        value = value.astimezone(UTC)
    except OverflowError:  # past year 1 or 9999 once in UTC
        return EARLIEST if value.year < EARLIEST.year else END
    return min(max(value, EARLIEST), END)


def client_moment(value: str | None) -> str | None:
    """A body field's RFC 3339 text, checked (pydantic validator: ValueError names the
    problem); the text itself is kept for the service that reads it."""
    if value is None:
        return None
    try:
        parse_rfc3339(value)
    except OutOfBounds:
        raise
    except ValueError:
        raise ValueError(
            "must be an RFC 3339 timestamp with its time zone, e.g. 2026-01-01T00:00:00Z"
        ) from None
    return value


# parse_rfc3339's rule as a JSON Schema pattern (declared beside `format: date-time` by every
# body field it reads): an RFC 3339 date-time whose UTC moment is within the bounds. Inside the
# years 2001 to 2998, and on every day of 2000 and 2999 but their first and last, any offset
# keeps it there; on 2000-01-01 an offset ahead of UTC could make it 1999, and on 2999-12-31 one
# behind UTC could make it 3000, so those two days are declared with the offsets that cannot
# (the few moments their other offsets still keep within the bounds are taken, not declared).
_MONTH = r"(?:0[1-9]|1[0-2])"
_DAY = r"(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"[Tt](?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?"
_HH_MM = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]"
_INNER_DATES = "|".join(
    (
        rf"(?:200[1-9]|20[1-9][0-9]|2[1-8][0-9][0-9]|29[0-8][0-9]|299[0-8])-{_MONTH}-{_DAY}",
        rf"2000-(?:0[2-9]|1[0-2])-{_DAY}",
        r"2000-01-(?:0[2-9]|[12][0-9]|3[01])",
        rf"2999-(?:0[1-9]|1[01])-{_DAY}",
        r"2999-12-(?:0[1-9]|[12][0-9]|30)",
    )
)
MOMENT_PATTERN = (
    rf"^(?:(?:{_INNER_DATES}){_TIME}(?:[Zz]|[+-]{_HH_MM})"
    rf"|2000-01-01{_TIME}(?:[Zz]|-{_HH_MM}|\+00:00)"
    rf"|2999-12-31{_TIME}(?:[Zz]|\+{_HH_MM}|-00:00))$"
)
# A body field's moment in /openapi.json: RFC 3339 and within the bounds.
MOMENT_SCHEMA: dict[str, Any] = {"format": "date-time", "pattern": MOMENT_PATTERN}
